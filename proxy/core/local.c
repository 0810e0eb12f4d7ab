/* SPDX-License-Identifier: MIT */
/*
 * The local transport: sender and receiver attach to the same proxy, so a
 * chunk moves by ownership, not by copy. The hand-off is the transfer's
 * whole life: it quiesces and lands in one step, through the core's fence.
 */
#include <stdlib.h>

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

struct kvsp_transport *kvsp_local_create(struct kvsp *p)
{
	struct kvsp_transport *t = calloc(1, sizeof(*t));
	if (!t)
		return NULL;
	t->ops = &local_ops;
	t->p = p;
	return t;
}
