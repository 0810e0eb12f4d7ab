/* SPDX-License-Identifier: MIT */
/*
 * The tcp transport's rooms: the control frames a room owes its peer (on
 * stream 0, in order), and what each frame from a peer means. Every frame
 * is authenticated (proxy/frame.c); what it says about a room is still
 * checked against our own record of the room (index, generation, token,
 * session) before anything changes.
 */
#include <endian.h>
#include <errno.h>
#include <string.h>

#include <sodium.h>

#include "daemon/log.h"
#include "peer/tcp.h"

/* ---------------------------------------------------------------- rooms */

struct kvsp_room_name tcp_room_name(const struct kvs_wire_room *w)
{
	struct kvsp_room_name n = { le32toh(w->room), le32toh(w->gen), { 0 } };
	memcpy(n.token, w->token, sizeof(n.token));
	return n;
}

void tcp_owe(struct tcp *tc, uint32_t i, uint8_t what)
{
	struct tcp_room *r = &tc->rooms[i];
	struct tcp_sess *s = tcp_sess_get(tc, r->sess);
	if (!s)
		return; /* nobody to tell: the session is gone, and with it the far half */
	r->owed |= what;
	if (r->on_owe)
		return;
	r->on_owe = true;
	r->owe_next = TCP_NONE;
	if (s->owe_tail != TCP_NONE)
		tc->rooms[s->owe_tail].owe_next = i;
	else
		s->owe_head = i;
	s->owe_tail = i;
}

/* Sending side: the frame names our room (sender_ref) and the peer's
 * receiving room (name); both must be what we recorded. */
static struct tcp_room *sender_room(struct tcp *tc, struct tcp_sess *s, uint64_t ref,
				    const struct kvs_wire_room *name, uint32_t *idx)
{
	uint32_t i = (uint32_t)ref, gen = (uint32_t)(ref >> 32);
	if (i >= tc->nrooms)
		return NULL;
	struct tcp_room *r = &tc->rooms[i];
	if (r->sess != s->id || r->gen != gen || r->name.room != name->room ||
	    r->name.gen != name->gen || sodium_memcmp(r->name.token, name->token, 16))
		return NULL;
	*idx = i;
	return r;
}

/* Receiving side: the frame names our room; the token is the core's to
 * check (a wrong one is counted there), the session ours. */
struct tcp_room *tcp_receiver_room(struct tcp *tc, struct tcp_sess *s,
				   const struct kvs_wire_room *name, uint32_t *idx)
{
	struct kvsp_room_name n = tcp_room_name(name);
	int rc = kvsp_room_find(tc->p, &n);
	if (rc < 0 && rc != -ECANCELED)
		return NULL;
	uint32_t i = le32toh(name->room);
	struct tcp_room *r = &tc->rooms[i];
	if (r->sess != s->id || r->gen != le32toh(name->gen))
		return NULL;
	*idx = i;
	return r;
}

static void ignored(struct tcp *tc, const char *what)
{
	KVS_STAT_ADD(tc->st->peer_frames_ignored, 1);
	LOG_DEBUG("tcp: %s for no room of ours: ignored", what);
}

bool tcp_room_cancelled(const struct tcp *tc, const struct kvsp_xfer *x)
{
	const struct tcp_room *r = &tc->rooms[x->room];
	return r->cancelled || r->gen != x->room_gen;
}

/* Sending side: the receiver said yes; the chunks that waited go out. */
static void room_acked(struct tcp *tc, struct tcp_sess *s, struct tcp_room *r)
{
	r->acked = true;
	while (r->pend_head != TCP_NONE) {
		uint32_t slot = r->pend_head;
		r->pend_head = tc->xnext[slot];
		struct tcp_conn *c = tcp_rdma_conn_for(s);
		tcp_conn_queue(tc, c, kvsp_xfer_of(tc->p, slot));
	}
	r->pend_tail = TCP_NONE;
}

/* ------------------------------------------------------ control frames */

static bool refusal_pop(struct tcp_sess *s, struct kvs_wire_open_ack *a);

bool tcp_next_control(struct tcp *tc, struct tcp_conn *c)
{
	struct tcp_sess *s = c->sess;
	if (c->stream != 0 || !s || s->state != TCP_S_UP)
		return false;
	if (s->owe_pong) {
		s->owe_pong = false;
		struct kvs_wire_ping b = { htole64(s->pong_value) };
		return tcp_conn_frame(c, KVS_WIRE_PONG, &b) == 0;
	}
	if (s->owe_ping) {
		s->owe_ping = false;
		struct kvs_wire_ping b = { htole64(kvsp_xport_now(tc->p)) };
		return tcp_conn_frame(c, KVS_WIRE_PING, &b) == 0;
	}
	if (s->owe_bye) {
		s->owe_bye = false;
		struct kvs_wire_bye b = { htole32(KVS_WIRE_BYE_DRAIN), 0 };
		return tcp_conn_frame(c, KVS_WIRE_BYE, &b) == 0;
	}
	struct kvs_wire_open_ack refusal;
	if (refusal_pop(s, &refusal))
		return tcp_conn_frame(c, KVS_WIRE_OPEN_ACK, &refusal) == 0;
	if (tcp_rdma_next_control(tc, c))
		return true;
	while (s->owe_head != TCP_NONE) {
		uint32_t i = s->owe_head;
		struct tcp_room *r = &tc->rooms[i];
		uint8_t what = r->owed & -r->owed; /* in the order of the bits */
		r->owed &= (uint8_t)~what;
		if (!r->owed) {
			s->owe_head = r->owe_next;
			if (s->owe_head == TCP_NONE)
				s->owe_tail = TCP_NONE;
			r->on_owe = false;
		}
		uint64_t ref = htole64(r->sender_ref);
		union kvs_wire_body b;
		memset(&b, 0, sizeof(b));
		uint16_t type;
		switch (what) {
		case OWE_OPEN:
			if (r->far_instance != s->instance) {
				/* The proxy at that endpoint restarted since the
				 * descriptor was made: its room is gone. */
				uint32_t id = r->sess;
				r->sess = 0;
				kvsp_room_peer_refused(tc->p, &tc->t, id, i, r->gen, -ESTALE);
				continue;
			}
			b.open = (struct kvs_wire_open){ r->name, htole64(r->bytes),
							 htole64(kvsp_slot_size(tc->p)), ref };
			type = KVS_WIRE_OPEN;
			break;
		case OWE_ACK:
			b.open_ack = (struct kvs_wire_open_ack){ .room = r->name, .sender_ref = ref,
								 .status = (int32_t)htole32(r->ack_status) };
			type = KVS_WIRE_OPEN_ACK;
			break;
		case OWE_ABORT:
			b.abort = (struct kvs_wire_abort){ .room = r->name,
							   .status = (int32_t)htole32(r->abort_status),
							   .from = htole32(r->from), .sender_ref = ref };
			type = KVS_WIRE_ABORT;
			break;
		case OWE_DONE:
			b.done = (struct kvs_wire_done){ r->name, ref };
			type = KVS_WIRE_DONE;
			break;
		default:
			b.ended = (struct kvs_wire_ended){ .room = r->name, .sender_ref = ref,
							   .from = htole32(r->from) };
			type = KVS_WIRE_ENDED;
			break;
		}
		return tcp_conn_frame(c, type, &b) == 0;
	}
	return false;
}

/* Refusals of OPENs that name no room we could record them in. Bounded:
 * past it, a peer sending that many bad OPENs hears nothing more. */
static bool refusal_push(struct tcp_sess *s, const struct kvs_wire_open_ack *a)
{
	if (s->nrefusals == TCP_REFUSALS)
		return false;
	s->refusals[(s->refusal_head + s->nrefusals++) % TCP_REFUSALS] = *a;
	return true;
}

static bool refusal_pop(struct tcp_sess *s, struct kvs_wire_open_ack *a)
{
	if (!s->nrefusals)
		return false;
	*a = s->refusals[s->refusal_head];
	s->refusal_head = (s->refusal_head + 1) % TCP_REFUSALS;
	s->nrefusals--;
	return true;
}

/* --------------------------------------------------------- what comes */

static void on_open(struct tcp *tc, struct tcp_sess *s, const struct kvs_wire_open *b)
{
	struct kvsp_room_name n = tcp_room_name(&b->room);
	int rc = kvsp_room_attach_peer(tc->p, &tc->t, s->id, &n, le64toh(b->bytes),
				       le64toh(b->slot_size));
	if (rc < 0) {
		/* Said back on the frame's own terms: this may name a room of
		 * someone else's, whose record must not change. */
		struct kvs_wire_open_ack a = { .room = b->room, .sender_ref = b->sender_ref,
					       .status = (int32_t)htole32(rc) };
		if (!refusal_push(s, &a))
			KVS_STAT_ADD(tc->st->peer_frames_ignored, 1);
		return;
	}
	uint32_t i = le32toh(b->room.room);
	struct tcp_room *r = &tc->rooms[i];
	*r = (struct tcp_room){ .gen = le32toh(b->room.gen), .sess = s->id, .name = b->room,
				.sender_ref = le64toh(b->sender_ref), .from = KVS_WIRE_FROM_RECV,
				.pend_head = TCP_NONE, .pend_tail = TCP_NONE };
	r->ack_status = 0;
	tcp_owe(tc, i, OWE_ACK);
}

static void on_open_ack(struct tcp *tc, struct tcp_sess *s, const struct kvs_wire_open_ack *b)
{
	uint32_t i;
	struct tcp_room *r = sender_room(tc, s, le64toh(b->sender_ref), &b->room, &i);
	if (!r || r->acked) {
		ignored(tc, "OPEN_ACK");
		return;
	}
	int status = (int32_t)le32toh((uint32_t)b->status);
	if (status == 0) {
		room_acked(tc, s, r);
		return;
	}
	if (status > 0 || status < -4095)
		status = -EPROTO;
	r->sess = 0; /* there is no far half to tell anything */
	kvsp_room_peer_refused(tc->p, &tc->t, s->id, i, r->gen, status);
}

/* ABORT and ENDED name the room from the speaker's side: from its sending
 * half (we hold the receiving one) or its receiving half. */
static struct tcp_room *named_room(struct tcp *tc, struct tcp_sess *s, uint32_t from,
				   const struct kvs_wire_room *name, uint64_t ref, uint32_t *i)
{
	if (from == KVS_WIRE_FROM_SEND)
		return tcp_receiver_room(tc, s, name, i);
	if (from == KVS_WIRE_FROM_RECV)
		return sender_room(tc, s, ref, name, i);
	return NULL;
}

static void on_abort(struct tcp *tc, struct tcp_sess *s, const struct kvs_wire_abort *b)
{
	uint32_t i;
	struct tcp_room *r = named_room(tc, s, le32toh(b->from), &b->room, le64toh(b->sender_ref), &i);
	int status = (int32_t)le32toh((uint32_t)b->status);
	if (status >= 0 || status < -4095)
		status = -ECANCELED;
	if (!r) {
		ignored(tc, "ABORT");
		return;
	}
	int rc = kvsp_room_peer_abort(tc->p, &tc->t, s->id, i, r->gen, status);
	if (rc == -EALREADY)
		tcp_owe(tc, i, OWE_ENDED); /* over here already: nothing of ours in flight */
	else if (rc < 0)
		ignored(tc, "ABORT");
}

static void on_ended(struct tcp *tc, struct tcp_sess *s, const struct kvs_wire_ended *b)
{
	uint32_t i;
	struct tcp_room *r = named_room(tc, s, le32toh(b->from), &b->room, le64toh(b->sender_ref), &i);
	if (!r) {
		ignored(tc, "ENDED");
		return;
	}
	kvsp_room_peer_ended(tc->p, &tc->t, s->id, i, r->gen);
}

static void on_done(struct tcp *tc, struct tcp_sess *s, const struct kvs_wire_done *b)
{
	uint32_t i;
	struct tcp_room *r = sender_room(tc, s, le64toh(b->sender_ref), &b->room, &i);
	if (!r) {
		ignored(tc, "DONE");
		return;
	}
	kvsp_room_peer_done(tc->p, &tc->t, s->id, i, r->gen);
}

int tcp_on_frame(struct tcp *tc, struct tcp_conn *c, const struct kvsp_frame *f)
{
	if (c->state == TCP_C_JOINING)
		return tcp_on_join(tc, c, f);
	struct tcp_sess *s = c->sess;
	if (f->type != KVS_WIRE_PING && f->type != KVS_WIRE_PONG && c->stream != 0)
		return -EPROTO; /* control goes on stream 0 only: that is its order */
	switch (f->type) {
	case KVS_WIRE_OPEN:
		on_open(tc, s, &f->body.open);
		break;
	case KVS_WIRE_OPEN_ACK:
		on_open_ack(tc, s, &f->body.open_ack);
		break;
	case KVS_WIRE_ABORT:
		on_abort(tc, s, &f->body.abort);
		break;
	case KVS_WIRE_ENDED:
		on_ended(tc, s, &f->body.ended);
		break;
	case KVS_WIRE_DONE:
		on_done(tc, s, &f->body.done);
		break;
	case KVS_WIRE_PING:
		s->owe_pong = true;
		s->pong_value = le64toh(f->body.ping.value);
		break;
	case KVS_WIRE_PONG:
		break; /* its arrival was the point */
	case KVS_WIRE_RDMA_HELLO:
	case KVS_WIRE_CHUNK_READ:
	case KVS_WIRE_CHUNK_ACK:
		return tcp_rdma_on_frame(tc, s, f);
	case KVS_WIRE_BYE:
		s->bye = true;
		KVS_STAT_ADD(tc->st->peer_byes, 1);
		LOG_INFO("tcp: peer %s is draining", s->ep.text);
		break;
	default:
		return -EPROTO; /* JOIN again, or a frame we never send */
	}
	return 0;
}

void tcp_on_chunk(struct tcp *tc, struct tcp_conn *c, const struct kvsp_frame *f)
{
	const struct kvs_wire_chunk *b = &f->body.chunk;
	c->rx_len = f->plen;
	c->rx_off = 0;
	c->rx_crc = 0;
	c->rx_want_crc = le32toh(b->crc32c);
	c->rx_has_crc = le32toh(b->flags) & KVS_WIRE_CHUNK_CRC;
	c->rx_x = NULL;
	c->rx_sink = true;
	uint32_t i;
	int rc = -ESTALE;
	struct tcp_room *r = tcp_receiver_room(tc, c->sess, &b->room, &i);
	if (r)
		rc = kvsp_chunk_post(tc->p, &tc->t, c->sess->id, i, r->gen, le32toh(b->chunk),
				     f->plen, &c->rx_x, (void **)&c->rx_dst);
	if (rc == 0)
		c->rx_sink = false;
	else
		LOG_DEBUG("tcp: chunk %u of room %u into the sink: %s", le32toh(b->chunk),
			  le32toh(b->room.room), strerror(-rc));
	if (!f->plen)
		kvsp_chunk_sunk(tc->p, 0); /* a chunk is never empty: nothing to read, counted */
}
