/* SPDX-License-Identifier: MIT */
/*
 * The chunks we send by RDMA READ: each is read under a key of its own
 * (datapath/verbs.h), and its slot is ours again only once that key is
 * dead. One chunk's life, by our slot:
 *
 *   QUEUED --key--> BINDING --bound--> READY --CHUNK_READ sent--> ANNOUNCED
 *      (regions: registered, READY at once)                           |
 *                     ack, room aborted, or the peer says it cannot READ
 *                                                                     v
 *                   the transfer ends <--invalidated-- REVOKING <-----+
 *                     (regions: deregistered, at once)
 *
 * A key dies by its revocation completing (an invalidate's success, a
 * region's deregistration), or with its queue pair: a window is bound
 * through the peer's queue pair and serves nothing once that is in the
 * error state (and every window of a failed queue pair is freed, which
 * kills it for good); regions outlive queue pairs, so they are always
 * deregistered. Only then does the transfer end (kvsp_xfer_quiesced), or
 * go on by the stream when the peer never read it. The peer's word alone
 * never ends a transfer. While a session is lost, its chunks end in the
 * core (kvsp_peer_lost), never here: this side only kills their keys.
 */
#include <endian.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "core/xport.h"
#include "base/log.h"
#include "datapath/rdma.h"
#include "layout.h"

/* ------------------------------------------------------------ lists */

static void keyed_add(struct rdma *r, struct rsess *rs, uint32_t slot)
{
	struct rsend *e = &r->rsend[slot];
	if (rs->keyed == NONE) {
		e->kprev = e->knext = slot;
		rs->keyed = slot;
	} else {
		uint32_t head = rs->keyed, tail = r->rsend[head].kprev;
		e->kprev = tail;
		e->knext = head;
		r->rsend[tail].knext = slot;
		r->rsend[head].kprev = slot;
	}
	rs->nkeys++;
}

static void keyed_del(struct rdma *r, struct rsess *rs, uint32_t slot)
{
	struct rsend *e = &r->rsend[slot];
	if (e->knext == slot) {
		rs->keyed = NONE;
	} else {
		r->rsend[e->kprev].knext = e->knext;
		r->rsend[e->knext].kprev = e->kprev;
		if (rs->keyed == slot)
			rs->keyed = e->knext;
	}
	rs->nkeys--;
}

static void list_add(struct rdma *r, uint32_t *head, uint32_t *tail, uint32_t slot)
{
	r->rsend[slot].next = NONE;
	if (*tail != NONE)
		r->rsend[*tail].next = slot;
	else
		*head = slot;
	*tail = slot;
}

static uint32_t list_pop(struct rdma *r, uint32_t *head, uint32_t *tail)
{
	uint32_t slot = *head;
	*head = r->rsend[slot].next;
	if (*head == NONE)
		*tail = NONE;
	return slot;
}

static void list_del(struct rdma *r, uint32_t *head, uint32_t *tail, uint32_t slot)
{
	for (uint32_t *at = head, prev = NONE; *at != NONE; prev = *at, at = &r->rsend[*at].next)
		if (*at == slot) {
			*at = r->rsend[slot].next;
			if (*tail == slot)
				*tail = prev;
			return;
		}
}

/* ------------------------------------------------------------- windows */

/* A free window of rs's, made if it has fewer than KEYS_MAX. */
static uint16_t win_take(struct rdma *r, struct rsess *rs)
{
	if (rs->win_free != WIN_NONE) {
		uint16_t w = rs->win_free;
		rs->win_free = rs->win[w].next;
		if (rs->win_free == WIN_NONE)
			rs->win_last = WIN_NONE;
		return w;
	}
	if (rs->nwin == KEYS_MAX)
		return WIN_NONE;
	if (!rs->win && !(rs->win = calloc(KEYS_MAX, sizeof(*rs->win))))
		return WIN_NONE;
	struct ibv_mw *mw = kvsp_verbs_mw_new(&r->verbs);
	if (!mw)
		return WIN_NONE;
	rs->win[rs->nwin] = (struct rwin){ .mw = mw, .next = WIN_NONE };
	return rs->nwin++;
}

/* w's key was invalidated: it may be bound again, after the others. */
static void win_put(struct rsess *rs, uint16_t w)
{
	rs->win[w].next = WIN_NONE;
	if (rs->win_last != WIN_NONE)
		rs->win[rs->win_last].next = w;
	else
		rs->win_free = w;
	rs->win_last = w;
}

/* ----------------------------------------------------------- an end */

/* slot's key is dead (reuse: by its invalidate, so its window may be
 * bound again): its transfer ends as planned, or goes on by the stream. */
/* Deregisters a chunk's region, if it has one: its key is dead once this returns. */
static void region_drop(struct rdma *r, struct ibv_mr **mr)
{
	if (*mr) {
		kvsp_verbs_region_free(*mr);
		KVS_STAT_ADD(r->dp.ctr[RDMA_CTR_REGION_FREES], 1);
		*mr = NULL;
	}
}

static void finish(struct rdma *r, struct rsess *rs, uint32_t slot, bool reuse)
{
	struct rsend *e = &r->rsend[slot];
	struct kvs_wire_room room = e->room;
	uint8_t then = e->then;
	keyed_del(r, rs, slot);
	if (reuse)
		win_put(rs, e->win);
	region_drop(r, &e->region); /* under its window, which is invalidated: it goes too */
	e->state = S_NONE;
	if (rs->lost)
		return; /* the core ends the session's transfers (kvsp_peer_lost) */
	struct kvsp_xfer *x = kvsp_xfer_of(r->dp.p, slot);
	struct psess *s = then == T_RECARRY ? rs_session(r, rs) : NULL;
	int rc = then == T_ACKED       ? 0
		 : then == T_CANCELLED ? -ECANCELED
		 : s		       ? rails_elsewhere(r->rails, r, s, x, &room)
				       : -ECONNRESET;
	if (then != T_RECARRY || rc < 0)
		kvsp_xfer_quiesced(r->dp.p, x, rc);
	rsend_pump(r, rs);
}

/* Revokes slot's key: at once (a region's deregistration), or once its
 * invalidate completes, or with its queue pair (rsend_link_dead). */
static void revoke(struct rdma *r, struct rsess *rs, uint32_t slot)
{
	struct rsend *e = &r->rsend[slot];
	if (r->verbs.keys == KVSP_KEYS_REGION || rs->keys_dead || e->gen != (uint16_t)rs->gen) {
		region_drop(r, &e->region);
		finish(r, rs, slot, false);
		return;
	}
	e->state = S_REVOKING;
	if (rs->broken || rs->lost || !rs->qp)
		return; /* its queue pair is in the error state: the key dies with it */
	if (kvsp_verbs_invalidate(rs->qp, wr_id(WR_INV, slot, rs->id), e->rkey) < 0) {
		rs_break(r, rs, RS_POST_FAILED); /* the queue pair goes, and the key with it */
		return;
	}
	rs_posted(r, rs);
}

/* -------------------------------------------------------------- a key */

/* Grants queued slot its key. Returns 0, -EAGAIN (none free: it waits),
 * or -errno (it cannot have one). */
static int grant(struct rdma *r, struct rsess *rs, uint32_t slot)
{
	struct rsend *e = &r->rsend[slot];
	e->gen = (uint16_t)rs->gen;
	struct kvsp_xfer *x = kvsp_xfer_of(r->dp.p, slot);
	void *addr = kvsp_slot_mem(r->dp.p, slot);
	if (r->verbs.keys == KVSP_KEYS_REGION) {
		struct ibv_mr *mr = kvsp_verbs_region_new(&r->verbs, addr, x->len, false);
		if (!mr)
			return -(errno ? errno : ENOMEM);
		KVS_STAT_ADD(r->dp.ctr[RDMA_CTR_REGIONS], 1);
		e->region = mr;
		e->rkey = mr->rkey;
		e->state = S_READY;
		keyed_add(r, rs, slot);
		list_add(r, &rs->ready_head, &rs->ready_tail, slot);
		return 0;
	}
	uint16_t w = win_take(r, rs);
	if (w == WIN_NONE)
		return rs->nwin ? -EAGAIN : -(errno ? errno : ENOMEM);
	struct ibv_mr *under = NULL;
	if (r->verbs.window_on_region) {
		/* The device keeps a READ only inside a window's region: the
		 * chunk's own, registered for binding alone. */
		under = kvsp_verbs_region_new(&r->verbs, addr, x->len, true);
		if (!under) {
			int e2 = errno ? errno : ENOMEM;
			win_put(rs, w);
			return -e2;
		}
		KVS_STAT_ADD(r->dp.ctr[RDMA_CTR_REGIONS], 1);
	}
	uint32_t key = rs->win[w].mw->rkey; /* the next tag after it */
	int rc = kvsp_verbs_bind(&r->verbs, rs->qp, wr_id(WR_BIND, slot, rs->id), rs->win[w].mw,
				 under, addr, x->len, &key);
	if (rc < 0) {
		win_put(rs, w);
		region_drop(r, &under);
		return rc;
	}
	e->region = under;
	rs_posted(r, rs);
	KVS_STAT_ADD(r->dp.ctr[RDMA_CTR_BINDS], 1);
	e->win = w;
	e->rkey = key;
	e->state = S_BINDING;
	keyed_add(r, rs, slot);
	return 0;
}

int rsend_pump(struct rdma *r, struct rsess *rs)
{
	int busy = KVSP_IDLE;
	while (rs->q_head != NONE && rs_usable(rs) && rs->nkeys < KEYS_MAX) {
		uint32_t slot = list_pop(r, &rs->q_head, &rs->q_tail);
		int rc = grant(r, rs, slot);
		if (rc == -EAGAIN) {
			r->rsend[slot].next = rs->q_head; /* back in front: it waits for a key */
			rs->q_head = slot;
			if (rs->q_tail == NONE)
				rs->q_tail = slot;
			break;
		}
		busy = KVSP_BUSY;
		if (rc == 0)
			continue;
		/* No key for it (the device is out of windows or regions): this
		 * chunk goes by the stream. */
		struct rsend *e = &r->rsend[slot];
		struct psess *s = rs_session(r, rs);
		struct kvs_wire_room room = e->room;
		e->state = S_NONE;
		RLOG(r, KVSP_LOG_WARN, "rdma: no key for a chunk (%s): it goes by TCP",
		     strerror(-rc));
		rc = s ? rails_elsewhere(r->rails, r, s, kvsp_xfer_of(r->dp.p, slot), &room)
		       : -ECONNRESET;
		if (rc < 0)
			kvsp_xfer_quiesced(r->dp.p, kvsp_xfer_of(r->dp.p, slot), rc);
	}
	return busy;
}

int rsend_chunk(struct rdma *r, struct psess *s, struct kvsp_xfer *x,
		const struct kvs_wire_room *room)
{
	struct rsess *rs = rs_of(r, s);
	struct rsend *e = &r->rsend[x->slot];
	*e = (struct rsend){ .room = *room,
			     .sess = s->id,
			     .state = S_QUEUED,
			     .then = T_ACKED,
			     .kprev = NONE,
			     .knext = NONE };
	list_add(r, &rs->q_head, &rs->q_tail, x->slot);
	rsend_pump(r, rs);
	return 0;
}

void rsend_bind_done(struct rdma *r, struct rsess *rs, uint32_t slot, const struct ibv_wc *wc)
{
	rs_completed(r, rs, wc);
	struct rsend *e = &r->rsend[slot];
	if (e->state != S_BINDING || e->sess != rs->id)
		return;
	if (wc->status != IBV_WC_SUCCESS)
		return; /* its queue pair failed: rsend_link_dead ends it */
	if (e->then == T_CANCELLED) {
		revoke(r, rs, slot); /* its room aborted while it was being bound */
		return;
	}
	e->state = S_READY;
	list_add(r, &rs->ready_head, &rs->ready_tail, slot);
}

void rsend_inv_done(struct rdma *r, struct rsess *rs, uint32_t slot, const struct ibv_wc *wc)
{
	rs_completed(r, rs, wc);
	struct rsend *e = &r->rsend[slot];
	if (e->state != S_REVOKING || e->sess != rs->id)
		return;
	/* Success: the key is dead, and its window free. Anything else: its
	 * queue pair is in the error state, and the key dies with it
	 * (rsend_link_dead, once every work request is in). */
	if (wc->status == IBV_WC_SUCCESS) {
		KVS_STAT_ADD(r->dp.ctr[RDMA_CTR_INVALIDATES], 1);
		finish(r, rs, slot, true);
	}
}

/* --------------------------------------------------------- CHUNK_READ */

bool rsend_next(struct rdma *r, struct rsess *rs, struct kvsp_dp_frame *out)
{
	if (rs->ready_head == NONE || !rs_usable(rs) || rs->unacked >= WINDOW)
		return false; /* nothing keyed, or the window waits for an ack */
	if (!out)
		return true;
	uint32_t slot = list_pop(r, &rs->ready_head, &rs->ready_tail);
	struct rsend *e = &r->rsend[slot];
	struct kvsp_xfer *x = kvsp_xfer_of(r->dp.p, slot);
	e->state = S_ANNOUNCED;
	rs->unacked++;
	out->type = KVS_WIRE_CHUNK_READ;
	out->body.chunk_read = (struct kvs_wire_chunk_read){
		.room = e->room,
		.chunk = htole32(x->chunk),
		.len = htole32(x->len),
		.xfer_ref = htole64((uint64_t)x->epoch << 32 | x->slot),
		.offset = htole64((uint64_t)x->slot * kvsp_slot_size(r->dp.p)),
		.rkey = htole32(e->rkey),
		.rail = htole32(r->rail),
	};
	KVS_STAT_ADD(r->rail_ctr[RAIL_CTR_SENT], 1);
	KVS_STAT_ADD(r->rail_ctr[RAIL_CTR_SENT_BYTES], x->len);
	return true;
}

bool rsend_forget_revoked(struct rsess *rs, uint64_t ref)
{
	for (unsigned i = 0; i < rs->nrevoked; i++)
		if (rs->revoked[i].ref == ref) {
			rs->revoked[i] = rs->revoked[--rs->nrevoked];
			return true;
		}
	return false;
}

/* The receiver is done with our slot for this transfer: it READ it, or
 * refused to. Its key is revoked; the transfer ends once it is dead. */
void rsend_on_ack(struct rdma *r, struct psess *s, const struct kvs_wire_chunk_ack *b)
{
	struct kvsp_dp *dp = &r->dp;
	struct rsess *rs = rs_of(r, s);
	uint64_t ref = le64toh(b->xfer_ref);
	uint32_t slot = (uint32_t)ref, epoch = (uint32_t)(ref >> 32);
	if (rsend_forget_revoked(rs, ref)) {
		rs->unacked--; /* an abort revoked it first: its window place is free again */
		return;
	}
	struct rsend *e = r->rsend && slot < kvsp_slot_count(dp->p) ? &r->rsend[slot] : NULL;
	struct kvsp_xfer *x = e ? kvsp_xfer_of(dp->p, slot) : NULL;
	if (!e || e->state != S_ANNOUNCED || e->sess != s->id || x->dir != KVSP_XFER_SEND ||
	    x->xport != dp->t->idx || x->peer != s->id || x->epoch != epoch) {
		KVS_STAT_ADD(dp->st->peer_frames_ignored, 1);
		return;
	}
	rs->unacked--;
	int status = (int32_t)le32toh((uint32_t)b->status);
	bool now = e->gen == (uint16_t)rs->gen; /* announced on the queue pair we have */
	e->then = status == -EOPNOTSUPP ? T_RECARRY : T_ACKED;
	revoke(r, rs, slot);
	if (status == -EOPNOTSUPP && now && rs_usable(rs)) {
		/* The peer cannot READ (from) us after all: ours goes to the
		 * error state too, every key dies, and its chunks go by the stream. */
		rs_break(r, rs, RS_PEER_GAVE_UP);
	}
}

/* ---------------------------------------------------------------- abort */

static bool of_room(struct rdma *r, uint32_t slot, uint32_t room, uint32_t gen)
{
	struct kvsp_xfer *x = kvsp_xfer_of(r->dp.p, slot);
	return x->room == room && x->room_gen == gen;
}

void rsend_cancel(struct rdma *r, uint32_t room, uint32_t gen)
{
	if (!r->rsend)
		return;
	for (unsigned i = 0; i < PSESS_MAX; i++) {
		struct rsess *rs = &r->rs[i];
		if (!rs->id)
			continue; /* no session's */
		/* Not keyed yet: never leaves its slot (a lost session's queue is its link's to settle). */
		for (uint32_t slot = rs->lost ? NONE : rs->q_head, next; slot != NONE;
		     slot = next) {
			next = r->rsend[slot].next;
			if (!of_room(r, slot, room, gen))
				continue;
			list_del(r, &rs->q_head, &rs->q_tail, slot);
			r->rsend[slot].state = S_NONE;
			kvsp_xfer_quiesced(r->dp.p, kvsp_xfer_of(r->dp.p, slot), -ECANCELED);
		}
		/* Keyed: the key is revoked now, whatever the peer is doing. */
		uint32_t n = rs->nkeys, slot = rs->keyed;
		for (uint32_t k = 0; k < n; k++) {
			struct rsend *e = &r->rsend[slot];
			uint32_t next = e->knext;
			if (of_room(r, slot, room, gen)) {
				struct kvsp_xfer *x = kvsp_xfer_of(r->dp.p, slot);
				switch (e->state) {
				case S_BINDING:
					e->then = T_CANCELLED; /* revoked once bound */
					break;
				case S_READY:
					list_del(r, &rs->ready_head, &rs->ready_tail, slot);
					e->then = T_CANCELLED;
					revoke(r, rs, slot);
					break;
				case S_ANNOUNCED:
					/* Its ack frees its window place, and is owed
					 * within --peer-timeout (rdma_tick). Each entry
					 * is an unacknowledged READ: never more than
					 * WINDOW of them. */
					rs->revoked[rs->nrevoked].ref = (uint64_t)x->epoch << 32 |
									slot;
					rs->revoked[rs->nrevoked++].at_ns = kvsp_xport_now(r->dp.p);
					rs->revoked_early |= e->gen == (uint16_t)rs->gen;
					e->then = T_CANCELLED;
					revoke(r, rs, slot);
					break;
				case S_REVOKING:
					if (e->then == T_RECARRY)
						e->then = T_CANCELLED;
					break;
				}
			}
			slot = next;
		}
	}
}

/* ------------------------------------------------------ a dead queue pair */

void rsend_link_dead(struct rdma *r, struct rsess *rs, struct psess *s, bool link_lost)
{
	if (!r->rsend)
		return;
	/* Every key of rs dies: windows freed first (a freed window honours
	 * no key, and a region is freed only once no window is bound over
	 * it), then regions deregistered. */
	for (uint16_t w = 0; w < rs->nwin; w++)
		kvsp_verbs_mw_free(rs->win[w].mw);
	rs->nwin = 0;
	rs->win_free = rs->win_last = WIN_NONE;
	uint32_t n = rs->nkeys, slot = rs->keyed;
	for (uint32_t k = 0; k < n; k++, slot = r->rsend[slot].knext) {
		struct rsend *e = &r->rsend[slot];
		region_drop(r, &e->region);
	}
	rs->keys_dead = true;
	if (!link_lost) {
		/* The session is lost or ended: the core ends its transfers. */
		n = rs->nkeys;
		slot = rs->keyed;
		for (uint32_t k = 0; k < n; k++, slot = r->rsend[slot].knext)
			r->rsend[slot].state = S_NONE;
		for (slot = rs->q_head; slot != NONE; slot = r->rsend[slot].next)
			r->rsend[slot].state = S_NONE;
		rs->keyed = rs->q_head = rs->q_tail = rs->ready_head = rs->ready_tail = NONE;
		rs->nkeys = 0;
		return;
	}
	/* The session goes on without RDMA: what never reached the peer goes
	 * by the stream; what it was sent ends at its ack (its key is dead). */
	rs->ready_head = rs->ready_tail = NONE;
	n = rs->nkeys;
	slot = rs->keyed;
	for (uint32_t k = 0; k < n; k++) {
		struct rsend *e = &r->rsend[slot];
		uint32_t next = e->knext;
		if (e->state != S_ANNOUNCED) {
			if (e->then == T_ACKED && e->state != S_REVOKING)
				e->then = T_RECARRY; /* bound or ready: never announced */
			finish(r, rs, slot, false);
		}
		slot = next;
	}
	while (rs->q_head != NONE) {
		uint32_t q = list_pop(r, &rs->q_head, &rs->q_tail);
		struct kvs_wire_room room = r->rsend[q].room;
		r->rsend[q].state = S_NONE;
		struct kvsp_xfer *x = kvsp_xfer_of(r->dp.p, q);
		int rc = rails_elsewhere(r->rails, r, s, x, &room);
		if (rc < 0)
			kvsp_xfer_quiesced(r->dp.p, x, rc);
	}
}
