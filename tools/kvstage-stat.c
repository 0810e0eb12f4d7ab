/* SPDX-License-Identifier: MIT */
/* kvstage-stat: what the proxy publishes in its read-only control segment. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "admin.h"
#include "kvstage.h"
#include "layout.h"

static const char *const state_names[KVS_SLOT_NSTATES] = {
	"free", "leased", "inflight", "tombstone", "recv_posted", "recv_filled",
};

static void usage(FILE *f)
{
	fprintf(f,
"Usage: kvstage-stat [OPTION]...\n"
"Show a running kvstaged's pool, slots, rooms, clients and counters.\n"
"\n"
"  -s, --socket PATH   proxy socket (default $KVSTAGE_SOCKET, else " KVS_DEFAULT_SOCKET ")\n"
"  -j, --json          one JSON object per sample\n"
"  -w, --watch MS      sample every MS milliseconds until interrupted\n"
"      --slots         also list every slot that is not free\n"
"  -h, --help          show this help\n"
"  -V, --version       show the version\n");
}

#define S(f) ((unsigned long long)__atomic_load_n(&st->f, __ATOMIC_RELAXED))

static double uptime_s(const struct kvs_ctrl *c)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	uint64_t now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
	return (double)(now - c->started_ns) / 1e9;
}

static void print_human(const struct kvs_ctrl *c, const char *path, int slots)
{
	const struct kvs_stats *st = &c->stats;
	printf("kvstaged %s  pid %d  instance %016llx  up %.1f s\n", path, c->proxy_pid,
	       (unsigned long long)c->instance, uptime_s(c));
	printf("pool      %u slots x %llu KiB = %llu MiB  hugepages %s  locked %s  failpoints %s\n",
	       c->slot_count, (unsigned long long)(c->slot_size >> 10),
	       (unsigned long long)(c->pool_size >> 20), c->flags & KVS_CTRL_HUGEPAGES ? "yes" : "no",
	       c->flags & KVS_CTRL_LOCKED ? "yes" : "no",
	       c->flags & KVS_CTRL_FAILPOINTS ? "on" : "off");
	printf("slots    ");
	for (int i = 0; i < KVS_SLOT_NSTATES; i++)
		printf(" %s %llu", state_names[i], S(slots[i]));
	printf("\nrooms     open %llu  done %llu  aborted %llu  failed %llu  timed-out %llu\n",
	       S(rooms_open), S(rooms_done), S(rooms_aborted), S(rooms_failed),
	       S(rooms_timed_out));
	printf("clients   now %llu  total %llu  died %llu  refused %llu\n", S(clients),
	       S(clients_total), S(clients_died), S(clients_refused));
	printf("rejected  stale %llu  perm %llu  busy %llu  inval %llu  token %llu  nobufs %llu\n",
	       S(rej_stale), S(rej_perm), S(rej_busy), S(rej_inval), S(rej_token), S(rej_nobufs));
	printf("traffic   chunks %llu  bytes %llu  ops %llu  events %llu  dropped %llu  reaped %llu"
	       "  sleeps %llu\n",
	       S(chunks_moved), S(bytes_moved), S(ops), S(events), S(events_dropped),
	       S(tombstones_reaped), S(sleeps));
	if (!slots)
		return;
	const struct kvs_slot *t = (const void *)((const char *)c + c->slots_off);
	printf("slot      state        epoch      owner  pins  room\n");
	for (uint32_t i = 0; i < c->slot_count; i++) {
		struct kvs_slot s = t[i];
		if (s.state != KVS_SLOT_FREE && s.state < KVS_SLOT_NSTATES)
			printf("%-9u %-12s %-10u %-6u %-5u %u\n", i, state_names[s.state], s.epoch,
			       s.owner, s.pins, s.room ? s.room - 1 : 0);
	}
}

static void print_json(const struct kvs_ctrl *c, const char *path, int slots)
{
	const struct kvs_stats *st = &c->stats;
	printf("{\"socket\":\"%s\",\"pid\":%d,\"instance\":\"%016llx\",\"uptime_s\":%.3f,", path,
	       c->proxy_pid, (unsigned long long)c->instance, uptime_s(c));
	printf("\"slot_count\":%u,\"slot_size\":%llu,\"pool_size\":%llu,\"hugepages\":%s,"
	       "\"locked\":%s,\"failpoints\":%s,\"slot_metadata_bytes\":%zu,\"slots\":{",
	       c->slot_count, (unsigned long long)c->slot_size, (unsigned long long)c->pool_size,
	       c->flags & KVS_CTRL_HUGEPAGES ? "true" : "false",
	       c->flags & KVS_CTRL_LOCKED ? "true" : "false",
	       c->flags & KVS_CTRL_FAILPOINTS ? "true" : "false", sizeof(struct kvs_slot));
	for (int i = 0; i < KVS_SLOT_NSTATES; i++)
		printf("%s\"%s\":%llu", i ? "," : "", state_names[i], S(slots[i]));
	printf("},\"rooms\":{\"open\":%llu,\"done\":%llu,\"aborted\":%llu,\"failed\":%llu,"
	       "\"timed_out\":%llu},",
	       S(rooms_open), S(rooms_done), S(rooms_aborted), S(rooms_failed), S(rooms_timed_out));
	printf("\"clients\":{\"now\":%llu,\"total\":%llu,\"died\":%llu,\"refused\":%llu},",
	       S(clients), S(clients_total), S(clients_died), S(clients_refused));
	printf("\"rejected\":{\"stale\":%llu,\"perm\":%llu,\"busy\":%llu,\"inval\":%llu,"
	       "\"token\":%llu,\"nobufs\":%llu},",
	       S(rej_stale), S(rej_perm), S(rej_busy), S(rej_inval), S(rej_token), S(rej_nobufs));
	printf("\"chunks_moved\":%llu,\"bytes_moved\":%llu,\"ops\":%llu,\"events\":%llu,"
	       "\"events_dropped\":%llu,\"tombstones_reaped\":%llu,\"sleeps\":%llu",
	       S(chunks_moved), S(bytes_moved), S(ops), S(events), S(events_dropped),
	       S(tombstones_reaped), S(sleeps));
	if (slots) {
		const struct kvs_slot *t = (const void *)((const char *)c + c->slots_off);
		printf(",\"slot_table\":[");
		int first = 1;
		for (uint32_t i = 0; i < c->slot_count; i++) {
			struct kvs_slot s = t[i];
			if (s.state == KVS_SLOT_FREE || s.state >= KVS_SLOT_NSTATES)
				continue;
			printf("%s{\"slot\":%u,\"state\":\"%s\",\"epoch\":%u,\"owner\":%u,\"pins\":%u}",
			       first ? "" : ",", i, state_names[s.state], s.epoch, s.owner, s.pins);
			first = 0;
		}
		printf("]");
	}
	printf("}\n");
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
	long watch = 0;
	while ((opt = getopt_long(argc, argv, "s:jw:hV", opts, NULL)) != -1) {
		switch (opt) {
		case 's': path = optarg; break;
		case 'j': json = 1; break;
		case 'S': slots = 1; break;
		case 'w': {
			char *end;
			watch = strtol(optarg, &end, 10);
			if (*end || watch <= 0) {
				fprintf(stderr, "kvstage-stat: invalid --watch '%s': want milliseconds > 0\n",
					optarg);
				return 2;
			}
			break;
		}
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
	const struct kvs_ctrl *c;
	size_t len;
	int rc = kvs_stat_map(path, &c, &len);
	if (rc < 0) {
		fprintf(stderr, "kvstage-stat: %s: %s\n", path, kvs_strerror(rc));
		return 1;
	}
	if (c->magic != KVS_MAGIC_CTRL || c->abi != KVS_ABI) {
		fprintf(stderr, "kvstage-stat: %s: proxy speaks another ABI\n", path);
		return 1;
	}
	for (;;) {
		if (json)
			print_json(c, path, slots);
		else
			print_human(c, path, slots);
		fflush(stdout);
		if (!watch)
			return 0;
		struct timespec ts = { watch / 1000, (watch % 1000) * 1000000 };
		nanosleep(&ts, NULL);
		if (!json)
			printf("\n");
	}
}
