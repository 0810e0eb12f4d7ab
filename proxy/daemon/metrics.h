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

#include <stddef.h>
#include <stdio.h>

struct kvsp;
struct kvsp_endpoint;

/* Parses "IPV4:PORT", "[IPV6]:PORT" or "PORT" (127.0.0.1). Returns 0, or -EINVAL. */
int kvsp_metrics_parse(const char *s, struct kvsp_endpoint *ep);
/* Serves p's metrics on listen ("[HOST:]PORT"). Returns 0, or -errno (logged). */
int kvsp_metrics_start(struct kvsp *p, const char *listen);
/* Stops serving (an answer in progress is finished first); nothing if not serving. */
void kvsp_metrics_stop(struct kvsp *p);
/* Writes p's metrics page to f. Returns 0, or -EIO. */
int kvsp_metrics_render(const struct kvsp *p, FILE *f);

#endif
