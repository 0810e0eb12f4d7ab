/* SPDX-License-Identifier: MIT */
/* The gpu mode when no CUDA toolkit was found at build time (see gpu.c). */
#include <stdio.h>

#include "bench.h"

int kvs_bench_gpu_main(int argc, char **argv)
{
	(void)argc;
	(void)argv;
#ifdef KVS_BENCH_NO_GPU_C
	/* A toolkit was found, but tools/bench/gpu.c was not in the tree yet. */
	fprintf(stderr, "kvstage-bench: built without the gpu mode (CUDA was found at build time, "
			"but tools/bench/gpu.c was not there)\n");
#else
	fprintf(stderr, "kvstage-bench: built without CUDA (no toolkit found at build time)\n");
#endif
	return 2;
}
