/* SPDX-License-Identifier: MIT */
/*
 * The baselines: what the hardware and kernel give without kvstage.
 *  - memcpy: one thread copying chunk-sized buffers around a ring larger
 *    than the last-level cache, so the figure is memory bandwidth, not
 *    cache bandwidth. Beside it, the same copies with end-to-end checksums
 *    as the engines make them: a sender's copy into a slot computing its
 *    CRC32C (kvs_copy_crc32c), a receiver's check of the slot before it
 *    copies out (kvs_crc32c, then memcpy).
 *  - rte_ring: the same SPSC ring kvstage uses, between two processes in a
 *    MAP_SHARED mapping, with nothing else: the floor for a hand-off.
 *  - TCP (rawtcp.c): raw streams, for the tcp transport to be held to.
 */
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <rte_config.h>
#include <rte_pause.h>
#include <rte_ring.h>
#include <rte_ring_elem.h>

#include "kvstage.h"
#include "report.h"

/* ------------------------------------------------------------- memcpy */

static uint8_t *m_src, *m_dst;
static size_t m_len;

void baseline_fini(void)
{
	bench_free(m_src, m_len);
	bench_free(m_dst, m_len);
	m_src = m_dst = NULL;
	m_len = 0;
}

static uint32_t crc_sink;

static void copy_chunk(enum copy_kind how, uint8_t *dst, const uint8_t *src, size_t n)
{
	switch (how) {
	case COPY_PLAIN:
		memcpy(dst, src, n);
		break;
	case COPY_CRC:
		crc_sink ^= kvs_copy_crc32c(dst, src, n, 0);
		break;
	case CHECK_COPY:
		crc_sink ^= kvs_crc32c(src, n, 0);
		memcpy(dst, src, n);
		break;
	}
}

double baseline_memcpy(uint64_t chunk, uint64_t wset, double sec)
{
	return baseline_copy(chunk, wset, sec, COPY_PLAIN);
}

double baseline_copy(uint64_t chunk, uint64_t wset, double sec, enum copy_kind how)
{
	size_t n = wset / chunk < 2 ? 2 : wset / chunk;
	size_t len = n * chunk;
	if (len != m_len) {
		baseline_fini();
		m_src = bench_alloc(len, false);
		m_dst = bench_alloc(len, false);
		if (!m_src || !m_dst) {
			baseline_fini();
			return -1;
		}
		m_len = len;
	}
	/* Check the clock about every MiB copied, not every chunk. */
	size_t batch = chunk >= (1u << 20) ? 1 : (1u << 20) / chunk;
	uint64_t bytes = 0, t0 = now_ns(), t = t0, end = t0 + (uint64_t)(sec * 1e9);
	size_t i = 0;
	do {
		for (size_t k = 0; k < batch; k++) {
			copy_chunk(how, m_dst + i * chunk, m_src + i * chunk, chunk);
			if (++i == n)
				i = 0;
		}
		bytes += batch * chunk;
		t = now_ns();
	} while (t < end);
	/* Keep the copies observable so nothing can be elided. */
	__asm__ volatile("" : : "r"(m_dst), "r"(crc_sink) : "memory");
	return (double)bytes / (double)(t - t0);
}

/* ------------------------------------------------------------ rte_ring */

#define RING_COUNT 1024
#define RING_BURST 32
#define RING_WINDOW 512
#define STOP_SEQ UINT64_MAX

struct ring_rec {
	uint64_t seq, t, a, b;
};
_Static_assert(sizeof(struct ring_rec) == 32, "32-byte records, like kvstage's sqe/cqe");

static void ring_push_all(struct rte_ring *r, const struct ring_rec *rec, unsigned n)
{
	while (n) {
		unsigned k = rte_ring_sp_enqueue_burst_elem(r, rec, sizeof(*rec), n, NULL);
		rec += k;
		n -= k;
		if (n)
			rte_pause();
	}
}

/* The echo side: everything that arrives on ping goes back on pong. */
static void __attribute__((noreturn)) ring_echo(struct rte_ring *ping, struct rte_ring *pong)
{
	struct ring_rec buf[RING_BURST];
	for (;;) {
		unsigned n =
			rte_ring_sc_dequeue_burst_elem(ping, buf, sizeof(buf[0]), RING_BURST, NULL);
		if (!n) {
			rte_pause();
			continue;
		}
		ring_push_all(pong, buf, n);
		if (buf[n - 1].seq == STOP_SEQ)
			_exit(0);
	}
}

static unsigned ring_pop(struct rte_ring *r, struct ring_rec *buf, unsigned max)
{
	return rte_ring_sc_dequeue_burst_elem(r, buf, sizeof(buf[0]), max, NULL);
}

int baseline_ring(double sec, struct ring_base *out)
{
	memset(out, 0, sizeof(*out));
	ssize_t sz = rte_ring_get_memsize_elem(sizeof(struct ring_rec), RING_COUNT);
	if (sz < 0)
		return -1;
	size_t each = ((size_t)sz + 4095) & ~(size_t)4095;
	uint8_t *m = bench_alloc(2 * each, true);
	if (!m)
		return -1;
	struct rte_ring *ping = (struct rte_ring *)m, *pong = (struct rte_ring *)(m + each);
	if (rte_ring_init(ping, "bench-ping", RING_COUNT, RING_F_SP_ENQ | RING_F_SC_DEQ) < 0 ||
	    rte_ring_init(pong, "bench-pong", RING_COUNT, RING_F_SP_ENQ | RING_F_SC_DEQ) < 0) {
		bench_free(m, 2 * each);
		return -1;
	}
	/* Two spinners must not share a CPU, or the figure is the scheduler's
	 * time slice: the echo side takes the last allowed CPU, we the first. */
	cpu_set_t all;
	int first = -1, last = -1;
	bool pin = g_pin.spread && sched_getaffinity(0, sizeof(all), &all) == 0;
	for (int c = 0; pin && c < CPU_SETSIZE; c++)
		if (CPU_ISSET(c, &g_pin.all)) {
			if (first < 0)
				first = c;
			last = c;
		}
	pid_t pid = bench_fork(pin ? last : -1);
	if (pid < 0) {
		bench_free(m, 2 * each);
		return -1;
	}
	if (pid == 0)
		ring_echo(ping, pong);
	pin_one(pin ? first : -1);

	/* Ping-pong: one record out, wait for it back. */
	struct hist *h = malloc(sizeof(*h));
	if (!h) {
		kill(pid, SIGKILL);
		waitpid(pid, NULL, 0);
		if (pin)
			sched_setaffinity(0, sizeof(all), &all);
		bench_free(m, 2 * each);
		return -1;
	}
	hist_init(h);
	struct ring_rec rec = { 0 }, back[RING_BURST];
	uint64_t t0 = now_ns(), end = t0 + (uint64_t)(sec * 1e9 / 2), t = t0, seq = 0;
	while (t < end) {
		rec.seq = seq++;
		ring_push_all(ping, &rec, 1);
		while (!ring_pop(pong, back, 1))
			rte_pause();
		uint64_t t1 = now_ns();
		hist_add(h, t1 - t);
		t = t1;
	}
	out->rt_per_s = (double)seq / ((double)(t - t0) / 1e9);
	out->rtt = hist_lat(h);
	free(h);

	/* Batched: bursts of 32, up to 512 records out and back at once. */
	struct ring_rec burst[RING_BURST] = { 0 };
	uint64_t sent = 0, got = 0;
	t0 = t = now_ns();
	end = t0 + (uint64_t)(sec * 1e9 / 2);
	while (t < end) {
		unsigned room = RING_WINDOW - (unsigned)(sent - got);
		if (room > RING_BURST)
			room = RING_BURST;
		if (room) {
			for (unsigned k = 0; k < room; k++)
				burst[k].seq = sent + k;
			sent += rte_ring_sp_enqueue_burst_elem(ping, burst, sizeof(burst[0]), room,
							       NULL);
		}
		got += ring_pop(pong, back, RING_BURST);
		if ((got & 255) < RING_BURST)
			t = now_ns();
	}
	t = now_ns();
	out->batch_rec_per_s = (double)got / ((double)(t - t0) / 1e9);
	while (got < sent)
		got += ring_pop(pong, back, RING_BURST);

	rec.seq = STOP_SEQ;
	ring_push_all(ping, &rec, 1);
	int st;
	waitpid(pid, &st, 0);
	if (pin)
		sched_setaffinity(0, sizeof(all), &all);
	bench_free(m, 2 * each);
	out->done = WIFEXITED(st) && WEXITSTATUS(st) == 0;
	return out->done ? 0 : -1;
}

/* ---------------------------------------------------------- copy pipe */

struct pipe_shared {
	uint64_t ready; /* sides done allocating */
	uint64_t go, stop;
	uint64_t bytes; /* through both copies */
};

/* Takes one slot index off r, yielding while there is none. False once told to stop. */
static bool pipe_take(struct rte_ring *r, uint32_t *idx, struct pipe_shared *ps)
{
	while (!rte_ring_sc_dequeue_bulk_elem(r, idx, sizeof(*idx), 1, NULL)) {
		if (__atomic_load_n(&ps->stop, __ATOMIC_RELAXED))
			return false;
		sched_yield();
	}
	return true;
}

static void __attribute__((noreturn))
pipe_side(bool in, int fd, size_t plen, uint64_t chunk, uint64_t wset, struct rte_ring *from,
	  struct rte_ring *to, struct pipe_shared *ps)
{
	pin_clients();
	/* Its own mapping, populated, as a client's is at kvs_connect. */
	uint8_t *pool = mmap(NULL, plen, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
	size_t n = wset / chunk < 2 ? 2 : wset / chunk, pos = 0;
	uint8_t *buf = bench_alloc(n * chunk, false);
	if (pool == MAP_FAILED || !buf)
		_exit(1);
	/* Nobody copies until both sides have their memory: setup stays
	 * out of the parent's window. */
	__atomic_add_fetch(&ps->ready, 1, __ATOMIC_RELEASE);
	while (!__atomic_load_n(&ps->go, __ATOMIC_ACQUIRE)) {
		if (__atomic_load_n(&ps->stop, __ATOMIC_RELAXED))
			_exit(0);
		sched_yield();
	}
	uint32_t idx = 0; /* set by pipe_take; GCC cannot see through DPDK's inlines */
	while (pipe_take(from, &idx, ps)) {
		if (in)
			memcpy(pool + idx * chunk, buf + pos * chunk, chunk);
		else
			memcpy(buf + pos * chunk, pool + idx * chunk, chunk);
		pos = (pos + 1) % n;
		while (!rte_ring_sp_enqueue_bulk_elem(to, &idx, sizeof(idx), 1, NULL))
			sched_yield();
		if (!in)
			__atomic_fetch_add(&ps->bytes, chunk, __ATOMIC_RELAXED);
	}
	_exit(0);
}

double baseline_pipe(uint64_t chunk, uint64_t inflight, uint64_t wset, double sec)
{
	uint32_t slots = (uint32_t)(inflight / chunk < 2 ? 2 : inflight / chunk);
	unsigned count = 1;
	while (count <= slots)
		count <<= 1;
	ssize_t rsz = rte_ring_get_memsize_elem(sizeof(uint32_t), count);
	if (rsz < 0)
		return -1;
	size_t each = ((size_t)rsz + 4095) & ~(size_t)4095;
	size_t mlen = 4096 + 2 * each;
	uint8_t *m = bench_alloc(mlen, true);
	int fd = memfd_create("kvstage-bench-pipe", MFD_CLOEXEC);
	size_t plen = (size_t)slots * chunk;
	if (!m || fd < 0 || ftruncate(fd, (off_t)plen) < 0) {
		bench_free(m, mlen);
		if (fd >= 0)
			close(fd);
		return -1;
	}
	memset(m, 0, 4096);
	struct pipe_shared *ps = (struct pipe_shared *)m;
	struct rte_ring *free_r = (struct rte_ring *)(m + 4096),
			*full = (struct rte_ring *)(m + 4096 + each);
	double gbps = -1;
	pid_t pid[2] = { -1, -1 };
	if (rte_ring_init(free_r, "pipe-free", count, RING_F_SP_ENQ | RING_F_SC_DEQ) < 0 ||
	    rte_ring_init(full, "pipe-full", count, RING_F_SP_ENQ | RING_F_SC_DEQ) < 0)
		goto out;
	for (uint32_t i = 0; i < slots; i++)
		rte_ring_sp_enqueue_bulk_elem(free_r, &i, sizeof(i), 1, NULL);
	for (int k = 0; k < 2; k++) {
		pid[k] = bench_fork(-1);
		if (pid[k] == 0)
			pipe_side(k == 0, fd, plen, chunk, wset, k ? full : free_r,
				  k ? free_r : full, ps);
		if (pid[k] < 0)
			goto out;
	}
	uint64_t until = now_ns() + 30000000000ull;
	while (__atomic_load_n(&ps->ready, __ATOMIC_ACQUIRE) < 2) {
		if (now_ns() > until)
			goto out;
		sleep_ns(1000000);
	}
	__atomic_store_n(&ps->go, 1, __ATOMIC_RELEASE);
	/* Settle: every slot through both copies twice (first touches, cold
	 * caches and TLBs), and a tenth of the time; then the window. */
	until = now_ns() + 10000000000ull;
	while (__atomic_load_n(&ps->bytes, __ATOMIC_RELAXED) < 2 * plen && now_ns() < until)
		sleep_ns(1000000);
	sleep_ns((uint64_t)(sec * 1e8));
	uint64_t b0 = __atomic_load_n(&ps->bytes, __ATOMIC_RELAXED), t0 = now_ns();
	sleep_ns((uint64_t)(sec * 1e9));
	uint64_t b1 = __atomic_load_n(&ps->bytes, __ATOMIC_RELAXED), t1 = now_ns();
	gbps = (double)(b1 - b0) / (double)(t1 - t0);
out:
	__atomic_store_n(&ps->stop, 1, __ATOMIC_RELAXED);
	for (int k = 0; k < 2; k++) {
		int st;
		if (pid[k] > 0 &&
		    (waitpid(pid[k], &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st)))
			gbps = -1;
	}
	close(fd);
	bench_free(m, mlen);
	return gbps;
}

/* -------------------------------------------------------------- wake-up */

int baseline_wake(unsigned samples, uint64_t gap_ns, struct lat *out)
{
	int there = eventfd(0, EFD_CLOEXEC), back = eventfd(0, EFD_CLOEXEC);
	struct hist *h = malloc(sizeof(*h));
	if (there < 0 || back < 0 || !h) {
		free(h);
		if (there >= 0)
			close(there);
		if (back >= 0)
			close(back);
		return -1;
	}
	pid_t pid = bench_fork(g_pin.on ? g_pin.proxy_cpu : -1);
	if (pid == 0) {
		for (;;) {
			eventfd_t v;
			if (eventfd_read(there, &v) < 0 && errno != EINTR)
				_exit(1);
			if (v > 1)
				_exit(0); /* the stop word */
			eventfd_write(back, 1);
		}
	}
	int rc = pid < 0 ? -1 : 0;
	hist_init(h);
	for (unsigned i = 0; i < samples && !rc; i++) {
		sleep_ns(gap_ns);
		eventfd_t v;
		uint64_t t0 = now_ns();
		eventfd_write(there, 1);
		while (eventfd_read(back, &v) < 0)
			if (errno != EINTR) {
				rc = -1;
				break;
			}
		hist_add(h, now_ns() - t0);
	}
	if (pid > 0) {
		eventfd_write(there, 2);
		waitpid(pid, NULL, 0);
	}
	*out = hist_lat(h);
	free(h);
	close(there);
	close(back);
	return rc;
}

/* ---------------------------------------------------------------- mode */

static int report_baseline(const struct bench_opts *o, const struct baseline_point *pt, unsigned n,
			   const struct ring_base *ring)
{
	char a[16];
	struct doc *d = doc_new(o, n);
	if (!d)
		return 1;
	struct point *pts = d->pt;
	CAT(d->head, "kvstage-bench %s baseline: %.2f s per figure\n", KVS_VERSION_STRING,
	    o->baseline_sec);
	doc_head(d, o, NULL, NULL, true, ring);
	put(&d->top, "points", U_POINTS);
	d->csv = "mode,chunk_bytes,memcpy_gbps,copy_crc_gbps,copy_crc_vs_memcpy,check_copy_gbps,"
		 "check_copy_vs_memcpy,tcp_gbps,ring_rt_per_s,ring_rtt_p50_us,ring_rtt_p99_us,"
		 "ring_rtt_p999_us,ring_batched_records_per_s";
	d->col0 = "chunk";
	d->pt = pts;
	d->npt = n;
	CAT(d->tail,
	    "\nmemcpy: one thread, chunk-sized buffers around a %s ring each way.\n"
	    "copy+CRC: the same copies computing each chunk's CRC32C as they go (kvs_copy_crc32c:\n"
	    "a sender's copy into a slot with end-to-end checksums); check+copy: the CRC32C of "
	    "the\n"
	    "source, then memcpy (a receiver's check before it copies out). x: of memcpy's rate.\n"
	    "TCP: one connection on 127.0.0.1, writes of the chunk size, two processes.\n",
	    bench_size_str(o->wset, a, sizeof(a)));
	for (unsigned i = 0; i < n; i++) {
		bench_size_str(pt[i].chunk, pts[i].name, sizeof(pts[i].name));
		put_int(&pts[i], "chunk_bytes", pt[i].chunk);
		fig(&pts[i], NULL, "memcpy GB/s", U_NUM, pt[i].memcpy_gbps, "memcpy_gbps");
		fig(&pts[i], NULL, "copy+CRC GB/s", U_NUM, pt[i].copy_crc_gbps, "copy_crc_gbps");
		fig(&pts[i], NULL, "x", U_NUM, pt[i].copy_crc_gbps / pt[i].memcpy_gbps,
		    "copy_crc_vs_memcpy");
		fig(&pts[i], NULL, "check+copy GB/s", U_NUM, pt[i].check_copy_gbps,
		    "check_copy_gbps");
		fig(&pts[i], NULL, "x", U_NUM, pt[i].check_copy_gbps / pt[i].memcpy_gbps,
		    "check_copy_vs_memcpy");
		fig(&pts[i], NULL, "TCP GB/s", U_NUM, pt[i].tcp_gbps, "tcp_gbps");
	}
	report(d);
	doc_free(d);
	if (!o->plot)
		return 0;
	uint64_t x[BENCH_MAX_CHUNKS];
	double mc[BENCH_MAX_CHUNKS], tc[BENCH_MAX_CHUNKS];
	for (unsigned i = 0; i < n; i++) {
		x[i] = pt[i].chunk;
		mc[i] = pt[i].memcpy_gbps;
		tc[i] = pt[i].tcp_gbps;
	}
	const double *cols[] = { mc, tc };
	const char *names[] = { "memcpy, one thread", "TCP, one loopback connection" };
	const char *styles[] = { "linespoints lw 2 pt 7", "linespoints lw 2 pt 5" };
	return plot(o, "kvstage-bench baselines", x, n, cols, names, styles, 2);
}

int run_baseline(const struct bench_opts *o)
{
	struct ring_base ring;
	struct baseline_point *pts = calloc(o->nchunks, sizeof(*pts));
	if (!pts)
		return 1;
	note(o, "baseline: rte_ring round trips between two processes (%.2f s)", o->baseline_sec);
	if (baseline_ring(o->baseline_sec, &ring) < 0)
		note(o, "baseline: the rte_ring measurement failed");
	int rc = 0;
	bool prog = progress_on(o);
	for (unsigned i = 0; i < o->nchunks; i++) {
		char cs[16];
		pts[i].chunk = o->chunks[i];
		bench_size_str(o->chunks[i], cs, sizeof(cs));
		if (prog)
			progress_line("baseline %s: memcpy, with checksums, then TCP (%u of %u)",
				      cs, i + 1, o->nchunks);
		pts[i].memcpy_gbps = baseline_memcpy(o->chunks[i], o->wset, o->baseline_sec);
		pts[i].copy_crc_gbps =
			baseline_copy(o->chunks[i], o->wset, o->baseline_sec, COPY_CRC);
		pts[i].check_copy_gbps =
			baseline_copy(o->chunks[i], o->wset, o->baseline_sec, CHECK_COPY);
		baseline_fini();
		pts[i].tcp_gbps = baseline_tcp(o->chunks[i], o->baseline_sec);
		if (pts[i].memcpy_gbps <= 0 || pts[i].tcp_gbps <= 0) {
			progress_clear();
			fprintf(stderr, "kvstage-bench: the %s baseline at %s failed\n",
				pts[i].memcpy_gbps <= 0 ? "memcpy" : "TCP", cs);
			rc = 1;
		}
	}
	progress_clear();
	int prc = report_baseline(o, pts, o->nchunks, ring.done ? &ring : NULL);
	free(pts);
	return rc ? rc : prc;
}
