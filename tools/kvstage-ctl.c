/* SPDX-License-Identifier: MIT */
/* kvstage-ctl: drive a kvstaged's failpoints (it must run with --failpoints). */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "admin.h"
#include "kvstage.h"
#include "parse.h"

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: kvstage-ctl [-s PATH] COMMAND [ARG]...\n"
		"Control a kvstaged started with --failpoints.\n"
		"\n"
		"Commands:\n"
		"  set NAME off|pause|fail[=ERRNO] [--match USER_DATA [--mask MASK]]\n"
		"                        pause: hold what reaches NAME until set off;\n"
		"                        fail: fail it with ERRNO, 1 to 4095 (default EIO);\n"
		"                        --match: only rooms whose user_data (either side) is "
		"USER_DATA;\n"
		"                        with --mask, whose user_data & MASK is USER_DATA;\n"
		"                        USER_DATA and MASK are decimal, or hexadecimal after 0x\n"
		"                        (up to 64 bits); MASK is not 0\n"
		"  wait NAME [HITS]      block until NAME has been hit HITS times (default 1)\n"
		"  hits NAME             print how many times NAME has been hit\n"
		"  list                  list the proxy's own failpoint names (its data\n"
		"                        paths add theirs: rdma.read with RDMA)\n"
		"\n"
		"Options:\n"
		"  -s, --socket PATH     proxy socket (default $KVSTAGE_SOCKET, "
		"else " KVS_DEFAULT_SOCKET ")\n"
		"  -t, --timeout MS      give up waiting after MS milliseconds (exit 3); default: "
		"never\n"
		"  -m, --match USER_DATA, -k, --mask MASK\n"
		"                        as for set; they may also follow the command\n"
		"  -h, --help            show this help\n"
		"  -V, --version         show the version\n"
		"\n"
		"Numbers are digits only: no sign, space or suffix.\n"
		"Exit status: 0 done, 1 the proxy refused or is not there, 2 bad command line,\n"
		"3 timed out.\n");
}

/* The proxy's own message is the reason when it gave one; else ours for rc. */
static int fail(const char *what, int rc)
{
	const char *m = kvs_admin_msg();
	fprintf(stderr, "kvstage-ctl: %s: %s\n", what, *m ? m : kvs_strerror(rc));
	return rc == -ETIMEDOUT ? 3 : 1;
}

/* USER_DATA or MASK: decimal digits, or 0x and hex digits, 64 bits at most. */
static int parse_u64(const char *s, uint64_t *out)
{
	if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
		size_t n = strspn(s + 2, "0123456789abcdefABCDEF");
		size_t zeros = strspn(s + 2, "0");
		if (n == 0 || s[2 + n] || n - (zeros < n ? zeros : n) > 16)
			return -EINVAL;
		*out = strtoull(s + 2, NULL, 16);
		return 0;
	}
	return kvs_parse_uint(s, UINT64_MAX, out);
}

/* Says "invalid OPT 'VAL': want ..." and returns 2 (a bad command line). */
__attribute__((format(printf, 3, 4))) static int bad_number(const char *opt, const char *val,
							    const char *want, ...)
{
	va_list ap;
	va_start(ap, want);
	fprintf(stderr, "kvstage-ctl: invalid %s '%s': ", opt, val);
	vfprintf(stderr, want, ap);
	fputc('\n', stderr);
	va_end(ap);
	return 2;
}

/* --match (is_mask 0) or --mask (1). Returns 0, or 2 after saying why. */
static int parse_match(const char *opt, const char *val, int is_mask, uint64_t *out)
{
	if (parse_u64(val, out) < 0)
		return bad_number(opt, val, "want a number, decimal or 0x hexadecimal (64 bits)");
	if (is_mask && !*out)
		return bad_number(opt, val,
				  "want a mask other than 0 (omit --mask to match all bits)");
	return 0;
}

/* "off", "pause", "fail" or "fail=ERRNO" (1 to 4095), as kvs_admin_fp_set takes. */
static int action_ok(const char *a)
{
	uint64_t e;
	if (!strcmp(a, "off") || !strcmp(a, "pause") || !strcmp(a, "fail"))
		return 1;
	return !strncmp(a, "fail=", 5) && !kvs_parse_uint(a + 5, 4095, &e) && e;
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "socket", required_argument, NULL, 's' },
		{ "timeout", required_argument, NULL, 't' },
		{ "match", required_argument, NULL, 'm' },
		{ "mask", required_argument, NULL, 'k' },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, 'V' },
		{ 0 },
	};
	const char *path = getenv("KVSTAGE_SOCKET");
	int timeout = -1, opt;
	uint64_t match = 0, mask = 0;
	int has_match = 0;
	while ((opt = getopt_long(argc, argv, "+s:t:m:k:hV", opts, NULL)) != -1) {
		uint64_t v;
		switch (opt) {
		case 's':
			path = optarg;
			break;
		case 't':
			if (kvs_parse_uint(optarg, INT_MAX, &v))
				return bad_number("--timeout", optarg,
						  "want milliseconds from 0 to %d", INT_MAX);
			timeout = (int)v;
			break;
		case 'm':
			if (parse_match("--match", optarg, 0, &match))
				return 2;
			has_match = 1;
			break;
		case 'k':
			if (parse_match("--mask", optarg, 1, &mask))
				return 2;
			break;
		case 'h':
			usage(stdout);
			return 0;
		case 'V':
			printf("kvstage-ctl %s\n", KVS_VERSION_STRING);
			return 0;
		default:
			fprintf(stderr, "Try 'kvstage-ctl --help'.\n");
			return 2;
		}
	}
	/* --match and --mask may also follow the command */
	int n = argc - optind;
	char **a = argv + optind;
	for (int i = 0; i < n; i++) {
		int is_match = !strcmp(a[i], "--match") || !strcmp(a[i], "-m");
		if (!is_match && strcmp(a[i], "--mask") && strcmp(a[i], "-k"))
			continue;
		if (i + 1 == n) {
			fprintf(stderr, "kvstage-ctl: %s needs a value\n", a[i]);
			return 2;
		}
		if (parse_match(a[i], a[i + 1], !is_match, is_match ? &match : &mask))
			return 2;
		has_match |= is_match;
		memmove(&a[i], &a[i + 2], (size_t)(n - i - 2) * sizeof(*a));
		n -= 2;
		i--;
	}
	if (n < 1) {
		usage(stderr);
		return 2;
	}
	if (!strcmp(a[0], "list")) {
		for (int i = 0; i < KVS_FP_COUNT; i++)
			printf("%s\n", kvs_fp_names[i]);
		return 0;
	}
	/* A name not of the proxy's own may be a data path's: the proxy says. */
	if (n < 2 || !*a[1] || strlen(a[1]) > 31) {
		fprintf(stderr, "kvstage-ctl: %s: want a failpoint name (see 'kvstage-ctl list')\n",
			n < 2 ? a[0] : a[1]);
		return 2;
	}
	/* Everything is checked before the proxy is asked anything. */
	enum { SET, WAIT, HITS } cmd;
	uint64_t hits = 1;
	if (!strcmp(a[0], "set") && n == 3) {
		cmd = SET;
		if (mask && !has_match) {
			fprintf(stderr, "kvstage-ctl: --mask needs --match\n");
			return 2;
		}
		if (!action_ok(a[2])) {
			fprintf(stderr,
				"kvstage-ctl: bad action '%s': want off, pause or "
				"fail[=ERRNO] (ERRNO 1 to 4095)\n",
				a[2]);
			return 2;
		}
	} else if (!strcmp(a[0], "wait") && (n == 2 || n == 3)) {
		cmd = WAIT;
		if (n == 3 && (kvs_parse_uint(a[2], UINT64_MAX, &hits) || !hits))
			return bad_number("HITS", a[2], "want a count from 1 to %llu",
					  (unsigned long long)UINT64_MAX);
	} else if (!strcmp(a[0], "hits") && n == 2) {
		cmd = HITS;
	} else {
		fprintf(stderr, "kvstage-ctl: unknown command or wrong arguments: %s\n", a[0]);
		fprintf(stderr, "Try 'kvstage-ctl --help'.\n");
		return 2;
	}
	if ((has_match || mask) && cmd != SET) {
		fprintf(stderr, "kvstage-ctl: --match and --mask are for set\n");
		return 2;
	}
	if (!path || !*path)
		path = KVS_DEFAULT_SOCKET;
	int fd = kvs_admin_connect(path);
	if (fd < 0)
		return fail(path, fd);
	int rc = 0;
	switch (cmd) {
	case SET:
		rc = has_match ? kvs_admin_fp_set_mask(fd, a[1], a[2], match, mask)
			       : kvs_admin_fp_set(fd, a[1], a[2], NULL);
		break;
	case WAIT:
		rc = kvs_admin_fp_wait(fd, a[1], hits, timeout);
		break;
	case HITS:
		rc = kvs_admin_fp_get(fd, a[1], &hits);
		if (rc == 0)
			printf("%llu\n", (unsigned long long)hits);
		break;
	}
	close(fd);
	if (rc == -ENOENT) {
		fprintf(stderr, "kvstage-ctl: %s: want a failpoint name (see 'kvstage-ctl list')\n",
			a[1]);
		return 2;
	}
	if (rc < 0)
		return fail(a[1], rc);
	if (fflush(stdout) == EOF || ferror(stdout)) {
		fprintf(stderr, "kvstage-ctl: writing the answer: %s\n", strerror(errno));
		return 1;
	}
	return 0;
}
