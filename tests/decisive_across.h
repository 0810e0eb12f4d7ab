/* SPDX-License-Identifier: MIT */
/* DESIGN's decisive scenario across two proxies, for the suites that run
 * them on loopback (tcp) and in network namespaces (netns). */
#ifndef KVS_TEST_DECISIVE_ACROSS_H
#define KVS_TEST_DECISIVE_ACROSS_H

#include <errno.h>

#include "xroom.h"

/* The receiving proxy's pool: small, so the reuser can take all of it. */
#define DECISIVE_SLOTS 16

#define A_RX 0xA1
#define A_TX 0xA2
#define B_OWNER 0xB0B

struct decisive {
	uint32_t victim;          /* the receiving proxy's slot posted for A's chunk */
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
static inline struct decisive decisive_hold(struct proxy *pa, struct proxy *pb, struct proxy *hold_px,
					    const char *hold_fp)
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
	fp_wait(hold_px, hold_fp, 1);               /* the chunk is in flight */
	stat_wait(pb, "slots.recv_posted", 1, 1);   /* the receiver posted a slot for it */
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
	/* The late bytes go, and have arrived: read off the socket, or READ. */
	bool rdma = hold_px == pb;
	const char *arrived = rdma ? "rdma_reads" : "tcp_bytes_rx";
	uint64_t before = stat_get(pb, arrived);
	fp_set(hold_px, hold_fp, "off", NULL);
	stat_wait(pb, arrived, 1, before + (rdma ? 1 : SLOT));

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

/* Over tcp: the payload held at the sending proxy. */
static inline struct decisive decisive_across(struct proxy *pa, struct proxy *pb)
{
	return decisive_hold(pa, pb, pa, "tcp.payload");
}

#endif
