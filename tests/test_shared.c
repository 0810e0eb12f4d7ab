/* SPDX-License-Identifier: MIT */
/*
 * Shared rooms (kvs_recv_open_shared, kvs_recv_join): one room's bytes,
 * landed once, read by several clients of the receiving proxy (the decode
 * ranks of an MLA model, whose KV is the same on every rank). Through real
 * proxies: a local room, and one across two proxies over tcp at the
 * default --peer-timeout, where the bytes must cross once. Canary-stamped
 * bytes checked by every reader; barriers only.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include "harness.h"
#include "xroom.h"

#define SECRET "kvstage-shared-test-secret-0123456789ab"
#define NSLOTS 64

static struct proxy pa = PROXY_INIT, pb = PROXY_INIT;

static void setup(void)
{
	setenv("KVSTAGE_PEER_SECRET", SECRET, 1);
}

static void teardown(void)
{
	proxy_stop(&pa);
	proxy_stop(&pb);
}

TestSuite(shared, .init = setup, .fini = teardown, .timeout = 120);

static void start(struct proxy *px, bool listen)
{
	proxy_start(px, NULL,
		    (const char *[]){ "--slots", "64", "--slot-size", "64K",
				      listen ? "--listen" : NULL, "127.0.0.1:0", NULL });
}

/* rx[0] opens a shared room of bytes for readers; rx[1..n-1] join it. */
static void open_shared(struct xroom *x, kvs_client **rx, unsigned n, unsigned readers,
			kvs_room **rr, kvs_client *tx, uint64_t bytes, uint64_t owner)
{
	x->bytes = bytes;
	x->owner = owner;
	x->nchunks = (unsigned)((bytes + SLOT - 1) / SLOT);
	int rc = kvs_recv_open_shared(rx[0], bytes, readers, owner, &rr[0], &x->d);
	cr_assert_eq(rc, 0, "open_shared: %s", kvs_strerror(rc));
	x->rr = rr[0];
	rc = kvs_send_open(tx, &x->d, owner | 1ull << 40, &x->sr);
	cr_assert_eq(rc, 0, "send_open: %s", kvs_strerror(rc));
	for (unsigned k = 1; k < n; k++) {
		rc = kvs_recv_join(rx[k], &x->d, owner + k, &rr[k]);
		cr_assert_eq(rc, 0, "join %u: %s", k, kvs_strerror(rc));
	}
}

/* Reader c's view of the room through its own handle r: every byte. */
static void verify_as(struct xroom *x, kvs_client *c, kvs_room *r)
{
	for (unsigned k = 0; k < x->nchunks; k++) {
		struct kvs_lease l;
		cr_assert_eq(kvs_room_lease(r, k, &l), 0);
		const void *p = kvs_lease_ptr(c, &l);
		cr_assert_not_null(p, "chunk %u: the reader may not read it", k);
		uint64_t off = (uint64_t)k * SLOT,
			 len = x->bytes - off < SLOT ? x->bytes - off : SLOT;
		cr_assert_eq(canary_check(p, x->owner, off, len), len, "chunk %u: wrong bytes", k);
	}
}

static unsigned events_now(kvs_client *c)
{
	struct kvs_event e[4];
	int n = kvs_poll(c, e, 4);
	cr_assert_geq(n, 0);
	return (unsigned)n;
}

Test(shared, every_reader_gets_every_byte_once_all_joined_and_the_last_frees_the_slots)
{
	start(&pa, false);
	kvs_client *rx[3] = { connect_ok(&pa), connect_ok(&pa), connect_ok(&pa) };
	kvs_client *tx = connect_ok(&pa);
	struct xroom x;
	kvs_room *rr[3];
	const uint64_t bytes = 3 * SLOT + 100;
	x.bytes = bytes;
	x.owner = 0x5a1;
	x.nchunks = 4;
	cr_assert_eq(kvs_recv_open_shared(rx[0], bytes, 3, x.owner, &rr[0], &x.d), 0);
	x.rr = rr[0];
	cr_assert_eq(kvs_send_open(tx, &x.d, 0x5a2, &x.sr), 0);
	cr_assert_eq(kvs_recv_join(rx[1], &x.d, 0x5a3, &rr[1]), 0);
	xroom_send(&x, tx);
	stat_wait(&pa, "chunks_moved", 1, x.nchunks); /* every byte landed */
	sync_barrier(rx[0]);
	cr_assert_eq(events_now(rx[0]) + events_now(rx[1]) + events_now(tx), 0,
		     "the room completed before its third reader joined");
	cr_assert_eq(kvs_recv_join(rx[2], &x.d, 0x5a4, &rr[2]), 0);
	cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
	for (unsigned k = 0; k < 3; k++) {
		struct kvs_event e = wait_event(rx[k]);
		cr_assert_eq(e.type, KVS_EV_RECV_DONE, "reader %u got %u", k, e.type);
		cr_assert_eq(e.bytes, bytes);
		verify_as(&x, rx[k], rr[k]);
	}
	cr_assert_eq(stat_get(&pa, "slots.recv_filled"), x.nchunks, "the bytes landed once");
	struct kvs_lease l;
	cr_assert_eq(kvs_room_lease(rr[0], 1, &l), 0);
	cr_assert_eq(kvs_release(rx[0], &l), -EBUSY, "the opener freed a slot others read");
	cr_assert_eq(kvs_release(rx[1], &l), -EPERM, "a reader released the opener's slot");
	cr_assert_eq(kvs_room_close(rr[0]), 0);
	cr_assert_eq(kvs_room_close(rr[1]), 0);
	sync_barrier(rx[0]);
	sync_barrier(rx[1]);
	cr_assert_eq(stat_get(&pa, "slots.recv_filled"), x.nchunks, "freed while a reader had it");
	verify_as(&x, rx[2], rr[2]);
	cr_assert_eq(kvs_room_close(rr[2]), 0);
	cr_assert_eq(kvs_room_close(x.sr), 0);
	for (unsigned k = 0; k < 3; k++)
		kvs_close(rx[k]);
	kvs_close(tx);
	wait_idle(&pa, 0);
}

Test(shared, an_abort_by_any_reader_ends_it_for_every_reader_and_the_sender)
{
	start(&pa, false);
	kvs_client *rx[3] = { connect_ok(&pa), connect_ok(&pa), connect_ok(&pa) };
	kvs_client *tx = connect_ok(&pa);
	struct xroom x;
	kvs_room *rr[3];
	open_shared(&x, rx, 2, 3, rr, tx, 2 * SLOT, 0x6b1); /* a third reader to come */
	struct kvs_lease l;
	cr_assert_eq(kvs_acquire(tx, 1, &l), 0);
	canary_fill(kvs_lease_ptr(tx, &l), x.owner, 0, SLOT);
	cr_assert_eq(kvs_send(x.sr, &l, 0, SLOT), 0);
	stat_wait(&pa, "chunks_moved", 1, 1);
	cr_assert_eq(kvs_abort(rr[1]), 0); /* the joined reader */
	cr_assert_eq(wait_event(rx[0]).type, KVS_EV_ABORTED);
	cr_assert_eq(wait_event(rx[1]).type, KVS_EV_ABORTED);
	cr_assert_eq(wait_event(tx).type, KVS_EV_ABORTED);
	cr_assert_eq(kvs_recv_join(rx[2], &x.d, 0x6b9, &rr[2]), -ECANCELED,
		     "joined an aborted room");
	cr_assert_eq(kvs_room_close(rr[0]), 0);
	cr_assert_eq(kvs_room_close(rr[1]), 0);
	cr_assert_eq(kvs_room_close(x.sr), 0);
	for (unsigned k = 0; k < 3; k++)
		kvs_close(rx[k]);
	kvs_close(tx);
	wait_idle(&pa, 0);
}

Test(shared, joins_that_name_no_place_are_refused_and_change_nothing)
{
	start(&pa, false);
	kvs_client *a = connect_ok(&pa), *b = connect_ok(&pa);
	kvs_room *r, *j;
	struct kvs_room_desc d, forged;
	cr_assert_eq(kvs_recv_open(a, SLOT, 1, &r, &d), 0);
	cr_assert_eq(kvs_recv_join(b, &d, 2, &j), -EINVAL, "joined a room that is not shared");
	cr_assert_eq(kvs_room_close(r), 0);
	cr_assert_eq(kvs_recv_open_shared(a, SLOT, KVS_MAX_READERS + 1, 3, &r, &d), -EINVAL);
	cr_assert_eq(kvs_recv_open_shared(a, SLOT, 2, 3, &r, &d), 0);
	forged = d;
	forged.bytes[24] ^=
		1; /* a bit of the token (after magic, version, flags, instance, room, gen) */
	cr_assert_eq(kvs_recv_join(b, &forged, 4, &j), -EPERM);
	cr_assert_eq(kvs_recv_join(b, &d, 5, &j), 0);
	kvs_room *k;
	cr_assert_eq(kvs_recv_join(b, &d, 6, &k), -EUSERS, "a third reader of two");
	cr_assert_eq(kvs_room_close(j), 0);
	cr_assert_eq(kvs_room_close(r), 0);
	sync_barrier(a);
	cr_assert_eq(kvs_recv_join(b, &d, 7, &k), -ESTALE, "joined a room that is gone");
	kvs_close(a);
	kvs_close(b);
	wait_idle(&pa, 0);
}

/* The opener, in a process of its own, dies once the room is complete: the
 * other reader keeps its bytes until it closes. */
static int opener(int rd, int wr, void *arg)
{
	(void)arg;
	kvs_client *c;
	kvs_room *r;
	struct kvs_room_desc d;
	struct kvs_event e;
	if (kvs_connect(pa.sock, &c) || kvs_recv_open_shared(c, 2 * SLOT, 2, 0x7c1, &r, &d))
		return 10;
	if (chan_put(wr, &d, sizeof(d)) || kvs_wait(c, &e, WAIT_MS) != 1 ||
	    e.type != KVS_EV_RECV_DONE)
		return 11;
	char go;
	if (chan_put(wr, "d", 1) || chan_get(rd, &go, 1))
		return 12;
	kill(getpid(), SIGKILL); /* dies holding the room */
	return 13;
}

Test(shared, the_opener_dying_leaves_the_other_reader_its_bytes)
{
	start(&pa, false);
	struct child ch;
	child_start(&ch, opener, NULL);
	struct xroom x = { .bytes = 2 * SLOT, .owner = 0x7c1, .nchunks = 2 };
	cr_assert_eq(chan_get(ch.from, &x.d, sizeof(x.d)), 0);
	kvs_client *rx = connect_ok(&pa), *tx = connect_ok(&pa);
	kvs_room *rr;
	cr_assert_eq(kvs_recv_join(rx, &x.d, 0x7c2, &rr), 0);
	cr_assert_eq(kvs_send_open(tx, &x.d, 0x7c3, &x.sr), 0);
	xroom_send(&x, tx);
	cr_assert_eq(wait_event(rx).type, KVS_EV_RECV_DONE);
	char done;
	cr_assert_eq(chan_get(ch.from, &done, 1), 0);
	uint64_t died = stat_get(&pa, "clients_died");
	cr_assert_eq(chan_put(ch.to, "k", 1), 0);
	cr_assert_eq(child_wait(&ch), 128 + SIGKILL);
	stat_wait(&pa, "clients_died", 1, died + 1);
	sync_barrier(rx);
	cr_assert_eq(stat_get(&pa, "slots.recv_filled"), 2, "the dead opener took the slots");
	verify_as(&x, rx, rr);
	cr_assert_eq(kvs_room_close(rr), 0);
	cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
	cr_assert_eq(kvs_room_close(x.sr), 0);
	kvs_close(rx);
	kvs_close(tx);
	wait_idle(&pa, 0);
}

/* Two readers on the receiving proxy, the sender on another, at the default
 * --peer-timeout: each byte crosses once, both readers read all of it. */
Test(shared, across_two_proxies_the_bytes_cross_once)
{
	start(&pb, true);
	start(&pa, true);
	kvs_client *rx[2] = { connect_ok(&pb), connect_ok(&pb) };
	kvs_client *tx = connect_ok(&pa);
	struct xroom x;
	kvs_room *rr[2];
	uint64_t rx0 = stat_get(&pb, "tcp_bytes_rx") + stat_get(&pb, "rdma_bytes_rx");
	open_shared(&x, rx, 2, 2, rr, tx, 8 * SLOT, 0x8d1);
	xroom_send(&x, tx);
	cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
	for (unsigned k = 0; k < 2; k++) {
		cr_assert_eq(wait_event(rx[k]).type, KVS_EV_RECV_DONE);
		verify_as(&x, rx[k], rr[k]);
	}
	uint64_t moved = stat_get(&pb, "tcp_bytes_rx") + stat_get(&pb, "rdma_bytes_rx") - rx0;
	cr_assert_geq(moved, x.bytes);
	cr_assert_lt(moved, 2 * x.bytes, "%llu bytes came for a room of %llu read by two",
		     (unsigned long long)moved, (unsigned long long)x.bytes);
	for (unsigned k = 0; k < 2; k++)
		cr_assert_eq(kvs_room_close(rr[k]), 0);
	cr_assert_eq(kvs_room_close(x.sr), 0);
	for (unsigned k = 0; k < 2; k++)
		kvs_close(rx[k]);
	kvs_close(tx);
	wait_idle(&pa, 0);
	wait_idle(&pb, 0);
}
