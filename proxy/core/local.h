/* SPDX-License-Identifier: MIT */
/*
 * The local hand-off (local.c) and its gated twin for tests
 * (local_gated.c). kvsp_local_kind (core/xport.h) makes the plain one, or
 * the gated one when kvstaged runs with --failpoints: nothing else picks it.
 */
#ifndef KVSP_LOCAL_H
#define KVSP_LOCAL_H

#include "core/xport.h"

/* The local hand-off behind failpoint local.quiesce: held hand-offs stay
 * pinned and in flight, as inside a NIC, until let go. Returns NULL on -ENOMEM. */
struct kvsp_transport *kvsp_gated_create(struct kvsp *p);

#endif
