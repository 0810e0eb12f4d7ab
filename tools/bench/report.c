/* SPDX-License-Identifier: MIT */
/* What each mode reports: the table (people), JSON and CSV (machines), the
 * plot; the machinery is in output.c. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <unistd.h>

#include "kvstage.h"
#include "output.h"

static const char *mode_word(enum bench_mode m)
{
	switch (m) {
	case MODE_LOCAL: return "local";
	case MODE_LATENCY: return "latency";
	case MODE_IDLE: return "idle";
	case MODE_BASELINE: return "baseline";
	case MODE_TCP: return "tcp";
	case MODE_VERBS: return "verbs";
	default: return "gpu";
	}
}

void json_head(struct jw *j, const struct bench_opts *o)
{
	j->f = stdout;
	j->depth = 0;
	j->first[0] = true;
	jw_open(j, NULL, '{');
	jw_str(j, "tool", "kvstage-bench");
	jw_str(j, "version", KVS_VERSION_STRING);
	jw_str(j, "mode", mode_word(o->mode));
	jw_open(j, "command", '[');
	for (int i = 0; i < o->argc; i++)
		jw_str(j, NULL, o->argv[i]);
	jw_close(j, ']');
	char cpu[256];
	cpu_model(cpu, sizeof(cpu));
	struct utsname u;
	uname(&u);
	jw_open(j, "machine", '{');
	jw_int(j, "nproc", (uint64_t)sysconf(_SC_NPROCESSORS_ONLN));
	jw_str(j, "cpu", cpu);
	jw_str(j, "kernel", u.release);
	jw_num_na(j, "loadavg_1m", loadavg());
	char pd[192];
	jw_str(j, "placement", pin_desc(pd, sizeof(pd)));
	jw_close(j, '}');
	jw_open(j, "config", '{');
	jw_int(j, "senders", o->senders);
	jw_int(j, "receivers", o->receivers);
	jw_int(j, "rooms", o->rooms);
	jw_str(j, "payload", bench_payload_str(o->payload));
	jw_num(j, "duration_s", o->bytes ? NAN : o->duration);
	jw_int(j, "bytes", o->bytes);
	jw_num(j, "warmup_s", o->warmup);
	jw_num(j, "baseline_s", o->baseline_sec);
	jw_int(j, "wset_bytes", o->wset);
	jw_close(j, '}');
}

void json_proxy(struct jw *j, const struct bench_proxy_info *px)
{
	jw_open(j, "proxy", '{');
	jw_bool(j, "external", px->external);
	jw_str(j, "bin", px->bin);
	jw_open(j, "extra_args", '[');
	for (unsigned i = 0; i < px->nargs; i++)
		jw_str(j, NULL, px->args[i]);
	jw_close(j, ']');
	if (px->external)
		jw_str(j, "socket", px->sock);
	jw_close(j, '}');
}

static void json_ring(struct jw *j, const struct ring_base *ring)
{
	if (!ring) {
		jw_sep(j, "ring");
		fputs("null", j->f);
		return;
	}
	jw_open(j, "ring", '{');
	jw_str(j, "what", "raw SPSC rte_ring between two processes, 32-byte records");
	jw_num(j, "pingpong_rt_per_s", ring->rt_per_s);
	jw_lat(j, "pingpong_rtt_us", &ring->rtt);
	jw_num(j, "batched_records_per_s", ring->batch_rec_per_s);
	jw_close(j, '}');
}

/* The head every mode's JSON starts with: command, machine, proxy, the ring baseline. */
static void json_start(struct jw *j, const struct bench_opts *o, const struct bench_proxy_info *px,
		       const struct ring_base *ring)
{
	json_head(j, o);
	json_proxy(j, px);
	jw_open(j, "baselines", '{');
	json_ring(j, ring);
	jw_close(j, '}');
}

void json_end(struct jw *j)
{
	jw_close(j, '}');
	fputc('\n', j->f);
}

/* One table row: figure, kvstage value, baseline value and what it is, ratio. */
void row(const char *what, const char *kv, double base, const char *base_txt,
		const char *base_what, double r)
{
	char b[32], rb[32];
	if (base_txt)
		snprintf(b, sizeof(b), "%s", base_txt);
	else if (isnan(base))
		snprintf(b, sizeof(b), "-");
	else
		num(base, b, sizeof(b));
	if (isnan(r))
		snprintf(rb, sizeof(rb), "-");
	else
		num(r, rb, sizeof(rb));
	printf("  %-28s %12s %12s  %-42s %8s\n", what, kv, b, base_what ? base_what : "", rb);
}

void row_head(void)
{
	printf("  %-28s %12s %12s  %-42s %8s\n", "", "kvstage", "baseline", "(baseline is)",
	       "ratio");
}

static void row_lat3(const char *what, const struct lat *l, const struct ring_base *ring)
{
	const double *v[3] = { &l->p50, &l->p99, &l->p999 };
	const char *pn[3] = { "p50", "p99", "p99.9" };
	for (int i = 0; i < 3; i++) {
		char name[64], kv[32], bw[48];
		snprintf(name, sizeof(name), "%s %s (us)", what, pn[i]);
		if (l->n)
			num(*v[i], kv, sizeof(kv));
		else
			snprintf(kv, sizeof(kv), "n/a");
		double base = NAN;
		if (ring) {
			const double *rv[3] = { &ring->rtt.p50, &ring->rtt.p99, &ring->rtt.p999 };
			base = *rv[i];
		}
		snprintf(bw, sizeof(bw), "rte_ring round trip %s", pn[i]);
		row(name, kv, base, NULL, bw, l->n ? ratio(*v[i], base) : NAN);
	}
}

static void print_ring(const struct ring_base *ring)
{
	char a[32], b[32];
	if (!ring) {
		printf("baseline rte_ring: n/a (the measurement failed)\n");
		return;
	}
	printf("baseline rte_ring (two processes, SPSC, 32-byte records): ping-pong %s round "
	       "trips/s, RTT p50/p99/p99.9 %.2f/%.2f/%.2f us; bursts of 32: %s records/s out "
	       "and back\n",
	       human(ring->rt_per_s, a, sizeof(a)), ring->rtt.p50, ring->rtt.p99, ring->rtt.p999,
	       human(ring->batch_rec_per_s, b, sizeof(b)));
}

void print_proxy(const struct bench_proxy_info *px, const char *how)
{
	if (px->external) {
		printf("proxy: the running one at %s (%s)\n", px->sock, px->bin);
		return;
	}
	printf("proxy: %s%s", px->bin, how);
	for (unsigned i = 0; i < px->nargs; i++)
		printf("%s %s", i ? "" : "; extra arguments:", px->args[i]);
	printf("\n");
}

void print_machine(void)
{
	char cpu[256];
	cpu_model(cpu, sizeof(cpu));
	char pd[192];
	printf("machine: %s, %ld CPUs, load %.2f; %s\n", cpu, sysconf(_SC_NPROCESSORS_ONLN),
	       loadavg(), pin_desc(pd, sizeof(pd)));
}

/* --------------------------------------------------------------- local */

static const char *bound_what(enum bench_payload p)
{
	return p == PAYLOAD_NONE ? "memcpy (bytes untouched: 0 copies)"
	       : p == PAYLOAD_IN ? "memcpy (copy in; read in place)"
				 : "memcpy / 2 (copy in + copy out, one core)";
}

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
};

static void local_table(const struct bench_opts *o, const struct local_point *pt, unsigned n,
			const struct ring_base *ring, const struct bench_proxy_info *px)
{
	char a[32], b[32], c[32];
	printf("kvstage-bench %s local: %u sender(s) x %u receiver(s), %u rooms in flight per "
	       "sender, payload %s, ",
	       KVS_VERSION_STRING, o->senders, o->receivers, o->rooms, bench_payload_str(o->payload));
	if (o->bytes)
		printf("%s bytes per point\n", bench_size_str(o->bytes, a, sizeof(a)));
	else
		printf("%.2f s per point\n", o->duration);
	print_machine();
	print_proxy(px, ", started per point with --slot-size = chunk size");
	print_ring(ring);
	for (unsigned i = 0; i < n; i++) {
		const struct local_point *p = &pt[i];
		printf("\n== chunk %s: rooms of %u chunks (%s bytes), pool %u slots, %.2f s "
		       "measured after %.2f s warm-up, %llu rooms\n",
		       bench_size_str(p->chunk, a, sizeof(a)), p->room_chunks,
		       bench_size_str(p->room_bytes, b, sizeof(b)), p->slots, p->seconds,
		       p->warmup_s, (unsigned long long)p->rooms);
		row_head();
		char bw[64];
		snprintf(bw, sizeof(bw), "%s", bound_what(o->payload));
		row("GB/s", num(p->gbps, a, sizeof(a)), p->bound_gbps, NULL, bw,
		    ratio(p->gbps, p->bound_gbps));
		snprintf(bw, sizeof(bw), "single-thread memcpy at %s", bench_size_str(p->chunk, c, sizeof(c)));
		row("", "", p->memcpy_gbps, NULL, bw, NAN);
		if (o->payload == PAYLOAD_COPY)
			row("", "", p->pipe_gbps > 0 ? p->pipe_gbps : NAN, p->pipe_gbps > 0 ? NULL : "n/a",
			    "same copies, 2 procs, raw rte_ring", ratio(p->gbps, p->pipe_gbps));
		row("chunks/s", human(p->chunks_s, a, sizeof(a)), NAN,
		    ring ? human(ring->batch_rec_per_s, b, sizeof(b)) : "n/a",
		    "rte_ring records/s, bursts of 32", ring ? ratio(p->chunks_s, ring->batch_rec_per_s) : NAN);
		row("rooms/s", human(p->rooms_s, a, sizeof(a)), NAN,
		    ring ? human(ring->rt_per_s, b, sizeof(b)) : "n/a", "rte_ring ping-pong round trips/s",
		    ring ? ratio(p->rooms_s, ring->rt_per_s) : NAN);
		row_lat3("chunk latency", &p->chunk_lat, ring);
		row_lat3("room latency", &p->room_lat, ring);
		row("proxy CPU (% of one core)", num(p->proxy_cpu, a, sizeof(a)), NAN, NULL, NULL, NAN);
		if (o->payload == PAYLOAD_VERIFY)
			printf("  verified: %llu chunks, %llu with a wrong byte\n",
			       (unsigned long long)p->chunks, (unsigned long long)p->errors);
	}
	if (n > 1) {
		printf("\n%-6s %8s %8s %6s %8s %6s %10s %10s %21s %21s %6s\n", "chunk", "GB/s",
		       "bound", "ratio", "pipe", "ratio", "chunks/s", "rooms/s", "chunk p50/p99/p99.9",
		       "room p50/p99/p99.9", "CPU%");
		for (unsigned i = 0; i < n; i++) {
			const struct local_point *p = &pt[i];
			char cl[32], rl[32], r[16], cp[16], pg[16], pr[16];
			snprintf(cl, sizeof(cl), "%.1f/%.1f/%.1f", p->chunk_lat.p50, p->chunk_lat.p99,
				 p->chunk_lat.p999);
			snprintf(rl, sizeof(rl), "%.1f/%.1f/%.1f", p->room_lat.p50, p->room_lat.p99,
				 p->room_lat.p999);
			snprintf(pg, sizeof(pg), "-");
			snprintf(pr, sizeof(pr), "-");
			if (p->pipe_gbps > 0) {
				snprintf(pg, sizeof(pg), "%.3f", p->pipe_gbps);
				num(ratio(p->gbps, p->pipe_gbps), pr, sizeof(pr));
			}
			printf("%-6s %8.3f %8.3f %6s %8s %6s %10s %10s %21s %21s %6s\n",
			       bench_size_str(p->chunk, a, sizeof(a)), p->gbps, p->bound_gbps,
			       num(ratio(p->gbps, p->bound_gbps), r, sizeof(r)), pg, pr,
			       human(p->chunks_s, b, sizeof(b)), human(p->rooms_s, c, sizeof(c)), cl,
			       rl, num(p->proxy_cpu, cp, sizeof(cp)));
		}
		printf("(latencies in us)\n");
	}
	printf("\nHow to read it:\n");
	for (size_t i = 0; i < sizeof(local_defs) / sizeof(local_defs[0]); i++)
		printf("  %s: %s.\n", local_defs[i][0], local_defs[i][1]);
}

void json_point_counts(struct jw *j, const struct local_point *p)
{
	jw_int(j, "chunk_bytes", p->chunk);
	jw_int(j, "room_bytes", p->room_bytes);
	jw_int(j, "room_chunks", p->room_chunks);
	jw_int(j, "slots", p->slots);
	jw_num(j, "warmup_s", p->warmup_s);
	jw_num(j, "seconds", p->seconds);
	jw_int(j, "bytes", p->bytes);
	jw_int(j, "chunks", p->chunks);
	jw_int(j, "rooms", p->rooms);
	jw_int(j, "errors", p->errors);
	jw_num(j, "gbps", p->gbps);
	jw_num(j, "chunks_per_s", p->chunks_s);
}

void csv_point_counts(const struct local_point *p)
{
	csv_num(p->seconds, false);
	printf("%llu,%llu,%llu,%llu,", (unsigned long long)p->bytes, (unsigned long long)p->chunks,
	       (unsigned long long)p->rooms, (unsigned long long)p->errors);
	csv_num(p->gbps, false);
	csv_num(p->chunks_s, false);
}

static void local_json(const struct bench_opts *o, const struct local_point *pt, unsigned n,
		       const struct ring_base *ring, const struct bench_proxy_info *px)
{
	struct jw j;
	json_start(&j, o, px, ring);
	jw_open(&j, "definitions", '{');
	for (size_t i = 0; i < sizeof(local_defs) / sizeof(local_defs[0]); i++)
		jw_str(&j, local_defs[i][0], local_defs[i][1]);
	jw_close(&j, '}');
	jw_open(&j, "points", '[');
	for (unsigned i = 0; i < n; i++) {
		const struct local_point *p = &pt[i];
		jw_open(&j, NULL, '{');
		json_point_counts(&j, p);
		jw_num(&j, "rooms_per_s", p->rooms_s);
		jw_lat(&j, "chunk_latency_us", &p->chunk_lat);
		jw_lat(&j, "room_latency_us", &p->room_lat);
		jw_num_na(&j, "proxy_cpu_pct", p->proxy_cpu);
		jw_open(&j, "baseline", '{');
		jw_num(&j, "memcpy_gbps", p->memcpy_gbps);
		jw_num(&j, "bound_gbps", p->bound_gbps);
		jw_str(&j, "bound", o->payload == PAYLOAD_NONE || o->payload == PAYLOAD_IN ? "memcpy" : "memcpy/2");
		jw_num(&j, "pipe_gbps", p->pipe_gbps > 0 ? p->pipe_gbps : NAN);
		jw_num(&j, "ring_batched_records_per_s", ring ? ring->batch_rec_per_s : NAN);
		jw_num(&j, "ring_rt_per_s", ring ? ring->rt_per_s : NAN);
		jw_close(&j, '}');
		jw_open(&j, "ratio", '{');
		jw_num(&j, "gbps_vs_bound", ratio(p->gbps, p->bound_gbps));
		jw_num(&j, "gbps_vs_memcpy", ratio(p->gbps, p->memcpy_gbps));
		jw_num(&j, "gbps_vs_pipe", ratio(p->gbps, p->pipe_gbps));
		jw_num(&j, "chunks_per_s_vs_ring_batched",
		       ring ? ratio(p->chunks_s, ring->batch_rec_per_s) : NAN);
		jw_num(&j, "rooms_per_s_vs_ring_rt", ring ? ratio(p->rooms_s, ring->rt_per_s) : NAN);
		bool cl = p->chunk_lat.n && ring, rl = p->room_lat.n && ring;
		jw_num(&j, "chunk_p50_vs_ring_rtt", cl ? ratio(p->chunk_lat.p50, ring->rtt.p50) : NAN);
		jw_num(&j, "chunk_p99_vs_ring_rtt", cl ? ratio(p->chunk_lat.p99, ring->rtt.p99) : NAN);
		jw_num(&j, "chunk_p999_vs_ring_rtt",
		       cl ? ratio(p->chunk_lat.p999, ring->rtt.p999) : NAN);
		jw_num(&j, "room_p50_vs_ring_rtt", rl ? ratio(p->room_lat.p50, ring->rtt.p50) : NAN);
		jw_num(&j, "room_p99_vs_ring_rtt", rl ? ratio(p->room_lat.p99, ring->rtt.p99) : NAN);
		jw_num(&j, "room_p999_vs_ring_rtt", rl ? ratio(p->room_lat.p999, ring->rtt.p999) : NAN);
		jw_close(&j, '}');
		jw_close(&j, '}');
	}
	jw_close(&j, ']');
	json_end(&j);
}

static void local_csv(const struct bench_opts *o, const struct local_point *pt, unsigned n,
		      const struct ring_base *ring)
{
	printf("mode,chunk_bytes,room_bytes,room_chunks,payload,pairs,rooms_in_flight,seconds,"
	       "bytes,chunks,rooms,errors,gbps,chunks_per_s,rooms_per_s,chunk_p50_us,"
	       "chunk_p99_us,chunk_p999_us,room_p50_us,room_p99_us,room_p999_us,proxy_cpu_pct,"
	       "memcpy_gbps,bound_gbps,gbps_vs_bound,ring_batched_records_per_s,"
	       "chunks_vs_ring,ring_rtt_p50_us,chunk_p50_vs_ring_rtt,pipe_gbps,gbps_vs_pipe\n");
	for (unsigned i = 0; i < n; i++) {
		const struct local_point *p = &pt[i];
		printf("local,%llu,%llu,%u,%s,%u,%u,", (unsigned long long)p->chunk,
		       (unsigned long long)p->room_bytes, p->room_chunks,
		       bench_payload_str(o->payload), o->senders, o->rooms);
		csv_point_counts(p);
		csv_num(p->rooms_s, false);
		csv_num(p->chunk_lat.n ? p->chunk_lat.p50 : NAN, false);
		csv_num(p->chunk_lat.n ? p->chunk_lat.p99 : NAN, false);
		csv_num(p->chunk_lat.n ? p->chunk_lat.p999 : NAN, false);
		csv_num(p->room_lat.n ? p->room_lat.p50 : NAN, false);
		csv_num(p->room_lat.n ? p->room_lat.p99 : NAN, false);
		csv_num(p->room_lat.n ? p->room_lat.p999 : NAN, false);
		csv_num(p->proxy_cpu, false);
		csv_num(p->memcpy_gbps, false);
		csv_num(p->bound_gbps, false);
		csv_num(ratio(p->gbps, p->bound_gbps), false);
		csv_num(ring ? ring->batch_rec_per_s : NAN, false);
		csv_num(ring ? ratio(p->chunks_s, ring->batch_rec_per_s) : NAN, false);
		csv_num(ring ? ring->rtt.p50 : NAN, false);
		csv_num(ring && p->chunk_lat.n ? ratio(p->chunk_lat.p50, ring->rtt.p50) : NAN, false);
		csv_num(p->pipe_gbps > 0 ? p->pipe_gbps : NAN, false);
		csv_num(ratio(p->gbps, p->pipe_gbps), true);
	}
}

int report_local(const struct bench_opts *o, const struct local_point *pt, unsigned n,
		 const struct ring_base *ring, const struct bench_proxy_info *px)
{
	if (o->fmt == FMT_JSON)
		local_json(o, pt, n, ring, px);
	else if (o->fmt == FMT_CSV)
		local_csv(o, pt, n, ring);
	else
		local_table(o, pt, n, ring, px);
	fflush(stdout);
	if (!o->plot)
		return 0;
	uint64_t *x = calloc(n, sizeof(*x));
	double *kv = calloc(n, sizeof(double)), *mc = calloc(n, sizeof(double)),
	       *bd = calloc(n, sizeof(double)), *pp = calloc(n, sizeof(double));
	int rc = 1;
	if (x && kv && mc && bd && pp) {
		for (unsigned i = 0; i < n; i++) {
			x[i] = pt[i].chunk;
			kv[i] = pt[i].gbps;
			mc[i] = pt[i].memcpy_gbps;
			bd[i] = pt[i].bound_gbps;
		}
		char title[160], kname[64];
		snprintf(title, sizeof(title), "kvstage local, payload %s, %u pair(s), %u rooms in flight",
			 bench_payload_str(o->payload), o->senders, o->rooms);
		snprintf(kname, sizeof(kname), "kvstage local (payload %s)",
			 bench_payload_str(o->payload));
		for (unsigned i = 0; i < n; i++)
			pp[i] = pt[i].pipe_gbps;
		const double *cols[] = { kv, mc, bd, pp };
		const char *names[] = { kname, "memcpy, one thread",
					o->payload == PAYLOAD_NONE || o->payload == PAYLOAD_IN ? "bound = memcpy"
								   : "bound = memcpy/2 (copy in + out)",
					"same copies, 2 processes, raw rte_ring" };
		const char *styles[] = { "linespoints lw 2 pt 7", "lines dt 2 lw 2", "lines dt 3 lw 2",
					 "linespoints dt 4 lw 2 pt 6" };
		rc = plot(o, title, x, n, cols, names, styles, o->payload == PAYLOAD_COPY ? 4 : 3);
	}
	free(x);
	free(kv);
	free(mc);
	free(bd);
	free(pp);
	return rc;
}

/* ------------------------------------------------------------- latency */

void report_latency(const struct bench_opts *o, const struct latency_result *r,
		    const struct ring_base *ring, const struct bench_proxy_info *px)
{
	if (o->fmt == FMT_JSON) {
		struct jw j;
		json_start(&j, o, px, ring);
		jw_open(&j, "result", '{');
		jw_int(&j, "chunk_bytes", r->chunk);
		jw_num(&j, "seconds", r->seconds);
		jw_int(&j, "handoffs", r->iters);
		jw_num(&j, "handoffs_per_s", r->handoffs_s);
		jw_lat(&j, "chunk_latency_us", &r->chunk_lat);
		jw_lat(&j, "room_latency_us", &r->room_lat);
		jw_lat(&j, "acquire_latency_us", &r->sync_lat);
		jw_num_na(&j, "proxy_cpu_pct", r->proxy_cpu);
		jw_open(&j, "ratio", '{');
		jw_num(&j, "handoffs_per_s_vs_ring_rt", ring ? ratio(r->handoffs_s, ring->rt_per_s) : NAN);
		jw_num(&j, "chunk_p50_vs_ring_rtt", ring ? ratio(r->chunk_lat.p50, ring->rtt.p50) : NAN);
		jw_num(&j, "chunk_p99_vs_ring_rtt", ring ? ratio(r->chunk_lat.p99, ring->rtt.p99) : NAN);
		jw_num(&j, "chunk_p999_vs_ring_rtt",
		       ring ? ratio(r->chunk_lat.p999, ring->rtt.p999) : NAN);
		jw_close(&j, '}');
		jw_close(&j, '}');
		jw_open(&j, "definitions", '{');
		jw_str(&j, "chunk_latency", "kvs_send to RECV_DONE seen by the receiver (one busy-polling "
					    "process holds both connections)");
		jw_str(&j, "room_latency", "kvs_recv_open to RECV_DONE: recv_open, send_open and acquire "
					   "round trips, then the hand-off");
		jw_str(&j, "acquire_latency", "one kvs_acquire(1) round trip (a sync op)");
		jw_close(&j, '}');
		json_end(&j);
		return;
	}
	if (o->fmt == FMT_CSV) {
		printf("mode,chunk_bytes,payload,seconds,handoffs,handoffs_per_s,chunk_p50_us,"
		       "chunk_p99_us,chunk_p999_us,room_p50_us,room_p99_us,room_p999_us,"
		       "acquire_p50_us,acquire_p99_us,acquire_p999_us,proxy_cpu_pct,ring_rt_per_s,"
		       "ring_rtt_p50_us,ring_rtt_p99_us,ring_rtt_p999_us\n");
		printf("latency,%llu,%s,", (unsigned long long)r->chunk, bench_payload_str(o->payload));
		csv_num(r->seconds, false);
		printf("%llu,", (unsigned long long)r->iters);
		csv_num(r->handoffs_s, false);
		const struct lat *ls[] = { &r->chunk_lat, &r->room_lat, &r->sync_lat };
		for (int i = 0; i < 3; i++) {
			csv_num(ls[i]->p50, false);
			csv_num(ls[i]->p99, false);
			csv_num(ls[i]->p999, false);
		}
		csv_num(r->proxy_cpu, false);
		csv_num(ring ? ring->rt_per_s : NAN, false);
		csv_num(ring ? ring->rtt.p50 : NAN, false);
		csv_num(ring ? ring->rtt.p99 : NAN, false);
		csv_num(ring ? ring->rtt.p999 : NAN, true);
		return;
	}
	char a[32], b[32];
	printf("kvstage-bench %s latency: one %s chunk in flight, payload %s, %.2f s, %llu "
	       "hand-offs (one busy-polling client process)\n",
	       KVS_VERSION_STRING, bench_size_str(r->chunk, a, sizeof(a)),
	       bench_payload_str(o->payload), r->seconds, (unsigned long long)r->iters);
	print_machine();
	print_proxy(px, "");
	print_ring(ring);
	printf("\n");
	row_head();
	row("hand-offs/s (1 in flight)", human(r->handoffs_s, a, sizeof(a)), NAN,
	    ring ? human(ring->rt_per_s, b, sizeof(b)) : "n/a", "rte_ring ping-pong round trips/s",
	    ring ? ratio(r->handoffs_s, ring->rt_per_s) : NAN);
	row_lat3("chunk latency", &r->chunk_lat, ring);
	row_lat3("room latency", &r->room_lat, ring);
	row_lat3("kvs_acquire", &r->sync_lat, ring);
	row("proxy CPU (% of one core)", num(r->proxy_cpu, a, sizeof(a)), NAN, NULL, NULL, NAN);
	printf("\nHow to read it:\n"
	       "  chunk latency: kvs_send to RECV_DONE seen by the receiver: one submission, one\n"
	       "    proxy pass, one completion; its baseline is one raw rte_ring round trip\n"
	       "    between two processes (the same two ring hops, with nothing in between).\n"
	       "  room latency: kvs_recv_open to RECV_DONE (three sync round trips, then the\n"
	       "    hand-off). kvs_acquire: one sync op round trip.\n");
}

/* ---------------------------------------------------------------- idle */

void report_idle(const struct bench_opts *o, const struct idle_result *r,
		 const struct bench_proxy_info *px)
{
	if (o->fmt == FMT_JSON) {
		struct jw j;
		json_head(&j, o);
		json_proxy(&j, px);
		jw_open(&j, "result", '{');
		jw_num(&j, "window_s", r->window_s);
		jw_num_na(&j, "proxy_cpu_pct", r->proxy_cpu);
		jw_int(&j, "proxy_sleeps", r->proxy_sleeps);
		jw_num_na(&j, "waiting_client_cpu_pct", r->client_cpu);
		jw_int(&j, "samples", r->samples);
		jw_int(&j, "samples_not_asleep", r->not_asleep);
		jw_num(&j, "gap_ms", r->gap_ms);
		jw_lat(&j, "wake_latency_us", &r->wake);
		jw_lat(&j, "warm_latency_us", &r->warm);
		jw_lat(&j, "eventfd_wake_rtt_us", &r->efd);
		jw_open(&j, "ratio", '{');
		jw_num(&j, "wake_p50_vs_eventfd", ratio(r->wake.p50, r->efd.n ? r->efd.p50 : NAN));
		jw_num(&j, "wake_p99_vs_eventfd", ratio(r->wake.p99, r->efd.n ? r->efd.p99 : NAN));
		jw_num(&j, "wake_p999_vs_eventfd", ratio(r->wake.p999, r->efd.n ? r->efd.p999 : NAN));
		jw_num(&j, "wake_p50_vs_warm", ratio(r->wake.p50, r->warm.p50));
		jw_num(&j, "wake_p99_vs_warm", ratio(r->wake.p99, r->warm.p99));
		jw_num(&j, "wake_p999_vs_warm", ratio(r->wake.p999, r->warm.p999));
		jw_close(&j, '}');
		jw_close(&j, '}');
		jw_open(&j, "definitions", '{');
		jw_str(&j, "wake_latency", "a kvs_acquire(1) round trip issued after gap_ms with no "
					   "requests, once the proxy says it sleeps");
		jw_str(&j, "warm_latency", "the same round trip back to back (the proxy polling)");
		jw_str(&j, "eventfd_wake_rtt", "baseline: an eventfd round trip between two processes "
					       "that both block (placed like the proxy and the "
					       "client), after the same gap: two wake-ups, the "
					       "kernel's floor for this path");
		jw_close(&j, '}');
		json_end(&j);
		return;
	}
	if (o->fmt == FMT_CSV) {
		printf("mode,window_s,proxy_cpu_pct,proxy_sleeps,waiting_client_cpu_pct,samples,"
		       "samples_not_asleep,gap_ms,wake_p50_us,wake_p99_us,wake_p999_us,warm_p50_us,"
		       "warm_p99_us,warm_p999_us,eventfd_p50_us,eventfd_p99_us,eventfd_p999_us\n");
		printf("idle,");
		csv_num(r->window_s, false);
		csv_num(r->proxy_cpu, false);
		printf("%llu,", (unsigned long long)r->proxy_sleeps);
		csv_num(r->client_cpu, false);
		printf("%u,%u,", r->samples, r->not_asleep);
		csv_num(r->gap_ms, false);
		csv_num(r->wake.p50, false);
		csv_num(r->wake.p99, false);
		csv_num(r->wake.p999, false);
		csv_num(r->warm.p50, false);
		csv_num(r->warm.p99, false);
		csv_num(r->warm.p999, false);
		csv_num(r->efd.n ? r->efd.p50 : NAN, false);
		csv_num(r->efd.n ? r->efd.p99 : NAN, false);
		csv_num(r->efd.n ? r->efd.p999 : NAN, true);
		return;
	}
	char a[32];
	printf("kvstage-bench %s idle: %.2f s with no work, then %u wake-up samples %.1f ms apart\n",
	       KVS_VERSION_STRING, r->window_s, r->samples, r->gap_ms);
	print_machine();
	print_proxy(px, "");
	printf("\n");
	row_head();
	row("proxy CPU (% of one core)", num(r->proxy_cpu, a, sizeof(a)), NAN, NULL,
	    "(no baseline: lower is better)", NAN);
	char s[32];
	snprintf(s, sizeof(s), "%llu", (unsigned long long)r->proxy_sleeps);
	row("times it went to sleep", s, NAN, NULL, "(0: it slept through the window)", NAN);
	row("kvs_wait client CPU (%)", num(r->client_cpu, a, sizeof(a)), NAN, NULL,
	    "(a client blocked in kvs_wait)", NAN);
	const double *w[3] = { &r->wake.p50, &r->wake.p99, &r->wake.p999 };
	const double *h[3] = { &r->warm.p50, &r->warm.p99, &r->warm.p999 };
	const double *e[3] = { &r->efd.p50, &r->efd.p99, &r->efd.p999 };
	const char *pn[3] = { "p50", "p99", "p99.9" };
	for (int i = 0; i < 3; i++) {
		char name[48], bw[48];
		double base = r->efd.n ? *e[i] : NAN;
		snprintf(name, sizeof(name), "wake-up latency %s (us)", pn[i]);
		snprintf(bw, sizeof(bw), "eventfd round trip, both asleep, %s", pn[i]);
		row(name, num(*w[i], a, sizeof(a)), base, NULL, bw, ratio(*w[i], base));
	}
	for (int i = 0; i < 3; i++) {
		char name[48], bw[48];
		snprintf(name, sizeof(name), "awake latency %s (us)", pn[i]);
		snprintf(bw, sizeof(bw), "(the same request, back to back)");
		row(name, num(*h[i], a, sizeof(a)), NAN, NULL, bw, NAN);
	}
	if (r->not_asleep)
		printf("  %u of %u samples found the proxy not asleep after the gap (its flag)\n",
		       r->not_asleep, r->samples);
	printf("\nHow to read it:\n"
	       "  proxy CPU: utime + stime from /proc/PID/stat over the idle window.\n"
	       "  wake-up latency: a kvs_acquire(1) round trip issued after the gap, once the\n"
	       "    proxy's control segment says it sleeps. Its baseline: an eventfd round trip\n"
	       "    between two processes that both block, placed like the proxy and the client,\n"
	       "    after the same gap (two wake-ups: the kernel's floor for this path).\n"
	       "  awake latency: the same kvs_acquire(1) issued back to back, the proxy polling.\n");
}

/* ------------------------------------------------------------ baseline */

int report_baseline(const struct bench_opts *o, const struct baseline_point *pt, unsigned n,
		    const struct ring_base *ring)
{
	if (o->fmt == FMT_JSON) {
		struct jw j;
		json_head(&j, o);
		jw_open(&j, "baselines", '{');
		json_ring(&j, ring);
		jw_close(&j, '}');
		jw_open(&j, "points", '[');
		for (unsigned i = 0; i < n; i++) {
			jw_open(&j, NULL, '{');
			jw_int(&j, "chunk_bytes", pt[i].chunk);
			jw_num_na(&j, "memcpy_gbps", pt[i].memcpy_gbps);
			jw_num_na(&j, "tcp_gbps", pt[i].tcp_gbps);
			jw_close(&j, '}');
		}
		jw_close(&j, ']');
		json_end(&j);
	} else if (o->fmt == FMT_CSV) {
		printf("mode,chunk_bytes,memcpy_gbps,tcp_gbps,ring_rt_per_s,ring_rtt_p50_us,"
		       "ring_rtt_p99_us,ring_rtt_p999_us,ring_batched_records_per_s\n");
		for (unsigned i = 0; i < n; i++) {
			printf("baseline,%llu,", (unsigned long long)pt[i].chunk);
			csv_num(pt[i].memcpy_gbps, false);
			csv_num(pt[i].tcp_gbps, false);
			csv_num(ring ? ring->rt_per_s : NAN, false);
			csv_num(ring ? ring->rtt.p50 : NAN, false);
			csv_num(ring ? ring->rtt.p99 : NAN, false);
			csv_num(ring ? ring->rtt.p999 : NAN, false);
			csv_num(ring ? ring->batch_rec_per_s : NAN, true);
		}
	} else {
		char a[16], b[16], c[16];
		printf("kvstage-bench %s baseline: %.2f s per figure\n", KVS_VERSION_STRING,
		       o->baseline_sec);
		print_machine();
		print_ring(ring);
		printf("\n%-8s %14s %14s\n", "chunk", "memcpy GB/s", "TCP GB/s");
		for (unsigned i = 0; i < n; i++)
			printf("%-8s %14s %14s\n", bench_size_str(pt[i].chunk, a, sizeof(a)),
			       num(pt[i].memcpy_gbps, b, sizeof(b)), num(pt[i].tcp_gbps, c, sizeof(c)));
		printf("\nmemcpy: one thread, chunk-sized buffers around a %s ring each way.\n"
		       "TCP: one connection on 127.0.0.1, writes of the chunk size, two processes.\n",
		       bench_size_str(o->wset, a, sizeof(a)));
	}
	fflush(stdout);
	if (!o->plot)
		return 0;
	uint64_t *x = calloc(n, sizeof(*x));
	double *mc = calloc(n, sizeof(double)), *tc = calloc(n, sizeof(double));
	int rc = 1;
	if (x && mc && tc) {
		for (unsigned i = 0; i < n; i++) {
			x[i] = pt[i].chunk;
			mc[i] = pt[i].memcpy_gbps;
			tc[i] = pt[i].tcp_gbps;
		}
		const double *cols[] = { mc, tc };
		const char *names[] = { "memcpy, one thread", "TCP, one loopback connection" };
		const char *styles[] = { "linespoints lw 2 pt 7", "linespoints lw 2 pt 5" };
		rc = plot(o, "kvstage-bench baselines", x, n, cols, names, styles, 2);
	}
	free(x);
	free(mc);
	free(tc);
	return rc;
}
