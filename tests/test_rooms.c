/* SPDX-License-Identifier: MIT */
/*
 * Rooms in process, through the transport API (xport.h), step by step: a
 * test transport stands for a peer proxy, so both halves of a room whose
 * other half is elsewhere can be driven one call at a time — posting,
 * the fence at landing, discards, quiescence, what a peer reports, and a
 * lost peer releasing exactly its own pins.
 */
#include <criterion/criterion.h>
#include <endian.h>
#include <errno.h>
#include <string.h>

#include "core/proxy.h"
#include "core/clients.h"
#include "core/rooms.h"
#include "core/xport.h"
#include "host/loop.h"
#include "ring.h"

#define SLOT 4096u
#define NSLOTS 16u

static struct kvsp P;

/* ------------------------------------------------ the test transport */

struct note_rec {
	uint32_t room, gen;
	int what, status;
};

static struct fake {
	struct kvsp_transport t;
	struct kvsp_xfer *sent[NSLOTS];
	unsigned nsent;
	struct note_rec notes[64];
	unsigned nnotes;
	struct note_rec cancels[16];
	unsigned ncancels;
	uint32_t attached_room, attached_gen;
	int reach_rc;
} F;

static int fake_submit(struct kvsp_transport *t, struct kvsp_xfer *x)
{
	(void)t;
	F.sent[F.nsent++] = x; /* held, as bytes on their way to the peer */
	return 0;
}

static void fake_cancel(struct kvsp_transport *t, uint32_t room, uint32_t gen, int status)
{
	(void)t;
	F.cancels[F.ncancels++] = (struct note_rec){ room, gen, 0, status };
}

static void fake_notify(struct kvsp_transport *t, uint32_t room, uint32_t gen, int what, int status)
{
	(void)t;
	F.notes[F.nnotes++] = (struct note_rec){ room, gen, what, status };
}

static int fake_reach(struct kvsp_transport *t, const struct kvs_desc_wire *d,
		      const struct kvsp_party *who, uint32_t *peer)
{
	(void)t;
	(void)who;
	if (strncmp(d->endpoint, "fake:", 5))
		return -EOPNOTSUPP;
	*peer = (uint32_t)(d->endpoint[5] - '0');
	return F.reach_rc;
}

static int fake_attach(struct kvsp_transport *t, uint32_t peer, uint32_t room, uint32_t gen,
		       const struct kvs_desc_wire *d)
{
	(void)t;
	(void)peer;
	(void)d;
	F.attached_room = room;
	F.attached_gen = gen;
	return 0;
}

static int fake_poll(struct kvsp_transport *t)
{
	(void)t;
	return KVSP_IDLE;
}

static bool fake_pending(struct kvsp_transport *t)
{
	(void)t;
	return false;
}

static void fake_destroy(struct kvsp_transport *t)
{
	(void)t; /* static */
}

static const struct kvsp_transport_ops fake_ops = {
	.name = "fake peer",
	.submit = fake_submit,
	.cancel = fake_cancel,
	.notify = fake_notify,
	.reach = fake_reach,
	.attach = fake_attach,
	.poll = fake_poll,
	.pending = fake_pending,
	.destroy = fake_destroy,
};

static bool noted(uint32_t room, int what)
{
	kvsp_rooms_settle(&P); /* as the loop does after each event */
	for (unsigned i = 0; i < F.nnotes; i++)
		if (F.notes[i].room == room && F.notes[i].what == what)
			return true;
	return false;
}

/* ------------------------------------------------------------ setup */

static void setup(void)
{
	struct kvsp_config cfg = {
		.socket_path = NULL,
		.slot_count = NSLOTS,
		.slot_size = SLOT,
		.huge = KVSP_HUGE_OFF,
		.log_level = -1,
		.max_rooms = 8,
		.client_rooms = 4,
		.max_clients = 4,
		.sq_count = 64,
	};
	cr_assert_eq(kvsp_init(&P, &cfg), 0);
	memset(&F, 0, sizeof(F));
	F.t.ops = &fake_ops;
	F.t.p = &P;
	cr_assert_eq(kvsp_xport_register(&P, &F.t), 0);
}

static void teardown(void)
{
	kvsp_fini(&P);
}

TestSuite(rooms, .init = setup, .fini = teardown, .timeout = 30);

static struct kvsp_client *client(pid_t pid)
{
	struct kvsp_client *c = kvsp_client_new(&P, -1, pid, 0, (uint64_t)pid);
	cr_assert_not_null(c);
	return c;
}

static bool next_event(struct kvsp_client *c, struct kvs_cqe *e)
{
	kvsp_rooms_settle(&P); /* as the loop does after each event */
	return kvs_ring_pop(&c->cq, e, sizeof(*e), 1) == 1;
}

static struct kvsp_room_name name_of(const struct kvs_desc_wire *d)
{
	struct kvsp_room_name n = { .room = le32toh(d->room), .gen = le32toh(d->gen) };
	memcpy(n.token, d->token, 16);
	return n;
}

/* A receiving room of bytes on P whose sender is peer 1 through F. */
static uint32_t remote_sender_room(struct kvsp_client *rx, uint16_t h, uint64_t bytes,
				   struct kvs_desc_wire *d)
{
	cr_assert_eq(kvsp_room_open_recv(&P, rx, h, bytes, 1, 100 + h, d), 0);
	struct kvsp_room_name n = name_of(d);
	cr_assert_eq(kvsp_room_attach_peer(&P, &F.t, 1, &n, bytes, SLOT), 0);
	return le32toh(d->room);
}

static const struct kvs_slot *pub(uint32_t slot)
{
	return &P.slots.pub[slot];
}

/* ----------------------------------------------------- receiving half */

Test(rooms, a_peer_attaches_only_with_the_rooms_name_and_terms)
{
	struct kvsp_client *rx = client(1);
	struct kvs_desc_wire d;
	cr_assert_eq(kvsp_room_open_recv(&P, rx, 0, 3 * SLOT, 1, 7, &d), 0);
	struct kvsp_room_name n = name_of(&d), bad = n;
	bad.token[3] ^= 1;
	uint64_t tok = P.stats->rej_token;
	cr_assert_eq(kvsp_room_attach_peer(&P, &F.t, 1, &bad, 3 * SLOT, SLOT), -EPERM);
	cr_assert_eq(P.stats->rej_token, tok + 1, "a wrong token is counted");
	bad = n;
	bad.gen = n.gen + 1;
	cr_assert_eq(kvsp_room_attach_peer(&P, &F.t, 1, &bad, 3 * SLOT, SLOT), -ESTALE);
	cr_assert_eq(kvsp_room_attach_peer(&P, &F.t, 1, &n, 2 * SLOT, SLOT), -EINVAL,
		     "bytes differ");
	cr_assert_eq(kvsp_room_attach_peer(&P, &F.t, 1, &n, 3 * SLOT, 2 * SLOT), -EINVAL,
		     "chunking differs");
	cr_assert_eq(kvsp_room_attach_peer(&P, &F.t, 1, &n, 3 * SLOT, SLOT), 0);
	cr_assert_eq(kvsp_room_attach_peer(&P, &F.t, 2, &n, 3 * SLOT, SLOT), -EBUSY,
		     "one sender per room");
	/* and a local sender cannot take it either */
	struct kvsp_client *tx = client(2);
	uint64_t bytes;
	cr_assert_eq(kvsp_room_open_send(&P, tx, 0, &d, 8, &bytes), -EBUSY);
}

Test(rooms, posted_chunks_land_through_the_fence_and_complete_the_room)
{
	struct kvsp_client *rx = client(1);
	struct kvs_desc_wire d;
	uint32_t room = remote_sender_room(rx, 0, 2 * SLOT + 100, &d);
	uint32_t gen = le32toh(d.gen);
	struct kvsp_xfer *x[3];
	void *dst[3];
	uint32_t len[3] = { SLOT, SLOT, 100 };
	for (uint32_t k = 0; k < 3; k++) {
		cr_assert_eq(kvsp_chunk_post(&P, &F.t, 1, room, gen, k, len[k], &x[k], &dst[k]), 0);
		const struct kvs_slot *s = pub(x[k]->slot);
		cr_assert_eq(s->state, KVS_SLOT_RECV_POSTED);
		cr_assert_eq(s->pins, 1, "pinned for its writer");
		cr_assert_eq(s->owner, rx->id);
		cr_assert_eq(x[k]->dir, KVSP_XFER_RECV);
		cr_assert_eq(x[k]->peer, 1, "the pin names its peer");
		memset(dst[k], 0x40 + (int)k, len[k]);
	}
	struct kvsp_xfer *dup;
	void *dd;
	cr_assert_eq(kvsp_chunk_post(&P, &F.t, 1, room, gen, 1, SLOT, &dup, &dd), -EEXIST);
	uint32_t slot2 = x[2]->slot, slot0 = x[0]->slot;
	cr_assert_eq(kvsp_chunk_land(&P, x[2]), 0);
	cr_assert_eq(pub(slot2)->state, KVS_SLOT_RECV_FILLED);
	cr_assert_eq(pub(slot2)->pins, 0);
	cr_assert_eq(P.xfers[slot2].dir, 0, "the pin and its record end together");
	cr_assert_eq(kvsp_chunk_land(&P, x[1]), 0);
	struct kvs_cqe e;
	cr_assert(!next_event(rx, &e), "complete only with the last chunk");
	cr_assert_eq(kvsp_chunk_land(&P, x[0]), 0);
	cr_assert(next_event(rx, &e));
	cr_assert_eq(e.type, KVS_EV_RECV_DONE);
	cr_assert_eq(e.bytes, 2 * SLOT + 100);
	cr_assert_eq(e.slot, slot0);
	cr_assert(noted(room, KVSP_NOTE_DONE), "the peer hears DONE");
	struct kvs_lease map[3];
	cr_assert_eq(kvsp_room_map(&P, rx, 0, map), 3);
	for (uint32_t k = 0; k < 3; k++) {
		const uint8_t *b = kvsp_slot_mem(&P, map[k].slot);
		cr_assert_eq(b[0], 0x40 + k);
		cr_assert_eq(b[len[k] - 1], 0x40 + k);
	}
	cr_assert_eq(P.stats->chunks_moved, 3);
}

Test(rooms, a_posted_chunk_bad_for_its_room_is_refused_and_changes_nothing)
{
	struct kvsp_client *rx = client(1);
	struct kvs_desc_wire d;
	uint32_t room = remote_sender_room(rx, 0, 2 * SLOT, &d);
	uint32_t gen = le32toh(d.gen);
	struct kvsp_xfer *x;
	void *dst;
	uint64_t nfree = P.stats->slots[KVS_SLOT_FREE];
	cr_assert_eq(kvsp_chunk_post(&P, &F.t, 1, room, gen + 1, 0, SLOT, &x, &dst), -ESTALE);
	cr_assert_eq(kvsp_chunk_post(&P, &F.t, 2, room, gen, 0, SLOT, &x, &dst), -ESTALE,
		     "another peer's chunk");
	cr_assert_eq(kvsp_chunk_post(&P, &F.t, 1, room, gen, 2, SLOT, &x, &dst), -EINVAL);
	cr_assert_eq(kvsp_chunk_post(&P, &F.t, 1, room, gen, 1, SLOT - 1, &x, &dst), -EINVAL);
	cr_assert_eq(kvsp_chunk_post(&P, &F.t, 1, 99, gen, 0, SLOT, &x, &dst), -ESTALE);
	cr_assert_eq(P.stats->slots[KVS_SLOT_FREE], nfree, "no slot was taken");
	kvsp_room_abort_from(&P, rx, 0, -ECANCELED);
	cr_assert_eq(kvsp_chunk_post(&P, &F.t, 1, room, gen, 0, SLOT, &x, &dst), -ECANCELED);
}

/* The decisive scenario, receiving side: a chunk is being written into its
 * posted slot when the receiver aborts; the slot must not be reused until
 * the writer is done, and the late chunk must not land. */
Test(rooms, an_abort_mid_write_tombstones_the_slot_and_the_late_chunk_is_discarded)
{
	struct kvsp_client *rx = client(1);
	struct kvs_desc_wire d;
	uint32_t room = remote_sender_room(rx, 0, SLOT, &d);
	uint32_t gen = le32toh(d.gen);
	struct kvsp_xfer *x;
	void *dst;
	cr_assert_eq(kvsp_chunk_post(&P, &F.t, 1, room, gen, 0, SLOT, &x, &dst), 0);
	uint32_t slot = x->slot, epoch = pub(slot)->epoch;
	kvsp_room_abort_from(&P, rx, 0, -ECANCELED);
	cr_assert_eq(pub(slot)->state, KVS_SLOT_TOMBSTONE);
	cr_assert_eq(pub(slot)->epoch, epoch + 1);
	cr_assert(noted(room, KVSP_NOTE_ABORT), "the peer is told");
	cr_assert_eq(F.ncancels, 1);
	cr_assert_eq(F.cancels[0].room, room);
	cr_assert_eq(F.cancels[0].gen, gen, "cancel names the generation");
	struct kvs_cqe e;
	cr_assert(!next_event(rx, &e), "ABORTED waits: a byte could still land");
	/* Another client drains the pool: the tombstone is not among it. */
	struct kvsp_client *b = client(2);
	struct kvs_lease all[NSLOTS];
	cr_assert_eq(kvsp_slot_acquire(&P.slots, b->id, NSLOTS - 1, -1, all), 0);
	for (unsigned k = 0; k < NSLOTS - 1; k++)
		cr_assert_neq(all[k].slot, slot, "a slot being written was leased");
	memset(dst, 0xEE, SLOT); /* the late bytes */
	uint64_t disc = P.stats->chunks_discarded;
	cr_assert_eq(kvsp_chunk_land(&P, x), -ECANCELED);
	cr_assert_eq(P.stats->chunks_discarded, disc + 1, "the discard is counted");
	cr_assert_eq(pub(slot)->state, KVS_SLOT_FREE, "reaped once the writer quiesced");
	cr_assert_eq(pub(slot)->epoch, epoch + 2);
	cr_assert(noted(room, KVSP_NOTE_ENDED), "the peer hears our half is quiescent");
	cr_assert(!next_event(rx, &e), "and the peer's half must end too");
	kvsp_room_peer_ended(&P, &F.t, 1, room, gen);
	cr_assert(next_event(rx, &e));
	cr_assert_eq(e.type, KVS_EV_ABORTED);
}

Test(rooms, a_writer_that_fails_mid_chunk_fails_the_room)
{
	struct kvsp_client *rx = client(1);
	struct kvs_desc_wire d;
	uint32_t room = remote_sender_room(rx, 0, 2 * SLOT, &d);
	uint32_t gen = le32toh(d.gen);
	struct kvsp_xfer *x;
	void *dst;
	cr_assert_eq(kvsp_chunk_post(&P, &F.t, 1, room, gen, 0, SLOT, &x, &dst), 0);
	uint32_t slot = x->slot;
	kvsp_chunk_discard(&P, x, -EBADMSG);
	cr_assert_eq(pub(slot)->state, KVS_SLOT_FREE);
	cr_assert(noted(room, KVSP_NOTE_ABORT));
	kvsp_room_peer_ended(&P, &F.t, 1, room, gen);
	struct kvs_cqe e;
	cr_assert(next_event(rx, &e));
	cr_assert_eq(e.type, KVS_EV_FAILED);
	cr_assert_eq(e.status, -EBADMSG);
}

/* ------------------------------------------------------- sending half */

static void far_desc(struct kvs_desc_wire *d, char peer, uint64_t bytes)
{
	memset(d, 0, sizeof(*d));
	d->magic = htole32(KVS_MAGIC_DESC);
	d->version = htole16(1);
	d->instance = htole64(P.instance + 1);
	d->room = htole32(5);
	d->gen = htole32(77);
	memset(d->token, 0x5a, 16);
	d->bytes = htole64(bytes);
	d->slot_size = htole64(SLOT);
	snprintf(d->endpoint, sizeof(d->endpoint), "fake:%c", peer);
}

Test(rooms, a_send_half_for_a_far_room_quiesces_then_completes_on_the_peers_word)
{
	struct kvsp_client *tx = client(1);
	struct kvs_desc_wire d;
	far_desc(&d, '1', 2 * SLOT);
	uint64_t bytes;
	cr_assert_eq(kvsp_room_open_send(&P, tx, 0, &d, 9, &bytes), 0);
	cr_assert_eq(bytes, 2 * SLOT);
	uint32_t room = F.attached_room, gen = F.attached_gen;
	cr_assert_eq(P.rooms[room].far, KVSP_FAR_RECV);
	struct kvs_lease l[2];
	cr_assert_eq(kvsp_slot_acquire(&P.slots, tx->id, 2, -1, l), 0);
	for (int k = 0; k < 2; k++)
		cr_assert_eq(kvsp_room_send(&P, tx, 0, &l[k], (uint64_t)k * SLOT, SLOT), 0);
	cr_assert_eq(F.nsent, 2);
	cr_assert_eq(F.sent[0]->dir, KVSP_XFER_SEND);
	cr_assert_eq(F.sent[0]->peer, 1);
	cr_assert_eq(pub(l[0].slot)->state, KVS_SLOT_INFLIGHT);
	kvsp_xfer_quiesced(&P, F.sent[0], 0);
	cr_assert_eq(pub(l[0].slot)->state, KVS_SLOT_FREE, "its bytes left: the slot is free");
	struct kvs_cqe e;
	kvsp_room_peer_done(&P, &F.t, 1, room, gen);
	cr_assert(!next_event(tx, &e), "done only once every slot quiesced");
	kvsp_xfer_quiesced(&P, F.sent[1], 0);
	cr_assert(next_event(tx, &e));
	cr_assert_eq(e.type, KVS_EV_SEND_DONE);
	cr_assert_eq(P.stats->slots[KVS_SLOT_FREE], NSLOTS);
}

Test(rooms, a_send_half_aborted_in_flight_waits_for_quiescence_and_the_peer)
{
	struct kvsp_client *tx = client(1);
	struct kvs_desc_wire d;
	far_desc(&d, '1', SLOT);
	uint64_t bytes;
	cr_assert_eq(kvsp_room_open_send(&P, tx, 0, &d, 9, &bytes), 0);
	uint32_t room = F.attached_room, gen = F.attached_gen;
	struct kvs_lease l;
	cr_assert_eq(kvsp_slot_acquire(&P.slots, tx->id, 1, -1, &l), 0);
	cr_assert_eq(kvsp_room_send(&P, tx, 0, &l, 0, SLOT), 0);
	kvsp_room_abort_from(&P, tx, 0, -ECANCELED);
	cr_assert_eq(pub(l.slot)->state, KVS_SLOT_TOMBSTONE, "the transport still reads it");
	cr_assert(noted(room, KVSP_NOTE_ABORT));
	cr_assert(!noted(room, KVSP_NOTE_ENDED));
	kvsp_xfer_quiesced(&P, F.sent[0], 0);
	cr_assert_eq(pub(l.slot)->state, KVS_SLOT_FREE);
	cr_assert(noted(room, KVSP_NOTE_ENDED));
	struct kvs_cqe e;
	cr_assert(!next_event(tx, &e));
	cr_assert_eq(kvsp_room_peer_abort(&P, &F.t, 1, room, gen + 1, -ECANCELED), -ESTALE,
		     "a stale generation changes nothing");
	kvsp_room_peer_ended(&P, &F.t, 1, room, gen);
	cr_assert(next_event(tx, &e));
	cr_assert_eq(e.type, KVS_EV_ABORTED);
}

Test(rooms, a_peers_abort_reaches_the_client_with_its_status)
{
	struct kvsp_client *tx = client(1);
	struct kvs_desc_wire d;
	far_desc(&d, '1', SLOT);
	uint64_t bytes;
	cr_assert_eq(kvsp_room_open_send(&P, tx, 0, &d, 9, &bytes), 0);
	uint32_t room = F.attached_room, gen = F.attached_gen;
	cr_assert_eq(kvsp_room_peer_abort(&P, &F.t, 2, room, gen, -ECANCELED), -ESTALE,
		     "only the peer that carries it");
	cr_assert_eq(kvsp_room_peer_abort(&P, &F.t, 1, room, gen, -ETIMEDOUT), 0);
	cr_assert(!noted(room, KVSP_NOTE_ABORT), "not echoed back to who said it");
	cr_assert(noted(room, KVSP_NOTE_ENDED), "nothing in flight: ENDED at once");
	kvsp_room_peer_ended(&P, &F.t, 1, room, gen);
	struct kvs_cqe e;
	cr_assert(next_event(tx, &e));
	cr_assert_eq(e.type, KVS_EV_ABORTED);
	cr_assert_eq(e.status, -ETIMEDOUT);
}

Test(rooms, far_descriptors_are_checked_before_anything_is_made)
{
	struct kvsp_client *tx = client(1);
	struct kvs_desc_wire d;
	uint64_t bytes;
	uint64_t open = P.stats->rooms_open;
	far_desc(&d, '1', SLOT);
	d.slot_size = htole64(2 * SLOT);
	cr_assert_eq(kvsp_room_open_send(&P, tx, 0, &d, 9, &bytes), -EINVAL, "slot sizes differ");
	far_desc(&d, '1', 0);
	cr_assert_eq(kvsp_room_open_send(&P, tx, 0, &d, 9, &bytes), -EINVAL);
	far_desc(&d, '1', SLOT);
	strcpy(d.endpoint, "nobody:1");
	cr_assert_eq(kvsp_room_open_send(&P, tx, 0, &d, 9, &bytes), -EOPNOTSUPP,
		     "no transport reaches it");
	far_desc(&d, '1', SLOT);
	d.endpoint[0] = 0;
	cr_assert_eq(kvsp_room_open_send(&P, tx, 0, &d, 9, &bytes), -ESTALE,
		     "another instance, no endpoint: ours from before a restart");
	far_desc(&d, '1', SLOT);
	F.reach_rc = -EHOSTUNREACH;
	cr_assert_eq(kvsp_room_open_send(&P, tx, 0, &d, 9, &bytes), -EHOSTUNREACH);
	cr_assert_eq(P.stats->rooms_open, open, "no room was made");
	cr_assert_eq(tx->handles[0].state, KVSP_H_FREE);
}

/* --------------------------------------------------------- lost peers */

Test(rooms, a_lost_peer_releases_exactly_its_own_pins)
{
	struct kvsp_client *rx = client(1), *tx = client(2);
	struct kvs_desc_wire d1, d2, d3;
	/* peer 1 writes into room a; peer 2 into room b; we send to peer 1 */
	uint32_t a = remote_sender_room(rx, 0, SLOT, &d1);
	cr_assert_eq(kvsp_room_open_recv(&P, rx, 1, SLOT, 1, 101, &d2), 0);
	struct kvsp_room_name n2 = name_of(&d2);
	cr_assert_eq(kvsp_room_attach_peer(&P, &F.t, 2, &n2, SLOT, SLOT), 0);
	uint32_t b = le32toh(d2.room);
	struct kvsp_xfer *xa, *xb;
	void *dst;
	cr_assert_eq(kvsp_chunk_post(&P, &F.t, 1, a, le32toh(d1.gen), 0, SLOT, &xa, &dst), 0);
	cr_assert_eq(kvsp_chunk_post(&P, &F.t, 2, b, le32toh(d2.gen), 0, SLOT, &xb, &dst), 0);
	uint32_t sa = xa->slot, sb = xb->slot;
	far_desc(&d3, '1', SLOT);
	uint64_t bytes;
	cr_assert_eq(kvsp_room_open_send(&P, tx, 0, &d3, 9, &bytes), 0);
	struct kvs_lease l;
	cr_assert_eq(kvsp_slot_acquire(&P.slots, tx->id, 1, -1, &l), 0);
	cr_assert_eq(kvsp_room_send(&P, tx, 0, &l, 0, SLOT), 0);

	kvsp_peer_lost(&P, &F.t, 1, -ECONNRESET);
	cr_assert_eq(pub(sa)->state, KVS_SLOT_FREE, "peer 1's posted slot is released");
	cr_assert_eq(pub(l.slot)->state, KVS_SLOT_FREE, "our slot sent to peer 1 too");
	cr_assert_eq(pub(sb)->state, KVS_SLOT_RECV_POSTED, "peer 2's pin is not touched");
	cr_assert_eq(pub(sb)->pins, 1);
	struct kvs_cqe e;
	cr_assert(next_event(rx, &e));
	cr_assert_eq(e.type, KVS_EV_FAILED);
	cr_assert_eq(e.user_data, 100);
	cr_assert_eq(e.status, -ECONNRESET);
	cr_assert(!next_event(rx, &e), "room b goes on");
	cr_assert(next_event(tx, &e));
	cr_assert_eq(e.type, KVS_EV_FAILED);
	cr_assert_eq(kvsp_chunk_land(&P, xb), 0);
	cr_assert(next_event(rx, &e));
	cr_assert_eq(e.type, KVS_EV_RECV_DONE);
	cr_assert_eq(e.user_data, 101);
}

/* ------------------------------------------------------------ local */

/* Both halves here: the local transport's hand-off quiesces and lands in
 * one step, and every pin it held is gone with it. */
Test(rooms, a_local_room_hands_its_slots_over_and_leaves_no_record)
{
	struct kvsp_client *rx = client(1), *tx = client(2);
	struct kvs_desc_wire d;
	uint64_t bytes;
	cr_assert_eq(kvsp_room_open_recv(&P, rx, 0, 2 * SLOT, 1, 1, &d), 0);
	cr_assert_eq(kvsp_room_open_send(&P, tx, 0, &d, 2, &bytes), 0);
	struct kvs_lease l[2];
	cr_assert_eq(kvsp_slot_acquire(&P.slots, tx->id, 2, -1, l), 0);
	for (int k = 0; k < 2; k++)
		cr_assert_eq(kvsp_room_send(&P, tx, 0, &l[k], (uint64_t)k * SLOT, SLOT), 0);
	for (int k = 0; k < 2; k++) {
		cr_assert_eq(pub(l[k].slot)->state, KVS_SLOT_RECV_FILLED);
		cr_assert_eq(pub(l[k].slot)->owner, rx->id);
		cr_assert_eq(P.xfers[l[k].slot].dir, 0);
	}
	struct kvs_cqe e;
	cr_assert(next_event(rx, &e));
	cr_assert_eq(e.type, KVS_EV_RECV_DONE);
	cr_assert(next_event(tx, &e));
	cr_assert_eq(e.type, KVS_EV_SEND_DONE);
	cr_assert_eq(F.nsent, 0, "the fake transport carried nothing");
}

/* The receiver's final is posted before the sender's (design note 37):
 * one client holding both halves hears RECV_DONE first. */
Test(rooms, the_receivers_final_is_posted_before_the_senders)
{
	struct kvsp_client *c = client(1);
	struct kvs_desc_wire d;
	uint64_t bytes;
	cr_assert_eq(kvsp_room_open_recv(&P, c, 0, SLOT, 1, 10, &d), 0);
	cr_assert_eq(kvsp_room_open_send(&P, c, 1, &d, 11, &bytes), 0);
	struct kvs_lease l;
	cr_assert_eq(kvsp_slot_acquire(&P.slots, c->id, 1, -1, &l), 0);
	cr_assert_eq(kvsp_room_send(&P, c, 1, &l, 0, SLOT), 0);
	struct kvs_cqe e;
	cr_assert(next_event(c, &e));
	cr_assert_eq(e.type, KVS_EV_RECV_DONE, "first: %u", e.type);
	cr_assert_eq(e.user_data, 10);
	cr_assert(next_event(c, &e));
	cr_assert_eq(e.type, KVS_EV_SEND_DONE, "second: %u", e.type);
	cr_assert_eq(e.user_data, 11);
	cr_assert_not(next_event(c, &e));
}
