/* SPDX-License-Identifier: MIT */
/*
 * The idle mode: a proxy with no work should sleep (not spin), a client
 * blocked in kvs_wait should not spin either, and the first request after
 * a quiet spell should be served quickly. The proxy's own `sleeping` flag
 * (control segment) confirms it really was asleep before each sample.
 */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "admin.h"
#include "bench.h"
#include "kvstage.h"
#include "layout.h"
#include "report.h"
#include "sock.h"

#define ASLEEP_WAIT_NS 200000000ull

/* Waits until the proxy says it sleeps. Returns true if it does. */
static bool wait_asleep(const struct kvs_ctrl *ctrl, uint64_t limit_ns)
{
	uint64_t until = now_ns() + limit_ns;
	while (!__atomic_load_n(&ctrl->sleeping, __ATOMIC_ACQUIRE)) {
		if (now_ns() > until)
			return false;
		sleep_ns(100000);
	}
	return true;
}

/* A client that blocks in kvs_wait until killed; tells the parent when it is connected. */
static pid_t spawn_waiter(const char *sock)
{
	int p[2];
	if (pipe(p) < 0)
		return -1;
	pid_t pid = bench_fork(-1);
	if (pid == 0) {
		close(p[0]);
		kvs_client *c;
		char b = kvs_connect(sock, &c) == 0 ? 'r' : 'x';
		kvs_write_full(p[1], &b, 1);
		close(p[1]);
		if (b != 'r')
			_exit(1);
		struct kvs_event ev;
		for (;;)
			kvs_wait(c, &ev, -1);
	}
	close(p[1]);
	char b = 0;
	if (pid < 0 || kvs_read_full(p[0], &b, 1) != 1 || b != 'r') {
		if (pid > 0) {
			kill(pid, SIGKILL);
			waitpid(pid, NULL, 0);
		}
		pid = -1;
	}
	close(p[0]);
	return pid;
}

/* One kvs_acquire(1) round trip, timed into *ns; the lease goes back after. Returns 0, or -errno. */
static int timed_acquire(kvs_client *c, uint64_t *ns)
{
	struct kvs_lease l;
	uint64_t t0 = now_ns();
	int rc = kvs_acquire(c, 1, &l);
	*ns = now_ns() - t0;
	return rc < 0 ? rc : kvs_release(c, &l);
}

static int ifail(const char *what, int rc)
{
	fprintf(stderr, "kvstage-bench idle: %s: %s\n", what, kvs_strerror(rc));
	return 1;
}

static int measure(const struct bench_opts *o, const struct bench_proxy *px,
		   const struct kvs_ctrl *ctrl, struct idle_result *r)
{
	kvs_client *c;
	int rc = kvs_connect(px->sock, &c);
	if (rc < 0)
		return ifail("kvs_connect", rc);
	pid_t waiter = spawn_waiter(px->sock);
	if (waiter < 0) {
		kvs_close(c);
		return ifail("starting the client that waits in kvs_wait", -ECHILD);
	}
	int ret = 0;
	if (!wait_asleep(ctrl, 2000000000ull))
		note(o, "idle: the proxy did not go to sleep within 2 s of its last request");

	/* The window: nobody asks anything. */
	note(o, "idle: %.1f s with no work (one client connected, one blocked in kvs_wait)",
	     o->duration);
	uint64_t sleeps_a = __atomic_load_n(&ctrl->stats.sleeps, __ATOMIC_RELAXED);
	double cpu_a = proc_cpu_seconds(px->cpu_pid), wcpu_a = proc_cpu_seconds(waiter);
	uint64_t t_a = now_ns();
	uint64_t end = t_a + (uint64_t)(o->duration * 1e9);
	bool prog = progress_on(o);
	while (now_ns() < end) {
		uint64_t left = end - now_ns();
		sleep_ns(left < 250000000ull ? left : 250000000ull);
		if (prog)
			progress_line("idle: %.1f / %.1f s", (double)(now_ns() - t_a) / 1e9,
				      o->duration);
	}
	double cpu_b = proc_cpu_seconds(px->cpu_pid), wcpu_b = proc_cpu_seconds(waiter);
	uint64_t t_b = now_ns();
	uint64_t sleeps_b = __atomic_load_n(&ctrl->stats.sleeps, __ATOMIC_RELAXED);
	progress_clear();
	r->window_s = (double)(t_b - t_a) / 1e9;
	r->proxy_cpu = cpu_a >= 0 && cpu_b >= 0 ? (cpu_b - cpu_a) / r->window_s * 100 : -1;
	r->client_cpu = wcpu_a >= 0 && wcpu_b >= 0 ? (wcpu_b - wcpu_a) / r->window_s * 100 : -1;
	r->proxy_sleeps = sleeps_b - sleeps_a;
	kill(waiter, SIGKILL);
	waitpid(waiter, NULL, 0);

	/* Wake-ups: quiet for the gap, confirm it sleeps, then one request. */
	struct hist *wake = malloc(sizeof(*wake)), *warm = malloc(sizeof(*warm));
	if (!wake || !warm) {
		ret = ifail("histograms", -ENOMEM);
		goto out;
	}
	hist_init(wake);
	hist_init(warm);
	r->gap_ms = o->idle_gap_ms;
	note(o, "idle: %u wake-up samples, %.1f ms apart", o->samples, o->idle_gap_ms);
	for (unsigned i = 0; i < o->samples; i++) {
		sleep_ns((uint64_t)(o->idle_gap_ms * 1e6));
		if (!wait_asleep(ctrl, ASLEEP_WAIT_NS))
			r->not_asleep++;
		uint64_t ns;
		if ((rc = timed_acquire(c, &ns)) < 0) {
			ret = ifail("kvs_acquire/kvs_release", rc);
			goto out;
		}
		hist_add(wake, ns);
		r->samples++;
		if (prog && (i & 31) == 31)
			progress_line("idle: wake-up sample %u / %u", i + 1, o->samples);
	}
	/* The same request, back to back: the proxy is awake and polling. */
	for (unsigned i = 0; i < o->samples; i++) {
		uint64_t ns;
		if ((rc = timed_acquire(c, &ns)) < 0) {
			ret = ifail("kvs_acquire/kvs_release", rc);
			goto out;
		}
		hist_add(warm, ns);
	}
	progress_clear();
	r->wake = hist_lat(wake);
	r->warm = hist_lat(warm);
	note(o,
	     "idle: baseline: %u eventfd round trips between two sleeping processes, %.1f ms "
	     "apart",
	     o->samples, o->idle_gap_ms);
	if (baseline_wake(o->samples, (uint64_t)(o->idle_gap_ms * 1e6), &r->efd) < 0)
		note(o, "idle: the eventfd baseline failed; its ratios are n/a");
out:
	free(wake);
	free(warm);
	kvs_close(c);
	return ret;
}

static const char *const idle_defs[][2] = {
	{ "wake_latency", "a kvs_acquire(1) round trip issued after gap_ms with no requests, once "
			  "the proxy's control segment says it sleeps" },
	{ "warm_latency", "the same round trip back to back (the proxy polling)" },
	{ "eventfd_wake_rtt", "baseline: an eventfd round trip between two processes that both "
			      "block (placed like the proxy and the client), after the same gap: "
			      "two wake-ups, the kernel's floor for this path" },
};

static void report_idle(const struct bench_opts *o, const struct idle_result *r,
			const struct bench_proxy *px)
{
	struct doc *d = calloc(1, sizeof(*d) + sizeof(struct point));
	if (!d)
		return;
	struct point *p = (struct point *)(d + 1);
	CAT(d->head,
	    "kvstage-bench %s idle: %.2f s with no work, then %u wake-up samples %.1f ms "
	    "apart\n",
	    KVS_VERSION_STRING, r->window_s, r->samples, r->gap_ms);
	doc_head(d, o, px, "", false, NULL);
	put(&d->top, "result", U_POINTS);
	put_defs(d, idle_defs, sizeof(idle_defs) / sizeof(idle_defs[0]));
	d->csv = "mode,window_s,proxy_cpu_pct,proxy_sleeps,waiting_client_cpu_pct,samples,"
		 "samples_not_asleep,gap_ms,wake_p50_us,wake_p99_us,wake_p999_us,warm_p50_us,"
		 "warm_p99_us,warm_p999_us,eventfd_p50_us,eventfd_p99_us,eventfd_p999_us";
	d->pt = p;
	d->npt = 1;
	d->sections = true;
	put_num(p, "window_s", r->window_s);
	vs(p, fig(p, "proxy CPU (% of one core)", NULL, U_NUM, r->proxy_cpu, "proxy_cpu_pct"), NAN,
	   "(no baseline: lower is better)", NULL, NULL);
	vs(p,
	   fig(p, "times it went to sleep", NULL, U_INT, (double)r->proxy_sleeps, "proxy_sleeps"),
	   NAN, "(0: it slept through the window)", NULL, NULL);
	vs(p,
	   fig(p, "kvs_wait client CPU (%)", NULL, U_NUM, r->client_cpu, "waiting_client_cpu_pct"),
	   NAN, "(a client blocked in kvs_wait)", NULL, NULL);
	put_int(p, "samples", r->samples);
	put_int(p, "samples_not_asleep", r->not_asleep);
	put_num(p, "gap_ms", r->gap_ms);
	vs_lat(p,
	       fig_lat(p, "wake-up latency", NULL, &r->wake, PALL, "wake_latency_us", "wake_%s_us"),
	       &r->efd, "eventfd round trip, both asleep,", "eventfd_wake_rtt_us|eventfd_%s_us",
	       "ratio.wake_%s_vs_eventfd");
	vs(p, fig_lat(p, "awake latency", NULL, &r->warm, PALL, "warm_latency_us", "warm_%s_us"),
	   NAN, "(the same request, back to back)", NULL, NULL);
	vs_lat(p, fig_lat(p, NULL, NULL, &r->wake, PALL, NULL, NULL), &r->warm, NULL, NULL,
	       "ratio.wake_%s_vs_warm");
	CAT(d->tail, "\nproxy CPU: utime + stime from /proc/PID/stat over the idle window.\n");
	if (r->not_asleep)
		CAT(p->notes,
		    "  %u of %u samples found the proxy not asleep after the gap (its flag)\n",
		    r->not_asleep, r->samples);
	report(d);
	free(d);
}

int run_idle(const struct bench_opts *o)
{
	struct bench_proxy px;
	struct idle_result r = { 0 };
	int rc = proxy_open(&px, o, o->chunks[0], proxy_slots_for(o->chunks[0], 1));
	if (rc)
		return rc;
	if (o->socket)
		note(o,
		     "idle: the proxy at %s must have no other clients for this to mean anything",
		     o->socket);
	const struct kvs_ctrl *ctrl;
	size_t clen;
	rc = kvs_stat_map(px.sock, &ctrl, &clen);
	if (rc < 0) {
		ifail("mapping the control segment", rc);
		proxy_stop(&px);
		return 1;
	}
	pin_clients();
	rc = measure(o, &px, ctrl, &r);
	pin_all();
	munmap((void *)ctrl, clen);
	proxy_stop(&px);
	if (!rc)
		report_idle(o, &r, &px);
	return rc;
}
