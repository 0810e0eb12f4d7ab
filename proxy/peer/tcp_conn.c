/* SPDX-License-Identifier: MIT */
/*
 * One tcp connection between proxies: the handshake, then frames. Writes
 * go straight from slot memory into the socket (header and payload in one
 * sendmsg); reads go straight from the socket into the slot posted for a
 * chunk, or into the sink. Non-blocking throughout: a full socket waits
 * for EPOLLOUT, never for memory of its own; what a socket cannot take
 * stays in the slot it came from (pinned, bounded by the pool).
 */
#include <arpa/inet.h>
#include <endian.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "core/failpoint.h"
#include "peer/tcp.h"

#define BURST 64

int tcp_ep_parse(const char *s, struct tcp_ep *ep)
{
	memset(ep, 0, sizeof(*ep));
	const char *colon = strrchr(s, ':');
	if (!colon || strlen(s) > 59) /* "tcp:" and it fit a descriptor's 64 bytes */
		return -EINVAL;
	char host[64];
	size_t hl = (size_t)(colon - s);
	if (hl == 0 || hl >= sizeof(host))
		return -EINVAL;
	memcpy(host, s, hl);
	host[hl] = 0;
	char *end;
	unsigned long port = strtoul(colon + 1, &end, 10);
	if (!colon[1] || *end || port > 65535)
		return -EINVAL;
	if (host[0] == '[') {
		if (hl < 3 || host[hl - 1] != ']')
			return -EINVAL;
		host[hl - 1] = 0;
		struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ep->sa;
		if (inet_pton(AF_INET6, host + 1, &a->sin6_addr) != 1)
			return -EINVAL;
		a->sin6_family = AF_INET6;
		a->sin6_port = htons((uint16_t)port);
		ep->len = sizeof(*a);
	} else {
		struct sockaddr_in *a = (struct sockaddr_in *)&ep->sa;
		if (inet_pton(AF_INET, host, &a->sin_addr) != 1)
			return -EINVAL;
		a->sin_family = AF_INET;
		a->sin_port = htons((uint16_t)port);
		ep->len = sizeof(*a);
	}
	snprintf(ep->text, sizeof(ep->text), "%s", s);
	return 0;
}

/* ------------------------------------------------------------ lifetime */

static int watch(struct tcp *tc, struct tcp_conn *c, uint32_t events, int op)
{
	struct epoll_event ev = { .events = events, .data.u64 = (uint64_t)c->id << 32 | c->idx };
	return epoll_ctl(tc->epfd, op, c->fd, &ev) < 0 ? -errno : 0;
}

struct tcp_conn *tcp_conn_new(struct tcp *tc, int fd, bool dialer, bool connecting)
{
	unsigned i;
	for (i = 0; i < TCP_MAX_CONNS && tc->conn[i].state != TCP_C_FREE; i++)
		;
	if (i == TCP_MAX_CONNS) {
		close(fd);
		return NULL;
	}
	struct tcp_conn *c = &tc->conn[i];
	memset(c, 0, sizeof(*c));
	c->fd = fd;
	c->idx = (uint16_t)i;
	c->id = ++tc->conn_gen;
	c->dialer = dialer;
	c->state = connecting ? TCP_C_CONNECTING : TCP_C_AUTH;
	c->born_ns = c->last_rx_ns = kvsp_xport_now(tc->p);
	c->q_head = c->q_tail = TCP_NONE;
	int one = 1;
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	if (kvsp_auth_start(&c->auth, tc->secret, dialer ? KVS_WIRE_DIALER : KVS_WIRE_LISTENER,
			    tc->instance) < 0 ||
	    watch(tc, c, EPOLLIN | (connecting ? EPOLLOUT : 0), EPOLL_CTL_ADD) < 0) {
		close(fd);
		c->state = TCP_C_FREE;
		return NULL;
	}
	if (i >= tc->conns_hi)
		tc->conns_hi = i + 1;
	return c;
}

void tcp_conn_close(struct tcp *tc, struct tcp_conn *c)
{
	if (c->state == TCP_C_FREE)
		return;
	epoll_ctl(tc->epfd, EPOLL_CTL_DEL, c->fd, NULL);
	close(c->fd);
	kvsp_auth_wipe(&c->auth);
	kvsp_frame_tx_wipe(&c->ftx);
	kvsp_frame_rx_wipe(&c->frx);
	c->state = TCP_C_FREE;
	while (tc->conns_hi && tc->conn[tc->conns_hi - 1].state == TCP_C_FREE)
		tc->conns_hi--;
	c->sess = NULL;
	c->tx_x = c->rx_x = NULL; /* the session releases them, with every other pin */
	c->qn = 0;
}

/* ----------------------------------------------------------- handshake */

int tcp_conn_handshake(struct tcp *tc, struct tcp_conn *c)
{
	if (c->state == TCP_C_CONNECTING) {
		int err = 0;
		socklen_t len = sizeof(err);
		if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0)
			err = errno;
		if (err == EINPROGRESS || err == EALREADY)
			return 0;
		if (err)
			return -err;
		c->state = TCP_C_AUTH;
		watch(tc, c, EPOLLIN, EPOLL_CTL_MOD);
	}
	for (;;) {
		while (c->hs_out_off < c->hs_out_len) {
			ssize_t n = send(c->fd, c->hs_out + c->hs_out_off, c->hs_out_len - c->hs_out_off,
					 MSG_DONTWAIT | MSG_NOSIGNAL);
			if (n < 0)
				return errno == EAGAIN ? 0 : -errno;
			c->hs_out_off += (uint32_t)n;
		}
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
			ssize_t n = recv(c->fd, c->hs_in + c->hs_have, need - c->hs_have, MSG_DONTWAIT);
			if (n == 0)
				return -ECONNRESET;
			if (n < 0)
				return errno == EAGAIN ? 0 : -errno;
			c->last_rx_ns = kvsp_xport_now(tc->p);
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
			kvsp_frame_rx_init(&c->frx, k.rx, (uint32_t)kvsp_slot_size(tc->p));
			memset(&k, 0, sizeof(k));
			return tcp_on_authed(tc, c);
		}
		default:
			return c->auth.err ? c->auth.err : -EPROTO;
		}
		if (rc < 0)
			return rc;
	}
}

/* --------------------------------------------------------------- write */

void tcp_conn_queue(struct tcp *tc, struct tcp_conn *c, struct kvsp_xfer *x)
{
	tc->xnext[x->slot] = TCP_NONE;
	if (c->q_tail != TCP_NONE)
		tc->xnext[c->q_tail] = x->slot;
	else
		c->q_head = x->slot;
	c->q_tail = x->slot;
	c->qn++;
}

static struct kvsp_xfer *dequeue(struct tcp *tc, struct tcp_conn *c)
{
	uint32_t s = c->q_head;
	c->q_head = tc->xnext[s];
	if (c->q_head == TCP_NONE)
		c->q_tail = TCP_NONE;
	c->qn--;
	return kvsp_xfer_of(tc->p, s);
}

int tcp_conn_frame(struct tcp_conn *c, uint16_t type, const void *body)
{
	uint32_t plen = type == KVS_WIRE_CHUNK ? le32toh(((const struct kvs_wire_chunk *)body)->len) : 0;
	int n = kvsp_frame_seal(&c->ftx, type, body, plen, c->txbuf);
	if (n < 0)
		return n;
	c->tx_len = (uint32_t)n;
	c->tx_off = 0;
	return 0;
}

bool tcp_conn_wants_tx(const struct tcp *tc, const struct tcp_conn *c)
{
	(void)tc;
	if (c->state != TCP_C_UP || c->wblocked)
		return false;
	if (c->tx_held) {
		int err;
		return kvsp_xport_fp_action(tc->p, KVSP_FP_TCP_PAYLOAD, &err) != KVS_FP_PAUSE;
	}
	return c->tx_len || c->qn || (c->stream == 0 && c->sess &&
				       (c->sess->owe_head != TCP_NONE || c->sess->owe_ping ||
					c->sess->owe_pong || c->sess->owe_bye));
}

/* The next chunk's frame, or false if there is none. */
static bool next_chunk(struct tcp *tc, struct tcp_conn *c)
{
	while (c->qn) {
		struct kvsp_xfer *x = kvsp_xfer_of(tc->p, c->q_head);
		if (tcp_room_cancelled(tc, x)) {
			dequeue(tc, c);
			kvsp_xfer_quiesced(tc->p, x, -ECANCELED); /* never sent */
			continue;
		}
		int by_rdma = tcp_rdma_chunk(tc, c, x);
		if (by_rdma < 0)
			return false; /* the READ window is full: it waits for an ack */
		dequeue(tc, c);
		if (by_rdma)
			return true; /* a CHUNK_READ: the peer pulls the payload */
		const uint8_t *src = kvsp_slot_mem(tc->p, x->slot);
		struct kvs_wire_chunk b = {
			.room = tc->rooms[x->room].name,
			.chunk = htole32(x->chunk),
			.len = htole32(x->len),
			.xfer_ref = htole64((uint64_t)x->epoch << 32 | x->slot),
		};
		if (tc->checksum) {
			b.crc32c = htole32(kvsp_crc32c(src, x->len, 0));
			b.flags = htole32(KVS_WIRE_CHUNK_CRC);
		}
		if (tcp_conn_frame(c, KVS_WIRE_CHUNK, &b) < 0) {
			kvsp_xfer_quiesced(tc->p, x, -EIO);
			continue;
		}
		c->tx_x = x;
		c->tx_poff = 0;
		c->tx_fp_checked = false;
		return true;
	}
	return false;
}

int tcp_conn_tx(struct tcp *tc, struct tcp_conn *c)
{
	int busy = KVSP_IDLE;
	if (c->state != TCP_C_UP)
		return busy;
	for (int k = 0; k < BURST && !c->wblocked; k++) {
		if (!c->tx_len && !tcp_next_control(tc, c) && !next_chunk(tc, c))
			break;
		struct kvsp_xfer *x = c->tx_x;
		if (x && !c->tx_fp_checked) {
			/* Test barrier: the header goes, the payload waits. */
			c->tx_fp_checked = true;
			c->tx_held = kvsp_xport_fp(tc->p, KVSP_FP_TCP_PAYLOAD, x->room) == KVSP_FP_HOLD;
		}
		if (c->tx_held) {
			int err;
			if (kvsp_xport_fp_action(tc->p, KVSP_FP_TCP_PAYLOAD, &err) != KVS_FP_PAUSE)
				c->tx_held = false;
			else if (c->tx_off == c->tx_len)
				break;
		}
		struct iovec iov[2];
		int n_iov = 0;
		if (c->tx_off < c->tx_len)
			iov[n_iov++] = (struct iovec){ c->txbuf + c->tx_off, c->tx_len - c->tx_off };
		if (x && !c->tx_held)
			iov[n_iov++] = (struct iovec){ (uint8_t *)kvsp_slot_mem(tc->p, x->slot) + c->tx_poff,
						       x->len - c->tx_poff };
		struct msghdr m = { .msg_iov = iov, .msg_iovlen = (size_t)n_iov };
		ssize_t n = sendmsg(c->fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
		if (n < 0) {
			if (errno != EAGAIN)
				return -errno;
			c->wblocked = true;
			watch(tc, c, EPOLLIN | EPOLLOUT, EPOLL_CTL_MOD);
			break;
		}
		busy = KVSP_BUSY;
		KVS_STAT_ADD(tc->st->tcp_bytes_tx, (uint64_t)n);
		KVS_STAT_ADD(c->sess->pub->bytes_tx, (uint64_t)n);
		c->sess->last_tx_ns = kvsp_xport_now(tc->p);
		uint32_t h = c->tx_len - c->tx_off < (size_t)n ? c->tx_len - c->tx_off : (uint32_t)n;
		c->tx_off += h;
		c->tx_poff += (uint32_t)n - h;
		if (c->tx_off < c->tx_len)
			continue;
		if (!x) {
			c->tx_len = 0;
		} else if (c->tx_poff == x->len) {
			/* Every byte left the slot: the socket has its copy. */
			c->tx_x = NULL;
			c->tx_len = 0;
			kvsp_xfer_quiesced(tc->p, x, 0);
		}
	}
	return busy;
}

/* ---------------------------------------------------------------- read */

static void chunk_end(struct tcp *tc, struct tcp_conn *c)
{
	struct kvsp_xfer *x = c->rx_x;
	c->rx_x = NULL;
	if (c->rx_sink) {
		kvsp_chunk_sunk(tc->p, c->rx_len);
		KVS_STAT_ADD(c->sess->pub->chunks_sunk, 1);
	} else if (c->rx_has_crc && c->rx_crc != c->rx_want_crc) {
		KVS_STAT_ADD(tc->st->peer_crc_errors, 1);
		kvsp_chunk_discard(tc->p, x, -EBADMSG);
	} else {
		kvsp_chunk_land(tc->p, x);
	}
}

int tcp_conn_rx(struct tcp *tc, struct tcp_conn *c)
{
	int busy = KVSP_IDLE;
	for (int k = 0; k < BURST && c->state >= TCP_C_JOINING; k++) {
		uint32_t owed = kvsp_frame_rx_owed(&c->frx);
		ssize_t n;
		if (owed) {
			uint8_t *dst = c->rx_sink ? tc->sink : c->rx_dst + c->rx_off;
			size_t want = owed;
			if (c->rx_sink && want > TCP_SINK_SIZE)
				want = TCP_SINK_SIZE;
			n = recv(c->fd, dst, want, MSG_DONTWAIT);
			if (n > 0) {
				if (!c->rx_sink && c->rx_has_crc)
					c->rx_crc = kvsp_crc32c(dst, (size_t)n, c->rx_crc);
				c->rx_off += (uint32_t)n;
				kvsp_frame_rx_payload(&c->frx, (size_t)n);
			}
		} else {
			void *at;
			size_t want = kvsp_frame_rx_want(&c->frx, &at);
			n = recv(c->fd, at, want, MSG_DONTWAIT);
			if (n > 0) {
				struct kvsp_frame f;
				int rc = kvsp_frame_rx_wrote(&c->frx, (size_t)n, &f);
				if (rc < 0) {
					KVS_STAT_ADD(tc->st->peer_frames_refused, 1);
					return rc;
				}
				if (rc == 1) {
					if (f.type == KVS_WIRE_CHUNK && c->state == TCP_C_UP) {
						tcp_on_chunk(tc, c, &f);
					} else {
						rc = tcp_on_frame(tc, c, &f);
						if (rc < 0)
							return rc;
					}
				}
			}
		}
		if (n == 0)
			return -ECONNRESET;
		if (n < 0)
			return errno == EAGAIN ? busy : -errno;
		busy = KVSP_BUSY;
		c->last_rx_ns = kvsp_xport_now(tc->p);
		KVS_STAT_ADD(tc->st->tcp_bytes_rx, (uint64_t)n);
		if (c->sess)
			KVS_STAT_ADD(c->sess->pub->bytes_rx, (uint64_t)n);
		if (owed && !kvsp_frame_rx_owed(&c->frx))
			chunk_end(tc, c);
		if (c->state == TCP_C_FREE)
			break;
	}
	return busy;
}
