/* SPDX-License-Identifier: MIT */
/*
 * One pair of the abort mode (abort.c): a process holding the receiving
 * engine's connection and the sending engine's, so the phase of every
 * abort is exact and both sides' finals are seen by the process that
 * aborted. It checks, as it runs, every byte of every room that completes,
 * that no event follows a room's final, that a handed-over lease is refused
 * once its room is aborted, and every aborted room's pages after its final.
 */
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "abort.h"
#include "canary.h"
#include "client.h"
#include "sock.h"

#define STUCK_NS (10 * 1000000000ull) /* a room with no final for this long: the run is stuck */
#define EV_BATCH 64
#define QUARANTINE 16 /* aborted rooms' pages held stamped before reuse */

struct aroom {
	bool busy, doomed, aborted, acquiring, rx_final, tx_final, reuse_pending;
	uint8_t side, phase;
	kvs_room *rr, *sr;
	uint64_t seq, ud, t_abort;
	unsigned nl; /* leases the room took (its reuse check's slots) */
	int pages;
	struct kvs_lease *l;
};

struct pair {
	struct ab_ctx *x;
	struct ab_res *res;
	kvs_client *rx, *tx;
	struct aroom *rooms;
	unsigned nrooms, active;
	uint64_t seq, rng;
	uint8_t *pages; /* nrooms + QUARANTINE buffers of room_bytes */
	uint64_t *tomb; /* per buffer: the canary owner stamped at an abort, or 0 */
	int *fifo;	/* free buffers, oldest first */
	unsigned fhead, fn, npages;
};

/* Records why this child failed in its shared figures; returns 1. */
#define fail(res, ...) child_fail((res)->msg, sizeof((res)->msg), &(res)->failed, __VA_ARGS__)

static uint64_t rnd(struct pair *p)
{
	p->rng ^= p->rng << 13;
	p->rng ^= p->rng >> 7;
	p->rng ^= p->rng << 17;
	return p->rng;
}

static uint64_t owner_of(const struct pair *p, uint64_t seq)
{
	return ((uint64_t)(p->x->pair + 1) << 40) | seq;
}

static uint8_t *pages_of(struct pair *p, int i)
{
	return p->pages + (size_t)i * p->x->room_bytes;
}

/* Bytes of len at p that differ from owner's canary at off, counted by 8-byte word. */
static uint64_t wrong_bytes(const uint8_t *p, uint64_t owner, uint64_t off, uint64_t len)
{
	uint64_t bad = 0;
	for (uint64_t i = 0; i < len;) {
		uint64_t k = canary_check(p + i, owner, off + i, len - i);
		if (k == len - i)
			break;
		uint64_t w = len - i - k < 8 ? len - i - k : 8;
		bad += w;
		i += k + w;
	}
	return bad;
}

static int pages_take(struct pair *p)
{
	int i = p->fifo[p->fhead];
	p->fhead = (p->fhead + 1) % p->npages;
	p->fn--;
	if (p->tomb[i] && wrong_bytes(pages_of(p, i), p->tomb[i], 0, p->x->room_bytes))
		p->res->pages_bad++;
	p->tomb[i] = 0;
	return i;
}

static void pages_give(struct pair *p, int i)
{
	p->fifo[(p->fhead + p->fn++) % p->npages] = i;
}

static bool in_window(const struct ab_ctx *x, uint64_t t)
{
	return t >= x->sh->t_start && t < x->sh->t_end;
}

/* The slot is the engine's again: free, or taken anew (a later epoch) by
 * a lease or by someone else; never a tombstone. */
static bool slot_back(const struct pair *p, const struct kvs_lease *l)
{
	const struct kvs_slot *s = &p->tx->slots[l->slot];
	uint8_t st = __atomic_load_n(&s->state, __ATOMIC_ACQUIRE);
	uint32_t epoch = __atomic_load_n(&s->epoch, __ATOMIC_ACQUIRE);
	uint32_t owner = __atomic_load_n(&s->owner, __ATOMIC_ACQUIRE);
	if (st == KVS_SLOT_FREE)
		return true;
	if (st == KVS_SLOT_TOMBSTONE || epoch == l->epoch)
		return false;
	bool ours = owner == p->tx->id || (p->x->one_proxy && owner == p->rx->id);
	return st == KVS_SLOT_LEASED || !ours;
}

static void record_fin(struct pair *p, struct aroom *r, uint64_t t)
{
	if (in_window(p->x, r->t_abort))
		hist_add(&p->res->fin[r->side][r->phase], t - r->t_abort);
}

/* Takes whatever events are waiting on both connections. Returns 1 on failure. */
static int drain(struct pair *p, bool *any);

static int do_abort(struct pair *p, struct aroom *r)
{
	kvs_room *h;
	r->t_abort = now_ns();
	int rc = 0;
	bool any;
	/* No handle: that side was final and closed already (a SEND_DONE
	 * taken before the RECV_DONE); the engine has nothing to abort. */
	while ((h = r->side == SEND ? r->sr : r->rr) && (rc = kvs_abort(h)) == -EAGAIN)
		if (drain(p, &any))
			return 1;
	if (rc < 0)
		return fail(p->res, "pair %u: kvs_abort: %s", p->x->pair, kvs_strerror(rc));
	r->aborted = true;
	if (in_window(p->x, r->t_abort))
		p->res->aborted[r->side]++;
	/* Already final on that side (the receiver after RECV_DONE, a
	 * sender whose SEND_DONE came first): nothing to wait for, so no
	 * abort-to-final figure; its slots are still timed. */
	if ((r->side == RECV ? r->rx_final : r->tx_final) && in_window(p->x, r->t_abort))
		p->res->final_before++;
	r->reuse_pending = r->nl > 0;
	return 0;
}

/* After a send-side abort: a lease the room was handed must be refused. */
static void stale_probe(struct pair *p, struct aroom *r, unsigned sent)
{
	if (!sent)
		return;
	p->res->stale_tried++;
	if (kvs_release(p->tx, &r->l[0]) < 0 && !kvs_lease_ptr(p->tx, &r->l[0]))
		p->res->stale_refused++;
}

static int release_from(struct pair *p, struct aroom *r, unsigned from)
{
	for (unsigned i = from; i < r->nl; i++) {
		int rc = kvs_release(p->tx, &r->l[i]);
		if (rc < 0)
			return fail(p->res, "pair %u: kvs_release of an unsent lease: %s",
				    p->x->pair, kvs_strerror(rc));
	}
	return 0;
}

static bool doomed_at(const struct aroom *r, enum phase ph)
{
	return r->doomed && !r->aborted && r->phase == ph;
}

/* Leases, stamps and sends the room's chunks, aborting where its phase says. */
static int room_fill(struct pair *p, struct aroom *r)
{
	struct ab_ctx *x = p->x;
	int rc = kvs_acquire(p->tx, x->room_chunks, r->l);
	if (rc == -ENOBUFS || rc == -EAGAIN)
		return 0; /* slots held by rooms still in flight: next pass */
	if (rc < 0)
		return fail(p->res, "pair %u: kvs_acquire: %s", x->pair, kvs_strerror(rc));
	r->acquiring = false;
	r->nl = x->room_chunks;
	bool any;
	for (unsigned i = 0; i < x->room_chunks; i++) {
		uint64_t off = (uint64_t)i * x->chunk;
		uint64_t len = x->room_bytes - off < x->chunk ? x->room_bytes - off : x->chunk;
		canary_fill(kvs_lease_ptr(p->tx, &r->l[i]), owner_of(p, r->seq), off, len);
		if (drain(p, &any))
			return 1;
	}
	if (doomed_at(r, PH_LEASE))
		return do_abort(p, r) || release_from(p, r, 0);
	unsigned mid = x->room_chunks / 2;
	for (unsigned i = 0; i < x->room_chunks; i++) {
		if (i == mid && doomed_at(r, PH_MID)) {
			if (do_abort(p, r) || release_from(p, r, i))
				return 1;
			if (r->side == SEND)
				stale_probe(p, r, i);
			return 0;
		}
		uint64_t off = (uint64_t)i * x->chunk;
		uint32_t len =
			(uint32_t)(x->room_bytes - off < x->chunk ? x->room_bytes - off : x->chunk);
		while ((rc = kvs_send(r->sr, &r->l[i], off, len)) == -EAGAIN)
			if (drain(p, &any))
				return 1;
		if (rc < 0)
			return fail(p->res, "pair %u: kvs_send: %s", x->pair, kvs_strerror(rc));
	}
	if (drain(p, &any))
		return 1;
	if (doomed_at(r, PH_SENT)) {
		if (do_abort(p, r))
			return 1;
		if (r->side == SEND)
			stale_probe(p, r, x->room_chunks);
	}
	return 0;
}

static int room_start(struct pair *p, unsigned idx)
{
	struct ab_ctx *x = p->x;
	struct aroom *r = &p->rooms[idx];
	struct kvs_room_desc d;
	uint64_t seq = p->seq + 1;
	memset(r, 0, offsetof(struct aroom, l));
	r->doomed = x->rate > 0 && (double)(rnd(p) >> 11) * 0x1p-53 < x->rate;
	if (r->doomed) {
		unsigned s = x->o->abort_sides;
		r->side = s == 3 ? rnd(p) & 1 : s == 1 ? SEND : RECV;
		r->phase = (uint8_t)(rnd(p) % NPH);
	}
	r->ud = (seq << 16) | idx;
	if (x->staged && r->doomed && (r->phase == PH_MID || r->phase == PH_SENT))
		r->ud |= DOOM_BIT;
	int rc = kvs_recv_open(p->rx, x->room_bytes, r->ud, &r->rr, &d);
	if (rc == -EAGAIN || rc == -EMFILE)
		return 0; /* handles still closing: next pass */
	if (rc < 0)
		return fail(p->res, "pair %u: kvs_recv_open: %s", x->pair, kvs_strerror(rc));
	p->seq = seq;
	r->seq = seq;
	r->busy = true;
	p->active++;
	r->pages = pages_take(p);
	if (doomed_at(r, PH_DESC) && r->side == RECV) {
		r->tx_final = true; /* its sender never hears of it */
		return do_abort(p, r);
	}
	bool any;
	while ((rc = kvs_send_open(p->tx, &d, r->ud, &r->sr)) == -EAGAIN || rc == -EMFILE)
		if (drain(p, &any))
			return 1;
	if (rc < 0)
		return fail(p->res, "pair %u: kvs_send_open: %s", x->pair, kvs_strerror(rc));
	if (doomed_at(r, PH_DESC))
		return do_abort(p, r);
	r->acquiring = true;
	return room_fill(p, r);
}

/* Reads a completed room: every byte against its canary, then into its pages. */
static int consume(struct pair *p, struct aroom *r, bool into_pages)
{
	struct ab_ctx *x = p->x;
	for (unsigned i = 0; i < x->room_chunks; i++) {
		struct kvs_lease l;
		int rc = kvs_room_lease(r->rr, i, &l);
		const uint8_t *s = rc < 0 ? NULL : kvs_lease_ptr(p->rx, &l);
		if (!s)
			return fail(p->res, "pair %u: chunk %u of a completed room: %s", x->pair, i,
				    rc < 0 ? kvs_strerror(rc) : "not ours");
		uint64_t off = (uint64_t)i * x->chunk;
		uint64_t len = x->room_bytes - off < x->chunk ? x->room_bytes - off : x->chunk;
		uint64_t bad = wrong_bytes(s, owner_of(p, r->seq), off, len);
		if (bad && !p->res->corrupt)
			snprintf(p->res->msg, sizeof(p->res->msg),
				 "pair %u: room %llu chunk %u: %llu "
				 "wrong bytes",
				 x->pair, (unsigned long long)r->seq, i, (unsigned long long)bad);
		p->res->corrupt += bad;
		p->res->verified += len;
		if (into_pages)
			memcpy(pages_of(p, r->pages) + off, s, len);
		bool any;
		if (drain(p, &any))
			return 1;
	}
	return 0;
}

static int rx_event(struct pair *p, const struct kvs_event *e, uint64_t t)
{
	struct ab_ctx *x = p->x;
	unsigned idx = (unsigned)(e->user_data & 0xffff);
	uint64_t seq = (e->user_data & ~DOOM_BIT) >> 16;
	struct aroom *r = idx < p->nrooms ? &p->rooms[idx] : NULL;
	if (!r || !r->busy || r->seq != seq || r->rx_final) {
		p->res->late_events++;
		return 0;
	}
	if (e->type == KVS_EV_REJECTED) {
		p->res->rejected++;
		return 0;
	}
	if (e->type != KVS_EV_RECV_DONE && !r->aborted)
		return fail(p->res, "pair %u: a room no one aborted ended %u on the receiver: %s",
			    x->pair, e->type, kvs_strerror(e->status));
	r->rx_final = true;
	if (e->type == KVS_EV_RECV_DONE) {
		if (doomed_at(r, PH_DONE) && do_abort(p, r))
			return 1;
		if (r->aborted && r->phase != PH_DONE)
			p->res->lost_race++;
		/* An engine that aborted the receiver drops the room; every
		 * byte is checked all the same. */
		bool dropped = r->aborted && r->side == RECV;
		if (consume(p, r, !dropped))
			return 1;
		if (!r->doomed && in_window(x, t)) {
			p->res->rooms++;
			p->res->bytes += x->room_bytes;
		}
	}
	if (r->aborted && r->side == RECV && !(r->phase == PH_DONE && e->type == KVS_EV_RECV_DONE))
		record_fin(p, r, t);
	if (r->aborted) {
		/* The engine frees the pages at the final: stamp them; they
		 * are read back when next taken, and at the end. */
		p->tomb[r->pages] = (1ull << 39) | owner_of(p, r->seq);
		canary_fill(pages_of(p, r->pages), p->tomb[r->pages], 0, x->room_bytes);
	}
	int rc = kvs_room_close(r->rr);
	if (rc < 0)
		return fail(p->res, "pair %u: kvs_room_close: %s", x->pair, kvs_strerror(rc));
	r->rr = NULL;
	return 0;
}

static int tx_event(struct pair *p, const struct kvs_event *e, uint64_t t)
{
	unsigned idx = (unsigned)(e->user_data & 0xffff);
	uint64_t seq = (e->user_data & ~DOOM_BIT) >> 16;
	struct aroom *r = idx < p->nrooms ? &p->rooms[idx] : NULL;
	if (!r || !r->busy || r->seq != seq || r->tx_final || !r->sr) {
		p->res->late_events++;
		return 0;
	}
	if (e->type == KVS_EV_REJECTED) {
		p->res->rejected++;
		return 0;
	}
	if (e->type != KVS_EV_SEND_DONE && !r->aborted)
		return fail(p->res, "pair %u: a room no one aborted ended %u on the sender: %s",
			    p->x->pair, e->type, kvs_strerror(e->status));
	r->tx_final = true;
	if (r->aborted && r->side == SEND)
		record_fin(p, r, t);
	int rc = kvs_room_close(r->sr);
	if (rc < 0)
		return fail(p->res, "pair %u: kvs_room_close: %s", p->x->pair, kvs_strerror(rc));
	r->sr = NULL;
	return 0;
}

/* The aborted rooms whose slots are all back, timed now. */
static void reuse_check(struct pair *p)
{
	uint64_t t = 0;
	for (unsigned i = 0; i < p->nrooms; i++) {
		struct aroom *r = &p->rooms[i];
		if (!r->busy || !r->reuse_pending)
			continue;
		bool back = true;
		for (unsigned k = 0; k < r->nl && back; k++)
			back = slot_back(p, &r->l[k]);
		if (!back)
			continue;
		t = t ? t : now_ns();
		r->reuse_pending = false;
		if (in_window(p->x, r->t_abort))
			hist_add(&p->res->reuse[r->side][r->phase], t - r->t_abort);
	}
}

/* Called between the steps of a room's work (each chunk stamped and sent,
 * each chunk checked), so a final or a slot's return is seen within one
 * step of its arrival; handlers may call it again (events on the stack). */
static int drain(struct pair *p, bool *any)
{
	struct kvs_event ev[EV_BATCH];
	*any = false;
	for (int side = 0; side < 2; side++) {
		kvs_client *c = side ? p->rx : p->tx;
		int n = kvs_poll(c, ev, EV_BATCH);
		if (n < 0)
			return fail(p->res, "pair %u: kvs_poll: %s", p->x->pair, kvs_strerror(n));
		uint64_t t = now_ns();
		for (int k = 0; k < n; k++)
			if (side ? rx_event(p, &ev[k], t) : tx_event(p, &ev[k], t))
				return 1;
		*any |= n > 0;
	}
	reuse_check(p);
	return 0;
}

/* Rooms whose slots came back, and rooms done on both sides. */
static int sweep(struct pair *p, bool *any)
{
	uint64_t t = now_ns();
	for (unsigned i = 0; i < p->nrooms; i++) {
		struct aroom *r = &p->rooms[i];
		if (!r->busy)
			continue;
		if (r->reuse_pending && t - r->t_abort > STUCK_NS)
			return fail(p->res, "pair %u: an aborted room's slots not back after 10 s",
				    p->x->pair);
		if (r->acquiring) {
			if (room_fill(p, r))
				return 1;
			*any = true;
			continue;
		}
		if (r->rx_final && r->tx_final && !r->reuse_pending) {
			r->busy = false;
			p->active--;
			pages_give(p, r->pages);
			*any = true;
		}
	}
	return 0;
}

int abort_pair_run(struct ab_ctx *x, int ready_wr, int go_rd)
{
	struct pair *p = calloc(1, sizeof(*p));
	struct ab_res *res = x->res;
	if (!p)
		return fail(res, "pair %u: out of memory", x->pair);
	p->x = x;
	p->res = res;
	p->rng = 0x9e3779b97f4a7c15ull * (x->pair + 1) ^ now_ns();
	int rc = kvs_connect(x->rx_sock, &p->rx);
	if (!rc)
		rc = kvs_connect(x->tx_sock, &p->tx);
	if (rc < 0)
		return fail(res, "pair %u: kvs_connect: %s", x->pair, kvs_strerror(rc));
	p->nrooms = x->o->rooms;
	p->npages = p->nrooms + QUARANTINE;
	p->rooms = calloc(p->nrooms, sizeof(*p->rooms));
	p->tomb = calloc(p->npages, sizeof(*p->tomb));
	p->fifo = calloc(p->npages, sizeof(*p->fifo));
	p->pages = bench_alloc((size_t)p->npages * x->room_bytes, false);
	if (!p->rooms || !p->tomb || !p->fifo || !p->pages)
		return fail(res, "pair %u: out of memory", x->pair);
	for (unsigned i = 0; i < p->nrooms; i++)
		if (!(p->rooms[i].l = calloc(x->room_chunks, sizeof(struct kvs_lease))))
			return fail(res, "pair %u: out of memory", x->pair);
	for (unsigned i = 0; i < p->npages; i++)
		pages_give(p, (int)i);
	char b = 'r';
	kvs_write_full(ready_wr, &b, 1);
	close(ready_wr);
	while (read(go_rd, &b, 1) < 0 && errno == EINTR)
		;
	close(go_rd);

	uint64_t t_idle = now_ns();
	for (;;) {
		uint64_t t = now_ns();
		bool stopping = t >= x->sh->t_end, any = false, more;
		if (stopping && !p->active)
			break;
		for (unsigned i = 0; i < p->nrooms && !stopping; i++)
			if (!p->rooms[i].busy) {
				if (room_start(p, i))
					return 1;
				any = true;
			}
		if (drain(p, &more) || sweep(p, &any))
			return 1;
		if (any || more) {
			t_idle = t;
		} else if (t - t_idle > STUCK_NS) {
			return fail(res, "pair %u: %u rooms without a final for 10 s", x->pair,
				    p->active);
		} else {
			sched_yield(); /* the proxy may share this CPU */
		}
	}
	for (unsigned i = 0; i < p->npages; i++) /* the pages still stamped */
		if (p->tomb[i] && wrong_bytes(pages_of(p, (int)i), p->tomb[i], 0, x->room_bytes))
			res->pages_bad++;
	kvs_close(p->rx);
	kvs_close(p->tx);
	return 0;
}
