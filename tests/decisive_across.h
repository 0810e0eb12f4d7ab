/* SPDX-License-Identifier: MIT */
/* DESIGN's decisive scenario across two proxies, for the suites that run
 * them on loopback (tcp) and in network namespaces (netns). */
#ifndef KVS_TEST_DECISIVE_ACROSS_H
#define KVS_TEST_DECISIVE_ACROSS_H

#include <errno.h>
#include <string.h>

#include "xroom.h"

/* The receiving proxy's pool: small, so the reuser can take all of it. */
#define DECISIVE_SLOTS 16

#define A_RX 0xA1
#define A_TX 0xA2
#define B_OWNER 0xB0B

struct decisive {
	uint32_t victim; /* the receiving proxy's slot posted for A's chunk */
	uint8_t state_after_abort;
	bool b_got_victim, b_intact, victim_has_a;
	unsigned b_slots;
	uint32_t rx_final, tx_final;
	uint64_t discarded;
};

/* Across hosts: A's chunk is held in flight with the receiving proxy's
 * slot posted for it: over tcp at the sending proxy with its header sent
 * and its payload not (hold_fp tcp.payload on pa), over rdma at the
 * receiving proxy with the READ not yet done (rdma.read on pb). The decode
 * side aborts; B drains the receiving pool and stamps every slot it gets;
 * the chunk is let go. The late bytes must never land in a slot that is
 * B's. pb must run with --slots 16 (DECISIVE_SLOTS). */
static inline struct decisive decisive_hold(struct proxy *pa, struct proxy *pb,
					    struct proxy *hold_px, const char *hold_fp)
{
	struct decisive o = { 0 };
	kvs_client *rx = connect_ok(pb), *tx = connect_ok(pa), *b = connect_ok(pb);
	kvs_room *rr, *sr;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(rx, SLOT, A_RX, &rr, &d), 0);
	cr_assert_eq(kvs_send_open(tx, &d, A_TX, &sr), 0);
	uint64_t match = hold_px == pb ? A_RX : A_TX; /* the room as the holding proxy names it */
	fp_set(hold_px, hold_fp, "pause", &match);
	struct kvs_lease a;
	cr_assert_eq(kvs_acquire(tx, 1, &a), 0);
	canary_fill(kvs_lease_ptr(tx, &a), A_TX, 0, SLOT);
	cr_assert_eq(kvs_send(sr, &a, 0, SLOT), 0);
	fp_wait(hold_px, hold_fp, 1);		  /* the chunk is in flight */
	stat_wait(pb, "slots.recv_posted", 1, 1); /* the receiver posted a slot for it */
	o.victim = UINT32_MAX;
	for (uint32_t i = 0; i < DECISIVE_SLOTS; i++)
		if (slot_pub(pb, i).state == KVS_SLOT_RECV_POSTED)
			o.victim = i;
	cr_assert_neq(o.victim, UINT32_MAX);

	cr_assert_eq(kvs_abort(rr), 0);
	sync_barrier(rx);
	o.state_after_abort = slot_pub(pb, o.victim).state;

	struct kvs_lease bl[DECISIVE_SLOTS];
	o.b_slots = xroom_drain_pool(b, bl, DECISIVE_SLOTS, B_OWNER, o.victim, &o.b_got_victim);
	/* The late bytes go, and have arrived: read off the socket. By READ:
	 * once the abort reached the sender, which revoked the chunk's key
	 * (the slot was only ever readable under it), the late READ goes and
	 * the sender's NIC refuses it; the posted slot, a tombstone till the
	 * READ's completion, is reaped then and the chunk counted discarded. */
	bool rdma = !strcmp(hold_fp, "rdma.read");
	if (rdma) {
		if (stat_get(pa, "rdma_binds"))
			stat_wait(pa, "rdma_invalidates", 1, 1);
		else
			stat_wait(pa, "rdma_region_frees", 1, 1);
	}
	uint64_t before = stat_get(pb, "tcp_bytes_rx"),
		 refused = stat_get(pa, "rdma_reads_refused"),
		 failed = stat_get(pb, "rdma_links_lost");
	fp_set(hold_px, hold_fp, "off", NULL);
	if (rdma) {
		stat_wait(pa, "rdma_reads_refused", 1, refused + 1); /* by the NIC, not by a word */
		stat_wait(pb, "rdma_links_lost", 1, failed + 1); /* the READ's failure, reaped */
	} else if (hold_px == pa) {
		stat_wait(pb, "tcp_bytes_rx", 1, before + SLOT);
	} /* else held at the receiver with its bytes in (relay.land): nothing more comes */

	o.rx_final = wait_event(rx).type;
	o.tx_final = wait_event(tx).type;
	o.discarded = stat_get(pb, "chunks_discarded");
	o.b_intact = true;
	for (unsigned i = 0; i < o.b_slots; i++) {
		const void *p = kvs_lease_ptr(b, &bl[i]);
		if (!p || canary_check(p, B_OWNER, bl[i].slot, SLOT) != SLOT)
			o.b_intact = false;
		if (p && bl[i].slot == o.victim)
			o.victim_has_a = canary_check(p, A_TX, 0, SLOT) == SLOT;
		kvs_release(b, &bl[i]);
	}
	kvs_room_close(rr);
	kvs_room_close(sr);
	kvs_close(rx);
	kvs_close(tx);
	kvs_close(b);
	return o;
}

/* By RDMA READ our own NIC may still write the posted slot: it stays a
 * tombstone until the READ has completed, and the late bytes are fenced
 * out then. */
static inline void decisive_expect_tombstone(const struct decisive *o)
{
	cr_assert_eq(o->state_after_abort, KVS_SLOT_TOMBSTONE,
		     "aborted mid-READ: the posted slot must be a tombstone");
	cr_assert(!o->b_got_victim, "B was given the slot the late READ still writes into");
	cr_assert_eq(o->b_slots, DECISIVE_SLOTS - 1, "B gets every slot but the tombstone");
	cr_assert(o->b_intact, "B's slots changed under it");
	cr_assert_eq(o->rx_final, KVS_EV_ABORTED);
	cr_assert_eq(o->tx_final, KVS_EV_ABORTED);
	cr_assert_eq(o->discarded, 1, "the late chunk is discarded, and counted");
}

/* Over the stream the receiver's own recv() is the only writer of the
 * posted slot: at the abort the rest of the payload goes to the sink, so
 * the slot comes back at once (B may be given it: a stalled peer holds
 * nothing), and the late bytes never land in it. */
static inline void decisive_expect_sunk(const struct decisive *o)
{
	cr_assert_eq(o->state_after_abort, KVS_SLOT_FREE,
		     "aborted mid-payload: the posted slot comes back at once (%u)",
		     o->state_after_abort);
	cr_assert_eq(o->b_slots, DECISIVE_SLOTS, "B gets every slot, the one posted for A too");
	cr_assert(o->b_intact, "the late bytes landed in B's slot");
	cr_assert(!o->victim_has_a, "A's chunk is in B's slot");
	cr_assert_eq(o->rx_final, KVS_EV_ABORTED);
	cr_assert_eq(o->tx_final, KVS_EV_ABORTED);
	cr_assert_eq(o->discarded, 1, "the late chunk is discarded once, and counted");
}

/* Over tcp: the payload held at the sending proxy. */
static inline struct decisive decisive_across(struct proxy *pa, struct proxy *pb)
{
	return decisive_hold(pa, pb, pa, "tcp.payload");
}

#endif
