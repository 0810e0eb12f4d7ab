/* SPDX-License-Identifier: MIT */
/* The proxy's clock: CLOCK_MONOTONIC. The loop reads it (or the TSC scaled
 * to it, host/poller.c) once a pass into struct kvsp's now_ns. */
#ifndef KVSP_CLOCK_H
#define KVSP_CLOCK_H

#include <stdint.h>
#include <time.h>

/* CLOCK_MONOTONIC in nanoseconds. */
static inline uint64_t kvsp_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

#endif
