/* SPDX-License-Identifier: MIT */
/*
 * The decisive scenario of DESIGN.md, forever a test:
 *
 *   room A's chunk sits in slot 42, held in flight inside the transport
 *   (failpoint local.quiesce); A is aborted; client B leases slots until
 *   the pool is empty and writes its canary into each; A's transfer is
 *   let go. B must never be given slot 42 until A's transport quiesced,
 *   and A's late bytes must never land in memory that is now B's.
 *
 * The same scenario runs against kvstaged-vulnerable (a test-only build:
 * the production core behind a transport that, as the buggy engines' do,
 * says it is done with a slot while it still holds its address, and
 * writes there late): there it must detect the corruption, or the green
 * half proves nothing.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "canary.h"
#include "harness.h"

#define SLOTS 64
#define SLOT (64 * 1024)
#define VICTIM 42
#define A_RX 0xA1
#define A_TX 0xA2
#define B_OWNER 0xB0B

static struct proxy px = PROXY_INIT;

static void teardown(void)
{
	proxy_stop(&px);
}

TestSuite(decisive, .fini = teardown, .timeout = 60);

struct outcome {
	uint32_t a_epoch;	   /* slot 42's epoch when A sent it */
	uint8_t state_held;	   /* slot 42 while A's chunk is held in the transport */
	uint8_t state_after_abort; /* slot 42 right after A's abort */
	unsigned b_slots;
	bool b_got_victim; /* B was leased slot 42 while A's transfer held it */
	uint32_t rx_final; /* A's receiver's final event */
	bool rx_saw_b;	   /* A's receiver read B's canary */
	bool rx_saw_a;
	bool b_intact;	   /* every B slot still B's, with B's bytes */
	bool victim_has_a; /* B's copy of slot 42 holds A's bytes */
	uint32_t tx_final;
	struct kvs_slot victim_after; /* slot 42 once A quiesced */
	struct kvs_lease b_later;     /* what B gets when it leases again */
};

/* Runs the scenario; abort_side 0: A's sender aborts, 1: A's receiver. */
static struct outcome scenario(const char *bin, int abort_side)
{
	struct outcome o = { 0 };
	proxy_start(&px, bin, (const char *[]){ "--slots", "64", "--slot-size", "64K", NULL });
	kvs_client *rx = connect_ok(&px), *tx = connect_ok(&px), *b = connect_ok(&px);

	kvs_room *rroom, *sroom;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(rx, SLOT, A_RX, &rroom, &d), 0);
	cr_assert_eq(kvs_send_open(tx, &d, A_TX, &sroom), 0);

	/* A leases slots 0..42 (the pool hands out the lowest first), keeps 42. */
	struct kvs_lease l[VICTIM + 1];
	cr_assert_eq(kvs_acquire(tx, VICTIM + 1, l), 0);
	struct kvs_lease a = l[VICTIM];
	cr_assert_eq(a.slot, VICTIM);
	for (int i = 0; i < VICTIM; i++)
		cr_assert_eq(kvs_release(tx, &l[i]), 0);
	o.a_epoch = a.epoch;

	uint64_t match = A_TX;
	fp_set(&px, "local.quiesce", "pause", &match);
	canary_fill(kvs_lease_ptr(tx, &a), A_TX, 0, SLOT);
	cr_assert_eq(kvs_send(sroom, &a, 0, SLOT), 0);
	fp_wait(&px, "local.quiesce", 1); /* barrier: A's chunk is inside the transport */
	o.state_held = slot_pub(&px, VICTIM).state;

	cr_assert_eq(kvs_abort(abort_side ? rroom : sroom), 0);
	sync_barrier(abort_side ? rx : tx); /* answered after the abort */
	o.state_after_abort = slot_pub(&px, VICTIM).state;

	/* B drains the pool and stamps every slot it gets. */
	struct kvs_lease bl[SLOTS];
	for (;;) {
		struct kvs_lease x;
		int rc = kvs_acquire(b, 1, &x);
		if (rc == -ENOBUFS)
			break;
		cr_assert_eq(rc, 0, "B's acquire: %s", kvs_strerror(rc));
		canary_fill(kvs_lease_ptr(b, &x), B_OWNER, x.slot, SLOT);
		bl[o.b_slots++] = x;
		if (x.slot == VICTIM)
			o.b_got_victim = true;
	}

	fp_set(&px, "local.quiesce", "off", NULL); /* A's transfer resumes */
	/* Barrier: the loop polls clients, then transports. The first answer
	 * may precede that pass's transports; the second comes a pass later,
	 * after whatever the resumed transfer did. */
	sync_barrier(b);
	sync_barrier(b);

	struct kvs_event ev = wait_event(rx);
	o.rx_final = ev.type;
	if (ev.type == KVS_EV_RECV_DONE) {
		struct kvs_lease got;
		cr_assert_eq(kvs_room_lease(rroom, 0, &got), 0);
		const void *p = kvs_lease_ptr(rx, &got);
		cr_assert_not_null(p);
		o.rx_saw_b = canary_check(p, B_OWNER, got.slot, SLOT) == SLOT;
		o.rx_saw_a = canary_check(p, A_TX, 0, SLOT) == SLOT;
	}
	o.tx_final = wait_event(tx).type;
	o.victim_after = slot_pub(&px, VICTIM);

	o.b_intact = true;
	for (unsigned i = 0; i < o.b_slots; i++) {
		const void *p = kvs_lease_ptr(b, &bl[i]);
		if (!p || canary_check(p, B_OWNER, bl[i].slot, SLOT) != SLOT)
			o.b_intact = false;
		if (p && bl[i].slot == VICTIM)
			o.victim_has_a = canary_check(p, A_TX, 0, SLOT) == SLOT;
	}
	if (kvs_acquire(b, 1, &o.b_later) < 0)
		o.b_later.slot = UINT32_MAX;

	kvs_room_close(rroom);
	kvs_room_close(sroom);
	kvs_close(rx);
	kvs_close(tx);
	kvs_close(b);
	if (bin == NULL)
		wait_idle(&px, 0);
	return o;
}

static void assert_safe(const struct outcome *o)
{
	cr_assert_eq(o->state_held, KVS_SLOT_INFLIGHT, "held in the transport: pinned, in flight");
	cr_assert_eq(o->state_after_abort, KVS_SLOT_TOMBSTONE,
		     "aborted while in flight: slot 42 must be a tombstone");
	cr_assert_eq(o->b_slots, SLOTS - 1, "B gets every slot but the tombstone");
	cr_assert(!o->b_got_victim, "B was given slot 42 while A's transport held it");
	cr_assert_eq(o->rx_final, KVS_EV_ABORTED, "A's receiver must end ABORTED");
	cr_assert(!o->rx_saw_b, "A's receiver read B's bytes");
	cr_assert_eq(o->tx_final, KVS_EV_ABORTED);
	cr_assert(o->b_intact, "B's slots changed under it");
	cr_assert_eq(o->victim_after.state, KVS_SLOT_FREE, "reaped once A quiesced");
	cr_assert_eq(o->victim_after.epoch, o->a_epoch + 2,
		     "tombstoning and reaping each bump the epoch");
	cr_assert_eq(o->b_later.slot, VICTIM, "slot 42 comes back once quiesced");
	cr_assert_eq(o->b_later.epoch, o->a_epoch + 2, "with a new epoch");
}

Test(decisive, sender_abort_while_in_flight_is_fenced)
{
	struct outcome o = scenario(NULL, 0);
	assert_safe(&o);
}

Test(decisive, receiver_abort_while_in_flight_is_fenced)
{
	struct outcome o = scenario(NULL, 1);
	assert_safe(&o);
}

/* The red half: the same scenario against the engines' behaviour. */
Test(decisive, vulnerable_build_is_caught_corrupting)
{
	struct outcome o = scenario(proxy_vulnerable_bin(), 0);
	cr_assert_eq(o.state_held, KVS_SLOT_FREE, "the vulnerable transport lets go at once");
	cr_assert_neq(o.state_after_abort, KVS_SLOT_TOMBSTONE, "so nothing is left to tombstone");
	cr_assert(o.b_got_victim, "B is handed slot 42 while A's transfer still holds it");
	cr_assert(!o.b_intact, "A's late bytes landed in B's slot 42: the corruption detected");
	cr_assert(o.victim_has_a, "what B's slot 42 holds now is A's chunk");
	cr_assert(!o.rx_saw_b);
}
