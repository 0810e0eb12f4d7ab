/* SPDX-License-Identifier: MIT */
/*
 * Failpoints: named places in the proxy that a test can make pause (hold
 * whatever reaches them until released), fail, or pass. Set from outside
 * the process through the admin protocol, and only when kvstaged runs with
 * --failpoints. Races in tests are staged with them, never with sleeps.
 */
#ifndef KVSP_FAILPOINT_H
#define KVSP_FAILPOINT_H

#include <stdbool.h>
#include <stdint.h>

#include "admin.h"

enum kvsp_fp_id {
	KVSP_FP_LOCAL_QUIESCE, /* local transport: hold or fail a chunk's hand-off (pinned, in flight) */
	KVSP_FP_ACQUIRE,       /* fail acquires */
	KVSP_FP_RECV_OPEN,     /* fail receiving-room opens */
	KVSP_FP_TCP_PAYLOAD,   /* tcp: hold a chunk's payload after its header went (the stream waits) */
	KVSP_FP_RDMA_READ,     /* rdma, receiving side: hold a READ into a slot posted for it */
	KVSP_FP_COUNT,
};

#define KVSP_FP_HOLD 1

struct kvsp_transport;

struct kvsp_fp {
	uint8_t action; /* enum kvs_fp_action */
	bool match_set;
	int32_t err;
	uint64_t match, mask;
	uint64_t hits;
	/* What holds work here and lets it go on request (admin release); NULL: nothing. */
	struct kvsp_transport *holder;
	unsigned (*release)(struct kvsp_transport *t, uint64_t match, uint64_t mask);
};

extern const char *const kvsp_fp_names[KVSP_FP_COUNT];

/* Returns the failpoint id for name, or -ENOENT. */
int kvsp_fp_find(const char *name);

/* Returns 0 (pass), KVSP_FP_HOLD, or the -errno to fail with. */
static inline int kvsp_fp_eval(struct kvsp_fp *fp, bool enabled, uint64_t ud_a, uint64_t ud_b)
{
	if (__builtin_expect(!enabled || fp->action == KVS_FP_OFF, 1))
		return 0;
	if (fp->match_set && (ud_a & fp->mask) != fp->match && (ud_b & fp->mask) != fp->match)
		return 0;
	fp->hits++;
	return fp->action == KVS_FP_PAUSE ? KVSP_FP_HOLD : fp->err;
}

#endif
