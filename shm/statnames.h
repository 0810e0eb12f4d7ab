/* SPDX-License-Identifier: MIT */
/* Names of the published counters, for admin barriers and tools: struct
 * kvs_stats's fields by this table, the counter block's by its records. */
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
	KVS_STAT(peer_byes),
	KVS_STAT(peer_timeouts),
	KVS_STAT(peer_evicted),
	KVS_STAT(peer_closed),
	KVS_STAT(peer_pings),
	KVS_STAT(peer_epoll_waits),
	KVS_STAT(peer_epoll_ctls),
	KVS_STAT(trace_written),
	KVS_STAT(trace_dropped),
};

/* Returns the counter's offset in struct kvs_stats, or -1 (it may still be
 * in the counter block: kvs_stat_at looks in both). */
static inline long kvs_stat_find(const char *name)
{
	for (size_t i = 0; i < sizeof(kvs_stat_names) / sizeof(kvs_stat_names[0]); i++)
		if (!strcmp(kvs_stat_names[i].name, name))
			return (long)kvs_stat_names[i].off;
	return -1;
}

/* Returns segment c's counter block (len bytes of c mapped) with its
 * published records' count in *n; or NULL and *n 0 when it has none, or
 * says one that lies past len or holds more than the ABI's capacity. */
static inline const struct kvs_counters *kvs_counters_of(const struct kvs_ctrl *c, size_t len,
							 uint32_t *n)
{
	/* Acquire: a record counted is a record written. */
	uint32_t k = __atomic_load_n(&c->counter_count, __ATOMIC_ACQUIRE);
	uint64_t off = c->counters_off;
	*n = 0;
	if (!k || k > KVS_COUNTERS_MAX || off < sizeof(*c) || off > len ||
	    len - off < sizeof(struct kvs_counters))
		return NULL;
	*n = k;
	return (const struct kvs_counters *)((const char *)c + off);
}

/* Returns the named counter's value in segment c (len bytes mapped): a
 * field of struct kvs_stats, else a record of the counter block; or NULL
 * when c has no counter of that name (a data path this proxy lacks). */
static inline const uint64_t *kvs_stat_at(const struct kvs_ctrl *c, size_t len, const char *name)
{
	long off = kvs_stat_find(name);
	if (off >= 0)
		return (const uint64_t *)((const char *)&c->stats + off);
	uint32_t n;
	const struct kvs_counters *b = kvs_counters_of(c, len, &n);
	if (strlen(name) >= sizeof(b->rec[0].name))
		return NULL; /* no record holds it whole */
	for (uint32_t i = 0; i < n; i++)
		if (!strncmp(b->rec[i].name, name, sizeof(b->rec[i].name)))
			return &b->value[i];
	return NULL;
}

#endif
