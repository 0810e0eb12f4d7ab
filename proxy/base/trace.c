/* SPDX-License-Identifier: MIT */
/*
 * The lifecycle trace: the ring the loop pushes into, and the thread that
 * writes it out (trace.h; design note 45).
 */
#include "base/trace.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <rte_ring.h>
#include <rte_ring_elem.h>

#include "base/clock.h"
#include "base/log.h"
#include "kvstage.h"

#define BURST 64	       /* records the writer takes and writes at once */
#define TRACE_LINE_MAX 320     /* the longest line kvsp_trace_format makes, with room to spare */
#define RETRY_NS 1000000000ull /* a failed socket is dialed again at most this often */
#define SEND_TIMEOUT_S 1       /* a socket that takes nothing this long has failed */

struct kvsp_trace {
	struct rte_ring *ring; /* SP/SC, exactly `records` records */
	void *ring_mem;
	char path[108]; /* the file, or the socket's path */
	bool sock;	/* "unix:": a socket, dialed again after it fails */
	int type;	/* SOCK_STREAM or SOCK_DGRAM */
	int fd;		/* -1: a socket lost, not yet dialed again */
	bool failing;	/* the last write failed: said once, till one succeeds */
	uint64_t retry_ns;
	struct kvsp_trace_conf conf;
	pthread_t thread;
	bool started;
	bool parked;	   /* the writer stopped at the hold (its thread's own) */
	uint32_t sleeping; /* the writer waits on this futex word; the loop wakes it */
	uint32_t stop;
	bool pushed; /* the loop's: records queued since its last flush */
	char buf[BURST * TRACE_LINE_MAX];
};

static const char *const event_names[KVSP_TR_NEVENTS] = {
	"room_opened", "chunk_queued", "chunk_sent",	  "chunk_landed",
	"room_final",  "room_fenced",  "slot_tombstoned", "room_reaped",
};

static const char *final_name(unsigned type)
{
	switch (type) {
	case KVS_EV_SEND_DONE:
		return "send_done";
	case KVS_EV_RECV_DONE:
		return "recv_done";
	case KVS_EV_ABORTED:
		return "aborted";
	default:
		return "failed";
	}
}

/* Appends to buf[*k..n): never past n, whatever snprintf would have made. */
static void add(char *buf, size_t n, size_t *k, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
static void add(char *buf, size_t n, size_t *k, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	int m = *k < n ? vsnprintf(buf + *k, n - *k, fmt, ap) : 0;
	va_end(ap);
	*k = m > 0 && *k + (size_t)m < n ? *k + (size_t)m : n - 1;
}

size_t kvsp_trace_format(const struct kvsp_trace_rec *r, uint64_t instance, char *buf, size_t n)
{
	size_t k = 0; /* the longest line is 304 bytes (every number at its widest) */
	add(buf, n, &k,
	    "{\"schema\":\"kvstage-proxy-v1\",\"event\":\"%s\",\"wall_ns\":%" PRIu64
	    ",\"monotonic_ns\":%" PRIu64 ",\"room\":\"%016" PRIx64
	    ".%u.%u\",\"side\":\"%s\",\"instance\":\"%016" PRIx64 "\"",
	    r->event < KVSP_TR_NEVENTS ? event_names[r->event] : "unknown", r->wall_ns, r->mono_ns,
	    r->instance, r->room, r->gen, r->side == KVSP_TR_SEND ? "send" : "recv", instance);
	if (r->has & KVSP_TR_BYTES)
		add(buf, n, &k, ",\"bytes\":%" PRIu64, r->bytes);
	if (r->has & KVSP_TR_CHUNK)
		add(buf, n, &k, ",\"chunk\":%u", r->chunk);
	if (r->has & KVSP_TR_FINAL)
		add(buf, n, &k, ",\"final\":\"%s\"", final_name(r->final));
	if (r->has & KVSP_TR_STATUS)
		add(buf, n, &k, ",\"status\":%d", r->status);
	add(buf, n, &k, "}\n");
	return k;
}

/* ---------------------------------------------------------------- sink */

/* Dials the socket: a stream one, else (EPROTOTYPE) a datagram one. Returns 0, or -errno. */
static int sock_dial(struct kvsp_trace *t)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	memcpy(sa.sun_path, t->path, sizeof(sa.sun_path));
	int types[2] = { SOCK_STREAM, SOCK_DGRAM }, err = 0;
	for (int k = 0; k < 2; k++) {
		int fd = socket(AF_UNIX, types[k] | SOCK_CLOEXEC, 0);
		if (fd < 0)
			return -errno;
		if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0) {
			/* A reader that stops reading fails the socket (and its
			 * lines are dropped) rather than hold the writer for ever:
			 * the daemon joins it at exit. */
			struct timeval tv = { .tv_sec = SEND_TIMEOUT_S };
			setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
			t->fd = fd;
			t->type = types[k];
			return 0;
		}
		err = -errno;
		close(fd);
		if (err != -EPROTOTYPE)
			break;
	}
	return err;
}

struct kvsp_trace *kvsp_trace_open(const char *where, uint32_t records, char *why, size_t n)
{
	struct kvsp_trace *t = calloc(1, sizeof(*t));
	if (!t) {
		snprintf(why, n, "%s", strerror(ENOMEM));
		return NULL;
	}
	t->fd = -1;
	t->sock = !strncmp(where, "unix:", 5);
	const char *path = t->sock ? where + 5 : where;
	if (!*path || strlen(path) >= sizeof(t->path)) {
		snprintf(why, n, "want a path of 1 to %zu bytes", sizeof(t->path) - 1);
		goto fail;
	}
	strcpy(t->path, path);
	int rc = 0;
	if (t->sock)
		rc = sock_dial(t);
	/* O_NONBLOCK for the open alone: a FIFO without a reader is refused
	 * (ENXIO) instead of holding the start. */
	else if ((t->fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NONBLOCK,
			       0640)) < 0 ||
		 fcntl(t->fd, F_SETFL, O_WRONLY | O_APPEND) < 0)
		rc = -errno;
	if (rc < 0) {
		snprintf(why, n, "%s", strerror(-rc));
		goto fail;
	}
	/* EXACT_SZ: the ring holds exactly `records` (DPDK sizes it to the
	 * next power of two above), so what is dropped is exactly the excess. */
	unsigned flags = RING_F_SP_ENQ | RING_F_SC_DEQ | RING_F_EXACT_SZ;
	ssize_t sz = rte_ring_get_memsize_elem(sizeof(struct kvsp_trace_rec),
					       rte_align32pow2(records + 1));
	if (sz < 0) {
		snprintf(why, n, "a ring of %u records: %s", records, strerror((int)-sz));
		goto fail;
	}
	t->ring_mem = aligned_alloc(RTE_CACHE_LINE_SIZE, RTE_ALIGN_CEIL((size_t)sz, 64));
	if (!t->ring_mem) {
		snprintf(why, n, "a ring of %u records: %s", records, strerror(ENOMEM));
		goto fail;
	}
	t->ring = t->ring_mem;
	rc = rte_ring_init(t->ring, "kvstaged-trace", records, flags);
	if (rc < 0) {
		snprintf(why, n, "a ring of %u records: %s", records, strerror(-rc));
		goto fail;
	}
	return t;
fail:
	if (t->fd >= 0)
		close(t->fd);
	free(t->ring_mem);
	free(t);
	return NULL;
}

/* Writes all of buf to the sink, or fails. Returns 0, or -errno. */
static int write_all(struct kvsp_trace *t, const char *buf, size_t len)
{
	while (len) {
		ssize_t k = t->sock ? send(t->fd, buf, len, MSG_NOSIGNAL) : write(t->fd, buf, len);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			return k < 0 ? -errno : -EIO;
		buf += k;
		len -= (size_t)k;
	}
	return 0;
}

/* Writes n lines (ends[i]: where line i ends in t->buf). Counts them as
 * written, or, those the sink did not take, as dropped. */
static void sink_write(struct kvsp_trace *t, const size_t *ends, unsigned n)
{
	unsigned done = 0;
	int rc = 0;
	if (t->sock && t->fd < 0) {
		uint64_t now = kvsp_now_ns();
		rc = -ENOTCONN;
		if (now >= t->retry_ns) { /* a lost socket: dialed again, not at every line */
			t->retry_ns = now + RETRY_NS;
			rc = sock_dial(t);
		}
	}
	if (rc == 0 && t->sock && t->type == SOCK_DGRAM) {
		for (size_t at = 0; done < n && rc == 0; at = ends[done++]) /* a line a datagram */
			rc = write_all(t, t->buf + at, ends[done] - at);
		if (rc < 0)
			done--; /* the one that failed */
	} else if (rc == 0) {
		rc = write_all(t, t->buf, ends[n - 1]);
		done = rc == 0 ? n : 0; /* a partial line may have gone: one line is torn */
	}
	if (done)
		__atomic_store_n(t->conf.written,
				 __atomic_load_n(t->conf.written, __ATOMIC_RELAXED) + done,
				 __ATOMIC_RELAXED);
	if (done < n) /* the loop adds to it too, when the ring is full */
		__atomic_fetch_add(t->conf.dropped, n - done, __ATOMIC_RELAXED);
	if (rc < 0 && !t->failing)
		LOG_WARN("--trace-file %s%s: %s; lines are dropped (trace_dropped) until it works "
			 "again",
			 t->sock ? "unix:" : "", t->path,
			 rc == -EAGAIN && t->sock ? "its reader took nothing for 1 s"
						  : strerror(-rc));
	else if (rc == 0 && t->failing)
		LOG_INFO("--trace-file %s%s: writing again", t->sock ? "unix:" : "", t->path);
	t->failing = rc < 0;
	if (rc < 0 && t->sock && t->fd >= 0) {
		close(t->fd);
		t->fd = -1;
		t->retry_ns = kvsp_now_ns() + RETRY_NS;
	}
}

/* ---------------------------------------------------------- the writer */

static void futex_wait(uint32_t *word, uint32_t val)
{
	syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void futex_wake(uint32_t *word)
{
	syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

/* Sleeps until the loop pushes or kicks, unless there is something to do
 * already: set `sleeping`, then look (the loop pushes, then looks at it). */
static void writer_sleep(struct kvsp_trace *t, bool held)
{
	__atomic_store_n(&t->sleeping, 1, __ATOMIC_SEQ_CST);
	bool work = __atomic_load_n(&t->stop, __ATOMIC_SEQ_CST) ||
		    (!held && !rte_ring_empty(t->ring)) ||
		    (held && __atomic_load_n(t->conf.hold, __ATOMIC_SEQ_CST) != 1);
	if (!work)
		futex_wait(&t->sleeping, 1);
	__atomic_store_n(&t->sleeping, 0, __ATOMIC_RELAXED);
}

/* Under --failpoints the loop answers admin barriers (kvstage-ctl, tests)
 * when it passes; one waiting on our counters or our hold must not wait
 * for something else to wake it. Without, nothing waits on us. */
static void wake_loop(struct kvsp_trace *t)
{
	uint64_t one = 1;
	if (t->conf.wake_fd >= 0 && write(t->conf.wake_fd, &one, sizeof(one)) < 0)
		LOG_DEBUG("trace: waking the loop: %s", strerror(errno));
}

static bool held(struct kvsp_trace *t)
{
	if (!t->conf.hold || __atomic_load_n(t->conf.hold, __ATOMIC_ACQUIRE) != 1 ||
	    __atomic_load_n(&t->stop, __ATOMIC_ACQUIRE))
		return t->parked = false;
	if (!t->parked) {
		t->parked = true;
		__atomic_fetch_add(t->conf.hits, 1, __ATOMIC_RELEASE);
		wake_loop(t);
	}
	return true;
}

static void *writer(void *arg)
{
	struct kvsp_trace *t = arg;
	struct kvsp_trace_rec recs[BURST];
	size_t ends[BURST];
	for (;;) {
		if (held(t)) {
			writer_sleep(t, true);
			continue;
		}
		unsigned n =
			rte_ring_sc_dequeue_burst_elem(t->ring, recs, sizeof(recs[0]), BURST, NULL);
		if (n && t->failing && __atomic_load_n(&t->stop, __ATOMIC_ACQUIRE)) {
			/* Exiting, and the sink failed: what is left is dropped,
			 * not tried a batch at a time (a socket's timeout each). */
			__atomic_fetch_add(t->conf.dropped, n, __ATOMIC_RELAXED);
			continue;
		}
		if (n) {
			size_t len = 0;
			for (unsigned k = 0; k < n; k++) {
				len += kvsp_trace_format(&recs[k], t->conf.instance, t->buf + len,
							 TRACE_LINE_MAX);
				ends[k] = len;
			}
			sink_write(t, ends, n);
			wake_loop(t);
			continue;
		}
		if (__atomic_load_n(&t->stop, __ATOMIC_ACQUIRE))
			break; /* after the last record pushed: the loop stopped first */
		writer_sleep(t, false);
	}
	return NULL;
}

int kvsp_trace_start(struct kvsp_trace *t, const struct kvsp_trace_conf *conf)
{
	t->conf = *conf;
	/* Every signal stays the loop's (SIGTERM drains it). */
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	int rc = pthread_create(&t->thread, NULL, writer, t);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (rc)
		return -rc;
	t->started = true;
	return 0;
}

void kvsp_trace_push(struct kvsp_trace *t, struct kvsp_trace_rec *rec)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	rec->wall_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
	rec->mono_ns = kvsp_now_ns();
	if (rte_ring_sp_enqueue_elem(t->ring, rec, sizeof(*rec)) < 0) {
		/* Full: the writer is behind (or held). Never wait for it. */
		__atomic_fetch_add(t->conf.dropped, 1, __ATOMIC_RELAXED);
		return;
	}
	t->pushed = true;
}

void kvsp_trace_flush(struct kvsp_trace *t)
{
	if (!t->pushed)
		return;
	t->pushed = false;
	/* Pairs with writer_sleep: either it sees the records, or we see it asleep. */
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	if (__atomic_load_n(&t->sleeping, __ATOMIC_RELAXED) &&
	    __atomic_exchange_n(&t->sleeping, 0, __ATOMIC_RELAXED))
		futex_wake(&t->sleeping);
}

void kvsp_trace_kick(struct kvsp_trace *t)
{
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	__atomic_store_n(&t->sleeping, 0, __ATOMIC_RELAXED);
	futex_wake(&t->sleeping);
}

void kvsp_trace_close(struct kvsp_trace *t)
{
	if (!t)
		return;
	if (t->started) {
		__atomic_store_n(&t->stop, 1, __ATOMIC_SEQ_CST);
		kvsp_trace_kick(t);
		pthread_join(t->thread, NULL);
	}
	if (t->fd >= 0)
		close(t->fd);
	free(t->ring_mem);
	free(t);
}
