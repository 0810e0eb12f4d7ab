/* SPDX-License-Identifier: MIT */
/*
 * The proxy's core in process, no sockets (as the fuzz target drives it):
 * orderings that one epoll batch can produce but a test from outside
 * cannot stage, checked step by step.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <string.h>

#include "core/proxy.h"
#include "core/clients.h"
#include "core/ops.h"
#include "core/rooms.h"
#include "host/loop.h"
#include "ring.h"

static struct kvsp P;

static void setup(void)
{
	struct kvsp_config cfg = {
		.socket_path = NULL,
		.slot_count = 8,
		.slot_size = 4096,
		.huge = KVSP_HUGE_OFF,
		.log_level = -1,
		.max_rooms = 8,
		.client_rooms = 4,
		.max_clients = 1, /* one kick entry: a second one overflows */
		.sq_count = 64,
	};
	cr_assert_eq(kvsp_init(&P, &cfg), 0);
}

static void teardown(void)
{
	kvsp_fini(&P);
}

TestSuite(core, .init = setup, .fini = teardown, .timeout = 30);

/* One epoll batch: A hangs up (its reclaim ends A's own room), then B's
 * hello takes A's index, then B's first reply is due a kick. */
Test(core, a_dying_client_is_sent_nothing_and_kicks_never_overflow)
{
	struct kvsp_client *a = kvsp_client_new(&P, -1, 100, 0, 100);
	cr_assert_not_null(a);
	struct kvs_desc_wire d;
	cr_assert_eq(kvsp_room_open_recv(&P, a, 0, 4096, 1, 7, &d), 0);
	kvsp_client_reply(&P, a, 1, 0); /* A is due a kick before it dies */
	cr_assert(a->kick);
	uint64_t events = P.stats->events;
	kvsp_client_destroy(&P, a);
	cr_assert_eq(P.stats->events, events, "a dying client was posted its own room's final");
	cr_assert_eq(P.nkicks, 0, "a dead client left its kick entry behind");

	struct kvsp_client *b = kvsp_client_new(&P, -1, 101, 0, 101);
	cr_assert_not_null(b);
	cr_assert_eq(b->idx, 0, "B takes A's index");
	kvsp_client_reply(&P, b, 1, 0);
	cr_assert_leq(P.nkicks, P.cfg.max_clients, "%u kicks for %u clients", P.nkicks,
		      P.cfg.max_clients);
	kvsp_kicks_flush(&P);
	cr_assert_eq(P.nkicks, 0);
	kvsp_client_destroy(&P, b);
}

/* A refusal names the handle and generation of the op it refuses, so the
 * library can tell whether the room at that index is still that one. */
Test(core, a_rejection_echoes_the_ops_handle_and_generation)
{
	struct kvsp_client *c = kvsp_client_new(&P, -1, 102, 0, 102);
	cr_assert_not_null(c);
	struct kvs_desc_wire d;
	cr_assert_eq(kvsp_room_open_recv(&P, c, 2, 4096, 1, 9, &d), 0);
	c->handles[2].gen = 41;
	struct kvs_sqe q = { .op = KVS_OP_SEND, .handle = 2, .gen = 40, .slot = 1, .epoch = 5 };
	kvsp_client_op(&P, c, &q); /* a receiving handle cannot send: refused */
	struct kvs_cqe e;
	cr_assert_eq(kvs_ring_pop(&c->cq, &e, sizeof(e), 1), 1);
	cr_assert_eq(e.type, KVS_EV_REJECTED);
	cr_assert_eq(e.handle, 2);
	cr_assert_eq(e.gen, 40, "the op's generation, not the handle's now");
	cr_assert_eq(e.status, -EBADF);
	/* a final carries the open's generation */
	struct kvs_sqe ab = { .op = KVS_OP_ABORT, .handle = 2, .gen = 41 };
	kvsp_client_op(&P, c, &ab);
	cr_assert_eq(kvs_ring_pop(&c->cq, &e, sizeof(e), 1), 1);
	cr_assert_eq(e.type, KVS_EV_ABORTED);
	cr_assert_eq(e.gen, 41);
	kvsp_client_destroy(&P, c);
}
