/* SPDX-License-Identifier: MIT */
/* Output machinery: the progress line, notes, a small JSON writer, number
 * formats, machine facts, and the gnuplot driver. What is said per mode is
 * in report.c. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "output.h"

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

/* ---------------------------------------------------------------- JSON */

void jw_sep(struct jw *j, const char *key)
{
	if (!j->first[j->depth])
		fputc(',', j->f);
	j->first[j->depth] = false;
	fputc('\n', j->f);
	for (int i = 0; i < j->depth; i++)
		fputs("  ", j->f);
	if (key) {
		kvs_json_string(j->f, key);
		fputs(": ", j->f);
	}
}

void jw_open(struct jw *j, const char *key, char c)
{
	if (j->depth > 0)
		jw_sep(j, key);
	fputc(c, j->f);
	j->first[++j->depth] = true;
}

void jw_close(struct jw *j, char c)
{
	bool empty = j->first[j->depth];
	j->depth--;
	if (!empty) {
		fputc('\n', j->f);
		for (int i = 0; i < j->depth; i++)
			fputs("  ", j->f);
	}
	fputc(c, j->f);
}

void jw_num(struct jw *j, const char *key, double v)
{
	jw_sep(j, key);
	if (isfinite(v))
		fprintf(j->f, "%.6g", v);
	else
		fputs("null", j->f);
}

/* A figure that may be n/a (negative: unknown). */
void jw_num_na(struct jw *j, const char *key, double v)
{
	jw_num(j, key, v < 0 ? NAN : v);
}

void jw_int(struct jw *j, const char *key, uint64_t v)
{
	jw_sep(j, key);
	fprintf(j->f, "%llu", (unsigned long long)v);
}

void jw_bool(struct jw *j, const char *key, bool v)
{
	jw_sep(j, key);
	fputs(v ? "true" : "false", j->f);
}

void jw_str(struct jw *j, const char *key, const char *s)
{
	jw_sep(j, key);
	kvs_json_string(j->f, s);
}

void jw_lat(struct jw *j, const char *key, const struct lat *l)
{
	jw_open(j, key, '{');
	jw_int(j, "n", l->n);
	jw_num(j, "p50", l->n ? l->p50 : NAN);
	jw_num(j, "p99", l->n ? l->p99 : NAN);
	jw_num(j, "p999", l->n ? l->p999 : NAN);
	jw_num(j, "mean", l->n ? l->mean : NAN);
	jw_num(j, "max", l->n ? l->max : NAN);
	jw_close(j, '}');
}

double ratio(double a, double b)
{
	return a >= 0 && b > 0 ? a / b : NAN;
}

/* --------------------------------------------------------------- common */

void cpu_model(char *buf, size_t len)
{
	snprintf(buf, len, "unknown");
	FILE *f = fopen("/proc/cpuinfo", "r");
	if (!f)
		return;
	char line[512];
	while (fgets(line, sizeof(line), f)) {
		if (strncmp(line, "model name", 10))
			continue;
		char *v = strchr(line, ':');
		if (v) {
			v++;
			while (*v == ' ' || *v == '\t')
				v++;
			v[strcspn(v, "\n")] = 0;
			snprintf(buf, len, "%s", v);
		}
		break;
	}
	fclose(f);
}

double loadavg(void)
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

/* "12.3 k", "4.56 M": a rate for people. */
const char *human(double v, char *buf, size_t len)
{
	if (!isfinite(v) || v < 0)
		snprintf(buf, len, "n/a");
	else if (v >= 1e9)
		snprintf(buf, len, "%.2f G", v / 1e9);
	else if (v >= 1e6)
		snprintf(buf, len, "%.2f M", v / 1e6);
	else if (v >= 1e3)
		snprintf(buf, len, "%.2f k", v / 1e3);
	else
		snprintf(buf, len, "%.2f", v);
	return buf;
}

const char *num(double v, char *buf, size_t len)
{
	if (!isfinite(v) || v < 0)
		snprintf(buf, len, "n/a");
	else if (v != 0 && v < 0.01)
		snprintf(buf, len, "%.2g", v);
	else if (v < 100)
		snprintf(buf, len, "%.2f", v);
	else
		snprintf(buf, len, "%.1f", v);
	return buf;
}

void csv_num(double v, bool last)
{
	if (isfinite(v) && v >= 0)
		printf("%.6g", v);
	putchar(last ? '\n' : ',');
}

/* ---------------------------------------------------------------- plot */

int plot(const struct bench_opts *o, const char *title, const uint64_t *x, unsigned n,
		const double *const *cols, const char *const *names, const char *const *styles,
		unsigned ncols)
{
	char dir[] = "/tmp/kvstage-plot.XXXXXX", data[64], script[64];
	if (!mkdtemp(dir)) {
		fprintf(stderr, "kvstage-bench: --plot: mkdtemp: %s\n", strerror(errno));
		return 1;
	}
	snprintf(data, sizeof(data), "%s/points.dat", dir);
	snprintf(script, sizeof(script), "%s/plot.gp", dir);
	FILE *d = fopen(data, "w"), *s = fopen(script, "w");
	int rc = 1;
	if (!d || !s) {
		fprintf(stderr, "kvstage-bench: --plot: cannot write in %s\n", dir);
		goto out;
	}
	for (unsigned i = 0; i < n; i++) {
		fprintf(d, "%llu", (unsigned long long)x[i]);
		for (unsigned c = 0; c < ncols; c++)
			fprintf(d, " %.6g", cols[c][i] > 0 ? cols[c][i] : NAN);
		fputc('\n', d);
	}
	fclose(d);
	d = NULL;
	size_t len = strlen(o->plot);
	bool svg = !strcmp(o->plot + len - 4, ".svg");
	fprintf(s, "set terminal %s size 900,640 font ',11'\n",
		svg ? "svg dynamic" : "pngcairo");
	fprintf(s, "set output '%s'\n", o->plot);
	fprintf(s, "set title \"%s\" noenhanced\n", title);
	fprintf(s, "set xlabel 'chunk size'\nset ylabel 'GB/s (10^9 bytes/s)'\n");
	fprintf(s, "set logscale x 2\nset grid\nset key below noenhanced\n");
	fprintf(s, "set yrange [0:*]\nset datafile missing 'nan'\n");
	fprintf(s, "set xtics (");
	for (unsigned i = 0; i < n; i++) {
		char cs[16];
		fprintf(s, "%s\"%s\" %llu", i ? ", " : "", bench_size_str(x[i], cs, sizeof(cs)),
			(unsigned long long)x[i]);
	}
	fprintf(s, ")\n");
	if (n == 1)
		fprintf(s, "set xrange [%llu:%llu]\n", (unsigned long long)x[0] / 2,
			(unsigned long long)x[0] * 2);
	fprintf(s, "plot ");
	for (unsigned c = 0; c < ncols; c++)
		fprintf(s, "%s'%s' using 1:%u with %s title '%s'", c ? ", \\\n     " : "", data,
			c + 2, styles[c], names[c]);
	fprintf(s, "\n");
	fclose(s);
	s = NULL;

	fflush(NULL);
	pid_t pid = fork();
	if (pid == 0) {
		execlp("gnuplot", "gnuplot", script, (char *)NULL);
		_exit(errno == ENOENT ? 126 : 127);
	}
	int st = 0;
	if (pid < 0 || waitpid(pid, &st, 0) < 0) {
		fprintf(stderr, "kvstage-bench: --plot: cannot run gnuplot: %s\n", strerror(errno));
	} else if (WIFEXITED(st) && WEXITSTATUS(st) == 126) {
		fprintf(stderr, "kvstage-bench: --plot needs gnuplot, which is not in PATH (Debian: "
				"apt-get install gnuplot-nox)\n");
	} else if (!WIFEXITED(st) || WEXITSTATUS(st)) {
		fprintf(stderr, "kvstage-bench: --plot: gnuplot failed (script kept: %s)\n", script);
		return 1;
	} else {
		if (!o->quiet)
			fprintf(stderr, "kvstage-bench: plot written to %s\n", o->plot);
		rc = 0;
	}
out:
	if (d)
		fclose(d);
	if (s)
		fclose(s);
	unlink(data);
	unlink(script);
	rmdir(dir);
	return rc;
}
