/* SPDX-License-Identifier: MIT */
/* libkvstage's private state. */
#ifndef KVS_SHM_CLIENT_H
#define KVS_SHM_CLIENT_H

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/eventfd.h>
#include <time.h>

#include <rte_atomic.h>

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
	uint64_t *sent;		/* sender: chunks handed over (kvs_client.sent_bits[idx]) */
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
	uint64_t **sent_bits; /* per handle index, once it has sent: slot_count bits, kept
			       * all 0 between rooms, so an open neither allocates nor
			       * clears the largest room's bitmap */
	uint16_t *free_idx;
	struct kvs_cqe *stash; /* events taken off the ring while waiting for a reply */
	unsigned stash_cap, stash_head, stash_n;
	struct kvs_ext ext[KVS_EXT_MAX];
};

/* ------------------------------------------------- the library's insides
 * Shared by its files: client.c (the registry of connections, liveness,
 * ops to the proxy and waits for its replies), connect.c, rooms.c (leases
 * and rooms), events.c. libkvstage.map keeps them out of the shared
 * library's interface; kvsc_ keeps them out of a static linker's way. */

#define KVS_NO_DEADLINE UINT64_MAX
#define KVS_LIVENESS_NS 1000000ull /* async calls look at the socket at most every 1 ms */

/* Every connection of the process, indexed by kvs_client.reg (client.c). */
extern kvs_client *kvsc_registry[KVS_REGISTRY_MAX];

static inline uint64_t kvsc_mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The vDSO's coarse clock: no syscall, a tick's resolution. Liveness
 * checks use it and nothing else, so their differences never go negative. */
static inline uint64_t kvsc_coarse_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* c may be used by this process: 0, or -EINVAL, -ECHILD. */
static inline int kvsc_usable(const kvs_client *c)
{
	if (!c)
		return -EINVAL;
	return c->forked ? -ECHILD : 0;
}

/* The room handle h names, if it names one that is open now (not closed,
 * not reused). Returns 0, or -EINVAL (NULL), -EBADF, -ECHILD.
 * Inline: every kvs_send takes it. */
static inline __attribute__((always_inline)) int kvsc_room_find(const kvs_room *h, kvs_client **cp,
								struct kvs_rstate **rp)
{
	if (!h)
		return -EINVAL;
	kvs_client *c = __atomic_load_n(&kvsc_registry[kvs_room_handle_reg(h)], __ATOMIC_ACQUIRE);
	if (!c)
		return -EBADF;
	if (c->forked)
		return -ECHILD;
	uint16_t i = kvs_room_handle_idx(h);
	if (i >= c->nrooms)
		return -EBADF;
	struct kvs_rstate *r = &c->rooms[i];
	if (!r->role || r->gen != kvs_room_handle_gen(h) || r->state == KVS_ROOM_CLOSING)
		return -EBADF;
	*cp = c;
	*rp = r;
	return 0;
}

/* kvs_event_fd was asked for: the proxy kicks the eventfd for every batch. */
static inline bool kvsc_fd_mode(const kvs_client *c)
{
	return c->event_fd >= 0;
}

/* Leaves `waiting` as the mode wants it after a blocking wait. */
static inline void kvsc_unwait(kvs_client *c)
{
	__atomic_store_n(&c->cshm->waiting, kvsc_fd_mode(c), __ATOMIC_RELAXED);
}

/* Adds c to the registry (c->reg). Returns 0, or -EMFILE. */
int kvsc_registry_add(kvs_client *c);
/* Takes c out of the registry. */
void kvsc_registry_del(kvs_client *c);
/* The connection's error once the proxy's end of the socket is gone (c->err), else 0. Costs a syscall. */
int kvsc_proxy_gone(kvs_client *c);

/* kvsc_proxy_gone at most every KVS_LIVENESS_NS, for the async fast path. */
static inline int kvsc_proxy_gone_lazy(kvs_client *c)
{
	if (c->err)
		return c->err;
	if (kvsc_coarse_ns() - c->alive_ns < KVS_LIVENESS_NS)
		return 0;
	return kvsc_proxy_gone(c);
}

/* Wakes the proxy if it sleeps, after our enqueue. */
static inline void kvsc_kick_proxy(kvs_client *c)
{
	/* Pairs with the proxy's fence between setting `sleeping` and its last
	 * look at the rings: our enqueue (a store) must be visible before we
	 * load `sleeping`, or both sides could decide the other will act. */
	rte_atomic_thread_fence(__ATOMIC_SEQ_CST);
	if (__atomic_load_n(&c->ctrl->sleeping, __ATOMIC_RELAXED))
		eventfd_write(c->wake_fd, 1);
}

/* kvsc_submit with the ring full: waits up to 1 ms for space. Returns 0, or -EAGAIN, c->err. */
int kvsc_submit_full(kvs_client *c, const struct kvs_sqe *q);

/* Enqueues q (an async op). Returns 0, or -EAGAIN (ring full for 1 ms), c->err.
 * Inline: every kvs_send takes it. */
static inline int kvsc_submit(kvs_client *c, const struct kvs_sqe *q)
{
	int rc = kvsc_proxy_gone_lazy(c);
	if (rc)
		return rc;
	if (kvs_ring_push(&c->sq, q, sizeof(*q), 1) == 1) {
		kvsc_kick_proxy(c);
		return 0;
	}
	return kvsc_submit_full(c, q);
}

/* Blocks until the eventfd fires, the proxy hangs up, or deadline (a CLOCK_MONOTONIC ns, or
 * KVS_NO_DEADLINE). Returns > 0 when woken, 0 at the deadline, or -errno (-ENOTCONN). */
int kvsc_block(kvs_client *c, uint64_t deadline);
/* Sends q and waits for the proxy's reply. Returns its status (>= 0), or -errno. */
int kvsc_sync_call(kvs_client *c, struct kvs_sqe *q);
/* Gives r's handle index back to c (rooms.c). */
void kvsc_room_free(kvs_client *c, struct kvs_rstate *r);

#endif
