/* SPDX-License-Identifier: MIT */
/*
 * libkvstage_cuda: copies between GPU memory and leased slots on the
 * caller's stream. Everything that can be refused is refused before any
 * CUDA call (arguments, then the lease as libkvstage sees it, then the
 * range), so a copy into a slot this client does not hold is never queued,
 * and the answers are the CPU path's. Then the device: no driver or no
 * device is -ENODEV, asked of CUDA once per process.
 *
 * Per-client state (the registration, the gather mode, scratch tables)
 * hangs on the client with kvs_ext_attach, so kvs_close unregisters the
 * pool before it unmaps it.
 */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_impl.h"
#include "kvstage_cuda.h"

struct cstate {
	char *pool; /* this client's mapping of the pool */
	size_t pool_len;
	char *dev_pool; /* the device's address of it; NULL: not mapped, copy engines only */
	bool registered;
	bool ours;    /* registered by us, so ours to undo */
	int mode;     /* enum kvs_cuda_gather_mode */
	unsigned cap; /* entries in each table below */
	uintptr_t *pages;
	void **dsts;
	const void **srcs;
	size_t *sizes;
};

static const char ext_key; /* its address names our state on a client */

static __thread char last_err[256];

/* Process-wide, set once by probe(). */
static pthread_once_t probe_once = PTHREAD_ONCE_INIT;
static cudaError_t probe_err;
static int default_mode = KVS_CUDA_GATHER_AUTO;
static size_t kernel_below = KVS_CUDA_KERNEL_BELOW;
static bool debug;
static int batch_broken; /* cudaMemcpyBatchAsync refused once: loop from then on */

__attribute__((format(printf, 1, 2))) static void set_err(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(last_err, sizeof(last_err), fmt, ap);
	va_end(ap);
}

static int fail(int err, const char *what)
{
	set_err("%s: %s", what, kvs_strerror(err));
	return err;
}

static int cuda_fail(cudaError_t e, const char *what)
{
	set_err("%s: %s (%s)", what, cudaGetErrorName(e), cudaGetErrorString(e));
	switch (e) {
	case cudaErrorNoDevice:
	case cudaErrorInsufficientDriver:
	case cudaErrorInitializationError:
	case cudaErrorStubLibrary:
	case cudaErrorDevicesUnavailable:
	case cudaErrorSystemNotReady:
	case cudaErrorSystemDriverMismatch:
	case cudaErrorCompatNotSupportedOnDevice:
		return -ENODEV;
	case cudaErrorMemoryAllocation:
		return -ENOMEM;
	case cudaErrorInvalidValue:
	case cudaErrorInvalidResourceHandle:
	case cudaErrorInvalidDevicePointer:
	case cudaErrorInvalidDevice:
		return -EINVAL;
	default:
		return -EIO;
	}
}

static void probe(void)
{
	int n = 0;
	probe_err = cudaGetDeviceCount(&n);
	if (probe_err == cudaSuccess && n == 0)
		probe_err = cudaErrorNoDevice;
	const char *m = getenv("KVSTAGE_CUDA_GATHER");
	if (m && !strcmp(m, "copy"))
		default_mode = KVS_CUDA_GATHER_COPY;
	else if (m && !strcmp(m, "kernel"))
		default_mode = KVS_CUDA_GATHER_KERNEL;
	const char *b = getenv("KVSTAGE_CUDA_KERNEL_BELOW");
	if (b && *b) {
		char *end;
		unsigned long long v = strtoull(b, &end, 0);
		if (*end == 0)
			kernel_below = (size_t)v;
	}
	const char *d = getenv("KVSTAGE_CUDA_DEBUG");
	debug = d && *d && strcmp(d, "0");
	if (debug)
		fprintf(stderr,
			"kvstage_cuda: %d device(s) (%s); gather mode %s, kernel below %zu bytes\n",
			probe_err ? 0 : n, cudaGetErrorName(probe_err),
			default_mode == KVS_CUDA_GATHER_COPY	 ? "copy"
			: default_mode == KVS_CUDA_GATHER_KERNEL ? "kernel"
								 : "auto",
			kernel_below);
}

/* 0 if CUDA has a device for us, else -ENODEV with the reason. */
static int device_ready(void)
{
	pthread_once(&probe_once, probe);
	if (probe_err == cudaSuccess)
		return 0;
	set_err("no CUDA device: cudaGetDeviceCount: %s (%s)", cudaGetErrorName(probe_err),
		cudaGetErrorString(probe_err));
	return -ENODEV;
}

static void unregister(struct cstate *st)
{
	if (st->registered && st->ours) {
		cudaError_t e = cudaHostUnregister(st->pool);
		if (e != cudaSuccess)
			cudaGetLastError(); /* nothing left to undo: do not leave it to the caller */
	}
	st->registered = st->ours = false;
	st->dev_pool = NULL;
}

static void state_fini(kvs_client *c, void *arg)
{
	struct cstate *st = arg;
	(void)c;
	unregister(st);
	free(st->pages);
	free(st->dsts);
	free(st->srcs);
	free(st->sizes);
	free(st);
}

/* c's state, created on first use. */
static int state_get(kvs_client *c, struct cstate **out)
{
	struct cstate *st = kvs_ext_get(c, &ext_key);
	if (!st) {
		st = calloc(1, sizeof(*st));
		if (!st)
			return fail(-ENOMEM, "kvstage_cuda state");
		st->pool = kvs_pool_map(c, &st->pool_len);
		st->mode = default_mode;
		int rc = kvs_ext_attach(c, &ext_key, st, state_fini);
		if (rc < 0) {
			free(st);
			return fail(rc, "kvs_ext_attach");
		}
	}
	*out = st;
	return 0;
}

static int do_register(struct cstate *st)
{
	if (st->registered)
		return 0;
	/* Mapped so the gather kernel can reach slots; portable so a stream of
	 * any device can copy into them. */
	cudaError_t e = cudaHostRegister(st->pool, st->pool_len,
					 cudaHostRegisterPortable | cudaHostRegisterMapped);
	st->ours = true;
	if (e == cudaErrorHostMemoryAlreadyRegistered) {
		/* The application registered this mapping itself: use it, and
		 * leave undoing it to the application. */
		cudaGetLastError();
		st->ours = false;
	} else if (e == cudaErrorNotSupported || e == cudaErrorInvalidValue) {
		cudaGetLastError();
		e = cudaHostRegister(st->pool, st->pool_len, cudaHostRegisterPortable);
	}
	if (e != cudaSuccess && e != cudaErrorHostMemoryAlreadyRegistered)
		return cuda_fail(e, "cudaHostRegister(pool)");
	st->registered = true;
	void *dp = NULL;
	if (cudaHostGetDevicePointer(&dp, st->pool, 0) == cudaSuccess) {
		st->dev_pool = dp;
	} else {
		cudaGetLastError();
		st->dev_pool = NULL;
		if (debug)
			fprintf(stderr, "kvstage_cuda: pool not mapped for the device: copy "
					"engines only\n");
	}
	return 0;
}

/* The device, c's state and the registration: what every copy needs once
 * its arguments, lease and range are good. */
static int ready(kvs_client *c, struct cstate **st)
{
	/* libkvstage hides the pool from a fork child: the connection and
	 * its registration are the parent's, and CUDA does not survive fork. */
	if (!kvs_pool_map(c, NULL))
		return fail(-ECHILD, "kvstage_cuda: the connection belongs to the parent process");
	int rc = device_ready();
	if (rc == 0)
		rc = state_get(c, st);
	if (rc == 0)
		rc = do_register(*st);
	return rc;
}

/* Where l's slot is mapped here. Computed, not asked of kvs_lease_ptr: that
 * would read the slot table a second time after kvs_lease_check, and a
 * change in between (a send of this lease already queued) would turn the
 * address into NULL + off. The one check that counts is the one before. */
static char *slot_base(kvs_client *c, const struct kvs_lease *l)
{
	return (char *)kvs_pool_map(c, NULL) + (size_t)l->slot * kvs_slot_size(c);
}

/* The host address of [off, off + len) of l's slot, if c holds l and the
 * range fits. Touches no CUDA. */
static int slot_range(kvs_client *c, const struct kvs_lease *l, size_t off, size_t len,
		      const char *fn, char **out)
{
	int rc = kvs_lease_check(c, l);
	if (rc < 0)
		return fail(rc, fn);
	size_t ss = kvs_slot_size(c);
	if (off > ss || len > ss - off) {
		set_err("%s: bytes [%zu, +%zu) past the slot's end (%zu)", fn, off, len, ss);
		return -EINVAL;
	}
	*out = slot_base(c, l) + off;
	return 0;
}

static int record(struct CUevent_st *done, cudaStream_t s)
{
	if (!done)
		return 0;
	cudaError_t e = cudaEventRecord(done, s);
	return e == cudaSuccess ? 0 : cuda_fail(e, "cudaEventRecord");
}

int kvs_cuda_register(kvs_client *c)
{
	if (!c)
		return fail(-EINVAL, "kvs_cuda_register");
	struct cstate *st;
	return ready(c, &st);
}

int kvs_cuda_unregister(kvs_client *c)
{
	if (!c)
		return fail(-EINVAL, "kvs_cuda_unregister");
	if (!kvs_pool_map(c, NULL))
		return fail(-ECHILD, "kvstage_cuda: the connection belongs to the parent process");
	struct cstate *st = kvs_ext_get(c, &ext_key);
	if (st)
		unregister(st);
	return 0;
}

int kvs_cuda_set_gather_mode(kvs_client *c, int mode)
{
	if (!c || mode < KVS_CUDA_GATHER_AUTO || mode > KVS_CUDA_GATHER_KERNEL)
		return fail(-EINVAL, "kvs_cuda_set_gather_mode");
	if (!kvs_pool_map(c, NULL))
		return fail(-ECHILD, "kvstage_cuda: the connection belongs to the parent process");
	struct cstate *st;
	int rc = device_ready();
	if (rc == 0)
		rc = state_get(c, &st);
	if (rc == 0)
		st->mode = mode;
	return rc;
}

const char *kvs_cuda_last_error(void)
{
	return last_err;
}

static int copy(kvs_client *c, const struct kvs_lease *l, size_t off, void *dev, size_t len,
		bool to_slot, cudaStream_t s, struct CUevent_st *done)
{
	const char *fn = to_slot ? "kvs_cuda_copy_to_slot" : "kvs_cuda_copy_from_slot";
	if (!c || !l || (!dev && len))
		return fail(-EINVAL, fn);
	char *host;
	int rc = slot_range(c, l, off, len, fn, &host);
	struct cstate *st;
	if (rc == 0)
		rc = ready(c, &st);
	if (rc < 0)
		return rc;
	if (len) {
		cudaError_t e = to_slot ? cudaMemcpyAsync(host, dev, len, cudaMemcpyDefault, s)
					: cudaMemcpyAsync(dev, host, len, cudaMemcpyDefault, s);
		if (e != cudaSuccess)
			return cuda_fail(e, "cudaMemcpyAsync");
	}
	return record(done, s);
}

int kvs_cuda_copy_to_slot(kvs_client *c, const struct kvs_lease *l, size_t slot_off,
			  const void *dev_src, size_t len, struct CUstream_st *stream,
			  struct CUevent_st *done)
{
	return copy(c, l, slot_off, (void *)dev_src, len, true, stream, done);
}

int kvs_cuda_copy_from_slot(kvs_client *c, const struct kvs_lease *l, size_t slot_off,
			    void *dev_dst, size_t len, struct CUstream_st *stream,
			    struct CUevent_st *done)
{
	return copy(c, l, slot_off, dev_dst, len, false, stream, done);
}

static int grow(struct cstate *st, unsigned n)
{
	if (n <= st->cap)
		return 0;
	unsigned cap = st->cap ? st->cap : 64;
	while (cap < n)
		cap *= 2;
	uintptr_t *p = realloc(st->pages, cap * sizeof(*p));
	if (p)
		st->pages = p;
	void **d = realloc(st->dsts, cap * sizeof(*d));
	if (d)
		st->dsts = d;
	const void **s = realloc(st->srcs, cap * sizeof(*s));
	if (s)
		st->srcs = s;
	size_t *z = realloc(st->sizes, cap * sizeof(*z));
	if (z)
		st->sizes = z;
	if (!p || !d || !s || !z)
		return fail(-ENOMEM, "kvstage_cuda page table");
	st->cap = cap;
	return 0;
}

/* The copy engines: one copy per run of pages contiguous on the device
 * (the slot side always is), all of them in one batch where the runtime
 * has cudaMemcpyBatchAsync, else one cudaMemcpyAsync each. */
static int pages_by_copy(struct cstate *st, bool gather, char *host, unsigned n, size_t page_size,
			 cudaStream_t s)
{
	unsigned runs = 0;
	for (unsigned k = 0; k < n; k++) {
		char *h = host + (size_t)k * page_size;
		if (runs && st->pages[k] == st->pages[k - 1] + page_size) {
			st->sizes[runs - 1] += page_size;
			continue;
		}
		void *dev = (void *)st->pages[k];
		st->dsts[runs] = gather ? (void *)h : dev;
		st->srcs[runs] = gather ? (const void *)dev : (const void *)h;
		st->sizes[runs] = page_size;
		runs++;
	}
#if CUDART_VERSION >= 12080
	/* The batch call refuses the legacy default stream. */
	if (runs > 1 && s != NULL && s != cudaStreamLegacy &&
	    !__atomic_load_n(&batch_broken, __ATOMIC_RELAXED)) {
		struct cudaMemcpyAttributes attr;
		memset(&attr, 0, sizeof(attr));
		attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
		size_t first = 0;
		/* The arrays go as void *: C converts that to whatever each
		 * toolkit's prototype wants (12.8 and 13 differ in const). */
#if CUDART_VERSION >= 13000
		cudaError_t e = cudaMemcpyBatchAsync((void *)st->dsts, (void *)st->srcs,
						     (void *)st->sizes, runs, &attr, &first, 1, s);
#else /* 12.8 and 12.9 say which copy failed, before the stream */
		size_t failed_at;
		cudaError_t e = cudaMemcpyBatchAsync((void *)st->dsts, (void *)st->srcs,
						     (void *)st->sizes, runs, &attr, &first, 1,
						     &failed_at, s);
#endif
		if (e == cudaSuccess)
			return 0;
		/* Copies are idempotent, so redoing them one by one is safe
		 * whatever the batch queued before it failed. */
		cudaGetLastError();
		__atomic_store_n(&batch_broken, 1, __ATOMIC_RELAXED);
		if (debug)
			fprintf(stderr,
				"kvstage_cuda: cudaMemcpyBatchAsync: %s; one copy per run from now "
				"on\n",
				cudaGetErrorName(e));
	}
#endif
	for (unsigned r = 0; r < runs; r++) {
		cudaError_t e = cudaMemcpyAsync(st->dsts[r], st->srcs[r], st->sizes[r],
						cudaMemcpyDefault, s);
		if (e != cudaSuccess)
			return cuda_fail(e, "cudaMemcpyAsync");
	}
	return 0;
}

/* Gather (pages into the slot) or scatter, from a pointer table (ptrs) or
 * a base and indices (base, idx). */
static int pages(kvs_client *c, const struct kvs_lease *l, size_t off, bool gather,
		 const void *const *ptrs, const char *base, const int32_t *idx, unsigned n,
		 size_t page_size, cudaStream_t s, struct CUevent_st *done, const char *fn)
{
	if (!c || !l || !page_size || (n && !ptrs && (!base || !idx)))
		return fail(-EINVAL, fn);
	for (unsigned k = 0; k < n; k++) {
		if (ptrs ? ptrs[k] == NULL : idx[k] < 0) {
			set_err("%s: page %u is %s", fn, k, ptrs ? "NULL" : "a negative index");
			return -EINVAL;
		}
	}
	int rc = kvs_lease_check(c, l);
	if (rc < 0)
		return fail(rc, fn);
	size_t ss = kvs_slot_size(c);
	if (off > ss || (n && page_size > (ss - off) / n)) {
		set_err("%s: %u pages of %zu bytes from %zu do not fit a slot of %zu", fn, n,
			page_size, off, ss);
		return -EINVAL;
	}
	char *host = slot_base(c, l) + off;
	struct cstate *st;
	rc = ready(c, &st);
	if (rc == 0)
		rc = grow(st, n);
	if (rc < 0)
		return rc;
	if (n) {
		uintptr_t any = (uintptr_t)page_size;
		for (unsigned k = 0; k < n; k++) {
			st->pages[k] = ptrs ? (uintptr_t)ptrs[k]
					    : (uintptr_t)base + (uintptr_t)idx[k] * page_size;
			any |= st->pages[k];
		}
		bool kernel = st->mode == KVS_CUDA_GATHER_KERNEL ||
			      (st->mode == KVS_CUDA_GATHER_AUTO && page_size < kernel_below);
		char *dev_slot = st->dev_pool ? st->dev_pool + (host - st->pool) : NULL;
		any |= (uintptr_t)dev_slot;
		if (kernel && dev_slot && any % KVS_CUDA_WORD == 0) {
			cudaError_t e =
				kvs_cuda_kernel_pages(gather, dev_slot, st->pages, n, page_size, s);
			if (e != cudaSuccess)
				return cuda_fail(e, "gather/scatter kernel launch");
		} else {
			rc = pages_by_copy(st, gather, host, n, page_size, s);
			if (rc < 0)
				return rc;
		}
	}
	return record(done, s);
}

int kvs_cuda_gather(kvs_client *c, const struct kvs_lease *l, size_t slot_off,
		    const void *const *dev_pages, unsigned npages, size_t page_size,
		    struct CUstream_st *stream, struct CUevent_st *done)
{
	return pages(c, l, slot_off, true, dev_pages, NULL, NULL, npages, page_size, stream, done,
		     "kvs_cuda_gather");
}

int kvs_cuda_scatter(kvs_client *c, const struct kvs_lease *l, size_t slot_off,
		     void *const *dev_pages, unsigned npages, size_t page_size,
		     struct CUstream_st *stream, struct CUevent_st *done)
{
	return pages(c, l, slot_off, false, (const void *const *)dev_pages, NULL, NULL, npages,
		     page_size, stream, done, "kvs_cuda_scatter");
}

int kvs_cuda_gather_idx(kvs_client *c, const struct kvs_lease *l, size_t slot_off,
			const void *dev_base, const int32_t *page_idx, unsigned npages,
			size_t page_size, struct CUstream_st *stream, struct CUevent_st *done)
{
	return pages(c, l, slot_off, true, NULL, dev_base, page_idx, npages, page_size, stream,
		     done, "kvs_cuda_gather_idx");
}

int kvs_cuda_scatter_idx(kvs_client *c, const struct kvs_lease *l, size_t slot_off, void *dev_base,
			 const int32_t *page_idx, unsigned npages, size_t page_size,
			 struct CUstream_st *stream, struct CUevent_st *done)
{
	return pages(c, l, slot_off, false, NULL, dev_base, page_idx, npages, page_size, stream,
		     done, "kvs_cuda_scatter_idx");
}
