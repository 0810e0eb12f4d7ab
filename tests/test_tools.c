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
