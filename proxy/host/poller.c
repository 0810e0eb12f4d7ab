/* SPDX-License-Identifier: MIT */
/*
 * The run-to-completion loop. Each pass polls every client's submission
 * ring and every transport; each poll says BUSY or IDLE. Sockets (accepts,
 * hang-ups, admin), timers and shutdown are looked at once a millisecond
 * while busy. After spin_ns without work the loop sleeps in epoll_wait,
 * having told clients (ctrl->sleeping) to kick its eventfd.
 */
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <rte_atomic.h>
#include <rte_pause.h>

#include "base/log.h"
#include "base/loop_fd.h"
#include "base/notify.h"
#include "base/trace.h"
#include "core/proxy.h"
#include "core/clients.h"
#include "core/ops.h"
#include "core/rooms.h"
#include "core/xport.h"
#include "host/loop.h"
#include "ring.h"

#define TICK_NS 1000000ull
#define DRAIN_REPORT_NS 2000000000ull /* a draining proxy says what it waits for this often */

struct kvsp *kvsp_signalled; /* for the signal handler: set by kvsp_listen */

/*
 * The loop's clock. CLOCK_MONOTONIC costs a vDSO call each pass (56 ns
 * under kvm-clock, a fifth of a small chunk's pass); the TSC is read in
 * 16. Where it runs at one rate whatever the CPU does (constant_tsc and
 * nonstop_tsc), the pass reads the TSC and scales it from an anchor that
 * each tick (and each wake from sleep) takes again from CLOCK_MONOTONIC:
 * timers are judged on a fresh anchor, and between two anchors (1 ms) the
 * estimate never steps back. An anchor the estimate missed by more than
 * 100 us (TSCs out of step across CPUs) turns the TSC off for good.
 */
static struct {
	bool on;
	uint64_t tsc0, ns0, last;
	uint64_t mult; /* ns per TSC tick, 32.32 fixed point */
} lclock;

static inline uint64_t rdtsc(void)
{
#if defined(__x86_64__)
	uint32_t lo, hi;
	__asm__ volatile("rdtsc" : "=a"(lo), "=d"(hi));
	return (uint64_t)hi << 32 | lo;
#else
	return 0;
#endif
}

static bool tsc_invariant(void)
{
#if defined(__x86_64__)
	FILE *f = fopen("/proc/cpuinfo", "r");
	char line[4096];
	bool constant = false, nonstop = false;
	while (f && fgets(line, sizeof(line), f) && strncmp(line, "flags", 5))
		;
	if (f && !strncmp(line, "flags", 5)) {
		constant = strstr(line, " constant_tsc") != NULL;
		nonstop = strstr(line, " nonstop_tsc") != NULL;
	}
	if (f)
		fclose(f);
	return constant && nonstop;
#else
	return false;
#endif
}

static void lclock_anchor(uint64_t ns)
{
	lclock.tsc0 = rdtsc();
	lclock.ns0 = ns > lclock.last ? ns : lclock.last;
	lclock.last = lclock.ns0;
}

static void lclock_init(void)
{
	if (!tsc_invariant() || getenv("KVSTAGE_NO_TSC"))
		return;
	uint64_t t0 = kvsp_now_ns(), c0 = rdtsc();
	nanosleep(&(struct timespec){ 0, 10000000 }, NULL);
	uint64_t t1 = kvsp_now_ns(), c1 = rdtsc();
	if (c1 <= c0 || t1 <= t0)
		return;
	lclock.mult = (uint64_t)(((unsigned __int128)(t1 - t0) << 32) / (c1 - c0));
	lclock.on = lclock.mult > 0;
	lclock_anchor(t1);
	LOG_INFO("loop clock: the TSC, %.3f GHz, anchored to CLOCK_MONOTONIC every tick",
		 (double)(c1 - c0) / (double)(t1 - t0));
}

/* The pass's time: the TSC scaled from the last anchor, or CLOCK_MONOTONIC. */
static inline uint64_t lclock_now(void)
{
	/* Never back, either way: a TSC turned off may have run up to 100 us
	 * ahead, and every "now - then" of the loop is unsigned. */
	uint64_t ns;
	if (lclock.on) {
		unsigned __int128 d = (unsigned __int128)(rdtsc() - lclock.tsc0) * lclock.mult;
		ns = lclock.ns0 + (uint64_t)(d >> 32);
	} else {
		ns = kvsp_now_ns();
	}
	if (ns < lclock.last)
		ns = lclock.last;
	lclock.last = ns;
	return ns;
}

/* CLOCK_MONOTONIC, and a new anchor for the TSC (checked against it). */
static uint64_t lclock_sync(void)
{
	uint64_t ns = kvsp_now_ns();
	if (!lclock.on)
		return ns;
	uint64_t est = lclock_now();
	if (est > ns + 100000 || ns > est + 100000) {
		lclock.on = false;
		LOG_WARN("loop clock: the TSC missed CLOCK_MONOTONIC by %lld us: CLOCK_MONOTONIC "
			 "from now on",
			 (long long)((int64_t)(est - ns) / 1000));
		return lclock_now();
	}
	lclock_anchor(ns);
	return lclock.ns0;
}

static void on_signal(int sig)
{
	(void)sig;
	if (kvsp_signalled) {
		kvsp_signalled->term++;
		eventfd_write(kvsp_signalled->wake_fd, 1);
	}
}

int kvsp_listen(struct kvsp *p)
{
	int rc = kvsp_listener_open(p);
	if (rc < 0)
		return rc;
	kvsp_signalled = p;
	struct sigaction sa_term = { .sa_handler = on_signal };
	sigemptyset(&sa_term.sa_mask);
	sigaction(SIGTERM, &sa_term, NULL);
	sigaction(SIGINT, &sa_term, NULL);
	signal(SIGPIPE, SIG_IGN);
	return 0;
}

/* ------------------------------------------------------------ sockets */

/* A client never writes to its socket after hello but to say goodbye:
 * anything else there (or a hang-up alone) is its death. */
static void on_client_socket(struct kvsp *p, struct kvsp_client *c)
{
	struct kvs_hello bye;
	ssize_t n = recv(c->sock, &bye, sizeof(bye), MSG_DONTWAIT);
	unsigned rooms = 0;
	for (uint16_t h = 0; h < p->cfg.client_rooms; h++)
		rooms += c->handles[h].state != KVSP_H_FREE;
	if (n == (ssize_t)sizeof(bye) && bye.magic == KVS_MAGIC_BYE) {
		KVS_STAT_ADD(p->stats->clients_closed, 1);
		kvsp_log_rl(&p->rl_attach, p->now_ns, &p->stats->log_suppressed, KVSP_LOG_INFO,
			    "client %u (pid %d) closed, %u rooms open", c->id, (int)c->pid, rooms);
	} else {
		KVS_STAT_ADD(p->stats->clients_died, 1);
		kvsp_log_rl(&p->rl_died, p->now_ns, &p->stats->log_suppressed, KVSP_LOG_INFO,
			    "client %u (pid %d) hung up without closing: aborting its %u rooms",
			    c->id, (int)c->pid, rooms);
	}
	kvsp_client_destroy(p, c);
}

static void on_events(struct kvsp *p, struct epoll_event *ev, int n)
{
	for (int k = 0; k < n; k++) {
		uint64_t d = ev[k].data.u64;
		unsigned type = (unsigned)(d >> 56), idx = (unsigned)(d >> 32) & 0xffffff;
		uint32_t id = (uint32_t)d;
		switch (type) {
		case KVSP_EP_LISTEN:
			if (p->listen_fd >= 0)
				kvsp_on_accept(p);
			break;
		case KVSP_EP_WAKE: {
			eventfd_t v;
			eventfd_read(p->wake_fd, &v);
			break;
		}
		case KVSP_EP_PENDING:
			if (kvsp_pending_valid(p, idx, id))
				kvsp_on_hello(p, idx);
			break;
		case KVSP_EP_CLIENT: {
			struct kvsp_client *c = kvsp_client_get(p, (uint16_t)idx, id);
			if (c)
				on_client_socket(p, c);
			break;
		}
		case KVSP_EP_ADMIN:
			kvsp_admin_event(p, idx, ev[k].events);
			break;
		case KVSP_EP_XPORT:
			if (idx < p->nxports && p->xports[idx]->ops->on_fd)
				p->xports[idx]->ops->on_fd(p->xports[idx], id, ev[k].events);
			break;
		}
	}
	kvsp_rooms_settle(p);
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

static int poll_transports(struct kvsp *p)
{
	int busy = KVSP_IDLE;
	for (unsigned k = 0; k < p->nxports; k++)
		busy |= p->xports[k]->ops->poll(p->xports[k]);
	kvsp_rooms_settle(p); /* what their completions ended */
	return busy;
}

static bool work_waiting(struct kvsp *p)
{
	for (unsigned k = 0; k < p->nxports; k++)
		if (p->xports[k]->ops->pending(p->xports[k]))
			return true;
	for (unsigned i = 0; i < p->clients_hi; i++) {
		struct kvsp_client *c = p->clients[i];
		if (!c)
			continue;
		int64_t sq = kvsp_sq_waiting(c);
		if (sq < 0 || (sq && kvs_ring_free(&c->cq) > c->finals_owed))
			return true; /* a bad index is work too: the client's cut-off */
	}
	return false;
}

/* What a draining proxy still waits for, in one line. */
static void drain_report(struct kvsp *p, const char *what)
{
	const struct kvs_stats *st = p->stats;
	LOG_INFO("%s: %u rooms active (%llu open), %llu slots in flight, %llu tombstones, "
		 "%llu clients attached",
		 what, p->rooms_active, (unsigned long long)st->rooms_open,
		 (unsigned long long)st->slots[KVS_SLOT_INFLIGHT],
		 (unsigned long long)st->slots[KVS_SLOT_TOMBSTONE],
		 (unsigned long long)st->clients);
	p->drain_report_ns = p->now_ns + DRAIN_REPORT_NS;
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
			drain_report(p, "draining, waiting for transports to quiesce");
		} else {
			next = p->drain_deadline_ns;
		}
	}
	if (p->draining) {
		if (p->now_ns >= p->drain_report_ns)
			drain_report(p, p->aborted_all ? "still draining, waiting for transports"
						       : "draining, waiting for clients");
		if (p->drain_report_ns < next)
			next = p->drain_report_ns;
	}
	uint64_t t = kvsp_rooms_tick(p);
	if (t < next)
		next = t;
	t = kvsp_pending_expire(p);
	if (t < next)
		next = t;
	kvsp_rl_flush(&p->rl_timeout, p->now_ns, KVSP_LOG_INFO, "room timeouts", 0);
	kvsp_rl_flush(&p->rl_refused, p->now_ns, KVSP_LOG_WARN, "refused connections", 0);
	kvsp_rl_flush(&p->rl_died, p->now_ns, KVSP_LOG_INFO, "client deaths", 0);
	kvsp_rl_flush(&p->rl_attach, p->now_ns, KVSP_LOG_INFO, "clients attached and closed", 0);
	kvsp_rl_flush(&p->rl_abort, p->now_ns, KVSP_LOG_INFO, "rooms aborted", 0);
	kvsp_rl_flush(&p->rl_full, p->now_ns, KVSP_LOG_WARN, "connections refused for want of room",
		      0);
	kvsp_admin_poll(p);
	p->next_tick_ns = p->now_ns + TICK_NS;
	return next;
}

static void sleep_until_work(struct kvsp *p, uint64_t deadline)
{
	if (p->trace)
		kvsp_trace_flush(p->trace); /* what the tick traced is not left for our wakeup */
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
		timeout = deadline <= p->now_ns ? 0
						: (int)((deadline - p->now_ns + 999999) / 1000000);
	struct epoll_event ev[32];
	KVS_STAT_ADD(p->stats->sleeps, 1);
	int n = epoll_wait(p->epfd, ev, 32, timeout);
	__atomic_store_n(&p->ctrl->sleeping, 0, __ATOMIC_RELAXED);
	p->now_ns = lclock_sync();
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
			LOG_WARN("second signal: exiting now, %u rooms still active",
				 p->rooms_active);
			*exit_code = 1;
			return true;
		}
		p->draining = true;
		__atomic_store_n(&p->stats->draining, 1, __ATOMIC_RELAXED);
		p->drain_deadline_ns = p->now_ns + p->cfg.shutdown_grace_ns;
		/* The socket stays: new clients are refused (-ESHUTDOWN), while
		 * kvstage-stat and the admin path still reach us. */
		drain_report(p, "draining: no new clients or rooms");
		kvsp_notify("STOPPING=1\nSTATUS=draining: %u rooms active, %llu clients attached",
			    p->rooms_active, (unsigned long long)p->stats->clients);
		for (unsigned k = 0; k < p->nxports; k++)
			if (p->xports[k]->ops->drain)
				p->xports[k]->ops->drain(p->xports[k]);
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
	lclock_init();
	uint64_t idle_since = lclock_now(), last_yield_ns = 0;
	uint64_t deadline = UINT64_MAX;
	p->spin_ns = p->cfg.spin_ns;
	int exit_code = 0;
	for (;;) {
		p->now_ns = lclock_now();
		int busy = poll_clients(p);
		busy |= poll_transports(p);
		if (p->now_ns >= p->next_tick_ns) {
			p->now_ns = lclock_sync(); /* timers are judged on the real clock */
			struct epoll_event ev[32];
			int n = epoll_wait(p->epfd, ev, 32, 0);
			if (n > 0)
				on_events(p, ev, n);
			deadline = tick(p);
		}
		kvsp_kicks_flush(p);
		if (p->trace)
			kvsp_trace_flush(p->trace); /* what this pass traced, one wakeup */
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
