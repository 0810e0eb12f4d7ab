/* SPDX-License-Identifier: MIT */
/*
 * libkvstage's own contract against a real proxy: stale room handles,
 * events about rooms gone since, NULL arguments, fork(), deadlines that
 * signals do not move, a proxy that dies or wedges under a client that
 * waits, and what each error says.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "rawclient.h"

#define SLOT 4096

static struct proxy px = PROXY_INIT;

static void setup(void)
{
	proxy_start(&px, NULL, (const char *[]){ "--slots", "16", "--slot-size", "4K", NULL });
}

static void teardown(void)
{
	proxy_stop(&px);
}

TestSuite(client, .init = setup, .fini = teardown, .timeout = 60);

static uint64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

Test(client, a_closed_room_handle_never_names_the_next_room)
{
	kvs_client *rx = connect_ok(&px), *tx = connect_ok(&px);
	kvs_room *x, *y, *s;
	struct kvs_room_desc dx, dy;
	cr_assert_eq(kvs_recv_open(rx, SLOT, 1, &x, &dx), 0);
	cr_assert_eq(kvs_room_close(x), 0);
	struct kvs_event ev = wait_event(rx);
	cr_assert_eq(ev.type, KVS_EV_ABORTED);
	cr_assert_eq(kvs_recv_open(rx, 2 * SLOT, 2, &y, &dy), 0);
	cr_assert_eq(kvs_room_handle_idx(x), kvs_room_handle_idx(y), "y reuses x's index");
	struct kvs_lease l = { 0, 0 };
	cr_assert_eq(kvs_room_close(x), -EBADF, "a second close");
	cr_assert_eq(kvs_abort(x), -EBADF);
	cr_assert_eq(kvs_send(x, &l, 0, SLOT), -EBADF);
	cr_assert_eq(kvs_room_lease(x, 0, &l), -EBADF);
	cr_assert_eq(kvs_room_chunks(x), 0);
	cr_assert_eq(kvs_room_bytes(x), 0);
	sync_barrier(rx);
	/* y is whole: it completes */
	cr_assert_eq(kvs_room_chunks(y), 2);
	cr_assert_eq(kvs_send_open(tx, &dy, 3, &s), 0);
	struct kvs_lease ls[2];
	cr_assert_eq(kvs_acquire(tx, 2, ls), 0);
	cr_assert_eq(kvs_send(s, &ls[0], 0, SLOT), 0);
	cr_assert_eq(kvs_send(s, &ls[1], SLOT, SLOT), 0);
	ev = wait_event(rx);
	cr_assert_eq(ev.type, KVS_EV_RECV_DONE, "y: %u %s", ev.type, kvs_strerror(ev.status));
	cr_assert_eq(ev.user_data, 2);
	cr_assert_eq(kvs_room_close(y), 0);
	cr_assert_eq(kvs_room_close(y), -EBADF);
	/* a handle of a closed connection is refused too */
	kvs_room *z;
	struct kvs_room_desc dz;
	cr_assert_eq(kvs_recv_open(rx, SLOT, 4, &z, &dz), 0);
	kvs_close(rx);
	cr_assert_eq(kvs_room_close(z), -EBADF);
	kvs_close(tx);
	wait_idle(&px, 0);
}

Test(client, a_rejection_for_a_room_gone_since_leaves_the_new_room_alone)
{
	kvs_client *rx = connect_ok(&px), *tx = connect_ok(&px);
	kvs_room *rr, *x, *y, *ry;
	struct kvs_room_desc d, d2;
	cr_assert_eq(kvs_recv_open(rx, SLOT, 1, &rr, &d), 0);
	cr_assert_eq(kvs_send_open(tx, &d, 2, &x), 0);
	cr_assert_eq(kvs_abort(rr), 0);
	cr_assert_eq(wait_event(tx).type, KVS_EV_ABORTED);
	uint32_t x_gen = kvs_room_handle_gen(x);
	cr_assert_eq(kvs_room_close(x), 0);
	cr_assert_eq(kvs_recv_open(rx, 2 * SLOT, 3, &ry, &d2), 0);
	cr_assert_eq(kvs_send_open(tx, &d2, 4, &y), 0);
	cr_assert_eq(kvs_room_handle_idx(y), kvs_room_handle_idx(x), "y reuses x's index");
	struct kvs_lease l[2];
	cr_assert_eq(kvs_acquire(tx, 2, l), 0);
	cr_assert_eq(kvs_send(y, &l[0], 0, SLOT), 0);
	/* x's late refusal, of a send of chunk 0 at offset 0 */
	struct kvs_sqe q = { .op = KVS_OP_SEND,
			     .handle = kvs_room_handle_idx(y),
			     .gen = x_gen,
			     .slot = l[1].slot,
			     .epoch = l[1].epoch + 1,
			     .arg = 0,
			     .len = SLOT };
	cr_assert_eq(raw_submit(tx, &q), 0);
	struct kvs_event ev = wait_event(tx);
	cr_assert_eq(ev.type, KVS_EV_REJECTED);
	cr_assert_eq(ev.status, -ESTALE);
	cr_assert_eq(kvs_send(y, &l[1], 0, SLOT), -EEXIST, "y's chunk 0 is still sent");
	cr_assert_eq(kvs_send(y, &l[1], SLOT, SLOT), 0);
	cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
	kvs_close(tx);
	kvs_close(rx);
	wait_idle(&px, 0);
}

/* Sends every chunk of s (4 of them) from fresh leases, each accepted. */
static void send_all4(kvs_client *tx, kvs_room *s)
{
	struct kvs_lease l[4];
	cr_assert_eq(kvs_acquire(tx, 4, l), 0);
	for (unsigned i = 0; i < 4; i++)
		cr_assert_eq(kvs_send(s, &l[i], (uint64_t)i * SLOT, SLOT), 0, "chunk %u", i);
}

Test(client, a_sending_handle_reused_starts_with_no_chunk_sent)
{
	/* The library keeps a handle's sent bitmap from room to room: each
	 * room must start with it clear, however the last one ended. */
	kvs_client *rx = connect_ok(&px), *tx = connect_ok(&px);
	kvs_room *r, *s;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(rx, 4 * SLOT, 1, &r, &d), 0);
	cr_assert_eq(kvs_send_open(tx, &d, 1, &s), 0);
	uint16_t idx = kvs_room_handle_idx(s);
	send_all4(tx, s);
	cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
	cr_assert_eq(wait_event(rx).type, KVS_EV_RECV_DONE);
	cr_assert_eq(kvs_room_close(s), 0, "closed once ended");
	cr_assert_eq(kvs_room_close(r), 0);

	/* the next room at that index: two chunks, then closed while open */
	cr_assert_eq(kvs_recv_open(rx, 4 * SLOT, 2, &r, &d), 0);
	cr_assert_eq(kvs_send_open(tx, &d, 2, &s), 0);
	cr_assert_eq(kvs_room_handle_idx(s), idx, "the index is reused");
	struct kvs_lease l[4];
	cr_assert_eq(kvs_acquire(tx, 4, l), 0);
	cr_assert_eq(kvs_send(s, &l[0], 0, SLOT), 0, "chunk 0 of the first room is not this one's");
	cr_assert_eq(kvs_send(s, &l[1], SLOT, SLOT), 0);
	cr_assert_eq(kvs_send(s, &l[2], SLOT, SLOT), -EEXIST, "this room's own chunk 1 is sent");
	cr_assert_eq(kvs_room_close(s), 0, "closed while open");
	cr_assert_eq(wait_event(tx).type, KVS_EV_ABORTED);
	cr_assert_eq(wait_event(rx).type, KVS_EV_ABORTED);
	cr_assert_eq(kvs_room_close(r), 0);
	cr_assert_eq(kvs_release(tx, &l[2]), 0);
	cr_assert_eq(kvs_release(tx, &l[3]), 0);

	/* and the one after it */
	cr_assert_eq(kvs_recv_open(rx, 4 * SLOT, 3, &r, &d), 0);
	cr_assert_eq(kvs_send_open(tx, &d, 3, &s), 0);
	cr_assert_eq(kvs_room_handle_idx(s), idx);
	send_all4(tx, s);
	cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
	cr_assert_eq(wait_event(rx).type, KVS_EV_RECV_DONE);
	kvs_close(tx);
	kvs_close(rx);
	wait_idle(&px, 0);
}

Test(client, null_arguments_are_refused_not_followed)
{
	kvs_client *c = connect_ok(&px);
	struct kvs_lease l;
	struct kvs_event ev;
	struct kvs_room_desc d;
	kvs_room *r;
	cr_assert_eq(kvs_connect(NULL, NULL), -EINVAL);
	cr_assert_eq(kvs_acquire(NULL, 1, &l), -EINVAL);
	cr_assert_eq(kvs_acquire(c, 1, NULL), -EINVAL);
	cr_assert_eq(kvs_release(NULL, &l), -EINVAL);
	cr_assert_eq(kvs_release(c, NULL), -EINVAL);
	cr_assert_null(kvs_lease_ptr(NULL, &l));
	cr_assert_null(kvs_lease_ptr(c, NULL));
	cr_assert_eq(kvs_lease_check(NULL, &l), -EINVAL);
	cr_assert_eq(kvs_lease_check(c, NULL), -EINVAL);
	cr_assert_eq(kvs_recv_open(NULL, 1, 0, &r, &d), -EINVAL);
	cr_assert_eq(kvs_recv_open(c, 1, 0, NULL, &d), -EINVAL);
	cr_assert_eq(kvs_recv_open(c, 1, 0, &r, NULL), -EINVAL);
	cr_assert_eq(kvs_send_open(NULL, &d, 0, &r), -EINVAL);
	cr_assert_eq(kvs_send_open(c, NULL, 0, &r), -EINVAL);
	cr_assert_eq(kvs_send_open(c, &d, 0, NULL), -EINVAL);
	cr_assert_eq(kvs_send(NULL, &l, 0, 1), -EINVAL);
	cr_assert_eq(kvs_abort(NULL), -EINVAL);
	cr_assert_eq(kvs_room_lease(NULL, 0, &l), -EINVAL);
	cr_assert_eq(kvs_room_close(NULL), -EINVAL);
	cr_assert_eq(kvs_room_chunks(NULL), 0);
	cr_assert_eq(kvs_room_bytes(NULL), 0);
	cr_assert_eq(kvs_poll(NULL, &ev, 1), -EINVAL);
	cr_assert_eq(kvs_poll(c, NULL, 1), -EINVAL);
	cr_assert_eq(kvs_poll(c, NULL, 0), 0, "no room asked for, none needed");
	cr_assert_eq(kvs_wait(NULL, &ev, 0), -EINVAL);
	cr_assert_eq(kvs_wait(c, NULL, 0), -EINVAL);
	cr_assert_eq(kvs_event_fd(NULL), -EINVAL);
	cr_assert_eq(kvs_set_sync_timeout(NULL, 100), -EINVAL);
	cr_assert_eq(kvs_ext_attach(NULL, &l, NULL, NULL), -EINVAL);
	cr_assert_null(kvs_ext_get(NULL, &l));
	cr_assert_null(kvs_pool_map(NULL, NULL));
	cr_assert_eq(kvs_slot_size(NULL), 0);
	cr_assert_eq(kvs_slot_count(NULL), 0);
	cr_assert_eq(kvs_max_rooms(NULL), 0);
	kvs_close(NULL);
	/* with a room: its pointer arguments */
	cr_assert_eq(kvs_recv_open(c, SLOT, 1, &r, &d), 0);
	cr_assert_eq(kvs_room_lease(r, 0, NULL), -EINVAL);
	kvs_room *s;
	cr_assert_eq(kvs_send_open(c, &d, 2, &s), 0);
	cr_assert_eq(kvs_send(s, NULL, 0, SLOT), -EINVAL);
	kvs_close(c);
	wait_idle(&px, 0);
}

/* A child that writes through a pointer its parent had into slots (the
 * sent one, the received one) faults: the pool is not mapped in a child,
 * and the receiver's completed room keeps what was sent. */
Test(client, a_fork_child_cannot_reach_a_slot)
{
	kvs_client *rx = connect_ok(&px), *tx = connect_ok(&px);
	kvs_room *r, *s;
	struct kvs_room_desc d;
	struct kvs_lease l, got;
	cr_assert_eq(kvs_recv_open(rx, SLOT, 1, &r, &d), 0);
	cr_assert_eq(kvs_send_open(tx, &d, 1, &s), 0);
	cr_assert_eq(kvs_acquire(tx, 1, &l), 0);
	uint8_t *sent = kvs_lease_ptr(tx, &l);
	cr_assert_not_null(sent);
	memset(sent, 0x5a, SLOT);
	cr_assert_eq(kvs_send(s, &l, 0, SLOT), 0);
	struct kvs_event ev = wait_event(rx);
	cr_assert_eq(ev.type, KVS_EV_RECV_DONE, "%u %s", ev.type, kvs_strerror(ev.status));
	cr_assert_eq(kvs_room_lease(r, 0, &got), 0);
	uint8_t *recvd = kvs_lease_ptr(rx, &got);
	cr_assert_not_null(recvd);
	uint8_t *targets[] = { sent, recvd };
	for (unsigned t = 0; t < 2; t++) {
		fflush(NULL);
		pid_t pid = fork();
		cr_assert_neq(pid, -1);
		if (pid == 0) {
			setrlimit(RLIMIT_CORE, &(struct rlimit){ 0, 0 });
			signal(SIGSEGV, SIG_DFL); /* (ASan's handler would exit 1) */
			memset(targets[t], 0xee, SLOT);
			_exit(0);
		}
		int st;
		cr_assert_eq(reap(pid, &st), pid);
		cr_assert(WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV,
			  "the child's write to the %s slot: %s %d", t ? "received" : "sent",
			  WIFSIGNALED(st) ? "signal" : "exit",
			  WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
	}
	for (unsigned i = 0; i < SLOT; i++)
		cr_assert_eq(recvd[i], 0x5a, "byte %u of the received chunk changed", i);
	cr_assert_eq(kvs_room_close(r), 0);
	cr_assert_eq(kvs_room_close(s), 0);
	kvs_close(rx);
	kvs_close(tx);
}

Test(client, a_fork_child_cannot_use_or_disturb_its_parents_connection)
{
	kvs_client *c = connect_ok(&px);
	struct kvs_lease l;
	cr_assert_eq(kvs_acquire(c, 1, &l), 0);
	kvs_room *r;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(c, SLOT, 1, &r, &d), 0);
	fflush(NULL);
	pid_t pid = fork();
	cr_assert_neq(pid, -1);
	if (pid == 0) {
		struct kvs_lease l2;
		struct kvs_event ev;
		kvs_room *r2;
		int bad = 0;
		bad += kvs_acquire(c, 1, &l2) != -ECHILD;
		bad += kvs_release(c, &l) != -ECHILD;
		bad += kvs_lease_ptr(c, &l) != NULL;
		bad += kvs_lease_check(c, &l) != -ECHILD;
		bad += kvs_pool_map(c, NULL) != NULL;
		bad += kvs_recv_open(c, SLOT, 9, &r2, &d) != -ECHILD;
		bad += kvs_abort(r) != -ECHILD;
		bad += kvs_room_close(r) != -ECHILD;
		bad += kvs_poll(c, &ev, 1) != -ECHILD;
		bad += kvs_wait(c, &ev, 0) != -ECHILD;
		bad += kvs_event_fd(c) != -ECHILD;
		kvs_close(c); /* only the child's copy */
		/* a connection of its own works */
		kvs_client *own;
		if (kvs_connect(px.sock, &own) == 0) {
			bad += kvs_acquire(own, 1, &l2) != 0;
			kvs_close(own);
		} else {
			bad++;
		}
		_exit(bad);
	}
	int st;
	cr_assert_eq(reap(pid, &st), pid);
	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child: %d calls misbehaved",
		  WEXITSTATUS(st));
	stat_wait(&px, "clients", 0, 1);
	/* the parent's connection is whole: its lease, its room, its replies */
	cr_assert_not_null(kvs_lease_ptr(c, &l));
	cr_assert_eq(stat_get(&px, "slots.leased"), 1,
		     "the child leased nothing through the parent");
	struct kvs_lease l3;
	cr_assert_eq(kvs_acquire(c, 1, &l3), 0);
	cr_assert_eq(stat_get(&px, "slots.leased"), 2);
	cr_assert_eq(kvs_release(c, &l), 0);
	cr_assert_eq(kvs_release(c, &l3), 0);
	cr_assert_eq(kvs_abort(r), 0);
	cr_assert_eq(wait_event(c).type, KVS_EV_ABORTED);
	kvs_close(c);
	wait_idle(&px, 0);
}

static volatile sig_atomic_t alarms;

static void on_alarm(int sig)
{
	(void)sig;
	alarms++;
}

Test(client, a_wait_ends_at_its_deadline_whatever_the_signals)
{
	kvs_client *c = connect_ok(&px);
	struct sigaction sa = { .sa_handler = on_alarm }; /* no SA_RESTART: poll sees EINTR */
	sigemptyset(&sa.sa_mask);
	cr_assert_eq(sigaction(SIGALRM, &sa, NULL), 0);
	/* A signal every 50 ms, more often than the 200 ms wait: restarting
	 * the full timeout after each one would never end. */
	struct itimerval it = { { 0, 50000 }, { 0, 50000 } };
	cr_assert_eq(setitimer(ITIMER_REAL, &it, NULL), 0);
	struct kvs_event ev;
	uint64_t t0 = now_ms();
	int rc = kvs_wait(c, &ev, 200);
	uint64_t took = now_ms() - t0;
	struct itimerval off = { { 0, 0 }, { 0, 0 } };
	setitimer(ITIMER_REAL, &off, NULL);
	cr_assert_eq(rc, -ETIMEDOUT, "%s", kvs_strerror(rc));
	cr_assert_geq(took, 200, "returned before its deadline (%llu ms)",
		      (unsigned long long)took);
	cr_assert_geq(alarms, 2, "signals arrived meanwhile");
	kvs_close(c);
}

Test(client, the_event_fd_wakes_when_the_proxy_dies)
{
	kvs_client *c = connect_ok(&px);
	int fd = kvs_event_fd(c);
	cr_assert_geq(fd, 0);
	struct kvs_event ev[4];
	cr_assert_eq(kvs_poll(c, ev, 4), 0);
	proxy_kill(&px, SIGKILL);
	struct pollfd p = { .fd = fd, .events = POLLIN };
	cr_assert_eq(poll(&p, 1, WAIT_MS), 1, "the event fd stayed silent");
	cr_assert_eq(kvs_poll(c, ev, 4), -ENOTCONN, "the next poll says the proxy is gone");
	kvs_close(c);
}

Test(client, sync_calls_give_up_on_a_wedged_proxy)
{
	setenv("KVSTAGE_SYNC_TIMEOUT_MS", "soon", 1);
	kvs_client *bad;
	cr_assert_eq(kvs_connect(px.sock, &bad), -EINVAL, "a bad bound is said, not ignored");
	setenv("KVSTAGE_SYNC_TIMEOUT_MS", "300", 1);
	kvs_client *c = connect_ok(&px);
	unsetenv("KVSTAGE_SYNC_TIMEOUT_MS");
	cr_assert_eq(kvs_set_sync_timeout(c, 0), -EINVAL);
	proxy_freeze(&px);
	struct kvs_lease l;
	uint64_t t0 = now_ms();
	cr_assert_eq(kvs_acquire(c, 1, &l), -ETIMEDOUT);
	cr_assert_geq(now_ms() - t0, 300);
	cr_assert_eq(kvs_release(c, &l), -ETIMEDOUT, "out of step: later calls fail too");
	kvs_room *r;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(c, SLOT, 1, &r, &d), -ETIMEDOUT);
	kill(px.pid, SIGCONT);
	kvs_close(c);
	/* a fresh connection to the resumed proxy works */
	kvs_client *c2 = connect_ok(&px);
	cr_assert_eq(kvs_set_sync_timeout(c2, -1), 0);
	cr_assert_eq(kvs_acquire(c2, 1, &l), 0);
	kvs_close(c2);
	wait_idle(&px, 0);
}

Test(client, a_complete_room_says_so_not_aborted)
{
	kvs_client *rx = connect_ok(&px), *tx = connect_ok(&px);
	kvs_room *rr, *s;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(rx, SLOT, 1, &rr, &d), 0);
	cr_assert_eq(kvs_send_open(tx, &d, 2, &s), 0);
	struct kvs_lease l[2];
	cr_assert_eq(kvs_acquire(tx, 2, l), 0);
	cr_assert_eq(kvs_send(s, &l[0], 0, SLOT), 0);
	cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
	int rc = kvs_send(s, &l[1], 0, SLOT);
	cr_assert_eq(rc, -EALREADY, "%s", kvs_strerror(rc));
	cr_assert(strstr(kvs_strerror(rc), "complete"), "%s", kvs_strerror(rc));
	/* an aborted one says why it ended */
	kvs_room *rr2, *s2;
	cr_assert_eq(kvs_recv_open(rx, SLOT, 3, &rr2, &d), 0);
	cr_assert_eq(kvs_send_open(tx, &d, 4, &s2), 0);
	cr_assert_eq(kvs_abort(s2), 0);
	cr_assert_eq(wait_event(tx).type, KVS_EV_ABORTED);
	cr_assert_eq(kvs_send(s2, &l[1], 0, SLOT), -ECANCELED);
	kvs_close(tx);
	kvs_close(rx);
	wait_idle(&px, 0);
}

Test(client, a_restarted_proxy_hands_out_other_epochs)
{
	kvs_client *c = connect_ok(&px);
	struct kvs_lease before;
	cr_assert_eq(kvs_acquire(c, 1, &before), 0);
	kvs_close(c);
	proxy_kill(&px, SIGKILL);
	proxy_restart(&px, (const char *[]){ "--slots", "16", "--slot-size", "4K", NULL });
	c = connect_ok(&px);
	struct kvs_lease after;
	cr_assert_eq(kvs_acquire(c, 1, &after), 0);
	cr_assert_eq(after.slot, before.slot, "the same slot again");
	cr_assert_neq(after.epoch, before.epoch,
		      "a lease kept across the restart equals a new one");
	kvs_close(c);
}

Test(client, a_close_is_counted_apart_from_a_death)
{
	kvs_client *c = connect_ok(&px);
	kvs_close(c);
	stat_wait(&px, "clients_closed", 1, 1);
	cr_assert_eq(stat_get(&px, "clients_died"), 0, "a clean close counted as a death");
	fflush(NULL);
	pid_t pid = fork();
	if (pid == 0) {
		kvs_client *k;
		if (kvs_connect(px.sock, &k))
			_exit(1);
		raise(SIGKILL);
	}
	int st;
	cr_assert_eq(reap(pid, &st), pid);
	stat_wait(&px, "clients_died", 1, 1);
	cr_assert_eq(stat_get(&px, "clients_closed"), 1);
}
