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

struct kvs_room {
	kvs_client *c;
	uint16_t idx;    /* handle index, shared with the proxy */
	uint8_t role;    /* 0: free */
	uint8_t state;
	bool aborted;
	uint32_t nchunks;
	uint32_t final_type;
	int32_t final_status;
	uint64_t bytes, chunk, user_data;
	uint64_t *sent;          /* sender: chunks handed over */
	struct kvs_lease *map;   /* receiver: chunk leases, fetched on demand */
	struct kvs_lease first;  /* receiver: chunk 0, from RECV_DONE */
};

#define KVS_EXT_MAX 4 /* companion libraries attached to one connection */

struct kvs_ext {
	const void *key;
	void *state;
	void (*fini)(kvs_client *c, void *state);
};

struct kvs_client {
	int sock, wake_fd, efd;
	bool dead;
	bool fd_mode; /* kvs_event_fd was asked for: the proxy kicks on every batch */
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
	unsigned nrooms, nfree;
	struct kvs_room *rooms;
	uint16_t *free_idx;
	struct kvs_cqe *stash; /* events taken off the ring while waiting for a reply */
	unsigned stash_cap, stash_head, stash_n;
	struct kvs_ext ext[KVS_EXT_MAX];
};

#endif
