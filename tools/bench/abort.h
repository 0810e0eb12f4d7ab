/* SPDX-License-Identifier: MIT */
/*
 * The abort mode's two halves: the parent (abort.c) forks the pairs and
 * reports; each pair (abort_pair.c) moves and aborts rooms. They meet
 * through these shared records.
 */
#ifndef KVS_BENCH_ABORT_H
#define KVS_BENCH_ABORT_H

#include "bench.h"
#include "kvstage.h"
#include "report.h"

#define DOOM_BIT (1ull << 63) /* user_data of a room whose chunks the staged runs hold */
#define STAGE_NS 1000000ull   /* staged runs: the held chunks are let go this often */

enum phase { PH_DESC, PH_LEASE, PH_MID, PH_SENT, PH_DONE, NPH };
enum { SEND, RECV };

/* One pair's figures, in shared memory. */
struct ab_res {
	uint64_t rooms, bytes;	    /* surviving rooms completed in the window */
	uint64_t aborted[2];	    /* aborts in the window, by side */
	uint64_t lost_race;	    /* aborted, yet the room completed first */
	uint64_t final_before;	    /* the aborting side was final before kvs_abort */
	uint64_t verified, corrupt; /* bytes checked, bytes wrong (8-byte words) */
	uint64_t late_events;	    /* an event for a room after its final */
	uint64_t pages_bad;	    /* aborted rooms' pages written after the final */
	uint64_t stale_tried, stale_refused, rejected;
	int failed;
	char msg[256];
	struct hist fin[2][NPH], reuse[2][NPH];
};

/* What the parent and the pairs share: the window, set at go, and the figures. */
struct ab_shared {
	uint64_t t_start, t_end;
	struct ab_res res[];
};

struct ab_ctx {
	const struct bench_opts *o;
	struct ab_shared *sh;
	const char *rx_sock, *tx_sock;
	bool one_proxy; /* the receiver's slots are in the sender's table too */
	bool staged;
	double rate;
	uint64_t chunk, room_bytes;
	unsigned room_chunks, pair;
	struct ab_res *res;
};

/* One pair's life: connect to both proxies, say ready on ready_wr, wait
 * for go_rd, move and abort rooms until the window ends, check every byte.
 * Returns 0, or 1 with x->res->msg saying why (the process's exit status). */
int abort_pair_run(struct ab_ctx *x, int ready_wr, int go_rd);

#endif
