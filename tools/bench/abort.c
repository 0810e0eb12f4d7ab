/* SPDX-License-Identifier: MIT */
/*
 * The abort mode: rooms at full rate while --abort-rate of them are aborted
 * at a random phase from --abort-side, through one proxy (local), then two
 * joined by tcp (and verbs with --rdma-device), every abort rate a point,
 * rate 0 first. Each pair is one process holding the receiving engine's
 * connection and the sending engine's, so the phase of every abort is
 * exact and both sides' finals are seen by the process that aborted.
 *
 * Checked while it runs: every byte of every room that completes (canary
 * stamping, tools/canary.h), no event after a room's final, a handed-over
 * lease refused once its room is aborted, and every aborted room's "pages"
 * (a buffer per room the engine copies the slots into only on RECV_DONE):
 * stamped with a canary at the final, read back when the buffer is next
 * taken and at the end. Any wrong byte and no figure is printed.
 *
 * Baseline: the same aborts staged in flight (failpoint local.quiesce holds
 * the doomed rooms' chunks inside the local transport and is let go every
 * millisecond, as a NIC's late DMA) through kvstaged and through the
 * test-only kvstaged-vulnerable, which frees a slot while it still holds
 * its address: what the fence costs, and what it buys.
 */
#include <errno.h>
#include <libgen.h>
#include <math.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "abort.h"
#include "admin.h"
#include "local.h"

static const char *const phase_names[NPH] = { "desc", "lease", "mid", "sent", "done" };
static const char *const phase_help[NPH] = {
	"before the descriptor reaches the sender (send side: right after kvs_send_open, "
	"before any lease)",
	"every chunk's slot leased and stamped, none sent",
	"half the room's chunks sent",
	"every chunk sent, no final yet",
	"after the receiver's RECV_DONE (a side final before its kvs_abort has no "
	"abort-to-final figure: counted in final_before_abort; its slots are still timed)",
};
static const char *const side_names[2] = { "send", "recv" };

/* -------------------------------------------------------------- parent */

struct abort_point {
	const char *path, *proxy; /* "local"/"tcp"/"verbs"; "kvstaged", ... */
	double rate;
	bool staged, vulnerable;
	unsigned slots;
	double seconds, gbps, rooms_s, ref_gbps; /* ref_gbps: the reference point's goodput */
	uint64_t rooms, aborted[2], lost_race, final_before, verified, corrupt, late_events,
		pages_bad;
	uint64_t stale_tried, stale_refused, rejected, rej_stale, tombstones, reaped;
	struct lat fin_all, reuse_all, fin[2][NPH], reuse[2][NPH];
};

/* Forks the pairs of one point, runs them over the window (with admin >= 0,
 * letting go of the staged chunks every STAGE_NS) and gathers their figures
 * into pt. Returns 0, or 1 (a pair failed, or an interruption). */
static int measure(const struct bench_opts *o, struct ab_ctx *x, unsigned pairs, int admin,
		   struct abort_point *pt)
{
	size_t shlen = sizeof(struct ab_shared) + pairs * sizeof(struct ab_res);
	struct ab_shared *sh = bench_alloc(shlen, true);
	if (!sh)
		return 1;
	memset(sh, 0, shlen);
	struct ab_res *res = sh->res;
	x->sh = sh;
	for (unsigned i = 0; i < pairs; i++)
		for (unsigned s = 0; s < 2; s++)
			for (unsigned f = 0; f < NPH; f++) {
				hist_init(&res[i].fin[s][f]);
				hist_init(&res[i].reuse[s][f]);
			}
	int ready[2], go[2], rc = 0;
	pid_t pid[BENCH_MAX_PAIRS];
	unsigned n = 0;
	if (pipe(ready) < 0 || pipe(go) < 0) {
		bench_free(sh, shlen);
		return 1;
	}
	for (; n < pairs; n++) {
		x->pair = n;
		x->res = &res[n];
		pid[n] = bench_fork(-1);
		if (pid[n] == 0) {
			close(ready[0]);
			close(go[1]);
			_exit(abort_pair_run(x, ready[1], go[0]));
		}
		if (pid[n] < 0) {
			rc = 1;
			break;
		}
	}
	close(ready[1]);
	close(go[0]);
	for (unsigned got = 0; !rc && got < n;) {
		char b[64];
		struct pollfd pf = { .fd = ready[0], .events = POLLIN };
		ssize_t k = poll(&pf, 1, 30000) > 0 ? read(ready[0], b, sizeof(b)) : -1;
		if (k <= 0 && !local_interrupted())
			fprintf(stderr, "kvstage-bench: abort: %u of %u pairs ready, the rest %s\n",
				got, n, k == 0 ? "exited first" : "not in 30 s");
		if (k <= 0 || local_interrupted())
			rc = 1;
		else
			got += (unsigned)k;
	}
	/* The window's bounds are set now, before go: the children read them. */
	uint64_t t0 = now_ns();
	sh->t_start = t0 + (uint64_t)(o->warmup * 1e9);
	sh->t_end = sh->t_start + (uint64_t)(o->duration * 1e9);
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	close(go[1]);
	close(ready[0]);
	unsigned left = n;
	bool prog = progress_on(o);
	uint64_t t_prog = 0, t_stage = now_ns();
	while (left) {
		for (unsigned i = 0; i < n; i++) {
			int st;
			if (pid[i] > 0 && waitpid(pid[i], &st, WNOHANG) == pid[i]) {
				pid[i] = 0;
				left--;
				if (!WIFEXITED(st) || WEXITSTATUS(st))
					rc = 1;
				if (WIFSIGNALED(st))
					fprintf(stderr,
						"kvstage-bench: abort pair %u: killed by signal %d "
						"(%s)\n",
						i, WTERMSIG(st), strsignal(WTERMSIG(st)));
				else if (WEXITSTATUS(st) && !res[i].failed)
					fprintf(stderr,
						"kvstage-bench: abort pair %u: exited %d, saying "
						"nothing\n",
						i, WEXITSTATUS(st));
			}
		}
		if (local_interrupted() || (rc && left)) {
			for (unsigned i = 0; i < n; i++)
				if (pid[i] > 0)
					kill(pid[i], SIGKILL);
			rc = 1;
		}
		uint64_t t = now_ns();
		if (admin >= 0 && t - t_stage >= STAGE_NS) {
			/* Let go of what is held (the late writes land), hold again. */
			if (kvs_admin_fp_set(admin, "local.quiesce", "off", NULL) < 0 ||
			    kvs_admin_fp_set_mask(admin, "local.quiesce", "pause", DOOM_BIT,
						  DOOM_BIT) < 0) {
				fprintf(stderr,
					"kvstage-bench: abort: failpoint local.quiesce: the "
					"proxy's admin socket refused\n");
				admin = -1, rc = 1;
			}
			t_stage = t;
		}
		if (prog && t - t_prog > 200000000ull) {
			progress_line("abort %s, rate %g%s: %.1f / %.1f s", pt->path, pt->rate,
				      pt->staged ? " (staged)" : "", (double)(t - t0) / 1e9,
				      o->warmup + o->duration);
			t_prog = t;
		}
		if (left)
			sleep_ns(admin >= 0 ? 200000 : 5000000);
	}
	if (admin >= 0) /* what is still held goes */
		kvs_admin_fp_set(admin, "local.quiesce", "off", NULL);
	progress_clear();

	struct hist *h = malloc(sizeof(*h)), *all = malloc(sizeof(*all)),
		    *rall = malloc(sizeof(*rall));
	if (!h || !all || !rall)
		rc = 1;
	else {
		hist_init(all);
		hist_init(rall);
	}
	for (unsigned s = 0; s < 2 && h && all && rall; s++)
		for (unsigned f = 0; f < NPH; f++) {
			hist_init(h);
			for (unsigned i = 0; i < n; i++)
				hist_merge(h, &res[i].fin[s][f]);
			hist_merge(all, h);
			pt->fin[s][f] = hist_lat(h);
			hist_init(h);
			for (unsigned i = 0; i < n; i++)
				hist_merge(h, &res[i].reuse[s][f]);
			hist_merge(rall, h);
			pt->reuse[s][f] = hist_lat(h);
		}
	if (all && rall) {
		pt->fin_all = hist_lat(all);
		pt->reuse_all = hist_lat(rall);
	}
	free(h);
	free(all);
	free(rall);
	uint64_t bytes = 0;
	for (unsigned i = 0; i < n; i++) {
		struct ab_res *r = &res[i];
		pt->rooms += r->rooms;
		bytes += r->bytes;
		pt->aborted[0] += r->aborted[0];
		pt->aborted[1] += r->aborted[1];
		pt->lost_race += r->lost_race;
		pt->final_before += r->final_before;
		pt->verified += r->verified;
		pt->corrupt += r->corrupt;
		pt->late_events += r->late_events;
		pt->pages_bad += r->pages_bad;
		pt->stale_tried += r->stale_tried;
		pt->stale_refused += r->stale_refused;
		pt->rejected += r->rejected;
		if (r->failed || (r->corrupt && !pt->vulnerable))
			fprintf(stderr, "kvstage-bench: %s\n", r->msg);
	}
	pt->seconds = o->duration;
	pt->gbps = (double)bytes / (o->duration * 1e9);
	pt->rooms_s = (double)pt->rooms / o->duration;
	bench_free(sh, shlen);
	if (local_interrupted())
		fprintf(stderr, "kvstage-bench: interrupted\n");
	return rc;
}

/* The counters that say what the proxies refused and reaped, summed over the point's proxies. */
static void proxy_counts(struct abort_point *pt, const char *const *socks, unsigned n)
{
	for (unsigned i = 0; i < n; i++) {
		pt->rej_stale += bench_stat(socks[i], "rej_stale");
		pt->tombstones += bench_stat(socks[i], "slots.tombstone");
		pt->reaped += bench_stat(socks[i], "tombstones_reaped");
	}
}

/* kvstaged-vulnerable: --vulnerable, else the build tree's, beside tools/bench/. */
static const char *find_vulnerable(const struct bench_opts *o, char *buf, size_t len)
{
	if (o->vulnerable)
		return access(o->vulnerable, X_OK) ? NULL : o->vulnerable;
	char self[512];
	ssize_t k = readlink("/proc/self/exe", self, sizeof(self) - 1);
	snprintf(buf, len, "tests/kvstaged-vulnerable next to this binary");
	if (k <= 0)
		return NULL;
	self[k] = 0;
	snprintf(buf, len, "%s/../../tests/kvstaged-vulnerable", dirname(self));
	return access(buf, X_OK) ? NULL : buf;
}

/* One point: its proxies started, the pairs run, the proxies' counters read, stopped. */
static int point(const struct bench_opts *o, const struct tcp_env *e, struct abort_point *pt,
		 const char *vuln_bin, struct bench_proxy *shown)
{
	struct ab_ctx x = { .o = o, .rate = pt->rate, .staged = pt->staged, .chunk = o->chunks[0] };
	x.room_bytes = bench_room_bytes(o, x.chunk);
	x.room_chunks = bench_room_chunks(o, x.chunk);
	uint64_t need = (uint64_t)o->senders * o->rooms * x.room_chunks;
	uint32_t slots = proxy_slots_for(x.chunk, need);
	pt->slots = slots;
	struct bench_proxy a, b;
	int rc, admin = -1;
	if (!strcmp(pt->path, "local")) {
		struct bench_opts po = *o;
		const char *fp[] = { "--failpoints", NULL };
		if (pt->vulnerable)
			po.kvstaged = vuln_bin;
		if (proxy_start_ex(&a, &po, x.chunk, slots, pt->staged ? fp : NULL, -1, NULL) < 0)
			return 1;
		if (proxy_fits(&a, x.chunk, need) < 0) {
			proxy_stop(&a);
			return 1;
		}
		pt->slots = a.slots;
		if (pt->staged) {
			admin = kvs_admin_connect(a.sock);
			if (admin < 0 || kvs_admin_fp_set_mask(admin, "local.quiesce", "pause",
							       DOOM_BIT, DOOM_BIT) < 0) {
				fprintf(stderr,
					"kvstage-bench: failpoint local.quiesce on %s: %s\n", a.bin,
					kvs_strerror(admin < 0 ? admin : -EPROTO));
				if (admin >= 0)
					close(admin);
				proxy_stop(&a);
				return 1;
			}
		}
		x.rx_sock = x.tx_sock = a.sock;
		x.one_proxy = true;
		if (!pt->staged)
			*shown = a;
		note(o,
		     "abort local, rate %g%s: %s pid %d, %u slots; %u pair(s), %u rooms x %u "
		     "chunks",
		     pt->rate, pt->staged ? ", staged" : "", pt->proxy, (int)a.pid, a.slots,
		     o->senders, o->rooms, x.room_chunks);
		rc = measure(o, &x, o->senders, admin, pt);
		proxy_counts(pt, (const char *[]){ a.sock }, 1);
		if (admin >= 0)
			close(admin);
		proxy_stop(&a);
		return rc;
	}
	if (tcp_proxies_start(o, e, !strcmp(pt->path, "verbs"), x.chunk, slots, need, &a, &b) < 0)
		return 1;
	pt->slots = a.slots;
	x.rx_sock = b.sock;
	x.tx_sock = a.sock;
	note(o,
	     "abort %s, rate %g: kvstaged A pid %d (senders) -> B pid %d (receivers), %u slots "
	     "each; %u pair(s), %u rooms x %u chunks",
	     pt->path, pt->rate, (int)a.pid, (int)b.pid, slots, o->senders, o->rooms,
	     x.room_chunks);
	rc = measure(o, &x, o->senders, -1, pt);
	proxy_counts(pt, (const char *[]){ a.sock, b.sock }, 2);
	proxy_stop(&a);
	proxy_stop(&b);
	return rc;
}

/* -------------------------------------------------------------- report */

static const char *const abort_defs[][2] = {
	{ "pair", "one process per --senders holding a receiving and a sending connection, "
		  "--rooms rooms in flight, busy-polling both (kvs_poll): each abort's phase is "
		  "exact and both sides' finals are seen where the abort was made" },
	{ "abort", "each room is doomed with probability --abort-rate; a doomed room is aborted "
		   "by kvs_abort from --abort-side at a phase drawn uniformly: desc, lease, mid, "
		   "sent, done (the table's rows name them)" },
	{ "abort_to_final", "kvs_abort's call to the aborting side's final event (ABORTED, or the "
			    "RECV_DONE/SEND_DONE that won the race): the moment the engine may "
			    "free its pages; a side already final at its kvs_abort (done phase) "
			    "has nothing to wait for and is counted in final_before_abort" },
	{ "abort_to_reusable",
	  "kvs_abort's call until every slot the room leased reads, in the "
	  "sending proxy's published slot table, free or taken anew (a later "
	  "epoch, never a tombstone); the room's unsent leases are released "
	  "right after the abort, as an engine would; over tcp the receiving "
	  "proxy's posted slots are not in that table (its tombstones are in "
	  "the counters). The pair looks for finals and slots between the steps "
	  "of its rooms' work (a chunk stamped, sent or checked), so both "
	  "latencies include up to one such step" },
	{ "gbps", "bytes of rooms never aborted completed in the window / window; ratio: over "
		  "the same path's abort rate 0 of this run" },
	{ "verified", "every completed room (aborted or not) is read in full and checked "
		      "against the canary its sender stamped; corrupt_bytes counts wrong 8-byte "
		      "words' bytes" },
	{ "pages", "each receiving room copies its slots into a buffer of its own (its pages) "
		   "only on RECV_DONE; an aborted room's pages are stamped with a canary at its "
		   "final and read back when next taken (after 16 others) and at the end: "
		   "pages_bad counts buffers written after the final" },
	{ "stale", "after a send-side abort with chunks sent, kvs_release of a lease the room "
		   "was handed must be refused and kvs_lease_ptr must give NULL; "
		   "rej_stale: the proxies' own counter of ops refused for an old epoch" },
	{ "staged", "the fence's baseline: failpoint local.quiesce holds the chunks of rooms "
		    "doomed at mid or sent inside the local transport, let go every 1 ms (a "
		    "NIC's late DMA); the same run through kvstaged and through the test-only "
		    "kvstaged-vulnerable (it tells the core a slot is free while it still holds "
		    "its address, and writes there late): corrupt_bytes there is what the fence "
		    "prevents" },
};

/* Whether a point saw any sign of a broken fence: the red control's
 * run must, or it shows nothing (too short a run for its race, say). */
static bool caught_any(const struct abort_point *ap)
{
	return ap->corrupt || ap->pages_bad || ap->late_events ||
	       ap->stale_refused < ap->stale_tried;
}

static void describe(const struct bench_opts *o, struct point *p, const struct abort_point *ap)
{
	snprintf(p->name, sizeof(p->name), "%s %g%s", ap->path, ap->rate,
		 ap->vulnerable ? (caught_any(ap) ? " vuln" : " vuln: caught nothing")
		 : ap->staged	? " staged"
				: "");
	snprintf(p->title, sizeof(p->title),
		 "%s, abort rate %g, %s%s: %.2f s, %llu rooms "
		 "completed, %llu aborted (%llu by the sender, %llu by the receiver)",
		 ap->path, ap->rate, ap->proxy, ap->staged ? " (aborts staged in flight)" : "",
		 ap->seconds, (unsigned long long)ap->rooms,
		 (unsigned long long)(ap->aborted[0] + ap->aborted[1]),
		 (unsigned long long)ap->aborted[0], (unsigned long long)ap->aborted[1]);
	put_str(p, "path", "%s", ap->path);
	put_str(p, "proxy", "%s", ap->proxy);
	put_bool(p, "staged", ap->staged);
	put_num(p, "abort_rate", ap->rate);
	put_str(p, "abort_side", "%s",
		o->abort_sides == 3 ? "both" : side_names[o->abort_sides - 1]);
	put_int(p, "slots", ap->slots);
	put_num(p, "seconds", ap->seconds);
	put_int(p, "rooms", ap->rooms);
	put_int(p, "aborted.send", ap->aborted[0]);
	put_int(p, "aborted.recv", ap->aborted[1]);
	put_int(p, "|aborted", ap->aborted[0] + ap->aborted[1]);
	put_int(p, "aborted_lost_race", ap->lost_race);
	put_int(p, "final_before_abort", ap->final_before);
	vs(p, fig(p, "goodput GB/s", "GB/s", U_NUM, ap->gbps, "gbps"), ap->ref_gbps,
	   ap->staged ? "kvstaged, the same staged aborts" : "the same path, abort rate 0",
	   "baseline.gbps", "ratio.gbps_vs_reference|gbps_ratio");
	fig(p, "rooms/s", "rooms/s", U_RATE, ap->rooms_s, "rooms_per_s");
	fig_lat(p, "abort to final", "final p50/p99/p99.9 us", &ap->fin_all, PALL,
		"abort_to_final_us", "final_%s_us");
	fig_lat(p, "abort to reusable", "reusable p50/p99/p99.9 us", &ap->reuse_all, PALL,
		"abort_to_reusable_us", "reusable_%s_us");
	/* Per side and phase: abort-to-final in the table, both figures in JSON. */
	for (unsigned s = 0; s < 2; s++)
		for (unsigned f = 0; f < NPH; f++) {
			if (!ap->fin[s][f].n && !ap->reuse[s][f].n)
				continue;
			const char *key =
				keep(p, "by_phase.%s.%s.final_us", side_names[s], phase_names[f]);
			if (ap->fin[s][f].n)
				fig_lat(p, keep(p, "  %s side, %s", side_names[s], phase_names[f]),
					NULL, &ap->fin[s][f], P50 | P99, key, NULL);
			else
				put_lat(p, key, &ap->fin[s][f]);
			put_lat(p,
				keep(p, "by_phase.%s.%s.reusable_us", side_names[s],
				     phase_names[f]),
				&ap->reuse[s][f]);
		}
	fig(p, "stale ops refused", "stale", U_INT, (double)ap->stale_refused, "stale.refused");
	put_int(p, "stale.tried", ap->stale_tried);
	put_int(p, "stale.rejected_events", ap->rejected);
	put_int(p, "stale.rej_stale", ap->rej_stale);
	fig(p, "tombstones reaped", "reaped", U_INT, (double)ap->reaped, "tombstones_reaped");
	put_int(p, "tombstones_left", ap->tombstones);
	fig(p, "corrupt bytes", "corrupt", U_INT, (double)ap->corrupt, "corrupt_bytes");
	put_int(p, "verified_bytes", ap->verified);
	put_int(p, "late_events", ap->late_events);
	put_int(p, "pages_bad", ap->pages_bad);
	if (ap->vulnerable) {
		put_bool(p, "control_caught", caught_any(ap));
		if (!caught_any(ap))
			CAT(p->notes,
			    "  the red control caught nothing: kvstaged-vulnerable corrupted no "
			    "byte in this run, so its row shows nothing about the fence (a longer "
			    "--duration gives its race more chances)\n");
	}
	CAT(p->notes,
	    "  checked: %llu bytes verified, %llu wrong; %llu events after a final; %llu "
	    "aborted rooms' pages written after it; stale ops %llu of %llu refused "
	    "(proxies' rej_stale %llu)\n",
	    (unsigned long long)ap->verified, (unsigned long long)ap->corrupt,
	    (unsigned long long)ap->late_events, (unsigned long long)ap->pages_bad,
	    (unsigned long long)ap->stale_refused, (unsigned long long)ap->stale_tried,
	    (unsigned long long)ap->rej_stale);
}

static int report_abort(const struct bench_opts *o, const struct abort_point *pt, unsigned n,
			const struct bench_proxy *px)
{
	struct doc *d = doc_new(o, n);
	if (!d)
		return 1;
	struct point *pts = d->pt;
	char a[16], b[16];
	d->npt = n;
	d->sections = true;
	d->col0 = "point";
	CAT(d->head,
	    "kvstage-bench %s abort: %u pair(s), %u rooms in flight each, rooms of %s "
	    "in %s chunks, %.2f s per point, aborts from %s\n",
	    KVS_VERSION_STRING, o->senders, o->rooms,
	    bench_size_str(bench_room_bytes(o, o->chunks[0]), a, sizeof(a)),
	    bench_size_str(o->chunks[0], b, sizeof(b)), o->duration,
	    o->abort_sides == 3	  ? "either side"
	    : o->abort_sides == 1 ? "the sender"
				  : "the receiver");
	doc_head(d, o, px, ", started per point with --slot-size = chunk size", false, NULL);
	put_defs(d, abort_defs, sizeof(abort_defs) / sizeof(abort_defs[0]));
	for (unsigned f = 0; f < NPH; f++)
		CAT(d->tail, "%s%-6s %s\n", f ? "" : "\nphases:\n", phase_names[f], phase_help[f]);
	if (!o->rdma_device)
		CAT(d->tail, "verbs: not run (no --rdma-device)\n");
	put(&d->top, "points", U_POINTS);
	d->csv = "mode,path,proxy,staged,abort_rate,abort_side,seconds,rooms,aborted,gbps,"
		 "gbps_ratio,final_p50_us,final_p99_us,final_p999_us,reusable_p50_us,"
		 "reusable_p99_us,reusable_p999_us,refused,rej_stale,tombstones_reaped,"
		 "late_events,pages_bad,corrupt_bytes";
	d->pt = pts;
	for (unsigned i = 0; i < n; i++)
		describe(o, &pts[i], &pt[i]);
	report(d);
	doc_free(d);
	if (!o->plot)
		return 0;
	/* Abort-to-final against abort rate, a line per path and percentile. */
	static const char *const paths[] = { "local", "tcp", "verbs" };
	double x[16], cols[6][16];
	const double *cp[6];
	const char *names[6], *styles[6];
	char nbuf[6][48];
	unsigned nc = 0, nx = o->nrates - 1;
	for (unsigned i = 1; i < o->nrates; i++)
		x[i - 1] = o->abort_rates[i];
	for (unsigned k = 0; k < 3; k++) {
		bool have = false;
		for (unsigned q = 0; q < 2; q++) {
			for (unsigned i = 0; i < nx; i++) {
				cols[nc][i] = NAN;
				for (unsigned j = 0; j < n; j++)
					if (!pt[j].staged && !strcmp(pt[j].path, paths[k]) &&
					    pt[j].rate == x[i] && pt[j].fin_all.n) {
						cols[nc][i] = q ? pt[j].fin_all.p99
								: pt[j].fin_all.p50;
						have = true;
					}
			}
			snprintf(nbuf[nc], sizeof(nbuf[nc]), "%s, %s", paths[k], q ? "p99" : "p50");
			cp[nc] = cols[nc];
			names[nc] = nbuf[nc];
			styles[nc] = q ? "linespoints dt 2 lw 2 pt 6" : "linespoints lw 2 pt 7";
			nc++;
		}
		if (!have)
			nc -= 2;
	}
	if (!nx || !nc) {
		fprintf(stderr, "kvstage-bench: --plot: no nonzero abort rate measured\n");
		return 1;
	}
	struct plot_axes ax = { "abort rate (fraction of rooms)", "abort to final (us)", false };
	return plot_xy(o, "kvstage abort to final", &ax, x, nx, cp, names, styles, nc);
}

int run_abort(const struct bench_opts *o)
{
	local_catch_signals();
	char vbuf[600];
	const char *vuln = find_vulnerable(o, vbuf, sizeof(vbuf));
	double top = o->abort_rates[o->nrates - 1];
	for (unsigned i = 0; i < o->nrates; i++)
		top = fmax(top, o->abort_rates[i]);
	unsigned npaths = o->rdma_device ? 3 : 2, max = npaths * o->nrates + 2;
	struct abort_point *pts = calloc(max, sizeof(*pts));
	struct tcp_env e;
	struct bench_proxy shown = { .pid = 0 };
	int rc = tcp_env_init(o, &e) < 0 || !pts;
	unsigned n = 0;
	static const char *const paths[] = { "local", "tcp", "verbs" };
	if (!o->rdma_device)
		note(o, "verbs: skipped (no --rdma-device)");
	pin_clients();
	for (unsigned k = 0; k < npaths && !rc; k++) {
		unsigned ref = n;
		for (unsigned i = 0; i < o->nrates && !rc && !local_interrupted(); i++) {
			struct abort_point *pt = &pts[n];
			pt->path = paths[k];
			pt->proxy = "kvstaged";
			pt->rate = o->abort_rates[i];
			rc = point(o, &e, pt, NULL, &shown);
			pt->ref_gbps = pts[ref].gbps;
			n += !rc;
		}
	}
	/* The fence's baseline: the same staged aborts, kvstaged then kvstaged-vulnerable. */
	if (!rc && top > 0 && !vuln) /* said even with -q: a figure is missing */
		fprintf(stderr,
			"kvstage-bench: the fence's baseline: skipped (no executable "
			"kvstaged-vulnerable at %s: build the tests, or give --vulnerable "
			"PATH)\n",
			o->vulnerable ? o->vulnerable : vbuf);
	for (unsigned v = 0; !rc && top > 0 && vuln && v < 2 && !local_interrupted(); v++) {
		struct abort_point *pt = &pts[n];
		pt->path = "local";
		pt->proxy = v ? "kvstaged-vulnerable" : "kvstaged";
		pt->rate = top;
		pt->staged = true;
		pt->vulnerable = v;
		int prc = point(o, &e, pt, vuln, &shown);
		pt->ref_gbps = v ? pts[n - 1].gbps : pt->gbps;
		if (v) {
			if (prc) { /* it may well break in other ways: said, not a failure of ours */
				fprintf(stderr,
					"kvstage-bench: the vulnerable baseline's run failed "
					"(above); its figures are what it got to\n");
				prc = 0;
			}
		}
		rc = prc;
		n += !rc;
	}
	pin_all();
	tcp_env_fini(&e);
	if (local_interrupted())
		rc = 130;
	/* Wrong bytes anywhere kvstaged ran: no figure means anything. */
	bool bad = false;
	for (unsigned i = 0; i < n; i++) {
		const struct abort_point *pt = &pts[i];
		if (pt->vulnerable || !(pt->corrupt || pt->pages_bad || pt->late_events ||
					pt->stale_refused < pt->stale_tried))
			continue;
		fprintf(stderr,
			"kvstage-bench: CORRUPTION through kvstaged (%s, abort rate %g%s): "
			"%llu wrong bytes, %llu pages written after their final, %llu events "
			"after a final, %llu stale ops accepted; no figure is printed\n",
			pt->path, pt->rate, pt->staged ? ", staged" : "",
			(unsigned long long)pt->corrupt, (unsigned long long)pt->pages_bad,
			(unsigned long long)pt->late_events,
			(unsigned long long)(pt->stale_tried - pt->stale_refused));
		bad = true;
	}
	if (bad) {
		free(pts);
		return 1;
	}
	if (n) {
		int prc = report_abort(o, pts, n, &shown);
		if (!rc)
			rc = prc;
	}
	/* Said even with -q, and in the table and JSON: a silent control is
	 * no proof. */
	for (unsigned i = 0; i < n; i++)
		if (pts[i].vulnerable && !caught_any(&pts[i])) {
			fprintf(stderr,
				"kvstage-bench: the red control (kvstaged-vulnerable, %.2f s) "
				"caught "
				"nothing%s\n",
				pts[i].seconds, o->strict ? ": --strict makes that an error" : "");
			if (o->strict && !rc)
				rc = 1;
		}
	free(pts);
	return rc;
}
