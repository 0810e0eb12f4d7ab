/* SPDX-License-Identifier: MIT */
/*
 * libFuzzer target: the proxy's decoder and state machine, in process, with
 * no sockets. An input is a script of steps over four clients: raw
 * submission records (through the real ring and back-pressure), records
 * aimed near valid state, descriptors (real ones with bit flips, or
 * garbage) in the request area, failpoint flips that hold chunks in
 * flight, scribbles on a client's own ring indices, event drains, and
 * client deaths. After every step the slot table must satisfy every
 * invariant; after every input, with all clients gone and all transfers
 * quiesced, the pool must be entirely free and no room open.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "core/proxy.h"
#include "core/clients.h"
#include "core/ops.h"
#include "core/rooms.h"
#include "core/xport.h"
#include "host/loop.h"
#include "ring.h"

#define NCLIENTS 4
#define NSLOTS 16

static struct kvsp P;
static struct kvsp_client *cl[NCLIENTS];
static uint32_t shadow_epoch[NSLOTS];
static struct kvs_desc_wire last_desc;

static void die(const char *why, uint32_t slot)
{
	fprintf(stderr, "invariant broken: %s (slot %u)\n", why, slot);
	abort();
}

static void setup(void)
{
	struct kvsp_config cfg = {
		.socket_path = NULL, /* in process: no socket */
		.slot_count = NSLOTS,
		.slot_size = 4096,
		.huge = KVSP_HUGE_OFF,
		.log_level = -1,
		.failpoints = true,
		.max_rooms = 8,
		.client_rooms = 4,
		.max_clients = NCLIENTS,
		.sq_count = 64,
		.room_timeout_ns = 0,
	};
	if (kvsp_init(&P, &cfg) < 0)
		abort();
	kvsp_log_level = -1;
	for (uint32_t i = 0; i < NSLOTS; i++)
		shadow_epoch[i] = P.slots.pub[i].epoch;
}

static struct kvsp_client *client(unsigned i)
{
	if (!cl[i])
		cl[i] = kvsp_client_new(&P, -1, 1000 + (pid_t)i, 0, 1000 + (uint64_t)i);
	if (!cl[i])
		abort();
	return cl[i];
}

/* Death without the munmaps: reclaim exactly as a death does, then reset
 * the rings and take a new identity, as a fresh client would have. */
static void reborn(struct kvsp_client *c)
{
	kvsp_client_reclaim(&P, c);
	memset(c->handles, 0, P.cfg.client_rooms * sizeof(*c->handles));
	memcpy(&c->sq.r->prod, P.sq_tmpl, P.tmpl_len);
	memcpy(&c->cq.r->prod, P.cq_tmpl, P.tmpl_len);
	c->id = ++P.next_cid;
	c->dying = false; /* a new client in the old one's place */
}

static bool live_owner(uint32_t id)
{
	for (unsigned i = 0; i < NCLIENTS; i++)
		if (cl[i] && cl[i]->id == id)
			return true;
	return false;
}

static void check(void)
{
	uint64_t count[KVS_SLOT_NSTATES] = { 0 };
	for (uint32_t i = 0; i < NSLOTS; i++) {
		const struct kvs_slot *s = &P.slots.pub[i];
		if (s->state >= KVS_SLOT_NSTATES)
			die("bad state", i);
		count[s->state]++;
		/* every pin belongs to a transfer record, and only a pin has one */
		if (s->pins != (P.xfers[i].dir != 0) || (s->pins && P.xfers[i].slot != i))
			die("a pin without its transfer record, or a record without a pin", i);
		if (KVS_EPOCH_AFTER(shadow_epoch[i], s->epoch))
			die("epoch went backwards", i);
		shadow_epoch[i] = s->epoch;
		switch (s->state) {
		case KVS_SLOT_FREE:
			if (s->owner || s->pins)
				die("free slot with owner or pins", i);
			break;
		case KVS_SLOT_TOMBSTONE:
			if (s->owner || !s->pins)
				die("tombstone with owner or no pins", i);
			break;
		case KVS_SLOT_INFLIGHT:
			if (!live_owner(s->owner) || s->pins > 1)
				die("in flight for a dead owner", i);
			break;
		default:
			if (!live_owner(s->owner) || (s->state != KVS_SLOT_RECV_POSTED && s->pins))
				die("held by a dead owner, or pinned", i);
		}
	}
	if (memcmp(count, P.stats->slots, sizeof(count)))
		die("published counts drifted", 0);
	if (P.slots.nfree != count[KVS_SLOT_FREE])
		die("free stack size", 0);
	for (uint32_t k = 0; k < P.slots.nfree; k++)
		if (P.slots.pub[P.slots.free_stack[k]].state != KVS_SLOT_FREE)
			die("non-free slot on the free stack", P.slots.free_stack[k]);
	for (unsigned i = 0; i < NCLIENTS; i++) {
		if (!cl[i])
			continue;
		uint32_t owed = 0;
		for (unsigned h = 0; h < P.cfg.client_rooms; h++)
			owed += cl[i]->handles[h].state == KVSP_H_OPEN ||
				cl[i]->handles[h].state == KVSP_H_CLOSING;
		if (owed != cl[i]->finals_owed)
			die("finals owed drifted", i);
	}
}

/* Pulls n bytes from the input, zero-padded at its end. */
static void take(const uint8_t **d, size_t *n, void *out, size_t len)
{
	size_t k = *n < len ? *n : len;
	memset(out, 0, len);
	memcpy(out, *d, k);
	*d += k;
	*n -= k;
}

static void remember_desc(struct kvsp_client *c, const struct kvs_sqe *q)
{
	if (q->op == KVS_OP_RECV_OPEN && c->cshm->reply.seq == q->seq && c->cshm->reply.status == 0)
		memcpy(&last_desc, c->cshm->reply.desc, sizeof(last_desc));
}

/* kvsp_client_poll, and whether c lives after it: a client whose ring
 * indices claim more than the ring holds is cut off and freed (design note
 * 38), and is then forgotten here as one that died (a new one takes its
 * place at its next use). */
static bool poll_client(struct kvsp_client *c)
{
	uint16_t idx = c->idx;
	kvsp_client_poll(&P, c);
	if (P.clients[idx] == c)
		return true;
	for (unsigned i = 0; i < NCLIENTS; i++)
		if (cl[i] == c)
			cl[i] = NULL;
	return false;
}

static void submit(struct kvsp_client *c, const struct kvs_sqe *q)
{
	kvs_ring_push(&c->sq, q, sizeof(*q), 1);
	if (poll_client(c)) /* the real path: ring, budget, decoder */
		remember_desc(c, q);
}

/* A record near valid state: small handles, real slots at about their
 * epochs, offsets on chunk boundaries. */
static void near_valid(struct kvsp_client *c, const uint8_t *b)
{
	uint32_t slot = b[2] % (NSLOTS + 1);
	int32_t de = (int8_t)b[3] % 3;
	struct kvs_sqe q = {
		.op = b[0] % KVS_OP_MAX,
		.handle = b[1] % 5,
		.seq = b[4],
		.slot = slot,
		.epoch = (slot < NSLOTS ? P.slots.pub[slot].epoch : 1) + (uint32_t)de,
		.arg = (uint64_t)(b[5] % 6) * 4096 + (b[6] & 1),
		.len = b[7] & 1 ? 4096 : b[6],
	};
	if (q.op == KVS_OP_ACQUIRE)
		q.arg = b[5] % (NSLOTS + 2);
	if (q.op == KVS_OP_RECV_OPEN)
		q.arg = 1 + (uint64_t)b[5] * 300;
	submit(c, &q);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static bool ready;
	if (!ready) {
		setup();
		ready = true;
	}
	memset(&last_desc, 0, sizeof(last_desc));
	while (size) {
		uint8_t b = *data++;
		size--;
		struct kvsp_client *c = client(b & 3);
		uint8_t tmp[128];
		switch (b >> 5) {
		case 0: { /* a raw record, as written by a hostile client */
			struct kvs_sqe q;
			take(&data, &size, &q, sizeof(q));
			submit(c, &q);
			break;
		}
		case 1:
		case 2:
			take(&data, &size, tmp, 8);
			near_valid(c, tmp);
			break;
		case 3: /* the last real descriptor, a bit flipped or not */
			take(&data, &size, tmp, 2);
			memcpy(c->cshm->request, &last_desc, sizeof(last_desc));
			if (tmp[0] & 1)
				c->cshm->request[tmp[1] % 128] ^= (uint8_t)(1u << (tmp[0] >> 5));
			break;
		case 4: /* garbage in the request area */
			take(&data, &size, c->cshm->request, sizeof(c->cshm->request));
			break;
		case 5: { /* hold, fail or let go of hand-offs */
			take(&data, &size, tmp, 1);
			struct kvsp_fp *fp = &P.fp[KVSP_FP_LOCAL_QUIESCE];
			fp->action = tmp[0] % 3;
			fp->err = -5;
			fp->match_set = false;
			P.local->ops->poll(P.local);
			kvsp_rooms_settle(&P); /* as the loop does after a transport's poll */
			break;
		}
		case 6: /* the client reads its events, or scribbles on its ring */
			take(&data, &size, tmp, 9);
			if (tmp[0] & 1) {
				/* bounded: scribbled indices can claim 4G entries */
				struct kvs_cqe e[8];
				for (unsigned k = 0; k < P.cfg.cq_count / 8; k++)
					if (!kvs_ring_pop(&c->cq, e, sizeof(e[0]), 8))
						break;
			} else {
				uint32_t v;
				memcpy(&v, tmp + 1, 4);
				struct rte_ring_headtail *ht[] = { &c->sq.r->prod, &c->sq.r->cons,
								   &c->cq.r->prod, &c->cq.r->cons };
				struct rte_ring_headtail *h = ht[tmp[5] & 3];
				if (tmp[5] & 4)
					h->head = v;
				else
					h->tail = v;
				poll_client(c);
			}
			break;
		default: /* the client dies: mostly reborn in place (the same
			  * reclaim a death runs), now and then freed outright */
			take(&data, &size, tmp, 1);
			if ((tmp[0] & 15) == 0) {
				kvsp_client_destroy(&P, c);
				cl[b & 3] = NULL;
			} else {
				reborn(c);
			}
			break;
		}
		kvsp_kicks_flush(&P);
		check();
	}
	/* Everyone leaves and every transfer quiesces: nothing may be left.
	 * Reclaiming is exactly what a death does; the mappings are kept and
	 * reset, with a new identity, so the next input starts fresh and fast. */
	P.fp[KVSP_FP_LOCAL_QUIESCE].action = KVS_FP_OFF;
	for (unsigned i = 0; i < NCLIENTS; i++)
		if (cl[i])
			reborn(cl[i]);
	P.local->ops->poll(P.local);
	kvsp_rooms_settle(&P);
	check();
	if (P.stats->slots[KVS_SLOT_FREE] != NSLOTS)
		die("slots leaked after every client left", 0);
	if (P.stats->rooms_open || P.rooms_active)
		die("rooms leaked after every client left", 0);
	return 0;
}
