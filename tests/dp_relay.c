/* SPDX-License-Identifier: MIT */
/*
 * relay: a data path that lives in this one file, the proof that a data
 * path is a module (peer/datapath.h). tests/meson.build adds it to the
 * list of kvstaged-relay, a test-only kvstaged; the conformance suite runs
 * every scenario through it (two proxies with --relay-chunks).
 *
 * It declares what a data path brings: an option (--relay-chunks: carry
 * every session's chunks; both ends need it), a frame type of its own
 * outside the protocol (RELAY_CHUNK, 48: a CHUNK's body, the payload
 * behind it, always with its CRC32C), a counter (relay_chunks: chunks it
 * landed) and a failpoint (relay.land: a received chunk whose bytes are
 * all in its posted slot waits before it lands, as a slow completion
 * would).
 *
 *   sending:   a session's chunks queue in order and go on its last
 *              stream; quiesced once the payload left the slot; one still
 *              queued when its room aborts never leaves.
 *   receiving: the slot is posted when the frame arrives (the core checks
 *              room, generation, token and chunk), the payload is read
 *              into it, its CRC checked, then it lands; when its room
 *              aborts while it is held at relay.land it is discarded, and
 *              a held chunk of a lost session is the core's to end.
 */
#include <endian.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/counters.h"
#include "core/failpoint.h"
#include "core/xport.h"
#include "layout.h"
#include "peer/conn.h"
#include "peer/datapath.h"
#include "peer/frame.h"
#include "peer/peer.h"
#include "peer/session.h"

#define RELAY_CHUNK 48
#define NONE UINT32_MAX

struct relay_conf {
	bool on; /* --relay-chunks */
};

struct rq {
	uint32_t id; /* the session this is about; another: stale */
	uint32_t head, tail;
};

struct relay {
	struct kvsp_dp dp;
	uint32_t *next;		    /* by slot: queued chunks to send, held chunks */
	struct kvs_wire_room *room; /* by slot: the receiving room of a queued chunk */
	struct rq q[PSESS_MAX];	    /* chunks to send, per session */
	uint32_t held_head, held_tail;
};

static struct relay *relay_of(struct kvsp_dp *dp)
{
	return (struct relay *)dp;
}

static int opt_on(void *conf, const char *val, const char **why)
{
	(void)val;
	(void)why;
	((struct relay_conf *)conf)->on = true;
	return 0;
}

static const struct kvsp_dp_opt relay_opts[] = {
	{ "relay-chunks", NULL,
	  "carry every peer's chunks by the relay data path\n"
	  "(a test's: both ends need it)",
	  opt_on },
	{ 0 },
};

static void relay_conf_init(void *conf)
{
	*(struct relay_conf *)conf = (struct relay_conf){ .on = false };
}

static struct kvsp_dp *relay_create(const struct kvsp_dp *base, const struct kvsp_peer_opts *o,
				    char *why, size_t len, int *err)
{
	(void)o;
	const struct relay_conf *c = base->conf;
	if (!c->on)
		return NULL; /* not asked for: the next data path carries */
	struct relay *r = calloc(1, sizeof(*r));
	uint32_t slots = kvsp_slot_count(base->p);
	if (r) {
		r->dp = *base;
		r->next = calloc(slots, sizeof(*r->next));
		r->room = calloc(slots, sizeof(*r->room));
		r->held_head = r->held_tail = NONE;
	}
	if (!r || !r->next || !r->room) {
		if (r) {
			free(r->next);
			free(r->room);
		}
		free(r);
		snprintf(why, len, "relay data path: out of memory");
		*err = -ENOMEM;
		return NULL;
	}
	return &r->dp;
}

static void relay_destroy(struct kvsp_dp *dp)
{
	struct relay *r = relay_of(dp);
	free(r->next);
	free(r->room);
	free(r);
}

static struct rq *rq_of(struct relay *r, const struct psess *s)
{
	struct rq *q = &r->q[s->idx];
	if (q->id != s->id)
		*q = (struct rq){ .id = s->id, .head = NONE, .tail = NONE };
	return q;
}

static void sess_nothing(struct kvsp_dp *dp, struct psess *s)
{
	(void)dp;
	(void)s;
}

static bool relay_carries(const struct kvsp_dp *dp, const struct psess *s)
{
	(void)dp;
	(void)s;
	return true;
}

/* ------------------------------------------------------------- sending */

static int relay_send(struct kvsp_dp *dp, struct psess *s, struct kvsp_xfer *x,
		      const struct kvs_wire_room *room)
{
	struct relay *r = relay_of(dp);
	struct rq *q = rq_of(r, s);
	r->room[x->slot] = *room;
	r->next[x->slot] = NONE;
	if (q->tail != NONE)
		r->next[q->tail] = x->slot;
	else
		q->head = x->slot;
	q->tail = x->slot;
	return 0;
}

static bool relay_next_frame(struct kvsp_dp *dp, struct psess *s, struct pconn *c,
			     struct kvsp_dp_frame *out)
{
	struct relay *r = relay_of(dp);
	struct rq *q = rq_of(r, s);
	if (c != s->conn[s->nstreams - 1] || q->head == NONE)
		return false;
	if (!out)
		return true;
	uint32_t slot = q->head;
	q->head = r->next[slot];
	if (q->head == NONE)
		q->tail = NONE;
	struct kvsp_xfer *x = kvsp_xfer_of(dp->p, slot);
	const uint8_t *src = kvsp_slot_mem(dp->p, slot);
	out->type = RELAY_CHUNK;
	out->body.chunk = (struct kvs_wire_chunk){
		.room = r->room[slot],
		.chunk = htole32(x->chunk),
		.len = htole32(x->len),
		.xfer_ref = htole64((uint64_t)x->epoch << 32 | x->slot),
		.crc32c = htole32(kvsp_crc32c(src, x->len, 0)),
		.flags = htole32(KVS_WIRE_CHUNK_CRC),
	};
	out->payload = src;
	out->plen = x->len;
	out->x = x;
	return true;
}

static void relay_sent(struct kvsp_dp *dp, struct psess *s, struct kvsp_xfer *x)
{
	(void)s;
	kvsp_xfer_quiesced(dp->p, x, 0); /* every byte left the slot */
}

/* ----------------------------------------------------------- receiving */

static int relay_on_frame(struct kvsp_dp *dp, struct psess *s, struct pconn *c,
			  const struct kvsp_frame *f)
{
	const struct kvs_wire_chunk *b = &f->body.chunk;
	if (!(le32toh(b->flags) & KVS_WIRE_CHUNK_CRC))
		return -EPROTO; /* relay always sends one */
	struct kvsp_room_name n = { le32toh(b->room.room), le32toh(b->room.gen), { 0 } };
	memcpy(n.token, b->room.token, sizeof(n.token));
	int rc = kvsp_room_find(dp->p, &n);
	struct kvsp_xfer *x = NULL;
	void *dst = NULL;
	if (rc >= 0)
		rc = kvsp_chunk_post(dp->p, dp->t, s->id, n.room, n.gen, le32toh(b->chunk), f->plen,
				     &x, &dst);
	if (rc >= 0)
		pconn_payload_into(c, x, dst, f->plen, true, le32toh(b->crc32c));
	if (!f->plen)
		kvsp_chunk_sunk(dp->p); /* a chunk is never empty: nothing to read, counted */
	return 0;
}

static void land(struct relay *r, struct kvsp_xfer *x);

static void relay_payload_end(struct kvsp_dp *dp, struct psess *s, struct pconn *c)
{
	struct relay *r = relay_of(dp);
	struct kvsp_xfer *x = c->rx_x;
	(void)s;
	c->rx_x = NULL;
	if (c->rx_ended)
		return; /* its room aborted mid-payload: discarded then */
	if (!x || !c->rx_dst) {
		kvsp_chunk_sunk(dp->p);
	} else if (c->rx_crc != c->rx_want_crc) {
		kvsp_chunk_discard(dp->p, x, -EBADMSG);
	} else if (kvsp_xport_fp(dp->p, dp->fp, x->room) == KVSP_FP_HOLD) {
		r->next[x->slot] = NONE; /* test barrier: its bytes are in, it lands later */
		if (r->held_tail != NONE)
			r->next[r->held_tail] = x->slot;
		else
			r->held_head = x->slot;
		r->held_tail = x->slot;
	} else {
		land(r, x);
	}
}

/* Drops from the held list the chunks keep() refuses, ending each with end(). */
static void held_filter(struct relay *r, bool (*keep)(const struct kvsp_xfer *x, const void *arg),
			const void *arg, void (*end)(struct relay *r, struct kvsp_xfer *x))
{
	uint32_t *at = &r->held_head, prev = NONE;
	while (*at != NONE) {
		uint32_t slot = *at;
		struct kvsp_xfer *x = kvsp_xfer_of(r->dp.p, slot);
		if (keep(x, arg)) {
			prev = slot;
			at = &r->next[slot];
			continue;
		}
		*at = r->next[slot];
		if (r->held_tail == slot)
			r->held_tail = prev;
		if (end)
			end(r, x);
	}
}

/* ------------------------------------------------------------- aborts */

struct room_gen {
	uint32_t room, gen;
};

static bool other_room(const struct kvsp_xfer *x, const void *arg)
{
	const struct room_gen *rg = arg;
	return x->room != rg->room || x->room_gen != rg->gen;
}

static void discard(struct relay *r, struct kvsp_xfer *x)
{
	kvsp_chunk_discard(r->dp.p, x, -ECANCELED);
}

static void relay_cancel(struct kvsp_dp *dp, uint32_t room, uint32_t gen)
{
	struct relay *r = relay_of(dp);
	struct room_gen rg = { room, gen };
	held_filter(r, other_room, &rg, discard);
	for (unsigned i = 0; i < PSESS_MAX; i++) {
		struct rq *q = &r->q[i];
		uint32_t *at = &q->head, prev = NONE;
		while (q->id && *at != NONE) {
			uint32_t slot = *at;
			struct kvsp_xfer *x = kvsp_xfer_of(dp->p, slot);
			if (x->room != room || x->room_gen != gen) {
				prev = slot;
				at = &r->next[slot];
				continue;
			}
			*at = r->next[slot];
			if (q->tail == slot)
				q->tail = prev;
			kvsp_xfer_quiesced(dp->p, x, -ECANCELED); /* never left its slot */
		}
	}
}

static bool quiesced(struct kvsp_dp *dp, struct psess *s)
{
	(void)dp;
	(void)s;
	return false; /* its sockets are closed: nothing of ours reads or writes a slot */
}

static bool other_sess(const struct kvsp_xfer *x, const void *arg)
{
	return x->peer != *(const uint32_t *)arg;
}

/* s is gone: its chunks, queued or held, are the core's to end. */
static void relay_sess_free(struct kvsp_dp *dp, struct psess *s)
{
	struct relay *r = relay_of(dp);
	held_filter(r, other_sess, &s->id, NULL);
	if (r->q[s->idx].id == s->id)
		r->q[s->idx].id = 0;
}

/* --------------------------------------------------------------- poll */

static bool relay_pending(const struct kvsp_dp *dp)
{
	const struct relay *r = (const struct relay *)dp;
	int err;
	return r->held_head != NONE && kvsp_xport_fp_action(dp->p, dp->fp, &err) != KVS_FP_PAUSE;
}

static bool none(const struct kvsp_xfer *x, const void *arg)
{
	(void)x;
	(void)arg;
	return false;
}

static void land(struct relay *r, struct kvsp_xfer *x)
{
	if (kvsp_chunk_land(r->dp.p, x) == 0)
		KVS_STAT_ADD(r->dp.ctr[0], 1);
}

/* Chunks held at relay.land land once it lets go. */
static int relay_poll(struct kvsp_dp *dp)
{
	if (!relay_pending(dp))
		return KVSP_IDLE;
	held_filter(relay_of(dp), none, NULL, land);
	return KVSP_BUSY;
}

static const struct kvsp_dp_frame_type relay_frames[] = {
	{ RELAY_CHUNK, sizeof(struct kvs_wire_chunk), KVSP_FRAME_PAYLOAD },
	{ 0, 0, 0 },
};

static const char *const relay_failpoints[] = { "relay.land", NULL };

static const struct kvsp_counter_def relay_counters[] = {
	{ "relay_chunks", "kvstage_relay_chunks_total", "Chunks the relay data path landed.",
	  false },
	{ 0 },
};

const struct kvsp_dp_ops kvsp_dp_relay = {
	.name = "relay",
	.frames = relay_frames,
	.opts = relay_opts,
	.conf_size = sizeof(struct relay_conf),
	.conf_init = relay_conf_init,
	.failpoints = relay_failpoints,
	.counters = relay_counters,
	.create = relay_create,
	.destroy = relay_destroy,
	.sess_up = sess_nothing,
	.carries = relay_carries,
	.send = relay_send,
	.cancel = relay_cancel,
	.on_frame = relay_on_frame,
	.payload_end = relay_payload_end,
	.next_frame = relay_next_frame,
	.sent = relay_sent,
	.sess_quiesce = quiesced,
	.sess_free = relay_sess_free,
	.poll = relay_poll,
	.pending = relay_pending,
};
