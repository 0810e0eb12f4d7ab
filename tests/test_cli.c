/* SPDX-License-Identifier: MIT */
/* The command lines: --help tells the truth, bad input gets a clear error
 * and exit code 2, and the tools work against a live proxy. */
#include <criterion/criterion.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "kvs_build.h"

static struct proxy px = PROXY_INIT;
static char out[65536], err[65536];

static void teardown(void)
{
	proxy_stop(&px);
}

TestSuite(cli, .fini = teardown, .timeout = 60);

#define RUN(...) run_cmd((const char *[]){ __VA_ARGS__, NULL }, out, sizeof(out), err, sizeof(err))

Test(cli, kvstaged_help_and_version)
{
	const char *bin = build_path("proxy/kvstaged");
	cr_assert_eq(RUN(bin, "--help"), 0);
	const char *opts[] = { "--socket",	 "--slots",	     "--slot-size", "--hugepages",
			       "--allow-uid",	 "--allow-gid",	     "--log-level", "--failpoints",
			       "--room-timeout", "--shutdown-grace", "--version" };
	for (unsigned i = 0; i < sizeof(opts) / sizeof(opts[0]); i++)
		cr_assert(strstr(out, opts[i]), "--help does not mention %s", opts[i]);
	cr_assert_eq(RUN(bin, "--version"), 0);
	cr_assert(strstr(out, "kvstaged " KVS_VERSION_STRING), "version: %s", out);
}

Test(cli, kvstaged_refuses_bad_input)
{
	const char *bin = build_path("proxy/kvstaged");
	struct {
		const char *a, *b, *says;
	} bad[] = {
		{ "--slots", "0", "--slots" },
		{ "--slots", "ten", "--slots" },
		{ "--slot-size", "1000", "multiple of 4K" },
		{ "--slot-size", "-4K", "--slot-size" },
		{ "--slot-size", "4Q", "--slot-size" },
		{ "--hugepages", "maybe", "auto, on or off" },
		{ "--log-level", "loud", "--log-level" },
		{ "--ring", "100", "power of two" },
		{ "--client-rooms", "70000", "--client-rooms" },
		{ "--ready-fd", "999", "--ready-fd" },
		{ "--bogus", "x", "--help" },
		{ "--socket", "", "want a path" },
		{ "--slots", " 5", "--slots" },
		{ "--slots", "+5", "--slots" },
		{ "--max-clients", "5 ", "--max-clients" },
		{ "--room-timeout", "-1", "--room-timeout" },
		{ "--slot-size", "4G", "32-bit length" },
		{ "--slot-size", " 4K", "--slot-size" },
		{ "--socket-mode", "rw", "octal" },
		{ "--transport", "rdma", "want auto, tcp or verbs" },
		{ "--metrics-listen", "localhost:9464",
		  KVS_HAVE_METRICS ? "numeric" : "this build has no metrics" },
	};
	for (unsigned i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		int rc = RUN(bin, "--socket", "/tmp/kvstage-cli-never.sock", bad[i].a, bad[i].b);
		cr_assert_eq(rc, 2, "%s %s: exit %d", bad[i].a, bad[i].b, rc);
		cr_assert(strstr(err, bad[i].says), "%s %s said: %s", bad[i].a, bad[i].b, err);
	}
	cr_assert_eq(RUN(bin, "--slots", "1048576", "--slot-size", "2M"), 2, "pool > 1 TiB");
	cr_assert(strstr(err, "1 TiB"), "%s", err);
	cr_assert_eq(RUN(bin, "stray"), 2);
	cr_assert(strstr(err, "unexpected argument"), "%s", err);
}

/* Whether this host has an RDMA device (the kernel lists it). */
static bool host_has_rdma(void)
{
	FILE *f = popen("ls /sys/class/infiniband 2>/dev/null", "r");
	char line[64];
	bool any = f && fgets(line, sizeof(line), f);
	if (f)
		pclose(f);
	return any;
}

/* --transport: the combinations that cannot work are refused at once. */
Test(cli, transport_choices_that_cannot_work)
{
	if (!KVS_HAVE_VERBS)
		cr_skip_test("this build has no RDMA (built without verbs): "
			     "cli::a_build_without_a_part_says_so shows what it refuses");
	const char *bin = build_path("proxy/kvstaged");
	unsetenv("KVSTAGE_PEER_SECRET");
	cr_assert_eq(RUN(bin, "--socket", "/tmp/kvstage-cli-never.sock", "--transport", "verbs"),
		     2);
	cr_assert(strstr(err, "--transport verbs rides on the tcp transport") &&
			  strstr(err, "secret"),
		  "%s", err);
	setenv("KVSTAGE_PEER_SECRET", "kvstage-cli-test-secret-0123456789", 1);
	cr_assert_eq(RUN(bin, "--socket", "/tmp/kvstage-cli-never.sock", "--transport", "tcp",
			 "--rdma-device", "rxe0"),
		     2);
	cr_assert(strstr(err, "--transport tcp never uses RDMA"), "%s", err);
}

/* Without a device: auto says it uses TCP and serves; verbs will not start. */
Test(cli, transport_without_an_rdma_device)
{
	if (!KVS_HAVE_VERBS)
		cr_skip_test("this build has no RDMA (built without verbs): "
			     "cli::a_build_without_a_part_says_so shows what it refuses");
	if (host_has_rdma())
		cr_skip_test("this host has an RDMA device (/sys/class/infiniband): the no-device "
			     "choices cannot be shown here");
	setenv("KVSTAGE_PEER_SECRET", "kvstage-cli-test-secret-0123456789", 1);
	const char *bin = build_path("proxy/kvstaged");
	cr_assert_eq(RUN(bin, "--socket", "/tmp/kvstage-cli-verbs.sock", "--slots", "1",
			 "--slot-size", "4K", "--no-lock", "--transport", "verbs"),
		     1);
	cr_assert(strstr(err, "--transport verbs: no RDMA device"), "%s", err);
	cr_assert(!strstr(err, "serving"), "it served: %s", err);
	const char *args[] = { "--slots", "1", "--slot-size", "4K", "--transport", "auto", NULL };
	proxy_start(&px, NULL, args);
	char log[8192];
	proxy_log(&px, log, sizeof(log));
	cr_assert(strstr(log, "peers: chunks by TCP (--transport auto: no RDMA device here)"), "%s",
		  log);
}

/* The parts a build lacks (meson_options.txt: verbs, metrics, systemd,
 * acl) are named by kvstaged --help and by kvstage-stat; each option that
 * needs one is refused with one line naming the package that was missing;
 * a build with every part names none. */
static bool lacks(const char *part)
{
	return strstr(KVS_BUILT_WITHOUT, part) != NULL;
}

static void refused_in_one_line(const char *a, const char *b, const char *says)
{
	int rc = RUN(build_path("proxy/kvstaged"), "--socket", "/tmp/kvstage-cli-never.sock", a, b);
	cr_assert_eq(rc, 2, "%s %s: exit %d", a, b, rc);
	char want[256];
	snprintf(want, sizeof(want), "kvstaged: %s: %s\n", a, says);
	if (!strcmp(a, "--transport"))
		snprintf(want, sizeof(want), "kvstaged: %s %s: %s\n", a, b, says);
	cr_assert_str_eq(err, want, "%s %s", a, b);
}

Test(cli, a_build_without_a_part_says_so)
{
	const char *bin = build_path("proxy/kvstaged");
	cr_assert_eq(RUN(bin, "--help"), 0);
	char line[128];
	snprintf(line, sizeof(line), "\nbuilt without: %s\n", KVS_BUILT_WITHOUT);
	if (*KVS_BUILT_WITHOUT)
		cr_assert(strstr(out, line), "--help does not say \"%s\": %s", line + 1, out);
	else
		cr_assert_null(strstr(out, "built without"), "%s", out);

	setenv("KVSTAGE_PEER_SECRET", "kvstage-cli-test-secret-0123456789", 1);
	if (lacks("verbs")) {
		const char *no = "this build has no RDMA (libibverbs-dev missing at build time)";
		refused_in_one_line("--rdma-device", "rxe0", no);
		refused_in_one_line("--rdma-gid-index", "1", no);
		refused_in_one_line("--rdma-keys", "windows", no);
		refused_in_one_line("--transport", "verbs", no);
	}
	if (lacks("metrics"))
		refused_in_one_line(
			"--metrics-listen", "9464",
			"this build has no metrics (libmicrohttpd-dev missing at build time)");

	/* A proxy of this build: its log and kvstage-stat say what it lacks. */
	if (lacks("systemd"))
		setenv("NOTIFY_SOCKET", "/tmp/kvstage-cli-no-such-notify", 1);
	const char *args[] = { "--slots", "1", "--slot-size", "4K", "--transport", "auto", NULL };
	proxy_start(&px, NULL, args);
	unsetenv("NOTIFY_SOCKET");
	char log[8192];
	proxy_log(&px, log, sizeof(log));
	if (lacks("verbs"))
		cr_assert(strstr(log,
				 "peers: chunks by TCP (this build has no RDMA: libibverbs-dev "
				 "missing at build time)"),
			  "%s", log);
	if (lacks("systemd"))
		cr_assert(strstr(log,
				 "$NOTIFY_SOCKET is set, but this build has no systemd support "
				 "(libsystemd-dev missing at build time)"),
			  "%s", log);
	const char *stat = build_path("tools/kvstage-stat");
	cr_assert_eq(RUN(stat, "-s", px.sock), 0, "%s", err);
	snprintf(line, sizeof(line), "\nbuilt without: %s\n", KVS_BUILT_WITHOUT);
	if (*KVS_BUILT_WITHOUT)
		cr_assert(strstr(out, line), "kvstage-stat does not say \"%s\": %s", line + 1, out);
	else
		cr_assert_null(strstr(out, "built without"), "%s", out);
	cr_assert_eq(RUN(stat, "-s", px.sock, "--json"), 0, "%s", err);
	char json[128] = "\"built_without\":[";
	bool first = true;
	for (const char *p = KVS_BUILT_WITHOUT; *p; first = false) {
		size_t n = strcspn(p, ",");
		snprintf(json + strlen(json), sizeof(json) - strlen(json), "%s\"%.*s\"",
			 first ? "" : ",", (int)n, p);
		p += n;
		p += strspn(p, ", ");
	}
	strcat(json, "]");
	cr_assert(strstr(out, json), "want %s in %s", json, out);
}

/* --ready-fd 2: "ready" goes to stderr, and stderr stays open for the log. */
Test(cli, ready_fd_two_keeps_stderr)
{
	char dir[] = "/tmp/kvstage-cli.XXXXXX", sock[64];
	cr_assert_not_null(mkdtemp(dir));
	snprintf(sock, sizeof(sock), "%s/s.sock", dir);
	int e[2];
	cr_assert_eq(pipe(e), 0);
	fflush(NULL);
	pid_t pid = fork();
	if (pid == 0) {
		dup2(e[1], 2);
		close(e[0]);
		close(e[1]);
		execl(build_path("proxy/kvstaged"), "kvstaged", "--socket", sock, "--no-lock",
		      "--slots", "1", "--slot-size", "4K", "--ready-fd", "2", (char *)NULL);
		_exit(127);
	}
	close(e[1]);
	/* read the log up to "ready", then stop it: its last words must follow */
	char buf[8192] = { 0 };
	size_t n = 0;
	while (!strstr(buf, "ready\n") && n < sizeof(buf) - 1) {
		struct pollfd p = { e[0], POLLIN, 0 };
		cr_assert_eq(poll(&p, 1, WAIT_MS), 1, "no ready: %s", buf);
		ssize_t k = read(e[0], buf + n, sizeof(buf) - 1 - n);
		cr_assert_gt(k, 0, "stderr closed before ready: %s", buf);
		n += (size_t)k;
	}
	cr_assert(strstr(buf, "4 KiB pool"), "a small pool is said in KiB: %s", buf);
	kill(pid, SIGTERM);
	for (;;) {
		struct pollfd p = { e[0], POLLIN, 0 };
		cr_assert_eq(poll(&p, 1, WAIT_MS), 1);
		ssize_t k = read(e[0], buf + n, sizeof(buf) - 1 - n);
		if (k <= 0)
			break;
		n += (size_t)k;
	}
	close(e[0]);
	int st;
	cr_assert_eq(reap(pid, &st), pid);
	cr_assert(strstr(buf, "drained: exiting"), "the log after ready went nowhere: %s", buf);
	unlink(sock);
	char lock[80];
	snprintf(lock, sizeof(lock), "%s.lock", sock);
	unlink(lock);
	rmdir(dir);
}

Test(cli, hugepages_on_is_honest)
{
	FILE *f = fopen("/proc/meminfo", "r");
	cr_assert_not_null(f);
	char line[256];
	long free_huge = 0;
	while (fgets(line, sizeof(line), f))
		sscanf(line, "HugePages_Free: %ld", &free_huge);
	fclose(f);
	const char *bin = build_path("proxy/kvstaged");
	if (free_huge >= 2) {
		/* hugepages are reserved here: check the pool really uses them */
		proxy_start(&px, NULL,
			    (const char *[]){ "--hugepages", "on", "--slots", "1", "--slot-size",
					      "2M", NULL });
		cr_assert(px.ctrl->flags & KVS_CTRL_HUGEPAGES);
	} else {
		int rc = RUN(bin, "--socket", "/tmp/kvstage-cli-huge.sock", "--hugepages", "on",
			     "--slots", "1", "--slot-size", "2M");
		cr_assert_eq(rc, 1);
		cr_assert(strstr(err, "nr_hugepages"), "no hint how to fix: %s", err);
		/* auto falls back to normal pages and serves */
		proxy_start(&px, NULL,
			    (const char *[]){ "--hugepages", "auto", "--slots", "1", "--slot-size",
					      "2M", NULL });
		cr_assert(!(px.ctrl->flags & KVS_CTRL_HUGEPAGES));
	}
}

Test(cli, stat_and_ctl_against_a_live_proxy)
{
	proxy_start(&px, NULL, (const char *[]){ "--slots", "8", "--slot-size", "4K", NULL });
	const char *stat = build_path("tools/kvstage-stat"), *ctl = build_path("tools/kvstage-ctl");
	cr_assert_eq(RUN(stat, "-s", px.sock), 0, "%s", err);
	cr_assert(strstr(out, "free 8"), "%s", out);
	cr_assert(strstr(out, "8 slots x 4 KiB = 32 KiB"), "a small pool in KiB: %s", out);
	cr_assert_eq(RUN(stat, "-s", px.sock, "--json", "--slots"), 0, "%s", err);
	cr_assert(strstr(out, "\"slot_count\":8"), "%s", out);
	cr_assert(strstr(out, "\"slot_table\":[]"), "%s", out);
	cr_assert_eq(RUN(stat, "-s", "/tmp/kvstage-no-such.sock"), 1);
	cr_assert(strstr(err, "no proxy"), "%s", err);
	cr_assert_eq(RUN(stat, "--watch", "0"), 2);

	cr_assert_eq(RUN(ctl, "list"), 0);
	cr_assert(strstr(out, "local.quiesce"), "%s", out);
	cr_assert_eq(RUN(ctl, "-s", px.sock, "set", "local.quiesce", "pause", "--match", "7"), 0,
		     "%s", err);
	cr_assert_eq(RUN(ctl, "-s", px.sock, "hits", "local.quiesce"), 0, "%s", err);
	cr_assert_eq(strcmp(out, "0\n"), 0, "%s", out);
	cr_assert_eq(RUN(ctl, "-s", px.sock, "-t", "1", "wait", "local.quiesce"), 3,
		     "an unmet wait times out with exit 3");
	cr_assert_eq(RUN(ctl, "-s", px.sock, "set", "local.quiesce", "sometimes"), 2);
	cr_assert_eq(RUN(ctl, "-s", px.sock, "set", "no.such.point", "off"), 2);
	cr_assert_eq(RUN(ctl, "-s", px.sock, "set", "local.quiesce", "fail=5"), 0, "%s", err);
	cr_assert_eq(RUN(ctl, "-s", px.sock, "set", "local.quiesce", "off"), 0, "%s", err);

	/* the demo runs through it */
	cr_assert_eq(RUN(build_path("tools/kvstage-demo"), "-s", px.sock, "-r", "8", "-b", "10000"),
		     0, "%s%s", out, err);
	cr_assert(strstr(out, "all bytes verified"), "%s", out);
}

Test(cli, ctl_needs_failpoints)
{
	/* a plain proxy: no --failpoints */
	proxy_start_plain(&px, (const char *[]){ "--slots", "2", "--slot-size", "4K", NULL });
	int rc = RUN(build_path("tools/kvstage-ctl"), "-s", px.sock, "set", "local.quiesce",
		     "pause");
	cr_assert_eq(rc, 1);
	cr_assert(strstr(err, "--failpoints"), "%s", err);
}

static void write_file(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");
	cr_assert_not_null(f);
	fputs(text, f);
	fclose(f);
}

/* --config FILE: its options apply, the command line overrides them, and a
 * bad line is named with its number, exit 2, before anything starts. */
Test(cli, config_file_sets_options_and_the_command_line_wins)
{
	char dir[] = "/tmp/kvstage-conf.XXXXXX", good[96], path[96];
	cr_assert_not_null(mkdtemp(dir));
	snprintf(good, sizeof(good), "%s/good.conf", dir);
	/* comments: whole lines of any length, and after a value ('#' or ';' after a blank) */
	static char text[1024];
	char longc[400];
	memset(longc, 'c', sizeof(longc) - 1);
	longc[sizeof(longc) - 1] = 0;
	snprintf(text, sizeof(text),
		 "# a deployment's options\n# %s\n[kvstaged]\nslots = 8\n"
		 "slot-size = 64K # the chunk size\nroom-timeout = 1234 ; ms\nno-lock = true\n"
		 "tcp-checksum = no\n",
		 longc);
	write_file(good, text);
	proxy_start(&px, NULL, (const char *[]){ "--config", good, "--slots", "4", NULL });
	cr_assert_eq(px.ctrl->slot_count, 4, "the command line's --slots wins");
	cr_assert_eq(px.ctrl->slot_size, 64 * 1024,
		     "the file's slot-size applies, its comment dropped");
	proxy_stop(&px);

	const char *bin = build_path("proxy/kvstaged");
	struct {
		const char *text, *says;
	} bad[] = {
		{ "slots = 8\nslotz = 3\n", ":2: unknown key 'slotz'" },
		{ "\n# comment\nslots = many\n", ":3: invalid --slots 'many'" },
		{ "no-lock = maybe\n", ":1: no-lock = 'maybe': want true or false" },
		{ "[other]\nslots = 3\n", "unknown section [other]" },
		{ "slots\n", ":1: not 'key = value'" },
		{ "help = true\n", ":1: unknown key 'help'" },
		{ "slots =\n", ":1: slots has no value" },
		{ "listen = 127.0.0.1:0\n", "needs the deployment's peer secret" },
		/* a line past what inih takes is refused whole, with its own number:
		 * never cut, its tail read as a line of its own (once: failpoints) */
		{ "slots = 8\nsocket = "
		  "/tmp/kvstage-cli-never-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
		  "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
		  "xxxx"
		  "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
		  "xxxx"
		  "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\nfailpoints = true\n",
		  ":2: a line longer than 198 bytes" },
		{ "slots = 8\nsocket-mode = 0660#x\n", ":2: invalid --socket-mode '0660#x'" },
	};
	for (unsigned i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		snprintf(path, sizeof(path), "%s/bad%u.conf", dir, i);
		write_file(path, bad[i].text);
		int rc = RUN(bin, "--socket", "/tmp/kvstage-cli-never.sock", "--config", path);
		cr_assert_eq(rc, 2, "%s: exit %d", bad[i].text, rc);
		cr_assert(strstr(err, bad[i].says), "%s said: %s", bad[i].text, err);
		unlink(path);
	}
	cr_assert_eq(RUN(bin, "--config", "/nonexistent/kvstaged.conf"), 2);
	cr_assert(strstr(err, "No such file"), "%s", err);
	cr_assert_eq(RUN(bin, "--config", good, "--config", good), 2);
	cr_assert(strstr(err, "twice"), "%s", err);
	unlink(good);
	rmdir(dir);
}

/* Under systemd (stderr is the journal stream $JOURNAL_STREAM names) each
 * line starts with its syslog priority and carries no time of its own;
 * anywhere else it is stamped. */
Test(cli, log_lines_carry_a_syslog_priority_on_the_journal_stream)
{
	char dir[] = "/tmp/kvstage-journal.XXXXXX", logf[96], sock[96], script[512];
	cr_assert_not_null(mkdtemp(dir));
	snprintf(logf, sizeof(logf), "%s/stderr", dir);
	snprintf(sock, sizeof(sock), "%s/kvs.sock", dir);
	/* A start that fails after the log is up (no RDMA device has that
	 * name anywhere; in a build without RDMA, no interface has that
	 * address): lines, an error among them, then exit 1. */
	const char *tail = KVS_HAVE_VERBS
				   ? "--slots 1 --slot-size 4K --rdma-device no-such-rdma-device"
				   : "--slots 1 --slot-size 4K --listen 192.0.2.1:1";
	snprintf(script, sizeof(script),
		 "exec 2>%s; KVSTAGE_PEER_SECRET=kvstage-journal-test-secret-0123 "
		 "JOURNAL_STREAM=$(stat -c %%d:%%i %s) exec %s --socket %s %s",
		 logf, logf, build_path("proxy/kvstaged"), sock, tail);
	int rc = RUN("/bin/sh", "-c", script);
	cr_assert_eq(rc, 1, "kvstaged with a device or address that does not exist: exit %d", rc);
	FILE *f = fopen(logf, "r");
	cr_assert_not_null(f);
	char line[512];
	unsigned lines = 0;
	while (fgets(line, sizeof(line), f)) {
		lines++;
		cr_assert(line[0] == '<' && line[2] == '>' && strchr("3467", line[1]),
			  "no priority prefix: %s", line);
		cr_assert(!strstr(line, " kvstaged "), "a stamped line on the journal: %s", line);
	}
	fclose(f);
	cr_assert_gt(lines, 0, "kvstaged logged nothing");
	/* The same start with no journal: stamped lines. */
	snprintf(script, sizeof(script),
		 "exec 2>%s; KVSTAGE_PEER_SECRET=kvstage-journal-test-secret-0123 exec %s --socket "
		 "%s %s",
		 logf, build_path("proxy/kvstaged"), sock, tail);
	RUN("/bin/sh", "-c", script);
	f = fopen(logf, "r");
	cr_assert_not_null(f);
	cr_assert_not_null(fgets(line, sizeof(line), f));
	fclose(f);
	cr_assert(line[0] != '<' && strstr(line, " kvstaged "), "%s", line);
	unlink(logf);
	rmdir(dir);
}
