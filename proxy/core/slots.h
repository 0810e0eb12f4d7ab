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

struct kvsp_slots {
	struct kvs_slot *pub; /* published in the control segment */
	struct kvsp_slot_priv *priv;
	uint32_t *free_stack; /* LIFO: the most recently freed slot is cache-hot */
	uint32_t nfree;
	uint32_t count;
	uint64_t *nstate; /* published: slots in each state */
	uint64_t *reaped; /* published: tombstones reaped */
};

/* Sets up count FREE slots at epoch epoch_base over pub[], counting them per
 * state in nstate[] and reaped tombstones in *reaped. Returns 0, or -ENOMEM. */
int kvsp_slots_init(struct kvsp_slots *s, struct kvs_slot *pub, uint32_t count, uint64_t *nstate,
		    uint64_t *reaped, uint32_t epoch_base);
void kvsp_slots_fini(struct kvsp_slots *s);

/* Leases n FREE slots to owner into out[]. Returns 0, or -ENOBUFS (none leased). */
int kvsp_slot_acquire(struct kvsp_slots *s, uint32_t owner, unsigned n, struct kvs_lease *out);
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
/* A FREE slot -> RECV_POSTED for owner, pinned for the writing transport. Returns 0, or -ENOBUFS. */
int kvsp_slot_post(struct kvsp_slots *s, uint32_t owner, uint32_t *slot);
/* RECV_POSTED slot whose writer quiesced (unpinned) -> RECV_FILLED. Returns 0, or -EINVAL. */
int kvsp_slot_fill(struct kvsp_slots *s, uint32_t slot);
/* The owner is gone: held slots are freed, pinned ones become tombstones. Returns the new state, or -EINVAL. */
int kvsp_slot_kill(struct kvsp_slots *s, uint32_t slot);

#endif
