/* SPDX-License-Identifier: MIT */
/*
 * Proxies on loopback, joined by the tcp transport: real kvstaged
 * processes, engines as clients of each. Every room is canary-stamped and
 * checked byte for byte on its receiver; every test ends with both pools
 * fully free. Barriers only: counters (stat_wait) and failpoints.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "harness.h"
#include "decisive_across.h"
#include "xroom.h"

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

/* The default --peer-timeout: nothing here may wait on the ping cadence. */
#define LISTEN_N(px, n)                                                               \
	proxy_start(px, NULL,                                                         \
		    (const char *[]){ "--slots", n, "--slot-size", "64K", "--listen", \
				      "127.0.0.1:0", NULL })
#define LISTEN(px) LISTEN_N(px, "64")

/* Rooms of every size byte for byte are the conformance suite's; here: one
 * session carries every room, its bytes are counted by the path that moved
 * them, and kvstage-stat shows the session on both sides. */
Test(tcp, one_session_serves_every_room_and_kvstage_stat_shows_it)
{
	LISTEN(&pb);
	LISTEN(&pa);
	kvs_client *rx = connect_ok(&pb), *tx = connect_ok(&pa);
	const uint64_t sizes[] = { 1, SLOT + 1, 5 * SLOT + 4096 + 3 };
	uint64_t total = 0;
	for (unsigned i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
		struct xroom x;
		xroom_open(&x, rx, tx, sizes[i], 0x100 + i);
		xroom_send(&x, tx);
		cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
		struct kvs_event e = wait_event(rx);
		cr_assert_eq(e.type, KVS_EV_RECV_DONE, "room of %llu bytes: receiver got %u (%d)",
			     (unsigned long long)sizes[i], e.type, e.status);
		xroom_verify(&x, rx);
		xroom_close(&x);
		total += sizes[i];
	}
	cr_assert_eq(stat_get(&pa, "peer_sessions"), 1, "one session, reused by every room");
	const char *extra = getenv("KVSTAGE_TEST_PROXY_ARGS");
	if (extra && strstr(extra, "--rdma-device")) {
		/* The RDMA data path (run in the soft-RoCE guest): B pulled every byte. */
		cr_assert_geq(stat_get(&pb, "rdma_bytes_rx"), total, "the bytes came by RDMA READ");
		cr_assert_geq(stat_get(&pb, "rdma_reads"), sizeof(sizes) / sizeof(sizes[0]));
	} else {
		cr_assert_geq(stat_get(&pa, "tcp_bytes_tx"), total, "the bytes went over tcp");
		cr_assert_geq(stat_get(&pb, "tcp_bytes_rx"), total);
	}
	static char out[8192], err[1024];
	cr_assert_eq(run_cmd((const char *[]){ build_path("tools/kvstage-stat"), "--socket",
					       pa.sock, NULL },
			     out, sizeof(out), err, sizeof(err)),
		     0, "%s", err);
	cr_assert(strstr(out, "tcp       peers 1 "), "%s", out);
	cr_assert(strstr(out, "peer      127.0.0.1:"), "the dialed endpoint: %s", out);
	cr_assert(strstr(out, "  up  streams 2 "), "%s", out);
	cr_assert_eq(run_cmd((const char *[]){ build_path("tools/kvstage-stat"), "--json",
					       "--socket", pb.sock, NULL },
			     out, sizeof(out), err, sizeof(err)),
		     0);
	cr_assert(
		strstr(out, "\"peers\":[{\"endpoint\":\"accepted\",\"state\":\"up\",\"streams\":2"),
		"%s", out);
	kvs_close(rx);
	kvs_close(tx);
	wait_idle(&pa, 0);
	wait_idle(&pb, 0);
	cr_assert_eq(stat_get(&pb, "chunks_discarded"), 0);
}

/* The keys of JSON text j, in order, each and a blank into keys. */
static void json_keys(const char *j, char *keys, size_t cap)
{
	size_t n = 0;
	keys[0] = 0;
	for (const char *q = j; *q; q++) {
		if (*q != '"')
			continue;
		const char *e = q + 1;
		while (*e && *e != '"')
			e += *e == '\\' && e[1] ? 2 : 1;
		if (!*e)
			break;
		if (e[1] == ':' && n < cap)
			n += (size_t)snprintf(keys + n, cap - n, "%.*s ", (int)(e - q - 1), q + 1);
		q = e;
	}
}

/* The number at key in the object that starts at section ("\"tcp\":{"). */
static uint64_t json_at(const char *j, const char *section, const char *key)
{
	const char *o = strstr(j, section);
	cr_assert_not_null(o, "no %s in %s", section, j);
	const char *end = strchr(o, '}');
	char k[64];
	snprintf(k, sizeof(k), "\"%s\":", key);
	const char *v = strstr(o, k);
	cr_assert(v && v < end, "no %s in %s of %s", key, section, j);
	return strtoull(v + strlen(k), NULL, 10);
}

/* ABI 4 moved the data paths' counters into the counter block: --json
 * still has every key of ABI 3's, in its place, and each of those
 * counters' figures under its old key; its "counters" object walks the
 * block and has them all under their own names. */
Test(tcp, stat_json_keeps_every_key_and_figure_of_the_data_paths)
{
	LISTEN(&pb);
	LISTEN(&pa);
	kvs_client *rx = connect_ok(&pb), *tx = connect_ok(&pa);
	struct xroom x;
	xroom_open(&x, rx, tx, 3 * SLOT, 0x40);
	xroom_send(&x, tx);
	cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
	cr_assert_eq(wait_event(rx).type, KVS_EV_RECV_DONE);
	xroom_verify(&x, rx);
	xroom_close(&x);

	static const struct {
		const char *name, *section, *key;
	} moved[] = {
		{ "tcp_bytes_tx", "\"tcp\":{", "bytes_tx" },
		{ "tcp_bytes_rx", "\"tcp\":{", "bytes_rx" },
		{ "tcp_send_calls", "\"tcp\":{", "send_calls" },
		{ "tcp_recv_calls", "\"tcp\":{", "recv_calls" },
		{ "tcp_lowat_calls", "\"tcp\":{", "lowat_calls" },
		{ "tcp_zc_sends", "\"tcp\":{", "zerocopy_sends" },
		{ "tcp_zc_copied", "\"tcp\":{", "zerocopy_copied" },
		{ "rdma_reads", "\"rdma\":{", "reads" },
		{ "rdma_bytes_rx", "\"rdma\":{", "bytes_rx" },
		{ "rdma_binds", "\"rdma\":{", "binds" },
		{ "rdma_invalidates", "\"rdma\":{", "invalidates" },
		{ "rdma_regions", "\"rdma\":{", "regions" },
		{ "rdma_region_frees", "\"rdma\":{", "region_frees" },
		{ "rdma_reads_refused", "\"rdma\":{", "reads_refused" },
		{ "rdma_links_lost", "\"rdma\":{", "links_lost" },
		{ "rdma_sessions", "\"rdma\":{", "sessions" },
	};
	enum { N = sizeof(moved) / sizeof(moved[0]) };
	uint64_t lo[N], hi[N];
	for (unsigned i = 0; i < N; i++)
		lo[i] = stat_get(&pb, moved[i].name);
	static char out[16384], err[1024], keys[4096];
	cr_assert_eq(run_cmd((const char *[]){ build_path("tools/kvstage-stat"), "--json",
					       "--socket", pb.sock, NULL },
			     out, sizeof(out), err, sizeof(err)),
		     0, "%s", err);
	for (unsigned i = 0; i < N; i++)
		hi[i] = stat_get(&pb, moved[i].name);
	cr_assert_gt(hi[0] + hi[8], 0, "B answered by tcp or read by RDMA");

	/* main's (ABI 3's) keys, with B's one peer and one client */
	const char *want =
		"socket up draining pid instance uptime_s built_without slot_count slot_size "
		"pool_size hugepages locked failpoints slot_metadata_bytes slots free leased "
		"inflight tombstone recv_posted recv_filled rooms open done aborted failed "
		"timed_out clients now total closed died refused rejected stale perm busy inval "
		"token nobufs chunks_moved bytes_moved ops events events_dropped tombstones_reaped "
		"sleeps log_suppressed tcp peers lost auth_failed refused frames_refused "
		"frames_ignored crc_errors chunks_discarded bytes_tx bytes_rx deadlines evicted "
		"closed pings send_calls recv_calls epoll_waits epoll_ctls lowat_calls "
		"zerocopy_sends zerocopy_copied rdma reads bytes_rx binds invalidates regions "
		"region_frees reads_refused links_lost sessions peers endpoint state streams "
		"instance bytes_tx bytes_rx chunks_sunk rdma reads_refused keys trace written "
		"dropped clients_table id pid uid gid command since_ns leases inflight rooms_open "
		"rooms_done rooms_aborted rooms_failed ops rejects chunks_sent bytes_sent "
		"chunks_recv bytes_recv ";
	/* ... and "counters": every counter of the block under its own name,
	 * these and whatever else the data paths count (a rail's). */
	static char rest[16384];
	const char *cs = strstr(out, "\"counters\":{"), *ce = cs ? strchr(cs, '}') : NULL;
	cr_assert(cs && ce && ce[1] == ',', "no counters object in %s", out);
	snprintf(rest, sizeof(rest), "%.*s%s", (int)(cs - out), out, ce + 2);
	json_keys(rest, keys, sizeof(keys));
	cr_assert_str_eq(keys, want, "%s", out);
	for (unsigned i = 0; i < N; i++) {
		uint64_t v = json_at(out, moved[i].section, moved[i].key);
		cr_assert(lo[i] <= v && v <= hi[i], "%s: %llu in --json, %llu to %llu",
			  moved[i].name, (unsigned long long)v, (unsigned long long)lo[i],
			  (unsigned long long)hi[i]);
		v = json_at(out, "\"counters\":{", moved[i].name);
		cr_assert(lo[i] <= v && v <= hi[i], "%s: %llu in counters, %llu to %llu",
			  moved[i].name, (unsigned long long)v, (unsigned long long)lo[i],
			  (unsigned long long)hi[i]);
	}
	kvs_close(rx);
	kvs_close(tx);
	wait_idle(&pa, 0);
	wait_idle(&pb, 0);
}

/* ------------------------------------------------ the decisive scenario */

/* The suite runs twice: over the sockets, and (in the soft-RoCE guest, with
 * KVSTAGE_TEST_PROXY_ARGS=--rdma-device rxe0) with chunks pulled by RDMA
 * READ. A chunk is held in flight by tcp.payload on the sending proxy over
 * the sockets, by rdma.read on the receiving proxy over RDMA. */
static bool by_rdma(void)
{
	const char *e = getenv("KVSTAGE_TEST_PROXY_ARGS");
	return e && strstr(e, "--rdma-device");
}

static const char *hold_fp(void)
{
	return by_rdma() ? "rdma.read" : "tcp.payload";
}

static struct proxy *hold_px(struct proxy *from, struct proxy *to)
{
	return by_rdma() ? to : from;
}

static struct decisive decisive_loopback(const char *rx_bin)
{
	proxy_start(&pb, rx_bin,
		    (const char *[]){ "--slots", "16", "--slot-size", "64K", "--listen",
				      "127.0.0.1:0", "--tcp-streams", "1", NULL });
	LISTEN(&pa);
	return decisive_hold(&pa, &pb, hold_px(&pa, &pb), hold_fp());
}

/* The red half: a receiving proxy that lets go of the slot at the abort
 * while the payload still comes (kvstaged-vulnerable). By RDMA READ the
 * late READ still goes, but the chunk's key died with the abort on the
 * sending proxy: its NIC refuses the READ, and even this receiver's bug
 * costs B nothing. */
Test(tcp, decisive_vulnerable_receiver_is_caught_corrupting)
{
	struct decisive o = decisive_loopback(proxy_vulnerable_bin());
	cr_assert_neq(o.state_after_abort, KVS_SLOT_TOMBSTONE,
		      "the vulnerable receiver frees at once");
	cr_assert(o.b_got_victim, "B is given the slot the late payload writes into");
	if (by_rdma()) {
		cr_assert(o.b_intact, "the late READ got through a revoked key into B's slot");
		cr_assert(!o.victim_has_a, "A's chunk is in B's slot");
		return;
	}
	/* The honest one may free it as soon (over the stream): what it never
	 * does is let the payload in after. */
	cr_assert(!o.b_intact, "the late bytes landed in B's slot: the corruption detected");
	cr_assert(o.victim_has_a, "what B's slot holds now is A's chunk");
}

/* ------------------------------------------------------- abort waves */

#define WAVE_ROOMS 24
#define WAVE_CHUNKS 4
#define VICTIM_BIT (1ull << 20)

/* nP sending proxies, nD receiving ones (all on loopback); room i goes from
 * sender i % nP to receiver i % nD. Eight victims are aborted mid-transfer,
 * from either side, while at least one of their payloads is held on a
 * sending proxy; then everything is let go. */
static void wave(unsigned nP, unsigned nD)
{
	struct proxy *all[3] = { &pa, &pb, &pc };
	struct proxy *P[2], *D[2];
	unsigned k = 0;
	for (unsigned i = 0; i < nP; i++)
		P[i] = all[k++];
	for (unsigned i = 0; i < nD; i++)
		D[i] = all[k++];
	for (unsigned i = 0; i < nP + nD; i++)
		LISTEN_N(all[i], "256");
	kvs_client *tx[2], *rx[2];
	for (unsigned i = 0; i < nP; i++)
		tx[i] = connect_ok(P[i]);
	for (unsigned i = 0; i < nD; i++)
		rx[i] = connect_ok(D[i]);
	struct proxy **H = by_rdma() ? D : P; /* where chunks are held: see hold_px */
	unsigned nH = by_rdma() ? nD : nP;
	for (unsigned i = 0; i < nH; i++) {
		int rc = kvs_admin_fp_set_mask(H[i]->admin, hold_fp(), "pause", VICTIM_BIT,
					       VICTIM_BIT); /* victims' chunks only */
		cr_assert_eq(rc, 0);
	}
	static struct xroom x[WAVE_ROOMS];
	for (unsigned i = 0; i < WAVE_ROOMS; i++) {
		bool victim = i % 3 == 0; /* 8 of 24 */
		xroom_open(&x[i], rx[i % nD], tx[i % nP], WAVE_CHUNKS * SLOT - 100,
			   0x1000 + i + (victim ? VICTIM_BIT : 0));
	}
	for (unsigned i = 0; i < WAVE_ROOMS; i++)
		xroom_send(&x[i], tx[i % nP]);
	for (unsigned i = 0; i < nH; i++)
		fp_wait(H[i], hold_fp(), 1); /* a victim's chunk is held on every holding proxy */
	for (unsigned i = 0; i < WAVE_ROOMS; i += 3)
		cr_assert_eq(kvs_abort(i % 2 ? x[i].sr : x[i].rr), 0);
	/* kvs_abort only queues the op: let every proxy act on its clients'
	 * aborts before the holds go, or a victim on a proxy slower than its
	 * peer (ASan in the guest) completes first and its abort is too late. */
	for (unsigned i = 0; i < nP; i++)
		sync_barrier(tx[i]);
	for (unsigned i = 0; i < nD; i++)
		sync_barrier(rx[i]);
	for (unsigned i = 0; i < nH; i++)
		fp_set(H[i], hold_fp(), "off", NULL);

	uint32_t rxf[WAVE_ROOMS] = { 0 }, txf[WAVE_ROOMS] = { 0 };
	kvs_client *cl[4];
	struct pollfd pfd[4];
	unsigned ncl = 0;
	for (unsigned i = 0; i < nP; i++)
		cl[ncl++] = tx[i];
	for (unsigned i = 0; i < nD; i++)
		cl[ncl++] = rx[i];
	for (unsigned c = 0; c < ncl; c++)
		pfd[c] = (struct pollfd){ kvs_event_fd(cl[c]), POLLIN, 0 };
	for (unsigned finals = 0; finals < 2 * WAVE_ROOMS;) {
		unsigned got = 0;
		for (unsigned c = 0; c < ncl; c++) {
			struct kvs_event e[16];
			int n = kvs_poll(cl[c], e, 16);
			cr_assert_geq(n, 0);
			for (int j = 0; j < n; j++) {
				unsigned i = (unsigned)(e[j].user_data & 0xfff);
				cr_assert_lt(i, WAVE_ROOMS);
				(c < nP ? txf : rxf)[i] = e[j].type;
			}
			got += (unsigned)n;
		}
		finals += got;
		if (!got && finals < 2 * WAVE_ROOMS)
			cr_assert_gt(poll(pfd, ncl, WAIT_MS), 0, "no final for %u s",
				     WAIT_MS / 1000);
	}
	for (unsigned i = 0; i < WAVE_ROOMS; i++) {
		if (i % 3 == 0) {
			cr_assert_eq(rxf[i], KVS_EV_ABORTED, "victim %u: receiver got %u", i,
				     rxf[i]);
			cr_assert_eq(txf[i], KVS_EV_ABORTED, "victim %u: sender got %u", i, txf[i]);
		} else {
			cr_assert_eq(rxf[i], KVS_EV_RECV_DONE, "room %u: receiver got %u", i,
				     rxf[i]);
			cr_assert_eq(txf[i], KVS_EV_SEND_DONE, "room %u: sender got %u", i, txf[i]);
			xroom_verify(&x[i], rx[i % nD]);
		}
		xroom_close(&x[i]);
	}
	for (unsigned i = 0; i < nP; i++)
		kvs_close(tx[i]);
	for (unsigned i = 0; i < nD; i++)
		kvs_close(rx[i]);
	for (unsigned i = 0; i < nP + nD; i++) {
		cr_assert_eq(kill(all[i]->pid, 0), 0, "a proxy died");
		wait_idle(all[i], 0);
	}
}

Test(tcp, abort_wave_2p1d)
{
	wave(2, 1);
}

Test(tcp, abort_wave_1p2d)
{
	wave(1, 2);
}

/* ----------------------------------------------------- peers that fail */

/* A room from a client of from to a client of to, its one chunk held at
 * from with the header sent: in flight on both proxies. */
static void held_room(struct xroom *x, struct proxy *from, kvs_client *tx, struct proxy *to,
		      kvs_client *rx, uint64_t owner)
{
	uint64_t posted = stat_get(to, "slots.recv_posted");
	struct proxy *h = hold_px(from, to);
	cr_assert_eq(kvs_admin_fp_set_mask(h->admin, hold_fp(), "pause", owner, 0xffff), 0);
	xroom_open(x, rx, tx, SLOT, owner);
	xroom_send(x, tx);
	fp_wait(h, hold_fp(), 1);
	stat_wait(to, "slots.recv_posted", 1, posted + 1);
}

Test(tcp, a_sender_proxy_killed_mid_transfer_fails_its_rooms_and_leaks_nothing)
{
	LISTEN(&pb);
	LISTEN(&pa);
	LISTEN(&pc);
	kvs_client *rx = connect_ok(&pb), *tx = connect_ok(&pa), *tx2 = connect_ok(&pc);
	struct xroom x;
	held_room(&x, &pa, tx, &pb, rx, 0x77);
	proxy_kill(&pa, SIGKILL);
	struct kvs_event e = wait_event(rx);
	cr_assert_eq(e.type, KVS_EV_FAILED, "the receiver's room fails, got %u", e.type);
	cr_assert_eq(kvs_room_close(x.rr), 0);
	wait_idle(&pb, 2); /* the posted slot is free again: nothing leaked */
	cr_assert_eq(stat_get(&pb, "peer_lost"), 1);
	one_room(rx, tx2, 0x78); /* and another sender is served as before */
	kvs_close(tx);
	kvs_close(tx2);
	kvs_close(rx);
	wait_idle(&pb, 0);
}

Test(tcp, a_receiver_proxy_killed_mid_transfer_fails_the_senders_rooms)
{
	LISTEN(&pb);
	LISTEN(&pa);
	LISTEN(&pc);
	kvs_client *rx = connect_ok(&pb), *tx = connect_ok(&pa), *rx2 = connect_ok(&pc);
	struct xroom x;
	held_room(&x, &pa, tx, &pb, rx, 0x55);
	proxy_kill(&pb, SIGKILL);
	struct kvs_event e = wait_event(tx);
	cr_assert_eq(e.type, KVS_EV_FAILED, "the sender's room fails, got %u", e.type);
	cr_assert_eq(kvs_room_close(x.sr), 0);
	if (!by_rdma()) /* over RDMA the hold was on the proxy that died */
		fp_set(&pa, "tcp.payload", "off", NULL);
	wait_idle(&pa, 1); /* its slot was released with the session */
	one_room(rx2, tx, 0x56);
	kvs_close(tx);
	kvs_close(rx2);
	kvs_close(rx);
	wait_idle(&pa, 0);
}

/* Two seconds of --peer-timeout: a handshake gets a quarter of it, and in
 * the qemu guest under ASan with RDMA a session took over the 75 ms that
 * 300 gave (the dialer lost it, "Connection timed out", before its first
 * room). */
Test(tcp, a_peer_stopped_past_the_peer_timeout_is_lost_on_both_sides)
{
	const char *args[] = { "--slots",  "64",	  "--slot-size",    "64K",
			       "--listen", "127.0.0.1:0", "--peer-timeout", "2000",
			       NULL };
	proxy_start(&pb, NULL, args);
	proxy_start(&pa, NULL, args);
	kvs_client *rx = connect_ok(&pb), *tx = connect_ok(&pa);
	one_room(rx, tx, 0x30); /* the session is up */
	struct xroom x;
	xroom_open(&x, rx, tx, 2 * SLOT, 0x31);
	proxy_freeze(&pb);
	xroom_send(&x, tx);
	struct kvs_event e = wait_event(tx); /* after 2 s of silence */
	cr_assert_eq(e.type, KVS_EV_FAILED);
	cr_assert_eq(e.status, -ETIMEDOUT, "got %s", kvs_strerror(e.status));
	kill(pb.pid, SIGCONT);
	e = wait_event(rx); /* it wakes to a closed connection */
	cr_assert_eq(e.type, KVS_EV_FAILED);
	xroom_close(&x);
	wait_idle(&pa, 1);
	wait_idle(&pb, 1);
	one_room(rx, tx, 0x32); /* a new session serves the next room */
	kvs_close(tx);
	kvs_close(rx);
}

/* SIGTERM on the receiving proxy with a remote room in flight: it tells its
 * peers (BYE: no new rooms towards it), aborts the room at the end of its
 * grace, and exits once both halves quiesced, with status 0. */
Test(tcp, a_draining_proxy_tells_its_peers_and_exits_quiesced)
{
	proxy_start(&pb, NULL,
		    (const char *[]){ "--slots", "64", "--slot-size", "64K", "--listen",
				      "127.0.0.1:0", "--shutdown-grace", "200", NULL });
	LISTEN(&pa);
	kvs_client *rx = connect_ok(&pb), *tx = connect_ok(&pa);
	struct xroom x;
	held_room(&x, &pa, tx, &pb, rx, 0x61);
	struct kvs_room_desc d2; /* a room made before the drain, opened after it */
	kvs_room *r2;
	cr_assert_eq(kvs_recv_open(rx, SLOT, 0x62, &r2, &d2), 0);
	kill(pb.pid, SIGTERM);
	stat_wait(&pa, "peer_byes", 1, 1);
	kvs_room *s2;
	cr_assert_eq(kvs_send_open(tx, &d2, 0x63, &s2), -ESHUTDOWN,
		     "a draining peer takes no new room");
	/* Over RDMA, A's slot is B's to READ until B's ack: A's room can end
	 * only once B's held READ has gone. Over the sockets it ends at B's
	 * abort, its payload still held here. */
	if (by_rdma()) {
		stat_wait(&pb, "rooms_aborted", 1, 1); /* B's grace is over: it aborted */
		fp_set(&pb, hold_fp(), "off", NULL);
	}
	struct kvs_event e = wait_event(tx); /* the grace ended: B aborted the held room */
	cr_assert_eq(e.type, KVS_EV_ABORTED, "got %u", e.type);
	cr_assert_eq(e.status, -ESHUTDOWN, "%s", kvs_strerror(e.status));
	if (!by_rdma())
		fp_set(&pa, hold_fp(), "off",
		       NULL); /* the held payload leaves; both sides quiesce */
	int st;
	cr_assert_eq(reap(pb.pid, &st), pb.pid, "the draining proxy did not exit");
	pb.pid = 0;
	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "exit status %d", st);
	cr_assert_eq(kvs_room_close(x.sr), 0);
	kvs_close(tx);
	wait_idle(&pa, 0);
	kvs_close(rx);
}

/* ------------------------------------------------------ batched writes */

#define SMALL 4096
#define BATCH_CHUNKS 32

/* Chunks owed on a connection at once leave several to a sendmsg: a room's
 * chunks, queued together when its OPEN_ACK comes (its OPEN waited behind
 * a payload held at tcp.payload), cost fewer sendmsg calls than half their
 * number, and arrive byte for byte. */
Test(tcp, chunks_owed_at_once_leave_several_to_a_sendmsg)
{
	if (by_rdma())
		cr_skip_test("chunks go by RDMA READ in this run");
	const char *args[] = { "--slots",  "64",	  "--slot-size",   "4K",
			       "--listen", "127.0.0.1:0", "--tcp-streams", "1",
			       NULL };
	proxy_start(&pb, NULL, args);
	proxy_start(&pa, NULL, args);
	kvs_client *rx = connect_ok(&pb), *tx = connect_ok(&pa);
	cr_assert_eq(kvs_admin_fp_set_mask(pa.admin, "tcp.payload", "pause", 0x70, 0xffff), 0);
	kvs_room *rr[2], *sr[2];
	struct kvs_room_desc d[2];
	const uint64_t owner[2] = { 0x70, 0x71 };
	const unsigned chunks[2] = { 1, BATCH_CHUNKS };
	for (unsigned r = 0; r < 2; r++) {
		cr_assert_eq(kvs_recv_open(rx, chunks[r] * SMALL, owner[r], &rr[r], &d[r]), 0);
		cr_assert_eq(kvs_send_open(tx, &d[r], owner[r], &sr[r]), 0);
		for (unsigned k = 0; k < chunks[r]; k++) {
			struct kvs_lease l;
			cr_assert_eq(kvs_acquire(tx, 1, &l), 0);
			canary_fill(kvs_lease_ptr(tx, &l), owner[r], k * SMALL, SMALL);
			cr_assert_eq(kvs_send(sr[r], &l, k * SMALL, SMALL), 0);
		}
		if (r == 0)
			fp_wait(&pa, "tcp.payload", 1); /* its header left, its payload waits */
	}
	sync_barrier(tx); /* every chunk of the second room is A's, waiting for its OPEN_ACK */
	uint64_t sends = stat_get(&pa, "tcp_send_calls");
	fp_set(&pa, "tcp.payload", "off", NULL);
	for (unsigned r = 0; r < 2; r++) {
		cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
		cr_assert_eq(wait_event(rx).type, KVS_EV_RECV_DONE);
	}
	sends = stat_get(&pa, "tcp_send_calls") - sends;
	cr_assert_lt(sends, BATCH_CHUNKS / 2, "%llu sendmsg calls for %u chunks",
		     (unsigned long long)sends, BATCH_CHUNKS + 1);
	for (unsigned k = 0; k < BATCH_CHUNKS; k++) {
		struct kvs_lease l;
		cr_assert_eq(kvs_room_lease(rr[1], k, &l), 0);
		cr_assert_eq(canary_check(kvs_lease_ptr(rx, &l), owner[1], k * SMALL, SMALL), SMALL,
			     "chunk %u: wrong bytes", k);
	}
	for (unsigned r = 0; r < 2; r++) {
		cr_assert_eq(kvs_room_close(rr[r]), 0);
		cr_assert_eq(kvs_room_close(sr[r]), 0);
	}
	kvs_close(tx);
	kvs_close(rx);
	wait_idle(&pa, 0);
	wait_idle(&pb, 0);
}

/* Sends a room of bytes in chunks of BIG_SLOT from tx, owner's canary. */
#define BIG_SLOT (2u << 20)
static kvs_room *big_room_send(kvs_client *rx, kvs_client *tx, uint64_t bytes, uint64_t owner,
			       kvs_room **sr)
{
	kvs_room *rr;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(rx, bytes, owner, &rr, &d), 0);
	cr_assert_eq(kvs_send_open(tx, &d, owner, sr), 0);
	for (uint64_t off = 0; off < bytes; off += BIG_SLOT) {
		uint32_t len = (uint32_t)(bytes - off < BIG_SLOT ? bytes - off : BIG_SLOT);
		struct kvs_lease l;
		cr_assert_eq(kvs_acquire(tx, 1, &l), 0);
		canary_fill(kvs_lease_ptr(tx, &l), owner, off, len);
		cr_assert_eq(kvs_send(*sr, &l, off, len), 0);
	}
	return rr;
}

/* Waits for both ends' finals, checks every byte, closes both ends. */
static void big_room_verify(kvs_client *rx, kvs_client *tx, kvs_room *rr, kvs_room *sr,
			    uint64_t bytes, uint64_t owner)
{
	cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
	struct kvs_event e = wait_event(rx);
	cr_assert_eq(e.type, KVS_EV_RECV_DONE, "room of %llu bytes: %u (%d)",
		     (unsigned long long)bytes, e.type, e.status);
	for (uint64_t off = 0; off < bytes; off += BIG_SLOT) {
		uint64_t len = bytes - off < BIG_SLOT ? bytes - off : BIG_SLOT;
		struct kvs_lease l;
		cr_assert_eq(kvs_room_lease(rr, (unsigned)(off / BIG_SLOT), &l), 0);
		cr_assert_eq(canary_check(kvs_lease_ptr(rx, &l), owner, off, len), len,
			     "room of %llu bytes at %llu: wrong bytes", (unsigned long long)bytes,
			     (unsigned long long)off);
	}
	cr_assert_eq(kvs_room_close(rr), 0);
	cr_assert_eq(kvs_room_close(sr), 0);
}

/* A large payload wakes its receiving proxy at a mark (SO_RCVLOWAT), never
 * above what the payload still owes. Chunks larger than the mark's cap, and
 * last chunks just above and just below the smallest payload that sets one,
 * land byte for byte at the defaults. Then the case a mark past a payload's
 * end would stall: the receiver has read a header and set its mark, and
 * only then the payload comes (held at tcp.payload on the sender until the
 * mark is counted); nothing comes behind it, so only the payload's own
 * bytes can wake the receiver. */
Test(tcp, large_payloads_wake_the_receiver_at_a_mark_their_tail_still_reaches)
{
	if (by_rdma())
		cr_skip_test("chunks go by RDMA READ in this run");
	const char *args[] = {
		"--slots", "8", "--slot-size", "2M", "--listen", "127.0.0.1:0", NULL
	};
	proxy_start(&pb, NULL, args);
	proxy_start(&pa, NULL, args);
	kvs_client *rx = connect_ok(&pb), *tx = connect_ok(&pa);
	const uint64_t sizes[] = { 2ull * BIG_SLOT + (100u << 10), BIG_SLOT + (64u << 10) - 1,
				   BIG_SLOT + 4096 };
	for (unsigned r = 0; r < sizeof(sizes) / sizeof(sizes[0]); r++) {
		kvs_room *sr, *rr = big_room_send(rx, tx, sizes[r], 0x90 + r, &sr);
		big_room_verify(rx, tx, rr, sr, sizes[r], 0x90 + r);
	}
	cr_assert_gt(stat_get(&pb, "tcp_lowat_calls"), 0, "the receiver set marks");

	const uint64_t owner = 0xa0, bytes = 100u << 10;
	cr_assert_eq(kvs_admin_fp_set_mask(pa.admin, "tcp.payload", "pause", owner, 0xffff), 0);
	uint64_t marks = stat_get(&pb, "tcp_lowat_calls");
	kvs_room *sr, *rr = big_room_send(rx, tx, bytes, owner, &sr);
	fp_wait(&pa, "tcp.payload", 1);			 /* its header left, its payload waits */
	stat_wait(&pb, "tcp_lowat_calls", 1, marks + 1); /* ... B read it and set its mark */
	fp_set(&pa, "tcp.payload", "off", NULL);
	big_room_verify(rx, tx, rr, sr, bytes, owner);
	cr_assert_eq(stat_get(&pa, "peer_lost") + stat_get(&pb, "peer_lost"), 0);
	kvs_close(tx);
	kvs_close(rx);
	wait_idle(&pa, 0);
	wait_idle(&pb, 0);
}

/* --tcp-zerocopy: the kernel reads a payload from its slot after sendmsg
 * returns, until it says so on the socket's error queue. On loopback it
 * copies anyway (and says that too), so these check the bytes and the
 * fence, not a speed. */
static const char *zc_args[] = { "--slots",  "8",	    "--slot-size",    "2M",
				 "--listen", "127.0.0.1:0", "--tcp-zerocopy", "--transport",
				 "tcp",	     NULL };
/* (--transport tcp: where a device is up, auto would pull chunks by RDMA READ.) */

/* B and A on zc_args, a client of each. */
static void zc_pair(kvs_client **rx, kvs_client **tx)
{
	if (by_rdma())
		cr_skip_test("chunks go by RDMA READ in this run");
	proxy_start(&pb, NULL, zc_args);
	proxy_start(&pa, NULL, zc_args);
	*rx = connect_ok(&pb);
	*tx = connect_ok(&pa);
}

/* One chunk (1 MiB) from tx, owner's canary; its lease in *l. */
static kvs_room *zc_room(kvs_client *rx, kvs_client *tx, uint64_t owner, kvs_room **sr,
			 struct kvs_lease *l)
{
	const uint32_t len = 1u << 20;
	kvs_room *rr;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(rx, len, owner, &rr, &d), 0);
	cr_assert_eq(kvs_send_open(tx, &d, owner, sr), 0);
	cr_assert_eq(kvs_acquire(tx, 1, l), 0);
	canary_fill(kvs_lease_ptr(tx, l), owner, 0, len);
	cr_assert_eq(kvs_send(*sr, l, 0, len), 0);
	struct kvs_event e = wait_event(rx);
	cr_assert_eq(e.type, KVS_EV_RECV_DONE, "got %u (%d)", e.type, e.status);
	struct kvs_lease rl;
	cr_assert_eq(kvs_room_lease(rr, 0, &rl), 0);
	cr_assert_eq(canary_check(kvs_lease_ptr(rx, &rl), owner, 0, len), len, "wrong bytes");
	return rr;
}

/* The answer for the chunk's sendmsg came (held at tcp.zc_notify): its slot
 * is still pinned in flight. A sender that quiesced at the write (the
 * socket's copy) would have let it go before the answer could come. */
static void zc_held(struct proxy *px, const struct kvs_lease *l)
{
	fp_wait(px, "tcp.zc_notify", 1);
	struct kvs_slot s = slot_pub(px, l->slot);
	cr_assert_eq(s.state, KVS_SLOT_INFLIGHT, "slot state %u: let go before the kernel's answer",
		     s.state);
	cr_assert_eq(s.pins, 1);
}

Test(tcp, zerocopy_payloads_land_whole_and_their_slot_waits_for_the_kernel)
{
	kvs_client *rx, *tx;
	zc_pair(&rx, &tx);
	const uint64_t sizes[] = { 2ull * BIG_SLOT + (100u << 10), BIG_SLOT + 4096, 20u << 10,
				   4096 };
	for (unsigned r = 0; r < sizeof(sizes) / sizeof(sizes[0]); r++) {
		kvs_room *sr, *rr = big_room_send(rx, tx, sizes[r], 0xb0 + r, &sr);
		big_room_verify(rx, tx, rr, sr, sizes[r], 0xb0 + r);
	}
	cr_assert_gt(stat_get(&pa, "tcp_zc_sends"), 0, "payloads went with MSG_ZEROCOPY");
	cr_assert_gt(stat_get(&pa, "tcp_zc_copied"), 0, "loopback: the kernel said it copied");

	/* The owner goes while the kernel may still read the slot: a tombstone,
	 * reaped once the kernel's answer is read. */
	fp_set(&pa, "tcp.zc_notify", "pause", NULL);
	kvs_room *sr;
	struct kvs_lease l;
	kvs_room *rr = zc_room(rx, tx, 0xc0, &sr, &l);
	zc_held(&pa, &l);
	uint64_t reaped = stat_get(&pa, "tombstones_reaped");
	kvs_close(tx);
	stat_wait(&pa, "slots.tombstone", 1, 1);
	cr_assert_eq(slot_pub(&pa, l.slot).pins, 1);
	fp_set(&pa, "tcp.zc_notify", "off", NULL);
	stat_wait(&pa, "tombstones_reaped", 1, reaped + 1);
	cr_assert_eq(kvs_room_close(rr), 0);
	cr_assert_eq(stat_get(&pa, "peer_lost") + stat_get(&pb, "peer_lost"), 0);
	kvs_close(rx);
	wait_idle(&pa, 0);
	wait_idle(&pb, 0);
}

/* A session lost while the kernel owes answers for slot bytes stays dying
 * (its socket purged, not closed) until they come; only then do its rooms
 * fail and its pins go. */
Test(tcp, a_session_lost_with_zerocopy_answers_owed_keeps_its_pins_until_they_come)
{
	kvs_client *rx, *tx;
	zc_pair(&rx, &tx);
	fp_set(&pa, "tcp.zc_notify", "pause", NULL);
	kvs_room *sr;
	struct kvs_lease l;
	(void)zc_room(rx, tx, 0xd0, &sr, &l);
	zc_held(&pa, &l);
	proxy_kill(&pb, SIGKILL);
	stat_wait(&pa, "peer_lost", 1, 1);
	uint64_t hits;
	cr_assert_eq(kvs_admin_fp_get(pa.admin, "tcp.zc_notify", &hits), 0);
	fp_wait(&pa, "tcp.zc_notify", hits + 2); /* the dying session asks for its answers */
	struct kvs_slot s = slot_pub(&pa, l.slot);
	cr_assert(s.state == KVS_SLOT_INFLIGHT && s.pins == 1,
		  "slot state %u pins %u: let go before the kernel's answer", s.state, s.pins);
	cr_assert_eq(kvs_poll(tx, &(struct kvs_event){ 0 }, 1), 0, "no final before the answer");
	fp_set(&pa, "tcp.zc_notify", "off", NULL);
	struct kvs_event e = wait_event(tx);
	cr_assert_eq(e.type, KVS_EV_FAILED, "the sender's room fails, got %u", e.type);
	cr_assert_eq(kvs_room_close(sr), 0);
	kvs_close(tx);
	wait_idle(&pa, 0);
}

/* To loopback the kernel copies every zerocopy send anyway, and says so:
 * after PCONN_ZC_COPIED_RUN (64) such answers in a row a connection copies
 * by itself, and every room still ends. (Answers still owed when it turns
 * off are read as they come; on loopback they mostly come together with the
 * one that turns it off, so this does not force that case: a kvstage-bench
 * run at 1M chunks did, and hung when only connections with zerocopy on
 * read their answers.) */
Test(tcp, zerocopy_the_kernel_copies_every_time_turns_itself_off_and_nothing_waits)
{
	kvs_client *rx, *tx;
	zc_pair(&rx, &tx);
	/* Rooms of one chunk, 8 in flight at a time, round robin on the 2
	 * streams: when a connection turns zerocopy off, sends are in flight. */
	const unsigned batch = 8, rooms = 24 * batch;
	const uint64_t bytes = 64u << 10;
	for (unsigned b = 0; b < rooms; b += batch) {
		kvs_room *rr[8], *sr[8];
		for (unsigned k = 0; k < batch; k++)
			rr[k] = big_room_send(rx, tx, bytes, 0xe000 + b + k, &sr[k]);
		for (unsigned k = 0; k < batch; k++) {
			cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
			cr_assert_eq(wait_event(rx).type, KVS_EV_RECV_DONE);
		}
		for (unsigned k = 0; k < batch; k++) {
			struct kvs_lease l;
			cr_assert_eq(kvs_room_lease(rr[k], 0, &l), 0);
			cr_assert_eq(canary_check(kvs_lease_ptr(rx, &l), 0xe000 + b + k, 0, bytes),
				     bytes, "room %u: wrong bytes", b + k);
			cr_assert_eq(kvs_room_close(rr[k]), 0);
			cr_assert_eq(kvs_room_close(sr[k]), 0);
		}
	}
	uint64_t sends = stat_get(&pa, "tcp_zc_sends"), copied = stat_get(&pa, "tcp_zc_copied");
	cr_assert_geq(copied, 2 * 64, "the kernel said it copied (%llu)",
		      (unsigned long long)copied);
	cr_assert_lt(sends, rooms, "zerocopy went on after %llu copied sends",
		     (unsigned long long)copied);
	kvs_close(tx);
	kvs_close(rx);
	wait_idle(&pa, 0);
	wait_idle(&pb, 0);
}
