/* SPDX-License-Identifier: MIT */
/*
 * The run-to-completion loop. Each pass polls every client's submission
 * ring and every transport; each poll says BUSY or IDLE. Sockets (accepts,
 * hang-ups, admin), timers and shutdown are looked at once a millisecond
 * while busy. After spin_ns without work the loop sleeps in epoll_wait,
 * having told clients (ctrl->sleeping) to kick its eventfd.
 */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <rte_atomic.h>
#include <rte_pause.h>

#include "log.h"
#include "proxy.h"
#include "sock.h"
#include "statnames.h"
#include "transport.h"

#define TICK_NS 1000000ull
#define HELLO_TIMEOUT_NS 5000000000ull
#define MAX_PENDING 64
#define MAX_ADMINS 16

enum { T_LISTEN = 1, T_WAKE, T_PENDING, T_CLIENT, T_ADMIN };

struct kvsp_pending {
	int fd;
	pid_t pid;
	uid_t uid;
	gid_t gid;
	uint64_t since_ns;
};

struct kvsp_admin {
	int fd;
	bool waiting;
	struct kvs_admin_req req;
};

static struct kvsp *g_proxy; /* for the signal handler */

uint64_t kvsp_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t tag(unsigned type, unsigned idx, uint32_t id)
{
	return (uint64_t)type << 56 | (uint64_t)(idx & 0xffffff) << 32 | id;
}

static int ep_add(struct kvsp *p, int fd, uint32_t events, uint64_t data)
{
	struct epoll_event ev = { .events = events, .data.u64 = data };
	return epoll_ctl(p->epfd, EPOLL_CTL_ADD, fd, &ev) < 0 ? -errno : 0;
}

static void on_signal(int sig)
{
	(void)sig;
	if (g_proxy) {
		g_proxy->term++;
		eventfd_write(g_proxy->wake_fd, 1);
	}
}

/* ------------------------------------------------------------ lifetime */

static uint32_t pow2_at_least(uint32_t v)
{
	uint32_t n = 1;
	while (n < v)
		n <<= 1;
	return n;
}

int kvsp_init(struct kvsp *p, const struct kvsp_config *cfg)
{
	memset(p, 0, sizeof(*p));
	p->cfg = *cfg;
	p->cfg.cq_count = pow2_at_least(2 * (cfg->client_rooms + 32));
	p->epfd = p->listen_fd = p->wake_fd = p->lock_fd = p->pool_fd = p->ctrl_fd = -1;
	kvsp_log_level = cfg->log_level;

	int rc = kvsp_pool_create(p);
	if (rc < 0)
		return rc;
	rc = kvsp_rooms_init(p);
	if (rc < 0)
		return rc;
	p->clients = calloc(p->cfg.max_clients, sizeof(*p->clients));
	p->kicks = calloc(p->cfg.max_clients, sizeof(*p->kicks));
	p->pending = calloc(MAX_PENDING, sizeof(*p->pending));
	p->admins = calloc(MAX_ADMINS, sizeof(*p->admins));
	p->local = kvsp_local_create(p);
	if (!p->clients || !p->kicks || !p->pending || !p->admins || !p->local)
		return -ENOMEM;
	for (unsigned i = 0; i < MAX_PENDING; i++)
		p->pending[i].fd = -1;
	for (unsigned i = 0; i < MAX_ADMINS; i++)
		p->admins[i].fd = -1;
	p->epfd = epoll_create1(EPOLL_CLOEXEC);
	p->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (p->epfd < 0 || p->wake_fd < 0)
		return -errno;
	rc = ep_add(p, p->wake_fd, EPOLLIN, tag(T_WAKE, 0, 0));
	if (rc < 0)
		return rc;
	p->now_ns = kvsp_now_ns();
	return 0;
}

static int lock_path(struct kvsp *p, const char *path)
{
	char lock[sizeof(((struct sockaddr_un *)0)->sun_path) + 8];
	snprintf(lock, sizeof(lock), "%s.lock", path);
	p->lock_fd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
	if (p->lock_fd < 0) {
		int err = -errno;
		LOG_ERR("cannot create %s: %s%s", lock, strerror(-err),
			err == -EACCES || err == -ENOENT || err == -EROFS
				? " (choose a writable place with --socket PATH or $KVSTAGE_SOCKET)"
				: "");
		return err;
	}
	if (flock(p->lock_fd, LOCK_EX | LOCK_NB) < 0) {
		int err = -errno;
		LOG_ERR("another kvstaged already serves %s (%s is locked)", path, lock);
		return err == -EWOULDBLOCK ? -EADDRINUSE : err;
	}
	return 0;
}

int kvsp_listen(struct kvsp *p)
{
	const char *path = p->cfg.socket_path;
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	if (strlen(path) >= sizeof(sa.sun_path)) {
		LOG_ERR("socket path too long (max %zu bytes): %s", sizeof(sa.sun_path) - 1, path);
		return -ENAMETOOLONG;
	}
	strcpy(sa.sun_path, path);
	if (!strcmp(path, KVS_DEFAULT_SOCKET))
		mkdir("/run/kvstage", 0755); /* may exist; bind reports the rest */
	int rc = lock_path(p, path);
	if (rc < 0)
		return rc;
	/* We hold the lock, so a socket file there is a dead proxy's. */
	unlink(path);
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	mode_t old = umask(0117);
	rc = bind(fd, (struct sockaddr *)&sa, sizeof(sa));
	umask(old);
	if (rc < 0 || chmod(path, 0660) < 0 || listen(fd, 128) < 0) {
		rc = -errno;
		LOG_ERR("cannot listen on %s: %s", path, strerror(-rc));
		close(fd);
		return rc;
	}
	p->listen_fd = fd;
	rc = ep_add(p, fd, EPOLLIN, tag(T_LISTEN, 0, 0));
	if (rc < 0)
		return rc;
	g_proxy = p;
	struct sigaction sa_term = { .sa_handler = on_signal };
	sigemptyset(&sa_term.sa_mask);
	sigaction(SIGTERM, &sa_term, NULL);
	sigaction(SIGINT, &sa_term, NULL);
	signal(SIGPIPE, SIG_IGN);
	return 0;
}

static void stop_listening(struct kvsp *p)
{
	if (p->listen_fd < 0)
		return;
	close(p->listen_fd);
	p->listen_fd = -1;
	unlink(p->cfg.socket_path);
}

void kvsp_fini(struct kvsp *p)
{
	for (unsigned i = 0; p->clients && i < p->cfg.max_clients; i++)
		if (p->clients[i])
			kvsp_client_destroy(p, p->clients[i]);
	for (unsigned i = 0; p->pending && i < MAX_PENDING; i++)
		if (p->pending[i].fd >= 0)
			close(p->pending[i].fd);
	for (unsigned i = 0; p->admins && i < MAX_ADMINS; i++)
		if (p->admins[i].fd >= 0)
			close(p->admins[i].fd);
	if (p->local)
		p->local->ops->destroy(p->local);
	stop_listening(p);
	kvsp_rooms_fini(p);
	kvsp_pool_destroy(p);
	free(p->clients);
	free(p->kicks);
	free(p->pending);
	free(p->admins);
	if (p->epfd >= 0)
		close(p->epfd);
	if (p->wake_fd >= 0)
		close(p->wake_fd);
	if (p->lock_fd >= 0)
		close(p->lock_fd);
	g_proxy = NULL;
}

/* ------------------------------------------------------------ sockets */

static void refuse(struct kvsp *p, int fd, int status, const char *msg)
{
	struct kvs_welcome w = { .magic = KVS_MAGIC_HELLO, .abi = KVS_ABI, .status = status };
	snprintf(w.msg, sizeof(w.msg), "%s", msg);
	KVS_STAT_ADD(p->stats->clients_refused, 1); /* counted before anyone hears of it */
	kvs_sock_send(fd, &w, sizeof(w), NULL, 0);
	close(fd);
}

static bool admitted(const struct kvsp *p, uid_t uid, gid_t gid)
{
	if (uid == 0 || uid == geteuid())
		return true;
	for (unsigned i = 0; i < p->cfg.n_allow_uid; i++)
		if (p->cfg.allow_uid[i] == uid)
			return true;
	if (gid == getegid())
		return true;
	for (unsigned i = 0; i < p->cfg.n_allow_gid; i++)
		if (p->cfg.allow_gid[i] == gid)
			return true;
	return false;
}

static void on_accept(struct kvsp *p)
{
	for (;;) {
		int fd = accept4(p->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0)
			return;
		struct ucred cr;
		socklen_t len = sizeof(cr);
		if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) < 0) {
			close(fd);
			continue;
		}
		unsigned i;
		for (i = 0; i < MAX_PENDING && p->pending[i].fd >= 0; i++)
			;
		if (i == MAX_PENDING) {
			refuse(p, fd, -EAGAIN, "too many connections in handshake");
			continue;
		}
		/* Judged at hello: refusing before reading it would close with
		 * its bytes unread, and the client would see ECONNRESET instead
		 * of the reason. */
		p->pending[i] = (struct kvsp_pending){ fd, cr.pid, cr.uid, cr.gid, p->now_ns };
		if (ep_add(p, fd, EPOLLIN | EPOLLRDHUP, tag(T_PENDING, i, 0)) < 0) {
			close(fd);
			p->pending[i].fd = -1;
		}
	}
}

static void welcome_client(struct kvsp *p, struct kvsp_pending *pd)
{
	int fd = pd->fd;
	if (p->draining) {
		refuse(p, fd, -ESHUTDOWN, "proxy is shutting down");
		return;
	}
	struct kvsp_client *c = kvsp_client_new(p, fd, pd->pid);
	if (!c) {
		refuse(p, fd, -EUSERS, "too many clients (--max-clients)");
		return;
	}
	struct kvs_welcome w = { .magic = KVS_MAGIC_HELLO, .abi = KVS_ABI, .client_id = c->id,
				 .instance = p->instance, .ctrl_size = p->ctrl_size,
				 .cmem_size = c->cmem_size };
	int fds[KVS_WELCOME_NFDS] = { p->pool_fd, p->ctrl_fd, c->cmem_fd, p->wake_fd, c->efd };
	if (kvs_sock_send(fd, &w, sizeof(w), fds, KVS_WELCOME_NFDS) < 0 ||
	    ep_add(p, fd, EPOLLIN | EPOLLRDHUP, tag(T_CLIENT, c->idx, c->id)) < 0) {
		kvsp_client_destroy(p, c);
		return;
	}
	LOG_DEBUG("client %u: pid %d uid %u", c->id, (int)pd->pid, (unsigned)pd->uid);
}

static void welcome_admin(struct kvsp *p, int fd)
{
	if (!p->cfg.failpoints) {
		refuse(p, fd, -EOPNOTSUPP, "failpoints are off: start kvstaged with --failpoints");
		return;
	}
	unsigned i;
	for (i = 0; i < MAX_ADMINS && p->admins[i].fd >= 0; i++)
		;
	if (i == MAX_ADMINS) {
		refuse(p, fd, -EUSERS, "too many admin connections");
		return;
	}
	struct kvs_welcome w = { .magic = KVS_MAGIC_HELLO, .abi = KVS_ABI, .instance = p->instance };
	if (ep_add(p, fd, EPOLLIN | EPOLLRDHUP, tag(T_ADMIN, i, 0)) < 0 ||
	    kvs_sock_send(fd, &w, sizeof(w), NULL, 0) < 0) {
		close(fd);
		return;
	}
	p->admins[i] = (struct kvsp_admin){ .fd = fd };
}

static void on_hello(struct kvsp *p, unsigned i)
{
	struct kvsp_pending pd = p->pending[i];
	p->pending[i].fd = -1;
	epoll_ctl(p->epfd, EPOLL_CTL_DEL, pd.fd, NULL);
	struct kvs_hello h;
	ssize_t n = kvs_sock_recv(pd.fd, &h, sizeof(h), NULL, NULL, MSG_DONTWAIT);
	if (n != sizeof(h) || h.magic != KVS_MAGIC_HELLO) {
		close(pd.fd);
		return;
	}
	if (h.abi != KVS_ABI) {
		refuse(p, pd.fd, -EPROTO, "ABI mismatch between libkvstage and kvstaged");
		return;
	}
	if (!admitted(p, pd.uid, pd.gid)) {
		LOG_WARN("refused pid %d: uid %u gid %u not allowed", (int)pd.pid, (unsigned)pd.uid,
			 (unsigned)pd.gid);
		refuse(p, pd.fd, -EACCES, "uid/gid not allowed (--allow-uid, --allow-gid)");
		return;
	}
	switch (h.kind) {
	case KVS_HELLO_CLIENT:
		welcome_client(p, &pd);
		break;
	case KVS_HELLO_STAT: {
		struct kvs_welcome w = { .magic = KVS_MAGIC_HELLO, .abi = KVS_ABI,
					 .instance = p->instance, .ctrl_size = p->ctrl_size };
		kvs_sock_send(pd.fd, &w, sizeof(w), &p->ctrl_fd, 1);
		close(pd.fd);
		break;
	}
	case KVS_HELLO_ADMIN:
		welcome_admin(p, pd.fd);
		break;
	default:
		refuse(p, pd.fd, -EPROTO, "unknown connection kind");
	}
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
		long off = kvs_stat_find(q->name);
		*val = __atomic_load_n((uint64_t *)((uint8_t *)p->stats + off), __ATOMIC_RELAXED);
		return q->action == 0 ? *val >= q->hits : *val <= q->hits;
	}
	*val = p->fp[kvsp_fp_find(q->name)].hits;
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
		if (kvs_stat_find(q.name) < 0 || q.action > 1) {
			admin_reply(a, -ENOENT, 0, "no such counter");
			return;
		}
		a->req = q;
		a->waiting = true; /* answered by admin_poll once it holds */
		return;
	}
	int id = kvsp_fp_find(q.name);
	if (id < 0) {
		admin_reply(a, -ENOENT, 0, "no such failpoint");
		return;
	}
	struct kvsp_fp *fp = &p->fp[id];
	switch (q.op) {
	case KVS_ADMIN_FP_SET:
		if (q.action > KVS_FP_FAIL || (q.action == KVS_FP_FAIL && (q.err >= 0 || q.err < -4095))) {
			admin_reply(a, -EINVAL, 0, "bad action");
			return;
		}
		fp->action = (uint8_t)q.action;
		fp->err = q.err;
		fp->match_set = q.match_set != 0;
		fp->mask = q.mask ? q.mask : UINT64_MAX;
		fp->match = q.match & fp->mask;
		LOG_INFO("failpoint %s: %s", q.name,
			 q.action == KVS_FP_OFF ? "off" : q.action == KVS_FP_PAUSE ? "pause" : "fail");
		admin_reply(a, 0, fp->hits, "ok");
		break;
	case KVS_ADMIN_FP_GET:
		admin_reply(a, 0, fp->hits, "ok");
		break;
	case KVS_ADMIN_FP_RELEASE: {
		if (id != KVSP_FP_LOCAL_QUIESCE) {
			admin_reply(a, -EOPNOTSUPP, 0, "only local.quiesce holds anything");
			return;
		}
		uint64_t mask = q.mask ? q.mask : UINT64_MAX;
		admin_reply(a, 0, kvsp_local_release(p->local, q.match & mask, mask), "ok");
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

static void admin_poll(struct kvsp *p)
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

static void on_events(struct kvsp *p, struct epoll_event *ev, int n)
{
	for (int k = 0; k < n; k++) {
		uint64_t d = ev[k].data.u64;
		unsigned type = (unsigned)(d >> 56), idx = (unsigned)(d >> 32) & 0xffffff;
		uint32_t id = (uint32_t)d;
		switch (type) {
		case T_LISTEN:
			if (p->listen_fd >= 0)
				on_accept(p);
			break;
		case T_WAKE: {
			eventfd_t v;
			eventfd_read(p->wake_fd, &v);
			break;
		}
		case T_PENDING:
			if (p->pending[idx].fd >= 0)
				on_hello(p, idx);
			break;
		case T_CLIENT: {
			/* A client never writes to its socket after hello: any
			 * event is its hang-up (or garbage, treated the same). */
			struct kvsp_client *c = kvsp_client_get(p, (uint16_t)idx, id);
			if (c) {
				LOG_DEBUG("client %u (pid %d) hung up", c->id, (int)c->pid);
				KVS_STAT_ADD(p->stats->clients_died, 1);
				kvsp_client_destroy(p, c);
			}
			break;
		}
		case T_ADMIN:
			if (p->admins[idx].fd >= 0) {
				if (ev[k].events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR) &&
				    !(ev[k].events & EPOLLIN))
					admin_close(p, &p->admins[idx]);
				else
					on_admin(p, &p->admins[idx]);
			}
			break;
		}
	}
}

/* ---------------------------------------------------------------- loop */

static int poll_clients(struct kvsp *p)
{
	int busy = KVSP_IDLE;
	for (unsigned i = 0; i < p->clients_hi; i++)
		if (p->clients[i])
			busy |= kvsp_client_poll(p, p->clients[i]);
	return busy;
}

static bool work_waiting(struct kvsp *p)
{
	if (p->local->ops->pending(p->local))
		return true;
	for (unsigned i = 0; i < p->clients_hi; i++) {
		struct kvsp_client *c = p->clients[i];
		if (c && kvs_ring_count(&c->sq) && kvs_ring_free(&c->cq) > c->finals_owed)
			return true;
	}
	return false;
}

/* Runs the timers; returns the next deadline any of them has. Admin
 * barriers are answered last, after every state change of this tick, so
 * a condition that just became true is never left waiting for a wakeup. */
static uint64_t tick(struct kvsp *p)
{
	uint64_t next = UINT64_MAX;
	if (p->draining && !p->aborted_all) {
		if (p->now_ns >= p->drain_deadline_ns) {
			LOG_INFO("shutdown grace over: aborting %u rooms", p->rooms_active);
			kvsp_rooms_abort_all(p, -ESHUTDOWN);
			p->aborted_all = true;
		} else {
			next = p->drain_deadline_ns;
		}
	}
	uint64_t t = kvsp_rooms_tick(p);
	if (t < next)
		next = t;
	for (unsigned i = 0; i < MAX_PENDING; i++) {
		struct kvsp_pending *pd = &p->pending[i];
		if (pd->fd < 0)
			continue;
		if (p->now_ns - pd->since_ns > HELLO_TIMEOUT_NS) {
			close(pd->fd); /* never said hello */
			pd->fd = -1;
		} else if (pd->since_ns + HELLO_TIMEOUT_NS < next) {
			next = pd->since_ns + HELLO_TIMEOUT_NS;
		}
	}
	admin_poll(p);
	p->next_tick_ns = p->now_ns + TICK_NS;
	return next;
}

static void sleep_until_work(struct kvsp *p, uint64_t deadline)
{
	__atomic_store_n(&p->ctrl->sleeping, 1, __ATOMIC_RELAXED);
	/* Pairs with the client's fence between its enqueue and reading
	 * `sleeping`: either it sees 1 and kicks, or we see its record. */
	rte_atomic_thread_fence(__ATOMIC_SEQ_CST);
	if (work_waiting(p)) {
		__atomic_store_n(&p->ctrl->sleeping, 0, __ATOMIC_RELAXED);
		return;
	}
	int timeout = -1;
	if (deadline != UINT64_MAX)
		timeout = deadline <= p->now_ns ? 0 : (int)((deadline - p->now_ns + 999999) / 1000000);
	struct epoll_event ev[32];
	KVS_STAT_ADD(p->stats->sleeps, 1);
	int n = epoll_wait(p->epfd, ev, 32, timeout);
	__atomic_store_n(&p->ctrl->sleeping, 0, __ATOMIC_RELAXED);
	p->now_ns = kvsp_now_ns();
	if (n > 0)
		on_events(p, ev, n);
}

/* Idle this long, and as often while spinning idle, the proxy gives its CPU
 * away (see kvsp_run). Short gaps between bursts of work yield nothing, so
 * a busy proxy keeps its pace. */
#define YIELD_EVERY_NS 5000

/* A sleep that ends soon after it began cost a wake-up (on some hosts more
 * than 100 us) to save a few microseconds of spinning: spin longer next
 * time. Sleeps that last shrink the budget back, so an idle proxy sleeps.
 * Bounded at 16 times --spin-us and 1 ms. */
static void adapt_spin(struct kvsp *p, uint64_t slept_ns)
{
	uint64_t base = p->cfg.spin_ns;
	uint64_t max = base * 16 < 1000000 ? base * 16 : 1000000;
	if (!base)
		return;
	if (slept_ns < 4 * p->spin_ns && p->spin_ns < max)
		p->spin_ns = p->spin_ns * 2 < max ? p->spin_ns * 2 : max;
	else if (slept_ns > 64 * p->spin_ns && p->spin_ns > base)
		p->spin_ns = p->spin_ns / 2 > base ? p->spin_ns / 2 : base;
}

/* Returns true when the loop should end. */
static bool shutdown_step(struct kvsp *p, int *exit_code)
{
	if (p->term > p->terms_seen) {
		p->terms_seen = p->term;
		if (p->draining) {
			LOG_WARN("second signal: exiting now, %u rooms still active", p->rooms_active);
			*exit_code = 1;
			return true;
		}
		p->draining = true;
		__atomic_store_n(&p->stats->draining, 1, __ATOMIC_RELAXED);
		p->drain_deadline_ns = p->now_ns + p->cfg.shutdown_grace_ns;
		stop_listening(p);
		LOG_INFO("draining: no new clients or rooms; %u rooms active", p->rooms_active);
	}
	/* Done when clients closed every room, or once the grace is over and
	 * nothing is in flight: an ended room a client still holds involves
	 * no transport, so leaving it is safe. */
	uint64_t open = __atomic_load_n(&p->stats->rooms_open, __ATOMIC_RELAXED);
	if (p->draining && (open == 0 || (p->aborted_all && p->rooms_active == 0))) {
		LOG_INFO("drained: exiting");
		*exit_code = 0;
		return true;
	}
	return false;
}

int kvsp_run(struct kvsp *p)
{
	uint64_t idle_since = kvsp_now_ns(), last_yield_ns = 0;
	uint64_t deadline = UINT64_MAX;
	p->spin_ns = p->cfg.spin_ns;
	int exit_code = 0;
	for (;;) {
		p->now_ns = kvsp_now_ns();
		int busy = poll_clients(p);
		busy |= p->local->ops->poll(p->local);
		if (p->now_ns >= p->next_tick_ns) {
			struct epoll_event ev[32];
			int n = epoll_wait(p->epfd, ev, 32, 0);
			if (n > 0)
				on_events(p, ev, n);
			deadline = tick(p);
		}
		kvsp_kicks_flush(p);
		if (p->term != p->terms_seen || p->draining)
			if (shutdown_step(p, &exit_code))
				return exit_code;
		if (busy) {
			idle_since = p->now_ns;
			continue;
		}
		if (p->now_ns - idle_since < p->spin_ns) {
			/* Spin politely: a client that shares our CPU gets it
			 * while we have nothing to do, or it would wait out our
			 * whole spin (up to 1 ms) for its reply. Whether a CPU is
			 * shared cannot be told from here (one CPU of affinity is
			 * a dedicated core or a one-CPU container alike); alone on
			 * it, sched_yield returns at once, and only gaps of 5 us
			 * pay for it. */
			if (p->now_ns - idle_since >= YIELD_EVERY_NS &&
			    p->now_ns - last_yield_ns >= YIELD_EVERY_NS) {
				sched_yield();
				last_yield_ns = p->now_ns;
			} else {
				rte_pause();
			}
			continue;
		}
		deadline = tick(p);
		uint64_t slept = p->now_ns;
		sleep_until_work(p, deadline);
		adapt_spin(p, p->now_ns - slept);
		p->next_tick_ns = 0; /* look at timers and sockets right away */
		idle_since = p->now_ns;
	}
}
