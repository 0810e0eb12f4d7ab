/* SPDX-License-Identifier: MIT */
/*
 * libkvstage: leases (checked against the slot table the proxy publishes) and rooms, both halves:
 * opens, kvs_send, kvs_abort, the receiver's leases, close.
 */
#include "client.h"

#include <endian.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* A shared room's slots are published as its opener's: a reader that
 * joined it holds them too, while its handle on the room is open. */
static bool joined_room_has(const kvs_client *c, const struct kvs_slot *s)
{
	uint32_t room = __atomic_load_n(&s->room, __ATOMIC_RELAXED);
	for (unsigned i = 0; room && i < c->nrooms; i++)
		if (c->rooms[i].joined == room && c->rooms[i].state != KVS_ROOM_CLOSING)
			return true;
	return false;
}

/* The proxy's verdict on l for c, read from the table it publishes. */
static int lease_state(const kvs_client *c, const struct kvs_lease *l)
{
	if (l->slot >= c->slot_count)
		return -EINVAL;
	const struct kvs_slot *s = &c->slots[l->slot];
	if (__atomic_load_n(&s->epoch, __ATOMIC_RELAXED) != l->epoch)
		return -ESTALE;
	if (__atomic_load_n(&s->owner, __ATOMIC_RELAXED) != c->id && !joined_room_has(c, s))
		return -EPERM;
	return __atomic_load_n(&s->state, __ATOMIC_RELAXED);
}

int kvs_acquire(kvs_client *c, unsigned n, struct kvs_lease *out)
{
	int rc = kvsc_usable(c);
	if (rc)
		return rc;
	if (!n || n > c->slot_count || !out)
		return -EINVAL;
	struct kvs_sqe q = { .op = KVS_OP_ACQUIRE, .arg = n };
	rc = kvsc_sync_call(c, &q);
	if (rc < 0)
		return rc;
	memcpy(out, c->reply_leases, n * sizeof(*out));
	return 0;
}

int kvs_lease_check(kvs_client *c, const struct kvs_lease *l)
{
	int rc = kvsc_usable(c);
	if (rc || !l)
		return rc ?: -EINVAL;
	int st = lease_state(c, l);
	if (st < 0)
		return st;
	return st == KVS_SLOT_LEASED || st == KVS_SLOT_RECV_FILLED ? 0 : -EBUSY;
}

void *kvs_lease_ptr(kvs_client *c, const struct kvs_lease *l)
{
	return kvs_lease_check(c, l) ? NULL : c->pool + (size_t)l->slot * c->slot_size;
}

int kvs_release(kvs_client *c, const struct kvs_lease *l)
{
	int rc = kvsc_usable(c);
	if (rc || !l)
		return rc ?: -EINVAL;
	struct kvs_sqe q = { .op = KVS_OP_RELEASE, .slot = l->slot, .epoch = l->epoch };
	return kvsc_sync_call(c, &q);
}

/* --------------------------------------------------------------- rooms */

static uint32_t room_gen; /* process-wide, so no two rooms share one for 2^32 opens */

static struct kvs_rstate *room_new(kvs_client *c, uint8_t role, uint64_t user_data)
{
	if (!c->nfree)
		return NULL;
	struct kvs_rstate *r = &c->rooms[c->free_idx[--c->nfree]];
	uint32_t gen;
	while (!(gen = __atomic_add_fetch(&room_gen, 1, __ATOMIC_RELAXED)))
		; /* 0 means free */
	r->gen = gen;
	r->role = role;
	r->state = KVS_ROOM_OPEN;
	r->user_data = user_data;
	return r;
}

/* Lets go of what r held beyond its handle: its chunk leases, and its sent
 * bitmap, cleared where this room set bits (below nchunks) for the next. */
static void room_drop_bufs(struct kvs_rstate *r)
{
	if (r->sent)
		memset(r->sent, 0, (size_t)(r->nchunks + 63) / 64 * sizeof(uint64_t));
	free(r->map);
	r->sent = NULL;
	r->map = NULL;
}

void kvsc_room_free(kvs_client *c, struct kvs_rstate *r)
{
	room_drop_bufs(r);
	uint16_t idx = r->idx;
	memset(r, 0, sizeof(*r));
	r->idx = idx;
	c->free_idx[c->nfree++] = idx;
}

static void room_set_size(struct kvs_rstate *r, uint64_t bytes, uint64_t chunk)
{
	r->bytes = bytes;
	r->chunk = chunk;
	r->nchunks = (uint32_t)((bytes + chunk - 1) / chunk);
}

static kvs_room *handle_of(const kvs_client *c, const struct kvs_rstate *r)
{
	return kvs_room_handle(c->reg, r->idx, r->gen);
}

int kvs_recv_open(kvs_client *c, uint64_t bytes, uint64_t user_data, kvs_room **room,
		  struct kvs_room_desc *desc)
{
	return kvs_recv_open_shared(c, bytes, 1, user_data, room, desc);
}

int kvs_recv_open_shared(kvs_client *c, uint64_t bytes, unsigned readers, uint64_t user_data,
			 kvs_room **room, struct kvs_room_desc *desc)
{
	int rc = kvsc_usable(c);
	if (rc)
		return rc;
	if (!room || !desc || !bytes || !readers || readers > KVS_MAX_READERS)
		return -EINVAL;
	if (c->err)
		return c->err;
	struct kvs_rstate *r = room_new(c, KVS_ROLE_RECV, user_data);
	if (!r)
		return -EMFILE;
	struct kvs_sqe q = { .op = KVS_OP_RECV_OPEN,
			     .readers = (uint8_t)readers,
			     .handle = r->idx,
			     .gen = r->gen,
			     .arg = bytes,
			     .arg2 = user_data };
	rc = kvsc_sync_call(c, &q);
	if (rc < 0) {
		kvsc_room_free(c, r);
		return rc;
	}
	room_set_size(r, bytes, c->cshm->reply.slot_size);
	memcpy(desc->bytes, c->cshm->reply.desc, KVS_ROOM_DESC_SIZE);
	*room = handle_of(c, r);
	return 0;
}

/* Opens a handle of role by a descriptor (a sender's, a reader's that joins):
 * desc into the request area, op, the room's size from the reply. Returns
 * 0 with *out, or -errno (nothing held). */
static int open_by_desc(kvs_client *c, const struct kvs_room_desc *desc, uint8_t role, uint8_t op,
			uint64_t user_data, struct kvs_rstate **out)
{
	int rc = kvsc_usable(c);
	if (rc)
		return rc;
	if (!desc)
		return -EINVAL;
	if (c->err)
		return c->err;
	struct kvs_rstate *r = room_new(c, role, user_data);
	if (!r)
		return -EMFILE;
	/* Sized for the largest room the pool allows, so nothing can fail
	 * after the proxy has opened it; made once per handle index, not
	 * per room (a pool of 1M slots makes it 128 KiB). */
	if (role == KVS_ROLE_SEND) {
		uint64_t **bits = &c->sent_bits[r->idx];
		if (!*bits && !(*bits = calloc((c->slot_count + 63) / 64, sizeof(uint64_t)))) {
			kvsc_room_free(c, r);
			return -ENOMEM;
		}
		r->sent = *bits;
	}
	memcpy(c->cshm->request, desc->bytes, KVS_ROOM_DESC_SIZE);
	struct kvs_sqe q = { .op = op, .handle = r->idx, .gen = r->gen, .arg2 = user_data };
	rc = kvsc_sync_call(c, &q);
	if (rc < 0) {
		kvsc_room_free(c, r);
		return rc;
	}
	room_set_size(r, c->cshm->reply.bytes, c->cshm->reply.slot_size);
	*out = r;
	return 0;
}

int kvs_recv_join(kvs_client *c, const struct kvs_room_desc *desc, uint64_t user_data,
		  kvs_room **room)
{
	struct kvs_rstate *r;
	int rc = room ? open_by_desc(c, desc, KVS_ROLE_RECV, KVS_OP_RECV_JOIN, user_data, &r)
		      : -EINVAL;
	if (rc)
		return rc;
	struct kvs_desc_wire d;
	memcpy(&d, desc->bytes, sizeof(d));
	r->joined = le32toh(d.room) + 1; /* the proxy said it names our room there */
	*room = handle_of(c, r);
	return 0;
}

int kvs_send_open(kvs_client *c, const struct kvs_room_desc *desc, uint64_t user_data,
		  kvs_room **room)
{
	struct kvs_rstate *r;
	int rc = room ? open_by_desc(c, desc, KVS_ROLE_SEND, KVS_OP_SEND_OPEN, user_data, &r)
		      : -EINVAL;
	if (rc)
		return rc;
	*room = handle_of(c, r);
	return 0;
}

unsigned kvs_room_chunks(const kvs_room *h)
{
	kvs_client *c;
	struct kvs_rstate *r;
	return kvsc_room_find(h, &c, &r) ? 0 : r->nchunks;
}

uint64_t kvs_room_bytes(const kvs_room *h)
{
	kvs_client *c;
	struct kvs_rstate *r;
	return kvsc_room_find(h, &c, &r) ? 0 : r->bytes;
}

/* Why an ended room takes no more chunks. */
static int ended_status(const struct kvs_rstate *r)
{
	if (r->final_type == KVS_EV_SEND_DONE || r->final_type == KVS_EV_RECV_DONE)
		return -EALREADY;
	return r->final_status ? r->final_status : -ECANCELED;
}

int kvs_send(kvs_room *h, const struct kvs_lease *l, uint64_t offset, uint32_t len)
{
	kvs_client *c;
	struct kvs_rstate *r;
	int rc = kvsc_room_find(h, &c, &r);
	if (rc)
		return rc;
	if (!l)
		return -EINVAL;
	if (c->err)
		return c->err;
	if (r->role != KVS_ROLE_SEND)
		return -EBADF;
	if (r->state == KVS_ROOM_ENDED)
		return ended_status(r);
	if (offset % r->chunk || offset >= r->bytes)
		return -EINVAL;
	uint64_t want = r->bytes - offset < r->chunk ? r->bytes - offset : r->chunk;
	if (len != want)
		return -EINVAL;
	uint32_t i = (uint32_t)(offset / r->chunk);
	if (r->sent[i / 64] & (1ull << (i % 64)))
		return -EEXIST;
	int st = lease_state(c, l);
	if (st < 0)
		return st;
	if (st != KVS_SLOT_LEASED)
		return -EBUSY;
	struct kvs_sqe q = { .op = KVS_OP_SEND,
			     .handle = r->idx,
			     .gen = r->gen,
			     .slot = l->slot,
			     .epoch = l->epoch,
			     .arg = offset,
			     .len = len };
	rc = kvsc_submit(c, &q);
	if (rc == 0)
		r->sent[i / 64] |= 1ull << (i % 64);
	return rc;
}

int kvs_abort(kvs_room *h)
{
	kvs_client *c;
	struct kvs_rstate *r;
	int rc = kvsc_room_find(h, &c, &r);
	if (rc)
		return rc;
	if (c->err)
		return c->err;
	if (r->state != KVS_ROOM_OPEN || r->aborted)
		return 0;
	struct kvs_sqe q = { .op = KVS_OP_ABORT, .handle = r->idx, .gen = r->gen };
	rc = kvsc_submit(c, &q);
	if (rc == 0)
		r->aborted = true;
	return rc;
}

int kvs_room_lease(kvs_room *h, unsigned i, struct kvs_lease *out)
{
	kvs_client *c;
	struct kvs_rstate *r;
	int rc = kvsc_room_find(h, &c, &r);
	if (rc)
		return rc;
	if (!out)
		return -EINVAL;
	if (r->role != KVS_ROLE_RECV)
		return -EBADF;
	if (r->state != KVS_ROOM_ENDED)
		return -EAGAIN;
	if (r->final_type != KVS_EV_RECV_DONE)
		return r->final_status ? r->final_status : -ECANCELED;
	if (i >= r->nchunks)
		return -ERANGE;
	if (i == 0) {
		*out = r->first;
		return 0;
	}
	if (!r->map) {
		struct kvs_lease *map = malloc(r->nchunks * sizeof(*map));
		if (!map)
			return -ENOMEM;
		struct kvs_sqe q = { .op = KVS_OP_ROOM_MAP, .handle = r->idx, .gen = r->gen };
		rc = kvsc_sync_call(c, &q);
		if (rc == 0 && c->cshm->reply.n != r->nchunks)
			rc = -EPROTO;
		if (rc < 0) {
			free(map);
			return rc;
		}
		memcpy(map, c->reply_leases, r->nchunks * sizeof(*map));
		r->map = map;
	}
	*out = r->map[i];
	return 0;
}

int kvs_room_close(kvs_room *h)
{
	kvs_client *c;
	struct kvs_rstate *r;
	int rc = kvsc_room_find(h, &c, &r);
	if (rc)
		return rc;
	if (c->err) {
		kvsc_room_free(c, r);
		return 0;
	}
	struct kvs_sqe q = { .op = KVS_OP_CLOSE, .handle = r->idx, .gen = r->gen };
	rc = kvsc_submit(c, &q);
	if (rc < 0)
		return rc;
	if (r->state == KVS_ROOM_ENDED) {
		kvsc_room_free(c, r);
	} else {
		/* The proxy still owes this handle its final event; keep the
		 * index reserved until that arrives. */
		r->state = KVS_ROOM_CLOSING;
		room_drop_bufs(r);
	}
	return 0;
}
