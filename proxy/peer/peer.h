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

/* --listen, or a peer secret alone: dial only. */
struct kvsp_peer_opts {
	const char *listen;    /* "HOST:PORT", NULL: no listening */
	const char *advertise; /* what goes into descriptors; NULL: the listen address */
	unsigned streams;      /* connections per peer */
	uint64_t peer_timeout_ns;
	bool checksum; /* CRC32C of every payload */
	bool zerocopy; /* payloads sent with MSG_ZEROCOPY */
	enum kvsp_peer_data data;
	const struct kvsp_secret *secret;
	/* The data paths, in the order they are asked (the build's table,
	 * datapath/datapath.h; peer/datapath.h is their interface);
	 * NULL-terminated; and each one's options' values (dp_conf[k]: its
	 * conf_size bytes, or NULL). */
	const struct kvsp_dp_ops *const *datapaths;
	void *const *dp_conf;
};

#endif
