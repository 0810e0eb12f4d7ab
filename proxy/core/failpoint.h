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

/* KVSP_FP_LOCAL_QUIESCE and the others: admin.h lists them, with their names. */
enum kvsp_fp_id {
#define KVSP_FP_ID(id, name) KVSP_FP_##id,
	KVS_FAILPOINTS(KVSP_FP_ID)
#undef KVSP_FP_ID
		KVSP_FP_COUNT
};

#define KVSP_FP_HOLD 1
#define KVSP_FP_MODULES 16 /* failpoints the data paths may register */

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
