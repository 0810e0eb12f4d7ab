/* SPDX-License-Identifier: MIT */
/*
 * Transports move one chunk from a sender's slot to a receiving room. A
 * transport pins the slot from submit() until it reports quiescence with
 * kvsp_xfer_done(): after that it never touches the slot again, and only
 * then may the slot be reaped or handed on. One file per transport.
 */
#ifndef KVSP_TRANSPORT_H
#define KVSP_TRANSPORT_H

#include <stdbool.h>

#include "proxy.h"
#include "wire.h" /* what the tcp and verbs transports will speak */

struct kvsp_transport;

struct kvsp_transport_ops {
	const char *name;
	/* Starts carrying x's chunk; completion comes through kvsp_xfer_done(x). Returns 0, or -errno (nothing started). */
	int (*submit)(struct kvsp_transport *t, const struct kvsp_xfer *x);
	/* Room is aborting: drop what has not started; started work still quiesces through kvsp_xfer_done(). */
	void (*cancel)(struct kvsp_transport *t, uint32_t room);
	/* Reaps completions. Returns KVSP_BUSY or KVSP_IDLE. */
	int (*poll)(struct kvsp_transport *t);
	/* True while poll() has work to finish that needs no outside event. */
	bool (*pending)(struct kvsp_transport *t);
	void (*destroy)(struct kvsp_transport *t);
};

struct kvsp_transport {
	const struct kvsp_transport_ops *ops;
	struct kvsp *p;
};

/* Sender and receiver share this proxy: a chunk lands by handing its slot over. Returns NULL on -ENOMEM. */
struct kvsp_transport *kvsp_local_create(struct kvsp *p);
/* Failpoint local.quiesce: lets go of held hand-offs of rooms whose user_data & mask == match. Returns how many. */
unsigned kvsp_local_release(struct kvsp_transport *t, uint64_t match, uint64_t mask);

#endif
