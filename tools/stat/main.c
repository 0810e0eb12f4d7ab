/* SPDX-License-Identifier: MIT */
/* kvstage-stat: what the proxy publishes in its read-only control segment.
 * This file: the command line and the sample loop (a proxy that is down or
 * unreadable, and one that comes back); tables.c reads the segment, and
 * human.c, json.c and top.c show it. */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "admin.h"
#include "kvstage.h"
#include "layout.h"
#include "parse.h"
#include "stat.h"

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: kvstage-stat [OPTION]...\n"
		"Show a running kvstaged's state (serving or draining), pool, slots, rooms,\n"
		"clients and counters.\n"
		"\n"
		"  -s, --socket PATH   proxy socket (default $KVSTAGE_SOCKET, "
		"else " KVS_DEFAULT_SOCKET ")\n"
		"  -j, --json          one JSON object per sample (one line each), with a\n"
		"                      clients_table: one entry per attached client\n"
		"  -w, --watch MS      sample every MS milliseconds (1 to 2147483647), with\n"
		"                      rates since the previous sample (rooms/s, aborts/s,\n"
		"                      GB/s) from the second one on, until\n"
		"                      interrupted; each sample asks the proxy anew, so a proxy\n"
		"                      that is down gets one line saying why, and one that\n"
		"                      comes back (a new instance) is shown again\n"
		"  -t, --top[=MS]      a top-like view, redrawn every MS milliseconds (default\n"
		"                      --watch's, else 1000): rates, one row per peer session\n"
		"                      and one per client, busiest first; plain samples, no\n"
		"                      escape codes, when stdout is not a terminal\n"
		"      --slots         also list every slot that is not free (not with --top)\n"
		"  -h, --help          show this help\n"
		"  -V, --version       show the version\n"
		"\n"
		"Exit status: 0 shown, 1 no proxy could be read (without --watch), 2 bad command "
		"line.\n");
}

/* A sample that found no readable proxy: up says whether one answered. */
static void print_down(const char *path, int json, int up, const char *why)
{
	if (!json) {
		printf("kvstaged %s: %s (%s)\n", path, up ? "unreadable" : "down", why);
		return;
	}
	printf("{");
	json_key("socket");
	kvs_json_string(stdout, path);
	printf(",\"up\":%s,", up ? "true" : "false");
	json_key("error");
	kvs_json_string(stdout, why);
	printf("}\n");
}

#define ABI_STR_(x) #x
#define ABI_STR(x) ABI_STR_(x)
#define ABI_WHY \
	"it speaks another ABI (its control segment is not kvstage ABI " ABI_STR(KVS_ABI) ")"

/* Maps the proxy's control segment afresh. Returns 0 (unmap *c after use),
 * -1 (no proxy answered) or -2 (one answered with a segment this tool cannot
 * read), with *why set. */
static int sample_map(const char *path, const struct kvs_ctrl **c, size_t *len, const char **why)
{
	int rc = kvs_stat_map(path, c, len);
	if (rc == -EBADMSG) {
		*why = "what answers there hands over a control segment smaller than the size it "
		       "says "
		       "(not kvstaged?)";
		return -2;
	}
	if (rc < 0) {
		*why = kvs_strerror(rc);
		return -1;
	}
	if (*len < sizeof(struct kvs_ctrl) || (*c)->magic != KVS_MAGIC_CTRL ||
	    (*c)->abi != KVS_ABI) {
		munmap((void *)*c, *len);
		*why = ABI_WHY;
		return -2;
	}
	return 0;
}

static void stdout_check(void)
{
	if (fflush(stdout) == EOF || ferror(stdout)) {
		fprintf(stderr, "kvstage-stat: writing the sample: %s\n", strerror(errno));
		exit(1);
	}
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "socket", required_argument, NULL, 's' }, { "json", no_argument, NULL, 'j' },
		{ "watch", required_argument, NULL, 'w' },  { "slots", no_argument, NULL, 'S' },
		{ "top", optional_argument, NULL, 't' },    { "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, 'V' },	    { 0 },
	};
	const char *path = getenv("KVSTAGE_SOCKET");
	int json = 0, slots = 0, top = 0, opt;
	uint64_t watch = 0, top_ms = 0;
	while ((opt = getopt_long(argc, argv, "s:jw:t::hV", opts, NULL)) != -1) {
		switch (opt) {
		case 's':
			path = optarg;
			break;
		case 'j':
			json = 1;
			break;
		case 'S':
			slots = 1;
			break;
		case 'w':
			if (kvs_parse_uint(optarg, INT_MAX, &watch) || !watch) {
				fprintf(stderr,
					"kvstage-stat: invalid --watch '%s': want milliseconds "
					"from 1 to %d (digits only)\n",
					optarg, INT_MAX);
				return 2;
			}
			break;
		case 't':
			top = 1;
			if (optarg && (kvs_parse_uint(optarg, INT_MAX, &top_ms) || !top_ms)) {
				fprintf(stderr,
					"kvstage-stat: invalid --top '%s': want milliseconds "
					"from 1 to %d (digits only)\n",
					optarg, INT_MAX);
				return 2;
			}
			break;
		case 'h':
			usage(stdout);
			return 0;
		case 'V':
			printf("kvstage-stat %s\n", KVS_VERSION_STRING);
			return 0;
		default:
			fprintf(stderr, "Try 'kvstage-stat --help'.\n");
			return 2;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "kvstage-stat: unexpected argument '%s'\n", argv[optind]);
		return 2;
	}
	if (top && slots) {
		fprintf(stderr, "kvstage-stat: --slots does not go with --top\n");
		return 2;
	}
	if (top)
		watch = top_ms ? top_ms : watch ? watch : 1000;
	/* Only a terminal gets a redrawn screen; anything else, plain samples. */
	bool screen = top && !json && isatty(STDOUT_FILENO);
	if (!path || !*path)
		path = KVS_DEFAULT_SOCKET;
	uint64_t last_instance = 0;
	for (int first = 1;; first = 0) {
		const struct kvs_ctrl *c;
		size_t len;
		const char *why;
		int rc = sample_map(path, &c, &len, &why);
		if (rc < 0 && !watch) {
			fprintf(stderr, "kvstage-stat: %s: %s\n", path, why);
			return 1;
		}
		if (!first && !json && !screen)
			printf("\n");
		if (rc < 0) {
			if (screen)
				fputs("\033[H\033[2J", stdout);
			print_down(path, json, rc == -2, why);
		} else {
			struct rates r;
			struct tables tb = { 0 };
			int restarted = last_instance && c->instance != last_instance;
			rates_take(c, len, &r);
			tables_take(c, len, &tb);
			if (json) {
				print_json(c, len, path, slots, watch ? &r : NULL, &tb);
			} else if (screen) {
				char *text = NULL;
				size_t n = 0;
				FILE *f = open_memstream(&text, &n);
				if (!f) {
					fprintf(stderr, "kvstage-stat: out of memory\n");
					return 1;
				}
				print_top(f, c, path, restarted, &r, &tb);
				fclose(f);
				show_frame(text);
				free(text);
			} else if (top) {
				print_top(stdout, c, path, restarted, &r, &tb);
			} else {
				print_human(c, len, path, slots, restarted, watch ? &r : NULL, &tb);
			}
			tables_free(&tb);
			last_instance = c->instance;
			munmap((void *)c, len);
		}
		stdout_check();
		if (!watch)
			return 0;
		struct timespec ts = { (time_t)(watch / 1000), (long)(watch % 1000) * 1000000 };
		while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
			;
	}
}
