/* SPDX-License-Identifier: MIT */
/* The tools' hardening: kvstage-ctl and kvstage-stat take numbers one strict
 * way, say the proxy's own reason, write JSON that parses whatever the
 * strings hold, and a watching kvstage-stat follows a proxy that dies and
 * comes back; kvstage-bench parses and escapes the same way. */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "rawclient.h"
#include "sock.h"

static struct proxy px = PROXY_INIT;
static char out[65536], err[65536];
static pid_t watcher;	   /* a kvstage-stat --watch child, or 0 */
static char links[2][128]; /* symlinks with awkward names, or "" */
static char tmpfile_[64];  /* JSON handed to python3, or "" */
static kvs_client *client; /* held across a drain */

static void teardown(void)
{
	if (watcher > 0) {
		kill(watcher, SIGKILL);
		waitpid(watcher, NULL, 0);
		watcher = 0;
	}
	if (client)
		kvs_close(client);
	client = NULL;
	proxy_stop(&px);
	for (int i = 0; i < 2; i++)
		if (links[i][0])
			unlink(links[i]);
	if (tmpfile_[0])
		unlink(tmpfile_);
}

TestSuite(tools, .fini = teardown, .timeout = 60);

#define RUN(...) run_cmd((const char *[]){ __VA_ARGS__, NULL }, out, sizeof(out), err, sizeof(err))
#define NO_SOCK "/tmp/kvstage-tools-no-such.sock"

static const char *const small[] = { "--slots", "4", "--slot-size", "4K", NULL };

/* ------------------------------------------------------------ helpers */

/* Whether every non-empty line of text is a JSON value, by python3's json
 * module (strict UTF-8); with socket, also that each line's "socket" member
 * decodes to exactly those bytes. 1 yes, 0 no (why in err), -1 when python3
 * cannot be run here (the callers' own substring checks still hold). */
static int json_lines_ok(const char *text, const char *socket)
{
	static const char script[] =
		"import json, os, sys\n"
		"data = open(sys.argv[1], 'rb').read()\n"
		"for line in data.splitlines():\n"
		"    if not line.strip():\n"
		"        continue\n"
		"    v = json.loads(line.decode('utf-8'))\n"
		"    if len(sys.argv) > 2:\n"
		"        got = v['socket'].encode('utf-8')\n"
		"        assert got == os.fsencode(sys.argv[2]), (got, sys.argv[2])\n";
	strcpy(tmpfile_, "/tmp/kvstage-tools-json.XXXXXX");
	int fd = mkstemp(tmpfile_);
	cr_assert_geq(fd, 0, "mkstemp: %s", strerror(errno));
	size_t n = strlen(text);
	cr_assert_eq(write(fd, text, n), (ssize_t)n);
	close(fd);
	char pout[4096], perr[8192];
	int rc = run_cmd(
		(const char *[]){ "/usr/bin/env", "python3", "-c", script, tmpfile_, socket, NULL },
		pout, sizeof(pout), perr, sizeof(perr));
	unlink(tmpfile_);
	tmpfile_[0] = 0;
	if (rc == 127) {
		cr_log_warn("python3 not found: JSON checked by substrings only");
		return -1;
	}
	if (rc)
		snprintf(err, sizeof(err), "%s", perr);
	return rc == 0;
}

static uint64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* What the watcher has written so far. */
static struct {
	int fd;
	size_t len;
	char buf[1 << 20];
} rd = { .fd = -1 };

/* Starts argv with its stdout to a pipe read by read_line. */
static void watcher_start(const char *const *argv)
{
	int p[2];
	cr_assert_eq(pipe2(p, O_CLOEXEC), 0);
	fflush(NULL);
	pid_t pid = fork();
	cr_assert_neq(pid, -1);
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		dup2(p[1], 1);
		execv(argv[0], (char *const *)argv);
		_exit(127);
	}
	close(p[1]);
	watcher = pid;
	rd.fd = p[0];
	rd.len = 0;
	rd.buf[0] = 0;
}

/* Reads the watcher's output until a whole line at or after offset from
 * holds needle; copies that line (without its newline) into line and
 * returns the offset after it. Fails the test after WAIT_MS. */
static size_t read_line(size_t from, const char *needle, char *line, size_t cap)
{
	uint64_t deadline = now_ms() + WAIT_MS;
	for (;;) {
		const char *hit = strstr(rd.buf + from, needle);
		const char *eol = hit ? strchr(hit, '\n') : NULL;
		if (eol) {
			const char *bol = hit;
			while (bol > rd.buf + from && bol[-1] != '\n')
				bol--;
			snprintf(line, cap, "%.*s", (int)(eol - bol), bol);
			return (size_t)(eol + 1 - rd.buf);
		}
		size_t tail = rd.len - from > 2000 ? rd.len - 2000 : from;
		uint64_t now = now_ms();
		cr_assert_lt(now, deadline, "no line with '%s' within %d ms; the last output: %s",
			     needle, WAIT_MS, rd.buf + tail);
		cr_assert_lt(rd.len, sizeof(rd.buf) - 1, "the watcher wrote 1 MiB without '%s'",
			     needle);
		struct pollfd p = { rd.fd, POLLIN, 0 };
		int rc = poll(&p, 1, (int)(deadline - now));
		if (rc < 0 && errno == EINTR)
			continue;
		cr_assert_geq(rc, 0, "poll: %s", strerror(errno));
		if (rc == 0)
			continue; /* the deadline check above fails the test */
		ssize_t k = read(rd.fd, rd.buf + rd.len, sizeof(rd.buf) - 1 - rd.len);
		cr_assert_gt(k, 0, "the watcher's output ended before '%s': %s", needle,
			     rd.buf + tail);
		rd.len += (size_t)k;
		rd.buf[rd.len] = 0;
	}
}

/* Lines of /proc/pid/maps that map the proxy's control segment. */
static int ctrl_mappings(pid_t pid)
{
	char path[64], line[512];
	snprintf(path, sizeof(path), "/proc/%d/maps", (int)pid);
	FILE *f = fopen(path, "r");
	cr_assert_not_null(f, "%s: %s", path, strerror(errno));
	int n = 0;
	while (fgets(line, sizeof(line), f))
		n += strstr(line, "kvstage-ctrl") != NULL;
	fclose(f);
	return n;
}

/* Open fds of pid. */
static int open_fds(pid_t pid)
{
	char path[64];
	snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
	DIR *d = opendir(path);
	cr_assert_not_null(d, "%s: %s", path, strerror(errno));
	int n = 0;
	for (struct dirent *e; (e = readdir(d));)
		n += e->d_name[0] != '.';
	closedir(d);
	return n;
}

/* ------------------------------------------------------------ kvstage-ctl */

Test(tools, ctl_help_tells_every_option_and_number_form)
{
	cr_assert_eq(RUN(build_path("tools/kvstage-ctl"), "--help"), 0);
	const char *says[] = { "--socket",  "--timeout", "--match",   "--mask",	    "--help",
			       "--version", "0x",	 "1 to 4095", "Exit status" };
	for (unsigned i = 0; i < sizeof(says) / sizeof(says[0]); i++)
		cr_assert(strstr(out, says[i]), "--help does not mention %s: %s", says[i], out);
}

/* Every number ctl takes: no sign, no space, no junk; refused with exit 2
 * before the proxy is asked anything (NO_SOCK would be exit 1). */
Test(tools, ctl_refuses_lenient_numbers)
{
	const char *ctl = build_path("tools/kvstage-ctl");
	cr_assert_eq(RUN(ctl, "-s", NO_SOCK, "wait", "local.quiesce", "-1"), 2,
		     "HITS -1 is a count of 2^64-1: it must be refused, not waited for: %s", err);
	cr_assert(strstr(err, "invalid HITS '-1': want a count from 1 to "), "%s", err);

	struct {
		const char *argv[8];
		const char *says;
	} bad[] = {
		{ { "wait", "local.quiesce", " 5" }, "invalid HITS ' 5'" },
		{ { "wait", "local.quiesce", "+5" }, "invalid HITS '+5'" },
		{ { "wait", "local.quiesce", "5x" }, "invalid HITS '5x'" },
		{ { "wait", "local.quiesce", "0" }, "invalid HITS '0'" },
		{ { "wait", "local.quiesce", "" }, "invalid HITS ''" },
		{ { "wait", "local.quiesce", "0x5" }, "invalid HITS '0x5'" },
		{ { "wait", "local.quiesce", "18446744073709551616" }, "invalid HITS" },
		{ { "-t", "-1", "wait", "local.quiesce" }, "invalid --timeout '-1'" },
		{ { "-t", " 5", "wait", "local.quiesce" }, "invalid --timeout ' 5'" },
		{ { "--timeout", "5ms", "wait", "local.quiesce" }, "invalid --timeout '5ms'" },
		{ { "--timeout", "+5", "wait", "local.quiesce" }, "invalid --timeout '+5'" },
		{ { "--timeout", "2147483648", "wait", "local.quiesce" }, "invalid --timeout" },
		{ { "--match", "-1", "set", "local.quiesce", "pause" }, "invalid --match '-1'" },
		{ { "--match", " 5", "set", "local.quiesce", "pause" }, "invalid --match ' 5'" },
		{ { "--match", "+5", "set", "local.quiesce", "pause" }, "invalid --match '+5'" },
		{ { "--match", "5x", "set", "local.quiesce", "pause" }, "invalid --match '5x'" },
		{ { "--match", "0x", "set", "local.quiesce", "pause" }, "invalid --match '0x'" },
		{ { "--match", "0x 5", "set", "local.quiesce", "pause" },
		  "invalid --match '0x 5'" },
		{ { "--match", "0x-1", "set", "local.quiesce", "pause" },
		  "invalid --match '0x-1'" },
		{ { "--match", "0x10000000000000000", "set", "local.quiesce", "pause" },
		  "invalid --match" },
		{ { "set", "local.quiesce", "pause", "--match", "-1" }, "invalid --match '-1'" },
		{ { "set", "local.quiesce", "pause", "-m", " 5" }, "invalid -m ' 5'" },
		{ { "set", "local.quiesce", "pause", "--match" }, "--match needs a value" },
		{ { "--match", "1", "--mask", "-1", "set", "local.quiesce", "pause" },
		  "invalid --mask '-1'" },
		{ { "--match", "1", "--mask", " 5", "set", "local.quiesce", "pause" },
		  "invalid --mask ' 5'" },
		{ { "set", "local.quiesce", "pause", "--match", "1", "--mask", "0" },
		  "invalid --mask '0'" },
		{ { "set", "local.quiesce", "pause", "--match", "1", "-k", "0x0" },
		  "invalid -k '0x0'" },
		{ { "--mask", "0xff", "set", "local.quiesce", "pause" }, "--mask needs --match" },
		{ { "wait", "local.quiesce", "--match", "1" }, "are for set" },
		{ { "set", "local.quiesce", "fail=-5" }, "bad action 'fail=-5'" },
		{ { "set", "local.quiesce", "fail= 5" }, "bad action 'fail= 5'" },
		{ { "set", "local.quiesce", "fail=+5" }, "bad action 'fail=+5'" },
		{ { "set", "local.quiesce", "fail=5x" }, "bad action 'fail=5x'" },
		{ { "set", "local.quiesce", "fail=0" }, "bad action 'fail=0'" },
		{ { "set", "local.quiesce", "fail=4096" }, "bad action 'fail=4096'" },
		{ { "set", "local.quiesce", "fail=" }, "bad action 'fail='" },
	};
	for (unsigned i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		const char *argv[16] = { ctl, "-s", NO_SOCK };
		int n = 3;
		for (int k = 0; bad[i].argv[k]; k++)
			argv[n++] = bad[i].argv[k];
		argv[n] = NULL;
		int rc = run_cmd(argv, out, sizeof(out), err, sizeof(err));
		cr_assert_eq(rc, 2, "case %u (%s %s %s): exit %d: %s", i, bad[i].argv[0],
			     bad[i].argv[1], bad[i].argv[2] ? bad[i].argv[2] : "", rc, err);
		cr_assert(strstr(err, bad[i].says), "case %u: want '%s', said: %s", i, bad[i].says,
			  err);
	}
}

Test(tools, ctl_takes_good_numbers)
{
	proxy_start(&px, NULL, small);
	const char *ctl = build_path("tools/kvstage-ctl");
	cr_assert_eq(RUN(ctl, "-s", px.sock, "--match", "0x7", "--mask", "0XfF", "set",
			 "local.quiesce", "pause"),
		     0, "%s", err);
	cr_assert_eq(RUN(ctl, "-s", px.sock, "set", "local.quiesce", "pause", "-m", "7", "-k",
			 "0x00000000000000000000ff"),
		     0, "leading zeros do not count against 64 bits: %s", err);
	cr_assert_eq(RUN(ctl, "-s", px.sock, "set", "local.quiesce", "fail=4095", "--match",
			 "18446744073709551615"),
		     0, "%s", err);
	cr_assert_eq(RUN(ctl, "-s", px.sock, "set", "local.quiesce", "off"), 0, "%s", err);
	cr_assert_eq(RUN(ctl, "-s", px.sock, "-t", "0", "wait", "local.quiesce", "1"), 3,
		     "HITS 1 with --timeout 0: an unmet wait times out: %s", err);
	cr_assert_eq(RUN(ctl, "-s", px.sock, "hits", "local.quiesce"), 0, "%s", err);
	cr_assert_str_eq(out, "0\n");
}

/* A plain proxy refuses admins saying why; that reason is the one shown. */
Test(tools, ctl_shows_the_proxys_reason)
{
	proxy_start_plain(&px, small);
	int rc = RUN(build_path("tools/kvstage-ctl"), "-s", px.sock, "set", "local.quiesce",
		     "pause");
	cr_assert_eq(rc, 1, "%s", err);
	cr_assert(strstr(err, "--failpoints"), "%s", err);
	cr_assert_null(strstr(err, "not yours"), "%s", err);
	char want[256];
	snprintf(want, sizeof(want),
		 "kvstage-ctl: %s: failpoints are off: start kvstaged with "
		 "--failpoints\n",
		 px.sock);
	cr_assert_str_eq(err, want, "the proxy's message is the reason, nothing before it");
}

/* Without a message from the proxy, ctl says what kvs_strerror says. */
Test(tools, ctl_without_a_proxy_says_why)
{
	cr_assert_eq(RUN(build_path("tools/kvstage-ctl"), "-s", NO_SOCK, "hits", "local.quiesce"),
		     1);
	char want[256];
	snprintf(want, sizeof(want), "kvstage-ctl: %s: %s\n", NO_SOCK, kvs_strerror(-ENOENT));
	cr_assert_str_eq(err, want);
}

/* ----------------------------------------------------------- kvstage-stat */

Test(tools, stat_help_tells_every_option)
{
	cr_assert_eq(RUN(build_path("tools/kvstage-stat"), "--help"), 0);
	const char *says[] = { "--socket",   "--json", "--watch",   "--top",
			       "--slots",    "--help", "--version", "serving or draining",
			       "Exit status" };
	for (unsigned i = 0; i < sizeof(says) / sizeof(says[0]); i++)
		cr_assert(strstr(out, says[i]), "--help does not mention %s: %s", says[i], out);
}

Test(tools, stat_refuses_lenient_watch)
{
	const char *stat = build_path("tools/kvstage-stat");
	const char *bad[] = { " 5", "5x", "+5", "-5", "0", "", "0x10", "5 ", "2147483648" };
	for (unsigned i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		int rc = RUN(stat, "-s", NO_SOCK, "--watch", bad[i]);
		cr_assert_eq(rc, 2, "--watch '%s': exit %d: %s", bad[i], rc, err);
		cr_assert(strstr(err, "invalid --watch"), "--watch '%s' said: %s", bad[i], err);
	}
}

static int die_without_close(int rd_, int wr, void *arg)
{
	(void)rd_, (void)wr, (void)arg;
	kvs_client *c;
	return kvs_connect(px.sock, &c) ? 1 : 0; /* exits holding the connection */
}

/* The first line says serving; the new counters show, each its own field. */
Test(tools, stat_shows_state_and_new_counters)
{
	proxy_start(&px, NULL, small);
	/* two clients die, one closes, one forges tokens past the log's burst */
	for (int i = 0; i < 2; i++) {
		struct child ch;
		child_start(&ch, die_without_close, NULL);
		cr_assert_eq(child_wait(&ch), 0);
	}
	stat_wait(&px, "clients_died", 1, 2);
	kvs_client *c = connect_ok(&px);
	kvs_room *rr, *sr;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(c, 4096, 1, &rr, &d), 0);
	d.bytes[24] ^= 1; /* a bit of the token */
	for (int i = 0; i < 7; i++)
		cr_assert_eq(kvs_send_open(c, &d, 2, &sr), -EPERM);
	kvs_close(c);
	stat_wait(&px, "clients", 0, 0);
	cr_assert_geq(stat_get(&px, "log_suppressed"), 1, "7 forgeries, a burst of 5 logged");
	unsigned long long closed = stat_get(&px, "clients_closed"),
			   died = stat_get(&px, "clients_died"),
			   supp = stat_get(&px, "log_suppressed");

	const char *stat = build_path("tools/kvstage-stat");
	cr_assert_eq(RUN(stat, "-s", px.sock), 0, "%s", err);
	char want[256];
	snprintf(want, sizeof(want), "kvstaged %s: serving  pid %d  instance %016llx  uptime ",
		 px.sock, px.pid, (unsigned long long)px.ctrl->instance);
	cr_assert_eq(strncmp(out, want, strlen(want)), 0, "first line: %s", out);
	snprintf(want, sizeof(want), "  closed %llu  died %llu  ", closed, died);
	cr_assert(strstr(out, want), "want '%s' in: %s", want, out);
	snprintf(want, sizeof(want), "  log-suppressed %llu\n", supp);
	cr_assert(strstr(out, want), "want '%s' in: %s", want, out);

	cr_assert_eq(RUN(stat, "-s", px.sock, "--json", "--slots"), 0, "%s", err);
	snprintf(want, sizeof(want), "{\"socket\":\"%s\",\"up\":true,\"draining\":false,", px.sock);
	cr_assert_eq(strncmp(out, want, strlen(want)), 0, "%s", out);
	snprintf(want, sizeof(want), "\"closed\":%llu,\"died\":%llu,", closed, died);
	cr_assert(strstr(out, want), "want '%s' in: %s", want, out);
	snprintf(want, sizeof(want), "\"log_suppressed\":%llu", supp);
	cr_assert(strstr(out, want), "want '%s' in: %s", want, out);
	cr_assert_neq(json_lines_ok(out, px.sock), 0, "not JSON: %s\n%s", err, out);
}

/* Every string in --json is escaped: a socket path holding '"', '\\', a
 * control character, and a byte that is not UTF-8. The proxy serves its
 * own path; the awkward ones are symlinks to its directory. */
Test(tools, stat_json_escapes_strings)
{
	proxy_start(&px, NULL, small);
	const char *stat = build_path("tools/kvstage-stat");
	char path[160], want[256];

	snprintf(links[0], sizeof(links[0]), "/tmp/kvstage-tools-%d-q\"b\\s\x01t", (int)getpid());
	cr_assert_eq(symlink(px.dir, links[0]), 0, "symlink: %s", strerror(errno));
	snprintf(path, sizeof(path), "%s/kvstaged.sock", links[0]);
	cr_assert_lt(strlen(path), 100);
	cr_assert_eq(RUN(stat, "-s", path, "--json", "--slots"), 0, "%s", err);
	snprintf(want, sizeof(want),
		 "{\"socket\":\"/tmp/kvstage-tools-%d-q\\\"b\\\\s\\u0001t/kvstaged.sock\",",
		 (int)getpid());
	cr_assert_eq(strncmp(out, want, strlen(want)), 0, "want %s, got %s", want, out);
	cr_assert_null(memchr(out, '\x01', strlen(out)), "a raw control character: %s", out);
	cr_assert_neq(json_lines_ok(out, path), 0, "not JSON: %s\n%s", err, out);

	/* JSON text is UTF-8: a stray byte becomes U+FFFD, real UTF-8 stays */
	snprintf(links[1], sizeof(links[1]), "/tmp/kvstage-tools-%d-\xff-\xc3\xa9", (int)getpid());
	cr_assert_eq(symlink(px.dir, links[1]), 0, "symlink: %s", strerror(errno));
	snprintf(path, sizeof(path), "%s/kvstaged.sock", links[1]);
	cr_assert_eq(RUN(stat, "-s", path, "--json"), 0, "%s", err);
	snprintf(want, sizeof(want), "{\"socket\":\"/tmp/kvstage-tools-%d-\\ufffd-\xc3\xa9/",
		 (int)getpid());
	cr_assert_eq(strncmp(out, want, strlen(want)), 0, "want %s, got %s", want, out);
	cr_assert_neq(json_lines_ok(out, NULL), 0, "not JSON: %s\n%s", err, out);
}

/* Something at the socket path answers the hello with a control segment
 * of its own making: abi is what its header says, said the size it says
 * (the memfd holds 4 KiB). */
struct liar_cfg {
	const char *path;
	uint32_t abi;
	uint64_t said;
};

static int liar(int rd, int wr, void *arg)
{
	(void)rd;
	const struct liar_cfg *cfg = arg;
	int l = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	snprintf(a.sun_path, sizeof(a.sun_path), "%s", cfg->path);
	if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof(a)) < 0 || listen(l, 4) < 0)
		return 1;
	chan_put(wr, "ready", 5);
	int c = accept(l, NULL, NULL);
	struct kvs_hello h;
	if (c < 0 || recv(c, &h, sizeof(h), 0) <= 0)
		return 2;
	int fd = memfd_create("liar", MFD_CLOEXEC);
	if (fd < 0 || ftruncate(fd, 4096) < 0)
		return 3;
	struct kvs_ctrl *ctl = mmap(NULL, 4096, PROT_WRITE, MAP_SHARED, fd, 0);
	ctl->magic = KVS_MAGIC_CTRL;
	ctl->abi = cfg->abi;
	ctl->slot_count = 16; /* its tables past the file's end, inside the size it says */
	ctl->slots_off = 64 << 10;
	ctl->peer_count = 64;
	ctl->peers_off = 128 << 10;
	struct kvs_welcome w = { .magic = KVS_MAGIC_HELLO, .abi = KVS_ABI, .ctrl_size = cfg->said };
	if (kvs_sock_send(c, &w, sizeof(w), &fd, 1) < 0)
		return 4;
	char b;
	recv(c, &b, 1, 0); /* until the tool is done */
	return 0;
}

/* Runs kvstage-stat ARGS... against a liar of cfg (its path set here);
 * returns its exit status, with out and err. */
static int stat_liar(struct liar_cfg *cfg, const char *json)
{
	char path[108];
	snprintf(path, sizeof(path), "/tmp/kvstage-liar-%d.sock", (int)getpid());
	unlink(path);
	cfg->path = path;
	struct child ch;
	child_start(&ch, liar, cfg);
	char ready[5];
	cr_assert_eq(chan_get(ch.from, ready, 5), 0);
	int rc = json ? RUN(build_path("tools/kvstage-stat"), "-s", path, json)
		      : RUN(build_path("tools/kvstage-stat"), "-s", path, "--slots");
	child_wait(&ch);
	unlink(path);
	return rc;
}

/* Mapping a larger segment than the memfd would fault at the first read
 * past the file's end. kvstage-stat says what is wrong. */
Test(tools, stat_refuses_a_segment_smaller_than_it_is_said)
{
	struct liar_cfg cfg = { .abi = KVS_ABI, .said = 1 << 20 };
	int rc = stat_liar(&cfg, NULL);
	cr_assert_eq(rc, 1, "exit %d (a signal?): %s", rc, err);
	cr_assert(strstr(err, "smaller than the size it says"), "%s", err);
}

/* A segment of ABI 3 (its data paths' counters were fields of struct
 * kvs_stats) is not read as ABI 4's: refused, with the ABI this tool reads. */
Test(tools, stat_refuses_a_segment_of_abi_3)
{
	cr_assert_eq(KVS_ABI, 4, "this test names the ABI before this one");
	struct liar_cfg cfg = { .abi = 3, .said = 4096 };
	int rc = stat_liar(&cfg, NULL);
	cr_assert_eq(rc, 1, "exit %d (a signal?): %s", rc, err);
	cr_assert(strstr(err, ": it speaks another ABI (its control segment is not kvstage ABI "
			      "4)\n"),
		  "%s", err);
	rc = stat_liar(&cfg, "--json");
	cr_assert_eq(rc, 1, "exit %d: %s", rc, err);
	cr_assert(strstr(err, "it speaks another ABI"), "%s", err);
}

/* A watching stat asks anew every sample: the proxy dies, it says so and
 * keeps watching; a new proxy on the path is shown; no mapping or fd is
 * left behind. */
Test(tools, stat_watch_follows_a_proxy_that_dies_and_comes_back)
{
	proxy_start(&px, NULL, small);
	watcher_start((const char *[]){ build_path("tools/kvstage-stat"), "--watch", "50", "-s",
					px.sock, NULL });
	char want[256], line[4096];
	snprintf(want, sizeof(want), "kvstaged %s: serving  pid %d  instance %016llx", px.sock,
		 px.pid, (unsigned long long)px.ctrl->instance);
	size_t at = read_line(0, want, line, sizeof(line));
	cr_assert_null(strstr(line, "new instance"), "%s", line);

	proxy_kill(&px, SIGKILL);
	/* The dead proxy's socket file is still there. (A sample caught
	 * mid-handshake by the kill may say something else first.) */
	snprintf(want, sizeof(want), "kvstaged %s: down (%s)", px.sock,
		 kvs_strerror(-ECONNREFUSED));
	at = read_line(at, want, line, sizeof(line));
	cr_assert_str_eq(line, want);
	at = read_line(at, want, line, sizeof(line)); /* and it keeps watching */

	proxy_restart(&px, small);
	snprintf(want, sizeof(want), "kvstaged %s: serving  pid %d  instance %016llx", px.sock,
		 px.pid, (unsigned long long)px.ctrl->instance);
	at = read_line(at, want, line, sizeof(line));
	cr_assert(strstr(line, "(new instance)"), "%s", line);

	/* samples map and unmap: nothing piles up */
	at = read_line(at, ": serving", line, sizeof(line));
	int fds = open_fds(watcher);
	for (int i = 0; i < 6; i++)
		at = read_line(at, ": serving", line, sizeof(line));
	cr_assert_leq(ctrl_mappings(watcher), 1, "control segment mappings pile up");
	cr_assert_leq(open_fds(watcher), fds + 2, "fds pile up: %d, then %d", fds,
		      open_fds(watcher));
	cr_assert_eq(waitpid(watcher, NULL, WNOHANG), 0, "the watcher exited");
}

/* --watch shows rates from its second sample on: rooms done in between
 * show as rooms/s above zero (and an abort as aborts/s). */
Test(tools, stat_watch_shows_rates)
{
	proxy_start(&px, NULL, small);
	watcher_start((const char *[]){ build_path("tools/kvstage-stat"), "--watch", "50", "-s",
					px.sock, NULL });
	char line[4096];
	size_t at = read_line(0, ": serving", line, sizeof(line));
	at = read_line(at, "rates     rooms/s", line, sizeof(line)); /* the second sample */
	kvs_client *rx = connect_ok(&px), *tx = connect_ok(&px);
	for (unsigned i = 0; i < 3; i++) {
		kvs_room *rr, *sr;
		struct kvs_room_desc d;
		struct kvs_lease l;
		cr_assert_eq(kvs_recv_open(rx, 4096, i, &rr, &d), 0);
		cr_assert_eq(kvs_send_open(tx, &d, i, &sr), 0);
		cr_assert_eq(kvs_acquire(tx, 1, &l), 0);
		cr_assert_eq(kvs_send(sr, &l, 0, 4096), 0);
		cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
		cr_assert_eq(wait_event(rx).type, KVS_EV_RECV_DONE);
		kvs_room_close(sr);
		kvs_room_close(rr);
	}
	kvs_room *rr;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(rx, 4096, 9, &rr, &d), 0);
	cr_assert_eq(kvs_abort(rr), 0);
	cr_assert_eq(wait_event(rx).type, KVS_EV_ABORTED);
	kvs_room_close(rr);
	/* Samples since: one of them saw the rooms, one the abort. */
	bool rooms = false, aborts = false;
	for (unsigned n = 0; n < 200 && !(rooms && aborts); n++) {
		at = read_line(at, "rates     rooms/s", line, sizeof(line));
		double r, a;
		cr_assert_eq(sscanf(line, "rates     rooms/s %lf  aborts/s %lf", &r, &a), 2, "%s",
			     line);
		rooms |= r > 0;
		aborts |= a > 0;
	}
	cr_assert(rooms && aborts, "no sample showed the rooms (%d) or the abort (%d)", rooms,
		  aborts);
	kvs_close(tx);
	kvs_close(rx);
}

/* The same in --json: a sample without a proxy is an object that says so. */
Test(tools, stat_watch_json_says_down)
{
	proxy_start(&px, NULL, small);
	watcher_start((const char *[]){ build_path("tools/kvstage-stat"), "--json", "--watch", "50",
					"-s", px.sock, NULL });
	char want[256], line[8192];
	snprintf(want, sizeof(want), "{\"socket\":\"%s\",\"up\":true,\"draining\":false,", px.sock);
	size_t at = read_line(0, want, line, sizeof(line));
	proxy_kill(&px, SIGKILL);
	snprintf(want, sizeof(want), "{\"socket\":\"%s\",\"up\":false,\"error\":\"%s\"}", px.sock,
		 kvs_strerror(-ECONNREFUSED));
	at = read_line(at, want, line, sizeof(line));
	cr_assert_str_eq(line, want);
	char both[8192];
	snprintf(both, sizeof(both), "%.*s", (int)at, rd.buf);
	cr_assert_neq(json_lines_ok(both, px.sock), 0, "not JSON lines: %s\n%s", err, both);
}

/* Watching a path where no proxy ever was: a line each sample, no exit. */
Test(tools, stat_watch_waits_for_a_proxy)
{
	watcher_start((const char *[]){ build_path("tools/kvstage-stat"), "-w", "50", "-s", NO_SOCK,
					NULL });
	char want[256], line[1024];
	snprintf(want, sizeof(want), "kvstaged %s: down (%s)", NO_SOCK, kvs_strerror(-ENOENT));
	size_t at = read_line(0, want, line, sizeof(line));
	cr_assert_str_eq(line, want);
	read_line(at, want, line, sizeof(line));
}

/* A proxy that got SIGTERM and still has a room open drains: stat says
 * draining. Needs the proxy to keep its socket while draining. */
Test(tools, stat_shows_draining)
{
	proxy_start(&px, NULL,
		    (const char *[]){ "--shutdown-grace", "60000", "--slots", "4", "--slot-size",
				      "4K", NULL });
	client = connect_ok(&px);
	kvs_room *rr;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(client, 4096, 1, &rr, &d), 0);
	cr_assert_eq(kill(px.pid, SIGTERM), 0);
	stat_wait(&px, "draining", 1, 1);

	const char *stat = build_path("tools/kvstage-stat");
	int rc = RUN(stat, "-s", px.sock);
	if (rc == 1 && strstr(err, kvs_strerror(-ENOENT)))
		cr_assert_fail("the draining proxy removed its socket, so no tool can reach it "
			       "(kvstaged must keep it while draining): %s",
			       err);
	cr_assert_eq(rc, 0, "%s", err);
	char want[256];
	snprintf(want, sizeof(want), "kvstaged %s: draining  pid %d", px.sock, px.pid);
	cr_assert_eq(strncmp(out, want, strlen(want)), 0, "first line: %s", out);
	cr_assert_eq(RUN(stat, "-s", px.sock, "--json"), 0, "%s", err);
	snprintf(want, sizeof(want), "{\"socket\":\"%s\",\"up\":true,\"draining\":true,", px.sock);
	cr_assert_eq(strncmp(out, want, strlen(want)), 0, "%s", out);
}

/* ------------------------------------------------- kvstage-stat --top */

#define SLOT4K 4096u

Test(tools, stat_refuses_lenient_top)
{
	const char *stat = build_path("tools/kvstage-stat");
	const char *bad[] = { "--top=",	  "--top=0",	      "--top= 5", "--top=5x", "--top=+5",
			      "--top=-5", "--top=2147483648", "-t0",	  "-t5ms" };
	for (unsigned i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		int rc = RUN(stat, "-s", NO_SOCK, bad[i]);
		cr_assert_eq(rc, 2, "%s: exit %d: %s", bad[i], rc, err);
		cr_assert(strstr(err, "invalid --top"), "%s said: %s", bad[i], err);
	}
	cr_assert_eq(RUN(stat, "-s", NO_SOCK, "--top", "--slots"), 2, "%s", err);
	cr_assert(strstr(err, "--slots does not go with --top"), "%s", err);
	/* --top takes its interval attached: "--top 50" is a stray argument */
	cr_assert_eq(RUN(stat, "-s", NO_SOCK, "--top", "50"), 2, "%s", err);
}

/* What a stepped client in its own process is told to do. */
enum { DO_ROOM = 1, DO_HOLD, DO_CLOSE };
struct step {
	int cmd;
	unsigned n; /* DO_HOLD: slots to hold */
	struct kvs_room_desc d;
};

/* A client in its own process (its own pid): DO_ROOM sends every chunk of
 * the room and waits for SEND_DONE; DO_HOLD opens the room (if given one),
 * holds n fresh leases and sends one of them at an offset no chunk has (a
 * raw record past libkvstage's checks: the proxy refuses it); DO_CLOSE
 * says goodbye. Each step is answered with a slot it holds (DO_HOLD) or 0
 * once done. */
static int stepped_client(int rd_, int wr, void *arg)
{
	(void)arg;
	kvs_client *c;
	if (kvs_connect(px.sock, &c))
		return 10;
	for (;;) {
		struct step st;
		if (chan_get(rd_, &st, sizeof(st)))
			return 11;
		uint32_t answer = 0;
		kvs_room *r;
		struct kvs_lease l[8];
		switch (st.cmd) {
		case DO_ROOM: {
			if (kvs_send_open(c, &st.d, 1, &r))
				return 12;
			unsigned n = kvs_room_chunks(r);
			uint64_t bytes = kvs_room_bytes(r);
			if (n > 8 || kvs_acquire(c, n, l))
				return 13;
			for (unsigned k = 0; k < n; k++) {
				uint64_t off = (uint64_t)k * SLOT4K;
				uint32_t len = bytes - off < SLOT4K ? (uint32_t)(bytes - off)
								    : SLOT4K;
				if (kvs_send(r, &l[k], off, len))
					return 14;
			}
			struct kvs_event ev;
			if (kvs_wait(c, &ev, WAIT_MS) != 1 || ev.type != KVS_EV_SEND_DONE)
				return 15;
			if (kvs_room_close(r))
				return 16;
			break;
		}
		case DO_HOLD:
			if (st.d.bytes[0] && kvs_send_open(c, &st.d, 2, &r))
				return 17;
			if (st.n > 8 || kvs_acquire(c, st.n, l))
				return 18;
			answer = l[0].slot;
			if (st.d.bytes[0]) {
				struct kvs_sqe q = { .op = KVS_OP_SEND,
						     .handle = kvs_room_handle_idx(r),
						     .gen = kvs_room_handle_gen(r),
						     .slot = l[0].slot,
						     .epoch = l[0].epoch,
						     .arg = 1,
						     .len = SLOT4K };
				struct kvs_event ev;
				if (raw_submit(c, &q) || kvs_wait(c, &ev, WAIT_MS) != 1 ||
				    ev.type != KVS_EV_REJECTED || ev.status != -EINVAL)
					return 21;
			}
			break;
		case DO_CLOSE:
			kvs_close(c);
			return 0;
		default:
			return 19;
		}
		if (chan_put(wr, &answer, sizeof(answer)))
			return 20;
	}
}

static uint32_t step(struct child *ch, int cmd, unsigned n, const struct kvs_room_desc *d)
{
	struct step st = { .cmd = cmd, .n = n };
	if (d)
		st.d = *d;
	cr_assert_eq(chan_put(ch->to, &st, sizeof(st)), 0);
	uint32_t answer;
	cr_assert_eq(chan_get(ch->from, &answer, sizeof(answer)), 0,
		     "the stepped client died: exit %d", child_wait(ch));
	return answer;
}

/* The JSON entry of client id in a --json line (up to its closing brace),
 * into buf; "" if there is none. */
static const char *json_client(const char *json, uint32_t id, char *buf, size_t cap)
{
	char key[32];
	snprintf(key, sizeof(key), "{\"id\":%u,", id);
	const char *at = strstr(json, key);
	buf[0] = 0;
	if (!at)
		return buf;
	int depth = 0;
	const char *q = at;
	for (; *q; q++) {
		depth += *q == '{';
		depth -= *q == '}';
		if (!depth)
			break;
	}
	snprintf(buf, cap, "%.*s", (int)(q - at + 1), at);
	return buf;
}

/* The next whole plain --top sample at or after *at (from its first line,
 * which holds first, to the blank line before the next), into buf; *at
 * moves on to the next one. */
static void next_sample(size_t *at, const char *first, char *buf, size_t cap)
{
	char line[4096];
	size_t a = read_line(*at, first, line, sizeof(line));
	size_t start = a - strlen(line) - 1;
	size_t b = read_line(a, first, line, sizeof(line));
	size_t end = b - strlen(line) - 1;
	snprintf(buf, cap, "%.*s", (int)(end - start), rd.buf + start);
	*at = end;
}

/* The start of a client's --top row: id, pid, uid, leases, inflight, rooms. */
static const char *top_row(char *buf, size_t cap, uint32_t id, pid_t pid, unsigned leases,
			   unsigned inflight, unsigned rooms)
{
	snprintf(buf, cap, "\n%5u %7d %5d %6u %5u %5u ", id, (int)pid, (int)getuid(), leases,
		 inflight, rooms);
	return buf;
}

/* Three clients, each what it did: a sender in its own process (3 chunks
 * sent in two rooms, 2 leases held, a third room open, a send refused), this test as their
 * receiver (3 chunks received, the second room's 2 slots still held, the
 * third room open), and an idle one holding a slot. --json and --top show
 * each with its pid, uid, leases, rooms and bytes; busiest first; one
 * that says goodbye is gone from both. */
Test(tools, stat_top_and_json_show_clients)
{
	proxy_start(&px, NULL, (const char *[]){ "--slots", "16", "--slot-size", "4K", NULL });
	const char *stat = build_path("tools/kvstage-stat");
	struct child tx, idle;
	child_start(&tx, stepped_client, NULL);
	child_start(&idle, stepped_client, NULL);
	kvs_client *rx = connect_ok(&px);

	kvs_room *ra, *rb, *rc;
	struct kvs_room_desc d;
	struct kvs_event ev;
	cr_assert_eq(kvs_recv_open(rx, 4096, 1, &ra, &d), 0);
	step(&tx, DO_ROOM, 0, &d);
	ev = wait_event(rx);
	cr_assert_eq(ev.type, KVS_EV_RECV_DONE);
	cr_assert_eq(kvs_room_close(ra), 0);
	cr_assert_eq(kvs_recv_open(rx, 8192, 2, &rb, &d), 0);
	step(&tx, DO_ROOM, 0, &d);
	ev = wait_event(rx);
	cr_assert_eq(ev.type, KVS_EV_RECV_DONE);
	struct kvs_lease held;
	cr_assert_eq(kvs_room_lease(rb, 0, &held), 0); /* rb stays: its 2 slots are ours */
	cr_assert_eq(kvs_recv_open(rx, 4096, 3, &rc, &d), 0);
	uint32_t tx_id = slot_pub(&px, step(&tx, DO_HOLD, 2, &d)).owner;
	struct kvs_room_desc none = { 0 };
	uint32_t idle_id = slot_pub(&px, step(&idle, DO_HOLD, 1, &none)).owner;
	uint32_t rx_id = slot_pub(&px, held.slot).owner;
	cr_assert(tx_id && idle_id && rx_id && tx_id != idle_id && tx_id != rx_id);

	/* --json: each client's values */
	cr_assert_eq(RUN(stat, "-s", px.sock, "--json"), 0, "%s", err);
	cr_assert_neq(json_lines_ok(out, px.sock), 0, "not JSON: %s\n%s", err, out);
	char e[2048], want[512];
	json_client(out, tx_id, e, sizeof(e));
	snprintf(want, sizeof(want), "{\"id\":%u,\"pid\":%d,\"uid\":%u,\"gid\":%u,", tx_id,
		 (int)tx.pid, (unsigned)getuid(), (unsigned)getgid());
	cr_assert_eq(strncmp(e, want, strlen(want)), 0, "want %s in: %s", want, out);
	const char *tx_has[] = {
		"\"command\":\"test-tools\"",
		"\"leases\":2,\"inflight\":0,\"rooms_open\":1,\"rooms_done\":2,\"rooms_aborted\":0,"
		"\"rooms_failed\":0,",
		"\"rejects\":1,\"chunks_sent\":3,\"bytes_sent\":12288,\"chunks_recv\":0,"
		"\"bytes_recv\":0}",
	};
	for (unsigned i = 0; i < 3; i++)
		cr_assert(strstr(e, tx_has[i]), "want %s in the sender's %s", tx_has[i], e);
	cr_assert_null(strstr(e, "\"rates\""), "one sample has no rates: %s", e);

	json_client(out, rx_id, e, sizeof(e));
	snprintf(want, sizeof(want), "{\"id\":%u,\"pid\":%d,\"uid\":%u,", rx_id, (int)getpid(),
		 (unsigned)getuid());
	cr_assert_eq(strncmp(e, want, strlen(want)), 0, "want %s in: %s", want, out);
	const char *rx_has[] = {
		"\"leases\":2,\"inflight\":0,\"rooms_open\":1,\"rooms_done\":2,",
		"\"chunks_sent\":0,\"bytes_sent\":0,\"chunks_recv\":3,\"bytes_recv\":12288}",
	};
	for (unsigned i = 0; i < 2; i++)
		cr_assert(strstr(e, rx_has[i]), "want %s in the receiver's %s", rx_has[i], e);

	json_client(out, idle_id, e, sizeof(e));
	snprintf(want, sizeof(want), "{\"id\":%u,\"pid\":%d,", idle_id, (int)idle.pid);
	cr_assert_eq(strncmp(e, want, strlen(want)), 0, "want %s in: %s", want, out);
	cr_assert(strstr(e, "\"leases\":1,\"inflight\":0,\"rooms_open\":0,\"rooms_done\":0,"), "%s",
		  e);
	cr_assert(strstr(e, "\"bytes_sent\":0,\"chunks_recv\":0,\"bytes_recv\":0}"), "%s", e);

	/* --top, plain: the same rows; once nothing moves (every rate 0), the
	 * two that moved bytes come before the idle one */
	watcher_start((const char *[]){ stat, "--top=50", "-s", px.sock, NULL });
	char first[256], sample[16384], r_tx[128], r_rx[128], r_idle[128];
	snprintf(first, sizeof(first), "kvstaged %s: serving  pid %d", px.sock, px.pid);
	char q_tx[192], q_rx[192], q_idle[192];
	top_row(r_tx, sizeof(r_tx), tx_id, tx.pid, 2, 0, 1);
	top_row(r_rx, sizeof(r_rx), rx_id, getpid(), 2, 0, 1);
	top_row(r_idle, sizeof(r_idle), idle_id, idle.pid, 1, 0, 0);
	/* OPS/s SENT SENT/s RECV RECV/s, all rates 0 */
	snprintf(q_tx, sizeof(q_tx), "%s%7s %6s %7s %6s %7s ", r_tx, "0", "12K", "0", "0", "0");
	snprintf(q_rx, sizeof(q_rx), "%s%7s %6s %7s %6s %7s ", r_rx, "0", "0", "0", "12K", "0");
	snprintf(q_idle, sizeof(q_idle), "%s%7s %6s %7s %6s %7s ", r_idle, "0", "0", "0", "0", "0");
	size_t at = 0;
	next_sample(&at, first, sample, sizeof(sample));
	cr_assert(strstr(sample, r_tx) && strstr(sample, r_rx) && strstr(sample, r_idle),
		  "want rows\n%s\n%s\n%s\nin the first sample:\n%s", r_tx, r_rx, r_idle, sample);
	cr_assert(strstr(sample, "rates     rooms/s -"), "%s", sample);
	bool quiet = false;
	for (unsigned n = 0; n < 100 && !quiet; n++) {
		next_sample(&at, first, sample, sizeof(sample));
		quiet = strstr(sample, q_tx) && strstr(sample, q_rx) && strstr(sample, q_idle);
	}
	cr_assert(quiet, "no sample with\n%s\n%s\n%s\nthe last:\n%s", q_tx, q_rx, q_idle, sample);
	cr_assert(strstr(sample, "  clients 3  peers 0\n"), "%s", sample);
	cr_assert_lt(strstr(sample, q_tx), strstr(sample, q_idle), "busiest first:\n%s", sample);
	cr_assert_lt(strstr(sample, q_rx), strstr(sample, q_idle), "busiest first:\n%s", sample);
	cr_assert_null(memchr(rd.buf, '\033', rd.len), "escape codes on a pipe: %s", rd.buf);
	kill(watcher, SIGKILL);
	waitpid(watcher, NULL, 0);
	watcher = 0;
	close(rd.fd);

	/* --top --json: JSON lines, each client with rates from the second on */
	watcher_start((const char *[]){ stat, "--top=50", "--json", "-s", px.sock, NULL });
	char line[65536];
	at = read_line(0, "\"clients_table\":[", line, sizeof(line));
	json_client(line, tx_id, e, sizeof(e));
	cr_assert(strstr(e, "\"rates\":null}"), "the first sample has no rates yet: %s", e);
	at = read_line(at, "\"clients_table\":[", line, sizeof(line));
	json_client(line, tx_id, e, sizeof(e));
	cr_assert(strstr(e, "\"rates\":{\"ops_per_s\":"), "%s", e);
	kill(watcher, SIGKILL);
	waitpid(watcher, NULL, 0);
	watcher = 0;
	close(rd.fd);

	/* the idle one says goodbye: gone from the table */
	struct step bye = { .cmd = DO_CLOSE };
	cr_assert_eq(chan_put(idle.to, &bye, sizeof(bye)), 0);
	cr_assert_eq(child_wait(&idle), 0);
	stat_wait(&px, "clients", 0, 2);
	cr_assert_eq(RUN(stat, "-s", px.sock, "--json"), 0, "%s", err);
	cr_assert_str_eq(json_client(out, idle_id, e, sizeof(e)), "", "still listed: %s", out);
	snprintf(want, sizeof(want), "\"pid\":%d,", (int)idle.pid);
	cr_assert_null(strstr(out, want), "%s", out);
	cr_assert_str_neq(json_client(out, tx_id, e, sizeof(e)), "");
	watcher_start((const char *[]){ stat, "--top=50", "-s", px.sock, NULL });
	at = 0;
	next_sample(&at, first, sample, sizeof(sample));
	cr_assert(strstr(sample, r_tx) && strstr(sample, r_rx), "%s", sample);
	snprintf(want, sizeof(want), "\n%5u %7d ", idle_id, (int)idle.pid);
	cr_assert_null(strstr(sample, want), "the closed client is still shown:\n%s", sample);
	cr_assert(strstr(sample, "  clients 2  peers 0\n"), "%s", sample);

	cr_assert_eq(chan_put(tx.to, &bye, sizeof(bye)), 0);
	cr_assert_eq(child_wait(&tx), 0);
	kvs_room_close(rb);
	kvs_room_close(rc);
	kvs_close(rx);
}

/* --top follows the proxy as --watch does: a line while it is down, the new
 * instance marked when it is back. */
Test(tools, stat_top_follows_a_proxy_that_dies_and_comes_back)
{
	proxy_start(&px, NULL, small);
	watcher_start((const char *[]){ build_path("tools/kvstage-stat"), "--top=50", "-s", px.sock,
					NULL });
	char want[256], line[4096];
	snprintf(want, sizeof(want), "kvstaged %s: serving  pid %d", px.sock, px.pid);
	size_t at = read_line(0, want, line, sizeof(line));
	at = read_line(at, "   ID     PID   UID LEASES INFLT ROOMS   OPS/s", line, sizeof(line));
	proxy_kill(&px, SIGKILL);
	snprintf(want, sizeof(want), "kvstaged %s: down (%s)", px.sock,
		 kvs_strerror(-ECONNREFUSED));
	at = read_line(at, want, line, sizeof(line));
	cr_assert_str_eq(line, want);
	proxy_restart(&px, small);
	snprintf(want, sizeof(want), "kvstaged %s: serving  pid %d", px.sock, px.pid);
	at = read_line(at, want, line, sizeof(line));
	cr_assert(strstr(line, "(new instance)"), "%s", line);
	/* rates start over with the new instance */
	at = read_line(at, "rates     ", line, sizeof(line));
	cr_assert_str_eq(line, "rates     rooms/s -  GB/s -  aborts/s -  failures/s -  chunks/s -");
	cr_assert_null(memchr(rd.buf, '\033', rd.len), "escape codes on a pipe: %s", rd.buf);
}

/* On a terminal --top redraws from the top left, cuts lines to the width
 * and rows to the height, and says how many it left out. */
Test(tools, stat_top_on_a_terminal_redraws_and_fits)
{
	proxy_start(&px, NULL, (const char *[]){ "--slots", "16", "--slot-size", "4K", NULL });
	kvs_client *cs[6];
	for (int i = 0; i < 6; i++)
		cs[i] = connect_ok(&px);
	int m = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
	cr_assert_geq(m, 0, "posix_openpt: %s", strerror(errno));
	cr_assert_eq(grantpt(m), 0);
	cr_assert_eq(unlockpt(m), 0);
	struct winsize ws = { .ws_row = 10, .ws_col = 60 };
	cr_assert_eq(ioctl(m, TIOCSWINSZ, &ws), 0);
	int sl = open(ptsname(m), O_RDWR | O_NOCTTY | O_CLOEXEC);
	cr_assert_geq(sl, 0, "%s", strerror(errno));
	struct termios tio;
	cr_assert_eq(tcgetattr(sl, &tio), 0);
	cfmakeraw(&tio); /* no \r added: lines as written */
	cr_assert_eq(tcsetattr(sl, TCSANOW, &tio), 0);
	fflush(NULL);
	pid_t pid = fork();
	cr_assert_neq(pid, -1);
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		dup2(sl, 1);
		execl(build_path("tools/kvstage-stat"), "kvstage-stat", "--top=50", "-s", px.sock,
		      (char *)NULL);
		_exit(127);
	}
	close(sl);
	watcher = pid;
	rd.fd = m;
	rd.len = 0;
	rd.buf[0] = 0;
	char line[4096];
	/* a whole screen: the clear, then 8 lines and what was left out (the
	 * 6 clients make 12 lines for a 10-row screen, one row kept free) */
	size_t at = read_line(0, "\033[H\033[2Jkvstaged ", line, sizeof(line));
	size_t start = at - strlen(line) - 1;
	at = read_line(at, "... ", line, sizeof(line));
	cr_assert_str_eq(line, "... 4 more lines");
	char screen[8192];
	snprintf(screen, sizeof(screen), "%.*s", (int)(at - start), rd.buf + start);
	unsigned lines = 0;
	for (char *q = screen; *q; lines++) {
		char *eol = strchr(q, '\n');
		cr_assert_not_null(eol);
		size_t n = (size_t)(eol - q) - (lines ? 0 : strlen("\033[H\033[2J"));
		cr_assert_leq(n, 60, "line %u is %zu wide:\n%s", lines, n, screen);
		q = eol + 1;
	}
	cr_assert_eq(lines, 9, "%s", screen);
	cr_assert(strstr(screen, "\n   ID     PID   UID LEASES INFLT ROOMS"), "%s", screen);
	read_line(at, "\033[H\033[2Jkvstaged ", line, sizeof(line)); /* and again */
	for (int i = 0; i < 6; i++)
		kvs_close(cs[i]);
}

/* ---------------------------------------------------------- kvstage-bench */

Test(tools, bench_refuses_lenient_numbers)
{
	const char *bench = build_path("tools/bench/kvstage-bench");
	struct {
		const char *opt, *val;
	} bad[] = {
		{ "--rooms", " 5" },	   { "--rooms", "+5" },	    { "--rooms", "5x" },
		{ "--senders", " 1" },	   { "--receivers", " 1" }, { "--samples", " 5" },
		{ "--duration", " 1" },	   { "--duration", "+1" },  { "--duration", "-1" },
		{ "--duration", "0x1p0" }, { "--duration", "inf" }, { "--duration", "1s" },
		{ "--warmup", " 0" },	   { "--warmup", "-0" },    { "--baseline-sec", "+0.1" },
		{ "--idle-gap", " 2" },	   { "--idle-gap", "nan" }, { "--room-bytes", " 4K" },
		{ "--bytes", "-1M" },	   { "--wset", " 1M" },	    { "--chunk", " 4K" },
	};
	for (unsigned i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		int rc = RUN(bench, bad[i].opt, bad[i].val, "local");
		cr_assert_eq(rc, 2, "%s '%s': exit %d: %s", bad[i].opt, bad[i].val, rc, err);
		char want[64];
		snprintf(want, sizeof(want), "invalid %s '%s'", bad[i].opt, bad[i].val);
		cr_assert(strstr(err, want), "%s '%s' said: %s", bad[i].opt, bad[i].val, err);
	}
	/* good ones still pass (--help ends the parse after them) */
	cr_assert_eq(RUN(bench, "--rooms", "5", "--duration", ".5", "--warmup", "0", "--idle-gap",
			 "1e1", "--samples", "10", "--help"),
		     0, "%s", err);

	/* the gpu mode's own numbers (a build without CUDA refuses the mode) */
	int rc = RUN(bench, "gpu", "--iters", " 5");
	cr_assert_eq(rc, 2, "%s", err);
	cr_assert(strstr(err, "--iters ' 5'") || strstr(err, "built without CUDA"), "%s", err);
	rc = RUN(bench, "gpu", "--reps", "+5");
	cr_assert_eq(rc, 2, "%s", err);
	cr_assert(strstr(err, "--reps '+5'") || strstr(err, "built without CUDA"), "%s", err);
}

/* kvstage-bench --json repeats its command line: a stray byte there must
 * not make the JSON invalid UTF-8, nor a quote or backslash end a string. */
Test(tools, bench_json_escapes_strings)
{
	const char *bench = build_path("tools/bench/kvstage-bench");
	int rc = RUN(bench, "baseline", "--json", "-q", "-c", "4K", "-d", "0.01", "--proxy-arg",
		     "a\"b\\c\x01"
		     "d\xff"
		     "e");
	cr_assert_eq(rc, 0, "%s", err);
	cr_assert(strstr(out, "\"a\\\"b\\\\c\\u0001d\\ufffde\""), "%s", out);
	/* one object, so one "line" for the checker: join it */
	for (char *p = out; *p; p++)
		if (*p == '\n')
			*p = ' ';
	cr_assert_neq(json_lines_ok(out, NULL), 0, "not JSON: %s\n%s", err, out);
}

/* The abort mode runs briefly at a nonzero rate: its JSON has the figures,
 * and every point through kvstaged (not the test-only vulnerable build,
 * whose corruption is the baseline's point) counts 0 wrong bytes. Shape
 * only: no figure is compared with a speed. */
Test(tools, bench_abort_mode_shape, .timeout = 120)
{
	const char *bench = build_path("tools/bench/kvstage-bench");
	int rc = RUN(bench, "abort", "--json", "-q", "--abort-rate", "0.3", "--abort-side", "both",
		     "--chunk", "16K", "--rooms", "2", "-d", "0.2", "--vulnerable",
		     build_path("tests/kvstaged-vulnerable"));
	cr_assert_eq(rc, 0, "%s", err);
	static const char *const keys[] = {
		"\"mode\": \"abort\"",
		"\"abort_to_final_us\"",
		"\"abort_to_reusable_us\"",
		"\"by_phase\"",
		"\"gbps_vs_reference\"",
		"\"tombstones_reaped\"",
		"\"refused\"",
		"\"late_events\": 0",
		"\"pages_bad\": 0",
		"\"path\": \"tcp\"",
		"\"proxy\": \"kvstaged-vulnerable\"",
	};
	for (unsigned i = 0; i < sizeof(keys) / sizeof(keys[0]); i++)
		cr_assert(strstr(out, keys[i]), "no %s in: %s", keys[i], out);
	unsigned fenced = 0, aborted = 0;
	for (const char *p = out; (p = strstr(p, "\"proxy\": \"kvstaged\",")); p++) {
		const char *c = strstr(p, "\"corrupt_bytes\": ");
		cr_assert_not_null(c, "a point without corrupt_bytes");
		cr_assert_eq(strncmp(c, "\"corrupt_bytes\": 0,", 19), 0, "wrong bytes: %.40s", c);
		fenced++;
		const char *r = strstr(p, "\"abort_rate\": ");
		aborted += r && strncmp(r, "\"abort_rate\": 0,", 16);
	}
	/* local and tcp at rates 0 and 0.3, and the staged run through kvstaged */
	cr_assert_eq(fenced, 5, "points through kvstaged: %u\n%s", fenced, out);
	cr_assert_eq(aborted, 3, "points with aborts: %u", aborted);
	for (char *p = out; *p; p++)
		if (*p == '\n')
			*p = ' ';
	cr_assert_neq(json_lines_ok(out, NULL), 0, "not JSON: %s\n%s", err, out);

	rc = RUN(bench, "abort", "--abort-rate", "1.5");
	cr_assert_eq(rc, 2, "%s", err);
	cr_assert(strstr(err, "invalid --abort-rate '1.5'"), "%s", err);
	rc = RUN(bench, "abort", "--abort-side", "sender");
	cr_assert_eq(rc, 2, "%s", err);
	cr_assert(strstr(err, "invalid --abort-side 'sender'"), "%s", err);
	rc = RUN(bench, "abort", "--payload", "copy");
	cr_assert_eq(rc, 2, "%s", err);
	cr_assert(strstr(err, "takes no --payload"), "%s", err);
}
