/* SPDX-License-Identifier: MIT */
/*
 * The decoder: one submission record, already copied out of the client's
 * ring, checked field by field and dispatched. Nothing here trusts the
 * record: every index is bounds-checked, every lease judged against the
 * proxy's own table, and a refusal changes no state.
 */
#include <errno.h>
#include <string.h>

#include "core/ops.h"

#include "core/clients.h"
#include "core/proxy.h"
#include "core/rooms.h"
#include "core/xport.h"
#include "ring.h"

#define BURST 32 /* records a client gets per pass: one client cannot starve the rest */

static bool handle_in_use(const struct kvsp *p, const struct kvsp_client *c, uint16_t h)
{
	return h < p->cfg.client_rooms && c->handles[h].state != KVSP_H_FREE;
}

static void op_sync(struct kvsp *p, struct kvsp_client *c, const struct kvs_sqe *q)
{
	struct kvs_lease l = { q->slot, q->epoch };
	int rc;

	switch (q->op) {
	case KVS_OP_ACQUIRE:
		if (!q->arg || q->arg > p->cfg.slot_count) {
			rc = -EINVAL;
			break;
		}
		rc = kvsp_fp_eval(&p->fp[KVSP_FP_ACQUIRE], p->cfg.failpoints, 0, 0);
		if (rc == 0)
			rc = kvsp_slot_acquire(&p->slots, c->id, (unsigned)q->arg, c->part,
					       c->reply_leases);
		else if (rc > 0)
			rc = -EAGAIN; /* pause is not meaningful here */
		break;
	case KVS_OP_RELEASE:
		rc = kvsp_lease_release(p, c, &l);
		break;
	case KVS_OP_RECV_OPEN: {
		struct kvs_desc_wire d;
		rc = kvsp_room_open_recv(p, c, q->handle, q->arg, q->readers, q->arg2, &d);
		if (rc == 0) {
			c->handles[q->handle].gen = q->gen;
			memcpy(c->cshm->reply.desc, &d, sizeof(d));
			c->cshm->reply.slot_size = p->cfg.slot_size;
		}
		break;
	}
	case KVS_OP_SEND_OPEN:
	case KVS_OP_RECV_JOIN: {
		/* Copy once, then check the copy: the client can rewrite the
		 * request area while we look at it. */
		struct kvs_desc_wire d;
		uint64_t bytes = 0;
		memcpy(&d, c->cshm->request, sizeof(d));
		rc = q->op == KVS_OP_SEND_OPEN
			     ? kvsp_room_open_send(p, c, q->handle, &d, q->arg2, &bytes)
			     : kvsp_room_join(p, c, q->handle, &d, q->arg2, &bytes);
		if (rc == 0) {
			c->handles[q->handle].gen = q->gen;
			c->cshm->reply.bytes = bytes;
			c->cshm->reply.slot_size = p->cfg.slot_size;
		}
		break;
	}
	case KVS_OP_ROOM_MAP:
		rc = kvsp_room_map(p, c, q->handle, c->reply_leases);
		if (rc >= 0) {
			c->cshm->reply.n = (uint32_t)rc;
			rc = 0;
		}
		break;
	default:
		rc = -EOPNOTSUPP;
	}
	kvsp_client_reply(p, c, q->seq, rc);
}

static void client_op(struct kvsp *p, struct kvsp_client *c, const struct kvs_sqe *q)
{
	int rc = 0;
	switch (q->op) {
	case KVS_OP_NOP:
		return;
	case KVS_OP_SEND: {
		struct kvs_lease l = { q->slot, q->epoch };
		rc = kvsp_room_send(p, c, q->handle, &l, q->arg, q->len);
		break;
	}
	case KVS_OP_ABORT:
		if (!handle_in_use(p, c, q->handle))
			rc = -EBADF;
		else
			kvsp_room_abort_from(p, c, q->handle, -ECANCELED);
		break;
	case KVS_OP_CLOSE:
		if (!handle_in_use(p, c, q->handle))
			rc = -EBADF;
		else
			kvsp_room_detach(p, c, q->handle, -ECANCELED);
		break;
	case KVS_OP_ACQUIRE:
	case KVS_OP_RELEASE:
	case KVS_OP_RECV_OPEN:
	case KVS_OP_SEND_OPEN:
	case KVS_OP_ROOM_MAP:
	case KVS_OP_RECV_JOIN:
		op_sync(p, c, q);
		return;
	default:
		rc = -EOPNOTSUPP;
	}
	if (rc < 0)
		kvsp_client_reject(p, c, q->handle, rc, q);
}

void kvsp_client_op(struct kvsp *p, struct kvsp_client *c, const struct kvs_sqe *q)
{
	client_op(p, c, q);
	kvsp_rooms_settle(
		p); /* what the op ended, ends now: its finals come before the next op's */
}

int kvsp_client_poll(struct kvsp *p, struct kvsp_client *c)
{
	/* Each op can use at most one completion slot (a rejection) or owe
	 * one more final (an open); finals already owed keep theirs. Taking
	 * no more ops than that leaves every final room on the ring. */
	int64_t waiting = kvsp_sq_waiting(c);
	if (!waiting)
		return KVSP_IDLE; /* the common case: one line, the client's tail */
	if (waiting < 0) {
		kvsp_client_cut_off(p, c);
		return KVSP_BUSY;
	}
	unsigned room = kvs_ring_free(&c->cq);
	if (room <= c->finals_owed)
		return KVSP_IDLE;
	unsigned n = room - c->finals_owed;
	if (n > BURST)
		n = BURST;
	struct kvs_sqe q[BURST];
	/* Our consumer index back into the ring first: one the client wrote
	 * there could replay old records or skip new ones. */
	c->sq.r->cons.head = c->sq.r->cons.tail = c->sq_cons;
	n = kvs_ring_pop(&c->sq, q, sizeof(q[0]), n);
	c->sq_cons += n;
	for (unsigned i = 0; i < n; i++)
		kvsp_client_op(p, c, &q[i]);
	kvsp_client_took(p, c, n);
	return n ? KVSP_BUSY : KVSP_IDLE;
}
