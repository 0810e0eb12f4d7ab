/* SPDX-License-Identifier: MIT */
/* Percentiles with bounded memory, clocks, and small I/O helpers. */
#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "sock.h"

uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void sleep_until_ns(uint64_t t)
{
	struct timespec ts = { .tv_sec = (time_t)(t / 1000000000ull),
			       .tv_nsec = (long)(t % 1000000000ull) };
	while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
		;
}

void sleep_ns(uint64_t ns)
{
	sleep_until_ns(now_ns() + ns);
}

/* Values below 64 get a bucket each; above, each power of two is cut into
 * 64 equal sub-buckets, so a bucket is never wider than 1/64 of its value. */
static unsigned bucket_of(uint64_t v)
{
	if (v < (1u << HIST_SUB_BITS))
		return (unsigned)v;
	unsigned e = 63 - (unsigned)__builtin_clzll(v); /* >= HIST_SUB_BITS */
	unsigned sub = (unsigned)(v >> (e - HIST_SUB_BITS)) & ((1u << HIST_SUB_BITS) - 1);
	return ((e - HIST_SUB_BITS + 1) << HIST_SUB_BITS) + sub;
}

static double bucket_mid(unsigned i)
{
	if (i < (1u << HIST_SUB_BITS))
		return i;
	unsigned e = (i >> HIST_SUB_BITS) + HIST_SUB_BITS - 1;
	unsigned sub = i & ((1u << HIST_SUB_BITS) - 1);
	double width = (double)(1ull << (e - HIST_SUB_BITS));
	double low = (double)((1ull << HIST_SUB_BITS) + sub) * width;
	return low + width / 2;
}

void hist_init(struct hist *h)
{
	memset(h, 0, sizeof(*h));
	h->min = UINT64_MAX;
}

void hist_add(struct hist *h, uint64_t v)
{
	h->b[bucket_of(v)]++;
	h->n++;
	h->sum += v;
	if (v < h->min)
		h->min = v;
	if (v > h->max)
		h->max = v;
}

void hist_merge(struct hist *dst, const struct hist *src)
{
	if (!src->n)
		return;
	for (unsigned i = 0; i < HIST_BUCKETS; i++)
		dst->b[i] += src->b[i];
	dst->n += src->n;
	dst->sum += src->sum;
	if (src->min < dst->min)
		dst->min = src->min;
	if (src->max > dst->max)
		dst->max = src->max;
}

double hist_quantile(const struct hist *h, double q)
{
	if (!h->n)
		return 0;
	/* The rank of the q-quantile, 1-based: ceil(q * n). */
	uint64_t want = (uint64_t)(q * (double)h->n);
	if ((double)want < q * (double)h->n)
		want++;
	if (want < 1)
		want = 1;
	uint64_t seen = 0;
	for (unsigned i = 0; i < HIST_BUCKETS; i++) {
		seen += h->b[i];
		if (seen >= want) {
			double v = bucket_mid(i);
			if (v < (double)h->min)
				v = (double)h->min;
			if (v > (double)h->max)
				v = (double)h->max;
			return v;
		}
	}
	return (double)h->max;
}

struct lat hist_lat(const struct hist *h)
{
	struct lat l = { 0 };
	if (!h->n)
		return l;
	l.n = h->n;
	l.p50 = hist_quantile(h, 0.50) / 1e3;
	l.p99 = hist_quantile(h, 0.99) / 1e3;
	l.p999 = hist_quantile(h, 0.999) / 1e3;
	l.mean = (double)h->sum / (double)h->n / 1e3;
	l.max = (double)h->max / 1e3;
	return l;
}

void *bench_alloc(size_t len, bool shared)
{
	void *p = mmap(NULL, len, PROT_READ | PROT_WRITE,
		       (shared ? MAP_SHARED : MAP_PRIVATE) | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED)
		return NULL;
	if (!shared)
		madvise(p, len, MADV_HUGEPAGE);
	/* Non-zero bytes: a zero page mapped copy-on-write would make reads
	 * cheaper than they are in real use. */
	memset(p, 0x5a, len);
	return p;
}

void bench_free(void *p, size_t len)
{
	if (p)
		munmap(p, len);
}
