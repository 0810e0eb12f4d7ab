/* SPDX-License-Identifier: MIT */
/* kvstage-stat --top: a top-like view, rates and one row per peer session
 * and per client, busiest first; redrawn on a terminal. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#include "layout.h"
#include "parse.h"
#include "stat.h"

/* Busiest first: bytes moved per second, then ops per second, then bytes
 * and ops in all; then the oldest id. */
static int by_activity(const void *a, const void *b)
{
	const struct client *x = a, *y = b;
	double kx[] = { x->bytes_sent_s + x->bytes_recv_s, x->ops_s,
			(double)(x->r.bytes_sent + x->r.bytes_recv), (double)x->r.ops };
	double ky[] = { y->bytes_sent_s + y->bytes_recv_s, y->ops_s,
			(double)(y->r.bytes_sent + y->r.bytes_recv), (double)y->r.ops };
	for (int i = 0; i < 4; i++)
		if (kx[i] != ky[i])
			return kx[i] > ky[i] ? -1 : 1;
	return by_id(a, b);
}

/* A number for a narrow column: exact below 1024, else 1024-based with a
 * unit letter ("4.0K", "12M"). */
static const char *compact(double v, char *buf, size_t cap)
{
	static const char unit[] = "KMGTPE";
	if (v < 1024) {
		snprintf(buf, cap, "%.0f", v);
		return buf;
	}
	int u = -1;
	while (v >= 1024 && u < 5) {
		v /= 1024;
		u++;
	}
	snprintf(buf, cap, v < 9.95 ? "%.1f%c" : "%.0f%c", v, unit[u]);
	return buf;
}

static const char *age(uint64_t since_ns, char *buf, size_t cap)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	uint64_t now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
	uint64_t s = now > since_ns ? (now - since_ns) / 1000000000ull : 0;
	if (s < 100)
		snprintf(buf, cap, "%llus", (unsigned long long)s);
	else if (s < 100 * 60)
		snprintf(buf, cap, "%llum", (unsigned long long)(s / 60));
	else if (s < 48 * 3600)
		snprintf(buf, cap, "%lluh", (unsigned long long)(s / 3600));
	else
		snprintf(buf, cap, "%llud", (unsigned long long)(s / 86400));
	return buf;
}

/* --top: one screen (or one plain sample) into f. Sorts tb's clients. */
void print_top(FILE *f, const struct kvs_ctrl *c, const char *path, int restarted,
	       const struct rates *r, struct tables *tb)
{
	const struct kvs_stats *st = &c->stats;
	char a[32], b[32], d[32], e[32], g[32];
	fprintf(f, "kvstaged %s: %s  pid %d  instance %016llx  uptime %.1f s%s\n", path,
		state_word(st), c->proxy_pid, (unsigned long long)c->instance, uptime_s(c),
		restarted ? "  (new instance)" : "");
	fprintf(f, "pool      %u x %s = %s ", c->slot_count,
		kvs_format_size(c->slot_size, a, sizeof(a)),
		kvs_format_size(c->pool_size, b, sizeof(b)));
	for (int i = 0; i < KVS_SLOT_NSTATES; i++)
		fprintf(f, " %s %llu", state_names[i], S(slots[i]));
	if (r->have)
		fprintf(f,
			"\nrates     rooms/s %.1f  GB/s %.3f  aborts/s %.1f  failures/s %.1f"
			"  chunks/s %.0f\n",
			r->per_s[R_ROOMS], r->per_s[R_BYTES] / 1e9, r->per_s[R_ABORTS],
			r->per_s[R_FAILS], r->per_s[R_CHUNKS]);
	else
		fprintf(f, "\nrates     rooms/s -  GB/s -  aborts/s -  failures/s -  chunks/s -\n");
	fprintf(f,
		"rooms     open %llu  done %llu  aborted %llu  failed %llu  timed-out %llu"
		"  clients %u  peers %u\n",
		S(rooms_open), S(rooms_done), S(rooms_aborted), S(rooms_failed), S(rooms_timed_out),
		tb->ncl, tb->npe);
	if (tb->npe) {
		fprintf(f, "\n%-32s %-7s %7s %7s %7s %7s %7s %7s %6s\n", "PEER", "STATE", "STREAMS",
			"LINK", "TX", "TX/s", "RX", "RX/s", "SUNK");
		for (uint32_t i = 0; i < tb->npe; i++) {
			const struct peer_row *k = &tb->pe[i];
			fprintf(f, "%-32s %-7s %7u %7s %7s %7s %7s %7s %6llu\n",
				k->ep[0] ? k->ep : "(joining)", peer_state(k->p.state),
				k->p.streams,
				!(k->p.flags & KVS_PEER_RDMA)	       ? "tcp"
				: !(k->p.flags & KVS_PEER_KEYS_REGION) ? "rdma/w"
				: !(k->p.flags & KVS_PEER_KEYS_WINDOW) ? "rdma/r"
								       : "rdma/wr",
				compact((double)k->p.bytes_tx, a, sizeof(a)),
				k->have ? compact(k->tx_s, b, sizeof(b)) : "-",
				compact((double)k->p.bytes_rx, d, sizeof(d)),
				k->have ? compact(k->rx_s, e, sizeof(e)) : "-",
				(unsigned long long)k->p.chunks_sunk);
		}
	}
	fprintf(f, "\n");
	if (!tb->published) {
		fprintf(f, "(this proxy publishes no clients table)\n");
		return;
	}
	fprintf(f, "%5s %7s %5s %6s %5s %5s %7s %6s %7s %6s %7s %4s %s\n", "ID", "PID", "UID",
		"LEASES", "INFLT", "ROOMS", "OPS/s", "SENT", "SENT/s", "RECV", "RECV/s", "AGE",
		"COMMAND");
	if (tb->ncl > 1)
		qsort(tb->cl, tb->ncl, sizeof(*tb->cl), by_activity);
	for (uint32_t i = 0; i < tb->ncl; i++) {
		const struct client *k = &tb->cl[i];
		char ops[16];
		if (k->have)
			compact(k->ops_s, ops, sizeof(ops));
		fprintf(f, "%5u %7d %5d %6u %5u %5llu %7s %6s %7s %6s %7s %4s %s\n", k->r.id,
			(int)k->r.pid, (int)k->r.uid, k->leases, k->inflight,
			(unsigned long long)k->r.rooms, k->have ? ops : "-",
			compact((double)k->r.bytes_sent, a, sizeof(a)),
			k->have ? compact(k->bytes_sent_s, b, sizeof(b)) : "-",
			compact((double)k->r.bytes_recv, d, sizeof(d)),
			k->have ? compact(k->bytes_recv_s, e, sizeof(e)) : "-",
			age(k->r.since_ns, g, sizeof(g)), k->comm[0] ? k->comm : "-");
	}
}

/* A frame for the terminal: from the top left, each line cut to the width,
 * as many lines as fit (the rest counted on the last). */
void show_frame(const char *text)
{
	struct winsize ws = { 0 };
	unsigned rows = 24, cols = 80;
	if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_row && ws.ws_col)
		rows = ws.ws_row, cols = ws.ws_col;
	unsigned total = 0;
	for (const char *q = text; *q; q++)
		total += *q == '\n';
	/* The last row stays free: a newline there would scroll the screen. */
	unsigned room = rows > 2 ? rows - 1 : 1;
	unsigned keep = total <= room ? total : room - 1;
	fputs("\033[H\033[2J", stdout);
	const char *q = text;
	for (unsigned i = 0; i < keep && *q; i++) {
		const char *eol = strchr(q, '\n');
		size_t n = eol ? (size_t)(eol - q) : strlen(q);
		printf("%.*s\n", (int)(n < cols ? n : cols), q);
		q += n + (eol != NULL);
	}
	if (keep < total)
		printf("... %u more lines\n", total - keep);
}
