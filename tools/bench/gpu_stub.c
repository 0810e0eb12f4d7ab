/* SPDX-License-Identifier: MIT */
/* The gpu mode when no CUDA toolkit was found at build time (see gpu.c). */
#include <stdio.h>

#include "bench.h"

int kvs_bench_gpu_main(int argc, char **argv)
{
	(void)argc;
	(void)argv;
	fprintf(stderr, "kvstage-bench: built without CUDA (no toolkit found at build time)\n");
	return 2;
}
