/* SPDX-License-Identifier: MIT */
/*
 * Rooms: one request's transfer, in two halves. The receiving half posts
 * slots and fences every landing; the sending half pins each slot it gives
 * a transport until the transport quiesces. A proxy may hold both halves
 * (a local room) or one, with the other on a peer proxy.
 *
 * rooms.c: lifetime, opens, abort and end (one rule: room_settle), what
 *          clients ask of a room.
 * xfer.c:  transfers and the transport API (xport.h): pins, quiescence,
 *          posting, the fence, what peers report.
 * roomtrace.c: the lifecycle trace's points (design note 45).
 */
#ifndef KVSP_ROOMS_H
#define KVSP_ROOMS_H

#include <stdbool.h>
#include <stdint.h>

#include "base/trace.h"
#include "core/clients.h"
#include "core/proxy.h"
#include "kvstage.h"
#include "layout.h"

struct kvsp;
struct kvsp_transport;

enum kvsp_room_state {
	KVSP_ROOM_FREE = 0,
	KVSP_ROOM_OPEN,
	KVSP_ROOM_ABORTING, /* waiting for its transfers (and the peer's half) to quiesce */
	KVSP_ROOM_ENDED,    /* final events posted */
};

struct kvsp_recv_half {
	struct kvsp_side client;		      /* the opener */
	struct kvsp_side joined[KVS_MAX_READERS - 1]; /* a shared room's other readers */
	uint8_t readers, njoined;	   /* readers it waits for (1: not shared); joined so far */
	uint32_t placed, posted;	   /* chunks landed; slots pinned for a writer */
	uint32_t placed_head, posted_head; /* slot lists through kvsp_slot_priv */
	uint32_t chunk0;		   /* slot holding chunk 0, once placed */
};

struct kvsp_send_half {
	struct kvsp_side client;
	uint32_t inflight, inflight_head; /* slots pinned for the transport */
};

/* What the trace keeps of a room (core/roomtrace.c), beside it in p->rtrace,
 * allocated only while tracing: the room itself stays as the chunk path
 * had it. */
struct kvsp_room_trace {
	uint64_t instance;     /* the room's key: the receiving proxy's instance, */
	uint32_t room, gen;    /* ... its room index and generation there */
	uint32_t queued, sent; /* chunks given to the transport, and done with by it */
	uint8_t sides;	       /* 1 << KVSP_TR_RECV, _SEND: the halves that said room_opened */
	bool flight;	       /* a chunk failed in flight: the abort fences it */
};

/* Where the half this proxy does not hold lives. */
enum kvsp_far { KVSP_FAR_NONE = 0, KVSP_FAR_RECV, KVSP_FAR_SEND };

struct kvsp_room {
	uint32_t gen;
	uint16_t share;	 /* the uid whose client opened it (p->shares) */
	uint16_t pshare; /* ... and its process, or KVSP_NO_SHARE */
	uint8_t state;
	uint8_t final_type; /* KVS_EV_* when ENDED */
	uint8_t far;	    /* enum kvsp_far: the other half is on peer, through xport */
	bool far_live;	    /* the peer's half has not ended: an abort waits for it */
	bool far_done;	    /* sending half: the peer's receiving half has every chunk */
	bool ended_told;    /* the peer heard that our half quiesced */
	int32_t status;
	uint8_t token[16]; /* frames about the room carry it (invariant 4) */
	uint64_t bytes;
	uint32_t nchunks;
	uint32_t peer;
	uint64_t *claimed_bits; /* chunks sent (sending half) or posted (receiving half, remote sender) */
	struct kvsp_recv_half recv;
	struct kvsp_send_half send;
	uint64_t progress_ns;
	uint64_t opened_ns;	     /* for the room duration histogram */
	uint32_t lru_prev, lru_next; /* open rooms, oldest progress first */
	uint32_t next_free;
	uint32_t mark_next; /* on the marked list while marked */
	bool marked;
	struct kvsp_transport *xport;
};

/* rooms.c */
int kvsp_rooms_init(struct kvsp *p);
void kvsp_rooms_fini(struct kvsp *p);
/* A receiving room for bytes, read by readers clients (0 or 1: c alone); its descriptor into desc. Returns 0, or -EBADF, -EINVAL, -EMSGSIZE, -ESHUTDOWN, -ENFILE. */
int kvsp_room_open_recv(struct kvsp *p, struct kvsp_client *c, uint16_t h, uint64_t bytes,
			unsigned readers, uint64_t user_data, struct kvs_desc_wire *desc);
/* Attaches c's handle h as one more reader of desc's shared room. Returns 0 with *bytes, or -EBADF, -EINVAL, -ESTALE, -EPERM, -ECANCELED, -EUSERS. */
int kvsp_room_join(struct kvsp *p, struct kvsp_client *c, uint16_t h,
		   const struct kvs_desc_wire *desc, uint64_t user_data, uint64_t *bytes);
/* Attaches c's handle h as the sender of desc's room (here, or through a transport). Returns 0 with *bytes, or -errno. */
int kvsp_room_open_send(struct kvsp *p, struct kvsp_client *c, uint16_t h,
			const struct kvs_desc_wire *desc, uint64_t user_data, uint64_t *bytes);
/* Gives lease l to the room as the chunk at offset. Returns 0, or -errno (nothing changed). */
int kvsp_room_send(struct kvsp *p, struct kvsp_client *c, uint16_t h, const struct kvs_lease *l,
		   uint64_t offset, uint64_t len);
void kvsp_room_abort_from(struct kvsp *p, struct kvsp_client *c, uint16_t h, int status);
void kvsp_room_detach(struct kvsp *p, struct kvsp_client *c, uint16_t h, int status);
/* The receiver's chunk leases, once complete. Returns their count, or -EAGAIN, -EBADF, -ECANCELED. */
int kvsp_room_map(struct kvsp *p, struct kvsp_client *c, uint16_t h, struct kvs_lease *out);
int kvsp_lease_release(struct kvsp *p, struct kvsp_client *c, const struct kvs_lease *l);
/* The slot's owner is gone: off its room's lists, then killed. */
void kvsp_slot_drop(struct kvsp *p, uint32_t slot);
/* A client is gone: aborts its rooms, frees its slots (tombstones where pinned). */
void kvsp_client_reclaim(struct kvsp *p, struct kvsp_client *c);
/* kvsp_client_reclaim, then frees the client itself. */
void kvsp_client_destroy(struct kvsp *p, struct kvsp_client *c);
/* A client whose submission ring claims more records than it holds
 * (kvsp_sq_waiting < 0) wrote its indices by hand: taken at its word, the
 * proxy would read the ring for ever while the client sleeps. It is
 * destroyed as a dead one is, with a log line, and counted as died. */
void kvsp_client_cut_off(struct kvsp *p, struct kvsp_client *c);
/* Aborts rooms past --room-timeout. Returns the next deadline. */
uint64_t kvsp_rooms_tick(struct kvsp *p);
void kvsp_rooms_abort_all(struct kvsp *p, int status);

/* Core-internal, shared by rooms.c and xfer.c; inline: every chunk takes them. */

/* Puts slot at the head of a room's list (linked through the slots' private records). */
static inline void kvsp_slist_push(struct kvsp *p, uint32_t *head, uint32_t slot)
{
	struct kvsp_slot_priv *sp = p->slots.priv;
	sp[slot].prev = KVSP_NONE;
	sp[slot].next = *head;
	if (*head != KVSP_NONE)
		sp[*head].prev = slot;
	*head = slot;
}

/* Takes slot off the list at head. */
static inline void kvsp_slist_del(struct kvsp *p, uint32_t *head, uint32_t slot)
{
	struct kvsp_slot_priv *sp = p->slots.priv;
	if (sp[slot].prev != KVSP_NONE)
		sp[sp[slot].prev].next = sp[slot].next;
	else
		*head = sp[slot].next;
	if (sp[slot].next != KVSP_NONE)
		sp[sp[slot].next].prev = sp[slot].prev;
	sp[slot].prev = sp[slot].next = KVSP_NONE;
}

void kvsp_room_touch_move(struct kvsp *p, uint32_t i);
/* Progress: the room moves to the young end of the timeout list (where a
 * room being sent already is). */
static inline void kvsp_room_touch(struct kvsp *p, uint32_t i)
{
	p->rooms[i].progress_ns = p->now_ns;
	if (p->lru_tail != i)
		kvsp_room_touch_move(p, i);
}

/* Bytes of chunk of room r: a slot's, or what is left for the last. */
static inline uint64_t kvsp_chunk_len(const struct kvsp *p, const struct kvsp_room *r,
				      uint32_t chunk)
{
	uint64_t off = (uint64_t)chunk * p->cfg.slot_size;
	uint64_t left = r->bytes - off;
	return left < p->cfg.slot_size ? left : p->cfg.slot_size;
}
/* Aborts room i (type KVS_EV_ABORTED or FAILED); told_by_peer: the peer aborted it. */
void kvsp_room_abort(struct kvsp *p, uint32_t i, int status, uint8_t type, bool told_by_peer);
/* Something room i holds changed that can end it (its last landing, the
 * last pin of an ended or far half, its state, the peer's half, a client):
 * kvsp_rooms_settle looks at it. */
void kvsp_room_mark_new(struct kvsp *p, uint32_t i);
static inline void kvsp_room_mark(struct kvsp *p, uint32_t i)
{
	if (!p->rooms[i].marked)
		kvsp_room_mark_new(p, i);
}
/* Applies the one end-of-life rule (rooms.c, room_settle) to every marked
 * room: completes, ends or frees it. The core settles at the end of each
 * event the loop hands it (a client's op or death, a transport's poll or
 * fd, a tick); transports only mark. */
void kvsp_rooms_settle_marked(struct kvsp *p);
static inline void kvsp_rooms_settle(struct kvsp *p)
{
	if (p->mark_head != KVSP_NONE) /* after most ops and passes, none is */
		kvsp_rooms_settle_marked(p);
}
/* xfer.c: pins lease l (checked) for chunk of room i and gives it to the room's transport. */
void kvsp_xfer_send(struct kvsp *p, uint32_t owner, uint32_t i, const struct kvs_lease *l,
		    uint32_t chunk);
bool kvsp_token_eq(const uint8_t a[16], const uint8_t b[16]);

/*
 * roomtrace.c: the trace's points in a room's life (base/trace.h does the
 * rest). Each is called behind `if (p->trace)`, so tracing off costs the
 * chunk path one well-predicted branch on a pointer at each point, and
 * nothing here runs. Lines name a room by its key (the receiving proxy's
 * instance, room index and generation: what the engine's own trace names
 * from the descriptor), never by its token.
 */
/* Traces rooms into t from now (p->trace). Returns 0, or -ENOMEM. */
int kvsp_rtrace_attach(struct kvsp *p, struct kvsp_trace *t);
/* A half of room i is here (side: KVSP_TR_RECV or _SEND); d: the
 * descriptor a far send half was opened with (its key), else NULL. */
void kvsp_rtrace_opened(struct kvsp *p, uint32_t i, uint8_t side, const struct kvs_desc_wire *d);
/* The sending half gave chunk to a transport (its first and last get a line). */
void kvsp_rtrace_queued(struct kvsp *p, uint32_t i, uint32_t chunk);
/* The transport is done with chunk, sent (its room's last gets a line). */
void kvsp_rtrace_sent(struct kvsp *p, uint32_t i, uint32_t chunk);
/* Chunk landed in the receiving half (its first and last get a line). */
void kvsp_rtrace_landed(struct kvsp *p, uint32_t i, uint32_t chunk);
/* Both at once: a local hand-off. */
void kvsp_rtrace_handed(struct kvsp *p, uint32_t i, uint32_t chunk);
/* Queued, sent and landed at once: a chunk landed at its submit (the local hand-off). */
void kvsp_rtrace_submitted(struct kvsp *p, uint32_t i, uint32_t chunk);
/* A chunk of room i failed in flight: the abort that follows fences it. */
void kvsp_rtrace_flight(struct kvsp *p, uint32_t i);
/* Room i leaves OPEN (abort, failure, lost peer): fenced if anything was in flight here. */
void kvsp_rtrace_abort(struct kvsp *p, uint32_t i, int status);
/* A slot of room i's side, holding chunk, became a tombstone. */
void kvsp_rtrace_tomb(struct kvsp *p, uint32_t i, uint8_t side, uint32_t chunk);
/* Room i's finals were posted: type KVS_EV_* (RECV_DONE: the send side's is SEND_DONE). */
void kvsp_rtrace_final(struct kvsp *p, uint32_t i, uint8_t type, int status);
/* Room i is freed: nothing of it is held any more. */
void kvsp_rtrace_reaped(struct kvsp *p, uint32_t i);

#endif
