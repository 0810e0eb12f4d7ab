/* SPDX-License-Identifier: MIT */
/*
 * A hostile peer proxy with an RDMA device, for the RDMA hostile suite
 * (test_hostile_rdma.c): it listens (a descriptor naming it makes a proxy
 * dial it), proves the secret, answers OPEN as a receiver would, makes its
 * own queue pair and connects it to the proxy's, and then READs whatever
 * it likes from the proxy's pool with whatever key it likes. Every wait
 * has WAIT_MS as a failure guard, never as an ordering.
 */
#ifndef KVS_TEST_HRDMA_H
#define KVS_TEST_HRDMA_H

#include <stdbool.h>
#include <stdint.h>

#include "datapath/verbs.h"
#include "hpeer.h"
#include "kvstage.h"

#define HZ_STREAMS KVSP_PEER_MAX_STREAMS
#define HZ_BUF (4u << 20)

struct hz {
	int lfd;
	char endpoint[32]; /* "127.0.0.1:PORT" */
	uint64_t inst;
	const struct kvsp_secret *secret;
	struct hpeer conn[HZ_STREAMS]; /* by stream */
	unsigned nstreams;
	/* verbs: our device, our buffer (READs land here), our queue pair */
	struct kvsp_verbs v;
	uint8_t *buf;
	struct ibv_qp *qp;
	struct kvsp_verbs_ep local, peer; /* peer: the proxy's, from its RDMA_HELLO */
	struct kvsp_frame stash;	  /* a frame that came before the HELLO (its OPEN) */
	bool stashed;
};

/* Listens on 127.0.0.1 (any port) as proxy instance inst, with secret s. */
void hz_listen(struct hz *z, const struct kvsp_secret *s, uint64_t inst);
/* A descriptor of a room of ours the proxy's sender may open: room, gen,
 * a token, bytes, chunked by slot_size (the proxy's). */
struct kvs_room_desc hz_desc(const struct hz *z, uint32_t room, uint32_t gen, uint64_t bytes,
			     uint64_t slot_size);
/* Accepts the proxy's session (each of its streams: handshake, JOIN), then
 * takes its RDMA_HELLO, makes our queue pair on $RXE_DEV and says ours. */
void hz_accept(struct hz *z);
/* The next frame on stream 0 that is not a PING (PINGs on every stream are answered). */
struct kvsp_frame hz_recv(struct hz *z);
/* As hz_recv, for at most ms: returns false (answering PINGs meanwhile) if no other frame came
 * or the proxy hung up. */
bool hz_recv_for(struct hz *z, int ms, struct kvsp_frame *out);
/* Answers the proxy's OPEN (the next frame must be one) with OPEN_ACK 0. */
void hz_ack_open(struct hz *z);
/* The next CHUNK_READ (the frame must be one). */
struct kvs_wire_chunk_read hz_chunk_read(struct hz *z);
/* Says CHUNK_ACK (status) for it. */
void hz_ack_chunk(struct hz *z, const struct kvs_wire_chunk_read *c, int status);
/* READs len bytes at offset of the proxy's pool with key into our buffer
 * (filled with 0x5a first). Returns the work completion's status. */
enum ibv_wc_status hz_read(struct hz *z, uint64_t offset, uint32_t len, uint32_t key);
/* Our buffer still holds only 0x5a over len bytes: nothing was read. */
bool hz_untouched(const struct hz *z, uint32_t len);
/* Closes every connection and the queue pair. */
void hz_close(struct hz *z);

#endif
