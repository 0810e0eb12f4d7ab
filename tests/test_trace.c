/* SPDX-License-Identifier: MIT */
/*
 * The lifecycle trace (--trace-file, design note 45): a room followed
 * across two proxies by its key, an abort's fence on both sides, a held
 * writer whose buffer drops exactly the excess while rooms go on, the
 * unix socket sinks, and what is refused at start. Barriers only: the
 * trace's counters (stat_wait), the trace.write and tcp.payload
 * failpoints, and sync ops.
 */
#include <criterion/criterion.h>
#include <endian.h>
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "harness.h"
#include "xroom.h"

#define SECRET "kvstage-test-secret-0123456789abcdef"

static struct proxy pa = PROXY_INIT, pb = PROXY_INIT;
static char dir[64];
static char fa[128], fb[128];

static void setup(void)
{
	setenv("KVSTAGE_PEER_SECRET", SECRET, 1);
	strcpy(dir, "/tmp/kvstage-trace.XXXXXX");
	cr_assert_not_null(mkdtemp(dir));
	snprintf(fa, sizeof(fa), "%s/a.jsonl", dir);
	snprintf(fb, sizeof(fb), "%s/b.jsonl", dir);
}

static void teardown(void)
{
	proxy_stop(&pa);
	proxy_stop(&pb);
	unlink(fa);
	unlink(fb);
	rmdir(dir);
}

TestSuite(trace, .init = setup, .fini = teardown, .timeout = 120);

/* ------------------------------------------------------------ the lines */

#define MAX_LINES 256

struct line {
	char event[32], side[8], room[48], instance[24], final[16];
	long long chunk, status;
	unsigned long long mono;
};

static char text[1 << 16];

/* The value of "name" in one line of ours (string or number), or "". */
static void field(const char *l, const char *name, char *out, size_t n)
{
	char key[40];
	snprintf(key, sizeof(key), "\"%s\":", name);
	const char *v = strstr(l, key);
	out[0] = 0;
	if (!v)
		return;
	v += strlen(key);
	bool str = *v == '"';
	v += str;
	size_t k = 0;
	while (v[k] && k + 1 < n && (str ? v[k] != '"' : v[k] != ',' && v[k] != '}'))
		k++;
	memcpy(out, v, k);
	out[k] = 0;
}

/* Every line of file: each parses as JSON (python3's json module), ends with
 * a newline, and carries the schema; returns how many, fields into ls. */
static unsigned read_lines(const char *file, struct line *ls)
{
	static char out[4096], err[4096];
	int rc = run_cmd((const char *[]){ "/usr/bin/python3", "-c",
					   "import json, sys\n"
					   "for l in open(sys.argv[1]):\n"
					   "    assert l.endswith('\\n'), l\n"
					   "    json.loads(l)\n",
					   file, NULL },
			 out, sizeof(out), err, sizeof(err));
	cr_assert_eq(rc, 0, "%s is not JSON lines: %s", file, err);
	FILE *f = fopen(file, "r");
	cr_assert_not_null(f, "%s: %s", file, strerror(errno));
	size_t len = fread(text, 1, sizeof(text) - 1, f);
	fclose(f);
	text[len] = 0;
	unsigned n = 0;
	char tmp[32];
	for (char *l = text, *e; *l; l = e + 1) {
		e = strchr(l, '\n');
		cr_assert_not_null(e);
		*e = 0;
		cr_assert_lt(n, MAX_LINES);
		cr_assert(strstr(l, "{\"schema\":\"kvstage-proxy-v1\",") == l, "%s", l);
		struct line *x = &ls[n++];
		field(l, "event", x->event, sizeof(x->event));
		field(l, "side", x->side, sizeof(x->side));
		field(l, "room", x->room, sizeof(x->room));
		field(l, "instance", x->instance, sizeof(x->instance));
		field(l, "final", x->final, sizeof(x->final));
		field(l, "chunk", tmp, sizeof(tmp));
		x->chunk = tmp[0] ? atoll(tmp) : -1;
		field(l, "status", tmp, sizeof(tmp));
		x->status = tmp[0] ? atoll(tmp) : 1;
		field(l, "monotonic_ns", tmp, sizeof(tmp));
		x->mono = strtoull(tmp, NULL, 10);
		*e = '\n';
	}
	return n;
}

/* The lines' events are exactly want (NULL-terminated), all on side, all
 * about room key, all written by instance; their clock never goes back. */
static void expect(const struct line *ls, unsigned n, const char *const *want, const char *side,
		   const char *key, uint64_t instance, const char *file)
{
	char inst[24];
	snprintf(inst, sizeof(inst), "%016llx", (unsigned long long)instance);
	unsigned k = 0;
	for (; want[k]; k++) {
		cr_assert_lt(k, n, "%s: %u lines, wanted %s next", file, n, want[k]);
		cr_assert_str_eq(ls[k].event, want[k], "%s line %u", file, k + 1);
		cr_assert_str_eq(ls[k].side, side, "%s line %u", file, k + 1);
		cr_assert_str_eq(ls[k].room, key, "%s line %u: another room key", file, k + 1);
		cr_assert_str_eq(ls[k].instance, inst, "%s line %u", file, k + 1);
		cr_assert(k == 0 || ls[k].mono >= ls[k - 1].mono, "%s line %u", file, k + 1);
	}
	cr_assert_eq(n, k, "%s: %u lines, wanted %u", file, n, k);
}

/* The room key of descriptor d: what the engine's trace names too. */
static void key_of(const struct kvs_room_desc *d, char *key, size_t n)
{
	const struct kvs_desc_wire *w = (const void *)d->bytes;
	snprintf(key, n, "%016llx.%u.%u", (unsigned long long)le64toh(w->instance),
		 le32toh(w->room), le32toh(w->gen));
}

/* Neither the token's bytes nor its hex are anywhere in file. */
/* A's file (fa) holds the send side's lines of the room d names, send[] in
 * order, B's (fb) the receive side's, recv[]; both read into la and lb. */
static void expect_both(const struct kvs_room_desc *d, char *key, size_t keylen, struct line *la,
			struct line *lb, const char *const *send, const char *const *recv)
{
	key_of(d, key, keylen);
	expect(la, read_lines(fa, la), send, "send", key, pa.ctrl->instance, fa);
	expect(lb, read_lines(fb, lb), recv, "recv", key, pb.ctrl->instance, fb);
}

static void no_token(const struct kvs_room_desc *d, const char *file)
{
	const struct kvs_desc_wire *w = (const void *)d->bytes;
	FILE *f = fopen(file, "r");
	cr_assert_not_null(f);
	size_t len = fread(text, 1, sizeof(text), f);
	fclose(f);
	char hex[33];
	for (int i = 0; i < 16; i++)
		snprintf(hex + 2 * i, 3, "%02x", w->token[i]);
	cr_assert_null(memmem(text, len, w->token, 16), "%s holds the token", file);
	cr_assert_null(memmem(text, len, hex, 32), "%s holds the token in hex", file);
	for (int i = 0; i < 16; i++) /* nor in upper case */
		if (hex[i * 2] >= 'a')
			hex[i * 2] = (char)(hex[i * 2] - 'a' + 'A');
	cr_assert_null(memmem(text, len, hex, 32), "%s holds the token in HEX", file);
}

#define TRACED(px, file)                                                                 \
	proxy_start(px, NULL,                                                            \
		    (const char *[]){ "--slots", "64", "--slot-size", "64K", "--listen", \
				      "127.0.0.1:0", "--trace-file", file, NULL })

/* --------------------------------------------------------- across tcp */

/* At the defaults: one room of three chunks from a client of A to one of
 * B. A's lines are the send side's, B's the receive side's, in the order
 * of the room's life, both naming the key the descriptor gives. */
Test(trace, one_room_is_followed_across_both_proxies_by_its_key)
{
	TRACED(&pb, fb);
	TRACED(&pa, fa);
	kvs_client *rx = connect_ok(&pb), *tx = connect_ok(&pa);
	struct xroom x;
	xroom_open(&x, rx, tx, 3 * SLOT - 7, 0x41);
	xroom_send(&x, tx);
	cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
	cr_assert_eq(wait_event(rx).type, KVS_EV_RECV_DONE);
	xroom_verify(&x, rx);
	xroom_close(&x);
	wait_idle(&pa, 1);
	wait_idle(&pb, 1); /* both halves freed: reaped */
	stat_wait(&pa, "trace_written", 1, 6);
	stat_wait(&pb, "trace_written", 1, 5);
	cr_assert_eq(stat_get(&pa, "trace_dropped"), 0);
	cr_assert_eq(stat_get(&pb, "trace_dropped"), 0);

	char key[48];
	static struct line la[MAX_LINES], lb[MAX_LINES];
	expect_both(&x.d, key, sizeof(key), la, lb,
		    (const char *[]){ "room_opened", "chunk_queued", "chunk_queued", "chunk_sent",
				      "room_final", "room_reaped", NULL },
		    (const char *[]){ "room_opened", "chunk_landed", "chunk_landed", "room_final",
				      "room_reaped", NULL });
	/* The key is the receiving proxy's room: its instance leads it. */
	char inst[24];
	snprintf(inst, sizeof(inst), "%016llx.", (unsigned long long)pb.ctrl->instance);
	cr_assert(!strncmp(key, inst, 17), "key %s, receiver %s", key, inst);
	cr_assert_eq(la[1].chunk, 0, "the first chunk queued");
	cr_assert_eq(la[2].chunk, 2, "the last chunk queued");
	/* Sent: the last the transport was done with, whichever (two streams). */
	cr_assert(la[3].chunk >= 0 && la[3].chunk <= 2, "the last chunk sent: %lld", la[3].chunk);
	cr_assert(lb[1].chunk >= 0 && lb[2].chunk >= 0 && lb[1].chunk != lb[2].chunk);
	cr_assert_str_eq(la[4].final, "send_done");
	cr_assert_eq(la[4].status, 0);
	cr_assert_str_eq(lb[3].final, "recv_done");
	cr_assert_eq(lb[3].status, 0);
	no_token(&x.d, fa);
	no_token(&x.d, fb);
	kvs_close(rx);
	kvs_close(tx);
}

/* The receiver aborts while the room's one chunk is in flight (its
 * payload held on A after its header: a slot posted on B, a pin on A).
 * Each side is fenced, its slot a tombstone until the transport lets go,
 * and its final is ABORTED. */
Test(trace, an_abort_mid_room_fences_both_sides)
{
	TRACED(&pb, fb);
	TRACED(&pa, fa);
	kvs_client *rx = connect_ok(&pb), *tx = connect_ok(&pa);
	uint64_t owner = 0x42;
	cr_assert_eq(kvs_admin_fp_set_mask(pa.admin, "tcp.payload", "pause", owner, 0xffff), 0);
	struct xroom x;
	xroom_open(&x, rx, tx, SLOT, owner);
	xroom_send(&x, tx);
	fp_wait(&pa, "tcp.payload", 1);
	stat_wait(&pb, "slots.recv_posted", 1, 1);
	cr_assert_eq(kvs_abort(x.rr), 0);
	sync_barrier(rx); /* B acted on the abort before the payload goes on */
	stat_wait(&pa, "slots.tombstone", 1, 1);
	fp_set(&pa, "tcp.payload", "off", NULL);
	struct kvs_event e = wait_event(rx);
	cr_assert_eq(e.type, KVS_EV_ABORTED, "receiver: %u", e.type);
	e = wait_event(tx);
	cr_assert_eq(e.type, KVS_EV_ABORTED, "sender: %u", e.type);
	xroom_close(&x);
	wait_idle(&pa, 1);
	wait_idle(&pb, 1);
	stat_wait(&pa, "trace_written", 1, 6);
	stat_wait(&pb, "trace_written", 1, 5);

	char key[48];
	static struct line la[MAX_LINES], lb[MAX_LINES];
	expect_both(&x.d, key, sizeof(key), la, lb,
		    (const char *[]){ "room_opened", "chunk_queued", "room_fenced",
				      "slot_tombstoned", "room_final", "room_reaped", NULL },
		    (const char *[]){ "room_opened", "room_fenced", "slot_tombstoned", "room_final",
				      "room_reaped", NULL });
	cr_assert_eq(la[3].chunk, 0);
	cr_assert_eq(lb[2].chunk, 0);
	cr_assert_str_eq(la[4].final, "aborted");
	cr_assert_str_eq(lb[3].final, "aborted");
	cr_assert_eq(lb[1].status, -ECANCELED, "the receiver's own abort");
	cr_assert_eq(lb[3].status, -ECANCELED);
	cr_assert_lt(la[2].status, 0, "the sender was told by its peer");
	no_token(&x.d, fa);
	no_token(&x.d, fb);
	kvs_close(rx);
	kvs_close(tx);
}

/* ------------------------------------------------- a writer held back */

/* One local room of one chunk: both halves on one proxy, 9 lines (each
 * half opened, queued, sent, landed, two finals, two reaped). */
#define LOCAL_LINES 9

static void local_room(kvs_client *c, uint64_t ud)
{
	kvs_room *rr, *sr;
	struct kvs_room_desc d;
	struct kvs_lease l;
	cr_assert_eq(kvs_recv_open(c, SLOT, ud, &rr, &d), 0);
	cr_assert_eq(kvs_send_open(c, &d, ud | 1ull << 40, &sr), 0);
	cr_assert_eq(kvs_acquire(c, 1, &l), 0);
	cr_assert_eq(kvs_send(sr, &l, 0, SLOT), 0);
	for (int k = 0; k < 2; k++) {
		struct kvs_event e = wait_event(c);
		cr_assert(e.type == KVS_EV_RECV_DONE || e.type == KVS_EV_SEND_DONE, "%u", e.type);
	}
	cr_assert_eq(kvs_room_close(rr), 0);
	cr_assert_eq(kvs_room_close(sr), 0);
}

/* The writer stops at trace.write before taking anything, with an empty
 * buffer of 16. Rooms go on as ever (the loop never waits): of their 36
 * records the first 16 are kept and the other 20 dropped and counted;
 * once let go, the writer writes those 16, whole, and then what comes. */
Test(trace, a_held_writer_drops_exactly_the_excess_and_blocks_nothing)
{
	proxy_start(&pa, NULL,
		    (const char *[]){ "--slots", "16", "--slot-size", "64K", "--trace-file", fa,
				      "--trace-buffer", "16", NULL });
	fp_set(&pa, "trace.write", "pause", NULL);
	fp_wait(&pa, "trace.write", 1);
	kvs_client *c = connect_ok(&pa);
	for (unsigned i = 0; i < 4; i++)
		local_room(c, 0x100 + i);
	sync_barrier(c); /* the closes are done: every record is pushed */
	cr_assert_eq(stat_get(&pa, "trace_dropped"), 4 * LOCAL_LINES - 16);
	cr_assert_eq(stat_get(&pa, "trace_written"), 0, "held: nothing taken");
	cr_assert_eq(stat_get(&pa, "rooms_done"), 4, "no room waited for the writer");

	fp_set(&pa, "trace.write", "off", NULL);
	stat_wait(&pa, "trace_written", 1, 16);
	static struct line la[MAX_LINES];
	cr_assert_eq(read_lines(fa, la), 16);
	cr_assert_str_eq(la[0].event, "room_opened");
	local_room(c, 0x200); /* and what comes after is written, all of it */
	sync_barrier(c);
	stat_wait(&pa, "trace_written", 1, 16 + LOCAL_LINES);
	cr_assert_eq(read_lines(fa, la), 16 + LOCAL_LINES);
	cr_assert_eq(stat_get(&pa, "trace_dropped"), 4 * LOCAL_LINES - 16);
	cr_assert_str_eq(la[16].event, "room_opened");
	cr_assert_str_eq(la[16 + LOCAL_LINES - 1].event, "room_reaped");
	kvs_close(c);
}

/* A sink that fails every write (/dev/full: ENOSPC): its lines are
 * dropped and counted, said once in the log, and the rooms go on. */
Test(trace, a_failing_sink_drops_and_counts_and_blocks_nothing)
{
	proxy_start(&pa, NULL,
		    (const char *[]){ "--slots", "16", "--slot-size", "64K", "--trace-file",
				      "/dev/full", NULL });
	kvs_client *c = connect_ok(&pa);
	local_room(c, 0x400);
	local_room(c, 0x401);
	sync_barrier(c);
	stat_wait(&pa, "trace_dropped", 1, 2 * LOCAL_LINES);
	cr_assert_eq(stat_get(&pa, "trace_dropped"), 2 * LOCAL_LINES);
	cr_assert_eq(stat_get(&pa, "trace_written"), 0);
	cr_assert_eq(stat_get(&pa, "rooms_done"), 2);
	cr_assert_eq(proxy_log_count(&pa, "--trace-file /dev/full: No space left on device"), 1,
		     "said once, however many lines it drops");
	kvs_close(c);
}

/* ------------------------------------------------------ socket sinks */

/* unix:PATH: a datagram socket gets a line a datagram, a stream one the
 * lines back to back. */
Test(trace, unix_socket_sinks_stream_and_datagram)
{
	const int types[2] = { SOCK_DGRAM, SOCK_STREAM };
	for (int k = 0; k < 2; k++) {
		struct sockaddr_un sa = { .sun_family = AF_UNIX };
		snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/sink%d", dir, k);
		int s = socket(AF_UNIX, types[k] | SOCK_CLOEXEC, 0);
		cr_assert_geq(s, 0);
		cr_assert_eq(bind(s, (struct sockaddr *)&sa, sizeof(sa)), 0, "%s", strerror(errno));
		if (types[k] == SOCK_STREAM)
			cr_assert_eq(listen(s, 1), 0);
		char where[160];
		snprintf(where, sizeof(where), "unix:%s", sa.sun_path);
		struct proxy *px = k ? &pb : &pa;
		proxy_start(px, NULL,
			    (const char *[]){ "--slots", "16", "--slot-size", "64K", "--trace-file",
					      where, NULL });
		int fd = s;
		if (types[k] == SOCK_STREAM) {
			fd = accept(s, NULL, NULL); /* it dialed at start: queued */
			cr_assert_geq(fd, 0);
		}
		kvs_client *c = connect_ok(px);
		local_room(c, 0x300);
		sync_barrier(c);
		stat_wait(px, "trace_written", 1, LOCAL_LINES);
		static char buf[8192];
		size_t got = 0;
		unsigned lines = 0;
		while (lines < LOCAL_LINES) {
			struct pollfd pfd = { fd, POLLIN, 0 };
			cr_assert_eq(poll(&pfd, 1, WAIT_MS), 1, "lines stopped at %u", lines);
			ssize_t n = recv(fd, buf + got, sizeof(buf) - got - 1, 0);
			cr_assert_gt(n, 0);
			if (types[k] == SOCK_DGRAM) /* one line, whole */
				cr_assert(n > 1 && buf[got + (size_t)n - 1] == '\n' &&
						  !memchr(buf + got, '\n', (size_t)n - 1),
					  "a datagram that is not one line");
			for (ssize_t i = 0; i < n; i++)
				lines += buf[got + (size_t)i] == '\n';
			got += (size_t)n;
		}
		buf[got] = 0;
		cr_assert_eq(lines, LOCAL_LINES);
		cr_assert(
			strstr(buf, "{\"schema\":\"kvstage-proxy-v1\",\"event\":\"room_opened\"") ==
				buf,
			"%s", buf);
		cr_assert(strstr(buf, "\"event\":\"room_reaped\""), "%s", buf);
		kvs_close(c);
		proxy_stop(px);
		if (fd != s)
			close(fd);
		close(s);
		unlink(sa.sun_path);
	}
}

/* ------------------------------------------------- refused at start */

Test(trace, an_unwritable_sink_or_a_bad_buffer_is_refused_at_start)
{
	static char out[4096], err[4096];
	const char *bin = build_path("proxy/kvstaged");
	char isdir[96], nosock[96], fifo[96];
	snprintf(isdir, sizeof(isdir), "%s", dir);
	snprintf(nosock, sizeof(nosock), "unix:%s/nobody-listens", dir);
	snprintf(fifo, sizeof(fifo), "%s/fifo", dir);
	cr_assert_eq(mkfifo(fifo, 0600), 0, "%s", strerror(errno));
	struct {
		const char *where, *says;
	} sinks[] = {
		{ "/nonexistent-kvstage-dir/trace.jsonl", "No such file or directory" },
		{ isdir, "Is a directory" },
		{ nosock, "No such file or directory" },
		{ fifo, "No such device or address" }, /* no reader: refused, not waited for */
	};
	for (unsigned i = 0; i < sizeof(sinks) / sizeof(sinks[0]); i++) {
		int rc = run_cmd((const char *[]){ bin, "--socket", "/tmp/kvstage-trace-never.sock",
						   "--slots", "1", "--slot-size", "4K", "--no-lock",
						   "--trace-file", sinks[i].where, NULL },
				 out, sizeof(out), err, sizeof(err));
		cr_assert_eq(rc, 1, "%s: exit %d", sinks[i].where, rc);
		char want[256];
		snprintf(want, sizeof(want), "kvstaged: --trace-file %s: %s", sinks[i].where,
			 sinks[i].says);
		cr_assert(strstr(err, want), "%s said: %s", sinks[i].where, err);
		cr_assert(!strstr(err, "serving"), "it served: %s", err);
	}
	unlink(fifo);
	const char *bufs[] = { "0", "15", "16777217", "lots", "-16", "" };
	for (unsigned i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) {
		int rc = run_cmd((const char *[]){ bin, "--socket", "/tmp/kvstage-trace-never.sock",
						   "--trace-file", fa, "--trace-buffer", bufs[i],
						   NULL },
				 out, sizeof(out), err, sizeof(err));
		cr_assert_eq(rc, 2, "--trace-buffer '%s': exit %d", bufs[i], rc);
		cr_assert(strstr(err, "invalid --trace-buffer") &&
				  strstr(err, "want records, 16 to 16777216"),
			  "--trace-buffer '%s' said: %s", bufs[i], err);
	}
	int rc = run_cmd((const char *[]){ bin, "--socket", "/tmp/kvstage-trace-never.sock",
					   "--trace-file", "", NULL },
			 out, sizeof(out), err, sizeof(err));
	cr_assert_eq(rc, 2);
	cr_assert(strstr(err, "want a path, or unix:PATH"), "%s", err);
}
