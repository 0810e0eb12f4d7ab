/* SPDX-License-Identifier: MIT */
/*
 * The command line of every mode: one table of options, each with the modes
 * it applies to; --help is printed from it (for one mode with MODE --help).
 */
#include <errno.h>
#include <getopt.h>
#include <stddef.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "kvstage.h"

#define MIN_CHUNK (4ull << 10)
#define MAX_CHUNK (1ull << 30)

#define M(m) (1u << MODE_##m)
#define FLOW (M(LOCAL) | M(TCP) | M(VERBS))
#define PROXIED (FLOW | M(LATENCY) | M(IDLE))
#define CPU (PROXIED | M(BASELINE))
#define ROOMS (FLOW | M(ABORT)) /* modes that move rooms of several chunks */
#define ALL (CPU | M(GPU) | M(ABORT))

static const char *const mode_names[] = {
	[MODE_LOCAL] = "local",	      [MODE_LATENCY] = "latency", [MODE_IDLE] = "idle",
	[MODE_BASELINE] = "baseline", [MODE_GPU] = "gpu",	  [MODE_TCP] = "tcp",
	[MODE_VERBS] = "verbs",	      [MODE_ABORT] = "abort",
};
#define NMODES (sizeof(mode_names) / sizeof(mode_names[0]))

static const char *const mode_help[] = {
	[MODE_LOCAL] = "sender and receiver processes move rooms through one proxy:\n"
		       "GB/s, chunks/s, rooms/s, chunk and room latency, proxy and\n"
		       "clients CPU, CPU seconds per GB;\n"
		       "baselines: single-thread memcpy at the chunk size (the bound),\n"
		       "a raw SPSC rte_ring between two processes, and for payload copy\n"
		       "the same two copies by two processes through shared memory with\n"
		       "raw rte_rings instead of kvstage",
	[MODE_LATENCY] = "one chunk in flight: one process holds the sender and the\n"
			 "receiver connection and busy-polls (kvs_poll); send-to-RECV_DONE\n"
			 "latency against a raw rte_ring round trip",
	[MODE_IDLE] = "a proxy with no work: its CPU use over --duration, a client\n"
		      "blocked in kvs_wait meanwhile, and the wake-up latency (first\n"
		      "request after an idle gap, to its reply)",
	[MODE_BASELINE] = "the baselines alone: memcpy and one TCP loopback connection at\n"
			  "each chunk size, the rte_ring round trip",
	[MODE_TCP] = "two proxies joined by the tcp transport: receivers on proxy B\n"
		     "(which listens), senders on proxy A (which dials B), on\n"
		     "loopback or with --netns in two network namespaces; GB/s,\n"
		     "chunks/s, room latency, the CPU of both proxies and the clients\n"
		     "and CPU seconds per GB, against raw TCP between the same two\n"
		     "endpoints (one stream, and --tcp-streams streams; read at\n"
		     "kvstaged's SO_RCVLOWAT mark) and, where ucx-utils is\n"
		     "installed, UCX tag_bw over UCX_TLS=tcp, measured\n"
		     "in the same run; and each proxy's syscalls per chunk it moved\n"
		     "(sendmsg/send, recv/recvmsg, epoll_wait/epoll_ctl/SO_RCVLOWAT\n"
		     "on its peer connections, EAGAIN ones included: its counters over\n"
		     "the window)",
	[MODE_VERBS] = "the tcp mode with --rdma-device on both proxies: chunks pulled\n"
		       "by RDMA READ; baseline: perftest's ib_read_bw between two\n"
		       "processes on the same device, in the same run",
	[MODE_ABORT] = "rooms at full rate with --abort-rate of them aborted from\n"
		       "--abort-side at a random phase (before the descriptor reaches\n"
		       "the sender, leased, mid-room, every chunk sent, after\n"
		       "RECV_DONE), through one proxy, then two over tcp (and verbs\n"
		       "with --rdma-device); every byte of every room checked, every\n"
		       "aborted room's pages checked at the end; abort-to-final and\n"
		       "abort-to-reusable latency, goodput against abort rate 0 of\n"
		       "the same run, stale operations refused, tombstones reaped;\n"
		       "baseline: the same staged aborts through the test-only\n"
		       "kvstaged-vulnerable (it frees at abort) beside kvstaged",
	[MODE_GPU] = "GPU memory into and out of slots (libkvstage_cuda, needs a CUDA\n"
		     "build): device->slot and slot->device GB/s, gather and scatter of\n"
		     "paged GPU memory, each against cudaMemcpy between the device and a\n"
		     "cudaMallocHost buffer of as many bytes (the PCIe limit), measured\n"
		     "beside it",
};

enum opt_id {
	O_SOCKET,
	O_KVSTAGED,
	O_PROXYARG,
	O_STREAMS,
	O_NETNS,
	O_RDMA,
	O_GIDX,
	O_CHUNK,
	O_SWEEP,
	O_ROOMBYTES,
	O_ROOMS,
	O_SENDERS,
	O_RECEIVERS,
	O_PAYLOAD,
	O_DURATION,
	O_BYTES,
	O_WARMUP,
	O_BASESEC,
	O_WSET,
	O_SAMPLES,
	O_GAP,
	O_NOPIN,
	O_SIZE,
	O_PSIZE,
	O_PAGES,
	O_POOL,
	O_GMODES,
	O_ITERS,
	O_REPS,
	O_DEVICE,
	O_ARATE,
	O_ASIDE,
	O_VULN,
	O_STRICT,
	O_JSON,
	O_CSV,
	O_PLOT,
	O_PROGRESS,
	O_QUIET,
	O_HELP,
	O_VERSION,
	O_COUNT
};

enum kind { K_FLAG, K_STR, K_UINT, K_INT, K_SEC, K_SIZE, K_OWN };

struct opt_def {
	const char *name, *arg; /* arg NULL: a flag */
	char letter;		/* short form, or 0 */
	unsigned modes;
	enum kind kind; /* how its value is read into the member at off */
	size_t off;
	double lo, hi;	     /* K_UINT, K_INT, K_SEC, K_SIZE: the range allowed */
	const char *why;     /* what is wanted, if not "want LO to HI" */
	const char *section; /* a heading printed before it in --help, or NULL */
	const char *help;    /* lines after the first are indented under it */
};

#define OFF(member) offsetof(struct bench_opts, member)
#define SIZE(member, lo, hi, why) K_SIZE, OFF(member), lo, hi, why
#define UINT(member, lo, hi) K_UINT, OFF(member), lo, hi, NULL
#define SEC(member, lo, hi) K_SEC, OFF(member), lo, hi, NULL
#define FLAG(member) K_FLAG, OFF(member), 0, 0, NULL
#define STR(member) K_STR, OFF(member), 0, 0, NULL
#define OWN K_OWN, 0, 0, 0, NULL

static const struct opt_def defs[O_COUNT] = {
	[O_SOCKET] = { "socket", "PATH", 's', M(LOCAL) | M(LATENCY) | M(IDLE) | M(GPU), OWN,
		       "Proxy:",
		       "use the kvstaged serving PATH (its slot size is the\nchunk size; gpu: at "
		       "least "
		       "one copy's bytes);\ndefault: start one" },
	[O_KVSTAGED] = { "kvstaged", "PATH", 0, PROXIED | M(GPU) | M(ABORT), STR(kvstaged), NULL,
			 "the kvstaged to start (default: $KVSTAGED, else\n../../proxy/kvstaged "
			 "next to "
			 "this binary, else PATH)" },
	[O_PROXYARG] = { "proxy-arg", "ARG", 0, PROXIED | M(GPU) | M(ABORT), OWN, NULL,
			 "pass ARG to the kvstaged we start (repeatable), "
			 "e.g.\n--proxy-arg=--spin-us=1000; "
			 "it is started with\n--socket, --slots, --slot-size and --ready-fd; an "
			 "ARG\n--slots=N gives each pool N slots (reported as it has them)" },
	[O_STREAMS] = { "tcp-streams", "N", 0, M(TCP) | M(VERBS) | M(ABORT),
			UINT(tcp_streams, 1, 16), "tcp, verbs, abort:",
			"connections per peer, for the proxies and the raw\nbaseline (default 2, "
			"at most 16)" },
	[O_NETNS] = { "netns", NULL, 0, M(TCP), FLAG(netns), NULL,
		      "put each proxy in a network namespace of its own,\njoined by a veth pair "
		      "(10.78.0.1 - 10.78.0.2) made\nfor this run and removed after it; needs root "
		      "and\n"
		      "iproute2 (default: both on 127.0.0.1)" },
	[O_RDMA] = { "rdma-device", "NAME", 0, M(VERBS) | M(ABORT), OWN, NULL,
		     "the RDMA device (ibv_devices lists them); abort:\nalso run the verbs path on "
		     "it "
		     "(default: skipped)" },
	[O_GIDX] = { "rdma-gid-index", "N", 0, M(VERBS) | M(ABORT), K_INT, OFF(rdma_gid_index), 0,
		     255, NULL, NULL,
		     "its GID for the proxies and ib_read_bw\n(default: their own choice)" },
	[O_CHUNK] = { "chunk", "SIZE[,SIZE...]", 'c', CPU | M(ABORT), OWN, "Work:",
		      "chunk (slot) sizes, multiples of 4K, K/M/G\nsuffixes (default: 1M; latency: "
		      "4K; "
		      "abort: one\nsize, 64K)" },
	[O_SWEEP] = { "sweep", NULL, 0, FLOW | M(BASELINE), OWN, NULL,
		      "chunk sizes 4K 16K 64K 256K 1M 4M 16M" },
	[O_ROOMBYTES] = { "room-bytes", "BYTES", 0, ROOMS,
			  SIZE(room_bytes, 1, 1ull << 40, "want 1 byte to 1T"), NULL,
			  "bytes per room (default: 16 chunks)" },
	[O_ROOMS] = { "rooms", "N", 0, ROOMS, UINT(rooms, 1, 256), NULL,
		      "rooms in flight per sender (default 4, at most 256)" },
	[O_SENDERS] = { "senders", "N", 0, ROOMS, UINT(senders, 1, BENCH_MAX_PAIRS), NULL,
			"sender processes (default 1, at most 64)" },
	[O_RECEIVERS] = { "receivers", "N", 0, FLOW, UINT(receivers, 1, BENCH_MAX_PAIRS), NULL,
			  "receiver processes; each is paired with one sender,\nso it must equal "
			  "--senders "
			  "(default: --senders)" },
	[O_PAYLOAD] = { "payload", "MODE", 0, FLOW | M(LATENCY), OWN, NULL,
			"none: slots are handed over untouched; copy: the\nsender copies into each "
			"slot "
			"from a private buffer,\nthe receiver copies out into another; in: "
			"the\nsender "
			"copies in, the receiver takes the slot and\nreads it in place (one copy, "
			"like a "
			"buffer-to-buffer\ntransport); verify: the sender stamps a canary, "
			"the\nreceiver "
			"checks every byte (default: copy;\nlatency and tcp: none)" },
	[O_DURATION] = { "duration", "SEC", 'd', CPU | M(ABORT), SEC(duration, 0.01, 86400), NULL,
			 "measured seconds per point; idle: the quiet window\n(default 2)" },
	[O_BYTES] = { "bytes", "TOTAL", 'b', FLOW,
		      SIZE(bytes, 1, 1e19, "want a byte count > 0 (K/M/G suffixes)"), NULL,
		      "measure until TOTAL bytes moved instead (K/M/G)" },
	[O_WARMUP] = { "warmup", "SEC", 0, FLOW | M(LATENCY) | M(ABORT), SEC(warmup, 0, 3600), NULL,
		       "unmeasured time first (default: a tenth of --duration,\nat most 0.5; 0 "
		       "with "
		       "--bytes); local mode also waits\nuntil each receiver has completed --rooms "
		       "rooms" },
	[O_BASESEC] = { "baseline-sec", "SEC", 0, FLOW | M(LATENCY) | M(BASELINE),
			SEC(baseline_sec, 0.001, 60), NULL,
			"seconds per baseline figure (default: a quarter of\n--duration, 0.05 to "
			"0.5; tcp: "
			"half, 0.1 to 1)" },
	/* small sets are allowed on purpose: to match a peer that reuses one
	 * buffer (ucx-compare.sh); rings hold 2 chunks at least */
	[O_WSET] = { "wset", "BYTES", 0, FLOW | M(LATENCY) | M(BASELINE),
		     SIZE(wset, 4096, 64ull << 30, "want 4K to 64G"), NULL,
		     "working set of each memcpy buffer ring and of each\nclient's private buffer "
		     "(default 256M; keep it above\nthe last-level cache)" },
	[O_SAMPLES] = { "samples", "N", 0, M(IDLE), UINT(samples, 1, 10000000), NULL,
			"wake-up samples (default 200)" },
	[O_GAP] = { "idle-gap", "MS", 0, M(IDLE), K_SEC, OFF(idle_gap_ms), 0, 60000,
		    "want milliseconds, 0 to 60000", NULL,
		    "quiet milliseconds before each sample (default 2)" },
	[O_NOPIN] = { "no-pin", NULL, 0, CPU | M(ABORT), FLAG(no_pin), NULL,
		      "leave CPU placement to the scheduler; by default, with\ntwo or more CPUs, a "
		      "proxy "
		      "we start runs on the last CPU\nwe may use and every client process on the "
		      "others;\n"
		      "the rte_ring baseline's two spinners take two CPUs" },
	[O_SIZE] = { "size", "BYTES", 0, M(GPU), SIZE(gpu_size, 4096, 1 << 30, NULL),
		     "gpu:", "bytes per slot copy and per gather, a multiple of 4K\n(default 4M)" },
	[O_PSIZE] = { "page-size", "LIST", 0, M(GPU), OWN, NULL,
		      "gather/scatter page sizes, multiples of 16\n(default 4K,8K,16K,32K,64K)" },
	[O_PAGES] = { "pages", "N", 0, M(GPU), UINT(pages, 1, 1 << 20), NULL,
		      "pages per gather (default: --size / page size)" },
	[O_POOL] = { "pool", "BYTES", 0, M(GPU), SIZE(pool, 1 << 20, 1e19, "want at least 1M"),
		     NULL, "device page pool the page tables draw from\n(default 256M)" },
	[O_GMODES] = { "modes", "LIST", 0, M(GPU), OWN, NULL,
		       "gather modes to measure: auto, copy, kernel\n(default all three)" },
	[O_ITERS] = { "iters", "N", 0, M(GPU), UINT(iters, 1, 100000), NULL,
		      "copies per timed run (default 20)" },
	[O_REPS] = { "reps", "N", 0, M(GPU), UINT(reps, 1, 1000), NULL,
		     "timed runs per figure, each beside a baseline run;\nthe medians are printed "
		     "(default 5)" },
	[O_DEVICE] = { "device", "N", 0, M(GPU), K_INT, OFF(device), 0, 1024, NULL, NULL,
		       "CUDA device (default 0)" },
	[O_ARATE] = { "abort-rate", "LIST", 0, M(ABORT), OWN, "abort:",
		      "fractions of rooms aborted, 0 to 1, one point each\n(default "
		      "0,0.01,0.1,0.5); 0 is "
		      "measured first\nwhether listed or not" },
	[O_ASIDE] = { "abort-side", "SIDE", 0, M(ABORT), OWN, NULL,
		      "who aborts: send, recv, or both (each abort picks\none at random; default "
		      "both)" },
	[O_VULN] = { "vulnerable", "PATH", 0, M(ABORT), STR(vulnerable), NULL,
		     "the test-only kvstaged-vulnerable for the baseline\n(default: tests/kvstaged-"
		     "vulnerable in the build tree\nnext to this binary; none there: skipped, "
		     "said)" },
	[O_STRICT] = { "strict", NULL, 0, M(ABORT), FLAG(strict), NULL,
		       "exit 1 when the red control caught nothing (the\nvulnerable build's run "
		       "corrupted no byte): its\nrow then shows nothing, said either way" },
	[O_JSON] = { "json", NULL, 0, ALL, OWN,
		     "Output (the table goes to stdout, progress and notes "
		     "to stderr):",
		     "one JSON object instead of the table" },
	[O_CSV] = { "csv", NULL, 0, ALL, OWN, NULL,
		    "a header and one row per point instead of the table" },
	[O_PLOT] = { "plot", "FILE", 0, M(LOCAL) | M(BASELINE) | M(ABORT), OWN, NULL,
		     "also draw GB/s against chunk size with the baselines\nas lines (abort: "
		     "abort-to-final latency against\nabort rate); FILE ends in .png or .svg; "
		     "needs "
		     "gnuplot" },
	[O_PROGRESS] = { "progress", NULL, 0, CPU | M(ABORT), FLAG(progress), NULL,
			 "draw the live progress line even if stderr is not a\nterminal" },
	[O_QUIET] = { "quiet", NULL, 'q', ALL, FLAG(quiet), NULL, "no progress line and no notes" },
	[O_HELP] = { "help", NULL, 'h', ALL, OWN, NULL,
		     "show this help (MODE --help: that mode's)" },
	[O_VERSION] = { "version", NULL, 'V', ALL, OWN, NULL, "show the version" },
};

const char *bench_mode_name(enum bench_mode m)
{
	return mode_names[m];
}

/* Lines after the first of s, each indented by ind columns. */
static void indented(const char *s, int ind)
{
	for (const char *nl; (nl = strchr(s, '\n')); s = nl + 1)
		printf("%.*s\n%*s", (int)(nl - s), s, ind, "");
	printf("%s\n", s);
}

/* The help of one mode (m >= 0: its options only) or of all. */
static void usage(int m)
{
	if (m >= 0)
		printf("Usage: kvstage-bench [OPTION]... %s\n%s: ", mode_names[m], mode_names[m]);
	else
		printf("Usage: kvstage-bench [OPTION]... MODE\n"
		       "Measures kvstaged and prints each figure next to a baseline measured in "
		       "the\n"
		       "same run. Without --socket it starts its own kvstaged per chunk size (in "
		       "a\n"
		       "temporary directory, stopped with SIGTERM at the end).\n\nModes:\n");
	for (unsigned k = 0; k < NMODES; k++) {
		if (m >= 0 && (int)k != m)
			continue;
		if (m < 0)
			printf("  %-10s ", mode_names[k]);
		indented(mode_help[k], m >= 0 ? 0 : 13);
		if (k == MODE_GPU)
			printf("%*stargets (printed, not enforced): slot copies >= %.2f of "
			       "it\n%*sboth "
			       "ways, gather of 16K pages >= %.2f\n",
			       m >= 0 ? 0 : 13, "", GPU_TARGET_SLOT, m >= 0 ? 0 : 13, "",
			       GPU_TARGET_GATHER);
	}
	const char *section = NULL;
	for (unsigned i = 0; i < O_COUNT; i++) {
		const struct opt_def *d = &defs[i];
		section = d->section ? d->section : section;
		if (m >= 0 && !(d->modes & (1u << m)))
			continue;
		if (section)
			printf("\n%s\n", section);
		section = NULL;
		char name[40];
		snprintf(name, sizeof(name), "--%s%s%s", d->name, d->arg ? " " : "",
			 d->arg ? d->arg : "");
		printf("  %c%c%c %-*s%s", d->letter ? '-' : ' ', d->letter ? d->letter : ' ',
		       d->letter ? ',' : ' ', strlen(name) > 19 ? (int)strlen(name) + 1 : 19, name,
		       strlen(name) > 19 ? " " : "");
		indented(d->help, 25);
		if (m < 0 && d->modes != ALL) {
			printf("%25s[", "");
			for (unsigned k = 0, n = 0; k < NMODES; k++)
				if (d->modes & (1u << k))
					printf("%s%s", n++ ? ", " : "", mode_names[k]);
			printf("]\n");
		}
	}
	printf("\nExit status: 0 done, 1 a measurement failed (or wrong bytes with verify),\n"
	       "2 bad command line (gpu: or no CUDA device), 130 interrupted.\n");
}

const char *bench_size_str(uint64_t v, char *buf, size_t len)
{
	static const char suf[] = "KMGT";
	int k = -1;
	for (; v && v % 1024 == 0 && k < 3; k++)
		v /= 1024;
	if (k < 0)
		snprintf(buf, len, "%llu", (unsigned long long)v);
	else
		snprintf(buf, len, "%llu%c", (unsigned long long)v, suf[k]);
	return buf;
}

const char *bench_payload_str(enum bench_payload p)
{
	return p == PAYLOAD_NONE   ? "none"
	       : p == PAYLOAD_COPY ? "copy"
	       : p == PAYLOAD_IN   ? "in"
				   : "verify";
}

unsigned bench_room_chunks(const struct bench_opts *o, uint64_t chunk)
{
	return (unsigned)((bench_room_bytes(o, chunk) + chunk - 1) / chunk);
}

uint64_t bench_room_bytes(const struct bench_opts *o, uint64_t chunk)
{
	return o->room_bytes ? o->room_bytes : 16 * chunk;
}

static int bad(const char *opt, const char *val, const char *why)
{
	fprintf(stderr, "kvstage-bench: invalid %s '%s': %s\nTry 'kvstage-bench --help'.\n", opt,
		val, why);
	return 2;
}

static int g_mode = -1; /* the mode word, once known: --help for it is where to look */

/* A refusal: the message (printf-style), then where to look. */
static int refuse(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int refuse(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fputs("kvstage-bench: ", stderr);
	vfprintf(stderr, fmt, ap);
	fprintf(stderr, "\nTry 'kvstage-bench %s%s--help'.\n", g_mode < 0 ? "" : mode_names[g_mode],
		g_mode < 0 ? "" : " ");
	va_end(ap);
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

/* A comma-separated list of sizes, each a multiple of align in [lo, hi], into out[max]. */
static int parse_sizes(const char *opt, const char *arg, uint64_t align, uint64_t lo, uint64_t hi,
		       const char *why, uint64_t *out, unsigned *n, unsigned max)
{
	char buf[512];
	if (strlen(arg) >= sizeof(buf))
		return bad(opt, arg, "too long");
	strcpy(buf, arg);
	char *save = NULL;
	*n = 0;
	for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
		uint64_t v;
		if (kvs_parse_size(t, &v) || v < lo || v > hi || v % align)
			return bad(opt, t, why);
		if (*n == max)
			return bad(opt, arg, max == 16 ? "at most 16 sizes" : "at most 32 sizes");
		out[(*n)++] = v;
	}
	return *n ? 0 : bad(opt, arg, "no size given");
}

static int parse_gather_modes(const char *arg, bool *modes)
{
	static const char *const names[] = { "auto", "copy", "kernel" };
	char buf[64];
	snprintf(buf, sizeof(buf), "%s", arg);
	memset(modes, 0, 3 * sizeof(*modes));
	char *save = NULL;
	for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
		unsigned k = 0;
		while (k < 3 && strcmp(t, names[k]))
			k++;
		if (k == 3)
			return bad("--modes", t, "want auto, copy or kernel");
		modes[k] = true;
	}
	return 0;
}

/* --abort-rate: fractions in [0, 1], 0 put first (the no-abort point every ratio needs). */
static int parse_rates(const char *arg, struct bench_opts *o)
{
	char buf[256];
	if (strlen(arg) >= sizeof(buf))
		return bad("--abort-rate", arg, "too long");
	strcpy(buf, arg);
	o->abort_rates[0] = 0;
	o->nrates = 1;
	char *save = NULL;
	for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
		double v;
		if (parse_sec(t, 0, 1, &v))
			return bad("--abort-rate", t, "want a fraction, 0 to 1");
		if (v == 0)
			continue;
		if (o->nrates == sizeof(o->abort_rates) / sizeof(o->abort_rates[0]))
			return bad("--abort-rate", arg, "at most 15 rates besides 0");
		o->abort_rates[o->nrates++] = v;
	}
	return 0;
}

/* One option's value into o. Returns 0, or 2 after saying why. */
static int take(struct bench_opts *o, enum opt_id id, const char *arg, int *payload)
{
	const struct opt_def *d = &defs[id];
	char opt[32], why[64];
	void *dst = (char *)o + d->off;
	uint64_t v;
	unsigned u;
	double sec;
	snprintf(opt, sizeof(opt), "--%s", d->name);
	snprintf(why, sizeof(why),
		 d->kind == K_SEC ? "want seconds, %g to %g" : "want %.0f to %.0f", d->lo, d->hi);
	switch (d->kind) {
	case K_FLAG:
		*(bool *)dst = true;
		return 0;
	case K_STR:
		*(const char **)dst = arg;
		return 0;
	case K_UINT:
	case K_INT:
		if (bench_parse_uint(arg, (unsigned)d->lo, (unsigned)d->hi, &u))
			return bad(opt, arg, d->why ? d->why : why);
		if (d->kind == K_INT)
			*(int *)dst = (int)u;
		else
			*(unsigned *)dst = u;
		return 0;
	case K_SEC:
		if (parse_sec(arg, d->lo, d->hi, &sec))
			return bad(opt, arg, d->why ? d->why : why);
		*(double *)dst = sec;
		return 0;
	case K_SIZE:
		if (kvs_parse_size(arg, &v) || v < d->lo || (double)v > d->hi ||
		    (id == O_SIZE && v % 4096))
			return bad(opt, arg,
				   d->why ? d->why : "want a multiple of 4K from 4K to 1G");
		*(uint64_t *)dst = v;
		return 0;
	case K_OWN:
		break;
	}
	switch (id) {
	case O_SOCKET:
	case O_RDMA:
		if (!*arg)
			return bad(opt, arg,
				   id == O_SOCKET ? "empty path"
						  : "want a device name (ibv_devices)");
		*(id == O_SOCKET ? &o->socket : &o->rdma_device) = arg;
		return 0;
	case O_PROXYARG:
		if (o->nproxy_args == sizeof(o->proxy_args) / sizeof(o->proxy_args[0]))
			return bad(opt, arg, "at most 16");
		o->proxy_args[o->nproxy_args++] = arg;
		return 0;
	case O_CHUNK:
		return parse_sizes(opt, arg, MIN_CHUNK, MIN_CHUNK, MAX_CHUNK,
				   "want a multiple of 4K from 4K to 1G", o->chunks, &o->nchunks,
				   BENCH_MAX_CHUNKS);
	case O_PSIZE:
		return parse_sizes(opt, arg, 16, 16, 256u << 20, "want multiples of 16 up to 256M",
				   o->psizes, &o->npsizes, 16);
	case O_PAYLOAD:
		for (int k = PAYLOAD_NONE; k <= PAYLOAD_IN; k++)
			if (!strcmp(arg, bench_payload_str((enum bench_payload)k)))
				*payload = k;
		return *payload >= 0 ? 0 : bad(opt, arg, "want none, copy, in or verify");
	case O_PLOT: {
		size_t n = strlen(arg);
		if (n < 5 || (strcmp(arg + n - 4, ".png") && strcmp(arg + n - 4, ".svg")))
			return bad(opt, arg, "the file name must end in .png or .svg");
		o->plot = arg;
		return 0;
	}
	case O_GMODES:
		return parse_gather_modes(arg, o->gather_modes);
	case O_ARATE:
		return parse_rates(arg, o);
	case O_ASIDE:
		if (!strcmp(arg, "send") || !strcmp(arg, "recv") || !strcmp(arg, "both")) {
			o->abort_sides = arg[0] == 's' ? 1 : arg[0] == 'r' ? 2 : 3;
			return 0;
		}
		return bad(opt, arg, "want send, recv or both");
	case O_JSON:
		o->fmt = FMT_JSON;
		return 0;
	case O_CSV:
		o->fmt = FMT_CSV;
		return 0;
	default:
		return 0;
	}
}

/* Checks across options, once the mode is known. Returns 0, or 2 after saying why. */
static int check(struct bench_opts *o, const bool *seen, int payload)
{
	const char *m = mode_names[o->mode];
	bool two = o->mode == MODE_TCP || o->mode == MODE_VERBS || o->mode == MODE_ABORT;
	for (unsigned i = 0; i < O_COUNT; i++) {
		if (!seen[i] || (defs[i].modes & (1u << o->mode)))
			continue;
		char opt[32];
		snprintf(opt, sizeof(opt), "--%s", defs[i].name);
		/* the gpu mode and the others share a few options only */
		if (o->mode == MODE_GPU || defs[i].modes == M(GPU))
			return refuse("%s is not an option of the %s mode", opt, m);
		if (i == O_SOCKET && two)
			return refuse(
				"the %s mode starts both of its proxies; %s is for local, latency "
				"and idle",
				m, opt);
		if (i == O_NETNS && o->mode == MODE_VERBS)
			return refuse(
				"%s is for the tcp mode (an RDMA device made in another namespace "
				"may not reach this one)",
				opt);
		if (i == O_PLOT)
			return refuse("%s draws GB/s against chunk size (local, baseline) or abort "
				      "latency against abort rate (abort) only",
				      opt);
		if (i == O_PAYLOAD && o->mode == MODE_ABORT)
			return refuse("the abort mode stamps and checks every byte (a canary): it "
				      "takes no --payload");
		/* how a proxy would be run is harmless where none is: said, not refused */
		if (i != O_KVSTAGED && i != O_PROXYARG && i != O_PROGRESS && i != O_NOPIN)
			return refuse("%s is not an option of the %s mode", opt, m);
		note(o, "%s does nothing in the %s mode", opt, m);
	}
	if (o->mode == MODE_ABORT) {
		if (!o->nrates) {
			static const double dflt[] = { 0, 0.01, 0.1, 0.5 };
			memcpy(o->abort_rates, dflt, sizeof(dflt));
			o->nrates = 4;
		}
		if (!o->abort_sides)
			o->abort_sides = 3;
		if (o->nchunks > 1)
			return refuse("the abort mode takes one chunk size");
		if (!o->nchunks)
			o->chunks[o->nchunks++] = 64 << 10;
	}
	if (o->mode == MODE_VERBS && !o->rdma_device)
		return refuse("the verbs mode needs --rdma-device NAME (ibv_devices lists them)");
	if (seen[O_JSON] && seen[O_CSV])
		return refuse("--json and --csv both write stdout: pick one");
	if (seen[O_SWEEP] && seen[O_CHUNK])
		return refuse("--sweep and --chunk both choose chunk sizes: pick one");
	if (seen[O_SWEEP])
		for (uint64_t c = 4096; c <= (16ull << 20); c *= 4)
			o->chunks[o->nchunks++] = c;
	o->chunk_set = seen[O_CHUNK] || seen[O_SWEEP];
	if (o->bytes && seen[O_DURATION])
		return refuse("--duration and --bytes both end a point: pick one");
	if (!o->receivers)
		o->receivers = o->senders;
	if (o->receivers != o->senders) {
		fprintf(stderr,
			"kvstage-bench: --receivers %u differs from --senders %u: each "
			"receiver is paired with one sender\n",
			o->receivers, o->senders);
		return 2;
	}
	o->payload = o->mode == MODE_ABORT	      ? PAYLOAD_VERIFY
		     : payload >= 0		      ? (enum bench_payload)payload
		     : o->mode == MODE_LATENCY || two ? PAYLOAD_NONE
						      : PAYLOAD_COPY;
	if (o->mode == MODE_LATENCY && o->payload == PAYLOAD_IN)
		return bad("--payload", "in", "latency mode takes none, copy or verify");
	if (o->warmup < 0)
		o->warmup = o->bytes ? 0 : fmin(0.5, o->duration / 10);
	if (o->baseline_sec < 0) /* tcp: raw TCP on a VM moves a lot from run to run */
		o->baseline_sec = two ? fmax(0.1, fmin(1, o->duration / 2))
				      : fmax(0.05, fmin(0.5, o->duration / 4));
	if ((o->mode == MODE_LATENCY || o->mode == MODE_IDLE) && o->nchunks > 1)
		return refuse("the %s mode takes one chunk size", m);
	if (o->socket && o->nchunks > 1)
		return refuse(
			"with --socket the chunk size is the proxy's slot size: one chunk size "
			"only (or omit --chunk)");
	if (o->socket && o->nproxy_args)
		return refuse("--proxy-arg is for a proxy we start; --socket uses a running one");
	if (o->socket && o->kvstaged)
		return refuse("--socket uses a running proxy; --kvstaged names one to start: pick "
			      "one");
	if (!o->nchunks) /* kvstaged's own default slot size; the smallest pool for latency */
		o->chunks[o->nchunks++] = o->mode == MODE_LATENCY ? 4096 : (1ull << 20);
	for (unsigned i = 0; i < o->nchunks; i++)
		if (bench_room_bytes(o, o->chunks[i]) / o->chunks[i] > 65536) {
			fprintf(stderr,
				"kvstage-bench: --room-bytes gives more than 65536 chunks a "
				"room at chunk size %llu\n",
				(unsigned long long)o->chunks[i]);
			return 2;
		}
	return 0;
}

int bench_opts_parse(int argc, char **argv, struct bench_opts *o)
{
	static const uint64_t dflt_ps[] = { 4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10 };
	*o = (struct bench_opts){ .rooms = 4,
				  .senders = 1,
				  .duration = 2,
				  .warmup = -1,
				  .baseline_sec = -1,
				  .wset = BENCH_WSET_DEFAULT,
				  .samples = 200,
				  .idle_gap_ms = 2,
				  .tcp_streams = 2,
				  .rdma_gid_index = -1,
				  .argc = argc,
				  .argv = argv,
				  .gpu_size = 4 << 20,
				  .npsizes = 5,
				  .pool = 256 << 20,
				  .iters = 20,
				  .reps = 5,
				  .gather_modes = { true, true, true } };
	memcpy(o->psizes, dflt_ps, sizeof(dflt_ps));
	struct option lo[O_COUNT + 1];
	char so[2 * O_COUNT + 1] = "", *sp = so;
	for (unsigned i = 0; i < O_COUNT; i++) {
		lo[i] = (struct option){ defs[i].name,
					 defs[i].arg ? required_argument : no_argument, NULL,
					 256 + (int)i };
		if (defs[i].letter) {
			*sp++ = defs[i].letter;
			if (defs[i].arg)
				*sp++ = ':';
		}
	}
	lo[O_COUNT] = (struct option){ 0 };
	bool seen[O_COUNT] = { false };
	int payload = -1, c;
	optind = 1;
	while ((c = getopt_long(argc, argv, so, lo, NULL)) != -1) {
		unsigned id = (unsigned)c - 256;
		for (unsigned i = 0; c < 256 && i < O_COUNT; i++)
			if (defs[i].letter == c)
				id = i;
		if (id >= O_COUNT) {
			fprintf(stderr, "Try 'kvstage-bench --help'.\n");
			return 2;
		}
		seen[id] = true;
		if (id == O_VERSION) {
			printf("kvstage-bench %s\n", KVS_VERSION_STRING);
			return 1;
		}
		if (id != O_HELP && take(o, (enum opt_id)id, optarg, &payload))
			return 2;
	}
	int mode = -1;
	for (unsigned k = 0; optind < argc && k < NMODES; k++)
		if (!strcmp(argv[optind], mode_names[k]))
			mode = (int)k;
	if (seen[O_HELP]) {
		usage(mode);
		return 1;
	}
	if (optind >= argc)
		return refuse(
			"no mode given (local, tcp, verbs, abort, latency, idle, baseline or gpu)");
	if (optind + 1 < argc)
		return refuse("unexpected argument '%s'", argv[optind + 1]);
	if (mode < 0)
		return bad("mode", argv[optind],
			   "want local, tcp, verbs, abort, latency, idle, baseline or gpu");
	o->mode = (enum bench_mode)mode;
	g_mode = mode;
	return check(o, seen, payload);
}
