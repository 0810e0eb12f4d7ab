/* SPDX-License-Identifier: MIT */
/*
 * Frames of a data path this proxy does not run (an RDMA frame to a build
 * without RDMA, or to a proxy without a device): the plane answers them by
 * what the wire says of their type (frame.h's KVSP_FRAME_ASKS, _ONCE), the
 * same for every data path, so that a build without one needs no stand-in
 * for it. It sits behind the data path interface, last, and carries nothing:
 *
 *   ASKS  (CHUNK_READ)  answered on stream 0 with a CHUNK_ACK -EOPNOTSUPP
 *                       naming the sender's transfer: it sends that chunk
 *                       another way. At most UNOWNED_OWED answers owed per
 *                       session: a peer asking more is out of protocol.
 *   ONCE  (RDMA_HELLO)  ignored the first time in a session; again is out
 *                       of protocol (no path here made it expect an answer).
 *   else  (CHUNK_ACK)   ignored: we asked nothing of the kind.
 */
#include "peer/unowned.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "core/xport.h"
#include "kvs_build.h"
#include "layout.h"
#include "peer/conn.h"
#include "peer/frame.h"
#include "peer/session.h"

#define UNOWNED_OWED 128 /* an RDMA sender's window (KVSP_RDMA_WINDOW) */

struct usess {
	uint32_t id;   /* the session this is about; another: stale, cleared first */
	uint64_t once; /* ONCE types heard, by bit */
	unsigned head, n;
	struct kvs_wire_chunk_ack acks[UNOWNED_OWED]; /* answers owed */
};

struct unowned {
	struct kvsp_dp dp;
	struct usess *us[PSESS_MAX]; /* made when a session first needs one */
};

static struct unowned *unowned_of(struct kvsp_dp *dp)
{
	return (struct unowned *)dp;
}

/* Returns s's state, made or cleared as needed, or NULL (out of memory). */
static struct usess *us_of(struct unowned *u, const struct psess *s)
{
	struct usess *us = u->us[s->idx];
	if (!us)
		us = u->us[s->idx] = malloc(sizeof(*us));
	if (us && us->id != s->id) {
		memset(us, 0, sizeof(*us));
		us->id = s->id;
	}
	return us;
}

static struct kvsp_dp *unowned_create(const struct kvsp_dp *base, const struct kvsp_peer_opts *o,
				      char *why, size_t len, int *err)
{
	(void)o;
	struct unowned *u = calloc(1, sizeof(*u));
	if (!u) {
		snprintf(why, len, "peer plane: out of memory");
		*err = -ENOMEM;
		return NULL;
	}
	u->dp = *base;
	return &u->dp;
}

static void unowned_destroy(struct kvsp_dp *dp)
{
	struct unowned *u = unowned_of(dp);
	for (unsigned i = 0; i < PSESS_MAX; i++)
		free(u->us[i]);
	free(u);
}

static int unowned_on_frame(struct kvsp_dp *dp, struct psess *s, struct pconn *c,
			    const struct kvsp_frame *f)
{
	const struct kvsp_frame_kind *k = kvsp_frame_kind(f->type);
	if (!k || !(k->flags & KVSP_FRAME_DATAPATH))
		return -EPROTO;
	if (k->flags & (KVSP_FRAME_ASKS | KVSP_FRAME_ONCE) && c->stream != 0)
		return -EPROTO; /* a data path's control goes on stream 0: that is its order */
	struct usess *us = us_of(unowned_of(dp), s);
	if (!us)
		return -ENOMEM;
	if (k->flags & KVSP_FRAME_ASKS) {
		if (us->n >= UNOWNED_OWED)
			return -EPROTO;
		const struct kvs_wire_chunk *b = &f->body.chunk; /* ASKS: a CHUNK's head */
		us->acks[(us->head + us->n++) % UNOWNED_OWED] = (struct kvs_wire_chunk_ack){
			.room = b->room,
			.chunk = b->chunk,
			.status = (int32_t)htole32((uint32_t)-EOPNOTSUPP),
			.xfer_ref = b->xfer_ref,
		};
		return 0;
	}
	if (k->flags & KVSP_FRAME_ONCE) {
		uint64_t bit = 1ull << f->type;
		if (us->once & bit)
			return -EPROTO;
		us->once |= bit;
		if (f->type == KVS_WIRE_RDMA_HELLO)
			LOG_INFO(
				"rdma: peer %s offers RDMA; this proxy has none (%s): chunks to it "
				"go by TCP",
				s->ep.text,
				KVS_HAVE_VERBS ? "no RDMA device"
					       : "libibverbs-dev missing at build time");
	}
	KVS_STAT_ADD(dp->st->peer_frames_ignored, 1);
	return 0;
}

static bool unowned_next_frame(struct kvsp_dp *dp, struct psess *s, struct pconn *c,
			       struct kvsp_dp_frame *out)
{
	struct usess *us = unowned_of(dp)->us[s->idx];
	if (c->stream != 0 || !us || us->id != s->id || !us->n)
		return false;
	if (out) {
		out->type = KVS_WIRE_CHUNK_ACK;
		out->body.chunk_ack = us->acks[us->head];
		us->head = (us->head + 1) % UNOWNED_OWED;
		us->n--;
	}
	return true;
}

static void unowned_sess_free(struct kvsp_dp *dp, struct psess *s)
{
	struct usess *us = unowned_of(dp)->us[s->idx];
	if (us && us->id == s->id)
		us->id = 0;
}

static void sess_nothing(struct kvsp_dp *dp, struct psess *s)
{
	(void)dp;
	(void)s;
}

static bool carries_nothing(const struct kvsp_dp *dp, const struct psess *s)
{
	(void)dp;
	(void)s;
	return false;
}

static int send_nothing(struct kvsp_dp *dp, struct psess *s, struct kvsp_xfer *x,
			const struct kvs_wire_room *room)
{
	(void)dp;
	(void)s;
	(void)x;
	(void)room;
	return -EOPNOTSUPP; /* never asked: it carries no session */
}

static void cancel_nothing(struct kvsp_dp *dp, uint32_t room, uint32_t gen)
{
	(void)dp;
	(void)room;
	(void)gen;
}

static bool quiesced(struct kvsp_dp *dp, struct psess *s)
{
	(void)dp;
	(void)s;
	return false; /* it touches no slot */
}

static int poll_nothing(struct kvsp_dp *dp)
{
	(void)dp;
	return KVSP_IDLE;
}

static bool nothing_pending(const struct kvsp_dp *dp)
{
	(void)dp;
	return false;
}

const struct kvsp_dp_ops kvsp_unowned = {
	.name = "unowned",
	.create = unowned_create,
	.destroy = unowned_destroy,
	.sess_up = sess_nothing,
	.carries = carries_nothing,
	.send = send_nothing,
	.cancel = cancel_nothing,
	.on_frame = unowned_on_frame,
	.next_frame = unowned_next_frame,
	.sess_quiesce = quiesced,
	.sess_free = unowned_sess_free,
	.poll = poll_nothing,
	.pending = nothing_pending,
};
