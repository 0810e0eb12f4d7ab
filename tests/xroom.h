/* SPDX-License-Identifier: MIT */
/* Rooms between clients of two proxies, canary-stamped and checked byte
 * for byte, for the suites that run more than one proxy. */
#ifndef KVS_TEST_XROOM_H
#define KVS_TEST_XROOM_H

#include <criterion/criterion.h>
#include <errno.h>
#include <stdint.h>

#include "canary.h"
#include "harness.h"

#define SLOT (64 * 1024)

/* One room from a client of tx_px to a client of rx_px, of bytes, owner's canary. */
struct xroom {
	kvs_room *rr, *sr;
	struct kvs_room_desc d;
	uint64_t bytes, owner;
	unsigned nchunks;
};

static inline void xroom_open(struct xroom *x, kvs_client *rx, kvs_client *tx, uint64_t bytes,
			      uint64_t owner)
{
	x->bytes = bytes;
	x->owner = owner;
	x->nchunks = (unsigned)((bytes + SLOT - 1) / SLOT);
	int rc = kvs_recv_open(rx, bytes, owner, &x->rr, &x->d);
	cr_assert_eq(rc, 0, "recv_open: %s", kvs_strerror(rc));
	rc = kvs_send_open(tx, &x->d, owner | 1ull << 40, &x->sr);
	cr_assert_eq(rc, 0, "send_open: %s", kvs_strerror(rc));
}

static inline void xroom_send(struct xroom *x, kvs_client *tx)
{
	for (unsigned k = 0; k < x->nchunks; k++) {
		struct kvs_lease l;
		int rc = kvs_acquire(tx, 1, &l);
		cr_assert_eq(rc, 0, "acquire: %s", kvs_strerror(rc));
		uint64_t off = (uint64_t)k * SLOT;
		uint32_t len = (uint32_t)(x->bytes - off < SLOT ? x->bytes - off : SLOT);
		canary_fill(kvs_lease_ptr(tx, &l), x->owner, off, len);
		rc = kvs_send(x->sr, &l, off, len);
		cr_assert_eq(rc, 0, "send: %s", kvs_strerror(rc));
	}
}

/* Checks every byte of a completed room, then closes both ends. */
static inline void xroom_verify(struct xroom *x, kvs_client *rx)
{
	for (unsigned k = 0; k < x->nchunks; k++) {
		struct kvs_lease l;
		cr_assert_eq(kvs_room_lease(x->rr, k, &l), 0);
		const void *p = kvs_lease_ptr(rx, &l);
		cr_assert_not_null(p);
		uint64_t off = (uint64_t)k * SLOT;
		uint64_t len = x->bytes - off < SLOT ? x->bytes - off : SLOT;
		cr_assert_eq(canary_check(p, x->owner, off, len), len,
			     "room %llx chunk %u: wrong bytes", (unsigned long long)x->owner, k);
	}
}

static inline void xroom_close(struct xroom *x)
{
	cr_assert_eq(kvs_room_close(x->rr), 0);
	cr_assert_eq(kvs_room_close(x->sr), 0);
}

static inline void one_room(kvs_client *rx, kvs_client *tx, uint64_t owner)
{
	struct xroom x;
	xroom_open(&x, rx, tx, 3 * SLOT, owner);
	xroom_send(&x, tx);
	struct kvs_event e = wait_event(tx);
	cr_assert_eq(e.type, KVS_EV_SEND_DONE, "room %llx: the sender's final is %u (%s)",
		     (unsigned long long)owner, e.type, kvs_strerror(e.status));
	e = wait_event(rx);
	cr_assert_eq(e.type, KVS_EV_RECV_DONE, "room %llx: the receiver's final is %u (%s)",
		     (unsigned long long)owner, e.type, kvs_strerror(e.status));
	xroom_verify(&x, rx);
	xroom_close(&x);
}

/* A reuser leases every slot of its proxy's pool and stamps each with
 * owner's canary: up to cap leases into bl. Returns how many; *got is set
 * if it was given slot victim. */
static inline unsigned xroom_drain_pool(kvs_client *b, struct kvs_lease *bl, unsigned cap,
					uint64_t owner, uint32_t victim, bool *got)
{
	unsigned n = 0;
	for (;;) {
		struct kvs_lease x;
		int rc = kvs_acquire(b, 1, &x);
		if (rc == -ENOBUFS)
			break;
		cr_assert_eq(rc, 0, "the reuser's acquire: %s", kvs_strerror(rc));
		cr_assert_lt(n, cap);
		canary_fill(kvs_lease_ptr(b, &x), owner, x.slot, SLOT);
		bl[n++] = x;
		*got |= x.slot == victim;
	}
	return n;
}

#endif
