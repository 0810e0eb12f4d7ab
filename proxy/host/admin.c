/* SPDX-License-Identifier: MIT */
/*
 * The admin protocol: failpoints and counter barriers, for kvstage-ctl and
 * tests. Only a proxy started with --failpoints takes admin connections;
 * they stay open through a drain, so a stuck shutdown can still be looked at.
 */
#include <errno.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/log.h"
#include "base/loop_fd.h"
#include "base/trace.h"
#include "core/proxy.h"
#include "core/xport.h"
#include "host/loop.h"
#include "sock.h"
#include "statnames.h"

#define MAX_ADMINS 16

struct kvsp_admin {
	int fd;
	bool waiting;
	struct kvs_admin_req req;
};

int kvsp_admin_init(struct kvsp *p)
{
	p->admins = calloc(MAX_ADMINS, sizeof(*p->admins));
	if (!p->admins)
		return -ENOMEM;
	for (unsigned i = 0; i < MAX_ADMINS; i++)
		p->admins[i].fd = -1;
	return 0;
}

void kvsp_admin_fini(struct kvsp *p)
{
	for (unsigned i = 0; p->admins && i < MAX_ADMINS; i++)
		if (p->admins[i].fd >= 0)
			close(p->admins[i].fd);
	free(p->admins);
	p->admins = NULL;
}

void kvsp_admin_welcome(struct kvsp *p, int fd)
{
	if (!p->cfg.failpoints) {
		kvsp_refuse(p, fd, -EOPNOTSUPP,
			    "failpoints are off: start kvstaged with --failpoints");
		return;
	}
	unsigned i;
	for (i = 0; i < MAX_ADMINS && p->admins[i].fd >= 0; i++)
		;
	if (i == MAX_ADMINS) {
		kvsp_refuse(p, fd, -EUSERS, "too many admin connections");
		return;
	}
	struct kvs_welcome w = { .magic = KVS_MAGIC_HELLO,
				 .abi = KVS_ABI,
				 .instance = p->instance };
	if (kvsp_ep_add(p->epfd, fd, EPOLLIN | EPOLLRDHUP, kvsp_ep_tag(KVSP_EP_ADMIN, i, 0)) < 0 ||
	    kvs_sock_send(fd, &w, sizeof(w), NULL, 0) < 0) {
		close(fd);
		return;
	}
	p->admins[i] = (struct kvsp_admin){ .fd = fd };
}

static void admin_reply(struct kvsp_admin *a, int status, uint64_t hits, const char *msg)
{
	struct kvs_admin_rep r = { .status = status, .hits = hits };
	snprintf(r.msg, sizeof(r.msg), "%s", msg);
	kvs_sock_send(a->fd, &r, sizeof(r), NULL, 0);
}

static void admin_close(struct kvsp *p, struct kvsp_admin *a)
{
	(void)p;
	close(a->fd);
	a->fd = -1;
	a->waiting = false;
}

static bool admin_ready(struct kvsp *p, const struct kvs_admin_req *q, uint64_t *val)
{
	if (q->op == KVS_ADMIN_STAT_WAIT) {
		/* Found when it was asked for (on_admin); none is ever removed. */
		const uint64_t *v = kvs_stat_at(p->ctrl, p->ctrl_size, q->name);
		*val = __atomic_load_n(v, __ATOMIC_RELAXED);
		return q->action == 0 ? *val >= q->hits : *val <= q->hits;
	}
	*val = p->fp[kvsp_fp_lookup(p, q->name)].hits;
	return *val >= q->hits;
}

static void on_admin(struct kvsp *p, struct kvsp_admin *a)
{
	struct kvs_admin_req q;
	ssize_t n = kvs_sock_recv(a->fd, &q, sizeof(q), NULL, NULL, MSG_DONTWAIT);
	if (n == -EAGAIN)
		return;
	if (n != sizeof(q) || a->waiting) {
		admin_close(p, a); /* garbage, or a request while one waits */
		return;
	}
	q.name[sizeof(q.name) - 1] = 0;
	if (q.op == KVS_ADMIN_STAT_WAIT) {
		if (!kvs_stat_at(p->ctrl, p->ctrl_size, q.name) || q.action > 1) {
			admin_reply(a, -ENOENT, 0, "no such counter");
			return;
		}
		a->req = q;
		a->waiting = true; /* answered by admin_poll once it holds */
		return;
	}
	int id = kvsp_fp_lookup(p, q.name);
	if (id < 0) {
		admin_reply(a, -ENOENT, 0, "no such failpoint");
		return;
	}
	struct kvsp_fp *fp = &p->fp[id];
	switch (q.op) {
	case KVS_ADMIN_FP_SET:
		if (q.action > KVS_FP_FAIL ||
		    (q.action == KVS_FP_FAIL && (q.err >= 0 || q.err < -4095))) {
			admin_reply(a, -EINVAL, 0, "bad action");
			return;
		}
		fp->action = (uint8_t)q.action;
		fp->err = q.err;
		fp->match_set = q.match_set != 0;
		fp->mask = q.mask ? q.mask : UINT64_MAX;
		fp->match = q.match & fp->mask;
		if (id == KVSP_FP_TRACE_WRITE && p->trace)
			kvsp_trace_kick(p->trace); /* another thread holds there: it looks again */
		LOG_INFO("failpoint %s: %s", q.name,
			 q.action == KVS_FP_OFF	    ? "off"
			 : q.action == KVS_FP_PAUSE ? "pause"
						    : "fail");
		admin_reply(a, 0, fp->hits, "ok");
		break;
	case KVS_ADMIN_FP_GET:
		admin_reply(a, 0, fp->hits, "ok");
		break;
	case KVS_ADMIN_FP_RELEASE: {
		if (!fp->release) {
			admin_reply(a, -EOPNOTSUPP, 0, "nothing holds work at that failpoint here");
			return;
		}
		uint64_t mask = q.mask ? q.mask : UINT64_MAX;
		admin_reply(a, 0, fp->release(fp->holder, q.match & mask, mask), "ok");
		break;
	}
	case KVS_ADMIN_FP_WAIT:
		a->req = q;
		a->waiting = true;
		break;
	default:
		admin_reply(a, -EOPNOTSUPP, 0, "unknown admin op");
	}
}

void kvsp_admin_poll(struct kvsp *p)
{
	for (unsigned i = 0; i < MAX_ADMINS; i++) {
		struct kvsp_admin *a = &p->admins[i];
		uint64_t val;
		if (a->fd >= 0 && a->waiting && admin_ready(p, &a->req, &val)) {
			a->waiting = false;
			admin_reply(a, 0, val, "ok");
		}
	}
}

void kvsp_admin_event(struct kvsp *p, unsigned i, uint32_t events)
{
	if (i >= MAX_ADMINS || p->admins[i].fd < 0)
		return;
	if (events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR) && !(events & EPOLLIN))
		admin_close(p, &p->admins[i]);
	else
		on_admin(p, &p->admins[i]);
}
