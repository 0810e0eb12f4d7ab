/* SPDX-License-Identifier: MIT */
/* kvstage-stat: reading the proxy's control segment (its counters, the slot
 * table, the peer table and the clients table), with rates between samples. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "layout.h"
#include "stat.h"
#include "statnames.h"

const char *const state_names[KVS_SLOT_NSTATES] = {
	"free", "leased", "inflight", "tombstone", "recv_posted", "recv_filled",
};

double uptime_s(const struct kvs_ctrl *c)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	uint64_t now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
	return (double)(now - c->started_ns) / 1e9;
}

/* The slots of the table that lie inside the mapping (all of them, from a
 * proxy of this ABI). */
uint32_t table_slots(const struct kvs_ctrl *c, size_t len)
{
	if (c->slots_off > len || c->slots_off % _Alignof(struct kvs_slot))
		return 0;
	uint64_t fit = (len - c->slots_off) / sizeof(struct kvs_slot);
	return c->slot_count < fit ? c->slot_count : (uint32_t)fit;
}

/* The peer table, where it lies inside the mapping. */
uint32_t peer_rows(const struct kvs_ctrl *c, size_t len, const struct kvs_peer **t)
{
	if (!c->peers_off || c->peers_off > len || c->peers_off % _Alignof(struct kvs_peer))
		return 0;
	uint64_t fit = (len - c->peers_off) / sizeof(struct kvs_peer);
	*t = (const void *)((const char *)c + c->peers_off);
	return c->peer_count < fit ? c->peer_count : (uint32_t)fit;
}

const char *peer_keys(uint32_t flags)
{
	uint32_t k = flags & (KVS_PEER_KEYS_WINDOW | KVS_PEER_KEYS_REGION);
	return !(flags & KVS_PEER_RDMA)	   ? NULL
	       : k == KVS_PEER_KEYS_WINDOW ? "windows"
	       : k == KVS_PEER_KEYS_REGION ? "regions"
	       : k			   ? "windows+regions"
					   : NULL;
}

const char *peer_link(uint32_t flags)
{
	if (!(flags & KVS_PEER_RDMA))
		return "tcp";
	uint32_t k = flags & (KVS_PEER_KEYS_WINDOW | KVS_PEER_KEYS_REGION);
	return k == KVS_PEER_KEYS_WINDOW   ? "rdma (windows)"
	       : k == KVS_PEER_KEYS_REGION ? "rdma (regions)"
	       : k			   ? "rdma (windows over chunk regions)"
					   : "rdma";
}

const char *peer_state(uint32_t st)
{
	return st == KVS_PEER_UP ? "up" : st == KVS_PEER_JOINING ? "joining" : "?";
}

const char *state_word(const struct kvs_stats *st)
{
	return S(draining) ? "draining" : "serving";
}

unsigned built_without(const struct kvs_ctrl *c, const char *names[4])
{
	static const struct {
		uint32_t flag;
		const char *name;
	} parts[4] = { { KVS_CTRL_WITHOUT_VERBS, "verbs" },
		       { KVS_CTRL_WITHOUT_METRICS, "metrics" },
		       { KVS_CTRL_WITHOUT_SYSTEMD, "systemd" },
		       { KVS_CTRL_WITHOUT_ACL, "acl" } };
	unsigned n = 0;
	for (unsigned i = 0; i < 4; i++)
		if (c->flags & parts[i].flag)
			names[n++] = parts[i].name;
	return n;
}

unsigned long long block_value(const struct kvs_ctrl *c, size_t len, const char *name)
{
	const uint64_t *v = kvs_stat_at(c, len, name);
	return v ? (unsigned long long)__atomic_load_n(v, __ATOMIC_RELAXED) : 0;
}

bool block_shown(const char *name)
{
	static const char *const shown[] = {
		"tcp_bytes_tx",	     "tcp_bytes_rx",	   "tcp_send_calls",   "tcp_recv_calls",
		"tcp_lowat_calls",   "tcp_zc_sends",	   "tcp_zc_copied",    "rdma_reads",
		"rdma_bytes_rx",     "rdma_binds",	   "rdma_invalidates", "rdma_regions",
		"rdma_region_frees", "rdma_reads_refused", "rdma_links_lost",  "rdma_sessions",
	};
	for (size_t i = 0; i < sizeof(shown) / sizeof(shown[0]); i++)
		if (!strcmp(shown[i], name))
			return true;
	return false;
}

void rates_take(const struct kvs_ctrl *c, size_t len, struct rates *r)
{
	static uint64_t inst, prev[R_N];
	static struct timespec prev_t;
	const struct kvs_stats *st = &c->stats;
	uint64_t now[R_N] = {
		S(rooms_done),	   S(rooms_aborted),  S(rooms_failed) + S(rooms_timed_out),
		S(chunks_moved),   S(bytes_moved),    B("tcp_bytes_tx"),
		B("tcp_bytes_rx"), B("rdma_bytes_rx")
	};
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

int by_id(const void *a, const void *b)
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

void tables_free(struct tables *tb)
{
	free(tb->cl);
	free(tb->pe);
	*tb = (struct tables){ 0 };
}

/* Reads the clients and peers of one sample, with rates since the previous
 * sample of the same proxy instance (a client by its id, a peer session by
 * its row and the peer's instance). */
void tables_take(const struct kvs_ctrl *c, size_t len, struct tables *tb)
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
		if (kvs_client_row_read((const struct kvs_client_row *)(rows + (size_t)i * step),
					&k->r))
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
		/* Whatever is in the segment, one line of printable text comes out. */
		memcpy(k->ep, p->endpoint, sizeof(p->endpoint));
		k->ep[sizeof(k->ep) - 1] = 0;
		for (char *e = k->ep; *e; e++)
			if ((unsigned char)*e < ' ' || (unsigned char)*e >= 0x7f)
				*e = '?';
		k->p.state = state;
		k->p.streams = LD(p->streams);
		k->p.instance = LD(p->instance);
		k->p.bytes_tx = LD(p->bytes_tx);
		k->p.bytes_rx = LD(p->bytes_rx);
		k->p.chunks_sunk = LD(p->chunks_sunk);
		k->p.flags = LD(p->flags);
		k->p.reads_refused = LD(p->reads_refused);
		k->row = i;
		for (uint32_t j = 0; rates && j < prev.npe; j++) {
			const struct peer_row *o = &prev.pe[j];
			if (o->row == i && o->p.instance == k->p.instance) {
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
