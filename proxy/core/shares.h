/* SPDX-License-Identifier: MIT */
/*
 * A uid's share of the tables every client of the proxy draws on: its
 * client places (--max-clients) and the rooms its clients opened
 * (--max-rooms), and a process's share of its uid's. No uid may hold more
 * than --uid-share percent of either, and no process more than that
 * percent of its uid's share, so another uid, and another process of the
 * same uid, always find a place and a room (design note 42). The uid is
 * SO_PEERCRED's, which holds across PID namespaces. A process is named by
 * its pidfs inode (SO_PEERPIDFD, Linux 6.9), which does too, so a pod's
 * containers are processes of their own; on older kernels by its pid,
 * which is 0 for a client outside the proxy's PID namespace: such a client
 * has no process share, only its uid's.
 */
#ifndef KVSP_SHARES_H
#define KVSP_SHARES_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#define KVSP_NO_SHARE UINT16_MAX

/* One uid's places (proc 0), or one process's within them; an entry
 * lives while it holds a client or a room. */
struct kvsp_share {
	uid_t uid;
	uint64_t proc;
	uint32_t clients, rooms;
};

struct kvsp_shares {
	struct kvsp_share *tab;
	uint16_t n;	      /* entries: four times --max-clients, at most 65535 */
	uint32_t max_clients; /* a uid's share of the client places */
	uint32_t max_rooms;   /* ... and of the rooms */
	uint32_t max_proc_clients, max_proc_rooms; /* a process's of its uid's */
};

/* Sizes the table for max_clients clients, and each uid's share of them and
 * of max_rooms rooms: pct percent (0: all). Returns 0, or -ENOMEM. */
int kvsp_shares_init(struct kvsp_shares *sh, uint32_t max_clients, uint32_t max_rooms,
		     unsigned pct);
void kvsp_shares_fini(struct kvsp_shares *sh);
/* The entry of uid (proc 0), or of process proc of uid, made if it has
 * none (an entry holding no client and no room is free). Returns its
 * index, or KVSP_NO_SHARE when the table is full. */
uint16_t kvsp_share_of(struct kvsp_shares *sh, uid_t uid, uint64_t proc);
/* Whether entry i (KVSP_NO_SHARE: none, always) may hold one more client,
 * or one more room. */
bool kvsp_share_takes_client(const struct kvsp_shares *sh, uint16_t i);
bool kvsp_share_takes_room(const struct kvsp_shares *sh, uint16_t i);

#endif
