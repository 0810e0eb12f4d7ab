/* SPDX-License-Identifier: MIT */
/*
 * Proxies on loopback, joined by the tcp transport: real kvstaged
 * processes, engines as clients of each. Every room is canary-stamped and
 * checked byte for byte on its receiver; every test ends with both pools
 * fully free. Barriers only: counters (stat_wait) and failpoints.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "canary.h"
#include "harness.h"

#define SLOT (64 * 1024)
#define SECRET "kvstage-test-secret-0123456789abcdef"

static struct proxy pa = PROXY_INIT, pb = PROXY_INIT, pc = PROXY_INIT;

static void setup(void)
{
	setenv("KVSTAGE_PEER_SECRET", SECRET, 1);
}

static void teardown(void)
{
	proxy_stop(&pa);
	proxy_stop(&pb);
	proxy_stop(&pc);
}

TestSuite(tcp, .init = setup, .fini = teardown, .timeout = 120);

#define LISTEN(px) proxy_start(px, NULL, (const char *[]){ "--slots", "64", "--slot-size", "64K", \
		"--listen", "127.0.0.1:0", "--peer-timeout", "5000", NULL })

/* One room from a client of tx_px to a client of rx_px, of bytes, owner's canary. */
struct xroom {
	kvs_room *rr, *sr;
	struct kvs_room_desc d;
	uint64_t bytes, owner;
	unsigned nchunks;
};

static void xroom_open(struct xroom *x, kvs_client *rx, kvs_client *tx, uint64_t bytes,
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

static void xroom_send(struct xroom *x, kvs_client *tx)
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
static void xroom_verify(struct xroom *x, kvs_client *rx)
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

static void xroom_close(struct xroom *x)
{
	cr_assert_eq(kvs_room_close(x->rr), 0);
	cr_assert_eq(kvs_room_close(x->sr), 0);
}

Test(tcp, rooms_of_one_byte_to_many_chunks_arrive_byte_for_byte)
{
	LISTEN(&pb);
	LISTEN(&pa);
	kvs_client *rx = connect_ok(&pb), *tx = connect_ok(&pa);
	const uint64_t sizes[] = { 1, 7, SLOT - 1, SLOT, SLOT + 1, 5 * SLOT + 4096 + 3, 20 * SLOT };
	for (unsigned i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
		struct xroom x;
		xroom_open(&x, rx, tx, sizes[i], 0x100 + i);
		xroom_send(&x, tx);
		struct kvs_event e = wait_event(tx);
		cr_assert_eq(e.type, KVS_EV_SEND_DONE, "room of %llu bytes: sender got %u (%d)",
			     (unsigned long long)sizes[i], e.type, e.status);
		e = wait_event(rx);
		cr_assert_eq(e.type, KVS_EV_RECV_DONE, "room of %llu bytes: receiver got %u (%d)",
			     (unsigned long long)sizes[i], e.type, e.status);
		cr_assert_eq(e.bytes, sizes[i]);
		xroom_verify(&x, rx);
		xroom_close(&x);
	}
	cr_assert_eq(stat_get(&pa, "peer_sessions"), 1, "one session, reused by every room");
	uint64_t total = 0;
	for (unsigned i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++)
		total += sizes[i];
	cr_assert_geq(stat_get(&pa, "tcp_bytes_tx"), total, "the bytes went over tcp");
	cr_assert_geq(stat_get(&pb, "tcp_bytes_rx"), total);
	kvs_close(rx);
	kvs_close(tx);
	wait_idle(&pa, 0);
	wait_idle(&pb, 0);
	cr_assert_eq(stat_get(&pb, "chunks_discarded"), 0);
}
