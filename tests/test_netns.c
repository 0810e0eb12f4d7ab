/* SPDX-License-Identifier: MIT */
/*
 * Proxies on hosts of their own: one network namespace per proxy, joined
 * through veth pairs to a bridge in a hub namespace, all made by the test
 * and removed after it. Engines are clients of each proxy. Needs root
 * (CAP_NET_ADMIN) and iproute2; without them every test here is skipped
 * and says why (the loopback suite 'tcp' covers the same without root).
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "hpeer.h"
#include "decisive_across.h"
#include "xroom.h"

#define SECRET "kvstage-netns-secret-0123456789abcdef"
#define NHOSTS 3

static struct proxy px[NHOSTS] = { PROXY_INIT, PROXY_INIT, PROXY_INIT };
static char ns[NHOSTS + 1][32]; /* hosts, then the hub */
static char addr[NHOSTS][16];
static bool made;

static int ip(const char *const *argv)
{
	char out[512], err[512];
	int rc = run_cmd(argv, out, sizeof(out), err, sizeof(err));
	if (rc)
		cr_log_error("%s %s %s: %s", argv[1], argv[2], argv[3], err);
	return rc;
}

#define IP(...) ip((const char *[]){ ipbin, __VA_ARGS__, NULL })

static const char *ipbin = "/usr/sbin/ip";

static void teardown(void)
{
	for (unsigned i = 0; i < NHOSTS; i++)
		proxy_stop(&px[i]);
	if (made)
		for (unsigned i = 0; i <= NHOSTS; i++)
			if (ns[i][0])
				IP("netns", "delete", ns[i]); /* its veth ends go with it */
}

TestSuite(netns, .fini = teardown, .timeout = 120);

/* Makes n hosts on one link, each proxy with a pool of slots x 64K and
 * --peer-timeout timeout (NULL: its default); skips the test where that
 * cannot be done. */
static void hosts_at(unsigned n, const char *slots, const char *timeout)
{
	if (geteuid() != 0)
		cr_skip_test("needs root to make network namespaces (suite 'tcp' covers loopback)");
	if (access(ipbin, X_OK) && access(ipbin = "/sbin/ip", X_OK))
		cr_skip_test("needs iproute2's ip (apt install iproute2)");
	setenv("KVSTAGE_PEER_SECRET", SECRET, 1);
	unsigned tag = (unsigned)getpid() % 100000;
	for (unsigned i = 0; i <= n; i++) {
		snprintf(ns[i], sizeof(ns[i]), "kvs%u-%c", tag, i == n ? 'h' : 'a' + i);
		if (IP("netns", "add", ns[i]))
			cr_skip_test("cannot make network namespaces here (ip netns add failed)");
		made = true;
	}
	const char *hub = ns[n];
	cr_assert_eq(IP("-n", hub, "link", "add", "br0", "type", "bridge"), 0);
	cr_assert_eq(IP("-n", hub, "link", "set", "br0", "up"), 0);
	for (unsigned i = 0; i < n; i++) {
		char peer[16], me[16];
		snprintf(me, sizeof(me), "eth%u", i);
		snprintf(peer, sizeof(peer), "port%u", i);
		snprintf(addr[i], sizeof(addr[i]), "10.77.0.%u", (i + 1) & 0xff);
		char cidr[48];
		snprintf(cidr, sizeof(cidr), "%.15s/24", addr[i]);
		cr_assert_eq(IP("-n", ns[i], "link", "add", me, "type", "veth", "peer", "name",
				peer, "netns", hub),
			     0);
		cr_assert_eq(IP("-n", hub, "link", "set", peer, "master", "br0", "up"), 0);
		cr_assert_eq(IP("-n", ns[i], "addr", "add", cidr, "dev", me), 0);
		cr_assert_eq(IP("-n", ns[i], "link", "set", me, "up"), 0);
		cr_assert_eq(IP("-n", ns[i], "link", "set", "lo", "up"), 0);
	}
	for (unsigned i = 0; i < n; i++) {
		char listen[48];
		snprintf(listen, sizeof(listen), "%.15s:7600", addr[i]);
		proxy_start_in(&px[i], ns[i],
			       (const char *[]){ "--slots", slots, "--slot-size", "64K", "--listen",
						 listen, timeout ? "--peer-timeout" : NULL, timeout,
						 NULL });
	}
}

/* 1 s: a cut link or a stopped peer is lost soon, yet a loaded machine never loses a live one. */
static void hosts_with(unsigned n, const char *slots)
{
	hosts_at(n, slots, "1000");
}

static void hosts(unsigned n)
{
	hosts_with(n, "128");
}

/* Rooms of every size from each sender host to each receiver host, all
 * open at once, checked byte for byte. */
static void spread(const unsigned *senders, unsigned ns_, const unsigned *receivers, unsigned nr)
{
	kvs_client *tx[NHOSTS], *rx[NHOSTS];
	for (unsigned i = 0; i < ns_; i++)
		tx[i] = connect_ok(&px[senders[i]]);
	for (unsigned i = 0; i < nr; i++)
		rx[i] = connect_ok(&px[receivers[i]]);
	const uint64_t sizes[] = { 1, SLOT - 1, SLOT, SLOT + 1, 7 * SLOT + 5, 16 * SLOT };
	enum { NS = sizeof(sizes) / sizeof(sizes[0]) };
	static struct xroom x[NHOSTS][NHOSTS][NS];
	for (unsigned s = 0; s < ns_; s++)
		for (unsigned r = 0; r < nr; r++)
			for (unsigned k = 0; k < NS; k++)
				xroom_open(&x[s][r][k], rx[r], tx[s], sizes[k],
					   0x100 * (s + 1) + 0x10 * r + k);
	for (unsigned s = 0; s < ns_; s++)
		for (unsigned r = 0; r < nr; r++)
			for (unsigned k = 0; k < NS; k++)
				xroom_send(&x[s][r][k], tx[s]);
	for (unsigned s = 0; s < ns_; s++)
		for (unsigned n = 0; n < nr * NS; n++)
			cr_assert_eq(wait_event(tx[s]).type, KVS_EV_SEND_DONE);
	for (unsigned r = 0; r < nr; r++)
		for (unsigned n = 0; n < ns_ * NS; n++)
			cr_assert_eq(wait_event(rx[r]).type, KVS_EV_RECV_DONE);
	for (unsigned s = 0; s < ns_; s++)
		for (unsigned r = 0; r < nr; r++)
			for (unsigned k = 0; k < NS; k++) {
				xroom_verify(&x[s][r][k], rx[r]);
				xroom_close(&x[s][r][k]);
			}
	for (unsigned i = 0; i < ns_; i++)
		kvs_close(tx[i]);
	for (unsigned i = 0; i < nr; i++)
		kvs_close(rx[i]);
	for (unsigned i = 0; i < ns_ + nr; i++)
		wait_idle(&px[i], 0);
}

Test(netns, one_prefill_one_decode)
{
	hosts(2);
	spread((unsigned[]){ 0 }, 1, (unsigned[]){ 1 }, 1);
}

Test(netns, two_prefill_one_decode)
{
	hosts(3);
	spread((unsigned[]){ 0, 1 }, 2, (unsigned[]){ 2 }, 1);
}

Test(netns, one_prefill_two_decode)
{
	hosts(3);
	spread((unsigned[]){ 0 }, 1, (unsigned[]){ 1, 2 }, 2);
}

/* The link to the decode host is cut mid-transfer: after --peer-timeout of
 * silence both sides fail the room and free everything; once the link is
 * back, rooms go through again. */
Test(netns, a_link_cut_mid_transfer_fails_the_room_on_both_sides)
{
	hosts(2);
	kvs_client *tx = connect_ok(&px[0]), *rx = connect_ok(&px[1]);
	one_room(rx, tx, 0x10); /* the session is up */
	uint64_t posted = stat_get(&px[1], "slots.recv_posted");
	cr_assert_eq(kvs_admin_fp_set_mask(px[0].admin, "tcp.payload", "pause", 0x11, 0xff), 0);
	struct xroom x;
	xroom_open(&x, rx, tx, SLOT, 0x11);
	xroom_send(&x, tx);
	fp_wait(&px[0], "tcp.payload", 1);
	stat_wait(&px[1], "slots.recv_posted", 1, posted + 1);
	cr_assert_eq(IP("-n", ns[1], "link", "set", "eth1", "down"), 0);
	fp_set(&px[0], "tcp.payload", "off", NULL);
	struct kvs_event e = wait_event(tx);
	cr_assert_eq(e.type, KVS_EV_FAILED, "sender got %u", e.type);
	e = wait_event(rx);
	cr_assert_eq(e.type, KVS_EV_FAILED, "receiver got %u", e.type);
	cr_assert_eq(e.status, -ETIMEDOUT, "%s", kvs_strerror(e.status));
	xroom_close(&x);
	wait_idle(&px[0], 1);
	wait_idle(&px[1], 1);
	cr_assert_eq(IP("-n", ns[1], "link", "set", "eth1", "up"), 0);
	one_room(rx, tx, 0x12);
	kvs_close(tx);
	kvs_close(rx);
}

/* The decode host's proxy SIGKILLed with a chunk in flight to it: the
 * prefill host fails the room, releases the slot, and serves the other
 * decode host as before. */
Test(netns, a_decode_proxy_killed_mid_transfer_fails_the_room_and_leaks_nothing)
{
	hosts(3);
	kvs_client *tx = connect_ok(&px[0]), *rx = connect_ok(&px[1]), *rx2 = connect_ok(&px[2]);
	uint64_t posted = stat_get(&px[1], "slots.recv_posted");
	cr_assert_eq(kvs_admin_fp_set_mask(px[0].admin, "tcp.payload", "pause", 0x51, 0xff), 0);
	struct xroom x;
	xroom_open(&x, rx, tx, SLOT, 0x51);
	xroom_send(&x, tx);
	fp_wait(&px[0], "tcp.payload", 1);
	stat_wait(&px[1], "slots.recv_posted", 1, posted + 1);
	proxy_kill(&px[1], SIGKILL);
	struct kvs_event e = wait_event(tx);
	cr_assert_eq(e.type, KVS_EV_FAILED, "the sender's room fails, got %u", e.type);
	cr_assert_eq(kvs_room_close(x.sr), 0);
	fp_set(&px[0], "tcp.payload", "off", NULL);
	wait_idle(&px[0], 1); /* its slot was released with the session */
	one_room(rx2, tx, 0x52);
	kvs_close(tx);
	kvs_close(rx2);
	kvs_close(rx);
	wait_idle(&px[0], 0);
}

/* ------------------------------------------------------ hostile hosts */

/* B's host dies silently (its link down, its proxy killed, what its
 * kernel held of the session destroyed without a word) and a new proxy
 * comes up at its address: A still holds the old session, which never
 * heard of it. A fresh descriptor from the new proxy names another
 * instance: A retires the old session and dials anew, and the room
 * arrives; it never fails as stale. At the default --peer-timeout, so
 * the old session is still up all along. */
/* Waits until no TCP socket on host i has bytes its peer has not acked:
 * the peer's delayed ACK is out, so nothing of the session is still owed
 * on the wire (an ACK that reached a host reborn meanwhile would draw
 * its RST). */
static void wire_settled(unsigned i)
{
	char out[16384], err[512];
	for (unsigned tries = 0;; tries++) {
		cr_assert_eq(run_cmd((const char *[]){ ipbin, "netns", "exec", ns[i], "ss", "-t",
						       "-i", "-n", "-H", NULL },
				     out, sizeof(out), err, sizeof(err)),
			     0, "ss -ti: %s", err);
		if (!strstr(out, "unacked:"))
			return;
		cr_assert_lt(tries, WAIT_MS, "host %u's sockets never settled: %s", i, out);
		usleep(1000); /* the kernel's delayed-ACK timer, up to 200 ms: polled, not guessed */
	}
}

Test(netns, a_proxy_restarted_at_its_address_is_dialed_anew_never_stale)
{
	hosts_at(2, "128", NULL);
	kvs_client *tx = connect_ok(&px[0]), *rx = connect_ok(&px[1]);
	one_room(rx, tx, 0x70); /* the session is up */
	kvs_close(rx);
	wire_settled(0);
	wire_settled(1);
	cr_assert_eq(IP("-n", ns[1], "link", "set", "eth1", "down"), 0);
	proxy_kill(&px[1], SIGKILL);
	/* What the killed proxy's kernel still holds would FIN or RST once the
	 * link is back: destroy it while nothing can leave, and see it gone. */
	char out[4096], err[512];
	cr_assert_eq(run_cmd((const char *[]){ ipbin, "netns", "exec", ns[1], "ss", "-K", "-t",
					       "-a", NULL },
			     out, sizeof(out), err, sizeof(err)),
		     0, "ss -K: %s", err);
	cr_assert_eq(run_cmd((const char *[]){ ipbin, "netns", "exec", ns[1], "ss", "-t", "-a",
					       "-n", "-H", NULL },
			     out, sizeof(out), err, sizeof(err)),
		     0);
	cr_assert_eq(out[0], 0, "sockets left on the dead host: %s", out);
	cr_assert_eq(IP("-n", ns[1], "link", "set", "eth1", "up"), 0);
	char listen[48];
	snprintf(listen, sizeof(listen), "%.15s:7600", addr[1]);
	proxy_start_in(&px[1], ns[1],
		       (const char *[]){ "--slots", "128", "--slot-size", "64K", "--listen", listen,
					 NULL });
	cr_assert_eq(stat_get(&px[0], "peer_sessions"), 1, "A never heard: the old session is up");
	rx = connect_ok(&px[1]);
	one_room(rx, tx, 0x71); /* not -ESTALE */
	static char log[1 << 16];
	proxy_log(&px[0], log, sizeof(log));
	cr_assert(strstr(log, "another proxy answers there now"),
		  "the old session was not retired: %s", log);
	kvs_close(tx);
	kvs_close(rx);
}

struct attack {
	const char *ns, *target;
	unsigned n;
};

/* n silent connections to target from host ns, over twenty addresses of
 * its own (10.77.0.100 up), each opened again when dropped; "ready" once
 * all are open; on until its pipe closes. */
static int attacker(int rd, int wr, void *arg)
{
	const struct attack *a = arg;
	char path[96];
	snprintf(path, sizeof(path), "/run/netns/%s", a->ns);
	int nsfd = open(path, O_RDONLY | O_CLOEXEC);
	if (nsfd < 0 || setns(nsfd, CLONE_NEWNET) < 0)
		return 2;
	char src[HP_SILENT_MAX][20];
	for (unsigned i = 0; i < a->n && i < HP_SILENT_MAX; i++)
		snprintf(src[i], sizeof(src[i]), "10.77.0.%u", 100 + i % 20);
	return hp_hold_silent(a->target, src, a->n, rd, wr);
}

/* A third host opens 240 connections to B from twenty addresses and never
 * says a word: B keeps taking A's sessions and rooms. */
Test(netns, silent_connections_from_another_host_cannot_lock_proxies_out)
{
	hosts_at(3, "128", NULL);
	for (unsigned i = 0; i < 20; i++) {
		char cidr[32];
		snprintf(cidr, sizeof(cidr), "10.77.0.%u/24", 100 + i);
		cr_assert_eq(IP("-n", ns[2], "addr", "add", cidr, "dev", "eth2"), 0);
	}
	char target[32];
	snprintf(target, sizeof(target), "%.15s:7600", addr[1]);
	struct attack a = { ns[2], target, 240 };
	struct child ch;
	child_start(&ch, attacker, &a);
	char ready[5];
	cr_assert_eq(chan_get(ch.from, ready, 5), 0, "the attack did not start");
	kvs_client *tx = connect_ok(&px[0]), *rx = connect_ok(&px[1]);
	one_room(rx, tx, 0x80);
	kvs_client *tx2 = connect_ok(&px[0]);
	one_room(rx, tx2, 0x81);
	close(ch.to);
	cr_assert_eq(child_wait(&ch), 0);
	kvs_close(tx);
	kvs_close(tx2);
	kvs_close(rx);
}
