/* SPDX-License-Identifier: MIT */
/* kvstaged: what the core is configured with (the daemon fills it from its options). */
#ifndef KVSP_CONFIG_H
#define KVSP_CONFIG_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

enum kvsp_huge { KVSP_HUGE_AUTO, KVSP_HUGE_ON, KVSP_HUGE_OFF };

#define KVSP_MAX_ALLOW 16
#define KVSP_MAX_XPORTS 8

struct kvsp_xport_kind;

/* A transport the proxy makes at start, and its options (the kind's own). */
struct kvsp_xport_conf {
	const struct kvsp_xport_kind *kind;
	const void *opts;
};

struct kvsp_config {
	const char *socket_path;
	uint32_t slot_count;
	uint64_t slot_size;
	enum kvsp_huge huge;
	bool lock; /* mlock the pool (best effort unless required) */
	uid_t allow_uid[KVSP_MAX_ALLOW];
	gid_t allow_gid[KVSP_MAX_ALLOW];
	unsigned n_allow_uid, n_allow_gid;
	unsigned socket_mode; /* the socket file's permission bits */
	gid_t socket_group;   /* the socket file's group */
	int log_level;
	bool failpoints;
	uint32_t max_rooms;    /* rooms open at once, proxy-wide */
	uint32_t client_rooms; /* room handles per client */
	uint32_t max_clients;
	unsigned uid_share_pct; /* the most of max_clients and max_rooms one uid may hold; 0: all */
	uint32_t sq_count, cq_count;
	uint64_t room_timeout_ns; /* 0: rooms never time out */
	uint64_t shutdown_grace_ns;
	uint64_t spin_ns; /* busy-poll this long after the last work, then sleep */
	/* The transports, in the order open_send asks them to reach a
	 * descriptor; the first carries rooms with both halves here. None:
	 * the local hand-off alone. */
	struct kvsp_xport_conf xports[KVSP_MAX_XPORTS];
	unsigned nxports;
};

#endif
