/* SPDX-License-Identifier: MIT */
/* A hostile client: writes raw submission records, bypassing every check
 * libkvstage makes, to show the proxy checks them all again. */
#ifndef KVS_TEST_RAWCLIENT_H
#define KVS_TEST_RAWCLIENT_H

#include <errno.h>
#include <poll.h>
#include <sys/eventfd.h>

#include <rte_atomic.h>

#include "client.h"

static inline void raw_kick(kvs_client *c)
{
	rte_atomic_thread_fence(__ATOMIC_SEQ_CST);
	if (__atomic_load_n(&c->ctrl->sleeping, __ATOMIC_RELAXED))
		eventfd_write(c->wake_fd, 1);
}

/* Enqueues q as is. Returns 0, or -EAGAIN if the ring is full. */
static inline int raw_submit(kvs_client *c, const struct kvs_sqe *q)
{
	if (kvs_ring_push(&c->sq, q, sizeof(*q), 1) != 1)
		return -EAGAIN;
	raw_kick(c);
	return 0;
}

/* Enqueues a sync op and waits for its reply. Returns the reply status. */
static inline int raw_sync(kvs_client *c, struct kvs_sqe *q)
{
	q->seq = ++c->seq;
	if (raw_submit(c, q))
		return -EAGAIN;
	for (int i = 0; i < 200; i++) {
		if (__atomic_load_n(&c->cshm->reply.seq, __ATOMIC_ACQUIRE) == q->seq)
			return c->cshm->reply.status;
		__atomic_store_n(&c->cshm->waiting, 1, __ATOMIC_RELAXED);
		rte_atomic_thread_fence(__ATOMIC_SEQ_CST);
		if (__atomic_load_n(&c->cshm->reply.seq, __ATOMIC_ACQUIRE) != q->seq) {
			struct pollfd p = { .fd = c->efd, .events = POLLIN };
			poll(&p, 1, 100);
			eventfd_t v;
			eventfd_read(c->efd, &v);
		}
		__atomic_store_n(&c->cshm->waiting, 0, __ATOMIC_RELAXED);
	}
	return -ETIMEDOUT;
}

#endif
