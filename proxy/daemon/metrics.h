/* SPDX-License-Identifier: MIT */
/*
 * kvstaged --metrics-listen: GET /metrics in Prometheus's text format,
 * served by libmicrohttpd from a thread of its own. The page is built
 * there from what the loop publishes anyway (the counters in the control
 * segment, the peer table, the latency histograms): a scrape costs the
 * loop nothing.
 */
#ifndef KVSP_METRICS_H
#define KVSP_METRICS_H

#include <errno.h>
#include <stddef.h>
#include <stdio.h>

#include "kvs_build.h"

struct kvsp;
struct kvsp_endpoint;

#if KVS_HAVE_METRICS

/* Parses "IPV4:PORT", "[IPV6]:PORT" or "PORT" (127.0.0.1). Returns 0, or -EINVAL. */
int kvsp_metrics_parse(const char *s, struct kvsp_endpoint *ep);
/* Serves p's metrics on listen ("[HOST:]PORT"). Returns 0, or -errno (logged). */
int kvsp_metrics_start(struct kvsp *p, const char *listen);
/* Stops serving (an answer in progress is finished first); nothing if not serving. */
void kvsp_metrics_stop(struct kvsp *p);
#else
/* Built without libmicrohttpd: no server, and kvstaged refuses --metrics-listen. */
static inline int kvsp_metrics_parse(const char *s, struct kvsp_endpoint *ep)
{
	(void)s;
	(void)ep;
	return -EOPNOTSUPP;
}
static inline int kvsp_metrics_start(struct kvsp *p, const char *listen)
{
	(void)p;
	(void)listen;
	return -EOPNOTSUPP;
}
static inline void kvsp_metrics_stop(struct kvsp *p)
{
	(void)p;
}
#endif
/* Writes p's metrics page to f. Returns 0, or -EIO. */
int kvsp_metrics_render(const struct kvsp *p, FILE *f);

#endif
