/* SPDX-License-Identifier: MIT */
/*
 * Local rooms through a real kvstaged: several sender and receiver
 * processes move canary-stamped bytes, verified byte for byte.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "canary.h"
#include "harness.h"

#define SLOT (64 * 1024)

static struct proxy px = PROXY_INIT;

static void setup(void)
{
	proxy_start(&px, NULL, (const char *[]){ "--slots", "64", "--slot-size", "64K", NULL });
}

static void teardown(void)
{
	proxy_stop(&px);
}

TestSuite(local, .init = setup, .fini = teardown, .timeout = 120);

/* Room sizes that cross every chunk boundary case. */
static const uint64_t sizes[] = { 1, 8, SLOT - 1, SLOT, SLOT + 1, 3 * SLOT + SLOT / 2, 5 * SLOT };
#define NSIZES (sizeof(sizes) / sizeof(sizes[0]))

struct pair {
	int desc[2]; /* receiver -> sender: descriptors (the engines' bootstrap channel) */
	unsigned id, rooms;
	int reverse; /* sender sends chunks last to first */
};

struct report {
	unsigned rooms, chunks, bad_chunks, bad_events;
};

static uint64_t owner_of(unsigned pair, unsigned room)
{
	return (uint64_t)pair << 32 | room;
}

static int receiver(int rd, int wr, void *arg)
{
	struct pair *pp = arg;
	struct report rep = { 0 };
	kvs_client *c;
	(void)rd;
	if (kvs_connect(px.sock, &c))
		return 10;
	for (unsigned i = 0; i < pp->rooms; i++) {
		uint64_t bytes = sizes[(i + pp->id) % NSIZES];
		kvs_room *r;
		struct kvs_room_desc d;
		if (kvs_recv_open(c, bytes, owner_of(pp->id, i), &r, &d))
			return 11;
		if (chan_put(pp->desc[1], &d, sizeof(d)))
			return 12;
		struct kvs_event ev;
		if (kvs_wait(c, &ev, WAIT_MS) != 1)
			return 13;
		if (ev.type != KVS_EV_RECV_DONE || ev.user_data != owner_of(pp->id, i) ||
		    ev.bytes != bytes || ev.status)
			rep.bad_events++;
		for (unsigned k = 0; k < kvs_room_chunks(r); k++) {
			struct kvs_lease l;
			uint64_t off = (uint64_t)k * SLOT,
				 len = bytes - off < SLOT ? bytes - off : SLOT;
			const void *p = kvs_room_lease(r, k, &l) ? NULL : kvs_lease_ptr(c, &l);
			if (!p || canary_check(p, owner_of(pp->id, i), off, len) != len)
				rep.bad_chunks++;
			rep.chunks++;
		}
		if (kvs_room_close(r))
			return 14;
		rep.rooms++;
	}
	/* nothing more may arrive: exactly one final per room */
	struct kvs_event extra;
	if (kvs_poll(c, &extra, 1) != 0)
		rep.bad_events++;
	kvs_close(c);
	return chan_put(wr, &rep, sizeof(rep)) ? 15 : 0;
}

static int sender(int rd, int wr, void *arg)
{
	struct pair *pp = arg;
	kvs_client *c;
	(void)rd;
	(void)wr;
	if (kvs_connect(px.sock, &c))
		return 20;
	for (unsigned i = 0; i < pp->rooms; i++) {
		struct kvs_room_desc d;
		if (chan_get(pp->desc[0], &d, sizeof(d)))
			return 21;
		kvs_room *r;
		if (kvs_send_open(c, &d, 0x5000 + i, &r))
			return 22;
		unsigned n = kvs_room_chunks(r);
		uint64_t bytes = kvs_room_bytes(r);
		struct kvs_lease l[8];
		int rc;
		while ((rc = kvs_acquire(c, n, l)) == -ENOBUFS) {
			/* the pool is shared: wait for a room of ours to finish */
			struct kvs_event ev;
			if (kvs_wait(c, &ev, 50) == -ENOTCONN)
				return 23;
		}
		if (rc)
			return 24;
		for (unsigned j = 0; j < n; j++) {
			unsigned k = pp->reverse ? n - 1 - j : j;
			uint64_t off = (uint64_t)k * SLOT,
				 len = bytes - off < SLOT ? bytes - off : SLOT;
			canary_fill(kvs_lease_ptr(c, &l[j]), owner_of(pp->id, i), off, len);
			if (kvs_send(r, &l[j], off, (uint32_t)len))
				return 25;
		}
		struct kvs_event ev;
		if (kvs_wait(c, &ev, WAIT_MS) != 1 || ev.type != KVS_EV_SEND_DONE ||
		    ev.user_data != 0x5000 + i)
			return 26;
		kvs_room_close(r);
	}
	kvs_close(c);
	return 0;
}

Test(local, processes_move_canary_bytes)
{
	enum { PAIRS = 3, ROOMS = 40 };
	struct pair pairs[PAIRS];
	struct child rx[PAIRS], tx[PAIRS];
	for (unsigned p = 0; p < PAIRS; p++) {
		pairs[p] = (struct pair){ .id = p + 1, .rooms = ROOMS, .reverse = p & 1 };
		cr_assert_eq(pipe(pairs[p].desc), 0);
		child_start(&rx[p], receiver, &pairs[p]);
		child_start(&tx[p], sender, &pairs[p]);
		close(pairs[p].desc[0]);
		close(pairs[p].desc[1]);
	}
	struct report total = { 0 };
	for (unsigned p = 0; p < PAIRS; p++) {
		struct report rep;
		cr_assert_eq(chan_get(rx[p].from, &rep, sizeof(rep)), 0, "receiver %u died", p);
		cr_assert_eq(child_wait(&rx[p]), 0);
		cr_assert_eq(child_wait(&tx[p]), 0, "sender %u failed", p);
		total.rooms += rep.rooms;
		total.chunks += rep.chunks;
		total.bad_chunks += rep.bad_chunks;
		total.bad_events += rep.bad_events;
	}
	cr_assert_eq(total.rooms, PAIRS * ROOMS);
	cr_assert_eq(total.bad_chunks, 0, "%u of %u chunks had a wrong byte", total.bad_chunks,
		     total.chunks);
	cr_assert_eq(total.bad_events, 0);
	wait_idle(&px, 0);
	cr_assert_eq(stat_get(&px, "rooms_done"), PAIRS * ROOMS);
	cr_assert_eq(stat_get(&px, "chunks_moved"), total.chunks);
	cr_assert_eq(stat_get(&px, "rej_stale") + stat_get(&px, "rej_perm"), 0);
}

Test(local, zero_copy_handoff_bumps_epoch_and_moves_ownership)
{
	kvs_client *rx = connect_ok(&px), *tx = connect_ok(&px);
	kvs_room *rr, *sr;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(rx, 3 * SLOT, 1, &rr, &d), 0);
	cr_assert_eq(kvs_send_open(tx, &d, 2, &sr), 0);
	cr_assert_eq(kvs_room_chunks(sr), 3);
	struct kvs_lease l[3];
	cr_assert_eq(kvs_acquire(tx, 3, l), 0);
	void *tp[3];
	for (int k = 0; k < 3; k++) {
		tp[k] = kvs_lease_ptr(tx, &l[k]);
		canary_fill(tp[k], 9, (uint64_t)k * SLOT, SLOT);
		cr_assert_eq(kvs_send(sr, &l[k], (uint64_t)k * SLOT, SLOT), 0);
	}
	cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
	struct kvs_event ev = wait_event(rx);
	cr_assert_eq(ev.type, KVS_EV_RECV_DONE);
	for (int k = 0; k < 3; k++) {
		struct kvs_lease got;
		cr_assert_eq(kvs_room_lease(rr, (unsigned)k, &got), 0);
		/* the very slot the sender filled, at the next epoch: no copy */
		cr_assert_eq(got.slot, l[k].slot);
		cr_assert_eq(got.epoch, l[k].epoch + 1);
		void *p = kvs_lease_ptr(rx, &got);
		cr_assert_not_null(p);
		cr_assert_eq(canary_check(p, 9, (uint64_t)k * SLOT, SLOT), SLOT);
		cr_assert_null(kvs_lease_ptr(tx, &l[k]),
			       "the sender still sees a slot it gave away");
		cr_assert_null(kvs_lease_ptr(tx, &got), "the receiver's slot is not the sender's");
	}
	cr_assert_eq(kvs_room_lease(rr, 3, &l[0]), -ERANGE);
	/* one slot released on its own, the rest by closing the room */
	struct kvs_lease one;
	kvs_room_lease(rr, 1, &one);
	cr_assert_eq(kvs_release(rx, &one), 0);
	cr_assert_null(kvs_lease_ptr(rx, &one));
	cr_assert_eq(kvs_room_close(rr), 0);
	cr_assert_eq(kvs_room_close(sr), 0);
	kvs_close(rx);
	kvs_close(tx);
	wait_idle(&px, 0);
}

Test(local, several_connections_in_one_process)
{
	kvs_client *c[4];
	for (int i = 0; i < 4; i++)
		c[i] = connect_ok(&px);
	kvs_room *rr[2], *sr[2];
	struct kvs_room_desc d[2];
	/* 0 receives from 3, 1 receives from 2 */
	cr_assert_eq(kvs_recv_open(c[0], 100, 10, &rr[0], &d[0]), 0);
	cr_assert_eq(kvs_recv_open(c[1], 200, 11, &rr[1], &d[1]), 0);
	cr_assert_eq(kvs_send_open(c[3], &d[0], 20, &sr[0]), 0);
	cr_assert_eq(kvs_send_open(c[2], &d[1], 21, &sr[1]), 0);
	cr_assert_eq(kvs_send_open(c[2], &d[0], 22, &sr[1]), -EBUSY, "a room has one sender");
	for (int i = 0; i < 2; i++) {
		kvs_client *s = c[3 - i];
		struct kvs_lease l;
		cr_assert_eq(kvs_acquire(s, 1, &l), 0);
		canary_fill(kvs_lease_ptr(s, &l), 100 + (uint64_t)i, 0, 100 * (uint64_t)(i + 1));
		cr_assert_eq(kvs_send(sr[i], &l, 0, 100 * (uint32_t)(i + 1)), 0);
	}
	for (int i = 0; i < 2; i++) {
		struct kvs_event ev = wait_event(c[i]);
		cr_assert_eq(ev.type, KVS_EV_RECV_DONE);
		cr_assert_eq(ev.user_data, 10 + (uint64_t)i);
		const void *p = kvs_lease_ptr(c[i], &ev.lease);
		cr_assert_not_null(p);
		cr_assert_eq(canary_check(p, 100 + (uint64_t)i, 0, 100 * (uint64_t)(i + 1)),
			     100 * (uint64_t)(i + 1));
	}
	for (int i = 0; i < 4; i++)
		kvs_close(c[i]);
	wait_idle(&px, 0);
}

/* kvs_wait sleeps in the kernel on the eventfd; it does not spin. */
static int waiter(int rd, int wr, void *arg)
{
	(void)arg;
	kvs_client *c;
	if (kvs_connect(px.sock, &c))
		return 1;
	struct kvs_room_desc d;
	kvs_room *r;
	if (kvs_recv_open(c, 10, 5, &r, &d))
		return 2;
	if (chan_put(wr, &d, sizeof(d)))
		return 3;
	struct kvs_event ev;
	int rc = kvs_wait(c, &ev, WAIT_MS);
	char ok = rc == 1 && ev.type == KVS_EV_RECV_DONE;
	chan_put(wr, &ok, 1);
	(void)rd;
	kvs_close(c);
	return 0;
}

static char proc_state(pid_t pid, char *wchan, size_t cap)
{
	char path[64], buf[512];
	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	FILE *f = fopen(path, "r");
	if (!f)
		return '?';
	size_t n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = 0;
	char *rp = strrchr(buf, ')');
	snprintf(path, sizeof(path), "/proc/%d/wchan", (int)pid);
	f = fopen(path, "r");
	wchan[0] = 0;
	if (f) {
		n = fread(wchan, 1, cap - 1, f);
		wchan[n] = 0;
		fclose(f);
	}
	return rp && rp[1] ? rp[2] : '?';
}

Test(local, kvs_wait_blocks_instead_of_spinning)
{
	struct child ch;
	child_start(&ch, waiter, NULL);
	struct kvs_room_desc d;
	cr_assert_eq(chan_get(ch.from, &d, sizeof(d)), 0);
	/* The child is now in, or about to enter, kvs_wait with nothing to
	 * receive. A spinning waiter would stay runnable; a blocked one goes
	 * to sleep in poll(). */
	char wchan[64], st = '?';
	for (int i = 0; i < 2000000; i++) {
		st = proc_state(ch.pid, wchan, sizeof(wchan));
		if (st == 'S' && strstr(wchan, "poll"))
			break;
		sched_yield();
	}
	cr_assert_eq(st, 'S', "kvs_wait never blocked (state %c)", st);
	cr_assert(strstr(wchan, "poll") != NULL, "kvs_wait sleeps in %s, not poll", wchan);
	kvs_client *tx = connect_ok(&px);
	kvs_room *sr;
	cr_assert_eq(kvs_send_open(tx, &d, 6, &sr), 0);
	struct kvs_lease l;
	cr_assert_eq(kvs_acquire(tx, 1, &l), 0);
	cr_assert_eq(kvs_send(sr, &l, 0, 10), 0);
	char ok = 0;
	cr_assert_eq(chan_get(ch.from, &ok, 1), 0);
	cr_assert(ok, "the waiter did not get RECV_DONE");
	cr_assert_eq(child_wait(&ch), 0);
	kvs_close(tx);
}
