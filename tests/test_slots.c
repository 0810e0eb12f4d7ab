/* SPDX-License-Identifier: MIT */
/*
 * The slot state machine, driven step by step with no proxy around it:
 * every transition, every illegal transition refused without a change,
 * epochs that only grow, and never two owners for one slot.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "core/slots.h"

#define N 16
/* Near the wrap, so the random walk crosses it: epochs are serial numbers. */
#define BASE 0xfffffff0u

static struct kvs_slot pub[N];
static uint64_t nstate[KVS_SLOT_NSTATES], reaped;
static struct kvsp_slots s;

static void setup(void)
{
	cr_assert_eq(kvsp_slots_init(&s, pub, N, nstate, &reaped, BASE), 0);
}

static void teardown(void)
{
	kvsp_slots_fini(&s);
}

TestSuite(slots, .init = setup, .fini = teardown);

/* Everything a refused call must leave untouched. */
struct snap {
	struct kvs_slot pub[N];
	uint64_t nstate[KVS_SLOT_NSTATES];
	uint32_t nfree;
};

static struct snap snap(void)
{
	struct snap x;
	memcpy(x.pub, pub, sizeof(pub));
	memcpy(x.nstate, nstate, sizeof(nstate));
	x.nfree = s.nfree;
	return x;
}

static void assert_unchanged(const struct snap *x, const char *what)
{
	cr_assert(!memcmp(x->pub, pub, sizeof(pub)), "%s changed the slot table", what);
	cr_assert(!memcmp(x->nstate, nstate, sizeof(nstate)), "%s changed the counts", what);
	cr_assert_eq(x->nfree, s.nfree, "%s changed the free stack", what);
}

static struct kvs_lease lease1(uint32_t owner)
{
	struct kvs_lease l;
	cr_assert_eq(kvsp_slot_acquire(&s, owner, 1, -1, &l), 0);
	return l;
}

Test(slots, starts_free_at_the_base_epoch)
{
	cr_assert_eq(nstate[KVS_SLOT_FREE], N);
	for (int i = 0; i < N; i++) {
		cr_assert_eq(pub[i].state, KVS_SLOT_FREE);
		cr_assert_eq(pub[i].epoch, BASE);
		cr_assert_eq(pub[i].owner, 0);
	}
}

Test(slots, acquire_leases_and_exhaustion_leases_none)
{
	struct kvs_lease l[N + 1];
	cr_assert_eq(kvsp_slot_acquire(&s, 7, 5, -1, l), 0);
	for (int i = 0; i < 5; i++) {
		cr_assert_eq(pub[l[i].slot].state, KVS_SLOT_LEASED);
		cr_assert_eq(pub[l[i].slot].owner, 7);
		cr_assert_eq(l[i].epoch, pub[l[i].slot].epoch);
		for (int j = 0; j < i; j++)
			cr_assert_neq(l[i].slot, l[j].slot, "one slot leased twice");
	}
	struct snap x = snap();
	cr_assert_eq(kvsp_slot_acquire(&s, 8, N - 4, -1, l), -ENOBUFS);
	assert_unchanged(&x, "a failed acquire");
	cr_assert_eq(kvsp_slot_acquire(&s, 8, N - 5, -1, l), 0);
	x = snap();
	cr_assert_eq(kvsp_slot_acquire(&s, 8, 1, -1, l), -ENOBUFS);
	assert_unchanged(&x, "acquire from an empty pool");
}

Test(slots, check_judges_range_epoch_owner)
{
	struct kvs_lease l = lease1(3);
	cr_assert_eq(kvsp_slot_check(&s, 3, &l), KVS_SLOT_LEASED);
	cr_assert_eq(kvsp_slot_check(&s, 3, &(struct kvs_lease){ N, l.epoch }), -EINVAL);
	cr_assert_eq(kvsp_slot_check(&s, 3, &(struct kvs_lease){ l.slot, l.epoch + 1 }), -ESTALE);
	cr_assert_eq(kvsp_slot_check(&s, 4, &l), -EPERM);
	cr_assert_eq(kvsp_slot_check(&s, 0, &l), -EPERM, "owner 0 is nobody");
	cr_assert_eq(kvsp_slot_check(&s, 3, &(struct kvs_lease){ l.slot ^ 1, l.epoch }), -EPERM,
		     "a FREE slot at the right epoch is nobody's");
}

Test(slots, release_frees_and_bumps_epoch)
{
	struct kvs_lease l = lease1(3);
	cr_assert_eq(kvsp_slot_release(&s, 3, &l), 0);
	cr_assert_eq(pub[l.slot].state, KVS_SLOT_FREE);
	cr_assert_eq(pub[l.slot].epoch, l.epoch + 1);
	cr_assert_eq(pub[l.slot].owner, 0);
	struct snap x = snap();
	cr_assert_eq(kvsp_slot_release(&s, 3, &l), -ESTALE, "double release");
	assert_unchanged(&x, "a double release");
	struct kvs_lease again = lease1(3);
	cr_assert_eq(again.slot, l.slot, "LIFO: the freed slot comes back first");
	cr_assert_eq(again.epoch, l.epoch + 1);
	x = snap();
	cr_assert_eq(kvsp_slot_release(&s, 3, &l), -ESTALE, "old handle to a re-leased slot");
	cr_assert_eq(kvsp_slot_pin(&s, 3, &l), -ESTALE);
	cr_assert_eq(kvsp_slot_release(&s, 9, &again), -EPERM, "someone else's lease");
	cr_assert_eq(kvsp_slot_pin(&s, 9, &again), -EPERM);
	assert_unchanged(&x, "stale and foreign leases");
}

Test(slots, pin_unpin_handoff)
{
	struct kvs_lease l = lease1(3);
	cr_assert_eq(kvsp_slot_pin(&s, 3, &l), 0);
	cr_assert_eq(pub[l.slot].state, KVS_SLOT_INFLIGHT);
	cr_assert_eq(pub[l.slot].pins, 1);
	struct snap x = snap();
	cr_assert_eq(kvsp_slot_pin(&s, 3, &l), -EBUSY, "pinned twice");
	cr_assert_eq(kvsp_slot_release(&s, 3, &l), -EBUSY, "released while in flight");
	cr_assert_eq(kvsp_slot_handoff(&s, l.slot, 5), -EINVAL, "handed off while pinned");
	assert_unchanged(&x, "illegal moves of an in-flight slot");
	cr_assert_eq(kvsp_slot_unpin(&s, l.slot), KVS_SLOT_INFLIGHT);
	x = snap();
	cr_assert_eq(kvsp_slot_unpin(&s, l.slot), -EINVAL, "unpinned with no pin");
	cr_assert_eq(kvsp_slot_handoff(&s, l.slot, 0), -EINVAL, "handed to nobody");
	assert_unchanged(&x, "bad unpin and handoff");
	cr_assert_eq(kvsp_slot_handoff(&s, l.slot, 5), 0);
	cr_assert_eq(pub[l.slot].state, KVS_SLOT_RECV_FILLED);
	cr_assert_eq(pub[l.slot].owner, 5);
	cr_assert_eq(pub[l.slot].epoch, l.epoch + 1);
	cr_assert_eq(kvsp_slot_release(&s, 3, &l), -ESTALE, "the sender's handle is stale");
	struct kvs_lease rl = { l.slot, l.epoch + 1 };
	cr_assert_eq(kvsp_slot_release(&s, 3, &rl), -EPERM, "the sender does not own it now");
	cr_assert_eq(kvsp_slot_release(&s, 5, &rl), 0);
	cr_assert_eq(pub[l.slot].epoch, l.epoch + 2);
}

Test(slots, kill_tombstones_pinned_and_reaps_on_quiescence)
{
	struct kvs_lease l = lease1(3);
	cr_assert_eq(kvsp_slot_pin(&s, 3, &l), 0);
	cr_assert_eq(kvsp_slot_kill(&s, l.slot), KVS_SLOT_TOMBSTONE);
	cr_assert_eq(pub[l.slot].owner, 0);
	cr_assert_eq(pub[l.slot].pins, 1);
	cr_assert_eq(pub[l.slot].epoch, l.epoch + 1, "the old owner's handle goes stale at once");
	cr_assert_eq(kvsp_slot_kill(&s, l.slot), KVS_SLOT_TOMBSTONE, "kill is idempotent");
	struct kvs_lease all[N];
	cr_assert_eq(kvsp_slot_acquire(&s, 4, N - 1, -1, all), 0);
	for (int i = 0; i < N - 1; i++)
		cr_assert_neq(all[i].slot, l.slot, "a tombstone was leased");
	struct kvs_lease one;
	cr_assert_eq(kvsp_slot_acquire(&s, 4, 1, -1, &one), -ENOBUFS, "a tombstone is not free");
	cr_assert_eq(kvsp_slot_unpin(&s, l.slot), KVS_SLOT_FREE, "last pin reaps");
	cr_assert_eq(pub[l.slot].epoch, l.epoch + 2);
	cr_assert_eq(reaped, 1);
	cr_assert_eq(kvsp_slot_acquire(&s, 4, 1, -1, &one), 0);
	cr_assert_eq(one.slot, l.slot);
	cr_assert_eq(one.epoch, l.epoch + 2);
}

Test(slots, kill_frees_held_and_unpinned)
{
	struct kvs_lease a = lease1(3), b = lease1(3);
	cr_assert_eq(kvsp_slot_kill(&s, a.slot), KVS_SLOT_FREE);
	cr_assert_eq(pub[a.slot].epoch, a.epoch + 1);
	cr_assert_eq(kvsp_slot_pin(&s, 3, &b), 0);
	cr_assert_eq(kvsp_slot_unpin(&s, b.slot), KVS_SLOT_INFLIGHT);
	cr_assert_eq(kvsp_slot_kill(&s, b.slot), KVS_SLOT_FREE, "no pin: nothing to wait for");
	struct snap x = snap();
	cr_assert_eq(kvsp_slot_kill(&s, a.slot), -EINVAL, "killing a free slot");
	cr_assert_eq(kvsp_slot_kill(&s, N), -EINVAL);
	assert_unchanged(&x, "bad kills");
}

Test(slots, post_fill_and_posted_tombstone)
{
	uint32_t a, b;
	cr_assert_eq(kvsp_slot_post(&s, 6, -1, &a), 0);
	cr_assert_eq(pub[a].state, KVS_SLOT_RECV_POSTED);
	cr_assert_eq(pub[a].pins, 1);
	struct snap x = snap();
	cr_assert_eq(kvsp_slot_fill(&s, a), -EINVAL, "filled while its writer still pins it");
	assert_unchanged(&x, "fill of a pinned slot");
	/* One rule with INFLIGHT: the writer's quiescence is unpin, then it
	 * may change hands. */
	cr_assert_eq(kvsp_slot_unpin(&s, a), KVS_SLOT_RECV_POSTED);
	cr_assert_eq(pub[a].pins, 0);
	cr_assert_eq(kvsp_slot_fill(&s, a), 0);
	cr_assert_eq(pub[a].state, KVS_SLOT_RECV_FILLED);
	cr_assert_eq(pub[a].owner, 6);
	x = snap();
	cr_assert_eq(kvsp_slot_fill(&s, a), -EINVAL, "filled twice");
	cr_assert_eq(kvsp_slot_unpin(&s, a), -EINVAL, "unpinned with no pin");
	cr_assert_eq(kvsp_slot_post(&s, 0, -1, &b), -EINVAL, "posted for nobody");
	assert_unchanged(&x, "bad post and fill");
	cr_assert_eq(kvsp_slot_post(&s, 6, -1, &b), 0);
	cr_assert_eq(kvsp_slot_kill(&s, b), KVS_SLOT_TOMBSTONE, "a writer may still land");
	cr_assert_eq(kvsp_slot_unpin(&s, b), KVS_SLOT_FREE);
	cr_assert_eq(kvsp_slot_kill(&s, a), KVS_SLOT_FREE);
	/* A posted slot whose writer quiesced without landing: nothing to wait for. */
	cr_assert_eq(kvsp_slot_post(&s, 6, -1, &b), 0);
	cr_assert_eq(kvsp_slot_unpin(&s, b), KVS_SLOT_RECV_POSTED);
	cr_assert_eq(kvsp_slot_kill(&s, b), KVS_SLOT_FREE);
}

/* Every operation from every state: the legal ones move, the rest refuse
 * with no change. */
enum op { OP_RELEASE, OP_PIN, OP_UNPIN, OP_HANDOFF, OP_FILL, OP_NOPS };

static uint32_t make_state(uint8_t st, struct kvs_lease *l)
{
	uint32_t slot;
	switch (st) {
	case KVS_SLOT_FREE:
		*l = lease1(3);
		kvsp_slot_release(&s, 3, l);
		l->epoch++;
		return l->slot;
	case KVS_SLOT_LEASED:
		*l = lease1(3);
		return l->slot;
	case KVS_SLOT_INFLIGHT:
		*l = lease1(3);
		kvsp_slot_pin(&s, 3, l);
		return l->slot;
	case KVS_SLOT_TOMBSTONE:
		*l = lease1(3);
		kvsp_slot_pin(&s, 3, l);
		kvsp_slot_kill(&s, l->slot);
		l->epoch++;
		return l->slot;
	case KVS_SLOT_RECV_POSTED:
		kvsp_slot_post(&s, 3, -1, &slot);
		*l = (struct kvs_lease){ slot, pub[slot].epoch };
		return slot;
	default:
		kvsp_slot_post(&s, 3, -1, &slot);
		kvsp_slot_unpin(&s, slot);
		kvsp_slot_fill(&s, slot);
		*l = (struct kvs_lease){ slot, pub[slot].epoch };
		return slot;
	}
}

Test(slots, transition_table)
{
	/* expected[state][op]: the state after, or -1 if refused */
	static const int expected[KVS_SLOT_NSTATES][OP_NOPS] = {
		[KVS_SLOT_FREE] = { -1, -1, -1, -1, -1 },
		[KVS_SLOT_LEASED] = { KVS_SLOT_FREE, KVS_SLOT_INFLIGHT, -1, -1, -1 },
		[KVS_SLOT_INFLIGHT] = { -1, -1, KVS_SLOT_INFLIGHT, -1, -1 },
		[KVS_SLOT_TOMBSTONE] = { -1, -1, KVS_SLOT_FREE, -1, -1 },
		/* posted and pinned: only the writer's unpin; fill waits for it */
		[KVS_SLOT_RECV_POSTED] = { -1, -1, KVS_SLOT_RECV_POSTED, -1, -1 },
		[KVS_SLOT_RECV_FILLED] = { KVS_SLOT_FREE, -1, -1, -1, -1 },
	};
	for (uint8_t st = 0; st < KVS_SLOT_NSTATES; st++) {
		for (int op = 0; op < OP_NOPS; op++) {
			kvsp_slots_fini(&s);
			kvsp_slots_init(&s, pub, N, nstate, &reaped, BASE);
			struct kvs_lease l;
			uint32_t slot = make_state(st, &l);
			cr_assert_eq(pub[slot].state, st);
			uint32_t e0 = pub[slot].epoch;
			struct snap x = snap();
			int rc;
			switch (op) {
			case OP_RELEASE:
				rc = kvsp_slot_release(&s, 3, &l);
				break;
			case OP_PIN:
				rc = kvsp_slot_pin(&s, 3, &l);
				break;
			case OP_UNPIN:
				rc = kvsp_slot_unpin(&s, slot);
				break;
			case OP_HANDOFF:
				rc = kvsp_slot_handoff(&s, slot, 9);
				break;
			default:
				rc = kvsp_slot_fill(&s, slot);
				break;
			}
			if (expected[st][op] < 0) {
				cr_assert_lt(rc, 0, "state %u op %d should be refused", st, op);
				assert_unchanged(&x, "a refused transition");
			} else {
				cr_assert_geq(rc, 0, "state %u op %d should work: %d", st, op, rc);
				cr_assert_eq(pub[slot].state, expected[st][op], "state %u op %d",
					     st, op);
				cr_assert_geq(pub[slot].epoch, e0);
			}
		}
	}
}

/* A long random walk, checked after every step against a model of who
 * holds what. */
Test(slots, random_walk_keeps_every_invariant)
{
	struct kvs_lease held[N]; /* the model: the one live lease per slot, by owner */
	uint32_t owner_of[N] = { 0 };
	uint32_t last_epoch[N];
	for (int i = 0; i < N; i++)
		last_epoch[i] = pub[i].epoch;
	unsigned seed = 12345;
	for (int step = 0; step < 200000; step++) {
		uint32_t i = (uint32_t)rand_r(&seed) % N;
		uint32_t who = 1 + (uint32_t)rand_r(&seed) % 3;
		struct kvs_lease stale = { i, pub[i].epoch - 1 };
		switch (rand_r(&seed) % 8) {
		case 0: {
			struct kvs_lease l;
			if (kvsp_slot_acquire(&s, who, 1, -1, &l) == 0) {
				cr_assert_eq(owner_of[l.slot], 0, "leased a held slot");
				owner_of[l.slot] = who;
				held[l.slot] = l;
			}
			break;
		}
		case 1:
			if (owner_of[i] && pub[i].state != KVS_SLOT_INFLIGHT &&
			    kvsp_slot_release(&s, owner_of[i], &held[i]) == 0)
				owner_of[i] = 0;
			break;
		case 2:
			if (owner_of[i] && pub[i].state == KVS_SLOT_LEASED)
				cr_assert_eq(kvsp_slot_pin(&s, owner_of[i], &held[i]), 0);
			break;
		case 3:
			if (pub[i].pins) {
				int st = kvsp_slot_unpin(&s, i);
				if (st == KVS_SLOT_FREE)
					owner_of[i] = 0;
			} else if (pub[i].state == KVS_SLOT_INFLIGHT) {
				cr_assert_eq(kvsp_slot_handoff(&s, i, who), 0);
				owner_of[i] = who;
				held[i] = (struct kvs_lease){ i, pub[i].epoch };
			} else if (pub[i].state == KVS_SLOT_RECV_POSTED) {
				cr_assert_eq(kvsp_slot_fill(&s, i), 0);
			}
			break;
		case 4:
			if (pub[i].state != KVS_SLOT_FREE) {
				kvsp_slot_kill(&s, i);
				owner_of[i] = 0;
			}
			break;
		case 5: {
			/* hostile: stale and foreign leases change nothing */
			struct snap x = snap();
			kvsp_slot_release(&s, who, &stale);
			kvsp_slot_pin(&s, who, &stale);
			if (owner_of[i] && owner_of[i] != who) {
				cr_assert_eq(kvsp_slot_release(&s, who, &held[i]), -EPERM);
				cr_assert_eq(kvsp_slot_pin(&s, who, &held[i]), -EPERM);
			}
			assert_unchanged(&x, "hostile leases");
			break;
		}
		case 6: {
			uint32_t slot;
			if (kvsp_slot_post(&s, who, -1, &slot) == 0) {
				cr_assert_eq(owner_of[slot], 0, "posted a held slot");
				owner_of[slot] = who;
				held[slot] = (struct kvs_lease){ slot, pub[slot].epoch };
			}
			break;
		}
		default:
			break;
		}
		/* invariants */
		uint64_t count[KVS_SLOT_NSTATES] = { 0 };
		for (uint32_t k = 0; k < N; k++) {
			struct kvs_slot *p = &pub[k];
			count[p->state]++;
			cr_assert(!KVS_EPOCH_AFTER(last_epoch[k], p->epoch),
				  "epoch went backwards");
			last_epoch[k] = p->epoch;
			switch (p->state) {
			case KVS_SLOT_FREE:
				cr_assert(p->owner == 0 && p->pins == 0);
				break;
			case KVS_SLOT_TOMBSTONE:
				cr_assert(p->owner == 0 && p->pins > 0);
				break;
			default:
				cr_assert_neq(p->owner, 0);
				cr_assert_eq(p->owner, owner_of[k], "slot %u in two owners' hands",
					     k);
				/* the one live lease is exactly the model's */
				cr_assert_geq(kvsp_slot_check(&s, p->owner, &held[k]), 0);
			}
		}
		cr_assert(!memcmp(count, nstate, sizeof(count)), "published counts drifted");
		cr_assert_eq(s.nfree, nstate[KVS_SLOT_FREE]);
		for (uint32_t k = 0; k < s.nfree; k++)
			cr_assert_eq(pub[s.free_stack[k]].state, KVS_SLOT_FREE);
	}
}

/* A pool split by NUMA node: each lease comes from its part while the part
 * has free slots, then from the fullest other; a freed slot goes back to its
 * own part; the split is refused once a slot is out, or if it is not one. */
Test(slots, parts_lease_from_their_own_node_first)
{
	const uint32_t bad[] = { 0, N, N, N };
	cr_assert_eq(kvsp_slots_split(&s, 3, bad), -EINVAL, "an empty part");
	const uint32_t start[] = { 0, N / 2, N };
	cr_assert_eq(kvsp_slots_split(&s, 2, start), 0);
	cr_assert_eq(kvsp_slot_part(&s, 0), 0);
	cr_assert_eq(kvsp_slot_part(&s, N / 2 - 1), 0);
	cr_assert_eq(kvsp_slot_part(&s, N / 2), 1);
	struct kvs_lease l[N];
	cr_assert_eq(kvsp_slot_acquire(&s, 9, N / 2, 1, l), 0);
	for (unsigned i = 0; i < N / 2; i++)
		cr_assert_eq(kvsp_slot_part(&s, l[i].slot), 1, "lease %u: slot %u", i, l[i].slot);
	cr_assert_eq(l[0].slot, N / 2, "the part's lowest first");
	struct kvs_lease more;
	cr_assert_eq(kvsp_slot_acquire(&s, 9, 1, 1, &more), 0);
	cr_assert_eq(kvsp_slot_part(&s, more.slot), 0, "part 1 is out: the other's");
	cr_assert_eq(kvsp_slot_release(&s, 9, &l[3]), 0);
	struct kvs_lease again;
	cr_assert_eq(kvsp_slot_acquire(&s, 9, 1, 1, &again), 0);
	cr_assert_eq(again.slot, l[3].slot, "a freed slot went back to its own part");
	cr_assert_eq(kvsp_slots_split(&s, 2, start), -EINVAL, "slots are out");
}
