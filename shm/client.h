/* SPDX-License-Identifier: MIT */
/* libkvstage's private state. */
#ifndef KVS_SHM_CLIENT_H
#define KVS_SHM_CLIENT_H

#include <stdbool.h>
#include <stdint.h>

#include "kvstage.h"
#include "layout.h"
#include "ring.h"

enum { KVS_ROLE_RECV = 1, KVS_ROLE_SEND = 2 };
enum { KVS_ROOM_OPEN = 1, KVS_ROOM_ENDED, KVS_ROOM_CLOSING };

/*
 * A kvs_room * is not an address: it names (connection, handle index,
 * generation) as one 64-bit value, so a handle kept past kvs_room_close
 * never names the room that reuses its index (-EBADF instead). The
 * connection is found in the process's registry of connections.
 */
#define KVS_REGISTRY_MAX 65536u
static_assert(sizeof(void *) == 8, "a room handle packs 64 bits");
static_assert(sizeof(struct kvs_event) == 64, "struct kvs_event is ABI: grow into rsvd");

static inline kvs_room *kvs_room_handle(uint16_t reg, uint16_t idx, uint32_t gen)
{
	return (kvs_room *)(uintptr_t)((uint64_t)gen << 32 | (uint64_t)reg << 16 | idx);
}

static inline uint16_t kvs_room_handle_idx(const kvs_room *h)
{
	return (uint16_t)(uintptr_t)h;
}

static inline uint16_t kvs_room_handle_reg(const kvs_room *h)
{
	return (uint16_t)((uintptr_t)h >> 16);
}

static inline uint32_t kvs_room_handle_gen(const kvs_room *h)
{
	return (uint32_t)((uintptr_t)h >> 32);
}

/* One room handle of a connection. gen is 0 while the index is free. */
struct kvs_rstate {
	uint32_t gen; /* shared with the proxy through the open's record */
	uint16_t idx; /* handle index, shared with the proxy */
	uint8_t role;
	uint8_t state;
	bool aborted;
	uint32_t nchunks;
	uint32_t final_type;
	int32_t final_status;
	uint64_t bytes, chunk, user_data;
	uint64_t *sent;		/* sender: chunks handed over */
	struct kvs_lease *map;	/* receiver: chunk leases, fetched on demand */
	struct kvs_lease first; /* receiver: chunk 0, from RECV_DONE */
	uint32_t joined;	/* a joined shared room: its index at the proxy + 1; else 0 */
};

#define KVS_EXT_MAX 4 /* companion libraries attached to one connection */

struct kvs_ext {
	const void *key;
	void *state;
	void (*fini)(kvs_client *c, void *state);
};

struct kvs_client {
	int sock, wake_fd, efd;
	int event_fd;  /* kvs_event_fd: an epoll fd over efd and sock, or -1 (then the
			 * proxy kicks efd only while we block) */
	int err;       /* 0 while usable, else why not: -ENOTCONN, -ETIMEDOUT */
	bool forked;   /* we are a child of the process that connected */
	bool welcomed; /* the proxy took us in: it is owed a goodbye */
	uint16_t reg;  /* index in the registry of connections */
	uint32_t id;
	uint8_t *pool;
	size_t pool_size, slot_size;
	uint32_t slot_count;
	const struct kvs_ctrl *ctrl;
	size_t ctrl_size;
	const struct kvs_slot *slots;
	struct kvs_cshm *cshm;
	size_t cmem_size;
	const struct kvs_lease *reply_leases;
	struct kvs_ring sq, cq;
	uint32_t seq;
	uint64_t spin_ns, alive_ns;
	int64_t sync_timeout_ns; /* < 0: no bound */
	unsigned nrooms, nfree;
	struct kvs_rstate *rooms;
	uint16_t *free_idx;
	struct kvs_cqe *stash; /* events taken off the ring while waiting for a reply */
	unsigned stash_cap, stash_head, stash_n;
	struct kvs_ext ext[KVS_EXT_MAX];
};

#endif
