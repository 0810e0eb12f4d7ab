/* SPDX-License-Identifier: MIT */
/* The gpu mode when no CUDA toolkit was found at build time (see gpu.c). */
#include <stdio.h>

#include "bench.h"

int run_gpu(const struct bench_opts *o)
{
	(void)o;
	fprintf(stderr, "kvstage-bench: built without CUDA (no toolkit found at build time)\n");
	return 2;
}
