/* SPDX-License-Identifier: MIT */
/*
 * A hostile peer with an RDMA device and the secret (hrdma.c) against a
 * victim proxy V that serves an honest peer proxy H at the same time. The
 * hostile peer is sent one chunk, with that chunk's key, and then READs
 * what it was not sent:
 *
 *   (a) a slot of V's that was never sent (another client's lease);
 *   (b) its chunk after its ack;
 *   (c) its chunk after its room's abort;
 *   (d) a chunk with the key of a chunk of an earlier room;
 *   (e) one byte past its chunk;
 *   (f) its chunk through another session's queue pair.
 *
 * and (g) leaves the CHUNK_READ of an aborted room unacknowledged while
 * answering everything else, which would hold a place of V's READ window
 * for good: past --peer-timeout V loses the session.
 *
 * Every READ fails at V's NIC (the hostile peer's buffer stays as it was);
 * V counts it (rdma_reads_refused) and says so in its log; for (a), (b),
 * (d), (e) and (f) the hostile session is lost. For (c) it is not: a READ
 * of a chunk whose room was aborted under it may be an honest one on its
 * way, so V drops that queue pair (made again) and the session goes on, as
 * it must for an honest peer; the NIC's refusal is the guarantee either
 * way. Around every case H is sent rooms by READ, byte for byte, and both
 * pools end free. The proxies run with the default --peer-timeout.
 *
 * Run in the soft-RoCE guest by tools/run-tests.sh (rxe0: windows over
 * chunk regions, as the device does not keep a READ inside a window by
 * itself), and with --rdma-keys regions for the cases a region fences. On
 * a host with no RDMA device every test skips and says so.
 */
#include <criterion/criterion.h>
#include <endian.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "harness.h"
#include "hrdma.h"
#include "xroom.h"

#define SECRET "kvstage-hostile-rdma-secret-0123456789ab"
#define V_OWNER 0x7100
#define Z_OWNER 0x7200

static struct proxy pv = PROXY_INIT, ph = PROXY_INIT;
static struct kvsp_secret good;
static struct hz z, z2;

static void setup(void)
{
	setenv("KVSTAGE_PEER_SECRET", SECRET, 1);
	char why[128];
	cr_assert_eq(kvsp_secret_load(NULL, SECRET, &good, why, sizeof(why)), 0, "%s", why);
	z.lfd = z2.lfd = -1;
}

static void teardown(void)
{
	proxy_stop(&pv);
	proxy_stop(&ph);
	hz_close(&z);
	hz_close(&z2);
	kvsp_secret_free(&good);
}

TestSuite(hostile_rdma, .init = setup, .fini = teardown, .timeout = 240);

/* V and H on the guest's device; keys: --rdma-keys, NULL for the default;
 * timeout: --peer-timeout, NULL for the default. */
static void start_with(const char *keys, const char *timeout)
{
	const char *dev = getenv("RXE_DEV");
	if (!(dev && *dev))
		cr_skip_test("no RDMA device here ($RXE_DEV unset): tools/run-tests.sh runs this "
			     "suite in the soft-RoCE guest: tests/rxe/run.sh -- "
			     "build/tests/test-hostile-rdma");
	const char *a[12] = { "--slots",  "64",		 "--slot-size",	  "64K",
			      "--listen", "127.0.0.1:0", "--rdma-device", dev };
	unsigned n = 8;
	if (keys) {
		a[n++] = "--rdma-keys";
		a[n++] = keys;
	}
	if (timeout) {
		a[n++] = "--peer-timeout";
		a[n++] = timeout;
	}
	proxy_start(&pv, NULL, a);
	proxy_start(&ph, NULL, a);
}

static void start(const char *keys)
{
	start_with(keys, NULL);
}

/* A room from V to H by READ, byte for byte: V still serves its honest peer. */
static void honest(uint64_t owner)
{
	kvs_client *rx = connect_ok(&ph), *tx = connect_ok(&pv);
	uint64_t reads = stat_get(&ph, "rdma_reads");
	one_room(rx, tx, owner);
	cr_assert_geq(stat_get(&ph, "rdma_reads"), reads + 3, "H's room came by READ");
	kvs_close(tx);
	kvs_close(rx);
}

/* V's client tx opens a room to z's room `room` of bytes; z takes V's
 * session if it has none yet, and answers the OPEN. */
static kvs_room *room_to(struct hz *h, kvs_client *tx, uint32_t room, uint64_t bytes)
{
	struct kvs_room_desc d = hz_desc(h, room, 1, bytes, SLOT);
	kvs_room *sr;
	int rc = kvs_send_open(tx, &d, Z_OWNER + room, &sr);
	cr_assert_eq(rc, 0, "send_open: %s", kvs_strerror(rc));
	if (!h->qp)
		hz_accept(h);
	hz_ack_open(h);
	return sr;
}

/* V's client sends chunk k (len bytes) of sr; the CHUNK_READ z gets for it. */
static struct kvs_wire_chunk_read send_chunk(struct hz *h, kvs_client *tx, kvs_room *sr,
					     uint64_t owner, unsigned k, uint32_t len)
{
	struct kvs_lease l;
	cr_assert_eq(kvs_acquire(tx, 1, &l), 0);
	canary_fill(kvs_lease_ptr(tx, &l), owner, (uint64_t)k * SLOT, len);
	cr_assert_eq(kvs_send(sr, &l, (uint64_t)k * SLOT, len), 0);
	struct kvs_wire_chunk_read c = hz_chunk_read(h);
	cr_assert_eq(le32toh(c.len), len);
	cr_assert_neq(le32toh(c.rkey), 0);
	return c;
}

/* The key died at V: its invalidate completed, or its region went. */
static void wait_revoked(uint64_t inv0, uint64_t free0)
{
	if (stat_get(&pv, "rdma_binds"))
		stat_wait(&pv, "rdma_invalidates", 1, inv0 + 1);
	else
		stat_wait(&pv, "rdma_region_frees", 1, free0 + 1);
}

struct before {
	uint64_t refused, lost, inv, freed, links;
};

static struct before before(void)
{
	return (struct before){ stat_get(&pv, "rdma_reads_refused"), stat_get(&pv, "peer_lost"),
				stat_get(&pv, "rdma_invalidates"),
				stat_get(&pv, "rdma_region_frees"),
				stat_get(&pv, "rdma_links_lost") };
}

/* z's READ failed at V's NIC, nothing of V's reached z, V counted and
 * logged it; lost: the hostile session was lost for it. */
static void refused(struct hz *h, enum ibv_wc_status st, uint32_t len, const struct before *b,
		    bool lost)
{
	cr_assert_neq(st, IBV_WC_SUCCESS, "the hostile READ got through");
	cr_log_info("the hostile READ: %s", ibv_wc_status_str(st));
	cr_assert(hz_untouched(h, len), "bytes of V's pool reached the hostile peer");
	stat_wait(&pv, "rdma_reads_refused", 1, b->refused + 1);
	if (lost) {
		stat_wait(&pv, "peer_lost", 1, b->lost + 1);
		cr_assert_geq(
			proxy_log_count(&pv, "our NIC refused its READ: a key it does not hold"),
			1);
	} else {
		stat_wait(&pv, "rdma_links_lost", 1, b->links + 1);
		cr_assert_eq(stat_get(&pv, "peer_lost"), b->lost, "the session was lost");
		cr_assert_geq(proxy_log_count(&pv, "whose key an abort revoked"), 1);
	}
}

/* Every client gone, every slot of both pools free again. */
static void pools_end_free(kvs_client *const *c, unsigned n)
{
	for (unsigned i = 0; i < n; i++)
		kvs_close(c[i]);
	wait_idle(&pv, 0);
	wait_idle(&ph, 0);
	cr_assert_eq(stat_get(&pv, "slots.free"), 64, "V's pool");
	cr_assert_eq(stat_get(&ph, "slots.free"), 64, "H's pool");
}

/* ------------------------------------------------------------- cases */

static void slot_never_sent(const char *keys)
{
	start(keys);
	honest(V_OWNER + 1);
	hz_listen(&z, &good, randombytes_random());
	kvs_client *tx = connect_ok(&pv), *other = connect_ok(&pv);
	struct kvs_lease secret;
	cr_assert_eq(kvs_acquire(other, 1, &secret), 0); /* another client's, never sent */
	canary_fill(kvs_lease_ptr(other, &secret), 0x5ec7e7, 0, SLOT);
	kvs_room *sr = room_to(&z, tx, 1, SLOT);
	struct kvs_wire_chunk_read c = send_chunk(&z, tx, sr, Z_OWNER + 1, 0, SLOT);
	struct before b = before();
	refused(&z, hz_read(&z, (uint64_t)secret.slot * SLOT, 4096, le32toh(c.rkey)), 4096, &b,
		true);
	honest(V_OWNER + 2);
	kvs_release(other, &secret);
	pools_end_free((kvs_client *[]){ tx, other }, 2);
}

Test(hostile_rdma, a_slot_never_sent)
{
	slot_never_sent(NULL);
}

Test(hostile_rdma, a_slot_never_sent_under_region_keys)
{
	slot_never_sent("regions");
}

static void chunk_after_ack(const char *keys)
{
	start(keys);
	hz_listen(&z, &good, randombytes_random());
	kvs_client *tx = connect_ok(&pv);
	kvs_room *sr = room_to(&z, tx, 1, SLOT);
	struct kvs_wire_chunk_read c = send_chunk(&z, tx, sr, Z_OWNER + 1, 0, SLOT);
	/* Sent to it: it reads it, byte for byte. */
	cr_assert_eq(hz_read(&z, le64toh(c.offset), SLOT, le32toh(c.rkey)), IBV_WC_SUCCESS);
	cr_assert_eq(canary_check(z.buf, Z_OWNER + 1, 0, SLOT), SLOT, "the chunk it was sent");
	struct before b = before();
	hz_ack_chunk(&z, &c, 0);
	wait_revoked(b.inv, b.freed);
	honest(V_OWNER + 1);
	refused(&z, hz_read(&z, le64toh(c.offset), SLOT, le32toh(c.rkey)), SLOT, &b, true);
	honest(V_OWNER + 2);
	pools_end_free((kvs_client *[]){ tx }, 1);
}

Test(hostile_rdma, a_chunk_after_its_ack)
{
	chunk_after_ack(NULL);
}

Test(hostile_rdma, a_chunk_after_its_ack_under_region_keys)
{
	chunk_after_ack("regions");
}

Test(hostile_rdma, a_chunk_after_its_rooms_abort)
{
	start(NULL);
	hz_listen(&z, &good, randombytes_random());
	kvs_client *tx = connect_ok(&pv);
	kvs_room *sr = room_to(&z, tx, 1, 2 * SLOT);
	struct kvs_wire_chunk_read c = send_chunk(&z, tx, sr, Z_OWNER + 1, 0, SLOT);
	struct before b = before();
	cr_assert_eq(kvs_abort(sr), 0);
	wait_revoked(b.inv, b.freed);
	refused(&z, hz_read(&z, le64toh(c.offset), SLOT, le32toh(c.rkey)), SLOT, &b, false);
	cr_assert_eq(wait_event(tx).type, KVS_EV_ABORTED);
	cr_assert_eq(kvs_room_close(sr), 0);
	honest(V_OWNER + 1);
	hz_close(&z); /* it hangs up: V's session with it ends, and what V held for it comes back */
	pools_end_free((kvs_client *[]){ tx }, 1);
}

/* (g) z answers V's ABORT with ENDED (a receiver whose READs are done) and
 * every PING, but never the CHUNK_READ's ack. At 2 s of --peer-timeout (the
 * other cases run at the default), so that the wait is short. */
Test(hostile_rdma, a_chunk_read_never_acknowledged)
{
	start_with(NULL, "2000");
	hz_listen(&z, &good, randombytes_random());
	kvs_client *tx = connect_ok(&pv);
	kvs_room *sr = room_to(&z, tx, 1, 2 * SLOT);
	send_chunk(&z, tx, sr, Z_OWNER + 1, 0, SLOT);
	struct before b = before();
	cr_assert_eq(kvs_abort(sr), 0);
	struct kvsp_frame f = hz_recv(&z);
	cr_assert_eq(f.type, KVS_WIRE_ABORT, "V's next frame is type %u", f.type);
	struct kvs_wire_ended e = { .room = f.body.abort.room,
				    .sender_ref = f.body.abort.sender_ref,
				    .from = htole32(KVS_WIRE_FROM_RECV) };
	hp_send(&z.conn[0], KVS_WIRE_ENDED, &e, 0, NULL);
	cr_assert_eq(wait_event(tx).type, KVS_EV_ABORTED);
	cr_assert_eq(kvs_room_close(sr), 0);
	/* Barrier: z keeps the session alive (PONGs) until V gives it up. */
	for (unsigned waited = 0; stat_get(&pv, "peer_lost") == b.lost; waited += 100) {
		cr_assert_lt(waited, WAIT_MS, "V kept the session with an unacknowledged READ");
		if (hz_recv_for(&z, 100, &f))
			cr_assert_eq(f.type, KVS_WIRE_ENDED, "V said type %u",
				     f.type); /* it quiesced */
	}
	cr_assert_geq(proxy_log_count(&pv, "unacknowledged past --peer-timeout"), 1);
	honest(V_OWNER + 1);
	pools_end_free((kvs_client *[]){ tx }, 1);
}

static void key_of_an_earlier_room(const char *keys)
{
	start(keys);
	hz_listen(&z, &good, randombytes_random());
	kvs_client *tx = connect_ok(&pv);
	kvs_room *r1 = room_to(&z, tx, 1, SLOT);
	struct kvs_wire_chunk_read c1 = send_chunk(&z, tx, r1, Z_OWNER + 1, 0, SLOT);
	cr_assert_eq(hz_read(&z, le64toh(c1.offset), SLOT, le32toh(c1.rkey)), IBV_WC_SUCCESS);
	struct before b = before();
	hz_ack_chunk(&z, &c1, 0);
	wait_revoked(b.inv, b.freed);
	kvs_room *r2 = room_to(&z, tx, 2, SLOT);
	struct kvs_wire_chunk_read c2 = send_chunk(&z, tx, r2, Z_OWNER + 2, 0, SLOT);
	cr_assert_neq(c2.rkey, c1.rkey, "the second room's chunk has a key of its own");
	b = before();
	refused(&z, hz_read(&z, le64toh(c2.offset), SLOT, le32toh(c1.rkey)), SLOT, &b, true);
	honest(V_OWNER + 1);
	pools_end_free((kvs_client *[]){ tx }, 1);
}

Test(hostile_rdma, a_key_from_an_earlier_room)
{
	key_of_an_earlier_room(NULL);
}

static void past_the_chunk(const char *keys)
{
	start(keys);
	hz_listen(&z, &good, randombytes_random());
	kvs_client *tx = connect_ok(&pv);
	kvs_room *sr = room_to(&z, tx, 1, 1000);
	struct kvs_wire_chunk_read c = send_chunk(&z, tx, sr, Z_OWNER + 1, 0, 1000);
	struct before b = before();
	refused(&z, hz_read(&z, le64toh(c.offset), 1001, le32toh(c.rkey)), 1001, &b, true);
	honest(V_OWNER + 1);
	pools_end_free((kvs_client *[]){ tx }, 1);
}

Test(hostile_rdma, one_byte_past_its_chunk)
{
	past_the_chunk(NULL);
}

Test(hostile_rdma, one_byte_past_its_chunk_under_region_keys)
{
	past_the_chunk("regions");
}

/* Two sessions of the hostile peer's (two endpoints): a key V sent on one
 * is no use through the other's queue pair. (Windows only: a region key
 * is the protection domain's, so this one is not fenced under regions.) */
Test(hostile_rdma, another_sessions_chunk)
{
	start(NULL);
	hz_listen(&z, &good, randombytes_random());
	hz_listen(&z2, &good, z.inst + 2);
	kvs_client *tx = connect_ok(&pv);
	kvs_room *r1 = room_to(&z, tx, 1, SLOT);
	struct kvs_wire_chunk_read c = send_chunk(&z, tx, r1, Z_OWNER + 1, 0, SLOT);
	room_to(&z2, tx, 1, SLOT);
	cr_assert_eq(stat_get(&pv, "peer_sessions"), 2);
	struct before b = before();
	refused(&z2, hz_read(&z2, le64toh(c.offset), SLOT, le32toh(c.rkey)), SLOT, &b, true);
	/* The session the key was sent on still reads its chunk. */
	cr_assert_eq(hz_read(&z, le64toh(c.offset), SLOT, le32toh(c.rkey)), IBV_WC_SUCCESS);
	cr_assert_eq(canary_check(z.buf, Z_OWNER + 1, 0, SLOT), SLOT);
	hz_ack_chunk(&z, &c, 0);
	honest(V_OWNER + 1);
	hz_close(&z);
	pools_end_free((kvs_client *[]){ tx }, 1);
}

/* What kvstage-stat shows: the keys each RDMA peer reads under, and how
 * many of its READs our NIC refused. */
Test(hostile_rdma, kvstage_stat_shows_the_keys_and_the_refusals)
{
	start(NULL);
	hz_listen(&z, &good, randombytes_random());
	kvs_client *tx = connect_ok(&pv);
	kvs_room *sr = room_to(&z, tx, 1, 2 * SLOT);
	struct kvs_wire_chunk_read c = send_chunk(&z, tx, sr, Z_OWNER + 1, 0, SLOT);
	static char out[16384], err[1024];
	cr_assert_eq(run_cmd((const char *[]){ build_path("tools/kvstage-stat"), "--json",
					       "--socket", pv.sock, NULL },
			     out, sizeof(out), err, sizeof(err)),
		     0, "%s", err);
	cr_assert(strstr(out, "\"rdma\":true,\"reads_refused\":0,\"keys\":\"windows+regions\"") ||
			  strstr(out, "\"rdma\":true,\"reads_refused\":0,\"keys\":\"windows\""),
		  "%s", out);
	struct before b = before();
	cr_assert_eq(kvs_abort(sr), 0);
	wait_revoked(b.inv, b.freed);
	refused(&z, hz_read(&z, le64toh(c.offset), SLOT, le32toh(c.rkey)), SLOT, &b, false);
	cr_assert_eq(run_cmd((const char *[]){ build_path("tools/kvstage-stat"), "--socket",
					       pv.sock, NULL },
			     out, sizeof(out), err, sizeof(err)),
		     0);
	cr_assert(strstr(out, "reads-refused 1"), "%s", out);
	cr_assert_eq(wait_event(tx).type, KVS_EV_ABORTED);
	cr_assert_eq(kvs_room_close(sr), 0);
	hz_close(&z);
	pools_end_free((kvs_client *[]){ tx }, 1);
}
