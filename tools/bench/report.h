/* SPDX-License-Identifier: MIT */
/*
 * The one output module (report.c). A mode does not print: it describes a
 * document, members about the run and then points of figures, and
 * report() renders that as the table (people), JSON or CSV (machines).
 *
 * A member is a JSON path ("baseline.memcpy_gbps": member memcpy_gbps of
 * the point's object "baseline"), optionally followed by "|NAME", the CSV
 * column it fills (else its last part; "|NAME" alone: a CSV column only).
 * A figure is a table row: a value against a baseline, with the ratio;
 * fig() and vs() add the figure's JSON members as they describe it.
 */
#ifndef KVS_BENCH_REPORT_H
#define KVS_BENCH_REPORT_H

#include "bench.h"

enum unit {
	U_NUM,	/* negative or NaN: unknown (null, empty, n/a) */
	U_RATE, /* per second, shown as "12.30 k" */
	U_INT,
	U_SIZE, /* bytes, shown as "64K" */
	U_STR,
	U_BOOL,
	U_LAT,	/* microsecond percentiles: an object, a row and a CSV field each */
	U_STRS, /* an array of strings */
	U_NULL,
	U_POINTS, /* where the points go: an array, or under key "result" the one point */
};

/* Latency percentiles a figure shows (table rows, CSV fields, ratios). */
enum { P50 = 1, P99 = 2, P999 = 4, PALL = 7 };

struct item {
	char key[72];
	enum unit unit;
	double v;
	uint64_t u;
	const char *s;
	struct lat l;
	const char *const *strs;
	unsigned nstrs;
};

struct fig {
	const char *label,
		*col; /* table row ("": under the row above), summary column; NULL: none */
	enum unit unit;
	double v, b;	  /* value, baseline (NaN: none) */
	struct lat l, bl; /* U_LAT: value, and baseline if has_bl */
	bool has_bl;
	unsigned pct;		     /* U_LAT: the percentiles shown */
	const char *s, *what, *bcol; /* U_STR's text; what the baseline is; its summary column */
};

#define REPORT_ITEMS 96
#define REPORT_FIGS 40

struct point {
	char name[64];	 /* summary table: the first column */
	char title[256]; /* table: the section's heading */
	char notes[512]; /* table: lines below the rows */
	struct item it[REPORT_ITEMS];
	unsigned nit;
	struct fig fig[REPORT_FIGS];
	unsigned nfig;
	char arena[4096]; /* the strings members hold */
	size_t used;
};

struct doc {
	const struct bench_opts *o;
	struct point top;	      /* the document's own members (its figures are unused) */
	char head[2048];	      /* table: the lines above the points */
	char tail[2048];	      /* table: the lines below them */
	const char *const (*defs)[2]; /* JSON "definitions"; the table's "How to read it" */
	unsigned ndefs;
	/* the CSV header: each column is looked up in the point, then the document */
	const char *csv;
	const char *col0; /* summary table's first column head; NULL: no summary */
	bool sections;	  /* table: a section per point (and the summary only with two or more) */
	struct point *pt;
	unsigned npt;
};

/* Adds member key (see above) to p; its value is the caller's to set. */
struct item *put(struct point *p, const char *key, enum unit u);
void put_num(struct point *p, const char *key, double v);
void put_int(struct point *p, const char *key, uint64_t v);
void put_bool(struct point *p, const char *key, bool v);
void put_lat(struct point *p, const char *key, const struct lat *l);
/* A string, kept in p (printf-style). */
void put_str(struct point *p, const char *key, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
/* A string kept in p's arena (printf-style), for members and figures. */
const char *keep(struct point *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The defs as the document's "definitions" (and the table's reading guide). */
void put_defs(struct doc *d, const char *const (*defs)[2], unsigned n);
/* A figure: row label (summary column col) showing v in unit u, JSON member key (NULL: none). */
struct fig *fig(struct point *p, const char *label, const char *col, enum unit u, double v,
		const char *key);
/* A latency figure: rows for the percentiles in pct; member key; CSV columns csv ("chunk_%s_us"). */
struct fig *fig_lat(struct point *p, const char *label, const char *col, const struct lat *l,
		    unsigned pct, const char *key, const char *csv);
/* f against baseline b (what it is: what; member bkey, NULL: none) and the ratio f / b at
 * member rkey (NULL: none; a latency's: "chunk_%s_vs_ring_rtt", one per percentile). */
void vs(struct point *p, struct fig *f, double b, const char *what, const char *bkey,
	const char *rkey);
/* A latency figure against a latency bl, percentile by percentile (NULL: unknown). */
void vs_lat(struct point *p, struct fig *f, const struct lat *bl, const char *what,
	    const char *bkey, const char *rkey);
/* printf to a fixed buffer, appended. */
void cat(char *buf, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
#define CAT(buf, ...) cat(buf, sizeof(buf), __VA_ARGS__)

/* The head every mode but gpu starts with: tool, command, machine, config;
 * proxy (px != NULL); the ring baseline (with_ring, NULL ring: failed). */
void doc_head(struct doc *d, const struct bench_opts *o, const struct bench_proxy *px,
	      const char *how, bool with_ring, const struct ring_base *ring);
/* A zeroed document for o with n zeroed points (d->pt, d->npt), or NULL
 * (out of memory). */
struct doc *doc_new(const struct bench_opts *o, unsigned n);
void doc_free(struct doc *d);
/* Renders d in d->o->fmt on stdout. */
void report(const struct doc *d);

/* a / b, or NaN when either is unknown (a < 0, b <= 0). */
double ratio(double a, double b);
/* Draws columns cols[c][i] against x[i] (log2 x axis of chunk sizes) into
 * o->plot with gnuplot. Returns 0, or 1 after saying why. */
int plot(const struct bench_opts *o, const char *title, const uint64_t *x, unsigned n,
	 const double *const *cols, const char *const *names, const char *const *styles,
	 unsigned ncols);

/* What plot_xy's axes say; sizes: x is a chunk size (log2 axis, "64K" ticks), else linear. */
struct plot_axes {
	const char *xlabel, *ylabel;
	bool sizes;
};
/* Draws cols[c][i] against x[i] into o->plot with gnuplot. Returns 0, or 1 after saying why. */
int plot_xy(const struct bench_opts *o, const char *title, const struct plot_axes *ax,
	    const double *x, unsigned n, const double *const *cols, const char *const *names,
	    const char *const *styles, unsigned ncols);

#endif
