/* SPDX-License-Identifier: MIT */
/*
 * The RDMA READ data path's own state, shared by its three files:
 *
 *   rdma.c       a session's queue pair and its life (HELLO, the one
 *                receive that only the error state completes, what a
 *                failed queue pair means), completions, the ops table;
 *   rdma_send.c  the chunks we send: a key per chunk, granted before its
 *                CHUNK_READ leaves and revoked at its ack, its room's abort
 *                or its session's loss;
 *   rdma_recv.c  the chunks we pull: READs into slots we posted, and the
 *                acks they owe.
 *
 * Work requests name their kind, their session and their slot in wr_id,
 * so a completion that outlived its session (a queue pair destroyed at
 * the deadline) is recognised and dropped.
 */
#ifndef KVSP_RDMA_H
#define KVSP_RDMA_H

#include <stdbool.h>
#include <stdint.h>

#include "core/xport.h"
#include "base/log.h"
#include "datapath/datapath.h"
#include "datapath/verbs.h"
#include "peer/session.h"
#include "peer/wire.h"

#define NONE UINT32_MAX
#define WINDOW KVSP_RDMA_WINDOW
/* Keys a session's sent chunks may hold at once (announced ones, and ones
 * being bound or revoked): its windows. */
#define KEYS_MAX (2 * WINDOW)
/* Sends one queue pair may have outstanding: our READs, and a bind or an
 * invalidate per key. */
#define SQ_DEPTH (WINDOW + KEYS_MAX)

/* Rails: devices a proxy drives at once (--rdma-device, each its own). */
#define RAILS_MAX 4

/* Its options (kvstaged --rdma-*). */
struct rdma_conf {
	const char *devices[RAILS_MAX]; /* --rdma-device, in order; none: as --transport says */
	unsigned ndevices;
	int gid_index; /* -1: each device's first RoCE v2 GID, IPv4-mapped first */
	enum kvsp_keys keys;
};

/* Its failpoints, from its first (dp.fp). */
enum { RDMA_FP_READ = 0 };

enum wr_kind { WR_READ = 1, WR_BIND, WR_INV, WR_SENTINEL };

/* kind:4 | slot:28 | session id:32. */
static inline uint64_t wr_id(enum wr_kind k, uint32_t slot, uint32_t sess)
{
	return (uint64_t)k << 60 | (uint64_t)(slot & 0x0fffffff) << 32 | sess;
}
#define WR_KIND(id) ((enum wr_kind)((id) >> 60))
#define WR_SLOT(id) ((uint32_t)((id) >> 32) & 0x0fffffff)
#define WR_SESS(id) ((uint32_t)(id))
#define SLOTS_MAX 0x0fffffffu

/* A sent chunk's key, by our slot. */
enum rsend_state {
	S_NONE = 0,
	S_QUEUED,    /* waiting for a key (the session's keys are all out) */
	S_BINDING,   /* its window's bind is posted */
	S_READY,     /* keyed: its CHUNK_READ is owed */
	S_ANNOUNCED, /* its CHUNK_READ left: the peer may READ it until its ack */
	S_REVOKING,  /* its window's invalidate is posted */
};
/* What a chunk's end is, once its key is revoked. */
enum rsend_then { T_ACKED = 0, T_CANCELLED, T_RECARRY };

struct rsend {
	struct kvs_wire_room room; /* the receiving room */
	uint32_t sess;		   /* the session it goes to */
	uint32_t next;		   /* the session's queued or ready list */
	uint32_t kprev, knext;	   /* the session's keyed list */
	uint32_t rkey;
	uint16_t win;	       /* windows: its window's index */
	uint16_t gen;	       /* the session's queue pair it was keyed on (rsess.gen) */
	uint8_t state;	       /* enum rsend_state */
	uint8_t then;	       /* enum rsend_then */
	struct ibv_mr *region; /* regions: its key */
};

/* One of a session's memory windows; the free ones in FIFO order, so
 * each one's key tag moves as slowly as it can. */
struct rwin {
	struct ibv_mw *mw; /* mw->rkey: its last key; the next bind takes the tag after it */
	uint16_t next;
};
#define WIN_NONE UINT16_MAX

/* Receiving side: a READ we posted into our slot, or its ack still owed. */
struct rread {
	struct kvs_wire_room name;
	uint64_t sender_ref;
	uint32_t sess, chunk;
	uint32_t next; /* the session's ack or held list */
	uint32_t len, rkey;
	void *dst;
	uint64_t raddr;
};

/* One session's RDMA state, by session index. */
struct rsess {
	uint32_t id; /* the session it is for; another id: stale, reset */
	struct ibv_qp *qp;
	struct kvsp_verbs_ep local, peer;
	bool owe_hello, heard, up;
	bool peer_pending; /* rs->peer is a HELLO for our next queue pair */
	uint32_t gen;	   /* queue pairs made before this one: a key of an older one is dead */
	unsigned relinks, hellos;
	bool lost;	 /* the session is lost: we moved the queue pair to error */
	bool broken;	 /* the queue pair failed under a live session: draining */
	bool judged;	 /* ... and what it meant was decided: RDMA is off for it */
	bool keys_dead;	 /* every key it granted is dead (rsend_link_dead) */
	int own_fault;	 /* a work request of ours failed (not flushed): its status */
	unsigned posted; /* our work requests on qp not yet completed, the sentinel too */
	bool sentinel;	 /* ... of which the sentinel receive is one */
	/* receiving */
	unsigned out;				 /* READs posted (or held), not completed */
	uint32_t ack_head, ack_tail;		 /* our slots whose READ ended, CHUNK_ACK owed */
	uint32_t held_head, held_tail;		 /* READs the rdma.read failpoint holds (tests) */
	struct kvs_wire_chunk_ack nacks[WINDOW]; /* CHUNK_READs refused, acks owed */
	unsigned nack_head, nnacks;
	/* sending */
	uint32_t q_head, q_tail;	 /* chunks waiting for a key */
	uint32_t ready_head, ready_tail; /* keyed chunks whose CHUNK_READ is owed */
	uint32_t keyed;			 /* every chunk holding a key (a circle, by kprev/knext) */
	unsigned unacked;		 /* CHUNK_READs sent whose ack has not come (revoked too) */
	unsigned nkeys;			 /* chunks holding a key */
	struct {
		uint64_t ref, at_ns; /* an xfer ref revoked before its ack came, and when */
	} revoked[WINDOW];	     /* each holds a window place: owed within --peer-timeout */
	unsigned nrevoked;
	bool revoked_early; /* ... one was, on this queue pair: a READ of it
					  * may have been on its way, and refused */
	struct rwin *win;   /* windows: KEYS_MAX, made as needed */
	uint16_t nwin, win_free, win_last;
};

/* Its counters in the counter block (rdma.c's rdma_counters, in this
 * order): r->dp.ctr[RDMA_CTR_*]. */
enum rdma_ctr {
	RDMA_CTR_READS,		/* chunks pulled by RDMA READ (landed or not) */
	RDMA_CTR_BYTES_RX,	/* ... their bytes */
	RDMA_CTR_BINDS,		/* chunk keys granted by binding a memory window */
	RDMA_CTR_INVALIDATES,	/* window keys revoked by a local invalidate (completed) */
	RDMA_CTR_REGIONS,	/* chunk keys granted by registering a region (no windows) */
	RDMA_CTR_REGION_FREES,	/* region keys revoked by deregistering */
	RDMA_CTR_READS_REFUSED, /* peers' READs our NIC refused (a key not held, or past it) */
	RDMA_CTR_LINKS_LOST,	/* queue pairs that failed under a live session (made again) */
	RDMA_CTR_SESSIONS,	/* gauge: sessions whose chunks go by READ now */
	RDMA_NCTR,
};

/* What each rail counts of its own (rdma_rail<N>_*, rails.c). */
enum rail_ctr {
	RAIL_CTR_SENT,	     /* chunks announced on it (CHUNK_READ sent) */
	RAIL_CTR_SENT_BYTES, /* ... their bytes */
	RAIL_CTR_READS,	     /* chunks pulled on it */
	RAIL_CTR_BYTES_RX,   /* ... their bytes */
	RAIL_CTR_LINKS_LOST, /* its queue pairs that failed under a live session */
	RAIL_CTR_LINKS,	     /* gauge: sessions with a queue pair up on it */
	RAIL_NCTR,
};

struct rails;

/* One rail: a device, and a queue pair on it for each session whose peer
 * has that rail too. The RDMA data path (rails.c) is one or more of them. */
struct rdma {
	struct kvsp_dp dp; /* the data path's, ops: kvsp_rail_ops */
	unsigned rail;	   /* its place in --rdma-device: it pairs with the peer's of that place */
	int node;	   /* the NUMA node its device hangs off, or -1 */
	struct rails *rails;
	uint64_t *rail_ctr; /* RAIL_CTR_* */
	struct kvsp_verbs verbs;
	struct kvsp_rl rl; /* lines a peer can cause */
	bool armed;	   /* the CQ will raise an event on its next completion */
	struct rsess rs[PSESS_MAX];
	struct rread *rread; /* by our slot index */
	struct rsend *rsend; /* by our slot index */
	unsigned busy;	     /* work requests posted, sentinels aside, every session */
	unsigned nheld;	     /* READs held by rdma.read, every session: 0 on any real run */
};

static inline struct rdma *rdma_of(struct kvsp_dp *dp)
{
	return (struct rdma *)dp;
}

/* s's state here; what an earlier session at its index left is dropped. */
struct rsess *rs_of(struct rdma *r, const struct psess *s);
/* The session a live record names, or NULL. */
struct psess *rs_session(struct rdma *r, const struct rsess *rs);
/* A work request of ours was posted on rs's queue pair: counted. */
static inline void rs_posted(struct rdma *r, struct rsess *rs)
{
	rs->posted++;
	r->busy++;
}
/* A log line a peer can cause, rate limited. */
#define RLOG(r, lvl, ...)                                                                  \
	kvsp_log_rl(&(r)->rl, kvsp_xport_now((r)->dp.p), &(r)->dp.st->log_suppressed, lvl, \
		    __VA_ARGS__)

/* Why a live session's queue pair failed, besides a work request's status. */
enum { RS_PEER_SENT = -1, RS_PEER_GAVE_UP = -2, RS_POST_FAILED = -3, RS_PEER_RELINKED = -4 };
/* Queue pairs a session makes again after its last failed: past these, RDMA stays off for it. */
#define RELINKS_MAX 16
/* Moves rs's queue pair to the error state for why: its work requests
 * flush, and once they are in, RDMA is off for the session. */
void rs_break(struct rdma *r, struct rsess *rs, int why);
/* A completion of ours on rs's queue pair (wc), counted back; a failure
 * breaks the link (rdma.c decides what it meant once all are in). */
void rs_completed(struct rdma *r, struct rsess *rs, const struct ibv_wc *wc);
/* True while rs's queue pair can take work and its peer's READs. */
static inline bool rs_usable(const struct rsess *rs)
{
	return rs->qp && rs->up && !rs->broken && !rs->lost;
}

/* rdma.c: a rail's life, and its half of the data path interface. */
extern const struct kvsp_dp_ops kvsp_rail_ops;
/* Opens rail idx on device (NULL: the first found) for base's plane.
 * Returns it, or NULL with *rc (-errno) and e (why) said. */
struct rdma *rail_open(const struct kvsp_dp *base, const char *device, int gid_index,
		       enum kvsp_keys keys, unsigned idx, char *e, size_t elen, int *rc);
/* s's queue pair on r came up or went down (counted once a change). */
void rail_link(struct rdma *r, struct rsess *rs, bool up);

/* rails.c: what a rail asks of the data path it is part of. */
/* x goes to s another way: another rail that carries s, else the next
 * data path. Returns 0, or -errno (no other way: nothing started). */
int rails_elsewhere(struct rails *rl, struct rdma *from, struct psess *s, struct kvsp_xfer *x,
		    const struct kvs_wire_room *room);
/* A rail's queue pair for session sess went up (up) or down, its rs->up
 * already set: rdma_sessions counts the sessions with one up or more. */
void rails_link(struct rails *rl, uint32_t sess, bool up);

/* rdma_send.c */
int rsend_chunk(struct rdma *r, struct psess *s, struct kvsp_xfer *x,
		const struct kvs_wire_room *room);
void rsend_on_ack(struct rdma *r, struct psess *s, const struct kvs_wire_chunk_ack *b);
bool rsend_next(struct rdma *r, struct rsess *rs, struct kvsp_dp_frame *out);
void rsend_cancel(struct rdma *r, uint32_t room, uint32_t gen);
void rsend_bind_done(struct rdma *r, struct rsess *rs, uint32_t slot, const struct ibv_wc *wc);
void rsend_inv_done(struct rdma *r, struct rsess *rs, uint32_t slot, const struct ibv_wc *wc);
/* Keys can be granted again (one was freed): queued chunks get theirs. */
int rsend_pump(struct rdma *r, struct rsess *rs);
/* The queue pair is dead (error state, every work request in): every key
 * of rs dies now (windows freed, regions deregistered) and its chunks end
 * or go by the stream (link_lost) as their state says. */
void rsend_link_dead(struct rdma *r, struct rsess *rs, struct psess *s, bool link_lost);
/* Whether ref was revoked before its ack; if so it is forgotten. */
bool rsend_forget_revoked(struct rsess *rs, uint64_t ref);

/* rdma_recv.c */
int rrecv_on_read(struct rdma *r, struct psess *s, const struct kvs_wire_chunk_read *b);
bool rrecv_next(struct rdma *r, struct rsess *rs, struct kvsp_dp_frame *out);
void rrecv_read_done(struct rdma *r, struct rsess *rs, uint32_t slot, const struct ibv_wc *wc);
/* Held READs go once the rdma.read failpoint lets go. */
int rrecv_release_held(struct rdma *r);
/* Held READs of rs end without being posted: unposted when the link is
 * lost (their chunks come again by the stream), discarded when the session is. */
void rrecv_drop_held(struct rdma *r, struct rsess *rs, bool session_lost);

#endif
