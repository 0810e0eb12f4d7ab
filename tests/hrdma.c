/* SPDX-License-Identifier: MIT */
#include "hrdma.h"

#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <endian.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <sodium.h>

#include "harness.h"
#include "layout.h"

void hz_listen(struct hz *z, const struct kvsp_secret *s, uint64_t inst)
{
	memset(z, 0, sizeof(*z));
	z->secret = s;
	z->inst = inst | 1;
	for (unsigned i = 0; i < HZ_STREAMS; i++)
		z->conn[i].fd = -1;
	z->lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	cr_assert_geq(z->lfd, 0);
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	cr_assert_eq(bind(z->lfd, (struct sockaddr *)&a, sizeof(a)), 0);
	cr_assert_eq(listen(z->lfd, 16), 0);
	socklen_t al = sizeof(a);
	cr_assert_eq(getsockname(z->lfd, (struct sockaddr *)&a, &al), 0);
	snprintf(z->endpoint, sizeof(z->endpoint), "127.0.0.1:%u", ntohs(a.sin_port));
}

struct kvs_room_desc hz_desc(const struct hz *z, uint32_t room, uint32_t gen, uint64_t bytes,
			     uint64_t slot_size)
{
	struct kvs_desc_wire w = { .magic = KVS_MAGIC_DESC,
				   .version = 1,
				   .instance = z->inst,
				   .room = room,
				   .gen = gen,
				   .bytes = bytes,
				   .slot_size = slot_size };
	randombytes_buf(w.token, sizeof(w.token));
	snprintf(w.endpoint, sizeof(w.endpoint), "tcp:%s", z->endpoint);
	struct kvs_room_desc d;
	_Static_assert(sizeof(d) == sizeof(w), "a descriptor is its wire form");
	memcpy(&d, &w, sizeof(d));
	return d;
}

/* One connection's listener handshake, then its JOIN. */
static void accept_one(struct hz *z, uint64_t *sid)
{
	struct pollfd p = { z->lfd, POLLIN, 0 };
	cr_assert_eq(poll(&p, 1, WAIT_MS), 1, "the proxy never dialed us");
	int fd = accept4(z->lfd, NULL, NULL, SOCK_CLOEXEC);
	cr_assert_geq(fd, 0);
	struct kvsp_auth a;
	cr_assert_eq(kvsp_auth_start(&a, z->secret, KVS_WIRE_LISTENER, z->inst), 0);
	uint8_t m[KVS_WIRE_HELLO_SIZE];
	for (int step; (step = kvsp_auth_next(&a)) != KVSP_AUTH_DONE;) {
		switch (step) {
		case KVSP_AUTH_SEND_HELLO:
			cr_assert_eq(kvsp_auth_hello(&a, m), 0);
			hp_put(fd, m, KVS_WIRE_HELLO_SIZE);
			break;
		case KVSP_AUTH_RECV_HELLO:
			cr_assert_eq(hp_get(fd, m, KVS_WIRE_HELLO_SIZE), 0);
			cr_assert_eq(kvsp_auth_on_hello(&a, m), 0, "the proxy's hello");
			break;
		case KVSP_AUTH_SEND_PROOF:
			cr_assert_eq(kvsp_auth_proof(&a, m), 0);
			hp_put(fd, m, KVS_WIRE_PROOF_SIZE);
			break;
		case KVSP_AUTH_RECV_PROOF:
			cr_assert_eq(hp_get(fd, m, KVS_WIRE_PROOF_SIZE), 0);
			cr_assert_eq(kvsp_auth_on_proof(&a, m), 0, "the proxy's proof");
			break;
		default:
			cr_assert_fail("handshake step %d", step);
		}
	}
	struct kvsp_frame_keys k;
	cr_assert_eq(kvsp_auth_keys(&a, &k), 0);
	struct hpeer h = { .fd = fd, .a = a };
	kvsp_frame_tx_init(&h.tx, k.tx);
	kvsp_frame_rx_init(&h.rx, k.rx, 16u << 20);
	struct kvsp_frame f;
	cr_assert(hp_recv_or_closed(&h, &f), "the proxy closed before its JOIN");
	cr_assert_eq(f.type, KVS_WIRE_JOIN);
	uint32_t stream = le32toh(f.body.join.stream), n = le32toh(f.body.join.nstreams);
	cr_assert(n >= 1 && n <= HZ_STREAMS && stream < n);
	cr_assert(z->nstreams == 0 || z->nstreams == n);
	cr_assert(!*sid || *sid == le64toh(f.body.join.sid), "one session");
	cr_assert_eq(z->conn[stream].fd, -1);
	*sid = le64toh(f.body.join.sid);
	z->nstreams = n;
	z->conn[stream] = h;
}

/* One frame from connection i (PINGs answered and returned as such). */
static struct kvsp_frame frame_from(struct hz *z, unsigned i)
{
	struct hpeer *h = &z->conn[i];
	struct kvsp_frame f;
	for (;;) {
		void *at;
		size_t want = kvsp_frame_rx_want(&h->rx, &at);
		cr_assert_gt(want, 0, "stream %u: a payload is owed (chunks by the stream?)", i);
		cr_assert_eq(hp_get(h->fd, at, want), 0, "stream %u: the proxy closed", i);
		int rc = kvsp_frame_rx_wrote(&h->rx, want, &f);
		cr_assert_geq(rc, 0, "a frame from the proxy did not verify: %d", rc);
		if (rc == 1)
			break;
	}
	if (f.type == KVS_WIRE_PING)
		hp_send(h, KVS_WIRE_PONG, &f.body.ping, 0, NULL);
	return f;
}

bool hz_recv_for(struct hz *z, int ms, struct kvsp_frame *out)
{
	if (z->stashed) {
		z->stashed = false;
		*out = z->stash;
		return true;
	}
	struct timespec t0, t;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (int left = ms; left >= 0;) {
		struct pollfd p[HZ_STREAMS];
		for (unsigned i = 0; i < z->nstreams; i++)
			p[i] = (struct pollfd){ z->conn[i].fd, POLLIN, 0 };
		int n = poll(p, z->nstreams, left);
		cr_assert_geq(n, 0);
		if (n == 0)
			return false;
		for (unsigned i = 0; i < z->nstreams; i++) {
			char c;
			if (!p[i].revents)
				continue;
			if (recv(z->conn[i].fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0)
				return false; /* the proxy hung up */
			struct kvsp_frame f = frame_from(z, i);
			if (f.type == KVS_WIRE_PING || f.type == KVS_WIRE_PONG)
				continue;
			/* We have one rail: a proxy with more says a HELLO for each,
			 * and a peer ignores those of rails it lacks. */
			if (f.type == KVS_WIRE_RDMA_HELLO && f.body.rdma_hello.rail != 0)
				continue;
			cr_assert_eq(i, 0, "frame type %u on stream %u", f.type, i);
			*out = f;
			return true;
		}
		clock_gettime(CLOCK_MONOTONIC, &t);
		left = ms -
		       (int)((t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000);
	}
	return false;
}

struct kvsp_frame hz_recv(struct hz *z)
{
	struct kvsp_frame f;
	cr_assert(hz_recv_for(z, WAIT_MS, &f), "the proxy said nothing");
	return f;
}

void hz_accept(struct hz *z)
{
	uint64_t sid = 0;
	unsigned joined = 0;
	do {
		accept_one(z, &sid);
		joined++;
	} while (joined < z->nstreams);
	/* The proxy's session is up once every stream proved itself: its
	 * HELLO comes on stream 0, after the OPEN that made it dial. */
	struct kvsp_frame f = hz_recv(z);
	if (f.type != KVS_WIRE_RDMA_HELLO) {
		z->stash = f;
		f = hz_recv(z);
		z->stashed = true;
	}
	cr_assert_eq(f.type, KVS_WIRE_RDMA_HELLO, "the proxy's second frame is type %u", f.type);
	const struct kvs_wire_rdma_hello *b = &f.body.rdma_hello;
	z->peer = (struct kvsp_verbs_ep){ .qpn = le32toh(b->qpn),
					  .psn = le32toh(b->psn),
					  .pool_addr = le64toh(b->pool_addr),
					  .pool_len = le64toh(b->pool_len),
					  .keys = le32toh(b->keys),
					  .mtu = le16toh(b->mtu) };
	memcpy(z->peer.gid, b->gid, sizeof(z->peer.gid));
	z->buf = aligned_alloc(4096, HZ_BUF);
	cr_assert_not_null(z->buf);
	char why[256];
	const char *dev = getenv("RXE_DEV"), *gix = getenv("RXE_GID_INDEX");
	int rc = kvsp_verbs_open(&z->v, dev && *dev ? dev : NULL, gix && *gix ? atoi(gix) : -1,
				 z->buf, HZ_BUF, 64, KVSP_KEYS_REGION, why, sizeof(why));
	cr_assert_eq(rc, 0, "our device: %s", why);
	z->qp = kvsp_verbs_qp_new(&z->v, 16, &z->local);
	cr_assert_not_null(z->qp);
	struct kvs_wire_rdma_hello h = { .qpn = htole32(z->local.qpn),
					 .psn = htole32(z->local.psn),
					 .pool_addr = htole64(z->local.pool_addr),
					 .pool_len = htole64(z->local.pool_len),
					 .keys = htole32(KVSP_KEYS_WIRE_REGION),
					 .mtu = htole16((uint16_t)z->local.mtu) };
	memcpy(h.gid, z->local.gid, sizeof(h.gid));
	hp_send(&z->conn[0], KVS_WIRE_RDMA_HELLO, &h, 0, NULL);
	cr_assert_eq(kvsp_verbs_qp_connect(&z->v, z->qp, &z->local, &z->peer), 0);
}

void hz_ack_open(struct hz *z)
{
	struct kvsp_frame f = hz_recv(z);
	cr_assert_eq(f.type, KVS_WIRE_OPEN, "got frame type %u", f.type);
	struct kvs_wire_open_ack a = { .room = f.body.open.room,
				       .sender_ref = f.body.open.sender_ref,
				       .status = 0 };
	hp_send(&z->conn[0], KVS_WIRE_OPEN_ACK, &a, 0, NULL);
}

struct kvs_wire_chunk_read hz_chunk_read(struct hz *z)
{
	struct kvsp_frame f = hz_recv(z);
	cr_assert_eq(f.type, KVS_WIRE_CHUNK_READ, "got frame type %u", f.type);
	return f.body.chunk_read;
}

void hz_ack_chunk(struct hz *z, const struct kvs_wire_chunk_read *c, int status)
{
	struct kvs_wire_chunk_ack a = { .room = c->room,
					.chunk = c->chunk,
					.status = (int32_t)htole32((uint32_t)status),
					.xfer_ref = c->xfer_ref };
	hp_send(&z->conn[0], KVS_WIRE_CHUNK_ACK, &a, 0, NULL);
}

enum ibv_wc_status hz_read(struct hz *z, uint64_t offset, uint32_t len, uint32_t key)
{
	cr_assert_leq(len, HZ_BUF);
	memset(z->buf, 0x5a, len);
	cr_assert_eq(
		kvsp_verbs_read(&z->v, z->qp, 0x7d, z->buf, len, z->peer.pool_addr + offset, key),
		0);
	struct ibv_wc wc;
	for (unsigned spins = 0;; spins++) {
		int n = kvsp_verbs_poll(&z->v, &wc, 1);
		cr_assert_geq(n, 0);
		if (n)
			return wc.status;
		if (spins % 1024 == 0) {
			struct pollfd p = { -1, 0, 0 };
			poll(&p, 0,
			     1); /* a READ under emulation takes milliseconds: no busy spin */
			cr_assert_lt(spins, 1024u * WAIT_MS, "our READ never completed");
		}
	}
}

bool hz_untouched(const struct hz *z, uint32_t len)
{
	for (uint32_t i = 0; i < len; i++)
		if (z->buf[i] != 0x5a)
			return false;
	return true;
}

void hz_close(struct hz *z)
{
	for (unsigned i = 0; i < HZ_STREAMS; i++)
		if (z->conn[i].fd >= 0) {
			close(z->conn[i].fd);
			z->conn[i].fd = -1;
		}
	if (z->qp) {
		kvsp_verbs_qp_error(z->qp);
		kvsp_verbs_qp_destroy(z->qp);
		z->qp = NULL;
	}
	if (z->v.ctx)
		kvsp_verbs_close(&z->v);
	free(z->buf);
	z->buf = NULL;
	if (z->lfd >= 0)
		close(z->lfd);
	z->lfd = -1;
}
