/* SPDX-License-Identifier: MIT */
/*
 * The transport conformance suite: one list of scenarios, run against
 * every transport. A new transport passes all of it or is not done.
 *
 *   local  one proxy; the sender's and the receiver's clients share its
 *          pool (the gated hand-off: failpoint local.quiesce holds a chunk)
 *   tcp    two proxies on loopback; the receiving proxy posts a slot for
 *          each chunk (failpoint tcp.payload holds a payload after its
 *          header left)
 *   relay  two proxies of kvstaged-relay with --relay-chunks: a data path
 *          that lives in one file under tests/ (dp_relay.c), its own frame
 *          type, option and failpoint (relay.land holds a chunk whose bytes
 *          are in its posted slot before it lands): the proof that a data
 *          path is a module
 *   verbs  the same two proxies with --rdma-device: the receiving proxy
 *          pulls each chunk by RDMA READ (failpoint rdma.read holds a READ
 *          there, its slot posted). Needs an RDMA device named by
 *          $KVSTAGE_TEST_RDMA_DEVICE: tools/run-tests.sh runs this suite
 *          again in the soft-RoCE guest with rxe0; elsewhere these cases
 *          skip and say so
 *
 * Scenarios: bytes verified from 1 byte to many chunks; DESIGN's decisive
 * scenario; an abort at every phase from either side; the sending side's
 * death mid-transfer; a forged descriptor; and every one ends with each
 * pool fully free and the path still serving.
 */
#include <assert.h>
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <errno.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "decisive_across.h"
#include "layout.h"
#include "xroom.h"

#define SECRET "kvstage-conformance-secret-0123456789"

enum kind { X_LOCAL, X_TCP, X_RELAY, X_VERBS, X_NKINDS };

static const char *const kind_name[X_NKINDS] = { "local", "tcp", "relay", "verbs" };

/* What a scenario needs to know of a transport. */
struct xport {
	bool two_proxies;    /* the halves are on two proxies */
	const char *hold_fp; /* failpoint that holds a chunk in flight */
	bool posts_slot;     /* the receiving proxy posts a slot before bytes arrive */
	bool hold_at_rx;     /* hold_fp is the receiving proxy's (else the sending one's) */
};

static const struct xport xports[X_NKINDS] = {
	[X_LOCAL] = { false, "local.quiesce", false, false },
	[X_TCP] = { true, "tcp.payload", true, false },
	[X_RELAY] = { true, "relay.land", true, true },
	[X_VERBS] = { true, "rdma.read", true, true },
};

static struct proxy p_rx = PROXY_INIT, p_tx = PROXY_INIT;
static struct proxy *rxp, *txp; /* the same proxy for local */
static enum kind cur_kind;
static const char *cur_bin;	 /* the path's kvstaged: NULL for the build's */
static const char *cur_args[12]; /* ... and its options */

static void setup(void)
{
	setenv("KVSTAGE_PEER_SECRET", SECRET, 1);
}

static void teardown(void)
{
	proxy_stop(&p_rx);
	proxy_stop(&p_tx);
}

TestSuite(conformance, .init = setup, .fini = teardown, .timeout = 120);

/* Starts the path for kind, each proxy with a pool of slots x 64 KiB. */
static const struct xport *path(enum kind k, const char *slots)
{
	cr_log_info("transport %s", kind_name[k]);
	cur_kind = k;
	const char *dev = getenv("KVSTAGE_TEST_RDMA_DEVICE");
	if (k == X_VERBS && !(dev && *dev))
		cr_skip_test("verbs: no RDMA device here ($KVSTAGE_TEST_RDMA_DEVICE unset); "
			     "tools/run-tests.sh runs these cases on rxe0 in the soft-RoCE guest");
	/* The ASan pass in the guest runs only the kind the host cannot. */
	const char *only = getenv("KVSTAGE_TEST_ONLY_KIND");
	if (only && *only && strcmp(only, kind_name[k]))
		cr_skip_test(
			"%s: this run is for %s only ($KVSTAGE_TEST_ONLY_KIND); the %s cases run "
			"in the other passes",
			kind_name[k], only, kind_name[k]);
	/* Each kind says its data path: in the soft-RoCE guest, --transport
	 * auto would give the tcp kind RDMA too. */
	/* The default --peer-timeout: nothing here may wait on the ping cadence. */
	const char *args[] = { "--slots",  slots,	  "--slot-size",
			       "64K",	   "--transport", k == X_VERBS ? "verbs" : "tcp",
			       "--listen", "127.0.0.1:0", NULL,
			       NULL,	   NULL };
	if (k == X_LOCAL)
		args[6] = NULL;
	if (k == X_VERBS) {
		args[8] = "--rdma-device";
		args[9] = dev;
	}
	const char *bin = NULL; /* kvstaged */
	if (k == X_RELAY) {
		args[8] = "--relay-chunks";
		bin = build_path("tests/kvstaged-relay");
	}
	cur_bin = bin;
	static_assert(sizeof(args) <= sizeof(cur_args), "cur_args holds a path's options");
	memcpy(cur_args, args, sizeof(args));
	proxy_start(&p_rx, bin, args);
	rxp = txp = &p_rx;
	if (xports[k].two_proxies) {
		proxy_start(&p_tx, bin, args);
		txp = &p_tx;
	}
	return &xports[k];
}

/* Every slot free and no room open on every proxy of the path, then one
 * more room goes through: the path still serves. */
static void path_ends_clean(kvs_client *rx, kvs_client *tx)
{
	uint64_t reads = stat_get(rxp, "rdma_reads");
	uint64_t relayed = cur_kind == X_RELAY ? stat_get(rxp, "relay_chunks") : 0;
	if (cur_kind == X_VERBS) /* an abort may have cost a session its queue pair: made again */
		for (uint64_t n;
		     (n = stat_get(txp, "peer_sessions")) > stat_get(txp, "rdma_sessions");)
			stat_wait(txp, "rdma_sessions", 1, n);
	one_room(rx, tx, 0xC1EA);
	if (cur_kind == X_VERBS) /* and it did not fall back to the sockets */
		cr_assert_geq(stat_get(rxp, "rdma_reads"), reads + 3,
			      "the room's 3 chunks came by READ");
	else /* and --transport tcp kept RDMA out, even where a device is */
		cr_assert_eq(stat_get(rxp, "rdma_reads"), 0, "%s: chunks came by READ",
			     kind_name[cur_kind]);
	if (cur_kind == X_RELAY) /* and the relay carried it, not the stream */
		cr_assert_geq(stat_get(rxp, "relay_chunks"), relayed + 3,
			      "the room's 3 chunks came by the relay");
	kvs_close(tx);
	kvs_close(rx);
	wait_idle(rxp, 0);
	wait_idle(txp, 0);
}

static struct proxy *holder(const struct xport *x)
{
	return x->hold_at_rx ? rxp : txp;
}

/* Holds the next chunk of the room whose user_data's low 16 bits are owner's. */
static void hold(const struct xport *x, uint64_t owner)
{
	cr_assert_eq(kvs_admin_fp_set_mask(holder(x)->admin, x->hold_fp, "pause", owner, 0xffff),
		     0);
}

static void let_go(const struct xport *x)
{
	fp_set(holder(x), x->hold_fp, "off", NULL);
}

/* The held chunk is in flight: inside the transport, and (where the
 * receiving proxy posts slots) its slot posted there. */
static void wait_held(const struct xport *x, uint64_t posted_before)
{
	fp_wait(holder(x), x->hold_fp, 1);
	if (x->posts_slot)
		stat_wait(rxp, "slots.recv_posted", 1, posted_before + 1);
}

static enum kind kinds[X_NKINDS] = { X_LOCAL, X_TCP, X_RELAY, X_VERBS };

/* ------------------------------------------------------------- bytes */

ParameterizedTestParameters(conformance, rooms_of_one_byte_to_many_chunks_arrive_byte_for_byte)
{
	return cr_make_param_array(enum kind, kinds, X_NKINDS);
}

ParameterizedTest(enum kind *k, conformance, rooms_of_one_byte_to_many_chunks_arrive_byte_for_byte)
{
	path(*k, "128");
	kvs_client *rx = connect_ok(rxp), *tx = connect_ok(txp);
	/* The first room, four chunks, comes before either proxy had a quiet
	 * quarter of --peer-timeout to send a PING in: nothing it needs (the
	 * OPEN_ACK, an RDMA_HELLO, a chunk's ack) waits for one. */
	one_room(rx, tx, 0xf00);
	cr_assert_eq(stat_get(rxp, "peer_pings") + stat_get(txp, "peer_pings"), 0,
		     "a room waited for a PING");
	const uint64_t sizes[] = { 1, 100, SLOT - 1, SLOT, SLOT + 1, 7 * SLOT + 5, 20 * SLOT };
	enum { N = sizeof(sizes) / sizeof(sizes[0]) };
	struct xroom x[N];
	for (unsigned i = 0; i < N; i++)
		xroom_open(&x[i], rx, tx, sizes[i], 0x100 + i);
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
	path_ends_clean(rx, tx);
}

/* ---------------------------------------------------------- decisive */

ParameterizedTestParameters(conformance, decisive_late_bytes_never_land_in_a_reused_slot)
{
	return cr_make_param_array(enum kind, kinds, X_NKINDS);
}

/* DESIGN's scenario: A's chunk held in flight, A's room aborted from the
 * decode side, client B leases every slot of the receiving pool and stamps
 * it, then A's chunk is let go. B never gets a slot A's chunk can still
 * reach (by READ: the posted slot, a tombstone; by the stream: none, the
 * rest goes to the sink), and B's bytes stay B's. */
ParameterizedTest(enum kind *k, conformance, decisive_late_bytes_never_land_in_a_reused_slot)
{
	const struct xport *x = path(*k, "16");
	if (x->posts_slot) {
		struct decisive o = decisive_hold(txp, rxp, holder(x), x->hold_fp);
		if (*k == X_VERBS)
			decisive_expect_tombstone(&o);
		else
			decisive_expect_sunk(&o);
		kvs_client *rx = connect_ok(rxp), *tx = connect_ok(txp);
		path_ends_clean(rx, tx);
		return;
	}
	/* One pool: the slot in flight is the sender's own lease. */
	kvs_client *rx = connect_ok(rxp), *tx = connect_ok(txp), *b = connect_ok(rxp);
	struct xroom a;
	hold(x, A_TX);
	xroom_open(&a, rx, tx, SLOT, A_TX);
	struct kvs_lease l;
	cr_assert_eq(kvs_acquire(tx, 1, &l), 0);
	uint32_t victim = l.slot;
	canary_fill(kvs_lease_ptr(tx, &l), A_TX, 0, SLOT);
	cr_assert_eq(kvs_send(a.sr, &l, 0, SLOT), 0);
	wait_held(x, 0);
	cr_assert_eq(kvs_abort(a.rr), 0);
	sync_barrier(rx);
	cr_assert_eq(slot_pub(rxp, victim).state, KVS_SLOT_TOMBSTONE);
	struct kvs_lease bl[DECISIVE_SLOTS];
	bool got_victim = false;
	unsigned nb = xroom_drain_pool(b, bl, DECISIVE_SLOTS, B_OWNER, victim, &got_victim);
	cr_assert(!got_victim, "B was given the slot still in flight");
	cr_assert_eq(nb, DECISIVE_SLOTS - 1, "B gets every slot but the tombstone");
	let_go(x);
	cr_assert_eq(wait_event(rx).type, KVS_EV_ABORTED);
	cr_assert_eq(wait_event(tx).type, KVS_EV_ABORTED);
	for (unsigned i = 0; i < nb; i++) {
		cr_assert_eq(canary_check(kvs_lease_ptr(b, &bl[i]), B_OWNER, bl[i].slot, SLOT),
			     SLOT, "B's slot %u changed under it", bl[i].slot);
		kvs_release(b, &bl[i]);
	}
	xroom_close(&a);
	kvs_close(b);
	path_ends_clean(rx, tx);
}

/* ------------------------------------------------------------ aborts */

enum phase { P_BEFORE_SEND, P_BETWEEN_CHUNKS, P_HELD, P_LAST_HELD, P_NPHASES };
static const char *const phase_name[P_NPHASES] = { "before any send", "between chunks",
						   "a chunk held in flight",
						   "the last chunk held in flight" };

struct abort_case {
	enum kind kind;
	enum phase phase;
	bool from_receiver;
};

ParameterizedTestParameters(conformance, an_abort_at_every_phase_from_either_side)
{
	static struct abort_case c[X_NKINDS * P_NPHASES * 2];
	unsigned n = 0;
	for (unsigned k = 0; k < X_NKINDS; k++)
		for (unsigned p = 0; p < P_NPHASES; p++)
			for (unsigned s = 0; s < 2; s++)
				c[n++] = (struct abort_case){ (enum kind)k, (enum phase)p, s };
	return cr_make_param_array(struct abort_case, c, n);
}

/* A room of three chunks aborted by one side at one phase: both sides end
 * ABORTED, a held chunk let go afterwards never completes the room, and the
 * pools end free. */
ParameterizedTest(struct abort_case *c, conformance, an_abort_at_every_phase_from_either_side)
{
	const struct xport *x = path(c->kind, "64");
	cr_log_info("abort %s, from the %s", phase_name[c->phase],
		    c->from_receiver ? "receiver" : "sender");
	kvs_client *rx = connect_ok(rxp), *tx = connect_ok(txp);
	one_room(rx, tx, 0x10); /* the path is up (a tcp session exists) */
	const uint64_t owner = 0x2A;
	struct xroom r;
	xroom_open(&r, rx, tx, 3 * SLOT, owner);
	uint64_t moved = stat_get(rxp, "chunks_moved");
	uint64_t posted = stat_get(rxp, "slots.recv_posted");
	unsigned sends = c->phase == P_BEFORE_SEND ? 0 : c->phase == P_LAST_HELD ? 3 : 2;
	bool held = c->phase == P_HELD || c->phase == P_LAST_HELD;
	for (unsigned i = 0; i < sends; i++) {
		bool this_held = held && i == sends - 1;
		if (this_held)
			hold(x, owner | 1ull << 40);
		struct kvs_lease l;
		cr_assert_eq(kvs_acquire(tx, 1, &l), 0);
		canary_fill(kvs_lease_ptr(tx, &l), owner, (uint64_t)i * SLOT, SLOT);
		cr_assert_eq(kvs_send(r.sr, &l, (uint64_t)i * SLOT, SLOT), 0);
		if (this_held)
			wait_held(x, posted);
		else
			stat_wait(rxp, "chunks_moved", 1, moved + i + 1); /* it landed */
	}
	if (c->phase == P_BETWEEN_CHUNKS)
		sends = 1; /* two went; the third never will */
	uint64_t aborted = stat_get(holder(x), "rooms_aborted");
	cr_assert_eq(kvs_abort(c->from_receiver ? r.rr : r.sr), 0);
	if (held) {
		/* Barrier: the proxy that holds the chunk knows of the abort (its
		 * own side's, or the peer's ABORT) before the chunk goes on: else a
		 * chunk let go first may complete the room, which is another
		 * (legitimate) ending than this test's. */
		stat_wait(holder(x), "rooms_aborted", 1, aborted + 1);
		let_go(x);
	}
	struct kvs_event et = wait_event(tx), er = wait_event(rx);
	cr_assert_eq(et.type, KVS_EV_ABORTED, "%s, abort %s from the %s: sender got %u (%s)",
		     kind_name[c->kind], phase_name[c->phase],
		     c->from_receiver ? "receiver" : "sender", et.type, kvs_strerror(et.status));
	cr_assert_eq(er.type, KVS_EV_ABORTED, "%s, abort %s from the %s: receiver got %u (%s)",
		     kind_name[c->kind], phase_name[c->phase],
		     c->from_receiver ? "receiver" : "sender", er.type, kvs_strerror(er.status));
	xroom_close(&r);
	path_ends_clean(rx, tx);
}

/* ------------------------------------------------------------- death */

ParameterizedTestParameters(conformance, the_sending_side_dies_mid_transfer)
{
	return cr_make_param_array(enum kind, kinds, X_NKINDS);
}

/* A sender process that opens the room on desc and sends one held chunk,
 * then waits to be killed. */
static pid_t doomed_sender(const struct kvs_room_desc *d, int ready_wr)
{
	fflush(NULL);
	pid_t pid = fork();
	cr_assert_geq(pid, 0);
	if (pid)
		return pid;
	kvs_client *c;
	kvs_room *sr;
	struct kvs_lease l;
	if (kvs_connect(txp->sock, &c) || kvs_send_open(c, d, 0x3D | 1ull << 40, &sr) ||
	    kvs_acquire(c, 1, &l))
		_exit(1);
	canary_fill(kvs_lease_ptr(c, &l), 0x3D, 0, SLOT);
	if (kvs_send(sr, &l, 0, SLOT) || write(ready_wr, "x", 1) != 1)
		_exit(1);
	for (;;)
		pause();
}

/* The sending side dies with a chunk in flight: its client process
 * (local), or its whole proxy (tcp). The receiver's room ends, its slots
 * come back, and another sender is served. */
ParameterizedTest(enum kind *k, conformance, the_sending_side_dies_mid_transfer)
{
	const struct xport *x = path(*k, "64");
	kvs_client *rx = connect_ok(rxp);
	struct xroom r;
	uint64_t posted = stat_get(rxp, "slots.recv_posted");
	cr_assert_eq(kvs_recv_open(rx, 2 * SLOT, 0x3D, &r.rr, &r.d), 0);
	hold(x, 0x3D | 1ull << 40);
	int p[2];
	cr_assert_eq(pipe(p), 0);
	pid_t pid = doomed_sender(&r.d, p[1]);
	char ch;
	cr_assert_eq(read(p[0], &ch, 1), 1, "the sender process failed before its send");
	wait_held(x, posted);
	if (x->two_proxies)
		proxy_kill(txp, SIGKILL);
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	close(p[0]);
	close(p[1]);
	/* Local: the room's end waits for the transport to let go of the
	 * dead client's chunk, as it must. */
	if (!x->two_proxies)
		let_go(x);
	struct kvs_event e = wait_event(rx);
	cr_assert(e.type == KVS_EV_ABORTED || e.type == KVS_EV_FAILED, "receiver got %u", e.type);
	cr_assert_eq(kvs_room_close(r.rr), 0);
	if (x->two_proxies) {
		proxy_stop(&p_tx);
		proxy_start(&p_tx, cur_bin, cur_args); /* the sending host, back */
	}
	kvs_client *tx = connect_ok(txp);
	path_ends_clean(rx, tx);
}

/* ------------------------------------------------------------ hostile */

ParameterizedTestParameters(conformance, a_forged_descriptor_opens_nothing)
{
	return cr_make_param_array(enum kind, kinds, X_NKINDS);
}

/* A descriptor with one token bit flipped is refused (at send_open, or by
 * the receiving proxy), the real room is untouched, and the genuine
 * descriptor still completes it. */
ParameterizedTest(enum kind *k, conformance, a_forged_descriptor_opens_nothing)
{
	path(*k, "64");
	kvs_client *rx = connect_ok(rxp), *tx = connect_ok(txp);
	struct xroom r;
	cr_assert_eq(kvs_recv_open(rx, SLOT, 0x4F, &r.rr, &r.d), 0);
	r.bytes = SLOT;
	r.owner = 0x4F;
	r.nchunks = 1;
	struct kvs_room_desc forged = r.d;
	forged.bytes[offsetof(struct kvs_desc_wire, token) + 3] ^= 0x01;
	kvs_room *fr;
	int rc = kvs_send_open(tx, &forged, 0x4F0, &fr);
	if (rc == 0) {
		struct kvs_event e = wait_event(tx);
		cr_assert(e.type == KVS_EV_FAILED || e.type == KVS_EV_REJECTED,
			  "the forged room got %u", e.type);
		cr_assert_eq(kvs_room_close(fr), 0);
	}
	cr_assert_eq(kvs_send_open(tx, &r.d, 0x4F | 1ull << 40, &r.sr), 0);
	xroom_send(&r, tx);
	cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
	cr_assert_eq(wait_event(rx).type, KVS_EV_RECV_DONE);
	xroom_verify(&r, rx);
	xroom_close(&r);
	path_ends_clean(rx, tx);
}

/* ------------------------------------------------------- the choice */

/* --transport auto: two proxies given no device find the one the host has
 * and pull chunks by READ; asked for tcp, the same host moves none by READ
 * (the tcp kind's every case checks that). Only where a device is. */
Test(conformance, auto_finds_the_device_and_reads)
{
	const char *dev = getenv("KVSTAGE_TEST_RDMA_DEVICE");
	if (!(dev && *dev))
		cr_skip_test("no RDMA device here ($KVSTAGE_TEST_RDMA_DEVICE unset): "
			     "tools/run-tests.sh runs this on rxe0 in the soft-RoCE guest");
	if (getenv("KVSTAGE_TEST_PROXY_ARGS") && strstr(getenv("KVSTAGE_TEST_PROXY_ARGS"), "rdma"))
		cr_skip_test(
			"KVSTAGE_TEST_PROXY_ARGS names a device already: nothing is left to find");
	const char *args[] = { "--slots",     "64",	     "--slot-size", "64K", "--listen",
			       "127.0.0.1:0", "--transport", "auto",	    NULL };
	proxy_start(&p_rx, NULL, args);
	proxy_start(&p_tx, NULL, args);
	rxp = &p_rx;
	txp = &p_tx;
	cur_kind = X_VERBS; /* path_ends_clean: the room's chunks must come by READ */
	kvs_client *rx = connect_ok(rxp), *tx = connect_ok(txp);
	path_ends_clean(rx, tx);
	char log[16384];
	proxy_log(&p_rx, log, sizeof(log));
	char want[96];
	snprintf(want, sizeof(want), "rdma: rail 0: %s port", dev);
	cr_assert(strstr(log, want), "the log does not say it uses %s:\n%s", dev, log);
}
