/* SPDX-License-Identifier: MIT */
/* libkvstage_cuda's private interface between cuda.c and cuda_kernels.cu. */
#ifndef KVS_SHM_CUDA_IMPL_H
#define KVS_SHM_CUDA_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The kernel moves 16-byte words: every page address, page_size and the
 * slot address must be multiples of this. */
#define KVS_CUDA_WORD 16

/*
 * Moves n pages of page_size bytes between the addresses pages[] (device
 * memory) and the contiguous slot (the device's view of the registered
 * pool): gather != 0 copies pages into the slot, else the slot out to them.
 * The table travels in the kernel's parameters, so the caller may reuse
 * pages[] at once. Returns the cudaError_t of the first launch that failed.
 */
cudaError_t kvs_cuda_kernel_pages(int gather, char *slot, const uintptr_t *pages, unsigned n,
				  size_t page_size, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif
