/* SPDX-License-Identifier: MIT */
/*
 * The RDMA READ data path: with a device on both ends (--rdma-device, or
 * found by --transport auto), the receiver pulls each chunk from the
 * sender's slot into a slot it posted and still owns, with a key that
 * covers that chunk alone (datapath/verbs.h says what the keys fence).
 * The session's control stays on its connections:
 *
 *   - Each end, once the session is up, makes an RC queue pair, posts its
 *     one receive (nothing but the error state completes it) and says
 *     RDMA_HELLO (its queue pair, its pool's base, its keys) on stream 0.
 *     On the peer's HELLO it connects; from then on the chunks it sends go
 *     as CHUNK_READ on stream 0, each with its key (rdma_send.c), and the
 *     chunks it receives are READ (rdma_recv.c).
 *   - A READ our NIC refused (a key revoked, never given, another
 *     session's, or past its chunk) puts our queue pair in the error
 *     state: its receive flushes and wakes us. Once every work request of
 *     ours on it is in, we decide what it meant: the peer read what it
 *     holds no key for, and its session is lost; or a key an abort revoked
 *     may have been in flight, or a work request of ours failed, and the
 *     session goes on with its chunks by the stream (the link is lost, not the
 *     session; its rooms keep every chunk).
 *   - A lost session: its queue pair to the error state, and it is
 *     quiesced once every work request it posted has completed (flushed)
 *     and every key it granted is dead; past the peer timeout the queue
 *     pair is destroyed instead.
 * A proxy without a device has no RDMA data path: the plane answers RDMA
 * frames by their type (peer/unowned.c), and chunks go by the stream.
 */
#include "datapath/rdma.h"

#include <endian.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/counters.h"
#include "base/numa.h"
#include "core/xport.h"
#include "base/log.h"
#include "layout.h"
#include "parse.h"
#include "peer/conn.h"
#include "peer/peer.h"

#define CQ_BATCH 32

#define PUB(f, v) __atomic_store_n(&(f), (v), __ATOMIC_RELAXED)

struct rsess *rs_of(struct rdma *r, const struct psess *s)
{
	struct rsess *rs = &r->rs[s->idx];
	if (rs->id != s->id) {
		struct rwin *win = rs->win; /* the array stays; a dead session's windows do not */
		for (uint16_t w = 0; w < rs->nwin; w++)
			kvsp_verbs_mw_free(win[w].mw);
		memset(rs, 0, sizeof(*rs));
		rs->win = win;
		rs->id = s->id;
		rs->q_head = rs->q_tail = rs->ack_head = rs->ack_tail = NONE;
		rs->held_head = rs->held_tail = NONE;
		rs->ready_head = rs->ready_tail = rs->keyed = NONE;
		rs->win_free = rs->win_last = WIN_NONE;
	}
	return rs;
}

struct psess *rs_session(struct rdma *r, const struct rsess *rs)
{
	return psess_up(r->dp.sessions, rs->id);
}

static uint32_t keys_flag(const struct rdma *r)
{
	uint32_t w = kvsp_verbs_keys_wire(&r->verbs);
	return KVS_PEER_RDMA | (w != KVSP_KEYS_WIRE_REGION ? KVS_PEER_KEYS_WINDOW : 0) |
	       (w != KVSP_KEYS_WIRE_WINDOW ? KVS_PEER_KEYS_REGION : 0);
}

/* ------------------------------------------------------------ lifetime */

static void rdma_destroy(struct kvsp_dp *dp)
{
	struct rdma *r = rdma_of(dp);
	for (unsigned i = 0; i < PSESS_MAX; i++)
		free(r->rs[i].win); /* sessions ended first: their windows are freed */
	if (r->verbs.ctx)
		kvsp_verbs_close(&r->verbs);
	free(r->rread);
	free(r->rsend);
	free(r);
}

struct rdma *rail_open(const struct kvsp_dp *base, const char *device, int gid_index,
		       enum kvsp_keys keys, unsigned idx, char *e, size_t elen, int *rc)
{
	uint32_t slots = kvsp_slot_count(base->p);
	struct rdma *r = calloc(1, sizeof(*r));
	if (!r) {
		snprintf(e, elen, "out of memory");
		*rc = -ENOMEM;
		return NULL;
	}
	r->dp = *base;
	r->dp.ops = &kvsp_rail_ops;
	r->rail = idx;
	*rc = kvsp_verbs_open(&r->verbs, device, gid_index, kvsp_slot_mem(base->p, 0),
			      (size_t)slots * kvsp_slot_size(base->p), PSESS_MAX * (SQ_DEPTH + 1),
			      keys, e, elen);
	if (*rc == 0) {
		r->rread = calloc(slots, sizeof(*r->rread));
		r->rsend = calloc(slots, sizeof(*r->rsend));
		if (!r->rread || !r->rsend) {
			snprintf(e, elen, "out of memory");
			*rc = -ENOMEM;
		}
	} else {
		memset(&r->verbs, 0, sizeof(r->verbs));
	}
	if (*rc < 0) {
		rdma_destroy(&r->dp);
		return NULL;
	}
	const char *because =
		r->verbs.keys == KVSP_KEYS_REGION
			? (keys == KVSP_KEYS_REGION ? "--rdma-keys regions"
						    : "the device has no type-2 memory windows")
		: r->verbs.window_confines == 1 ? "the device keeps a READ inside its window"
		: r->verbs.window_confines == 0
			? "the device does not keep a READ inside its "
			  "window, only inside the region under it: each "
			  "chunk gets a region of its own"
			: "whether the device keeps a READ inside its window could "
			  "not be tried: each "
			  "chunk gets a region of its own";
	char dev[128];
	snprintf(dev, sizeof(dev), "/sys/class/infiniband/%s/device", r->verbs.name);
	r->node = kvsp_numa_of_device(dev);
	LOG_INFO("rdma: rail %u: %s port %u, GID index %d%s: chunks by RDMA READ with peers that "
		 "have it, each under a key of its own: %s (%s)",
		 idx, r->verbs.name, r->verbs.port, r->verbs.gid_index,
		 r->node >= 0 ? ", on its NUMA node's slots first" : "",
		 kvsp_keys_wire_name(kvsp_verbs_keys_wire(&r->verbs)), because);
	return r;
}

void rail_link(struct rdma *r, struct rsess *rs, bool up)
{
	if (rs->up == up)
		return;
	rs->up = up;
	if (up)
		KVS_STAT_ADD(r->rail_ctr[RAIL_CTR_LINKS], 1);
	else
		KVS_STAT_SUB(r->rail_ctr[RAIL_CTR_LINKS], 1);
	rails_link(r->rails, rs->id, up);
}

/* rs's queue pair for s: made, its sentinel posted, its HELLO owed.
 * Returns 0, or -errno (the session's chunks go by the stream). */
static int link_make(struct rdma *r, struct rsess *rs, struct psess *s)
{
	rs->qp = kvsp_verbs_qp_new(&r->verbs, SQ_DEPTH, &rs->local);
	int rc = rs->qp ? kvsp_verbs_sentinel(rs->qp, wr_id(WR_SENTINEL, 0, s->id)) : -errno;
	if (rc < 0) {
		RLOG(r, KVSP_LOG_WARN, "rdma: peer %s: no queue pair (%s): chunks go by TCP",
		     s->ep.text, strerror(-rc));
		kvsp_verbs_qp_destroy(rs->qp);
		rs->qp = NULL;
		return rc;
	}
	rs->posted = 1; /* the sentinel: not work we wait on, so not in r->busy */
	rs->sentinel = true;
	rs->owe_hello = true;
	return 0;
}

/* Connects rs's queue pair to the peer's, whose HELLO is in rs->peer. */
static void link_connect(struct rdma *r, struct rsess *rs, struct psess *s)
{
	int rc = kvsp_verbs_qp_connect(&r->verbs, rs->qp, &rs->local, &rs->peer);
	if (rc < 0) {
		RLOG(r, KVSP_LOG_WARN,
		     "rdma: peer %s: cannot connect the queue pair (%s): chunks go "
		     "by TCP",
		     s->ep.text, strerror(-rc));
		rs_break(r, rs, RS_POST_FAILED); /* its sentinel flushes; then it is made again */
		return;
	}
	rail_link(r, rs, true);
	PUB(s->pub->flags, keys_flag(r));
	LOG_INFO(
		"rdma: peer %s: chunks by RDMA READ on rail %u (%s); ours under %s, its under %s%s",
		s->ep.text, r->rail, r->verbs.name,
		kvsp_keys_wire_name(kvsp_verbs_keys_wire(&r->verbs)),
		kvsp_keys_wire_name(rs->peer.keys), rs->relinks ? " (queue pair made again)" : "");
}

static void rdma_sess_up(struct kvsp_dp *dp, struct psess *s)
{
	struct rdma *r = rdma_of(dp);
	struct rsess *rs = rs_of(r, s);
	if (!rs->qp)
		link_make(r, rs, s);
}

static bool rdma_carries(const struct kvsp_dp *dp, const struct psess *s)
{
	const struct rsess *rs = &((const struct rdma *)dp)->rs[s->idx];
	return rs->id == s->id && rs_usable(rs);
}

static int rdma_send(struct kvsp_dp *dp, struct psess *s, struct kvsp_xfer *x,
		     const struct kvs_wire_room *room)
{
	return rsend_chunk(rdma_of(dp), s, x, room);
}

static void rdma_cancel(struct kvsp_dp *dp, uint32_t room, uint32_t gen)
{
	/* READs we posted for the room complete in their own time (our NIC
	 * may be writing): the fence discards them then. */
	rsend_cancel(rdma_of(dp), room, gen);
}

/* ------------------------------------------------------ control frames */

/* The peer's HELLO: its queue pair for this session, first, or made again
 * after one of ours or its failed (its last one died with it). */
static int on_hello(struct rdma *r, struct psess *s, const struct kvs_wire_rdma_hello *b)
{
	struct rsess *rs = rs_of(r, s);
	if (++rs->hellos > RELINKS_MAX + 1)
		return -EPROTO; /* a peer out of protocol: more queue pairs than we make */
	struct kvsp_verbs_ep p = {
		.qpn = le32toh(b->qpn),
		.psn = le32toh(b->psn),
		.pool_addr = le64toh(b->pool_addr),
		.pool_len = le64toh(b->pool_len),
		.keys = le32toh(b->keys),
		.mtu = le16toh(b->mtu),
	};
	memcpy(p.gid, b->gid, sizeof(p.gid));
	if (p.pool_addr + p.pool_len < p.pool_addr)
		return -EPROTO; /* a pool that wraps the address space names nothing */
	if (!rs->qp && !rs->broken) {
		KVS_STAT_ADD(r->dp.st->peer_frames_ignored, 1);
		if (rs->hellos == 1)
			LOG_INFO("rdma: peer %s offers RDMA; we have no queue pair for it: "
				 "chunks to it go by TCP",
				 s->ep.text);
		return 0;
	}
	rs->peer = p;
	if (!rs->heard && !rs->broken) {
		rs->heard = true;
		link_connect(r, rs, s);
		return 0;
	}
	/* A queue pair of the peer's made again: ours is done with (its
	 * queue pair, connected to the peer's last, is in error or goes to
	 * it now), and the next connects to this one. */
	rs->peer_pending = true;
	rs_break(r, rs, RS_PEER_RELINKED);
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
		return rrecv_on_read(r, s, &f->body.chunk_read);
	case KVS_WIRE_CHUNK_ACK:
		rsend_on_ack(r, s, &f->body.chunk_ack);
		return 0;
	}
	return -EPROTO;
}

/* Our HELLO, before the rooms' frames: a sender that hears our OPEN_ACK
 * has heard it, and READs the room's first chunks. */
static bool rdma_next_control(struct kvsp_dp *dp, struct psess *s, struct kvsp_dp_frame *out)
{
	struct rdma *r = rdma_of(dp);
	struct rsess *rs = &r->rs[s->idx];
	if (rs->id != s->id || !rs->owe_hello)
		return false;
	if (out) {
		rs->owe_hello = false;
		const struct kvsp_verbs_ep *e = &rs->local;
		out->type = KVS_WIRE_RDMA_HELLO;
		out->body.rdma_hello =
			(struct kvs_wire_rdma_hello){ .qpn = htole32(e->qpn),
						      .psn = htole32(e->psn),
						      .pool_addr = htole64(e->pool_addr),
						      .pool_len = htole64(e->pool_len),
						      .keys = htole32(e->keys),
						      .mtu = htole16((uint16_t)e->mtu),
						      .rail = (uint8_t)r->rail };
		memcpy(out->body.rdma_hello.gid, e->gid, sizeof(e->gid));
	}
	return true;
}

/* On stream 0, in order: the acks we owe (each lands its chunk as it is
 * sealed), then the chunks we send, within the window. */
static bool rdma_next_frame(struct kvsp_dp *dp, struct psess *s, struct pconn *c,
			    struct kvsp_dp_frame *out)
{
	struct rdma *r = rdma_of(dp);
	struct rsess *rs = &r->rs[s->idx];
	if (c->stream != 0 || rs->id != s->id)
		return false;
	return rrecv_next(r, rs, out) || rsend_next(r, rs, out);
}

/* ------------------------------------------------- a failed queue pair */

/* rs's failed queue pair is gone, the session lives: a new one, and a
 * HELLO for it; chunks go by the stream until both ends are connected again. */
static void relink(struct rdma *r, struct rsess *rs, struct psess *s)
{
	if (rs->relinks == RELINKS_MAX)
		return; /* RDMA stays off for this session */
	rs->relinks++;
	rs->gen++;
	rs->broken = rs->judged = rs->keys_dead = rs->heard = rs->revoked_early = false;
	rs->own_fault = 0;
	if (link_make(r, rs, s) < 0)
		return;
	if (rs->peer_pending) { /* its new queue pair's HELLO came first */
		rs->peer_pending = false;
		rs->heard = true;
		link_connect(r, rs, s);
	}
}

/* Every work request of ours on rs's failed queue pair is in: what it
 * meant, decided once. */
static void judge(struct rdma *r, struct rsess *rs)
{
	struct kvsp_dp *dp = &r->dp;
	struct psess *s = rs_session(r, rs);
	rs->judged = true;
	/* Refused with no key revoked early on this queue pair: the peer READ
	 * what it held no key for. (Its ack may have come before we saw the
	 * refusal: an early revocation counts for the queue pair's life.) */
	bool refused = !rs->own_fault,
	     forged = rs->own_fault == RS_PEER_SENT || (refused && !rs->revoked_early);
	if (refused) {
		KVS_STAT_ADD(dp->ctr[RDMA_CTR_READS_REFUSED], 1);
		if (s)
			PUB(s->pub->reads_refused, s->pub->reads_refused + 1);
	}
	/* Nothing reads through it any more: every key it held dies now, and
	 * the queue pair goes (nothing of ours is posted on it). */
	rsend_link_dead(r, rs, s, !forged && s);
	rrecv_drop_held(r, rs, forged || !s);
	kvsp_verbs_qp_destroy(rs->qp);
	rs->qp = NULL;
	if (!s)
		return;
	if (forged) {
		RLOG(r, KVSP_LOG_WARN, "rdma: peer %s: %s: session lost", s->ep.text,
		     rs->own_fault == RS_PEER_SENT
			     ? "it SENT on its queue pair (out of protocol)"
			     : "our NIC refused its READ: a key it does not hold (never sent, "
			       "acknowledged, "
			       "another room's or session's, or past its chunk)");
		psess_lost(dp->sessions, s, -EACCES);
		return;
	}
	KVS_STAT_ADD(dp->ctr[RDMA_CTR_LINKS_LOST], 1);
	KVS_STAT_ADD(r->rail_ctr[RAIL_CTR_LINKS_LOST], 1);
	PUB(s->pub->flags, 0);
	relink(r, rs, s);
	const char *why = rs->own_fault == RS_PEER_GAVE_UP    ? "it says it cannot READ from us"
			  : rs->own_fault == RS_PEER_RELINKED ? "it made its queue pair again"
			  : rs->own_fault == RS_POST_FAILED   ? "a work request could not be posted"
			  : rs->own_fault > 0 ? ibv_wc_status_str((enum ibv_wc_status)rs->own_fault)
					      : "our NIC refused its READ of a chunk whose key an "
						"abort revoked while the "
						"READ may have been on its way";
	RLOG(r, KVSP_LOG_WARN, "rdma: peer %s: %s: its chunks go by TCP %s", s->ep.text, why,
	     rs->qp ? "until the queue pairs are made again" : "for the rest of this session");
}

void rs_break(struct rdma *r, struct rsess *rs, int why)
{
	if (rs->lost)
		return; /* the session is being quiesced: its queue pair is in error already */
	if (why && !rs->own_fault)
		rs->own_fault = why;
	if (!rs->broken) {
		rs->broken = true;
		rail_link(r, rs, false);
		if (rs->qp)
			kvsp_verbs_qp_error(rs->qp); /* flushes what is posted; no READ is served */
	}
}

void rs_completed(struct rdma *r, struct rsess *rs, const struct ibv_wc *wc)
{
	bool sentinel = WR_KIND(wc->wr_id) == WR_SENTINEL;
	rs->posted--;
	if (sentinel)
		rs->sentinel = false;
	else
		r->busy--;
	if (wc->status == IBV_WC_SUCCESS && !sentinel)
		return;
	/* A failure of ours is ours to blame; a flush alone (the sentinel's
	 * first) means the device put the queue pair in error: it refused a
	 * peer's request. The sentinel consumed: the peer SENT to us. */
	rs_break(r, rs,
		 wc->status == IBV_WC_SUCCESS	     ? RS_PEER_SENT
		 : wc->status != IBV_WC_WR_FLUSH_ERR ? (int)wc->status
						     : 0);
}

/* ---------------------------------------------------------- completions */

static int rdma_poll(struct kvsp_dp *dp)
{
	struct rdma *r = rdma_of(dp);
	int busy = rrecv_release_held(r);
	struct ibv_wc wc[CQ_BATCH];
	int n = kvsp_verbs_poll(&r->verbs, wc, CQ_BATCH);
	if (n == 0 && !r->armed) {
		/* Quiet: the next completion wakes the loop (loop_fd). What
		 * came before the arm raised nothing: look once more. */
		r->armed = kvsp_verbs_arm(&r->verbs) == 0;
		n = kvsp_verbs_poll(&r->verbs, wc, CQ_BATCH);
	}
	for (int k = 0; k < n; k++) {
		uint32_t sid = WR_SESS(wc[k].wr_id), slot = WR_SLOT(wc[k].wr_id);
		struct rsess *rs = &r->rs[(sid & 0xff) % PSESS_MAX];
		if (rs->id != sid || !sid)
			continue; /* its session's queue pair was destroyed: the core released it */
		switch (WR_KIND(wc[k].wr_id)) {
		case WR_READ:
			rrecv_read_done(r, rs, slot, &wc[k]);
			break;
		case WR_BIND:
			rsend_bind_done(r, rs, slot, &wc[k]);
			break;
		case WR_INV:
			rsend_inv_done(r, rs, slot, &wc[k]);
			break;
		case WR_SENTINEL:
			rs_completed(r, rs, &wc[k]);
			break;
		}
		if (rs->broken && !rs->judged && rs->posted == 0)
			judge(r, rs);
	}
	return n > 0 ? KVSP_BUSY : busy;
}

static bool rdma_pending(const struct kvsp_dp *dp)
{
	const struct rdma *r = (const struct rdma *)dp;
	return r->busy > 0;
}

static int rdma_loop_fd(const struct kvsp_dp *dp)
{
	const struct rdma *r = (const struct rdma *)dp;
	return r->verbs.chan ? r->verbs.chan->fd : -1;
}

static void rdma_on_fd(struct kvsp_dp *dp)
{
	struct rdma *r = rdma_of(dp);
	kvsp_verbs_ack(&r->verbs);
	r->armed = false;
}

/* A CHUNK_READ whose key an abort revoked keeps its window place until the
 * peer acknowledges it; a peer that never does would stall the session's
 * READs for good. Past --peer-timeout it loses the session instead. */
static void rdma_tick(struct kvsp_dp *dp, uint64_t now, uint64_t timeout_ns)
{
	struct rdma *r = rdma_of(dp);
	for (unsigned i = 0; i < PSESS_MAX; i++) {
		struct rsess *rs = &r->rs[i];
		struct psess *s = rs->nrevoked && !rs->lost ? rs_session(r, rs) : NULL;
		if (!s)
			continue;
		uint64_t oldest = now;
		for (unsigned k = 0; k < rs->nrevoked; k++)
			if (rs->revoked[k].at_ns < oldest)
				oldest = rs->revoked[k].at_ns;
		if (now - oldest <= timeout_ns)
			continue;
		RLOG(r, KVSP_LOG_WARN,
		     "peer %s: %u CHUNK_READs of aborted rooms unacknowledged past --peer-timeout "
		     "(%llu ms): session lost",
		     s->ep.text, rs->nrevoked, (unsigned long long)(timeout_ns / 1000000));
		psess_lost(dp->sessions, s, -ETIMEDOUT);
	}
}

/* ------------------------------------------------------- a session's end */

static bool rdma_sess_quiesce(struct kvsp_dp *dp, struct psess *s)
{
	struct rdma *r = rdma_of(dp);
	struct rsess *rs = &r->rs[s->idx];
	if (rs->id != s->id)
		return false;
	rail_link(r, rs, false);
	if (!rs->lost) {
		rs->lost = true;
		rrecv_drop_held(r, rs, true); /* never posted: nothing of ours reads for them */
		if (rs->qp && !rs->broken)
			kvsp_verbs_qp_error(
				rs->qp); /* every work request posted completes, flushed */
	}
	if (rs->qp && rs->posted > 0)
		return true;
	/* Nothing of ours is posted: every key it granted dies before the
	 * core releases the pins. */
	rsend_link_dead(r, rs, NULL, false);
	return false;
}

static void rdma_sess_force(struct kvsp_dp *dp, struct psess *s)
{
	struct rdma *r = rdma_of(dp);
	struct rsess *rs = &r->rs[s->idx];
	if (rs->id != s->id || !rs->qp)
		return;
	/* A destroyed queue pair's work requests are dropped: the device
	 * touches nothing for them any more, and they never complete. Its
	 * windows go first (verbs.h). */
	rsend_link_dead(r, rs, NULL, false);
	kvsp_verbs_qp_destroy(rs->qp);
	rs->qp = NULL;
	r->busy -= rs->posted - rs->sentinel;
	rs->posted = 0;
	rs->sentinel = false;
	rs->out = 0;
}

static void rdma_sess_free(struct kvsp_dp *dp, struct psess *s)
{
	struct rdma *r = rdma_of(dp);
	struct rsess *rs = &r->rs[s->idx];
	if (rs->id != s->id)
		return;
	rail_link(r, rs, false);
	if (rs->qp)
		kvsp_verbs_qp_error(rs->qp);
	rsend_link_dead(r, rs, NULL, false); /* its windows before its queue pair (verbs.h) */
	kvsp_verbs_qp_destroy(rs->qp);
	r->busy -= rs->posted - rs->sentinel;
	for (uint32_t slot = rs->held_head; slot != NONE; slot = r->rread[slot].next)
		r->nheld--;
	struct rwin *win = rs->win;
	memset(rs, 0, sizeof(*rs));
	rs->win = win;
}

/* A rail behind the data path (rails.c), which reads the frames, names
 * the options, counters and failpoints, and asks each rail in turn. */
const struct kvsp_dp_ops kvsp_rail_ops = {
	.name = "rdma rail",
	.destroy = rdma_destroy,
	.sess_up = rdma_sess_up,
	.carries = rdma_carries,
	.send = rdma_send,
	.cancel = rdma_cancel,
	.on_frame = rdma_on_frame,
	.next_control = rdma_next_control,
	.next_frame = rdma_next_frame,
	.sess_quiesce = rdma_sess_quiesce,
	.sess_force = rdma_sess_force,
	.sess_free = rdma_sess_free,
	.tick = rdma_tick,
	.poll = rdma_poll,
	.pending = rdma_pending,
	.loop_fd = rdma_loop_fd,
	.on_fd = rdma_on_fd,
};
