/* SPDX-License-Identifier: MIT */
/*
 * The gated local transport, for tests: the local hand-off behind the
 * failpoint local.quiesce. A held hand-off keeps its slot pinned and in
 * flight, as inside a NIC, until the failpoint is let go (all of it, or
 * the rooms one release names). Used instead of the local transport only
 * when kvstaged runs with --failpoints; the production hand-off has no gate.
 */
#include <errno.h>
#include <stdlib.h>

#include "core/failpoint.h"
#include "core/local.h"

struct held {
	struct kvsp_xfer *x;
	uint64_t ud_a, ud_b; /* the room's user_data, for matching */
	bool released;
};

struct gated {
	struct kvsp_transport t;
	struct held *held; /* FIFO; at most one transfer per slot */
	uint32_t cap, head, n;
	uint32_t nreleased;
};

static int gated_submit(struct kvsp_transport *t, struct kvsp_xfer *x)
{
	struct gated *g = (struct gated *)t;
	struct kvsp *p = t->p;
	int rc = kvsp_xport_fp(p, KVSP_FP_LOCAL_QUIESCE, x->room);
	if (rc == KVSP_FP_HOLD) {
		if (g->n == g->cap)
			return -ENOBUFS; /* cannot happen: one transfer per slot */
		struct held *h = &g->held[(g->head + g->n++) % g->cap];
		*h = (struct held){ .x = x };
		kvsp_room_user_data(p, x->room, &h->ud_a, &h->ud_b);
		return 0;
	}
	kvsp_xfer_handoff(p, x, rc);
	return 0;
}

static void gated_cancel(struct kvsp_transport *t, uint32_t room, uint32_t gen, int status)
{
	/* Nothing to stop: a held hand-off is "already posted" and must
	 * quiesce like any other. */
	(void)t;
	(void)room;
	(void)gen;
	(void)status;
}

static bool gated_pending(struct kvsp_transport *t)
{
	struct gated *g = (struct gated *)t;
	int err;
	return g->n && (g->nreleased ||
			kvsp_xport_fp_action(t->p, KVSP_FP_LOCAL_QUIESCE, &err) != KVS_FP_PAUSE);
}

static unsigned gated_release(struct kvsp_transport *t, uint64_t match, uint64_t mask)
{
	struct gated *g = (struct gated *)t;
	unsigned k = 0;
	for (uint32_t i = 0; i < g->n; i++) {
		struct held *h = &g->held[(g->head + i) % g->cap];
		if (!h->released && ((h->ud_a & mask) == match || (h->ud_b & mask) == match)) {
			h->released = true;
			k++;
		}
	}
	g->nreleased += k;
	return k;
}

static int gated_poll(struct kvsp_transport *t)
{
	struct gated *g = (struct gated *)t;
	if (!gated_pending(t))
		return KVSP_IDLE;
	int err;
	int action = kvsp_xport_fp_action(t->p, KVSP_FP_LOCAL_QUIESCE, &err);
	bool all = action != KVS_FP_PAUSE;
	int status = action == KVS_FP_FAIL ? err : 0;
	/* Complete what is let go, in order; keep the rest, in order. */
	uint32_t n = g->n, kept = 0;
	for (uint32_t i = 0; i < n; i++) {
		struct held h = g->held[(g->head + i) % g->cap];
		if (all || h.released) {
			if (h.released)
				g->nreleased--;
			g->n--;
			kvsp_xfer_handoff(t->p, h.x, h.released ? 0 : status);
		} else {
			g->held[(g->head + kept++) % g->cap] = h;
		}
	}
	return KVSP_BUSY;
}

static void gated_destroy(struct kvsp_transport *t)
{
	struct gated *g = (struct gated *)t;
	free(g->held);
	free(g);
}

static const struct kvsp_transport_ops gated_ops = {
	.name = "local (gated)",
	.submit = gated_submit,
	.cancel = gated_cancel,
	.poll = gated_poll,
	.pending = gated_pending,
	.destroy = gated_destroy,
};

struct kvsp_transport *kvsp_gated_create(struct kvsp *p)
{
	struct gated *g = calloc(1, sizeof(*g));
	if (!g)
		return NULL;
	g->cap = kvsp_slot_count(p);
	g->held = calloc(g->cap, sizeof(*g->held));
	if (!g->held) {
		free(g);
		return NULL;
	}
	g->t.ops = &gated_ops;
	g->t.p = p;
	kvsp_xport_fp_holder(p, KVSP_FP_LOCAL_QUIESCE, &g->t, gated_release);
	return &g->t;
}
