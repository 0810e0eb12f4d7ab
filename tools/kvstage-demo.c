/* SPDX-License-Identifier: MIT */
/*
 * kvstage-demo: a receiver process and a sender process move canary-stamped
 * rooms through a running kvstaged, the way a decode and a prefill engine
 * would. Descriptors travel over a pipe (the engines' bootstrap channel).
 * The receiver checks every byte; then the demo shows what the proxy
 * refuses (a stale lease, a forged token) and aborts one room.
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "canary.h"
#include "kvstage.h"
#include "parse.h"
#include "sock.h"

static const char *sock_path;
static unsigned nrooms = 64;
static uint64_t room_bytes;

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int die(const char *who, const char *what, int rc)
{
	fprintf(stderr, "kvstage-demo %s: %s: %s\n", who, what, kvs_strerror(rc));
	return 1;
}

static int receiver(int desc_wr)
{
	kvs_client *c;
	int rc = kvs_connect(sock_path, &c);
	if (rc < 0)
		return die("receiver", "connect", rc);
	unsigned bad = 0, done = 0;
	for (unsigned i = 0; i < nrooms; i++) {
		kvs_room *r;
		struct kvs_room_desc d;
		rc = kvs_recv_open(c, room_bytes, i, &r, &d);
		if (rc < 0)
			return die("receiver", "recv_open", rc);
		if (kvs_write_full(desc_wr, &d, sizeof(d)) < 0)
			return die("receiver", "pipe", -EPIPE);
		struct kvs_event ev;
		rc = kvs_wait(c, &ev, 10000);
		if (rc < 0)
			return die("receiver", "wait", rc);
		if (ev.type != KVS_EV_RECV_DONE || ev.user_data != i) {
			fprintf(stderr, "kvstage-demo receiver: room %u ended with event %u (%s)\n",
				i, ev.type, kvs_strerror(ev.status));
			return 1;
		}
		size_t ss = kvs_slot_size(c);
		for (unsigned k = 0; k < kvs_room_chunks(r); k++) {
			struct kvs_lease l;
			kvs_room_lease(r, k, &l);
			const void *p = kvs_lease_ptr(c, &l);
			uint64_t off = (uint64_t)k * ss;
			uint64_t len = room_bytes - off < ss ? room_bytes - off : ss;
			if (!p || canary_check(p, 1000 + i, off, len) != len)
				bad++;
		}
		kvs_room_close(r);
		done++;
	}
	printf("receiver: %u rooms of %llu bytes received, %u chunks with a wrong byte\n", done,
	       (unsigned long long)room_bytes, bad);
	kvs_close(c);
	return bad ? 1 : 0;
}

static int sender(int desc_rd)
{
	kvs_client *c;
	int rc = kvs_connect(sock_path, &c);
	if (rc < 0)
		return die("sender", "connect", rc);
	size_t ss = kvs_slot_size(c);
	for (unsigned i = 0; i < nrooms; i++) {
		struct kvs_room_desc d;
		if (kvs_read_full(desc_rd, &d, sizeof(d)) != 1)
			return die("sender", "pipe", -EPIPE);
		kvs_room *r;
		rc = kvs_send_open(c, &d, 0x5000 + i, &r);
		if (rc < 0)
			return die("sender", "send_open", rc);
		unsigned n = kvs_room_chunks(r);
		struct kvs_lease l[64];
		if (n > 64)
			return die("sender", "room too big for the demo", -EINVAL);
		rc = kvs_acquire(c, n, l);
		if (rc < 0)
			return die("sender", "acquire", rc);
		for (unsigned k = 0; k < n; k++) {
			uint64_t off = (uint64_t)k * ss;
			uint32_t len = (uint32_t)(room_bytes - off < ss ? room_bytes - off : ss);
			canary_fill(kvs_lease_ptr(c, &l[k]), 1000 + i, off, len);
			rc = kvs_send(r, &l[k], off, len);
			if (rc < 0)
				return die("sender", "send", rc);
		}
		struct kvs_event ev;
		rc = kvs_wait(c, &ev, 10000);
		if (rc < 0 || ev.type != KVS_EV_SEND_DONE)
			return die("sender", "SEND_DONE", rc < 0 ? rc : ev.status);
		kvs_room_close(r);
		/* The slots went to the receiver: our old leases are stale now. */
		if (i == 0) {
			rc = kvs_release(c, &l[0]);
			printf("sender: releasing a slot already handed over -> %d (%s)\n", rc,
			       kvs_strerror(rc));
		}
	}
	kvs_close(c);
	return 0;
}

/* One room with a forged token, one aborted mid-way. */
static int refusals(void)
{
	kvs_client *a, *b;
	int rc = kvs_connect(sock_path, &a);
	if (rc == 0)
		rc = kvs_connect(sock_path, &b);
	if (rc < 0)
		return die("demo", "connect", rc);
	kvs_room *rr, *sr;
	struct kvs_room_desc d, forged;
	rc = kvs_recv_open(a, 3 * kvs_slot_size(a), 77, &rr, &d);
	if (rc < 0)
		return die("demo", "recv_open", rc);
	forged = d;
	forged.bytes[24] ^= 1; /* a bit of the token */
	rc = kvs_send_open(b, &forged, 1, &sr);
	printf("demo: sender with a forged token -> %d (%s)\n", rc, kvs_strerror(rc));
	rc = kvs_send_open(b, &d, 78, &sr);
	if (rc < 0)
		return die("demo", "send_open", rc);
	struct kvs_lease l;
	kvs_acquire(b, 1, &l);
	kvs_send(sr, &l, 0, (uint32_t)kvs_slot_size(b));
	kvs_abort(sr);
	struct kvs_event ev = { 0 };
	rc = kvs_wait(a, &ev, 10000);
	if (rc < 0)
		return die("demo", "wait for the aborted room's final", rc);
	printf("demo: room aborted by its sender after 1 of 3 chunks -> receiver gets %s (%s)\n",
	       ev.type == KVS_EV_ABORTED ? "ABORTED" : "something else", kvs_strerror(ev.status));
	kvs_close(a);
	kvs_close(b);
	return rc < 0 || ev.type != KVS_EV_ABORTED;
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "socket", required_argument, NULL, 's' },
		{ "rooms", required_argument, NULL, 'r' },
		{ "bytes", required_argument, NULL, 'b' },
		{ "help", no_argument, NULL, 'h' },
		{ 0 },
	};
	int opt;
	sock_path = getenv("KVSTAGE_SOCKET");
	while ((opt = getopt_long(argc, argv, "s:r:b:h", opts, NULL)) != -1) {
		switch (opt) {
		case 's':
			sock_path = optarg;
			break;
		case 'r': {
			char *end;
			unsigned long v = strtoul(optarg, &end, 10);
			if (*optarg < '0' || *optarg > '9' || *end || !v || v > 1000000) {
				fprintf(stderr,
					"kvstage-demo: bad --rooms '%s' (want 1 to 1000000)\n",
					optarg);
				return 2;
			}
			nrooms = (unsigned)v;
			break;
		}
		case 'b':
			if (kvs_parse_size(optarg, &room_bytes) || !room_bytes) {
				fprintf(stderr,
					"kvstage-demo: bad --bytes '%s' (want BYTES, K/M/G "
					"suffixes)\n",
					optarg);
				return 2;
			}
			break;
		case 'h':
			printf("Usage: kvstage-demo [-s SOCKET] [-r ROOMS] [-b BYTES]\n"
			       "Moves ROOMS canary-stamped rooms of BYTES (default 2.5 slots) from "
			       "a\n"
			       "sender process to a receiver process through kvstaged, checks "
			       "every\n"
			       "byte, and shows a forged token and an abort being handled.\n");
			return 0;
		default:
			fprintf(stderr, "Try 'kvstage-demo --help'.\n");
			return 2;
		}
	}
	if (!nrooms) {
		fprintf(stderr, "kvstage-demo: --rooms must be > 0\n");
		return 2;
	}
	kvs_client *probe;
	int rc = kvs_connect(sock_path, &probe);
	if (rc < 0)
		return die("demo", sock_path ? sock_path : "default socket", rc);
	size_t ss = kvs_slot_size(probe);
	if (!room_bytes)
		room_bytes = ss * 2 + ss / 2;
	if (room_bytes > 64 * ss || room_bytes > (uint64_t)kvs_slot_count(probe) * ss) {
		fprintf(stderr, "kvstage-demo: --bytes too large for this pool\n");
		return 2;
	}
	printf("demo: %u rooms of %llu bytes through a pool of %u x %zu KiB slots\n", nrooms,
	       (unsigned long long)room_bytes, kvs_slot_count(probe), ss >> 10);
	fflush(stdout);
	kvs_close(probe);

	int p[2];
	if (pipe(p) < 0)
		return 1;
	double t0 = now_s();
	pid_t rx = fork();
	if (rx == 0) {
		close(p[0]);
		int rc = receiver(p[1]);
		fflush(stdout);
		_exit(rc);
	}
	pid_t tx = fork();
	if (tx == 0) {
		close(p[1]);
		int rc = sender(p[0]);
		fflush(stdout);
		_exit(rc);
	}
	close(p[0]);
	close(p[1]);
	int st_rx, st_tx;
	waitpid(rx, &st_rx, 0);
	waitpid(tx, &st_tx, 0);
	double dt = now_s() - t0;
	int ok = WIFEXITED(st_rx) && !WEXITSTATUS(st_rx) && WIFEXITED(st_tx) && !WEXITSTATUS(st_tx);
	printf("demo: %s in %.3f s (%.1f MB/s, payload written and checked by the clients)\n",
	       ok ? "all bytes verified" : "FAILED", dt,
	       (double)nrooms * (double)room_bytes / dt / 1e6);
	if (!ok)
		return 1;
	return refusals();
}
