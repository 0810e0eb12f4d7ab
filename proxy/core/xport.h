/* SPDX-License-Identifier: MIT */
/*
 * The transport API: all a transport sees of the proxy. A transport
 * includes this header, never proxy.h.
 *
 * A room has two halves. The sending half pins each slot it gives a
 * transport; the receiving half posts slots for a writer and fences every
 * landing. When both halves are on this proxy the local transport hands
 * a slot over; otherwise a transport carries chunks to the proxy that
 * holds the other half. Completion has two phases and the core owns both:
 *
 *   sending side:   kvsp_xfer_quiesced()  the transport will never touch
 *                                         that slot again for that transfer
 *   receiving side: kvsp_chunk_land()     the chunk's bytes are in the slot
 *                                         posted for it; the fence decides
 *                   kvsp_chunk_discard()  they never will be (counted)
 *
 * Every pin belongs to a transfer record (struct kvsp_xfer): the core knows
 * which transport and which peer holds it, so a lost peer releases exactly
 * its own pins (kvsp_peer_lost). A transport that reports a quiescence
 * early (while it can still touch the slot) breaks invariant 3: nothing in
 * the core can then protect the slot's next owner.
 *
 * Each call below is made from the proxy's one thread, from a transport's
 * op or poll; none may be called while another of them runs.
 */
#ifndef KVSP_XPORT_H
#define KVSP_XPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "layout.h"

struct kvsp;
struct kvsp_transport;

/* A receiving room as a peer names it (host byte order): index,
 * generation and token, checked whole before anything lands. */
struct kvsp_room_name {
	uint32_t room, gen;
	uint8_t token[16];
};

/* Who makes a transport reach another proxy: the sharing unit of what it
 * holds for them (design note 43): a uid (SO_PEERCRED's), and its process
 * (core/shares.h), or where that is not known (0) its connection (cid). */
struct kvsp_party {
	uint32_t uid, cid;
	uint64_t proc;
};

enum { KVSP_IDLE = 0, KVSP_BUSY = 1 };
enum kvsp_xfer_dir { KVSP_XFER_SEND = 1, KVSP_XFER_RECV };

/* One pin: who holds it, for what. Core-owned; a transport reads it and
 * keeps the pointer until it reports the transfer's end. */
struct kvsp_xfer {
	uint32_t slot, epoch;	 /* the slot, at the epoch it was captured with */
	uint32_t room, room_gen; /* the room on this proxy, at its generation */
	uint32_t chunk, len;
	uint8_t dir;	  /* enum kvsp_xfer_dir; 0: no transfer */
	uint8_t xport;	  /* the transport's index in the registry */
	uint32_t peer;	  /* the transport's name for the far proxy; 0: none */
	uint64_t sent_ns; /* the loop pass that took it: for the chunk latency histogram */
};

/* What the core tells a transport about a room it carries. */
enum kvsp_note {
	KVSP_NOTE_ABORT = 1, /* this proxy's half is aborting (status): tell the peer */
	KVSP_NOTE_ENDED,     /* this proxy's half has quiesced after an abort */
	KVSP_NOTE_DONE,	     /* receiving half: every chunk landed */
};

struct kvsp_transport_ops {
	const char *name;
	/* Sending half: starts carrying x's chunk. Returns 0 (it ends through
	 * kvsp_xfer_quiesced or kvsp_xfer_handoff), or -errno (nothing started). */
	int (*submit)(struct kvsp_transport *t, struct kvsp_xfer *x);
	/* Room (room, gen) is aborting: drops what has not started; started
	 * work still ends through the core. */
	void (*cancel)(struct kvsp_transport *t, uint32_t room, uint32_t gen, int status);
	/* Optional: what the peer must hear about a room (enum kvsp_note). */
	void (*notify)(struct kvsp_transport *t, uint32_t room, uint32_t gen, int note, int status);
	/* Optional: a descriptor names another proxy, for a room of who's.
	 * Returns 0 when this transport reaches it (peer set), -EOPNOTSUPP
	 * when it does not, or -errno. */
	int (*reach)(struct kvsp_transport *t, const struct kvs_desc_wire *d,
		     const struct kvsp_party *who, uint32_t *peer);
	/* Optional: a send half on this proxy now has room (room, gen) for the
	 * far half desc names: tells that proxy. */
	int (*attach)(struct kvsp_transport *t, uint32_t peer, uint32_t room, uint32_t gen,
		      const struct kvs_desc_wire *d);
	/* Reaps completions. Returns KVSP_BUSY or KVSP_IDLE. */
	int (*poll)(struct kvsp_transport *t);
	/* True while poll() has work that needs no outside event (the loop
	 * does not sleep then). */
	bool (*pending)(struct kvsp_transport *t);
	/* Optional: one fd the loop watches for t from registration on
	 * (EPOLLIN, tag 0), so that t's readiness wakes a sleeping loop.
	 * Registration adds it: only then does t have its index. */
	int (*loop_fd)(struct kvsp_transport *t);
	/* Optional: an fd registered with kvsp_xport_fd_add (or loop_fd) is ready. */
	void (*on_fd)(struct kvsp_transport *t, uint32_t tag, uint32_t events);
	/* Optional: the proxy is draining (SIGTERM): peers should open nothing new here. */
	void (*drain)(struct kvsp_transport *t);
	/* Optional: where peers reach this proxy through t, as descriptors
	 * name it ("" when they do not). */
	const char *(*endpoint)(const struct kvsp_transport *t);
	void (*destroy)(struct kvsp_transport *t);
};

struct kvsp_transport {
	const struct kvsp_transport_ops *ops;
	struct kvsp *p;
	uint8_t idx; /* in the registry */
	/* Its submit lands every chunk at once, with no failure (the local
	 * transport): the core lands it without the transfer record. */
	bool lands_at_submit;
};

/* --------------------------------------------------- the registry */

/* A kind of transport, as the daemon configures it (struct kvsp_config's
 * xports, in the order open_send asks them to reach a descriptor; the
 * first carries rooms whose halves are both here). */
struct kvsp_xport_kind {
	const char *name;
	/* Makes the transport over p with the daemon's options for it.
	 * Returns it, or NULL with why set (a sentence). */
	struct kvsp_transport *(*create)(struct kvsp *p, const void *opts, char *why, size_t len);
};

/* The local hand-off (core/local.c): rooms with both halves here. */
extern const struct kvsp_xport_kind kvsp_local_kind;

/* Adds t to the transports the loop polls, and its loop_fd to the loop.
 * Returns 0, or -ENOSPC, or -errno from epoll (t is then not registered). */
int kvsp_xport_register(struct kvsp *p, struct kvsp_transport *t);

/* ------------------------------------------- what transports call */

/* Sending side: x's slot will never again be touched by its transport for
 * x. status 0: its bytes left; else the transfer failed (the room fails). */
void kvsp_xfer_quiesced(struct kvsp *p, struct kvsp_xfer *x, int status);
/* Local hand-off: x's sender quiesced and its very slot is the landing,
 * through the same fence as kvsp_chunk_land. status != 0 fails the room. */
void kvsp_xfer_handoff(struct kvsp *p, struct kvsp_xfer *x, int status);

/* Receiving half: finds room (name->room, name->gen) if it is open and the
 * token matches. Returns the room index, or -ESTALE, -EPERM (wrong token,
 * counted), -ECANCELED (over). */
int kvsp_room_find(struct kvsp *p, const struct kvsp_room_name *name);
/* A peer's sender attaches to the receiving room name names. Returns 0,
 * or -errno as kvsp_room_find, -EBUSY (a sender is attached), -EINVAL
 * (bytes or slot_size disagree). */
int kvsp_room_attach_peer(struct kvsp *p, struct kvsp_transport *t, uint32_t peer,
			  const struct kvsp_room_name *name, uint64_t bytes, uint64_t slot_size);
/* Posts a slot of room (index, gen) for chunk, pinned for t's writer
 * (RECV_POSTED). Returns 0 with *x and *dst (len bytes to write), or
 * -ESTALE/-ECANCELED (room gone or over), -EEXIST (chunk claimed already),
 * -EINVAL (no such chunk, or len is not its length), -ENOBUFS. */
int kvsp_chunk_post(struct kvsp *p, struct kvsp_transport *t, uint32_t peer, uint32_t room,
		    uint32_t gen, uint32_t chunk, uint32_t len, struct kvsp_xfer **x, void **dst);
/* x's bytes are all in its slot and the writer quiesced. The fence: the
 * chunk lands only if the slot is still that room's, posted at that
 * epoch, and the room that generation and open. Returns 0 (landed), or
 * -errno why it was discarded (counted). */
int kvsp_chunk_land(struct kvsp *p, struct kvsp_xfer *x);
/* x's writer quiesced and its bytes will never land (status says why:
 * the room fails unless it is over already). */
void kvsp_chunk_discard(struct kvsp *p, struct kvsp_xfer *x, int status);
/* x's writer quiesced without writing it: its slot goes back. Returns
 * true if the chunk may be posted anew (its room is open: the peer may
 * resend it another way; the room goes on), false if its room is over
 * (the chunk is discarded, counted). */
bool kvsp_chunk_unpost(struct kvsp *p, struct kvsp_xfer *x);
/* Counts a chunk read into a discard sink without a posted slot. */
void kvsp_chunk_sunk(struct kvsp *p);

/* The peer aborted room (index, gen). Returns 0, or -ESTALE (another
 * generation, or not carried by t to that peer: nothing changes, counted). */
int kvsp_room_peer_abort(struct kvsp *p, struct kvsp_transport *t, uint32_t peer, uint32_t room,
			 uint32_t gen, int status);
/* The peer's half of room (index, gen) has quiesced after an abort. */
void kvsp_room_peer_ended(struct kvsp *p, struct kvsp_transport *t, uint32_t peer, uint32_t room,
			  uint32_t gen);
/* Sending half: the peer refused the room (status) and holds nothing of it: the room fails
 * (ends ABORTED when status is -ECANCELED: the receiving room was aborted first). */
void kvsp_room_peer_refused(struct kvsp *p, struct kvsp_transport *t, uint32_t peer, uint32_t room,
			    uint32_t gen, int status);
/* Sending half: the peer's receiving half has every chunk. */
void kvsp_room_peer_done(struct kvsp *p, struct kvsp_transport *t, uint32_t peer, uint32_t room,
			 uint32_t gen);
/* The connection to peer is closed: no byte for it can arrive or leave any
 * more. Ends every transfer t holds for it (status) and aborts every room
 * it carried. */
void kvsp_peer_lost(struct kvsp *p, struct kvsp_transport *t, uint32_t peer, int status);

/* ------------------------------------------------ what they may use */

/* The transfer record that holds slot's pin (dir 0 when none). */
struct kvsp_xfer *kvsp_xfer_of(struct kvsp *p, uint32_t slot);
/* The slot's bytes. */
void *kvsp_slot_mem(struct kvsp *p, uint32_t slot);
/* The NUMA node the slot's memory is on, or -1 (the pool is not split by node). */
int kvsp_slot_node(const struct kvsp *p, uint32_t slot);
uint64_t kvsp_slot_size(const struct kvsp *p);
uint32_t kvsp_slot_count(const struct kvsp *p);
/* Rooms this proxy can hold (core room indices run below it). */
uint32_t kvsp_room_count(const struct kvsp *p);
/* This proxy's instance: random per start, in its descriptors. */
uint64_t kvsp_instance(const struct kvsp *p);
/* The published counters (the transport's own among them). */
struct kvs_stats *kvsp_xport_stats(struct kvsp *p);
/* The published peer table (KVS_MAX_PEERS entries): transports of peers write it. */
struct kvs_peer *kvsp_xport_peers(struct kvsp *p);
/* The loop's clock, read once a pass. */
uint64_t kvsp_xport_now(const struct kvsp *p);
/* True while room (index, gen) is open or aborting (its final not posted). */
bool kvsp_room_live(const struct kvsp *p, uint32_t room, uint32_t gen);
/* The room's user_data on each side (0 where none), for failpoint matching. */
void kvsp_room_user_data(const struct kvsp *p, uint32_t room, uint64_t *recv_ud, uint64_t *send_ud);
/* Adds failpoint name (at most 31 bytes; a module's own: "relay.send").
 * Returns its id (for the calls below), or -EEXIST, -ENOSPC, -EINVAL. */
int kvsp_fp_register(struct kvsp *p, const char *name);
/* Returns the id of failpoint name (the core's, the plane's or a data
 * path's), or -ENOENT. */
int kvsp_fp_lookup(const struct kvsp *p, const char *name);
/* Evaluates failpoint id (enum kvsp_fp_id, or a registered one) for a room. Returns 0 (pass), KVSP_FP_HOLD, or -errno. */
int kvsp_xport_fp(struct kvsp *p, unsigned id, uint32_t room);
/* Evaluates failpoint id for what ud names (not a room). Returns 0 (pass), KVSP_FP_HOLD, or -errno. */
int kvsp_xport_fp_ud(struct kvsp *p, unsigned id, uint64_t ud);
/* The failpoint's action now (enum kvs_fp_action) and its error. */
int kvsp_xport_fp_action(const struct kvsp *p, unsigned id, int *err);
/* What t holds at failpoint id is let go through release (kvstage-ctl's
 * release: work whose room's user_data & mask == match; returns how many). */
void kvsp_xport_fp_holder(struct kvsp *p, unsigned id, struct kvsp_transport *t,
			  unsigned (*release)(struct kvsp_transport *t, uint64_t match,
					      uint64_t mask));

/* Watches fd in the loop; events come to t->ops->on_fd with tag. Returns 0, or -errno. */
int kvsp_xport_fd_add(struct kvsp *p, struct kvsp_transport *t, int fd, uint32_t events,
		      uint32_t tag);
/* Stops watching fd (before closing it). */
void kvsp_xport_fd_del(struct kvsp *p, int fd);

#endif
