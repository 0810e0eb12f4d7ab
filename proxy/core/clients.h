/* SPDX-License-Identifier: MIT */
/* Clients of this proxy: their regions, room handles and events (clients.c).
 * What they ask is core/ops.h's to decode; what their rooms and slots
 * become when they go, core/rooms.h's. */
#ifndef KVSP_CLIENTS_H
#define KVSP_CLIENTS_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "layout.h"
#include "base/log.h"
#include "ring.h"

struct kvsp;

/* A half's client on this proxy: its handle. cid 0: nobody attached. */
struct kvsp_side {
	uint32_t cid;
	uint16_t cidx;
	uint16_t handle;
	uint64_t user_data;
	int part; /* its client's part of the pool (kvsp_client.part): where its slots come from */
};

enum kvsp_handle_state {
	KVSP_H_FREE = 0,
	KVSP_H_OPEN,	/* its final event is still owed */
	KVSP_H_ENDED,	/* final posted; waiting for CLOSE */
	KVSP_H_CLOSING, /* CLOSE seen; freed when the final is posted */
};
enum kvsp_role { KVSP_RECV = 1, KVSP_SEND = 2, KVSP_JOIN = 3 /* a shared room's other reader */ };

struct kvsp_handle {
	uint8_t state;
	uint8_t role;
	uint32_t room;
	uint32_t gen; /* the library's generation for it, from the open; events echo it */
	uint64_t user_data;
};

/* What a client did: the proxy's own copy of its published row (the row
 * is only ever stored to, never read back). */
struct kvsp_client_tally {
	uint64_t ops, rejects, rooms;
	uint64_t rooms_done, rooms_aborted, rooms_failed;
	uint64_t chunks_sent, bytes_sent, chunks_recv, bytes_recv;
};

/* Lines a client can cause at will, each kind rate-limited apart. */
enum { KVSP_RL_TOKEN, KVSP_RL_KINDS };

struct kvsp_client {
	uint32_t id;  /* unique for the proxy's life; the owner in slot metadata */
	uint16_t idx; /* in p->clients */
	int sock, efd, cmem_fd;
	pid_t pid;
	uid_t uid;
	uint16_t share;	       /* its uid's entry in p->shares */
	uint16_t pshare;       /* its process's, or KVSP_NO_SHARE (not known) */
	uint64_t proc;	       /* its process (kvsp_client_new) */
	int part;	       /* the pool's part of its NUMA node: it leases there; -1: any */
	struct kvs_cshm *cshm; /* client-writable: copy before trusting */
	size_t cmem_size;
	struct kvs_lease *reply_leases;
	struct kvs_ring sq, cq;
	/* The submission ring's consumer index. Its copy in the ring lives in
	 * memory the client can write: this one is what the proxy trusts. */
	uint32_t sq_cons;
	struct kvsp_handle *handles;
	uint32_t finals_owed; /* one cq entry reserved for each */
	bool kick;	      /* on p->kicks: its eventfd is due a look */
	bool dying;	      /* being reclaimed: posts nothing more */
	struct kvsp_rl rl[KVSP_RL_KINDS];
	struct kvs_client_row *pub; /* its row in the published clients table */
	struct kvsp_client_tally tally;
};

/* Records waiting on c's submission ring, by the producer index the client
 * wrote and the consumer index we keep; -1 when that claims more than the
 * ring holds, which only a client writing its indices by hand can make. */
static inline int64_t kvsp_sq_waiting(const struct kvsp_client *c)
{
	/* Acquire: pairs with the client's release of prod.tail, so the
	 * records it covers are visible once we see it. */
	uint32_t n = __atomic_load_n(&c->sq.r->prod.tail, __ATOMIC_ACQUIRE) - c->sq_cons;
	return n <= c->sq.r->capacity ? (int64_t)n : -1;
}

/* Counts a chunk of len bytes c gave to an open room's transport. */
void kvsp_client_sent(struct kvsp_client *c, uint64_t len);

/* A new client of uid on sock, of process proc (0: unknown; core/shares.h:
 * its pidfs inode, else its pid). Returns it, or NULL with errno EUSERS
 * (--max-clients reached), EDQUOT (uid holds its share of them),
 * ETOOMANYREFS (its process holds its share of its uid's) or why. */
struct kvsp_client *kvsp_client_new(struct kvsp *p, int sock, pid_t pid, uid_t uid, uint64_t proc);
/* Frees c itself: its rooms and slots must be gone (kvsp_client_destroy, core/rooms.h). */
void kvsp_client_free(struct kvsp *p, struct kvsp_client *c);
struct kvsp_client *kvsp_client_get(struct kvsp *p, uint16_t cidx, uint32_t cid);
/* The final event of side s (its client c, live) on its handle, once: later ones are dropped. */
void kvsp_client_final(struct kvsp *p, struct kvsp_client *c, const struct kvsp_side *s,
		       uint16_t type, int status, uint64_t bytes, uint32_t slot, uint32_t epoch);
void kvsp_client_reply(struct kvsp *p, struct kvsp_client *c, uint32_t seq, int status);
void kvsp_client_reject(struct kvsp *p, struct kvsp_client *c, uint16_t h, int status,
			const struct kvs_sqe *q);
/* Counts n ops taken from c's ring (and the rooms they opened or closed). */
void kvsp_client_took(struct kvsp *p, struct kvsp_client *c, unsigned n);
void kvsp_kicks_flush(struct kvsp *p);
void kvsp_count_reject(struct kvsp *p, int err);

#endif
