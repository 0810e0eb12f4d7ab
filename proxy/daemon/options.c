/* SPDX-License-Identifier: MIT */
/*
 * kvstaged's command line: one option table, made of the daemon's own and
 * those each data path of this build declares (peer/datapath.h), which
 * --help, --config files and the parser all read; what each value must be.
 */
#include "daemon/options.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <grp.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"
#include "daemon/config_file.h"
#include "daemon/metrics.h"
#include "datapath/datapath.h"
#include "kvs_build.h"
#include "kvstage.h"
#include "parse.h"
#include "peer/endpoint.h"

/* Each data path's options, shown as the daemon's are: the name and its
 * argument, then the help from column 28. */
static void datapath_usage(FILE *f, const struct kvsp_dp_ops *const *dps)
{
	for (; *dps; dps++)
		for (const struct kvsp_dp_opt *o = (*dps)->opts; o && o->name; o++) {
			char head[64];
			int n = snprintf(head, sizeof(head), "      --%s%s%s", o->name,
					 o->arg ? " " : "", o->arg ? o->arg : "");
			fprintf(f, "%s%*s", head, n < 27 ? 27 - n : 2, "");
			for (const char *l = o->help; *l;) {
				size_t len = strcspn(l, "\n");
				fprintf(f, "%s%.*s\n",
					l == o->help ? "" : "                           ", (int)len,
					l);
				l += len + (l[len] == '\n');
			}
		}
}

static void usage(FILE *f, const struct kvsp_dp_ops *const *dps)
{
	fprintf(f,
		"Usage: kvstaged [OPTION]...\n"
		"The kvstage staging proxy: owns a shared-memory pool of slots that engines\n"
		"lease, fill and hand to rooms; only its transports move slot bytes.\n"
		"Runs in the foreground until SIGTERM or SIGINT (a second one exits at once).\n"
		"\n"
		"  -c, --config FILE        read options from FILE first: one \"name = value\"\n"
		"                           per line for each long option below (a flag:\n"
		"                           true or false), '#' or ';' comments (a line, or\n"
		"                           after a value and a blank), an optional\n"
		"                           [kvstaged] section; the command line overrides it\n"
		"  -s, --socket PATH        Unix socket to serve (default: $KVSTAGE_SOCKET,\n"
		"                           else " KVS_DEFAULT_SOCKET ")\n"
		"  -n, --slots N            slots in the pool (default 256)\n"
		"  -z, --slot-size BYTES    bytes per slot, a multiple of 4K below 4G; K, M, G\n"
		"                           suffixes (default 1M)\n"
		"      --hugepages MODE     auto | on | off (default auto: 2 MiB hugepages when\n"
		"                           free, else normal pages with MADV_HUGEPAGE)\n"
		"      --no-lock            do not mlock the pool\n"
		"      --socket-mode MODE   the socket file's mode, octal (default 0660)\n"
		"      --socket-group GROUP the socket file's group, a name or a gid (default:\n"
		"                           ours); its members are admitted\n"
		"      --allow-uid UID      also admit clients with this uid (repeatable)\n"
		"      --allow-gid GID      also admit members of this group, primary or\n"
		"                           supplementary (repeatable)\n"
		"                           Admitted: root, our uid, --allow-uid, and members of\n"
		"                           the socket's group or an --allow-gid. A mode that\n"
		"                           would keep one of them out is refused at start.\n"
		"      --max-rooms N        rooms open at once, proxy-wide (default 4096)\n"
		"      --client-rooms N     rooms one connection may hold open (default 256)\n"
		"      --max-clients N      connections at once (default 256)\n"
		"      --uid-share PERCENT  the most of --max-clients and of --max-rooms the\n"
		"                           clients of one uid may hold, and one process of\n"
		"                           its uid's share (default 75; 100: no share)\n"
		"      --ring N             submission ring entries per connection, a power of\n"
		"                           two (default 1024)\n"
		"      --room-timeout MS    abort a room that makes no progress for MS\n"
		"                           milliseconds (default 30000; 0: never)\n"
		"      --shutdown-grace MS  on SIGTERM, let active rooms finish for MS before\n"
		"                           aborting them (default 5000)\n"
		"      --spin-us US         busy-poll at least US microseconds after the last\n"
		"                           work, then sleep until kicked (default 50; the\n"
		"                           spin grows, up to 16x and 1 ms, while sleeps end\n"
		"                           soon after they begin; 0: never spin). Once idle\n"
		"                           for 5 us the spin yields its CPU every 5 us to\n"
		"                           whoever shares it\n"
		"      --listen HOST:PORT   take rooms from proxies on other hosts over TCP;\n"
		"                           HOST is a numeric IPv4 address or [IPv6]; port 0:\n"
		"                           any free one. Needs the peer secret\n"
		"      --advertise HOST:PORT  the endpoint our descriptors name, when peers\n"
		"                           must dial something else than --listen (NAT, or a\n"
		"                           wildcard listen address)\n"
		"      --peer-secret-file PATH  the deployment's shared secret (16 to 4096\n"
		"                           bytes; mode 0600 or stricter); else the value of\n"
		"                           $KVSTAGE_PEER_SECRET. With a secret and no --listen\n"
		"                           this proxy only sends to others\n"
		"      --tcp-streams N      connections to each peer, 1 to 16 (default 2)\n"
		"      --peer-timeout MS    the bound on every wait on a peer (default 10000,\n"
		"                           at least 100): silent this long, or owing an\n"
		"                           answer or a payload this long, it is lost and its\n"
		"                           rooms fail; a handshake gets a quarter of it\n"
		"      --tcp-checksum       send a CRC32C of every chunk's payload (received\n"
		"                           ones are always checked when they carry one)\n"
		"      --tcp-zerocopy       send chunk payloads with MSG_ZEROCOPY: the NIC reads\n"
		"                           them from the slot, which stays pinned until the\n"
		"                           kernel says it is done (for a real NIC; to loopback\n"
		"                           or veth the kernel copies anyway, and a connection\n"
		"                           whose last 64 sends were copied stops asking)\n"
		"      --transport MODE     how chunks go to peers: auto | tcp | verbs (default\n"
		"                           auto: by RDMA READ on --rdma-device, else on the\n"
		"                           first RDMA device listed if its port is up, else\n"
		"                           by TCP;\n"
		"                           tcp: never RDMA; verbs: RDMA, and no start\n"
		"                           without a device). Each peer without RDMA gets\n"
		"                           TCP; the log says which a peer gets\n");
	datapath_usage(f, dps);
	fprintf(f,
		"      --metrics-listen [HOST:]PORT  serve Prometheus metrics over HTTP at\n"
		"                           GET /metrics (HOST numeric; default 127.0.0.1;\n"
		"                           port 0: any free one, logged); default: off\n"
		"      --trace-file PATH    write each room's lifecycle (opened, chunks queued,\n"
		"                           sent, landed, final, fenced, tombstones, reaped) as\n"
		"                           JSON lines to PATH (appended), or to a unix socket:\n"
		"                           unix:PATH (stream or datagram); default: off.\n"
		"                           Lines name rooms by their key, never their token\n"
		"      --trace-buffer N     records the trace buffers while its writer is\n"
		"                           behind, 16 to 16777216 (default 16384); past that\n"
		"                           they are dropped and counted (trace_dropped), and\n"
		"                           the loop never waits\n"
		"      --failpoints         accept failpoint control from kvstage-ctl (tests)\n"
		"      --ready-fd FD        write \"ready\\n\" to FD once serving, then close it\n"
		"                           (0, 1 and 2 are written to but kept open)\n"
		"  -l, --log-level LEVEL    error | warn | info | debug (default info)\n"
		"  -h, --help               show this help\n"
		"  -V, --version            show the version\n");
	if (*KVS_BUILT_WITHOUT)
		fprintf(f,
			"\nbuilt without: %s\n(the options that need them are refused; "
			"meson_options.txt lists the parts)\n",
			KVS_BUILT_WITHOUT);
}

/* An octal mode: digits 0-7 only, at most 0777. */
static int parse_mode(const char *s, unsigned *out)
{
	if (!*s || strspn(s, "01234567") != strlen(s) || strlen(s) > 4)
		return -EINVAL;
	unsigned long v = strtoul(s, NULL, 8);
	if (v > 0777)
		return -EINVAL;
	*out = (unsigned)v;
	return 0;
}

/* A group name, or a gid. */
static int parse_group(const char *s, gid_t *out)
{
	uint64_t v;
	if (kvs_parse_uint(s, UINT32_MAX - 1, &v) == 0) {
		*out = (gid_t)v;
		return 0;
	}
	struct group *g = getgrnam(s);
	if (!g)
		return -ENOENT;
	*out = g->gr_gid;
	return 0;
}

/* "FILE:LINE: " while the option being parsed came from --config. */
static char origin[320];

static int bad(const char *opt, const char *val, const char *why)
{
	fprintf(stderr, "kvstaged: %sinvalid %s '%s': %s\n", origin, opt, val, why);
	fprintf(stderr, "Try 'kvstaged --help'.\n");
	return 2;
}

/* An option of a part this build lacks (meson_options.txt): one line, saying
 * which library was missing when it was built. */
static int lacks(const char *opt, const char *part, const char *package)
{
	fprintf(stderr, "kvstaged: %s%s: this build has no %s (%s missing at build time)\n", origin,
		opt, part, package);
	return 2;
}
#define NO_METRICS(opt) lacks(opt, "metrics", "libmicrohttpd-dev")

enum {
	O_HUGE = 256,
	O_NOLOCK,
	O_UID,
	O_GID,
	O_ROOMS,
	O_CROOMS,
	O_CLIENTS,
	O_USHARE,
	O_RING,
	O_TIMEOUT,
	O_GRACE,
	O_SPIN,
	O_FP,
	O_READY,
	O_SMODE,
	O_SGROUP,
	O_LISTEN,
	O_ADVERTISE,
	O_SECRET,
	O_STREAMS,
	O_PTIMEOUT,
	O_CSUM,
	O_ZEROCOPY,
	O_METRICS,
	O_TRANSPORT,
	O_TRACE,
	O_TRACE_BUF,
	O_LACKING =
		384, /* an option of a part this build lacks: O_LACKING + its place in lacking[] */
	O_DP0 = 512, /* a data path's: O_DP0 + its place in dp_opts[] */
};

static const struct option base_opts[] = {
	{ "config", required_argument, NULL, 'c' },
	{ "socket", required_argument, NULL, 's' },
	{ "slots", required_argument, NULL, 'n' },
	{ "slot-size", required_argument, NULL, 'z' },
	{ "hugepages", required_argument, NULL, O_HUGE },
	{ "no-lock", no_argument, NULL, O_NOLOCK },
	{ "socket-mode", required_argument, NULL, O_SMODE },
	{ "socket-group", required_argument, NULL, O_SGROUP },
	{ "allow-uid", required_argument, NULL, O_UID },
	{ "allow-gid", required_argument, NULL, O_GID },
	{ "max-rooms", required_argument, NULL, O_ROOMS },
	{ "client-rooms", required_argument, NULL, O_CROOMS },
	{ "max-clients", required_argument, NULL, O_CLIENTS },
	{ "uid-share", required_argument, NULL, O_USHARE },
	{ "ring", required_argument, NULL, O_RING },
	{ "room-timeout", required_argument, NULL, O_TIMEOUT },
	{ "shutdown-grace", required_argument, NULL, O_GRACE },
	{ "spin-us", required_argument, NULL, O_SPIN },
	{ "failpoints", no_argument, NULL, O_FP },
	{ "listen", required_argument, NULL, O_LISTEN },
	{ "advertise", required_argument, NULL, O_ADVERTISE },
	{ "peer-secret-file", required_argument, NULL, O_SECRET },
	{ "tcp-streams", required_argument, NULL, O_STREAMS },
	{ "peer-timeout", required_argument, NULL, O_PTIMEOUT },
	{ "tcp-checksum", no_argument, NULL, O_CSUM },
	{ "tcp-zerocopy", no_argument, NULL, O_ZEROCOPY },
	{ "transport", required_argument, NULL, O_TRANSPORT },
	{ "metrics-listen", required_argument, NULL, O_METRICS },
	{ "trace-file", required_argument, NULL, O_TRACE },
	{ "trace-buffer", required_argument, NULL, O_TRACE_BUF },
	{ "ready-fd", required_argument, NULL, O_READY },
	{ "log-level", required_argument, NULL, 'l' },
	{ "help", no_argument, NULL, 'h' },
	{ "version", no_argument, NULL, 'V' },
};

/* Options of parts this build may lack (meson_options.txt) that no module
 * here declares: refused in one line naming the package that was missing
 * at build time, not as unknown. */
static const struct lacking {
	const char *name, *part, *package;
	bool lacks;
} lacking[] = {
	{ "--rdma-device", "RDMA", "libibverbs-dev", !KVS_HAVE_VERBS },
	{ "--rdma-gid-index", "RDMA", "libibverbs-dev", !KVS_HAVE_VERBS },
	{ "--rdma-keys", "RDMA", "libibverbs-dev", !KVS_HAVE_VERBS },
};
#define NLACKING (sizeof(lacking) / sizeof(lacking[0]))

/* A data path's option, by the data path it belongs to. */
struct dp_opt {
	unsigned dp; /* its place in kvsp_datapaths */
	const struct kvsp_dp_opt *opt;
};

#define MAX_DP_OPTS 64
static struct dp_opt dp_opts[MAX_DP_OPTS];
static unsigned ndp_opts;
/* The whole table: base_opts, the lacking parts' and the data paths' options. */
static struct option table[sizeof(base_opts) / sizeof(base_opts[0]) + NLACKING + MAX_DP_OPTS + 1];

/* Makes table, and each data path's options' values at their defaults.
 * Returns 0, or 1 (out of memory, or more options than the table holds). */
static int make_table(struct kvsp_args *a)
{
	unsigned n = 0;
	for (unsigned i = 0; i < sizeof(base_opts) / sizeof(base_opts[0]); i++)
		table[n++] = base_opts[i];
	for (unsigned i = 0; i < NLACKING; i++)
		if (lacking[i].lacks)
			table[n++] = (struct option){ lacking[i].name + 2, required_argument, NULL,
						      O_LACKING + (int)i };
	ndp_opts = 0;
	for (unsigned k = 0; kvsp_datapaths[k]; k++) {
		const struct kvsp_dp_ops *dp = kvsp_datapaths[k];
		if (k >= KVSP_ARGS_MAX_DPS)
			return 1;
		if (dp->conf_size) {
			a->dp_conf[k] = calloc(1, dp->conf_size);
			if (!a->dp_conf[k])
				return 1;
			dp->conf_init(a->dp_conf[k]);
		}
		for (const struct kvsp_dp_opt *o = dp->opts; o && o->name; o++) {
			if (ndp_opts == MAX_DP_OPTS)
				return 1;
			dp_opts[ndp_opts] = (struct dp_opt){ k, o };
			table[n++] = (struct option){ o->name,
						      o->arg ? required_argument : no_argument,
						      NULL, O_DP0 + (int)ndp_opts++ };
		}
	}
	table[n] = (struct option){ 0 };
	a->peer.datapaths = kvsp_datapaths;
	a->peer.dp_conf = a->dp_conf;
	return 0;
}

/* Returns 0, or 2 after saying why val is refused. */
static int datapath_opt(struct kvsp_args *a, const struct dp_opt *d, const char *val)
{
	const char *why = "not taken";
	char opt[48];
	snprintf(opt, sizeof(opt), "--%s", d->opt->name);
	if (d->opt->parse(a->dp_conf[d->dp], val, &why) < 0)
		return bad(opt, val ? val : "", why);
	return 0;
}

/* The --config FILE argument, if any, before anything is parsed: the
 * file's options go first so that the command line overrides them.
 * Returns 0 (*path NULL: none), or 2 after saying why. */
static int find_config(int argc, char **argv, const char **path)
{
	*path = NULL;
	for (int i = 1; i < argc && strcmp(argv[i], "--"); i++) {
		const char *v = NULL;
		if (!strncmp(argv[i], "--config=", 9))
			v = argv[i] + 9;
		else if ((!strcmp(argv[i], "--config") || !strcmp(argv[i], "-c")) && i + 1 < argc)
			v = argv[++i];
		else
			continue;
		if (*path) {
			fprintf(stderr, "kvstaged: --config given twice\nTry 'kvstaged --help'.\n");
			return 2;
		}
		*path = v;
	}
	return 0;
}

int kvsp_args_parse(struct kvsp_args *a, int argc, char **argv)
{
	int opt;
	uint64_t v;
	const char *conf_path;
	if (make_table(a)) {
		fprintf(stderr, "kvstaged: the data paths' options do not fit the option table\n");
		return 1;
	}
	static struct kvsp_conf_args conf; /* its strings are the options' values: kept */
	if (find_config(argc, argv, &conf_path))
		return 2;
	static char **args; /* static: what it holds lives as long as the options do */
	args = argv;
	int nargs = argc;
	if (conf_path) {
		char why[512];
		if (kvsp_conf_read(conf_path, table, &conf, why, sizeof(why)) < 0) {
			fprintf(stderr, "kvstaged: %s\nTry 'kvstaged --help'.\n", why);
			return 2;
		}
		nargs = argc + conf.argc;
		args = calloc((size_t)nargs + 1, sizeof(*args));
		if (!args)
			return 1;
		args[0] = argv[0];
		memcpy(args + 1, conf.argv, (size_t)conf.argc * sizeof(*args));
		memcpy(args + 1 + conf.argc, argv + 1, (size_t)(argc - 1) * sizeof(*args));
	}

	for (;;) {
		int at = optind; /* a file entry is one "--name=value": it is args[at] */
		opt = getopt_long(nargs, args, "c:s:n:z:l:hV", table, NULL);
		if (opt == -1)
			break;
		origin[0] = 0;
		if (at >= 1 && at <= conf.argc)
			snprintf(origin, sizeof(origin), "%.255s:%u: ", conf_path,
				 conf.line[at - 1]);
		switch (opt) {
		case 'c':
			break; /* read first, above */
		case 's':
			if (!*optarg)
				return bad("--socket", optarg, "want a path");
			a->cfg.socket_path = optarg;
			break;
		case O_SMODE:
			if (parse_mode(optarg, &a->cfg.socket_mode))
				return bad("--socket-mode", optarg,
					   "want an octal mode such as 0660");
			break;
		case O_SGROUP:
			if (parse_group(optarg, &a->cfg.socket_group))
				return bad("--socket-group", optarg, "no such group");
			break;
		case 'n':
			if (kvs_parse_uint(optarg, 1u << 24, &v) || v == 0)
				return bad("--slots", optarg, "want 1 to 16777216");
			a->cfg.slot_count = (uint32_t)v;
			break;
		case 'z':
			/* A chunk's length is 32-bit in kvs_send: a slot must fit in it. */
			if (kvs_parse_size(optarg, &v) || v < 4096 || v % 4096 || v > UINT32_MAX)
				return bad(
					"--slot-size", optarg,
					"want a multiple of 4K, at most 4G - 4K (kvs_send takes a "
					"32-bit length)");
			a->cfg.slot_size = v;
			break;
		case O_HUGE:
			if (!strcmp(optarg, "auto"))
				a->cfg.huge = KVSP_HUGE_AUTO;
			else if (!strcmp(optarg, "on"))
				a->cfg.huge = KVSP_HUGE_ON;
			else if (!strcmp(optarg, "off"))
				a->cfg.huge = KVSP_HUGE_OFF;
			else
				return bad("--hugepages", optarg, "want auto, on or off");
			break;
		case O_NOLOCK:
			a->cfg.lock = false;
			break;
		case O_UID:
		case O_GID:
			if (kvs_parse_uint(optarg, UINT32_MAX - 1, &v))
				return bad(opt == O_UID ? "--allow-uid" : "--allow-gid", optarg,
					   "want a number");
			if (opt == O_UID && a->cfg.n_allow_uid < KVSP_MAX_ALLOW)
				a->cfg.allow_uid[a->cfg.n_allow_uid++] = (uid_t)v;
			else if (opt == O_GID && a->cfg.n_allow_gid < KVSP_MAX_ALLOW)
				a->cfg.allow_gid[a->cfg.n_allow_gid++] = (gid_t)v;
			else
				return bad(opt == O_UID ? "--allow-uid" : "--allow-gid", optarg,
					   "at most 16 of each");
			break;
		case O_ROOMS:
			if (kvs_parse_uint(optarg, 1u << 24, &v) || !v)
				return bad("--max-rooms", optarg, "want 1 to 16777216");
			a->cfg.max_rooms = (uint32_t)v;
			break;
		case O_CROOMS:
			if (kvs_parse_uint(optarg, 65534, &v) || !v)
				return bad("--client-rooms", optarg, "want 1 to 65534");
			a->cfg.client_rooms = (uint32_t)v;
			break;
		case O_CLIENTS:
			if (kvs_parse_uint(optarg, 65535, &v) || !v)
				return bad("--max-clients", optarg, "want 1 to 65535");
			a->cfg.max_clients = (uint32_t)v;
			break;
		case O_USHARE:
			if (kvs_parse_uint(optarg, 100, &v) || !v)
				return bad("--uid-share", optarg, "want a percent, 1 to 100");
			a->cfg.uid_share_pct = (unsigned)v;
			break;
		case O_RING:
			if (kvs_parse_uint(optarg, 65536, &v) || v < 64 || (v & (v - 1)))
				return bad("--ring", optarg, "want a power of two, 64 to 65536");
			a->cfg.sq_count = (uint32_t)v;
			break;
		case O_TIMEOUT:
			if (kvs_parse_uint(optarg, 86400000, &v))
				return bad("--room-timeout", optarg,
					   "want milliseconds, 0 to 86400000");
			a->cfg.room_timeout_ns = v * 1000000;
			break;
		case O_GRACE:
			if (kvs_parse_uint(optarg, 86400000, &v))
				return bad("--shutdown-grace", optarg, "want milliseconds");
			a->cfg.shutdown_grace_ns = v * 1000000;
			break;
		case O_SPIN:
			if (kvs_parse_uint(optarg, 1000000, &v))
				return bad("--spin-us", optarg, "want 0 to 1000000");
			a->cfg.spin_ns = v * 1000;
			break;
		case O_FP:
			a->cfg.failpoints = true;
			break;
		case O_LISTEN:
		case O_ADVERTISE: {
			struct kvsp_endpoint ep;
			if (kvsp_endpoint_parse(optarg, &ep) < 0)
				return bad(opt == O_LISTEN ? "--listen" : "--advertise", optarg,
					   "want IPV4:PORT or [IPV6]:PORT, numeric");
			if (opt == O_LISTEN)
				a->peer.listen = optarg;
			else
				a->peer.advertise = optarg;
			break;
		}
		case O_SECRET:
			a->secret_path = optarg;
			break;
		case O_STREAMS:
			if (kvs_parse_uint(optarg, KVSP_PEER_MAX_STREAMS, &v) || !v)
				return bad("--tcp-streams", optarg, "want 1 to 16");
			a->peer.streams = (unsigned)v;
			break;
		case O_PTIMEOUT:
			if (kvs_parse_uint(optarg, 86400000, &v) || v < 100)
				return bad("--peer-timeout", optarg,
					   "want milliseconds, 100 to 86400000");
			a->peer.peer_timeout_ns = v * 1000000;
			break;
		case O_CSUM:
			a->peer.checksum = true;
			break;
		case O_ZEROCOPY:
			a->peer.zerocopy = true;
			break;
		case O_TRANSPORT:
			if (!strcmp(optarg, "auto"))
				a->peer.data = KVSP_DATA_AUTO;
			else if (!strcmp(optarg, "tcp"))
				a->peer.data = KVSP_DATA_STREAM;
			else if (!strcmp(optarg, "verbs") && !KVS_HAVE_VERBS)
				return lacks("--transport verbs", lacking[0].part, /* RDMA's */
					     lacking[0].package);
			else if (!strcmp(optarg, "verbs"))
				a->peer.data = KVSP_DATA_VERBS;
			else
				return bad("--transport", optarg, "want auto, tcp or verbs");
			break;
		case O_METRICS: {
			if (!KVS_HAVE_METRICS)
				return NO_METRICS("--metrics-listen");
			struct kvsp_endpoint ep;
			if (kvsp_metrics_parse(optarg, &ep) < 0)
				return bad("--metrics-listen", optarg,
					   "want PORT, IPV4:PORT or [IPV6]:PORT, numeric");
			a->metrics_listen = optarg;
			break;
		}
		case O_TRACE:
			if (!*optarg)
				return bad("--trace-file", optarg, "want a path, or unix:PATH");
			a->trace_file = optarg;
			break;
		case O_TRACE_BUF:
			if (kvs_parse_uint(optarg, 1u << 24, &v) || v < 16)
				return bad("--trace-buffer", optarg,
					   "want records, 16 to 16777216");
			a->trace_buffer = (uint32_t)v;
			break;
		case O_READY:
			if (kvs_parse_uint(optarg, INT_MAX, &v) || fcntl((int)v, F_GETFD) < 0)
				return bad("--ready-fd", optarg, "not an open file descriptor");
			a->ready_fd = (int)v;
			break;
		case 'l': {
			int lvl = kvsp_log_parse(optarg);
			if (lvl < 0)
				return bad("--log-level", optarg,
					   "want error, warn, info or debug");
			a->cfg.log_level = lvl;
			break;
		}
		case 'h':
			usage(stdout, kvsp_datapaths);
			return 0;
		case 'V':
			printf("kvstaged %s\n", KVS_VERSION_STRING);
			return 0;
		default:
			if (opt >= O_LACKING && opt < O_LACKING + (int)NLACKING)
				return lacks(lacking[opt - O_LACKING].name,
					     lacking[opt - O_LACKING].part,
					     lacking[opt - O_LACKING].package);
			if (opt >= O_DP0 && opt < O_DP0 + (int)ndp_opts) {
				if (datapath_opt(a, &dp_opts[opt - O_DP0], optarg))
					return 2;
				break;
			}
			fprintf(stderr, "Try 'kvstaged --help'.\n");
			return 2;
		}
	}
	origin[0] = 0;
	if (optind < nargs) {
		fprintf(stderr, "kvstaged: unexpected argument '%s'\nTry 'kvstaged --help'.\n",
			args[optind]);
		return 2;
	}
	return -1;
}
