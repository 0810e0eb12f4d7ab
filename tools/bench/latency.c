/* SPDX-License-Identifier: MIT */
/*
 * The latency mode: one chunk in flight. One process holds a receiver and a
 * sender connection and busy-polls with kvs_poll (one spinner plus the
 * proxy: two cores' worth), so what is timed is the proxy's hand-off, not a
 * scheduler wake-up.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <rte_config.h>
#include <rte_pause.h>

#include "bench.h"
#include "canary.h"
#include "kvstage.h"
#include "report.h"

#define SPIN_LIMIT_NS 10000000000ull

/* Spins on kvs_poll until one event arrives. Returns 1, or -errno. */
static int spin_event(kvs_client *c, struct kvs_event *ev)
{
	uint64_t until = 0;
	for (unsigned i = 0;; i++) {
		int n = kvs_poll(c, ev, 1);
		if (n)
			return n;
		if ((i & 1023) == 1023) {
			uint64_t t = now_ns();
			if (!until)
				until = t + SPIN_LIMIT_NS;
			else if (t > until)
				return -ETIMEDOUT;
		}
		rte_pause();
	}
}

static int lfail(const char *what, int rc)
{
	fprintf(stderr, "kvstage-bench latency: %s: %s\n", what, kvs_strerror(rc));
	return 1;
}

struct lat_hists {
	struct hist chunk, room, sync;
};

/* Runs room cycles until the window ends; fills r. Returns 0, or 1. */
static int cycles(const struct bench_opts *o, kvs_client *rx, kvs_client *tx, uint64_t chunk,
		  pid_t cpu_pid, struct latency_result *r, struct lat_hists *h)
{
	uint8_t *buf = NULL;
	size_t blen = 0, pos = 0;
	if (o->payload == PAYLOAD_COPY) {
		/* One ring, copied into the slot from one place and out to
		 * another: both copies from and to memory beyond the cache. */
		blen = (o->wset / chunk < 4 ? 4 : o->wset / chunk) * chunk;
		buf = bench_alloc(blen, false);
		if (!buf) {
			fprintf(stderr, "kvstage-bench latency: cannot allocate %zu bytes\n", blen);
			return 1;
		}
	}
	uint64_t t_start = now_ns();
	uint64_t t_warm = t_start + (uint64_t)(o->warmup * 1e9);
	uint64_t t_end = t_warm + (uint64_t)(o->duration * 1e9);
	double cpu_a = -1;
	uint64_t t_a = 0, seq = 0;
	bool prog = progress_on(o);
	uint64_t next_prog = t_start + 250000000ull;
	int rc = 0;
	for (;;) {
		uint64_t t0 = now_ns();
		if (!t_a && t0 >= t_warm) {
			cpu_a = proc_cpu_seconds(cpu_pid);
			t_a = t0 = now_ns();
		}
		if (t0 >= t_end)
			break;
		kvs_room *rr, *sr;
		struct kvs_room_desc d;
		struct kvs_lease l;
		struct kvs_event ev;
		if ((rc = kvs_recv_open(rx, chunk, seq, &rr, &d)) < 0)
			return lfail("kvs_recv_open", rc);
		if ((rc = kvs_send_open(tx, &d, seq, &sr)) < 0)
			return lfail("kvs_send_open", rc);
		uint64_t ta = now_ns();
		if ((rc = kvs_acquire(tx, 1, &l)) < 0)
			return lfail("kvs_acquire", rc);
		uint64_t tb = now_ns();
		void *p = kvs_lease_ptr(tx, &l);
		if (!p)
			return lfail("kvs_lease_ptr", -EPERM);
		if (o->payload == PAYLOAD_COPY) {
			memcpy(p, buf + pos, chunk);
		} else if (o->payload == PAYLOAD_VERIFY) {
			canary_fill(p, seq, 0, chunk);
		}
		uint64_t t1 = now_ns();
		if ((rc = kvs_send(sr, &l, 0, (uint32_t)chunk)) < 0)
			return lfail("kvs_send", rc);
		if ((rc = spin_event(rx, &ev)) < 0)
			return lfail("waiting for RECV_DONE", rc);
		uint64_t t2 = now_ns();
		if (ev.type != KVS_EV_RECV_DONE)
			return lfail("the room did not complete", ev.status ? ev.status : -EPROTO);
		if (o->payload != PAYLOAD_NONE) {
			struct kvs_lease rl;
			if ((rc = kvs_room_lease(rr, 0, &rl)) < 0)
				return lfail("kvs_room_lease", rc);
			const void *q = kvs_lease_ptr(rx, &rl);
			if (!q)
				return lfail("kvs_lease_ptr (receiver)", -EPERM);
			if (o->payload == PAYLOAD_COPY) {
				pos = (pos + chunk) % blen;
				memcpy(buf + pos, q, chunk);
				pos = (pos + chunk) % blen;
			} else if (canary_check(q, seq, 0, chunk) != chunk) {
				fprintf(stderr,
					"kvstage-bench latency: room %llu: wrong bytes received\n",
					(unsigned long long)seq);
				return 1;
			}
		}
		if ((rc = kvs_room_close(rr)) < 0)
			return lfail("kvs_room_close (receiver)", rc);
		if ((rc = spin_event(tx, &ev)) < 0)
			return lfail("waiting for SEND_DONE", rc);
		if (ev.type != KVS_EV_SEND_DONE)
			return lfail("the sender's room did not complete",
				     ev.status ? ev.status : -EPROTO);
		if ((rc = kvs_room_close(sr)) < 0)
			return lfail("kvs_room_close (sender)", rc);
		if (t_a) {
			hist_add(&h->chunk, t2 - t1);
			hist_add(&h->room, t2 - t0);
			hist_add(&h->sync, tb - ta);
			r->iters++;
		}
		seq++;
		if (prog && t2 >= next_prog) {
			double el = (double)(t2 - t_start) / 1e9;
			progress_line("latency: %.1f / %.1f s, %llu hand-offs", el,
				      o->warmup + o->duration, (unsigned long long)r->iters);
			next_prog = t2 + 250000000ull;
		}
	}
	uint64_t t_b = now_ns();
	double cpu_b = proc_cpu_seconds(cpu_pid);
	progress_clear();
	r->seconds = (double)(t_b - t_a) / 1e9;
	r->handoffs_s = (double)r->iters / r->seconds;
	r->proxy_cpu = cpu_a >= 0 && cpu_b >= 0 ? (cpu_b - cpu_a) / r->seconds * 100 : -1;
	r->chunk_lat = hist_lat(&h->chunk);
	r->room_lat = hist_lat(&h->room);
	r->sync_lat = hist_lat(&h->sync);
	bench_free(buf, blen);
	if (!r->iters)
		fprintf(stderr,
			"kvstage-bench latency: no hand-off completed in the measured window\n");
	return r->iters ? 0 : 1;
}

static const char *const latency_defs[][2] = {
	{ "chunk_latency", "kvs_send to RECV_DONE seen by the receiver (one busy-polling process "
			   "holds both connections): one submission, one proxy pass, one "
			   "completion; its baseline is one raw rte_ring round trip between two "
			   "processes (the same two ring hops, with nothing in between)" },
	{ "room_latency", "kvs_recv_open to RECV_DONE: recv_open, send_open and acquire round "
			  "trips, then the hand-off" },
	{ "acquire_latency", "one kvs_acquire(1) round trip (a sync op)" },
};

static void report_latency(const struct bench_opts *o, const struct latency_result *r,
			   const struct ring_base *ring, const struct bench_proxy *px)
{
	char a[16];
	struct doc *d = calloc(1, sizeof(*d) + sizeof(struct point));
	if (!d)
		return;
	struct point *p = (struct point *)(d + 1);
	CAT(d->head,
	    "kvstage-bench %s latency: one %s chunk in flight, payload %s, %.2f s, %llu "
	    "hand-offs (one busy-polling client process)\n",
	    KVS_VERSION_STRING, bench_size_str(r->chunk, a, sizeof(a)),
	    bench_payload_str(o->payload), r->seconds, (unsigned long long)r->iters);
	doc_head(d, o, px, "", true, ring);
	put(&d->top, "result", U_POINTS);
	put_defs(d, latency_defs, sizeof(latency_defs) / sizeof(latency_defs[0]));
	d->csv = "mode,chunk_bytes,payload,seconds,handoffs,handoffs_per_s,chunk_p50_us,"
		 "chunk_p99_us,chunk_p999_us,room_p50_us,room_p99_us,room_p999_us,"
		 "acquire_p50_us,acquire_p99_us,acquire_p999_us,proxy_cpu_pct,ring_rt_per_s,"
		 "ring_rtt_p50_us,ring_rtt_p99_us,ring_rtt_p999_us";
	d->pt = p;
	d->npt = 1;
	d->sections = true;
	put_int(p, "chunk_bytes", r->chunk);
	put_num(p, "seconds", r->seconds);
	put_int(p, "handoffs", r->iters);
	vs(p, fig(p, "hand-offs/s (1 in flight)", NULL, U_RATE, r->handoffs_s, "handoffs_per_s"),
	   ring ? ring->rt_per_s : -1, "rte_ring ping-pong round trips/s", NULL,
	   "ratio.handoffs_per_s_vs_ring_rt");
	vs_lat(p,
	       fig_lat(p, "chunk latency", NULL, &r->chunk_lat, PALL, "chunk_latency_us",
		       "chunk_%s_us"),
	       ring ? &ring->rtt : NULL, "rte_ring round trip", NULL, "ratio.chunk_%s_vs_ring_rtt");
	vs_lat(p,
	       fig_lat(p, "room latency", NULL, &r->room_lat, PALL, "room_latency_us",
		       "room_%s_us"),
	       ring ? &ring->rtt : NULL, "rte_ring round trip", NULL, NULL);
	vs_lat(p,
	       fig_lat(p, "kvs_acquire", NULL, &r->sync_lat, PALL, "acquire_latency_us",
		       "acquire_%s_us"),
	       ring ? &ring->rtt : NULL, "rte_ring round trip", NULL, NULL);
	fig(p, "proxy CPU (% of one core)", NULL, U_NUM, r->proxy_cpu, "proxy_cpu_pct");
	report(d);
	free(d);
}

int run_latency(const struct bench_opts *o)
{
	struct bench_proxy px;
	struct latency_result r = { 0 };
	struct ring_base ring;

	note(o, "baseline: rte_ring round trips between two processes (%.2f s)", o->baseline_sec);
	if (baseline_ring(o->baseline_sec, &ring) < 0)
		note(o, "baseline: the rte_ring measurement failed; its ratios are n/a");

	uint64_t chunk = o->chunks[0];
	int rc = proxy_open(&px, o, chunk, proxy_slots_for(chunk, 2));
	if (rc)
		return rc;
	r.chunk = chunk = px.slot_size;

	kvs_client *rx = NULL, *tx = NULL;
	struct lat_hists *h = malloc(sizeof(*h));
	rc = h ? kvs_connect(px.sock, &rx) : -ENOMEM;
	if (rc == 0)
		rc = kvs_connect(px.sock, &tx);
	if (rc < 0) {
		lfail("kvs_connect", rc);
		rc = 1;
	} else {
		hist_init(&h->chunk);
		hist_init(&h->room);
		hist_init(&h->sync);
		note(o, "latency: one %llu-byte chunk in flight, payload %s, %.1f s (busy-polling)",
		     (unsigned long long)chunk, bench_payload_str(o->payload), o->duration);
		pin_clients();
		rc = cycles(o, rx, tx, chunk, px.cpu_pid, &r, h);
		pin_all();
	}
	kvs_close(tx);
	kvs_close(rx);
	free(h);
	proxy_stop(&px);
	if (!rc)
		report_latency(o, &r, ring.done ? &ring : NULL, &px);
	return rc;
}
