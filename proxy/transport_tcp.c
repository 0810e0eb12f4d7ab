/* SPDX-License-Identifier: MIT */
/*
 * The tcp transport: rooms whose halves are on two proxies. The sending
 * proxy dials the endpoint a descriptor names (on demand, then reused),
 * authenticates, joins --tcp-streams connections into one session, says
 * OPEN for the room and, once the receiver acknowledged, writes each chunk
 * straight from its slot. The receiving proxy reads each chunk straight
 * into a slot it posts for it, and the core's fence decides whether it
 * lands. Aborts and ends travel both ways with the room's token; a lost
 * session releases exactly the pins it held (kvsp_peer_lost).
 *
 * Every frame a peer sends is authenticated (proxy/frame.c); what it says
 * about a room is still checked against our own record of the room
 * (index, generation, token, session) before anything changes.
 */
#include <arpa/inet.h>
#include <endian.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <sodium.h>

#include "log.h"
#include "tcp.h"

#define NONE UINT32_MAX
#define TAG_LISTEN UINT64_MAX
#define TAG_TIMER (UINT64_MAX - 1)
#define MAX_HANDSHAKES 32 /* unauthenticated connections at once */

static struct tcp *tcp_of(struct kvsp_transport *t)
{
	return (struct tcp *)t;
}

/* ------------------------------------------------------------ sessions */

static struct tcp_sess *sess_get(struct tcp *tc, uint32_t id)
{
	unsigned i = id & 0xff;
	if (!id || i >= TCP_MAX_SESS || tc->sess[i].state == TCP_S_FREE || tc->sess[i].id != id)
		return NULL;
	return &tc->sess[i];
}

static struct tcp_sess *sess_new(struct tcp *tc)
{
	for (unsigned i = 0; i < TCP_MAX_SESS; i++) {
		struct tcp_sess *s = &tc->sess[i];
		if (s->state != TCP_S_FREE)
			continue;
		memset(s, 0, sizeof(*s));
		tc->sess_gen = (tc->sess_gen + 1) & 0xffffff;
		if (!tc->sess_gen)
			tc->sess_gen = 1;
		s->id = i | tc->sess_gen << 8;
		s->state = TCP_S_JOINING;
		s->owe_head = s->owe_tail = NONE;
		s->pub = &tc->peers[i];
		memset(s->pub, 0, sizeof(*s->pub));
		PEER_SET(s->pub->state, KVS_PEER_JOINING);
		return s;
	}
	return NULL;
}

static void sess_up(struct tcp *tc, struct tcp_sess *s)
{
	s->state = TCP_S_UP;
	s->owe_bye = tc->draining;
	KVS_STAT_ADD(tc->st->peer_sessions, 1);
	memcpy(s->pub->endpoint, s->ep.text, sizeof(s->pub->endpoint));
	PEER_SET(s->pub->streams, s->nstreams);
	PEER_SET(s->pub->instance, s->instance);
	PEER_SET(s->pub->state, KVS_PEER_UP);
	LOG_INFO("tcp: peer %s up (%s), %u streams", s->ep.text, s->dialer ? "dialed" : "accepted",
		 s->nstreams);
}

/* Frees s and its connections; no call into the core. */
static void sess_free(struct tcp *tc, struct tcp_sess *s)
{
	for (unsigned i = 0; i < tc->conns_hi; i++)
		if (tc->conn[i].state != TCP_C_FREE && tc->conn[i].sess == s)
			tcp_conn_close(tc, &tc->conn[i]);
	for (uint32_t i = s->owe_head; i != NONE; i = tc->rooms[i].owe_next)
		tc->rooms[i].on_owe = false;
	if (s->state == TCP_S_UP)
		KVS_STAT_SUB(tc->st->peer_sessions, 1);
	s->state = TCP_S_FREE;
	PEER_SET(s->pub->state, KVS_PEER_FREE);
}

/* The session is gone: its sockets are closed first, so no byte for any
 * of its transfers can arrive or leave; then the core releases their pins
 * and fails the rooms it carried. */
static void sess_lost(struct tcp *tc, struct tcp_sess *s, int status)
{
	uint32_t id = s->id;
	LOG_INFO("tcp: peer %s (%s) lost: %s", s->ep.text[0] ? s->ep.text : "?",
		 s->dialer ? "dialed" : "accepted", strerror(-status));
	KVS_STAT_ADD(tc->st->peer_lost, 1);
	sess_free(tc, s);
	kvsp_peer_lost(tc->p, &tc->t, id, status);
	for (uint32_t i = 0; i < tc->nrooms; i++)
		if (tc->rooms[i].sess == id)
			tc->rooms[i].sess = 0;
}

static void conn_fail(struct tcp *tc, struct tcp_conn *c, int status)
{
	if (c->state == TCP_C_FREE)
		return;
	if (c->sess) {
		sess_lost(tc, c->sess, status);
		return;
	}
	if (c->state == TCP_C_AUTH || c->state == TCP_C_JOINING) {
		KVS_STAT_ADD(tc->st->peer_auth_failed, 1);
		LOG_INFO("tcp: connection refused before joining: %s", strerror(-status));
	}
	tcp_conn_close(tc, c);
}

/* ---------------------------------------------------------------- rooms */

static void owe(struct tcp *tc, uint32_t i, uint8_t what)
{
	struct tcp_room *r = &tc->rooms[i];
	struct tcp_sess *s = sess_get(tc, r->sess);
	if (!s)
		return; /* nobody to tell: the session is gone, and with it the far half */
	r->owed |= what;
	if (r->on_owe)
		return;
	r->on_owe = true;
	r->owe_next = NONE;
	if (s->owe_tail != NONE)
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
static struct tcp_room *receiver_room(struct tcp *tc, struct tcp_sess *s,
				      const struct kvs_wire_room *name, uint32_t *idx)
{
	int rc = kvsp_room_find(tc->p, name);
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
	while (r->pend_head != NONE) {
		uint32_t slot = r->pend_head;
		r->pend_head = tc->xnext[slot];
		struct tcp_conn *c = s->conn[s->rr++ % s->nstreams];
		tcp_conn_queue(tc, c, kvsp_xfer_of(tc->p, slot));
	}
	r->pend_tail = NONE;
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
	while (s->owe_head != NONE) {
		uint32_t i = s->owe_head;
		struct tcp_room *r = &tc->rooms[i];
		uint8_t what = r->owed & -r->owed; /* in the order of the bits */
		r->owed &= (uint8_t)~what;
		if (!r->owed) {
			s->owe_head = r->owe_next;
			if (s->owe_head == NONE)
				s->owe_tail = NONE;
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

static int on_join(struct tcp *tc, struct tcp_conn *c, const struct kvsp_frame *f)
{
	if (f->type != KVS_WIRE_JOIN)
		return -EPROTO;
	uint64_t sid = le64toh(f->body.join.sid);
	uint32_t stream = le32toh(f->body.join.stream), n = le32toh(f->body.join.nstreams);
	if (!n || n > TCP_MAX_STREAMS || stream >= n)
		return -EPROTO;
	uint64_t inst = kvsp_auth_peer_instance(&c->auth);
	struct tcp_sess *s = NULL;
	for (unsigned i = 0; i < TCP_MAX_SESS && !s; i++) {
		struct tcp_sess *x = &tc->sess[i];
		if (x->state != TCP_S_FREE && !x->dialer && x->instance == inst && x->sid == sid)
			s = x;
	}
	if (!s) {
		s = sess_new(tc);
		if (!s)
			return -EUSERS;
		s->instance = inst;
		s->sid = sid;
		s->nstreams = n;
		snprintf(s->ep.text, sizeof(s->ep.text), "accepted");
	}
	if (s->nstreams != n || s->conn[stream])
		return -EPROTO;
	s->conn[stream] = c;
	c->sess = s;
	c->stream = stream;
	c->state = TCP_C_UP;
	if (++s->njoined == s->nstreams)
		sess_up(tc, s);
	return 0;
}

int tcp_on_authed(struct tcp *tc, struct tcp_conn *c)
{
	if (!c->dialer) {
		c->state = TCP_C_JOINING; /* its first frame must say which session */
		return 0;
	}
	struct tcp_sess *s = c->sess;
	uint64_t inst = kvsp_auth_peer_instance(&c->auth);
	if (s->njoined && s->instance != inst)
		return -EPROTO; /* one session, one proxy */
	s->instance = inst;
	c->state = TCP_C_UP;
	struct kvs_wire_join j = { htole64(s->sid), htole32(c->stream), htole32(s->nstreams) };
	int rc = tcp_conn_frame(c, KVS_WIRE_JOIN, &j);
	if (rc < 0)
		return rc;
	if (++s->njoined == s->nstreams)
		sess_up(tc, s);
	return 0;
}

static void on_open(struct tcp *tc, struct tcp_sess *s, const struct kvs_wire_open *b)
{
	int rc = kvsp_room_attach_peer(tc->p, &tc->t, s->id, &b->room, le64toh(b->bytes),
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
				.pend_head = NONE, .pend_tail = NONE };
	r->ack_status = 0;
	owe(tc, i, OWE_ACK);
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
		return receiver_room(tc, s, name, i);
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
		owe(tc, i, OWE_ENDED); /* over here already: nothing of ours in flight */
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
		return on_join(tc, c, f);
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
	struct tcp_room *r = receiver_room(tc, c->sess, &b->room, &i);
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

/* ------------------------------------------------------------- the ops */

static int tcp_submit(struct kvsp_transport *t, struct kvsp_xfer *x)
{
	struct tcp *tc = tcp_of(t);
	struct tcp_room *r = &tc->rooms[x->room];
	struct tcp_sess *s = sess_get(tc, r->sess);
	if (!s)
		return -ECONNRESET;
	if (!r->acked) {
		tc->xnext[x->slot] = NONE;
		if (r->pend_tail != NONE)
			tc->xnext[r->pend_tail] = x->slot;
		else
			r->pend_head = x->slot;
		r->pend_tail = x->slot;
		return 0;
	}
	tcp_conn_queue(tc, s->conn[s->rr++ % s->nstreams], x);
	return 0;
}

static void tcp_cancel(struct kvsp_transport *t, uint32_t room, uint32_t gen, int status)
{
	struct tcp *tc = tcp_of(t);
	struct tcp_room *r = &tc->rooms[room];
	(void)status;
	if (r->gen != gen)
		return;
	r->cancelled = true;
	/* What waited for OPEN_ACK never left its slot. Queued chunks are
	 * dropped as their stream reaches them; a chunk being written
	 * finishes, and quiesces then. */
	while (r->pend_head != NONE) {
		uint32_t slot = r->pend_head;
		r->pend_head = tc->xnext[slot];
		kvsp_xfer_quiesced(tc->p, kvsp_xfer_of(tc->p, slot), -ECANCELED);
	}
	r->pend_tail = NONE;
}

static void tcp_notify(struct kvsp_transport *t, uint32_t room, uint32_t gen, int note, int status)
{
	struct tcp *tc = tcp_of(t);
	struct tcp_room *r = &tc->rooms[room];
	if (r->gen != gen)
		return;
	switch (note) {
	case KVSP_NOTE_ABORT:
		r->abort_status = status;
		owe(tc, room, OWE_ABORT);
		break;
	case KVSP_NOTE_ENDED:
		owe(tc, room, OWE_ENDED);
		break;
	case KVSP_NOTE_DONE:
		owe(tc, room, OWE_DONE);
		break;
	}
}

static struct tcp_sess *dial(struct tcp *tc, const struct tcp_ep *ep, int *err)
{
	struct tcp_sess *s = sess_new(tc);
	if (!s) {
		*err = -EUSERS;
		return NULL;
	}
	s->dialer = true;
	s->ep = *ep;
	s->nstreams = tc->streams;
	randombytes_buf(&s->sid, sizeof(s->sid));
	for (unsigned k = 0; k < s->nstreams; k++) {
		int fd = socket(ep->sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
		if (fd < 0) {
			*err = -errno;
			sess_free(tc, s);
			return NULL;
		}
		if (connect(fd, (const struct sockaddr *)&ep->sa, ep->len) < 0 &&
		    errno != EINPROGRESS) {
			*err = -errno;
			close(fd);
			sess_free(tc, s);
			return NULL;
		}
		struct tcp_conn *c = tcp_conn_new(tc, fd, true, true);
		if (!c) {
			*err = -EMFILE;
			sess_free(tc, s);
			return NULL;
		}
		c->sess = s;
		c->stream = k;
		s->conn[k] = c;
	}
	LOG_INFO("tcp: dialing %s, %u streams", ep->text, s->nstreams);
	return s;
}

static int tcp_reach(struct kvsp_transport *t, const struct kvs_desc_wire *d, uint32_t *peer)
{
	struct tcp *tc = tcp_of(t);
	if (strncmp(d->endpoint, "tcp:", 4))
		return -EOPNOTSUPP;
	if (!memchr(d->endpoint, 0, sizeof(d->endpoint)))
		return -EINVAL;
	if (tc->endpoint[0] && !strcmp(d->endpoint, tc->endpoint))
		return -ESTALE; /* one of ours, from before a restart */
	struct tcp_ep ep;
	if (tcp_ep_parse(d->endpoint + 4, &ep) < 0)
		return -EINVAL;
	for (unsigned i = 0; i < TCP_MAX_SESS; i++) {
		struct tcp_sess *s = &tc->sess[i];
		if (s->state != TCP_S_FREE && s->dialer && !strcmp(s->ep.text, ep.text)) {
			if (s->bye)
				return -ESHUTDOWN;
			*peer = s->id;
			return 0;
		}
	}
	int err = 0;
	struct tcp_sess *s = dial(tc, &ep, &err);
	if (!s)
		return err;
	*peer = s->id;
	return 0;
}

static int tcp_attach(struct kvsp_transport *t, uint32_t peer, uint32_t room, uint32_t gen,
		      const struct kvs_desc_wire *d)
{
	struct tcp *tc = tcp_of(t);
	struct tcp_room *r = &tc->rooms[room];
	*r = (struct tcp_room){ .gen = gen, .sess = peer, .from = KVS_WIRE_FROM_SEND,
				.sender_ref = (uint64_t)gen << 32 | room,
				.far_instance = le64toh(d->instance), .bytes = le64toh(d->bytes),
				.pend_head = NONE, .pend_tail = NONE };
	r->name.room = d->room;
	r->name.gen = d->gen;
	memcpy(r->name.token, d->token, 16);
	owe(tc, room, OWE_OPEN);
	return 0;
}

static void on_accept(struct tcp *tc)
{
	for (;;) {
		int fd = accept4(tc->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0)
			return;
		unsigned hs = 0;
		for (unsigned i = 0; i < tc->conns_hi; i++)
			hs += !tc->conn[i].dialer && (tc->conn[i].state == TCP_C_AUTH ||
						      tc->conn[i].state == TCP_C_JOINING);
		if (hs >= MAX_HANDSHAKES || !tcp_conn_new(tc, fd, false, false)) {
			if (hs >= MAX_HANDSHAKES)
				close(fd);
			KVS_STAT_ADD(tc->st->peer_refused, 1);
		}
	}
}

/* Every quarter of --peer-timeout: silence past it loses a session, a
 * quiet stretch of a quarter earns a PING, a handshake past it is dropped. */
static void on_timer(struct tcp *tc)
{
	uint64_t expirations;
	if (read(tc->timer_fd, &expirations, sizeof(expirations)) < 0)
		return;
	uint64_t now = kvsp_xport_now(tc->p);
	for (unsigned i = 0; i < tc->conns_hi; i++) {
		struct tcp_conn *c = &tc->conn[i];
		if (c->state == TCP_C_FREE || c->state == TCP_C_UP)
			continue;
		if (now - c->born_ns > tc->timeout_ns)
			conn_fail(tc, c, -ETIMEDOUT);
	}
	for (unsigned i = 0; i < TCP_MAX_SESS; i++) {
		struct tcp_sess *s = &tc->sess[i];
		if (s->state != TCP_S_UP)
			continue;
		/* The peer speaks on stream 0 at least (PONG, PING): its
		 * silence anywhere but there says nothing. */
		uint64_t heard = 0;
		for (unsigned k = 0; k < s->nstreams; k++)
			if (s->conn[k]->last_rx_ns > heard)
				heard = s->conn[k]->last_rx_ns;
		if (now - heard > tc->timeout_ns) {
			sess_lost(tc, s, -ETIMEDOUT);
			continue;
		}
		if (now - s->last_tx_ns > tc->timeout_ns / 4)
			s->owe_ping = true;
	}
}

static void on_conn_event(struct tcp *tc, struct tcp_conn *c, uint32_t events)
{
	if (events & EPOLLOUT && c->wblocked) {
		c->wblocked = false;
		struct epoll_event ev = { .events = EPOLLIN,
					  .data.u64 = (uint64_t)c->id << 32 | c->idx };
		epoll_ctl(tc->epfd, EPOLL_CTL_MOD, c->fd, &ev);
	}
	int rc;
	if (c->state == TCP_C_CONNECTING || c->state == TCP_C_AUTH)
		rc = tcp_conn_handshake(tc, c);
	else
		rc = tcp_conn_rx(tc, c);
	if (rc < 0)
		conn_fail(tc, c, rc);
}

static int tcp_poll(struct kvsp_transport *t)
{
	struct tcp *tc = tcp_of(t);
	int busy = KVSP_IDLE;
	/* With no connection, only the listener and the timer can have news,
	 * and the loop hears of those through our fd (tcp_on_fd): a proxy
	 * with no peers pays no syscall a pass. */
	if (!tc->conns_hi && !tc->woken)
		return KVSP_IDLE;
	tc->woken = false;
	struct epoll_event ev[64];
	int n = epoll_wait(tc->epfd, ev, 64, 0);
	for (int k = 0; k < n; k++) {
		uint64_t d = ev[k].data.u64;
		busy = KVSP_BUSY;
		if (d == TAG_LISTEN) {
			on_accept(tc);
		} else if (d == TAG_TIMER) {
			on_timer(tc);
		} else {
			struct tcp_conn *c = &tc->conn[(uint32_t)d % TCP_MAX_CONNS];
			if (c->state != TCP_C_FREE && c->id == (uint32_t)(d >> 32))
				on_conn_event(tc, c, ev[k].events);
		}
	}
	for (unsigned i = 0; i < tc->conns_hi; i++) {
		struct tcp_conn *c = &tc->conn[i];
		if (!tcp_conn_wants_tx(tc, c))
			continue;
		int rc = tcp_conn_tx(tc, c);
		if (rc < 0)
			conn_fail(tc, c, rc);
		else
			busy |= rc;
	}
	return busy;
}

static bool tcp_pending(struct kvsp_transport *t)
{
	struct tcp *tc = tcp_of(t);
	if (tc->woken)
		return true;
	for (unsigned i = 0; i < tc->conns_hi; i++)
		if (tcp_conn_wants_tx(tc, &tc->conn[i]))
			return true;
	return false;
}

static void tcp_drain(struct kvsp_transport *t)
{
	struct tcp *tc = tcp_of(t);
	for (unsigned i = 0; i < TCP_MAX_SESS; i++)
		if (tc->sess[i].state != TCP_S_FREE)
			tc->sess[i].owe_bye = true;
	tc->draining = true; /* sessions that join from now on hear it too */
}

static void tcp_on_fd(struct kvsp_transport *t, uint32_t tag, uint32_t events)
{
	/* Our epoll fd woke the loop; tcp_poll reads it. */
	tcp_of(t)->woken = true;
	(void)tag;
	(void)events;
}

static int tcp_loop_fd(struct kvsp_transport *t)
{
	return tcp_of(t)->epfd;
}

static void tcp_destroy(struct kvsp_transport *t)
{
	struct tcp *tc = tcp_of(t);
	for (unsigned i = 0; i < tc->conns_hi; i++)
		tcp_conn_close(tc, &tc->conn[i]);
	if (tc->listen_fd >= 0)
		close(tc->listen_fd);
	if (tc->timer_fd >= 0)
		close(tc->timer_fd);
	if (tc->epfd >= 0) {
		kvsp_xport_fd_del(tc->p, tc->epfd);
		close(tc->epfd);
	}
	free(tc->rooms);
	free(tc->xnext);
	free(tc->sink);
	free(tc);
}

static const struct kvsp_transport_ops tcp_ops = {
	.name = "tcp",
	.submit = tcp_submit,
	.cancel = tcp_cancel,
	.notify = tcp_notify,
	.reach = tcp_reach,
	.attach = tcp_attach,
	.poll = tcp_poll,
	.pending = tcp_pending,
	.loop_fd = tcp_loop_fd,
	.on_fd = tcp_on_fd,
	.drain = tcp_drain,
	.destroy = tcp_destroy,
};

/* ------------------------------------------------------------- creation */

static int open_listener(struct tcp *tc, char *why, size_t len)
{
	int fd = socket(tc->listen.sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	int one = 1;
	if (fd < 0) {
		snprintf(why, len, "--listen %s: socket: %s", tc->listen.text, strerror(errno));
		return -errno;
	}
	setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (bind(fd, (struct sockaddr *)&tc->listen.sa, tc->listen.len) < 0 || listen(fd, 128) < 0) {
		int e = errno;
		snprintf(why, len, "--listen %s: %s", tc->listen.text, strerror(e));
		close(fd);
		return -e;
	}
	tc->listen_fd = fd;
	/* Port 0: the kernel chose; peers must hear the one it chose. */
	struct sockaddr_storage sa;
	socklen_t sl = sizeof(sa);
	getsockname(fd, (struct sockaddr *)&sa, &sl);
	uint16_t port = sa.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&sa)->sin6_port)
						 : ntohs(((struct sockaddr_in *)&sa)->sin_port);
	struct tcp_ep *adv = &tc->advertise;
	if (!adv->len) {
		bool any = tc->listen.sa.ss_family == AF_INET6
				   ? !memcmp(&((struct sockaddr_in6 *)&tc->listen.sa)->sin6_addr,
					     &in6addr_any, sizeof(in6addr_any))
				   : ((struct sockaddr_in *)&tc->listen.sa)->sin_addr.s_addr == 0;
		if (any) {
			snprintf(why, len, "--listen %s is every address: say which one peers dial "
				 "with --advertise HOST:PORT", tc->listen.text);
			return -EINVAL;
		}
		*adv = tc->listen;
	}
	char host[60]; /* "tcp:" and it fit a descriptor's endpoint */
	snprintf(host, sizeof(host), "%.59s", adv->text);
	char *colon = strrchr(host, ':');
	if (colon && !strcmp(colon, ":0"))
		snprintf(colon, sizeof(host) - (size_t)(colon - host), ":%u", port);
	snprintf(tc->endpoint, sizeof(tc->endpoint), "tcp:%.59s", host);
	struct epoll_event ev = { .events = EPOLLIN, .data.u64 = TAG_LISTEN };
	return epoll_ctl(tc->epfd, EPOLL_CTL_ADD, fd, &ev) < 0 ? -errno : 0;
}

struct kvsp_transport *kvsp_tcp_create(struct kvsp *p, const struct kvsp_tcp_opts *o, char *why,
				       size_t why_len)
{
	struct tcp *tc = calloc(1, sizeof(*tc));
	if (!tc) {
		snprintf(why, why_len, "out of memory");
		return NULL;
	}
	tc->t.ops = &tcp_ops;
	tc->t.p = p;
	tc->p = p;
	tc->secret = o->secret;
	tc->instance = o->instance;
	tc->streams = o->streams ? o->streams : 2;
	tc->checksum = o->checksum;
	tc->timeout_ns = o->peer_timeout_ns;
	tc->st = kvsp_xport_stats(p);
	tc->peers = kvsp_xport_peers(p);
	tc->listen_fd = tc->timer_fd = -1;
	tc->nrooms = o->max_rooms;
	tc->rooms = calloc(tc->nrooms, sizeof(*tc->rooms));
	tc->xnext = calloc(kvsp_slot_count(p), sizeof(*tc->xnext));
	tc->sink = malloc(TCP_SINK_SIZE);
	tc->epfd = epoll_create1(EPOLL_CLOEXEC);
	tc->timer_fd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
	int rc = 0;
	if (!tc->rooms || !tc->xnext || !tc->sink || tc->epfd < 0 || tc->timer_fd < 0) {
		snprintf(why, why_len, "tcp transport: %s", strerror(errno ? errno : ENOMEM));
		rc = -ENOMEM;
	}
	if (rc == 0 && o->advertise && tcp_ep_parse(o->advertise, &tc->advertise) < 0) {
		snprintf(why, why_len, "--advertise '%s': want IPV4:PORT or [IPV6]:PORT", o->advertise);
		rc = -EINVAL;
	}
	if (rc == 0 && o->listen) {
		if (tcp_ep_parse(o->listen, &tc->listen) < 0) {
			snprintf(why, why_len, "--listen '%s': want IPV4:PORT or [IPV6]:PORT", o->listen);
			rc = -EINVAL;
		} else {
			rc = open_listener(tc, why, why_len);
		}
	}
	if (rc == 0) {
		uint64_t q = tc->timeout_ns / 4;
		struct itimerspec its = { .it_interval = { (time_t)(q / 1000000000), (long)(q % 1000000000) } };
		its.it_value = its.it_interval;
		struct epoll_event ev = { .events = EPOLLIN, .data.u64 = TAG_TIMER };
		if (timerfd_settime(tc->timer_fd, 0, &its, NULL) < 0 ||
		    epoll_ctl(tc->epfd, EPOLL_CTL_ADD, tc->timer_fd, &ev) < 0) {
			snprintf(why, why_len, "tcp transport: %s", strerror(errno));
			rc = -errno;
		}
	}
	if (rc < 0) {
		tcp_destroy(&tc->t);
		return NULL;
	}
	return &tc->t;
}

const char *kvsp_tcp_endpoint(const struct kvsp_transport *t)
{
	return ((const struct tcp *)t)->endpoint;
}
