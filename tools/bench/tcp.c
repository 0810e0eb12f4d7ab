/* SPDX-License-Identifier: MIT */
/*
 * The tcp mode: two proxies joined by the tcp transport, the receivers on
 * one (B, which listens) and the senders on the other (A, which dials B
 * when a descriptor names it), on loopback or, with --netns, in two
 * network namespaces joined by a veth pair this run makes and removes.
 * Per chunk size: the raw TCP baselines between the same two endpoints
 * (rawtcp.c), then the rooms (local_measure, the local mode's clients).
 */
#include <errno.h>
#include <math.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "admin.h"
#include "kvstage.h"
#include "layout.h"
#include "local.h"
#include "statnames.h"

#define NS_A_IP "10.78.0.1"
#define NS_B_IP "10.78.0.2"

static int run_ip(const char *ipbin, const char *const *args)
{
	const char *argv[16] = { ipbin };
	unsigned n = 1;
	for (; args[n - 1] && n < 15; n++)
		argv[n] = args[n - 1];
	argv[n] = NULL;
	fflush(NULL);
	pid_t pid = fork();
	if (pid == 0) {
		execv(ipbin, (char *const *)argv);
		_exit(127);
	}
	int st;
	if (pid < 0 || waitpid(pid, &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st)) {
		fprintf(stderr, "kvstage-bench: --netns: '%s", ipbin);
		for (unsigned i = 1; i < n; i++)
			fprintf(stderr, " %s", argv[i]);
		fprintf(stderr, "' failed\n");
		return -1;
	}
	return 0;
}

#define IP(e, ...) run_ip((e)->ipbin, (const char *[]){ __VA_ARGS__, NULL })

void tcp_env_fini(struct tcp_env *e)
{
	for (unsigned i = 0; i < 2; i++)
		if (e->ns[i][0])
			IP(e, "netns", "delete", e->ns[i]); /* its veth end goes with it */
	if (e->secret[0])
		unlink(e->secret);
	if (e->dir[0])
		rmdir(e->dir);
}

/* Two namespaces, a veth pair between them, an address on each end. */
static int make_netns(struct tcp_env *e)
{
	if (geteuid() != 0) {
		fprintf(stderr, "kvstage-bench: --netns makes network namespaces: it needs root "
				"(CAP_NET_ADMIN); without --netns the proxies meet on loopback\n");
		return -1;
	}
	e->ipbin = access("/usr/sbin/ip", X_OK) == 0 ? "/usr/sbin/ip" : "/sbin/ip";
	if (access(e->ipbin, X_OK)) {
		fprintf(stderr,
			"kvstage-bench: --netns needs iproute2's ip (apt install iproute2)\n");
		return -1;
	}
	unsigned tag = (unsigned)getpid() % 100000;
	for (unsigned i = 0; i < 2; i++) {
		snprintf(e->ns[i], sizeof(e->ns[i]), "kvsbench%u-%c", tag, 'a' + i);
		if (IP(e, "netns", "add", e->ns[i])) {
			e->ns[i][0] = 0;
			return -1;
		}
	}
	if (IP(e, "-n", e->ns[0], "link", "add", "veth0", "type", "veth", "peer", "name", "veth1",
	       "netns", e->ns[1]) ||
	    IP(e, "-n", e->ns[0], "addr", "add", NS_A_IP "/24", "dev", "veth0") ||
	    IP(e, "-n", e->ns[1], "addr", "add", NS_B_IP "/24", "dev", "veth1") ||
	    IP(e, "-n", e->ns[0], "link", "set", "veth0", "up") ||
	    IP(e, "-n", e->ns[1], "link", "set", "veth1", "up") ||
	    IP(e, "-n", e->ns[0], "link", "set", "lo", "up") ||
	    IP(e, "-n", e->ns[1], "link", "set", "lo", "up"))
		return -1;
	e->b_ip = NS_B_IP;
	return 0;
}

/* A fresh random secret in a 0600 file only this run knows. */
static int make_secret(struct tcp_env *e)
{
	strcpy(e->dir, "/tmp/kvstage-bench-tcp.XXXXXX");
	if (!mkdtemp(e->dir)) {
		fprintf(stderr, "kvstage-bench: mkdtemp: %s\n", strerror(errno));
		e->dir[0] = 0;
		return -1;
	}
	snprintf(e->secret, sizeof(e->secret), "%s/peer-secret", e->dir);
	uint8_t raw[32];
	char hex[2 * sizeof(raw) + 2];
	if (getrandom(raw, sizeof(raw), 0) != (ssize_t)sizeof(raw))
		return -1;
	for (size_t i = 0; i < sizeof(raw); i++)
		snprintf(hex + 2 * i, 3, "%02x", raw[i]);
	strcat(hex, "\n");
	int fd = open(e->secret, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	bool ok = fd >= 0 && write(fd, hex, strlen(hex)) == (ssize_t)strlen(hex);
	if (fd >= 0)
		close(fd);
	if (!ok) {
		fprintf(stderr, "kvstage-bench: cannot write %s: %s\n", e->secret, strerror(errno));
		return -1;
	}
	return 0;
}

int bench_stats(const char *sock, const char *const *names, unsigned n, uint64_t *out)
{
	const struct kvs_ctrl *ctrl;
	size_t len;
	memset(out, 0, n * sizeof(*out));
	if (kvs_stat_map(sock, &ctrl, &len) < 0)
		return -1;
	for (unsigned i = 0; i < n; i++) {
		/* A counter the proxy lacks (RDMA without a device) stays 0. */
		const uint64_t *v = kvs_stat_at(ctrl, len, names[i]);
		if (v)
			out[i] = __atomic_load_n(v, __ATOMIC_RELAXED);
	}
	munmap((void *)ctrl, len);
	return 0;
}

uint64_t bench_stat(const char *sock, const char *name)
{
	uint64_t v;
	bench_stats(sock, &name, 1, &v);
	return v;
}

int tcp_proxies_start(const struct bench_opts *o, const struct tcp_env *e, bool verbs,
		      uint64_t chunk, uint32_t slots, uint64_t need, struct bench_proxy *a,
		      struct bench_proxy *b)
{
	char streams[8], listen[48], gid[16];
	snprintf(streams, sizeof(streams), "%u", o->tcp_streams);
	snprintf(listen, sizeof(listen), "%s:0", e->b_ip);
	snprintf(gid, sizeof(gid), "%d", o->rdma_gid_index);
	/* The mode names the data path: tcp must not become RDMA on a host
	 * with a device (--transport auto would), verbs must not fall back. */
	const char *data = verbs ? "verbs" : "tcp";
	const char *b_args[] = { "--peer-secret-file",
				 e->secret,
				 "--tcp-streams",
				 streams,
				 "--transport",
				 data,
				 "--listen",
				 listen,
				 NULL,
				 NULL,
				 NULL,
				 NULL,
				 NULL };
	const char *a_args[] = { "--peer-secret-file",
				 e->secret,
				 "--tcp-streams",
				 streams,
				 "--transport",
				 data,
				 NULL,
				 NULL,
				 NULL,
				 NULL,
				 NULL };
	if (verbs) {
		b_args[8] = a_args[6] = "--rdma-device";
		b_args[9] = a_args[7] = o->rdma_device;
		if (o->rdma_gid_index >= 0) {
			b_args[10] = a_args[8] = "--rdma-gid-index";
			b_args[11] = a_args[9] = gid;
		}
	}
	if (proxy_start_ex(b, o, chunk, slots, b_args, g_pin.proxy2_cpu, e->ns[1]) < 0)
		return -1;
	if (proxy_start_ex(a, o, chunk, slots, a_args, g_pin.proxy_cpu, e->ns[0]) < 0) {
		proxy_stop(b);
		return -1;
	}
	if (proxy_fits(a, chunk, need) < 0 || proxy_fits(b, chunk, need) < 0) {
		proxy_stop(a);
		proxy_stop(b);
		return -1;
	}
	return 0;
}

int tcp_env_init(const struct bench_opts *o, struct tcp_env *e)
{
	memset(e, 0, sizeof(*e));
	e->b_ip = "127.0.0.1";
	return make_secret(e) < 0 || (o->netns && make_netns(e) < 0) ? -1 : 0;
}

static int point(const struct bench_opts *o, const struct tcp_env *e, struct local_point *pt,
		 struct bench_proxy *shown)
{
	uint64_t chunk = pt->chunk;
	unsigned pairs = o->senders;
	uint64_t need = (uint64_t)pairs * o->rooms * pt->room_chunks;
	uint32_t slots = proxy_slots_for(chunk, need);
	char cs[16], listen[48];
	bench_size_str(chunk, cs, sizeof(cs));
	if ((uint64_t)slots * chunk > (32ull << 30)) {
		fprintf(stderr,
			"kvstage-bench: %u x %s would need two %llu GiB pools: lower --rooms, "
			"--senders or --room-bytes\n",
			slots, cs, (unsigned long long)((uint64_t)slots * chunk >> 30));
		return 2;
	}
	pt->slots = slots;
	snprintf(listen, sizeof(listen), "%s:0", e->b_ip);

	bool verbs = o->mode == MODE_VERBS;
	struct raw_tcp raw = { .chunk = chunk,
			       .sec = o->baseline_sec,
			       .streams = 1,
			       .tx_ns = e->ns[0],
			       .rx_ns = e->ns[1],
			       .rx_ip = e->b_ip,
			       .tx_cpu = g_pin.proxy_cpu,
			       .rx_cpu = g_pin.proxy2_cpu };
	pt->rdma_gbps = -1;
	if (verbs) {
		char why[320];
		note(o, "baseline: ib_read_bw on %s, READs of %s (%.0f s)", o->rdma_device, cs,
		     o->baseline_sec < 1 ? 1 : o->baseline_sec);
		pt->rdma_gbps = baseline_ib_read_bw(o->rdma_device, o->rdma_gid_index, chunk,
						    o->baseline_sec, why, sizeof(why));
		if (pt->rdma_gbps <= 0) { /* said even with -q: a figure is missing */
			progress_clear();
			fprintf(stderr, "kvstage-bench: baseline: %s; its ratio is n/a\n", why);
		}
	}
	note(o, "baseline: raw TCP %s, one stream, writes of %s (%.2f s)", listen, cs,
	     o->baseline_sec);
	pt->tcp1_gbps = baseline_raw_tcp(&raw);
	pt->tcp1_cpu_gb = raw.cpu_s_per_gb;
	pt->tcpn_gbps = pt->tcp1_gbps;
	pt->tcpn_cpu_gb = pt->tcp1_cpu_gb;
	if (o->tcp_streams > 1) {
		raw.streams = o->tcp_streams;
		note(o, "baseline: raw TCP, %u streams in one thread each side (%.2f s)",
		     raw.streams, o->baseline_sec);
		pt->tcpn_gbps = baseline_raw_tcp(&raw);
		pt->tcpn_cpu_gb = raw.cpu_s_per_gb;
	}
	if (pt->tcp1_gbps <= 0 || pt->tcpn_gbps <= 0)
		note(o, "baseline: a raw TCP measurement failed; its ratio is n/a");
	pt->ucx_gbps = pt->ucx_cpu_gb = -1;
	if (!verbs) {
		/* About --baseline-sec at the better raw rate, at least 200 messages. */
		double rate = fmax(fmax(pt->tcp1_gbps, pt->tcpn_gbps), 0.5) * 1e9;
		uint64_t iters = (uint64_t)(o->baseline_sec * rate / (double)chunk);
		char why[320];
		note(o, "baseline: UCX tag_bw over UCX_TLS=tcp, %llu messages of %s",
		     (unsigned long long)(iters < 200 ? 200 : iters), cs);
		pt->ucx_gbps = baseline_ucx_tcp(&raw, iters < 200 ? 200 : iters, &pt->ucx_cpu_gb,
						why, sizeof(why));
		if (pt->ucx_gbps <= 0)
			note(o, "baseline: no UCX figure: %s", why);
	}

	struct bench_proxy a, b;
	if (tcp_proxies_start(o, e, verbs, chunk, slots, need, &a, &b))
		return 1;
	pt->slots = a.slots;
	*shown = a; /* the report names A's binary */
	note(o,
	     "tcp %s: kvstaged A pid %d (senders) -> B pid %d (receivers, %s), %u slots each; "
	     "%u pair(s), %u rooms x %u chunks, payload %s",
	     cs, (int)a.pid, (int)b.pid, listen, a.slots, pairs, o->rooms, pt->room_chunks,
	     bench_payload_str(o->payload));
	struct bench_ends ends = { b.sock, a.sock, b.pid, a.pid, !verbs };
	int rc = local_measure(o, &ends, chunk, pt);
	/* Every room crossed the wire (by READ in verbs mode): at least the
	 * window's bytes went, or the figure is not this path's. */
	uint64_t sent = verbs ? bench_stat(b.sock, "rdma_bytes_rx")
			      : bench_stat(a.sock, "tcp_bytes_tx");
	if (verbs) {
		/* What each chunk's key cost A: its operations per chunk B READ. */
		double reads = (double)bench_stat(b.sock, "rdma_reads");
		pt->binds = reads ? (double)bench_stat(a.sock, "rdma_binds") / reads : NAN;
		pt->invalidates = reads ? (double)bench_stat(a.sock, "rdma_invalidates") / reads
					: NAN;
		pt->regions = reads ? (double)bench_stat(a.sock, "rdma_regions") / reads : NAN;
		pt->region_frees = reads ? (double)bench_stat(a.sock, "rdma_region_frees") / reads
					 : NAN;
	}
	if (!rc && sent < pt->bytes) {
		fprintf(stderr,
			"kvstage-bench: %llu bytes went %s, fewer than the %llu the receivers "
			"counted: the rooms did not take this path\n",
			(unsigned long long)sent, verbs ? "by RDMA READ" : "over tcp",
			(unsigned long long)pt->bytes);
		rc = 1;
	}
	proxy_stop(&a);
	proxy_stop(&b);
	return rc;
}

/* -------------------------------------------------------------- report */

static const char *const tcp_defs[][2] = {
	{ "path", "proxy A (the senders' clients) dials proxy B (the receivers' clients) with the "
		  "tcp transport: --tcp-streams connections, authenticated, frames MACed; every "
		  "chunk is read off a socket into B's posted slot through the fence" },
	{ "raw_tcp",
	  "the same two endpoints with nothing of kvstage: one sender process and one "
	  "receiver process placed like the proxies, each holding all its sockets in "
	  "one thread, writes and reads of the chunk size from a 64 MiB ring of buffers, "
	  "the reader woken at kvstaged's mark (SO_RCVLOWAT: what a chunk of 64 KiB or "
	  "more still owes, at most 1 MiB); one stream, and --tcp-streams streams" },
	{ "ucx_tcp", "UCX's ucx_perftest -t tag_bw with UCX_TLS=tcp between the same two "
		     "endpoints, placed like the proxies, about --baseline-sec of messages of the "
		     "chunk size (where ucx-utils is installed; what NIXL builds on); its CPU is "
		     "both processes' whole lives" },
	{ "gbps", "room bytes completed in the window / window; 1 GB = 1e9 bytes; ratio over the "
		  "raw figure" },
	{ "chunks_per_s", "chunks completed per second; baseline: the better raw figure in "
			  "chunks of this size" },
	{ "room_latency", "kvs_recv_open on B to RECV_DONE, under load; baseline: the room bytes "
			  "in flight (senders x --rooms x room bytes) over the better raw rate, "
			  "the least a room can wait at that rate (Little's law)" },
	{ "chunk_latency",
	  "a room's last kvs_send on A to its SEND_DONE (the bytes left A's slot)" },
	{ "proxy_cpu", "utime + stime of each proxy over the window, % of one core" },
	{ "syscalls_per_chunk",
	  "each proxy's syscalls on its peer connections over the window (as its proxy_cpu), "
	  "over the chunks it moved in it (its chunks_moved counter): sends are sendmsg and "
	  "send calls (tcp_send_calls), recvs recv and recvmsg calls (tcp_recv_calls), epoll "
	  "the calls that say when the loop wakes: the peer plane's epoll_wait and epoll_ctl "
	  "calls and the SO_RCVLOWAT setsockopts of large payloads (peer_epoll_waits + "
	  "peer_epoll_ctls + tcp_lowat_calls); "
	  "calls that found the socket full or empty (EAGAIN) are counted. Sends and recvs "
	  "are counts of work, not times: they move little with the machine's load; epoll "
	  "is mostly the loop's passes (an epoll_wait each, busy or not), so it does" },
	{ "cpu_s_per_gb",
	  "CPU seconds per GB moved, of every process on the path: both proxies and every "
	  "sender and receiver process (utime + stime over the window, over the window's "
	  "bytes); baseline: raw TCP's two processes (the receiver's over its window, the "
	  "sender's whole life), the lower of its two figures" },
};

/* CPU seconds per GB of a process that used pct % of a core while gbps moved; < 0: n/a. */
static double cpu_per_gb(double pct, double gbps)
{
	return pct >= 0 && gbps > 0 ? pct / 100 / gbps : -1;
}

/* The keys A's chunks went under, from what it did per chunk. */
static const char *keys_name(const struct local_point *p)
{
	if (!(p->binds > 0) && !(p->regions > 0))
		return "none counted";
	return !(p->binds > 0)	? "regions"
	       : p->regions > 0 ? "windows over chunk regions"
				: "windows";
}

/* Each proxy's syscalls per chunk on its peer connections (tcp mode). */
static void calls_figs(struct point *p, const struct local_point *lp)
{
	static const char *const side[2] = { "senders' side", "receivers' side" };
	for (int i = 0; i < 2; i++) {
		char who = (char)('A' + i), key = (char)('a' + i);
		vs(p,
		   fig(p, keep(p, "proxy %c sends per chunk", who), NULL, U_NUM, lp->sends[i],
		       keep(p, "syscalls_per_chunk.proxy_%c.sends|%c_sends_per_chunk", key, key)),
		   NAN, keep(p, "%s: sendmsg, send", side[i]), NULL, NULL);
		vs(p,
		   fig(p, keep(p, "proxy %c recvs per chunk", who), NULL, U_NUM, lp->recvs[i],
		       keep(p, "syscalls_per_chunk.proxy_%c.recvs|%c_recvs_per_chunk", key, key)),
		   NAN, "recv, recvmsg", NULL, NULL);
		vs(p,
		   fig(p, keep(p, "proxy %c epoll per chunk", who), NULL, U_NUM, lp->epolls[i],
		       keep(p, "syscalls_per_chunk.proxy_%c.epoll|%c_epoll_per_chunk", key, key)),
		   NAN, "epoll_wait, epoll_ctl, SO_RCVLOWAT", NULL, NULL);
	}
}

static void describe(const struct bench_opts *o, struct point *p, const struct local_point *lp)
{
	bool verbs = o->mode == MODE_VERBS;
	/* What the path's hardware gives it: ib_read_bw in verbs mode, else the better raw TCP. */
	double raw = lp->rdma_gbps > 0 ? lp->rdma_gbps : fmax(lp->tcp1_gbps, lp->tcpn_gbps);
	double raw_cps = raw > 0 ? raw * 1e9 / (double)lp->chunk : NAN;
	/* Little's law: with this many room bytes in flight, a room waits at
	 * least in_flight / rate, the floor for room latency at the raw rate. */
	double floor = raw > 0 ? (double)o->senders * o->rooms * (double)lp->room_bytes /
					 (raw * 1e3)
			       : NAN;
	local_point_counts(p, lp, "on each proxy");
	struct fig *f = fig(p, "GB/s", "GB/s", U_NUM, lp->gbps, "gbps");
	if (verbs) {
		f->bcol = "ib_read_bw";
		vs(p, f, lp->rdma_gbps > 0 ? lp->rdma_gbps : -1,
		   keep(p, "ib_read_bw, %s", o->rdma_device), "baseline.ib_read_bw_gbps",
		   "ratio.gbps_vs_ib_read_bw");
		f = fig(p, "", NULL, U_NUM, lp->gbps, NULL);
	}
	f->bcol = "raw 1";
	vs(p, f, lp->tcp1_gbps > 0 ? lp->tcp1_gbps : -1, "raw TCP, 1 stream",
	   "baseline.raw_tcp_1_gbps", "ratio.gbps_vs_raw_tcp_1");
	f = fig(p, o->tcp_streams > 1 ? "" : NULL, NULL, U_NUM, lp->gbps, NULL);
	f->bcol = "raw N";
	vs(p, f, lp->tcpn_gbps > 0 ? lp->tcpn_gbps : -1,
	   keep(p, "raw TCP, %u streams", o->tcp_streams), "baseline.raw_tcp_n_gbps",
	   "ratio.gbps_vs_raw_tcp_n");
	if (!verbs) {
		f = fig(p, "", NULL, U_NUM, lp->gbps, NULL);
		f->bcol = "UCX tcp";
		vs(p, f, lp->ucx_gbps > 0 ? lp->ucx_gbps : -1, "UCX tag_bw, UCX_TLS=tcp",
		   "baseline.ucx_tcp_gbps", "ratio.gbps_vs_ucx_tcp");
	}
	vs(p, fig(p, "chunks/s", "chunks/s", U_RATE, lp->chunks_s, "chunks_per_s"), raw_cps,
	   verbs ? "ib_read_bw, in chunks" : "raw TCP (better), in chunks",
	   "baseline.raw_tcp_chunks_per_s", "ratio.chunks_per_s_vs_raw_tcp");
	vs(p,
	   fig_lat(p, "room latency", "room p50/p99 us", &lp->room_lat, P50 | P99,
		   "room_latency_us", "room_%s_us"),
	   floor, verbs ? "bytes in flight / ib_read_bw rate" : "bytes in flight / raw TCP rate",
	   "baseline.room_latency_floor_us", "ratio.room_%s_vs_floor");
	fig_lat(p, "chunk latency", NULL, &lp->chunk_lat, P50 | P99, "chunk_latency_us",
		"chunk_%s_us");
	vs(p,
	   fig(p, "proxy A CPU (% of a core)", "A CPU%", U_NUM, lp->proxy_cpu, "proxy_a_cpu_pct"),
	   NAN, "senders' side", NULL, NULL);
	vs(p,
	   fig(p, "proxy B CPU (% of a core)", "B CPU%", U_NUM, lp->proxy_rx_cpu,
	       "proxy_b_cpu_pct"),
	   NAN, "receivers' side", NULL, NULL);
	fig(p, "clients CPU (% of a core)", NULL, U_NUM, lp->clients_cpu, "clients_cpu_pct");
	if (!verbs)
		calls_figs(p, lp);
	double a = cpu_per_gb(lp->proxy_cpu, lp->gbps), b = cpu_per_gb(lp->proxy_rx_cpu, lp->gbps),
	       cl = cpu_per_gb(lp->clients_cpu, lp->gbps);
	double raw_cpu = lp->tcp1_cpu_gb > 0 && lp->tcpn_cpu_gb > 0
				 ? fmin(lp->tcp1_cpu_gb, lp->tcpn_cpu_gb)
				 : fmax(lp->tcp1_cpu_gb, lp->tcpn_cpu_gb);
	put_num(p, "cpu_s_per_gb.proxy_a", a);
	put_num(p, "cpu_s_per_gb.proxy_b", b);
	put_num(p, "cpu_s_per_gb.clients", cl);
	put_num(p, "baseline.raw_tcp_1_cpu_s_per_gb", lp->tcp1_cpu_gb);
	put_num(p, "baseline.raw_tcp_n_cpu_s_per_gb", lp->tcpn_cpu_gb);
	vs(p,
	   fig(p, "CPU s per GB, every process", "CPU s/GB", U_NUM,
	       a >= 0 && b >= 0 && cl >= 0 ? a + b + cl : -1, "cpu_s_per_gb.all|cpu_s_per_gb"),
	   raw_cpu > 0 ? raw_cpu : -1, "raw TCP's two processes", "baseline.raw_tcp_cpu_s_per_gb",
	   "ratio.cpu_s_per_gb_vs_raw_tcp");
	if (!verbs)
		vs(p, fig(p, "", NULL, U_NUM, a >= 0 && b >= 0 && cl >= 0 ? a + b + cl : -1, NULL),
		   lp->ucx_cpu_gb > 0 ? lp->ucx_cpu_gb : -1, "UCX's two processes",
		   "baseline.ucx_tcp_cpu_s_per_gb", "ratio.cpu_s_per_gb_vs_ucx_tcp");
	if (verbs) {
		put_str(p, "keys.kind", "%s", keys_name(lp));
		put_num(p, "keys.binds_per_chunk", lp->binds);
		put_num(p, "keys.invalidates_per_chunk", lp->invalidates);
		put_num(p, "keys.regions_per_chunk", lp->regions);
		put_num(p, "keys.region_frees_per_chunk", lp->region_frees);
		CAT(p->notes,
		    "  keys: %s; per chunk: %.2f binds, %.2f invalidates, %.2f region "
		    "registrations, %.2f deregistrations (their cost is in the ratios to "
		    "ib_read_bw, which reads one region under one key)\n",
		    keys_name(lp), lp->binds, lp->invalidates, lp->regions, lp->region_frees);
	}
	put_str(p, "|path", o->netns ? "veth" : "loopback");
	local_point_notes(o, p, lp);
}

static void report_tcp(const struct bench_opts *o, const struct local_point *pt, unsigned n,
		       const struct bench_proxy *px, const char *path)
{
	char title[160];
	struct doc *d = doc_new(o, n);
	if (!d)
		return;
	struct point *pts = d->pt;
	snprintf(title, sizeof(title),
		 "%s: %u sender(s) on proxy A -> %u receiver(s) on proxy B "
		 "over %s, --tcp-streams %u",
		 bench_mode_name(o->mode), o->senders, o->receivers, path, o->tcp_streams);
	local_doc_begin(d, o, n, title);
	doc_head(d, o, px, ", two started per point with --slot-size = chunk size", false, NULL);
	put_str(&d->top, "transport.path", "%s", path);
	put_int(&d->top, "transport.tcp_streams", o->tcp_streams);
	put_defs(d, tcp_defs, sizeof(tcp_defs) / sizeof(tcp_defs[0]));
	put(&d->top, "points", U_POINTS);
	d->csv = "mode,path,tcp_streams,chunk_bytes,room_bytes,payload,pairs,rooms_in_flight,"
		 "seconds,"
		 "bytes,chunks,rooms,errors,gbps,chunks_per_s,room_p50_us,room_p99_us,chunk_p50_us,"
		 "chunk_p99_us,proxy_a_cpu_pct,proxy_b_cpu_pct,clients_cpu_pct,raw_tcp_1_gbps,"
		 "raw_tcp_n_gbps,gbps_vs_raw_tcp_1,gbps_vs_raw_tcp_n,cpu_s_per_gb,"
		 "raw_tcp_cpu_s_per_gb,cpu_s_per_gb_vs_raw_tcp,ucx_tcp_gbps,gbps_vs_ucx_tcp,"
		 "ucx_tcp_cpu_s_per_gb,cpu_s_per_gb_vs_ucx_tcp,a_sends_per_chunk,a_recvs_per_chunk,"
		 "a_epoll_per_chunk,b_sends_per_chunk,b_recvs_per_chunk,b_epoll_per_chunk";
	if (o->mode == MODE_VERBS)
		CAT(d->tail,
		    "\nverbs: the same two proxies with --rdma-device %s: every chunk is pulled "
		    "by RDMA READ from A's slot into B's posted slot (the fence decides at the "
		    "completion), under a key of its own that A grants before and revokes "
		    "after (--proxy-arg=--rdma-keys=regions measures the fallback for a device "
		    "without windows); the baselines are the device's ib_read_bw and, for "
		    "scale, raw TCP; latency floors and chunks/s use ib_read_bw.%s\n",
		    o->rdma_device,
		    strncmp(o->rdma_device, "rxe", 3)
			    ? ""
			    : " The device is soft-RoCE (rxe): the CPU does the NIC's work, so no "
			      "figure "
			      "here is a NIC's (and under emulation no speed means anything).");
	d->pt = pts;
	for (unsigned i = 0; i < n; i++)
		describe(o, &pts[i], &pt[i]);
	report(d);
	doc_free(d);
}

int run_tcp(const struct bench_opts *o)
{
	local_catch_signals();
	struct tcp_env e;
	struct local_point *pts = calloc(o->nchunks, sizeof(*pts));
	struct bench_proxy shown = { .pid = 0 };
	int rc = 0;
	unsigned done = 0;
	if (tcp_env_init(o, &e) < 0 || !pts)
		rc = 1;
	pin_clients();
	for (unsigned i = 0; i < o->nchunks && !rc && !local_interrupted(); i++) {
		struct local_point *pt = &pts[i];
		pt->chunk = o->chunks[i];
		pt->room_bytes = bench_room_bytes(o, pt->chunk);
		pt->room_chunks = bench_room_chunks(o, pt->chunk);
		rc = point(o, &e, pt, &shown);
		if (!rc)
			done++;
	}
	pin_all();
	tcp_env_fini(&e);
	if (local_interrupted())
		rc = 130;
	if (done)
		report_tcp(o, pts, done, &shown,
			   o->mode == MODE_VERBS
				   ? "RDMA READ on the device, control on loopback TCP"
			   : o->netns ? "veth between two network namespaces"
				      : "loopback");
	free(pts);
	return rc;
}
