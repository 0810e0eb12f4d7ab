/* SPDX-License-Identifier: MIT */
/*
 * The data paths this kvstaged has, each a module behind the interface
 * the peer plane calls (peer/datapath.h). The table is generated from the
 * build's list (datapath/table.c.in); the daemon hands it to the plane
 * (struct kvsp_peer_opts's datapaths): peer/ is below this folder and
 * names none of them.
 */
#ifndef KVSP_DATAPATH_H
#define KVSP_DATAPATH_H

#include "peer/datapath.h"

/* The data paths, in the order they are asked; NULL-terminated. */
extern const struct kvsp_dp_ops *const kvsp_datapaths[];

/* CHUNK_READs an RDMA sender keeps unacknowledged on one session: bounds
 * the receiver's READs in flight and the acks it may owe at once. */
#define KVSP_RDMA_WINDOW 128

#endif
