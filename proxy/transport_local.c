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

struct local {
	struct kvsp_transport t;
	struct kvsp_xfer *held; /* FIFO; at most one transfer per slot */
	uint32_t cap, head, n;
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
		l->held[(l->head + l->n++) % l->cap] = *x;
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
	return l->n && t->p->fp[KVSP_FP_LOCAL_QUIESCE].action != KVS_FP_PAUSE;
}

static int local_poll(struct kvsp_transport *t)
{
	struct local *l = (struct local *)t;
	if (!local_pending(t))
		return KVSP_IDLE;
	struct kvsp_fp *fp = &t->p->fp[KVSP_FP_LOCAL_QUIESCE];
	int status = fp->action == KVS_FP_FAIL ? fp->err : 0;
	while (l->n) {
		struct kvsp_xfer x = l->held[l->head];
		l->head = (l->head + 1) % l->cap;
		l->n--;
		kvsp_xfer_done(t->p, &x, status);
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
