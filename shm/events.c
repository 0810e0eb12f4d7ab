/* SPDX-License-Identifier: MIT */
/*
 * libkvstage: the proxy's events, as they reach the caller (kvs_poll, kvs_wait), and what each
 * changes of its room.
 */
#include "client.h"

#include <errno.h>
#include <sys/eventfd.h>

#include <rte_atomic.h>

static void deliver(kvs_client *c, const struct kvs_cqe *e, struct kvs_event *ev)
{
	*ev = (struct kvs_event){ .type = e->type,
				  .status = e->status,
				  .user_data = e->user_data,
				  .bytes = e->bytes,
				  .lease = { e->slot, e->epoch } };
	if (e->handle >= c->nrooms)
		return;
	struct kvs_rstate *r = &c->rooms[e->handle];
	/* An event about a room that is gone (its index reused since) has
	 * nothing of the room now there to change. */
	if (!r->role || r->gen != e->gen)
		return;
	if (e->type == KVS_EV_REJECTED) {
		/* A refused send did not claim its chunk (unless the refusal
		 * is that the chunk was claimed already): it may be sent again. */
		if (r->sent && r->state == KVS_ROOM_OPEN && e->bytes < r->bytes &&
		    e->status != -EEXIST) {
			uint64_t i = e->bytes / r->chunk;
			r->sent[i / 64] &= ~(1ull << (i % 64));
		}
		return;
	}
	if (r->state == KVS_ROOM_CLOSING) {
		kvsc_room_free(c, r);
		return;
	}
	if (r->state != KVS_ROOM_OPEN)
		return;
	r->state = KVS_ROOM_ENDED;
	r->final_type = e->type;
	r->final_status = e->status;
	if (e->type == KVS_EV_RECV_DONE) {
		r->first.slot = e->slot;
		r->first.epoch = e->epoch;
	}
}

int kvs_poll(kvs_client *c, struct kvs_event *ev, unsigned max)
{
	int rc = kvsc_usable(c);
	if (rc)
		return rc;
	if (max && !ev)
		return -EINVAL;
	/* Events the proxy posted before it went away are still delivered:
	 * -ENOTCONN only once none is left. */
	unsigned n = 0;
	while (n < max && c->stash_n) {
		deliver(c, &c->stash[c->stash_head], &ev[n++]);
		c->stash_head = (c->stash_head + 1) % c->stash_cap;
		c->stash_n--;
	}
	struct kvs_cqe buf[32];
	while (n < max) {
		unsigned want = max - n < 32 ? max - n : 32;
		unsigned k = kvs_ring_pop(&c->cq, buf, sizeof(buf[0]), want);
		for (unsigned i = 0; i < k; i++)
			deliver(c, &buf[i], &ev[n++]);
		if (k < want)
			break;
	}
	/* A proxy that stopped taking our submissions for want of completion
	 * space sleeps until told that we made some. */
	if (n && kvs_ring_count(&c->sq))
		kvsc_kick_proxy(c);
	if (n == 0 && kvsc_fd_mode(c) && max) {
		/* Drain the fd first, then look once more: an event posted
		 * after our look kicks it again, so none is left unsignalled. */
		eventfd_t v;
		eventfd_read(c->efd, &v);
		unsigned want = max < 32 ? max : 32;
		n = kvs_ring_pop(&c->cq, buf, sizeof(buf[0]), want);
		for (unsigned i = 0; i < n; i++)
			deliver(c, &buf[i], &ev[i]);
		if (n == want)
			eventfd_write(c->efd, 1); /* more may wait: the fd stays readable */
		/* The fd may be readable for the proxy's hang-up: say so now,
		 * or an event loop would spin on it until the lazy check. */
		if (n == 0 && (rc = kvsc_proxy_gone(c)))
			return rc;
	}
	if (n == 0 && max && (rc = kvsc_proxy_gone_lazy(c)))
		return rc;
	return (int)n;
}

int kvs_wait(kvs_client *c, struct kvs_event *ev, int timeout_ms)
{
	int rc = kvsc_usable(c);
	if (rc || !ev)
		return rc ?: -EINVAL;
	int n = kvs_poll(c, ev, 1);
	if (n != 0)
		return n;
	uint64_t deadline = timeout_ms >= 0 ? kvsc_mono_ns() + (uint64_t)timeout_ms * 1000000
					    : KVS_NO_DEADLINE;
	for (;;) {
		__atomic_store_n(&c->cshm->waiting, 1, __ATOMIC_RELAXED);
		/* Pairs with the proxy's fence after its enqueue: either it sees
		 * `waiting` and kicks the eventfd, or we see its event here. */
		rte_atomic_thread_fence(__ATOMIC_SEQ_CST);
		n = kvs_poll(c, ev, 1);
		if (n != 0)
			break;
		if (deadline != KVS_NO_DEADLINE && kvsc_mono_ns() >= deadline) {
			n = -ETIMEDOUT;
			break;
		}
		n = kvsc_block(c, deadline);
		if (n < 0) {
			n = kvs_poll(c, ev, 1); /* an event may have beaten the hang-up */
			break;
		}
	}
	kvsc_unwait(c);
	return n;
}
