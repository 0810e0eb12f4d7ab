/* SPDX-License-Identifier: MIT */
/*
 * Abort waves: 8 sender and 8 receiver processes move thousands of
 * canary-stamped rooms while aborts hit every point of a room's life,
 * from either side: before any send, between chunks, while a chunk is held
 * in flight inside the transport, after the last chunk, and during close.
 * Every surviving room must deliver exactly its own bytes; every aborted
 * room must end with exactly one ABORTED per side, only after its slots
 * quiesced; at the end the pool is entirely free.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "canary.h"
#include "harness.h"
#include "rawclient.h"

#define SLOT 4096
#define PAIRS 8
#define ROOMS 250
#define HOLD (1ull << 62) /* user_data tag: local.quiesce holds these rooms' chunks */

static struct proxy px = PROXY_INIT;

static void teardown(void)
{
	proxy_stop(&px);
}

TestSuite(storm, .fini = teardown, .timeout = 240);

enum plan {
	P_NONE,
	P_NONE2,
	P_NONE3,
	P_BEFORE_SEND, /* abort after open, before any chunk */
	P_BETWEEN,     /* abort after some chunks */
	P_HELD,	       /* abort while a chunk is held in flight */
	P_AFTER_LAST,  /* abort right after the last chunk: races completion */
	P_CLOSE,       /* close an unfinished room */
	P_NPLANS,
};

static const char *const plan_names[] = { "none",	 "none",	   "none",
					  "before-send", "between-chunks", "held-in-flight",
					  "after-last",	 "during-close" };

struct pair {
	int desc[2]; /* receiver -> sender */
	int ctl[2];  /* sender -> receiver: "abort now" / "close now" */
	int ack[2];  /* receiver -> sender */
	unsigned id;
};

/* Per-room verdicts each side reports. */
struct result {
	uint8_t rx_final[ROOMS], tx_final[ROOMS];
	uint8_t rx_finals[ROOMS], tx_finals[ROOMS]; /* how many final events each side saw */
	unsigned corrupt, quiesce_violations, epoch_regressions, held_seen, tombstones_seen;
	unsigned late_orders; /* after-last aborts whose room had ended first */
	unsigned errors;
	char what[128];
};

static uint64_t ud_of(unsigned pair, unsigned room, enum plan pl)
{
	return (pl == P_HELD ? HOLD : 0) | (uint64_t)pair << 32 | room;
}

static enum plan plan_of(unsigned pair, unsigned room)
{
	return (enum plan)((room * 7 + pair * 3) % P_NPLANS);
}

/* Which side aborts: alternate by room. */
static int rx_aborts(unsigned pair, unsigned room)
{
	return ((room / P_NPLANS) + pair) & 1;
}

static unsigned chunks_of(unsigned pair, unsigned room)
{
	return 1 + (room + pair) % 4;
}

static uint64_t bytes_of(unsigned pair, unsigned room)
{
	unsigned n = chunks_of(pair, room);
	return (uint64_t)(n - 1) * SLOT + 1 + (room * 131 + pair) % SLOT;
}

#define FAIL(r, ...)                                                 \
	do {                                                         \
		snprintf((r)->what, sizeof((r)->what), __VA_ARGS__); \
		(r)->errors++;                                       \
		goto out;                                            \
	} while (0)

/* The sender orders this room's receiver to abort ('a') or close ('c'). */
static bool rx_gets_order(unsigned pair, unsigned room)
{
	return rx_aborts(pair, room) && plan_of(pair, room) >= P_BEFORE_SEND;
}

/* Carries out one order from the sender on room r, then acks it. */
static int serve_order(kvs_client *c, struct pair *pp, kvs_room *r, bool *closed)
{
	char cmd;
	if (chan_get(pp->ctl[0], &cmd, 1))
		return -1;
	if (cmd == 'a')
		kvs_abort(r);
	else if (!*closed) {
		kvs_room_close(r);
		*closed = true;
	}
	sync_barrier(c);
	return chan_put(pp->ack[1], &cmd, 1);
}

static int receiver(int rd, int wr, void *arg)
{
	struct pair *pp = arg;
	static struct result res;
	kvs_client *c;
	(void)rd;
	/* Only our ends stay open: if the sender dies we see EOF, not a hang. */
	close(pp->desc[0]);
	close(pp->ctl[1]);
	close(pp->ack[0]);
	if (kvs_connect(px.sock, &c)) {
		res.errors++;
		goto report;
	}
	int efd = kvs_event_fd(c);
	bool sender_gone = false;
	for (unsigned i = 0; i < ROOMS; i++) {
		enum plan pl = plan_of(pp->id, i);
		uint64_t bytes = bytes_of(pp->id, i), ud = ud_of(pp->id, i, pl);
		kvs_room *r;
		struct kvs_room_desc d;
		int rc = kvs_recv_open(c, bytes, ud, &r, &d);
		if (rc)
			FAIL(&res, "recv_open room %u: %s", i, kvs_strerror(rc));
		if (chan_put(pp->desc[1], &d, sizeof(d)))
			FAIL(&res, "desc pipe");
		bool closed = false, ordered = false;
		while (!res.rx_finals[i]) {
			/* the sender hangs up once its side of the last room is over */
			struct pollfd p[2] = { { efd, POLLIN, 0 },
					       { sender_gone ? -1 : pp->ctl[0], POLLIN, 0 } };
			if (poll(p, 2, WAIT_MS) <= 0)
				FAIL(&res, "room %u (%s): no final", i, plan_names[pl]);
			if (p[1].revents && !(p[1].revents & POLLIN))
				sender_gone = true;
			if (p[1].revents & POLLIN) {
				if (ordered)
					FAIL(&res, "room %u: a second order", i);
				if (serve_order(c, pp, r, &closed))
					FAIL(&res, "ctl pipe");
				ordered = true;
			}
			struct kvs_event ev[4];
			int n = kvs_poll(c, ev, 4);
			if (n < 0)
				FAIL(&res, "poll: %s", kvs_strerror(n));
			for (int k = 0; k < n; k++) {
				if (ev[k].type == KVS_EV_REJECTED)
					FAIL(&res, "room %u rejected: %s", i,
					     kvs_strerror(ev[k].status));
				if (ev[k].user_data != ud)
					FAIL(&res, "room %u: event for another room", i);
				res.rx_finals[i]++;
				res.rx_final[i] = (uint8_t)ev[k].type;
			}
		}
		/* An abort ordered right after the last chunk races completion:
		 * the room may have ended before the order came. It is this
		 * room's order all the same; serve it here, or the next room
		 * would take it for its own. */
		if (rx_gets_order(pp->id, i) && !ordered) {
			struct pollfd p = { pp->ctl[0], POLLIN, 0 };
			if (poll(&p, 1, WAIT_MS) <= 0 || serve_order(c, pp, r, &closed))
				FAIL(&res, "room %u (%s): no order came", i, plan_names[pl]);
			res.late_orders++;
		}
		if (res.rx_final[i] == KVS_EV_RECV_DONE) {
			for (unsigned k = 0; k < kvs_room_chunks(r); k++) {
				struct kvs_lease l;
				uint64_t off = (uint64_t)k * SLOT,
					 len = bytes - off < SLOT ? bytes - off : SLOT;
				const void *p = kvs_room_lease(r, k, &l) ? NULL
									 : kvs_lease_ptr(c, &l);
				if (!p || canary_check(p, ud, off, len) != len)
					res.corrupt++;
			}
		}
		if (!closed)
			kvs_room_close(r);
	}
	/* nothing more may come: one final per room */
	struct kvs_event extra;
	if (kvs_poll(c, &extra, 1) > 0)
		FAIL(&res, "an event after the last final (type %u)", extra.type);
out:
	kvs_close(c);
report:
	chan_put(wr, &res, sizeof(res));
	return 0;
}

/* The proxy's view of one slot, from the read-only table. */
static struct kvs_slot view(kvs_client *c, uint32_t slot)
{
	struct kvs_slot s;
	memcpy(&s, &c->slots[slot], sizeof(s));
	return s;
}

static int order_rx(struct pair *pp, char cmd)
{
	char a;
	return chan_put(pp->ctl[1], &cmd, 1) || chan_get(pp->ack[0], &a, 1) ? -1 : 0;
}

static int sender(int rd, int wr, void *arg)
{
	struct pair *pp = arg;
	static struct result res;
	static uint32_t last_epoch[1024];
	static bool seen[1024]; /* epochs start at the proxy's random base */
	kvs_client *c;
	int admin = -1;
	(void)rd;
	/* Only our ends stay open: if the receiver dies we see EOF, not a hang. */
	close(pp->desc[1]);
	close(pp->ctl[0]);
	close(pp->ack[1]);
	if (kvs_connect(px.sock, &c) || (admin = kvs_admin_connect(px.sock)) < 0) {
		res.errors++;
		goto report;
	}
	for (unsigned i = 0; i < ROOMS; i++) {
		enum plan pl = plan_of(pp->id, i);
		int rxa = rx_aborts(pp->id, i);
		uint64_t ud = ud_of(pp->id, i, pl);
		unsigned n = chunks_of(pp->id, i);
		struct kvs_room_desc d;
		if (chan_get(pp->desc[0], &d, sizeof(d)))
			FAIL(&res, "desc pipe");
		uint32_t room_idx;
		memcpy(&room_idx, d.bytes + 16, 4);
		if (pl == P_BEFORE_SEND && rxa && order_rx(pp, 'a'))
			FAIL(&res, "ctl");
		kvs_room *r;
		int rc = kvs_send_open(c, &d, ud ^ 0x5, &r);
		if (pl == P_BEFORE_SEND && rxa) {
			/* the receiver aborted first: refused (cancelled, or stale
			 * once it closed the room), and no final of ours */
			if (rc != -ECANCELED && rc != -ESTALE)
				FAIL(&res, "send_open of an aborted room: %s", kvs_strerror(rc));
			res.tx_final[i] = KVS_EV_ABORTED;
			res.tx_finals[i] = 1;
			continue;
		}
		if (rc)
			FAIL(&res, "send_open room %u: %s", i, kvs_strerror(rc));
		struct kvs_lease l[4];
		rc = kvs_acquire(c, n, l);
		if (rc)
			FAIL(&res, "acquire: %s", kvs_strerror(rc));
		for (unsigned k = 0; k < n; k++) {
			if (l[k].slot >= 1024 ||
			    (seen[l[k].slot] &&
			     !KVS_EPOCH_AFTER(l[k].epoch, last_epoch[l[k].slot])))
				res.epoch_regressions++;
			if (l[k].slot < 1024) {
				last_epoch[l[k].slot] = l[k].epoch;
				seen[l[k].slot] = true;
			}
		}
		uint64_t bytes = kvs_room_bytes(r);
		unsigned stop = n; /* chunks to send */
		if (pl == P_BEFORE_SEND)
			stop = 0;
		else if (pl == P_BETWEEN || pl == P_CLOSE)
			stop = n / 2;
		else if (pl == P_HELD)
			stop = 1;
		for (unsigned k = 0; k < stop; k++) {
			uint64_t off = (uint64_t)k * SLOT,
				 len = bytes - off < SLOT ? bytes - off : SLOT;
			canary_fill(kvs_lease_ptr(c, &l[k]), ud, off, len);
			if ((rc = kvs_send(r, &l[k], off, (uint32_t)len)))
				FAIL(&res, "send: %s", kvs_strerror(rc));
		}
		if (pl == P_HELD) {
			sync_barrier(c); /* the proxy has taken chunk 0: the failpoint holds it */
			if (view(c, l[0].slot).state != KVS_SLOT_INFLIGHT)
				FAIL(&res, "room %u: chunk 0 not held in flight", i);
			res.held_seen++;
		}
		if (pl >= P_BEFORE_SEND) { /* abort, or close unfinished, from one side */
			char cmd = pl == P_CLOSE ? 'c' : 'a';
			if (rxa) {
				if (order_rx(pp, cmd))
					FAIL(&res, "ctl");
			} else {
				if (cmd == 'a')
					kvs_abort(r);
				else
					kvs_room_close(r);
				sync_barrier(c);
			}
		}
		if (pl == P_HELD) {
			struct kvs_slot s = view(c, l[0].slot);
			if (s.state != KVS_SLOT_TOMBSTONE || s.room != room_idx + 1)
				FAIL(&res, "room %u: aborted in flight but slot state %u", i,
				     s.state);
			res.tombstones_seen++;
			uint64_t k;
			if (kvs_admin_fp_release(admin, "local.quiesce", ud, 0, &k) || k != 1)
				FAIL(&res, "release of room %u's held chunk", i);
		}
		/* leases we did not send are still ours */
		for (unsigned k = stop; k < n; k++)
			kvs_release(c, &l[k]);
		while (!res.tx_finals[i]) {
			struct kvs_event ev;
			rc = kvs_wait(c, &ev, WAIT_MS);
			if (rc != 1)
				FAIL(&res, "room %u (%s): no final: %s", i, plan_names[pl],
				     kvs_strerror(rc));
			if (ev.type == KVS_EV_REJECTED)
				FAIL(&res, "room %u: rejected: %s", i, kvs_strerror(ev.status));
			res.tx_finals[i]++;
			res.tx_final[i] = (uint8_t)ev.type;
			/* ABORTED only after quiescence: nothing of this room is a tombstone now */
			for (unsigned k = 0; k < stop; k++) {
				struct kvs_slot s = view(c, l[k].slot);
				if (s.state == KVS_SLOT_TOMBSTONE && s.room == room_idx + 1)
					res.quiesce_violations++;
			}
		}
		if (pl != P_CLOSE || rxa)
			kvs_room_close(r);
	}
out:
	kvs_close(c);
report:
	if (admin >= 0)
		close(admin);
	chan_put(wr, &res, sizeof(res));
	return 0;
}

Test(storm, abort_waves_lose_and_cross_nothing)
{
	proxy_start(&px, NULL,
		    (const char *[]){ "--slots", "256", "--slot-size", "4K", "--room-timeout", "0",
				      NULL });
	int rc = kvs_admin_fp_set_mask(px.admin, "local.quiesce", "pause", HOLD, HOLD);
	cr_assert_eq(rc, 0);
	struct pair pairs[PAIRS];
	struct child rx[PAIRS], tx[PAIRS];
	for (unsigned p = 0; p < PAIRS; p++) {
		pairs[p].id = p + 1;
		cr_assert_eq(pipe(pairs[p].desc), 0);
		cr_assert_eq(pipe(pairs[p].ctl), 0);
		cr_assert_eq(pipe(pairs[p].ack), 0);
		child_start(&rx[p], receiver, &pairs[p]);
		child_start(&tx[p], sender, &pairs[p]);
		for (int k = 0; k < 2; k++) {
			close(pairs[p].desc[k]);
			close(pairs[p].ctl[k]);
			close(pairs[p].ack[k]);
		}
	}
	unsigned rooms = 0, done = 0, aborted = 0, corrupt = 0, violations = 0, regressions = 0;
	unsigned held = 0, tombs = 0, late = 0, by_plan[P_NPLANS] = { 0 };
	for (unsigned p = 0; p < PAIRS; p++) {
		static struct result rr, tr;
		cr_assert_eq(chan_get(rx[p].from, &rr, sizeof(rr)), 0, "receiver %u died", p);
		cr_assert_eq(chan_get(tx[p].from, &tr, sizeof(tr)), 0, "sender %u died", p);
		cr_assert_eq(child_wait(&rx[p]), 0);
		cr_assert_eq(child_wait(&tx[p]), 0);
		cr_assert(!rr.errors && !tr.errors, "pair %u: receiver: %s / sender: %s", p,
			  rr.what, tr.what);
		for (unsigned i = 0; i < ROOMS; i++) {
			enum plan pl = plan_of(p + 1, i);
			cr_assert_eq(rr.rx_finals[i], 1, "pair %u room %u: %u receiver finals", p,
				     i, rr.rx_finals[i]);
			cr_assert_eq(tr.tx_finals[i], 1, "pair %u room %u: %u sender finals", p, i,
				     tr.tx_finals[i]);
			bool ok = rr.rx_final[i] == KVS_EV_RECV_DONE;
			cr_assert_eq(ok, tr.tx_final[i] == KVS_EV_SEND_DONE,
				     "pair %u room %u (%s): receiver %u vs sender %u", p, i,
				     plan_names[pl], rr.rx_final[i], tr.tx_final[i]);
			if (!ok)
				cr_assert_eq(rr.rx_final[i], KVS_EV_ABORTED);
			if (pl < P_BEFORE_SEND)
				cr_assert(ok, "pair %u room %u: no abort planned, yet %u", p, i,
					  rr.rx_final[i]);
			else if (pl != P_AFTER_LAST)
				cr_assert(!ok, "pair %u room %u (%s): abort did not take", p, i,
					  plan_names[pl]);
			if (pl >= P_BEFORE_SEND && !ok)
				by_plan[pl]++;
			done += ok;
			aborted += !ok;
			rooms++;
		}
		corrupt += rr.corrupt;
		late += rr.late_orders;
		violations += tr.quiesce_violations;
		regressions += tr.epoch_regressions;
		held += tr.held_seen;
		tombs += tr.tombstones_seen;
	}
	fp_set(&px, "local.quiesce", "off", NULL);
	wait_idle(&px, 0);
	fprintf(stderr,
		"storm: %u rooms, %u done, %u aborted (before-send %u, between-chunks %u, "
		"held-in-flight %u, after-last %u, during-close %u; %u after-last rooms ended "
		"before the abort came), %u chunks held then tombstoned, corruptions %u, "
		"quiescence violations %u, epoch regressions %u, "
		"leaked slots %llu\n",
		rooms, done, aborted, by_plan[P_BEFORE_SEND], by_plan[P_BETWEEN], by_plan[P_HELD],
		by_plan[P_AFTER_LAST], by_plan[P_CLOSE], late, tombs, corrupt, violations,
		regressions,
		(unsigned long long)(px.ctrl->slot_count - stat_get(&px, "slots.free")));
	cr_assert_eq(rooms, PAIRS * ROOMS);
	cr_assert_eq(corrupt, 0);
	cr_assert_eq(violations, 0);
	cr_assert_eq(regressions, 0);
	cr_assert_eq(held, tombs);
	cr_assert_gt(tombs, PAIRS * ROOMS / P_NPLANS / 2, "too few held-in-flight aborts: %u",
		     tombs);
	for (int pl = P_BEFORE_SEND; pl < P_NPLANS; pl++)
		if (pl != P_AFTER_LAST)
			cr_assert_gt(by_plan[pl], 0, "no abort at %s", plan_names[pl]);
	cr_assert_eq(stat_get(&px, "tombstones_reaped"), tombs);
	cr_assert_eq(stat_get(&px, "slots.free"), px.ctrl->slot_count);
}

/* ------------------------------------------------------------ timeouts */

Test(storm, room_timeout_fires_while_held_and_waits_for_quiescence)
{
	proxy_start(&px, NULL,
		    (const char *[]){ "--slots", "16", "--slot-size", "4K", "--room-timeout",
				      "2000", NULL });
	kvs_client *rx = connect_ok(&px), *tx = connect_ok(&px);
	kvs_room *rr, *sr, *idle;
	struct kvs_room_desc d, d2;
	/* Everything but the opens and the send first: from the first open
	 * to the send, the test must stay under the timeout (2 s: a loaded
	 * machine under ASan can stall a process for 100 ms). */
	struct kvs_lease l;
	cr_assert_eq(kvs_acquire(tx, 1, &l), 0);
	fp_set(&px, "local.quiesce", "pause", NULL);
	cr_assert_eq(kvs_recv_open(rx, 2 * SLOT, 1, &rr, &d), 0);
	cr_assert_eq(kvs_recv_open(rx, SLOT, 2, &idle, &d2), 0); /* its sender never comes */
	cr_assert_eq(kvs_send_open(tx, &d, 3, &sr), 0);
	cr_assert_eq(kvs_send(sr, &l, 0, SLOT), 0);
	fp_wait(&px, "local.quiesce", 1);
	/* no more progress: the proxy's timer aborts both rooms */
	stat_wait(&px, "rooms_timed_out", 1, 2);
	cr_assert_eq(slot_pub(&px, l.slot).state, KVS_SLOT_TOMBSTONE, "held: a tombstone");
	struct kvs_event ev = wait_event(rx);
	cr_assert_eq(ev.type, KVS_EV_ABORTED, "the idle room ends at once");
	cr_assert_eq(ev.user_data, 2);
	cr_assert_eq(ev.status, -ETIMEDOUT);
	cr_assert_eq(kvs_poll(rx, &ev, 1), 0, "the held room's final waits for quiescence");
	fp_set(&px, "local.quiesce", "off", NULL);
	ev = wait_event(rx);
	cr_assert_eq(ev.type, KVS_EV_ABORTED);
	cr_assert_eq(ev.user_data, 1);
	cr_assert_eq(ev.status, -ETIMEDOUT);
	cr_assert_eq(slot_pub(&px, l.slot).state, KVS_SLOT_FREE, "back only after release");
	cr_assert_eq(slot_pub(&px, l.slot).epoch, l.epoch + 2);
	ev = wait_event(tx);
	cr_assert_eq(ev.type, KVS_EV_ABORTED);
	cr_assert_eq(ev.status, -ETIMEDOUT);
	kvs_close(rx);
	kvs_close(tx);
	wait_idle(&px, 0);
}

/* ----------------------------------------------------------- kill storm */

/* A bystander pair moving verified rooms until told to stop. */
static int bystander(int rd, int wr, void *arg)
{
	(void)arg;
	kvs_client *rx, *tx;
	unsigned rooms = 0, bad = 0;
	if (kvs_connect(px.sock, &rx) || kvs_connect(px.sock, &tx))
		return 1;
	struct pollfd stop = { rd, POLLIN, 0 };
	while (poll(&stop, 1, 0) == 0) {
		kvs_room *rr, *sr;
		struct kvs_room_desc d;
		uint64_t owner = 0xB000 + rooms, bytes = 3 * SLOT - 7;
		if (kvs_recv_open(rx, bytes, owner, &rr, &d) || kvs_send_open(tx, &d, owner, &sr))
			return 2;
		struct kvs_lease l[3];
		int rc;
		while ((rc = kvs_acquire(tx, 3, l)) == -ENOBUFS)
			sync_barrier(tx); /* victims hold slots for a moment */
		if (rc)
			return 3;
		for (unsigned k = 0; k < 3; k++) {
			uint64_t off = (uint64_t)k * SLOT,
				 len = bytes - off < SLOT ? bytes - off : SLOT;
			canary_fill(kvs_lease_ptr(tx, &l[k]), owner, off, len);
			if (kvs_send(sr, &l[k], off, (uint32_t)len))
				return 4;
		}
		struct kvs_event ev;
		if (kvs_wait(rx, &ev, WAIT_MS) != 1 || ev.type != KVS_EV_RECV_DONE)
			return 5;
		if (kvs_wait(tx, &ev, WAIT_MS) != 1 || ev.type != KVS_EV_SEND_DONE)
			return 6;
		for (unsigned k = 0; k < 3; k++) {
			struct kvs_lease g;
			uint64_t off = (uint64_t)k * SLOT,
				 len = bytes - off < SLOT ? bytes - off : SLOT;
			const void *p = kvs_room_lease(rr, k, &g) ? NULL : kvs_lease_ptr(rx, &g);
			if (!p || canary_check(p, owner, off, len) != len)
				bad++;
		}
		kvs_room_close(rr);
		kvs_room_close(sr);
		rooms++;
	}
	unsigned out[2] = { rooms, bad };
	chan_put(wr, out, sizeof(out));
	kvs_close(rx);
	kvs_close(tx);
	return 0;
}

/* A victim: loops through acquiring, sending (some chunks held in flight),
 * holding received slots and blocking in kvs_wait, reporting each step,
 * until SIGKILL lands somewhere in it. */
static int victim(int rd, int wr, void *arg)
{
	unsigned seed = (unsigned)(uintptr_t)arg;
	kvs_client *rx, *tx;
	(void)rd;
	if (kvs_connect(px.sock, &rx) || kvs_connect(px.sock, &tx))
		return 1;
	for (unsigned step = 0;; step++) {
		char b = (char)step;
		chan_put(wr, &b, 1);
		kvs_room *rr, *sr;
		struct kvs_room_desc d;
		unsigned n = 1 + (unsigned)rand_r(&seed) % 3;
		uint64_t ud = (rand_r(&seed) % 3 == 0 ? HOLD : 0) | step;
		if (kvs_recv_open(rx, (uint64_t)n * SLOT, ud, &rr, &d) ||
		    kvs_send_open(tx, &d, ud, &sr))
			continue;
		struct kvs_lease l[4];
		if (kvs_acquire(tx, n + 1, l)) /* one extra, just held */
			continue;
		chan_put(wr, &b, 1);
		for (unsigned k = 0; k < n; k++)
			kvs_send(sr, &l[k], (uint64_t)k * SLOT, SLOT);
		chan_put(wr, &b, 1);
		struct kvs_event ev;
		kvs_wait(rx, &ev, 200); /* held rooms never finish: blocked here */
		chan_put(wr, &b, 1);
		/* received slots stay held, rooms open, leases kept: all for the proxy to reclaim */
	}
}

Test(storm, kill_storm_spares_everyone_else)
{
	enum { KILLS = 100 };
	proxy_start(&px, NULL,
		    (const char *[]){ "--slots", "256", "--slot-size", "4K", "--room-timeout", "0",
				      NULL });
	cr_assert_eq(kvs_admin_fp_set_mask(px.admin, "local.quiesce", "pause", HOLD, HOLD), 0);
	struct child by;
	child_start(&by, bystander, NULL);
	unsigned seed = 7;
	for (unsigned k = 0; k < KILLS; k++) {
		struct child v;
		child_start(&v, victim, (void *)(uintptr_t)(k + 1));
		/* let it run a random number of steps, then kill it wherever it is */
		unsigned steps = 1 + (unsigned)rand_r(&seed) % 12;
		char b;
		for (unsigned s = 0; s < steps; s++)
			cr_assert_eq(chan_get(v.from, &b, 1), 0, "victim %u died on its own", k);
		kill(v.pid, SIGKILL);
		cr_assert_eq(child_wait(&v), 128 + SIGKILL);
		/* barrier: both its connections reclaimed (the bystander has 2) */
		stat_wait(&px, "clients_died", 1, 2ull * (k + 1));
		if (k % 10 == 9) {
			/* held chunks quiesce; their tombstones are reaped */
			uint64_t n;
			cr_assert_eq(
				kvs_admin_fp_release(px.admin, "local.quiesce", HOLD, HOLD, &n), 0);
		}
	}
	unsigned char stop = 1;
	cr_assert_eq(chan_put(by.to, &stop, 1), 0);
	unsigned out[2];
	cr_assert_eq(chan_get(by.from, out, sizeof(out)), 0, "the bystander failed");
	cr_assert_eq(child_wait(&by), 0, "the bystander was not served");
	fp_set(&px, "local.quiesce", "off", NULL);
	wait_idle(&px, 0);
	fprintf(stderr,
		"kill storm: %u clients SIGKILLed at random points, %llu tombstones reaped; "
		"bystander moved %u rooms meanwhile, %u with a wrong byte; pool free %llu/%u\n",
		KILLS, (unsigned long long)stat_get(&px, "tombstones_reaped"), out[0], out[1],
		(unsigned long long)stat_get(&px, "slots.free"), px.ctrl->slot_count);
	cr_assert_eq(out[1], 0);
	cr_assert_gt(out[0], 0);
	cr_assert_gt(stat_get(&px, "tombstones_reaped"), 0, "no kill hit a chunk in flight");
}

/* ------------------------------------------------- floods and scribbles */

static uint64_t proxy_rss_kb(void)
{
	char path[64], line[256];
	snprintf(path, sizeof(path), "/proc/%d/status", (int)px.pid);
	FILE *f = fopen(path, "r");
	uint64_t kb = 0;
	while (f && fgets(line, sizeof(line), f))
		if (sscanf(line, "VmRSS: %lu", &kb) == 1)
			break;
	if (f)
		fclose(f);
	return kb;
}

static void one_clean_room(kvs_client *rx, kvs_client *tx, uint64_t owner)
{
	kvs_room *rr, *sr;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(rx, SLOT, owner, &rr, &d), 0);
	cr_assert_eq(kvs_send_open(tx, &d, owner, &sr), 0);
	struct kvs_lease l;
	cr_assert_eq(kvs_acquire(tx, 1, &l), 0);
	canary_fill(kvs_lease_ptr(tx, &l), owner, 0, SLOT);
	cr_assert_eq(kvs_send(sr, &l, 0, SLOT), 0);
	struct kvs_event ev = wait_event(rx);
	cr_assert_eq(ev.type, KVS_EV_RECV_DONE);
	cr_assert_eq(canary_check(kvs_lease_ptr(rx, &ev.lease), owner, 0, SLOT), SLOT);
	cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
	kvs_room_close(rr);
	kvs_room_close(sr);
}

Test(storm, flooded_ring_backpressures_and_recovers)
{
	proxy_start(&px, NULL, (const char *[]){ "--slots", "16", "--slot-size", "4K", NULL });
	kvs_client *flood = connect_ok(&px), *rx = connect_ok(&px), *tx = connect_ok(&px);
	kvs_room *own;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(flood, SLOT, 9, &own, &d), 0);
	uint64_t rss0 = proxy_rss_kb();
	/* records that each earn a REJECTED event, never polled: the completion
	 * ring fills, the proxy stops taking from this client, its ring fills */
	struct kvs_sqe bad = { .op = KVS_OP_ABORT, .handle = 3 };
	unsigned pushed = 0;
	unsigned cq_cap = flood->cq.r->capacity;
	for (unsigned i = 0; i < 100000; i++) {
		if (raw_submit(flood, &bad) == 0)
			pushed++;
		/* stable once the proxy may take nothing more (its completion
		 * ring full but the entry kept for the room's final) and our
		 * ring is full: checked in that order, it cannot change under us */
		else if (kvs_ring_count(&flood->cq) == cq_cap - 1 && kvs_ring_free(&flood->sq) == 0)
			break;
	}
	cr_assert_lt(pushed, 100000, "the ring never filled: no back-pressure");
	one_clean_room(rx, tx, 1); /* everyone else is served meanwhile */
	/* a sync call takes the events aside and gets through by itself */
	struct kvs_lease l;
	cr_assert_eq(kvs_acquire(flood, 1, &l), 0);
	/* the flooder reads its events */
	unsigned events = 0;
	while (events < pushed) {
		struct kvs_event ev[64];
		int n = kvs_poll(flood, ev, 64);
		cr_assert_gt(n, 0, "events lost: %u of %u", events, pushed);
		for (int k = 0; k < n; k++)
			cr_assert_eq(ev[k].type, KVS_EV_REJECTED);
		events += (unsigned)n;
	}
	/* a ring the proxy does not drain at all: -EAGAIN, then recovery */
	proxy_freeze(&px);
	struct kvs_sqe nop = { .op = KVS_OP_NOP };
	while (raw_submit(flood, &nop) == 0)
		;
	cr_assert_eq(kvs_abort(own), -EAGAIN, "a full ring gives -EAGAIN");
	kill(px.pid, SIGCONT);
	int rc;
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	do { /* a failure guard, not a wait: the proxy drains the ring now */
		rc = kvs_abort(own);
		clock_gettime(CLOCK_MONOTONIC, &t1);
	} while (rc == -EAGAIN && (t1.tv_sec - t0.tv_sec) * 1000 < WAIT_MS);
	cr_assert_eq(rc, 0, "recovered: %s", kvs_strerror(rc));
	cr_assert_eq(wait_event(flood).type, KVS_EV_ABORTED);
	uint64_t rss1 = proxy_rss_kb();
	fprintf(stderr, "flood: %u hostile records, %u rejections, proxy RSS %lu -> %lu KiB\n",
		pushed, events, rss0, rss1);
	cr_assert_lt(rss1, rss0 + 4096, "the proxy grew with client input");
	kvs_close(flood);
	kvs_close(rx);
	kvs_close(tx);
	wait_idle(&px, 0);
}

Test(storm, scribbled_ring_hurts_only_its_owner)
{
	proxy_start(&px, NULL, (const char *[]){ "--slots", "16", "--slot-size", "4K", NULL });
	kvs_client *evil = connect_ok(&px), *rx = connect_ok(&px), *tx = connect_ok(&px);
	struct kvs_lease held;
	cr_assert_eq(kvs_acquire(evil, 1, &held), 0);
	unsigned seed = 1;
	for (int round = 0; round < 50; round++) {
		/* garbage indices and garbage records, as only the owner can write */
		struct rte_ring_headtail *ht[] = { &evil->sq.r->prod, &evil->sq.r->cons,
						   &evil->cq.r->prod, &evil->cq.r->cons };
		for (int k = 0; k < 4; k++) {
			ht[k]->head = (uint32_t)rand_r(&seed);
			ht[k]->tail = (uint32_t)rand_r(&seed);
		}
		uint32_t *body = (uint32_t *)&evil->sq.r[1];
		for (int k = 0; k < 512; k++)
			body[k] = (uint32_t)rand_r(&seed);
		raw_kick(evil);
		one_clean_room(rx, tx, 100 + (uint64_t)round);
	}
	kvs_close(evil);
	wait_idle(&px, 2);
	kvs_close(rx);
	kvs_close(tx);
	wait_idle(&px, 0);
}

Test(storm, ring_claiming_more_than_it_holds_is_cut_off)
{
	proxy_start(&px, NULL, NULL); /* the defaults a user runs with */
	kvs_client *evil = connect_ok(&px), *rx = connect_ok(&px), *tx = connect_ok(&px);
	struct kvs_lease held;
	cr_assert_eq(kvs_acquire(evil, 1, &held), 0);
	uint64_t died = stat_get(&px, "clients_died");
	/* One write, then sleep: 2^32 - 1 records claimed, all zeroes (NOPs).
	 * Taken at its word, the proxy read them for ever (57-72 % of a CPU). */
	struct rte_ring *r = evil->sq.r;
	__atomic_store_n(&r->prod.tail, r->cons.head - 1, __ATOMIC_RELEASE);
	raw_kick(evil);
	stat_wait(&px, "clients_died", 1, died + 1);
	stat_wait(&px, "clients", 0, 2);
	stat_wait(&px, "slots.leased", 0, 0); /* its lease came back */
	/* and the proxy sleeps again: a spinning one never would. Read from the
	 * published counter, not by an admin barrier: the proxy counts a sleep
	 * as it goes to sleep, after it answered this tick's barriers. */
	uint64_t sleeps = stat_get(&px, "sleeps");
	struct kvs_lease l;
	cr_assert_eq(kvs_acquire(rx, 1, &l), 0); /* wakes it, if it slept already */
	cr_assert_eq(kvs_release(rx, &l), 0);
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	do { /* a failure guard, not a wait: an idle proxy sleeps within its 50 us spin */
		clock_gettime(CLOCK_MONOTONIC, &t1);
	} while (stat_get(&px, "sleeps") == sleeps && (t1.tv_sec - t0.tv_sec) * 1000 < WAIT_MS);
	cr_assert_gt(stat_get(&px, "sleeps"), sleeps, "the proxy never slept again");
	cr_assert_lt(kvs_acquire(evil, 1, &held), 0, "a cut-off client is told so");
	one_clean_room(rx, tx, 1);
	kvs_close(evil);
	kvs_close(rx);
	kvs_close(tx);
	wait_idle(&px, 0);
}

/* ---------------------------------------------------------------- limits */

Test(storm, limits_give_clear_errors)
{
	proxy_start(&px, NULL,
		    (const char *[]){ "--slots", "16", "--slot-size", "4K", "--max-clients", "3",
				      "--max-rooms", "2", "--uid-share", "100", NULL });
	kvs_client *c[3];
	for (int i = 0; i < 3; i++)
		c[i] = connect_ok(&px);
	kvs_client *extra;
	cr_assert_eq(kvs_connect(px.sock, &extra), -EUSERS, "a client past --max-clients");
	kvs_room *r[3];
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(c[0], 10, 1, &r[0], &d), 0);
	cr_assert_eq(kvs_recv_open(c[1], 10, 2, &r[1], &d), 0);
	cr_assert_eq(kvs_recv_open(c[2], 10, 3, &r[2], &d), -ENFILE, "a room past --max-rooms");
	kvs_close(c[2]);
	stat_wait(&px, "clients", 0, 2);
	cr_assert_eq(kvs_connect(px.sock, &c[2]), 0, "capacity returns");
	kvs_room_close(r[0]);
	sync_barrier(c[0]);
	cr_assert_eq(kvs_recv_open(c[2], 10, 3, &r[2], &d), 0, "so do rooms");
	for (int i = 0; i < 3; i++)
		kvs_close(c[i]);
	wait_idle(&px, 0);
}
