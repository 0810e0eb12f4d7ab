/* SPDX-License-Identifier: MIT */
/* Frames of data paths this proxy does not run, answered by their type (unowned.c). */
#ifndef KVSP_PEER_UNOWNED_H
#define KVSP_PEER_UNOWNED_H

#include "peer/datapath.h"

/* The plane asks it last: it carries no session, and reads every data
 * path's frame type that no data path of this proxy reads. */
extern const struct kvsp_dp_ops kvsp_unowned;

#endif
