/* SPDX-License-Identifier: MIT */
/*
 * Client registry: each client's region (rings, reply and request areas),
 * its room handles, the events we post to it, and its end. A client's
 * death aborts every room it is in and frees every slot it holds; what a
 * transport still pins becomes a tombstone. Each client also has a row in
 * the control segment's clients table (kvstage-stat --top): stored to
 * here, never read back.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <rte_atomic.h>

#include "base/log.h"
#include "base/numa.h"
#include "core/proxy.h"
#include "core/clients.h"
#include "core/pool.h"
#include "ring.h"

/* ------------------------------------------------------ published row */

#define PUB(f, v) __atomic_store_n(&(f), (v), __ATOMIC_RELAXED)

/* Adds v to the proxy's own count and stores the sum in the row. */
#define TALLY(c, f, v) PUB((c)->pub->f, (c)->tally.f += (v))

static void row_open(struct kvsp_client *c, int sock)
{
	struct kvs_client_row *r = c->pub;
	struct ucred cr = { .pid = c->pid, .uid = (uid_t)-1, .gid = (gid_t)-1 };
	socklen_t cl = sizeof(cr);
	if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cr, &cl) < 0)
		cr.uid = (uid_t)-1, cr.gid = (gid_t)-1;
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	/* The id goes first (0) and last (this client's): a reader that sees
	 * the same id on both sides of its copy has this client's values. */
	PUB(r->id, 0);
	__atomic_thread_fence(__ATOMIC_RELEASE);
	PUB(r->pid, (int32_t)c->pid);
	PUB(r->uid, (uint32_t)cr.uid);
	PUB(r->gid, (uint32_t)cr.gid);
	PUB(r->since_ns, (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec);
	PUB(r->ops, 0);
	PUB(r->rejects, 0);
	PUB(r->rooms, 0);
	PUB(r->rooms_done, 0);
	PUB(r->rooms_aborted, 0);
	PUB(r->rooms_failed, 0);
	PUB(r->chunks_sent, 0);
	PUB(r->bytes_sent, 0);
	PUB(r->chunks_recv, 0);
	PUB(r->bytes_recv, 0);
	__atomic_store_n(&r->id, c->id, __ATOMIC_RELEASE);
}

static void publish_rooms(struct kvsp_client *c)
{
	if (c->tally.rooms != c->finals_owed)
		PUB(c->pub->rooms, c->tally.rooms = c->finals_owed);
}

static void count_refusal(struct kvsp_client *c)
{
	TALLY(c, rejects, 1);
}

void kvsp_client_sent(struct kvsp_client *c, uint64_t len)
{
	TALLY(c, chunks_sent, 1);
	TALLY(c, bytes_sent, len);
}

static int region_create(struct kvsp *p, struct kvsp_client *c)
{
	struct kvs_cmem_layout l;
	kvs_cmem_layout(&l, p->cfg.slot_count, p->cfg.sq_count, p->cfg.cq_count);
	int fd = memfd_create("kvstage-client", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return -errno;
	c->cmem_fd = fd;
	if (ftruncate(fd, (off_t)l.size) < 0 ||
	    /* A client must not shrink what we read and write. */
	    fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0)
		return -errno;
	void *m = mmap(NULL, l.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (m == MAP_FAILED)
		return -errno;
	c->cshm = m;
	c->cmem_size = l.size;
	c->reply_leases = (struct kvs_lease *)((uint8_t *)m + l.reply_off);
	memcpy((uint8_t *)m + l.sq_off, p->sq_tmpl, p->tmpl_len);
	memcpy((uint8_t *)m + l.cq_off, p->cq_tmpl, p->tmpl_len);
	int rc = kvs_ring_map(&c->sq, p->ctrl_fd, p->ctrl->sq_geom_off, fd, l.sq_off,
			      l.cq_off - l.sq_off);
	if (rc == 0)
		rc = kvs_ring_map(&c->cq, p->ctrl_fd, p->ctrl->cq_geom_off, fd, l.cq_off,
				  l.size - l.cq_off);
	return rc;
}

static void client_free(struct kvsp_client *c)
{
	kvs_ring_unmap(&c->sq);
	kvs_ring_unmap(&c->cq);
	if (c->cshm)
		munmap(c->cshm, c->cmem_size);
	if (c->cmem_fd >= 0)
		close(c->cmem_fd);
	if (c->efd >= 0)
		close(c->efd);
	if (c->sock >= 0)
		close(c->sock);
	free(c->handles);
	free(c);
}

struct kvsp_client *kvsp_client_new(struct kvsp *p, int sock, pid_t pid, uid_t uid, uint64_t proc)
{
	unsigned idx;
	for (idx = 0; idx < p->cfg.max_clients; idx++)
		if (!p->clients[idx])
			break;
	if (idx == p->cfg.max_clients) {
		errno = EUSERS;
		return NULL;
	}
	uint16_t share = kvsp_share_of(&p->shares, uid, 0);
	if (share == KVSP_NO_SHARE) {
		errno = EUSERS;
		return NULL;
	}
	if (!kvsp_share_takes_client(&p->shares, share)) {
		errno = EDQUOT;
		return NULL;
	}
	/* Held while the process's entry is found: a new entry holding
	 * nothing is free, and must not be found again as the process's. */
	p->shares.tab[share].clients++;
	uint16_t pshare = proc ? kvsp_share_of(&p->shares, uid, proc) : KVSP_NO_SHARE;
	p->shares.tab[share].clients--;
	if (proc && pshare == KVSP_NO_SHARE) {
		errno = EUSERS;
		return NULL;
	}
	if (!kvsp_share_takes_client(&p->shares, pshare)) {
		errno = ETOOMANYREFS;
		return NULL;
	}
	struct kvsp_client *c = calloc(1, sizeof(*c));
	if (!c)
		return NULL;
	c->sock = sock;
	c->cmem_fd = -1;
	c->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	c->handles = calloc(p->cfg.client_rooms, sizeof(*c->handles));
	int rc = c->efd < 0 ? -errno : !c->handles ? -ENOMEM : region_create(p, c);
	if (rc < 0) {
		c->sock = -1; /* the caller owns it still, and says why */
		client_free(c);
		errno = -rc;
		return NULL;
	}
	if (++p->next_cid == 0)
		++p->next_cid;
	c->id = p->next_cid;
	c->idx = (uint16_t)idx;
	c->pid = pid;
	/* Its node, from the CPUs it may run on: sysfs is read only where the
	 * pool has parts to choose from. */
	c->part = p->nnodes > 1 ? kvsp_pool_part_of(p, kvsp_numa_of_pid(pid)) : -1;
	c->uid = uid;
	c->proc = proc;
	c->share = share;
	c->pshare = pshare;
	p->shares.tab[share].clients++;
	if (pshare != KVSP_NO_SHARE)
		p->shares.tab[pshare].clients++;
	c->pub = &kvsp_client_rows(p)[idx];
	row_open(c, sock);
	p->clients[idx] = c;
	if (idx >= p->clients_hi)
		p->clients_hi = idx + 1;
	KVS_STAT_ADD(p->stats->clients, 1);
	KVS_STAT_ADD(p->stats->clients_total, 1);
	return c;
}

static void unkick(struct kvsp *p, struct kvsp_client *c)
{
	if (!c->kick)
		return;
	/* Its index may be taken by a new client before the list is
	 * flushed; an entry left behind would then be that client's twice. */
	for (unsigned k = 0; k < p->nkicks; k++)
		if (p->kicks[k] == c->idx) {
			p->kicks[k] = p->kicks[--p->nkicks];
			break;
		}
	c->kick = false;
}

void kvsp_client_free(struct kvsp *p, struct kvsp_client *c)
{
	unkick(p, c);
	kvsp_rl_flush(&c->rl[KVSP_RL_TOKEN], p->now_ns, KVSP_LOG_WARN, "wrong room tokens", 1);
	p->clients[c->idx] = NULL;
	p->shares.tab[c->share].clients--;
	if (c->pshare != KVSP_NO_SHARE)
		p->shares.tab[c->pshare].clients--;
	while (p->clients_hi && !p->clients[p->clients_hi - 1])
		p->clients_hi--;
	/* Gone from the table before the count says so (the fence orders
	 * the two stores): whoever sees the count drop finds no row for it. */
	__atomic_store_n(&c->pub->id, 0, __ATOMIC_RELAXED);
	__atomic_thread_fence(__ATOMIC_RELEASE);
	KVS_STAT_SUB(p->stats->clients, 1);
	client_free(c);
}

struct kvsp_client *kvsp_client_get(struct kvsp *p, uint16_t cidx, uint32_t cid)
{
	struct kvsp_client *c = cidx < p->cfg.max_clients ? p->clients[cidx] : NULL;
	return c && c->id == cid ? c : NULL;
}

static void mark_kick(struct kvsp *p, struct kvsp_client *c)
{
	if (!c->kick) {
		/* One entry per live client with kick set (unkick keeps it so),
		 * so the list cannot outgrow max_clients. */
		c->kick = true;
		p->kicks[p->nkicks++] = c->idx;
	}
}

void kvsp_kicks_flush(struct kvsp *p)
{
	if (!p->nkicks)
		return;
	/* Pairs with the client's fence between setting `waiting` and its
	 * last look at the ring or reply: our posts are stores, `waiting` is
	 * a load, and without a full barrier both could miss each other. */
	rte_atomic_thread_fence(__ATOMIC_SEQ_CST);
	for (unsigned k = 0; k < p->nkicks; k++) {
		struct kvsp_client *c = p->clients[p->kicks[k]];
		if (!c || !c->kick)
			continue;
		c->kick = false;
		if (__atomic_load_n(&c->cshm->waiting, __ATOMIC_RELAXED))
			eventfd_write(c->efd, 1);
	}
	p->nkicks = 0;
}

static void post(struct kvsp *p, struct kvsp_client *c, const struct kvs_cqe *e)
{
	if (c->dying)
		return;
	/* Space is reserved (see kvsp_client_poll); a miss means the client
	 * scribbled on its own ring. */
	if (kvs_ring_push(&c->cq, e, sizeof(*e), 1) == 1)
		KVS_STAT_ADD(p->stats->events, 1);
	else
		KVS_STAT_ADD(p->stats->events_dropped, 1);
	mark_kick(p, c);
}

void kvsp_client_final(struct kvsp *p, struct kvsp_client *c, const struct kvsp_side *s,
		       uint16_t type, int status, uint64_t bytes, uint32_t slot, uint32_t epoch)
{
	struct kvsp_handle *hd = &c->handles[s->handle];
	if (hd->state != KVSP_H_OPEN && hd->state != KVSP_H_CLOSING)
		return; /* one final per handle, ever */
	struct kvs_cqe e = { .type = type,
			     .handle = s->handle,
			     .status = status,
			     .user_data = hd->user_data,
			     .bytes = bytes,
			     .slot = slot,
			     .epoch = epoch,
			     .gen = hd->gen };
	post(p, c, &e);
	c->finals_owed--;
	hd->state = hd->state == KVSP_H_CLOSING ? KVSP_H_FREE : KVSP_H_ENDED;
	switch (type) {
	case KVS_EV_RECV_DONE:
		TALLY(c, chunks_recv, (bytes + p->cfg.slot_size - 1) / p->cfg.slot_size);
		TALLY(c, bytes_recv, bytes);
		/* fall through */
	case KVS_EV_SEND_DONE:
		TALLY(c, rooms_done, 1);
		break;
	case KVS_EV_ABORTED:
		TALLY(c, rooms_aborted, 1);
		break;
	default:
		TALLY(c, rooms_failed, 1);
	}
	publish_rooms(c);
}

void kvsp_count_reject(struct kvsp *p, int err)
{
	uint64_t *ctr;
	switch (err) {
	case -ESTALE:
		ctr = &p->stats->rej_stale;
		break;
	case -EPERM:
		ctr = &p->stats->rej_perm;
		break;
	case -EBUSY:
		ctr = &p->stats->rej_busy;
		break;
	case -ENOBUFS:
		ctr = &p->stats->rej_nobufs;
		break;
	default:
		ctr = &p->stats->rej_inval;
		break;
	}
	KVS_STAT_ADD(*ctr, 1);
}

void kvsp_client_reject(struct kvsp *p, struct kvsp_client *c, uint16_t h, int status,
			const struct kvs_sqe *q)
{
	/* The op's own handle and generation: the library tells by them
	 * whether the room it meant is still the one at that index. */
	bool in_range = h < p->cfg.client_rooms;
	bool valid = in_range && c->handles[h].state != KVSP_H_FREE;
	struct kvs_cqe e = { .type = KVS_EV_REJECTED,
			     .handle = in_range ? h : KVS_NO_HANDLE,
			     .status = status,
			     .user_data = valid ? c->handles[h].user_data : 0,
			     .bytes = q->arg,
			     .slot = q->slot,
			     .epoch = q->epoch,
			     .gen = q->gen };
	kvsp_count_reject(p, status);
	count_refusal(c);
	post(p, c, &e);
}

void kvsp_client_reply(struct kvsp *p, struct kvsp_client *c, uint32_t seq, int status)
{
	/* Counted before the client can hear of it: whoever reads the
	 * counters after the reply sees the refusal among them. */
	if (status < 0) {
		kvsp_count_reject(p, status);
		count_refusal(c);
	}
	c->cshm->reply.status = status;
	/* Release: the reply fields, the lease area and the counters are
	 * written before the client can see this seq. */
	__atomic_store_n(&c->cshm->reply.seq, seq, __ATOMIC_RELEASE);
	mark_kick(p, c);
}

void kvsp_client_took(struct kvsp *p, struct kvsp_client *c, unsigned n)
{
	KVS_STAT_ADD(p->stats->ops, n);
	if (n) {
		TALLY(c, ops, n);
		publish_rooms(c); /* opens and closes change it */
	}
}
