/* SPDX-License-Identifier: MIT */
/*
 * The data paths this build has (datapath.c), each behind the interface
 * the peer plane calls (peer/datapath.h). The daemon hands the list to the
 * plane (struct kvsp_peer_opts's datapaths): peer/ is below this folder
 * and names none of them.
 */
#ifndef KVSP_DATAPATH_H
#define KVSP_DATAPATH_H

#include "peer/datapath.h"

/* The data paths, in the order they are asked; NULL-terminated. */
extern const struct kvsp_dp_ops *const kvsp_datapaths[];

/* CHUNK_READs an RDMA sender keeps unacknowledged on one session: bounds
 * the receiver's READs in flight and the acks it may owe at once. */
#define KVSP_RDMA_WINDOW 128

/* datapath/rdma.c; in a build without libibverbs, datapath/no_rdma.c, which
 * answers peers' RDMA frames as a proxy without a device does. */
extern const struct kvsp_dp_ops kvsp_dp_rdma;
extern const struct kvsp_dp_ops kvsp_dp_stream; /* datapath/stream.c */

#endif
