/* SPDX-License-Identifier: MIT */
/*
 * The gather/scatter kernel: GPU pages to and from a slot of the pool,
 * which the GPU reaches through its registered, mapped host memory. One
 * launch moves a whole table of pages, where the copy engines would take
 * one command each; each thread keeps UNROLL 16-byte loads in flight
 * before its first store, so reads across PCIe (scatter) overlap.
 */
#include "cuda_impl.h"

namespace {

constexpr unsigned UNROLL = 4;
constexpr unsigned MAX_THREADS = 256;

/* The page table rides in the kernel's parameters (up to 32 KiB since
 * CUDA 12.1 on every device CUDA 13 supports): no device buffer to own,
 * no copy to order against the caller's stream. Three sizes, so a short
 * table does not pay for copying a long parameter block. */
template <unsigned N> struct table {
	const char *p[N];
};

template <unsigned N, bool GATHER>
__global__ void __launch_bounds__(MAX_THREADS)
pages_kernel(const table<N> t, char *__restrict__ slot, unsigned words)
{
	char *s = slot + (size_t)blockIdx.y * words * KVS_CUDA_WORD;
	const uint4 *__restrict__ src =
		(const uint4 *)(GATHER ? t.p[blockIdx.y] : (const char *)s);
	uint4 *__restrict__ dst = (uint4 *)(GATHER ? s : (char *)t.p[blockIdx.y]);
	unsigned i = blockIdx.x * blockDim.x * UNROLL + threadIdx.x;
	uint4 v[UNROLL];
#pragma unroll
	for (unsigned k = 0; k < UNROLL; k++) {
		unsigned j = i + k * blockDim.x;
		if (j < words)
			v[k] = src[j];
	}
#pragma unroll
	for (unsigned k = 0; k < UNROLL; k++) {
		unsigned j = i + k * blockDim.x;
		if (j < words)
			dst[j] = v[k];
	}
}

template <unsigned N>
cudaError_t launch(bool gather, char *slot, const uintptr_t *pages, unsigned n, unsigned words,
		   cudaStream_t stream)
{
	table<N> t;
	for (unsigned k = 0; k < n; k++)
		t.p[k] = (const char *)pages[k];
	/* Just enough threads for one pass of UNROLL words each over a small
	 * page (4 KiB: 64 threads); larger pages take more blocks in x. */
	unsigned threads = (words + UNROLL - 1) / UNROLL;
	threads = (threads + 31) / 32 * 32;
	if (threads > MAX_THREADS)
		threads = MAX_THREADS;
	dim3 grid((words + threads * UNROLL - 1) / (threads * UNROLL), n);
	void *args[] = { &t, &slot, &words };
	const void *fn = gather ? (const void *)pages_kernel<N, true>
				: (const void *)pages_kernel<N, false>;
	return cudaLaunchKernel(fn, grid, dim3(threads), args, 0, stream);
}

} // namespace

extern "C" cudaError_t kvs_cuda_kernel_pages(int gather, char *slot, const uintptr_t *pages,
					    unsigned n, size_t page_size, cudaStream_t stream)
{
	const unsigned words = (unsigned)(page_size / KVS_CUDA_WORD);
	while (n) {
		unsigned k;
		cudaError_t e;
		if (n <= 32) {
			k = n;
			e = launch<32>(gather, slot, pages, k, words, stream);
		} else if (n <= 256) {
			k = n;
			e = launch<256>(gather, slot, pages, k, words, stream);
		} else {
			k = n < 2048 ? n : 2048;
			e = launch<2048>(gather, slot, pages, k, words, stream);
		}
		if (e != cudaSuccess)
			return e;
		slot += (size_t)k * page_size;
		pages += k;
		n -= k;
	}
	return cudaSuccess;
}
