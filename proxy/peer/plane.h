/* SPDX-License-Identifier: MIT */
/* The peer plane as the daemon sees it: a transport kind of the core
 * (core/xport.h), made with the options of peer.h. */
#ifndef KVSP_PLANE_H
#define KVSP_PLANE_H

struct kvsp_dp;
struct kvsp_transport;
struct kvsp_xport_kind;

/* Proxies on other hosts: sessions over TCP, chunks by a data path. opts: struct kvsp_peer_opts. */
extern const struct kvsp_xport_kind kvsp_peer_kind;

/* The data paths the peer plane t (made by kvsp_peer_kind) opened, in the
 * order it asks them; *n says how many. */
struct kvsp_dp *const *kvsp_peer_datapaths(struct kvsp_transport *t, unsigned *n);

#endif
