/* SPDX-License-Identifier: MIT */
/*
 * The counter block's registrar (counters.c): a part of the proxy that
 * counts (a data path, the peer plane's socket layer) names its counters
 * once at start, and adds to the values it is handed. Readers (kvstage-stat,
 * the metrics page, admin barriers) walk the block's records, so a new
 * counter is a line in its owner's table, not a field of the ABI.
 */
#ifndef KVSP_COUNTERS_H
#define KVSP_COUNTERS_H

#include <stdbool.h>
#include <stdint.h>

struct kvsp;

/* One counter, as its owner names it; arrays end with a NULL name. */
struct kvsp_counter_def {
	const char *name;   /* kvstage-stat's name: "rdma_reads" (below 32 bytes) */
	const char *metric; /* Prometheus's: "kvstage_rdma_reads_total" (below 64) */
	const char *help;   /* one sentence (below 152 bytes) */
	bool gauge;	    /* it goes down too (a level, not a count) */
};

/* Publishes defs in p's counter block. Returns 0 and points *values at
 * their values, in defs' order (add with KVS_STAT_ADD(values[i], n)); or
 * -ENOSPC (the block is full), -EEXIST (a name is taken) or -EINVAL (a
 * name, metric or help too long); nothing is published then. The loop's
 * thread only, before the proxy takes a connection. */
int kvsp_counters_add(struct kvsp *p, const struct kvsp_counter_def *defs, uint64_t **values);

#endif
