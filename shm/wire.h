/* SPDX-License-Identifier: MIT */
/*
 * Records between proxies (the tcp transport, and the control path of
 * verbs). Little-endian, fixed-size, 8-byte aligned; a frame is a header
 * and its body, and a CHUNK frame's body is followed by its payload.
 *
 * Not spoken yet: the local transport needs none. These are fixed now so
 * that the tcp and verbs transports slot in behind struct kvsp_transport
 * without changing the descriptor or the rooms:
 *
 *  - A room descriptor names the receiving proxy (instance, endpoint) and
 *    the room (index, generation, token). A sender whose proxy is not the
 *    descriptor's instance asks its transport for the endpoint.
 *  - Every frame about a room carries the room's (index, generation,
 *    token); a receiver checks all three before anything lands, and
 *    counts a wrong token (invariant 4).
 *  - The receiving proxy posts slots (RECV_POSTED) for a remote sender and
 *    fences every CHUNK: it lands only if that slot is still that room's,
 *    at that epoch; otherwise its bytes go to a discard sink (tcp) or the
 *    slot stays a tombstone until the sender reports QUIESCED (verbs,
 *    where the NIC may still write) (invariant 5).
 *  - Quiescence on the sending proxy: tcp, once the payload left the slot
 *    (copied into the socket); verbs, once the write's work completion
 *    (success or flush) arrived.
 */
#ifndef KVS_SHM_WIRE_H
#define KVS_SHM_WIRE_H

#include <assert.h>
#include <stdint.h>

#define KVS_WIRE_MAGIC 0x4b565357u /* "KVSW" */
#define KVS_WIRE_VERSION 1

enum kvs_wire_type {
	KVS_WIRE_HELLO = 1,  /* peer -> peer: instance, nonce */
	KVS_WIRE_PROOF,      /* both ways: MAC of the other's nonce under the shared secret */
	KVS_WIRE_OPEN,       /* sender proxy -> receiver proxy: attach a remote sender to a room */
	KVS_WIRE_OPEN_ACK,   /* status; for verbs, the posted slots' addresses and rkey follow */
	KVS_WIRE_CHUNK,      /* one chunk; payload follows (tcp) or was RDMA-written (verbs) */
	KVS_WIRE_CHUNK_ACK,  /* receiver: placed or discarded, and why */
	KVS_WIRE_ABORT,      /* either side: the room is aborted */
	KVS_WIRE_QUIESCED,   /* sender (verbs): nothing of this room is in flight any more */
	KVS_WIRE_DONE,       /* receiver: every chunk placed */
};

struct kvs_wire_hdr {
	uint32_t magic;  /* KVS_WIRE_MAGIC */
	uint16_t version;
	uint16_t type;   /* enum kvs_wire_type */
	uint32_t len;    /* body bytes after this header (payload not included) */
	uint32_t rsvd;
};
static_assert(sizeof(struct kvs_wire_hdr) == 16, "wire header is 16 bytes");

/* Names a room on the receiving proxy: checked whole before anything lands. */
struct kvs_wire_room {
	uint32_t room, gen;
	uint8_t token[16];
};
static_assert(sizeof(struct kvs_wire_room) == 24, "room name is 24 bytes");

struct kvs_wire_hello {
	uint64_t instance; /* the speaker's proxy instance */
	uint8_t nonce[32]; /* getrandom */
};

struct kvs_wire_proof {
	uint8_t mac[32]; /* HMAC-SHA256(secret, peer's nonce || our instance) */
};

struct kvs_wire_open {
	struct kvs_wire_room room;
	uint64_t bytes;     /* as the sender understood the descriptor */
	uint64_t slot_size; /* chunking the sender will use: must equal the receiver's */
	uint64_t sender_ref; /* the sender proxy's name for its side, echoed back */
};

struct kvs_wire_chunk {
	struct kvs_wire_room room;
	uint32_t chunk;
	uint32_t len;      /* payload bytes (tcp: they follow) */
	uint64_t xfer_ref; /* the sender's transfer, echoed in the ack */
};
static_assert(sizeof(struct kvs_wire_chunk) == 40, "chunk record is 40 bytes");

struct kvs_wire_chunk_ack {
	struct kvs_wire_room room;
	uint32_t chunk;
	int32_t status;    /* 0: placed; else why it was discarded */
	uint64_t xfer_ref;
};

struct kvs_wire_abort {
	struct kvs_wire_room room;
	int32_t status;
	uint32_t rsvd;
};

#endif
