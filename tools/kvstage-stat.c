/* SPDX-License-Identifier: MIT */
/* kvstage-stat: what the proxy publishes in its read-only control segment. */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "admin.h"
#include "kvstage.h"
#include "layout.h"
#include "parse.h"

static const char *const state_names[KVS_SLOT_NSTATES] = {
	"free", "leased", "inflight", "tombstone", "recv_posted", "recv_filled",
};

static void usage(FILE *f)
{
	fprintf(f,
"Usage: kvstage-stat [OPTION]...\n"
"Show a running kvstaged's state (serving or draining), pool, slots, rooms,\n"
"clients and counters.\n"
"\n"
"  -s, --socket PATH   proxy socket (default $KVSTAGE_SOCKET, else " KVS_DEFAULT_SOCKET ")\n"
"  -j, --json          one JSON object per sample (one line each), with a\n"
"                      clients_table: one entry per attached client\n"
"  -w, --watch MS      sample every MS milliseconds (1 to 2147483647), with\n"
"                      rates since the previous sample (rooms/s, aborts/s,\n"
"                      GB/s) from the second one on, until\n"
"                      interrupted; each sample asks the proxy anew, so a proxy\n"
"                      that is down gets one line saying why, and one that\n"
"                      comes back (a new instance) is shown again\n"
"  -t, --top[=MS]      a top-like view, redrawn every MS milliseconds (default\n"
"                      --watch's, else 1000): rates, one row per peer session\n"
"                      and one per client, busiest first; plain samples, no\n"
"                      escape codes, when stdout is not a terminal\n"
"      --slots         also list every slot that is not free (not with --top)\n"
"  -h, --help          show this help\n"
"  -V, --version       show the version\n"
"\n"
"Exit status: 0 shown, 1 no proxy could be read (without --watch), 2 bad command line.\n");
}

#define S(f) ((unsigned long long)__atomic_load_n(&st->f, __ATOMIC_RELAXED))

static double uptime_s(const struct kvs_ctrl *c)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	uint64_t now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
	return (double)(now - c->started_ns) / 1e9;
}

/* The slots of the table that lie inside the mapping (all of them, from a
 * proxy of this ABI). */
static uint32_t table_slots(const struct kvs_ctrl *c, size_t len)
{
	if (c->slots_off > len || c->slots_off % _Alignof(struct kvs_slot))
		return 0;
	uint64_t fit = (len - c->slots_off) / sizeof(struct kvs_slot);
	return c->slot_count < fit ? c->slot_count : (uint32_t)fit;
}

/* The peer table, where it lies inside the mapping. */
static uint32_t peer_rows(const struct kvs_ctrl *c, size_t len, const struct kvs_peer **t)
{
	if (!c->peers_off || c->peers_off > len || c->peers_off % _Alignof(struct kvs_peer))
		return 0;
	uint64_t fit = (len - c->peers_off) / sizeof(struct kvs_peer);
	*t = (const void *)((const char *)c + c->peers_off);
	return c->peer_count < fit ? c->peer_count : (uint32_t)fit;
}


static const char *peer_state(uint32_t st)
{
	return st == KVS_PEER_UP ? "up" : st == KVS_PEER_JOINING ? "joining" : "?";
}

static const char *state_word(const struct kvs_stats *st)
{
	return S(draining) ? "draining" : "serving";
}

/* --watch: rates over the time since the previous sample of the same
 * proxy instance (none on the first sample, nor across a restart). */
enum { R_ROOMS, R_ABORTS, R_FAILS, R_CHUNKS, R_BYTES, R_TCP_TX, R_TCP_RX, R_RDMA_RX, R_N };
struct rates {
	bool have;
	double per_s[R_N];
};

static void rates_take(const struct kvs_ctrl *c, struct rates *r)
{
	static uint64_t inst, prev[R_N];
	static struct timespec prev_t;
	const struct kvs_stats *st = &c->stats;
	uint64_t now[R_N] = { S(rooms_done), S(rooms_aborted), S(rooms_failed) + S(rooms_timed_out),
			      S(chunks_moved), S(bytes_moved), S(tcp_bytes_tx), S(tcp_bytes_rx),
			      S(rdma_bytes_rx) };
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	double dt = (double)(t.tv_sec - prev_t.tv_sec) + (double)(t.tv_nsec - prev_t.tv_nsec) / 1e9;
	r->have = inst == c->instance && dt > 0;
	for (int i = 0; i < R_N && r->have; i++)
		r->per_s[i] = now[i] >= prev[i] ? (double)(now[i] - prev[i]) / dt : 0;
	inst = c->instance;
	prev_t = t;
	memcpy(prev, now, sizeof(prev));
}

/* ------------------------------------------------ clients and peers */

#define LD(x) __atomic_load_n(&(x), __ATOMIC_RELAXED)

/* One attached client: a consistent copy of its row, what it holds by the
 * slot table, and its rates since the previous sample that had it. */
struct client {
	struct kvs_client_row r;
	uint32_t leases;   /* slots it owns that it holds: leased, recv_filled */
	uint32_t inflight; /* slots it owns in a transport's hands: inflight, recv_posted */
	char comm[20];     /* /proc/PID/comm, as this tool sees that pid; "" if unknown */
	bool have;         /* the rates below are set */
	double ops_s, chunks_sent_s, bytes_sent_s, chunks_recv_s, bytes_recv_s;
};

struct peer_row {
	struct kvs_peer p;
	char ep[sizeof(((struct kvs_peer *)0)->endpoint) + 1];
	bool have;
	double tx_s, rx_s;
};

struct tables {
	bool published; /* the proxy publishes a clients table (older ones do not) */
	struct client *cl;
	uint32_t ncl;
	struct peer_row *pe;
	uint32_t npe;
};

/* The row fields this tool reads: a proxy's rows must be at least this big. */
#define ROW_MIN offsetof(struct kvs_client_row, rsvd)

/* The clients table, where it lies inside the mapping; *step: its row size. */
static uint32_t client_rows(const struct kvs_ctrl *c, size_t len, const uint8_t **t, size_t *step)
{
	uint64_t off = c->clients_off, sz = c->client_row_size;
	if (!off || off > len || off % 8 || sz < ROW_MIN || sz % 8)
		return 0;
	uint64_t fit = (len - off) / sz;
	*t = (const uint8_t *)c + off;
	*step = (size_t)sz;
	return c->client_count < fit ? c->client_count : (uint32_t)fit;
}

/* Copies row s into d. Returns false if it holds no client, or if its
 * client changed while it was copied. */
static bool row_copy(const struct kvs_client_row *s, struct kvs_client_row *d)
{
	uint32_t id = __atomic_load_n(&s->id, __ATOMIC_ACQUIRE);
	if (!id)
		return false;
	*d = (struct kvs_client_row){
		.id = id, .pid = LD(s->pid), .uid = LD(s->uid), .gid = LD(s->gid),
		.since_ns = LD(s->since_ns), .ops = LD(s->ops), .rejects = LD(s->rejects),
		.rooms = LD(s->rooms), .rooms_done = LD(s->rooms_done),
		.rooms_aborted = LD(s->rooms_aborted), .rooms_failed = LD(s->rooms_failed),
		.chunks_sent = LD(s->chunks_sent), .bytes_sent = LD(s->bytes_sent),
		.chunks_recv = LD(s->chunks_recv), .bytes_recv = LD(s->bytes_recv),
	};
	__atomic_thread_fence(__ATOMIC_ACQUIRE);
	return LD(s->id) == id;
}

static int by_id(const void *a, const void *b)
{
	uint32_t x = ((const struct client *)a)->r.id, y = ((const struct client *)b)->r.id;
	return x < y ? -1 : x > y;
}

static struct client *find_client(struct client *cl, uint32_t n, uint32_t id)
{
	struct client key = { .r.id = id };
	return n ? bsearch(&key, cl, n, sizeof(*cl), by_id) : NULL;
}

static void read_comm(int32_t pid, char *buf, size_t cap)
{
	buf[0] = 0;
	if (pid <= 0)
		return;
	char path[64];
	snprintf(path, sizeof(path), "/proc/%d/comm", (int)pid);
	FILE *f = fopen(path, "re");
	if (!f)
		return;
	if (fgets(buf, (int)cap, f))
		buf[strcspn(buf, "\n")] = 0;
	else
		buf[0] = 0;
	fclose(f);
}

static double since_s(const struct timespec *a, const struct timespec *b)
{
	return (double)(b->tv_sec - a->tv_sec) + (double)(b->tv_nsec - a->tv_nsec) / 1e9;
}

static double per_s(uint64_t now, uint64_t prev, double dt)
{
	return now >= prev ? (double)(now - prev) / dt : 0;
}

static void tables_free(struct tables *tb)
{
	free(tb->cl);
	free(tb->pe);
	*tb = (struct tables){ 0 };
}

/* Reads the clients and peers of one sample, with rates since the previous
 * sample of the same proxy instance (a client by its id, a peer session by
 * its row and the peer's instance). */
static void tables_take(const struct kvs_ctrl *c, size_t len, struct tables *tb)
{
	static uint64_t inst;
	static struct timespec prev_t;
	static struct tables prev;
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	double dt = since_s(&prev_t, &t);
	bool rates = inst == c->instance && dt > 0;
	*tb = (struct tables){ 0 };

	const uint8_t *rows = NULL;
	size_t step = 0;
	uint32_t n = client_rows(c, len, &rows, &step);
	tb->published = n > 0;
	tb->cl = n ? calloc(n, sizeof(*tb->cl)) : NULL;
	if (n && !tb->cl) {
		fprintf(stderr, "kvstage-stat: out of memory\n");
		exit(1);
	}
	for (uint32_t i = 0; i < n; i++) {
		struct client *k = &tb->cl[tb->ncl];
		if (row_copy((const struct kvs_client_row *)(rows + (size_t)i * step), &k->r))
			tb->ncl++;
	}
	if (tb->ncl > 1)
		qsort(tb->cl, tb->ncl, sizeof(*tb->cl), by_id);
	/* What each holds: the slot table's owners. */
	uint32_t ns = tb->ncl ? table_slots(c, len) : 0;
	const struct kvs_slot *st = (const void *)((const char *)c + c->slots_off);
	for (uint32_t i = 0; i < ns; i++) {
		uint32_t owner = LD(st[i].owner);
		struct client *k = owner ? find_client(tb->cl, tb->ncl, owner) : NULL;
		if (!k)
			continue;
		uint8_t s = LD(st[i].state);
		if (s == KVS_SLOT_LEASED || s == KVS_SLOT_RECV_FILLED)
			k->leases++;
		else if (s == KVS_SLOT_INFLIGHT || s == KVS_SLOT_RECV_POSTED)
			k->inflight++;
	}
	for (uint32_t i = 0; i < tb->ncl; i++) {
		struct client *k = &tb->cl[i];
		read_comm(k->r.pid, k->comm, sizeof(k->comm));
		const struct client *o = rates ? find_client(prev.cl, prev.ncl, k->r.id) : NULL;
		if (!o)
			continue;
		k->have = true;
		k->ops_s = per_s(k->r.ops, o->r.ops, dt);
		k->chunks_sent_s = per_s(k->r.chunks_sent, o->r.chunks_sent, dt);
		k->bytes_sent_s = per_s(k->r.bytes_sent, o->r.bytes_sent, dt);
		k->chunks_recv_s = per_s(k->r.chunks_recv, o->r.chunks_recv, dt);
		k->bytes_recv_s = per_s(k->r.bytes_recv, o->r.bytes_recv, dt);
	}

	const struct kvs_peer *pt = NULL;
	uint32_t np = peer_rows(c, len, &pt);
	tb->pe = np ? calloc(np, sizeof(*tb->pe)) : NULL;
	if (np && !tb->pe) {
		fprintf(stderr, "kvstage-stat: out of memory\n");
		exit(1);
	}
	for (uint32_t i = 0; i < np; i++) {
		const struct kvs_peer *p = &pt[i];
		uint32_t state = LD(p->state);
		if (state == KVS_PEER_FREE)
			continue;
		struct peer_row *k = &tb->pe[tb->npe++];
		memcpy(k->p.endpoint, p->endpoint, sizeof(p->endpoint));
		memcpy(k->ep, p->endpoint, sizeof(p->endpoint));
		k->p.state = state;
		k->p.streams = LD(p->streams);
		k->p.instance = LD(p->instance);
		k->p.bytes_tx = LD(p->bytes_tx);
		k->p.bytes_rx = LD(p->bytes_rx);
		k->p.chunks_sunk = LD(p->chunks_sunk);
		k->p.flags = LD(p->flags);
		k->p.rsvd = i; /* its row: what the next sample matches it by */
		for (uint32_t j = 0; rates && j < prev.npe; j++) {
			const struct peer_row *o = &prev.pe[j];
			if (o->p.rsvd == i && o->p.instance == k->p.instance) {
				k->have = true;
				k->tx_s = per_s(k->p.bytes_tx, o->p.bytes_tx, dt);
				k->rx_s = per_s(k->p.bytes_rx, o->p.bytes_rx, dt);
				break;
			}
		}
	}

	/* Kept for the next sample (the caller's copy is its own). */
	tables_free(&prev);
	prev = *tb;
	prev.cl = tb->ncl ? malloc(tb->ncl * sizeof(*tb->cl)) : NULL;
	prev.pe = tb->npe ? malloc(tb->npe * sizeof(*tb->pe)) : NULL;
	if ((tb->ncl && !prev.cl) || (tb->npe && !prev.pe)) {
		fprintf(stderr, "kvstage-stat: out of memory\n");
		exit(1);
	}
	if (tb->ncl)
		memcpy(prev.cl, tb->cl, tb->ncl * sizeof(*tb->cl));
	if (tb->npe)
		memcpy(prev.pe, tb->pe, tb->npe * sizeof(*tb->pe));
	inst = c->instance;
	prev_t = t;
}

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
static void print_top(FILE *f, const struct kvs_ctrl *c, const char *path, int restarted,
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
		fprintf(f, "\nrates     rooms/s %.1f  GB/s %.3f  aborts/s %.1f  failures/s %.1f"
			   "  chunks/s %.0f\n",
			r->per_s[R_ROOMS], r->per_s[R_BYTES] / 1e9, r->per_s[R_ABORTS],
			r->per_s[R_FAILS], r->per_s[R_CHUNKS]);
	else
		fprintf(f, "\nrates     rooms/s -  GB/s -  aborts/s -  failures/s -  chunks/s -\n");
	fprintf(f, "rooms     open %llu  done %llu  aborted %llu  failed %llu  timed-out %llu"
		   "  clients %u  peers %u\n",
		S(rooms_open), S(rooms_done), S(rooms_aborted), S(rooms_failed), S(rooms_timed_out),
		tb->ncl, tb->npe);
	if (tb->npe) {
		fprintf(f, "\n%-32s %-7s %7s %4s %7s %7s %7s %7s %6s\n", "PEER", "STATE", "STREAMS",
			"LINK", "TX", "TX/s", "RX", "RX/s", "SUNK");
		for (uint32_t i = 0; i < tb->npe; i++) {
			const struct peer_row *k = &tb->pe[i];
			fprintf(f, "%-32s %-7s %7u %4s %7s %7s %7s %7s %6llu\n",
				k->ep[0] ? k->ep : "(joining)", peer_state(k->p.state), k->p.streams,
				k->p.flags & KVS_PEER_RDMA ? "rdma" : "tcp",
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
static void show_frame(const char *text)
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

#define P(f) ((unsigned long long)__atomic_load_n(&p->f, __ATOMIC_RELAXED))

static void print_human(const struct kvs_ctrl *c, size_t len, const char *path, int slots,
			int restarted, const struct rates *r)
{
	const struct kvs_stats *st = &c->stats;
	printf("kvstaged %s: %s  pid %d  instance %016llx  uptime %.1f s%s\n", path,
	       state_word(st), c->proxy_pid, (unsigned long long)c->instance, uptime_s(c),
	       restarted ? "  (new instance)" : "");
	char slot[32], pool[32];
	printf("pool      %u slots x %s = %s  hugepages %s  locked %s  failpoints %s\n",
	       c->slot_count, kvs_format_size(c->slot_size, slot, sizeof(slot)),
	       kvs_format_size(c->pool_size, pool, sizeof(pool)),
	       c->flags & KVS_CTRL_HUGEPAGES ? "yes" : "no",
	       c->flags & KVS_CTRL_LOCKED ? "yes" : "no",
	       c->flags & KVS_CTRL_FAILPOINTS ? "on" : "off");
	printf("slots    ");
	for (int i = 0; i < KVS_SLOT_NSTATES; i++)
		printf(" %s %llu", state_names[i], S(slots[i]));
	printf("\nrooms     open %llu  done %llu  aborted %llu  failed %llu  timed-out %llu\n",
	       S(rooms_open), S(rooms_done), S(rooms_aborted), S(rooms_failed),
	       S(rooms_timed_out));
	printf("clients   now %llu  total %llu  closed %llu  died %llu  refused %llu\n", S(clients),
	       S(clients_total), S(clients_closed), S(clients_died), S(clients_refused));
	printf("rejected  stale %llu  perm %llu  busy %llu  inval %llu  token %llu  nobufs %llu"
	       "  log-suppressed %llu\n",
	       S(rej_stale), S(rej_perm), S(rej_busy), S(rej_inval), S(rej_token), S(rej_nobufs),
	       S(log_suppressed));
	printf("traffic   chunks %llu  bytes %llu  ops %llu  events %llu  dropped %llu  reaped %llu"
	       "  sleeps %llu\n",
	       S(chunks_moved), S(bytes_moved), S(ops), S(events), S(events_dropped),
	       S(tombstones_reaped), S(sleeps));
	printf("tcp       peers %llu  lost %llu  auth-failed %llu  refused %llu  frames-refused %llu"
	       "  frames-ignored %llu  crc-errors %llu  discarded %llu  tx %llu  rx %llu\n",
	       S(peer_sessions), S(peer_lost), S(peer_auth_failed), S(peer_refused),
	       S(peer_frames_refused), S(peer_frames_ignored), S(peer_crc_errors),
	       S(chunks_discarded), S(tcp_bytes_tx), S(tcp_bytes_rx));
	printf("rdma      reads %llu  rx %llu\n", S(rdma_reads), S(rdma_bytes_rx));
	if (r && r->have)
		printf("rates     rooms/s %.1f  aborts/s %.1f  failures/s %.1f  chunks/s %.0f  GB/s %.3f"
		       "  tcp tx %.3f rx %.3f GB/s  rdma rx %.3f GB/s\n",
		       r->per_s[R_ROOMS], r->per_s[R_ABORTS], r->per_s[R_FAILS], r->per_s[R_CHUNKS],
		       r->per_s[R_BYTES] / 1e9, r->per_s[R_TCP_TX] / 1e9, r->per_s[R_TCP_RX] / 1e9,
		       r->per_s[R_RDMA_RX] / 1e9);
	const struct kvs_peer *pt = NULL;
	uint32_t np = peer_rows(c, len, &pt);
	for (uint32_t i = 0; i < np; i++) {
		const struct kvs_peer *p = &pt[i];
		uint32_t st = __atomic_load_n(&p->state, __ATOMIC_RELAXED);
		if (st == KVS_PEER_FREE)
			continue;
		char ep[sizeof(p->endpoint) + 1] = { 0 };
		memcpy(ep, p->endpoint, sizeof(p->endpoint));
		printf("peer      %s  %s  streams %llu  instance %016llx  tx %llu  rx %llu  sunk %llu  "
		       "chunks by %s\n",
		       ep[0] ? ep : "(joining)", peer_state(st), P(streams), P(instance), P(bytes_tx),
		       P(bytes_rx), P(chunks_sunk), P(flags) & KVS_PEER_RDMA ? "rdma" : "tcp");
	}
	if (!slots)
		return;
	uint32_t n = table_slots(c, len);
	const struct kvs_slot *t = n ? (const void *)((const char *)c + c->slots_off) : NULL;
	printf("slot      state        epoch      owner  pins  room\n");
	for (uint32_t i = 0; i < n; i++) {
		struct kvs_slot s = t[i];
		if (s.state != KVS_SLOT_FREE && s.state < KVS_SLOT_NSTATES)
			printf("%-9u %-12s %-10u %-6u %-5u %u\n", i, state_names[s.state], s.epoch,
			       s.owner, s.pins, s.room ? s.room - 1 : 0);
	}
	if (n < c->slot_count)
		printf("(slots %u to %u lie outside the control segment)\n", n, c->slot_count - 1);
}

static void json_key(const char *key)
{
	kvs_json_string(stdout, key);
	putchar(':');
}

static void print_json(const struct kvs_ctrl *c, size_t len, const char *path, int slots,
		       const struct rates *r, const struct tables *tb)
{
	const struct kvs_stats *st = &c->stats;
	char inst[24];
	snprintf(inst, sizeof(inst), "%016llx", (unsigned long long)c->instance);
	printf("{");
	json_key("socket");
	kvs_json_string(stdout, path);
	printf(",\"up\":true,\"draining\":%s,\"pid\":%d,", S(draining) ? "true" : "false",
	       c->proxy_pid);
	json_key("instance");
	kvs_json_string(stdout, inst);
	printf(",\"uptime_s\":%.3f,", uptime_s(c));
	if (r && r->have)
		printf("\"rates\":{\"rooms_per_s\":%.3f,\"aborts_per_s\":%.3f,\"failures_per_s\":%.3f,"
		       "\"chunks_per_s\":%.3f,\"bytes_per_s\":%.0f,\"tcp_tx_bytes_per_s\":%.0f,"
		       "\"tcp_rx_bytes_per_s\":%.0f,\"rdma_rx_bytes_per_s\":%.0f},",
		       r->per_s[R_ROOMS], r->per_s[R_ABORTS], r->per_s[R_FAILS], r->per_s[R_CHUNKS],
		       r->per_s[R_BYTES], r->per_s[R_TCP_TX], r->per_s[R_TCP_RX], r->per_s[R_RDMA_RX]);
	else if (r)
		printf("\"rates\":null,");
	printf("\"slot_count\":%u,\"slot_size\":%llu,\"pool_size\":%llu,\"hugepages\":%s,"
	       "\"locked\":%s,\"failpoints\":%s,\"slot_metadata_bytes\":%zu,\"slots\":{",
	       c->slot_count, (unsigned long long)c->slot_size, (unsigned long long)c->pool_size,
	       c->flags & KVS_CTRL_HUGEPAGES ? "true" : "false",
	       c->flags & KVS_CTRL_LOCKED ? "true" : "false",
	       c->flags & KVS_CTRL_FAILPOINTS ? "true" : "false", sizeof(struct kvs_slot));
	for (int i = 0; i < KVS_SLOT_NSTATES; i++) {
		if (i)
			putchar(',');
		json_key(state_names[i]);
		printf("%llu", S(slots[i]));
	}
	printf("},\"rooms\":{\"open\":%llu,\"done\":%llu,\"aborted\":%llu,\"failed\":%llu,"
	       "\"timed_out\":%llu},",
	       S(rooms_open), S(rooms_done), S(rooms_aborted), S(rooms_failed), S(rooms_timed_out));
	printf("\"clients\":{\"now\":%llu,\"total\":%llu,\"closed\":%llu,\"died\":%llu,"
	       "\"refused\":%llu},",
	       S(clients), S(clients_total), S(clients_closed), S(clients_died), S(clients_refused));
	printf("\"rejected\":{\"stale\":%llu,\"perm\":%llu,\"busy\":%llu,\"inval\":%llu,"
	       "\"token\":%llu,\"nobufs\":%llu},",
	       S(rej_stale), S(rej_perm), S(rej_busy), S(rej_inval), S(rej_token), S(rej_nobufs));
	printf("\"chunks_moved\":%llu,\"bytes_moved\":%llu,\"ops\":%llu,\"events\":%llu,"
	       "\"events_dropped\":%llu,\"tombstones_reaped\":%llu,\"sleeps\":%llu,"
	       "\"log_suppressed\":%llu",
	       S(chunks_moved), S(bytes_moved), S(ops), S(events), S(events_dropped),
	       S(tombstones_reaped), S(sleeps), S(log_suppressed));
	printf(",\"tcp\":{\"peers\":%llu,\"lost\":%llu,\"auth_failed\":%llu,\"refused\":%llu,"
	       "\"frames_refused\":%llu,\"frames_ignored\":%llu,\"crc_errors\":%llu,"
	       "\"chunks_discarded\":%llu,\"bytes_tx\":%llu,\"bytes_rx\":%llu},"
	       "\"rdma\":{\"reads\":%llu,\"bytes_rx\":%llu},\"peers\":[",
	       S(peer_sessions), S(peer_lost), S(peer_auth_failed), S(peer_refused),
	       S(peer_frames_refused), S(peer_frames_ignored), S(peer_crc_errors),
	       S(chunks_discarded), S(tcp_bytes_tx), S(tcp_bytes_rx), S(rdma_reads), S(rdma_bytes_rx));
	const struct kvs_peer *pt = NULL;
	uint32_t np = peer_rows(c, len, &pt);
	for (uint32_t i = 0, first = 1; i < np; i++) {
		const struct kvs_peer *p = &pt[i];
		uint32_t st = __atomic_load_n(&p->state, __ATOMIC_RELAXED);
		if (st == KVS_PEER_FREE)
			continue;
		char ep[sizeof(p->endpoint) + 1] = { 0 };
		memcpy(ep, p->endpoint, sizeof(p->endpoint));
		printf("%s{\"endpoint\":", first ? "" : ",");
		kvs_json_string(stdout, ep);
		printf(",\"state\":\"%s\",\"streams\":%llu,\"instance\":\"%016llx\",\"bytes_tx\":%llu,"
		       "\"bytes_rx\":%llu,\"chunks_sunk\":%llu,\"rdma\":%s}",
		       peer_state(st), P(streams), P(instance), P(bytes_tx), P(bytes_rx), P(chunks_sunk),
		       P(flags) & KVS_PEER_RDMA ? "true" : "false");
		first = 0;
	}
	printf("]");
	/* The clients, by id; with --watch each has its rates (null on the
	 * first sample that has it). */
	if (tb->published) {
		printf(",\"clients_table\":[");
		for (uint32_t i = 0; i < tb->ncl; i++) {
			const struct client *k = &tb->cl[i];
			printf("%s{\"id\":%u,\"pid\":%d,\"uid\":%u,\"gid\":%u,\"command\":", i ? "," : "",
			       k->r.id, (int)k->r.pid, k->r.uid, k->r.gid);
			if (k->comm[0])
				kvs_json_string(stdout, k->comm);
			else
				printf("null");
			printf(",\"since_ns\":%llu,\"leases\":%u,\"inflight\":%u,\"rooms_open\":%llu,"
			       "\"rooms_done\":%llu,\"rooms_aborted\":%llu,\"rooms_failed\":%llu,"
			       "\"ops\":%llu,\"rejects\":%llu,\"chunks_sent\":%llu,\"bytes_sent\":%llu,"
			       "\"chunks_recv\":%llu,\"bytes_recv\":%llu",
			       (unsigned long long)k->r.since_ns, k->leases, k->inflight,
			       (unsigned long long)k->r.rooms, (unsigned long long)k->r.rooms_done,
			       (unsigned long long)k->r.rooms_aborted,
			       (unsigned long long)k->r.rooms_failed, (unsigned long long)k->r.ops,
			       (unsigned long long)k->r.rejects, (unsigned long long)k->r.chunks_sent,
			       (unsigned long long)k->r.bytes_sent, (unsigned long long)k->r.chunks_recv,
			       (unsigned long long)k->r.bytes_recv);
			if (k->have)
				printf(",\"rates\":{\"ops_per_s\":%.3f,\"chunks_sent_per_s\":%.3f,"
				       "\"bytes_sent_per_s\":%.0f,\"chunks_recv_per_s\":%.3f,"
				       "\"bytes_recv_per_s\":%.0f}",
				       k->ops_s, k->chunks_sent_s, k->bytes_sent_s, k->chunks_recv_s,
				       k->bytes_recv_s);
			else if (r)
				printf(",\"rates\":null");
			printf("}");
		}
		printf("]");
	} else {
		printf(",\"clients_table\":null");
	}
	if (slots) {
		uint32_t n = table_slots(c, len);
		const struct kvs_slot *t = n ? (const void *)((const char *)c + c->slots_off) : NULL;
		printf(",\"slot_table\":[");
		int first = 1;
		for (uint32_t i = 0; i < n; i++) {
			struct kvs_slot s = t[i];
			if (s.state == KVS_SLOT_FREE || s.state >= KVS_SLOT_NSTATES)
				continue;
			printf("%s{\"slot\":%u,\"state\":", first ? "" : ",", i);
			kvs_json_string(stdout, state_names[s.state]);
			printf(",\"epoch\":%u,\"owner\":%u,\"pins\":%u}", s.epoch, s.owner, s.pins);
			first = 0;
		}
		printf("]");
		if (n < c->slot_count)
			printf(",\"slot_table_truncated\":true");
	}
	printf("}\n");
}

/* A sample that found no readable proxy: up says whether one answered. */
static void print_down(const char *path, int json, int up, const char *why)
{
	if (!json) {
		printf("kvstaged %s: %s (%s)\n", path, up ? "unreadable" : "down", why);
		return;
	}
	printf("{");
	json_key("socket");
	kvs_json_string(stdout, path);
	printf(",\"up\":%s,", up ? "true" : "false");
	json_key("error");
	kvs_json_string(stdout, why);
	printf("}\n");
}

#define ABI_STR_(x) #x
#define ABI_STR(x) ABI_STR_(x)
#define ABI_WHY "it speaks another ABI (its control segment is not kvstage ABI " ABI_STR(KVS_ABI) ")"

/* Maps the proxy's control segment afresh. Returns 0 (unmap *c after use),
 * -1 (no proxy answered) or -2 (one answered with a segment this tool cannot
 * read), with *why set. */
static int sample_map(const char *path, const struct kvs_ctrl **c, size_t *len, const char **why)
{
	int rc = kvs_stat_map(path, c, len);
	if (rc < 0) {
		*why = kvs_strerror(rc);
		return -1;
	}
	if (*len < sizeof(struct kvs_ctrl) || (*c)->magic != KVS_MAGIC_CTRL ||
	    (*c)->abi != KVS_ABI) {
		munmap((void *)*c, *len);
		*why = ABI_WHY;
		return -2;
	}
	return 0;
}

static void stdout_check(void)
{
	if (fflush(stdout) == EOF || ferror(stdout)) {
		fprintf(stderr, "kvstage-stat: writing the sample: %s\n", strerror(errno));
		exit(1);
	}
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "socket", required_argument, NULL, 's' }, { "json", no_argument, NULL, 'j' },
		{ "watch", required_argument, NULL, 'w' },  { "slots", no_argument, NULL, 'S' },
		{ "top", optional_argument, NULL, 't' },
		{ "help", no_argument, NULL, 'h' },         { "version", no_argument, NULL, 'V' },
		{ 0 },
	};
	const char *path = getenv("KVSTAGE_SOCKET");
	int json = 0, slots = 0, top = 0, opt;
	uint64_t watch = 0, top_ms = 0;
	while ((opt = getopt_long(argc, argv, "s:jw:t::hV", opts, NULL)) != -1) {
		switch (opt) {
		case 's': path = optarg; break;
		case 'j': json = 1; break;
		case 'S': slots = 1; break;
		case 'w':
			if (kvs_parse_uint(optarg, INT_MAX, &watch) || !watch) {
				fprintf(stderr, "kvstage-stat: invalid --watch '%s': want milliseconds "
						"from 1 to %d (digits only)\n",
					optarg, INT_MAX);
				return 2;
			}
			break;
		case 't':
			top = 1;
			if (optarg && (kvs_parse_uint(optarg, INT_MAX, &top_ms) || !top_ms)) {
				fprintf(stderr, "kvstage-stat: invalid --top '%s': want milliseconds "
						"from 1 to %d (digits only)\n",
					optarg, INT_MAX);
				return 2;
			}
			break;
		case 'h': usage(stdout); return 0;
		case 'V': printf("kvstage-stat %s\n", KVS_VERSION_STRING); return 0;
		default: fprintf(stderr, "Try 'kvstage-stat --help'.\n"); return 2;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "kvstage-stat: unexpected argument '%s'\n", argv[optind]);
		return 2;
	}
	if (top && slots) {
		fprintf(stderr, "kvstage-stat: --slots does not go with --top\n");
		return 2;
	}
	if (top)
		watch = top_ms ? top_ms : watch ? watch : 1000;
	/* Only a terminal gets a redrawn screen; anything else, plain samples. */
	bool screen = top && !json && isatty(STDOUT_FILENO);
	if (!path || !*path)
		path = KVS_DEFAULT_SOCKET;
	uint64_t last_instance = 0;
	for (int first = 1;; first = 0) {
		const struct kvs_ctrl *c;
		size_t len;
		const char *why;
		int rc = sample_map(path, &c, &len, &why);
		if (rc < 0 && !watch) {
			fprintf(stderr, "kvstage-stat: %s: %s\n", path, why);
			return 1;
		}
		if (!first && !json && !screen)
			printf("\n");
		if (rc < 0) {
			if (screen)
				fputs("\033[H\033[2J", stdout);
			print_down(path, json, rc == -2, why);
		} else {
			struct rates r;
			struct tables tb = { 0 };
			int restarted = last_instance && c->instance != last_instance;
			rates_take(c, &r);
			if (json || top)
				tables_take(c, len, &tb);
			if (json) {
				print_json(c, len, path, slots, watch ? &r : NULL, &tb);
			} else if (screen) {
				char *text = NULL;
				size_t n = 0;
				FILE *f = open_memstream(&text, &n);
				if (!f) {
					fprintf(stderr, "kvstage-stat: out of memory\n");
					return 1;
				}
				print_top(f, c, path, restarted, &r, &tb);
				fclose(f);
				show_frame(text);
				free(text);
			} else if (top) {
				print_top(stdout, c, path, restarted, &r, &tb);
			} else {
				print_human(c, len, path, slots, restarted, watch ? &r : NULL);
			}
			tables_free(&tb);
			last_instance = c->instance;
			munmap((void *)c, len);
		}
		stdout_check();
		if (!watch)
			return 0;
		struct timespec ts = { (time_t)(watch / 1000), (long)(watch % 1000) * 1000000 };
		while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
			;
	}
}
