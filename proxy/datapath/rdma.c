/* SPDX-License-Identifier: MIT */
/*
 * The RDMA READ data path: with a device on both ends (--rdma-device, or
 * found by --transport auto), the receiver pulls each chunk from the
 * sender's slot into a slot it posted and still owns. The session's
 * control stays on its connections (see datapath/verbs.h for the memory
 * rules):
 *
 *   - Each end, once the session is up, makes an RC queue pair and says
 *     RDMA_HELLO (its queue pair and pool) on stream 0. On the peer's
 *     HELLO it connects; from then on the chunks it sends go as
 *     CHUNK_READ on stream 0, which the HELLO preceded.
 *   - The receiver posts a slot for the chunk (kvsp_chunk_post: room,
 *     generation and token checked), READs into it, and on the READ's
 *     completion owes CHUNK_ACK; the chunk lands (the fence decides again)
 *     as the ack is sealed. A slot is never reused while a READ of ours
 *     may still write it: an aborted room's slot stays a tombstone until
 *     the completion (success or flush) has been reaped.
 *   - The sender's slot stays pinned until the ack: the peer's NIC may
 *     read it until then. It never posts anything itself.
 *   - A lost session: its queue pair to the error state, and it is
 *     quiesced once every READ it posted has completed (flushed); past
 *     the peer timeout the queue pair is destroyed instead. Our sending
 *     pins are dead for the peer from the error state on: a queue pair in
 *     error answers no READ.
 * A proxy without a device ignores RDMA_HELLO and chunks go by the stream.
 */
#include <endian.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/failpoint.h"
#include "core/xport.h"
#include "daemon/log.h"
#include "datapath/datapath.h"
#include "datapath/verbs.h"
#include "layout.h"
#include "peer/conn.h"
#include "peer/peer.h"
#include "peer/session.h"

#define NONE UINT32_MAX
#define CQ_BATCH 32
/* CHUNK_READs a sender keeps unacknowledged on one session: bounds the
 * receiver's READs in flight and the acks it may owe at once. */
#define WINDOW 128

#define PUB(f, v) __atomic_store_n(&(f), (v), __ATOMIC_RELAXED)

/* One session's RDMA state, by session index. */
struct rsess {
	uint32_t id;   /* the session it is for; another id: stale, reset */
	struct ibv_qp *qp;
	struct kvsp_verbs_ep local, peer;
	bool owe_hello, heard, up, errored;
	unsigned inflight;           /* sending: CHUNK_READs not yet acknowledged */
	unsigned out;                /* receiving: READs posted (or held), not completed */
	uint32_t q_head, q_tail;     /* sending: chunks to announce, through xnext */
	uint32_t ack_head, ack_tail; /* receiving: our slots whose READ ended, CHUNK_ACK owed */
	uint32_t held_head, held_tail; /* receiving: READs the rdma.read failpoint holds (tests) */
	struct kvs_wire_chunk_ack nacks[WINDOW]; /* CHUNK_READs refused, acks owed */
	unsigned nack_head, nnacks;
};

/* Receiving side: a READ we posted into our slot, or its ack still owed. */
struct rread {
	struct kvs_wire_room name;
	uint64_t sender_ref;
	uint32_t sess, chunk;
	uint32_t next; /* the session's ack or held list */
	uint32_t len;
	void *dst;
	uint64_t raddr;
};

struct rdma {
	struct kvsp_dp dp;
	struct kvsp_verbs verbs;
	struct rsess rs[PSESS_MAX];
	struct rread *rread;        /* by our slot index */
	uint8_t *rwait;             /* by our slot: sent by CHUNK_READ, waiting for CHUNK_ACK */
	uint32_t *xnext;            /* sending queues, by slot */
	struct kvs_wire_room *room; /* by slot: the receiving room of a chunk we send */
	unsigned nheld;             /* READs held by rdma.read, every session: 0 on any real run */
};

static struct rdma *rdma_of(struct kvsp_dp *dp)
{
	return (struct rdma *)dp;
}

/* s's state here; what an earlier session at its index left is dropped. */
static struct rsess *rs_of(struct rdma *r, const struct psess *s)
{
	struct rsess *rs = &r->rs[s->idx];
	if (rs->id != s->id) {
		memset(rs, 0, sizeof(*rs));
		rs->id = s->id;
		rs->q_head = rs->q_tail = rs->ack_head = rs->ack_tail = NONE;
		rs->held_head = rs->held_tail = NONE;
	}
	return rs;
}

static void list_add(struct rdma *r, uint32_t *head, uint32_t *tail, uint32_t slot)
{
	r->rread[slot].next = NONE;
	if (*tail != NONE)
		r->rread[*tail].next = slot;
	else
		*head = slot;
	*tail = slot;
}

/* ------------------------------------------------------------ lifetime */

static void rdma_destroy(struct kvsp_dp *dp)
{
	struct rdma *r = rdma_of(dp);
	if (r->verbs.ctx)
		kvsp_verbs_close(&r->verbs);
	free(r->rread);
	free(r->rwait);
	free(r->xnext);
	free(r->room);
	free(r);
}

/* --transport: opens the device it asks for (or finds one, for auto).
 * Without one it still answers what peers with one say (RDMA_HELLO
 * ignored, CHUNK_READ refused: their chunks come by the stream). */
static struct kvsp_dp *rdma_create(const struct kvsp_dp *base, const struct kvsp_peer_opts *o,
				   char *why, size_t len, int *err)
{
	*err = 0;
	struct rdma *r = calloc(1, sizeof(*r));
	if (!r) {
		snprintf(why, len, "rdma data path: out of memory");
		*err = -ENOMEM;
		return NULL;
	}
	r->dp = *base;
	if (o->data == KVSP_DATA_TCP) {
		LOG_INFO("peers: chunks by TCP (--transport tcp)");
		return &r->dp;
	}
	uint32_t slots = kvsp_slot_count(base->p);
	char e[256];
	int rc = kvsp_verbs_open(&r->verbs, o->rdma_device, o->rdma_gid_index, kvsp_slot_mem(base->p, 0),
				 (size_t)slots * kvsp_slot_size(base->p), PSESS_MAX * WINDOW, e,
				 sizeof(e));
	if (rc < 0) {
		memset(&r->verbs, 0, sizeof(r->verbs));
		if (o->rdma_device || o->data == KVSP_DATA_VERBS) {
			if (o->rdma_device)
				snprintf(why, len, "--rdma-device %s: %s", o->rdma_device, e);
			else
				snprintf(why, len, "--transport verbs: %s", e);
			*err = rc;
			rdma_destroy(&r->dp);
			return NULL;
		}
		/* auto, no device named: a device that will not open costs this
		 * proxy RDMA, never its start. */
		if (rc == -ENODEV && strstr(e, "found none"))
			LOG_INFO("peers: chunks by TCP (--transport auto: no RDMA device here)");
		else
			LOG_WARN("peers: chunks by TCP (--transport auto: %s)", e);
		return &r->dp;
	}
	r->rread = calloc(slots, sizeof(*r->rread));
	r->rwait = calloc(slots, 1);
	r->xnext = calloc(slots, sizeof(*r->xnext));
	r->room = calloc(slots, sizeof(*r->room));
	if (!r->rread || !r->rwait || !r->xnext || !r->room) {
		rdma_destroy(&r->dp);
		snprintf(why, len, "rdma data path: out of memory");
		*err = -ENOMEM;
		return NULL;
	}
	LOG_INFO("rdma: %s port %u, GID index %d: chunks by RDMA READ with peers that have it",
		 r->verbs.name, r->verbs.port, r->verbs.gid_index);
	return &r->dp;
}

static void rdma_sess_up(struct kvsp_dp *dp, struct psess *s)
{
	struct rdma *r = rdma_of(dp);
	struct rsess *rs = rs_of(r, s);
	if (rs->qp || !r->verbs.ctx)
		return;
	rs->qp = kvsp_verbs_qp_new(&r->verbs, WINDOW, &rs->local);
	if (!rs->qp) {
		LOG_WARN("rdma: peer %s: no queue pair (%s): chunks go by TCP", s->ep.text,
			 strerror(errno));
		return;
	}
	rs->owe_hello = true;
}

static bool rdma_carries(const struct kvsp_dp *dp, const struct psess *s)
{
	const struct rsess *rs = &((const struct rdma *)dp)->rs[s->idx];
	return rs->id == s->id && rs->up;
}

/* -------------------------------------------------------------- sending */

static int rdma_send(struct kvsp_dp *dp, struct psess *s, struct kvsp_xfer *x,
		     const struct kvs_wire_room *room)
{
	struct rdma *r = rdma_of(dp);
	struct rsess *rs = rs_of(r, s);
	r->room[x->slot] = *room;
	r->xnext[x->slot] = NONE;
	if (rs->q_tail != NONE)
		r->xnext[rs->q_tail] = x->slot;
	else
		rs->q_head = x->slot;
	rs->q_tail = x->slot;
	return 0;
}

/* The receiver is done with our slot for this transfer: it READ it, or
 * refused to. Either way its NIC will not touch it again. */
static void on_ack(struct rdma *r, struct psess *s, const struct kvs_wire_chunk_ack *b)
{
	struct kvsp_dp *dp = &r->dp;
	struct rsess *rs = rs_of(r, s);
	uint64_t ref = le64toh(b->xfer_ref);
	uint32_t slot = (uint32_t)ref, epoch = (uint32_t)(ref >> 32);
	if (!r->rwait || slot >= kvsp_slot_count(dp->p) || !r->rwait[slot]) {
		KVS_STAT_ADD(dp->st->peer_frames_ignored, 1);
		return;
	}
	struct kvsp_xfer *x = kvsp_xfer_of(dp->p, slot);
	if (x->dir != KVSP_XFER_SEND || x->xport != dp->t->idx || x->peer != s->id ||
	    x->epoch != epoch) {
		KVS_STAT_ADD(dp->st->peer_frames_ignored, 1);
		return;
	}
	r->rwait[slot] = 0;
	rs->inflight--;
	int status = (int32_t)le32toh((uint32_t)b->status);
	if (status == -EOPNOTSUPP) {
		/* The peer cannot READ after all: this chunk, and the rest, by TCP. */
		LOG_WARN("rdma: peer %s cannot read from us: chunks go by TCP", s->ep.text);
		rs->up = false;
		PUB(s->pub->flags, 0);
		for (uint32_t q = rs->q_head; q != NONE; q = r->xnext[q])
			kvsp_dp_carry(dp->dps, *dp->ndps, s, kvsp_xfer_of(dp->p, q), &r->room[q]);
		rs->q_head = rs->q_tail = NONE;
		int rc = kvsp_dp_carry(dp->dps, *dp->ndps, s, x, &r->room[slot]);
		if (rc < 0)
			kvsp_xfer_quiesced(dp->p, x, rc);
		return;
	}
	kvsp_xfer_quiesced(dp->p, x, 0);
}

/* ------------------------------------------------------------ receiving */

static void nack(struct rsess *rs, const struct kvs_wire_chunk_read *b, int status)
{
	struct kvs_wire_chunk_ack a = { .room = b->room, .chunk = b->chunk,
					.status = (int32_t)htole32((uint32_t)status),
					.xfer_ref = b->xfer_ref };
	rs->nacks[(rs->nack_head + rs->nnacks++) % WINDOW] = a;
}

/* Posts the READ recorded for our slot. A refused post is a completion
 * that failed: the slot is discarded and the peer told. */
static void post(struct rdma *r, struct rsess *rs, uint32_t slot)
{
	struct rread *rr = &r->rread[slot];
	if (kvsp_verbs_read(&r->verbs, rs->qp, slot, rr->dst, rr->len, rr->raddr, rs->peer.rkey) == 0)
		return;
	rs->out--;
	kvsp_chunk_discard(r->dp.p, kvsp_xfer_of(r->dp.p, slot), -EIO);
	struct kvs_wire_chunk_read b = { .room = rr->name, .chunk = htole32(rr->chunk),
					 .xfer_ref = htole64(rr->sender_ref) };
	nack(rs, &b, -EIO);
}

static int on_read(struct rdma *r, struct psess *s, const struct kvs_wire_chunk_read *b)
{
	struct kvsp_dp *dp = &r->dp;
	struct rsess *rs = rs_of(r, s);
	/* The sender keeps at most a window unacknowledged: more is a peer
	 * out of protocol, and we owe no ack we cannot hold. */
	if (rs->out + rs->nnacks >= WINDOW)
		return -EPROTO;
	if (!rs->qp || !rs->heard) {
		nack(rs, b, -EOPNOTSUPP);
		return 0;
	}
	uint32_t len = le32toh(b->len), chunk = le32toh(b->chunk);
	uint64_t off = le64toh(b->offset);
	if (!len || len > kvsp_slot_size(dp->p) || off > rs->peer.pool_len ||
	    len > rs->peer.pool_len - off)
		return -EPROTO;
	struct kvsp_room_name n = { le32toh(b->room.room), le32toh(b->room.gen), { 0 } };
	memcpy(n.token, b->room.token, sizeof(n.token));
	struct kvsp_xfer *x;
	void *dst;
	int rc = kvsp_room_find(dp->p, &n);
	if (rc >= 0)
		rc = kvsp_chunk_post(dp->p, dp->t, s->id, n.room, n.gen, chunk, len, &x, &dst);
	if (rc < 0) {
		kvsp_chunk_sunk(dp->p, 0); /* refused: counted, nothing read */
		nack(rs, b, rc);
		return 0;
	}
	struct rread *rr = &r->rread[x->slot];
	*rr = (struct rread){ .name = b->room, .sender_ref = le64toh(b->xfer_ref), .sess = s->id,
			      .chunk = chunk, .next = NONE, .len = len, .dst = dst,
			      .raddr = rs->peer.pool_addr + off };
	rs->out++;
	if (kvsp_xport_fp(dp->p, KVSP_FP_RDMA_READ, n.room) == KVSP_FP_HOLD) {
		/* Test barrier: the slot is posted, the READ waits (as a slow one would). */
		list_add(r, &rs->held_head, &rs->held_tail, x->slot);
		r->nheld++;
		return 0;
	}
	post(r, rs, x->slot);
	return 0;
}

static int on_hello(struct rdma *r, struct psess *s, const struct kvs_wire_rdma_hello *b)
{
	struct rsess *rs = rs_of(r, s);
	if (rs->heard)
		return -EPROTO; /* once per session */
	rs->heard = true;
	if (!rs->qp) {
		KVS_STAT_ADD(r->dp.st->peer_frames_ignored, 1);
		LOG_INFO("rdma: peer %s offers RDMA; %s: chunks to it go by TCP", s->ep.text,
			 r->verbs.ctx ? "we have no queue pair for it" : "this proxy has no RDMA device");
		return 0;
	}
	struct kvsp_verbs_ep *p = &rs->peer;
	p->qpn = le32toh(b->qpn);
	p->psn = le32toh(b->psn);
	memcpy(p->gid, b->gid, sizeof(p->gid));
	p->pool_addr = le64toh(b->pool_addr);
	p->pool_len = le64toh(b->pool_len);
	p->rkey = le32toh(b->rkey);
	p->mtu = le32toh(b->mtu);
	int rc = kvsp_verbs_qp_connect(&r->verbs, rs->qp, &rs->local, p);
	if (rc < 0) {
		LOG_WARN("rdma: peer %s: cannot connect the queue pair (%s): chunks go by TCP",
			 s->ep.text, strerror(-rc));
		kvsp_verbs_qp_destroy(rs->qp);
		rs->qp = NULL;
		return 0;
	}
	rs->up = true;
	PUB(s->pub->flags, KVS_PEER_RDMA);
	LOG_INFO("rdma: peer %s: chunks by RDMA READ on %s", s->ep.text, r->verbs.name);
	return 0;
}

static int rdma_on_frame(struct kvsp_dp *dp, struct psess *s, struct pconn *c,
			 const struct kvsp_frame *f)
{
	struct rdma *r = rdma_of(dp);
	if (c->stream != 0)
		return -EPROTO; /* RDMA control goes on stream 0: that is its order */
	switch (f->type) {
	case KVS_WIRE_RDMA_HELLO:
		return on_hello(r, s, &f->body.rdma_hello);
	case KVS_WIRE_CHUNK_READ:
		return on_read(r, s, &f->body.chunk_read);
	case KVS_WIRE_CHUNK_ACK:
		on_ack(r, s, &f->body.chunk_ack);
		return 0;
	}
	return -EPROTO;
}

/* ------------------------------------------------------- frames we owe */

/* On stream 0, in order: our HELLO, refusals, acks (each lands its chunk
 * as it is sealed), then the chunks we send, within the window. */
static bool rdma_next_frame(struct kvsp_dp *dp, struct psess *s, struct pconn *c,
			    struct kvsp_dp_frame *out)
{
	struct rdma *r = rdma_of(dp);
	struct rsess *rs = &r->rs[s->idx];
	if (c->stream != 0 || rs->id != s->id)
		return false;
	if (rs->owe_hello) {
		if (out) {
			rs->owe_hello = false;
			const struct kvsp_verbs_ep *e = &rs->local;
			out->type = KVS_WIRE_RDMA_HELLO;
			out->body.rdma_hello = (struct kvs_wire_rdma_hello){
				.qpn = htole32(e->qpn), .psn = htole32(e->psn),
				.pool_addr = htole64(e->pool_addr), .pool_len = htole64(e->pool_len),
				.rkey = htole32(e->rkey), .mtu = htole32(e->mtu) };
			memcpy(out->body.rdma_hello.gid, e->gid, sizeof(e->gid));
		}
		return true;
	}
	if (rs->nnacks) {
		if (out) {
			out->type = KVS_WIRE_CHUNK_ACK;
			out->body.chunk_ack = rs->nacks[rs->nack_head];
			rs->nack_head = (rs->nack_head + 1) % WINDOW;
			rs->nnacks--;
		}
		return true;
	}
	if (rs->ack_head != NONE) {
		if (out) {
			uint32_t slot = rs->ack_head;
			struct rread *rr = &r->rread[slot];
			rs->ack_head = rr->next;
			if (rs->ack_head == NONE)
				rs->ack_tail = NONE;
			out->type = KVS_WIRE_CHUNK_ACK;
			out->body.chunk_ack = (struct kvs_wire_chunk_ack){
				.room = rr->name, .chunk = htole32(rr->chunk), .status = 0,
				.xfer_ref = htole64(rr->sender_ref) };
			/* Its bytes are in our slot and no READ of ours is left
			 * on it: the fence decides whether they land. */
			kvsp_chunk_land(dp->p, kvsp_xfer_of(dp->p, slot));
		}
		return true;
	}
	if (rs->q_head == NONE || !rs->up || rs->inflight >= WINDOW)
		return false; /* nothing to send, or the window waits for an ack */
	if (out) {
		uint32_t slot = rs->q_head;
		rs->q_head = r->xnext[slot];
		if (rs->q_head == NONE)
			rs->q_tail = NONE;
		struct kvsp_xfer *x = kvsp_xfer_of(dp->p, slot);
		out->type = KVS_WIRE_CHUNK_READ;
		out->body.chunk_read = (struct kvs_wire_chunk_read){
			.room = r->room[slot],
			.chunk = htole32(x->chunk),
			.len = htole32(x->len),
			.xfer_ref = htole64((uint64_t)x->epoch << 32 | x->slot),
			.offset = htole64((uint64_t)x->slot * kvsp_slot_size(dp->p)),
		};
		r->rwait[slot] = 1;
		rs->inflight++;
	}
	return true;
}

/* ------------------------------------------------------------- aborts */

static void rdma_cancel(struct kvsp_dp *dp, uint32_t room, uint32_t gen)
{
	struct rdma *r = rdma_of(dp);
	for (unsigned i = 0; i < PSESS_MAX; i++) {
		struct rsess *rs = &r->rs[i];
		if (!rs->id)
			continue; /* no session's */
		/* Not announced yet: never leaves its slot. (Announced ones
		 * wait for their ack: the peer's NIC may be reading them. READs
		 * we posted complete in their own time: our NIC may be writing;
		 * the fence discards them then.) */
		for (uint32_t *at = &rs->q_head, prev = NONE; *at != NONE;) {
			uint32_t slot = *at;
			struct kvsp_xfer *x = kvsp_xfer_of(dp->p, slot);
			if (x->room != room || x->room_gen != gen) {
				prev = slot;
				at = &r->xnext[slot];
				continue;
			}
			*at = r->xnext[slot];
			if (rs->q_tail == slot)
				rs->q_tail = prev;
			kvsp_xfer_quiesced(dp->p, x, -ECANCELED);
		}
	}
}

/* ------------------------------------------------------- a session's end */

static bool rdma_sess_quiesce(struct kvsp_dp *dp, struct psess *s)
{
	struct rdma *r = rdma_of(dp);
	struct rsess *rs = &r->rs[s->idx];
	if (rs->id != s->id)
		return false;
	rs->up = false;
	/* Held READs were never posted: nothing of ours reads for them. */
	while (rs->held_head != NONE) {
		uint32_t slot = rs->held_head;
		rs->held_head = r->rread[slot].next;
		r->nheld--;
		rs->out--;
		kvsp_chunk_discard(dp->p, kvsp_xfer_of(dp->p, slot), -ECONNRESET);
	}
	rs->held_tail = NONE;
	if (rs->qp && !rs->errored) {
		kvsp_verbs_qp_error(rs->qp); /* every READ posted completes, flushed */
		rs->errored = true;
	}
	return rs->qp && rs->out > 0;
}

static void rdma_sess_force(struct kvsp_dp *dp, struct psess *s)
{
	struct rdma *r = rdma_of(dp);
	struct rsess *rs = &r->rs[s->idx];
	if (rs->id != s->id || !rs->qp)
		return;
	/* A destroyed queue pair's work requests are dropped: the device
	 * touches nothing for them any more, and they never complete. */
	kvsp_verbs_qp_destroy(rs->qp);
	rs->qp = NULL;
	rs->out = 0;
}

static void rdma_sess_free(struct kvsp_dp *dp, struct psess *s)
{
	struct rdma *r = rdma_of(dp);
	struct rsess *rs = &r->rs[s->idx];
	if (rs->id != s->id)
		return;
	if (rs->qp) {
		kvsp_verbs_qp_error(rs->qp);
		kvsp_verbs_qp_destroy(rs->qp);
	}
	/* Our sending pins for this peer are the core's to release now
	 * (kvsp_peer_lost): forget that they waited for an ack. */
	uint32_t slots = r->rwait ? kvsp_slot_count(dp->p) : 0;
	for (uint32_t i = 0; i < slots; i++) {
		struct kvsp_xfer *x = kvsp_xfer_of(dp->p, i);
		if (r->rwait[i] && x->xport == dp->t->idx && x->peer == s->id)
			r->rwait[i] = 0;
	}
	for (uint32_t slot = rs->held_head; slot != NONE; slot = r->rread[slot].next)
		r->nheld--;
	memset(rs, 0, sizeof(*rs));
}

/* ---------------------------------------------------------- completions */

/* Held READs go once the rdma.read failpoint lets go. */
static int release_held(struct rdma *r)
{
	int err;
	if (!r->nheld ||
	    kvsp_xport_fp_action(r->dp.p, KVSP_FP_RDMA_READ, &err) == KVS_FP_PAUSE)
		return KVSP_IDLE; /* every real run: nothing held */
	for (unsigned i = 0; i < PSESS_MAX; i++) {
		struct rsess *rs = &r->rs[i];
		if (!rs->id)
			continue;
		while (rs->held_head != NONE) {
			uint32_t slot = rs->held_head;
			rs->held_head = r->rread[slot].next;
			r->nheld--;
			post(r, rs, slot);
		}
		rs->held_tail = NONE;
	}
	return KVSP_BUSY;
}

static int rdma_poll(struct kvsp_dp *dp)
{
	struct rdma *r = rdma_of(dp);
	if (!r->verbs.ctx)
		return KVSP_IDLE;
	int busy = release_held(r);
	struct ibv_wc wc[CQ_BATCH];
	int n = kvsp_verbs_poll(&r->verbs, wc, CQ_BATCH);
	for (int k = 0; k < n; k++) {
		uint32_t slot = (uint32_t)wc[k].wr_id;
		struct rread *rr = &r->rread[slot];
		struct rsess *rs = &r->rs[rr->sess & 0xff];
		struct kvsp_xfer *x = kvsp_xfer_of(dp->p, slot);
		if (rs->id != rr->sess)
			continue; /* its session was forced: the core released it */
		rs->out--;
		struct psess *s = psess_up(dp->sessions, rr->sess);
		if (!s || wc[k].status != IBV_WC_SUCCESS) {
			/* Flushed, or failed: nothing more of it can land. */
			kvsp_chunk_discard(dp->p, x, -EIO);
			if (s) {
				LOG_WARN("rdma: peer %s: READ failed: %s", s->ep.text,
					 ibv_wc_status_str(wc[k].status));
				psess_lost(dp->sessions, s, -EIO); /* its queue pair is in error now */
			}
			continue;
		}
		KVS_STAT_ADD(dp->st->rdma_reads, 1);
		KVS_STAT_ADD(dp->st->rdma_bytes_rx, wc[k].byte_len);
		KVS_STAT_ADD(s->pub->bytes_rx, wc[k].byte_len);
		list_add(r, &rs->ack_head, &rs->ack_tail, slot);
	}
	return n > 0 ? KVSP_BUSY : busy;
}

static bool rdma_pending(const struct kvsp_dp *dp)
{
	const struct rdma *r = (const struct rdma *)dp;
	for (unsigned i = 0; i < PSESS_MAX; i++)
		if (r->rs[i].out)
			return true;
	return false;
}

static const uint16_t rdma_types[] = { KVS_WIRE_RDMA_HELLO, KVS_WIRE_CHUNK_READ, KVS_WIRE_CHUNK_ACK,
				       0 };

const struct kvsp_dp_ops kvsp_dp_rdma = {
	.name = "rdma",
	.peer_flag = KVS_PEER_RDMA,
	.types = rdma_types,
	.create = rdma_create,
	.destroy = rdma_destroy,
	.sess_up = rdma_sess_up,
	.carries = rdma_carries,
	.send = rdma_send,
	.cancel = rdma_cancel,
	.on_frame = rdma_on_frame,
	.next_frame = rdma_next_frame,
	.sess_quiesce = rdma_sess_quiesce,
	.sess_force = rdma_sess_force,
	.sess_free = rdma_sess_free,
	.poll = rdma_poll,
	.pending = rdma_pending,
};
