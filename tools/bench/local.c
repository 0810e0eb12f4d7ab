/* SPDX-License-Identifier: MIT */
/*
 * The local mode, parent side: per chunk size, the baselines, a proxy, the
 * sender/receiver pairs (local_clients.c) started together, the measured
 * window, the proxy's CPU over it, and the figures gathered from the
 * children's shared records.
 */
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "local.h"
#include "report.h"

static volatile sig_atomic_t interrupted;

static void on_interrupt(int sig)
{
	(void)sig;
	interrupted = 1;
}

void local_catch_signals(void)
{
	struct sigaction sa = { .sa_handler = on_interrupt };
	sigemptyset(&sa.sa_mask);
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);
}

bool local_interrupted(void)
{
	return interrupted;
}

/* -------------------------------------------------------------- parent */

struct kids {
	pid_t pid[2 * BENCH_MAX_PAIRS];
	int status[2 * BENCH_MAX_PAIRS];
	bool reaped[2 * BENCH_MAX_PAIRS];
	double cpu[2 * BENCH_MAX_PAIRS]; /* once reaped: its CPU seconds */
	unsigned n;
};

/* Reaps whichever children have exited; returns true if one failed. */
static bool kids_reap(struct kids *k, bool block)
{
	bool bad = false;
	for (unsigned i = 0; i < k->n; i++) {
		if (k->reaped[i])
			continue;
		pid_t r;
		struct rusage ru;
		while ((r = wait4(k->pid[i], &k->status[i], block ? 0 : WNOHANG, &ru)) < 0 &&
		       errno == EINTR)
			;
		if (r == k->pid[i]) {
			k->reaped[i] = true;
			k->cpu[i] = (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
				    (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
			if (!WIFEXITED(k->status[i]) || WEXITSTATUS(k->status[i]))
				bad = true;
		}
	}
	return bad;
}

static void kids_kill(struct kids *k)
{
	for (unsigned i = 0; i < k->n; i++)
		if (!k->reaped[i])
			kill(k->pid[i], SIGKILL);
	kids_reap(k, true);
}

/* CPU seconds of every child still running, summed; < 0 if one cannot be read. */
static double kids_cpu_seconds(const struct kids *k)
{
	double sum = 0;
	for (unsigned i = 0; i < k->n; i++) {
		double s = k->reaped[i] ? k->cpu[i] : proc_cpu_seconds(k->pid[i]);
		if (s < 0)
			return -1;
		sum += s;
	}
	return sum;
}

static pid_t spawn(struct kids *k)
{
	fflush(NULL);
	pid_t pid = fork();
	if (pid == 0) {
		signal(SIGINT, SIG_DFL);
		signal(SIGTERM, SIG_DFL);
	} else if (pid > 0) {
		k->pid[k->n++] = pid;
	}
	return pid;
}

static void print_child_errors(const struct lshared *sh, unsigned pairs)
{
	for (unsigned i = 0; i < pairs; i++) {
		const struct child_res *r[2] = { &sh->rx[i], &sh->tx[i] };
		for (unsigned j = 0; j < 2; j++)
			if (r[j]->msg[0])
				fprintf(stderr, "kvstage-bench: %s\n", r[j]->msg);
	}
}

static void progress(const struct bench_opts *o, const struct lshared *sh, unsigned pairs,
		     uint64_t chunk, uint64_t *last_b, uint64_t *last_t)
{
	uint64_t b = 0, t = now_ns();
	for (unsigned i = 0; i < pairs; i++)
		b += __atomic_load_n(&sh->rx[i].p_bytes, __ATOMIC_RELAXED);
	if (t <= *last_t)
		return;
	double rate = (double)(b - *last_b) / (double)(t - *last_t);
	char cs[16];
	uint64_t tm = __atomic_load_n(&sh->t_meas, __ATOMIC_ACQUIRE);
	double el = tm ? (double)(t - tm) / 1e9 : 0;
	bench_size_str(chunk, cs, sizeof(cs));
	if (!tm)
		progress_line("local %s: warming up (%.1f s), now %.2f GB/s", cs,
			      (double)(t - sh->t0) / 1e9, rate);
	else if (o->bytes)
		progress_line("local %s: %.1f s, %.2f of %.2f GB, now %.2f GB/s", cs, el,
			      (double)b / 1e9, (double)o->bytes / 1e9, rate);
	else
		progress_line("local %s: %.1f / %.1f s, now %.2f GB/s", cs, el, o->duration, rate);
	*last_b = b;
	*last_t = t;
}

/* The counters a proxy's tcp syscalls per chunk come from (local_point's sends, recvs, epolls). */
enum { K_SEND, K_RECV, K_WAIT, K_CTL, K_LOWAT, K_CHUNKS, K_N };
static const char *const calls_names[K_N] = { "tcp_send_calls",	  "tcp_recv_calls",
					      "peer_epoll_waits", "peer_epoll_ctls",
					      "tcp_lowat_calls",  "chunks_moved" };

/* Each proxy's counters now (0: A, the senders', 1: B); false if one is unreadable. */
static bool calls_take(const struct bench_ends *e, uint64_t v[2][K_N])
{
	return bench_stats(e->tx_sock, calls_names, K_N, v[0]) == 0 &&
	       bench_stats(e->rx_sock, calls_names, K_N, v[1]) == 0;
}

/* Per chunk each proxy moved between the two samples; NaN where unknown. */
static void calls_per_chunk(struct local_point *pt, bool ok, uint64_t a[2][K_N], uint64_t b[2][K_N])
{
	for (int i = 0; i < 2; i++) {
		double chunks = ok ? (double)(b[i][K_CHUNKS] - a[i][K_CHUNKS]) : 0;
		pt->sends[i] = chunks > 0 ? (double)(b[i][K_SEND] - a[i][K_SEND]) / chunks : NAN;
		pt->recvs[i] = chunks > 0 ? (double)(b[i][K_RECV] - a[i][K_RECV]) / chunks : NAN;
		pt->epolls[i] = chunks > 0 ? (double)(b[i][K_WAIT] - a[i][K_WAIT] + b[i][K_CTL] -
						      a[i][K_CTL] + b[i][K_LOWAT] - a[i][K_LOWAT]) /
						     chunks
					   : NAN;
	}
}

int local_measure(const struct bench_opts *o, const struct bench_ends *e, uint64_t chunk,
		  struct local_point *pt)
{
	unsigned pairs = o->senders;
	struct lshared *sh = bench_alloc(sizeof(*sh), true);
	if (!sh) {
		fprintf(stderr, "kvstage-bench: cannot map %zu bytes of shared memory\n",
			sizeof(*sh));
		return 1;
	}
	memset(sh, 0, sizeof(*sh));
	for (unsigned i = 0; i < pairs; i++) {
		hist_init(&sh->rx[i].h);
		hist_init(&sh->tx[i].h);
	}
	struct lctx x = { .o = o,
			  .rx_sock = e->rx_sock,
			  .tx_sock = e->tx_sock,
			  .chunk = chunk,
			  .room_bytes = pt->room_bytes,
			  .room_chunks = pt->room_chunks,
			  .sh = sh };
	int go[2], ready[2], done[2];
	if (pipe(go) < 0 || pipe(ready) < 0 || pipe(done) < 0) {
		fprintf(stderr, "kvstage-bench: pipe: %s\n", strerror(errno));
		return 1;
	}
	struct kids kids = { .n = 0 };
	int rc = 0;
	for (unsigned i = 0; i < pairs && !rc; i++) {
		int desc[2];
		if (pipe(desc) < 0) {
			rc = 1;
			break;
		}
		x.pair = i;
		pid_t pid = spawn(&kids);
		if (pid == 0) {
			close(desc[0]);
			close(go[1]);
			close(ready[0]);
			close(done[0]);
			_exit(local_receiver(&x, desc[1], ready[1], go[0], done[1]));
		}
		if (pid > 0)
			pid = spawn(&kids);
		if (pid == 0) {
			close(desc[1]);
			close(go[1]);
			close(ready[0]);
			close(done[0]);
			close(done[1]);
			_exit(local_sender(&x, desc[0], ready[1], go[0]));
		}
		if (pid < 0) {
			fprintf(stderr, "kvstage-bench: fork: %s\n", strerror(errno));
			rc = 1;
		}
		close(desc[0]);
		close(desc[1]);
	}
	close(go[0]);
	close(ready[1]);
	close(done[1]);

	/* Every child connected and allocated before the clock starts. */
	unsigned nready = 0;
	while (!rc && nready < kids.n) {
		char b[64];
		struct pollfd pf = { .fd = ready[0], .events = POLLIN };
		if (poll(&pf, 1, 30000) <= 0 || interrupted) {
			rc = 1;
			break;
		}
		ssize_t k = read(ready[0], b, sizeof(b));
		if (k <= 0)
			rc = 1; /* a child died before it was ready */
		else
			nready += (unsigned)k;
	}
	pid_t rx_pid = e->rx_cpu_pid != e->tx_cpu_pid ? e->rx_cpu_pid : 0;
	double cpu_a = -1, cpu_b = -1, rcpu_a = -1, rcpu_b = -1, kcpu_a = -1, kcpu_b = -1;
	uint64_t t_a = 0, t_b = 0;
	uint64_t calls_a[2][K_N] = { { 0 } }, calls_b[2][K_N] = { { 0 } };
	bool calls_ok = e->tcp_calls;
	if (!rc) {
		uint64_t t0 = now_ns();
		sh->t0 = t0;
		sh->t_warm = t0 + (uint64_t)(o->warmup * 1e9);
		sh->target = o->bytes ? (o->bytes + pairs - 1) / pairs : 0;
		sh->pairs = pairs;
		__atomic_thread_fence(__ATOMIC_SEQ_CST);
		close(go[1]); /* go */
		go[1] = -1;
		bool prog = progress_on(o);
		uint64_t last_b = 0, last_t = t0;
		unsigned ndone = 0;
		while (ndone < pairs) {
			/* Look often until the window opens: the CPU sample
			 * should start with it. */
			int timeout = t_a ? 250 : 2;
			struct pollfd pf = { .fd = done[0], .events = POLLIN };
			int pr = poll(&pf, 1, timeout);
			if (pr > 0) {
				char b[64];
				ssize_t k = read(done[0], b, sizeof(b));
				if (k <= 0) {
					rc = 1; /* every receiver is gone, not all done */
					break;
				}
				ndone += (unsigned)k;
			}
			if (!t_a && __atomic_load_n(&sh->t_meas, __ATOMIC_ACQUIRE)) {
				cpu_a = proc_cpu_seconds(e->tx_cpu_pid);
				rcpu_a = proc_cpu_seconds(rx_pid);
				kcpu_a = kids_cpu_seconds(&kids);
				if (calls_ok)
					calls_ok = calls_take(e, calls_a);
				t_a = now_ns();
			}
			if (interrupted || kids_reap(&kids, false)) {
				rc = 1;
				break;
			}
			if (prog && now_ns() - last_t >= 200000000ull)
				progress(o, sh, pairs, chunk, &last_b, &last_t);
		}
		cpu_b = proc_cpu_seconds(e->tx_cpu_pid);
		rcpu_b = proc_cpu_seconds(rx_pid);
		kcpu_b = kids_cpu_seconds(&kids);
		if (calls_ok)
			calls_ok = t_a && calls_take(e, calls_b);
		t_b = now_ns();
		progress_clear();
	}
	if (go[1] >= 0)
		close(go[1]);
	close(ready[0]);
	close(done[0]);
	if (rc)
		kids_kill(&kids);
	else if (kids_reap(&kids, true))
		rc = 1;

	struct hist *hr = malloc(sizeof(*hr)), *hs = malloc(sizeof(*hs));
	if (!hr || !hs) {
		rc = 1;
	} else {
		hist_init(hr);
		hist_init(hs);
	}
	uint64_t t_end = 0;
	for (unsigned i = 0; i < pairs && hr && hs; i++) {
		pt->bytes += sh->rx[i].bytes;
		pt->chunks += sh->rx[i].chunks;
		pt->rooms += sh->rx[i].rooms;
		pt->errors += sh->rx[i].errors;
		if (sh->rx[i].t_last > t_end)
			t_end = sh->rx[i].t_last;
		hist_merge(hr, &sh->rx[i].h);
		hist_merge(hs, &sh->tx[i].h);
	}
	calls_per_chunk(pt, calls_ok && !rc, calls_a, calls_b);
	uint64_t t_meas = sh->t_meas;
	if (!rc && (!t_meas || !pt->rooms || t_end <= t_meas)) {
		fprintf(stderr, "kvstage-bench: no room completed in the measured window\n");
		rc = 1;
	}
	if (t_meas && t_end > t_meas) {
		pt->warmup_s = (double)(t_meas - sh->t0) / 1e9;
		pt->seconds = (double)(t_end - t_meas) / 1e9;
		pt->gbps = (double)pt->bytes / (double)(t_end - t_meas);
		pt->chunks_s = (double)pt->chunks / pt->seconds;
		pt->rooms_s = (double)pt->rooms / pt->seconds;
		pt->room_lat = hist_lat(hr);
		pt->chunk_lat = hist_lat(hs);
		double win = (double)(t_b - t_a) / 1e9;
		pt->proxy_cpu = cpu_a >= 0 && cpu_b >= 0 && t_b > t_a ? (cpu_b - cpu_a) / win * 100
								      : -1;
		pt->proxy_rx_cpu = rcpu_a >= 0 && rcpu_b >= 0 && t_b > t_a
					   ? (rcpu_b - rcpu_a) / win * 100
					   : -1;
		pt->clients_cpu = kcpu_a >= 0 && kcpu_b >= 0 && t_b > t_a
					  ? (kcpu_b - kcpu_a) / win * 100
					  : -1;
	}
	if (rc || pt->errors)
		print_child_errors(sh, pairs);
	if (interrupted)
		fprintf(stderr, "kvstage-bench: interrupted\n");
	free(hr);
	free(hs);
	bench_free(sh, sizeof(*sh));
	return rc || pt->errors ? 1 : 0;
}

/* -------------------------------------------------------------- report */

static const char *const local_defs[][2] = {
	{ "window", "opens once every receiver is past --warmup and has completed its first "
		    "--rooms rooms (every slot in flight written and read once: first-touch "
		    "costs stay out), and closes at the last room completed after --duration "
		    "(or --bytes)" },
	{ "gbps", "room bytes completed in the window / window; 1 GB = 1e9 bytes" },
	{ "chunk_latency", "a room's last kvs_send to its SEND_DONE, seen by the sender: the "
			   "hand-off through the proxy (with 1-chunk rooms, one chunk's); under "
			   "load, so it includes queueing" },
	{ "room_latency", "kvs_recv_open to RECV_DONE, seen by the receiver: the whole room "
			  "(descriptor to the sender, its leases, fills and sends); under load" },
	{ "bound", "payload copy or verify: each byte is written into a slot and read out of "
		   "one, so with m = single-thread memcpy GB/s at this chunk size (over a --wset "
		   "ring of buffers each way, larger than the cache) and both copies on one core "
		   "the bound is 1 / (1/m + 1/m) = m/2; payload none: m itself" },
	{ "pipe", "payload copy: the same two copies by two processes placed like the clients, "
		  "through a shared memfd as large as the slots in flight, slot indices passed by "
		  "two raw rte_rings (no kvstage): what this host gives the copy path; the ratio "
		  "beside it is kvstage's share of that" },
	{ "chunks_ratio", "chunks/s over the raw rte_ring's batched records/s (out and back)" },
	{ "rooms_ratio", "rooms/s over the raw rte_ring's ping-pong round trips/s" },
	{ "latency_ratio", "each percentile over the same percentile of the raw rte_ring "
			   "ping-pong round trip" },
	{ "proxy_cpu", "utime + stime of the proxy from /proc/PID/stat over the window, as % "
		       "of one core" },
	{ "cpu_s_per_gb", "CPU seconds per GB moved, of the proxy and every sender and "
			  "receiver process, over the window" },
};

void local_doc_begin(struct doc *d, const struct bench_opts *o, unsigned n, const char *title)
{
	char a[16];
	d->o = o;
	d->npt = n;
	d->sections = true;
	d->col0 = "chunk";
	CAT(d->head, "kvstage-bench %s %s, %u rooms in flight per sender, payload %s, ",
	    KVS_VERSION_STRING, title, o->rooms, bench_payload_str(o->payload));
	if (o->bytes)
		CAT(d->head, "%s bytes per point\n", bench_size_str(o->bytes, a, sizeof(a)));
	else
		CAT(d->head, "%.2f s per point\n", o->duration);
}

void local_point_counts(struct point *p, const struct local_point *lp, const char *pool)
{
	char a[16], b[16];
	bench_size_str(lp->chunk, p->name, sizeof(p->name));
	snprintf(p->title, sizeof(p->title),
		 "chunk %s: rooms of %u chunks (%s bytes), %u slots %s, "
		 "%.2f s measured after %.2f s warm-up, %llu rooms",
		 bench_size_str(lp->chunk, a, 16), lp->room_chunks,
		 bench_size_str(lp->room_bytes, b, 16), lp->slots, pool, lp->seconds, lp->warmup_s,
		 (unsigned long long)lp->rooms);
	fig(p, NULL, NULL, U_SIZE, (double)lp->chunk, "chunk_bytes");
	fig(p, NULL, NULL, U_SIZE, (double)lp->room_bytes, "room_bytes");
	put_int(p, "room_chunks", lp->room_chunks);
	put_int(p, "slots", lp->slots);
	put_num(p, "warmup_s", lp->warmup_s);
	put_num(p, "seconds", lp->seconds);
	put_int(p, "bytes", lp->bytes);
	put_int(p, "chunks", lp->chunks);
	put_int(p, "rooms", lp->rooms);
	put_int(p, "errors", lp->errors);
}

void local_point_notes(const struct bench_opts *o, struct point *p, const struct local_point *lp)
{
	if (o->payload == PAYLOAD_VERIFY)
		CAT(p->notes, "  verified: %llu chunks, %llu with a wrong byte\n",
		    (unsigned long long)lp->chunks, (unsigned long long)lp->errors);
}

static void describe(const struct bench_opts *o, struct point *p, const struct local_point *lp,
		     const struct ring_base *ring)
{
	bool copy = o->payload == PAYLOAD_COPY,
	     one = o->payload == PAYLOAD_NONE || o->payload == PAYLOAD_IN;
	local_point_counts(p, lp, "in the pool");
	struct fig *f = fig(p, "GB/s", "GB/s", U_NUM, lp->gbps, "gbps");
	f->bcol = "bound";
	vs(p, f, lp->bound_gbps,
	   o->payload == PAYLOAD_NONE ? "memcpy (bytes untouched: 0 copies)"
	   : one		      ? "memcpy (copy in; read in place)"
				      : "memcpy / 2 (copy in + copy out, one core)",
	   "baseline.bound_gbps", "ratio.gbps_vs_bound");
	put_str(p, "baseline.bound", one ? "memcpy" : "memcpy/2");
	vs(p, fig(p, "", NULL, U_NUM, lp->gbps, NULL), lp->memcpy_gbps,
	   keep(p, "single-thread memcpy at %s", p->name), "baseline.memcpy_gbps",
	   "ratio.gbps_vs_memcpy");
	f = fig(p, copy ? "" : NULL, NULL, U_NUM, lp->gbps, NULL);
	f->bcol = copy ? "pipe" : NULL;
	vs(p, f, lp->pipe_gbps > 0 ? lp->pipe_gbps : -1, "same copies, 2 procs, raw rte_ring",
	   "baseline.pipe_gbps", "ratio.gbps_vs_pipe");
	vs(p, fig(p, "chunks/s", "chunks/s", U_RATE, lp->chunks_s, "chunks_per_s"),
	   ring ? ring->batch_rec_per_s : -1, "rte_ring records/s, bursts of 32",
	   "baseline.ring_batched_records_per_s",
	   "ratio.chunks_per_s_vs_ring_batched|chunks_vs_ring");
	vs(p, fig(p, "rooms/s", "rooms/s", U_RATE, lp->rooms_s, "rooms_per_s"),
	   ring ? ring->rt_per_s : -1, "rte_ring ping-pong round trips/s", "baseline.ring_rt_per_s",
	   "ratio.rooms_per_s_vs_ring_rt");
	vs_lat(p,
	       fig_lat(p, "chunk latency", "chunk p50/p99/p99.9 us", &lp->chunk_lat, PALL,
		       "chunk_latency_us", "chunk_%s_us"),
	       ring ? &ring->rtt : NULL, "rte_ring round trip", NULL, "ratio.chunk_%s_vs_ring_rtt");
	vs_lat(p,
	       fig_lat(p, "room latency", "room p50/p99/p99.9 us", &lp->room_lat, PALL,
		       "room_latency_us", "room_%s_us"),
	       ring ? &ring->rtt : NULL, "rte_ring round trip", NULL, "ratio.room_%s_vs_ring_rtt");
	fig(p, "proxy CPU (% of one core)", "CPU%", U_NUM, lp->proxy_cpu, "proxy_cpu_pct");
	fig(p, "clients CPU (% of one core)", NULL, U_NUM, lp->clients_cpu, "clients_cpu_pct");
	fig(p, "CPU s per GB, every process", NULL, U_NUM,
	    lp->proxy_cpu >= 0 && lp->clients_cpu >= 0 && lp->gbps > 0
		    ? (lp->proxy_cpu + lp->clients_cpu) / 100 / lp->gbps
		    : -1,
	    "cpu_s_per_gb");
	local_point_notes(o, p, lp);
}

static int report_local(const struct bench_opts *o, const struct local_point *pt, unsigned n,
			const struct ring_base *ring, const struct bench_proxy *px)
{
	char title[128];
	struct doc *d = doc_new(o, n);
	if (!d)
		return 1;
	struct point *pts = d->pt;
	snprintf(title, sizeof(title), "local: %u sender(s) x %u receiver(s)", o->senders,
		 o->receivers);
	local_doc_begin(d, o, n, title);
	doc_head(d, o, px, ", started per point with --slot-size = chunk size", true, ring);
	put_defs(d, local_defs, sizeof(local_defs) / sizeof(local_defs[0]));
	put(&d->top, "points", U_POINTS);
	d->csv = "mode,chunk_bytes,room_bytes,room_chunks,payload,pairs,rooms_in_flight,seconds,"
		 "bytes,chunks,rooms,errors,gbps,chunks_per_s,rooms_per_s,chunk_p50_us,"
		 "chunk_p99_us,chunk_p999_us,room_p50_us,room_p99_us,room_p999_us,proxy_cpu_pct,"
		 "memcpy_gbps,bound_gbps,gbps_vs_bound,ring_batched_records_per_s,"
		 "chunks_vs_ring,ring_rtt_p50_us,chunk_p50_vs_ring_rtt,pipe_gbps,gbps_vs_pipe,"
		 "clients_cpu_pct,cpu_s_per_gb";
	d->pt = pts;
	for (unsigned i = 0; i < n; i++)
		describe(o, &pts[i], &pt[i], ring);
	report(d);
	doc_free(d);
	if (!o->plot)
		return 0;
	uint64_t x[BENCH_MAX_CHUNKS];
	double kv[BENCH_MAX_CHUNKS], mc[BENCH_MAX_CHUNKS], bd[BENCH_MAX_CHUNKS],
		pp[BENCH_MAX_CHUNKS];
	for (unsigned i = 0; i < n; i++) {
		x[i] = pt[i].chunk;
		kv[i] = pt[i].gbps;
		mc[i] = pt[i].memcpy_gbps;
		bd[i] = pt[i].bound_gbps;
		pp[i] = pt[i].pipe_gbps;
	}
	char kname[64];
	snprintf(title, sizeof(title), "kvstage local, payload %s, %u pair(s), %u rooms in flight",
		 bench_payload_str(o->payload), o->senders, o->rooms);
	snprintf(kname, sizeof(kname), "kvstage local (payload %s)", bench_payload_str(o->payload));
	const double *cols[] = { kv, mc, bd, pp };
	const char *names[] = { kname, "memcpy, one thread",
				o->payload == PAYLOAD_NONE || o->payload == PAYLOAD_IN
					? "bound = memcpy"
					: "bound = memcpy/2 (copy in + out)",
				"same copies, 2 processes, raw rte_ring" };
	const char *styles[] = { "linespoints lw 2 pt 7", "lines dt 2 lw 2", "lines dt 3 lw 2",
				 "linespoints dt 4 lw 2 pt 6" };
	return plot(o, title, x, n, cols, names, styles, o->payload == PAYLOAD_COPY ? 4 : 3);
}

int run_local(const struct bench_opts *o)
{
	local_catch_signals();

	struct local_point *pts = calloc(o->nchunks, sizeof(*pts));
	struct ring_base ring;
	if (!pts)
		return 1;
	unsigned pairs = o->senders;
	int rc = 0;
	unsigned done = 0;

	struct bench_proxy px;
	uint64_t ext_chunk = 0;
	if (o->socket) {
		if ((rc = proxy_open(&px, o, o->chunks[0], 0))) {
			free(pts);
			return rc;
		}
		ext_chunk = px.slot_size;
	}

	note(o, "baseline: rte_ring round trips between two processes (%.2f s)", o->baseline_sec);
	if (baseline_ring(o->baseline_sec, &ring) < 0)
		note(o, "baseline: the rte_ring measurement failed; its ratios are n/a");
	/* From here on this process and every client it forks stay off the
	 * proxy's CPU; so does the memcpy baseline, where the copies run. */
	pin_clients();

	for (unsigned i = 0; i < o->nchunks && !rc && !interrupted; i++) {
		uint64_t chunk = o->socket ? ext_chunk : o->chunks[i];
		struct local_point *pt = &pts[i];
		pt->chunk = chunk;
		pt->room_bytes = bench_room_bytes(o, chunk);
		pt->room_chunks = bench_room_chunks(o, chunk);
		uint64_t need = (uint64_t)pairs * o->rooms * pt->room_chunks;
		char cs[16];
		bench_size_str(chunk, cs, sizeof(cs));

		note(o, "baseline: memcpy of %s chunks over %s each way (%.2f s)", cs,
		     bench_size_str(o->wset, (char[16]){ 0 }, 16), o->baseline_sec);
		pt->memcpy_gbps = baseline_memcpy(chunk, o->wset, o->baseline_sec);
		if (pt->memcpy_gbps <= 0) {
			fprintf(stderr,
				"kvstage-bench: cannot allocate the memcpy baseline's 2 x %llu "
				"bytes (--wset)\n",
				(unsigned long long)o->wset);
			rc = 1;
			break;
		}
		/* Copy in and copy out, one after the other on one core:
		 * 1 / (1/m + 1/m) = m/2. */
		/* in: one copy, m. none: nothing is copied; m is shown for scale. */
		pt->bound_gbps = o->payload == PAYLOAD_NONE || o->payload == PAYLOAD_IN
					 ? pt->memcpy_gbps
					 : pt->memcpy_gbps / 2;
		baseline_fini(); /* give its 2 x wset back before the clients take theirs */
		if (o->payload == PAYLOAD_COPY) {
			note(o,
			     "baseline: the same two copies through shared memory by two "
			     "processes, "
			     "raw rte_rings instead of kvstage (%.2f s)",
			     o->baseline_sec);
			pt->pipe_gbps =
				baseline_pipe(chunk, need * chunk, o->wset, o->baseline_sec);
			if (pt->pipe_gbps <= 0)
				note(o, "baseline: the copy pipe failed; its ratio is n/a");
		}

		if (o->socket) {
			if (px.slots < need) {
				fprintf(stderr,
					"kvstage-bench: the proxy at %s has %u slots; %u pairs x "
					"%u rooms x %u chunks need %llu: lower --rooms, "
					"--senders or --room-bytes\n",
					o->socket, px.slots, pairs, o->rooms, pt->room_chunks,
					(unsigned long long)need);
				rc = 2;
				break;
			}
			pt->slots = px.slots;
			note(o, "local %s: %u pair(s) through the proxy at %s", cs, pairs,
			     o->socket);
			struct bench_ends e = { o->socket, o->socket, px.cpu_pid, px.cpu_pid,
						false };
			rc = local_measure(o, &e, chunk, pt);
		} else {
			uint32_t slots = proxy_slots_for(chunk, need);
			if ((uint64_t)slots * chunk > (64ull << 30)) {
				fprintf(stderr,
					"kvstage-bench: %u x %s would need a %llu GiB pool: "
					"lower --rooms, --senders or --room-bytes\n",
					slots, cs,
					(unsigned long long)((uint64_t)slots * chunk >> 30));
				rc = 2;
				break;
			}
			if (proxy_start(&px, o, chunk, slots) < 0) {
				rc = 1;
				break;
			}
			if (proxy_fits(&px, chunk, need) < 0) {
				proxy_stop(&px);
				rc = 2;
				break;
			}
			pt->slots = px.slots;
			note(o,
			     "local %s: kvstaged pid %d, %u slots; %u pair(s), %u rooms x %u "
			     "chunks, "
			     "payload %s",
			     cs, (int)px.pid, px.slots, pairs, o->rooms, pt->room_chunks,
			     bench_payload_str(o->payload));
			struct bench_ends e = { px.sock, px.sock, px.cpu_pid, px.cpu_pid, false };
			rc = local_measure(o, &e, chunk, pt);
			proxy_stop(&px);
		}
		if (!rc)
			done++;
	}
	baseline_fini();
	pin_all();
	if (interrupted)
		rc = 130;
	if (done) {
		int prc = report_local(o, pts, done, ring.done ? &ring : NULL, &px);
		if (!rc)
			rc = prc;
	}
	free(pts);
	return rc;
}
