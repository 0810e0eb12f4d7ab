/* SPDX-License-Identifier: MIT */
/*
 * Latency histograms for the metrics page: fixed buckets, counted by the
 * proxy's loop (the only writer) and read by the metrics thread.
 */
#ifndef KVSP_HIST_H
#define KVSP_HIST_H

#include <stdint.h>

#define KVSP_HIST_BUCKETS 20

struct kvsp_hist {
	const uint64_t *upper_ns;	       /* KVSP_HIST_BUCKETS bounds, increasing; then +Inf */
	uint64_t count[KVSP_HIST_BUCKETS + 1]; /* per bucket, not cumulative */
	uint64_t sum_ns;
};

/* Rooms: 100 us to 2 min. Chunks: 1 us to 10 s (hist.c). */
extern const uint64_t kvsp_hist_room_ns[KVSP_HIST_BUCKETS];
extern const uint64_t kvsp_hist_chunk_ns[KVSP_HIST_BUCKETS];

/* Counts one observation of ns. A linear walk: most observations stop in
 * the first few buckets, and a pass of the loop moves many bytes per call. */
static inline void kvsp_hist_add(struct kvsp_hist *h, uint64_t ns)
{
	unsigned b = 0;
	while (b < KVSP_HIST_BUCKETS && ns > h->upper_ns[b])
		b++;
	/* One writer: a relaxed load and store, so the metrics thread reads
	 * whole values (never a torn one) without a locked instruction here. */
	__atomic_store_n(&h->count[b], __atomic_load_n(&h->count[b], __ATOMIC_RELAXED) + 1,
			 __ATOMIC_RELAXED);
	__atomic_store_n(&h->sum_ns, __atomic_load_n(&h->sum_ns, __ATOMIC_RELAXED) + ns,
			 __ATOMIC_RELAXED);
}

#endif
