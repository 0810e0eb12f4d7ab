/* SPDX-License-Identifier: MIT */
/*
 * The slot state machine: the only code that changes a slot's state,
 * epoch, owner or pins. Every transition checks its precondition and, when
 * it does not hold, returns -errno and changes nothing.
 *
 *   FREE --acquire--> LEASED --pin(send)--> INFLIGHT --unpin, handoff--> RECV_FILLED
 *   FREE --post(pinned)--> RECV_POSTED --unpin, fill--> RECV_FILLED
 *   LEASED, RECV_FILLED, unpinned INFLIGHT/RECV_POSTED --release/kill--> FREE (epoch+1)
 *   INFLIGHT, RECV_POSTED --kill with pins--> TOMBSTONE (epoch+1) --last unpin--> FREE (epoch+1)
 *
 * One rule for a writer or reader transport: its quiescence is unpin, in
 * every state; only an unpinned slot changes hands (handoff, fill).
 */
#ifndef KVSP_SLOTS_H
#define KVSP_SLOTS_H

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>

#include "kvstage.h"
#include "layout.h"

#define KVSP_NONE UINT32_MAX

/* What only the proxy needs to know about a slot. */
struct kvsp_slot_priv {
	uint32_t room; /* room index while a room holds it, else KVSP_NONE */
	uint32_t chunk;
	uint32_t prev, next; /* the room's list it is on */
};

#define KVSP_SLOT_PARTS 8 /* KVSP_NUMA_MAX: the pool's parts, one per NUMA node */

struct kvsp_slots {
	struct kvs_slot *pub; /* published in the control segment */
	struct kvsp_slot_priv *priv;
	/* Free slots, a LIFO per part of the pool (the most recently freed
	 * slot is cache-hot): part k's are free_stack[part_start[k] ..
	 * part_start[k] + part_free[k]), as its slots are part_start[k] ..
	 * part_start[k + 1] - 1. One part unless the pool is split by node:
	 * then the stack is free_stack[0 .. nfree) and part_free is not kept. */
	uint32_t *free_stack;
	uint32_t nfree;
	uint32_t count;
	unsigned nparts;
	uint32_t part_start[KVSP_SLOT_PARTS + 1];
	uint32_t part_free[KVSP_SLOT_PARTS];
	uint64_t *nstate; /* published: slots in each state */
	uint64_t *reaped; /* published: tombstones reaped */
};

/* Sets up count FREE slots at epoch epoch_base over pub[], counting them per
 * state in nstate[] and reaped tombstones in *reaped. Returns 0, or -ENOMEM. */
int kvsp_slots_init(struct kvsp_slots *s, struct kvs_slot *pub, uint32_t count, uint64_t *nstate,
		    uint64_t *reaped, uint32_t epoch_base);
void kvsp_slots_fini(struct kvsp_slots *s);

/* Splits the pool into n parts (2 to KVSP_SLOT_PARTS): part k is slots
 * start[k] .. start[k + 1] - 1 (start[0] 0, start[n] the count, ascending).
 * Only while every slot is FREE. Returns 0, or -EINVAL. */
int kvsp_slots_split(struct kvsp_slots *s, unsigned n, const uint32_t *start);
/* Returns the part slot is in. */
static inline unsigned kvsp_slot_part(const struct kvsp_slots *s, uint32_t slot)
{
	unsigned k = 0;
	while (k + 1 < s->nparts && slot >= s->part_start[k + 1])
		k++;
	return k;
}
/* Leases n FREE slots to owner into out[], from part as far as it has them
 * (part -1, or once it has none: the part with the most free). Returns 0,
 * or -ENOBUFS (none leased). */
int kvsp_slot_acquire(struct kvsp_slots *s, uint32_t owner, unsigned n, int part,
		      struct kvs_lease *out);
/* Judges owner's lease l. Returns its state, or -EINVAL (no such slot), -ESTALE, -EPERM. */
static inline int kvsp_slot_check(const struct kvsp_slots *s, uint32_t owner,
				  const struct kvs_lease *l)
{
	if (l->slot >= s->count)
		return -EINVAL;
	const struct kvs_slot *p = &s->pub[l->slot];
	if (p->epoch != l->epoch)
		return -ESTALE;
	if (p->owner != owner || owner == 0)
		return -EPERM;
	return p->state;
}
/* LEASED or RECV_FILLED l -> FREE. Returns 0, or -EINVAL, -ESTALE, -EPERM, -EBUSY (in flight). */
int kvsp_slot_release(struct kvsp_slots *s, uint32_t owner, const struct kvs_lease *l);
/* LEASED l -> INFLIGHT with one transport pin. Returns 0, or -EINVAL, -ESTALE, -EPERM, -EBUSY. */
int kvsp_slot_pin(struct kvsp_slots *s, uint32_t owner, const struct kvs_lease *l);
/* A transport quiesced: drops a pin; the last pin of a TOMBSTONE frees it. Returns the new state, or -EINVAL. */
int kvsp_slot_unpin(struct kvsp_slots *s, uint32_t slot);
/* Unpinned INFLIGHT slot -> RECV_FILLED owned by new_owner (epoch+1). Returns 0, or -EINVAL. */
int kvsp_slot_handoff(struct kvsp_slots *s, uint32_t slot, uint32_t new_owner);
/* A FREE slot (of part, as kvsp_slot_acquire) -> RECV_POSTED for owner,
 * pinned for the writing transport. Returns 0, or -ENOBUFS. */
int kvsp_slot_post(struct kvsp_slots *s, uint32_t owner, int part, uint32_t *slot);
/* RECV_POSTED slot whose writer quiesced (unpinned) -> RECV_FILLED. Returns 0, or -EINVAL. */
int kvsp_slot_fill(struct kvsp_slots *s, uint32_t slot);
/* The owner is gone: held slots are freed, pinned ones become tombstones. Returns the new state, or -EINVAL. */
int kvsp_slot_kill(struct kvsp_slots *s, uint32_t slot);

#endif
