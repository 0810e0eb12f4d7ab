/* SPDX-License-Identifier: MIT */
/* What the tcp mode reports: the table, JSON and CSV. */
#include <math.h>
#include <string.h>
#include <stdio.h>

#include "kvstage.h"
#include "output.h"

/* The keys A's chunks went under, from what it did per chunk. */
static const char *keys_name(const struct local_point *p)
{
	if (!(p->binds > 0) && !(p->regions > 0))
		return "none counted";
	return !(p->binds > 0) ? "regions" : p->regions > 0 ? "windows over chunk regions" : "windows";
}

/* What the path's hardware gives it: ib_read_bw in verbs mode, else the
 * better of the two raw TCP figures. */
static double raw_best(const struct local_point *p)
{
	return p->rdma_gbps > 0 ? p->rdma_gbps : fmax(p->tcp1_gbps, p->tcpn_gbps);
}

/* Little's law: with this many room bytes in flight, a room waits at
 * least in_flight / rate, the floor for room latency at the raw rate. */
static double lat_floor_us(const struct bench_opts *o, const struct local_point *p)
{
	double gbps = raw_best(p);
	if (gbps <= 0)
		return NAN;
	double in_flight = (double)o->senders * o->rooms * (double)p->room_bytes;
	return in_flight / (gbps * 1e3);
}

static const char *const tcp_defs[][2] = {
	{ "path", "proxy A (the senders' clients) dials proxy B (the receivers' clients) with the "
		  "tcp transport: --tcp-streams connections, authenticated, frames MACed; every "
		  "chunk is read off a socket into B's posted slot through the fence" },
	{ "raw_tcp", "the same two endpoints with nothing of kvstage: one sender process and one "
		     "receiver process placed like the proxies, each holding all its sockets in "
		     "one thread, writes and reads of the chunk size from a 64 MiB ring of buffers; "
		     "one stream, and --tcp-streams streams" },
	{ "gbps", "room bytes completed in the window / window; 1 GB = 1e9 bytes; ratio over the "
		  "raw figure" },
	{ "chunks_per_s", "chunks completed per second; baseline: the better raw figure in "
			  "chunks of this size" },
	{ "room_latency", "kvs_recv_open on B to RECV_DONE, under load; baseline: the room bytes "
			  "in flight (senders x --rooms x room bytes) over the better raw rate, "
			  "the least a room can wait at that rate (Little's law)" },
	{ "chunk_latency", "a room's last kvs_send on A to its SEND_DONE (the bytes left A's slot)" },
	{ "proxy_cpu", "utime + stime of each proxy over the window, % of one core" },
};

static void table(const struct bench_opts *o, const struct local_point *pt, unsigned n,
		  const struct bench_proxy_info *px, const char *path)
{
	char a[32], b[32], c[32];
	printf("kvstage-bench %s tcp: %u sender(s) on proxy A -> %u receiver(s) on proxy B over "
	       "%s, --tcp-streams %u, %u rooms in flight per sender, payload %s, ",
	       KVS_VERSION_STRING, o->senders, o->receivers, path, o->tcp_streams, o->rooms,
	       bench_payload_str(o->payload));
	if (o->bytes)
		printf("%s bytes per point\n", bench_size_str(o->bytes, a, sizeof(a)));
	else
		printf("%.2f s per point\n", o->duration);
	print_machine();
	print_proxy(px, ", two started per point with --slot-size = chunk size");
	for (unsigned i = 0; i < n; i++) {
		const struct local_point *p = &pt[i];
		printf("\n== chunk %s: rooms of %u chunks (%s bytes), %u slots on each proxy, %.2f s "
		       "measured after %.2f s warm-up, %llu rooms\n",
		       bench_size_str(p->chunk, a, sizeof(a)), p->room_chunks,
		       bench_size_str(p->room_bytes, b, sizeof(b)), p->slots, p->seconds, p->warmup_s,
		       (unsigned long long)p->rooms);
		row_head();
		char bw[64];
		if (o->mode == MODE_VERBS) {
			snprintf(bw, sizeof(bw), "ib_read_bw, %s", o->rdma_device);
			row("GB/s", num(p->gbps, a, sizeof(a)), p->rdma_gbps > 0 ? p->rdma_gbps : NAN,
			    p->rdma_gbps > 0 ? NULL : "n/a", bw, ratio(p->gbps, p->rdma_gbps));
		}
		row(o->mode == MODE_VERBS ? "" : "GB/s", o->mode == MODE_VERBS ? "" : num(p->gbps, a, sizeof(a)),
		    p->tcp1_gbps > 0 ? p->tcp1_gbps : NAN,
		    p->tcp1_gbps > 0 ? NULL : "n/a", "raw TCP, 1 stream", ratio(p->gbps, p->tcp1_gbps));
		if (o->tcp_streams > 1) {
			snprintf(bw, sizeof(bw), "raw TCP, %u streams", o->tcp_streams);
			row("", "", p->tcpn_gbps > 0 ? p->tcpn_gbps : NAN, p->tcpn_gbps > 0 ? NULL : "n/a",
			    bw, ratio(p->gbps, p->tcpn_gbps));
		}
		double raw_cps = raw_best(p) > 0 ? raw_best(p) * 1e9 / (double)p->chunk : NAN;
		row("chunks/s", human(p->chunks_s, a, sizeof(a)), NAN,
		    isnan(raw_cps) ? "n/a" : human(raw_cps, b, sizeof(b)), o->mode == MODE_VERBS ? "ib_read_bw, in chunks" : "raw TCP (better), in chunks",
		    ratio(p->chunks_s, raw_cps));
		double fl = lat_floor_us(o, p);
		row("room latency p50 (us)", p->room_lat.n ? num(p->room_lat.p50, a, sizeof(a)) : "n/a",
		    fl, NULL, o->mode == MODE_VERBS ? "bytes in flight / ib_read_bw rate" : "bytes in flight / raw TCP rate", ratio(p->room_lat.p50, fl));
		row("room latency p99 (us)", p->room_lat.n ? num(p->room_lat.p99, a, sizeof(a)) : "n/a",
		    fl, NULL, o->mode == MODE_VERBS ? "bytes in flight / ib_read_bw rate" : "bytes in flight / raw TCP rate", ratio(p->room_lat.p99, fl));
		row("chunk latency p50 (us)", p->chunk_lat.n ? num(p->chunk_lat.p50, a, sizeof(a)) : "n/a",
		    NAN, NULL, NULL, NAN);
		row("chunk latency p99 (us)", p->chunk_lat.n ? num(p->chunk_lat.p99, a, sizeof(a)) : "n/a",
		    NAN, NULL, NULL, NAN);
		row("proxy A CPU (% of a core)", num(p->proxy_cpu, a, sizeof(a)), NAN, NULL, "senders' side",
		    NAN);
		row("proxy B CPU (% of a core)", num(p->proxy_rx_cpu, a, sizeof(a)), NAN, NULL,
		    "receivers' side", NAN);
		if (o->mode == MODE_VERBS)
			printf("  keys: %s; per chunk: %.2f binds, %.2f invalidates, %.2f region "
			       "registrations, %.2f deregistrations (their cost is in the ratios to "
			       "ib_read_bw, which reads one region under one key)\n",
			       keys_name(p), p->binds, p->invalidates, p->regions, p->region_frees);
		if (o->payload == PAYLOAD_VERIFY)
			printf("  verified: %llu chunks, %llu with a wrong byte\n",
			       (unsigned long long)p->chunks, (unsigned long long)p->errors);
	}
	if (n > 1) {
		printf("\n%-6s %8s %8s %6s %8s %6s %10s %17s %7s %7s\n", "chunk", "GB/s", "raw 1",
		       "ratio", "raw N", "ratio", "chunks/s", "room p50/p99 us", "A CPU%", "B CPU%");
		for (unsigned i = 0; i < n; i++) {
			const struct local_point *p = &pt[i];
			char r1[16], rn[16], rl[32], ca[16], cb[16];
			snprintf(rl, sizeof(rl), "%.0f/%.0f", p->room_lat.p50, p->room_lat.p99);
			printf("%-6s %8.3f %8.3f %6s %8.3f %6s %10s %17s %7s %7s\n",
			       bench_size_str(p->chunk, a, sizeof(a)), p->gbps, p->tcp1_gbps,
			       num(ratio(p->gbps, p->tcp1_gbps), r1, sizeof(r1)), p->tcpn_gbps,
			       num(ratio(p->gbps, p->tcpn_gbps), rn, sizeof(rn)),
			       human(p->chunks_s, c, sizeof(c)), rl, num(p->proxy_cpu, ca, sizeof(ca)),
			       num(p->proxy_rx_cpu, cb, sizeof(cb)));
		}
	}
	printf("\nHow to read it:\n");
	if (o->mode == MODE_VERBS)
		printf("  verbs: the same two proxies with --rdma-device %s: every chunk is pulled by "
		       "RDMA READ from A's slot into B's posted slot (the fence decides at the "
		       "completion), under a key of its own that A grants before and revokes after "
		       "(--proxy-arg=--rdma-keys=regions measures the fallback for a device without "
		       "windows); the baselines below are the device's ib_read_bw and, for scale, "
		       "raw TCP; latency floors and chunks/s use ib_read_bw.%s\n", o->rdma_device,
		       strncmp(o->rdma_device, "rxe", 3) ? ""
		       : " The device is soft-RoCE (rxe): the CPU does the NIC's work, so no figure "
			 "here is a NIC's (and under emulation no speed means anything).");
	for (size_t i = 0; i < sizeof(tcp_defs) / sizeof(tcp_defs[0]); i++)
		printf("  %s: %s.\n", tcp_defs[i][0], tcp_defs[i][1]);
}

static void json(const struct bench_opts *o, const struct local_point *pt, unsigned n,
		 const struct bench_proxy_info *px, const char *path)
{
	struct jw j;
	json_head(&j, o);
	json_proxy(&j, px);
	jw_open(&j, "transport", '{');
	jw_str(&j, "path", path);
	jw_int(&j, "tcp_streams", o->tcp_streams);
	jw_close(&j, '}');
	jw_open(&j, "definitions", '{');
	for (size_t i = 0; i < sizeof(tcp_defs) / sizeof(tcp_defs[0]); i++)
		jw_str(&j, tcp_defs[i][0], tcp_defs[i][1]);
	jw_close(&j, '}');
	jw_open(&j, "points", '[');
	for (unsigned i = 0; i < n; i++) {
		const struct local_point *p = &pt[i];
		double raw_cps = raw_best(p) > 0 ? raw_best(p) * 1e9 / (double)p->chunk : NAN;
		double fl = lat_floor_us(o, p);
		jw_open(&j, NULL, '{');
		json_point_counts(&j, p);
		jw_lat(&j, "room_latency_us", &p->room_lat);
		jw_lat(&j, "chunk_latency_us", &p->chunk_lat);
		jw_num_na(&j, "proxy_a_cpu_pct", p->proxy_cpu);
		jw_num_na(&j, "proxy_b_cpu_pct", p->proxy_rx_cpu);
		jw_open(&j, "baseline", '{');
		jw_num_na(&j, "raw_tcp_1_gbps", p->tcp1_gbps);
		jw_num_na(&j, "raw_tcp_n_gbps", p->tcpn_gbps);
		if (o->mode == MODE_VERBS)
			jw_num_na(&j, "ib_read_bw_gbps", p->rdma_gbps);
		jw_num(&j, "raw_tcp_chunks_per_s", raw_cps);
		jw_num(&j, "room_latency_floor_us", fl);
		jw_close(&j, '}');
		jw_open(&j, "ratio", '{');
		jw_num(&j, "gbps_vs_raw_tcp_1", ratio(p->gbps, p->tcp1_gbps));
		jw_num(&j, "gbps_vs_raw_tcp_n", ratio(p->gbps, p->tcpn_gbps));
		if (o->mode == MODE_VERBS)
			jw_num(&j, "gbps_vs_ib_read_bw", ratio(p->gbps, p->rdma_gbps));
		jw_num(&j, "chunks_per_s_vs_raw_tcp", ratio(p->chunks_s, raw_cps));
		jw_num(&j, "room_p50_vs_floor", p->room_lat.n ? ratio(p->room_lat.p50, fl) : NAN);
		jw_num(&j, "room_p99_vs_floor", p->room_lat.n ? ratio(p->room_lat.p99, fl) : NAN);
		jw_close(&j, '}');
		if (o->mode == MODE_VERBS) {
			jw_open(&j, "keys", '{');
			jw_str(&j, "kind", keys_name(p));
			jw_num(&j, "binds_per_chunk", p->binds);
			jw_num(&j, "invalidates_per_chunk", p->invalidates);
			jw_num(&j, "regions_per_chunk", p->regions);
			jw_num(&j, "region_frees_per_chunk", p->region_frees);
			jw_close(&j, '}');
		}
		jw_close(&j, '}');
	}
	jw_close(&j, ']');
	json_end(&j);
}

static void csv(const struct bench_opts *o, const struct local_point *pt, unsigned n)
{
	printf("mode,path,tcp_streams,chunk_bytes,room_bytes,payload,pairs,rooms_in_flight,seconds,"
	       "bytes,chunks,rooms,errors,gbps,chunks_per_s,room_p50_us,room_p99_us,chunk_p50_us,"
	       "chunk_p99_us,proxy_a_cpu_pct,proxy_b_cpu_pct,raw_tcp_1_gbps,raw_tcp_n_gbps,"
	       "gbps_vs_raw_tcp_1,gbps_vs_raw_tcp_n\n");
	for (unsigned i = 0; i < n; i++) {
		const struct local_point *p = &pt[i];
		printf("tcp,%s,%u,%llu,%llu,%s,%u,%u,", o->netns ? "veth" : "loopback", o->tcp_streams,
		       (unsigned long long)p->chunk, (unsigned long long)p->room_bytes,
		       bench_payload_str(o->payload), o->senders, o->rooms);
		csv_point_counts(p);
		csv_num(p->room_lat.n ? p->room_lat.p50 : NAN, false);
		csv_num(p->room_lat.n ? p->room_lat.p99 : NAN, false);
		csv_num(p->chunk_lat.n ? p->chunk_lat.p50 : NAN, false);
		csv_num(p->chunk_lat.n ? p->chunk_lat.p99 : NAN, false);
		csv_num(p->proxy_cpu, false);
		csv_num(p->proxy_rx_cpu, false);
		csv_num(p->tcp1_gbps > 0 ? p->tcp1_gbps : NAN, false);
		csv_num(p->tcpn_gbps > 0 ? p->tcpn_gbps : NAN, false);
		csv_num(ratio(p->gbps, p->tcp1_gbps), false);
		csv_num(ratio(p->gbps, p->tcpn_gbps), true);
	}
}

void report_tcp(const struct bench_opts *o, const struct local_point *pt, unsigned n,
		const struct bench_proxy_info *px, const char *path)
{
	if (o->fmt == FMT_JSON)
		json(o, pt, n, px, path);
	else if (o->fmt == FMT_CSV)
		csv(o, pt, n);
	else
		table(o, pt, n, px, path);
	fflush(stdout);
}
