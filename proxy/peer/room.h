/* SPDX-License-Identifier: MIT */
/*
 * The room protocol between two proxies, over a session: OPEN and its
 * OPEN_ACK, ABORT, ENDED, DONE. What the core tells the peer plane about a
 * room (xport.h's notes) becomes frames owed on the room's session, sent
 * on stream 0 in order; what a peer says about a room is checked against
 * our own record of it (index, generation, token, session) before the core
 * hears of it. The chunks themselves are the data paths'.
 *
 * Every wait on the peer here has a deadline (proom_overdue): an OPEN must
 * be answered, and once a room aborts on either side, the peer's ENDED
 * must come, within --peer-timeout; past it, the session is lost.
 */
#ifndef KVSP_ROOM_H
#define KVSP_ROOM_H

#include <stdbool.h>
#include <stdint.h>

#include "peer/session.h"
#include "peer/wire.h"

struct kvsp;
struct kvsp_dp;
struct kvsp_frame;
struct kvsp_rl;
struct kvsp_transport;
struct kvsp_xfer;
struct kvs_desc_wire;
struct kvs_stats;

#define PROOM_REFUSALS 32

/* One core room that rides on a session (by core room index). */
struct proom {
	uint32_t gen;  /* the core room's generation this record is about */
	uint32_t sess; /* its session's id; 0: none */
	uint8_t owed;  /* frames owed, OWE_* bits */
	bool on_owe, acked;
	uint32_t owe_next;
	int32_t ack_status, abort_status;
	struct kvs_wire_room name; /* the receiving room (ours, or the peer's from the descriptor) */
	uint64_t sender_ref;	   /* the sending proxy's room: gen << 32 | index */
	uint64_t far_instance;	   /* sending half: the descriptor's instance */
	uint32_t pend_head, pend_tail; /* sending half: chunks waiting for OPEN_ACK */
	uint32_t from;		       /* the half we hold: KVS_WIRE_FROM_SEND or _RECV */
	uint64_t bytes;
	uint64_t open_ns;  /* sending half: our OPEN left, its OPEN_ACK owed since; 0: none */
	uint64_t abort_ns; /* aborted: the peer's ENDED owed since; 0: none */
};

/* Per session: the rooms with frames owed, and OPENs refused that name no
 * room of ours (answered on the frame's own terms). */
struct powe {
	uint32_t sess; /* the session these are for: another id means they are stale */
	uint32_t head, tail;
	struct kvs_wire_open_ack refusals[PROOM_REFUSALS];
	unsigned rhead, nref;
};

struct proom_table {
	struct proom *r; /* by core room index */
	uint32_t n;
	uint32_t *xnext; /* pending chunks, through slot indices */
	struct powe owe[PSESS_MAX];
	struct kvsp *p;
	struct kvsp_transport *t;
	struct psess_table *sessions;
	struct kvsp_dp *const *dps;
	const unsigned *ndps;
	struct kvs_stats *st;
};

/* Sets t up for the core's rooms and slots. Returns 0, or -ENOMEM. */
int proom_init(struct proom_table *t);
void proom_fini(struct proom_table *t);

/* xport.h's ops, for the rooms: see there. */
int proom_attach(struct proom_table *t, uint32_t sess, uint32_t room, uint32_t gen,
		 const struct kvs_desc_wire *d);
int proom_submit(struct proom_table *t, struct kvsp_xfer *x);
void proom_cancel(struct proom_table *t, uint32_t room, uint32_t gen);
void proom_notify(struct proom_table *t, uint32_t room, uint32_t gen, int note, int status);

/* A room frame (OPEN, OPEN_ACK, ABORT, ENDED, DONE) from s. Returns 0, or -errno (s is lost). */
int proom_on_frame(struct proom_table *t, struct psess *s, const struct kvsp_frame *f);
/* The next room frame s owes into type and body (body NULL: only whether
 * there is one). Returns true if so. */
bool proom_next_frame(struct proom_table *t, struct psess *s, uint64_t now, uint16_t *type,
		      void *body);
/* How many rooms ride on each session of st (live here, or with frames
 * owed): rides[i] for the session at index i. One look at every room. */
void proom_rooms_on(void *t, const struct psess_table *st, unsigned rides[]);
/* A session with an answer overdue (an OPEN_ACK or an ENDED past timeout), or 0. */
uint32_t proom_overdue(struct proom_table *t, uint64_t now, uint64_t timeout_ns);

#endif
