/* SPDX-License-Identifier: MIT */
/*
 * Rooms: one request's transfer. A receiving client opens one (bytes, and a
 * descriptor with a random token); a sending client opens its other side
 * with that descriptor and hands it leased slots, one chunk each. A
 * transport carries each chunk and reports quiescence; only then, and only
 * through the fence in kvsp_xfer_done(), does a chunk land.
 *
 * A room ends with exactly one final event on each attached handle. An
 * aborted room ends only after every slot it touched has quiesced.
 */
#include <endian.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "log.h"
#include "proxy.h"
#include "transport.h"

#define NONE KVSP_NONE

/* ------------------------------------------------------------ helpers */

static void slist_push(struct kvsp *p, uint32_t *head, uint32_t slot)
{
	struct kvsp_slot_priv *sp = p->slots.priv;
	sp[slot].prev = NONE;
	sp[slot].next = *head;
	if (*head != NONE)
		sp[*head].prev = slot;
	*head = slot;
}

static void slist_del(struct kvsp *p, uint32_t *head, uint32_t slot)
{
	struct kvsp_slot_priv *sp = p->slots.priv;
	if (sp[slot].prev != NONE)
		sp[sp[slot].prev].next = sp[slot].next;
	else
		*head = sp[slot].next;
	if (sp[slot].next != NONE)
		sp[sp[slot].next].prev = sp[slot].prev;
	sp[slot].prev = sp[slot].next = NONE;
}

static void lru_del(struct kvsp *p, uint32_t i)
{
	struct kvsp_room *r = &p->rooms[i];
	if (r->lru_prev != NONE)
		p->rooms[r->lru_prev].lru_next = r->lru_next;
	else if (p->lru_head == i)
		p->lru_head = r->lru_next;
	else
		return; /* not on the list */
	if (r->lru_next != NONE)
		p->rooms[r->lru_next].lru_prev = r->lru_prev;
	else
		p->lru_tail = r->lru_prev;
	r->lru_prev = r->lru_next = NONE;
}

/* Progress: the room moves to the young end of the timeout list. */
static void touch(struct kvsp *p, uint32_t i)
{
	struct kvsp_room *r = &p->rooms[i];
	r->progress_ns = p->now_ns;
	if (p->lru_tail == i)
		return;
	lru_del(p, i);
	r->lru_prev = p->lru_tail;
	r->lru_next = NONE;
	if (p->lru_tail != NONE)
		p->rooms[p->lru_tail].lru_next = i;
	else
		p->lru_head = i;
	p->lru_tail = i;
}

static void new_token(struct kvsp *p, uint8_t token[16])
{
	if (p->rnd_used + 16 > sizeof(p->rnd)) {
		/* getrandom() only blocks before the pool is seeded at boot */
		ssize_t n = getrandom(p->rnd, sizeof(p->rnd), 0);
		if (n != (ssize_t)sizeof(p->rnd)) {
			LOG_ERR("getrandom: %s", n < 0 ? strerror(errno) : "short read");
			abort(); /* a guessable token would break invariant 4 */
		}
		p->rnd_used = 0;
	}
	memcpy(token, p->rnd + p->rnd_used, 16);
	p->rnd_used += 16;
}

static bool token_eq(const uint8_t a[16], const uint8_t b[16])
{
	uint8_t d = 0; /* constant time: a forger learns nothing from timing */
	for (int i = 0; i < 16; i++)
		d |= a[i] ^ b[i];
	return d == 0;
}

static uint64_t chunk_len(const struct kvsp *p, const struct kvsp_room *r, uint32_t chunk)
{
	uint64_t off = (uint64_t)chunk * p->cfg.slot_size;
	uint64_t left = r->bytes - off;
	return left < p->cfg.slot_size ? left : p->cfg.slot_size;
}

static struct kvsp_handle *handle_of(struct kvsp *p, struct kvsp_client *c, uint16_t h)
{
	return h < p->cfg.client_rooms ? &c->handles[h] : NULL;
}

/* ---------------------------------------------------------- lifetime */

int kvsp_rooms_init(struct kvsp *p)
{
	uint32_t n = p->cfg.max_rooms;
	p->bits_words = (p->cfg.slot_count + 63) / 64;
	p->rooms = calloc(n, sizeof(*p->rooms));
	p->bits_arena = calloc((size_t)n * p->bits_words, sizeof(uint64_t));
	if (!p->rooms || !p->bits_arena)
		return -ENOMEM;
	for (uint32_t i = 0; i < n; i++) {
		struct kvsp_room *r = &p->rooms[i];
		r->gen = 1;
		r->lru_prev = r->lru_next = NONE;
		r->placed_head = r->inflight_head = NONE;
		r->claimed_bits = p->bits_arena + (size_t)i * p->bits_words;
		r->next_free = i + 1 < n ? i + 1 : NONE;
	}
	p->room_free_head = 0;
	p->room_free_tail = n - 1;
	p->lru_head = p->lru_tail = NONE;
	p->rnd_used = sizeof(p->rnd);
	return 0;
}

void kvsp_rooms_fini(struct kvsp *p)
{
	free(p->rooms);
	free(p->bits_arena);
	p->rooms = NULL;
	p->bits_arena = NULL;
}

static uint32_t room_alloc(struct kvsp *p)
{
	uint32_t i = p->room_free_head;
	if (i == NONE)
		return NONE;
	p->room_free_head = p->rooms[i].next_free;
	if (p->room_free_head == NONE)
		p->room_free_tail = NONE;
	KVS_STAT_ADD(p->stats->rooms_open, 1);
	return i;
}

/* Frees an ENDED room nobody is attached to. FIFO, so an index is reused
 * as late as possible; the generation makes old descriptors stale anyway. */
static void room_maybe_free(struct kvsp *p, uint32_t i)
{
	struct kvsp_room *r = &p->rooms[i];
	if (r->state != KVSP_ROOM_ENDED || r->recv.cid || r->send.cid)
		return;
	r->state = KVSP_ROOM_FREE;
	r->gen++;
	r->next_free = NONE;
	if (p->room_free_tail != NONE)
		p->rooms[p->room_free_tail].next_free = i;
	else
		p->room_free_head = i;
	p->room_free_tail = i;
	KVS_STAT_SUB(p->stats->rooms_open, 1);
}

/* Posts a final event to one side; detaches the side if its handle was
 * already closed by the client. */
static void post_final(struct kvsp *p, struct kvsp_side *s, uint16_t type, int status,
		       uint64_t bytes, uint32_t slot, uint32_t epoch)
{
	if (!s->cid)
		return;
	struct kvsp_client *c = kvsp_client_get(p, s->cidx, s->cid);
	if (!c) {
		s->cid = 0;
		return;
	}
	struct kvsp_handle *hd = &c->handles[s->handle];
	kvsp_client_final(p, s, type, status, bytes, slot, epoch);
	if (hd->state == KVSP_H_FREE)
		s->cid = 0;
}

#ifdef KVS_VULNERABLE
/* The buggy engines: what is in flight is freed at once and forgotten;
 * the transport does not know and carries on. */
static void vulnerable_forget_inflight(struct kvsp *p, struct kvsp_room *r)
{
	while (r->inflight_head != NONE) {
		uint32_t s = r->inflight_head;
		slist_del(p, &r->inflight_head, s);
		kvsp_slot_kill(&p->slots, s);
		r->inflight--;
	}
}
#endif

static void room_end(struct kvsp *p, uint32_t i)
{
	struct kvsp_room *r = &p->rooms[i];
	r->state = KVSP_ROOM_ENDED;
	p->rooms_active--;
	post_final(p, &r->send, r->final_type, r->status, 0, NONE, 0);
	post_final(p, &r->recv, r->final_type, r->status, 0, NONE, 0);
	room_maybe_free(p, i);
}

static void room_complete(struct kvsp *p, uint32_t i, uint32_t first_slot)
{
	struct kvsp_room *r = &p->rooms[i];
	lru_del(p, i);
	r->state = KVSP_ROOM_ENDED;
	r->final_type = KVS_EV_RECV_DONE;
	p->rooms_active--;
	KVS_STAT_ADD(p->stats->rooms_done, 1);
	post_final(p, &r->send, KVS_EV_SEND_DONE, 0, r->bytes, NONE, 0);
	post_final(p, &r->recv, KVS_EV_RECV_DONE, 0, r->bytes, first_slot,
		   p->slots.pub[first_slot].epoch);
	room_maybe_free(p, i);
}

/* Aborts room i: what it holds is freed, what a transport still pins
 * becomes a tombstone, and the final events wait for the last quiescence. */
static void room_abort(struct kvsp *p, uint32_t i, int status, uint8_t type)
{
	struct kvsp_room *r = &p->rooms[i];
	if (r->state != KVSP_ROOM_OPEN)
		return;
	r->state = KVSP_ROOM_ABORTING;
	r->status = status;
	r->final_type = type;
	lru_del(p, i);
	if (type == KVS_EV_FAILED)
		KVS_STAT_ADD(p->stats->rooms_failed, 1);
	else
		KVS_STAT_ADD(p->stats->rooms_aborted, 1);
	while (r->placed_head != NONE) {
		uint32_t s = r->placed_head;
		slist_del(p, &r->placed_head, s);
		kvsp_slot_kill(&p->slots, s);
	}
#ifdef KVS_VULNERABLE
	vulnerable_forget_inflight(p, r);
#else
	for (uint32_t s = r->inflight_head; s != NONE; s = p->slots.priv[s].next)
		kvsp_slot_kill(&p->slots, s);
#endif
	if (r->xport)
		r->xport->ops->cancel(r->xport, i);
	LOG_DEBUG("room %u aborted (%d), %u in flight", i, status, r->inflight);
	if (r->inflight == 0)
		room_end(p, i);
}

void kvsp_rooms_abort_all(struct kvsp *p, int status)
{
	for (uint32_t i = 0; i < p->cfg.max_rooms; i++)
		room_abort(p, i, status, KVS_EV_ABORTED);
}

uint64_t kvsp_rooms_tick(struct kvsp *p)
{
	uint64_t t = p->cfg.room_timeout_ns;
	if (!t)
		return UINT64_MAX;
	while (p->lru_head != NONE) {
		struct kvsp_room *r = &p->rooms[p->lru_head];
		if (p->now_ns - r->progress_ns < t)
			return r->progress_ns + t;
		kvsp_log_rl(&p->rl_timeout, p->now_ns, &p->stats->log_suppressed, KVSP_LOG_INFO,
			    "room %u: no progress for %llu ms, aborting", p->lru_head,
			    (unsigned long long)(t / 1000000));
		KVS_STAT_ADD(p->stats->rooms_timed_out, 1);
		room_abort(p, p->lru_head, -ETIMEDOUT, KVS_EV_ABORTED);
	}
	return UINT64_MAX;
}

/* --------------------------------------------------------------- opens */

int kvsp_room_open_recv(struct kvsp *p, struct kvsp_client *c, uint16_t h, uint64_t bytes,
			uint64_t user_data, struct kvs_desc_wire *d)
{
	struct kvsp_handle *hd = handle_of(p, c, h);
	if (!hd || hd->state != KVSP_H_FREE)
		return -EBADF;
	if (!bytes)
		return -EINVAL;
	if (bytes > (uint64_t)p->cfg.slot_count * p->cfg.slot_size)
		return -EMSGSIZE;
	if (p->draining)
		return -ESHUTDOWN;
	int rc = kvsp_fp_eval(&p->fp[KVSP_FP_RECV_OPEN], p->cfg.failpoints, user_data, user_data);
	if (rc < 0)
		return rc;
	uint32_t i = room_alloc(p);
	if (i == NONE)
		return -ENFILE;
	struct kvsp_room *r = &p->rooms[i];
	r->state = KVSP_ROOM_OPEN;
	r->final_type = 0;
	r->status = 0;
	r->bytes = bytes;
	r->nchunks = (uint32_t)((bytes + p->cfg.slot_size - 1) / p->cfg.slot_size);
	r->placed = r->inflight = 0;
	r->placed_head = r->inflight_head = NONE;
	memset(r->claimed_bits, 0, ((r->nchunks + 63) / 64) * sizeof(uint64_t));
	new_token(p, r->token);
	r->recv = (struct kvsp_side){ c->id, c->idx, h, user_data };
	r->send = (struct kvsp_side){ 0 };
	r->xport = p->local;
	*hd = (struct kvsp_handle){ .state = KVSP_H_OPEN, .role = KVSP_RECV, .room = i,
				    .user_data = user_data };
	c->finals_owed++;
	p->rooms_active++;
	touch(p, i);

	memset(d, 0, sizeof(*d));
	d->magic = htole32(KVS_MAGIC_DESC);
	d->version = htole16(1);
	d->instance = htole64(p->instance);
	d->room = htole32(i);
	d->gen = htole32(r->gen);
	memcpy(d->token, r->token, 16);
	d->bytes = htole64(bytes);
	d->slot_size = htole64(p->cfg.slot_size);
	return 0;
}

int kvsp_room_open_send(struct kvsp *p, struct kvsp_client *c, uint16_t h,
			const struct kvs_desc_wire *d, uint64_t user_data, uint64_t *bytes)
{
	struct kvsp_handle *hd = handle_of(p, c, h);
	if (!hd || hd->state != KVSP_H_FREE)
		return -EBADF;
	if (le32toh(d->magic) != KVS_MAGIC_DESC || le16toh(d->version) != 1)
		return -EINVAL;
	if (le64toh(d->instance) != p->instance)
		/* Another proxy's room, or one from before a restart. */
		return d->endpoint[0] ? -EOPNOTSUPP : -ESTALE;
	uint32_t i = le32toh(d->room);
	if (i >= p->cfg.max_rooms)
		return -EINVAL;
	struct kvsp_room *r = &p->rooms[i];
	if (r->state == KVSP_ROOM_FREE || r->gen != le32toh(d->gen))
		return -ESTALE;
	if (!token_eq(r->token, d->token)) {
		KVS_STAT_ADD(p->stats->rej_token, 1);
		kvsp_log_rl(&c->rl[KVSP_RL_TOKEN], p->now_ns, &p->stats->log_suppressed, KVSP_LOG_WARN,
			    "client %u (pid %d): wrong token for room %u", c->id, (int)c->pid, i);
		return -EPERM;
	}
	if (r->state != KVSP_ROOM_OPEN)
		return -ECANCELED;
	if (r->send.cid)
		return -EBUSY;
	r->send = (struct kvsp_side){ c->id, c->idx, h, user_data };
	*hd = (struct kvsp_handle){ .state = KVSP_H_OPEN, .role = KVSP_SEND, .room = i,
				    .user_data = user_data };
	c->finals_owed++;
	touch(p, i);
	*bytes = r->bytes;
	return 0;
}

/* ---------------------------------------------------------------- send */

int kvsp_room_send(struct kvsp *p, struct kvsp_client *c, uint16_t h, const struct kvs_lease *l,
		   uint64_t offset, uint64_t len)
{
	struct kvsp_handle *hd = handle_of(p, c, h);
	if (!hd || hd->state == KVSP_H_FREE || hd->role != KVSP_SEND)
		return -EBADF;
	int st = kvsp_slot_check(&p->slots, c->id, l);
	if (st < 0)
		return st;
	if (st != KVS_SLOT_LEASED)
		return -EBUSY;
	uint32_t i = hd->room;
	struct kvsp_room *r = &p->rooms[i];
	if (hd->state != KVSP_H_OPEN || r->state != KVSP_ROOM_OPEN) {
		/* The room is over; the slot was given to it, so it is freed. */
		return kvsp_slot_release(&p->slots, c->id, l);
	}
	if (offset % p->cfg.slot_size || offset >= r->bytes)
		return -EINVAL;
	uint32_t chunk = (uint32_t)(offset / p->cfg.slot_size);
	if (len != chunk_len(p, r, chunk))
		return -EINVAL;
	if (r->claimed_bits[chunk / 64] & (1ull << (chunk % 64)))
		return -EEXIST;

	kvsp_slot_pin(&p->slots, c->id, l);
	struct kvsp_slot_priv *sp = &p->slots.priv[l->slot];
	sp->room = i;
	sp->chunk = chunk;
	__atomic_store_n(&p->slots.pub[l->slot].room, i + 1, __ATOMIC_RELAXED);
	slist_push(p, &r->inflight_head, l->slot);
	r->inflight++;
	r->claimed_bits[chunk / 64] |= 1ull << (chunk % 64);
	touch(p, i);

	struct kvsp_xfer x = { l->slot, l->epoch, i, r->gen, chunk };
	int rc = r->xport->ops->submit(r->xport, &x);
	if (rc < 0)
		kvsp_xfer_done(p, &x, rc); /* refused before touching: fail the room */
	return 0;
}

#ifdef KVS_VULNERABLE
/* The buggy engines' transport: no fence. The late chunk lands in the
 * room from whatever slot it named, whoever holds that slot now. */
static void vulnerable_land(struct kvsp *p, const struct kvsp_xfer *x)
{
	struct kvsp_room *r = &p->rooms[x->room];
	if (r->state != KVSP_ROOM_OPEN || !r->recv.cid)
		return;
	kvsp_slot_force_handoff(&p->slots, x->slot, r->recv.cid);
	p->slots.priv[x->slot].room = x->room;
	p->slots.priv[x->slot].chunk = x->chunk;
	slist_push(p, &r->placed_head, x->slot);
	if (x->chunk == 0)
		r->chunk0 = x->slot;
	if (++r->placed == r->nchunks)
		room_complete(p, x->room, r->chunk0);
}
#endif

void kvsp_xfer_done(struct kvsp *p, const struct kvsp_xfer *x, int status)
{
	struct kvs_slot *pub = &p->slots.pub[x->slot];
#ifdef KVS_VULNERABLE
	if (pub->state != KVS_SLOT_INFLIGHT || pub->epoch != x->epoch) {
		vulnerable_land(p, x);
		return;
	}
#endif
	/* The slot is pinned for x, so it is still on its room's in-flight
	 * list, INFLIGHT or (if the room was aborted) a TOMBSTONE. */
	struct kvsp_room *r = &p->rooms[x->room];
	slist_del(p, &r->inflight_head, x->slot);
	r->inflight--;
	/* The fence (invariant 5): the chunk lands only if the slot is still
	 * in flight for this room, at the epoch it was captured with, and the
	 * room is the same generation and still open. */
	bool lands = status == 0 && pub->state == KVS_SLOT_INFLIGHT && pub->epoch == x->epoch &&
		     r->gen == x->room_gen && r->state == KVSP_ROOM_OPEN;
	int st = kvsp_slot_unpin(&p->slots, x->slot);
	if (lands) {
		kvsp_slot_handoff(&p->slots, x->slot, r->recv.cid);
		slist_push(p, &r->placed_head, x->slot);
		KVS_STAT_ADD(p->stats->chunks_moved, 1);
		KVS_STAT_ADD(p->stats->bytes_moved, chunk_len(p, r, x->chunk));
		if (x->chunk == 0)
			r->chunk0 = x->slot;
		touch(p, x->room);
		if (++r->placed == r->nchunks)
			room_complete(p, x->room, r->chunk0);
	} else if (st == KVS_SLOT_INFLIGHT) {
		/* Not tombstoned, yet not landing: the transport failed it. */
		kvsp_slot_kill(&p->slots, x->slot);
		room_abort(p, x->room, status ? status : -EIO, KVS_EV_FAILED);
	}
	if (r->state == KVSP_ROOM_ABORTING && r->inflight == 0)
		room_end(p, x->room);
}

/* ---------------------------------------------------- abort, close, map */

void kvsp_room_abort_from(struct kvsp *p, struct kvsp_client *c, uint16_t h, int status)
{
	struct kvsp_handle *hd = handle_of(p, c, h);
	if (hd->state != KVSP_H_OPEN)
		return; /* its final is posted or owed already: idempotent */
#ifdef KVS_VULNERABLE
	if (hd->role == KVSP_SEND) {
		/* The buggy engines: the sender's abort is local. Its pages
		 * are freed at once; the receiver keeps waiting. */
		struct kvsp_room *r = &p->rooms[hd->room];
		vulnerable_forget_inflight(p, r);
		post_final(p, &r->send, KVS_EV_ABORTED, status, 0, NONE, 0);
		return;
	}
#endif
	room_abort(p, hd->room, status, KVS_EV_ABORTED);
}

/* The receiver's slots still in room i go back to the pool. */
static void release_placed(struct kvsp *p, uint32_t i)
{
	struct kvsp_room *r = &p->rooms[i];
	while (r->placed_head != NONE) {
		uint32_t s = r->placed_head;
		slist_del(p, &r->placed_head, s);
		kvsp_slot_kill(&p->slots, s);
	}
}

void kvsp_room_detach(struct kvsp *p, struct kvsp_client *c, uint16_t h, int status)
{
	struct kvsp_handle *hd = handle_of(p, c, h);
	uint32_t i = hd->room;
	struct kvsp_room *r = &p->rooms[i];
	struct kvsp_side *side = hd->role == KVSP_RECV ? &r->recv : &r->send;
	bool dead = status == -ECONNRESET;

	if (hd->state == KVSP_H_FREE || hd->state == KVSP_H_CLOSING)
		return;
	if (r->state == KVSP_ROOM_OPEN)
		room_abort(p, i, status, KVS_EV_ABORTED);
	if (hd->role == KVSP_RECV)
		release_placed(p, i);
	if (hd->state == KVSP_H_OPEN && !dead) {
		/* The final is still owed to this handle: it frees it. */
		hd->state = KVSP_H_CLOSING;
		return;
	}
	if (hd->state == KVSP_H_OPEN)
		c->finals_owed--;
	hd->state = KVSP_H_FREE;
	side->cid = 0;
	room_maybe_free(p, i);
}

int kvsp_room_map(struct kvsp *p, struct kvsp_client *c, uint16_t h, struct kvs_lease *out)
{
	struct kvsp_handle *hd = handle_of(p, c, h);
	if (!hd || hd->state != KVSP_H_ENDED || hd->role != KVSP_RECV)
		return hd && hd->state == KVSP_H_OPEN ? -EAGAIN : -EBADF;
	struct kvsp_room *r = &p->rooms[hd->room];
	if (r->final_type != KVS_EV_RECV_DONE)
		return -ECANCELED;
	for (uint32_t k = 0; k < r->nchunks; k++)
		out[k] = (struct kvs_lease){ NONE, 0 };
	for (uint32_t s = r->placed_head; s != NONE; s = p->slots.priv[s].next)
		out[p->slots.priv[s].chunk] = (struct kvs_lease){ s, p->slots.pub[s].epoch };
	return (int)r->nchunks;
}

int kvsp_lease_release(struct kvsp *p, struct kvsp_client *c, const struct kvs_lease *l)
{
	int st = kvsp_slot_check(&p->slots, c->id, l);
	if (st == KVS_SLOT_RECV_FILLED) {
		uint32_t i = p->slots.priv[l->slot].room;
		if (i != NONE)
			slist_del(p, &p->rooms[i].placed_head, l->slot);
	}
	return kvsp_slot_release(&p->slots, c->id, l);
}

void kvsp_slot_drop(struct kvsp *p, uint32_t slot)
{
	uint32_t i = p->slots.priv[slot].room;
	if (i != NONE && p->slots.pub[slot].state == KVS_SLOT_RECV_FILLED)
		slist_del(p, &p->rooms[i].placed_head, slot);
	kvsp_slot_kill(&p->slots, slot);
}
