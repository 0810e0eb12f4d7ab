/* SPDX-License-Identifier: MIT */
/* The command line: every option, its default, and what is refused. */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "kvstage.h"

#define MIN_CHUNK (4ull << 10)
#define MAX_CHUNK (1ull << 30)

static void usage(FILE *f)
{
	fprintf(f,
"Usage: kvstage-bench [OPTION]... MODE\n"
"Measures kvstaged and prints each figure next to a baseline measured in the\n"
"same run. Without --socket it starts its own kvstaged per chunk size (in a\n"
"temporary directory, stopped with SIGTERM at the end).\n"
"\n"
"Modes:\n"
"  local      sender and receiver processes move rooms through one proxy:\n"
"             GB/s, chunks/s, rooms/s, chunk and room latency, proxy CPU;\n"
"             baselines: single-thread memcpy at the chunk size (the bound),\n"
"             a raw SPSC rte_ring between two processes, and for payload copy\n"
"             the same two copies by two processes through shared memory with\n"
"             raw rte_rings instead of kvstage\n"
"  latency    one chunk in flight: one process holds the sender and the\n"
"             receiver connection and busy-polls (kvs_poll); send-to-RECV_DONE\n"
"             latency against a raw rte_ring round trip\n"
"  idle       a proxy with no work: its CPU use over --duration, a client\n"
"             blocked in kvs_wait meanwhile, and the wake-up latency (first\n"
"             request after an idle gap, to its reply)\n"
"  baseline   the baselines alone: memcpy and one TCP loopback connection at\n"
"             each chunk size, the rte_ring round trip\n"
"  tcp        two proxies joined by the tcp transport: receivers on proxy B\n"
"             (which listens), senders on proxy A (which dials B), on\n"
"             loopback or with --netns in two network namespaces; GB/s,\n"
"             chunks/s, room latency and both proxies' CPU, against raw TCP\n"
"             between the same two endpoints (one stream, and --tcp-streams\n"
"             streams), measured in the same run\n"
"  verbs      the tcp mode with --rdma-device on both proxies: chunks pulled\n"
"             by RDMA READ; baseline: perftest's ib_read_bw between two\n"
"             processes on the same device, in the same run\n"
"  gpu        GPU memory into and out of slots (needs a CUDA build); it takes\n"
"             its own options: kvstage-bench gpu --help\n"
"\n"
"Proxy:\n"
"  -s, --socket PATH      use the kvstaged serving PATH (its slot size is the\n"
"                         chunk size); default: start one\n"
"      --kvstaged PATH    the kvstaged to start (default: $KVSTAGED, else\n"
"                         ../../proxy/kvstaged next to this binary, else PATH)\n"
"      --proxy-arg ARG    pass ARG to the kvstaged we start (repeatable), e.g.\n"
"                         --proxy-arg=--spin-us=1000; it is started with\n"
"                         --socket, --slots, --slot-size and --ready-fd\n"
"\n"
"tcp mode:\n"
"      --tcp-streams N    connections per peer, for the proxies and the raw\n"
"                         baseline (default 2, at most 16)\n"
"      --netns            put each proxy in a network namespace of its own,\n"
"                         joined by a veth pair (10.78.0.1 - 10.78.0.2) made\n"
"                         for this run and removed after it; needs root and\n"
"                         iproute2 (default: both on 127.0.0.1)\n"
"      --rdma-device NAME verbs: the RDMA device (ibv_devices lists them)\n"
"      --rdma-gid-index N verbs: its GID for the proxies and ib_read_bw\n"
"                         (default: their own choice)\n"
"\n"
"Work:\n"
"  -c, --chunk SIZE[,SIZE...]  chunk (slot) sizes, multiples of 4K, K/M/G\n"
"                         suffixes (default: 1M; latency: 4K)\n"
"      --sweep            chunk sizes 4K 16K 64K 256K 1M 4M 16M\n"
"      --room-bytes BYTES bytes per room (default: 16 chunks)\n"
"      --rooms N          rooms in flight per sender (default 4, at most 256)\n"
"      --senders N        sender processes (default 1, at most 64)\n"
"      --receivers N      receiver processes; each is paired with one sender,\n"
"                         so it must equal --senders (default: --senders)\n"
"      --payload MODE     none: slots are handed over untouched; copy: the\n"
"                         sender copies into each slot from a private buffer,\n"
"                         the receiver copies out into another; in: the\n"
"                         sender copies in, the receiver takes the slot and\n"
"                         reads it in place (one copy, like a buffer-to-buffer\n"
"                         transport); verify: the sender stamps a canary, the\n"
"                         receiver checks every byte (default: copy;\n"
"                         latency and tcp: none)\n"
"  -d, --duration SEC     measured seconds per point; idle: the quiet window\n"
"                         (default 2)\n"
"  -b, --bytes TOTAL      measure until TOTAL bytes moved instead (K/M/G)\n"
"      --warmup SEC       unmeasured time first (default: a tenth of --duration,\n"
"                         at most 0.5; 0 with --bytes); local mode also waits\n"
"                         until each receiver has completed --rooms rooms\n"
"      --baseline-sec SEC seconds per baseline figure (default: a quarter of\n"
"                         --duration, 0.05 to 0.5; tcp: half, 0.1 to 1)\n"
"      --wset BYTES       working set of each memcpy buffer ring and of each\n"
"                         client's private buffer (default 256M; keep it above\n"
"                         the last-level cache)\n"
"      --samples N        idle: wake-up samples (default 200)\n"
"      --idle-gap MS      idle: quiet milliseconds before each sample (default 2)\n"
"      --no-pin           leave CPU placement to the scheduler; by default, with\n"
"                         two or more CPUs, a proxy we start runs on the last CPU\n"
"                         we may use and every client process on the others;\n"
"                         the rte_ring baseline's two spinners take two CPUs\n"
"\n"
"Output (the table goes to stdout, progress and notes to stderr):\n"
"      --json             one JSON object instead of the table\n"
"      --csv              a header and one row per point instead of the table\n"
"      --plot FILE        also draw GB/s against chunk size with the baselines\n"
"                         as lines (FILE ends in .png or .svg; needs gnuplot)\n"
"      --progress         draw the live progress line even if stderr is not a\n"
"                         terminal\n"
"  -q, --quiet            no progress line and no notes\n"
"  -h, --help             show this help\n"
"  -V, --version          show the version\n"
"\n"
"Exit status: 0 done, 1 a measurement failed (or wrong bytes with verify),\n"
"2 bad command line, 130 interrupted.\n");
}

enum {
	O_KVSTAGED = 256, O_SWEEP, O_ROOMBYTES, O_ROOMS, O_SENDERS, O_RECEIVERS, O_PAYLOAD,
	O_WARMUP, O_BASESEC, O_WSET, O_SAMPLES, O_GAP, O_JSON, O_CSV, O_PLOT, O_PROGRESS,
	O_NOPIN, O_PROXYARG, O_STREAMS, O_NETNS, O_RDMA, O_GIDX,
};

static const struct option long_opts[] = {
	{ "socket", required_argument, NULL, 's' },
	{ "kvstaged", required_argument, NULL, O_KVSTAGED },
	{ "proxy-arg", required_argument, NULL, O_PROXYARG },
	{ "chunk", required_argument, NULL, 'c' },
	{ "sweep", no_argument, NULL, O_SWEEP },
	{ "room-bytes", required_argument, NULL, O_ROOMBYTES },
	{ "rooms", required_argument, NULL, O_ROOMS },
	{ "senders", required_argument, NULL, O_SENDERS },
	{ "receivers", required_argument, NULL, O_RECEIVERS },
	{ "payload", required_argument, NULL, O_PAYLOAD },
	{ "duration", required_argument, NULL, 'd' },
	{ "bytes", required_argument, NULL, 'b' },
	{ "warmup", required_argument, NULL, O_WARMUP },
	{ "baseline-sec", required_argument, NULL, O_BASESEC },
	{ "wset", required_argument, NULL, O_WSET },
	{ "samples", required_argument, NULL, O_SAMPLES },
	{ "idle-gap", required_argument, NULL, O_GAP },
	{ "json", no_argument, NULL, O_JSON },
	{ "csv", no_argument, NULL, O_CSV },
	{ "plot", required_argument, NULL, O_PLOT },
	{ "progress", no_argument, NULL, O_PROGRESS },
	{ "no-pin", no_argument, NULL, O_NOPIN },
	{ "tcp-streams", required_argument, NULL, O_STREAMS },
	{ "netns", no_argument, NULL, O_NETNS },
	{ "rdma-device", required_argument, NULL, O_RDMA },
	{ "rdma-gid-index", required_argument, NULL, O_GIDX },
	{ "quiet", no_argument, NULL, 'q' },
	{ "help", no_argument, NULL, 'h' },
	{ "version", no_argument, NULL, 'V' },
	{ 0 },
};
static const char short_opts[] = "s:c:d:b:qhV";

const char *bench_size_str(uint64_t v, char *buf, size_t len)
{
	static const char suf[] = "KMGT";
	int k = -1;
	while (v && v % 1024 == 0 && k < 3) {
		v /= 1024;
		k++;
	}
	if (k < 0)
		snprintf(buf, len, "%llu", (unsigned long long)v);
	else
		snprintf(buf, len, "%llu%c", (unsigned long long)v, suf[k]);
	return buf;
}

const char *bench_payload_str(enum bench_payload p)
{
	return p == PAYLOAD_NONE ? "none" : p == PAYLOAD_COPY ? "copy" : p == PAYLOAD_IN ? "in" : "verify";
}

unsigned bench_room_chunks(const struct bench_opts *o, uint64_t chunk)
{
	uint64_t b = bench_room_bytes(o, chunk);
	return (unsigned)((b + chunk - 1) / chunk);
}

uint64_t bench_room_bytes(const struct bench_opts *o, uint64_t chunk)
{
	return o->room_bytes ? o->room_bytes : 16 * chunk;
}

static int bad(const char *opt, const char *val, const char *why)
{
	fprintf(stderr, "kvstage-bench: invalid %s '%s': %s\n", opt, val, why);
	fprintf(stderr, "Try 'kvstage-bench --help'.\n");
	return 2;
}

int bench_parse_uint(const char *s, unsigned lo, unsigned hi, unsigned *out)
{
	uint64_t v;
	if (kvs_parse_uint(s, hi, &v) || v < lo) /* digits only: no sign, space or suffix */
		return -1;
	*out = (unsigned)v;
	return 0;
}

/* Seconds as a plain decimal ("2", "0.5", ".5", "1e-3"): strtod alone would
 * also take leading spaces, a sign, hex ("0x1p3"), "inf" and "nan". */
static int parse_sec(const char *s, double lo, double hi, double *out)
{
	if (!((*s >= '0' && *s <= '9') || *s == '.') || s[strspn(s, "0123456789.eE+-")])
		return -1;
	char *end;
	errno = 0;
	double v = strtod(s, &end);
	if (errno || end == s || *end || !isfinite(v) || v < lo || v > hi)
		return -1;
	*out = v;
	return 0;
}

static int parse_chunks(const char *arg, struct bench_opts *o)
{
	char buf[512];
	if (strlen(arg) >= sizeof(buf))
		return bad("--chunk", arg, "too long");
	strcpy(buf, arg);
	char *save = NULL;
	for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
		uint64_t v;
		if (kvs_parse_size(t, &v) || v < MIN_CHUNK || v > MAX_CHUNK || v % MIN_CHUNK)
			return bad("--chunk", t, "want a multiple of 4K from 4K to 1G");
		if (o->nchunks == BENCH_MAX_CHUNKS)
			return bad("--chunk", arg, "at most 32 sizes");
		o->chunks[o->nchunks++] = v;
	}
	if (!o->nchunks)
		return bad("--chunk", arg, "no size given");
	return 0;
}

static const char *const mode_names[] = {
	[MODE_LOCAL] = "local", [MODE_LATENCY] = "latency", [MODE_IDLE] = "idle",
	[MODE_BASELINE] = "baseline", [MODE_GPU] = "gpu", [MODE_TCP] = "tcp", [MODE_VERBS] = "verbs",
};

bool bench_mode_is_gpu(int argc, char **argv)
{
	/* The first word that is neither an option nor an option's value. */
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (!strcmp(a, "--"))
			return i + 1 < argc && !strcmp(argv[i + 1], "gpu");
		if (a[0] != '-' || !a[1])
			return !strcmp(a, "gpu");
		if (a[1] == '-') {
			if (strchr(a, '='))
				continue;
			for (const struct option *p = long_opts; p->name; p++)
				if (!strcmp(a + 2, p->name) && p->has_arg == required_argument)
					i++;
			continue;
		}
		/* -xVAL or -x VAL: only the last letter of a cluster can take one */
		const char *s = strchr(short_opts, a[strlen(a) - 1]);
		if (strlen(a) == 2 && s && s[1] == ':')
			i++;
	}
	return false;
}

int bench_opts_parse(int argc, char **argv, struct bench_opts *o)
{
	memset(o, 0, sizeof(*o));
	o->rooms = 4;
	o->senders = 1;
	o->duration = 2;
	o->warmup = -1;
	o->baseline_sec = -1;
	o->wset = BENCH_WSET_DEFAULT;
	o->samples = 200;
	o->idle_gap_ms = 2;
	o->tcp_streams = 2;
	o->rdma_gid_index = -1;
	o->argc = argc;
	o->argv = argv;
	int payload = -1, opt;
	bool sweep = false, dur_set = false, json = false, csv = false, streams_set = false;
	uint64_t v;
	unsigned u;

	optind = 1;
	while ((opt = getopt_long(argc, argv, short_opts, long_opts, NULL)) != -1) {
		switch (opt) {
		case 's':
			if (!*optarg)
				return bad("--socket", optarg, "empty path");
			o->socket = optarg;
			break;
		case O_KVSTAGED:
			o->kvstaged = optarg;
			break;
		case O_PROXYARG:
			if (o->nproxy_args == sizeof(o->proxy_args) / sizeof(o->proxy_args[0]))
				return bad("--proxy-arg", optarg, "at most 16");
			o->proxy_args[o->nproxy_args++] = optarg;
			break;
		case 'c':
			if (parse_chunks(optarg, o))
				return 2;
			o->chunk_set = true;
			break;
		case O_SWEEP:
			sweep = true;
			break;
		case O_ROOMBYTES:
			if (kvs_parse_size(optarg, &v) || !v || v > (1ull << 40))
				return bad("--room-bytes", optarg, "want 1 byte to 1T");
			o->room_bytes = v;
			break;
		case O_ROOMS:
			if (bench_parse_uint(optarg, 1, 256, &u))
				return bad("--rooms", optarg, "want 1 to 256");
			o->rooms = u;
			break;
		case O_SENDERS:
		case O_RECEIVERS:
			if (bench_parse_uint(optarg, 1, BENCH_MAX_PAIRS, &u))
				return bad(opt == O_SENDERS ? "--senders" : "--receivers", optarg,
					   "want 1 to 64");
			if (opt == O_SENDERS)
				o->senders = u;
			else
				o->receivers = u;
			break;
		case O_PAYLOAD:
			if (!strcmp(optarg, "none"))
				payload = PAYLOAD_NONE;
			else if (!strcmp(optarg, "copy"))
				payload = PAYLOAD_COPY;
			else if (!strcmp(optarg, "verify"))
				payload = PAYLOAD_VERIFY;
			else if (!strcmp(optarg, "in"))
				payload = PAYLOAD_IN;
			else
				return bad("--payload", optarg, "want none, copy, in or verify");
			break;
		case 'd':
			if (parse_sec(optarg, 0.01, 86400, &o->duration))
				return bad("--duration", optarg, "want seconds, 0.01 to 86400");
			dur_set = true;
			break;
		case 'b':
			if (kvs_parse_size(optarg, &v) || !v)
				return bad("--bytes", optarg, "want a byte count > 0 (K/M/G suffixes)");
			o->bytes = v;
			break;
		case O_WARMUP:
			if (parse_sec(optarg, 0, 3600, &o->warmup))
				return bad("--warmup", optarg, "want seconds, 0 to 3600");
			break;
		case O_BASESEC:
			if (parse_sec(optarg, 0.001, 60, &o->baseline_sec))
				return bad("--baseline-sec", optarg, "want seconds, 0.001 to 60");
			break;
		case O_WSET:
			/* small sets are allowed on purpose: to match a peer that
			 * reuses one buffer (ucx-compare.sh); rings hold 2 chunks at least */
			if (kvs_parse_size(optarg, &v) || v < 4096 || v > (64ull << 30))
				return bad("--wset", optarg, "want 4K to 64G");
			o->wset = v;
			break;
		case O_SAMPLES:
			if (bench_parse_uint(optarg, 1, 10000000, &u))
				return bad("--samples", optarg, "want 1 to 10000000");
			o->samples = u;
			break;
		case O_GAP:
			if (parse_sec(optarg, 0, 60000, &o->idle_gap_ms))
				return bad("--idle-gap", optarg, "want milliseconds, 0 to 60000");
			break;
		case O_JSON:
			json = true;
			break;
		case O_CSV:
			csv = true;
			break;
		case O_PLOT: {
			size_t n = strlen(optarg);
			if (n < 5 || (strcmp(optarg + n - 4, ".png") && strcmp(optarg + n - 4, ".svg")))
				return bad("--plot", optarg, "the file name must end in .png or .svg");
			o->plot = optarg;
			break;
		}
		case O_PROGRESS:
			o->progress = true;
			break;
		case O_NOPIN:
			o->no_pin = true;
			break;
		case O_STREAMS:
			if (bench_parse_uint(optarg, 1, 16, &u))
				return bad("--tcp-streams", optarg, "want 1 to 16");
			o->tcp_streams = u;
			streams_set = true;
			break;
		case O_NETNS:
			o->netns = true;
			break;
		case O_RDMA:
			if (!*optarg)
				return bad("--rdma-device", optarg, "want a device name (ibv_devices)");
			o->rdma_device = optarg;
			break;
		case O_GIDX:
			if (bench_parse_uint(optarg, 0, 255, &u))
				return bad("--rdma-gid-index", optarg, "want 0 to 255");
			o->rdma_gid_index = (int)u;
			break;
		case 'q':
			o->quiet = true;
			break;
		case 'h':
			usage(stdout);
			return 1;
		case 'V':
			printf("kvstage-bench %s\n", KVS_VERSION_STRING);
			return 1;
		default:
			fprintf(stderr, "Try 'kvstage-bench --help'.\n");
			return 2;
		}
	}
	if (optind >= argc) {
		fprintf(stderr, "kvstage-bench: no mode given (local, tcp, verbs, latency, idle, "
				"baseline or gpu)\nTry 'kvstage-bench --help'.\n");
		return 2;
	}
	if (optind + 1 < argc) {
		fprintf(stderr, "kvstage-bench: unexpected argument '%s'\nTry 'kvstage-bench --help'.\n",
			argv[optind + 1]);
		return 2;
	}
	const char *m = argv[optind];
	unsigned k;
	for (k = 0; k < sizeof(mode_names) / sizeof(mode_names[0]); k++)
		if (!strcmp(m, mode_names[k]))
			break;
	if (k == sizeof(mode_names) / sizeof(mode_names[0]))
		return bad("mode", m, "want local, tcp, verbs, latency, idle, baseline or gpu");
	o->mode = (enum bench_mode)k;
	bool two = o->mode == MODE_TCP || o->mode == MODE_VERBS;
	if (o->mode != MODE_VERBS && (o->rdma_device || o->rdma_gid_index >= 0)) {
		fprintf(stderr, "kvstage-bench: --rdma-device and --rdma-gid-index are for the verbs "
				"mode\n");
		return 2;
	}
	if (o->mode == MODE_VERBS && !o->rdma_device) {
		fprintf(stderr, "kvstage-bench: the verbs mode needs --rdma-device NAME (ibv_devices "
				"lists them)\n");
		return 2;
	}
	if (o->mode == MODE_VERBS && o->netns) {
		fprintf(stderr, "kvstage-bench: --netns is for the tcp mode (an RDMA device made in "
				"another namespace may not reach this one)\n");
		return 2;
	}
	if (!two && (o->netns || streams_set)) {
		fprintf(stderr, "kvstage-bench: --%s is for the tcp mode\n",
			o->netns ? "netns" : "tcp-streams");
		return 2;
	}
	if (two && o->socket) {
		fprintf(stderr, "kvstage-bench: the tcp mode starts both of its proxies; --socket "
				"is for local, latency and idle\n");
		return 2;
	}

	if (json && csv) {
		fprintf(stderr, "kvstage-bench: --json and --csv both write stdout: pick one\n");
		return 2;
	}
	o->fmt = json ? FMT_JSON : csv ? FMT_CSV : FMT_TABLE;
	if (sweep && o->chunk_set) {
		fprintf(stderr, "kvstage-bench: --sweep and --chunk both choose chunk sizes: pick one\n");
		return 2;
	}
	if (sweep) {
		for (uint64_t c = 4096; c <= (16ull << 20); c *= 4)
			o->chunks[o->nchunks++] = c;
		o->chunk_set = true;
	}
	if (o->bytes && dur_set) {
		fprintf(stderr, "kvstage-bench: --duration and --bytes both end a point: pick one\n");
		return 2;
	}
	if (!o->receivers)
		o->receivers = o->senders;
	if (o->receivers != o->senders) {
		fprintf(stderr, "kvstage-bench: --receivers %u differs from --senders %u: each "
				"receiver is paired with one sender\n",
			o->receivers, o->senders);
		return 2;
	}
	o->payload = payload >= 0 ? (enum bench_payload)payload
				  : o->mode == MODE_LATENCY || two ? PAYLOAD_NONE
										   : PAYLOAD_COPY;
	if (o->mode == MODE_LATENCY && o->payload == PAYLOAD_IN)
		return bad("--payload", "in", "latency mode takes none, copy or verify");
	if (o->warmup < 0)
		o->warmup = o->bytes ? 0 : fmin(0.5, o->duration / 10);
	if (o->baseline_sec < 0) /* tcp: raw TCP on a VM moves a lot from run to run */
		o->baseline_sec = two ? fmax(0.1, fmin(1, o->duration / 2))
						      : fmax(0.05, fmin(0.5, o->duration / 4));
	if (o->mode == MODE_LATENCY || o->mode == MODE_IDLE) {
		if (o->nchunks > 1) {
			fprintf(stderr, "kvstage-bench: the %s mode takes one chunk size\n", m);
			return 2;
		}
		if (o->bytes) {
			fprintf(stderr, "kvstage-bench: the %s mode runs for --duration, not --bytes\n",
				m);
			return 2;
		}
	}
	if (o->plot && o->mode != MODE_LOCAL && o->mode != MODE_BASELINE) {
		fprintf(stderr, "kvstage-bench: --plot draws GB/s against chunk size: local or "
				"baseline mode only\n");
		return 2;
	}
	if (o->socket && o->nchunks > 1) {
		fprintf(stderr, "kvstage-bench: with --socket the chunk size is the proxy's slot "
				"size: one chunk size only (or omit --chunk)\n");
		return 2;
	}
	if (o->socket && o->nproxy_args) {
		fprintf(stderr, "kvstage-bench: --proxy-arg is for a proxy we start; --socket "
				"uses a running one\n");
		return 2;
	}
	if (o->socket && o->kvstaged) {
		fprintf(stderr, "kvstage-bench: --socket uses a running proxy; --kvstaged names "
				"one to start: pick one\n");
		return 2;
	}
	if (!o->nchunks) {
		/* kvstaged's own default slot size; the smallest pool for latency */
		o->chunks[o->nchunks++] = o->mode == MODE_LATENCY ? 4096 : (1ull << 20);
	}
	for (unsigned i = 0; i < o->nchunks; i++) {
		uint64_t rb = bench_room_bytes(o, o->chunks[i]);
		if (rb / o->chunks[i] > 65536) {
			fprintf(stderr, "kvstage-bench: --room-bytes gives more than 65536 chunks a "
					"room at chunk size %llu\n",
				(unsigned long long)o->chunks[i]);
			return 2;
		}
	}
	return 0;
}
