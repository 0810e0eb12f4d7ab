/* SPDX-License-Identifier: MIT */
/*
 * The verbs data path of a tcp session: with --rdma-device on both ends,
 * chunks are pulled by RDMA READ instead of written into the sockets.
 * Everything else stays the session's: authentication, OPEN/ACK, ABORT,
 * ENDED, DONE, peer loss (see proxy/verbs.h for the memory rules).
 *
 *   - Each end, once the session is up, makes an RC queue pair and says
 *     RDMA_HELLO (its queue pair and pool) on stream 0. On the peer's
 *     HELLO it connects; from then on chunks it sends go as CHUNK_READ on
 *     stream 0, which the HELLO preceded, so the peer is connected first.
 *   - The receiver posts a slot for the chunk (kvsp_chunk_post: room,
 *     generation and token checked), READs into it, and on the READ's
 *     completion owes CHUNK_ACK; the chunk lands (the fence decides again)
 *     as the ack is sealed. A slot is never reused while a READ of ours
 *     may still write it: an aborted room's slot stays a tombstone until
 *     the completion (success or flush) has been reaped.
 *   - The sender's slot stays pinned until the ack: the peer's NIC may
 *     read it until then. It never posts anything itself.
 *   - A lost session: sockets closed, queue pair to the error state, and
 *     only once every READ it posted has completed does the core release
 *     its pins (tcp_sess_end). Ours are then dead for the peer too: a queue
 *     pair in the error state answers no READ.
 * A proxy without a device ignores RDMA_HELLO and chunks go on the sockets.
 */
#include <endian.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/failpoint.h"
#include "daemon/log.h"
#include "peer/tcp.h"

#define CQ_BATCH 32

int tcp_rdma_open(struct tcp *tc, const struct kvsp_peer_opts *o, char *why, size_t len)
{
	uint32_t slots = kvsp_slot_count(tc->p);
	tc->verbs = calloc(1, sizeof(*tc->verbs));
	tc->rread = calloc(slots, sizeof(*tc->rread));
	tc->rwait = calloc(slots, 1);
	if (!tc->verbs || !tc->rread || !tc->rwait) {
		snprintf(why, len, "out of memory");
		return -ENOMEM;
	}
	char err[256];
	int rc = kvsp_verbs_open(tc->verbs, o->rdma_device, o->rdma_gid_index,
				 kvsp_slot_mem(tc->p, 0), (size_t)slots * kvsp_slot_size(tc->p),
				 TCP_MAX_SESS * TCP_RDMA_WINDOW, err, sizeof(err));
	if (rc < 0) {
		if (o->rdma_device)
			snprintf(why, len, "--rdma-device %s: %s", o->rdma_device, err);
		else
			snprintf(why, len, "%s", err);
		free(tc->verbs);
		tc->verbs = NULL;
		return rc;
	}
	LOG_INFO("rdma: %s port %u, GID index %d: chunks by RDMA READ with peers that have it",
		 tc->verbs->name, tc->verbs->port, tc->verbs->gid_index);
	return 0;
}

int tcp_rdma_choose(struct tcp *tc, const struct kvsp_peer_opts *o, char *why, size_t len)
{
	if (o->data == KVSP_DATA_TCP) {
		LOG_INFO("peers: chunks by TCP (--transport tcp)");
		return 0;
	}
	if (o->data == KVSP_DATA_VERBS || o->rdma_device) {
		int rc = tcp_rdma_open(tc, o, why, len);
		if (rc < 0 && o->data == KVSP_DATA_VERBS && !o->rdma_device) {
			char err[256];
			snprintf(err, sizeof(err), "%s", why);
			snprintf(why, len, "--transport verbs: %s", err);
		}
		return rc;
	}
	/* auto, no device named: the first one listed, if its port is up; a
	 * device that will not open costs this proxy RDMA, never its start. */
	char err[256];
	int rc = tcp_rdma_open(tc, o, err, sizeof(err));
	if (rc == -ENODEV && strstr(err, "found none"))
		LOG_INFO("peers: chunks by TCP (--transport auto: no RDMA device here)");
	else if (rc < 0)
		LOG_WARN("peers: chunks by TCP (--transport auto: %s)", err);
	if (rc < 0)
		tcp_rdma_close(tc);
	return 0;
}

void tcp_rdma_close(struct tcp *tc)
{
	if (tc->verbs)
		kvsp_verbs_close(tc->verbs);
	free(tc->verbs);
	free(tc->rread);
	free(tc->rwait);
	tc->verbs = NULL;
	tc->rread = NULL;
	tc->rwait = NULL;
}

void tcp_rdma_sess_up(struct tcp *tc, struct tcp_sess *s)
{
	if (!tc->verbs || s->qp)
		return;
	s->qp = kvsp_verbs_qp_new(tc->verbs, TCP_RDMA_WINDOW, &s->rdma_local);
	if (!s->qp) {
		LOG_WARN("rdma: peer %s: no queue pair (%s): chunks go by TCP", s->ep.text,
			 strerror(errno));
		return;
	}
	s->owe_rdma_hello = true;
}

bool tcp_rdma_sess_lost(struct tcp *tc, struct tcp_sess *s)
{
	(void)tc;
	if (!s->qp)
		return false;
	kvsp_verbs_qp_error(s->qp);
	return s->reads_out > 0;
}

void tcp_rdma_sess_free(struct tcp *tc, struct tcp_sess *s)
{
	if (!s->qp)
		return;
	kvsp_verbs_qp_error(s->qp);
	kvsp_verbs_qp_destroy(s->qp);
	s->qp = NULL;
	s->rdma_up = false;
	/* Our sending pins for this peer are the core's to release now
	 * (kvsp_peer_lost): forget that they waited for an ack. */
	uint32_t slots = kvsp_slot_count(tc->p);
	for (uint32_t i = 0; i < slots; i++) {
		struct kvsp_xfer *x = kvsp_xfer_of(tc->p, i);
		if (tc->rwait[i] && x->xport == tc->t.idx && x->peer == s->id)
			tc->rwait[i] = 0;
	}
	s->reads_inflight = 0;
	s->ack_head = s->ack_tail = TCP_NONE;
	for (uint32_t slot = s->held_head; slot != TCP_NONE; slot = tc->rread[slot].next)
		tc->nheld--;
	s->held_head = s->held_tail = TCP_NONE;
	s->nnacks = 0;
}

bool tcp_rdma_pending(const struct tcp *tc)
{
	if (!tc->verbs)
		return false;
	for (unsigned i = 0; i < TCP_MAX_SESS; i++)
		if (tc->sess[i].reads_out)
			return true;
	return false;
}

struct tcp_conn *tcp_rdma_conn_for(struct tcp_sess *s)
{
	/* By RDMA, chunks go on stream 0, behind our RDMA_HELLO. */
	return s->rdma_up ? s->conn[0] : s->conn[s->rr++ % s->nstreams];
}

/* -------------------------------------------------------------- sending */

int tcp_rdma_chunk(struct tcp *tc, struct tcp_conn *c, struct kvsp_xfer *x)
{
	struct tcp_sess *s = c->sess;
	if (!s || !s->rdma_up || c->stream != 0)
		return 0;
	if (s->reads_inflight >= TCP_RDMA_WINDOW)
		return -1;
	struct kvs_wire_chunk_read b = {
		.room = tc->rooms[x->room].name,
		.chunk = htole32(x->chunk),
		.len = htole32(x->len),
		.xfer_ref = htole64((uint64_t)x->epoch << 32 | x->slot),
		.offset = htole64((uint64_t)x->slot * kvsp_slot_size(tc->p)),
	};
	if (tcp_conn_frame(c, KVS_WIRE_CHUNK_READ, &b) < 0)
		return 0;
	tc->rwait[x->slot] = 1;
	s->reads_inflight++;
	return 1;
}

/* The receiver is done with our slot for this transfer: it READ it, or
 * refused to. Either way its NIC will not touch it again. */
static int on_ack(struct tcp *tc, struct tcp_sess *s, const struct kvs_wire_chunk_ack *b)
{
	uint64_t ref = le64toh(b->xfer_ref);
	uint32_t slot = (uint32_t)ref, epoch = (uint32_t)(ref >> 32);
	if (!tc->rwait || slot >= kvsp_slot_count(tc->p) || !tc->rwait[slot]) {
		KVS_STAT_ADD(tc->st->peer_frames_ignored, 1);
		return 0;
	}
	struct kvsp_xfer *x = kvsp_xfer_of(tc->p, slot);
	if (x->dir != KVSP_XFER_SEND || x->xport != tc->t.idx || x->peer != s->id ||
	    x->epoch != epoch) {
		KVS_STAT_ADD(tc->st->peer_frames_ignored, 1);
		return 0;
	}
	tc->rwait[slot] = 0;
	s->reads_inflight--;
	int status = (int32_t)le32toh((uint32_t)b->status);
	if (status == -EOPNOTSUPP) {
		/* The peer cannot READ after all: this chunk, and the rest, by TCP. */
		LOG_WARN("rdma: peer %s cannot read from us: chunks go by TCP", s->ep.text);
		s->rdma_up = false;
		PEER_SET(s->pub->flags, 0);
		tcp_conn_queue(tc, s->conn[s->rr++ % s->nstreams], x);
		return 0;
	}
	kvsp_xfer_quiesced(tc->p, x, 0);
	return 0;
}

/* ------------------------------------------------------------ receiving */

static void nack(struct tcp_sess *s, const struct kvs_wire_chunk_read *b, int status);

static void list_add(struct tcp *tc, uint32_t *head, uint32_t *tail, uint32_t slot)
{
	tc->rread[slot].next = TCP_NONE;
	if (*tail != TCP_NONE)
		tc->rread[*tail].next = slot;
	else
		*head = slot;
	*tail = slot;
}

/* Posts the READ recorded for our slot. A refused post is a completion
 * that failed: the slot is discarded and the peer told. */
static void post(struct tcp *tc, struct tcp_sess *s, uint32_t slot)
{
	struct tcp_rread *rr = &tc->rread[slot];
	if (kvsp_verbs_read(tc->verbs, s->qp, slot, rr->dst, rr->len, rr->raddr, s->rdma_peer.rkey) == 0)
		return;
	s->reads_out--;
	kvsp_chunk_discard(tc->p, kvsp_xfer_of(tc->p, slot), -EIO);
	struct kvs_wire_chunk_read b = { .room = rr->name, .chunk = htole32(rr->chunk),
					 .xfer_ref = htole64(rr->sender_ref) };
	nack(s, &b, -EIO);
}

static void nack(struct tcp_sess *s, const struct kvs_wire_chunk_read *b, int status)
{
	struct kvs_wire_chunk_ack a = { .room = b->room, .chunk = b->chunk,
					.status = (int32_t)htole32((uint32_t)status),
					.xfer_ref = b->xfer_ref };
	s->nacks[(s->nack_head + s->nnacks++) % TCP_RDMA_WINDOW] = a;
}

static int on_read(struct tcp *tc, struct tcp_sess *s, const struct kvs_wire_chunk_read *b)
{
	/* The sender keeps at most a window unacknowledged: more is a peer
	 * out of protocol, and we owe no ack we cannot hold. */
	if (s->reads_out + s->nnacks >= TCP_RDMA_WINDOW)
		return -EPROTO;
	if (!s->qp || !s->rdma_heard) {
		nack(s, b, -EOPNOTSUPP);
		return 0;
	}
	uint32_t len = le32toh(b->len), chunk = le32toh(b->chunk);
	uint64_t off = le64toh(b->offset);
	if (!len || len > kvsp_slot_size(tc->p) || off > s->rdma_peer.pool_len ||
	    len > s->rdma_peer.pool_len - off)
		return -EPROTO;
	uint32_t i;
	struct tcp_room *r = tcp_receiver_room(tc, s, &b->room, &i);
	if (!r) {
		KVS_STAT_ADD(tc->st->peer_frames_ignored, 1);
		nack(s, b, -ESTALE);
		return 0;
	}
	struct kvsp_xfer *x;
	void *dst;
	int rc = kvsp_chunk_post(tc->p, &tc->t, s->id, i, r->gen, chunk, len, &x, &dst);
	if (rc < 0) {
		kvsp_chunk_sunk(tc->p, 0); /* refused: counted, nothing read */
		nack(s, b, rc);
		return 0;
	}
	struct tcp_rread *rr = &tc->rread[x->slot];
	*rr = (struct tcp_rread){ .name = b->room, .sender_ref = le64toh(b->xfer_ref), .sess = s->id,
				  .chunk = chunk, .next = TCP_NONE, .len = len, .dst = dst,
				  .raddr = s->rdma_peer.pool_addr + off };
	s->reads_out++;
	if (kvsp_xport_fp(tc->p, KVSP_FP_RDMA_READ, i) == KVSP_FP_HOLD) {
		/* Test barrier: the slot is posted, the READ waits (as a slow one would). */
		list_add(tc, &s->held_head, &s->held_tail, x->slot);
		tc->nheld++;
		return 0;
	}
	post(tc, s, x->slot);
	return 0;
}

static int on_hello(struct tcp *tc, struct tcp_sess *s, const struct kvs_wire_rdma_hello *b)
{
	if (s->rdma_heard)
		return -EPROTO; /* once per session */
	s->rdma_heard = true;
	/* The peer's stream 0 may speak before our last stream joined. */
	tcp_rdma_sess_up(tc, s);
	if (!tc->verbs || !s->qp) {
		KVS_STAT_ADD(tc->st->peer_frames_ignored, 1);
		LOG_INFO("rdma: peer %s offers RDMA; %s: chunks to it go by TCP", s->ep.text,
			 tc->verbs ? "we have no queue pair for it" : "this proxy has no --rdma-device");
		return 0;
	}
	struct kvsp_verbs_ep *p = &s->rdma_peer;
	p->qpn = le32toh(b->qpn);
	p->psn = le32toh(b->psn);
	memcpy(p->gid, b->gid, sizeof(p->gid));
	p->pool_addr = le64toh(b->pool_addr);
	p->pool_len = le64toh(b->pool_len);
	p->rkey = le32toh(b->rkey);
	p->mtu = le32toh(b->mtu);
	int rc = kvsp_verbs_qp_connect(tc->verbs, s->qp, &s->rdma_local, p);
	if (rc < 0) {
		LOG_WARN("rdma: peer %s: cannot connect the queue pair (%s): chunks go by TCP",
			 s->ep.text, strerror(-rc));
		kvsp_verbs_qp_destroy(s->qp);
		s->qp = NULL;
		return 0;
	}
	s->rdma_up = true;
	PEER_SET(s->pub->flags, KVS_PEER_RDMA);
	LOG_INFO("rdma: peer %s: chunks by RDMA READ on %s", s->ep.text, tc->verbs->name);
	return 0;
}

int tcp_rdma_on_frame(struct tcp *tc, struct tcp_sess *s, const struct kvsp_frame *f)
{
	switch (f->type) {
	case KVS_WIRE_RDMA_HELLO:
		return on_hello(tc, s, &f->body.rdma_hello);
	case KVS_WIRE_CHUNK_READ:
		return on_read(tc, s, &f->body.chunk_read);
	case KVS_WIRE_CHUNK_ACK:
		return on_ack(tc, s, &f->body.chunk_ack);
	}
	return -EPROTO;
}

/* ---------------------------------------------------------- completions */

/* Held READs go once the rdma.read failpoint lets go; a lost session's
 * are never posted: discarded, nothing of ours reads for them. */
static int release_held(struct tcp *tc)
{
	int err, busy = KVSP_IDLE;
	if (!tc->nheld)
		return busy; /* every real run: nothing held, nothing to look at */
	bool paused = kvsp_xport_fp_action(tc->p, KVSP_FP_RDMA_READ, &err) == KVS_FP_PAUSE;
	for (unsigned i = 0; i < TCP_MAX_SESS; i++) {
		struct tcp_sess *s = &tc->sess[i];
		bool dying = s->state == TCP_S_DYING;
		if (s->state == TCP_S_FREE || s->held_head == TCP_NONE || (paused && !dying))
			continue;
		while (s->held_head != TCP_NONE) {
			uint32_t slot = s->held_head;
			s->held_head = tc->rread[slot].next;
			tc->nheld--;
			if (dying) {
				s->reads_out--;
				kvsp_chunk_discard(tc->p, kvsp_xfer_of(tc->p, slot), -ECONNRESET);
			} else {
				post(tc, s, slot);
			}
		}
		s->held_tail = TCP_NONE;
		busy = KVSP_BUSY;
		if (dying && !s->reads_out)
			tcp_sess_end(tc, s);
	}
	return busy;
}

int tcp_rdma_poll(struct tcp *tc)
{
	if (!tc->verbs)
		return KVSP_IDLE;
	int busy = release_held(tc);
	struct ibv_wc wc[CQ_BATCH];
	int n = kvsp_verbs_poll(tc->verbs, wc, CQ_BATCH);
	for (int k = 0; k < n; k++) {
		uint32_t slot = (uint32_t)wc[k].wr_id;
		struct tcp_rread *rr = &tc->rread[slot];
		struct tcp_sess *s = &tc->sess[rr->sess & 0xff];
		struct kvsp_xfer *x = kvsp_xfer_of(tc->p, slot);
		s->reads_out--;
		if (s->state == TCP_S_DYING || wc[k].status != IBV_WC_SUCCESS) {
			/* Flushed, or failed: nothing more of it can land. */
			kvsp_chunk_discard(tc->p, x, -EIO);
			if (s->state != TCP_S_DYING) {
				LOG_WARN("rdma: peer %s: READ failed: %s", s->ep.text,
					 ibv_wc_status_str(wc[k].status));
				tcp_sess_lost(tc, s, -EIO); /* the queue pair is in error now */
			}
			if (s->state == TCP_S_DYING && !s->reads_out)
				tcp_sess_end(tc, s);
			continue;
		}
		KVS_STAT_ADD(tc->st->rdma_reads, 1);
		KVS_STAT_ADD(tc->st->rdma_bytes_rx, wc[k].byte_len);
		KVS_STAT_ADD(s->pub->bytes_rx, wc[k].byte_len);
		rr->status = 0;
		rr->next = TCP_NONE;
		if (s->ack_tail != TCP_NONE)
			tc->rread[s->ack_tail].next = slot;
		else
			s->ack_head = slot;
		s->ack_tail = slot;
	}
	return n > 0 ? KVSP_BUSY : busy;
}

bool tcp_rdma_next_control(struct tcp *tc, struct tcp_conn *c)
{
	struct tcp_sess *s = c->sess;
	if (s->owe_rdma_hello) {
		s->owe_rdma_hello = false;
		const struct kvsp_verbs_ep *e = &s->rdma_local;
		struct kvs_wire_rdma_hello b = { .qpn = htole32(e->qpn), .psn = htole32(e->psn),
						 .pool_addr = htole64(e->pool_addr),
						 .pool_len = htole64(e->pool_len),
						 .rkey = htole32(e->rkey), .mtu = htole32(e->mtu) };
		memcpy(b.gid, e->gid, sizeof(b.gid));
		return tcp_conn_frame(c, KVS_WIRE_RDMA_HELLO, &b) == 0;
	}
	if (s->nnacks) {
		struct kvs_wire_chunk_ack a = s->nacks[s->nack_head];
		s->nack_head = (s->nack_head + 1) % TCP_RDMA_WINDOW;
		s->nnacks--;
		return tcp_conn_frame(c, KVS_WIRE_CHUNK_ACK, &a) == 0;
	}
	if (s->ack_head == TCP_NONE)
		return false;
	uint32_t slot = s->ack_head;
	struct tcp_rread *rr = &tc->rread[slot];
	s->ack_head = rr->next;
	if (s->ack_head == TCP_NONE)
		s->ack_tail = TCP_NONE;
	struct kvs_wire_chunk_ack a = { .room = rr->name, .chunk = htole32(rr->chunk),
					.status = 0, .xfer_ref = htole64(rr->sender_ref) };
	int rc = tcp_conn_frame(c, KVS_WIRE_CHUNK_ACK, &a);
	/* Its bytes are in our slot and no READ of ours is left on it: the
	 * fence decides whether they land. */
	kvsp_chunk_land(tc->p, kvsp_xfer_of(tc->p, slot));
	return rc == 0;
}
