/* SPDX-License-Identifier: MIT */
/*
 * The RDMA data path of a build without libibverbs (meson_options.txt):
 * it carries nothing, and answers what peers with a device say exactly as
 * a proxy without a device does (datapath/rdma.c), so that the peer sends
 * by the stream: its RDMA_HELLO is ignored (once per session; twice is out
 * of protocol), a CHUNK_READ is answered "not supported", and an ack for a
 * READ we never asked for is ignored.
 */
#include <endian.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/xport.h"
#include "base/log.h"
#include "datapath/datapath.h"
#include "peer/conn.h"
#include "peer/peer.h"
#include "peer/session.h"

struct nsess {
	uint32_t id; /* the session this is about; another: stale, cleared first */
	unsigned hellos;
	unsigned nack_head, nnacks;
	struct kvs_wire_chunk_ack nacks[KVSP_RDMA_WINDOW]; /* CHUNK_READs refused, acks owed */
};

struct no_rdma {
	struct kvsp_dp dp;
	struct nsess ns[PSESS_MAX];
};

static struct nsess *ns_of(struct no_rdma *n, const struct psess *s)
{
	struct nsess *ns = &n->ns[s->idx];
	if (ns->id != s->id) {
		memset(ns, 0, sizeof(*ns));
		ns->id = s->id;
	}
	return ns;
}

static struct kvsp_dp *no_rdma_create(const struct kvsp_dp *base, const struct kvsp_peer_opts *o,
				      char *why, size_t len, int *err)
{
	*err = 0;
	struct no_rdma *n = calloc(1, sizeof(*n));
	if (!n) {
		snprintf(why, len, "rdma data path: out of memory");
		*err = -ENOMEM;
		return NULL;
	}
	n->dp = *base;
	/* kvstaged refused every RDMA option: only auto and tcp (the stream) come here. */
	if (o->data == KVSP_DATA_STREAM)
		LOG_INFO("peers: chunks by TCP (--transport tcp)");
	else
		LOG_INFO("peers: chunks by TCP (this build has no RDMA: libibverbs-dev missing at "
			 "build time)");
	return &n->dp;
}

static void no_rdma_destroy(struct kvsp_dp *dp)
{
	free(dp);
}

static bool no_rdma_carries(const struct kvsp_dp *dp, const struct psess *s)
{
	(void)dp;
	(void)s;
	return false;
}

static int no_rdma_send(struct kvsp_dp *dp, struct psess *s, struct kvsp_xfer *x,
			const struct kvs_wire_room *room)
{
	(void)dp;
	(void)s;
	(void)x;
	(void)room;
	return -EOPNOTSUPP; /* never asked: it carries no session */
}

static void no_rdma_cancel(struct kvsp_dp *dp, uint32_t room, uint32_t gen)
{
	(void)dp;
	(void)room;
	(void)gen;
}

static int no_rdma_on_frame(struct kvsp_dp *dp, struct psess *s, struct pconn *c,
			    const struct kvsp_frame *f)
{
	struct no_rdma *n = (struct no_rdma *)dp;
	struct nsess *ns = ns_of(n, s);
	if (c->stream != 0)
		return -EPROTO; /* RDMA control goes on stream 0: that is its order */
	switch (f->type) {
	case KVS_WIRE_RDMA_HELLO: {
		const struct kvs_wire_rdma_hello *b = &f->body.rdma_hello;
		uint64_t addr = le64toh(b->pool_addr), plen = le64toh(b->pool_len);
		if (addr + plen < addr || ++ns->hellos > 1)
			return -EPROTO; /* a pool that wraps, or a HELLO again: out of protocol */
		KVS_STAT_ADD(dp->st->peer_frames_ignored, 1);
		LOG_INFO("rdma: peer %s offers RDMA; this build has no RDMA (libibverbs-dev "
			 "missing at "
			 "build time): chunks to it go by TCP",
			 s->ep.text);
		return 0;
	}
	case KVS_WIRE_CHUNK_READ: {
		const struct kvs_wire_chunk_read *b = &f->body.chunk_read;
		/* The sender keeps at most a window unacknowledged. */
		if (ns->nnacks >= KVSP_RDMA_WINDOW)
			return -EPROTO;
		ns->nacks[(ns->nack_head + ns->nnacks++) % KVSP_RDMA_WINDOW] =
			(struct kvs_wire_chunk_ack){ .room = b->room,
						     .chunk = b->chunk,
						     .status = (int32_t)htole32(
							     (uint32_t)-EOPNOTSUPP),
						     .xfer_ref = b->xfer_ref };
		return 0;
	}
	case KVS_WIRE_CHUNK_ACK:
		KVS_STAT_ADD(dp->st->peer_frames_ignored, 1); /* we sent no CHUNK_READ */
		return 0;
	}
	return -EPROTO;
}

static bool no_rdma_next_frame(struct kvsp_dp *dp, struct psess *s, struct pconn *c,
			       struct kvsp_dp_frame *out)
{
	struct no_rdma *n = (struct no_rdma *)dp;
	struct nsess *ns = &n->ns[s->idx];
	if (c->stream != 0 || ns->id != s->id || !ns->nnacks)
		return false;
	if (out) {
		out->type = KVS_WIRE_CHUNK_ACK;
		out->body.chunk_ack = ns->nacks[ns->nack_head];
		ns->nack_head = (ns->nack_head + 1) % KVSP_RDMA_WINDOW;
		ns->nnacks--;
	}
	return true;
}

static bool no_rdma_sess_quiesce(struct kvsp_dp *dp, struct psess *s)
{
	(void)dp;
	(void)s;
	return false; /* no hardware touches our slots */
}

static void no_rdma_sess_free(struct kvsp_dp *dp, struct psess *s)
{
	struct no_rdma *n = (struct no_rdma *)dp;
	if (n->ns[s->idx].id == s->id)
		memset(&n->ns[s->idx], 0, sizeof(n->ns[s->idx]));
}

static int no_rdma_poll(struct kvsp_dp *dp)
{
	(void)dp;
	return KVSP_IDLE;
}

static bool no_rdma_pending(const struct kvsp_dp *dp)
{
	(void)dp;
	return false;
}

static void no_rdma_sess_up(struct kvsp_dp *dp, struct psess *s)
{
	(void)dp;
	(void)s;
}

static const uint16_t rdma_types[] = { KVS_WIRE_RDMA_HELLO, KVS_WIRE_CHUNK_READ, KVS_WIRE_CHUNK_ACK,
				       0 };

const struct kvsp_dp_ops kvsp_dp_rdma = {
	.name = "rdma",
	.types = rdma_types,
	.create = no_rdma_create,
	.destroy = no_rdma_destroy,
	.sess_up = no_rdma_sess_up,
	.carries = no_rdma_carries,
	.send = no_rdma_send,
	.cancel = no_rdma_cancel,
	.on_frame = no_rdma_on_frame,
	.next_frame = no_rdma_next_frame,
	.sess_quiesce = no_rdma_sess_quiesce,
	.sess_free = no_rdma_sess_free,
	.poll = no_rdma_poll,
	.pending = no_rdma_pending,
};
