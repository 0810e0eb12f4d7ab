/* SPDX-License-Identifier: MIT */
/* Output machinery shared by the reports (output.c). */
#ifndef KVS_BENCH_OUTPUT_H
#define KVS_BENCH_OUTPUT_H

#include "bench.h"

/* A JSON writer that places commas and indentation itself. */
struct jw {
	FILE *f;
	int depth;
	bool first[16];
};

/* Starts a member (key != NULL) or an array element: comma, newline, indent, key. */
void jw_sep(struct jw *j, const char *key);
/* Opens an object ('{') or array ('['), as member key of the enclosing one (NULL in arrays or at the top). */
void jw_open(struct jw *j, const char *key, char c);
/* Closes what jw_open opened (c is '}' or ']'). */
void jw_close(struct jw *j, char c);
/* A number; NaN or infinity is written as null. */
void jw_num(struct jw *j, const char *key, double v);
/* A number that is unknown when negative (written as null). */
void jw_num_na(struct jw *j, const char *key, double v);
/* An unsigned integer. */
void jw_int(struct jw *j, const char *key, uint64_t v);
/* true or false. */
void jw_bool(struct jw *j, const char *key, bool v);
/* A string, escaped. */
void jw_str(struct jw *j, const char *key, const char *s);
/* A latency object: n, p50, p99, p999, mean, max (null when n == 0). */
void jw_lat(struct jw *j, const char *key, const struct lat *l);

/* a / b, or NaN when either is unknown (a < 0, b <= 0). */
double ratio(double a, double b);
/* The CPU's model name from /proc/cpuinfo into buf ("unknown" if none). */
void cpu_model(char *buf, size_t len);
/* The 1-minute load average, or -1. */
double loadavg(void);
/* A rate for people: "12.30 k", "4.56 M" ("n/a" when unknown). */
const char *human(double v, char *buf, size_t len);
/* A figure for people: 2 decimals below 100, 1 above, 2 significant digits below 0.01. */
const char *num(double v, char *buf, size_t len);
/* One CSV field: the number, or nothing when unknown; then ',' or (last) a newline. */
void csv_num(double v, bool last);
/* Draws columns cols[c][i] against x[i] (log2 x axis of chunk sizes) into
 * o->plot with gnuplot. Returns 0, or 1 after saying why. */
int plot(const struct bench_opts *o, const char *title, const uint64_t *x, unsigned n,
	 const double *const *cols, const char *const *names, const char *const *styles,
	 unsigned ncols);

/* report.c's parts the other reports share. */
/* Opens the JSON document: tool, mode, command, machine, config. */
void json_head(struct jw *j, const struct bench_opts *o);
/* The "proxy" member: binary, extra arguments. */
void json_proxy(struct jw *j, const struct bench_proxy_info *px);
/* A local or tcp point's sizes, window and counts, as members of the open object. */
void json_point_counts(struct jw *j, const struct local_point *p);
/* The same as CSV fields: seconds,bytes,chunks,rooms,errors,gbps,chunks_per_s, each with its comma. */
void csv_point_counts(const struct local_point *p);
/* Closes the JSON document. */
void json_end(struct jw *j);
/* One table row: figure, kvstage value, baseline (base_txt, else base) and what it is, ratio. */
void row(const char *what, const char *kv, double base, const char *base_txt,
	 const char *base_what, double r);
/* The table's column heads. */
void row_head(void);
/* "proxy: BIN how; extra arguments: ..." */
void print_proxy(const struct bench_proxy_info *px, const char *how);
/* "machine: CPU, N CPUs, load; placement" */
void print_machine(void);

#endif
