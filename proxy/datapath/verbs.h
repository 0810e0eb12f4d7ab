/* SPDX-License-Identifier: MIT */
/*
 * The RDMA device under the verbs data path: one device, one protection
 * domain, the pool registered once, one completion queue with a channel
 * for the loop's sleep, and RC queue pairs to peers.
 *
 * The data moves by RDMA READ only: a receiving proxy pulls each chunk
 * from the sender's slot into a slot it posted and still owns. So the pool
 * is registered for local writes and remote reads, never remote writes:
 * no peer, honest or not, can make this host's NIC write into its pool.
 * A READ's destination slot can be written by this host's own NIC until
 * its work completion arrives (success or flush), which is the moment the
 * core's fence may decide; moving the queue pair to the error state flushes
 * every outstanding READ, so a lost peer's pins come back as completions.
 */
#ifndef KVSP_VERBS_H
#define KVSP_VERBS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <infiniband/verbs.h>

/* What a peer needs to reach one of our queue pairs and read our pool. */
struct kvsp_verbs_ep {
	uint32_t qpn, psn;
	uint8_t gid[16];
	uint64_t pool_addr; /* our pool's address in our process: the base of its rkey */
	uint64_t pool_len;
	uint32_t rkey;
	uint32_t mtu;       /* enum ibv_mtu */
};

struct kvsp_verbs {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_mr *mr;
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
 * IPv4-mapped one first; gid_index >= 0 forces one), registers pool (len
 * bytes) for local write and remote read, makes a CQ of cq_depth entries
 * with a completion channel. Returns 0, or -errno with why filled in. */
int kvsp_verbs_open(struct kvsp_verbs *v, const char *name, int gid_index, void *pool, size_t len,
		    uint32_t cq_depth, char *why, size_t why_len);
/* Releases everything kvsp_verbs_open made (queue pairs must be gone). */
void kvsp_verbs_close(struct kvsp_verbs *v);

/* A new RC queue pair on v's CQ, moved to INIT, with room for depth
 * outstanding work requests; *ep gets what the peer needs (psn random).
 * Returns it, or NULL with errno set. */
struct ibv_qp *kvsp_verbs_qp_new(struct kvsp_verbs *v, uint32_t depth, struct kvsp_verbs_ep *ep);
/* Connects qp to the peer's endpoint (INIT -> RTR -> RTS). Returns 0, or -errno. */
int kvsp_verbs_qp_connect(struct kvsp_verbs *v, struct ibv_qp *qp, const struct kvsp_verbs_ep *local,
			  const struct kvsp_verbs_ep *remote);
/* Moves qp to the error state: every outstanding work request completes
 * (flushed) and no new one is executed. Returns 0, or -errno. */
int kvsp_verbs_qp_error(struct ibv_qp *qp);
/* Destroys qp (move it to error and reap its completions first). */
void kvsp_verbs_qp_destroy(struct ibv_qp *qp);

/* Posts one signalled RDMA READ of len bytes from the peer's raddr (its
 * rkey) into dst, which lies in v's pool. Returns 0, or -errno (queue full: -ENOMEM). */
int kvsp_verbs_read(struct kvsp_verbs *v, struct ibv_qp *qp, uint64_t wr_id, void *dst, uint32_t len,
		    uint64_t raddr, uint32_t rkey);
/* Up to n completions without waiting. Returns how many, or -errno. */
int kvsp_verbs_poll(struct kvsp_verbs *v, struct ibv_wc *wc, int n);
/* Before the loop sleeps: asks for an event on the next completion.
 * Returns 0, or -errno. The channel fd (v->chan->fd) then becomes readable. */
int kvsp_verbs_arm(struct kvsp_verbs *v);
/* After the channel fd woke the loop: takes and acks its event. */
void kvsp_verbs_ack(struct kvsp_verbs *v);

#endif
