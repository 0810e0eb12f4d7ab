/* SPDX-License-Identifier: MIT */
/*
 * The metrics page, in Prometheus's text exposition format (0.0.4). It runs
 * on the metrics thread and reads only what the loop publishes with
 * relaxed stores: the counters, the peer table, the histograms, and the
 * fields of the control segment that never change after start.
 */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "core/hist.h"
#include "kvstage.h"
#include "daemon/metrics.h"
#include "core/proxy.h"
#include "core/clients.h"
#include "core/pool.h"
#include "statnames.h"

#define ST(f) offsetof(struct kvs_stats, f)

struct metric {
	const char *name, *type, *help;
	size_t off; /* in struct kvs_stats */
};

/* One line each: every counter of struct kvs_stats kvstage-stat shows,
 * named after Prometheus's conventions (base units, _total on counters).
 * The counter block's follow them, named by their records. */
static const struct metric plain[] = {
	{ "kvstage_rooms_open", "gauge", "Rooms not yet freed.", ST(rooms_open) },
	{ "kvstage_rooms_done_total", "counter",
	  "Rooms (or this proxy's halves of them) that completed: every chunk landed.",
	  ST(rooms_done) },
	{ "kvstage_rooms_aborted_total", "counter", "Rooms aborted, by a client or a peer.",
	  ST(rooms_aborted) },
	{ "kvstage_rooms_failed_total", "counter", "Rooms failed by a transport or the proxy.",
	  ST(rooms_failed) },
	{ "kvstage_rooms_timed_out_total", "counter",
	  "Rooms aborted after --room-timeout without progress.", ST(rooms_timed_out) },
	{ "kvstage_clients", "gauge", "Client connections attached now.", ST(clients) },
	{ "kvstage_clients_attached_total", "counter", "Client connections attached since start.",
	  ST(clients_total) },
	{ "kvstage_clients_closed_total", "counter", "Clients that said goodbye (kvs_close).",
	  ST(clients_closed) },
	{ "kvstage_clients_died_total", "counter", "Clients that hung up without kvs_close.",
	  ST(clients_died) },
	{ "kvstage_clients_refused_total", "counter",
	  "Connections refused (credentials, limits, bad hello).", ST(clients_refused) },
	{ "kvstage_ops_total", "counter", "Submission records the proxy took.", ST(ops) },
	{ "kvstage_events_total", "counter", "Events posted to clients.", ST(events) },
	{ "kvstage_events_dropped_total", "counter",
	  "Events a full completion ring could not take.", ST(events_dropped) },
	{ "kvstage_chunks_moved_total", "counter",
	  "Chunks that landed in a receiver's slot here, or left for a peer.", ST(chunks_moved) },
	{ "kvstage_bytes_moved_total", "counter", "Payload bytes of those chunks.",
	  ST(bytes_moved) },
	{ "kvstage_chunks_discarded_total", "counter",
	  "Late or refused chunks the fence kept out of any slot.", ST(chunks_discarded) },
	{ "kvstage_tombstones_reaped_total", "counter",
	  "Tombstoned slots freed once their transport quiesced.", ST(tombstones_reaped) },
	{ "kvstage_loop_sleeps_total", "counter", "Times the polling loop went to sleep.",
	  ST(sleeps) },
	{ "kvstage_draining", "gauge", "1 once SIGTERM was seen.", ST(draining) },
	{ "kvstage_log_lines_suppressed_total", "counter", "Log lines the rate limits kept back.",
	  ST(log_suppressed) },
	{ "kvstage_peer_sessions", "gauge", "Sessions with other proxies up now.",
	  ST(peer_sessions) },
	{ "kvstage_peer_sessions_lost_total", "counter",
	  "Peer sessions lost: dropped, cut, or silent past --peer-timeout.", ST(peer_lost) },
	{ "kvstage_peer_drain_notices_total", "counter", "Peers that said they are draining.",
	  ST(peer_byes) },
	{ "kvstage_peer_auth_failures_total", "counter",
	  "Peer connections that did not prove the secret in time.", ST(peer_auth_failed) },
	{ "kvstage_peer_connections_refused_total", "counter",
	  "Peer connections refused, or unproven ones dropped, for want of room.",
	  ST(peer_refused) },
	{ "kvstage_peer_deadlines_total", "counter",
	  "Peer sessions and handshakes lost at a deadline (joining, silence, an answer owed, "
	  "quiescence).",
	  ST(peer_timeouts) },
	{ "kvstage_peer_evictions_total", "counter",
	  "Joining or idle peer sessions dropped to make room for new ones.", ST(peer_evicted) },
	{ "kvstage_peer_sessions_closed_total", "counter",
	  "Peer sessions closed quietly: idle, or their peer restarted.", ST(peer_closed) },
	{ "kvstage_peer_pings_total", "counter", "PINGs sent to keep quiet peer sessions alive.",
	  ST(peer_pings) },
	{ "kvstage_peer_frames_refused_total", "counter",
	  "Malformed, forged or replayed peer frames (their connection dropped).",
	  ST(peer_frames_refused) },
	{ "kvstage_peer_frames_ignored_total", "counter",
	  "Authentic peer frames naming no room of ours.", ST(peer_frames_ignored) },
	{ "kvstage_peer_checksum_errors_total", "counter",
	  "Chunks whose payload failed its CRC32C.", ST(peer_crc_errors) },
	{ "kvstage_peer_epoll_waits_total", "counter", "epoll_wait calls of the peer plane.",
	  ST(peer_epoll_waits) },
	{ "kvstage_peer_epoll_ctls_total", "counter", "epoll_ctl calls of the peer plane.",
	  ST(peer_epoll_ctls) },
	{ "kvstage_trace_written_total", "counter", "Lifecycle trace lines written (--trace-file).",
	  ST(trace_written) },
	{ "kvstage_trace_dropped_total", "counter",
	  "Lifecycle trace records dropped: its buffer was full, or the sink failed.",
	  ST(trace_dropped) },
};

static uint64_t ld(const uint64_t *v)
{
	return __atomic_load_n(v, __ATOMIC_RELAXED);
}

static uint64_t stat_at(const struct kvs_stats *st, size_t off)
{
	return ld((const uint64_t *)((const char *)st + off));
}

static void head(FILE *f, const char *name, const char *type, const char *help)
{
	fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* A label value: the format's three escapes; bytes that are not printable
 * ASCII (the table is the loop's, read while it may write) become '?'. */
static void label(FILE *f, const char *s, size_t max)
{
	for (size_t i = 0; i < max && s[i]; i++) {
		char ch = s[i];
		if (ch == '\\' || ch == '"')
			fprintf(f, "\\%c", ch);
		else if (ch == '\n')
			fputs("\\n", f);
		else
			fputc(ch >= 0x20 && ch < 0x7f ? ch : '?', f);
	}
}

static void histogram(FILE *f, const char *name, const char *help, const struct kvsp_hist *h)
{
	head(f, name, "histogram", help);
	uint64_t cum = 0;
	for (unsigned b = 0; b <= KVSP_HIST_BUCKETS; b++) {
		cum += ld(&h->count[b]);
		if (b < KVSP_HIST_BUCKETS)
			fprintf(f, "%s_bucket{le=\"%.9g\"} %llu\n", name,
				(double)h->upper_ns[b] / 1e9, (unsigned long long)cum);
		else
			fprintf(f, "%s_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long)cum);
	}
	/* _count is the buckets' sum as read, so it always equals +Inf. */
	fprintf(f, "%s_sum %.9f\n%s_count %llu\n", name, (double)ld(&h->sum_ns) / 1e9, name,
		(unsigned long long)cum);
}

static void peers(FILE *f, const struct kvs_ctrl *c)
{
	const struct kvs_peer *tab = (const void *)((const char *)c + c->peers_off);
	static const struct {
		const char *name, *type, *help;
		size_t off;
	} cols[] = {
		{ "kvstage_peer_up", "gauge", "1 for a peer session that is up, 0 while it joins.",
		  0 },
		{ "kvstage_peer_streams", "gauge", "TCP connections in the session.", 0 },
		{ "kvstage_peer_sent_bytes_total", "counter", "Bytes sent to the peer.",
		  offsetof(struct kvs_peer, bytes_tx) },
		{ "kvstage_peer_received_bytes_total", "counter", "Bytes received from the peer.",
		  offsetof(struct kvs_peer, bytes_rx) },
		{ "kvstage_peer_chunks_discarded_total", "counter",
		  "The peer's chunks the fence kept out.", offsetof(struct kvs_peer, chunks_sunk) },
		{ "kvstage_peer_rdma_reads_refused_total", "counter",
		  "The peer's READs our NIC refused.", 0 },
	};
	for (unsigned k = 0; k < sizeof(cols) / sizeof(cols[0]); k++) {
		bool any = false;
		for (uint32_t i = 0; c->peers_off && i < c->peer_count; i++) {
			const struct kvs_peer *e = &tab[i];
			uint32_t state = __atomic_load_n(&e->state, __ATOMIC_RELAXED);
			if (state == KVS_PEER_FREE)
				continue;
			if (!any)
				head(f, cols[k].name, cols[k].type, cols[k].help);
			any = true;
			uint32_t fl = __atomic_load_n(&e->flags, __ATOMIC_RELAXED);
			uint64_t v =
				k == 0	 ? state == KVS_PEER_UP
				: k == 1 ? __atomic_load_n(&e->streams, __ATOMIC_RELAXED)
				: k == 5 ? __atomic_load_n(&e->reads_refused, __ATOMIC_RELAXED)
					 : ld((const uint64_t *)((const char *)e + cols[k].off));
			fprintf(f, "%s{peer=\"", cols[k].name);
			label(f, e->endpoint, sizeof(e->endpoint));
			fprintf(f, "\",peer_instance=\"%016llx\",rdma=\"%s\",keys=\"%s\"} %llu\n",
				(unsigned long long)ld(&e->instance),
				fl & KVS_PEER_RDMA ? "yes" : "no",
				!(fl & KVS_PEER_RDMA)	       ? "none"
				: !(fl & KVS_PEER_KEYS_REGION) ? "windows"
				: !(fl & KVS_PEER_KEYS_WINDOW) ? "regions"
							       : "windows+regions",
				(unsigned long long)v);
		}
	}
}

/* One series per attached client (at most --max-clients), from the clients
 * table kvstage-stat --top reads. */
static void clients(FILE *f, const struct kvsp *p)
{
	static const struct {
		const char *name, *type, *help;
		size_t off;
	} cols[] = {
		{ "kvstage_client_ops_total", "counter",
		  "Submission records taken from the client's ring.",
		  offsetof(struct kvs_client_row, ops) },
		{ "kvstage_client_requests_rejected_total", "counter",
		  "The client's requests refused.", offsetof(struct kvs_client_row, rejects) },
		{ "kvstage_client_rooms", "gauge",
		  "Rooms the client is in that have not ended for it.",
		  offsetof(struct kvs_client_row, rooms) },
		{ "kvstage_client_rooms_done_total", "counter",
		  "The client's rooms that completed.",
		  offsetof(struct kvs_client_row, rooms_done) },
		{ "kvstage_client_rooms_aborted_total", "counter",
		  "The client's rooms that were aborted.",
		  offsetof(struct kvs_client_row, rooms_aborted) },
		{ "kvstage_client_rooms_failed_total", "counter", "The client's rooms that failed.",
		  offsetof(struct kvs_client_row, rooms_failed) },
		{ "kvstage_client_sent_chunks_total", "counter",
		  "Chunks the client sent into open rooms.",
		  offsetof(struct kvs_client_row, chunks_sent) },
		{ "kvstage_client_sent_bytes_total", "counter", "Bytes of those chunks.",
		  offsetof(struct kvs_client_row, bytes_sent) },
		{ "kvstage_client_received_chunks_total", "counter",
		  "Chunks of rooms the client received whole.",
		  offsetof(struct kvs_client_row, chunks_recv) },
		{ "kvstage_client_received_bytes_total", "counter", "Bytes of those rooms.",
		  offsetof(struct kvs_client_row, bytes_recv) },
	};
	const struct kvs_client_row *tab = kvsp_client_rows(p);
	uint32_t n = p->cfg.max_clients, have = 0;
	struct kvs_client_row *rows = calloc(n, sizeof(*rows));
	if (!rows)
		return;
	for (uint32_t i = 0; i < n; i++)
		if (kvs_client_row_read(&tab[i], &rows[have]))
			have++;
	for (unsigned k = 0; k < sizeof(cols) / sizeof(cols[0]) && have; k++) {
		head(f, cols[k].name, cols[k].type, cols[k].help);
		for (uint32_t i = 0; i < have; i++)
			fprintf(f, "%s{client=\"%u\",pid=\"%d\",uid=\"%u\"} %llu\n", cols[k].name,
				rows[i].id, rows[i].pid, rows[i].uid,
				(unsigned long long)*(const uint64_t *)((const char *)&rows[i] +
									cols[k].off));
	}
	free(rows);
}

int kvsp_metrics_render(const struct kvsp *p, FILE *f)
{
	const struct kvs_ctrl *c = p->ctrl;
	const struct kvs_stats *st = p->stats;

	head(f, "kvstage_info", "gauge", "The proxy: its version and this start's instance id.");
	fprintf(f, "kvstage_info{version=\"%s\",proxy_instance=\"%016llx\"} 1\n",
		KVS_VERSION_STRING, (unsigned long long)c->instance);
	head(f, "kvstage_pool_slots", "gauge", "Slots in the pool.");
	fprintf(f, "kvstage_pool_slots %u\n", c->slot_count);
	head(f, "kvstage_slot_size_bytes", "gauge", "Bytes per slot.");
	fprintf(f, "kvstage_slot_size_bytes %llu\n", (unsigned long long)c->slot_size);
	head(f, "kvstage_slots", "gauge", "Slots in each state now.");
	static const char *const states[KVS_SLOT_NSTATES] = {
		"free", "leased", "inflight", "tombstone", "recv_posted", "recv_filled",
	};
	for (int s = 0; s < KVS_SLOT_NSTATES; s++)
		fprintf(f, "kvstage_slots{state=\"%s\"} %llu\n", states[s],
			(unsigned long long)ld(&st->slots[s]));
	for (unsigned i = 0; i < sizeof(plain) / sizeof(plain[0]); i++) {
		head(f, plain[i].name, plain[i].type, plain[i].help);
		fprintf(f, "%s %llu\n", plain[i].name,
			(unsigned long long)stat_at(st, plain[i].off));
	}
	uint32_t nb;
	const struct kvs_counters *b = kvs_counters_of(c, p->ctrl_size, &nb);
	for (uint32_t i = 0; i < nb; i++) {
		const struct kvs_counter *r = &b->rec[i];
		head(f, r->metric, r->kind == KVS_GAUGE ? "gauge" : "counter", r->help);
		fprintf(f, "%s %llu\n", r->metric, (unsigned long long)ld(&b->value[i]));
	}
	head(f, "kvstage_requests_rejected_total", "counter",
	     "Client requests refused, by reason (stale epoch, not the owner, busy, invalid, wrong "
	     "room token, pool exhausted).");
	static const struct {
		const char *why;
		size_t off;
	} rej[] = {
		{ "stale", ST(rej_stale) }, { "perm", ST(rej_perm) },
		{ "busy", ST(rej_busy) },   { "inval", ST(rej_inval) },
		{ "token", ST(rej_token) }, { "nobufs", ST(rej_nobufs) },
	};
	for (unsigned i = 0; i < sizeof(rej) / sizeof(rej[0]); i++)
		fprintf(f, "kvstage_requests_rejected_total{reason=\"%s\"} %llu\n", rej[i].why,
			(unsigned long long)stat_at(st, rej[i].off));
	peers(f, c);
	clients(f, p);
	histogram(
		f, "kvstage_room_duration_seconds",
		"Completed rooms (this proxy's halves), from their open here to their last chunk.",
		&p->room_hist);
	histogram(f, "kvstage_chunk_latency_seconds",
		  "Sent chunks, from the proxy taking them until they landed (local room), were "
		  "all in the socket (tcp) or the peer had read them (RDMA).",
		  &p->chunk_hist);
	/* The process: CPU (the loop spins, so this is the proxy's cost) and start. */
	struct rusage ru;
	if (getrusage(RUSAGE_SELF, &ru) == 0) {
		head(f, "process_cpu_seconds_total", "counter",
		     "User and system CPU time spent, in seconds.");
		fprintf(f, "process_cpu_seconds_total %.6f\n",
			(double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
				(double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6);
	}
	head(f, "process_start_time_seconds", "gauge",
	     "Start time of the process since the Unix epoch, in seconds.");
	fprintf(f, "process_start_time_seconds %.3f\n", (double)c->started_ns / 1e9);
	return ferror(f) ? -EIO : 0;
}
