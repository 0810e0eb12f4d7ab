/* SPDX-License-Identifier: MIT */
/* kvstage-stat's parts: what the sampling (tables.c) hands the views
 * (human.c, json.c, top.c) and main.c. Internal to the tool. */
#ifndef KVSTAGE_STAT_H
#define KVSTAGE_STAT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "layout.h"

/* A counter of the struct kvs_stats *st in scope, read once. */
#define S(f) ((unsigned long long)__atomic_load_n(&st->f, __ATOMIC_RELAXED))
/* A counter of the block of the segment c in scope (len bytes of it
 * mapped), by its name, read once. */
#define B(name) block_value(c, len, name)

/* The slot states' names, by enum kvs_slot_state. */
extern const char *const state_names[KVS_SLOT_NSTATES];

/* --watch: rates over the time since the previous sample of the same
 * proxy instance (none on the first sample, nor across a restart). */
enum { R_ROOMS, R_ABORTS, R_FAILS, R_CHUNKS, R_BYTES, R_TCP_TX, R_TCP_RX, R_RDMA_RX, R_N };
struct rates {
	bool have;
	double per_s[R_N];
};

/* One attached client: a consistent copy of its row, what it holds by the
 * slot table, and its rates since the previous sample that had it. */
struct client {
	struct kvs_client_row r;
	uint32_t leases;   /* slots it owns that it holds: leased, recv_filled */
	uint32_t inflight; /* slots it owns in a transport's hands: inflight, recv_posted */
	char comm[20];	   /* /proc/PID/comm, as this tool sees that pid; "" if unknown */
	bool have;	   /* the rates below are set */
	double ops_s, chunks_sent_s, bytes_sent_s, chunks_recv_s, bytes_recv_s;
};

/* One peer session that is not free: a copy of its row's values (not its
 * endpoint: that is ep, as a string), the row it is in (what the next
 * sample matches it by), and its rates since the previous sample that had it. */
struct peer_row {
	struct kvs_peer p;
	char ep[sizeof(((struct kvs_peer *)0)->endpoint) + 1];
	uint32_t row;
	bool have;
	double tx_s, rx_s;
};

/* The clients and peers of one sample. */
struct tables {
	bool published; /* the proxy publishes a clients table (older ones do not) */
	struct client *cl;
	uint32_t ncl;
	struct peer_row *pe;
	uint32_t npe;
};

/* tables.c: reading the control segment c, len bytes of it mapped. */

/* Seconds since the proxy started. */
double uptime_s(const struct kvs_ctrl *c);
/* The slots of the table that lie inside the mapping (all of them, from a
 * proxy of this ABI). */
uint32_t table_slots(const struct kvs_ctrl *c, size_t len);
/* The peer table, where it lies inside the mapping: sets *t, returns its rows. */
uint32_t peer_rows(const struct kvs_ctrl *c, size_t len, const struct kvs_peer **t);
/* A peer row's state as a word: "up", "joining", else "?". */
const char *peer_state(uint32_t st);
/* How chunks go to a peer: "rdma (windows)", "tcp", ... */
const char *peer_link(uint32_t flags);
/* The keys a peer reads our chunks under: "windows", "regions",
 * "windows+regions", or NULL (no RDMA). */
const char *peer_keys(uint32_t flags);
/* The proxy's state as a word: "serving" or "draining". */
const char *state_word(const struct kvs_stats *st);
/* The parts the proxy was built without (its KVS_CTRL_WITHOUT_* flags),
 * in order; n is how many (at most 4). */
unsigned built_without(const struct kvs_ctrl *c, const char *names[4]);
/* Returns the value of the counter block's record called name, or 0 where
 * the proxy has none (a data path it has not got has never counted). */
unsigned long long block_value(const struct kvs_ctrl *c, size_t len, const char *name);
/* True if the views name this block counter in a place of their own (the
 * tcp, syscalls and rdma lines, --json's "tcp" and "rdma"); the others are
 * listed as they come. */
bool block_shown(const char *name);
/* Fills *r with the rates since the previous call for the same instance. */
void rates_take(const struct kvs_ctrl *c, size_t len, struct rates *r);
/* qsort order of struct client: by id, lowest first. */
int by_id(const void *a, const void *b);
/* Reads the clients and peers of one sample into *tb (free it with
 * tables_free), with rates since the previous call for the same instance. */
void tables_take(const struct kvs_ctrl *c, size_t len, struct tables *tb);
/* Frees what tables_take put in *tb and zeroes it. */
void tables_free(struct tables *tb);

/* human.c: the default output, one sample to stdout; r NULL without --watch. */
void print_human(const struct kvs_ctrl *c, size_t len, const char *path, int slots, int restarted,
		 const struct rates *r, const struct tables *tb);

/* json.c: --json, one sample as one line to stdout; r NULL without --watch. */
void print_json(const struct kvs_ctrl *c, size_t len, const char *path, int slots,
		const struct rates *r, const struct tables *tb);
/* Writes key as a JSON string and a colon to stdout. */
void json_key(const char *key);

/* top.c: --top, one screen (or one plain sample) into f. Sorts tb's clients. */
void print_top(FILE *f, const struct kvs_ctrl *c, const char *path, int restarted,
	       const struct rates *r, struct tables *tb);
/* Draws text on the terminal from the top left, cut to its size. */
void show_frame(const char *text);

#endif
