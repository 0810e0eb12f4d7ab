/* SPDX-License-Identifier: MIT */
/* kvstage-stat: the default output, a block of labelled lines per sample
 * (and with --slots every slot that is not free). */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "layout.h"
#include "parse.h"
#include "stat.h"
#include "statnames.h"

void print_human(const struct kvs_ctrl *c, size_t len, const char *path, int slots, int restarted,
		 const struct rates *r, const struct tables *tb)
{
	const struct kvs_stats *st = &c->stats;
	printf("kvstaged %s: %s  pid %d  instance %016llx  uptime %.1f s%s\n", path, state_word(st),
	       c->proxy_pid, (unsigned long long)c->instance, uptime_s(c),
	       restarted ? "  (new instance)" : "");
	char slot[32], pool[32];
	printf("pool      %u slots x %s = %s  hugepages %s  locked %s  failpoints %s\n",
	       c->slot_count, kvs_format_size(c->slot_size, slot, sizeof(slot)),
	       kvs_format_size(c->pool_size, pool, sizeof(pool)),
	       c->flags & KVS_CTRL_HUGEPAGES ? "yes" : "no",
	       c->flags & KVS_CTRL_LOCKED ? "yes" : "no",
	       c->flags & KVS_CTRL_FAILPOINTS ? "on" : "off");
	const char *without[4];
	unsigned nw = built_without(c, without);
	for (unsigned i = 0; i < nw; i++)
		printf("%s%s%s", i ? ", " : "built without: ", without[i], i + 1 == nw ? "\n" : "");
	printf("slots    ");
	for (int i = 0; i < KVS_SLOT_NSTATES; i++)
		printf(" %s %llu", state_names[i], S(slots[i]));
	printf("\nrooms     open %llu  done %llu  aborted %llu  failed %llu  timed-out %llu\n",
	       S(rooms_open), S(rooms_done), S(rooms_aborted), S(rooms_failed), S(rooms_timed_out));
	printf("clients   now %llu  total %llu  closed %llu  died %llu  refused %llu\n", S(clients),
	       S(clients_total), S(clients_closed), S(clients_died), S(clients_refused));
	printf("rejected  stale %llu  perm %llu  busy %llu  inval %llu  token %llu  nobufs %llu"
	       "  log-suppressed %llu\n",
	       S(rej_stale), S(rej_perm), S(rej_busy), S(rej_inval), S(rej_token), S(rej_nobufs),
	       S(log_suppressed));
	printf("traffic   chunks %llu  bytes %llu  ops %llu  events %llu  dropped %llu  reaped %llu"
	       "  sleeps %llu\n",
	       S(chunks_moved), S(bytes_moved), S(ops), S(events), S(events_dropped),
	       S(tombstones_reaped), S(sleeps));
	printf("tcp       peers %llu  lost %llu  auth-failed %llu  refused %llu  frames-refused "
	       "%llu"
	       "  frames-ignored %llu  crc-errors %llu  discarded %llu  tx %llu  rx %llu\n",
	       S(peer_sessions), S(peer_lost), S(peer_auth_failed), S(peer_refused),
	       S(peer_frames_refused), S(peer_frames_ignored), S(peer_crc_errors),
	       S(chunks_discarded), B("tcp_bytes_tx"), B("tcp_bytes_rx"));
	printf("peers     deadlines %llu  evicted %llu  closed %llu  pings %llu\n",
	       S(peer_timeouts), S(peer_evicted), S(peer_closed), S(peer_pings));
	printf("syscalls  tcp-sends %llu  tcp-recvs %llu  epoll-waits %llu  epoll-ctls %llu  "
	       "lowat-sets %llu  zerocopy-sends %llu  zerocopy-copied %llu\n",
	       B("tcp_send_calls"), B("tcp_recv_calls"), S(peer_epoll_waits), S(peer_epoll_ctls),
	       B("tcp_lowat_calls"), B("tcp_zc_sends"), B("tcp_zc_copied"));
	printf("rdma      sessions %llu  reads %llu  rx %llu  binds %llu  invalidates %llu  "
	       "regions %llu"
	       "  region-frees %llu  reads-refused %llu  links-lost %llu\n",
	       B("rdma_sessions"), B("rdma_reads"), B("rdma_bytes_rx"), B("rdma_binds"),
	       B("rdma_invalidates"), B("rdma_regions"), B("rdma_region_frees"),
	       B("rdma_reads_refused"), B("rdma_links_lost"));
	printf("trace     written %llu  dropped %llu\n", S(trace_written), S(trace_dropped));
	/* The block's other counters (a data path's this tool does not name), as
	 * the proxy names them. */
	uint32_t nb;
	const struct kvs_counters *b = kvs_counters_of(c, len, &nb);
	bool any = false;
	for (uint32_t i = 0; i < nb; i++) {
		char name[sizeof(b->rec[i].name) + 1] = "";
		memcpy(name, b->rec[i].name, sizeof(b->rec[i].name));
		if (block_shown(name))
			continue;
		printf("%s %s %llu", any ? " " : "counters ", name,
		       (unsigned long long)__atomic_load_n(&b->value[i], __ATOMIC_RELAXED));
		any = true;
	}
	if (any)
		printf("\n");
	if (r && r->have)
		printf("rates     rooms/s %.1f  aborts/s %.1f  failures/s %.1f  chunks/s %.0f  "
		       "GB/s %.3f"
		       "  tcp tx %.3f rx %.3f GB/s  rdma rx %.3f GB/s\n",
		       r->per_s[R_ROOMS], r->per_s[R_ABORTS], r->per_s[R_FAILS], r->per_s[R_CHUNKS],
		       r->per_s[R_BYTES] / 1e9, r->per_s[R_TCP_TX] / 1e9, r->per_s[R_TCP_RX] / 1e9,
		       r->per_s[R_RDMA_RX] / 1e9);
	for (uint32_t i = 0; i < tb->npe; i++) {
		const struct peer_row *k = &tb->pe[i];
		printf("peer      %s  %s  streams %u  instance %016llx  tx %llu  rx %llu  sunk "
		       "%llu  "
		       "chunks by %s  reads-refused %u\n",
		       k->ep[0] ? k->ep : "(joining)", peer_state(k->p.state), k->p.streams,
		       (unsigned long long)k->p.instance, (unsigned long long)k->p.bytes_tx,
		       (unsigned long long)k->p.bytes_rx, (unsigned long long)k->p.chunks_sunk,
		       peer_link(k->p.flags), k->p.reads_refused);
	}
	if (!slots)
		return;
	uint32_t n = table_slots(c, len);
	const struct kvs_slot *t = n ? (const void *)((const char *)c + c->slots_off) : NULL;
	printf("slot      state        epoch      owner  pins  room\n");
	for (uint32_t i = 0; i < n; i++) {
		struct kvs_slot s = t[i];
		if (s.state != KVS_SLOT_FREE && s.state < KVS_SLOT_NSTATES)
			printf("%-9u %-12s %-10u %-6u %-5u %u\n", i, state_names[s.state], s.epoch,
			       s.owner, s.pins, s.room ? s.room - 1 : 0);
	}
	if (n < c->slot_count)
		printf("(slots %u to %u lie outside the control segment)\n", n, c->slot_count - 1);
}
