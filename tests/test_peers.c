/* SPDX-License-Identifier: MIT */
/*
 * Hostile peers against a real kvstaged --listen on loopback: a test peer
 * speaking the wire (tests/hpeer.c over proxy/peer/frame.c and auth.c) with no secret, a
 * wrong one, replays, forged and stale tokens, broken frames, or nothing
 * at all. Each is refused or dropped and counted, and a real room between
 * two real proxies, open all along, still arrives byte for byte.
 */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <endian.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <sodium.h>

#include "canary.h"
#include "harness.h"
#include "hpeer.h"
#include "kvs_build.h"

#define SLOT (64 * 1024)
#define SECRET "kvstage-test-secret-0123456789abcdef"

static struct proxy pa = PROXY_INIT, pb = PROXY_INIT;
static struct kvsp_secret good, bad;

static void setup(void)
{
	setenv("KVSTAGE_PEER_SECRET", SECRET, 1);
	char why[128];
	cr_assert_eq(kvsp_secret_load(NULL, SECRET, &good, why, sizeof(why)), 0, "%s", why);
	cr_assert_eq(
		kvsp_secret_load(NULL, "another-secret-of-32-bytes-long!", &bad, why, sizeof(why)),
		0, "%s", why);
	/* The default --peer-timeout (a handshake is given 2.5 s of it). */
	proxy_start(&pb, NULL,
		    (const char *[]){ "--slots", "32", "--slot-size", "64K", "--listen",
				      "127.0.0.1:0", NULL });
	proxy_start(&pa, NULL, (const char *[]){ "--slots", "32", "--slot-size", "64K", NULL });
}

static void teardown(void)
{
	proxy_stop(&pa);
	proxy_stop(&pb);
	kvsp_secret_free(&good);
	kvsp_secret_free(&bad);
}

TestSuite(peers, .init = setup, .fini = teardown, .timeout = 60);

/* A room on B, open all along: its descriptor names B's endpoint. */
static kvs_client *rx;
static kvs_room *rroom;
static struct kvs_desc_wire desc;

static void open_room(void)
{
	rx = connect_ok(&pb);
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(rx, 2 * SLOT, 0x99, &rroom, &d), 0);
	memcpy(&desc, &d, sizeof(desc));
	cr_assert(!strncmp(desc.endpoint, "tcp:127.0.0.1:", 14), "endpoint %s", desc.endpoint);
}

static int connect_b(void)
{
	return hp_connect(hp_endpoint(&desc), NULL);
}

/* The dialer's handshake with secret s, then JOIN as a one-stream session. */
static void join_b(struct hpeer *h, const struct kvsp_secret *s)
{
	uint64_t inst, sid;
	randombytes_buf(&inst, sizeof(inst));
	randombytes_buf(&sid, sizeof(sid));
	hp_join(h, hp_endpoint(&desc), NULL, s, inst, sid, 0, 1);
}

static struct kvs_wire_room room_name(void)
{
	return hp_room(&desc);
}

/* The real room, sent by a real proxy, arrives whole after it all. */
static void real_room_arrives(void)
{
	kvs_client *tx = connect_ok(&pa);
	kvs_room *sr;
	struct kvs_room_desc d;
	memcpy(&d, &desc, sizeof(d));
	cr_assert_eq(kvs_send_open(tx, &d, 0x98, &sr), 0);
	for (unsigned k = 0; k < 2; k++) {
		struct kvs_lease l;
		cr_assert_eq(kvs_acquire(tx, 1, &l), 0);
		canary_fill(kvs_lease_ptr(tx, &l), 0x99, (uint64_t)k * SLOT, SLOT);
		cr_assert_eq(kvs_send(sr, &l, (uint64_t)k * SLOT, SLOT), 0);
	}
	struct kvs_event e = wait_event(rx);
	cr_assert_eq(e.type, KVS_EV_RECV_DONE, "the real room got %u (%s)", e.type,
		     kvs_strerror(e.status));
	cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
	for (unsigned k = 0; k < 2; k++) {
		struct kvs_lease l;
		cr_assert_eq(kvs_room_lease(rroom, k, &l), 0);
		cr_assert_eq(canary_check(kvs_lease_ptr(rx, &l), 0x99, (uint64_t)k * SLOT, SLOT),
			     SLOT);
	}
	kvs_room_close(sr);
	kvs_room_close(rroom);
	kvs_close(tx);
	kvs_close(rx);
	wait_idle(&pb, 0);
	wait_idle(&pa, 0);
}

/* ---------------------------------------------------------- the tests */

Test(peers, no_secret_garbage_is_refused_before_anything)
{
	open_room();
	int fd = connect_b();
	uint8_t junk[KVS_WIRE_HELLO_SIZE];
	randombytes_buf(junk, sizeof(junk));
	hp_put(fd, junk, sizeof(junk));
	hp_wait_closed(fd);
	close(fd);
	stat_wait(&pb, "peer_auth_failed", 1, 1);
	real_room_arrives();
}

Test(peers, a_wrong_secret_cannot_prove_itself)
{
	open_room();
	/* We can see the listener's proof does not verify under our key... */
	struct hpeer h;
	h.fd = connect_b();
	cr_assert_eq(kvsp_auth_start(&h.a, &bad, KVS_WIRE_DIALER, 12345), 0);
	cr_assert_eq(kvsp_auth_hello(&h.a, h.hello), 0);
	hp_put(h.fd, h.hello, sizeof(h.hello));
	uint8_t in[KVS_WIRE_HELLO_SIZE];
	cr_assert_eq(hp_get(h.fd, in, KVS_WIRE_HELLO_SIZE), 0);
	cr_assert_eq(kvsp_auth_on_hello(&h.a, in), 0);
	cr_assert_eq(hp_get(h.fd, in, KVS_WIRE_PROOF_SIZE), 0);
	cr_assert_eq(kvsp_auth_on_proof(&h.a, in), -EACCES);
	/* ...and the proof we can make without the secret is refused. */
	struct kvs_wire_proof p = { .magic = htole32(KVS_WIRE_HELLO_MAGIC),
				    .version = htole16(KVS_WIRE_VERSION),
				    .type = htole16(KVS_WIRE_PROOF),
				    .role = htole32(KVS_WIRE_DIALER) };
	randombytes_buf(p.mac, sizeof(p.mac));
	hp_put(h.fd, &p, sizeof(p));
	hp_wait_closed(h.fd);
	close(h.fd);
	stat_wait(&pb, "peer_auth_failed", 1, 1);
	real_room_arrives();
}

Test(peers, a_replayed_handshake_is_refused)
{
	open_room();
	struct hpeer h;
	join_b(&h, &good);
	hp_in_sync(&h); /* the real one works */
	int fd = connect_b();
	hp_put(fd, h.hello, sizeof(h.hello));
	uint8_t in[KVS_WIRE_HELLO_SIZE + KVS_WIRE_PROOF_SIZE];
	cr_assert_eq(hp_get(fd, in, sizeof(in)), 0);
	hp_put(fd, h.proof, sizeof(h.proof)); /* the old proof, for the old nonce */
	hp_wait_closed(fd);
	close(fd);
	stat_wait(&pb, "peer_auth_failed", 1, 1);
	close(h.fd);
	real_room_arrives();
}

Test(peers, a_replayed_frame_drops_the_connection)
{
	open_room();
	struct hpeer h;
	join_b(&h, &good);
	uint8_t f[KVS_WIRE_FRAME_MAX];
	struct kvs_wire_ping p = { htole64(1) };
	size_t n = hp_send(&h, KVS_WIRE_PING, &p, 0, f);
	cr_assert_eq(hp_recv(&h).type, KVS_WIRE_PONG);
	hp_put(h.fd, f, n); /* the same frame again: its seq is spent */
	hp_wait_closed(h.fd);
	close(h.fd);
	stat_wait(&pb, "peer_frames_refused", 1, 1);
	real_room_arrives();
}

Test(peers, forged_and_stale_tokens_change_nothing)
{
	open_room();
	struct hpeer h;
	join_b(&h, &good);
	uint64_t tokens = stat_get(&pb, "rej_token");
	/* OPEN with a wrong token: refused, counted */
	struct kvs_wire_open o = { .room = room_name(),
				   .bytes = htole64(2 * SLOT),
				   .slot_size = htole64(SLOT),
				   .sender_ref = htole64(7) };
	o.room.token[0] ^= 1;
	hp_send(&h, KVS_WIRE_OPEN, &o, 0, NULL);
	struct kvsp_frame f = hp_recv(&h);
	cr_assert_eq(f.type, KVS_WIRE_OPEN_ACK);
	cr_assert_eq((int32_t)le32toh((uint32_t)f.body.open_ack.status), -EPERM);
	cr_assert_eq(stat_get(&pb, "rej_token"), tokens + 1);
	/* OPEN naming a stale generation */
	o.room = room_name();
	o.room.gen = htole32(le32toh(o.room.gen) + 1);
	hp_send(&h, KVS_WIRE_OPEN, &o, 0, NULL);
	f = hp_recv(&h);
	cr_assert_eq((int32_t)le32toh((uint32_t)f.body.open_ack.status), -ESTALE);
	/* ABORT with a wrong token, and one for a room we never opened */
	uint64_t ignored = stat_get(&pb, "peer_frames_ignored");
	struct kvs_wire_abort ab = { .room = room_name(),
				     .status = (int32_t)htole32(-ECANCELED),
				     .from = htole32(KVS_WIRE_FROM_SEND) };
	ab.room.token[5] ^= 0x80;
	hp_send(&h, KVS_WIRE_ABORT, &ab, 0, NULL);
	ab.room = room_name();
	hp_send(&h, KVS_WIRE_ABORT, &ab, 0, NULL); /* right token, but not our room's sender */
	/* CHUNK with a wrong token: its payload goes to the sink, in step */
	uint64_t disc = stat_get(&pb, "chunks_discarded");
	static uint8_t payload[SLOT];
	memset(payload, 0xEE, sizeof(payload));
	struct kvs_wire_chunk c = { .room = room_name(), .chunk = 0, .len = htole32(SLOT) };
	c.room.token[15] ^= 1;
	hp_send(&h, KVS_WIRE_CHUNK, &c, SLOT, NULL);
	hp_put(h.fd, payload, sizeof(payload));
	hp_in_sync(&h);
	cr_assert_eq(stat_get(&pb, "peer_frames_ignored"), ignored + 2);
	cr_assert_eq(stat_get(&pb, "chunks_discarded"), disc + 1);
	cr_assert_eq(stat_get(&pb, "rooms_aborted"), 0, "the real room was not touched");
	close(h.fd);
	real_room_arrives();
}

/* RDMA frames to a proxy with no RDMA data path (no --rdma-device, or a
 * build without libibverbs): answered by their type (peer/unowned.c). A
 * CHUNK_READ, before a HELLO or after, is answered "not supported" (the
 * sender then sends by TCP), the HELLO is ignored and counted, an ack for
 * a read we never asked for is ignored, and a second HELLO on the session
 * drops the connection. The real room is untouched. */
static bool proxies_have_rdma(void)
{
	const char *e = getenv("KVSTAGE_TEST_PROXY_ARGS");
	return e && strstr(e, "--rdma-device");
}

Test(peers, rdma_frames_to_a_proxy_without_a_device)
{
	if (proxies_have_rdma())
		cr_skip_test("the proxies have an RDMA device here: see "
			     "rdma_frames_to_a_proxy_with_one");
	open_room();
	struct hpeer h;
	join_b(&h, &good);
	uint64_t ignored = stat_get(&pb, "peer_frames_ignored");
	struct kvs_wire_rdma_hello hello = { .qpn = htole32(0x11),
					     .psn = htole32(0x22),
					     .pool_addr = htole64(0x7f0000000000ull),
					     .pool_len = htole64(64 * SLOT),
					     .keys = htole32(1),
					     .mtu = htole16(3 /* IBV_MTU_1024 */) };
	/* A READ before any HELLO: refused by its type as well. */
	struct kvs_wire_chunk_read rd = { .room = room_name(),
					  .chunk = 0,
					  .len = htole32(SLOT),
					  .xfer_ref = htole64(0x1234),
					  .offset = 0,
					  .rkey = htole32(0x33) };
	hp_send(&h, KVS_WIRE_CHUNK_READ, &rd, 0, NULL);
	struct kvsp_frame f = hp_recv(&h);
	cr_assert_eq(f.type, KVS_WIRE_CHUNK_ACK, "got frame type %u", f.type);
	cr_assert_eq((int32_t)le32toh((uint32_t)f.body.chunk_ack.status), -EOPNOTSUPP);
	cr_assert_eq(le64toh(f.body.chunk_ack.xfer_ref), 0x1234);
	hp_send(&h, KVS_WIRE_RDMA_HELLO, &hello, 0, NULL);
	rd.xfer_ref = htole64(0xabcdef);
	hp_send(&h, KVS_WIRE_CHUNK_READ, &rd, 0, NULL);
	f = hp_recv(&h);
	cr_assert_eq(f.type, KVS_WIRE_CHUNK_ACK, "got frame type %u", f.type);
	cr_assert_eq((int32_t)le32toh((uint32_t)f.body.chunk_ack.status), -EOPNOTSUPP);
	cr_assert_eq(le64toh(f.body.chunk_ack.xfer_ref), 0xabcdef,
		     "the ack names the sender's transfer");
	struct kvs_wire_chunk_ack forged = { .room = room_name(), .xfer_ref = htole64(3) };
	hp_send(&h, KVS_WIRE_CHUNK_ACK, &forged, 0, NULL);
	hp_in_sync(&h);
	cr_assert_eq(stat_get(&pb, "peer_frames_ignored"), ignored + 2, "the HELLO and the ack");
	cr_assert_eq(stat_get(&pb, "slots.recv_posted"), 0, "no slot was posted for the READ");
	hp_send(&h, KVS_WIRE_RDMA_HELLO, &hello, 0, NULL); /* twice: out of protocol */
	hp_wait_closed(h.fd);
	close(h.fd);
	cr_assert_eq(stat_get(&pb, "rooms_aborted"), 0, "the real room was not touched");
	real_room_arrives();
}

/* Hostile RDMA frames to a proxy with a device (run in the soft-RoCE
 * guest, where tools/run-tests.sh gives every proxy --rdma-device rxe0): a
 * CHUNK_READ past the pool the peer's HELLO named drops the connection;
 * a READ towards a queue pair that answers nothing (the HELLO named none
 * of ours) fails: that costs the session its RDMA (the chunk is answered
 * "not supported", so a sender would send it by TCP), not the session, and
 * the slot posted for it comes back. The real room arrives. */
Test(peers, rdma_frames_to_a_proxy_with_a_device)
{
	if (!KVS_HAVE_VERBS)
		cr_skip_test(
			"this build has no RDMA (built without verbs: libibverbs-dev missing)");
	if (!proxies_have_rdma())
		cr_skip_test(
			"no RDMA device for the proxies here: tools/run-tests.sh runs this in the "
			"soft-RoCE guest (KVSTAGE_TEST_PROXY_ARGS=--rdma-device rxe0)");
	open_room();
	struct kvs_wire_rdma_hello hello = { .qpn = htole32(0x7777),
					     .psn = htole32(0x22),
					     .pool_addr = htole64(0x7f0000000000ull),
					     .pool_len = htole64(64 * SLOT),
					     .keys = htole32(1),
					     .mtu = htole16(3 /* IBV_MTU_1024 */) };
	uint64_t lost = stat_get(&pb, "peer_lost");
	struct hpeer h;
	join_b(&h, &good);
	hp_send(&h, KVS_WIRE_RDMA_HELLO, &hello, 0, NULL);
	struct kvs_wire_chunk_read rd = { .room = room_name(),
					  .chunk = 0,
					  .len = htole32(SLOT),
					  .xfer_ref = htole64(1),
					  .offset = htole64(64 * SLOT),
					  .rkey = htole32(0x33) };
	hp_send(&h, KVS_WIRE_CHUNK_READ, &rd, 0, NULL); /* one byte past the pool */
	hp_wait_closed(h.fd);
	close(h.fd);
	stat_wait(&pb, "peer_lost", 1, lost + 1);

	uint64_t links = stat_get(&pb, "rdma_links_lost");
	join_b(&h, &good);
	hp_send(&h, KVS_WIRE_RDMA_HELLO, &hello, 0, NULL);
	rd.offset = 0;
	hp_send(&h, KVS_WIRE_CHUNK_READ, &rd, 0, NULL); /* in range, to nobody */
	struct kvsp_frame f = hp_recv(&h);		/* the READ failed: by TCP instead */
	cr_assert_eq(f.type, KVS_WIRE_CHUNK_ACK, "got frame type %u", f.type);
	cr_assert_eq((int32_t)le32toh((uint32_t)f.body.chunk_ack.status), -EOPNOTSUPP);
	cr_assert_eq(le64toh(f.body.chunk_ack.xfer_ref), 1);
	stat_wait(&pb, "rdma_links_lost", 1, links + 1);
	hp_in_sync(&h); /* the session lives on */
	cr_assert_eq(stat_get(&pb, "peer_lost"), lost + 1, "the session was not lost");
	cr_assert_eq(stat_get(&pb, "slots.recv_posted"), 0, "the slot posted for it came back");
	close(h.fd);
	cr_assert_eq(stat_get(&pb, "rooms_aborted"), 0, "the real room was not touched");
	real_room_arrives();
}

Test(peers, oversized_truncated_and_garbage_frames_drop_the_connection)
{
	open_room();
	uint64_t refused = stat_get(&pb, "peer_frames_refused");
	/* a CHUNK header claiming more than a slot */
	struct hpeer h;
	join_b(&h, &good);
	struct kvs_wire_frame_hdr big = { .magic = htole32(KVS_WIRE_FRAME_MAGIC),
					  .type = htole16(KVS_WIRE_CHUNK),
					  .len = htole32(sizeof(struct kvs_wire_chunk)),
					  .plen = htole32(2 * SLOT),
					  .seq = htole64(1) };
	hp_put(h.fd, &big, sizeof(big));
	hp_wait_closed(h.fd);
	close(h.fd);
	/* garbage after the handshake */
	join_b(&h, &good);
	uint8_t junk[128];
	randombytes_buf(junk, sizeof(junk));
	hp_put(h.fd, junk, sizeof(junk));
	hp_wait_closed(h.fd);
	close(h.fd);
	stat_wait(&pb, "peer_frames_refused", 1, refused + 2);
	/* half a frame, then the peer is gone */
	uint64_t lost = stat_get(&pb, "peer_lost");
	join_b(&h, &good);
	hp_in_sync(&h);
	uint8_t f[KVS_WIRE_FRAME_MAX];
	struct kvs_wire_ping p = { 0 };
	int n = kvsp_frame_seal(&h.tx, KVS_WIRE_PING, &p, 0, f);
	hp_put(h.fd, f, (size_t)n / 2);
	close(h.fd);
	stat_wait(&pb, "peer_lost", 1, lost + 1);
	real_room_arrives();
}

Test(peers, a_connection_that_says_nothing_is_dropped)
{
	open_room();
	uint64_t failed = stat_get(&pb, "peer_auth_failed");
	int fd = connect_b();
	hp_wait_closed(fd); /* at the handshake deadline */
	close(fd);
	cr_assert_eq(stat_get(&pb, "peer_auth_failed"), failed + 1);
	real_room_arrives();
}
