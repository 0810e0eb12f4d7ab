/* SPDX-License-Identifier: MIT */
/*
 * The room protocol (peer/room.h). Every frame is authenticated (peer/
 * frame.c); what it says about a room is still checked against our own
 * record of the room (index, generation, token, session) before anything
 * changes, and a frame that names no room of ours is counted and ignored.
 */
#include "peer/room.h"

#include <endian.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "core/xport.h"
#include "layout.h"
#include "peer/datapath.h"
#include "peer/frame.h"

#define NONE UINT32_MAX

/* Control frames a room owes its peer, sent in the order of the bits. */
enum { OWE_OPEN = 1, OWE_ACK = 2, OWE_ABORT = 4, OWE_DONE = 8, OWE_ENDED = 16 };

int proom_init(struct proom_table *t)
{
	t->n = kvsp_room_count(t->p);
	t->r = calloc(t->n, sizeof(*t->r));
	t->xnext = calloc(kvsp_slot_count(t->p), sizeof(*t->xnext));
	return t->r && t->xnext ? 0 : -ENOMEM;
}

void proom_fini(struct proom_table *t)
{
	free(t->r);
	free(t->xnext);
	t->r = NULL;
	t->xnext = NULL;
}

static struct kvsp_room_name core_name(const struct kvs_wire_room *w)
{
	struct kvsp_room_name n = { le32toh(w->room), le32toh(w->gen), { 0 } };
	memcpy(n.token, w->token, sizeof(n.token));
	return n;
}

/* s's owed frames; a list left by an earlier session at its index is dropped. */
static struct powe *owe_of(struct proom_table *t, const struct psess *s)
{
	struct powe *o = &t->owe[s->idx];
	if (o->sess != s->id) {
		o->sess = s->id;
		o->head = o->tail = NONE;
		o->nref = 0;
	}
	return o;
}

/* Room i owes its peer the frame what. */
static void owe(struct proom_table *t, uint32_t i, uint8_t what)
{
	struct proom *r = &t->r[i];
	struct psess *s = psess_get(t->sessions, r->sess);
	if (!s)
		return; /* nobody to tell: the session is gone, and with it the far half */
	struct powe *o = owe_of(t, s);
	r->owed |= what;
	if (r->on_owe)
		return;
	r->on_owe = true;
	r->owe_next = NONE;
	if (o->tail != NONE)
		t->r[o->tail].owe_next = i;
	else
		o->head = i;
	o->tail = i;
}

static void ignored(struct proom_table *t)
{
	KVS_STAT_ADD(t->st->peer_frames_ignored, 1);
}

/* --------------------------------------------------- what the core says */

int proom_attach(struct proom_table *t, uint32_t sess, uint32_t i, uint32_t gen,
		 const struct kvs_desc_wire *d)
{
	struct proom *r = &t->r[i];
	*r = (struct proom){ .gen = gen,
			     .sess = sess,
			     .from = KVS_WIRE_FROM_SEND,
			     .sender_ref = (uint64_t)gen << 32 | i,
			     .far_instance = le64toh(d->instance),
			     .bytes = le64toh(d->bytes),
			     .pend_head = NONE,
			     .pend_tail = NONE };
	r->name.room = d->room;
	r->name.gen = d->gen;
	memcpy(r->name.token, d->token, 16);
	owe(t, i, OWE_OPEN);
	return 0;
}

/* Gives chunk x to the first data path that carries s. Returns what its
 * send returns. */
static int carry(struct proom_table *t, struct psess *s, struct kvsp_xfer *x, const struct proom *r)
{
	for (unsigned k = 0; k < *t->ndps; k++)
		if (t->dps[k]->ops->carries(t->dps[k], s))
			return t->dps[k]->ops->send(t->dps[k], s, x, &r->name);
	return -EOPNOTSUPP;
}

int proom_submit(struct proom_table *t, struct kvsp_xfer *x)
{
	struct proom *r = &t->r[x->room];
	struct psess *s = psess_get(t->sessions, r->sess);
	if (!s)
		return -ECONNRESET;
	if (r->acked)
		return carry(t, s, x, r);
	/* Not a byte before the receiver said yes. */
	t->xnext[x->slot] = NONE;
	if (r->pend_tail != NONE)
		t->xnext[r->pend_tail] = x->slot;
	else
		r->pend_head = x->slot;
	r->pend_tail = x->slot;
	return 0;
}

void proom_cancel(struct proom_table *t, uint32_t i, uint32_t gen)
{
	struct proom *r = &t->r[i];
	if (r->gen != gen)
		return;
	/* What waited for OPEN_ACK never left its slot. */
	while (r->pend_head != NONE) {
		uint32_t slot = r->pend_head;
		r->pend_head = t->xnext[slot];
		struct kvsp_xfer *x = kvsp_xfer_of(t->p, slot);
		if (x->dir == KVSP_XFER_SEND && x->room == i && x->room_gen == gen)
			kvsp_xfer_quiesced(t->p, x, -ECANCELED);
	}
	r->pend_tail = NONE;
}

void proom_notify(struct proom_table *t, uint32_t i, uint32_t gen, int note, int status)
{
	struct proom *r = &t->r[i];
	if (r->gen != gen)
		return;
	switch (note) {
	case KVSP_NOTE_ABORT:
		r->abort_status = status;
		r->abort_ns = kvsp_xport_now(t->p); /* the peer's ENDED is owed from now */
		owe(t, i, OWE_ABORT);
		break;
	case KVSP_NOTE_ENDED:
		owe(t, i, OWE_ENDED);
		break;
	case KVSP_NOTE_DONE:
		owe(t, i, OWE_DONE);
		break;
	}
}

/* ------------------------------------------------------ frames we owe */

static bool refusal_push(struct powe *o, const struct kvs_wire_open_ack *a)
{
	if (o->nref == PROOM_REFUSALS)
		return false; /* a peer sending that many bad OPENs hears nothing more */
	o->refusals[(o->rhead + o->nref++) % PROOM_REFUSALS] = *a;
	return true;
}

/* Seals what room i owes, the lowest bit first. Returns false if it owes
 * nothing the session can still hear (it is refused here instead). */
static bool room_frame(struct proom_table *t, struct psess *s, uint32_t i, uint8_t what,
		       uint64_t now, uint16_t *type, union kvs_wire_body *b)
{
	struct proom *r = &t->r[i];
	uint64_t ref = htole64(r->sender_ref);
	memset(b, 0, sizeof(*b));
	switch (what) {
	case OWE_OPEN:
		if (r->far_instance != s->instance) {
			/* Another proxy answers at that address than the one
			 * that made the descriptor: its room is gone. */
			r->sess = 0;
			kvsp_room_peer_refused(t->p, t->t, s->id, i, r->gen, -ESTALE);
			return false;
		}
		b->open = (struct kvs_wire_open){ r->name, htole64(r->bytes),
						  htole64(kvsp_slot_size(t->p)), ref };
		*type = KVS_WIRE_OPEN;
		r->open_ns = now; /* its OPEN_ACK is owed from now */
		return true;
	case OWE_ACK:
		b->open_ack =
			(struct kvs_wire_open_ack){ .room = r->name,
						    .sender_ref = ref,
						    .status = (int32_t)htole32(r->ack_status) };
		*type = KVS_WIRE_OPEN_ACK;
		return true;
	case OWE_ABORT:
		b->abort = (struct kvs_wire_abort){ .room = r->name,
						    .status = (int32_t)htole32(r->abort_status),
						    .from = htole32(r->from),
						    .sender_ref = ref };
		*type = KVS_WIRE_ABORT;
		return true;
	case OWE_DONE:
		b->done = (struct kvs_wire_done){ r->name, ref };
		*type = KVS_WIRE_DONE;
		return true;
	default:
		b->ended = (struct kvs_wire_ended){ .room = r->name,
						    .sender_ref = ref,
						    .from = htole32(r->from) };
		*type = KVS_WIRE_ENDED;
		return true;
	}
}

bool proom_next_frame(struct proom_table *t, struct psess *s, uint64_t now, uint16_t *type,
		      void *body)
{
	struct powe *o = owe_of(t, s);
	if (o->nref) {
		*type = KVS_WIRE_OPEN_ACK;
		if (body) {
			((union kvs_wire_body *)body)->open_ack = o->refusals[o->rhead];
			o->rhead = (o->rhead + 1) % PROOM_REFUSALS;
			o->nref--;
		}
		return true;
	}
	if (!body)
		return o->head != NONE;
	while (o->head != NONE) {
		uint32_t i = o->head;
		struct proom *r = &t->r[i];
		uint8_t what = r->owed & -r->owed;
		r->owed &= (uint8_t)~what;
		if (!r->owed || r->sess != s->id) {
			o->head = r->owe_next;
			if (o->head == NONE)
				o->tail = NONE;
			r->on_owe = false;
		}
		if (r->sess == s->id && what && room_frame(t, s, i, what, now, type, body))
			return true;
	}
	return false;
}

/* ------------------------------------------------------ what comes */

/* Sending half: the frame names our room (sender_ref) and the peer's
 * receiving room (name); both must be what we recorded. */
static struct proom *sender_room(struct proom_table *t, const struct psess *s, uint64_t ref,
				 const struct kvs_wire_room *name, uint32_t *idx)
{
	uint32_t i = (uint32_t)ref, gen = (uint32_t)(ref >> 32);
	if (i >= t->n)
		return NULL;
	struct proom *r = &t->r[i];
	if (r->sess != s->id || r->gen != gen || r->from != KVS_WIRE_FROM_SEND ||
	    r->name.room != name->room || r->name.gen != name->gen ||
	    sodium_memcmp(r->name.token, name->token, 16))
		return NULL;
	*idx = i;
	return r;
}

/* Receiving half: the frame names our room; the token is the core's to
 * check (a wrong one is counted there), the session ours. */
static struct proom *receiver_room(struct proom_table *t, const struct psess *s,
				   const struct kvs_wire_room *name, uint32_t *idx)
{
	struct kvsp_room_name n = core_name(name);
	int rc = kvsp_room_find(t->p, &n);
	if (rc < 0 && rc != -ECANCELED)
		return NULL;
	if (n.room >= t->n)
		return NULL;
	struct proom *r = &t->r[n.room];
	if (r->sess != s->id || r->gen != n.gen || r->from != KVS_WIRE_FROM_RECV)
		return NULL;
	*idx = n.room;
	return r;
}

/* ABORT and ENDED name the room from the speaker's side: from its sending
 * half (we hold the receiving one) or its receiving half. */
static struct proom *named_room(struct proom_table *t, const struct psess *s, uint32_t from,
				const struct kvs_wire_room *name, uint64_t ref, uint32_t *i)
{
	if (from == KVS_WIRE_FROM_SEND)
		return receiver_room(t, s, name, i);
	if (from == KVS_WIRE_FROM_RECV)
		return sender_room(t, s, ref, name, i);
	return NULL;
}

static void on_open(struct proom_table *t, struct psess *s, const struct kvs_wire_open *b)
{
	struct kvsp_room_name n = core_name(&b->room);
	int rc = kvsp_room_attach_peer(t->p, t->t, s->id, &n, le64toh(b->bytes),
				       le64toh(b->slot_size));
	if (rc < 0) {
		/* Said back on the frame's own terms: it may name a room of
		 * someone else's, whose record must not change. */
		struct kvs_wire_open_ack a = { .room = b->room,
					       .sender_ref = b->sender_ref,
					       .status = (int32_t)htole32(rc) };
		if (!refusal_push(owe_of(t, s), &a))
			ignored(t);
		return;
	}
	struct proom *r = &t->r[n.room];
	*r = (struct proom){ .gen = n.gen,
			     .sess = s->id,
			     .name = b->room,
			     .sender_ref = le64toh(b->sender_ref),
			     .from = KVS_WIRE_FROM_RECV,
			     .pend_head = NONE,
			     .pend_tail = NONE };
	owe(t, n.room, OWE_ACK);
}

static void on_open_ack(struct proom_table *t, struct psess *s, const struct kvs_wire_open_ack *b)
{
	uint32_t i;
	struct proom *r = sender_room(t, s, le64toh(b->sender_ref), &b->room, &i);
	if (!r || r->acked || !r->open_ns) {
		ignored(t); /* not asked, or answered already */
		return;
	}
	r->open_ns = 0;
	int status = (int32_t)le32toh((uint32_t)b->status);
	if (status > 0 || status < -4095)
		status = -EPROTO;
	if (status < 0) {
		r->sess = 0; /* there is no far half to tell anything */
		kvsp_room_peer_refused(t->p, t->t, s->id, i, r->gen, status);
		return;
	}
	/* The receiver said yes: the chunks that waited go out. */
	r->acked = true;
	while (r->pend_head != NONE) {
		uint32_t slot = r->pend_head;
		r->pend_head = t->xnext[slot];
		struct kvsp_xfer *x = kvsp_xfer_of(t->p, slot);
		int rc = carry(t, s, x, r);
		if (rc < 0)
			kvsp_xfer_quiesced(t->p, x, rc);
	}
	r->pend_tail = NONE;
}

static void on_abort(struct proom_table *t, struct psess *s, const struct kvs_wire_abort *b)
{
	uint32_t i;
	struct proom *r = named_room(t, s, le32toh(b->from), &b->room, le64toh(b->sender_ref), &i);
	int status = (int32_t)le32toh((uint32_t)b->status);
	if (status >= 0 || status < -4095)
		status = -ECANCELED;
	if (!r) {
		ignored(t);
		return;
	}
	int rc = kvsp_room_peer_abort(t->p, t->t, s->id, i, r->gen, status);
	if (rc == -EALREADY) {
		owe(t, i, OWE_ENDED); /* over here already: nothing of ours in flight */
	} else if (rc < 0) {
		ignored(t);
	} else if (!r->abort_ns) {
		r->abort_ns = kvsp_xport_now(t->p); /* its ENDED follows once it quiesced */
	}
}

static void on_ended(struct proom_table *t, struct psess *s, const struct kvs_wire_ended *b)
{
	uint32_t i;
	struct proom *r = named_room(t, s, le32toh(b->from), &b->room, le64toh(b->sender_ref), &i);
	if (!r) {
		ignored(t);
		return;
	}
	r->abort_ns = 0;
	kvsp_room_peer_ended(t->p, t->t, s->id, i, r->gen);
}

static void on_done(struct proom_table *t, struct psess *s, const struct kvs_wire_done *b)
{
	uint32_t i;
	struct proom *r = sender_room(t, s, le64toh(b->sender_ref), &b->room, &i);
	if (!r) {
		ignored(t);
		return;
	}
	kvsp_room_peer_done(t->p, t->t, s->id, i, r->gen);
}

int proom_on_frame(struct proom_table *t, struct psess *s, const struct kvsp_frame *f)
{
	switch (f->type) {
	case KVS_WIRE_OPEN:
		on_open(t, s, &f->body.open);
		return 0;
	case KVS_WIRE_OPEN_ACK:
		on_open_ack(t, s, &f->body.open_ack);
		return 0;
	case KVS_WIRE_ABORT:
		on_abort(t, s, &f->body.abort);
		return 0;
	case KVS_WIRE_ENDED:
		on_ended(t, s, &f->body.ended);
		return 0;
	case KVS_WIRE_DONE:
		on_done(t, s, &f->body.done);
		return 0;
	}
	return -EPROTO;
}

/* ------------------------------------------------------------ counts */

void proom_rooms_on(void *arg, const struct psess_table *st, unsigned rides[])
{
	struct proom_table *t = arg;
	memset(rides, 0, PSESS_MAX * sizeof(*rides));
	for (uint32_t i = 0; i < t->n; i++) {
		const struct proom *r = &t->r[i];
		unsigned k = r->sess & 0xff;
		if (r->sess && k < PSESS_MAX && st->s[k].id == r->sess &&
		    (r->on_owe || kvsp_room_live(t->p, i, r->gen)))
			rides[k]++;
	}
}

uint32_t proom_overdue(struct proom_table *t, uint64_t now, uint64_t timeout_ns)
{
	for (uint32_t i = 0; i < t->n; i++) {
		struct proom *r = &t->r[i];
		bool open_due = r->open_ns && now - r->open_ns > timeout_ns;
		bool ended_due = r->abort_ns && now - r->abort_ns > timeout_ns;
		if (!open_due && !ended_due)
			continue;
		r->open_ns = r->abort_ns = 0;
		/* Over here, or its session gone: nothing is owed any more. */
		if (kvsp_room_live(t->p, i, r->gen) && psess_get(t->sessions, r->sess))
			return r->sess;
	}
	return 0;
}
