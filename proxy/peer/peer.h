/* SPDX-License-Identifier: MIT */
/*
 * The peer plane's options, as the daemon sets them and the data paths read
 * them; its transport kind is plane.h's. Everything else of it is its own
 * (peer/, datapath/).
 */
#ifndef KVSP_PEER_H
#define KVSP_PEER_H

#include <stdbool.h>
#include <stdint.h>

struct kvsp_dp_ops;
struct kvsp_secret;

#define KVSP_PEER_MAX_STREAMS 16

/* --transport: how chunks go to peer proxies. */
enum kvsp_peer_data {
	/* auto: RDMA READ on --rdma-device, else on the first device found, else the stream */
	KVSP_DATA_AUTO = 0,
	KVSP_DATA_STREAM, /* tcp: the stream only; no device is opened */
	KVSP_DATA_VERBS,  /* verbs: RDMA READ: a device must open, or the start fails */
};

/* --rdma-keys: how the key a peer reads each chunk with is made
 * (datapath/verbs.h says what each fences). */
enum kvsp_keys {
	KVSP_KEYS_AUTO = 0, /* windows where the device has them, else regions */
	KVSP_KEYS_WINDOW,   /* type-2 memory windows, or no RDMA on this device */
	KVSP_KEYS_REGION,   /* a memory region per chunk */
};

/* --listen, or a peer secret alone: dial only. */
struct kvsp_peer_opts {
	const char *listen;    /* "HOST:PORT", NULL: no listening */
	const char *advertise; /* what goes into descriptors; NULL: the listen address */
	unsigned streams;      /* connections per peer */
	uint64_t peer_timeout_ns;
	bool checksum; /* CRC32C of every payload */
	bool zerocopy; /* payloads sent with MSG_ZEROCOPY */
	enum kvsp_peer_data data;
	const char *rdma_device; /* chunks by RDMA READ with peers that have it; NULL: per data */
	int rdma_gid_index;	 /* -1: the device's first RoCE v2 GID, IPv4-mapped first */
	enum kvsp_keys rdma_keys;
	const struct kvsp_secret *secret;
	/* The data paths, in the order they are asked (datapath/datapath.h's
	 * kvsp_datapaths; peer/datapath.h is their interface); NULL-terminated. */
	const struct kvsp_dp_ops *const *datapaths;
};

#endif
