/* SPDX-License-Identifier: MIT */
/*
 * Rooms: lifetime, opens, abort and end, and what clients ask of them. A
 * receiving client opens one (bytes, and a descriptor with a random
 * token); a sending client opens its other half with that descriptor, on
 * this proxy or another, and hands it leased slots, one chunk each. The
 * transfers themselves, and the fence every landing passes, are xfer.c's.
 *
 * A room ends with exactly one final event on each attached handle. An
 * aborted room ends only after every slot it touched has quiesced, here
 * and, when its other half is on a peer, there.
 */
#include <endian.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "base/log.h"
#include "core/proxy.h"
#include "core/clients.h"
#include "core/rooms.h"
#include "core/xport.h"

#define NONE KVSP_NONE

/* ------------------------------------------------------------ helpers */

static void lru_del(struct kvsp *p, uint32_t i)
{
	struct kvsp_room *r = &p->rooms[i];
	if (r->lru_prev != NONE)
		p->rooms[r->lru_prev].lru_next = r->lru_next;
	else if (p->lru_head == i)
		p->lru_head = r->lru_next;
	else
		return; /* not on the list */
	if (r->lru_next != NONE)
		p->rooms[r->lru_next].lru_prev = r->lru_prev;
	else
		p->lru_tail = r->lru_prev;
	r->lru_prev = r->lru_next = NONE;
}

void kvsp_room_touch_move(struct kvsp *p, uint32_t i)
{
	struct kvsp_room *r = &p->rooms[i];
	lru_del(p, i);
	r->lru_prev = p->lru_tail;
	r->lru_next = NONE;
	if (p->lru_tail != NONE)
		p->rooms[p->lru_tail].lru_next = i;
	else
		p->lru_head = i;
	p->lru_tail = i;
}

static void new_token(struct kvsp *p, uint8_t token[16])
{
	if (p->rnd_used + 16 > sizeof(p->rnd)) {
		/* getrandom() only blocks before the pool is seeded at boot */
		ssize_t n = getrandom(p->rnd, sizeof(p->rnd), 0);
		if (n != (ssize_t)sizeof(p->rnd)) {
			LOG_ERR("getrandom: %s", n < 0 ? strerror(errno) : "short read");
			abort(); /* a guessable token would break invariant 4 */
		}
		p->rnd_used = 0;
	}
	memcpy(token, p->rnd + p->rnd_used, 16);
	p->rnd_used += 16;
}

bool kvsp_token_eq(const uint8_t a[16], const uint8_t b[16])
{
	uint8_t d = 0; /* constant time: a forger learns nothing from timing */
	for (int i = 0; i < 16; i++)
		d |= a[i] ^ b[i];
	return d == 0;
}

static struct kvsp_handle *handle_of(struct kvsp *p, struct kvsp_client *c, uint16_t h)
{
	return h < p->cfg.client_rooms ? &c->handles[h] : NULL;
}

/* The side of room r that c's handle h is. */
static struct kvsp_side *side_of(struct kvsp_room *r, const struct kvsp_client *c, uint16_t h,
				 uint8_t role)
{
	if (role == KVSP_SEND)
		return &r->send.client;
	if (role == KVSP_RECV)
		return &r->recv.client;
	for (unsigned k = 0; k < r->recv.njoined; k++)
		if (r->recv.joined[k].cid == c->id && r->recv.joined[k].handle == h)
			return &r->recv.joined[k];
	return NULL;
}

/* A reader of room r other than self still attached: its slots are that
 * reader's too, and stay until the last one lets go. */
static bool others_read(const struct kvsp_room *r, const struct kvsp_side *self)
{
	if (r->recv.client.cid && &r->recv.client != self)
		return true;
	for (unsigned k = 0; k < r->recv.njoined; k++)
		if (r->recv.joined[k].cid && &r->recv.joined[k] != self)
			return true;
	return false;
}

/* ---------------------------------------------------------- lifetime */

int kvsp_rooms_init(struct kvsp *p)
{
	uint32_t n = p->cfg.max_rooms;
	p->bits_words = (p->cfg.slot_count + 63) / 64;
	p->rooms = calloc(n, sizeof(*p->rooms));
	p->bits_arena = calloc((size_t)n * p->bits_words, sizeof(uint64_t));
	if (!p->rooms || !p->bits_arena)
		return -ENOMEM;
	for (uint32_t i = 0; i < n; i++) {
		struct kvsp_room *r = &p->rooms[i];
		r->gen = 1;
		r->lru_prev = r->lru_next = NONE;
		r->recv.placed_head = r->recv.posted_head = r->send.inflight_head = NONE;
		r->claimed_bits = p->bits_arena + (size_t)i * p->bits_words;
		r->next_free = i + 1 < n ? i + 1 : NONE;
	}
	p->room_free_head = 0;
	p->room_free_tail = n - 1;
	p->lru_head = p->lru_tail = p->mark_head = NONE;
	p->rnd_used = sizeof(p->rnd);
	return 0;
}

void kvsp_rooms_fini(struct kvsp *p)
{
	free(p->rooms);
	free(p->bits_arena);
	free(p->rtrace);
	p->rtrace = NULL;
	p->rooms = NULL;
	p->bits_arena = NULL;
}

/* A free room for client c, within its uid's share and its process's
 * (shares.h); NONE when the table or a share is full (-ENFILE to the
 * client either way). */
static uint32_t room_alloc(struct kvsp *p, const struct kvsp_client *c)
{
	if (!kvsp_share_takes_room(&p->shares, c->share) ||
	    !kvsp_share_takes_room(&p->shares, c->pshare))
		return NONE;
	uint32_t i = p->room_free_head;
	if (i == NONE) {
		kvsp_rooms_settle(p); /* a room that ended this pass may be free now */
		i = p->room_free_head;
	}
	if (i == NONE)
		return NONE;
	p->room_free_head = p->rooms[i].next_free;
	if (p->room_free_head == NONE)
		p->room_free_tail = NONE;
	p->rooms[i].share = c->share;
	p->rooms[i].pshare = c->pshare;
	p->shares.tab[c->share].rooms++;
	if (c->pshare != KVSP_NO_SHARE)
		p->shares.tab[c->pshare].rooms++;
	KVS_STAT_ADD(p->stats->rooms_open, 1);
	return i;
}

/* Back on the free list, FIFO, so an index is reused as late as possible;
 * the generation makes old descriptors stale anyway. */
static void room_free(struct kvsp *p, uint32_t i)
{
	struct kvsp_room *r = &p->rooms[i];
	r->state = KVSP_ROOM_FREE;
	r->gen++;
	p->shares.tab[r->share].rooms--;
	if (r->pshare != KVSP_NO_SHARE)
		p->shares.tab[r->pshare].rooms--;
	r->next_free = NONE;
	if (p->room_free_tail != NONE)
		p->rooms[p->room_free_tail].next_free = i;
	else
		p->room_free_head = i;
	p->room_free_tail = i;
	KVS_STAT_SUB(p->stats->rooms_open, 1);
}

/* Posts a final event to one side; detaches the side if its handle was
 * already closed by the client. */
static void post_final(struct kvsp *p, struct kvsp_side *s, uint16_t type, int status,
		       uint64_t bytes, uint32_t slot, uint32_t epoch)
{
	if (!s->cid)
		return;
	struct kvsp_client *c = kvsp_client_get(p, s->cidx, s->cid);
	if (!c) {
		s->cid = 0;
		return;
	}
	struct kvsp_handle *hd = &c->handles[s->handle];
	kvsp_client_final(p, c, s, type, status, bytes, slot, epoch);
	if (hd->state == KVSP_H_FREE)
		s->cid = 0;
}

static void note(struct kvsp *p, uint32_t i, int what, int status)
{
	struct kvsp_room *r = &p->rooms[i];
	if (r->far && r->xport->ops->notify)
		r->xport->ops->notify(r->xport, i, r->gen, what, status);
}

/* ------------------------------------------------------- end of life */

void kvsp_room_mark_new(struct kvsp *p, uint32_t i)
{
	struct kvsp_room *r = &p->rooms[i];
	r->marked = true;
	r->mark_next = p->mark_head;
	p->mark_head = i;
}

/* Every chunk is in: RECV_DONE here (and SEND_DONE to a sender here), or,
 * for a send half whose receiver is on a peer, SEND_DONE. */
static void room_complete(struct kvsp *p, uint32_t i, uint8_t type)
{
	struct kvsp_room *r = &p->rooms[i];
	lru_del(p, i);
	r->state = KVSP_ROOM_ENDED;
	r->final_type = type;
	p->rooms_active--;
	/* The receivers' finals first: a request waits on them (its KV is in),
	 * while SEND_DONE only hands back what the sender already let go of.
	 * The bookkeeping comes after both. */
	if (type == KVS_EV_RECV_DONE) {
		uint32_t epoch = p->slots.pub[r->recv.chunk0].epoch;
		post_final(p, &r->recv.client, KVS_EV_RECV_DONE, 0, r->bytes, r->recv.chunk0,
			   epoch);
		for (unsigned k = 0; k < r->recv.njoined; k++)
			post_final(p, &r->recv.joined[k], KVS_EV_RECV_DONE, 0, r->bytes,
				   r->recv.chunk0, epoch);
		note(p, i, KVSP_NOTE_DONE, 0);
	}
	post_final(p, &r->send.client, KVS_EV_SEND_DONE, 0, r->bytes, NONE, 0);
	if (p->trace)
		kvsp_rtrace_final(p, i, type, 0);
	KVS_STAT_ADD(p->stats->rooms_done, 1);
	kvsp_hist_add(&p->room_hist, p->now_ns - r->opened_ns);
}

/*
 * The one end-of-life rule of a room, looked at whenever something it
 * holds changed that can end it (kvsp_room_mark; the per-chunk paths mark
 * only what can: a local open room's last landing, not each chunk):
 *
 *   OPEN      every chunk landed here, and every reader
 *             of a shared room joined                  -> ENDED (RECV_DONE)
 *             send half, the peer has every chunk and
 *             none is in flight here                   -> ENDED (SEND_DONE)
 *   ABORTING  nothing in flight here                   -> the peer hears ENDED
 *             ... and nothing on the peer (far_live)   -> ENDED (its final)
 *   ENDED     no client attached                       -> FREE
 *             (a shared room's slots go back when its last reader leaves)
 *
 * A peer that never answers is the transport's to bound (invariant 7): it
 * loses the session, which ends far_live (kvsp_peer_lost).
 */
static void room_settle(struct kvsp *p, uint32_t i)
{
	struct kvsp_room *r = &p->rooms[i];
	if (r->state == KVSP_ROOM_OPEN) {
		if (r->recv.placed == r->nchunks && r->recv.njoined + 1u >= r->recv.readers)
			room_complete(p, i, KVS_EV_RECV_DONE);
		else if (r->far == KVSP_FAR_RECV && r->far_done && !r->send.inflight)
			room_complete(p, i, KVS_EV_SEND_DONE);
	}
	if (r->state == KVSP_ROOM_ABORTING && !r->send.inflight && !r->recv.posted) {
		if (r->far && !r->ended_told) {
			r->ended_told = true;
			note(p, i, KVSP_NOTE_ENDED, r->status);
		}
		if (!r->far || !r->far_live) {
			r->state = KVSP_ROOM_ENDED;
			p->rooms_active--;
			post_final(p, &r->send.client, r->final_type, r->status, 0, NONE, 0);
			post_final(p, &r->recv.client, r->final_type, r->status, 0, NONE, 0);
			for (unsigned k = 0; k < r->recv.njoined; k++)
				post_final(p, &r->recv.joined[k], r->final_type, r->status, 0, NONE,
					   0);
			if (p->trace)
				kvsp_rtrace_final(p, i, r->final_type, r->status);
		}
	}
	if (r->state == KVSP_ROOM_ENDED && !r->send.client.cid && !others_read(r, NULL)) {
		if (p->trace)
			kvsp_rtrace_reaped(p, i);
		room_free(p, i);
	}
}

void kvsp_rooms_settle_marked(struct kvsp *p)
{
	while (p->mark_head != NONE) {
		uint32_t i = p->mark_head;
		p->mark_head = p->rooms[i].mark_next;
		p->rooms[i].marked = false;
		room_settle(p, i);
	}
}

void kvsp_room_abort(struct kvsp *p, uint32_t i, int status, uint8_t type, bool told_by_peer)
{
	struct kvsp_room *r = &p->rooms[i];
	if (r->state != KVSP_ROOM_OPEN)
		return;
	r->state = KVSP_ROOM_ABORTING;
	r->status = status;
	r->final_type = type;
	lru_del(p, i);
	kvsp_room_mark(p, i);
	if (type == KVS_EV_FAILED)
		KVS_STAT_ADD(p->stats->rooms_failed, 1);
	else
		KVS_STAT_ADD(p->stats->rooms_aborted, 1);
	if (p->trace)
		kvsp_rtrace_abort(p, i, status);
	/* What the room holds is freed; what a transport still pins (sent
	 * and not quiesced, posted and being written) becomes a tombstone. */
	while (r->recv.placed_head != NONE) {
		uint32_t s = r->recv.placed_head;
		kvsp_slist_del(p, &r->recv.placed_head, s);
		kvsp_slot_kill(&p->slots, s);
	}
	for (uint32_t s = r->send.inflight_head; s != NONE; s = p->slots.priv[s].next)
		if (kvsp_slot_kill(&p->slots, s) == KVS_SLOT_TOMBSTONE && p->trace)
			kvsp_rtrace_tomb(p, i, KVSP_TR_SEND, p->slots.priv[s].chunk);
	for (uint32_t s = r->recv.posted_head; s != NONE; s = p->slots.priv[s].next)
		if (kvsp_slot_kill(&p->slots, s) == KVS_SLOT_TOMBSTONE && p->trace)
			kvsp_rtrace_tomb(p, i, KVSP_TR_RECV, p->slots.priv[s].chunk);
	/* Why, once (a timeout said so already); a client aborting at will
	 * is held to the rate limit. */
	if (status != -ETIMEDOUT)
		kvsp_log_rl(&p->rl_abort, p->now_ns, &p->stats->log_suppressed, KVSP_LOG_INFO,
			    "room %u %s: %s (%u chunks in flight, %u slots posted)", i,
			    told_by_peer	    ? "aborted by the peer proxy"
			    : type == KVS_EV_FAILED ? "failed"
						    : "aborted",
			    strerror(status < 0 ? -status : status), r->send.inflight,
			    r->recv.posted);
	r->xport->ops->cancel(r->xport, i, r->gen, status);
	if (!told_by_peer)
		note(p, i, KVSP_NOTE_ABORT, status);
}

void kvsp_rooms_abort_all(struct kvsp *p, int status)
{
	for (uint32_t i = 0; i < p->cfg.max_rooms; i++)
		kvsp_room_abort(p, i, status, KVS_EV_ABORTED, false);
	kvsp_rooms_settle(p);
}

uint64_t kvsp_rooms_tick(struct kvsp *p)
{
	uint64_t t = p->cfg.room_timeout_ns;
	if (!t)
		return UINT64_MAX;
	while (p->lru_head != NONE) {
		struct kvsp_room *r = &p->rooms[p->lru_head];
		if (p->now_ns - r->progress_ns < t)
			return r->progress_ns + t;
		kvsp_log_rl(&p->rl_timeout, p->now_ns, &p->stats->log_suppressed, KVSP_LOG_INFO,
			    "room %u: no progress for %llu ms, aborting", p->lru_head,
			    (unsigned long long)(t / 1000000));
		KVS_STAT_ADD(p->stats->rooms_timed_out, 1);
		kvsp_room_abort(p, p->lru_head, -ETIMEDOUT, KVS_EV_ABORTED, false);
		kvsp_rooms_settle(p);
	}
	return UINT64_MAX;
}

/* --------------------------------------------------------------- opens */

/* A room in use from now: both halves empty, nothing claimed. */
static struct kvsp_room *room_start(struct kvsp *p, uint32_t i, uint64_t bytes,
				    struct kvsp_transport *t)
{
	struct kvsp_room *r = &p->rooms[i];
	r->state = KVSP_ROOM_OPEN;
	r->final_type = 0;
	r->status = 0;
	r->far = KVSP_FAR_NONE;
	r->far_live = r->far_done = r->ended_told = false;
	r->peer = 0;
	r->bytes = bytes;
	r->nchunks = (uint32_t)((bytes + p->cfg.slot_size - 1) / p->cfg.slot_size);
	memset(r->claimed_bits, 0, ((r->nchunks + 63) / 64) * sizeof(uint64_t));
	r->recv =
		(struct kvsp_recv_half){ .placed_head = NONE, .posted_head = NONE, .chunk0 = NONE };
	r->send = (struct kvsp_send_half){ .inflight_head = NONE };
	r->xport = t;
	r->opened_ns = p->now_ns;
	return r;
}

static void attach_handle(struct kvsp *p, struct kvsp_client *c, uint16_t h, uint32_t i,
			  uint8_t role, uint64_t user_data)
{
	struct kvsp_room *r = &p->rooms[i];
	struct kvsp_side *s = role == KVSP_RECV	  ? &r->recv.client
			      : role == KVSP_SEND ? &r->send.client
						  : &r->recv.joined[r->recv.njoined++];
	*s = (struct kvsp_side){ c->id, c->idx, h, user_data, c->part };
	c->handles[h] = (struct kvsp_handle){ .state = KVSP_H_OPEN,
					      .role = role,
					      .room = i,
					      .user_data = user_data };
	c->finals_owed++;
	kvsp_room_touch(p, i);
}

int kvsp_room_open_recv(struct kvsp *p, struct kvsp_client *c, uint16_t h, uint64_t bytes,
			unsigned readers, uint64_t user_data, struct kvs_desc_wire *d)
{
	struct kvsp_handle *hd = handle_of(p, c, h);
	if (!hd || hd->state != KVSP_H_FREE)
		return -EBADF;
	if (!bytes || readers > KVS_MAX_READERS)
		return -EINVAL;
	if (bytes > (uint64_t)p->cfg.slot_count * p->cfg.slot_size)
		return -EMSGSIZE;
	if (p->draining)
		return -ESHUTDOWN;
	int rc = kvsp_fp_eval(&p->fp[KVSP_FP_RECV_OPEN], p->cfg.failpoints, user_data, user_data);
	if (rc < 0)
		return rc;
	uint32_t i = room_alloc(p, c);
	if (i == NONE)
		return -ENFILE;
	struct kvsp_room *r = room_start(p, i, bytes, p->local);
	new_token(p, r->token);
	r->recv.readers = (uint8_t)(readers ? readers : 1);
	p->rooms_active++;
	attach_handle(p, c, h, i, KVSP_RECV, user_data);
	if (p->trace)
		kvsp_rtrace_opened(p, i, KVSP_TR_RECV, NULL);

	memset(d, 0, sizeof(*d));
	d->magic = htole32(KVS_MAGIC_DESC);
	d->version = htole16(1);
	d->instance = htole64(p->instance);
	d->room = htole32(i);
	d->gen = htole32(r->gen);
	memcpy(d->token, r->token, 16);
	d->bytes = htole64(bytes);
	d->slot_size = htole64(p->cfg.slot_size);
	memcpy(d->endpoint, p->endpoint, sizeof(d->endpoint));
	return 0;
}

/* The descriptor names another proxy: a send half here, its receiving
 * half there, through the first transport that reaches it. Whether that
 * room exists is the peer's to say: a refusal comes as the final FAILED. */
static int open_send_far(struct kvsp *p, struct kvsp_client *c, uint16_t h,
			 const struct kvs_desc_wire *d, uint64_t user_data, uint64_t *bytes)
{
	struct kvsp_transport *t = NULL;
	uint32_t peer = 0;
	const struct kvsp_party who = { (uint32_t)c->uid, c->id, c->proc };
	int rc = -EOPNOTSUPP;
	for (unsigned k = 0; k < p->nxports && rc == -EOPNOTSUPP; k++)
		if (p->xports[k]->ops->reach) {
			t = p->xports[k];
			rc = t->ops->reach(t, d, &who, &peer);
		}
	if (rc < 0)
		return rc;
	uint64_t n = le64toh(d->bytes);
	if (!n || le64toh(d->slot_size) != p->cfg.slot_size)
		return -EINVAL; /* one deployment, one slot size: a chunk is a slot on both */
	if (n > (uint64_t)p->cfg.slot_count * p->cfg.slot_size)
		return -EMSGSIZE;
	if (p->draining)
		return -ESHUTDOWN;
	uint32_t i = room_alloc(p, c);
	if (i == NONE)
		return -ENFILE;
	struct kvsp_room *r = room_start(p, i, n, t);
	r->far = KVSP_FAR_RECV;
	r->far_live = true;
	r->peer = peer;
	memcpy(r->token, d->token, 16);
	rc = t->ops->attach(t, peer, i, r->gen, d);
	if (rc < 0) {
		r->state = KVSP_ROOM_ENDED; /* nobody attached: freed at once */
		room_free(p, i);
		return rc;
	}
	p->rooms_active++;
	attach_handle(p, c, h, i, KVSP_SEND, user_data);
	if (p->trace)
		kvsp_rtrace_opened(p, i, KVSP_TR_SEND, d);
	*bytes = n;
	return 0;
}

/* The room of ours desc names, its token checked (invariant 4), into *i;
 * NULL with *rc: -EINVAL (malformed), -ESTALE (gone, or not a room here),
 * -EPERM (wrong token: counted and logged). */
static struct kvsp_room *room_named(struct kvsp *p, struct kvsp_client *c,
				    const struct kvs_desc_wire *d, uint32_t *i, int *rc)
{
	*i = le32toh(d->room);
	*rc = *i >= p->cfg.max_rooms ? -EINVAL : -ESTALE;
	if (*i >= p->cfg.max_rooms)
		return NULL;
	struct kvsp_room *r = &p->rooms[*i];
	if (r->state == KVSP_ROOM_FREE || r->gen != le32toh(d->gen) || r->far == KVSP_FAR_RECV)
		return NULL;
	if (!kvsp_token_eq(r->token, d->token)) {
		KVS_STAT_ADD(p->stats->rej_token, 1);
		kvsp_log_rl(&c->rl[KVSP_RL_TOKEN], p->now_ns, &p->stats->log_suppressed,
			    KVSP_LOG_WARN, "client %u (pid %d): wrong token for room %u", c->id,
			    (int)c->pid, *i);
		*rc = -EPERM;
		return NULL;
	}
	return r;
}

/* Returns 0 if desc is one of ours in form and c's handle h is free, else -errno. */
static int desc_check(struct kvsp *p, struct kvsp_client *c, uint16_t h,
		      const struct kvs_desc_wire *d)
{
	struct kvsp_handle *hd = handle_of(p, c, h);
	if (!hd || hd->state != KVSP_H_FREE)
		return -EBADF;
	if (le32toh(d->magic) != KVS_MAGIC_DESC || le16toh(d->version) != 1)
		return -EINVAL;
	return 0;
}

int kvsp_room_open_send(struct kvsp *p, struct kvsp_client *c, uint16_t h,
			const struct kvs_desc_wire *d, uint64_t user_data, uint64_t *bytes)
{
	int rc = desc_check(p, c, h, d);
	if (rc)
		return rc;
	if (le64toh(d->instance) != p->instance)
		/* Another proxy's room, or one of ours from before a restart. */
		return d->endpoint[0] ? open_send_far(p, c, h, d, user_data, bytes) : -ESTALE;
	uint32_t i;
	struct kvsp_room *r = room_named(p, c, d, &i, &rc);
	if (!r)
		return rc;
	if (r->state != KVSP_ROOM_OPEN)
		return -ECANCELED;
	if (r->send.client.cid || r->far)
		return -EBUSY;
	attach_handle(p, c, h, i, KVSP_SEND, user_data);
	if (p->trace)
		kvsp_rtrace_opened(p, i, KVSP_TR_SEND, NULL);
	*bytes = r->bytes;
	return 0;
}

/* One more reader of a shared room of ours: only while it waits for
 * readers, and never more than its opener said. */
int kvsp_room_join(struct kvsp *p, struct kvsp_client *c, uint16_t h, const struct kvs_desc_wire *d,
		   uint64_t user_data, uint64_t *bytes)
{
	int rc = desc_check(p, c, h, d);
	if (rc)
		return rc;
	if (le64toh(d->instance) != p->instance)
		return -ESTALE; /* readers join where the bytes land: the opener's proxy */
	uint32_t i;
	struct kvsp_room *r = room_named(p, c, d, &i, &rc);
	if (!r)
		return rc;
	if (r->recv.readers < 2)
		return -EINVAL;
	if (r->recv.njoined + 1u >= r->recv.readers)
		return -EUSERS; /* whether or not it has completed since */
	if (r->state != KVSP_ROOM_OPEN)
		return -ECANCELED;
	attach_handle(p, c, h, i, KVSP_JOIN, user_data);
	kvsp_room_mark(p, i); /* the last reader may complete it */
	*bytes = r->bytes;
	return 0;
}

/* ---------------------------------------------------------------- send */

int kvsp_room_send(struct kvsp *p, struct kvsp_client *c, uint16_t h, const struct kvs_lease *l,
		   uint64_t offset, uint64_t len)
{
	struct kvsp_handle *hd = handle_of(p, c, h);
	if (!hd || hd->state == KVSP_H_FREE || hd->role != KVSP_SEND)
		return -EBADF;
	int st = kvsp_slot_check(&p->slots, c->id, l);
	if (st < 0)
		return st;
	if (st != KVS_SLOT_LEASED)
		return -EBUSY;
	uint32_t i = hd->room;
	struct kvsp_room *r = &p->rooms[i];
	if (hd->state != KVSP_H_OPEN || r->state != KVSP_ROOM_OPEN) {
		/* The room is over; the slot was given to it, so it is freed. */
		return kvsp_slot_release(&p->slots, c->id, l);
	}
	if (offset % p->cfg.slot_size || offset >= r->bytes)
		return -EINVAL;
	uint32_t chunk = (uint32_t)(offset / p->cfg.slot_size);
	if (len != kvsp_chunk_len(p, r, chunk))
		return -EINVAL;
	if (r->claimed_bits[chunk / 64] & (1ull << (chunk % 64)))
		return -EEXIST;
	kvsp_client_sent(c, len);
	kvsp_xfer_send(p, c->id, i, l, chunk);
	return 0;
}

/* ---------------------------------------------------- abort, close, map */

void kvsp_room_abort_from(struct kvsp *p, struct kvsp_client *c, uint16_t h, int status)
{
	struct kvsp_handle *hd = handle_of(p, c, h);
	if (hd->state != KVSP_H_OPEN)
		return; /* its final is posted or owed already: idempotent */
	kvsp_room_abort(p, hd->room, status, KVS_EV_ABORTED, false);
}

/* The receiver's slots still in room i go back to the pool. */
static void release_placed(struct kvsp *p, uint32_t i)
{
	struct kvsp_room *r = &p->rooms[i];
	while (r->recv.placed_head != NONE) {
		uint32_t s = r->recv.placed_head;
		kvsp_slist_del(p, &r->recv.placed_head, s);
		kvsp_slot_kill(&p->slots, s);
	}
}

void kvsp_room_detach(struct kvsp *p, struct kvsp_client *c, uint16_t h, int status)
{
	struct kvsp_handle *hd = handle_of(p, c, h);
	uint32_t i = hd->room;
	struct kvsp_room *r = &p->rooms[i];
	struct kvsp_side *side = side_of(r, c, h, hd->role);
	bool dead = status == -ECONNRESET;

	if (hd->state == KVSP_H_FREE || hd->state == KVSP_H_CLOSING)
		return;
	if (r->state == KVSP_ROOM_OPEN)
		kvsp_room_abort(p, i, status, KVS_EV_ABORTED, false);
	if (hd->role != KVSP_SEND && !others_read(r, side))
		release_placed(p, i); /* the last reader: its slots go back */
	if (hd->state == KVSP_H_OPEN && !dead) {
		/* The final is still owed to this handle: it frees it. */
		hd->state = KVSP_H_CLOSING;
		return;
	}
	if (hd->state == KVSP_H_OPEN)
		c->finals_owed--;
	hd->state = KVSP_H_FREE;
	side->cid = 0;
	kvsp_room_mark(p, i);
}

int kvsp_room_map(struct kvsp *p, struct kvsp_client *c, uint16_t h, struct kvs_lease *out)
{
	struct kvsp_handle *hd = handle_of(p, c, h);
	if (!hd || hd->state != KVSP_H_ENDED || hd->role == KVSP_SEND)
		return hd && hd->state == KVSP_H_OPEN ? -EAGAIN : -EBADF;
	struct kvsp_room *r = &p->rooms[hd->room];
	if (r->final_type != KVS_EV_RECV_DONE)
		return -ECANCELED;
	for (uint32_t k = 0; k < r->nchunks; k++)
		out[k] = (struct kvs_lease){ NONE, 0 };
	for (uint32_t s = r->recv.placed_head; s != NONE; s = p->slots.priv[s].next)
		out[p->slots.priv[s].chunk] = (struct kvs_lease){ s, p->slots.pub[s].epoch };
	return (int)r->nchunks;
}

int kvsp_lease_release(struct kvsp *p, struct kvsp_client *c, const struct kvs_lease *l)
{
	int st = kvsp_slot_check(&p->slots, c->id, l);
	if (st == KVS_SLOT_RECV_FILLED) {
		uint32_t i = p->slots.priv[l->slot].room;
		if (i != NONE && others_read(&p->rooms[i], &p->rooms[i].recv.client))
			return -EBUSY; /* a shared room's: its other readers read it */
		if (i != NONE)
			kvsp_slist_del(p, &p->rooms[i].recv.placed_head, l->slot);
	}
	return kvsp_slot_release(&p->slots, c->id, l);
}

void kvsp_slot_drop(struct kvsp *p, uint32_t slot)
{
	uint32_t i = p->slots.priv[slot].room;
	if (i != NONE && p->slots.pub[slot].state == KVS_SLOT_RECV_FILLED)
		kvsp_slist_del(p, &p->rooms[i].recv.placed_head, slot);
	kvsp_slot_kill(&p->slots, slot);
}

/* ---------------------------------------------------- a client gone */

void kvsp_client_reclaim(struct kvsp *p, struct kvsp_client *c)
{
	/* Nobody reads its rings any more: the rooms' finals go to their
	 * other sides only. */
	c->dying = true;
	for (uint16_t h = 0; h < p->cfg.client_rooms; h++)
		if (c->handles[h].state != KVSP_H_FREE)
			kvsp_room_detach(p, c, h, -ECONNRESET);
	/* What it still leases (outside rooms) goes back to the pool. */
	struct kvsp_slots *s = &p->slots;
	for (uint32_t i = 0; i < s->count; i++) {
		uint32_t room = s->priv[i].room;
		if (s->pub[i].owner != c->id)
			continue;
		if (s->pub[i].state == KVS_SLOT_RECV_FILLED && room != NONE &&
		    others_read(&p->rooms[room], NULL))
			continue; /* a shared room's: its last reader gives it back */
		kvsp_slot_drop(p, i);
	}
	c->finals_owed = 0;
	kvsp_rooms_settle(p);
}

void kvsp_client_destroy(struct kvsp *p, struct kvsp_client *c)
{
	kvsp_client_reclaim(p, c);
	kvsp_client_free(p, c);
}

void kvsp_client_cut_off(struct kvsp *p, struct kvsp_client *c)
{
	KVS_STAT_ADD(p->stats->clients_died, 1);
	kvsp_log_rl(&p->rl_died, p->now_ns, &p->stats->log_suppressed, KVSP_LOG_WARN,
		    "client %u (pid %d) cut off: its submission ring's producer index is %u "
		    "records past ours, and the ring holds %u",
		    c->id, (int)c->pid, c->sq.r->prod.tail - c->sq_cons, c->sq.r->capacity);
	kvsp_client_destroy(p, c);
}
