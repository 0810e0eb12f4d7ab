/* SPDX-License-Identifier: MIT */
/*
 * libkvstage: the client side. Async ops (send, abort, close) are checked
 * here against the proxy's read-only slot table and enqueued; the proxy
 * checks them again and answers a refusal with a REJECTED event. Sync ops
 * (acquire, release, opens, room map) wait for the proxy's reply, so their
 * result reflects every op submitted before them.
 *
 * This file: the registry of connections, liveness, and the two ways an op
 * reaches the proxy (kvsc_submit; kvsc_sync_call, which waits for the
 * reply). connect.c makes and ends connections, rooms.c holds leases and
 * rooms, events.c delivers the proxy's events; client.h is what they share.
 */
#include "client.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

#include <rte_atomic.h>
#include <rte_pause.h>

#define SPIN_POLITE_NS 5000ull /* a sync call's spin yields the CPU after this */

/* --------------------------------------------------------- registry */

/*
 * Every connection of the process, so that a room handle (see client.h)
 * finds its connection and a fork() child can mark the copies it got.
 * Writers hold the lock; the fast path only loads an entry.
 */
kvs_client *kvsc_registry[KVS_REGISTRY_MAX];
static unsigned registry_hi; /* entries from here up are empty */
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

/* Held across fork(), so the child never inherits it locked. */
static void atfork_prepare(void)
{
	pthread_mutex_lock(&registry_lock);
}

static void atfork_parent(void)
{
	pthread_mutex_unlock(&registry_lock);
}

/* The child holds copies of its parent's connections: same rings, same
 * reply area, same slots. Using one would interleave two processes' ops on
 * one connection, so from now on every call on them says -ECHILD. */
static void atfork_child(void)
{
	for (unsigned i = 0; i < registry_hi; i++)
		if (kvsc_registry[i])
			kvsc_registry[i]->forked = true;
	pthread_mutex_unlock(&registry_lock);
}

static void atfork_install(void)
{
	pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

int kvsc_registry_add(kvs_client *c)
{
	pthread_once(&atfork_once, atfork_install);
	pthread_mutex_lock(&registry_lock);
	unsigned i = 0;
	while (i < KVS_REGISTRY_MAX && kvsc_registry[i])
		i++;
	if (i < KVS_REGISTRY_MAX) {
		c->reg = (uint16_t)i;
		/* Release: a handle naming c is only made after this. */
		__atomic_store_n(&kvsc_registry[i], c, __ATOMIC_RELEASE);
		if (i >= registry_hi)
			registry_hi = i + 1;
	}
	pthread_mutex_unlock(&registry_lock);
	return i < KVS_REGISTRY_MAX ? 0 : -EMFILE;
}

void kvsc_registry_del(kvs_client *c)
{
	pthread_mutex_lock(&registry_lock);
	if (kvsc_registry[c->reg] == c)
		__atomic_store_n(&kvsc_registry[c->reg], NULL, __ATOMIC_RELEASE);
	while (registry_hi && !kvsc_registry[registry_hi - 1])
		registry_hi--;
	pthread_mutex_unlock(&registry_lock);
}

/* --------------------------------------------------------- liveness */

int kvsc_proxy_gone(kvs_client *c)
{
	char b;
	if (c->err)
		return c->err;
	ssize_t n = recv(c->sock, &b, 1, MSG_PEEK | MSG_DONTWAIT);
	if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
		c->err = -ENOTCONN;
	c->alive_ns = kvsc_coarse_ns();
	return c->err;
}

/* Moves completions from the ring to the stash, so the proxy never stalls
 * on a full ring while we wait for a reply. */
static void stash_fill(kvs_client *c)
{
	unsigned moved = 0;
	while (c->stash_n < c->stash_cap) {
		unsigned tail = (c->stash_head + c->stash_n) % c->stash_cap;
		if (!kvs_ring_pop(&c->cq, &c->stash[tail], sizeof(struct kvs_cqe), 1))
			break;
		c->stash_n++;
		moved++;
	}
	if (moved)
		kvsc_kick_proxy(c); /* it may be waiting for completion space to take our op */
}

int kvsc_submit_full(kvs_client *c, const struct kvs_sqe *q)
{
	/* Full: the proxy drains it unless it is gone, or waits for room for
	 * the events it owes us; moving those aside (bounded) lets it go on. */
	kvsc_kick_proxy(c);
	uint64_t until = kvsc_mono_ns() + 1000000;
	do {
		stash_fill(c);
		rte_pause();
		if (kvs_ring_push(&c->sq, q, sizeof(*q), 1) == 1) {
			kvsc_kick_proxy(c);
			return 0;
		}
	} while (kvsc_mono_ns() < until);
	return kvsc_proxy_gone(c) ?: -EAGAIN;
}

/* A signal does not move the deadline: poll is restarted with what is left. */
int kvsc_block(kvs_client *c, uint64_t deadline)
{
	struct pollfd p[2] = { { .fd = c->efd, .events = POLLIN },
			       { .fd = c->sock, .events = POLLIN | POLLRDHUP } };
	int rc;
	for (;;) {
		int ms = -1;
		if (deadline != KVS_NO_DEADLINE) {
			uint64_t now = kvsc_mono_ns();
			if (now >= deadline)
				return 0;
			uint64_t left = (deadline - now + 999999) / 1000000;
			ms = left > INT_MAX ? INT_MAX : (int)left;
		}
		rc = poll(p, 2, ms);
		if (rc >= 0 || errno != EINTR)
			break;
	}
	if (rc < 0)
		return -errno;
	if (p[1].revents && kvsc_proxy_gone(c))
		return c->err;
	if (p[0].revents) {
		eventfd_t v;
		eventfd_read(c->efd, &v);
	}
	return rc;
}

static uint64_t deadline_after(int64_t ns)
{
	return ns < 0 ? KVS_NO_DEADLINE : kvsc_mono_ns() + (uint64_t)ns;
}

/* The proxy did not answer in time: the connection is out of step with it. */
static int out_of_step(kvs_client *c)
{
	if (!c->err)
		c->err = -ETIMEDOUT;
	return c->err;
}

static int sync_call_wait(kvs_client *c, struct kvs_sqe *q);

int kvsc_sync_call(kvs_client *c, struct kvs_sqe *q)
{
	if (c->err)
		return c->err;
	/* Every op queued ahead of ours may earn an event, and the proxy takes
	 * ours only once there is room for them: the stash must be able to
	 * take them all and what the ring holds, or we could wait for ever. */
	if (c->stash_cap - c->stash_n < kvs_ring_count(&c->cq) + kvs_ring_count(&c->sq))
		return -EAGAIN; /* events are waiting: kvs_poll first */
	int rc = sync_call_wait(c, q);
	/* Waiting drained the event fd; events we moved aside still need it. */
	if (kvsc_fd_mode(c) && c->stash_n)
		eventfd_write(c->efd, 1);
	return rc;
}

static int sync_call_wait(kvs_client *c, struct kvs_sqe *q)
{
	uint64_t deadline = deadline_after(c->sync_timeout_ns);
	q->seq = ++c->seq;
	/* A sync call may wait for ring space, as it waits for its reply: while
	 * the proxy lives and our stash can take its events, it makes room. */
	int rc;
	while ((rc = kvsc_submit(c, q)) == -EAGAIN && c->stash_n < c->stash_cap) {
		if (kvsc_mono_ns() >= deadline)
			return out_of_step(c);
		if ((rc = kvsc_block(c, kvsc_mono_ns() + 1000000)) < 0)
			break;
	}
	if (rc < 0) {
		c->seq--;
		return rc;
	}
	uint64_t t0 = c->spin_ns ? kvsc_mono_ns() : 0, spin_until = t0 + c->spin_ns;
	for (unsigned i = 0;; i++) {
		/* Acquire pairs with the proxy's release store of reply.seq:
		 * the reply fields and lease area are complete once we see it. */
		if (__atomic_load_n(&c->cshm->reply.seq, __ATOMIC_ACQUIRE) == q->seq)
			return c->cshm->reply.status;
		stash_fill(c);
		if (t0 && ((i + 1) & 63)) { /* the clock is read every 64 turns, not at once */
			rte_pause();
			continue;
		}
		if (t0) {
			uint64_t now = kvsc_mono_ns();
			if (now < spin_until) {
				/* Past the first few microseconds the proxy may be
				 * waiting for this CPU (it is not pinned apart from
				 * us): let it run. Alone, sched_yield returns at once. */
				if (now - t0 >= SPIN_POLITE_NS)
					sched_yield();
				continue;
			}
		}
		__atomic_store_n(&c->cshm->waiting, 1, __ATOMIC_RELAXED);
		/* Pairs with the proxy's fence between its reply and reading
		 * `waiting`: one of us sees the other's store. */
		rte_atomic_thread_fence(__ATOMIC_SEQ_CST);
		if (__atomic_load_n(&c->cshm->reply.seq, __ATOMIC_ACQUIRE) != q->seq) {
			uint64_t wake = kvsc_mono_ns() + 100000000;
			rc = kvsc_block(c, wake < deadline ? wake : deadline);
			if (rc == 0)
				rc = kvsc_proxy_gone(c);
			if (rc < 0 || kvsc_mono_ns() >= deadline) {
				kvsc_unwait(c);
				/* the reply may have come before the hang-up or the bound */
				if (__atomic_load_n(&c->cshm->reply.seq, __ATOMIC_ACQUIRE) ==
				    q->seq)
					return c->cshm->reply.status;
				return rc < 0 ? rc : out_of_step(c);
			}
		}
		kvsc_unwait(c);
	}
}

/* ------------------------------------------------------------- strings */

const char *kvs_version(void)
{
	return KVS_VERSION_STRING;
}

const char *kvs_strerror(int err)
{
	switch (err) {
	case 0:
		return "success";
	case -ESTALE:
		return "stale lease or descriptor: its epoch or generation is gone";
	case -EPERM:
		return "not yours: the slot belongs to someone else, or the room token is wrong";
	case -ENOBUFS:
		return "pool exhausted: no free slot";
	case -EAGAIN:
		return "try again: ring full, events waiting, or room not complete yet";
	case -EINVAL:
		return "invalid argument";
	case -ENOTCONN:
		return "proxy gone: the connection to kvstaged is closed";
	case -ECANCELED:
		return "room aborted";
	case -ETIMEDOUT:
		return "timed out (a room's final: its peer proxy stopped answering within "
		       "--peer-timeout, or the room within --room-timeout; from a sync call: the "
		       "proxy did not answer within the bound, and the connection is no longer "
		       "usable)";
	case -EBUSY:
		return "busy: the slot is in flight, or the room already has a sender";
	case -EEXIST:
		return "that chunk was already sent";
	case -EBADF:
		return "not an open room handle of this role (closed, or never opened)";
	case -EALREADY:
		return "the room is complete: it takes no more chunks";
	case -ECHILD:
		return "this connection belongs to the parent process: after fork(), connect anew";
	case -EUSERS:
		return "the proxy is full: too many clients, or too many connecting at once";
	case -ENOSR:
		return "peer sessions full: the proxy holds as many sessions with other proxies as "
		       "it can, or dials as many for this client at once as it may (try again)";
	case -EMFILE:
		return "no room handle free on this connection";
	case -ENFILE:
		return "the proxy's room table is full";
	case -EMSGSIZE:
		return "room larger than the whole pool";
	case -ERANGE:
		return "chunk index out of range";
	case -ESHUTDOWN:
		return "proxy shutting down";
	case -ECONNRESET:
		return "the other side of the room went away (its client died or closed)";
	case -EPROTO:
		return "protocol mismatch with the proxy (version?)";
	case -ENOEXEC:
		return "libkvstage and kvstaged were built against DPDK versions that lay out "
		       "rte_ring differently: rebuild them against the same DPDK";
	case -EACCES:
		return "permission denied: the socket's mode or the proxy's "
		       "--allow-uid/--allow-gid refused this user";
	case -ENOENT:
		return "no proxy socket at that path";
	case -ECONNREFUSED:
		return "no proxy listening at that path, or it closed the connection unasked";
	case -EOPNOTSUPP:
		return "not supported";
	case -ENODEV:
		return "no device";
	case -EIO:
		return "transport I/O error";
	case -ENOMEM:
		return "out of memory";
	default:
		return err < 0 ? strerror(-err) : "not an error code";
	}
}
