/* SPDX-License-Identifier: MIT */
/*
 * libkvstage: the client side. Async ops (send, abort, close) are checked
 * here against the proxy's read-only slot table and enqueued; the proxy
 * checks them again and answers a refusal with a REJECTED event. Sync ops
 * (acquire, release, opens, room map) wait for the proxy's reply, so their
 * result reflects every op submitted before them.
 */
#include "client.h"

#include <endian.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <rte_atomic.h>
#include <rte_pause.h>

#include "sock.h"

#define LIVENESS_NS 1000000ull /* async calls look at the socket at most every 1 ms */
#define SPIN_POLITE_NS 5000ull /* a sync call's spin yields the CPU after this */
#define SYNC_TIMEOUT_MS 10000  /* default bound on a sync call */
#define NO_DEADLINE UINT64_MAX

static uint64_t mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The vDSO's coarse clock: no syscall, a tick's resolution. Liveness
 * checks use it and nothing else, so their differences never go negative. */
static uint64_t coarse_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* --------------------------------------------------------- registry */

/*
 * Every connection of the process, so that a room handle (see client.h)
 * finds its connection and a fork() child can mark the copies it got.
 * Writers hold the lock; the fast path only loads an entry.
 */
static kvs_client *registry[KVS_REGISTRY_MAX];
static unsigned registry_hi; /* entries from here up are empty */
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static uint32_t room_gen; /* process-wide, so no two rooms share one for 2^32 opens */

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
		if (registry[i])
			registry[i]->forked = true;
	pthread_mutex_unlock(&registry_lock);
}

static void atfork_install(void)
{
	pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

static int registry_add(kvs_client *c)
{
	pthread_once(&atfork_once, atfork_install);
	pthread_mutex_lock(&registry_lock);
	unsigned i = 0;
	while (i < KVS_REGISTRY_MAX && registry[i])
		i++;
	if (i < KVS_REGISTRY_MAX) {
		c->reg = (uint16_t)i;
		/* Release: a handle naming c is only made after this. */
		__atomic_store_n(&registry[i], c, __ATOMIC_RELEASE);
		if (i >= registry_hi)
			registry_hi = i + 1;
	}
	pthread_mutex_unlock(&registry_lock);
	return i < KVS_REGISTRY_MAX ? 0 : -EMFILE;
}

static void registry_del(kvs_client *c)
{
	pthread_mutex_lock(&registry_lock);
	if (registry[c->reg] == c)
		__atomic_store_n(&registry[c->reg], NULL, __ATOMIC_RELEASE);
	while (registry_hi && !registry[registry_hi - 1])
		registry_hi--;
	pthread_mutex_unlock(&registry_lock);
}

/* c may be used by this process: 0, or -EINVAL, -ECHILD. */
static int usable(const kvs_client *c)
{
	if (!c)
		return -EINVAL;
	return c->forked ? -ECHILD : 0;
}

/* The room handle h names, if it names one that is open now (not closed,
 * not reused). Returns 0, or -EINVAL (NULL), -EBADF, -ECHILD. */
/* Inline: every kvs_send takes it. */
static inline __attribute__((always_inline)) int room_find(const kvs_room *h, kvs_client **cp,
							   struct kvs_rstate **rp)
{
	if (!h)
		return -EINVAL;
	kvs_client *c = __atomic_load_n(&registry[kvs_room_handle_reg(h)], __ATOMIC_ACQUIRE);
	if (!c)
		return -EBADF;
	if (c->forked)
		return -ECHILD;
	uint16_t i = kvs_room_handle_idx(h);
	if (i >= c->nrooms)
		return -EBADF;
	struct kvs_rstate *r = &c->rooms[i];
	if (!r->role || r->gen != kvs_room_handle_gen(h) || r->state == KVS_ROOM_CLOSING)
		return -EBADF;
	*cp = c;
	*rp = r;
	return 0;
}

/* --------------------------------------------------------- liveness */

/* The connection's error once the proxy's end of the socket is gone. Costs a syscall. */
static int proxy_gone(kvs_client *c)
{
	char b;
	if (c->err)
		return c->err;
	ssize_t n = recv(c->sock, &b, 1, MSG_PEEK | MSG_DONTWAIT);
	if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
		c->err = -ENOTCONN;
	c->alive_ns = coarse_ns();
	return c->err;
}

/* Rate-limited proxy_gone for the async fast path. */
static int proxy_gone_lazy(kvs_client *c)
{
	if (c->err)
		return c->err;
	if (coarse_ns() - c->alive_ns < LIVENESS_NS)
		return 0;
	return proxy_gone(c);
}

static void unwait(kvs_client *c);

/* kvs_event_fd was asked for: the proxy kicks the eventfd for every batch. */
static bool fd_mode(const kvs_client *c)
{
	return c->event_fd >= 0;
}

static void kick_proxy(kvs_client *c)
{
	/* Pairs with the proxy's fence between setting `sleeping` and its last
	 * look at the rings: our enqueue (a store) must be visible before we
	 * load `sleeping`, or both sides could decide the other will act. */
	rte_atomic_thread_fence(__ATOMIC_SEQ_CST);
	if (__atomic_load_n(&c->ctrl->sleeping, __ATOMIC_RELAXED))
		eventfd_write(c->wake_fd, 1);
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
		kick_proxy(c); /* it may be waiting for completion space to take our op */
}

static int submit(kvs_client *c, const struct kvs_sqe *q)
{
	int rc = proxy_gone_lazy(c);
	if (rc)
		return rc;
	if (kvs_ring_push(&c->sq, q, sizeof(*q), 1) == 1) {
		kick_proxy(c);
		return 0;
	}
	/* Full: the proxy drains it unless it is gone, or waits for room for
	 * the events it owes us; moving those aside (bounded) lets it go on. */
	kick_proxy(c);
	uint64_t until = mono_ns() + 1000000;
	do {
		stash_fill(c);
		rte_pause();
		if (kvs_ring_push(&c->sq, q, sizeof(*q), 1) == 1) {
			kick_proxy(c);
			return 0;
		}
	} while (mono_ns() < until);
	return proxy_gone(c) ?: -EAGAIN;
}

/* Blocks until the eventfd fires, the proxy hangs up, or deadline (a
 * CLOCK_MONOTONIC ns, or NO_DEADLINE). A signal does not move the deadline.
 * Returns > 0 when woken, 0 at the deadline, or -errno (-ENOTCONN). */
static int block(kvs_client *c, uint64_t deadline)
{
	struct pollfd p[2] = { { .fd = c->efd, .events = POLLIN },
			       { .fd = c->sock, .events = POLLIN | POLLRDHUP } };
	int rc;
	for (;;) {
		int ms = -1;
		if (deadline != NO_DEADLINE) {
			uint64_t now = mono_ns();
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
	if (p[1].revents && proxy_gone(c))
		return c->err;
	if (p[0].revents) {
		eventfd_t v;
		eventfd_read(c->efd, &v);
	}
	return rc;
}

static uint64_t deadline_after(int64_t ns)
{
	return ns < 0 ? NO_DEADLINE : mono_ns() + (uint64_t)ns;
}

/* The proxy did not answer in time: the connection is out of step with it. */
static int out_of_step(kvs_client *c)
{
	if (!c->err)
		c->err = -ETIMEDOUT;
	return c->err;
}

static int sync_call_wait(kvs_client *c, struct kvs_sqe *q);

static int sync_call(kvs_client *c, struct kvs_sqe *q)
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
	if (fd_mode(c) && c->stash_n)
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
	while ((rc = submit(c, q)) == -EAGAIN && c->stash_n < c->stash_cap) {
		if (mono_ns() >= deadline)
			return out_of_step(c);
		if ((rc = block(c, mono_ns() + 1000000)) < 0)
			break;
	}
	if (rc < 0) {
		c->seq--;
		return rc;
	}
	uint64_t t0 = c->spin_ns ? mono_ns() : 0, spin_until = t0 + c->spin_ns;
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
			uint64_t now = mono_ns();
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
			uint64_t wake = mono_ns() + 100000000;
			rc = block(c, wake < deadline ? wake : deadline);
			if (rc == 0)
				rc = proxy_gone(c);
			if (rc < 0 || mono_ns() >= deadline) {
				unwait(c);
				/* the reply may have come before the hang-up or the bound */
				if (__atomic_load_n(&c->cshm->reply.seq, __ATOMIC_ACQUIRE) ==
				    q->seq)
					return c->cshm->reply.status;
				return rc < 0 ? rc : out_of_step(c);
			}
		}
		unwait(c);
	}
}

/* ------------------------------------------------------------ connect */

static void unmap_all(kvs_client *c)
{
	if (c->ctrl)
		munmap((void *)c->ctrl, c->ctrl_size);
	/* A fork child never had the writable mappings (attach: DONTFORK);
	 * what now lies at their addresses, if anything, is the child's own. */
	if (c->forked)
		return;
	kvs_ring_unmap(&c->sq);
	kvs_ring_unmap(&c->cq);
	if (c->pool)
		munmap(c->pool, c->pool_size);
	if (c->cshm)
		munmap(c->cshm, c->cmem_size);
}

/* A fork child must never reach a slot, nor the rings and replies the
 * parent's connection shares with the proxy: without this it inherits a
 * writable view of them, and a write there lands in a slot already sent
 * (the receiver's completed chunk changes) or in the parent's rings. In the
 * child these ranges are simply not mapped: a touch faults. */
static int keep_from_children(void *p, size_t len)
{
	return madvise(p, len, MADV_DONTFORK) ? -errno : 0;
}

void kvs_close(kvs_client *c)
{
	if (!c)
		return;
	if (!c->forked) {
		/* Companions first, last attached first: they may still need
		 * the pool mapped (a DMA registration is undone before the
		 * munmap). A fork child skips them: what they registered is
		 * the parent's. */
		for (unsigned i = KVS_EXT_MAX; i-- > 0;)
			if (c->ext[i].key && c->ext[i].fini)
				c->ext[i].fini(c, c->ext[i].state);
		/* Goodbye, then the hang-up: the proxy aborts and reclaims
		 * either way, and counts a hang-up without it as a death. A
		 * child says nothing: the connection is its parent's. */
		struct kvs_hello bye = { .magic = KVS_MAGIC_BYE, .abi = KVS_ABI };
		if (c->welcomed && c->err != -ENOTCONN)
			(void)!send(c->sock, &bye, sizeof(bye), MSG_DONTWAIT | MSG_NOSIGNAL);
	}
	registry_del(c);
	for (unsigned i = 0; c->rooms && i < c->nrooms; i++) {
		free(c->rooms[i].sent);
		free(c->rooms[i].map);
	}
	int fds[] = { c->sock, c->wake_fd, c->efd, c->event_fd };
	for (unsigned i = 0; i < 4; i++)
		if (fds[i] >= 0)
			close(fds[i]);
	unmap_all(c);
	free(c->rooms);
	free(c->free_idx);
	free(c->stash);
	free(c);
}

static void *map_fd(int fd, size_t len, int prot)
{
	struct stat st;
	if (fstat(fd, &st) < 0 || (uint64_t)st.st_size < len)
		return NULL;
	void *p = mmap(NULL, len, prot, MAP_SHARED, fd, 0);
	return p == MAP_FAILED ? NULL : p;
}

/* Reads the welcome. A proxy that refuses us early may close before our
 * hello was read: the kernel then reports ECONNRESET once, ahead of the
 * refusal that is still queued for us. */
static ssize_t recv_welcome(int sock, struct kvs_welcome *w, int *fds, int *nfds)
{
	int want = *nfds;
	ssize_t n = kvs_sock_recv(sock, w, sizeof(*w), fds, nfds, 0);
	if (n == -ECONNRESET) {
		*nfds = want;
		n = kvs_sock_recv(sock, w, sizeof(*w), fds, nfds, MSG_DONTWAIT);
		if (n == -EAGAIN || n == 0 || n == -ECONNRESET)
			n = -ECONNREFUSED; /* closed on us with no reason given */
	}
	return n;
}

static int handshake(kvs_client *c, const char *path, int fds[KVS_WELCOME_NFDS],
		     struct kvs_welcome *w)
{
	int sock = kvs_sock_connect(path);
	if (sock < 0)
		return sock;
	c->sock = sock;
	/* A wedged proxy must not hang kvs_connect. */
	struct timeval tv = { .tv_sec = 10 };
	setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	struct kvs_hello h = { .magic = KVS_MAGIC_HELLO,
			       .abi = KVS_ABI,
			       .kind = KVS_HELLO_CLIENT,
			       .ring_layout = kvs_ring_layout() };
	int rc = kvs_sock_send(sock, &h, sizeof(h), NULL, 0);
	/* A proxy that refuses us at accept has closed before our hello;
	 * its reason is still waiting to be read. */
	if (rc < 0 && rc != -EPIPE && rc != -ECONNRESET)
		return rc;
	int nfds = KVS_WELCOME_NFDS;
	ssize_t n = recv_welcome(sock, w, fds, &nfds);
	if (n < 0)
		return n == -EAGAIN ? -ETIMEDOUT : (int)n;
	if (n != sizeof(*w) || w->magic != KVS_MAGIC_HELLO) {
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		return n == 0 ? -ECONNREFUSED : -EPROTO;
	}
	if (w->status < 0 || nfds != KVS_WELCOME_NFDS) {
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		return w->status < 0 ? w->status : -EPROTO;
	}
	if (w->abi != KVS_ABI) {
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		return -EPROTO;
	}
	tv.tv_sec = 0;
	setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	return 0;
}

static int attach(kvs_client *c, const struct kvs_welcome *w, const int fds[KVS_WELCOME_NFDS])
{
	int pool_fd = fds[0], ctrl_fd = fds[1], cmem_fd = fds[2];
	c->wake_fd = fds[3];
	c->efd = fds[4];

	c->ctrl_size = w->ctrl_size;
	c->ctrl = map_fd(ctrl_fd, c->ctrl_size, PROT_READ);
	if (!c->ctrl || c->ctrl->magic != KVS_MAGIC_CTRL || c->ctrl->abi != KVS_ABI ||
	    c->ctrl->instance != w->instance)
		return -EPROTO;
	if (c->ctrl->ring_layout != kvs_ring_layout())
		return -ENOEXEC; /* its rings are laid out by another DPDK than ours */
	c->slot_size = c->ctrl->slot_size;
	c->slot_count = c->ctrl->slot_count;
	c->pool_size = c->ctrl->pool_size;
	c->slots = (const struct kvs_slot *)((const uint8_t *)c->ctrl + c->ctrl->slots_off);
	c->pool = map_fd(pool_fd, c->pool_size, PROT_READ | PROT_WRITE);
	if (!c->pool)
		return -ENOMEM;
	int rc = keep_from_children(c->pool, c->pool_size);
	if (rc < 0)
		return rc;
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
	/* The proxy allocated every page; fill our page tables in one pass
	 * now rather than fault each page on first touch in the fast path.
	 * Best effort: older kernels lack it, and that only costs faults. */
	madvise(c->pool, c->pool_size, MADV_POPULATE_WRITE);

	struct kvs_cmem_layout l;
	kvs_cmem_layout(&l, c->slot_count, c->ctrl->sq_count, c->ctrl->cq_count);
	if (l.size != w->cmem_size)
		return -EPROTO;
	c->cmem_size = l.size;
	c->cshm = map_fd(cmem_fd, c->cmem_size, PROT_READ | PROT_WRITE);
	if (!c->cshm)
		return -ENOMEM;
	c->reply_leases = (const struct kvs_lease *)((uint8_t *)c->cshm + l.reply_off);
	rc = kvs_ring_map(&c->sq, ctrl_fd, c->ctrl->sq_geom_off, cmem_fd, l.sq_off,
			  l.cq_off - l.sq_off);
	if (rc == 0)
		rc = kvs_ring_map(&c->cq, ctrl_fd, c->ctrl->cq_geom_off, cmem_fd, l.cq_off,
				  l.size - l.cq_off);
	if (rc == 0)
		rc = keep_from_children(c->cshm, c->cmem_size);
	if (rc == 0)
		rc = keep_from_children(c->sq.map, c->sq.map_len);
	if (rc == 0)
		rc = keep_from_children(c->cq.map, c->cq.map_len);
	if (rc < 0)
		return rc;

	c->id = w->client_id;
	c->nrooms = c->ctrl->client_rooms;
	c->rooms = calloc(c->nrooms, sizeof(*c->rooms));
	c->free_idx = calloc(c->nrooms, sizeof(*c->free_idx));
	c->stash_cap = c->ctrl->cq_count + c->ctrl->sq_count; /* see sync_call */
	c->stash = calloc(c->stash_cap, sizeof(*c->stash));
	if (!c->rooms || !c->free_idx || !c->stash)
		return -ENOMEM;
	for (unsigned i = 0; i < c->nrooms; i++) {
		c->rooms[i].idx = (uint16_t)i;
		c->free_idx[i] = (uint16_t)(c->nrooms - 1 - i);
	}
	c->nfree = c->nrooms;
	return 0;
}

/* A number of the environment: unset leaves *out as it is. Returns 0, or -EINVAL. */
static int env_num(const char *name, long long min, long long max, long long *out)
{
	const char *s = getenv(name);
	if (!s)
		return 0;
	char *end;
	errno = 0;
	long long v = strtoll(s, &end, 10);
	if (errno || end == s || *end || (*s != '-' && (*s < '0' || *s > '9')) || v < min ||
	    v > max)
		return -EINVAL;
	*out = v;
	return 0;
}

int kvs_connect(const char *path, kvs_client **out)
{
	if (!out)
		return -EINVAL;
	*out = NULL;
	if (!path)
		path = getenv("KVSTAGE_SOCKET");
	if (!path || !*path)
		path = KVS_DEFAULT_SOCKET;
	long long spin_us = 20, sync_ms = SYNC_TIMEOUT_MS;
	if (env_num("KVSTAGE_SPIN_US", 0, 1000000, &spin_us) ||
	    env_num("KVSTAGE_SYNC_TIMEOUT_MS", -1, INT_MAX, &sync_ms) || sync_ms == 0)
		return -EINVAL;
	kvs_client *c = calloc(1, sizeof(*c));
	if (!c)
		return -ENOMEM;
	c->sock = c->wake_fd = c->efd = c->event_fd = -1;
	c->spin_ns = (uint64_t)spin_us * 1000;
	c->sync_timeout_ns = sync_ms < 0 ? -1 : sync_ms * 1000000;

	int fds[KVS_WELCOME_NFDS];
	struct kvs_welcome w;
	int rc = handshake(c, path, fds, &w);
	if (rc == 0) {
		c->welcomed = true;
		rc = attach(c, &w, fds);
		/* The mappings keep what we need; these three are not used again. */
		close(fds[0]);
		close(fds[1]);
		close(fds[2]);
	}
	if (rc == 0)
		rc = registry_add(c);
	if (rc < 0) {
		kvs_close(c);
		return rc;
	}
	c->alive_ns = coarse_ns();
	*out = c;
	return 0;
}

int kvs_set_sync_timeout(kvs_client *c, int timeout_ms)
{
	int rc = usable(c);
	if (rc)
		return rc;
	if (timeout_ms == 0)
		return -EINVAL;
	c->sync_timeout_ns = timeout_ms < 0 ? -1 : (int64_t)timeout_ms * 1000000;
	return 0;
}

size_t kvs_slot_size(const kvs_client *c)
{
	return c ? c->slot_size : 0;
}

uint32_t kvs_slot_count(const kvs_client *c)
{
	return c ? c->slot_count : 0;
}

unsigned kvs_max_rooms(const kvs_client *c)
{
	return c ? c->nrooms : 0;
}

int kvs_event_fd(kvs_client *c)
{
	int rc = usable(c);
	if (rc)
		return rc;
	if (c->event_fd < 0) {
		/* The eventfd says "events"; the socket's hang-up says "the
		 * proxy is gone", which nobody could write into the eventfd. */
		int ep = epoll_create1(EPOLL_CLOEXEC);
		if (ep < 0)
			return -errno;
		struct epoll_event ev = { .events = EPOLLIN };
		struct epoll_event hup = { .events = EPOLLIN | EPOLLRDHUP };
		if (epoll_ctl(ep, EPOLL_CTL_ADD, c->efd, &ev) < 0 ||
		    epoll_ctl(ep, EPOLL_CTL_ADD, c->sock, &hup) < 0) {
			rc = -errno;
			close(ep);
			return rc;
		}
		c->event_fd = ep;
	}
	/* From now on the proxy signals the fd for every batch of events,
	 * not only while we block in kvs_wait. */
	__atomic_store_n(&c->cshm->waiting, 1, __ATOMIC_RELAXED);
	return c->event_fd;
}

/* Leaves `waiting` as the mode wants it after a blocking wait. */
static void unwait(kvs_client *c)
{
	__atomic_store_n(&c->cshm->waiting, fd_mode(c), __ATOMIC_RELAXED);
}

void *kvs_pool_map(kvs_client *c, size_t *len)
{
	bool ok = usable(c) == 0;
	if (len)
		*len = ok ? c->pool_size : 0;
	return ok ? c->pool : NULL;
}

int kvs_ext_attach(kvs_client *c, const void *key, void *state,
		   void (*fini)(kvs_client *c, void *state))
{
	int rc = usable(c);
	if (rc || !key)
		return rc ?: -EINVAL;
	struct kvs_ext *free_ = NULL;
	for (unsigned i = 0; i < KVS_EXT_MAX; i++) {
		if (c->ext[i].key == key)
			return -EEXIST;
		if (!c->ext[i].key && !free_)
			free_ = &c->ext[i];
	}
	if (!free_)
		return -ENOSPC;
	*free_ = (struct kvs_ext){ .key = key, .state = state, .fini = fini };
	return 0;
}

void *kvs_ext_get(const kvs_client *c, const void *key)
{
	for (unsigned i = 0; c && key && i < KVS_EXT_MAX; i++)
		if (c->ext[i].key == key)
			return c->ext[i].state;
	return NULL;
}

/* -------------------------------------------------------------- leases */

/* The proxy's verdict on l for c, read from the table it publishes. */
/* A shared room's slots are published as its opener's: a reader that
 * joined it holds them too, while its handle on the room is open. */
static bool joined_room_has(const kvs_client *c, const struct kvs_slot *s)
{
	uint32_t room = __atomic_load_n(&s->room, __ATOMIC_RELAXED);
	for (unsigned i = 0; room && i < c->nrooms; i++)
		if (c->rooms[i].joined == room && c->rooms[i].state != KVS_ROOM_CLOSING)
			return true;
	return false;
}

static int lease_state(const kvs_client *c, const struct kvs_lease *l)
{
	if (l->slot >= c->slot_count)
		return -EINVAL;
	const struct kvs_slot *s = &c->slots[l->slot];
	if (__atomic_load_n(&s->epoch, __ATOMIC_RELAXED) != l->epoch)
		return -ESTALE;
	if (__atomic_load_n(&s->owner, __ATOMIC_RELAXED) != c->id && !joined_room_has(c, s))
		return -EPERM;
	return __atomic_load_n(&s->state, __ATOMIC_RELAXED);
}

int kvs_acquire(kvs_client *c, unsigned n, struct kvs_lease *out)
{
	int rc = usable(c);
	if (rc)
		return rc;
	if (!n || n > c->slot_count || !out)
		return -EINVAL;
	struct kvs_sqe q = { .op = KVS_OP_ACQUIRE, .arg = n };
	rc = sync_call(c, &q);
	if (rc < 0)
		return rc;
	memcpy(out, c->reply_leases, n * sizeof(*out));
	return 0;
}

int kvs_lease_check(kvs_client *c, const struct kvs_lease *l)
{
	int rc = usable(c);
	if (rc || !l)
		return rc ?: -EINVAL;
	int st = lease_state(c, l);
	if (st < 0)
		return st;
	return st == KVS_SLOT_LEASED || st == KVS_SLOT_RECV_FILLED ? 0 : -EBUSY;
}

void *kvs_lease_ptr(kvs_client *c, const struct kvs_lease *l)
{
	return kvs_lease_check(c, l) ? NULL : c->pool + (size_t)l->slot * c->slot_size;
}

int kvs_release(kvs_client *c, const struct kvs_lease *l)
{
	int rc = usable(c);
	if (rc || !l)
		return rc ?: -EINVAL;
	struct kvs_sqe q = { .op = KVS_OP_RELEASE, .slot = l->slot, .epoch = l->epoch };
	return sync_call(c, &q);
}

/* --------------------------------------------------------------- rooms */

static struct kvs_rstate *room_new(kvs_client *c, uint8_t role, uint64_t user_data)
{
	if (!c->nfree)
		return NULL;
	struct kvs_rstate *r = &c->rooms[c->free_idx[--c->nfree]];
	uint32_t gen;
	while (!(gen = __atomic_add_fetch(&room_gen, 1, __ATOMIC_RELAXED)))
		; /* 0 means free */
	r->gen = gen;
	r->role = role;
	r->state = KVS_ROOM_OPEN;
	r->user_data = user_data;
	return r;
}

static void room_free(kvs_client *c, struct kvs_rstate *r)
{
	free(r->sent);
	free(r->map);
	uint16_t idx = r->idx;
	memset(r, 0, sizeof(*r));
	r->idx = idx;
	c->free_idx[c->nfree++] = idx;
}

static void room_set_size(struct kvs_rstate *r, uint64_t bytes, uint64_t chunk)
{
	r->bytes = bytes;
	r->chunk = chunk;
	r->nchunks = (uint32_t)((bytes + chunk - 1) / chunk);
}

static kvs_room *handle_of(const kvs_client *c, const struct kvs_rstate *r)
{
	return kvs_room_handle(c->reg, r->idx, r->gen);
}

int kvs_recv_open(kvs_client *c, uint64_t bytes, uint64_t user_data, kvs_room **room,
		  struct kvs_room_desc *desc)
{
	return kvs_recv_open_shared(c, bytes, 1, user_data, room, desc);
}

int kvs_recv_open_shared(kvs_client *c, uint64_t bytes, unsigned readers, uint64_t user_data,
			 kvs_room **room, struct kvs_room_desc *desc)
{
	int rc = usable(c);
	if (rc)
		return rc;
	if (!room || !desc || !bytes || !readers || readers > KVS_MAX_READERS)
		return -EINVAL;
	if (c->err)
		return c->err;
	struct kvs_rstate *r = room_new(c, KVS_ROLE_RECV, user_data);
	if (!r)
		return -EMFILE;
	struct kvs_sqe q = { .op = KVS_OP_RECV_OPEN,
			     .readers = (uint8_t)readers,
			     .handle = r->idx,
			     .gen = r->gen,
			     .arg = bytes,
			     .arg2 = user_data };
	rc = sync_call(c, &q);
	if (rc < 0) {
		room_free(c, r);
		return rc;
	}
	room_set_size(r, bytes, c->cshm->reply.slot_size);
	memcpy(desc->bytes, c->cshm->reply.desc, KVS_ROOM_DESC_SIZE);
	*room = handle_of(c, r);
	return 0;
}

/* Opens a handle of role by a descriptor (a sender's, a reader's that joins):
 * desc into the request area, op, the room's size from the reply. Returns
 * 0 with *out, or -errno (nothing held). */
static int open_by_desc(kvs_client *c, const struct kvs_room_desc *desc, uint8_t role, uint8_t op,
			uint64_t user_data, struct kvs_rstate **out)
{
	int rc = usable(c);
	if (rc)
		return rc;
	if (!desc)
		return -EINVAL;
	if (c->err)
		return c->err;
	struct kvs_rstate *r = room_new(c, role, user_data);
	if (!r)
		return -EMFILE;
	/* Sized for the largest room the pool allows, so nothing can fail
	 * after the proxy has opened it. */
	if (role == KVS_ROLE_SEND &&
	    !(r->sent = calloc((c->slot_count + 63) / 64, sizeof(uint64_t)))) {
		room_free(c, r);
		return -ENOMEM;
	}
	memcpy(c->cshm->request, desc->bytes, KVS_ROOM_DESC_SIZE);
	struct kvs_sqe q = { .op = op, .handle = r->idx, .gen = r->gen, .arg2 = user_data };
	rc = sync_call(c, &q);
	if (rc < 0) {
		room_free(c, r);
		return rc;
	}
	room_set_size(r, c->cshm->reply.bytes, c->cshm->reply.slot_size);
	*out = r;
	return 0;
}

int kvs_recv_join(kvs_client *c, const struct kvs_room_desc *desc, uint64_t user_data,
		  kvs_room **room)
{
	struct kvs_rstate *r;
	int rc = room ? open_by_desc(c, desc, KVS_ROLE_RECV, KVS_OP_RECV_JOIN, user_data, &r)
		      : -EINVAL;
	if (rc)
		return rc;
	struct kvs_desc_wire d;
	memcpy(&d, desc->bytes, sizeof(d));
	r->joined = le32toh(d.room) + 1; /* the proxy said it names our room there */
	*room = handle_of(c, r);
	return 0;
}

int kvs_send_open(kvs_client *c, const struct kvs_room_desc *desc, uint64_t user_data,
		  kvs_room **room)
{
	struct kvs_rstate *r;
	int rc = room ? open_by_desc(c, desc, KVS_ROLE_SEND, KVS_OP_SEND_OPEN, user_data, &r)
		      : -EINVAL;
	if (rc)
		return rc;
	*room = handle_of(c, r);
	return 0;
}

unsigned kvs_room_chunks(const kvs_room *h)
{
	kvs_client *c;
	struct kvs_rstate *r;
	return room_find(h, &c, &r) ? 0 : r->nchunks;
}

uint64_t kvs_room_bytes(const kvs_room *h)
{
	kvs_client *c;
	struct kvs_rstate *r;
	return room_find(h, &c, &r) ? 0 : r->bytes;
}

/* Why an ended room takes no more chunks. */
static int ended_status(const struct kvs_rstate *r)
{
	if (r->final_type == KVS_EV_SEND_DONE || r->final_type == KVS_EV_RECV_DONE)
		return -EALREADY;
	return r->final_status ? r->final_status : -ECANCELED;
}

int kvs_send(kvs_room *h, const struct kvs_lease *l, uint64_t offset, uint32_t len)
{
	kvs_client *c;
	struct kvs_rstate *r;
	int rc = room_find(h, &c, &r);
	if (rc)
		return rc;
	if (!l)
		return -EINVAL;
	if (c->err)
		return c->err;
	if (r->role != KVS_ROLE_SEND)
		return -EBADF;
	if (r->state == KVS_ROOM_ENDED)
		return ended_status(r);
	if (offset % r->chunk || offset >= r->bytes)
		return -EINVAL;
	uint64_t want = r->bytes - offset < r->chunk ? r->bytes - offset : r->chunk;
	if (len != want)
		return -EINVAL;
	uint32_t i = (uint32_t)(offset / r->chunk);
	if (r->sent[i / 64] & (1ull << (i % 64)))
		return -EEXIST;
	int st = lease_state(c, l);
	if (st < 0)
		return st;
	if (st != KVS_SLOT_LEASED)
		return -EBUSY;
	struct kvs_sqe q = { .op = KVS_OP_SEND,
			     .handle = r->idx,
			     .gen = r->gen,
			     .slot = l->slot,
			     .epoch = l->epoch,
			     .arg = offset,
			     .len = len };
	rc = submit(c, &q);
	if (rc == 0)
		r->sent[i / 64] |= 1ull << (i % 64);
	return rc;
}

int kvs_abort(kvs_room *h)
{
	kvs_client *c;
	struct kvs_rstate *r;
	int rc = room_find(h, &c, &r);
	if (rc)
		return rc;
	if (c->err)
		return c->err;
	if (r->state != KVS_ROOM_OPEN || r->aborted)
		return 0;
	struct kvs_sqe q = { .op = KVS_OP_ABORT, .handle = r->idx, .gen = r->gen };
	rc = submit(c, &q);
	if (rc == 0)
		r->aborted = true;
	return rc;
}

int kvs_room_lease(kvs_room *h, unsigned i, struct kvs_lease *out)
{
	kvs_client *c;
	struct kvs_rstate *r;
	int rc = room_find(h, &c, &r);
	if (rc)
		return rc;
	if (!out)
		return -EINVAL;
	if (r->role != KVS_ROLE_RECV)
		return -EBADF;
	if (r->state != KVS_ROOM_ENDED)
		return -EAGAIN;
	if (r->final_type != KVS_EV_RECV_DONE)
		return r->final_status ? r->final_status : -ECANCELED;
	if (i >= r->nchunks)
		return -ERANGE;
	if (i == 0) {
		*out = r->first;
		return 0;
	}
	if (!r->map) {
		struct kvs_lease *map = malloc(r->nchunks * sizeof(*map));
		if (!map)
			return -ENOMEM;
		struct kvs_sqe q = { .op = KVS_OP_ROOM_MAP, .handle = r->idx, .gen = r->gen };
		rc = sync_call(c, &q);
		if (rc == 0 && c->cshm->reply.n != r->nchunks)
			rc = -EPROTO;
		if (rc < 0) {
			free(map);
			return rc;
		}
		memcpy(map, c->reply_leases, r->nchunks * sizeof(*map));
		r->map = map;
	}
	*out = r->map[i];
	return 0;
}

int kvs_room_close(kvs_room *h)
{
	kvs_client *c;
	struct kvs_rstate *r;
	int rc = room_find(h, &c, &r);
	if (rc)
		return rc;
	if (c->err) {
		room_free(c, r);
		return 0;
	}
	struct kvs_sqe q = { .op = KVS_OP_CLOSE, .handle = r->idx, .gen = r->gen };
	rc = submit(c, &q);
	if (rc < 0)
		return rc;
	if (r->state == KVS_ROOM_ENDED) {
		room_free(c, r);
	} else {
		/* The proxy still owes this handle its final event; keep the
		 * index reserved until that arrives. */
		r->state = KVS_ROOM_CLOSING;
		free(r->sent);
		free(r->map);
		r->sent = NULL;
		r->map = NULL;
	}
	return 0;
}

/* -------------------------------------------------------------- events */

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
		room_free(c, r);
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
	int rc = usable(c);
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
		kick_proxy(c);
	if (n == 0 && fd_mode(c) && max) {
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
		if (n == 0 && (rc = proxy_gone(c)))
			return rc;
	}
	if (n == 0 && max && (rc = proxy_gone_lazy(c)))
		return rc;
	return (int)n;
}

int kvs_wait(kvs_client *c, struct kvs_event *ev, int timeout_ms)
{
	int rc = usable(c);
	if (rc || !ev)
		return rc ?: -EINVAL;
	int n = kvs_poll(c, ev, 1);
	if (n != 0)
		return n;
	uint64_t deadline = timeout_ms >= 0 ? mono_ns() + (uint64_t)timeout_ms * 1000000
					    : NO_DEADLINE;
	for (;;) {
		__atomic_store_n(&c->cshm->waiting, 1, __ATOMIC_RELAXED);
		/* Pairs with the proxy's fence after its enqueue: either it sees
		 * `waiting` and kicks the eventfd, or we see its event here. */
		rte_atomic_thread_fence(__ATOMIC_SEQ_CST);
		n = kvs_poll(c, ev, 1);
		if (n != 0)
			break;
		if (deadline != NO_DEADLINE && mono_ns() >= deadline) {
			n = -ETIMEDOUT;
			break;
		}
		n = block(c, deadline);
		if (n < 0) {
			n = kvs_poll(c, ev, 1); /* an event may have beaten the hang-up */
			break;
		}
	}
	unwait(c);
	return n;
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
