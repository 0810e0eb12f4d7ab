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
 * This file is the ops table the core calls, the loop's poll and the
 * transport's lifetime; tcp_sess.c has the sessions, tcp_room.c what the
 * frames mean, tcp_conn.c one connection.
 */
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <sodium.h>

#include "daemon/log.h"
#include "peer/tcp.h"

#define TAG_LISTEN UINT64_MAX
#define TAG_TIMER (UINT64_MAX - 1)

static struct tcp *tcp_of(struct kvsp_transport *t)
{
	return (struct tcp *)t;
}

/* ------------------------------------------------------------- the ops */

static int tcp_submit(struct kvsp_transport *t, struct kvsp_xfer *x)
{
	struct tcp *tc = tcp_of(t);
	struct tcp_room *r = &tc->rooms[x->room];
	struct tcp_sess *s = tcp_sess_get(tc, r->sess);
	if (!s)
		return -ECONNRESET;
	if (!r->acked) {
		tc->xnext[x->slot] = TCP_NONE;
		if (r->pend_tail != TCP_NONE)
			tc->xnext[r->pend_tail] = x->slot;
		else
			r->pend_head = x->slot;
		r->pend_tail = x->slot;
		return 0;
	}
	tcp_conn_queue(tc, tcp_rdma_conn_for(s), x);
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
	while (r->pend_head != TCP_NONE) {
		uint32_t slot = r->pend_head;
		r->pend_head = tc->xnext[slot];
		kvsp_xfer_quiesced(tc->p, kvsp_xfer_of(tc->p, slot), -ECANCELED);
	}
	r->pend_tail = TCP_NONE;
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
		tcp_owe(tc, room, OWE_ABORT);
		break;
	case KVSP_NOTE_ENDED:
		tcp_owe(tc, room, OWE_ENDED);
		break;
	case KVSP_NOTE_DONE:
		tcp_owe(tc, room, OWE_DONE);
		break;
	}
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
		if (s->state != TCP_S_FREE && s->state != TCP_S_DYING && s->dialer &&
		    !strcmp(s->ep.text, ep.text)) {
			if (s->bye)
				return -ESHUTDOWN;
			*peer = s->id;
			return 0;
		}
	}
	int err = 0;
	struct tcp_sess *s = tcp_dial(tc, &ep, &err);
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
				.pend_head = TCP_NONE, .pend_tail = TCP_NONE };
	r->name.room = d->room;
	r->name.gen = d->gen;
	memcpy(r->name.token, d->token, 16);
	tcp_owe(tc, room, OWE_OPEN);
	return 0;
}

static int tcp_poll(struct kvsp_transport *t)
{
	struct tcp *tc = tcp_of(t);
	/* With no connection, only the listener and the timer can have news,
	 * and the loop hears of those through our fd (tcp_on_fd): a proxy
	 * with no peers pays no syscall a pass. */
	int rdma = tcp_rdma_poll(tc); /* before: a lost session's READs flush with no socket left */
	if (!tc->conns_hi && !tc->woken)
		return rdma;
	tc->woken = false;
	int busy = rdma;
	struct epoll_event ev[64];
	int n = epoll_wait(tc->epfd, ev, 64, 0);
	for (int k = 0; k < n; k++) {
		uint64_t d = ev[k].data.u64;
		busy = KVSP_BUSY;
		if (d == TAG_LISTEN) {
			tcp_on_accept(tc);
		} else if (d == TAG_TIMER) {
			tcp_on_timer(tc);
		} else {
			struct tcp_conn *c = &tc->conn[(uint32_t)d % TCP_MAX_CONNS];
			if (c->state != TCP_C_FREE && c->id == (uint32_t)(d >> 32))
				tcp_on_conn_event(tc, c, ev[k].events);
		}
	}
	for (unsigned i = 0; i < tc->conns_hi; i++) {
		struct tcp_conn *c = &tc->conn[i];
		if (!tcp_conn_wants_tx(tc, c))
			continue;
		int rc = tcp_conn_tx(tc, c);
		if (rc < 0)
			tcp_conn_fail(tc, c, rc);
		else
			busy |= rc;
	}
	return busy;
}

static bool tcp_pending(struct kvsp_transport *t)
{
	struct tcp *tc = tcp_of(t);
	if (tc->woken || tcp_rdma_pending(tc))
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
		if (tc->sess[i].state == TCP_S_JOINING || tc->sess[i].state == TCP_S_UP)
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

static const char *tcp_endpoint(const struct kvsp_transport *t)
{
	return ((const struct tcp *)t)->endpoint;
}

static void tcp_destroy(struct kvsp_transport *t)
{
	struct tcp *tc = tcp_of(t);
	for (unsigned i = 0; i < tc->conns_hi; i++)
		tcp_conn_close(tc, &tc->conn[i]);
	for (unsigned i = 0; i < TCP_MAX_SESS; i++)
		tcp_rdma_sess_free(tc, &tc->sess[i]);
	tcp_rdma_close(tc);
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
	.endpoint = tcp_endpoint,
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

static struct kvsp_transport *tcp_create(struct kvsp *p, const void *opts, char *why, size_t why_len)
{
	const struct kvsp_peer_opts *o = opts;
	struct tcp *tc = calloc(1, sizeof(*tc));
	if (!tc) {
		snprintf(why, why_len, "out of memory");
		return NULL;
	}
	tc->t.ops = &tcp_ops;
	tc->t.p = p;
	tc->p = p;
	tc->secret = o->secret;
	tc->instance = kvsp_instance(p);
	tc->streams = o->streams ? o->streams : 2;
	tc->checksum = o->checksum;
	tc->timeout_ns = o->peer_timeout_ns;
	tc->st = kvsp_xport_stats(p);
	tc->peers = kvsp_xport_peers(p);
	tc->listen_fd = tc->timer_fd = -1;
	tc->nrooms = kvsp_room_count(p);
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
	if (rc == 0)
		rc = tcp_rdma_choose(tc, o, why, why_len);
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

const struct kvsp_xport_kind kvsp_peer_kind = { "tcp", tcp_create };
