/* SPDX-License-Identifier: MIT */
/*
 * The peer plane: rooms whose halves are on two proxies, as one transport
 * of the core (core/xport.h). The sending proxy dials the endpoint a
 * descriptor names (on demand, then reused), proves the secret, joins
 * --tcp-streams connections into one session (peer/session.c), says OPEN
 * for the room and, once the receiver acknowledged it (peer/room.c), gives
 * each chunk to a data path (datapath/). Aborts and ends travel both ways
 * with the room's token; a lost session releases exactly the pins it held.
 *
 * This file is the ops table the core calls, the loop's poll (accepts,
 * reads, the frames' owners, writes), the timer, and the plane's
 * lifetime. What is owed on a connection is decided in one place
 * (next_frame): writing it and saying whether there is anything to write
 * are the same call, so nothing owed can wait for the next PING. Whatever
 * can make a frame owed reaches the plane through one of its entry points
 * (an op of the core, a socket's event, the timer, a data path's
 * completion), and each sets tx_due: the next pass offers every connection
 * its frames, and a pass with nothing new costs no look at them.
 */
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include "core/counters.h"
#include "core/failpoint.h"
#include "core/xport.h"
#include "base/log.h"
#include "layout.h"
#include "peer/conn.h"
#include "peer/datapath.h"
#include "peer/frame.h"
#include "peer/peer.h"
#include "peer/plane.h"
#include "peer/room.h"
#include "peer/session.h"
#include "peer/unowned.h"

#define TAG_LISTEN UINT64_MAX
#define TAG_TIMER (UINT64_MAX - 1)
#define TAG_DP0 (UINT64_MAX - 2 - MAX_DPS) /* data path k's fd: TAG_DP0 + k */
#define BURST 64
#define MAX_DPS 8 /* the build's, and the one for frames of no data path here */

struct peer {
	struct kvsp_transport t;
	struct kvsp *p;
	struct kvs_stats *st;
	uint64_t timeout_ns, hs_ns;
	int epfd, listen_fd, timer_fd;
	int spare_fd; /* given up to accept (and close) a connection when out of fds */
	bool woken;   /* our epoll fd woke the loop (the listener, the timer, a socket) */
	bool tx_due;  /* something happened that may owe a frame: the next pass writes */
	struct kvsp_endpoint listen, advertise;
	char endpoint[64]; /* "tcp:" advertise; "" when we do not listen */
	struct pconn_table conns;
	struct psess_table sessions;
	struct proom_table rooms;
	struct kvsp_dp *dps[MAX_DPS];
	unsigned ndps;
	struct kvsp_dp *by_type[KVSP_FRAME_TYPES]; /* who reads each data path's frame types */
	struct kvsp_rl rl_conn, rl_sess;
	uint64_t accepts; /* connections accepted: failpoint peer.accept matches the count */
};

static struct peer *peer_of(struct kvsp_transport *t)
{
	return (struct peer *)t;
}

static uint64_t now_of(const struct peer *pr)
{
	return kvsp_xport_now(pr->p);
}

/* ---------------------------------------------------- what is owed where */

/* The next frame c owes, in the order the peer must hear them: on stream
 * 0 the session's own (PONG, PING, BYE), the data paths' about the session
 * (an RDMA HELLO), then the rooms' (refusals, OPEN, OPEN_ACK, ABORT, DONE,
 * ENDED); then each data path's (its control on stream 0, its chunks).
 * out NULL: only whether there is one. */
static bool next_frame(struct peer *pr, struct psess *s, struct pconn *c, struct kvsp_dp_frame *out)
{
	if (out) /* a frame without a payload sets none of these */
		*out = (struct kvsp_dp_frame){ .payload = NULL, .plen = 0, .x = NULL };
	if (c->stream == 0) {
		uint64_t now = out ? now_of(pr) : 0; /* a PING's value, an OPEN's time */
		union kvs_wire_body *body = out ? &out->body : NULL;
		uint16_t type;
		if (psess_next_frame(s, now, &type, body)) {
			if (out)
				out->type = type;
			return true;
		}
		for (unsigned k = 0; k < pr->ndps; k++)
			if (pr->dps[k]->ops->next_control &&
			    pr->dps[k]->ops->next_control(pr->dps[k], s, out))
				return true;
		if (proom_next_frame(&pr->rooms, s, now, &type, body)) {
			if (out)
				out->type = type;
			return true;
		}
	}
	for (unsigned k = 0; k < pr->ndps; k++)
		if (pr->dps[k]->ops->next_frame(pr->dps[k], s, c, out))
			return true;
	return false;
}

/* True if c has something to write now. */
static bool wants_tx(struct peer *pr, struct pconn *c)
{
	if (c->state != PCONN_UP || c->wblocked)
		return false;
	if (pconn_tx_busy(c))
		return pconn_tx_ready(c);
	struct psess *s = psess_up(&pr->sessions, c->sess);
	return s && next_frame(pr, s, c, NULL);
}

/* ------------------------------------------------------------- failures */

static void conn_fail(struct peer *pr, struct pconn *c, int status)
{
	if (c->state == PCONN_FREE)
		return;
	struct psess *s = psess_get(&pr->sessions, c->sess);
	if (s && psess_redial(&pr->sessions, s, c, status, now_of(pr)) == 0)
		return; /* a place refused, not us: dialed again */
	if (s) {
		psess_lost(&pr->sessions, s, status);
		return;
	}
	if (!c->dialer) {
		/* Not joined: nothing of ours rides on it, and who it is is not
		 * proven. Its lines are a peer's to cause: rate-limited. */
		KVS_STAT_ADD(pr->st->peer_auth_failed, 1);
		if (status == -ETIMEDOUT)
			KVS_STAT_ADD(pr->st->peer_timeouts, 1);
		kvsp_log_rl(&pr->rl_conn, now_of(pr), &pr->st->log_suppressed, KVSP_LOG_INFO,
			    "peer connection from %s refused before joining: %s", c->from.text,
			    strerror(-status));
	}
	pconn_close(&pr->conns, c);
}

/* ------------------------------------------------------------- writing */

static void on_sent(struct peer *pr, struct psess *s, uint16_t type, struct kvsp_xfer *x)
{
	s->last_tx_ns = now_of(pr);
	if (type == KVS_WIRE_PING)
		KVS_STAT_ADD(pr->st->peer_pings, 1);
	if (x && type < KVSP_FRAME_TYPES && pr->by_type[type] && pr->by_type[type]->ops->sent)
		pr->by_type[type]->ops->sent(pr->by_type[type], s, x);
	if (type == KVS_WIRE_BYE && s->closing)
		psess_bye_sent(&pr->sessions, s);
}

/* c's frames that are done go to their owners. Returns KVSP_BUSY if any did. */
static int conn_done(struct peer *pr, struct psess *s, struct pconn *c)
{
	int busy = KVSP_IDLE;
	uint16_t type;
	struct kvsp_xfer *x;
	while (pconn_tx_done(c, &type, &x)) {
		busy = KVSP_BUSY;
		on_sent(pr, s, type, x); /* a BYE may close c: its batch is empty then */
	}
	return busy;
}

/* Seals into c's batch what next_frame says s owes on it, while the batch
 * has room. Returns 0, or -errno (c is lost). */
static int conn_fill(struct peer *pr, struct psess *s, struct pconn *c)
{
	struct kvsp_dp_frame f;
	while (s->state == PSESS_UP && pconn_tx_room(c) && next_frame(pr, s, c, &f)) {
		int rc = pconn_put(c, f.type, &f.body, f.payload, f.plen, f.x);
		if (rc < 0)
			return rc;
	}
	return 0;
}

/* Writes what c owes until its socket is full, a batch a sendmsg. Returns
 * KVSP_BUSY or KVSP_IDLE. */
static int conn_tx(struct peer *pr, struct pconn *c)
{
	int busy = KVSP_IDLE;
	uint32_t id = c->id;
	for (int k = 0; k < BURST && c->state == PCONN_UP && c->id == id; k++) {
		/* A dialer's JOIN is written before its session is up. */
		struct psess *s = psess_get(&pr->sessions, c->sess);
		if (!s)
			break;
		int rc = conn_fill(pr, s, c);
		if (rc == 0 && !pconn_tx_ready(c))
			break; /* nothing owed, the socket is full, or a payload is held */
		if (rc == 0)
			rc = pconn_write(&pr->conns, c, now_of(pr));
		if (rc < 0) {
			conn_fail(pr, c, rc);
			break;
		}
		busy |= conn_done(pr, s, c);
		if (rc == 0)
			break;
	}
	return busy;
}

/* The kernel answered zerocopy sendmsgs of c (EPOLLERR): the frames whose
 * bytes it no longer reads are done. */
static void conn_zc(struct peer *pr, struct pconn *c)
{
	if (kvsp_xport_fp_ud(pr->p, KVSP_FP_TCP_ZC_NOTIFY, 0) == KVSP_FP_HOLD)
		return; /* test barrier: the answers wait unread */
	int rc = pconn_zc_reap(&pr->conns, c);
	if (rc < 0) {
		conn_fail(pr, c, rc);
		return;
	}
	struct psess *s = psess_get(&pr->sessions, c->sess);
	if (s && conn_done(pr, s, c))
		pr->tx_due = true; /* places in its batch came free */
}

/* ------------------------------------------------------------- reading */

/* A verified frame on c: whose it is. Returns 0, or -errno (c's session is lost). */
static int dispatch(struct peer *pr, struct pconn *c, const struct kvsp_frame *f)
{
	if (c->state == PCONN_JOINING)
		return psess_join(&pr->sessions, c, f, now_of(pr));
	struct psess *s = psess_up(&pr->sessions, c->sess);
	if (!s)
		return -EPROTO; /* frames for a session that is not up are refused */
	switch (f->type) {
	case KVS_WIRE_PING:
	case KVS_WIRE_PONG:
	case KVS_WIRE_BYE:
		return psess_on_frame(&pr->sessions, s, f);
	case KVS_WIRE_OPEN:
	case KVS_WIRE_OPEN_ACK:
	case KVS_WIRE_ABORT:
	case KVS_WIRE_ENDED:
	case KVS_WIRE_DONE:
		if (c->stream != 0)
			return -EPROTO; /* control goes on stream 0 only: that is its order */
		return proom_on_frame(&pr->rooms, s, f);
	}
	struct kvsp_dp *dp = f->type < KVSP_FRAME_TYPES ? pr->by_type[f->type] : NULL;
	if (!dp)
		return -EPROTO; /* JOIN again, or a frame nobody here speaks */
	return dp->ops->on_frame(dp, s, c, f);
}

/* The payload c's last frame announced is all in: its owner hears it.
 * Returns 0, or the refusal of the frame read with its tail (c is lost). */
static int payload_end(struct peer *pr, struct pconn *c)
{
	struct kvsp_dp *dp = c->rx_type < KVSP_FRAME_TYPES ? pr->by_type[c->rx_type] : NULL;
	struct psess *s = psess_up(&pr->sessions, c->sess);
	if (dp && dp->ops->payload_end && s)
		dp->ops->payload_end(dp, s, c);
	return pconn_rx_err(c);
}

/* Reads what c's socket has, a bounded amount. */
static int conn_rx(struct peer *pr, struct pconn *c)
{
	int busy = KVSP_IDLE;
	uint32_t id = c->id;
	for (int k = 0; k < BURST; k++) {
		if (c->id != id || c->state < PCONN_JOINING || c->rx_paused)
			break; /* closed, or its session is not up yet */
		struct kvsp_frame f;
		int rc = pconn_read(&pr->conns, c, &f, now_of(pr));
		if (rc == PCONN_NOTHING)
			break;
		if (rc == PCONN_FRAME)
			rc = dispatch(pr, c, &f);
		else if (rc == PCONN_PAYLOAD_END)
			rc = payload_end(pr, c);
		if (rc < 0) {
			conn_fail(pr, c, rc);
			break;
		}
		busy = KVSP_BUSY;
	}
	return busy;
}

static void on_conn_event(struct peer *pr, struct pconn *c, uint32_t events)
{
	pconn_ready(&pr->conns, c, events);
	if (events & EPOLLERR && c->state == PCONN_UP && pconn_zc_owed(c)) {
		uint32_t id = c->id;
		conn_zc(pr, c);
		if (c->id != id || c->state != PCONN_UP)
			return; /* it failed reading them */
	}
	if (c->rx_paused && events & (EPOLLERR | EPOLLHUP)) {
		conn_fail(pr, c, -ECONNRESET); /* hung up while its session was joining */
		return;
	}
	if (c->state == PCONN_CONNECTING || c->state == PCONN_HANDSHAKE) {
		int rc = pconn_handshake(&pr->conns, c, now_of(pr));
		if (rc == 1)
			rc = psess_authed(&pr->sessions, c, now_of(pr));
		if (rc < 0)
			conn_fail(pr, c, rc);
		if (rc != 0 || c->state != PCONN_JOINING)
			return;
	}
	conn_rx(pr, c);
}

/* ----------------------------------------------------- accept and timer */

/* At most a burst a pass: a flood of connections must not keep the loop
 * from everything else (the listener stays readable for the next pass). */
static void on_accept(struct peer *pr)
{
	for (unsigned k = 0; k < BURST; k++) {
		struct sockaddr_storage sa;
		socklen_t sl = sizeof(sa);
		int fd = accept4(pr->listen_fd, (struct sockaddr *)&sa, &sl,
				 SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0 && (errno == EMFILE || errno == ENFILE) && pr->spare_fd >= 0) {
			/* Out of fds: the listener would stay readable and the loop
			 * spin. Take the one waiting with our spare, and drop it. */
			close(pr->spare_fd);
			fd = accept4(pr->listen_fd, NULL, NULL, SOCK_CLOEXEC);
			if (fd >= 0)
				close(fd);
			pr->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
			KVS_STAT_ADD(pr->st->peer_refused, 1);
			kvsp_log_rl(&pr->rl_conn, now_of(pr), &pr->st->log_suppressed,
				    KVSP_LOG_WARN,
				    "peer connection refused: out of file descriptors");
			continue;
		}
		if (fd < 0)
			return;
		struct kvsp_endpoint from;
		if (kvsp_endpoint_of(&from, (struct sockaddr *)&sa, sl) < 0 ||
		    kvsp_xport_fp_ud(pr->p, KVSP_FP_PEER_ACCEPT, ++pr->accepts) < 0) {
			close(fd);
			continue;
		}
		/* Unproven connections get a bounded share: the newcomer takes
		 * the place of the longest-silent one, never the other way. */
		if (pconn_admit(&pr->conns, &from) != PCONN_NONE) {
			KVS_STAT_ADD(pr->st->peer_refused, 1);
			kvsp_log_rl(&pr->rl_conn, now_of(pr), &pr->st->log_suppressed,
				    KVSP_LOG_WARN,
				    "peer handshakes full: the longest silent one made way for %s",
				    from.text);
		}
		struct pconn *c = pconn_new(&pr->conns, fd, false, &from, now_of(pr));
		if (!c) {
			KVS_STAT_ADD(pr->st->peer_refused, 1);
			kvsp_log_rl(&pr->rl_conn, now_of(pr), &pr->st->log_suppressed,
				    KVSP_LOG_WARN,
				    "peer connection from %s refused: no place for it", from.text);
			continue;
		}
		/* A dialer speaks first, so an honest HELLO is usually here
		 * already: read it now. Unread, the connection would count as
		 * silent, and the next ones accepted in this pass from its
		 * address could evict it. */
		on_conn_event(pr, c, EPOLLIN);
	}
}

/* Every eighth of --peer-timeout: every deadline of a connection, a
 * session or an answer a room waits for. */
static void on_timer(struct peer *pr)
{
	uint64_t expirations, now = now_of(pr);
	if (read(pr->timer_fd, &expirations, sizeof(expirations)) < 0)
		return;
	for (unsigned i = 0; i < pr->conns.hi; i++) {
		struct pconn *c = &pr->conns.conn[i];
		/* A payload read at a mark (conn.c's rx_lowat) is read at every
		 * tick too: bytes that trickle in below the mark are its
		 * progress, as every piece was without one, and only a payload
		 * that stops arriving meets its deadline. */
		if (c->rx_lowat)
			conn_rx(pr, c);
		if (now > pconn_deadline(c, pr->hs_ns, pr->timeout_ns))
			conn_fail(pr, c, -ETIMEDOUT);
	}
	psess_tick(&pr->sessions, now);
	for (unsigned k = 0; k < pr->ndps; k++)
		if (pr->dps[k]->ops->tick)
			pr->dps[k]->ops->tick(pr->dps[k], now, pr->timeout_ns);
	uint32_t id;
	while ((id = proom_overdue(&pr->rooms, now, pr->timeout_ns))) {
		struct psess *s = psess_get(&pr->sessions, id);
		if (!s)
			continue;
		kvsp_log_rl(&pr->rl_sess, now, &pr->st->log_suppressed, KVSP_LOG_WARN,
			    "peer %s: a room's answer is overdue (%llu ms)", s->ep.text,
			    (unsigned long long)(pr->timeout_ns / 1000000));
		psess_lost(&pr->sessions, s, -ETIMEDOUT);
	}
	kvsp_rl_flush(&pr->rl_conn, now, KVSP_LOG_WARN, "peer connection lines", 0);
	kvsp_rl_flush(&pr->rl_sess, now, KVSP_LOG_INFO, "peer session lines", 0);
}

/* ------------------------------------------------------------- the ops */

static int peer_submit(struct kvsp_transport *t, struct kvsp_xfer *x)
{
	peer_of(t)->tx_due = true;
	return proom_submit(&peer_of(t)->rooms, x);
}

static void peer_cancel(struct kvsp_transport *t, uint32_t room, uint32_t gen, int status)
{
	struct peer *pr = peer_of(t);
	(void)status;
	pr->tx_due = true;
	proom_cancel(&pr->rooms, room, gen);
	for (unsigned k = 0; k < pr->ndps; k++)
		pr->dps[k]->ops->cancel(pr->dps[k], room, gen);
}

static void peer_notify(struct kvsp_transport *t, uint32_t room, uint32_t gen, int note, int status)
{
	peer_of(t)->tx_due = true;
	proom_notify(&peer_of(t)->rooms, room, gen, note, status);
}

static int peer_reach(struct kvsp_transport *t, const struct kvs_desc_wire *d,
		      const struct kvsp_party *who, uint32_t *peer)
{
	struct peer *pr = peer_of(t);
	if (strncmp(d->endpoint, "tcp:", 4))
		return -EOPNOTSUPP;
	struct kvsp_endpoint ep;
	if (!memchr(d->endpoint, 0, sizeof(d->endpoint)) ||
	    kvsp_endpoint_parse(d->endpoint + 4, &ep) < 0 || !kvsp_endpoint_port(&ep))
		return -EINVAL;
	if (pr->endpoint[0] && kvsp_endpoint_eq(&ep, &pr->advertise))
		return -ESTALE; /* one of ours, from before a restart */
	uint64_t instance = le64toh(d->instance);
	struct psess *s = psess_dialed(&pr->sessions, &ep);
	if (s && s->bye)
		return -ESHUTDOWN;
	if (s && (s->state == PSESS_UP || s->njoined) && s->instance != instance) {
		/* Another proxy than the descriptor's answers there, or the
		 * descriptor is old: a fresh session tells which. The old one
		 * keeps what rides on it and takes nothing new. */
		psess_retire(&pr->sessions, s);
		s = NULL;
	}
	if (!s) {
		int err = 0;
		s = psess_dial(&pr->sessions, &ep, who, now_of(pr), &err);
		if (!s)
			return err;
	}
	*peer = s->id;
	return 0;
}

static int peer_attach(struct kvsp_transport *t, uint32_t peer, uint32_t room, uint32_t gen,
		       const struct kvs_desc_wire *d)
{
	peer_of(t)->tx_due = true;
	return proom_attach(&peer_of(t)->rooms, peer, room, gen, d);
}

static int peer_poll(struct kvsp_transport *t)
{
	struct peer *pr = peer_of(t);
	int busy = KVSP_IDLE;
	for (unsigned k = 0; k < pr->ndps; k++)
		busy |= pr->dps[k]->ops->poll(
			pr->dps[k]); /* before: a lost session's READs flush */
	busy |= psess_reap(&pr->sessions, now_of(pr));
	pr->tx_due |= busy;
	/* With no connection, only the listener and the timer can have news,
	 * and the loop hears of those through our fd (peer_on_fd): a proxy
	 * with no peers pays no syscall a pass. */
	if (!pr->conns.hi && !pr->woken)
		return busy;
	pr->woken = false;
	struct epoll_event ev[64];
	KVS_STAT_ADD(pr->st->peer_epoll_waits, 1);
	int n = epoll_wait(pr->epfd, ev, 64, 0);
	for (int k = 0; k < n; k++) {
		uint64_t tag = ev[k].data.u64;
		busy = KVSP_BUSY;
		if (tag == TAG_LISTEN) {
			on_accept(pr);
		} else if (tag == TAG_TIMER) {
			on_timer(pr);
		} else if (tag >= TAG_DP0 && tag < TAG_DP0 + pr->ndps) {
			struct kvsp_dp *dp = pr->dps[tag - TAG_DP0];
			dp->ops->on_fd(dp); /* its poll, next pass, reaps what woke it */
		} else {
			struct pconn *c = pconn_of_tag(&pr->conns, tag);
			if (c)
				on_conn_event(pr, c, ev[k].events);
		}
	}
	if (!(pr->tx_due | (n > 0)))
		return busy; /* nothing new since the last look: nothing new is owed */
	pr->tx_due = false;
	for (unsigned i = 0; i < pr->conns.hi; i++) {
		struct pconn *c = &pr->conns.conn[i];
		if (wants_tx(pr, c) && conn_tx(pr, c) == KVSP_BUSY) {
			busy = KVSP_BUSY;
			pr->tx_due = true; /* it may have stopped at its burst: look again */
		}
	}
	return busy;
}

static bool peer_pending(struct kvsp_transport *t)
{
	struct peer *pr = peer_of(t);
	if (pr->woken || pr->tx_due)
		return true;
	for (unsigned k = 0; k < pr->ndps; k++)
		if (pr->dps[k]->ops->pending(pr->dps[k]))
			return true;
	return false;
}

static void peer_drain(struct kvsp_transport *t)
{
	peer_of(t)->tx_due = true;
	psess_drain(&peer_of(t)->sessions);
}

static void peer_on_fd(struct kvsp_transport *t, uint32_t tag, uint32_t events)
{
	/* Our epoll fd woke the loop; peer_poll reads it. */
	peer_of(t)->woken = true;
	(void)tag;
	(void)events;
}

static int peer_loop_fd(struct kvsp_transport *t)
{
	return peer_of(t)->epfd;
}

static const char *peer_endpoint(const struct kvsp_transport *t)
{
	return ((const struct peer *)t)->endpoint;
}

static void peer_destroy(struct kvsp_transport *t)
{
	struct peer *pr = peer_of(t);
	psess_fini(&pr->sessions);
	pconn_table_fini(&pr->conns);
	for (unsigned k = 0; k < pr->ndps; k++)
		pr->dps[k]->ops->destroy(pr->dps[k]);
	proom_fini(&pr->rooms);
	if (pr->listen_fd >= 0)
		close(pr->listen_fd);
	if (pr->spare_fd >= 0)
		close(pr->spare_fd);
	if (pr->timer_fd >= 0)
		close(pr->timer_fd);
	if (pr->epfd >= 0) {
		kvsp_xport_fd_del(pr->p, pr->epfd);
		close(pr->epfd);
	}
	free(pr);
}

static const struct kvsp_transport_ops peer_ops = {
	.name = "peer",
	.submit = peer_submit,
	.cancel = peer_cancel,
	.notify = peer_notify,
	.reach = peer_reach,
	.attach = peer_attach,
	.poll = peer_poll,
	.pending = peer_pending,
	.loop_fd = peer_loop_fd,
	.on_fd = peer_on_fd,
	.drain = peer_drain,
	.endpoint = peer_endpoint,
	.destroy = peer_destroy,
};

/* ------------------------------------------------------------- creation */

static int open_listener(struct peer *pr, bool advertised, char *why, size_t len)
{
	const struct kvsp_endpoint *l = &pr->listen;
	int fd = socket(l->sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	int one = 1;
	if (fd < 0) {
		snprintf(why, len, "--listen %s: socket: %s", l->text, strerror(errno));
		return -errno;
	}
	setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	pconn_zc_prepare(&pr->conns, fd); /* accepted connections inherit it */
	if (bind(fd, (const struct sockaddr *)&l->sa, l->len) < 0 || listen(fd, 128) < 0) {
		int e = errno;
		snprintf(why, len, "--listen %s: %s", l->text, strerror(e));
		close(fd);
		return -e;
	}
	pr->listen_fd = fd;
	/* Port 0: the kernel chose; peers must hear the one it chose. */
	struct sockaddr_storage sa;
	socklen_t sl = sizeof(sa);
	struct kvsp_endpoint bound;
	getsockname(fd, (struct sockaddr *)&sa, &sl);
	kvsp_endpoint_of(&bound, (struct sockaddr *)&sa, sl);
	if (!advertised) {
		static const struct in6_addr any6 = IN6ADDR_ANY_INIT;
		bool any = l->sa.ss_family == AF_INET6
				   ? !memcmp(&((const struct sockaddr_in6 *)&l->sa)->sin6_addr,
					     &any6, sizeof(any6))
				   : ((const struct sockaddr_in *)&l->sa)->sin_addr.s_addr == 0;
		if (any) {
			snprintf(why, len,
				 "--listen %s is every address: say which one peers dial "
				 "with --advertise HOST:PORT",
				 l->text);
			return -EINVAL;
		}
		pr->advertise = bound;
	} else if (!kvsp_endpoint_port(&pr->advertise)) {
		/* --advertise HOST:0: the host given, the port chosen */
		char host[64];
		snprintf(host, sizeof(host), "%s", pr->advertise.text);
		*strrchr(host, ':') = 0;
		char text[80];
		snprintf(text, sizeof(text), "%s:%u", host, kvsp_endpoint_port(&bound));
		kvsp_endpoint_parse(text, &pr->advertise);
	}
	snprintf(pr->endpoint, sizeof(pr->endpoint), "tcp:%.59s", pr->advertise.text);
	struct epoll_event ev = { .events = EPOLLIN, .data.u64 = TAG_LISTEN };
	return epoll_ctl(pr->epfd, EPOLL_CTL_ADD, fd, &ev) < 0 ? -errno : 0;
}

/* What a data path of the build names, before it is made (create copies
 * base, so its instance and any it makes of its own hold them): its
 * counters, in the counter block, and its failpoints' ids. They are there
 * whether or not this proxy runs it. Returns 0, or -errno with why said. */
static int datapath_names(struct peer *pr, struct kvsp_dp *base, char *why, size_t len)
{
	const struct kvsp_dp_ops *ops = base->ops;
	base->ctr = NULL;
	int rc = ops->counters ? kvsp_counters_add(pr->p, ops->counters, &base->ctr) : 0;
	if (rc < 0) {
		snprintf(why, len, "%s data path: its counters: %s", ops->name, strerror(-rc));
		return rc;
	}
	base->fp = 0;
	for (unsigned i = 0; ops->failpoints && ops->failpoints[i]; i++) {
		int id = kvsp_fp_register(pr->p, ops->failpoints[i]);
		if (id < 0) {
			snprintf(why, len, "%s data path: failpoint %s: %s", ops->name,
				 ops->failpoints[i], strerror(-id));
			return id;
		}
		if (i == 0)
			base->fp = (unsigned)id;
	}
	return 0;
}

/* dp, made, reads its frame types. Returns 0, or -errno with why said. */
static int datapath_frames(struct peer *pr, struct kvsp_dp *dp, char *why, size_t len)
{
	const struct kvsp_dp_ops *ops = dp->ops;
	for (const struct kvsp_dp_frame_type *ft = ops->frames; ft && ft->type; ft++) {
		int rc = ft->size ? kvsp_frame_register(ft->type, ft->size, ft->flags)
				  : (kvsp_frame_kind(ft->type) ? 0 : -ENOMSG);
		if (rc < 0 || pr->by_type[ft->type]) {
			snprintf(why, len, "%s data path: frame type %u: %s", ops->name, ft->type,
				 rc < 0 ? strerror(-rc) : "another data path reads it");
			return rc < 0 ? rc : -EEXIST;
		}
		pr->by_type[ft->type] = dp;
	}
	return 0;
}

/* The build's data paths that this proxy runs, in order, then the one that
 * answers the frames of those it does not (peer/unowned.c). */
static int open_datapaths(struct peer *pr, const struct kvsp_peer_opts *o, char *why, size_t len)
{
	struct kvsp_dp base = { .p = pr->p,
				.t = &pr->t,
				.sessions = &pr->sessions,
				.conns = &pr->conns,
				.st = pr->st,
				.dps = pr->dps,
				.ndps = &pr->ndps };
	for (unsigned k = 0; k == 0 || o->datapaths[k - 1]; k++) {
		base.ops = o->datapaths[k] ? o->datapaths[k] : &kvsp_unowned;
		base.conf = o->datapaths[k] && o->dp_conf ? o->dp_conf[k] : NULL;
		if (pr->ndps == MAX_DPS) {
			snprintf(why, len, "peer plane: more than %u data paths", MAX_DPS - 1);
			return -E2BIG;
		}
		int rc = datapath_names(pr, &base, why, len);
		if (rc < 0)
			return rc;
		int err = 0;
		struct kvsp_dp *dp = base.ops->create(&base, o, why, len, &err);
		if (!dp) {
			if (err < 0)
				return err;
			continue; /* not on this proxy: its frames are answered by their type */
		}
		int fd = dp->ops->loop_fd ? dp->ops->loop_fd(dp) : -1;
		struct epoll_event ev = { .events = EPOLLIN, .data.u64 = TAG_DP0 + pr->ndps };
		pr->dps[pr->ndps++] = dp;
		if (fd >= 0 && epoll_ctl(pr->epfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
			snprintf(why, len, "%s data path: epoll: %s", dp->ops->name,
				 strerror(errno));
			return -errno;
		}
		if (o->datapaths[k]) {
			rc = datapath_frames(pr, dp, why, len);
			if (rc < 0)
				return rc;
			continue;
		}
		for (unsigned ty = 0; ty < KVSP_FRAME_TYPES; ty++) {
			const struct kvsp_frame_kind *fk = kvsp_frame_kind(ty);
			if (fk && fk->flags & KVSP_FRAME_DATAPATH && !pr->by_type[ty])
				pr->by_type[ty] = dp;
		}
	}
	return 0;
}

static int start(struct peer *pr, const struct kvsp_peer_opts *o, char *why, size_t len)
{
	if (!pr->rooms.r) {
		snprintf(why, len, "peer plane: out of memory");
		return -ENOMEM;
	}
	uint64_t *ctr;
	int rc = kvsp_counters_add(pr->p, pconn_counters, &ctr);
	if (rc < 0) {
		snprintf(why, len, "peer plane: its counters: %s", strerror(-rc));
		return rc;
	}
	if (pr->epfd < 0 || pr->timer_fd < 0 ||
	    pconn_table_init(&pr->conns, pr->epfd, (uint32_t)kvsp_slot_size(pr->p),
			     kvsp_instance(pr->p), o->secret, pr->st, ctr, o->zerocopy) < 0) {
		snprintf(why, len, "peer plane: %s", strerror(errno ? errno : ENOMEM));
		return -ENOMEM;
	}
	if (o->advertise && kvsp_endpoint_parse(o->advertise, &pr->advertise) < 0) {
		snprintf(why, len, "--advertise '%s': want IPV4:PORT or [IPV6]:PORT", o->advertise);
		return -EINVAL;
	}
	if (o->listen) {
		if (kvsp_endpoint_parse(o->listen, &pr->listen) < 0) {
			snprintf(why, len, "--listen '%s': want IPV4:PORT or [IPV6]:PORT",
				 o->listen);
			return -EINVAL;
		}
		rc = open_listener(pr, o->advertise != NULL, why, len);
		if (rc < 0)
			return rc;
	}
	rc = open_datapaths(pr, o, why, len);
	if (rc < 0)
		return rc;
	uint64_t q = pr->timeout_ns / 8;
	struct itimerspec its = { .it_interval = { (time_t)(q / 1000000000),
						   (long)(q % 1000000000) } };
	its.it_value = its.it_interval;
	struct epoll_event ev = { .events = EPOLLIN, .data.u64 = TAG_TIMER };
	if (timerfd_settime(pr->timer_fd, 0, &its, NULL) < 0 ||
	    epoll_ctl(pr->epfd, EPOLL_CTL_ADD, pr->timer_fd, &ev) < 0) {
		snprintf(why, len, "peer plane: %s", strerror(errno));
		return -errno;
	}
	return 0;
}

static struct kvsp_transport *peer_create(struct kvsp *p, const void *opts, char *why, size_t len)
{
	const struct kvsp_peer_opts *o = opts;
	struct peer *pr = calloc(1, sizeof(*pr));
	if (!pr) {
		snprintf(why, len, "peer plane: out of memory");
		return NULL;
	}
	pr->t.ops = &peer_ops;
	pr->t.p = p;
	pr->p = p;
	pr->st = kvsp_xport_stats(p);
	pr->timeout_ns = o->peer_timeout_ns;
	pr->hs_ns = o->peer_timeout_ns / 4; /* a handshake is round trips: well under it */
	pr->listen_fd = -1;
	pr->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	pr->epfd = epoll_create1(EPOLL_CLOEXEC);
	pr->timer_fd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
	struct psess_table *st = &pr->sessions;
	st->p = p;
	st->t = &pr->t;
	st->conns = &pr->conns;
	st->dps = pr->dps;
	st->ndps = &pr->ndps;
	st->st = pr->st;
	st->pub = kvsp_xport_peers(p);
	st->rl_sess = &pr->rl_sess;
	st->streams = o->streams ? o->streams : 2;
	st->timeout_ns = pr->timeout_ns;
	st->hs_ns = pr->hs_ns;
	st->idle_ns = 6 * pr->timeout_ns;
	st->rooms_on = proom_rooms_on;
	st->rooms_arg = &pr->rooms;
	pr->rooms = (struct proom_table){ .p = p,
					  .t = &pr->t,
					  .sessions = st,
					  .dps = pr->dps,
					  .ndps = &pr->ndps,
					  .st = pr->st };
	if (proom_init(&pr->rooms) < 0)
		proom_fini(&pr->rooms);
	if (start(pr, o, why, len) < 0) {
		peer_destroy(&pr->t);
		return NULL;
	}
	return &pr->t;
}

const struct kvsp_xport_kind kvsp_peer_kind = { "peer", peer_create };

struct kvsp_dp *const *kvsp_peer_datapaths(struct kvsp_transport *t, unsigned *n)
{
	struct peer *pr = peer_of(t);
	*n = pr->ndps;
	return pr->dps;
}
