/* SPDX-License-Identifier: MIT */
/*
 * The local transport: sender and receiver attach to the same proxy, so a
 * chunk moves by ownership, not by copy. The hand-off is the transfer's
 * whole life: it quiesces and lands in one step, through the core's fence.
 */
#include <stdio.h>
#include <stdlib.h>

#include "core/local.h"
#include "core/proxy.h"
#include "core/xport.h"

static int local_submit(struct kvsp_transport *t, struct kvsp_xfer *x)
{
	kvsp_xfer_handoff(t->p, x, 0);
	return 0;
}

static void local_cancel(struct kvsp_transport *t, uint32_t room, uint32_t gen, int status)
{
	/* Nothing is ever left half-done here. */
	(void)t;
	(void)room;
	(void)gen;
	(void)status;
}

static int local_poll(struct kvsp_transport *t)
{
	(void)t;
	return KVSP_IDLE;
}

static bool local_pending(struct kvsp_transport *t)
{
	(void)t;
	return false;
}

static void local_destroy(struct kvsp_transport *t)
{
	free(t);
}

static const struct kvsp_transport_ops local_ops = {
	.name = "local",
	.submit = local_submit,
	.cancel = local_cancel,
	.poll = local_poll,
	.pending = local_pending,
	.destroy = local_destroy,
};

static struct kvsp_transport *local_create(struct kvsp *p, const void *opts, char *why, size_t len)
{
	(void)opts;
	/* Tests stage races at the hand-off (failpoint local.quiesce): only
	 * --failpoints puts the gate in, so a production proxy has none. */
	struct kvsp_transport *t = p->cfg.failpoints ? kvsp_gated_create(p) : calloc(1, sizeof(*t));
	if (!t) {
		snprintf(why, len, "local transport: out of memory");
		return NULL;
	}
	if (!p->cfg.failpoints) {
		t->ops = &local_ops;
		t->p = p;
		t->lands_at_submit = true; /* local_submit is kvsp_xfer_handoff's every time */
	}
	return t;
}

const struct kvsp_xport_kind kvsp_local_kind = { "local", local_create };
