/* SPDX-License-Identifier: MIT */
#include "hpeer.h"

#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <endian.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <sodium.h>

#include "harness.h"

int hp_connect(const char *endpoint, const char *src)
{
	char host[64];
	snprintf(host, sizeof(host), "%s", endpoint);
	char *colon = strrchr(host, ':');
	cr_assert_not_null(colon, "endpoint %s", endpoint);
	*colon = 0;
	struct sockaddr_in a = { .sin_family = AF_INET,
				 .sin_port = htons((uint16_t)atoi(colon + 1)) };
	cr_assert_eq(inet_pton(AF_INET, host, &a.sin_addr), 1, "endpoint %s", endpoint);
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	cr_assert_geq(fd, 0);
	if (src) {
		struct sockaddr_in s = { .sin_family = AF_INET };
		cr_assert_eq(inet_pton(AF_INET, src, &s.sin_addr), 1);
		cr_assert_eq(bind(fd, (struct sockaddr *)&s, sizeof(s)), 0, "bind %s", src);
	}
	cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0, "connect %s", endpoint);
	return fd;
}

void hp_put(int fd, const void *b, size_t n)
{
	cr_assert_eq(send(fd, b, n, MSG_NOSIGNAL), (ssize_t)n);
}

int hp_get(int fd, void *b, size_t n)
{
	size_t have = 0;
	while (have < n) {
		struct pollfd p = { fd, POLLIN, 0 };
		cr_assert_eq(poll(&p, 1, WAIT_MS), 1, "the proxy said nothing");
		ssize_t k = recv(fd, (uint8_t *)b + have, n - have, 0);
		if (k <= 0)
			return -1;
		have += (size_t)k;
	}
	return 0;
}

void hp_wait_closed(int fd)
{
	uint8_t b[256];
	for (;;) {
		struct pollfd p = { fd, POLLIN, 0 };
		cr_assert_eq(poll(&p, 1, WAIT_MS), 1, "the proxy kept the connection");
		ssize_t k = recv(fd, b, sizeof(b), 0);
		if (k <= 0)
			return;
	}
}

void hp_dial(struct hpeer *h, const char *endpoint, const char *src, const struct kvsp_secret *s,
	     uint64_t inst)
{
	h->fd = hp_connect(endpoint, src);
	h->pings = 0;
	cr_assert_eq(kvsp_auth_start(&h->a, s, KVS_WIRE_DIALER, inst | 1), 0);
	cr_assert_eq(kvsp_auth_hello(&h->a, h->hello), 0);
	hp_put(h->fd, h->hello, sizeof(h->hello));
}

int hp_dial_end(struct hpeer *h)
{
	uint8_t in[KVS_WIRE_HELLO_SIZE];
	if (hp_get(h->fd, in, KVS_WIRE_HELLO_SIZE) < 0)
		return -1;
	cr_assert_eq(kvsp_auth_on_hello(&h->a, in), 0);
	cr_assert_eq(hp_get(h->fd, in, KVS_WIRE_PROOF_SIZE), 0);
	cr_assert_eq(kvsp_auth_on_proof(&h->a, in), 0, "the listener's proof");
	cr_assert_eq(kvsp_auth_proof(&h->a, h->proof), 0);
	hp_put(h->fd, h->proof, sizeof(h->proof));
	struct kvsp_frame_keys k;
	cr_assert_eq(kvsp_auth_keys(&h->a, &k), 0);
	kvsp_frame_tx_init(&h->tx, k.tx);
	kvsp_frame_rx_init(&h->rx, k.rx, 16u << 20);
	return 0;
}

void hp_handshake(struct hpeer *h, const char *endpoint, const char *src,
		  const struct kvsp_secret *s, uint64_t inst)
{
	hp_dial(h, endpoint, src, s, inst);
	cr_assert_eq(hp_dial_end(h), 0, "the proxy closed before its HELLO");
}

void hp_join(struct hpeer *h, const char *endpoint, const char *src, const struct kvsp_secret *s,
	     uint64_t inst, uint64_t sid, uint32_t stream, uint32_t nstreams)
{
	hp_handshake(h, endpoint, src, s, inst);
	struct kvs_wire_join j = { htole64(sid), htole32(stream), htole32(nstreams) };
	hp_send(h, KVS_WIRE_JOIN, &j, 0, NULL);
}

size_t hp_send(struct hpeer *h, uint16_t type, const void *body, uint32_t plen, void *out)
{
	uint8_t f[KVS_WIRE_FRAME_MAX];
	int n = kvsp_frame_seal(&h->tx, type, body, plen, f);
	cr_assert_gt(n, 0);
	hp_put(h->fd, f, (size_t)n);
	if (out)
		memcpy(out, f, (size_t)n);
	return (size_t)n;
}

bool hp_recv_or_closed(struct hpeer *h, struct kvsp_frame *f)
{
	for (;;) {
		void *at;
		size_t want = kvsp_frame_rx_want(&h->rx, &at);
		cr_assert_gt(want, 0);
		if (hp_get(h->fd, at, want) < 0)
			return false;
		int rc = kvsp_frame_rx_wrote(&h->rx, want, f);
		cr_assert_geq(rc, 0, "a frame from the proxy did not verify: %d", rc);
		if (rc == 1 && f->type == KVS_WIRE_PING) {
			h->pings++;
			hp_send(h, KVS_WIRE_PONG, &f->body.ping, 0, NULL);
			continue;
		}
		if (rc == 1 && f->type == KVS_WIRE_RDMA_HELLO)
			continue;
		if (rc == 1)
			return true;
	}
}

struct kvsp_frame hp_recv(struct hpeer *h)
{
	struct kvsp_frame f;
	cr_assert(hp_recv_or_closed(h, &f), "the proxy closed");
	return f;
}

void hp_in_sync(struct hpeer *h)
{
	struct kvs_wire_ping p = { htole64(0x5eed) };
	hp_send(h, KVS_WIRE_PING, &p, 0, NULL);
	struct kvsp_frame f = hp_recv(h);
	cr_assert_eq(f.type, KVS_WIRE_PONG);
	cr_assert_eq(le64toh(f.body.ping.value), 0x5eed);
}

int hp_hold_silent(const char *endpoint, char (*src)[20], unsigned n, int rd, int wr)
{
	struct pollfd p[HP_SILENT_MAX + 1];
	if (n > HP_SILENT_MAX)
		return 2;
	for (unsigned i = 0; i < n; i++)
		p[i] = (struct pollfd){ hp_connect(endpoint, src[i]), POLLIN, 0 };
	p[n] = (struct pollfd){ rd, POLLIN, 0 };
	chan_put(wr, "ready", 5);
	for (;;) {
		if (poll(p, n + 1, -1) < 0)
			return 1;
		if (p[n].revents)
			return 0; /* told to stop */
		for (unsigned i = 0; i < n; i++) {
			char b[64];
			if (!p[i].revents || recv(p[i].fd, b, sizeof(b), MSG_DONTWAIT) > 0)
				continue;
			close(p[i].fd); /* dropped: straight back */
			p[i].fd = hp_connect(endpoint, src[i]);
		}
	}
}

struct kvs_wire_room hp_room(const struct kvs_desc_wire *d)
{
	struct kvs_wire_room n = { d->room, d->gen, { 0 } };
	memcpy(n.token, d->token, 16);
	return n;
}

const char *hp_endpoint(const struct kvs_desc_wire *d)
{
	return d->endpoint + 4;
}
