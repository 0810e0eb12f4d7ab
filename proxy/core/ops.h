/* SPDX-License-Identifier: MIT */
/* What clients ask: their submission records, taken and decoded (ops.c). */
#ifndef KVSP_OPS_H
#define KVSP_OPS_H

#include "layout.h"

struct kvsp;
struct kvsp_client;

/* Takes a burst of c's submissions, as many as its completion ring has
 * room to answer. Returns KVSP_BUSY or KVSP_IDLE. */
int kvsp_client_poll(struct kvsp *p, struct kvsp_client *c);
/* One record, copied out of the ring: checked field by field, then done;
 * what it ended, ends now (rooms settle). */
void kvsp_client_op(struct kvsp *p, struct kvsp_client *c, const struct kvs_sqe *q);

#endif
