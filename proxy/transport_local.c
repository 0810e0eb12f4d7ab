/* SPDX-License-Identifier: MIT */
/*
 * The local transport: sender and receiver attach to the same proxy, so a
 * chunk moves by ownership, not by copy. Completion is immediate, unless
 * the local.quiesce failpoint holds it: then the slot stays pinned and in
 * flight, as it would inside a NIC, until the failpoint is let go.
 */
#include <errno.h>
#include <stdlib.h>

#include "transport.h"

struct held {
	struct kvsp_xfer x;
	uint64_t ud_a, ud_b; /* the room's user_data, for matching */
	bool released;
};

struct local {
	struct kvsp_transport t;
	struct held *held; /* FIFO; at most one transfer per slot */
	uint32_t cap, head, n;
	uint32_t nreleased;
};

static int local_submit(struct kvsp_transport *t, const struct kvsp_xfer *x)
{
	struct local *l = (struct local *)t;
	struct kvsp *p = t->p;
	struct kvsp_room *r = &p->rooms[x->room];
	int rc = kvsp_fp_eval(&p->fp[KVSP_FP_LOCAL_QUIESCE], p->cfg.failpoints,
			      r->recv.user_data, r->send.user_data);
	if (rc == KVSP_FP_HOLD) {
		if (l->n == l->cap)
			return -ENOBUFS; /* cannot happen: one transfer per slot */
		l->held[(l->head + l->n++) % l->cap] =
			(struct held){ *x, r->recv.user_data, r->send.user_data, false };
		return 0;
	}
	kvsp_xfer_done(p, x, rc);
	return 0;
}

static void local_cancel(struct kvsp_transport *t, uint32_t room)
{
	/* Nothing to stop: a held hand-off is "already posted" and must
	 * quiesce like any other. */
	(void)t;
	(void)room;
}

static bool local_pending(struct kvsp_transport *t)
{
	struct local *l = (struct local *)t;
	return l->n && (l->nreleased || t->p->fp[KVSP_FP_LOCAL_QUIESCE].action != KVS_FP_PAUSE);
}

unsigned kvsp_local_release(struct kvsp_transport *t, uint64_t match, uint64_t mask)
{
	struct local *l = (struct local *)t;
	unsigned k = 0;
	for (uint32_t i = 0; i < l->n; i++) {
		struct held *h = &l->held[(l->head + i) % l->cap];
		if (!h->released && ((h->ud_a & mask) == match || (h->ud_b & mask) == match)) {
			h->released = true;
			k++;
		}
	}
	l->nreleased += k;
	return k;
}

static int local_poll(struct kvsp_transport *t)
{
	struct local *l = (struct local *)t;
	if (!local_pending(t))
		return KVSP_IDLE;
	struct kvsp_fp *fp = &t->p->fp[KVSP_FP_LOCAL_QUIESCE];
	bool all = fp->action != KVS_FP_PAUSE;
	int status = fp->action == KVS_FP_FAIL ? fp->err : 0;
	/* Complete what is let go, in order; keep the rest, in order. */
	uint32_t n = l->n, kept = 0;
	for (uint32_t i = 0; i < n; i++) {
		struct held h = l->held[(l->head + i) % l->cap];
		if (all || h.released) {
			if (h.released)
				l->nreleased--;
			l->n--;
			kvsp_xfer_done(t->p, &h.x, h.released ? 0 : status);
		} else {
			l->held[(l->head + kept++) % l->cap] = h;
		}
	}
	return KVSP_BUSY;
}

static void local_destroy(struct kvsp_transport *t)
{
	struct local *l = (struct local *)t;
	free(l->held);
	free(l);
}

static const struct kvsp_transport_ops local_ops = {
	.name = "local",
	.submit = local_submit,
	.cancel = local_cancel,
	.poll = local_poll,
	.pending = local_pending,
	.destroy = local_destroy,
};

struct kvsp_transport *kvsp_local_create(struct kvsp *p)
{
	struct local *l = calloc(1, sizeof(*l));
	if (!l)
		return NULL;
	l->cap = p->cfg.slot_count;
	l->held = calloc(l->cap, sizeof(*l->held));
	if (!l->held) {
		free(l);
		return NULL;
	}
	l->t.ops = &local_ops;
	l->t.p = p;
	return &l->t;
}
