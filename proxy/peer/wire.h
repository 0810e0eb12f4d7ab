/* SPDX-License-Identifier: MIT */
/*
 * Records between proxies: the peer plane's sessions, and the frames of its
 * data paths (the stream's CHUNK, RDMA READ's). Little-endian, fixed-size, 8-byte aligned. The structs here are
 * the wire form: fill them with htole*() and read them with le*toh(), as
 * rooms.c does for the descriptor. proxy/peer/auth.c speaks the
 * handshake, proxy/peer/frame.c seals and decodes the frames.
 *
 * A connection is a handshake, then frames.
 *
 *  - Handshake (struct kvs_wire_hello, struct kvs_wire_proof): the dialer
 *    and the listener each prove the deployment's shared secret over both
 *    sides' fresh nonces and instances, and both derive one session key
 *    per direction. Nothing else is spoken before it is done. The version
 *    is settled here; frames carry none.
 *  - Frame: a 40-byte header (struct kvs_wire_frame_hdr), the body of its
 *    type (exactly kvsp_frame_body_size(type) bytes) and, for CHUNK only,
 *    hdr.plen bytes of payload. The header's MAC is keyed BLAKE2b (16
 *    bytes, the direction's session key) over the header before the MAC
 *    and the body; seq counts the frames of a direction from 0, and a
 *    receiver takes only the next one. A frame forged, altered, replayed,
 *    reordered or dropped is refused, and the connection with it.
 *  - The payload is not in the MAC: a MAC over every byte would cost more
 *    than the link carries. CHUNK may carry a CRC32C of it (in the MACed
 *    body), which catches corruption, not an attacker on the path, who
 *    can change payload bytes and keep their CRC. Rooms, tokens, chunk
 *    numbers and lengths, everything the fence decides on, are MACed.
 *
 * How the transports use them (DESIGN.md, "Across hosts"):
 *
 *  - A room descriptor names the receiving proxy (instance, endpoint) and
 *    the room (index, generation, token). A sender whose proxy is not the
 *    descriptor's instance asks its transport for the endpoint.
 *  - Every frame about a room carries the room's (index, generation,
 *    token); a receiver checks all three before anything lands, and
 *    counts a wrong token (invariant 4).
 *  - The receiving proxy posts slots (RECV_POSTED) for a remote sender and
 *    fences every CHUNK: it lands only if that slot is still that room's,
 *    at that epoch; otherwise its bytes go to a discard sink (stream) or the
 *    slot stays a tombstone until the sender reports QUIESCED (verbs,
 *    where the NIC may still write) (invariant 5).
 *  - Quiescence on the sending proxy: stream, once the payload left the slot
 *    (copied into the socket); verbs, once the write's work completion
 *    (success or flush) arrived.
 *
 * Status fields are 0 or a negative Linux errno.
 */
#ifndef KVS_SHM_WIRE_H
#define KVS_SHM_WIRE_H

#include <assert.h>
#include <stdint.h>

/* 2: CHUNK_READ carries the chunk's own key; 3: RDMA_HELLO and CHUNK_READ
 * name their rail */
#define KVS_WIRE_VERSION 3

/* --------------------------------------------------------------- handshake */

#define KVS_WIRE_HELLO_MAGIC 0x4853564bu /* "KVSH" */

enum kvs_wire_auth_type {
	KVS_WIRE_HELLO = 1, /* both ways: who I am, my nonce */
	KVS_WIRE_PROOF = 2, /* both ways: HMAC of both nonces and instances, role-labelled */
};

enum kvs_wire_role {
	KVS_WIRE_DIALER = 1,   /* opened the connection */
	KVS_WIRE_LISTENER = 2, /* accepted it */
};

/* Every field is either checked for its one value or bound into the
 * proofs, so a HELLO changed on the way fails the handshake. */
struct kvs_wire_hello {
	uint32_t magic;	   /* KVS_WIRE_HELLO_MAGIC */
	uint16_t version;  /* KVS_WIRE_VERSION */
	uint16_t type;	   /* KVS_WIRE_HELLO */
	uint32_t role;	   /* enum kvs_wire_role: the speaker's */
	uint32_t rsvd;	   /* 0 */
	uint64_t instance; /* the speaker's proxy instance */
	uint8_t nonce[32]; /* fresh per connection (randombytes_buf) */
};
static_assert(sizeof(struct kvs_wire_hello) == 56, "hello is 56 bytes");

struct kvs_wire_proof {
	uint32_t magic;	  /* KVS_WIRE_HELLO_MAGIC */
	uint16_t version; /* KVS_WIRE_VERSION */
	uint16_t type;	  /* KVS_WIRE_PROOF */
	uint32_t role;	  /* the prover's */
	uint32_t rsvd;	  /* 0 */
	uint8_t mac[32];  /* HMAC-SHA256 under the master key, see proxy/peer/auth.c */
};
static_assert(sizeof(struct kvs_wire_proof) == 48, "proof is 48 bytes");

/* ------------------------------------------------------------------ frames */

#define KVS_WIRE_FRAME_MAGIC 0x4653564bu /* "KVSF" */
#define KVS_WIRE_MAC_SIZE 16

struct kvs_wire_frame_hdr {
	uint32_t magic; /* KVS_WIRE_FRAME_MAGIC */
	uint16_t type;	/* enum kvs_wire_type */
	uint16_t flags; /* 0 in version 1 */
	uint32_t len;	/* body bytes: exactly the type's body size */
	uint32_t plen;	/* payload bytes after the body: CHUNK only, else 0 */
	uint64_t seq;	/* this direction's frame count, from 0 after the handshake */
	uint8_t mac[KVS_WIRE_MAC_SIZE]; /* over the 24 bytes above and the body */
};
static_assert(sizeof(struct kvs_wire_frame_hdr) == 40, "frame header is 40 bytes");

enum kvs_wire_type {
	KVS_WIRE_OPEN = 1,  /* sender proxy -> receiver proxy: attach a remote sender to a room */
	KVS_WIRE_OPEN_ACK,  /* receiver -> sender: attached, or why not */
	KVS_WIRE_CHUNK,	    /* sender -> receiver: one chunk; plen payload bytes follow the body */
	KVS_WIRE_CHUNK_ACK, /* receiver -> sender: placed or discarded, and why */
	KVS_WIRE_ABORT,	    /* either way: the room is aborted */
	KVS_WIRE_DONE,	    /* receiver -> sender: every chunk placed */
	KVS_WIRE_PING,	    /* either way: keep-alive, answered with PONG */
	KVS_WIRE_PONG,
	KVS_WIRE_BYE,	/* either way: no new rooms on this connection (drain) */
	KVS_WIRE_JOIN,	/* dialer, first frame of each connection: which session, which stream */
	KVS_WIRE_ENDED, /* either way: after an abort, nothing of the room is in flight here */
	KVS_WIRE_RDMA_HELLO, /* either way, once per session: my queue pair and pool, for RDMA READ */
	KVS_WIRE_CHUNK_READ, /* sender -> receiver: pull this chunk from my pool; CHUNK_ACK when done */
	KVS_WIRE_NTYPES,
	/* QUIESCED (verbs: nothing of a room in flight any more) will take the
	 * next number, with its body size; until then it is an unknown type. */
};

/* Names a room on the receiving proxy: checked whole before anything lands. */
struct kvs_wire_room {
	uint32_t room, gen;
	uint8_t token[16];
};
static_assert(sizeof(struct kvs_wire_room) == 24, "room name is 24 bytes");

struct kvs_wire_open {
	struct kvs_wire_room room;
	uint64_t bytes;	     /* as the sender understood the descriptor */
	uint64_t slot_size;  /* chunking the sender will use: must equal the receiver's */
	uint64_t sender_ref; /* the sender proxy's name for its side, echoed back */
};
static_assert(sizeof(struct kvs_wire_open) == 48, "open is 48 bytes");

struct kvs_wire_open_ack {
	struct kvs_wire_room room;
	uint64_t sender_ref;
	int32_t status; /* 0, or -ESTALE, -EPERM (wrong token), -ECANCELED, -EBUSY, -EINVAL */
	uint32_t rsvd;
};
static_assert(sizeof(struct kvs_wire_open_ack) == 40, "open ack is 40 bytes");

#define KVS_WIRE_CHUNK_CRC (1u << 0) /* crc32c holds CRC32C of the payload */

struct kvs_wire_chunk {
	struct kvs_wire_room room;
	uint32_t chunk;
	uint32_t len;	   /* payload bytes: equals hdr.plen */
	uint64_t xfer_ref; /* the sender's transfer, echoed in the ack */
	uint32_t crc32c;   /* kvsp_crc32c(payload, len, 0), when flags has KVS_WIRE_CHUNK_CRC */
	uint32_t flags;
};
static_assert(sizeof(struct kvs_wire_chunk) == 48, "chunk is 48 bytes");

struct kvs_wire_chunk_ack {
	struct kvs_wire_room room;
	uint32_t chunk;
	int32_t status; /* 0: placed; else why it was discarded */
	uint64_t xfer_ref;
};
static_assert(sizeof(struct kvs_wire_chunk_ack) == 40, "chunk ack is 40 bytes");

/* Which half of a room speaks in ABORT and ENDED: they travel both ways. */
enum kvs_wire_from {
	KVS_WIRE_FROM_SEND = 1, /* the sending half (the receiver's proxy looks up room) */
	KVS_WIRE_FROM_RECV = 2, /* the receiving half (the sender's proxy looks up sender_ref) */
};

struct kvs_wire_abort {
	struct kvs_wire_room room;
	int32_t status;
	uint32_t from; /* enum kvs_wire_from */
	uint64_t sender_ref;
};
static_assert(sizeof(struct kvs_wire_abort) == 40, "abort is 40 bytes");

struct kvs_wire_done {
	struct kvs_wire_room room;
	uint64_t sender_ref;
};
static_assert(sizeof(struct kvs_wire_done) == 32, "done is 32 bytes");

struct kvs_wire_ended {
	struct kvs_wire_room room;
	uint64_t sender_ref;
	uint32_t from; /* enum kvs_wire_from */
	uint32_t rsvd;
};
static_assert(sizeof(struct kvs_wire_ended) == 40, "ended is 40 bytes");

/* The dialer's session: every connection of it names the same sid, each
 * its stream; the listener groups them (and the peer's instance) into one. */
struct kvs_wire_join {
	uint64_t sid;
	uint32_t stream, nstreams;
};
static_assert(sizeof(struct kvs_wire_join) == 16, "join is 16 bytes");

/* PING and PONG: the pinger's value (a nonce or a time), echoed. */
struct kvs_wire_ping {
	uint64_t value;
};
static_assert(sizeof(struct kvs_wire_ping) == 8, "ping is 8 bytes");

enum kvs_wire_bye_reason {
	KVS_WIRE_BYE_UNSPEC = 0,
	KVS_WIRE_BYE_DRAIN = 1, /* the proxy is draining: finish what is open, open nothing */
	KVS_WIRE_BYE_CLOSE = 2, /* the dialer closes this session: nothing rides on it */
};

struct kvs_wire_bye {
	uint32_t reason; /* enum kvs_wire_bye_reason */
	uint32_t rsvd;
};
static_assert(sizeof(struct kvs_wire_bye) == 8, "bye is 8 bytes");

/* RDMA_HELLO: how to reach the speaker's queue pair for this session on
 * one rail (struct kvsp_verbs_ep on the wire). A rail is a device of each
 * end, paired by their order (--rdma-device): rail 1 is each end's second;
 * a session has a queue pair on every rail both ends have, each said by
 * its own HELLO. No key: each CHUNK_READ carries its chunk's own. A proxy
 * without RDMA ignores it, and chunks go on the sockets. */
struct kvs_wire_rdma_hello {
	uint32_t qpn, psn;
	uint8_t gid[16];
	uint64_t pool_addr, pool_len;
	uint32_t keys; /* the speaker's chunk keys: 1 windows, 2 regions, 3 windows over regions */
	uint16_t mtu;  /* enum ibv_mtu */
	uint8_t rail;
	uint8_t rsvd; /* 0 */
};
static_assert(sizeof(struct kvs_wire_rdma_hello) == 48, "rdma hello is 48 bytes");

/* CHUNK_READ: a chunk to pull by RDMA READ from the sender's pool at
 * offset (within the pool its RDMA_HELLO named), with rkey: a key that
 * covers exactly these len bytes, for this session's queue pair, until
 * the CHUNK_ACK that echoes xfer_ref, the room's abort or the session's
 * loss, on its rail. The sender's slot stays its transport's until that key is revoked. */
struct kvs_wire_chunk_read {
	struct kvs_wire_room room;
	uint32_t chunk;
	uint32_t len;
	uint64_t xfer_ref;
	uint64_t offset;
	uint32_t rkey;
	uint32_t rail; /* the rail whose queue pairs the key is for: READ it there */
};
static_assert(sizeof(struct kvs_wire_chunk_read) == 56, "chunk read is 56 bytes");

/* Any body, for buffers that must hold the largest. */
union kvs_wire_body {
	struct kvs_wire_open open;
	struct kvs_wire_open_ack open_ack;
	struct kvs_wire_chunk chunk;
	struct kvs_wire_chunk_ack chunk_ack;
	struct kvs_wire_abort abort;
	struct kvs_wire_done done;
	struct kvs_wire_ping ping; /* PING and PONG */
	struct kvs_wire_bye bye;
	struct kvs_wire_join join;
	struct kvs_wire_ended ended;
	struct kvs_wire_rdma_hello rdma_hello;
	struct kvs_wire_chunk_read chunk_read;
	uint8_t bytes[56];
};
#define KVS_WIRE_BODY_MAX 56
static_assert(sizeof(union kvs_wire_body) == KVS_WIRE_BODY_MAX, "largest body is 56 bytes");
#define KVS_WIRE_FRAME_MAX (sizeof(struct kvs_wire_frame_hdr) + KVS_WIRE_BODY_MAX)

#endif
