/* SPDX-License-Identifier: MIT */
/*
 * The raw TCP baseline: what the kernel gives a stream between two
 * endpoints with nothing of kvstage in it. One sender process and one
 * receiver process (placed like the two proxies, in their namespaces with
 * --netns), each holding every socket in one thread and polling them
 * without sleeping, reading and writing each until EAGAIN, as a proxy
 * does, and reading large chunks at a mark as it does: one socket is the
 * single-stream figure, --tcp-streams sockets the multi-stream one. The
 * receiver measures.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"

#define RAW_MAX_STREAMS 16

int bench_enter_netns(const char *ns)
{
	if (!ns || !*ns)
		return 0;
	char path[128];
	snprintf(path, sizeof(path), "/run/netns/%s", ns);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	int rc = setns(fd, CLONE_NEWNET) < 0 ? -errno : 0;
	close(fd);
	return rc;
}

/* A chunk-sized ring of buffers, at least 64 MiB: copies from and to
 * memory that is not all in cache, as a transport's are. */
static size_t ring_len(uint64_t chunk, size_t *n)
{
	*n = (64u << 20) / chunk < 16 ? 16 : (64u << 20) / chunk;
	return *n * chunk;
}

static void sender(const struct raw_tcp *r, const struct sockaddr_in *sa)
{
	size_t n, len = ring_len(r->chunk, &n);
	uint8_t *src = bench_alloc(len, false);
	int s[RAW_MAX_STREAMS];
	struct pollfd pf[RAW_MAX_STREAMS];
	size_t off[RAW_MAX_STREAMS] = { 0 }, idx[RAW_MAX_STREAMS] = { 0 };
	if (!src)
		_exit(1);
	for (unsigned k = 0; k < r->streams; k++) {
		s[k] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
		int one = 1;
		if (s[k] < 0 || connect(s[k], (const struct sockaddr *)sa, sizeof(*sa)) < 0)
			_exit(1);
		setsockopt(s[k], IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
		fcntl(s[k], F_SETFL, O_NONBLOCK);
		pf[k] = (struct pollfd){ .fd = s[k], .events = POLLOUT };
		idx[k] = k % n;
	}
	/* Until the receiver hangs up. */
	for (;;) {
		if (poll(pf, r->streams, 0) < 0 && errno != EINTR)
			_exit(1);
		for (unsigned k = 0; k < r->streams; k++) {
			if (!(pf[k].revents & (POLLOUT | POLLERR | POLLHUP)))
				continue;
			for (;;) {
				const uint8_t *p = src + idx[k] * r->chunk + off[k];
				ssize_t w = send(s[k], p, r->chunk - off[k], MSG_NOSIGNAL);
				if (w < 0 && errno == EAGAIN)
					break;
				if (w <= 0)
					_exit(0);
				off[k] += (size_t)w;
				if (off[k] == r->chunk) {
					off[k] = 0;
					idx[k] = (idx[k] + r->streams) % n;
				}
			}
		}
	}
}

/*
 * kvstaged's mark for a large payload (proxy/peer/conn.h's PCONN_LOWAT_*,
 * design note 35): the socket wakes its reader once what the chunk still
 * owes is in (at most 1 MiB), when that is at least 64 KiB; else at the
 * kernel's 1. A baseline that read each piece loopback hands over (64-100
 * KiB) ran at 0.6 of the proxies it stands beside, so it was no limit.
 */
#define RAW_LOWAT_MIN (64u << 10)
#define RAW_LOWAT_MAX (1u << 20)

static void raw_mark(int fd, size_t owed, int *mark)
{
	int v = owed < RAW_LOWAT_MIN ? 1 : owed > RAW_LOWAT_MAX ? (int)RAW_LOWAT_MAX : (int)owed;
	if (v != *mark && setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &v, sizeof(v)) == 0)
		*mark = v;
}

/* What the receiver tells the parent: GB/s (< 0: failed), and the bytes
 * and its own CPU seconds over the same window. */
struct raw_result {
	double gbps, bytes, cpu_s;
};

static double cpu_of(const struct rusage *ru)
{
	return (double)(ru->ru_utime.tv_sec + ru->ru_stime.tv_sec) +
	       (double)(ru->ru_utime.tv_usec + ru->ru_stime.tv_usec) / 1e6;
}

static double self_cpu_seconds(void)
{
	struct rusage ru;
	return getrusage(RUSAGE_SELF, &ru) == 0 ? cpu_of(&ru) : -1;
}

/* Accepts every stream, then reads for r->sec; writes a raw_result to out_fd. */
static void receiver(const struct raw_tcp *r, int ls, int out_fd)
{
	size_t n, len = ring_len(r->chunk, &n);
	uint8_t *dst = bench_alloc(len, false);
	struct pollfd pf[RAW_MAX_STREAMS];
	size_t off[RAW_MAX_STREAMS] = { 0 }, idx[RAW_MAX_STREAMS] = { 0 };
	int mark[RAW_MAX_STREAMS] = { 0 };
	if (!dst)
		_exit(1);
	for (unsigned k = 0; k < r->streams; k++) {
		struct pollfd lp = { .fd = ls, .events = POLLIN };
		int fd = poll(&lp, 1, 10000) == 1
				 ? accept4(ls, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK)
				 : -1;
		if (fd < 0)
			_exit(1);
		pf[k] = (struct pollfd){ .fd = fd, .events = POLLIN };
		idx[k] = k % n;
	}
	/* The clock starts with the first bytes: a slow start (a loaded or
	 * instrumented host) must not leave the window empty. */
	if (poll(pf, r->streams, 10000) <= 0)
		_exit(1);
	double cpu0 = self_cpu_seconds();
	uint64_t bytes = 0, t0 = now_ns(), t = t0, end = t0 + (uint64_t)(r->sec * 1e9);
	while (t < end) {
		for (unsigned k = 0; k < r->streams; k++) /* where its reading stopped */
			raw_mark(pf[k].fd, r->chunk - off[k], &mark[k]);
		if (poll(pf, r->streams, 0) < 0 && errno != EINTR)
			break;
		for (unsigned k = 0; k < r->streams; k++) {
			if (!(pf[k].revents & (POLLIN | POLLERR | POLLHUP)))
				continue;
			for (;;) {
				ssize_t got = recv(pf[k].fd, dst + idx[k] * r->chunk + off[k],
						   r->chunk - off[k], 0);
				if (got < 0 && (errno == EAGAIN || errno == EINTR))
					break;
				if (got <= 0)
					goto out;
				bytes += (uint64_t)got;
				off[k] += (size_t)got;
				if (off[k] == r->chunk) {
					off[k] = 0;
					idx[k] = (idx[k] + r->streams) % n;
				}
			}
		}
		t = now_ns();
	}
out:;
	struct raw_result res = { -1, (double)bytes, self_cpu_seconds() - cpu0 };
	if (t >= end)
		res.gbps = (double)bytes / (double)(t - t0);
	if (write(out_fd, &res, sizeof(res)) != sizeof(res))
		_exit(1);
	_exit(0);
}

double baseline_raw_tcp(struct raw_tcp *r)
{
	r->cpu_s_per_gb = -1;
	if (r->streams < 1 || r->streams > RAW_MAX_STREAMS)
		return -1;
	struct sockaddr_in sa = { .sin_family = AF_INET };
	if (inet_pton(AF_INET, r->rx_ip ? r->rx_ip : "127.0.0.1", &sa.sin_addr) != 1)
		return -1;
	int port_pipe[2], res_pipe[2];
	if (pipe2(port_pipe, O_CLOEXEC) < 0)
		return -1;
	if (pipe2(res_pipe, O_CLOEXEC) < 0) {
		close(port_pipe[0]);
		close(port_pipe[1]);
		return -1;
	}
	pid_t rx = bench_fork(r->rx_cpu);
	if (rx == 0) {
		close(port_pipe[0]);
		close(res_pipe[0]);
		/* The listener lives in the receiver's namespace. */
		int ls = bench_enter_netns(r->rx_ns) < 0
				 ? -1
				 : socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
		socklen_t sl = sizeof(sa);
		if (ls < 0 || bind(ls, (struct sockaddr *)&sa, sizeof(sa)) < 0 ||
		    listen(ls, 16) < 0 || getsockname(ls, (struct sockaddr *)&sa, &sl) < 0 ||
		    write(port_pipe[1], &sa.sin_port, sizeof(sa.sin_port)) != sizeof(sa.sin_port))
			_exit(1);
		close(port_pipe[1]);
		receiver(r, ls, res_pipe[1]);
	}
	close(port_pipe[1]);
	close(res_pipe[1]);
	pid_t tx = -1;
	struct raw_result res = { -1, 0, -1 };
	if (rx > 0 &&
	    read(port_pipe[0], &sa.sin_port, sizeof(sa.sin_port)) == sizeof(sa.sin_port)) {
		tx = bench_fork(r->tx_cpu);
		if (tx == 0) {
			if (bench_enter_netns(r->tx_ns) < 0)
				_exit(1);
			sender(r, &sa);
		}
		if (read(res_pipe[0], &res, sizeof(res)) != sizeof(res))
			res.gbps = -1;
	}
	close(port_pipe[0]);
	close(res_pipe[0]);
	/* The receiver exits after writing; the sender on its hang-up. The
	 * sender's CPU is its whole life: connecting, and the moment after
	 * the window until it hears the hang-up, are small beside it. */
	struct rusage ru;
	if (rx > 0)
		waitpid(rx, NULL, 0);
	if (tx > 0 && wait4(tx, NULL, 0, &ru) == tx && res.gbps > 0 && res.bytes > 0 &&
	    res.cpu_s >= 0)
		r->cpu_s_per_gb = (res.cpu_s + cpu_of(&ru)) / (res.bytes / 1e9);
	return res.gbps;
}

double baseline_tcp(uint64_t chunk, double sec)
{
	struct raw_tcp r = { .chunk = chunk, .sec = sec, .streams = 1, .tx_cpu = -1, .rx_cpu = -1 };
	return baseline_raw_tcp(&r);
}
