/* SPDX-License-Identifier: MIT */
/*
 * The chunks we pull by RDMA READ: the receiver posts a slot for the chunk
 * (kvsp_chunk_post: room, generation and token checked), READs into it
 * with the chunk's own key, and on the READ's completion owes CHUNK_ACK;
 * the chunk lands (the fence decides again) as the ack is sealed. A slot
 * is never reused while a READ of ours may still write it: an aborted
 * room's slot stays a tombstone until the completion (success or flush)
 * has been reaped.
 *
 * A READ that fails while the session lives (the sender's NIC refused it:
 * an abort revoked its key on the way) takes the queue pair with it: each
 * READ then flushed gives its slot back unwritten (kvsp_chunk_unpost) and
 * is answered -EOPNOTSUPP, so the sender sends that chunk by the stream.
 */
#include <endian.h>
#include <errno.h>
#include <string.h>

#include "core/failpoint.h"
#include "core/xport.h"
#include "datapath/rdma.h"
#include "layout.h"

static void list_add(struct rdma *r, uint32_t *head, uint32_t *tail, uint32_t slot)
{
	r->rread[slot].next = NONE;
	if (*tail != NONE)
		r->rread[*tail].next = slot;
	else
		*head = slot;
	*tail = slot;
}

static void nack(struct rsess *rs, const struct kvs_wire_room *room, uint32_t chunk, uint64_t ref,
		 int status)
{
	struct kvs_wire_chunk_ack a = { .room = *room,
					.chunk = htole32(chunk),
					.status = (int32_t)htole32((uint32_t)status),
					.xfer_ref = htole64(ref) };
	rs->nacks[(rs->nack_head + rs->nnacks++) % WINDOW] = a;
}

/* Our READ into slot never wrote it and never will, while the session
 * lives: the slot goes back, and the sender sends the chunk by the stream
 * (unless its room is over here: then it is discarded, and said so). */
static void resend_by_stream(struct rdma *r, struct rsess *rs, uint32_t slot)
{
	struct rread *rr = &r->rread[slot];
	bool again = kvsp_chunk_unpost(r->dp.p, kvsp_xfer_of(r->dp.p, slot));
	nack(rs, &rr->name, rr->chunk, rr->sender_ref, again ? -EOPNOTSUPP : -ECANCELED);
}

/* Posts the READ recorded for our slot. One that cannot be posted breaks
 * the queue pair (it is full or failed): its chunk comes by the stream. */
static void post(struct rdma *r, struct rsess *rs, uint32_t slot)
{
	struct rread *rr = &r->rread[slot];
	bool usable = rs_usable(rs);
	if (usable && kvsp_verbs_read(&r->verbs, rs->qp, wr_id(WR_READ, slot, rs->id), rr->dst,
				      rr->len, rr->raddr, rr->rkey) == 0) {
		rs_posted(r, rs);
		return;
	}
	rs->out--;
	resend_by_stream(r, rs, slot);
	if (usable)
		rs_break(r, rs, RS_POST_FAILED);
}

int rrecv_on_read(struct rdma *r, struct psess *s, const struct kvs_wire_chunk_read *b)
{
	struct kvsp_dp *dp = &r->dp;
	struct rsess *rs = rs_of(r, s);
	/* The sender keeps at most a window unacknowledged: more is a peer
	 * out of protocol, and we owe no ack we cannot hold. */
	if (rs->out + rs->nnacks >= WINDOW)
		return -EPROTO;
	uint32_t len = le32toh(b->len), chunk = le32toh(b->chunk);
	uint64_t off = le64toh(b->offset), ref = le64toh(b->xfer_ref);
	if (!rs->heard || !rs_usable(rs)) {
		/* We cannot READ (no queue pair, or it failed): by the stream. */
		nack(rs, &b->room, chunk, ref, -EOPNOTSUPP);
		return 0;
	}
	if (!len || len > kvsp_slot_size(dp->p) || off > rs->peer.pool_len ||
	    len > rs->peer.pool_len - off || le32toh(b->rail) != r->rail)
		return -EPROTO;
	struct kvsp_room_name n = { le32toh(b->room.room), le32toh(b->room.gen), { 0 } };
	memcpy(n.token, b->room.token, sizeof(n.token));
	struct kvsp_xfer *x;
	void *dst;
	int rc = kvsp_room_find(dp->p, &n);
	if (rc >= 0)
		rc = kvsp_chunk_post(dp->p, dp->t, s->id, n.room, n.gen, chunk, len, &x, &dst);
	if (rc < 0) {
		kvsp_chunk_sunk(dp->p); /* refused: counted, nothing read */
		nack(rs, &b->room, chunk, ref, rc);
		return 0;
	}
	struct rread *rr = &r->rread[x->slot];
	*rr = (struct rread){ .name = b->room,
			      .sender_ref = ref,
			      .sess = s->id,
			      .chunk = chunk,
			      .next = NONE,
			      .len = len,
			      .rkey = le32toh(b->rkey),
			      .dst = dst,
			      .raddr = rs->peer.pool_addr + off };
	rs->out++;
	if (kvsp_xport_fp(dp->p, dp->fp + RDMA_FP_READ, n.room) == KVSP_FP_HOLD) {
		/* Test barrier: the slot is posted, the READ waits (as a slow one would). */
		list_add(r, &rs->held_head, &rs->held_tail, x->slot);
		r->nheld++;
		return 0;
	}
	post(r, rs, x->slot);
	return 0;
}

void rrecv_read_done(struct rdma *r, struct rsess *rs, uint32_t slot, const struct ibv_wc *wc)
{
	struct kvsp_dp *dp = &r->dp;
	rs_completed(r, rs, wc);
	struct rread *rr = &r->rread[slot];
	if (rr->sess != rs->id)
		return;
	rs->out--;
	struct kvsp_xfer *x = kvsp_xfer_of(dp->p, slot);
	if (wc->status == IBV_WC_SUCCESS) {
		struct psess *s = rs_session(r, rs);
		KVS_STAT_ADD(dp->ctr[RDMA_CTR_READS], 1);
		KVS_STAT_ADD(dp->ctr[RDMA_CTR_BYTES_RX], wc->byte_len);
		KVS_STAT_ADD(r->rail_ctr[RAIL_CTR_READS], 1);
		KVS_STAT_ADD(r->rail_ctr[RAIL_CTR_BYTES_RX], wc->byte_len);
		if (s)
			KVS_STAT_ADD(s->pub->bytes_rx, wc->byte_len);
		list_add(r, &rs->ack_head, &rs->ack_tail, slot);
		return;
	}
	if (rs->lost) {
		/* Flushed with its session: nothing more of it can land. */
		kvsp_chunk_discard(dp->p, x, -ECONNRESET);
		return;
	}
	/* Failed or flushed under a live session: rs_completed broke the
	 * queue pair; this chunk comes again by the stream. */
	resend_by_stream(r, rs, slot);
}

/* Refusals, then acks (each lands its chunk as it is sealed). */
bool rrecv_next(struct rdma *r, struct rsess *rs, struct kvsp_dp_frame *out)
{
	if (rs->nnacks) {
		if (out) {
			out->type = KVS_WIRE_CHUNK_ACK;
			out->body.chunk_ack = rs->nacks[rs->nack_head];
			rs->nack_head = (rs->nack_head + 1) % WINDOW;
			rs->nnacks--;
		}
		return true;
	}
	if (rs->ack_head == NONE)
		return false;
	if (out) {
		uint32_t slot = rs->ack_head;
		struct rread *rr = &r->rread[slot];
		rs->ack_head = rr->next;
		if (rs->ack_head == NONE)
			rs->ack_tail = NONE;
		out->type = KVS_WIRE_CHUNK_ACK;
		out->body.chunk_ack =
			(struct kvs_wire_chunk_ack){ .room = rr->name,
						     .chunk = htole32(rr->chunk),
						     .status = 0,
						     .xfer_ref = htole64(rr->sender_ref) };
		/* Its bytes are in our slot and no READ of ours is left on it:
		 * the fence decides whether they land. */
		kvsp_chunk_land(r->dp.p, kvsp_xfer_of(r->dp.p, slot));
	}
	return true;
}

int rrecv_release_held(struct rdma *r)
{
	int err;
	if (!r->nheld ||
	    kvsp_xport_fp_action(r->dp.p, r->dp.fp + RDMA_FP_READ, &err) == KVS_FP_PAUSE)
		return KVSP_IDLE; /* every real run: nothing held */
	for (unsigned i = 0; i < PSESS_MAX; i++) {
		struct rsess *rs = &r->rs[i];
		if (!rs->id)
			continue;
		while (rs->held_head != NONE) {
			uint32_t slot = rs->held_head;
			rs->held_head = r->rread[slot].next;
			r->nheld--;
			post(r, rs, slot);
		}
		rs->held_tail = NONE;
	}
	return KVSP_BUSY;
}

void rrecv_drop_held(struct rdma *r, struct rsess *rs, bool session_lost)
{
	while (rs->held_head != NONE) {
		uint32_t slot = rs->held_head;
		rs->held_head = r->rread[slot].next;
		r->nheld--;
		rs->out--;
		if (session_lost)
			kvsp_chunk_discard(r->dp.p, kvsp_xfer_of(r->dp.p, slot), -ECONNRESET);
		else
			resend_by_stream(r, rs, slot);
	}
	rs->held_tail = NONE;
}
