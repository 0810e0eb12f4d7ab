/* SPDX-License-Identifier: MIT */
/*
 * Frames between proxies after the handshake (the format is shm/wire.h):
 * a sealer for what we send, an incremental decoder for what we receive.
 * Pure code over byte buffers; the peer plane (peer/conn.c) owns the sockets.
 *
 * The decoder reads a frame's header and body into its own buffer, then
 * hands the frame back only once its MAC verified and its seq is the next
 * one. A CHUNK's payload is not read by the decoder: after a CHUNK frame
 * the caller takes hdr.plen bytes straight from the stream into wherever
 * they belong (a slot, or a discard sink) and says so with
 * kvsp_frame_rx_payload(); only then does the next frame's header come.
 *
 * Two ways to feed it, mixed as the caller likes:
 *   n = kvsp_frame_rx_want(rx, &at);  recv(fd, at, n);  kvsp_frame_rx_wrote(rx, got, &f);
 *   kvsp_frame_rx_feed(rx, buf, len, &used, &f);   (copies from a buffer the caller filled)
 * A payload's tail and the next frame's first bytes can come in one read:
 *   m = kvsp_frame_rx_want_next(rx, &next);  recvmsg(fd, {tail, owed}, {next, m});
 *   kvsp_frame_rx_payload(rx, owed);  kvsp_frame_rx_wrote(rx, got - owed, &f);
 *
 * Every refusal kills the decoder (the connection is to be dropped): the
 * call and every later one return the same -errno, one per cause, so the
 * caller can count them:
 *   -EPROTO       header magic is not KVS_WIRE_FRAME_MAGIC
 *   -ENOMSG       unknown frame type
 *   -EBADMSG      len is not the type's body size
 *   -EMSGSIZE     plen != 0 on a type without a payload (CHUNK has one)
 *   -E2BIG        CHUNK plen above the decoder's max_payload
 *   -EACCES       MAC mismatch (forged, altered, or another key's)
 *   -EILSEQ       seq is not the next one (replayed, reordered, dropped)
 *   -EOPNOTSUPP   header flags set (none exist in version 1)
 *   -ERANGE       CHUNK body's len differs from plen
 * The first five are judged from the header alone, before the body is
 * read, so a garbage length never makes the decoder wait for bytes that
 * are not coming; the last four only after the MAC (or, for -EACCES, by
 * it), so what they report is what an authenticated peer said.
 */
#ifndef KVSP_FRAME_H
#define KVSP_FRAME_H

#include <assert.h>
#include <stddef.h>
#include <stdint.h>

#include "peer/wire.h"

#define KVSP_KEY_SIZE 32

/* One connection's session keys, from the handshake (proxy/peer_auth.h). */
struct kvsp_frame_keys {
	uint8_t tx[KVSP_KEY_SIZE]; /* seals what we send */
	uint8_t rx[KVSP_KEY_SIZE]; /* verifies what we receive */
};

struct kvsp_frame_tx {
	uint8_t key[KVSP_KEY_SIZE];
	uint64_t seq; /* the next frame's */
};

/* A verified frame, copied out of the decoder. */
struct kvsp_frame {
	uint16_t type; /* enum kvs_wire_type */
	uint32_t plen; /* CHUNK: payload bytes that follow, owed to kvsp_frame_rx_payload() */
	uint64_t seq;
	union kvs_wire_body body; /* wire form (little-endian); bytes past the type's size are 0 */
};

struct kvsp_frame_rx {
	uint8_t key[KVSP_KEY_SIZE];
	uint64_t seq;	      /* the next one we take */
	uint32_t max_payload; /* largest CHUNK payload (the slot size) */
	uint32_t have;	      /* header and body bytes in buf */
	uint32_t need; /* header and body bytes of this frame; the header's alone until it is judged */
	uint32_t owed; /* CHUNK payload bytes the caller has still to take */
	int err;       /* 0, or the refusal that killed the decoder */
	_Alignas(8) uint8_t buf[KVS_WIRE_FRAME_MAX];
};

/* Frame types: the protocol's (wire.h) below KVS_WIRE_NTYPES; from
 * KVSP_FRAME_OWN_MIN, a data path's outside the protocol (a test's, an
 * experiment's), registered at start: both ends must run that path, a
 * proxy without it refuses the frame as unknown. */
#define KVSP_FRAME_TYPES 64
#define KVSP_FRAME_OWN_MIN 48
static_assert(KVS_WIRE_NTYPES <= KVSP_FRAME_OWN_MIN, "the protocol's types stay below 48");

/* What a frame type is. A data path's type that no data path of this proxy
 * reads (an RDMA frame to a build without RDMA, or to a proxy without a
 * device) is answered by its flags (peer/unowned.c): ASKS, with a
 * CHUNK_ACK -EOPNOTSUPP, so that the sender carries that chunk another
 * way; ONCE, ignored the first time in a session (a second is out of
 * protocol); else ignored. Each ignored one is counted. */
#define KVSP_FRAME_PAYLOAD 0x1u	 /* plen payload bytes follow; the body starts as a CHUNK's */
#define KVSP_FRAME_DATAPATH 0x2u /* a data path's, not the plane's own */
#define KVSP_FRAME_ASKS 0x4u	 /* the body starts as a CHUNK's: room, chunk, len, xfer_ref */
#define KVSP_FRAME_ONCE 0x8u
struct kvsp_frame_kind {
	uint32_t size; /* the body's bytes: exactly this */
	unsigned flags;
};

/* Returns what type is, or NULL for an unknown type. */
const struct kvsp_frame_kind *kvsp_frame_kind(uint32_t type);
/* Returns the body size of frame type type, or 0 for an unknown type. */
uint32_t kvsp_frame_body_size(uint32_t type);
/* Makes type (KVSP_FRAME_OWN_MIN to KVSP_FRAME_TYPES - 1) a data path's, of
 * size body bytes (8 to KVS_WIRE_BODY_MAX, a multiple of 8) and flags
 * (PAYLOAD, ASKS, ONCE). Returns 0 (also when it already is exactly that),
 * -EEXIST (it is something else), or -EINVAL. Called before any frame is
 * sealed or decoded: the table is not locked. */
int kvsp_frame_register(uint16_t type, uint32_t size, unsigned flags);

/* Starts a sending direction at seq 0 under key (KVSP_KEY_SIZE bytes, copied). */
void kvsp_frame_tx_init(struct kvsp_frame_tx *tx, const uint8_t *key);
/* Wipes tx's key. */
void kvsp_frame_tx_wipe(struct kvsp_frame_tx *tx);
/* Writes type's header (next seq, MAC) and body (wire form, the type's body size)
 * to out (KVS_WIRE_FRAME_MAX bytes will do); a CHUNK's plen payload bytes are the
 * caller's to send after it. Returns header + body bytes, or -EINVAL (unknown type,
 * plen on a type other than CHUNK, or a CHUNK body whose len is not plen): nothing
 * written, seq unchanged. */
int kvsp_frame_seal(struct kvsp_frame_tx *tx, uint16_t type, const void *body, uint32_t plen,
		    void *out);

/* Starts a receiving direction at seq 0 under key (copied), taking CHUNK payloads
 * of at most max_payload bytes. */
void kvsp_frame_rx_init(struct kvsp_frame_rx *rx, const uint8_t *key, uint32_t max_payload);
/* Wipes rx's key and buffer; the decoder is dead after it (-EPIPE). */
void kvsp_frame_rx_wipe(struct kvsp_frame_rx *rx);
/* Returns how many header or body bytes the decoder wants next (never more than the
 * frame has), with *at where to write them; 0 while a payload is owed or once dead. */
size_t kvsp_frame_rx_want(struct kvsp_frame_rx *rx, void **at);
/* n bytes (at most what want said) were written at want's *at. Returns 1 with the
 * frame in *f, 0 if it wants more, or the refusal's -errno (see above); -EINVAL
 * for an n want did not offer (the decoder is then dead too). */
int kvsp_frame_rx_wrote(struct kvsp_frame_rx *rx, size_t n, struct kvsp_frame *f);
/* Takes what it wants of the n bytes at bytes, stopping after one whole frame.
 * Returns 1 with the frame in *f, 0 if all n were taken and it wants more, or
 * -errno (see above); *used says how many it took (after 1, the rest is the
 * next frame's, or the CHUNK's payload). -EBUSY, and nothing taken, while a
 * payload is owed: the decoder stays alive. */
int kvsp_frame_rx_feed(struct kvsp_frame_rx *rx, const void *bytes, size_t n, size_t *used,
		       struct kvsp_frame *f);
/* While a payload is owed: returns how many bytes of the next frame the decoder
 * will want once it is all taken, with *at where (what kvsp_frame_rx_want will
 * say then), so they can be read with its tail; 0 when none is owed or once dead. */
size_t kvsp_frame_rx_want_next(struct kvsp_frame_rx *rx, void **at);
/* Returns 0, or the refusal that killed the decoder. */
int kvsp_frame_rx_err(const struct kvsp_frame_rx *rx);
/* Returns the CHUNK payload bytes the caller has still to take. */
uint32_t kvsp_frame_rx_owed(const struct kvsp_frame_rx *rx);
/* The caller took n more payload bytes off the stream. Returns 0, or -EINVAL if n
 * is more than is owed (the decoder is then dead). */
int kvsp_frame_rx_payload(struct kvsp_frame_rx *rx, size_t n);

/* Returns the CRC32C (Castagnoli, as iSCSI and ext4: "123456789" -> 0xe3069283)
 * of the n bytes at p, continuing from crc: 0 to start, a previous result to
 * carry on over the next bytes. */
uint32_t kvsp_crc32c(const void *p, size_t n, uint32_t crc);

#endif
