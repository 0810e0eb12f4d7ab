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
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

static struct proxy px = PROXY_INIT;
static char out[65536], err[65536];
static pid_t watcher;       /* a kvstage-stat --watch child, or 0 */
static char links[2][128];  /* symlinks with awkward names, or "" */
static char tmpfile_[64];   /* JSON handed to python3, or "" */
static kvs_client *client;  /* held across a drain */

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
	int rc = run_cmd((const char *[]){ "/usr/bin/env", "python3", "-c", script, tmpfile_,
					   socket, NULL },
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

/* ------------------------------------------------------------ kvstage-ctl */

Test(tools, ctl_help_tells_every_option_and_number_form)
{
	cr_assert_eq(RUN(build_path("tools/kvstage-ctl"), "--help"), 0);
	const char *says[] = { "--socket", "--timeout", "--match", "--mask", "--help", "--version",
			       "0x", "1 to 4095", "Exit status" };
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
		{ { "--match", "0x 5", "set", "local.quiesce", "pause" }, "invalid --match '0x 5'" },
		{ { "--match", "0x-1", "set", "local.quiesce", "pause" }, "invalid --match '0x-1'" },
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
		{ { "set", "local.quiesce", "pause", "--match", "1", "-k", "0x0" }, "invalid -k '0x0'" },
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
	snprintf(want, sizeof(want), "kvstage-ctl: %s: failpoints are off: start kvstaged with "
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

/* ---------------------------------------------------------- kvstage-bench */

Test(tools, bench_refuses_lenient_numbers)
{
	const char *bench = build_path("tools/bench/kvstage-bench");
	struct {
		const char *opt, *val;
	} bad[] = {
		{ "--rooms", " 5" },      { "--rooms", "+5" },       { "--rooms", "5x" },
		{ "--senders", " 1" },    { "--receivers", " 1" },   { "--samples", " 5" },
		{ "--duration", " 1" },   { "--duration", "+1" },    { "--duration", "-1" },
		{ "--duration", "0x1p0" }, { "--duration", "inf" },  { "--duration", "1s" },
		{ "--warmup", " 0" },     { "--warmup", "-0" },      { "--baseline-sec", "+0.1" },
		{ "--idle-gap", " 2" },   { "--idle-gap", "nan" },   { "--room-bytes", " 4K" },
		{ "--bytes", "-1M" },     { "--wset", " 1M" },       { "--chunk", " 4K" },
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
		     "a\"b\\c\x01" "d\xff" "e");
	cr_assert_eq(rc, 0, "%s", err);
	cr_assert(strstr(out, "\"a\\\"b\\\\c\\u0001d\\ufffde\""), "%s", out);
	/* one object, so one "line" for the checker: join it */
	for (char *p = out; *p; p++)
		if (*p == '\n')
			*p = ' ';
	cr_assert_neq(json_lines_ok(out, NULL), 0, "not JSON: %s\n%s", err, out);
}
