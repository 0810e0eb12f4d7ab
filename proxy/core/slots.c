/* SPDX-License-Identifier: MIT */
#include "core/slots.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* Clients read the table while we write it; single-field stores that
 * cannot tear are all they need (events order everything else). */
#define PUB_SET(f, v) __atomic_store_n(&(f), (v), __ATOMIC_RELAXED)

static void set_state(struct kvsp_slots *s, uint32_t i, uint8_t st)
{
	struct kvs_slot *p = &s->pub[i];
	KVS_STAT_SUB(s->nstate[p->state], 1);
	KVS_STAT_ADD(s->nstate[st], 1);
	PUB_SET(p->state, st);
}

static void bump(struct kvsp_slots *s, uint32_t i)
{
	PUB_SET(s->pub[i].epoch, s->pub[i].epoch + 1);
}

static inline __attribute__((always_inline)) void to_free(struct kvsp_slots *s, uint32_t i)
{
	struct kvs_slot *p = &s->pub[i];
	bump(s, i);
	PUB_SET(p->owner, 0);
	PUB_SET(p->room, 0);
	PUB_SET(p->pins, 0);
	set_state(s, i, KVS_SLOT_FREE);
	s->priv[i].room = KVSP_NONE;
	if (s->nparts == 1) { /* one node: one stack, nfree its height */
		s->free_stack[s->nfree++] = i;
		return;
	}
	unsigned k = kvsp_slot_part(s, i);
	s->free_stack[s->part_start[k] + s->part_free[k]++] = i;
	s->nfree++;
}

/* A FREE slot off part's stack, or the fullest one's. The caller checked
 * that one is free. */
static inline __attribute__((always_inline)) uint32_t pop_free(struct kvsp_slots *s, int part)
{
	if (s->nparts == 1)
		return s->free_stack[--s->nfree];
	unsigned k = part >= 0 && (unsigned)part < s->nparts ? (unsigned)part : 0;
	if (part < 0 || !s->part_free[k])
		for (unsigned j = 0; j < s->nparts; j++)
			if (s->part_free[j] > s->part_free[k])
				k = j;
	s->nfree--;
	return s->free_stack[s->part_start[k] + --s->part_free[k]];
}

/* Every slot of every part free, pushed high to low so each part's lowest
 * slot is handed out first. */
static void stack_all(struct kvsp_slots *s)
{
	s->nfree = 0;
	for (unsigned k = 0; k < s->nparts; k++) {
		s->part_free[k] = 0;
		for (uint32_t i = s->part_start[k + 1]; i-- > s->part_start[k];)
			s->free_stack[s->part_start[k] + s->part_free[k]++] = i;
		s->nfree += s->part_free[k];
	}
}

int kvsp_slots_split(struct kvsp_slots *s, unsigned n, const uint32_t *start)
{
	if (n < 2 || n > KVSP_SLOT_PARTS || start[0] != 0 || start[n] != s->count ||
	    s->nfree != s->count)
		return -EINVAL;
	for (unsigned k = 0; k < n; k++)
		if (start[k] >= start[k + 1])
			return -EINVAL;
	s->nparts = n;
	memcpy(s->part_start, start, (n + 1) * sizeof(*start));
	stack_all(s);
	return 0;
}

int kvsp_slots_init(struct kvsp_slots *s, struct kvs_slot *pub, uint32_t count, uint64_t *nstate,
		    uint64_t *reaped, uint32_t epoch_base)
{
	s->pub = pub;
	s->count = count;
	s->nstate = nstate;
	s->reaped = reaped;
	s->priv = calloc(count, sizeof(*s->priv));
	s->free_stack = calloc(count, sizeof(*s->free_stack));
	if (!s->priv || !s->free_stack) {
		kvsp_slots_fini(s);
		return -ENOMEM;
	}
	for (unsigned st = 0; st < KVS_SLOT_NSTATES; st++)
		nstate[st] = 0;
	nstate[KVS_SLOT_FREE] = count;
	for (uint32_t i = 0; i < count; i++) {
		pub[i] = (struct kvs_slot){ .epoch = epoch_base, .state = KVS_SLOT_FREE };
		s->priv[i] = (struct kvsp_slot_priv){ .room = KVSP_NONE };
	}
	s->nparts = 1;
	s->part_start[0] = 0;
	s->part_start[1] = count;
	stack_all(s);
	*reaped = 0;
	return 0;
}

void kvsp_slots_fini(struct kvsp_slots *s)
{
	free(s->priv);
	free(s->free_stack);
	s->priv = NULL;
	s->free_stack = NULL;
}

int kvsp_slot_acquire(struct kvsp_slots *s, uint32_t owner, unsigned n, int part,
		      struct kvs_lease *out)
{
	if (n > s->nfree)
		return -ENOBUFS;
	for (unsigned k = 0; k < n; k++) {
		uint32_t i = pop_free(s, part);
		PUB_SET(s->pub[i].owner, owner);
		set_state(s, i, KVS_SLOT_LEASED);
		out[k].slot = i;
		out[k].epoch = s->pub[i].epoch;
	}
	return 0;
}

int kvsp_slot_release(struct kvsp_slots *s, uint32_t owner, const struct kvs_lease *l)
{
	int st = kvsp_slot_check(s, owner, l);
	if (st < 0)
		return st;
	if (st != KVS_SLOT_LEASED && st != KVS_SLOT_RECV_FILLED)
		return -EBUSY;
	to_free(s, l->slot);
	return 0;
}

int kvsp_slot_pin(struct kvsp_slots *s, uint32_t owner, const struct kvs_lease *l)
{
	int st = kvsp_slot_check(s, owner, l);
	if (st < 0)
		return st;
	if (st != KVS_SLOT_LEASED)
		return -EBUSY;
	PUB_SET(s->pub[l->slot].pins, 1);
	set_state(s, l->slot, KVS_SLOT_INFLIGHT);
	return 0;
}

int kvsp_slot_unpin(struct kvsp_slots *s, uint32_t slot)
{
	if (slot >= s->count)
		return -EINVAL;
	struct kvs_slot *p = &s->pub[slot];
	if (!p->pins || (p->state != KVS_SLOT_INFLIGHT && p->state != KVS_SLOT_TOMBSTONE &&
			 p->state != KVS_SLOT_RECV_POSTED))
		return -EINVAL;
	PUB_SET(p->pins, p->pins - 1);
	if (p->state == KVS_SLOT_TOMBSTONE && p->pins == 0) {
		to_free(s, slot);
		KVS_STAT_ADD(*s->reaped, 1);
	}
	return p->state;
}

int kvsp_slot_handoff(struct kvsp_slots *s, uint32_t slot, uint32_t new_owner)
{
	if (slot >= s->count || !new_owner)
		return -EINVAL;
	struct kvs_slot *p = &s->pub[slot];
	if (p->state != KVS_SLOT_INFLIGHT || p->pins)
		return -EINVAL;
	bump(s, slot);
	PUB_SET(p->owner, new_owner);
	set_state(s, slot, KVS_SLOT_RECV_FILLED);
	return 0;
}

int kvsp_slot_post(struct kvsp_slots *s, uint32_t owner, int part, uint32_t *slot)
{
	if (!owner)
		return -EINVAL;
	if (!s->nfree)
		return -ENOBUFS;
	uint32_t i = pop_free(s, part);
	PUB_SET(s->pub[i].owner, owner);
	PUB_SET(s->pub[i].pins, 1);
	set_state(s, i, KVS_SLOT_RECV_POSTED);
	*slot = i;
	return 0;
}

int kvsp_slot_fill(struct kvsp_slots *s, uint32_t slot)
{
	if (slot >= s->count)
		return -EINVAL;
	struct kvs_slot *p = &s->pub[slot];
	if (p->state != KVS_SLOT_RECV_POSTED || p->pins)
		return -EINVAL;
	set_state(s, slot, KVS_SLOT_RECV_FILLED);
	return 0;
}

int kvsp_slot_kill(struct kvsp_slots *s, uint32_t slot)
{
	if (slot >= s->count)
		return -EINVAL;
	struct kvs_slot *p = &s->pub[slot];
	switch (p->state) {
	case KVS_SLOT_LEASED:
	case KVS_SLOT_RECV_FILLED:
		to_free(s, slot);
		break;
	case KVS_SLOT_INFLIGHT:
	case KVS_SLOT_RECV_POSTED:
		if (!p->pins) {
			to_free(s, slot);
			break;
		}
		/* A transport may still touch it: nobody's, and never reused
		 * until the last pin goes. */
		bump(s, slot);
		PUB_SET(p->owner, 0);
		set_state(s, slot, KVS_SLOT_TOMBSTONE);
		break;
	case KVS_SLOT_TOMBSTONE:
		break;
	default:
		return -EINVAL;
	}
	return p->state;
}
