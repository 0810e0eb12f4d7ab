/* SPDX-License-Identifier: MIT */
/* kvstage-stat --json: one JSON object per sample, on one line. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "layout.h"
#include "parse.h"
#include "stat.h"
#include "statnames.h"

void json_key(const char *key)
{
	kvs_json_string(stdout, key);
	putchar(':');
}

void print_json(const struct kvs_ctrl *c, size_t len, const char *path, int slots,
		const struct rates *r, const struct tables *tb)
{
	const struct kvs_stats *st = &c->stats;
	char inst[24];
	snprintf(inst, sizeof(inst), "%016llx", (unsigned long long)c->instance);
	printf("{");
	json_key("socket");
	kvs_json_string(stdout, path);
	printf(",\"up\":true,\"draining\":%s,\"pid\":%d,", S(draining) ? "true" : "false",
	       c->proxy_pid);
	json_key("instance");
	kvs_json_string(stdout, inst);
	printf(",\"uptime_s\":%.3f,", uptime_s(c));
	if (r && r->have)
		printf("\"rates\":{\"rooms_per_s\":%.3f,\"aborts_per_s\":%.3f,\"failures_per_s\":%."
		       "3f,"
		       "\"chunks_per_s\":%.3f,\"bytes_per_s\":%.0f,\"tcp_tx_bytes_per_s\":%.0f,"
		       "\"tcp_rx_bytes_per_s\":%.0f,\"rdma_rx_bytes_per_s\":%.0f},",
		       r->per_s[R_ROOMS], r->per_s[R_ABORTS], r->per_s[R_FAILS], r->per_s[R_CHUNKS],
		       r->per_s[R_BYTES], r->per_s[R_TCP_TX], r->per_s[R_TCP_RX],
		       r->per_s[R_RDMA_RX]);
	else if (r)
		printf("\"rates\":null,");
	const char *without[4];
	unsigned nw = built_without(c, without);
	printf("\"built_without\":[");
	for (unsigned i = 0; i < nw; i++)
		printf("%s\"%s\"", i ? "," : "", without[i]);
	printf("],");
	printf("\"slot_count\":%u,\"slot_size\":%llu,\"pool_size\":%llu,\"hugepages\":%s,"
	       "\"locked\":%s,\"failpoints\":%s,\"slot_metadata_bytes\":%zu,\"slots\":{",
	       c->slot_count, (unsigned long long)c->slot_size, (unsigned long long)c->pool_size,
	       c->flags & KVS_CTRL_HUGEPAGES ? "true" : "false",
	       c->flags & KVS_CTRL_LOCKED ? "true" : "false",
	       c->flags & KVS_CTRL_FAILPOINTS ? "true" : "false", sizeof(struct kvs_slot));
	for (int i = 0; i < KVS_SLOT_NSTATES; i++) {
		if (i)
			putchar(',');
		json_key(state_names[i]);
		printf("%llu", S(slots[i]));
	}
	printf("},\"rooms\":{\"open\":%llu,\"done\":%llu,\"aborted\":%llu,\"failed\":%llu,"
	       "\"timed_out\":%llu},",
	       S(rooms_open), S(rooms_done), S(rooms_aborted), S(rooms_failed), S(rooms_timed_out));
	printf("\"clients\":{\"now\":%llu,\"total\":%llu,\"closed\":%llu,\"died\":%llu,"
	       "\"refused\":%llu},",
	       S(clients), S(clients_total), S(clients_closed), S(clients_died),
	       S(clients_refused));
	printf("\"rejected\":{\"stale\":%llu,\"perm\":%llu,\"busy\":%llu,\"inval\":%llu,"
	       "\"token\":%llu,\"nobufs\":%llu},",
	       S(rej_stale), S(rej_perm), S(rej_busy), S(rej_inval), S(rej_token), S(rej_nobufs));
	printf("\"chunks_moved\":%llu,\"bytes_moved\":%llu,\"ops\":%llu,\"events\":%llu,"
	       "\"events_dropped\":%llu,\"tombstones_reaped\":%llu,\"sleeps\":%llu,"
	       "\"log_suppressed\":%llu",
	       S(chunks_moved), S(bytes_moved), S(ops), S(events), S(events_dropped),
	       S(tombstones_reaped), S(sleeps), S(log_suppressed));
	printf(",\"tcp\":{\"peers\":%llu,\"lost\":%llu,\"auth_failed\":%llu,\"refused\":%llu,"
	       "\"frames_refused\":%llu,\"frames_ignored\":%llu,\"crc_errors\":%llu,"
	       "\"chunks_discarded\":%llu,\"bytes_tx\":%llu,\"bytes_rx\":%llu,"
	       "\"deadlines\":%llu,\"evicted\":%llu,\"closed\":%llu,\"pings\":%llu,"
	       "\"send_calls\":%llu,\"recv_calls\":%llu,\"epoll_waits\":%llu,"
	       "\"epoll_ctls\":%llu,\"lowat_calls\":%llu,\"zerocopy_sends\":%llu,"
	       "\"zerocopy_copied\":%llu},"
	       "\"rdma\":{\"reads\":%llu,\"bytes_rx\":%llu,\"binds\":%llu,\"invalidates\":%llu,"
	       "\"regions\":%llu,\"region_frees\":%llu,\"reads_refused\":%llu,"
	       "\"links_lost\":%llu,\"sessions\":%llu},",
	       S(peer_sessions), S(peer_lost), S(peer_auth_failed), S(peer_refused),
	       S(peer_frames_refused), S(peer_frames_ignored), S(peer_crc_errors),
	       S(chunks_discarded), B("tcp_bytes_tx"), B("tcp_bytes_rx"), S(peer_timeouts),
	       S(peer_evicted), S(peer_closed), S(peer_pings), B("tcp_send_calls"),
	       B("tcp_recv_calls"), S(peer_epoll_waits), S(peer_epoll_ctls), B("tcp_lowat_calls"),
	       B("tcp_zc_sends"), B("tcp_zc_copied"), B("rdma_reads"), B("rdma_bytes_rx"),
	       B("rdma_binds"), B("rdma_invalidates"), B("rdma_regions"), B("rdma_region_frees"),
	       B("rdma_reads_refused"), B("rdma_links_lost"), B("rdma_sessions"));
	/* Every counter of the block, by the name its owner gave it (a data
	 * path's: a rail's, a test's), whether or not it is shown above. */
	uint32_t nb;
	const struct kvs_counters *b = kvs_counters_of(c, len, &nb);
	printf("\"counters\":{");
	for (uint32_t i = 0; i < nb; i++) {
		char name[sizeof(b->rec[i].name) + 1] = "";
		memcpy(name, b->rec[i].name, sizeof(b->rec[i].name));
		printf("%s", i ? "," : "");
		kvs_json_string(stdout, name);
		printf(":%llu",
		       (unsigned long long)__atomic_load_n(&b->value[i], __ATOMIC_RELAXED));
	}
	printf("},\"peers\":[");
	for (uint32_t i = 0; i < tb->npe; i++) {
		const struct peer_row *k = &tb->pe[i];
		printf("%s{\"endpoint\":", i ? "," : "");
		kvs_json_string(stdout, k->ep);
		printf(",\"state\":\"%s\",\"streams\":%u,\"instance\":\"%016llx\",\"bytes_tx\":%"
		       "llu,"
		       "\"bytes_rx\":%llu,\"chunks_sunk\":%llu,\"rdma\":%s,\"reads_refused\":%u,"
		       "\"keys\":",
		       peer_state(k->p.state), k->p.streams, (unsigned long long)k->p.instance,
		       (unsigned long long)k->p.bytes_tx, (unsigned long long)k->p.bytes_rx,
		       (unsigned long long)k->p.chunks_sunk,
		       k->p.flags & KVS_PEER_RDMA ? "true" : "false", k->p.reads_refused);
		const char *keys = peer_keys(k->p.flags);
		if (keys)
			printf("\"%s\"}", keys);
		else
			printf("null}");
	}
	printf("],\"trace\":{\"written\":%llu,\"dropped\":%llu}", S(trace_written),
	       S(trace_dropped));
	/* The clients, by id; with --watch each has its rates (null on the
	 * first sample that has it). */
	if (tb->published) {
		printf(",\"clients_table\":[");
		for (uint32_t i = 0; i < tb->ncl; i++) {
			const struct client *k = &tb->cl[i];
			printf("%s{\"id\":%u,\"pid\":%d,\"uid\":%u,\"gid\":%u,\"command\":",
			       i ? "," : "", k->r.id, (int)k->r.pid, k->r.uid, k->r.gid);
			if (k->comm[0])
				kvs_json_string(stdout, k->comm);
			else
				printf("null");
			printf(",\"since_ns\":%llu,\"leases\":%u,\"inflight\":%u,\"rooms_open\":%"
			       "llu,"
			       "\"rooms_done\":%llu,\"rooms_aborted\":%llu,\"rooms_failed\":%llu,"
			       "\"ops\":%llu,\"rejects\":%llu,\"chunks_sent\":%llu,\"bytes_sent\":%"
			       "llu,"
			       "\"chunks_recv\":%llu,\"bytes_recv\":%llu",
			       (unsigned long long)k->r.since_ns, k->leases, k->inflight,
			       (unsigned long long)k->r.rooms, (unsigned long long)k->r.rooms_done,
			       (unsigned long long)k->r.rooms_aborted,
			       (unsigned long long)k->r.rooms_failed, (unsigned long long)k->r.ops,
			       (unsigned long long)k->r.rejects,
			       (unsigned long long)k->r.chunks_sent,
			       (unsigned long long)k->r.bytes_sent,
			       (unsigned long long)k->r.chunks_recv,
			       (unsigned long long)k->r.bytes_recv);
			if (k->have)
				printf(",\"rates\":{\"ops_per_s\":%.3f,\"chunks_sent_per_s\":%.3f,"
				       "\"bytes_sent_per_s\":%.0f,\"chunks_recv_per_s\":%.3f,"
				       "\"bytes_recv_per_s\":%.0f}",
				       k->ops_s, k->chunks_sent_s, k->bytes_sent_s,
				       k->chunks_recv_s, k->bytes_recv_s);
			else if (r)
				printf(",\"rates\":null");
			printf("}");
		}
		printf("]");
	} else {
		printf(",\"clients_table\":null");
	}
	if (slots) {
		uint32_t n = table_slots(c, len);
		const struct kvs_slot *t = n ? (const void *)((const char *)c + c->slots_off)
					     : NULL;
		printf(",\"slot_table\":[");
		int first = 1;
		for (uint32_t i = 0; i < n; i++) {
			struct kvs_slot s = t[i];
			if (s.state == KVS_SLOT_FREE || s.state >= KVS_SLOT_NSTATES)
				continue;
			printf("%s{\"slot\":%u,\"state\":", first ? "" : ",", i);
			kvs_json_string(stdout, state_names[s.state]);
			printf(",\"epoch\":%u,\"owner\":%u,\"pins\":%u}", s.epoch, s.owner, s.pins);
			first = 0;
		}
		printf("]");
		if (n < c->slot_count)
			printf(",\"slot_table_truncated\":true");
	}
	printf("}\n");
}
