/* SPDX-License-Identifier: MIT */
/* kvstage-ctl: drive a kvstaged's failpoints (it must run with --failpoints). */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "admin.h"
#include "failpoint.h"
#include "kvstage.h"

static void usage(FILE *f)
{
	fprintf(f,
"Usage: kvstage-ctl [-s PATH] COMMAND [ARG]...\n"
"Control a kvstaged started with --failpoints.\n"
"\n"
"Commands:\n"
"  set NAME off|pause|fail[=ERRNO] [--match USER_DATA [--mask MASK]]\n"
"                        pause: hold what reaches NAME until set off;\n"
"                        fail: fail it with ERRNO (default EIO);\n"
"                        --match: only rooms whose user_data (either side) is USER_DATA;\n"
"                        with --mask, whose user_data & MASK is USER_DATA\n"
"  wait NAME [HITS]      block until NAME has been hit HITS times (default 1)\n"
"  hits NAME             print how many times NAME has been hit\n"
"  list                  list failpoint names\n"
"\n"
"Options:\n"
"  -s, --socket PATH     proxy socket (default $KVSTAGE_SOCKET, else " KVS_DEFAULT_SOCKET ")\n"
"  -t, --timeout MS      give up waiting after MS milliseconds (exit 3)\n"
"  -h, --help            show this help\n"
"  -V, --version         show the version\n");
}

static int fail(const char *what, int rc)
{
	const char *m = kvs_admin_msg();
	fprintf(stderr, "kvstage-ctl: %s: %s%s%s\n", what, kvs_strerror(rc), *m ? ": " : "", m);
	return rc == -ETIMEDOUT ? 3 : 1;
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "socket", required_argument, NULL, 's' }, { "timeout", required_argument, NULL, 't' },
		{ "match", required_argument, NULL, 'm' },  { "mask", required_argument, NULL, 'k' },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, 'V' },      { 0 },
	};
	const char *path = getenv("KVSTAGE_SOCKET");
	int timeout = -1, opt;
	uint64_t match = 0, mask = 0;
	int has_match = 0;
	while ((opt = getopt_long(argc, argv, "+s:t:m:k:hV", opts, NULL)) != -1) {
		char *end;
		switch (opt) {
		case 's': path = optarg; break;
		case 't':
			timeout = (int)strtol(optarg, &end, 10);
			if (*end || timeout < 0) {
				fprintf(stderr, "kvstage-ctl: invalid --timeout '%s'\n", optarg);
				return 2;
			}
			break;
		case 'm':
			match = strtoull(optarg, &end, 0);
			if (*end || !*optarg) {
				fprintf(stderr, "kvstage-ctl: invalid --match '%s'\n", optarg);
				return 2;
			}
			has_match = 1;
			break;
		case 'k':
			mask = strtoull(optarg, &end, 0);
			if (*end || !*optarg || !mask) {
				fprintf(stderr, "kvstage-ctl: invalid --mask '%s'\n", optarg);
				return 2;
			}
			break;
		case 'h': usage(stdout); return 0;
		case 'V': printf("kvstage-ctl %s\n", KVS_VERSION_STRING); return 0;
		default: fprintf(stderr, "Try 'kvstage-ctl --help'.\n"); return 2;
		}
	}
	/* options may also follow the command */
	int n = argc - optind;
	char **a = argv + optind;
	for (int i = 0; i + 1 < n; i++) {
		int is_match = !strcmp(a[i], "--match") || !strcmp(a[i], "-m");
		if (is_match || !strcmp(a[i], "--mask") || !strcmp(a[i], "-k")) {
			char *end;
			uint64_t v = strtoull(a[i + 1], &end, 0);
			if (*end || !*a[i + 1] || (!is_match && !v)) {
				fprintf(stderr, "kvstage-ctl: invalid %s '%s'\n", a[i], a[i + 1]);
				return 2;
			}
			if (is_match) {
				match = v;
				has_match = 1;
			} else {
				mask = v;
			}
			memmove(&a[i], &a[i + 2], (size_t)(n - i - 2) * sizeof(*a));
			n -= 2;
			i--;
		}
	}
	if (n < 1) {
		usage(stderr);
		return 2;
	}
	if (!strcmp(a[0], "list")) {
		for (int i = 0; i < KVSP_FP_COUNT; i++)
			printf("%s\n", kvsp_fp_names[i]);
		return 0;
	}
	if (n < 2 || kvsp_fp_find(a[1]) < 0) {
		fprintf(stderr, "kvstage-ctl: %s: want a failpoint name (see 'kvstage-ctl list')\n",
			n < 2 ? a[0] : a[1]);
		return 2;
	}
	if (!path || !*path)
		path = KVS_DEFAULT_SOCKET;
	int fd = kvs_admin_connect(path);
	if (fd < 0)
		return fail(path, fd);
	int rc;
	if (!strcmp(a[0], "set") && n == 3) {
		if (mask && !has_match) {
			fprintf(stderr, "kvstage-ctl: --mask needs --match\n");
			return 2;
		}
		rc = has_match ? kvs_admin_fp_set_mask(fd, a[1], a[2], match, mask)
			       : kvs_admin_fp_set(fd, a[1], a[2], NULL);
		if (rc == -EINVAL && !*kvs_admin_msg()) {
			fprintf(stderr, "kvstage-ctl: bad action '%s': want off, pause or fail[=ERRNO]\n",
				a[2]);
			return 2;
		}
		if (rc < 0)
			return fail(a[1], rc);
	} else if (!strcmp(a[0], "wait") && (n == 2 || n == 3)) {
		char *end = NULL;
		uint64_t hits = n == 3 ? strtoull(a[2], &end, 10) : 1;
		if (n == 3 && (*end || !hits)) {
			fprintf(stderr, "kvstage-ctl: invalid HITS '%s'\n", a[2]);
			return 2;
		}
		rc = kvs_admin_fp_wait(fd, a[1], hits, timeout);
		if (rc < 0)
			return fail(a[1], rc);
	} else if (!strcmp(a[0], "hits") && n == 2) {
		uint64_t hits;
		rc = kvs_admin_fp_get(fd, a[1], &hits);
		if (rc < 0)
			return fail(a[1], rc);
		printf("%llu\n", (unsigned long long)hits);
	} else {
		fprintf(stderr, "kvstage-ctl: unknown command or wrong arguments: %s\n", a[0]);
		fprintf(stderr, "Try 'kvstage-ctl --help'.\n");
		return 2;
	}
	close(fd);
	return 0;
}
