/* SPDX-License-Identifier: MIT */
/*
 * A test peer that speaks the wire between proxies itself (peer/frame.c,
 * peer/auth.c), for the hostile-peer suites: it can prove a secret or
 * not, join some streams of a session and not others, send any frame, stall
 * a payload, answer PINGs and nothing else. Every wait has WAIT_MS as a
 * failure guard, never as an ordering.
 */
#ifndef KVS_TEST_HPEER_H
#define KVS_TEST_HPEER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "layout.h"
#include "peer/frame.h"
#include "peer/auth.h"

struct hpeer {
	int fd;
	struct kvsp_auth a;
	struct kvsp_frame_tx tx;
	struct kvsp_frame_rx rx;
	uint8_t hello[KVS_WIRE_HELLO_SIZE], proof[KVS_WIRE_PROOF_SIZE]; /* what we sent */
	unsigned pings; /* PINGs the proxy sent us (hp_recv answers them) */
};

/* A TCP connection to the proxy at "IPV4:PORT", from source address src
 * (NULL: any). Returns the fd (blocking). */
int hp_connect(const char *endpoint, const char *src);
/* The dialer's first half: a new connection from src (NULL: any), its HELLO sent. */
void hp_dial(struct hpeer *h, const char *endpoint, const char *src, const struct kvsp_secret *s,
	     uint64_t inst);
/* The rest of the dialer's handshake. Returns 0, or -1 if the proxy closed before its HELLO. */
int hp_dial_end(struct hpeer *h);
/* The dialer's handshake with secret s as proxy instance inst, on a new connection from src (NULL: any). */
void hp_handshake(struct hpeer *h, const char *endpoint, const char *src,
		  const struct kvsp_secret *s, uint64_t inst);
/* hp_handshake, then JOIN as stream `stream` of session sid with nstreams. */
void hp_join(struct hpeer *h, const char *endpoint, const char *src, const struct kvsp_secret *s,
	     uint64_t inst, uint64_t sid, uint32_t stream, uint32_t nstreams);
/* Seals and sends a frame; its bytes into out (for replays) if given. Returns its size. */
size_t hp_send(struct hpeer *h, uint16_t type, const void *body, uint32_t plen, void *out);
/* Reads exactly n raw bytes. Returns 0, or -1 once the proxy closed. */
int hp_get(int fd, void *b, size_t n);
/* Writes n raw bytes (a payload, or anything). */
void hp_put(int fd, const void *b, size_t n);
/* The next frame from the proxy that is not a PING (answered) nor an RDMA_HELLO. */
struct kvsp_frame hp_recv(struct hpeer *h);
/* As hp_recv, but returns false (no frame) once the proxy closed. */
bool hp_recv_or_closed(struct hpeer *h, struct kvsp_frame *f);
/* PING, PONG: the stream is still in step. */
void hp_in_sync(struct hpeer *h);
/* Barrier: the proxy closes fd's connection (whatever it sends first is read and dropped). */
void hp_wait_closed(int fd);
#define HP_SILENT_MAX 256
/* For a child process (child_start): holds n (at most HP_SILENT_MAX)
 * connections to endpoint that never say a word, the i-th from src[i],
 * each opened again as soon as the proxy drops it; writes "ready" to wr
 * once all are open. Returns 0 once rd is readable (the parent closed it). */
int hp_hold_silent(const char *endpoint, char (*src)[20], unsigned n, int rd, int wr);
/* The room a descriptor names, in the wire's form. */
struct kvs_wire_room hp_room(const struct kvs_desc_wire *d);
/* The endpoint a descriptor names, without "tcp:". */
const char *hp_endpoint(const struct kvs_desc_wire *d);

#endif
