/* SPDX-License-Identifier: MIT */
/*
 * Rails: two proxies, each with two RDMA devices on two links
 * (--rdma-device rxe0 --rdma-device rxe1, the soft-RoCE guest's). A
 * session has a queue pair on each rail, its chunks take turns on them,
 * and each rail says what it carried (rdma_rail<N>_*, in kvstage-stat
 * --json and /metrics). A link cut mid-room takes its rail's queue pairs
 * with it: the READs it had in flight fail, their slots come back, and
 * their chunks go again on the other rail; the room completes byte for
 * byte, nothing lands twice, and the other rail never stopped.
 *
 * tools/run-tests.sh runs this suite in the soft-RoCE guest (tests/rxe,
 * which makes rxe1 on a second link); on a host without two RDMA devices
 * every case skips and says so. The proxies run at the default
 * --peer-timeout.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "xroom.h"

#define SECRET "kvstage-rails-secret-0123456789abcdef"
#define IP "/usr/sbin/ip" /* iproute2's; run_cmd does not search PATH */

static struct proxy pa = PROXY_INIT, pb = PROXY_INIT;

static void setup(void)
{
	setenv("KVSTAGE_PEER_SECRET", SECRET, 1);
}

static void teardown(void)
{
	const char *nd = getenv("RXE_NETDEV1");
	if (nd && *nd) { /* a case that cut the link leaves it up again */
		char out[256], err[256];
		run_cmd((const char *[]){ IP, "link", "set", nd, "up", NULL }, out, sizeof(out),
			err, sizeof(err));
	}
	proxy_stop(&pa);
	proxy_stop(&pb);
}

TestSuite(rails, .init = setup, .fini = teardown, .timeout = 240);

/* A sends, B receives, both on both rails; the session up on each. */
static void start(void)
{
	const char *d0 = getenv("RXE_DEV"), *d1 = getenv("RXE_DEV1");
	if (!(d0 && *d0 && d1 && *d1))
		cr_skip_test("two RDMA devices on two links are needed ($RXE_DEV, $RXE_DEV1 "
			     "unset): tools/run-tests.sh runs this suite in the soft-RoCE guest "
			     "(tests/rxe: rxe0 and rxe1)");
	const char *a[] = {
		"--slots",	 "128", "--slot-size",	 "64K", "--listen", "127.0.0.1:0",
		"--rdma-device", d0,	"--rdma-device", d1,	NULL
	};
	proxy_start(&pa, NULL, a);
	proxy_start(&pb, NULL, a);
	kvs_client *rx = connect_ok(&pb), *tx = connect_ok(&pa);
	one_room(rx, tx, 0x5100); /* the session, dialed */
	for (struct proxy *px = &pa; px; px = px == &pa ? &pb : NULL) {
		stat_wait(px, "rdma_rail0_links", 1, 1);
		stat_wait(px, "rdma_rail1_links", 1, 1);
		cr_assert_eq(stat_get(px, "rdma_sessions"), 1, "one session, on two rails");
	}
	kvs_close(tx);
	kvs_close(rx);
}

static void run(const char *const *argv)
{
	char out[1024], err[1024];
	cr_assert_eq(run_cmd(argv, out, sizeof(out), err, sizeof(err)), 0, "%s: %s", argv[0], err);
}

Test(rails, rooms_spread_over_both_rails_byte_for_byte)
{
	start();
	kvs_client *rx = connect_ok(&pb), *tx = connect_ok(&pa);
	uint64_t r0 = stat_get(&pb, "rdma_rail0_reads"), r1 = stat_get(&pb, "rdma_rail1_reads"),
		 s0 = stat_get(&pa, "rdma_rail0_sent"), s1 = stat_get(&pa, "rdma_rail1_sent"),
		 reads = stat_get(&pb, "rdma_reads"), tcp = stat_get(&pb, "tcp_bytes_rx");
	enum { N = 8, CHUNKS = 5 };
	struct xroom x[N];
	for (unsigned i = 0; i < N; i++)
		xroom_open(&x[i], rx, tx, CHUNKS * SLOT - i, 0x5200 + i);
	for (unsigned i = 0; i < N; i++)
		xroom_send(&x[i], tx);
	for (unsigned i = 0; i < N; i++) {
		cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
		cr_assert_eq(wait_event(rx).type, KVS_EV_RECV_DONE);
	}
	for (unsigned i = 0; i < N; i++) {
		xroom_verify(&x[i], rx);
		xroom_close(&x[i]);
	}
	uint64_t d0 = stat_get(&pb, "rdma_rail0_reads") - r0,
		 d1 = stat_get(&pb, "rdma_rail1_reads") - r1;
	cr_assert_eq(d0 + d1, N * CHUNKS, "every chunk by READ on a rail (%llu + %llu)",
		     (unsigned long long)d0, (unsigned long long)d1);
	cr_assert_eq(stat_get(&pb, "rdma_reads") - reads, N * CHUNKS);
	cr_assert(d0 >= N * CHUNKS / 4 && d1 >= N * CHUNKS / 4,
		  "the chunks took turns on the rails: %llu and %llu", (unsigned long long)d0,
		  (unsigned long long)d1);
	cr_assert_eq(stat_get(&pa, "rdma_rail0_sent") - s0, d0, "what A announced on rail 0");
	cr_assert_eq(stat_get(&pa, "rdma_rail1_sent") - s1, d1, "what A announced on rail 1");
	cr_assert_lt(stat_get(&pb, "tcp_bytes_rx") - tcp, SLOT, "no payload came by the sockets");

	/* kvstage-stat --json says what each rail carried. */
	static char out[32768], err[1024], want[96];
	cr_assert_eq(run_cmd((const char *[]){ build_path("tools/kvstage-stat"), "--json",
					       "--socket", pb.sock, NULL },
			     out, sizeof(out), err, sizeof(err)),
		     0, "%s", err);
	snprintf(want, sizeof(want), "\"rdma_rail1_reads\":%llu",
		 (unsigned long long)stat_get(&pb, "rdma_rail1_reads"));
	cr_assert(strstr(out, want), "no %s in %s", want, out);
	kvs_close(tx);
	kvs_close(rx);
	wait_idle(&pa, 0);
	wait_idle(&pb, 0);
}

/* Every READ of a room held at B (rdma.read), on both rails; rail 1's
 * link cut; the READs let go. Rail 1's fail on the wire, their slots come
 * back unwritten and their chunks go again on rail 0: the room arrives
 * whole, no chunk is discarded or lands twice. Then the link comes back
 * and rooms go on. */
Test(rails, a_rail_cut_mid_room_fences_its_reads_and_the_other_carries_on)
{
	start();
	const char *nd = getenv("RXE_NETDEV1");
	cr_assert(nd && *nd, "the guest names rail 1's link ($RXE_NETDEV1)");
	kvs_client *rx = connect_ok(&pb), *tx = connect_ok(&pa);
	uint64_t lost = stat_get(&pb, "rdma_rail1_links_lost") +
			stat_get(&pa, "rdma_rail1_links_lost"),
		 discarded = stat_get(&pb, "chunks_discarded"),
		 r0 = stat_get(&pb, "rdma_rail0_reads"), held0 = 0;
	enum { CHUNKS = 8 };
	fp_set(&pb, "rdma.read", "pause", NULL);
	cr_assert_eq(kvs_admin_fp_get(pb.admin, "rdma.read", &held0), 0);
	struct xroom x;
	xroom_open(&x, rx, tx, CHUNKS * SLOT, 0x5300);
	xroom_send(&x, tx);
	fp_wait(&pb, "rdma.read", held0 + CHUNKS); /* every chunk's READ held, its slot posted */
	cr_assert_geq(stat_get(&pa, "rdma_rail1_sent"), 1);

	run((const char *[]){ IP, "link", "set", nd, "down", NULL });
	fp_set(&pb, "rdma.read", "off", NULL);
	cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
	cr_assert_eq(wait_event(rx).type, KVS_EV_RECV_DONE);
	xroom_verify(&x, rx);
	xroom_close(&x);
	cr_assert_gt(stat_get(&pb, "rdma_rail1_links_lost") +
			     stat_get(&pa, "rdma_rail1_links_lost"),
		     lost, "rail 1's queue pair failed with its link");
	cr_assert_eq(stat_get(&pb, "chunks_discarded"), discarded,
		     "no chunk was fenced out: none landed twice, none was lost");
	cr_assert_gt(stat_get(&pb, "rdma_rail0_reads"), r0, "rail 0 carried on");

	run((const char *[]){ IP, "link", "set", nd, "up", NULL });
	for (unsigned i = 0; i < 3; i++)
		one_room(rx, tx, 0x5400 + i);
	kvs_close(tx);
	kvs_close(rx);
	wait_idle(&pa, 0);
	wait_idle(&pb, 0);
}
