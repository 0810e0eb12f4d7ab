/* SPDX-License-Identifier: MIT */
/* kvstage-stat: what the proxy publishes in its read-only control segment. */
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

static const char *const state_names[KVS_SLOT_NSTATES] = {
	"free", "leased", "inflight", "tombstone", "recv_posted", "recv_filled",
};

static void usage(FILE *f)
{
	fprintf(f,
"Usage: kvstage-stat [OPTION]...\n"
"Show a running kvstaged's state (serving or draining), pool, slots, rooms,\n"
"clients and counters.\n"
"\n"
"  -s, --socket PATH   proxy socket (default $KVSTAGE_SOCKET, else " KVS_DEFAULT_SOCKET ")\n"
"  -j, --json          one JSON object per sample (one line each)\n"
"  -w, --watch MS      sample every MS milliseconds (1 to 2147483647), with\n"
"                      rates since the previous sample (rooms/s, aborts/s,\n"
"                      GB/s) from the second one on, until\n"
"                      interrupted; each sample asks the proxy anew, so a proxy\n"
"                      that is down gets one line saying why, and one that\n"
"                      comes back (a new instance) is shown again\n"
"      --slots         also list every slot that is not free\n"
"  -h, --help          show this help\n"
"  -V, --version       show the version\n"
"\n"
"Exit status: 0 shown, 1 no proxy could be read (without --watch), 2 bad command line.\n");
}

#define S(f) ((unsigned long long)__atomic_load_n(&st->f, __ATOMIC_RELAXED))

static double uptime_s(const struct kvs_ctrl *c)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	uint64_t now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
	return (double)(now - c->started_ns) / 1e9;
}

/* The slots of the table that lie inside the mapping (all of them, from a
 * proxy of this ABI). */
static uint32_t table_slots(const struct kvs_ctrl *c, size_t len)
{
	if (c->slots_off > len || c->slots_off % _Alignof(struct kvs_slot))
		return 0;
	uint64_t fit = (len - c->slots_off) / sizeof(struct kvs_slot);
	return c->slot_count < fit ? c->slot_count : (uint32_t)fit;
}

/* The peer table, where it lies inside the mapping. */
static uint32_t peer_rows(const struct kvs_ctrl *c, size_t len, const struct kvs_peer **t)
{
	if (!c->peers_off || c->peers_off > len || c->peers_off % _Alignof(struct kvs_peer))
		return 0;
	uint64_t fit = (len - c->peers_off) / sizeof(struct kvs_peer);
	*t = (const void *)((const char *)c + c->peers_off);
	return c->peer_count < fit ? c->peer_count : (uint32_t)fit;
}

#define P(f) ((unsigned long long)__atomic_load_n(&p->f, __ATOMIC_RELAXED))

static const char *peer_state(uint32_t st)
{
	return st == KVS_PEER_UP ? "up" : st == KVS_PEER_JOINING ? "joining" : "?";
}

static const char *state_word(const struct kvs_stats *st)
{
	return S(draining) ? "draining" : "serving";
}

/* --watch: rates over the time since the previous sample of the same
 * proxy instance (none on the first sample, nor across a restart). */
enum { R_ROOMS, R_ABORTS, R_FAILS, R_CHUNKS, R_BYTES, R_TCP_TX, R_TCP_RX, R_RDMA_RX, R_N };
struct rates {
	bool have;
	double per_s[R_N];
};

static void rates_take(const struct kvs_ctrl *c, struct rates *r)
{
	static uint64_t inst, prev[R_N];
	static struct timespec prev_t;
	const struct kvs_stats *st = &c->stats;
	uint64_t now[R_N] = { S(rooms_done), S(rooms_aborted), S(rooms_failed) + S(rooms_timed_out),
			      S(chunks_moved), S(bytes_moved), S(tcp_bytes_tx), S(tcp_bytes_rx),
			      S(rdma_bytes_rx) };
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	double dt = (double)(t.tv_sec - prev_t.tv_sec) + (double)(t.tv_nsec - prev_t.tv_nsec) / 1e9;
	r->have = inst == c->instance && dt > 0;
	for (int i = 0; i < R_N && r->have; i++)
		r->per_s[i] = now[i] >= prev[i] ? (double)(now[i] - prev[i]) / dt : 0;
	inst = c->instance;
	prev_t = t;
	memcpy(prev, now, sizeof(prev));
}

static void print_human(const struct kvs_ctrl *c, size_t len, const char *path, int slots,
			int restarted, const struct rates *r)
{
	const struct kvs_stats *st = &c->stats;
	printf("kvstaged %s: %s  pid %d  instance %016llx  uptime %.1f s%s\n", path,
	       state_word(st), c->proxy_pid, (unsigned long long)c->instance, uptime_s(c),
	       restarted ? "  (new instance)" : "");
	char slot[32], pool[32];
	printf("pool      %u slots x %s = %s  hugepages %s  locked %s  failpoints %s\n",
	       c->slot_count, kvs_format_size(c->slot_size, slot, sizeof(slot)),
	       kvs_format_size(c->pool_size, pool, sizeof(pool)),
	       c->flags & KVS_CTRL_HUGEPAGES ? "yes" : "no",
	       c->flags & KVS_CTRL_LOCKED ? "yes" : "no",
	       c->flags & KVS_CTRL_FAILPOINTS ? "on" : "off");
	printf("slots    ");
	for (int i = 0; i < KVS_SLOT_NSTATES; i++)
		printf(" %s %llu", state_names[i], S(slots[i]));
	printf("\nrooms     open %llu  done %llu  aborted %llu  failed %llu  timed-out %llu\n",
	       S(rooms_open), S(rooms_done), S(rooms_aborted), S(rooms_failed),
	       S(rooms_timed_out));
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
	printf("tcp       peers %llu  lost %llu  auth-failed %llu  refused %llu  frames-refused %llu"
	       "  frames-ignored %llu  crc-errors %llu  discarded %llu  tx %llu  rx %llu\n",
	       S(peer_sessions), S(peer_lost), S(peer_auth_failed), S(peer_refused),
	       S(peer_frames_refused), S(peer_frames_ignored), S(peer_crc_errors),
	       S(chunks_discarded), S(tcp_bytes_tx), S(tcp_bytes_rx));
	printf("rdma      reads %llu  rx %llu\n", S(rdma_reads), S(rdma_bytes_rx));
	if (r && r->have)
		printf("rates     rooms/s %.1f  aborts/s %.1f  failures/s %.1f  chunks/s %.0f  GB/s %.3f"
		       "  tcp tx %.3f rx %.3f GB/s  rdma rx %.3f GB/s\n",
		       r->per_s[R_ROOMS], r->per_s[R_ABORTS], r->per_s[R_FAILS], r->per_s[R_CHUNKS],
		       r->per_s[R_BYTES] / 1e9, r->per_s[R_TCP_TX] / 1e9, r->per_s[R_TCP_RX] / 1e9,
		       r->per_s[R_RDMA_RX] / 1e9);
	const struct kvs_peer *pt = NULL;
	uint32_t np = peer_rows(c, len, &pt);
	for (uint32_t i = 0; i < np; i++) {
		const struct kvs_peer *p = &pt[i];
		uint32_t st = __atomic_load_n(&p->state, __ATOMIC_RELAXED);
		if (st == KVS_PEER_FREE)
			continue;
		char ep[sizeof(p->endpoint) + 1] = { 0 };
		memcpy(ep, p->endpoint, sizeof(p->endpoint));
		printf("peer      %s  %s  streams %llu  instance %016llx  tx %llu  rx %llu  sunk %llu  "
		       "chunks by %s\n",
		       ep[0] ? ep : "(joining)", peer_state(st), P(streams), P(instance), P(bytes_tx),
		       P(bytes_rx), P(chunks_sunk), P(flags) & KVS_PEER_RDMA ? "rdma" : "tcp");
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

static void json_key(const char *key)
{
	kvs_json_string(stdout, key);
	putchar(':');
}

static void print_json(const struct kvs_ctrl *c, size_t len, const char *path, int slots,
		       const struct rates *r)
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
		printf("\"rates\":{\"rooms_per_s\":%.3f,\"aborts_per_s\":%.3f,\"failures_per_s\":%.3f,"
		       "\"chunks_per_s\":%.3f,\"bytes_per_s\":%.0f,\"tcp_tx_bytes_per_s\":%.0f,"
		       "\"tcp_rx_bytes_per_s\":%.0f,\"rdma_rx_bytes_per_s\":%.0f},",
		       r->per_s[R_ROOMS], r->per_s[R_ABORTS], r->per_s[R_FAILS], r->per_s[R_CHUNKS],
		       r->per_s[R_BYTES], r->per_s[R_TCP_TX], r->per_s[R_TCP_RX], r->per_s[R_RDMA_RX]);
	else if (r)
		printf("\"rates\":null,");
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
	       S(clients), S(clients_total), S(clients_closed), S(clients_died), S(clients_refused));
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
	       "\"chunks_discarded\":%llu,\"bytes_tx\":%llu,\"bytes_rx\":%llu},"
	       "\"rdma\":{\"reads\":%llu,\"bytes_rx\":%llu},\"peers\":[",
	       S(peer_sessions), S(peer_lost), S(peer_auth_failed), S(peer_refused),
	       S(peer_frames_refused), S(peer_frames_ignored), S(peer_crc_errors),
	       S(chunks_discarded), S(tcp_bytes_tx), S(tcp_bytes_rx), S(rdma_reads), S(rdma_bytes_rx));
	const struct kvs_peer *pt = NULL;
	uint32_t np = peer_rows(c, len, &pt);
	for (uint32_t i = 0, first = 1; i < np; i++) {
		const struct kvs_peer *p = &pt[i];
		uint32_t st = __atomic_load_n(&p->state, __ATOMIC_RELAXED);
		if (st == KVS_PEER_FREE)
			continue;
		char ep[sizeof(p->endpoint) + 1] = { 0 };
		memcpy(ep, p->endpoint, sizeof(p->endpoint));
		printf("%s{\"endpoint\":", first ? "" : ",");
		kvs_json_string(stdout, ep);
		printf(",\"state\":\"%s\",\"streams\":%llu,\"instance\":\"%016llx\",\"bytes_tx\":%llu,"
		       "\"bytes_rx\":%llu,\"chunks_sunk\":%llu,\"rdma\":%s}",
		       peer_state(st), P(streams), P(instance), P(bytes_tx), P(bytes_rx), P(chunks_sunk),
		       P(flags) & KVS_PEER_RDMA ? "true" : "false");
		first = 0;
	}
	printf("]");
	if (slots) {
		uint32_t n = table_slots(c, len);
		const struct kvs_slot *t = n ? (const void *)((const char *)c + c->slots_off) : NULL;
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
#define ABI_WHY "it speaks another ABI (its control segment is not kvstage ABI " ABI_STR(KVS_ABI) ")"

/* Maps the proxy's control segment afresh. Returns 0 (unmap *c after use),
 * -1 (no proxy answered) or -2 (one answered with a segment this tool cannot
 * read), with *why set. */
static int sample_map(const char *path, const struct kvs_ctrl **c, size_t *len, const char **why)
{
	int rc = kvs_stat_map(path, c, len);
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
		{ "help", no_argument, NULL, 'h' },         { "version", no_argument, NULL, 'V' },
		{ 0 },
	};
	const char *path = getenv("KVSTAGE_SOCKET");
	int json = 0, slots = 0, opt;
	uint64_t watch = 0;
	while ((opt = getopt_long(argc, argv, "s:jw:hV", opts, NULL)) != -1) {
		switch (opt) {
		case 's': path = optarg; break;
		case 'j': json = 1; break;
		case 'S': slots = 1; break;
		case 'w':
			if (kvs_parse_uint(optarg, INT_MAX, &watch) || !watch) {
				fprintf(stderr, "kvstage-stat: invalid --watch '%s': want milliseconds "
						"from 1 to %d (digits only)\n",
					optarg, INT_MAX);
				return 2;
			}
			break;
		case 'h': usage(stdout); return 0;
		case 'V': printf("kvstage-stat %s\n", KVS_VERSION_STRING); return 0;
		default: fprintf(stderr, "Try 'kvstage-stat --help'.\n"); return 2;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "kvstage-stat: unexpected argument '%s'\n", argv[optind]);
		return 2;
	}
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
		if (!first && !json)
			printf("\n");
		if (rc < 0) {
			print_down(path, json, rc == -2, why);
		} else {
			struct rates r;
			rates_take(c, &r);
			if (json)
				print_json(c, len, path, slots, watch ? &r : NULL);
			else
				print_human(c, len, path, slots,
					    last_instance && c->instance != last_instance,
					    watch ? &r : NULL);
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
