/* SPDX-License-Identifier: MIT */
/*
 * A uid's share of the tables every client of the proxy draws on: its
 * client places (--max-clients) and the rooms its clients opened
 * (--max-rooms). No uid may hold more than --uid-share percent of either,
 * so another uid always finds a place and a room (design note 42). The uid
 * is SO_PEERCRED's, which holds across PID namespaces (a pod's sidecar sees
 * pid 0 for every client, never the uid wrong).
 */
#ifndef KVSP_SHARES_H
#define KVSP_SHARES_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#define KVSP_NO_SHARE UINT16_MAX

/* One uid's places; an entry lives while it holds a client or a room. */
struct kvsp_share {
	uid_t uid;
	uint32_t clients, rooms;
};

struct kvsp_shares {
	struct kvsp_share *tab;
	uint16_t n;	      /* entries: twice --max-clients, at most 65535 */
	uint32_t max_clients; /* a uid's share of the client places */
	uint32_t max_rooms;   /* ... and of the rooms */
};

/* Sizes the table for max_clients clients, and each uid's share of them and
 * of max_rooms rooms: pct percent (0: all). Returns 0, or -ENOMEM. */
int kvsp_shares_init(struct kvsp_shares *sh, uint32_t max_clients, uint32_t max_rooms,
		     unsigned pct);
void kvsp_shares_fini(struct kvsp_shares *sh);
/* uid's entry, made if it has none (an entry holding no client and no room
 * is free). Returns its index, or KVSP_NO_SHARE when the table is full. */
uint16_t kvsp_share_of(struct kvsp_shares *sh, uid_t uid);

#endif
