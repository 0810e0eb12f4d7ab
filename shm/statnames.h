/* SPDX-License-Identifier: MIT */
/* Names of the published counters, for admin barriers and tools. */
#ifndef KVS_SHM_STATNAMES_H
#define KVS_SHM_STATNAMES_H

#include <stddef.h>
#include <string.h>

#include "layout.h"

struct kvs_stat_name {
	const char *name;
	size_t off;
};

#define KVS_STAT(f)                               \
	{                                         \
#f, offsetof(struct kvs_stats, f) \
	}
#define KVS_STAT_SLOTS(st, n)                                          \
	{                                                              \
		"slots." n, offsetof(struct kvs_stats, slots) + (st)*8 \
	}

static const struct kvs_stat_name kvs_stat_names[] = {
	KVS_STAT_SLOTS(KVS_SLOT_FREE, "free"),
	KVS_STAT_SLOTS(KVS_SLOT_LEASED, "leased"),
	KVS_STAT_SLOTS(KVS_SLOT_INFLIGHT, "inflight"),
	KVS_STAT_SLOTS(KVS_SLOT_TOMBSTONE, "tombstone"),
	KVS_STAT_SLOTS(KVS_SLOT_RECV_POSTED, "recv_posted"),
	KVS_STAT_SLOTS(KVS_SLOT_RECV_FILLED, "recv_filled"),
	KVS_STAT(rooms_open),
	KVS_STAT(rooms_done),
	KVS_STAT(rooms_aborted),
	KVS_STAT(rooms_failed),
	KVS_STAT(rooms_timed_out),
	KVS_STAT(clients),
	KVS_STAT(clients_total),
	KVS_STAT(clients_died),
	KVS_STAT(clients_refused),
	KVS_STAT(clients_closed),
	KVS_STAT(rej_stale),
	KVS_STAT(rej_perm),
	KVS_STAT(rej_busy),
	KVS_STAT(rej_inval),
	KVS_STAT(rej_token),
	KVS_STAT(rej_nobufs),
	KVS_STAT(ops),
	KVS_STAT(events),
	KVS_STAT(events_dropped),
	KVS_STAT(chunks_moved),
	KVS_STAT(bytes_moved),
	KVS_STAT(tombstones_reaped),
	KVS_STAT(sleeps),
	KVS_STAT(draining),
	KVS_STAT(log_suppressed),
	KVS_STAT(chunks_discarded),
	KVS_STAT(peer_sessions),
	KVS_STAT(peer_lost),
	KVS_STAT(peer_auth_failed),
	KVS_STAT(peer_refused),
	KVS_STAT(peer_frames_refused),
	KVS_STAT(peer_frames_ignored),
	KVS_STAT(peer_crc_errors),
	KVS_STAT(tcp_bytes_tx),
	KVS_STAT(tcp_bytes_rx),
	KVS_STAT(peer_byes),
	KVS_STAT(rdma_reads),
	KVS_STAT(rdma_bytes_rx),
	KVS_STAT(peer_timeouts),
	KVS_STAT(peer_evicted),
	KVS_STAT(peer_closed),
	KVS_STAT(peer_pings),
	KVS_STAT(rdma_binds),
	KVS_STAT(rdma_invalidates),
	KVS_STAT(rdma_regions),
	KVS_STAT(rdma_region_frees),
	KVS_STAT(rdma_reads_refused),
	KVS_STAT(rdma_links_lost),
	KVS_STAT(rdma_sessions),
	KVS_STAT(tcp_send_calls),
	KVS_STAT(tcp_recv_calls),
	KVS_STAT(peer_epoll_waits),
	KVS_STAT(peer_epoll_ctls),
	KVS_STAT(tcp_lowat_calls),
	KVS_STAT(tcp_zc_sends),
	KVS_STAT(tcp_zc_copied),
	KVS_STAT(trace_written),
	KVS_STAT(trace_dropped),
};

/* Returns the counter's offset in struct kvs_stats, or -1. */
static inline long kvs_stat_find(const char *name)
{
	for (size_t i = 0; i < sizeof(kvs_stat_names) / sizeof(kvs_stat_names[0]); i++)
		if (!strcmp(kvs_stat_names[i].name, name))
			return (long)kvs_stat_names[i].off;
	return -1;
}

#endif
