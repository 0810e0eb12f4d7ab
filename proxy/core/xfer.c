/* SPDX-License-Identifier: MIT */
/*
 * Transfers: the record behind every pin, the two phases of completion
 * (the sending side's quiescence, the receiving side's land or discard),
 * the fence, and what transports report about peers. What a transport may
 * call is in xport.h; this file is its other side.
 */
#include <endian.h>
#include <errno.h>
#include <string.h>
#include <sys/epoll.h>

#include "base/log.h"
#include "base/loop_fd.h"
#include "core/proxy.h"
#include "core/rooms.h"
#include "core/xport.h"

#define NONE KVSP_NONE

static void xfer_end(struct kvsp_xfer *x)
{
	memset(x, 0, sizeof(*x));
}

static bool claimed(const struct kvsp_room *r, uint32_t chunk)
{
	return r->claimed_bits[chunk / 64] & (1ull << (chunk % 64));
}

static void claim(struct kvsp_room *r, uint32_t chunk)
{
	r->claimed_bits[chunk / 64] |= 1ull << (chunk % 64);
}

/* The slot now holds chunk of room i. */
static void slot_names(struct kvsp *p, uint32_t slot, uint32_t i, uint32_t chunk)
{
	struct kvsp_slot_priv *sp = &p->slots.priv[slot];
	sp->room = i;
	sp->chunk = chunk;
	__atomic_store_n(&p->slots.pub[slot].room, i + 1, __ATOMIC_RELAXED);
}

/* ... and is on the half's list at head. */
static void slot_to_room(struct kvsp *p, uint32_t slot, uint32_t i, uint32_t chunk, uint32_t *head)
{
	slot_names(p, slot, i, chunk);
	kvsp_slist_push(p, head, slot);
}

static void count_moved(struct kvsp *p, uint64_t len)
{
	KVS_STAT_ADD(p->stats->chunks_moved, 1);
	KVS_STAT_ADD(p->stats->bytes_moved, len);
}

/* A landed chunk of len bytes: on the receiver's list; the room completes
 * with its last (before it, room_settle has nothing to do: not marked). */
static void placed(struct kvsp *p, uint32_t i, uint32_t slot, uint32_t chunk, uint32_t len)
{
	struct kvsp_room *r = &p->rooms[i];
	kvsp_slist_push(p, &r->recv.placed_head, slot);
	count_moved(p, len);
	if (chunk == 0)
		r->recv.chunk0 = slot;
	kvsp_room_touch(p, i);
	if (++r->recv.placed == r->nchunks)
		kvsp_room_mark(p, i);
}

/* The fence let a sent chunk through: its slot is the receiver's now. */
static void land(struct kvsp *p, uint32_t i, uint32_t slot, uint32_t chunk, uint32_t len,
		 uint64_t sent_ns)
{
	kvsp_slot_handoff(&p->slots, slot, p->rooms[i].recv.client.cid);
	kvsp_hist_add(&p->chunk_hist, p->now_ns - sent_ns);
	placed(p, i, slot, chunk, len);
}

/* ------------------------------------------------------- sending side */

/* A transport that lands every chunk at its submit (the local one): the
 * transfer record, the in-flight list and the call through the ops table
 * would be written and undone within this call, a fifth of a small
 * chunk's path. The slot goes the same way (LEASED, INFLIGHT with a pin,
 * RECV_FILLED) behind the same fence: kvsp_room_send found the room open
 * and the lease valid in this pass, and the receiver is attached. */
static void land_at_submit(struct kvsp *p, uint32_t owner, uint32_t i, const struct kvs_lease *l,
			   uint32_t chunk)
{
	struct kvsp_room *r = &p->rooms[i];
	kvsp_slot_pin(&p->slots, owner, l);
	slot_names(p, l->slot, i, chunk);
	claim(r, chunk);
	kvsp_slot_unpin(&p->slots, l->slot);
	land(p, i, l->slot, chunk, (uint32_t)kvsp_chunk_len(p, r, chunk), p->now_ns);
	/* The chunk's one trace point, last: queued, sent and landed at once. */
	if (__builtin_expect(p->trace != NULL, 0))
		kvsp_rtrace_submitted(p, i, chunk);
}

/* The general path: a transfer record, and the chunk given to the
 * transport. Apart, so that the hand-off's path is compiled for itself. */
static __attribute__((noinline)) void xfer_submit(struct kvsp *p, uint32_t owner, uint32_t i,
						  const struct kvs_lease *l, uint32_t chunk)
{
	struct kvsp_room *r = &p->rooms[i];
	struct kvsp_transport *t = r->xport;
	if (p->trace)
		kvsp_rtrace_queued(p, i, chunk);
	kvsp_slot_pin(&p->slots, owner, l);
	slot_to_room(p, l->slot, i, chunk, &r->send.inflight_head);
	r->send.inflight++;
	claim(r, chunk);
	kvsp_room_touch(p, i);
	struct kvsp_xfer *x = &p->xfers[l->slot];
	*x = (struct kvsp_xfer){ .slot = l->slot,
				 .epoch = l->epoch,
				 .room = i,
				 .room_gen = r->gen,
				 .chunk = chunk,
				 .len = (uint32_t)kvsp_chunk_len(p, r, chunk),
				 .dir = KVSP_XFER_SEND,
				 .xport = t->idx,
				 .peer = r->peer,
				 .sent_ns = p->now_ns };
	int rc = t->ops->submit(t, x);
	if (rc < 0)
		kvsp_xfer_quiesced(p, x, rc); /* refused before touching: fail the room */
}

void kvsp_xfer_send(struct kvsp *p, uint32_t owner, uint32_t i, const struct kvs_lease *l,
		    uint32_t chunk)
{
	const struct kvsp_room *r = &p->rooms[i];
	if (r->xport->lands_at_submit && r->recv.client.cid)
		land_at_submit(p, owner, i, l, chunk);
	else
		xfer_submit(p, owner, i, l, chunk);
}

/* The sending phase, common to both ends of a send: the transport is done
 * with the slot. Returns the slot's state after the unpin (a tombstone's
 * last pin frees it). */
static int send_quiesce(struct kvsp *p, struct kvsp_xfer *x)
{
	struct kvsp_room *r = &p->rooms[x->room];
	kvsp_slist_del(p, &r->send.inflight_head, x->slot);
	r->send.inflight--;
	/* room_settle's rule reads the send half only once the room is over,
	 * or for a far receiver with nothing left in flight: a local open
	 * room ends with its last landing (placed), not here. */
	if (r->state != KVSP_ROOM_OPEN || (r->far && !r->send.inflight))
		kvsp_room_mark(p, x->room);
	int st = kvsp_slot_unpin(&p->slots, x->slot);
	xfer_end(x);
	return st;
}

void kvsp_xfer_quiesced(struct kvsp *p, struct kvsp_xfer *x, int status)
{
	if (x->dir != KVSP_XFER_SEND)
		return;
	uint32_t i = x->room, slot = x->slot, len = x->len, x_chunk = x->chunk;
	uint64_t sent_ns = x->sent_ns;
	struct kvsp_room *r = &p->rooms[i];
	if (send_quiesce(p, x) == KVS_SLOT_INFLIGHT)
		/* Still the room's (not aborted): its bytes left, or never
		 * will; either way the slot is done with. */
		kvsp_slot_kill(&p->slots, slot);
	if (status) {
		if (p->trace)
			kvsp_rtrace_flight(p, i);
		kvsp_room_abort(p, i, status, KVS_EV_FAILED, false);
	} else if (r->state == KVSP_ROOM_OPEN && r->far) { /* local rooms count their landings */
		count_moved(p, len);
		kvsp_hist_add(&p->chunk_hist, p->now_ns - sent_ns);
		if (p->trace)
			kvsp_rtrace_sent(p, i, x_chunk);
	}
}

void kvsp_xfer_handoff(struct kvsp *p, struct kvsp_xfer *x, int status)
{
	if (x->dir != KVSP_XFER_SEND)
		return;
	uint32_t i = x->room, gen = x->room_gen, slot = x->slot, epoch = x->epoch, chunk = x->chunk;
	uint32_t len = x->len;
	uint64_t sent_ns = x->sent_ns;
	struct kvsp_room *r = &p->rooms[i];
	int st = send_quiesce(p, x);
	/* The fence (invariant 5), the receiving phase: the chunk lands only
	 * if the slot is still in flight for this room, at the epoch it was
	 * captured with, and the room is the same generation and still open. */
	bool lands = status == 0 && st == KVS_SLOT_INFLIGHT && p->slots.pub[slot].epoch == epoch &&
		     r->gen == gen && r->state == KVSP_ROOM_OPEN && r->recv.client.cid;
	if (lands) {
		land(p, i, slot, chunk, len, sent_ns);
		if (p->trace)
			kvsp_rtrace_handed(p, i, chunk);
	} else if (st == KVS_SLOT_INFLIGHT) {
		/* Not tombstoned, yet not landing: the transport failed it. */
		kvsp_slot_kill(&p->slots, slot);
		if (p->trace)
			kvsp_rtrace_flight(p, i);
		kvsp_room_abort(p, i, status ? status : -EIO, KVS_EV_FAILED, false);
	} else {
		KVS_STAT_ADD(p->stats->chunks_discarded, 1); /* a tombstone, reaped */
	}
}

/* ----------------------------------------------------- receiving side */

int kvsp_room_find(struct kvsp *p, const struct kvsp_room_name *name)
{
	uint32_t i = name->room;
	if (i >= p->cfg.max_rooms)
		return -ESTALE;
	struct kvsp_room *r = &p->rooms[i];
	if (r->state == KVSP_ROOM_FREE || r->gen != name->gen)
		return -ESTALE;
	if (!kvsp_token_eq(r->token, name->token)) {
		KVS_STAT_ADD(p->stats->rej_token, 1);
		return -EPERM;
	}
	if (r->state != KVSP_ROOM_OPEN)
		return -ECANCELED;
	return (int)i;
}

int kvsp_room_attach_peer(struct kvsp *p, struct kvsp_transport *t, uint32_t peer,
			  const struct kvsp_room_name *name, uint64_t bytes, uint64_t slot_size)
{
	int i = kvsp_room_find(p, name);
	if (i < 0)
		return i;
	struct kvsp_room *r = &p->rooms[i];
	if (r->far || r->send.client.cid)
		return -EBUSY;
	if (bytes != r->bytes || slot_size != p->cfg.slot_size)
		return -EINVAL;
	r->far = KVSP_FAR_SEND;
	r->far_live = true;
	r->peer = peer;
	r->xport = t;
	kvsp_room_touch(p, (uint32_t)i);
	return 0;
}

/* Room (i, gen) with its sender on peer, through t; NULL if not that. */
static struct kvsp_room *carried(struct kvsp *p, struct kvsp_transport *t, uint32_t peer,
				 uint32_t i, uint32_t gen)
{
	if (i >= p->cfg.max_rooms)
		return NULL;
	struct kvsp_room *r = &p->rooms[i];
	if (r->state == KVSP_ROOM_FREE || r->gen != gen || !r->far || r->xport != t ||
	    r->peer != peer)
		return NULL;
	return r;
}

int kvsp_chunk_post(struct kvsp *p, struct kvsp_transport *t, uint32_t peer, uint32_t i,
		    uint32_t gen, uint32_t chunk, uint32_t len, struct kvsp_xfer **xp, void **dst)
{
	struct kvsp_room *r = carried(p, t, peer, i, gen);
	if (!r || r->far != KVSP_FAR_SEND)
		return -ESTALE;
	if (r->state != KVSP_ROOM_OPEN)
		return -ECANCELED;
	if (chunk >= r->nchunks || len != kvsp_chunk_len(p, r, chunk))
		return -EINVAL;
	if (claimed(r, chunk))
		return -EEXIST;
	uint32_t slot;
	/* On the receiving client's node, which reads it. */
	if (kvsp_slot_post(&p->slots, r->recv.client.cid, r->recv.client.part, &slot) < 0) {
		/* No slot to land in: the room cannot complete. */
		KVS_STAT_ADD(p->stats->rej_nobufs, 1);
		kvsp_room_abort(p, i, -ENOBUFS, KVS_EV_FAILED, false);
		return -ENOBUFS;
	}
	slot_to_room(p, slot, i, chunk, &r->recv.posted_head);
	r->recv.posted++;
	claim(r, chunk);
	kvsp_room_touch(p, i);
	struct kvsp_xfer *x = &p->xfers[slot];
	*x = (struct kvsp_xfer){ .slot = slot,
				 .epoch = p->slots.pub[slot].epoch,
				 .room = i,
				 .room_gen = gen,
				 .chunk = chunk,
				 .len = len,
				 .dir = KVSP_XFER_RECV,
				 .xport = t->idx,
				 .peer = peer };
	*xp = x;
	*dst = p->pool + (size_t)slot * p->cfg.slot_size;
	return 0;
}

/* The receiving phase's first half: the writer is done with the slot. */
static int recv_quiesce(struct kvsp *p, struct kvsp_xfer *x)
{
	struct kvsp_room *r = &p->rooms[x->room];
	kvsp_slist_del(p, &r->recv.posted_head, x->slot);
	r->recv.posted--;
	kvsp_room_mark(p, x->room);
	int st = kvsp_slot_unpin(&p->slots, x->slot);
	xfer_end(x);
	return st;
}

int kvsp_chunk_land(struct kvsp *p, struct kvsp_xfer *x)
{
	if (x->dir != KVSP_XFER_RECV)
		return -EINVAL;
	uint32_t i = x->room, gen = x->room_gen, slot = x->slot, epoch = x->epoch, chunk = x->chunk;
	uint32_t len = x->len;
	struct kvsp_room *r = &p->rooms[i];
	int st = recv_quiesce(p, x);
	/* The fence (invariant 5): the slot is still posted for this room at
	 * the epoch it was posted with (an abort made it a tombstone, and the
	 * unpin just reaped it), and the room is that generation, open. */
	if (st == KVS_SLOT_RECV_POSTED && p->slots.pub[slot].epoch == epoch && r->gen == gen &&
	    r->state == KVSP_ROOM_OPEN) {
		kvsp_slot_fill(&p->slots, slot);
		placed(p, i, slot, chunk, len);
		if (p->trace)
			kvsp_rtrace_landed(p, i, chunk);
		return 0;
	}
	if (st == KVS_SLOT_RECV_POSTED)
		kvsp_slot_kill(&p->slots, slot);
	KVS_STAT_ADD(p->stats->chunks_discarded, 1);
	return -ECANCELED;
}

void kvsp_chunk_discard(struct kvsp *p, struct kvsp_xfer *x, int status)
{
	if (x->dir != KVSP_XFER_RECV)
		return;
	uint32_t i = x->room, slot = x->slot;
	if (recv_quiesce(p, x) == KVS_SLOT_RECV_POSTED)
		kvsp_slot_kill(&p->slots, slot);
	KVS_STAT_ADD(p->stats->chunks_discarded, 1);
	if (p->trace)
		kvsp_rtrace_flight(p, i);
	kvsp_room_abort(p, i, status ? status : -EIO, KVS_EV_FAILED, false);
}

bool kvsp_chunk_unpost(struct kvsp *p, struct kvsp_xfer *x)
{
	if (x->dir != KVSP_XFER_RECV)
		return false;
	uint32_t i = x->room, gen = x->room_gen, slot = x->slot, chunk = x->chunk;
	struct kvsp_room *r = &p->rooms[i];
	if (recv_quiesce(p, x) == KVS_SLOT_RECV_POSTED)
		kvsp_slot_kill(&p->slots, slot);
	if (r->gen != gen || r->state != KVSP_ROOM_OPEN) {
		KVS_STAT_ADD(p->stats->chunks_discarded, 1);
		return false;
	}
	r->claimed_bits[chunk / 64] &= ~(1ull << (chunk % 64));
	return true;
}

void kvsp_chunk_sunk(struct kvsp *p)
{
	KVS_STAT_ADD(p->stats->chunks_discarded, 1);
}

/* -------------------------------------------------- what peers report */

int kvsp_room_peer_abort(struct kvsp *p, struct kvsp_transport *t, uint32_t peer, uint32_t i,
			 uint32_t gen, int status)
{
	struct kvsp_room *r = carried(p, t, peer, i, gen);
	if (!r)
		return -ESTALE;
	if (r->state == KVSP_ROOM_ENDED)
		return -EALREADY; /* quiescent here: the peer may hear ENDED at once */
	kvsp_room_abort(p, i, status, KVS_EV_ABORTED, true);
	return 0;
}

void kvsp_room_peer_ended(struct kvsp *p, struct kvsp_transport *t, uint32_t peer, uint32_t i,
			  uint32_t gen)
{
	struct kvsp_room *r = carried(p, t, peer, i, gen);
	if (!r)
		return;
	/* Ended without telling us it aborted: it did. */
	kvsp_room_abort(p, i, -ECONNABORTED, KVS_EV_ABORTED, true);
	r->far_live = false;
	kvsp_room_mark(p, i);
}

void kvsp_room_peer_refused(struct kvsp *p, struct kvsp_transport *t, uint32_t peer, uint32_t i,
			    uint32_t gen, int status)
{
	struct kvsp_room *r = carried(p, t, peer, i, gen);
	if (!r || r->far != KVSP_FAR_RECV)
		return;
	/* -ECANCELED: the receiving room was aborted there before our OPEN
	 * arrived. Locally the sender hears ABORTED for an abort after its
	 * send_open; so it does here. */
	kvsp_room_abort(p, i, status, status == -ECANCELED ? KVS_EV_ABORTED : KVS_EV_FAILED, true);
	r->far_live = false;
	kvsp_room_mark(p, i);
}

void kvsp_room_peer_done(struct kvsp *p, struct kvsp_transport *t, uint32_t peer, uint32_t i,
			 uint32_t gen)
{
	struct kvsp_room *r = carried(p, t, peer, i, gen);
	if (!r || r->far != KVSP_FAR_RECV)
		return;
	r->far_live = false;
	r->far_done = r->state == KVSP_ROOM_OPEN;
	kvsp_room_mark(p, i);
}

void kvsp_peer_lost(struct kvsp *p, struct kvsp_transport *t, uint32_t peer, int status)
{
	/* Its pins first: nothing can reach or leave those slots any more. */
	for (uint32_t s = 0; s < p->cfg.slot_count; s++) {
		struct kvsp_xfer *x = &p->xfers[s];
		if (!x->dir || x->xport != t->idx || x->peer != peer)
			continue;
		if (x->dir == KVSP_XFER_SEND)
			kvsp_xfer_quiesced(p, x, status);
		else
			kvsp_chunk_discard(p, x, status);
	}
	for (uint32_t i = 0; i < p->cfg.max_rooms; i++) {
		struct kvsp_room *r = &p->rooms[i];
		if ((r->state != KVSP_ROOM_OPEN && r->state != KVSP_ROOM_ABORTING) || !r->far ||
		    r->xport != t || r->peer != peer)
			continue;
		kvsp_room_abort(p, i, status, KVS_EV_FAILED, true);
		r->far_live = false;
		kvsp_room_mark(p, i);
	}
}

/* ------------------------------------------------- what transports use */

int kvsp_xport_register(struct kvsp *p, struct kvsp_transport *t)
{
	if (p->nxports == KVSP_MAX_XPORTS)
		return -ENOSPC;
	t->idx = (uint8_t)p->nxports;
	if (t->ops->loop_fd) {
		int rc = kvsp_xport_fd_add(p, t, t->ops->loop_fd(t), EPOLLIN, 0);
		if (rc < 0)
			return rc;
	}
	p->xports[p->nxports++] = t;
	return 0;
}

int kvsp_slot_node(const struct kvsp *p, uint32_t slot)
{
	return p->nnodes > 1 ? (int)p->node_ids[kvsp_slot_part(&p->slots, slot)] : -1;
}

struct kvsp_xfer *kvsp_xfer_of(struct kvsp *p, uint32_t slot)
{
	return &p->xfers[slot];
}

void *kvsp_slot_mem(struct kvsp *p, uint32_t slot)
{
	return p->pool + (size_t)slot * p->cfg.slot_size;
}

uint64_t kvsp_slot_size(const struct kvsp *p)
{
	return p->cfg.slot_size;
}

uint32_t kvsp_slot_count(const struct kvsp *p)
{
	return p->cfg.slot_count;
}

uint32_t kvsp_room_count(const struct kvsp *p)
{
	return p->cfg.max_rooms;
}

uint64_t kvsp_instance(const struct kvsp *p)
{
	return p->instance;
}

struct kvs_stats *kvsp_xport_stats(struct kvsp *p)
{
	return p->stats;
}

struct kvs_peer *kvsp_xport_peers(struct kvsp *p)
{
	return (struct kvs_peer *)((uint8_t *)p->ctrl + p->ctrl->peers_off);
}

uint64_t kvsp_xport_now(const struct kvsp *p)
{
	return p->now_ns;
}

bool kvsp_room_live(const struct kvsp *p, uint32_t i, uint32_t gen)
{
	if (i >= p->cfg.max_rooms)
		return false;
	const struct kvsp_room *r = &p->rooms[i];
	return r->gen == gen && (r->state == KVSP_ROOM_OPEN || r->state == KVSP_ROOM_ABORTING);
}

void kvsp_room_user_data(const struct kvsp *p, uint32_t i, uint64_t *recv_ud, uint64_t *send_ud)
{
	const struct kvsp_room *r = &p->rooms[i];
	*recv_ud = r->recv.client.cid ? r->recv.client.user_data : 0;
	*send_ud = r->send.client.cid ? r->send.client.user_data : 0;
}

int kvsp_fp_lookup(const struct kvsp *p, const char *name)
{
	int id = kvs_fp_find(name);
	for (unsigned k = KVSP_FP_COUNT; id < 0 && k < p->nfp; k++)
		if (!strcmp(name, p->fp_names[k - KVSP_FP_COUNT]))
			id = (int)k;
	return id;
}

int kvsp_fp_register(struct kvsp *p, const char *name)
{
	if (!*name || strlen(name) >= sizeof(p->fp_names[0]))
		return -EINVAL;
	if (kvsp_fp_lookup(p, name) >= 0)
		return -EEXIST;
	if (p->nfp >= KVSP_FP_COUNT + KVSP_FP_MODULES)
		return -ENOSPC;
	strcpy(p->fp_names[p->nfp - KVSP_FP_COUNT], name);
	return (int)p->nfp++;
}

int kvsp_xport_fp(struct kvsp *p, unsigned id, uint32_t i)
{
	uint64_t a, b;
	kvsp_room_user_data(p, i, &a, &b);
	return kvsp_fp_eval(&p->fp[id], p->cfg.failpoints, a, b);
}

int kvsp_xport_fp_ud(struct kvsp *p, unsigned id, uint64_t ud)
{
	return kvsp_fp_eval(&p->fp[id], p->cfg.failpoints, ud, ud);
}

int kvsp_xport_fp_action(const struct kvsp *p, unsigned id, int *err)
{
	*err = p->fp[id].err;
	return p->fp[id].action;
}

void kvsp_xport_fp_holder(struct kvsp *p, unsigned id, struct kvsp_transport *t,
			  unsigned (*release)(struct kvsp_transport *t, uint64_t match,
					      uint64_t mask))
{
	p->fp[id].holder = t;
	p->fp[id].release = release;
}

int kvsp_xport_fd_add(struct kvsp *p, struct kvsp_transport *t, int fd, uint32_t events,
		      uint32_t tag)
{
	return kvsp_ep_add(p->epfd, fd, events, kvsp_ep_tag(KVSP_EP_XPORT, t->idx, tag));
}

void kvsp_xport_fd_del(struct kvsp *p, int fd)
{
	kvsp_ep_del(p->epfd, fd);
}
