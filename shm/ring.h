/* SPDX-License-Identifier: MIT */
/*
 * SPSC rte_rings that cross the trust boundary.
 *
 * An rte_ring keeps its geometry (size, mask, capacity) in the same header
 * as the producer and consumer indices. A client can write its region, so
 * if the geometry lived there a hostile client could widen the mask and
 * make the proxy read or write outside the ring. We split the header at
 * rte_ring.prod: the geometry prefix sits at the end of a page of the
 * sealed control segment, and the indices plus elements start the next
 * page, in the client region. Each side maps the two back to back, so DPDK
 * sees one contiguous ring. Scribbled indices can then only garble that
 * client's own records; every access stays inside the ring.
 */
#ifndef KVS_SHM_RING_H
#define KVS_SHM_RING_H

#include <rte_config.h>
#include <rte_ring.h>
#include <rte_ring_elem.h>
#include <stddef.h>
#include <sys/types.h>

#include "layout.h"

#define KVS_RING_SPLIT offsetof(struct rte_ring, prod)
static_assert(KVS_RING_SPLIT % KVS_CACHE_LINE == 0, "split on a cache line");

/* The rte_ring layout this side was built with: a hash of the size of
 * struct rte_ring and the offsets of every member either side's ring code
 * touches (the geometry, both head/tail pairs, and where the elements
 * start). A library and a proxy built against DPDKs that lay the ring out
 * differently would each misread the other's indices; the proxy says its
 * layout in the control segment and the library in its hello, and each
 * refuses the other's if it is not its own (-ENOEXEC). Never 0. */
static inline uint32_t kvs_ring_layout(void)
{
	const uint32_t parts[] = {
		sizeof(struct rte_ring),
		offsetof(struct rte_ring, flags),
		offsetof(struct rte_ring, size),
		offsetof(struct rte_ring, mask),
		offsetof(struct rte_ring, capacity),
		offsetof(struct rte_ring, prod),
		offsetof(struct rte_ring, cons),
		sizeof(struct rte_ring_headtail),
		offsetof(struct rte_ring_headtail, head),
		offsetof(struct rte_ring_headtail, tail),
		offsetof(struct rte_ring_headtail, sync_type),
		sizeof(((struct rte_ring_headtail *)0)->sync_type),
	};
	uint32_t h = 2166136261u; /* FNV-1a, over each part's four bytes */
	for (size_t i = 0; i < sizeof(parts) / sizeof(parts[0]); i++)
		for (unsigned b = 0; b < 32; b += 8)
			h = (h ^ ((parts[i] >> b) & 0xff)) * 16777619u;
	return h ? h : 1;
}

struct kvs_ring {
	struct rte_ring *r; /* page-end of the geometry page */
	void *map;
	size_t map_len;
};

/* Bytes of a ring body (indices and elements), page-rounded. */
size_t kvs_ring_body_size(unsigned count, unsigned esize);
/* Maps geometry page geom_fd@geom_off read-only and body_fd@body_off read-write behind it. Returns 0, or -errno. */
int kvs_ring_map(struct kvs_ring *v, int geom_fd, off_t geom_off, int body_fd, off_t body_off,
		 size_t body_size);
/* Unmaps a ring mapped by kvs_ring_map; safe on a zeroed one. */
void kvs_ring_unmap(struct kvs_ring *v);
/* Computes the per-client region's layout from the pool and ring sizes. */
void kvs_cmem_layout(struct kvs_cmem_layout *l, uint32_t slot_count, unsigned sq_count,
		     unsigned cq_count);

/* Single producer: returns how many of n records were enqueued. */
static inline unsigned kvs_ring_push(struct kvs_ring *v, const void *rec, unsigned esize,
				     unsigned n)
{
	return rte_ring_sp_enqueue_burst_elem(v->r, rec, esize, n, NULL);
}

/* Single consumer: returns how many records (at most n) were dequeued. */
static inline unsigned kvs_ring_pop(struct kvs_ring *v, void *rec, unsigned esize, unsigned n)
{
	return rte_ring_sc_dequeue_burst_elem(v->r, rec, esize, n, NULL);
}

static inline unsigned kvs_ring_free(const struct kvs_ring *v)
{
	return rte_ring_free_count(v->r);
}

static inline unsigned kvs_ring_count(const struct kvs_ring *v)
{
	return rte_ring_count(v->r);
}

#endif
