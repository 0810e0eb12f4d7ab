/* SPDX-License-Identifier: MIT */
/*
 * The stream data path: a chunk is a CHUNK frame on one of the session's
 * connections (round robin), its payload right behind it, written
 * straight from the sender's slot and read straight into the slot the
 * receiver posts for it (or into the sink, when the fence says no). It
 * carries every session: the last data path asked.
 *
 *   sending:   quiesced once every payload byte left the slot (the socket
 *              has its copy; with --tcp-zerocopy, the kernel said it is
 *              done reading the slot); a chunk still queued when its room
 *              aborts never leaves (quiesced -ECANCELED).
 *   receiving: the slot is posted when the header arrives (room,
 *              generation, token, chunk checked by the core) and lands or
 *              is discarded when the payload is all in; when its room
 *              aborts meanwhile, the rest goes to the sink at once and the
 *              slot comes back, so a stalled peer holds nothing.
 */
#include <endian.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/failpoint.h"
#include "core/xport.h"
#include "base/log.h"
#include "datapath/datapath.h"
#include "layout.h"
#include "peer/conn.h"
#include "peer/peer.h"
#include "peer/session.h"

struct stream {
	struct kvsp_dp dp;
	bool checksum;		    /* --tcp-checksum: a CRC32C of every payload we send */
	bool held;		    /* some connection's payload waits at tcp.payload */
	uint32_t *xnext;	    /* chunk queues through slot indices */
	struct kvs_wire_room *room; /* by slot: the receiving room of the chunk queued there */
};

static struct stream *stream_of(struct kvsp_dp *dp)
{
	return (struct stream *)dp;
}

static struct kvsp_dp *stream_create(const struct kvsp_dp *base, const struct kvsp_peer_opts *o,
				     char *why, size_t len, int *err)
{
	struct stream *st = calloc(1, sizeof(*st));
	uint32_t slots = kvsp_slot_count(base->p);
	if (st) {
		st->dp = *base;
		st->checksum = o->checksum;
		st->xnext = calloc(slots, sizeof(*st->xnext));
		st->room = calloc(slots, sizeof(*st->room));
	}
	if (!st || !st->xnext || !st->room) {
		if (st) {
			free(st->xnext);
			free(st->room);
		}
		free(st);
		snprintf(why, len, "stream data path: out of memory");
		*err = -ENOMEM;
		return NULL;
	}
	return &st->dp;
}

static void stream_destroy(struct kvsp_dp *dp)
{
	struct stream *st = stream_of(dp);
	free(st->xnext);
	free(st->room);
	free(st);
}

static void sess_nothing(struct kvsp_dp *dp, struct psess *s)
{
	(void)dp;
	(void)s;
}

static bool stream_carries(const struct kvsp_dp *dp, const struct psess *s)
{
	(void)dp;
	(void)s;
	return true;
}

/* ------------------------------------------------------------- sending */

static int stream_send(struct kvsp_dp *dp, struct psess *s, struct kvsp_xfer *x,
		       const struct kvs_wire_room *room)
{
	struct stream *st = stream_of(dp);
	struct pconn *c = s->conn[s->rr++ % s->nstreams];
	if (!c)
		return -ECONNRESET;
	st->room[x->slot] = *room;
	st->xnext[x->slot] = PCONN_NONE;
	if (c->q_tail != PCONN_NONE)
		st->xnext[c->q_tail] = x->slot;
	else
		c->q_head = x->slot;
	c->q_tail = x->slot;
	c->qn++;
	return 0;
}

static bool stream_next_frame(struct kvsp_dp *dp, struct psess *s, struct pconn *c,
			      struct kvsp_dp_frame *out)
{
	struct stream *st = stream_of(dp);
	(void)s;
	if (!c->qn)
		return false;
	if (!out)
		return true;
	uint32_t slot = c->q_head;
	c->q_head = st->xnext[slot];
	if (c->q_head == PCONN_NONE)
		c->q_tail = PCONN_NONE;
	c->qn--;
	struct kvsp_xfer *x = kvsp_xfer_of(dp->p, slot);
	const uint8_t *src = kvsp_slot_mem(dp->p, slot);
	struct kvs_wire_chunk b = {
		.room = st->room[slot],
		.chunk = htole32(x->chunk),
		.len = htole32(x->len),
		.xfer_ref = htole64((uint64_t)x->epoch << 32 | x->slot),
	};
	if (st->checksum) {
		b.crc32c = htole32(kvsp_crc32c(src, x->len, 0));
		b.flags = htole32(KVS_WIRE_CHUNK_CRC);
	}
	out->type = KVS_WIRE_CHUNK;
	out->body.chunk = b;
	out->payload = src;
	out->plen = x->len;
	out->x = x;
	/* Test barrier: the header goes, the payload waits (and, as the
	 * batch's last, so does every frame after it). */
	if (kvsp_xport_fp(dp->p, KVSP_FP_TCP_PAYLOAD, x->room) == KVSP_FP_HOLD)
		c->tx_held = st->held = true;
	return true;
}

static void stream_sent(struct kvsp_dp *dp, struct psess *s, struct kvsp_xfer *x)
{
	(void)s;
	kvsp_xfer_quiesced(dp->p, x, 0); /* every byte left the slot */
}

/* ----------------------------------------------------------- receiving */

static int stream_on_frame(struct kvsp_dp *dp, struct psess *s, struct pconn *c,
			   const struct kvsp_frame *f)
{
	const struct kvs_wire_chunk *b = &f->body.chunk;
	struct kvsp_room_name n = { le32toh(b->room.room), le32toh(b->room.gen), { 0 } };
	memcpy(n.token, b->room.token, sizeof(n.token));
	/* The core checks the name (a wrong token is counted there), that
	 * this session carries the room, and the chunk; else the sink. */
	int rc = kvsp_room_find(dp->p, &n);
	struct kvsp_xfer *x = NULL;
	void *dst = NULL;
	if (rc >= 0)
		rc = kvsp_chunk_post(dp->p, dp->t, s->id, n.room, n.gen, le32toh(b->chunk), f->plen,
				     &x, &dst);
	if (rc >= 0)
		pconn_payload_into(c, x, dst, f->plen, le32toh(b->flags) & KVS_WIRE_CHUNK_CRC,
				   le32toh(b->crc32c));
	else
		LOG_DEBUG("peer %s: chunk %u of room %u into the sink: %s", s->ep.text,
			  le32toh(b->chunk), n.room, strerror(-rc));
	if (!f->plen)
		kvsp_chunk_sunk(dp->p); /* a chunk is never empty: nothing to read, counted */
	return 0;
}

static void stream_payload_end(struct kvsp_dp *dp, struct psess *s, struct pconn *c)
{
	struct kvsp_xfer *x = c->rx_x;
	c->rx_x = NULL;
	if (c->rx_ended)
		return; /* its room aborted mid-payload: discarded (and counted) then */
	if (!x || !c->rx_dst) {
		kvsp_chunk_sunk(dp->p);
		KVS_STAT_ADD(s->pub->chunks_sunk, 1);
	} else if (c->rx_has_crc && c->rx_crc != c->rx_want_crc) {
		KVS_STAT_ADD(dp->st->peer_crc_errors, 1);
		kvsp_chunk_discard(dp->p, x, -EBADMSG);
	} else {
		kvsp_chunk_land(dp->p, x);
	}
}

/* ------------------------------------------------------------- aborts */

static void stream_cancel(struct kvsp_dp *dp, uint32_t room, uint32_t gen)
{
	struct stream *st = stream_of(dp);
	struct pconn_table *ct = dp->conns;
	for (unsigned i = 0; i < ct->hi; i++) {
		struct pconn *c = &ct->conn[i];
		if (c->state != PCONN_UP)
			continue;
		/* Being received: the rest of it goes to the sink, and its slot
		 * comes back now (our own recv() is the only writer). */
		if (c->rx_x && c->rx_x->room == room && c->rx_x->room_gen == gen)
			kvsp_chunk_discard(dp->p, pconn_payload_to_sink(c), -ECANCELED);
		/* Queued to be sent: never leaves its slot. (One sealed into the
		 * connection's batch finishes, at most PCONN_TX_FRAMES of them: its
		 * frame's seq is spent, the peer reads its length whole, and it
		 * quiesces then.) */
		uint32_t *at = &c->q_head, prev = PCONN_NONE;
		while (*at != PCONN_NONE) {
			uint32_t slot = *at;
			struct kvsp_xfer *x = kvsp_xfer_of(dp->p, slot);
			if (x->room != room || x->room_gen != gen) {
				prev = slot;
				at = &st->xnext[slot];
				continue;
			}
			*at = st->xnext[slot];
			if (c->q_tail == slot)
				c->q_tail = prev;
			c->qn--;
			kvsp_xfer_quiesced(dp->p, x, -ECANCELED);
		}
	}
}

static bool stream_sess_quiesce(struct kvsp_dp *dp, struct psess *s)
{
	/* Its sockets are closed, but for those the kernel still reads slot
	 * bytes from (zerocopy sends): their answers, then. */
	if (!dp->conns->nzombies)
		return false;
	/* (test barrier: at tcp.zc_notify the answers wait unread) */
	bool read = kvsp_xport_fp_ud(dp->p, KVSP_FP_TCP_ZC_NOTIFY, 0) != KVSP_FP_HOLD;
	return pconn_zombies_reap(dp->conns, s->id, read) > 0;
}

/* Overdue: a kernel that has not answered for bytes it dropped at the purge
 * in a peer timeout never will (its NIC is gone); the pins go with them. */
static void stream_sess_force(struct kvsp_dp *dp, struct psess *s)
{
	pconn_zombies_close(dp->conns, s->id);
}

/* --------------------------------------------------------------- poll */

static bool stream_pending(const struct kvsp_dp *dp)
{
	const struct stream *st = (const struct stream *)dp;
	int err;
	return st->held && kvsp_xport_fp_action(dp->p, KVSP_FP_TCP_PAYLOAD, &err) != KVS_FP_PAUSE;
}

/* Payloads held at tcp.payload go once it lets go. */
static int stream_poll(struct kvsp_dp *dp)
{
	struct stream *st = stream_of(dp);
	if (!stream_pending(dp))
		return KVSP_IDLE; /* every real run: nothing held */
	for (unsigned i = 0; i < dp->conns->hi; i++)
		dp->conns->conn[i].tx_held = false;
	st->held = false;
	return KVSP_BUSY;
}

static const struct kvsp_dp_frame_type stream_frames[] = { { KVS_WIRE_CHUNK, 0, 0 }, { 0, 0, 0 } };

const struct kvsp_dp_ops kvsp_dp_stream = {
	.name = "stream",
	.frames = stream_frames,
	.create = stream_create,
	.destroy = stream_destroy,
	.sess_up = sess_nothing,
	.carries = stream_carries,
	.send = stream_send,
	.cancel = stream_cancel,
	.on_frame = stream_on_frame,
	.payload_end = stream_payload_end,
	.next_frame = stream_next_frame,
	.sent = stream_sent,
	.sess_quiesce = stream_sess_quiesce,
	.sess_force = stream_sess_force,
	.sess_free = sess_nothing,
	.poll = stream_poll,
	.pending = stream_pending,
};
