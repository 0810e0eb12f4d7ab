/* SPDX-License-Identifier: MIT */
#include "ring.h"

#include <errno.h>
#include <sys/mman.h>

size_t kvs_ring_body_size(unsigned count, unsigned esize)
{
	return KVS_ALIGN_UP(sizeof(struct rte_ring) - KVS_RING_SPLIT + (size_t)count * esize,
			    KVS_PAGE);
}

int kvs_ring_map(struct kvs_ring *v, int geom_fd, off_t geom_off, int body_fd, off_t body_off,
		 size_t body_size)
{
	size_t len = KVS_PAGE + body_size;
	/* Reserve the span first so the two MAP_FIXED mappings cannot land on
	 * anything else. */
	char *base = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (base == MAP_FAILED)
		return -errno;
	if (mmap(base, KVS_PAGE, PROT_READ, MAP_SHARED | MAP_FIXED, geom_fd, geom_off) ==
		    MAP_FAILED ||
	    mmap(base + KVS_PAGE, body_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
		 body_fd, body_off) == MAP_FAILED) {
		int err = -errno;
		munmap(base, len);
		return err;
	}
	v->map = base;
	v->map_len = len;
	v->r = (struct rte_ring *)(base + KVS_PAGE - KVS_RING_SPLIT);
	return 0;
}

void kvs_ring_unmap(struct kvs_ring *v)
{
	if (v->map)
		munmap(v->map, v->map_len);
	v->map = NULL;
	v->r = NULL;
}

void kvs_cmem_layout(struct kvs_cmem_layout *l, uint32_t slot_count, unsigned sq_count,
		     unsigned cq_count)
{
	l->reply_off = KVS_PAGE;
	l->sq_off = l->reply_off + KVS_ALIGN_UP((size_t)slot_count * 8, KVS_PAGE);
	l->cq_off = l->sq_off + kvs_ring_body_size(sq_count, sizeof(struct kvs_sqe));
	l->size = l->cq_off + kvs_ring_body_size(cq_count, sizeof(struct kvs_cqe));
}
