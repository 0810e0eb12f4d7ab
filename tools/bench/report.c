/* SPDX-License-Identifier: MIT */
/*
 * The one output module: documents as described in report.h, rendered as
 * the table, JSON or CSV; the progress line, notes, number formats, and
 * the gnuplot driver.
 */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvstage.h"
#include "report.h"

/* ------------------------------------------------------------ progress */

static bool g_progress_drawn;

bool progress_on(const struct bench_opts *o)
{
	return !o->quiet && (o->progress || isatty(2));
}

void progress_line(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fputs("\r\033[K", stderr);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fflush(stderr);
	g_progress_drawn = true;
}

void progress_clear(void)
{
	if (!g_progress_drawn)
		return;
	fputs("\r\033[K", stderr);
	fflush(stderr);
	g_progress_drawn = false;
}

void note(const struct bench_opts *o, const char *fmt, ...)
{
	if (o->quiet)
		return;
	va_list ap;
	va_start(ap, fmt);
	progress_clear();
	fputs("kvstage-bench: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
}

int child_fail(char *msg, size_t len, int *failed, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, len, fmt, ap);
	va_end(ap);
	*failed = 1;
	return 1;
}

/* ------------------------------------------------------------- numbers */

struct doc *doc_new(const struct bench_opts *o, unsigned n)
{
	struct doc *d = calloc(1, sizeof(*d));
	struct point *pts = calloc(n ? n : 1, sizeof(*pts));
	if (!d || !pts) {
		free(d);
		free(pts);
		return NULL;
	}
	d->o = o;
	d->pt = pts;
	d->npt = n;
	return d;
}

void doc_free(struct doc *d)
{
	if (d)
		free(d->pt);
	free(d);
}

double ratio(double a, double b)
{
	return a >= 0 && b > 0 ? a / b : NAN;
}

static const char *human(double v, char *buf, size_t len)
{
	static const char *const sfx[] = { "", " k", " M", " G" };
	int k = 0;
	if (!isfinite(v) || v < 0) {
		snprintf(buf, len, "n/a");
		return buf;
	}
	for (; k < 3 && v >= 1e3; k++)
		v /= 1e3;
	snprintf(buf, len, "%.2f%s", v, sfx[k]);
	return buf;
}

static const char *num(double v, char *buf, size_t len)
{
	if (!isfinite(v) || v < 0)
		snprintf(buf, len, "n/a");
	else
		snprintf(buf, len, v != 0 && v < 0.01 ? "%.2g" : v < 100 ? "%.2f" : "%.1f", v);
	return buf;
}

void cat(char *buf, size_t len, const char *fmt, ...)
{
	size_t n = strlen(buf);
	va_list ap;
	va_start(ap, fmt);
	if (n < len)
		vsnprintf(buf + n, len - n, fmt, ap);
	va_end(ap);
}

static const char *const pct_key[3] = { "p50", "p99", "p999" };
static const char *const pct_txt[3] = { "p50", "p99", "p99.9" };

static double pct_of(const struct lat *l, int i)
{
	return i == 0 ? l->p50 : i == 1 ? l->p99 : l->p999;
}

/* ------------------------------------------------------------ building */

struct item *put(struct point *p, const char *key, enum unit u)
{
	if (p->nit == REPORT_ITEMS) {
		fprintf(stderr, "kvstage-bench: report: more than %d members\n", REPORT_ITEMS);
		abort();
	}
	struct item *it = &p->it[p->nit++];
	memset(it, 0, sizeof(*it));
	snprintf(it->key, sizeof(it->key), "%s", key);
	it->unit = u;
	return it;
}

void put_num(struct point *p, const char *key, double v)
{
	put(p, key, U_NUM)->v = v;
}
void put_int(struct point *p, const char *key, uint64_t v)
{
	put(p, key, U_INT)->u = v;
}
void put_bool(struct point *p, const char *key, bool v)
{
	put(p, key, U_BOOL)->u = v;
}
void put_lat(struct point *p, const char *key, const struct lat *l)
{
	put(p, key, U_LAT)->l = *l;
}

static const char *vkeep(struct point *p, const char *fmt, va_list ap)
{
	char *s = p->arena + p->used;
	size_t left = sizeof(p->arena) - p->used;
	int n = left ? vsnprintf(s, left, fmt, ap) : -1;
	p->used += n < 0 ? 0 : (size_t)n < left ? (size_t)n + 1 : left;
	return n < 0 ? "" : s;
}

const char *keep(struct point *p, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	const char *s = vkeep(p, fmt, ap);
	va_end(ap);
	return s;
}

void put_str(struct point *p, const char *key, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	put(p, key, U_STR)->s = vkeep(p, fmt, ap);
	va_end(ap);
}

void put_defs(struct doc *d, const char *const (*defs)[2], unsigned n)
{
	char key[72];
	d->defs = defs;
	d->ndefs = n;
	for (unsigned i = 0; i < n; i++) {
		snprintf(key, sizeof(key), "definitions.%s", defs[i][0]);
		put(&d->top, key, U_STR)->s = defs[i][1];
	}
}

struct fig *fig(struct point *p, const char *label, const char *col, enum unit u, double v,
		const char *key)
{
	if (p->nfig == REPORT_FIGS) {
		fprintf(stderr, "kvstage-bench: report: more than %d figures\n", REPORT_FIGS);
		abort();
	}
	struct fig *f = &p->fig[p->nfig++];
	*f = (struct fig){ .label = label, .col = col, .unit = u, .v = v, .b = NAN };
	if (key) {
		struct item *it = put(p, key, u);
		it->v = v;
		it->u = v >= 0 ? (uint64_t)v : 0;
	}
	return f;
}

struct fig *fig_lat(struct point *p, const char *label, const char *col, const struct lat *l,
		    unsigned pct, const char *key, const char *csv)
{
	struct fig *f = fig(p, label, col, U_LAT, NAN, NULL);
	f->l = *l;
	f->pct = pct;
	if (key || csv) {
		char k[72];
		snprintf(k, sizeof(k), "%s%s%s", key ? key : "", csv ? "|" : "", csv ? csv : "");
		put_lat(p, k, l);
	}
	return f;
}

/* The ratio of each percentile of f shown, to the baseline's (b, or bl's). */
static void lat_ratios(struct point *p, const struct fig *f, const char *rkey)
{
	for (int i = 0; i < 3 && rkey; i++) {
		if (!(f->pct & (1u << i)))
			continue;
		char k[72];
		snprintf(k, sizeof(k), rkey, pct_key[i]);
		double b = !f->has_bl ? f->b : f->bl.n ? pct_of(&f->bl, i) : NAN;
		put_num(p, k, f->l.n ? ratio(pct_of(&f->l, i), b) : NAN);
	}
}

void vs(struct point *p, struct fig *f, double b, const char *what, const char *bkey,
	const char *rkey)
{
	f->b = b;
	f->what = what;
	if (bkey)
		put_num(p, bkey, b);
	if (f->unit == U_LAT)
		lat_ratios(p, f, rkey);
	else if (rkey)
		put_num(p, rkey, ratio(f->v, b));
}

void vs_lat(struct point *p, struct fig *f, const struct lat *bl, const char *what,
	    const char *bkey, const char *rkey)
{
	f->has_bl = true;
	f->bl = bl ? *bl : (struct lat){ 0 };
	f->what = what;
	if (bkey)
		put_lat(p, bkey, &f->bl);
	lat_ratios(p, f, rkey);
}

/* ------------------------------------------------------------ the head */

static void cpu_model(char *buf, size_t len)
{
	snprintf(buf, len, "unknown");
	FILE *f = fopen("/proc/cpuinfo", "r");
	char line[512];
	while (f && fgets(line, sizeof(line), f)) {
		char *v = strchr(line, ':');
		if (strncmp(line, "model name", 10) || !v)
			continue;
		v += 1 + strspn(v + 1, " \t");
		v[strcspn(v, "\n")] = 0;
		snprintf(buf, len, "%s", v);
		break;
	}
	if (f)
		fclose(f);
}

static double loadavg(void)
{
	double l = -1;
	FILE *f = fopen("/proc/loadavg", "r");
	if (f) {
		if (fscanf(f, "%lf", &l) != 1)
			l = -1;
		fclose(f);
	}
	return l;
}

void doc_head(struct doc *d, const struct bench_opts *o, const struct bench_proxy *px,
	      const char *how, bool with_ring, const struct ring_base *ring)
{
	struct point *t = &d->top;
	char cpu[256], pd[192], a[32], b[32];
	struct utsname u;
	d->o = o;
	cpu_model(cpu, sizeof(cpu));
	pin_desc(pd, sizeof(pd));
	uname(&u);
	put_str(t, "tool", "kvstage-bench");
	put_str(t, "version", KVS_VERSION_STRING);
	put_str(t, "mode", "%s", bench_mode_name(o->mode));
	struct item *cmd = put(t, "command", U_STRS);
	cmd->strs = (const char *const *)o->argv;
	cmd->nstrs = (unsigned)o->argc;
	put_int(t, "machine.nproc", (uint64_t)sysconf(_SC_NPROCESSORS_ONLN));
	put_str(t, "machine.cpu", "%s", cpu);
	put_str(t, "machine.kernel", "%s", u.release);
	put_num(t, "machine.loadavg_1m", loadavg());
	put_str(t, "machine.placement", "%s", pd);
	put_int(t, "config.senders", o->senders);
	put_int(t, "config.receivers", o->receivers);
	put_int(t, "config.rooms", o->rooms);
	put_str(t, "config.payload", "%s", bench_payload_str(o->payload));
	put_num(t, "config.duration_s", o->bytes ? NAN : o->duration);
	put_int(t, "config.bytes", o->bytes);
	put_num(t, "config.warmup_s", o->warmup);
	put_num(t, "config.baseline_s", o->baseline_sec);
	put_int(t, "config.wset_bytes", o->wset);
	put_int(t, "|pairs", o->senders);
	put_int(t, "|rooms_in_flight", o->rooms);
	CAT(d->head, "machine: %s, %ld CPUs, load %.2f; %s\n", cpu, sysconf(_SC_NPROCESSORS_ONLN),
	    loadavg(), pd);
	if (px) {
		put_bool(t, "proxy.external", o->socket);
		put_str(t, "proxy.bin", "%s", px->bin);
		struct item *xa = put(t, "proxy.extra_args", U_STRS);
		xa->strs = o->proxy_args;
		xa->nstrs = o->nproxy_args;
		if (o->socket) {
			put_str(t, "proxy.socket", "%s", px->sock);
			CAT(d->head, "proxy: the running one at %s (%s)\n", px->sock, px->bin);
		} else {
			CAT(d->head, "proxy: %s%s", px->bin, how);
			for (unsigned i = 0; i < o->nproxy_args; i++)
				CAT(d->head, "%s %s",
				    i ? "" : "; extra arguments:", o->proxy_args[i]);
			CAT(d->head, "\n");
		}
	}
	if (!with_ring)
		return;
	if (!ring) {
		put(t, "baselines.ring", U_NULL);
		CAT(d->head, "baseline rte_ring: n/a (the measurement failed)\n");
		return;
	}
	put_str(t, "baselines.ring.what",
		"raw SPSC rte_ring between two processes, 32-byte records");
	put_num(t, "baselines.ring.pingpong_rt_per_s|ring_rt_per_s", ring->rt_per_s);
	put_lat(t, "baselines.ring.pingpong_rtt_us|ring_rtt_%s_us", &ring->rtt);
	put_num(t, "baselines.ring.batched_records_per_s|ring_batched_records_per_s",
		ring->batch_rec_per_s);
	CAT(d->head,
	    "baseline rte_ring (two processes, SPSC, 32-byte records): ping-pong %s round "
	    "trips/s, RTT p50/p99/p99.9 %.2f/%.2f/%.2f us; bursts of 32: %s records/s out "
	    "and back\n",
	    human(ring->rt_per_s, a, sizeof(a)), ring->rtt.p50, ring->rtt.p99, ring->rtt.p999,
	    human(ring->batch_rec_per_s, b, sizeof(b)));
}

/* ---------------------------------------------------------------- JSON */

struct jw {
	int depth;
	bool first[16];
};

static void jw_sep(struct jw *j, const char *key)
{
	if (!j->first[j->depth])
		putchar(',');
	j->first[j->depth] = false;
	printf("\n%*s", 2 * j->depth, "");
	if (key) {
		kvs_json_string(stdout, key);
		fputs(": ", stdout);
	}
}

static void jw_open(struct jw *j, const char *key, char c)
{
	if (j->depth > 0)
		jw_sep(j, key);
	putchar(c);
	j->first[++j->depth] = true;
}

static void jw_close(struct jw *j, char c)
{
	if (!j->first[j->depth--])
		printf("\n%*s", 2 * j->depth, "");
	putchar(c);
}

static void jw_num(double v)
{
	if (isfinite(v) && v >= 0)
		printf("%.6g", v);
	else
		fputs("null", stdout);
}

static void emit(struct jw *j, const struct doc *d, const struct point *p, const char *pre,
		 size_t plen, bool *done);

static void emit_point(struct jw *j, const struct doc *d, const char *key, const struct point *p)
{
	bool done[REPORT_ITEMS] = { false };
	jw_open(j, key, '{');
	emit(j, d, p, "", 0, done);
	jw_close(j, '}');
}

static void emit_leaf(struct jw *j, const struct doc *d, const char *name, const struct item *it)
{
	if (it->unit == U_POINTS && !strcmp(name, "result")) {
		emit_point(j, d, name, &d->pt[0]);
		return;
	}
	if (it->unit == U_LAT || it->unit == U_STRS || it->unit == U_POINTS) {
		jw_open(j, name, it->unit == U_LAT ? '{' : '[');
		for (unsigned i = 0; i < it->nstrs && it->unit == U_STRS; i++) {
			jw_sep(j, NULL);
			kvs_json_string(stdout, it->strs[i]);
		}
		for (unsigned i = 0; i < d->npt && it->unit == U_POINTS; i++)
			emit_point(j, d, NULL, &d->pt[i]);
		if (it->unit == U_LAT) {
			const struct lat *l = &it->l;
			double v[5] = { l->p50, l->p99, l->p999, l->mean, l->max };
			static const char *const k[5] = { "p50", "p99", "p999", "mean", "max" };
			jw_sep(j, "n");
			printf("%llu", (unsigned long long)l->n);
			for (int i = 0; i < 5; i++) {
				jw_sep(j, k[i]);
				jw_num(l->n ? v[i] : NAN);
			}
		}
		jw_close(j, it->unit == U_LAT ? '}' : ']');
		return;
	}
	jw_sep(j, name);
	switch (it->unit) {
	case U_INT:
	case U_SIZE:
		printf("%llu", (unsigned long long)it->u);
		break;
	case U_STR:
		kvs_json_string(stdout, it->s);
		break;
	case U_BOOL:
		fputs(it->u ? "true" : "false", stdout);
		break;
	case U_NULL:
		fputs("null", stdout);
		break;
	default:
		jw_num(it->v);
	}
}

/* The members of p under prefix pre (plen bytes, ending in '.'), in the
 * order of their first appearance, each object whole where it first appears. */
static void emit(struct jw *j, const struct doc *d, const struct point *p, const char *pre,
		 size_t plen, bool *done)
{
	for (unsigned i = 0; i < p->nit; i++) {
		const char *key = p->it[i].key;
		size_t klen = strcspn(key, "|");
		if (done[i] || klen <= plen || strncmp(key, pre, plen))
			continue;
		size_t seg = strcspn(key + plen, ".|");
		char name[72];
		snprintf(name, sizeof(name), "%.*s", (int)seg, key + plen);
		if (key[plen + seg] == '.') {
			jw_open(j, name, '{');
			emit(j, d, p, key, plen + seg + 1, done);
			jw_close(j, '}');
		} else {
			done[i] = true;
			emit_leaf(j, d, name, &p->it[i]);
		}
	}
}

/* ----------------------------------------------------------------- CSV */

/* The member filling CSV column col, and for a latency which percentile. */
static const struct item *csv_find(const struct point *p, const char *col, int *pct)
{
	for (unsigned i = 0; i < p->nit; i++) {
		const char *key = p->it[i].key, *bar = strchr(key, '|'), *name;
		char leaf[72];
		if (bar) {
			name = bar + 1;
		} else {
			name = strrchr(key, '.') ? strrchr(key, '.') + 1 : key;
		}
		snprintf(leaf, sizeof(leaf), "%s", name);
		if (p->it[i].unit != U_LAT && !strcmp(leaf, col))
			return &p->it[i];
		for (int k = 0; k < 3 && p->it[i].unit == U_LAT && strstr(leaf, "%s"); k++) {
			char want[72];
			snprintf(want, sizeof(want), leaf, pct_key[k]);
			if (!strcmp(want, col)) {
				*pct = k;
				return &p->it[i];
			}
		}
	}
	return NULL;
}

static void csv_field(const struct item *it, int pct)
{
	double v = it ? it->v : NAN;
	switch (it ? it->unit : U_NULL) {
	case U_INT:
	case U_SIZE:
		printf("%llu", (unsigned long long)it->u);
		return;
	case U_STR:
		fputs(it->s, stdout);
		return;
	case U_BOOL:
		fputs(it->u ? "true" : "false", stdout);
		return;
	case U_LAT:
		v = it->l.n ? pct_of(&it->l, pct) : NAN;
		break;
	case U_NUM:
	case U_RATE:
		break;
	default:
		return;
	}
	if (isfinite(v) && v >= 0)
		printf("%.6g", v);
}

static void csv(const struct doc *d)
{
	char cols[1024], *save;
	printf("%s\n", d->csv);
	for (unsigned i = 0; i < d->npt; i++) {
		snprintf(cols, sizeof(cols), "%s", d->csv);
		save = NULL;
		for (char *c = strtok_r(cols, ",", &save); c; c = strtok_r(NULL, ",", &save)) {
			int pct = 0;
			const struct item *it = csv_find(&d->pt[i], c, &pct);
			csv_field(it ? it : csv_find(&d->top, c, &pct), pct);
			putchar(save && *save ? ',' : '\n');
		}
	}
}

/* --------------------------------------------------------------- table */

/* The text of a value of f's unit. */
static const char *text(const struct fig *f, double v, char *buf, size_t len)
{
	switch (f->unit) {
	case U_STR:
		return f->s ? f->s : "";
	case U_RATE:
		return human(v, buf, len);
	case U_SIZE:
		return bench_size_str((uint64_t)v, buf, len);
	case U_INT:
		snprintf(buf, len, "%llu", (unsigned long long)v);
		return buf;
	default:
		return num(v, buf, len);
	}
}

static void row(const char *what, const char *kv, const char *base, const char *base_what, double r)
{
	char rb[32];
	printf("  %-28s %12s %12s  %-42s %8s\n", what, kv, base, base_what ? base_what : "",
	       isnan(r) ? "-" : num(r, rb, sizeof(rb)));
}

static void section(const struct point *p)
{
	char name[96], kv[32], base[32], what[96];
	printf("\n");
	if (p->title[0])
		printf("== %s\n", p->title);
	printf("  %-28s %12s %12s  %-42s %8s\n", "", "kvstage", "baseline", "(baseline is)",
	       "ratio");
	for (unsigned i = 0; i < p->nfig; i++) {
		const struct fig *f = &p->fig[i];
		if (!f->label)
			continue;
		if (f->unit != U_LAT) {
			row(f->label, f->label[0] ? text(f, f->v, kv, sizeof(kv)) : "",
			    isnan(f->b) ? "-" : text(f, f->b, base, sizeof(base)), f->what,
			    isnan(f->b) ? NAN : ratio(f->v, f->b));
			continue;
		}
		for (int k = 0; k < 3; k++) {
			if (!(f->pct & (1u << k)))
				continue;
			double v = pct_of(&f->l, k), b = f->b;
			if (f->has_bl)
				b = f->bl.n ? pct_of(&f->bl, k) : -1;
			snprintf(name, sizeof(name), "%s %s (us)", f->label, pct_txt[k]);
			snprintf(what, sizeof(what), "%s%s%s", f->what ? f->what : "",
				 f->has_bl ? " " : "", f->has_bl ? pct_txt[k] : "");
			row(name, f->l.n ? num(v, kv, sizeof(kv)) : "n/a",
			    isnan(b) ? "-" : num(b, base, sizeof(base)), what,
			    f->l.n && !isnan(b) ? ratio(v, b) : NAN);
		}
	}
	fputs(p->notes, stdout);
}

#define SUM_COLS 16
#define SUM_W 64

/* A point's summary cells: a column per figure with a summary column, its
 * baseline's and the ratio; names (heads) from the figures' columns. */
static unsigned sum_cells(const struct point *p, char (*cell)[SUM_W], const char **head)
{
	unsigned c = 1;
	snprintf(cell[0], SUM_W, "%s", p->name);
	for (unsigned i = 0; i < p->nfig && c + 3 <= SUM_COLS; i++) {
		const struct fig *f = &p->fig[i];
		char tmp[SUM_W];
		if (f->col && f->unit == U_LAT && !f->l.n) {
			snprintf(cell[c], SUM_W, "n/a");
		} else if (f->col && f->unit == U_LAT) {
			for (int k = 0; k < 3; k++)
				if (f->pct & (1u << k))
					cat(cell[c], SUM_W, "%s%.1f", cell[c][0] ? "/" : "",
					    pct_of(&f->l, k));
		} else if (f->col) {
			snprintf(cell[c], SUM_W, "%s", text(f, f->v, tmp, sizeof(tmp)));
		}
		if (f->col)
			head[c++] = f->col;
		if (f->bcol) {
			snprintf(cell[c], SUM_W, "%s", text(f, f->b, tmp, sizeof(tmp)));
			head[c++] = f->bcol;
			num(ratio(f->v, f->b), cell[c], SUM_W);
			head[c++] = "ratio";
		}
	}
	return c;
}

/* One line per point, in columns as wide as their widest cell. */
static void summary(const struct doc *d)
{
	const char *head[SUM_COLS] = { d->col0 };
	char(*cell)[SUM_COLS][SUM_W] = calloc(d->npt, sizeof(*cell));
	unsigned nc = 0, w[SUM_COLS];
	if (!cell)
		return;
	for (unsigned r = 0; r < d->npt; r++)
		nc = sum_cells(&d->pt[r], cell[r], head);
	for (unsigned c = 0; c < nc; c++) {
		w[c] = (unsigned)strlen(head[c]);
		for (unsigned r = 0; r < d->npt; r++)
			w[c] = strlen(cell[r][c]) > w[c] ? (unsigned)strlen(cell[r][c]) : w[c];
	}
	printf("\n");
	for (unsigned r = 0; r <= d->npt; r++) { /* the heads, then a line per point */
		for (unsigned c = 0; c < nc; c++)
			printf(c ? "  %*s" : "%-*s", (int)w[c], r ? cell[r - 1][c] : head[c]);
		printf("\n");
	}
	free(cell);
}

static void table(const struct doc *d)
{
	fputs(d->head, stdout);
	for (unsigned i = 0; d->sections && i < d->npt; i++)
		section(&d->pt[i]);
	if (d->col0 && d->npt && (!d->sections || d->npt > 1))
		summary(d);
	fputs(d->tail, stdout);
	if (d->ndefs)
		printf("\nHow to read it:\n");
	for (unsigned i = 0; i < d->ndefs; i++)
		printf("  %s: %s.\n", d->defs[i][0], d->defs[i][1]);
}

void report(const struct doc *d)
{
	if (d->o->fmt == FMT_JSON) {
		struct jw j = { .depth = 0 };
		bool done[REPORT_ITEMS] = { false };
		jw_open(&j, NULL, '{');
		emit(&j, d, &d->top, "", 0, done);
		jw_close(&j, '}');
		putchar('\n');
	} else if (d->o->fmt == FMT_CSV) {
		csv(d);
	} else {
		table(d);
	}
	fflush(stdout);
}

/* ---------------------------------------------------------------- plot */

int plot(const struct bench_opts *o, const char *title, const uint64_t *x, unsigned n,
	 const double *const *cols, const char *const *names, const char *const *styles,
	 unsigned ncols)
{
	double xd[BENCH_MAX_CHUNKS];
	for (unsigned i = 0; i < n && i < BENCH_MAX_CHUNKS; i++)
		xd[i] = (double)x[i];
	struct plot_axes ax = { "chunk size", "GB/s (10^9 bytes/s)", true };
	return plot_xy(o, title, &ax, xd, n, cols, names, styles, ncols);
}

int plot_xy(const struct bench_opts *o, const char *title, const struct plot_axes *ax,
	    const double *x, unsigned n, const double *const *cols, const char *const *names,
	    const char *const *styles, unsigned ncols)
{
	/* The data rides in the script (a datablock): no temporary files. */
	void (*old)(int) = signal(SIGPIPE, SIG_IGN); /* a gnuplot that dies must not kill us */
	fflush(NULL);
	FILE *g = popen("exec gnuplot", "w");
	if (!g) {
		fprintf(stderr, "kvstage-bench: --plot: cannot run gnuplot: %s\n", strerror(errno));
		signal(SIGPIPE, old);
		return 1;
	}
	fprintf(g, "$points << EOD\n");
	for (unsigned i = 0; i < n; i++) {
		fprintf(g, "%.9g", x[i]);
		for (unsigned c = 0; c < ncols; c++)
			fprintf(g, " %.6g", cols[c][i] > 0 ? cols[c][i] : NAN);
		fputc('\n', g);
	}
	bool svg = !strcmp(o->plot + strlen(o->plot) - 4, ".svg");
	fprintf(g, "EOD\nset terminal %s size 900,640 font ',11'\n",
		svg ? "svg dynamic" : "pngcairo");
	fprintf(g, "set output '%s'\nset title \"%s\" noenhanced\n", o->plot, title);
	fprintf(g, "set xlabel '%s'\nset ylabel '%s'\n", ax->xlabel, ax->ylabel);
	fprintf(g, "set grid\nset key below noenhanced\n");
	fprintf(g, "set yrange [0:*]\nset datafile missing 'nan'\n");
	if (ax->sizes) {
		fprintf(g, "set logscale x 2\nset xtics (");
		for (unsigned i = 0; i < n; i++) {
			char cs[16];
			fprintf(g, "%s\"%s\" %.0f", i ? ", " : "",
				bench_size_str((uint64_t)x[i], cs, sizeof(cs)), x[i]);
		}
		fprintf(g, ")\n");
		if (n == 1)
			fprintf(g, "set xrange [%.0f:%.0f]\n", x[0] / 2, x[0] * 2);
	} else {
		fprintf(g, "set xtics (");
		for (unsigned i = 0; i < n; i++)
			fprintf(g, "%s\"%g\" %.9g", i ? ", " : "", x[i], x[i]);
		fprintf(g, ")\n");
		if (n == 1)
			fprintf(g, "set xrange [%.9g:%.9g]\n", x[0] / 2, x[0] * 2 + 0.01);
	}
	for (unsigned c = 0; c < ncols; c++)
		fprintf(g, "%s$points using 1:%u with %s title '%s'", c ? ", \\\n     " : "plot ",
			c + 2, styles[c], names[c]);
	fprintf(g, "\n");
	int st = pclose(g);
	signal(SIGPIPE, old);
	if (WIFEXITED(st) && WEXITSTATUS(st) == 127) {
		fprintf(stderr,
			"kvstage-bench: --plot needs gnuplot, which is not in PATH (Debian: "
			"apt-get install gnuplot-nox)\n");
		return 1;
	}
	if (st) {
		fprintf(stderr, "kvstage-bench: --plot: gnuplot failed\n");
		return 1;
	}
	if (!o->quiet)
		fprintf(stderr, "kvstage-bench: plot written to %s\n", o->plot);
	return 0;
}
