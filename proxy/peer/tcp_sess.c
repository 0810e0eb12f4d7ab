/* SPDX-License-Identifier: MIT */
/*
 * The tcp transport's sessions: what the core calls a peer. A dialed
 * session is --tcp-streams connections made on demand to one endpoint; an
 * accepted one is joined from the connections that name it (JOIN, the
 * first frame after the handshake). Losing any stream loses the session,
 * and the timer loses one that falls silent past --peer-timeout.
 */
#include <endian.h>
#include <errno.h>
#include <string.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <sodium.h>

#include "daemon/log.h"
#include "peer/tcp.h"

#define MAX_HANDSHAKES 32 /* unauthenticated connections at once */

/* ------------------------------------------------------------ sessions */

struct tcp_sess *tcp_sess_get(struct tcp *tc, uint32_t id)
{
	unsigned i = id & 0xff;
	if (!id || i >= TCP_MAX_SESS || tc->sess[i].state == TCP_S_FREE ||
	    tc->sess[i].state == TCP_S_DYING || tc->sess[i].id != id)
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
		s->owe_head = s->owe_tail = TCP_NONE;
		s->ack_head = s->ack_tail = TCP_NONE;
		s->held_head = s->held_tail = TCP_NONE;
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
	s->counted = true;
	memcpy(s->pub->endpoint, s->ep.text, sizeof(s->pub->endpoint));
	PEER_SET(s->pub->streams, s->nstreams);
	PEER_SET(s->pub->instance, s->instance);
	PEER_SET(s->pub->state, KVS_PEER_UP);
	LOG_INFO("tcp: peer %s up (%s), %u streams", s->ep.text, s->dialer ? "dialed" : "accepted",
		 s->nstreams);
	tcp_rdma_sess_up(tc, s);
}

/* Frees s and its connections; no call into the core. */
static void sess_free(struct tcp *tc, struct tcp_sess *s)
{
	for (unsigned i = 0; i < tc->conns_hi; i++)
		if (tc->conn[i].state != TCP_C_FREE && tc->conn[i].sess == s)
			tcp_conn_close(tc, &tc->conn[i]);
	for (uint32_t i = s->owe_head; i != TCP_NONE; i = tc->rooms[i].owe_next)
		tc->rooms[i].on_owe = false;
	s->owe_head = s->owe_tail = TCP_NONE;
	tcp_rdma_sess_free(tc, s);
	if (s->counted)
		KVS_STAT_SUB(tc->st->peer_sessions, 1);
	s->counted = false;
	s->state = TCP_S_FREE;
	PEER_SET(s->pub->state, KVS_PEER_FREE);
}

/* The session is gone: its sockets are closed first, so no byte for any
 * of its transfers can arrive or leave, and its queue pair is moved to the
 * error state; once every READ it posted has completed (flushed), the core
 * releases its pins and fails the rooms it carried (tcp_sess_end). */
void tcp_sess_lost(struct tcp *tc, struct tcp_sess *s, int status)
{
	if (s->state == TCP_S_DYING || s->state == TCP_S_FREE)
		return;
	LOG_INFO("tcp: peer %s (%s) lost: %s", s->ep.text[0] ? s->ep.text : "?",
		 s->dialer ? "dialed" : "accepted", strerror(-status));
	KVS_STAT_ADD(tc->st->peer_lost, 1);
	for (unsigned i = 0; i < tc->conns_hi; i++)
		if (tc->conn[i].state != TCP_C_FREE && tc->conn[i].sess == s)
			tcp_conn_close(tc, &tc->conn[i]);
	s->state = TCP_S_DYING;
	s->lost_status = status;
	PEER_SET(s->pub->state, KVS_PEER_FREE);
	if (!tcp_rdma_sess_lost(tc, s))
		tcp_sess_end(tc, s);
}

void tcp_sess_end(struct tcp *tc, struct tcp_sess *s)
{
	uint32_t id = s->id;
	int status = s->lost_status;
	sess_free(tc, s);
	kvsp_peer_lost(tc->p, &tc->t, id, status);
	for (uint32_t i = 0; i < tc->nrooms; i++)
		if (tc->rooms[i].sess == id)
			tc->rooms[i].sess = 0;
}

void tcp_conn_fail(struct tcp *tc, struct tcp_conn *c, int status)
{
	if (c->state == TCP_C_FREE)
		return;
	if (c->sess) {
		tcp_sess_lost(tc, c->sess, status);
		return;
	}
	if (c->state == TCP_C_AUTH || c->state == TCP_C_JOINING) {
		KVS_STAT_ADD(tc->st->peer_auth_failed, 1);
		LOG_INFO("tcp: connection refused before joining: %s", strerror(-status));
	}
	tcp_conn_close(tc, c);
}

/* ------------------------------------------------------------- joining */

int tcp_on_join(struct tcp *tc, struct tcp_conn *c, const struct kvsp_frame *f)
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
		if (x->state != TCP_S_FREE && x->state != TCP_S_DYING &&
		    !x->dialer && x->instance == inst && x->sid == sid)
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
struct tcp_sess *tcp_dial(struct tcp *tc, const struct tcp_ep *ep, int *err)
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

void tcp_on_accept(struct tcp *tc)
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
void tcp_on_timer(struct tcp *tc)
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
			tcp_conn_fail(tc, c, -ETIMEDOUT);
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
			tcp_sess_lost(tc, s, -ETIMEDOUT);
			continue;
		}
		if (now - s->last_tx_ns > tc->timeout_ns / 4)
			s->owe_ping = true;
	}
}

void tcp_on_conn_event(struct tcp *tc, struct tcp_conn *c, uint32_t events)
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
		tcp_conn_fail(tc, c, rc);
}
