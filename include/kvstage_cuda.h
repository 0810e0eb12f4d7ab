/* SPDX-License-Identifier: MIT */
/*
 * libkvstage_cuda: GPU pages into leased slots and out of received ones.
 *
 * pkg-config --cflags --libs libkvstage_cuda. The CUDA runtime is linked
 * into the library (statically), so it runs wherever the NVIDIA driver does
 * and, where none is, answers -ENODEV. The engine's GPU pages never reach a
 * transport: they are copied into a slot this client holds, on the caller's
 * CUDA stream, and the slot is what gets sent.
 *
 * Streams and events are the CUDA runtime's own types, spelled without its
 * header: cudaStream_t is struct CUstream_st *, cudaEvent_t is struct
 * CUevent_st * (as are the driver API's CUstream and CUevent), so pass them
 * as they are, from the application's runtime or the driver API. A NULL
 * stream is the legacy default stream. The calls work in the context current
 * on the calling thread (the application's cudaSetDevice); give a stream of
 * that device, as for any kernel launch.
 *
 * Every call checks, in this order, and queues nothing unless all pass:
 *   1. its arguments (-EINVAL),
 *   2. the lease, exactly as the CPU path does (kvs_lease_check: -EINVAL no
 *      such slot, -ESTALE old epoch, -EPERM not this client's, -EBUSY in flight),
 *   3. the range: bytes past the slot's end are -EINVAL,
 *   4. the device: no driver or no device is -ENODEV (kvs_cuda_last_error()
 *      says what CUDA answered); nothing here ever aborts the process.
 * Other CUDA failures are -ENOMEM, -EINVAL (a bad stream or pointer) or -EIO,
 * again with kvs_cuda_last_error() saying which.
 *
 * The lease is checked when the copy is queued; the copy engine does not
 * know about epochs. Keep the lease (no kvs_send, kvs_release or
 * kvs_room_close naming it) until `done` has fired or the stream is
 * synchronised, as a CPU memcpy finishes before kvs_send.
 *
 * The pool mapping is registered with CUDA (pinned, mapped, portable to
 * every device) by kvs_cuda_register or by the first copy, once per client;
 * kvs_close undoes it, so a client needs no CUDA-specific teardown.
 *
 * A kvs_client is not thread-safe, and neither are these calls on it. In a
 * fork() child every call on the parent's connection is -ECHILD, before
 * CUDA is touched (the registration is the parent's, and CUDA does not
 * survive fork).
 */
#ifndef KVSTAGE_CUDA_H
#define KVSTAGE_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "kvstage.h"

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st; /* cudaStream_t */
struct CUevent_st;  /* cudaEvent_t */

/* How gather/scatter move pages (kvs_cuda_set_gather_mode; $KVSTAGE_CUDA_GATHER gives the default). */
enum kvs_cuda_gather_mode {
	KVS_CUDA_GATHER_AUTO =
		0, /* the kernel below KVS_CUDA_KERNEL_BELOW bytes a page, else the copy engines */
	KVS_CUDA_GATHER_COPY,	/* the copy engines: one copy per run of contiguous pages */
	KVS_CUDA_GATHER_KERNEL, /* a kernel moving 16-byte words between the pages and the mapped slot
				     (pages, page_size or slot_off not 16-byte aligned: the copy engines) */
};

/* Default page size from which AUTO uses the copy engines ($KVSTAGE_CUDA_KERNEL_BELOW overrides). */
#define KVS_CUDA_KERNEL_BELOW (1u << 20)

/* Registers c's pool mapping with CUDA; idempotent. Returns 0, or -EINVAL, -ENODEV, -ENOMEM, -EIO. */
int kvs_cuda_register(kvs_client *c);
/* Undoes kvs_cuda_register (kvs_close does it too); 0 when nothing is registered, with or without a device. Returns 0, or -EINVAL, -EIO. */
int kvs_cuda_unregister(kvs_client *c);

/* Queues len bytes from device memory dev_src into slot l at slot_off on stream, then records done (may be NULL). Returns 0, or -errno. */
int kvs_cuda_copy_to_slot(kvs_client *c, const struct kvs_lease *l, size_t slot_off,
			  const void *dev_src, size_t len, struct CUstream_st *stream,
			  struct CUevent_st *done);
/* Queues len bytes from slot l at slot_off to device memory dev_dst on stream, then records done (may be NULL). Returns 0, or -errno. */
int kvs_cuda_copy_from_slot(kvs_client *c, const struct kvs_lease *l, size_t slot_off,
			    void *dev_dst, size_t len, struct CUstream_st *stream,
			    struct CUevent_st *done);

/*
 * Gather and scatter: the engine's paged KV (a block table) into one slot
 * and back. Page k lies at slot_off + k * page_size in the slot;
 * npages * page_size must fit between slot_off and the slot's end. The
 * table is read before the call returns (it may be reused at once). npages
 * may be 0 (only done is recorded).
 */
/* Queues dev_pages[0..npages) (device pointers, none NULL) into slot l from slot_off. Returns 0, or -errno. */
int kvs_cuda_gather(kvs_client *c, const struct kvs_lease *l, size_t slot_off,
		    const void *const *dev_pages, unsigned npages, size_t page_size,
		    struct CUstream_st *stream, struct CUevent_st *done);
/* Queues slot l from slot_off out to dev_pages[0..npages). Returns 0, or -errno. */
int kvs_cuda_scatter(kvs_client *c, const struct kvs_lease *l, size_t slot_off,
		     void *const *dev_pages, unsigned npages, size_t page_size,
		     struct CUstream_st *stream, struct CUevent_st *done);
/* As kvs_cuda_gather, page k at dev_base + page_idx[k] * page_size (page_idx: host memory, each >= 0). Returns 0, or -errno. */
int kvs_cuda_gather_idx(kvs_client *c, const struct kvs_lease *l, size_t slot_off,
			const void *dev_base, const int32_t *page_idx, unsigned npages,
			size_t page_size, struct CUstream_st *stream, struct CUevent_st *done);
/* As kvs_cuda_scatter, page k at dev_base + page_idx[k] * page_size. Returns 0, or -errno. */
int kvs_cuda_scatter_idx(kvs_client *c, const struct kvs_lease *l, size_t slot_off, void *dev_base,
			 const int32_t *page_idx, unsigned npages, size_t page_size,
			 struct CUstream_st *stream, struct CUevent_st *done);

/* Sets how c's gathers and scatters move pages (enum kvs_cuda_gather_mode). Returns 0, or -EINVAL, -ENODEV. */
int kvs_cuda_set_gather_mode(kvs_client *c, int mode);

/* What CUDA said about this thread's last failed kvs_cuda_* call ("" if none). */
const char *kvs_cuda_last_error(void);

#ifdef __cplusplus
}
#endif
#endif /* KVSTAGE_CUDA_H */
