/* SPDX-License-Identifier: MIT */
/*
 * Deaths and shutdowns: a client killed mid-room, a proxy killed under its
 * clients, a restart on the same socket, and SIGTERM's drain.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "canary.h"
#include "harness.h"

#define SLOT (64 * 1024)

static struct proxy px = PROXY_INIT;

static void teardown(void)
{
	proxy_stop(&px);
}

TestSuite(crash, .fini = teardown, .timeout = 60);

static void start(const char *const *extra)
{
	const char *args[16] = { "--slots", "32", "--slot-size", "64K" };
	int n = 4;
	for (; extra && *extra; extra++)
		args[n++] = *extra;
	args[n] = NULL;
	proxy_start(&px, NULL, args);
}

/* A sender that sends chunk 0 (held by the failpoint), keeps two more
 * slots leased, says so, and waits to be killed. */
static int doomed_sender(int rd, int wr, void *arg)
{
	(void)arg;
	kvs_client *c;
	struct kvs_room_desc d;
	if (kvs_connect(px.sock, &c) || chan_get(rd, &d, sizeof(d)))
		return 1;
	kvs_room *r;
	struct kvs_lease l[3];
	if (kvs_send_open(c, &d, 0xC0, &r) || kvs_acquire(c, 3, l))
		return 2;
	if (kvs_send(r, &l[0], 0, SLOT))
		return 3;
	if (chan_put(wr, l, sizeof(l)))
		return 4;
	char x;
	chan_get(rd, &x, 1); /* until killed */
	return 0;
}

static void one_room(kvs_client *rx, kvs_client *tx, uint64_t owner)
{
	kvs_room *rr, *sr;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(rx, 2 * SLOT, owner, &rr, &d), 0);
	cr_assert_eq(kvs_send_open(tx, &d, owner + 1, &sr), 0);
	struct kvs_lease l[2];
	cr_assert_eq(kvs_acquire(tx, 2, l), 0);
	for (int k = 0; k < 2; k++) {
		canary_fill(kvs_lease_ptr(tx, &l[k]), owner, (uint64_t)k * SLOT, SLOT);
		cr_assert_eq(kvs_send(sr, &l[k], (uint64_t)k * SLOT, SLOT), 0);
	}
	cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
	struct kvs_event ev = wait_event(rx);
	cr_assert_eq(ev.type, KVS_EV_RECV_DONE);
	for (unsigned k = 0; k < 2; k++) {
		struct kvs_lease got;
		cr_assert_eq(kvs_room_lease(rr, k, &got), 0);
		cr_assert_eq(canary_check(kvs_lease_ptr(rx, &got), owner, k * SLOT, SLOT), SLOT);
	}
	kvs_room_close(rr);
	kvs_room_close(sr);
}

Test(crash, client_killed_mid_room)
{
	start(NULL);
	kvs_client *rx = connect_ok(&px), *rx2 = connect_ok(&px), *tx2 = connect_ok(&px);
	kvs_room *rr;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(rx, 3 * SLOT, 0xC1, &rr, &d), 0);
	uint64_t match = 0xC0;
	fp_set(&px, "local.quiesce", "pause", &match);

	struct child ch;
	child_start(&ch, doomed_sender, NULL);
	cr_assert_eq(chan_put(ch.to, &d, sizeof(d)), 0);
	struct kvs_lease l[3];
	cr_assert_eq(chan_get(ch.from, l, sizeof(l)), 0);
	fp_wait(&px, "local.quiesce", 1);
	cr_assert_eq(slot_pub(&px, l[0].slot).state, KVS_SLOT_INFLIGHT);

	kill(ch.pid, SIGKILL);
	cr_assert_eq(child_wait(&ch), 128 + SIGKILL);
	stat_wait(&px, "clients_died", 1, 1); /* barrier: the proxy saw the hang-up */

	cr_assert_eq(slot_pub(&px, l[0].slot).state, KVS_SLOT_TOMBSTONE, "in flight: tombstone");
	cr_assert_eq(slot_pub(&px, l[1].slot).state, KVS_SLOT_FREE, "merely leased: freed");
	cr_assert_eq(slot_pub(&px, l[2].slot).state, KVS_SLOT_FREE);
	struct kvs_event ev;
	cr_assert_eq(kvs_poll(rx, &ev, 1), 0, "no final before quiescence");

	/* everyone else is served meanwhile */
	one_room(rx2, tx2, 77);

	fp_set(&px, "local.quiesce", "off", NULL);
	ev = wait_event(rx);
	cr_assert_eq(ev.type, KVS_EV_ABORTED);
	cr_assert_eq(ev.status, -ECONNRESET);
	cr_assert_eq(slot_pub(&px, l[0].slot).state, KVS_SLOT_FREE, "reaped after quiescence");
	kvs_room_close(rr);
	wait_idle(&px, 3);
	kvs_close(rx);
	kvs_close(rx2);
	kvs_close(tx2);
	wait_idle(&px, 0);
}

/* Blocks in kvs_wait; reports what it returned. */
static int blocked_waiter(int rd, int wr, void *arg)
{
	(void)rd;
	(void)arg;
	kvs_client *c;
	if (kvs_connect(px.sock, &c))
		return 1;
	kvs_room *r;
	struct kvs_room_desc d;
	if (kvs_recv_open(c, 10, 1, &r, &d))
		return 2;
	char ok = 1;
	chan_put(wr, &ok, 1);
	struct kvs_event ev;
	int rc = kvs_wait(c, &ev, WAIT_MS);
	chan_put(wr, &rc, sizeof(rc));
	return 0;
}

Test(crash, proxy_killed_gives_enotconn_and_restart_is_clean)
{
	start(NULL);
	kvs_client *c = connect_ok(&px), *tx = connect_ok(&px);
	kvs_room *rr, *sr;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(c, 2 * SLOT, 1, &rr, &d), 0);
	cr_assert_eq(kvs_send_open(tx, &d, 2, &sr), 0);
	struct kvs_lease l;
	cr_assert_eq(kvs_acquire(tx, 1, &l), 0);
	struct child ch;
	child_start(&ch, blocked_waiter, NULL);
	char ok;
	cr_assert_eq(chan_get(ch.from, &ok, 1), 0);

	cr_assert(WIFSIGNALED(proxy_kill(&px, SIGKILL)));

	int rc;
	cr_assert_eq(chan_get(ch.from, &rc, sizeof(rc)), 0);
	cr_assert_eq(rc, -ENOTCONN, "a client blocked in kvs_wait: %s", kvs_strerror(rc));
	cr_assert_eq(child_wait(&ch), 0);
	struct kvs_event ev;
	cr_assert_eq(kvs_wait(c, &ev, WAIT_MS), -ENOTCONN,
		     "kvs_wait must not wait for a dead proxy");
	cr_assert_eq(kvs_acquire(tx, 1, &l), -ENOTCONN);
	cr_assert_eq(kvs_poll(c, &ev, 1), -ENOTCONN);
	cr_assert_eq(kvs_send(sr, &l, 0, SLOT), -ENOTCONN);
	cr_assert_eq(kvs_release(tx, &l), -ENOTCONN);
	cr_assert_eq(kvs_abort(rr), -ENOTCONN);
	kvs_room *r2;
	cr_assert_eq(kvs_recv_open(c, 10, 3, &r2, &d), -ENOTCONN);

	/* a new proxy on the same path: stale socket and lock handled */
	proxy_restart(&px, (const char *[]){ "--slots", "32", "--slot-size", "64K", NULL });
	kvs_client *fresh = connect_ok(&px);
	cr_assert_eq(kvs_acquire(tx, 1, &l), -ENOTCONN, "an old handle stays refused");
	kvs_room *sr2;
	cr_assert_eq(kvs_send_open(fresh, &d, 4, &sr2), -ESTALE,
		     "an old descriptor is not confused with the new generation");
	struct kvs_lease fl;
	cr_assert_eq(kvs_acquire(fresh, 1, &fl), 0);
	kvs_close(c);
	kvs_close(tx);
	kvs_close(fresh);
	wait_idle(&px, 0);
}

Test(crash, second_proxy_on_a_live_socket_is_refused)
{
	start(NULL);
	char out[4096], err[4096];
	const char *argv[] = { build_path("proxy/kvstaged"),
			       "--socket",
			       px.sock,
			       "--slots",
			       "4",
			       "--slot-size",
			       "4K",
			       NULL };
	int rc = run_cmd(argv, out, sizeof(out), err, sizeof(err));
	cr_assert_eq(rc, 1, "second proxy exit %d: %s", rc, err);
	cr_assert(strstr(err, "another kvstaged") != NULL, "said: %s", err);
	kvs_client *c = connect_ok(&px); /* the first still serves */
	kvs_close(c);
}

Test(crash, sigterm_lets_active_rooms_finish)
{
	start(NULL);
	kvs_client *rx = connect_ok(&px), *tx = connect_ok(&px);
	kvs_room *rr, *sr;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(rx, 2 * SLOT, 1, &rr, &d), 0);
	cr_assert_eq(kvs_send_open(tx, &d, 2, &sr), 0);
	struct kvs_lease l[2];
	cr_assert_eq(kvs_acquire(tx, 2, l), 0);
	canary_fill(kvs_lease_ptr(tx, &l[0]), 5, 0, SLOT);
	cr_assert_eq(kvs_send(sr, &l[0], 0, SLOT), 0);
	kill(px.pid, SIGTERM);
	stat_wait(&px, "draining", 1, 1);
	kvs_client *late;
	cr_assert_neq(kvs_connect(px.sock, &late), 0, "no new clients while draining");
	kvs_room *r2;
	struct kvs_room_desc d2;
	cr_assert_eq(kvs_recv_open(rx, 10, 3, &r2, &d2), -ESHUTDOWN, "no new rooms while draining");
	canary_fill(kvs_lease_ptr(tx, &l[1]), 5, SLOT, SLOT);
	cr_assert_eq(kvs_send(sr, &l[1], SLOT, SLOT), 0);
	struct kvs_event ev = wait_event(rx);
	cr_assert_eq(ev.type, KVS_EV_RECV_DONE, "the active room finishes");
	struct kvs_lease got;
	cr_assert_eq(kvs_room_lease(rr, 1, &got), 0);
	cr_assert_eq(canary_check(kvs_lease_ptr(rx, &got), 5, SLOT, SLOT), SLOT);
	cr_assert_eq(waitpid(px.pid, NULL, WNOHANG), 0, "exits only once the rooms are closed");
	kvs_room_close(rr);
	kvs_room_close(sr);
	int st;
	cr_assert_eq(reap(px.pid, &st), px.pid, "the draining proxy did not exit");
	px.pid = 0;
	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "drained exit status %d", st);
	cr_assert_eq(kvs_wait(rx, &ev, WAIT_MS), -ENOTCONN);
	kvs_close(rx);
	kvs_close(tx);
}

Test(crash, sigterm_grace_aborts_but_waits_for_quiescence)
{
	start((const char *[]){ "--shutdown-grace", "0", NULL });
	kvs_client *rx = connect_ok(&px), *tx = connect_ok(&px);
	kvs_room *rr, *sr;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(rx, 2 * SLOT, 1, &rr, &d), 0);
	cr_assert_eq(kvs_send_open(tx, &d, 2, &sr), 0);
	struct kvs_lease l;
	cr_assert_eq(kvs_acquire(tx, 1, &l), 0);
	fp_set(&px, "local.quiesce", "pause", NULL);
	cr_assert_eq(kvs_send(sr, &l, 0, SLOT), 0);
	fp_wait(&px, "local.quiesce", 1);
	kill(px.pid, SIGTERM);
	stat_wait(&px, "rooms_aborted", 1, 1);
	cr_assert_eq(slot_pub(&px, l.slot).state, KVS_SLOT_TOMBSTONE);
	struct kvs_event ev;
	cr_assert_eq(kvs_poll(rx, &ev, 1), 0, "ABORTED only after quiescence");
	int st;
	cr_assert_eq(waitpid(px.pid, &st, WNOHANG), 0,
		     "the proxy must not exit while a transport holds a slot");
	fp_set(&px, "local.quiesce", "off", NULL);
	ev = wait_event(rx);
	cr_assert_eq(ev.type, KVS_EV_ABORTED);
	cr_assert_eq(ev.status, -ESHUTDOWN);
	cr_assert_eq(reap(px.pid, &st), px.pid, "the draining proxy did not exit");
	px.pid = 0;
	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
	kvs_close(rx);
	kvs_close(tx);
}
