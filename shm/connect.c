/* SPDX-License-Identifier: MIT */
/*
 * libkvstage: making a connection (the handshake, the mappings it brings), ending one, and what a
 * connection says of itself (sizes, the event fd, the pool, companion libraries' state).
 */
#include "client.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sock.h"

#define SYNC_TIMEOUT_MS 10000 /* default bound on a sync call */

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
	kvsc_registry_del(c);
	for (unsigned i = 0; c->rooms && i < c->nrooms; i++) {
		free(c->sent_bits ? c->sent_bits[i] : NULL);
		free(c->rooms[i].map);
	}
	int fds[] = { c->sock, c->wake_fd, c->efd, c->event_fd };
	for (unsigned i = 0; i < 4; i++)
		if (fds[i] >= 0)
			close(fds[i]);
	unmap_all(c);
	free(c->rooms);
	free(c->sent_bits);
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
	c->sent_bits = calloc(c->nrooms, sizeof(*c->sent_bits));
	c->free_idx = calloc(c->nrooms, sizeof(*c->free_idx));
	c->stash_cap = c->ctrl->cq_count + c->ctrl->sq_count; /* see sync_call */
	c->stash = calloc(c->stash_cap, sizeof(*c->stash));
	if (!c->rooms || !c->sent_bits || !c->free_idx || !c->stash)
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
		rc = kvsc_registry_add(c);
	if (rc < 0) {
		kvs_close(c);
		return rc;
	}
	c->alive_ns = kvsc_coarse_ns();
	*out = c;
	return 0;
}

int kvs_set_sync_timeout(kvs_client *c, int timeout_ms)
{
	int rc = kvsc_usable(c);
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
	int rc = kvsc_usable(c);
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

void *kvs_pool_map(kvs_client *c, size_t *len)
{
	bool ok = kvsc_usable(c) == 0;
	if (len)
		*len = ok ? c->pool_size : 0;
	return ok ? c->pool : NULL;
}

int kvs_ext_attach(kvs_client *c, const void *key, void *state,
		   void (*fini)(kvs_client *c, void *state))
{
	int rc = kvsc_usable(c);
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
