/* SPDX-License-Identifier: MIT */
/*
 * The RDMA device under the verbs data path: one device, one protection
 * domain, the pool registered once, one completion queue with a channel
 * for the loop's sleep, and RC queue pairs to peers.
 *
 * The data moves by RDMA READ only: a receiving proxy pulls each chunk
 * from the sender's slot into a slot it posted and still owns. The pool is
 * registered for local access only: no peer, honest or not, can make this
 * host's NIC write into it, nor read it with the pool's own key. What a
 * peer may read is granted per chunk, by a remote key that covers exactly
 * that chunk's bytes, from the moment its CHUNK_READ is sent until its ack,
 * its room's abort or its session's loss (datapath/rdma_send.c):
 *
 *   - windows: a type-2 memory window bound over the chunk on the peer's
 *     own queue pair (so only that peer's queue pair can use it) with a
 *     fresh key tag, and revoked by a local invalidate, whose completion
 *     is what frees the slot. A device must also keep a READ inside the
 *     window's bytes; one that checks only the region under the window
 *     (rxe, found out at open by trying) gets a region per chunk under
 *     each window, registered for binding only: "windows over chunk
 *     regions", which fence bytes, time and the peer as windows do;
 *   - regions: where the device has no type-2 windows, a memory region
 *     registered over the chunk and deregistered at its end (a synchronous
 *     verb: once it returns, the NIC refuses the key). Any queue pair of
 *     the protection domain could use it, so it fences bytes and time,
 *     not which peer.
 *
 * A READ's destination slot can be written by this host's own NIC until
 * its work completion arrives (success or flush), which is the moment the
 * core's fence may decide; moving the queue pair to the error state flushes
 * every outstanding READ, so a lost peer's pins come back as completions.
 * Each queue pair keeps one receive posted that no peer may consume (we
 * never SEND): it flushes when the queue pair goes to the error state, so
 * a READ our NIC refused (which errors our queue pair) is heard at once,
 * on the completion queue, with nothing else posted.
 */
#ifndef KVSP_VERBS_H
#define KVSP_VERBS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <infiniband/verbs.h>

#include "peer/peer.h"

/* --rdma-keys: how the key a peer reads each chunk with is made
 * (datapath/verbs.h says what each fences). */
enum kvsp_keys {
	KVSP_KEYS_AUTO = 0, /* windows where the device has them, else regions */
	KVSP_KEYS_WINDOW,   /* type-2 memory windows, or no RDMA on this device */
	KVSP_KEYS_REGION,   /* a memory region per chunk */
};

/* What a peer needs to reach one of our queue pairs; chunk keys come with
 * each CHUNK_READ. */
struct kvsp_verbs_ep {
	uint32_t qpn, psn;
	uint8_t gid[16];
	uint64_t pool_addr; /* our pool's address in our process: chunk offsets are from it */
	uint64_t pool_len;
	uint32_t keys; /* enum kvsp_keys_wire: the speaker's, for its chunks */
	uint32_t mtu;  /* enum ibv_mtu */
};

struct kvsp_verbs {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_mr *mr;     /* the pool: local access (and window binding) only */
	enum kvsp_keys keys;   /* in force: KVSP_KEYS_WINDOW or _REGION */
	int window_confines;   /* windows: 1 the device keeps a READ in the window's bytes, 0 it
			      * does not, -1 its try did not finish */
	bool window_on_region; /* windows: each goes over a region of its chunk's own */
	struct ibv_comp_channel *chan;
	struct ibv_cq *cq;
	uint8_t port;
	int gid_index;
	union ibv_gid gid;
	enum ibv_mtu mtu;
	uint32_t cq_depth;
	char name[64];
};

/* Opens device name (NULL: the first one), finds its RoCE v2 GID (an
 * IPv4-mapped one first; gid_index >= 0 forces one), picks the keys (keys:
 * what --rdma-keys asks), registers pool (len bytes) for local access only,
 * makes a CQ of cq_depth entries (at most the device's) with a completion
 * channel.
 * Returns 0, or -errno with why filled in (-EOPNOTSUPP: windows were asked
 * for and the device has none). */
int kvsp_verbs_open(struct kvsp_verbs *v, const char *name, int gid_index, void *pool, size_t len,
		    uint32_t cq_depth, enum kvsp_keys keys, char *why, size_t why_len);
/* The keys in force as RDMA_HELLO says them. */
enum kvsp_keys_wire {
	KVSP_KEYS_WIRE_WINDOW = 1,
	KVSP_KEYS_WIRE_REGION = 2,
	KVSP_KEYS_WIRE_WINDOW_ON_REGION = 3,
};
uint32_t kvsp_verbs_keys_wire(const struct kvsp_verbs *v);
/* "windows", "regions", "windows over chunk regions", or "unknown keys". */
const char *kvsp_keys_wire_name(uint32_t w);
/* Releases everything kvsp_verbs_open made (queue pairs must be gone). */
void kvsp_verbs_close(struct kvsp_verbs *v);

/* A new RC queue pair on v's CQ, moved to INIT (remote READ allowed: the
 * keys say of what), with room for depth outstanding sends (READs, binds,
 * invalidates) and one receive; *ep gets what the peer needs (psn random).
 * Returns it, or NULL with errno set. */
struct ibv_qp *kvsp_verbs_qp_new(struct kvsp_verbs *v, uint32_t depth, struct kvsp_verbs_ep *ep);
/* Connects qp to the peer's endpoint (INIT -> RTR -> RTS). Returns 0, or -errno. */
int kvsp_verbs_qp_connect(struct kvsp_verbs *v, struct ibv_qp *qp,
			  const struct kvsp_verbs_ep *local, const struct kvsp_verbs_ep *remote);
/* Moves qp to the error state: every outstanding work request completes
 * (flushed) and no new one is executed. Returns 0, or -errno. */
int kvsp_verbs_qp_error(struct ibv_qp *qp);
/* Destroys qp (move it to error and reap its completions first, and free
 * every window bound through it: rxe waits for those for ever). */
void kvsp_verbs_qp_destroy(struct ibv_qp *qp);

/* Posts one signalled RDMA READ of len bytes from the peer's raddr (its
 * rkey) into dst, which lies in v's pool. Returns 0, or -errno (queue full: -ENOMEM). */
int kvsp_verbs_read(struct kvsp_verbs *v, struct ibv_qp *qp, uint64_t wr_id, void *dst,
		    uint32_t len, uint64_t raddr, uint32_t rkey);
/* Posts qp's one receive, which nothing should ever complete but the
 * queue pair's error state (flushed). Returns 0, or -errno. */
int kvsp_verbs_sentinel(struct ibv_qp *qp, uint64_t wr_id);

/* A type-2 memory window in v's protection domain, unbound. Returns it, or NULL with errno set. */
struct ibv_mw *kvsp_verbs_mw_new(struct kvsp_verbs *v);
/* Frees mw; bound or not, no key of it is honoured once this returns. */
void kvsp_verbs_mw_free(struct ibv_mw *mw);
/* Posts a signalled bind of mw, through qp, over [addr, addr + len) of mr
 * (NULL: the pool's) for remote READ only, with the key tag after *rkey's
 * (*rkey and mw->rkey get the new key: honoured once the bind completes).
 * Returns 0, or -errno. */
int kvsp_verbs_bind(struct kvsp_verbs *v, struct ibv_qp *qp, uint64_t wr_id, struct ibv_mw *mw,
		    struct ibv_mr *mr, void *addr, uint32_t len, uint32_t *rkey);
/* Posts a signalled local invalidate of rkey on qp: once it completes
 * (success), the NIC honours that key no more. Returns 0, or -errno. */
int kvsp_verbs_invalidate(struct ibv_qp *qp, uint64_t wr_id, uint32_t rkey);
/* A memory region over [addr, addr + len) of the pool: for remote READ
 * only (a region key), or under_window: for a window to be bound over it
 * only (no remote access of its own). Returns it, or NULL with errno set. */
struct ibv_mr *kvsp_verbs_region_new(struct kvsp_verbs *v, void *addr, uint32_t len,
				     bool under_window);
/* Deregisters a region (its windows freed or invalidated first): once
 * this returns, the NIC honours its key no more. */
void kvsp_verbs_region_free(struct ibv_mr *mr);
/* Up to n completions without waiting. Returns how many, or -errno. */
int kvsp_verbs_poll(struct kvsp_verbs *v, struct ibv_wc *wc, int n);
/* Asks for one event on the next completion: the channel fd (v->chan->fd)
 * then becomes readable. Poll the CQ after it: what came before raises
 * none. Returns 0, or -errno. */
int kvsp_verbs_arm(struct kvsp_verbs *v);
/* After the channel fd woke the loop: takes and acks its events. */
void kvsp_verbs_ack(struct kvsp_verbs *v);

#endif
