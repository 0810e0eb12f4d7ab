/* SPDX-License-Identifier: MIT */
/* The latency histograms' buckets (hist.h): the loop counts into them, the
 * metrics page (daemon/metrics_page.c) names them. */
#include "core/hist.h"

const uint64_t kvsp_hist_room_ns[KVSP_HIST_BUCKETS] = {
	100000,	    250000,	 500000,      1000000,	   2500000,	5000000,      10000000,
	25000000,   50000000,	 100000000,   250000000,   500000000,	1000000000,   2500000000,
	5000000000, 10000000000, 30000000000, 60000000000, 90000000000, 120000000000,
};
const uint64_t kvsp_hist_chunk_ns[KVSP_HIST_BUCKETS] = {
	1000,	  2500,	     5000,	10000,	    25000,	50000,	     100000,
	250000,	  500000,    1000000,	2500000,    5000000,	10000000,    25000000,
	50000000, 100000000, 250000000, 1000000000, 5000000000, 10000000000,
};
