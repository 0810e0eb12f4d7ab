/* SPDX-License-Identifier: MIT */
/* kvstaged: what the command line decides. */
#ifndef KVSP_CONFIG_H
#define KVSP_CONFIG_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

struct kvsp;
struct kvsp_transport;

enum kvsp_huge { KVSP_HUGE_AUTO, KVSP_HUGE_ON, KVSP_HUGE_OFF };

#define KVSP_MAX_ALLOW 16

/* --transport: how chunks go to peer proxies. */
enum kvsp_peer_data {
	KVSP_DATA_AUTO = 0, /* RDMA READ on --rdma-device, else on the first device found, else TCP */
	KVSP_DATA_TCP,      /* TCP only; no device is opened */
	KVSP_DATA_VERBS,    /* RDMA READ: a device must open, or the start fails */
};

struct kvsp_secret;

/* The tcp transport (--listen, or a peer secret alone: dial only). */
struct kvsp_tcp_opts {
	const char *listen;    /* "HOST:PORT", NULL: no listening */
	const char *advertise; /* what goes into descriptors; NULL: the listen address */
	unsigned streams;      /* connections per peer */
	uint64_t peer_timeout_ns;
	bool checksum;         /* CRC32C of every payload */
	enum kvsp_peer_data data;
	const char *rdma_device; /* chunks by RDMA READ with peers that have it; NULL: per data */
	int rdma_gid_index;    /* -1: the device's first RoCE v2 GID, IPv4-mapped first */
	const struct kvsp_secret *secret; /* NULL: no tcp transport */
	uint64_t instance;     /* ours: filled in by kvsp_init */
	uint32_t max_rooms;    /* filled in by kvsp_init */
};

struct kvsp_config {
	const char *socket_path;
	uint32_t slot_count;
	uint64_t slot_size;
	enum kvsp_huge huge;
	bool lock;            /* mlock the pool (best effort unless required) */
	uid_t allow_uid[KVSP_MAX_ALLOW];
	gid_t allow_gid[KVSP_MAX_ALLOW];
	unsigned n_allow_uid, n_allow_gid;
	unsigned socket_mode;  /* the socket file's permission bits */
	gid_t socket_group;    /* the socket file's group */
	int log_level;
	bool failpoints;
	uint32_t max_rooms;    /* rooms open at once, proxy-wide */
	uint32_t client_rooms; /* room handles per client */
	uint32_t max_clients;
	uint32_t sq_count, cq_count;
	uint64_t room_timeout_ns; /* 0: rooms never time out */
	uint64_t shutdown_grace_ns;
	uint64_t spin_ns;         /* busy-poll this long after the last work, then sleep */
	const char *metrics_listen; /* "HOST:PORT" or "PORT"; NULL: no metrics server */
	/* The transport for rooms with both halves here. NULL: the local
	 * hand-off, or with failpoints its gated twin. Test builds set theirs. */
	struct kvsp_transport *(*local_create)(struct kvsp *p);
	struct kvsp_tcp_opts tcp;
};

#endif
