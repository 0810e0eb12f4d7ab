/* SPDX-License-Identifier: MIT */
/*
 * One connection between proxies (peer/conn.h). Its life; no other file
 * changes a connection's state:
 *
 *   FREE --dial--> CONNECTING --connected--> HANDSHAKE --proved--> UP
 *   FREE --accept-------------------------> HANDSHAKE --proved--> JOINING --JOIN--> UP
 *   any state --close--> FREE (a zerocopy one the kernel still reads for:
 *                         a zombie of its session, closed once answered)
 *
 * Deadlines (pconn_deadline): every state before UP ends by born + the
 * handshake time; an UP connection lives as long as its session, except
 * that a payload which stops arriving is overdue past the peer timeout.
 * Past its deadline the plane fails it: an unjoined one is closed and
 * counted, a joined one loses its session.
 */
#include "peer/conn.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "core/counters.h"
#include "layout.h"

/* Named as they were when they were fields of struct kvs_stats, so
 * kvstage-stat, --json, /metrics and barriers say what they said. */
const struct kvsp_counter_def pconn_counters[PCONN_NCTR + 1] = {
	[PCONN_CTR_BYTES_TX] = { "tcp_bytes_tx", "kvstage_tcp_sent_bytes_total",
				 "Bytes written to peer connections.", false },
	[PCONN_CTR_BYTES_RX] = { "tcp_bytes_rx", "kvstage_tcp_received_bytes_total",
				 "Bytes read from peer connections.", false },
	[PCONN_CTR_SEND_CALLS] = { "tcp_send_calls", "kvstage_tcp_send_calls_total",
				   "sendmsg and send calls on peer connections, those that found "
				   "the socket full included.",
				   false },
	[PCONN_CTR_RECV_CALLS] = { "tcp_recv_calls", "kvstage_tcp_recv_calls_total",
				   "recv and recvmsg calls on peer connections, those that found "
				   "nothing included.",
				   false },
	[PCONN_CTR_LOWAT_CALLS] = { "tcp_lowat_calls", "kvstage_tcp_lowat_calls_total",
				    "setsockopt(SO_RCVLOWAT) calls on peer connections: a large "
				    "payload's wake-up mark.",
				    false },
	[PCONN_CTR_ZC_SENDS] = { "tcp_zc_sends", "kvstage_tcp_zerocopy_sends_total",
				 "sendmsg calls with MSG_ZEROCOPY on peer connections "
				 "(--tcp-zerocopy).",
				 false },
	[PCONN_CTR_ZC_COPIED] = { "tcp_zc_copied", "kvstage_tcp_zerocopy_copied_total",
				  "Zerocopy sendmsg calls the kernel said it copied anyway "
				  "(loopback, veth).",
				  false },
	[PCONN_NCTR] = { 0 },
};

int pconn_table_init(struct pconn_table *t, int epfd, uint32_t max_payload, uint64_t instance,
		     const struct kvsp_secret *secret, struct kvs_stats *st, uint64_t *ctr,
		     bool zerocopy)
{
	t->zerocopy = zerocopy;
	for (unsigned i = 0; i < PCONN_MAX; i++)
		t->zombie[i].fd = -1;
	t->nzombies = 0;
	t->epfd = epfd;
	t->max_payload = max_payload;
	t->instance = instance;
	t->secret = secret;
	t->st = st;
	t->ctr = ctr;
	t->sink = malloc(PCONN_SINK_SIZE);
	return t->sink ? 0 : -ENOMEM;
}

void pconn_table_fini(struct pconn_table *t)
{
	for (unsigned i = 0; i < t->hi; i++)
		pconn_close(t, &t->conn[i]);
	pconn_zombies_close(t, 0); /* the proxy is going: nothing reuses the pool */
	free(t->sink);
	t->sink = NULL;
}

/* What c waits for: to read unless paused; to write while connecting or full. */
static int watch(struct pconn_table *t, struct pconn *c, int op)
{
	uint32_t events = (c->rx_paused ? 0 : EPOLLIN) |
			  (c->wblocked || c->state == PCONN_CONNECTING ? EPOLLOUT : 0);
	struct epoll_event ev = { .events = events, .data.u64 = (uint64_t)c->id << 32 | c->idx };
	KVS_STAT_ADD(t->st->peer_epoll_ctls, 1);
	return epoll_ctl(t->epfd, op, c->fd, &ev) < 0 ? -errno : 0;
}

void pconn_rx_pause(struct pconn_table *t, struct pconn *c, bool paused)
{
	if (c->rx_paused == paused || c->state == PCONN_FREE)
		return;
	c->rx_paused = paused;
	watch(t, c, EPOLL_CTL_MOD);
}

void pconn_ready(struct pconn_table *t, struct pconn *c, uint32_t events)
{
	if (events & EPOLLOUT && c->wblocked) {
		c->wblocked = false;
		watch(t, c, EPOLL_CTL_MOD);
	}
}

struct pconn *pconn_of_tag(struct pconn_table *t, uint64_t tag)
{
	struct pconn *c = &t->conn[(uint32_t)tag % PCONN_MAX];
	return c->state != PCONN_FREE && c->id == (uint32_t)(tag >> 32) ? c : NULL;
}

/* ------------------------------------------------------------ lifetime */

static bool unjoined(const struct pconn *c)
{
	return !c->dialer && (c->state == PCONN_HANDSHAKE || c->state == PCONN_JOINING);
}

/* True if a has been silent longer than b: never a byte before any byte, then the longer wait. */
static bool more_silent(const struct pconn *a, const struct pconn *b)
{
	if (a->heard != b->heard)
		return !a->heard;
	return a->last_rx_ns < b->last_rx_ns;
}

uint32_t pconn_admit(struct pconn_table *t, const struct kvsp_endpoint *from)
{
	unsigned all = 0, mine = 0;
	uint32_t oldest = PCONN_NONE, oldest_mine = PCONN_NONE;
	for (unsigned i = 0; i < t->hi; i++) {
		const struct pconn *c = &t->conn[i];
		if (!unjoined(c))
			continue;
		all++;
		if (oldest == PCONN_NONE || more_silent(c, &t->conn[oldest]))
			oldest = i;
		if (kvsp_endpoint_same_host(&c->from, from)) {
			mine++;
			if (oldest_mine == PCONN_NONE || more_silent(c, &t->conn[oldest_mine]))
				oldest_mine = i;
		}
	}
	uint32_t victim = mine >= PCONN_PER_SOURCE  ? oldest_mine
			  : all >= PCONN_HANDSHAKES ? oldest
						    : PCONN_NONE;
	if (victim != PCONN_NONE)
		pconn_close(t, &t->conn[victim]);
	return victim;
}

struct pconn *pconn_new(struct pconn_table *t, int fd, bool dialer,
			const struct kvsp_endpoint *from, uint64_t now)
{
	unsigned i;
	for (i = 0; i < PCONN_MAX && t->conn[i].state != PCONN_FREE; i++)
		;
	if (i == PCONN_MAX) {
		close(fd);
		return NULL;
	}
	struct pconn *c = &t->conn[i];
	memset(c, 0, sizeof(*c));
	c->fd = fd;
	c->idx = (uint16_t)i;
	c->id = ++t->gen;
	c->dialer = dialer;
	c->from = *from;
	c->state = dialer ? PCONN_CONNECTING : PCONN_HANDSHAKE;
	c->born_ns = c->last_rx_ns = now;
	c->q_head = c->q_tail = PCONN_NONE;
	int one = 1;
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	c->zc_on = t->zerocopy && pconn_zc_set(fd);
	if (kvsp_auth_start(&c->auth, t->secret, dialer ? KVS_WIRE_DIALER : KVS_WIRE_LISTENER,
			    t->instance) < 0 ||
	    watch(t, c, EPOLL_CTL_ADD) < 0) {
		close(fd);
		c->state = PCONN_FREE;
		return NULL;
	}
	if (i >= t->hi)
		t->hi = i + 1;
	return c;
}

void pconn_close(struct pconn_table *t, struct pconn *c)
{
	if (c->state == PCONN_FREE)
		return;
	KVS_STAT_ADD(t->st->peer_epoll_ctls, 1);
	epoll_ctl(t->epfd, EPOLL_CTL_DEL, c->fd, NULL);
	if (!pconn_zc_owed(c) || !pconn_zombie_from(t, c))
		close(c->fd);
	kvsp_auth_wipe(&c->auth);
	kvsp_frame_tx_wipe(&c->ftx);
	kvsp_frame_rx_wipe(&c->frx);
	c->state = PCONN_FREE;
	c->sess = 0;
	c->pub = NULL;
	c->rx_x = NULL; /* its owner releases it, and the batch's, with every other pin */
	c->tx_head = c->tx_n = c->tx_sent = 0;
	c->tx_off = 0;
	c->tx_pbytes = 0;
	c->qn = 0;
	c->q_head = c->q_tail = PCONN_NONE;
	c->zc = (struct pconn_zc){ 0 };
	while (t->hi && t->conn[t->hi - 1].state == PCONN_FREE)
		t->hi--;
}

void pconn_authed(struct pconn *c, uint32_t sess, unsigned stream)
{
	if (c->dialer) {
		c->state = PCONN_UP;
		c->sess = sess;
		c->stream = stream;
	} else {
		c->state = PCONN_JOINING; /* its first frame must say which session */
	}
}

void pconn_joined(struct pconn *c, uint32_t sess, unsigned stream, struct kvs_peer *pub)
{
	c->state = PCONN_UP;
	c->sess = sess;
	c->stream = stream;
	c->pub = pub;
}

uint64_t pconn_deadline(const struct pconn *c, uint64_t hs_ns, uint64_t timeout_ns)
{
	if (c->state == PCONN_FREE)
		return UINT64_MAX;
	if (c->state != PCONN_UP)
		return c->born_ns + hs_ns;
	/* A payload that stops arriving holds its posted slot: it may pause
	 * as long as a silent peer may, no longer. */
	if (c->rx_len && c->rx_off < c->rx_len)
		return c->last_rx_ns + timeout_ns;
	return UINT64_MAX;
}

/* ----------------------------------------------------------- handshake */

/* Writes what is left of the handshake's message. Returns 1 once it is all
 * out, 0 while the socket is full (c waits for EPOLLOUT), or -errno. */
static int hs_send(struct pconn_table *t, struct pconn *c)
{
	while (c->hs_out_off < c->hs_out_len) {
		KVS_STAT_ADD(t->ctr[PCONN_CTR_SEND_CALLS], 1);
		ssize_t n = send(c->fd, c->hs_out + c->hs_out_off, c->hs_out_len - c->hs_out_off,
				 MSG_DONTWAIT | MSG_NOSIGNAL);
		if (n < 0) {
			if (errno != EAGAIN)
				return -errno;
			c->wblocked = true;
			watch(t, c, EPOLL_CTL_MOD);
			return 0;
		}
		c->hs_out_off += (uint32_t)n;
	}
	return 1;
}

int pconn_handshake(struct pconn_table *t, struct pconn *c, uint64_t now)
{
	if (c->state == PCONN_CONNECTING) {
		int err = 0;
		socklen_t len = sizeof(err);
		if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0)
			err = errno;
		if (err == EINPROGRESS || err == EALREADY)
			return 0;
		if (err)
			return -err;
		c->state = PCONN_HANDSHAKE;
		watch(t, c, EPOLL_CTL_MOD);
	}
	for (;;) {
		int sent = hs_send(t, c);
		if (sent <= 0)
			return sent;
		enum kvsp_auth_step step = kvsp_auth_next(&c->auth);
		int rc = 0;
		switch (step) {
		case KVSP_AUTH_SEND_HELLO:
		case KVSP_AUTH_SEND_PROOF:
			rc = step == KVSP_AUTH_SEND_HELLO ? kvsp_auth_hello(&c->auth, c->hs_out)
							  : kvsp_auth_proof(&c->auth, c->hs_out);
			c->hs_out_len = step == KVSP_AUTH_SEND_HELLO ? KVS_WIRE_HELLO_SIZE
								     : KVS_WIRE_PROOF_SIZE;
			c->hs_out_off = 0;
			break;
		case KVSP_AUTH_RECV_HELLO:
		case KVSP_AUTH_RECV_PROOF: {
			uint32_t need = step == KVSP_AUTH_RECV_HELLO ? KVS_WIRE_HELLO_SIZE
								     : KVS_WIRE_PROOF_SIZE;
			/* Exactly this message: what follows it is the first frame's. */
			KVS_STAT_ADD(t->ctr[PCONN_CTR_RECV_CALLS], 1);
			ssize_t n =
				recv(c->fd, c->hs_in + c->hs_have, need - c->hs_have, MSG_DONTWAIT);
			if (n == 0)
				return -ECONNRESET;
			if (n < 0)
				return errno == EAGAIN ? 0 : -errno;
			c->last_rx_ns = now;
			c->heard = true;
			c->hs_have += (uint32_t)n;
			if (c->hs_have < need)
				return 0;
			c->hs_have = 0;
			rc = step == KVSP_AUTH_RECV_HELLO ? kvsp_auth_on_hello(&c->auth, c->hs_in)
							  : kvsp_auth_on_proof(&c->auth, c->hs_in);
			break;
		}
		case KVSP_AUTH_DONE: {
			struct kvsp_frame_keys k;
			if (kvsp_auth_keys(&c->auth, &k) < 0)
				return -EPROTO;
			kvsp_frame_tx_init(&c->ftx, k.tx);
			kvsp_frame_rx_init(&c->frx, k.rx, t->max_payload);
			memset(&k, 0, sizeof(k));
			return 1;
		}
		default:
			return c->auth.err ? c->auth.err : -EPROTO;
		}
		if (rc < 0)
			return rc;
	}
}

void pconn_dialed(struct pconn_table *t, struct pconn *c)
{
	struct pollfd pfd = { .fd = c->fd, .events = POLLOUT };
	if (c->state != PCONN_CONNECTING || poll(&pfd, 1, 0) != 1 || pfd.revents != POLLOUT)
		return; /* the loop hears how the connect went */
	/* The HELLO only, never a read: the listener may answer at once
	 * (loopback, another CPU), and a handshake that finished here would
	 * have no one to join its session. The loop reads the answer. */
	c->state = PCONN_HANDSHAKE;
	watch(t, c, EPOLL_CTL_MOD);
	if (kvsp_auth_next(&c->auth) != KVSP_AUTH_SEND_HELLO ||
	    kvsp_auth_hello(&c->auth, c->hs_out) < 0)
		return;
	c->hs_out_len = KVS_WIRE_HELLO_SIZE;
	c->hs_out_off = 0;
	/* A failure is the socket's: its error wakes the loop, which fails c. */
	(void)hs_send(t, c);
}

/* --------------------------------------------------------------- write */

static unsigned ring(const struct pconn *c, unsigned k)
{
	return (c->tx_head + k) % PCONN_TX_FRAMES;
}

/* The held payload is the batch's last (it ends the batch). */
static bool held_payload(const struct pconn *c, unsigned k)
{
	return c->tx_held && k + 1 == c->tx_n;
}

/* What is left to write that may go now, as iovecs (frame, payload, ...). Returns their count. */
static int tx_iov(const struct pconn *c, struct iovec *iov, size_t *len)
{
	int n = 0;
	uint32_t done = c->tx_off;
	*len = 0;
	for (unsigned k = c->tx_sent; k < c->tx_n; k++, done = 0) {
		unsigned i = ring(c, k);
		const struct pconn_tx *f = &c->tx[i];
		if (done < f->len)
			iov[n++] = (struct iovec){ (uint8_t *)c->txbuf[i] + done, f->len - done };
		uint32_t pdone = done > f->len ? done - f->len : 0;
		if (pdone < f->plen && !held_payload(c, k))
			iov[n++] = (struct iovec){ (uint8_t *)f->payload + pdone, f->plen - pdone };
	}
	for (int k = 0; k < n; k++)
		*len += iov[k].iov_len;
	return n;
}

/* n more bytes left, in order: frames all out are counted sent. zc: a
 * zerocopy call took them, whose answer frees its frames (zc_end). */
static void tx_advance(struct pconn *c, size_t n, bool zc)
{
	while (n) {
		struct pconn_tx *f = &c->tx[ring(c, c->tx_sent)];
		if (zc) {
			f->zc = true;
			f->zc_end = c->zc.sent;
		}
		uint32_t left = f->len + f->plen - c->tx_off;
		uint32_t k = n < left ? (uint32_t)n : left;
		c->tx_off += k;
		n -= k;
		if (c->tx_off == f->len + f->plen) {
			c->tx_sent++;
			c->tx_off = 0;
			c->tx_pbytes -= f->plen; /* the batch's bytes are those still to write */
		}
	}
}

bool pconn_tx_busy(const struct pconn *c)
{
	return c->tx_sent < c->tx_n;
}

bool pconn_tx_ready(const struct pconn *c)
{
	if (c->state != PCONN_UP || c->wblocked || !pconn_tx_busy(c))
		return false;
	/* Only the last frame's payload can be held: anything before it can go. */
	return c->tx_sent + 1 < c->tx_n || c->tx_off < c->tx[ring(c, c->tx_sent)].len ||
	       !c->tx_held;
}

bool pconn_tx_room(const struct pconn *c)
{
	if (c->tx_n == PCONN_TX_FRAMES)
		return false;
	if (!c->tx_n)
		return true;
	const struct pconn_tx *last = &c->tx[ring(c, c->tx_n - 1)];
	/* All written, some awaiting the kernel's zerocopy answer: a new batch
	 * (but nothing goes after a BYE). */
	if (c->tx_sent == c->tx_n)
		return last->type != KVS_WIRE_BYE;
	return last->plen && !c->tx_held && c->tx_pbytes < PCONN_TX_BYTES;
}

int pconn_put(struct pconn *c, uint16_t type, const void *body, const void *payload, uint32_t plen,
	      struct kvsp_xfer *x)
{
	if (c->tx_n == PCONN_TX_FRAMES)
		return -ENOBUFS;
	unsigned i = ring(c, c->tx_n);
	int n = kvsp_frame_seal(&c->ftx, type, body, plen, c->txbuf[i]);
	if (n < 0)
		return n;
	c->tx[i] = (struct pconn_tx){ .payload = payload,
				      .x = x,
				      .len = (uint32_t)n,
				      .plen = plen,
				      .type = type };
	c->tx_n++;
	c->tx_pbytes += plen;
	return 0;
}

/* The socket took less than it was offered, or nothing: it is full. */
static void tx_full(struct pconn_table *t, struct pconn *c)
{
	c->wblocked = true;
	watch(t, c, EPOLL_CTL_MOD);
}

int pconn_write(struct pconn_table *t, struct pconn *c, uint64_t now)
{
	(void)now;
	struct iovec iov[2 * PCONN_TX_FRAMES];
	size_t want;
	int n_iov = pconn_tx_ready(c) ? tx_iov(c, iov, &want) : 0;
	if (!n_iov)
		return 0;
	struct msghdr m = { .msg_iov = iov, .msg_iovlen = (size_t)n_iov };
	/* Zerocopy for a batch with payload enough to pay for the answer, while
	 * the kernel owes fewer answers than the window. */
	bool zc = c->zc_on && want >= PCONN_ZC_MIN && c->zc.sent - c->zc.done < PCONN_ZC_WINDOW;
	KVS_STAT_ADD(t->ctr[PCONN_CTR_SEND_CALLS], 1);
	ssize_t n = sendmsg(c->fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL | (zc ? MSG_ZEROCOPY : 0));
	if (n < 0 && zc && errno == ENOBUFS) { /* no memory left for its answer: copy */
		zc = false;
		KVS_STAT_ADD(t->ctr[PCONN_CTR_SEND_CALLS], 1);
		n = sendmsg(c->fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
	}
	if (n < 0) {
		if (errno != EAGAIN)
			return -errno;
		tx_full(t, c);
		return 0;
	}
	KVS_STAT_ADD(t->ctr[PCONN_CTR_BYTES_TX], (uint64_t)n);
	if (c->pub)
		KVS_STAT_ADD(c->pub->bytes_tx, (uint64_t)n);
	if (zc) { /* the call took bytes: the kernel numbered it, as we do */
		c->zc.sent++;
		KVS_STAT_ADD(t->ctr[PCONN_CTR_ZC_SENDS], 1);
	}
	tx_advance(c, (size_t)n, zc);
	/* A short write filled the socket: asking again would only hear
	 * EAGAIN. The level-triggered EPOLLOUT says when it has room (at
	 * once, if it made some meanwhile). */
	if ((size_t)n < want) {
		tx_full(t, c);
		return 0;
	}
	return 1;
}

bool pconn_tx_done(struct pconn *c, uint16_t *type, struct kvsp_xfer **x)
{
	if (!c->tx_sent)
		return false;
	const struct pconn_tx *f = &c->tx[c->tx_head];
	if (f->zc && (int32_t)(c->zc.done - f->zc_end) < 0)
		return false; /* the kernel may still read its bytes */
	*type = f->type;
	*x = f->x;
	c->tx_head = (uint8_t)ring(c, 1);
	c->tx_n--;
	c->tx_sent--;
	return true;
}

/* ---------------------------------------------------------------- read */

void pconn_payload_into(struct pconn *c, struct kvsp_xfer *x, void *dst, uint32_t plen,
			bool has_crc, uint32_t crc)
{
	c->rx_x = x;
	c->rx_dst = dst;
	c->rx_len = plen;
	c->rx_off = 0;
	c->rx_crc = 0;
	c->rx_want_crc = crc;
	c->rx_has_crc = has_crc && dst;
	c->rx_ended = false;
}

struct kvsp_xfer *pconn_payload_to_sink(struct pconn *c)
{
	struct kvsp_xfer *x = c->rx_x;
	c->rx_x = NULL;
	c->rx_dst = NULL;
	c->rx_has_crc = false;
	c->rx_ended = x != NULL;
	return x;
}

/* Payload bytes, and after its tail the next frame's first ones in the same
 * call (a chunk costs a recv less). Returns what came, or -errno. */
static ssize_t read_payload(struct pconn_table *t, struct pconn *c, uint32_t owed, int *what)
{
	uint8_t *dst = c->rx_dst ? c->rx_dst + c->rx_off : t->sink;
	size_t want = owed;
	if (!c->rx_dst && want > PCONN_SINK_SIZE)
		want = PCONN_SINK_SIZE;
	struct iovec iov[2] = { { dst, want }, { NULL, 0 } };
	size_t n_iov = 1;
	if (want == owed && (iov[1].iov_len = kvsp_frame_rx_want_next(&c->frx, &iov[1].iov_base)))
		n_iov = 2;
	struct msghdr m = { .msg_iov = iov, .msg_iovlen = n_iov };
	ssize_t n = recvmsg(c->fd, &m, MSG_DONTWAIT);
	if (n <= 0)
		return n;
	size_t took = (size_t)n < want ? (size_t)n : want;
	if (c->rx_has_crc)
		c->rx_crc = kvsp_crc32c(dst, took, c->rx_crc);
	c->rx_off += (uint32_t)took;
	kvsp_frame_rx_payload(&c->frx, took);
	*what = kvsp_frame_rx_owed(&c->frx) ? PCONN_DATA : PCONN_PAYLOAD_END;
	if ((size_t)n > took) {
		/* A header alone is never a frame: the decoder says only whether
		 * it wants more, or refuses it. The refusal is the next read's
		 * (kvsp_frame_rx_err), after this payload's end is heard. */
		struct kvsp_frame unused;
		if (kvsp_frame_rx_wrote(&c->frx, (size_t)n - took, &unused) < 0)
			KVS_STAT_ADD(t->st->peer_frames_refused, 1);
	}
	return n;
}

/*
 * A large payload wakes the loop for a useful amount, not for each piece
 * the loopback or the NIC hands over (64-100 KiB): epoll reports the socket
 * once SO_RCVLOWAT bytes are in, or once the kernel's buffer or window is
 * full (it never waits for more than can come), or at a hang-up. The mark
 * never exceeds what the payload still owes, so the payload's last bytes
 * always wake us: nothing else need come behind them. Below
 * PCONN_LOWAT_MIN owed, or between frames, the mark is the kernel's 1.
 */
static void rx_lowat(struct pconn_table *t, struct pconn *c)
{
	uint32_t owed = kvsp_frame_rx_owed(&c->frx);
	uint32_t want = owed < PCONN_LOWAT_MIN ? 0 : owed;
	if (want > PCONN_LOWAT_MAX)
		want = PCONN_LOWAT_MAX;
	if (want == c->rx_lowat)
		return;
	int v = want ? (int)want : 1;
	KVS_STAT_ADD(t->ctr[PCONN_CTR_LOWAT_CALLS], 1);
	/* It cannot fail on a TCP socket. Were it to, the mark is unknown: the
	 * next read sets it again, and the timer's ticks read meanwhile. */
	c->rx_lowat = setsockopt(c->fd, SOL_SOCKET, SO_RCVLOWAT, &v, sizeof(v)) ? UINT32_MAX : want;
}

int pconn_rx_err(const struct pconn *c)
{
	return kvsp_frame_rx_err(&c->frx);
}

int pconn_read(struct pconn_table *t, struct pconn *c, struct kvsp_frame *f, uint64_t now)
{
	int err = kvsp_frame_rx_err(&c->frx);
	if (err)
		return err; /* refused with the tail of the payload before it: counted then */
	uint32_t owed = kvsp_frame_rx_owed(&c->frx);
	ssize_t n;
	int what = PCONN_NOTHING;
	KVS_STAT_ADD(t->ctr[PCONN_CTR_RECV_CALLS], 1);
	if (owed) {
		n = read_payload(t, c, owed, &what);
	} else {
		void *at;
		size_t want = kvsp_frame_rx_want(&c->frx, &at);
		n = recv(c->fd, at, want, MSG_DONTWAIT);
		if (n > 0) {
			int rc = kvsp_frame_rx_wrote(&c->frx, (size_t)n, f);
			if (rc < 0) {
				KVS_STAT_ADD(t->st->peer_frames_refused, 1);
				return rc;
			}
			what = rc == 1 ? PCONN_FRAME : PCONN_DATA;
			if (rc == 1 && f->plen) { /* to the sink unless its owner says where */
				pconn_payload_into(c, NULL, NULL, f->plen, false, 0);
				c->rx_type = f->type;
			}
		}
	}
	if (n == 0)
		return -ECONNRESET;
	if (n < 0)
		return errno == EAGAIN ? PCONN_NOTHING : -errno;
	c->last_rx_ns = now;
	KVS_STAT_ADD(t->ctr[PCONN_CTR_BYTES_RX], (uint64_t)n);
	if (c->pub)
		KVS_STAT_ADD(c->pub->bytes_rx, (uint64_t)n);
	if (what == PCONN_PAYLOAD_END)
		c->rx_len = 0; /* no payload in progress: no payload deadline */
	rx_lowat(t, c);
	return what;
}
