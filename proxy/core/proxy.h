/* SPDX-License-Identifier: MIT */
/*
 * kvstaged: the proxy's shared context. One thread owns all of it. It holds
 * by value only what it must (config, slots, failpoints, histograms, rate
 * limits); every part a .c file calls, it includes itself. Its lifetime and
 * the loop are host/loop.h's.
 */
#ifndef KVSP_PROXY_H
#define KVSP_PROXY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "base/clock.h"
#include "base/log.h"
#include "core/shares.h"
#include "core/config.h"
#include "core/failpoint.h"
#include "core/hist.h"
#include "core/slots.h"
#include "layout.h"

struct kvsp_admin;
struct kvsp_client;
struct kvsp_metrics;
struct kvsp_pending;
struct kvsp_room;
struct kvsp_room_trace;
struct kvsp_trace;
struct kvsp_transport;
struct kvsp_xfer;

struct kvsp {
	struct kvsp_config cfg;
	/* memory */
	int pool_fd, ctrl_fd;
	uint8_t *pool;
	size_t pool_size;
	struct kvs_ctrl *ctrl;
	size_t ctrl_size;
	struct kvs_stats *stats;
	bool huge, locked;
	/* The pool's parts, one per NUMA node with memory (slots.part_start
	 * says whose slots): node_ids[k] is part k's node. One part, node 0,
	 * on a machine of one node. */
	unsigned nnodes;
	unsigned node_ids[KVSP_SLOT_PARTS];
	uint32_t part_start[KVSP_SLOT_PARTS + 1];
	uint8_t sq_tmpl[KVS_PAGE], cq_tmpl[KVS_PAGE]; /* a fresh ring body's header */
	size_t tmpl_len;
	struct kvsp_slots slots;
	/* rooms */
	struct kvsp_room *rooms;
	uint64_t *bits_arena;
	uint32_t bits_words;
	uint32_t room_free_head, room_free_tail;
	uint32_t lru_head, lru_tail;
	uint32_t mark_head;    /* rooms kvsp_rooms_settle has to look at */
	uint32_t rooms_active; /* OPEN or ABORTING */
	uint8_t rnd[4096];
	unsigned rnd_used;
	/* clients */
	struct kvsp_client **clients;
	struct kvsp_shares shares; /* each uid's client places and rooms */
	uint32_t next_cid;
	unsigned clients_hi; /* clients[] is empty from here up: the loop stops here */
	uint16_t *kicks;     /* clients with kick set, each once: never more than max_clients */
	unsigned nkicks;
	/* transfers and transports */
	struct kvsp_xfer *xfers; /* one per slot: a slot has at most one pin */
	struct kvsp_transport *xports[KVSP_MAX_XPORTS];
	unsigned nxports;
	struct kvsp_transport *local; /* carries rooms whose halves are both here */
	char endpoint[64];	      /* where peers reach us, in our descriptors; "": nowhere */
	/* failpoints: the core's and the plane's (admin.h), then the data
	 * paths' (kvsp_fp_register), named by fp_names[id - KVSP_FP_COUNT] */
	struct kvsp_fp fp[KVSP_FP_COUNT + KVSP_FP_MODULES];
	char fp_names[KVSP_FP_MODULES][32];
	unsigned nfp; /* failpoints in fp[] */
	/* event loop */
	int epfd, listen_fd, wake_fd, lock_fd;
	int spare_fd;		     /* given up to accept (and refuse) when out of fds */
	uint64_t sock_dev, sock_ino; /* our socket file: only it is ever unlinked */
	struct kvsp_pending *pending;
	uint32_t pending_ids;
	struct kvsp_admin *admins;
	uint64_t now_ns, next_tick_ns;
	volatile int term; /* set from the signal handler */
	int terms_seen;
	bool draining, aborted_all;
	uint64_t drain_deadline_ns, drain_report_ns;
	struct kvsp_rl rl_refused, rl_timeout, rl_died, rl_full, rl_attach, rl_abort;
	uint64_t instance;
	uint64_t spin_ns; /* the adaptive spin budget, from cfg.spin_ns up */
	/* what the metrics thread reads besides the published counters */
	struct kvsp_hist room_hist, chunk_hist;
	struct kvsp_metrics *metrics;	/* NULL: no --metrics-listen */
	struct kvsp_trace *trace;	/* NULL: no --trace-file (base/trace.h) */
	struct kvsp_room_trace *rtrace; /* per room, while tracing (core/roomtrace.c) */
};

/* Returns the pool's part on NUMA node node, or -1 (node -1, the pool is
 * not split, or it has no part there). */
static inline int kvsp_pool_part_of(const struct kvsp *p, int node)
{
	for (unsigned k = 0; p->nnodes > 1 && node >= 0 && k < p->nnodes; k++)
		if (p->node_ids[k] == (unsigned)node)
			return (int)k;
	return -1;
}

#endif
