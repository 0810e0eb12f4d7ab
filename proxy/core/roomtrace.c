/* SPDX-License-Identifier: MIT */
/*
 * The trace's points in a room's life: what each event means in the state
 * machine is design note 45's table (and kvstaged(8)'s). Called only
 * while tracing (p->trace set); what it keeps of a room is in p->rtrace,
 * so that struct kvsp_room, which the chunk path reads, is as it was.
 */
#include <endian.h>
#include <errno.h>
#include <stdlib.h>

#include "core/proxy.h"
#include "core/rooms.h"

int kvsp_rtrace_attach(struct kvsp *p, struct kvsp_trace *t)
{
	p->rtrace = calloc(p->cfg.max_rooms, sizeof(*p->rtrace));
	if (!p->rtrace)
		return -ENOMEM;
	p->trace = t;
	return 0;
}

static void push(struct kvsp *p, uint32_t i, uint8_t ev, uint8_t side, uint8_t has, uint64_t bytes,
		 uint32_t chunk, int status, uint8_t final)
{
	const struct kvsp_room_trace *k = &p->rtrace[i];
	struct kvsp_trace_rec rec = { .instance = k->instance,
				      .room = k->room,
				      .gen = k->gen,
				      .bytes = bytes,
				      .chunk = chunk,
				      .status = status,
				      .event = ev,
				      .side = side,
				      .has = has,
				      .final = final };
	kvsp_trace_push(p->trace, &rec);
}

void kvsp_rtrace_opened(struct kvsp *p, uint32_t i, uint8_t side, const struct kvs_desc_wire *d)
{
	struct kvsp_room_trace *k = &p->rtrace[i];
	if (d) /* a far receiver's room: the key it made, from its descriptor */
		*k = (struct kvsp_room_trace){ .instance = le64toh(d->instance),
					       .room = le32toh(d->room),
					       .gen = le32toh(d->gen) };
	else if (side == KVSP_TR_RECV)
		*k = (struct kvsp_room_trace){ .instance = p->instance,
					       .room = i,
					       .gen = p->rooms[i].gen };
	/* else a sender joining a room of ours: its key is set */
	k->sides |= (uint8_t)(1u << side);
	push(p, i, KVSP_TR_ROOM_OPENED, side, KVSP_TR_BYTES, p->rooms[i].bytes, 0, 0, 0);
}

void kvsp_rtrace_queued(struct kvsp *p, uint32_t i, uint32_t chunk)
{
	const struct kvsp_room *r = &p->rooms[i];
	uint32_t n = ++p->rtrace[i].queued;
	if (n == 1 || n == r->nchunks)
		push(p, i, KVSP_TR_CHUNK_QUEUED, KVSP_TR_SEND, KVSP_TR_BYTES | KVSP_TR_CHUNK,
		     kvsp_chunk_len(p, r, chunk), chunk, 0, 0);
}

void kvsp_rtrace_sent(struct kvsp *p, uint32_t i, uint32_t chunk)
{
	const struct kvsp_room *r = &p->rooms[i];
	if (++p->rtrace[i].sent == r->nchunks)
		push(p, i, KVSP_TR_CHUNK_SENT, KVSP_TR_SEND, KVSP_TR_BYTES | KVSP_TR_CHUNK,
		     kvsp_chunk_len(p, r, chunk), chunk, 0, 0);
}

void kvsp_rtrace_landed(struct kvsp *p, uint32_t i, uint32_t chunk)
{
	const struct kvsp_room *r = &p->rooms[i];
	if (r->recv.placed == 1 || r->recv.placed == r->nchunks) /* counted already */
		push(p, i, KVSP_TR_CHUNK_LANDED, KVSP_TR_RECV, KVSP_TR_BYTES | KVSP_TR_CHUNK,
		     kvsp_chunk_len(p, r, chunk), chunk, 0, 0);
}

void kvsp_rtrace_handed(struct kvsp *p, uint32_t i, uint32_t chunk)
{
	kvsp_rtrace_sent(p, i, chunk);
	kvsp_rtrace_landed(p, i, chunk);
}

void kvsp_rtrace_submitted(struct kvsp *p, uint32_t i, uint32_t chunk)
{
	kvsp_rtrace_queued(p, i, chunk);
	kvsp_rtrace_handed(p, i, chunk);
}

void kvsp_rtrace_flight(struct kvsp *p, uint32_t i)
{
	p->rtrace[i].flight = true;
}

void kvsp_rtrace_abort(struct kvsp *p, uint32_t i, int status)
{
	const struct kvsp_room *r = &p->rooms[i];
	const struct kvsp_room_trace *k = &p->rtrace[i];
	if (!r->send.inflight && !r->recv.posted && !k->flight)
		return; /* nothing of it in motion here: its final says the rest */
	for (uint8_t side = KVSP_TR_RECV; side <= KVSP_TR_SEND; side++)
		if (k->sides & (1u << side))
			push(p, i, KVSP_TR_ROOM_FENCED, side, KVSP_TR_STATUS, 0, 0, status, 0);
}

void kvsp_rtrace_tomb(struct kvsp *p, uint32_t i, uint8_t side, uint32_t chunk)
{
	push(p, i, KVSP_TR_SLOT_TOMBSTONED, side, KVSP_TR_CHUNK, 0, chunk, 0, 0);
}

void kvsp_rtrace_final(struct kvsp *p, uint32_t i, uint8_t type, int status)
{
	bool done = type == KVS_EV_RECV_DONE || type == KVS_EV_SEND_DONE;
	uint8_t has = KVSP_TR_FINAL | KVSP_TR_STATUS | (done ? KVSP_TR_BYTES : 0);
	for (uint8_t side = KVSP_TR_RECV; side <= KVSP_TR_SEND; side++) {
		if (!(p->rtrace[i].sides & (1u << side)))
			continue;
		uint8_t t = done ? (side == KVSP_TR_SEND ? KVS_EV_SEND_DONE : KVS_EV_RECV_DONE)
				 : type;
		push(p, i, KVSP_TR_ROOM_FINAL, side, has, p->rooms[i].bytes, 0, status, t);
	}
}

void kvsp_rtrace_reaped(struct kvsp *p, uint32_t i)
{
	for (uint8_t side = KVSP_TR_RECV; side <= KVSP_TR_SEND; side++)
		if (p->rtrace[i].sides & (1u << side))
			push(p, i, KVSP_TR_ROOM_REAPED, side, 0, 0, 0, 0, 0);
	p->rtrace[i].sides = 0; /* a reused index says room_opened anew */
}
