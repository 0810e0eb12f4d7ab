/* SPDX-License-Identifier: MIT */
/*
 * TEST ONLY, never installed: the buggy engines' transport, so the
 * decisive test can show that it catches what they do. It reads the
 * sender's slot, then tells the core at once that it is done with it (as
 * a transport's "release" or timeout does while the NIC still holds the
 * address), and later writes the chunk to the address it captured, which
 * by then may be someone else's. Behind failpoint local.quiesce, like the
 * gated transport, so the late write is staged with the same barrier.
 *
 * The core is the production one: this file proves the core cannot save
 * a transport that reports quiescence early (invariant 3 is the
 * transport's promise), and that the test sees the damage.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/config.h"
#include "core/failpoint.h"
#include "core/proxy.h"
#include "core/xport.h"
#include "daemon/daemon.h"

struct late_write {
	void *dst;	/* the address it captured */
	uint8_t *bytes; /* what it read */
	uint32_t len;
};

struct vulnerable {
	struct kvsp_transport t;
	struct late_write *w;
	uint32_t cap, n;
};

static int vuln_submit(struct kvsp_transport *t, struct kvsp_xfer *x)
{
	struct vulnerable *v = (struct vulnerable *)t;
	struct kvsp *p = t->p;
	if (kvsp_xport_fp(p, KVSP_FP_LOCAL_QUIESCE, x->room) != KVSP_FP_HOLD) {
		kvsp_xfer_handoff(p, x, 0);
		return 0;
	}
	if (v->n == v->cap)
		return -ENOBUFS;
	struct late_write *w = &v->w[v->n];
	w->dst = kvsp_slot_mem(p, x->slot);
	w->len = x->len;
	w->bytes = malloc(x->len);
	if (!w->bytes)
		return -ENOMEM;
	memcpy(w->bytes, w->dst, x->len);
	v->n++;
	kvsp_xfer_quiesced(p, x, 0); /* the lie */
	return 0;
}

static void vuln_cancel(struct kvsp_transport *t, uint32_t room, uint32_t gen, int status)
{
	/* An abort stops nothing already posted: that is the bug. */
	(void)t;
	(void)room;
	(void)gen;
	(void)status;
}

static bool vuln_pending(struct kvsp_transport *t)
{
	struct vulnerable *v = (struct vulnerable *)t;
	int err;
	return v->n && kvsp_xport_fp_action(t->p, KVSP_FP_LOCAL_QUIESCE, &err) != KVS_FP_PAUSE;
}

static int vuln_poll(struct kvsp_transport *t)
{
	struct vulnerable *v = (struct vulnerable *)t;
	if (!vuln_pending(t))
		return KVSP_IDLE;
	for (uint32_t i = 0; i < v->n; i++) {
		memcpy(v->w[i].dst, v->w[i].bytes, v->w[i].len); /* the late write */
		free(v->w[i].bytes);
	}
	v->n = 0;
	return KVSP_BUSY;
}

static void vuln_destroy(struct kvsp_transport *t)
{
	struct vulnerable *v = (struct vulnerable *)t;
	for (uint32_t i = 0; i < v->n; i++)
		free(v->w[i].bytes);
	free(v->w);
	free(v);
}

static const struct kvsp_transport_ops vuln_ops = {
	.name = "vulnerable (test only)",
	.submit = vuln_submit,
	.cancel = vuln_cancel,
	.poll = vuln_poll,
	.pending = vuln_pending,
	.destroy = vuln_destroy,
};

static struct kvsp_transport *vuln_create(struct kvsp *p, const void *opts, char *why, size_t len)
{
	(void)opts;
	struct vulnerable *v = calloc(1, sizeof(*v));
	if (v) {
		v->cap = kvsp_slot_count(p);
		v->w = calloc(v->cap, sizeof(*v->w));
	}
	if (!v || !v->w) {
		free(v);
		snprintf(why, len, "vulnerable transport: out of memory");
		return NULL;
	}
	v->t.ops = &vuln_ops;
	v->t.p = p;
	return &v->t;
}

static const struct kvsp_xport_kind vuln_kind = { "vulnerable (test only)", vuln_create };

/* ------------------------------------------- the vulnerable receiver */

/*
 * The peer plane's data paths as a receiver that skips the fence: when a
 * room is aborted while a chunk's payload is still being read into the
 * slot posted for it, the stream tells the core the write is over (the
 * slot is freed and can be leased at once) and goes on reading the
 * payload into that slot's memory. Over RDMA the same: a READ not yet done
 * (held by the rdma.read failpoint) is reported over, and still goes into
 * the slot once let go. Each wraps its data path's cancel; the rest of
 * the plane is the production one.
 */
#include "datapath/datapath.h"
#include "peer/conn.h"
#include "peer/peer.h"
#include "peer/plane.h"

static struct kvsp_dp_ops vuln_stream_ops, vuln_rdma_ops;
static void (*stream_cancel)(struct kvsp_dp *dp, uint32_t room, uint32_t gen);
static struct kvsp_xfer nothing; /* what the late read ends on: no record, no effect */

static void vuln_stream_cancel(struct kvsp_dp *dp, uint32_t room, uint32_t gen)
{
	for (unsigned i = 0; i < dp->conns->hi; i++) {
		struct pconn *c = &dp->conns->conn[i];
		if (c->state == PCONN_UP && c->rx_x && c->rx_x != &nothing &&
		    c->rx_x->room == room && c->rx_x->room_gen == gen) {
			kvsp_chunk_discard(dp->p, c->rx_x, -ECANCELED); /* the lie */
			c->rx_x = &nothing; /* rx_dst still points into the slot */
		}
	}
	stream_cancel(dp, room, gen); /* what it sends is dropped as ever */
}

static void vuln_rdma_cancel(struct kvsp_dp *dp, uint32_t room, uint32_t gen)
{
	/* The lie: every READ of the room is reported over, held ones too,
	 * which stay held and go into the slot once the failpoint lets go. */
	for (uint32_t slot = 0; slot < kvsp_slot_count(dp->p); slot++) {
		struct kvsp_xfer *x = kvsp_xfer_of(dp->p, slot);
		if (x->dir == KVSP_XFER_RECV && x->xport == dp->t->idx && x->room == room &&
		    x->room_gen == gen)
			kvsp_chunk_discard(dp->p, x, -ECANCELED);
	}
}

static void vulnerable_wrap(struct kvsp_transport **xports, unsigned n)
{
	for (unsigned k = 0; k < n; k++) {
		if (strcmp(xports[k]->ops->name, "peer"))
			continue;
		unsigned ndps;
		struct kvsp_dp *const *dps = kvsp_peer_datapaths(xports[k], &ndps);
		for (unsigned d = 0; d < ndps; d++) { /* by name: a build may lack RDMA */
			if (!strcmp(dps[d]->ops->name, "stream")) {
				vuln_stream_ops = *dps[d]->ops;
				stream_cancel = vuln_stream_ops.cancel;
				vuln_stream_ops.cancel = vuln_stream_cancel;
				dps[d]->ops = &vuln_stream_ops;
			} else if (!strcmp(dps[d]->ops->name, "rdma")) {
				vuln_rdma_ops = *dps[d]->ops;
				vuln_rdma_ops.cancel = vuln_rdma_cancel;
				dps[d]->ops = &vuln_rdma_ops;
			}
		}
	}
}

/* ------------------------------------------------------ the daemon */

static void configure(struct kvsp_config *cfg)
{
	cfg->xports[0].kind = &vuln_kind; /* in place of the local hand-off */
}

static void started(struct kvsp *p)
{
	vulnerable_wrap(p->xports, p->nxports);
}

int main(int argc, char **argv)
{
	static const struct kvsp_daemon_hooks hooks = {
		.warning = "TEST-ONLY BUILD: the local transport reports quiescence early, and the "
			   "peer plane's receiver lets a late payload into a reused slot; never "
			   "deploy this",
		.configure = configure,
		.started = started,
	};
	return kvsp_daemon_main(argc, argv, &hooks);
}
