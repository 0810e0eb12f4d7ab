/* SPDX-License-Identifier: MIT */
/*
 * The local mode's client processes. The receiver keeps --rooms rooms open
 * and passes their descriptors over a pipe to its sender; the sender opens
 * each, leases slots in batches, fills them (per --payload) and sends them;
 * the receiver consumes each completed room, closes it and opens another.
 * Receivers count what completes in the measured window; senders time each
 * room's hand-off. Both block in kvs_wait, never spin.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "canary.h"
#include "local.h"
#include "sock.h"

#define WAIT_MS 10000 /* no event for this long: the run is stuck */
#define DESC_BATCH 64 /* descriptors a sender takes in one go */
#define EV_BATCH 64
#define LEASE_BATCH 256 /* leases per kvs_acquire when rooms are small */

/* Records why this child failed in its shared figures; returns 1. */
#define fail(res, ...) child_fail((res)->msg, sizeof((res)->msg), &(res)->failed, __VA_ARGS__)

static uint64_t canary_owner(unsigned pair, uint64_t seq)
{
	return ((uint64_t)(pair + 1) << 40) | seq;
}

static uint32_t chunk_len(const struct lctx *x, unsigned i)
{
	uint64_t off = (uint64_t)i * x->chunk;
	return (uint32_t)(x->room_bytes - off < x->chunk ? x->room_bytes - off : x->chunk);
}

static const char *ev_name(uint32_t t)
{
	switch (t) {
	case KVS_EV_SEND_DONE:
		return "SEND_DONE";
	case KVS_EV_RECV_DONE:
		return "RECV_DONE";
	case KVS_EV_ABORTED:
		return "ABORTED";
	case KVS_EV_FAILED:
		return "FAILED";
	case KVS_EV_REJECTED:
		return "REJECTED";
	default:
		return "an unknown event";
	}
}

/* Waits for the parent's go: it closes the write end. */
static void ready_and_go(int ready_wr, int go_rd)
{
	char b = 'r';
	kvs_write_full(ready_wr, &b, 1);
	close(ready_wr);
	while (read(go_rd, &b, 1) < 0 && errno == EINTR)
		;
	close(go_rd);
}

/* ------------------------------------------------------------ receiver */

struct rroom {
	kvs_room *r;
	uint64_t seq, t_open;
};

struct receiver {
	struct lctx *x;
	struct child_res *res;
	kvs_client *c;
	struct rroom *rooms;
	struct desc_msg *out;
	unsigned nout, open;
	uint64_t seq, completed;
	bool warm;
	uint8_t *dst;
	size_t dlen, dpos;
};

static int rx_open(struct receiver *rv, unsigned idx)
{
	struct rroom *rr = &rv->rooms[idx];
	rr->seq = rv->seq++;
	rr->t_open = now_ns();
	struct desc_msg *m = &rv->out[rv->nout];
	int rc = kvs_recv_open(rv->c, rv->x->room_bytes, idx, &rr->r, &m->d);
	if (rc < 0)
		return fail(rv->res, "receiver %u: kvs_recv_open: %s", rv->x->pair,
			    kvs_strerror(rc));
	m->seq = rr->seq;
	rv->nout++;
	rv->open++;
	return 0;
}

static int rx_flush(struct receiver *rv, int desc_wr)
{
	if (!rv->nout)
		return 0;
	/* At most --rooms descriptors are ever unread, well under a pipe's
	 * capacity, so this never blocks on the sender. */
	if (kvs_write_full(desc_wr, rv->out, rv->nout * sizeof(rv->out[0])) < 0)
		return fail(rv->res, "receiver %u: its sender is gone (pipe closed)", rv->x->pair);
	rv->nout = 0;
	return 0;
}

/* Reads (or checks) every chunk of a completed room, per --payload. */
static int rx_consume(struct receiver *rv, struct rroom *rr)
{
	struct lctx *x = rv->x;
	enum bench_payload pl = x->o->payload;
	if (pl == PAYLOAD_NONE || pl == PAYLOAD_IN)
		return 0; /* in: the slot is the receiver's buffer, readable in place */
	for (unsigned i = 0; i < x->room_chunks; i++) {
		struct kvs_lease l;
		int rc = kvs_room_lease(rr->r, i, &l);
		if (rc < 0)
			return fail(rv->res, "receiver %u: kvs_room_lease(%u): %s", x->pair, i,
				    kvs_strerror(rc));
		const uint8_t *p = kvs_lease_ptr(rv->c, &l);
		if (!p)
			return fail(rv->res,
				    "receiver %u: chunk %u of a completed room is not ours",
				    x->pair, i);
		uint32_t len = chunk_len(x, i);
		if (pl == PAYLOAD_COPY) {
			memcpy(rv->dst + rv->dpos, p, len);
			rv->dpos += x->chunk;
			if (rv->dpos + x->chunk > rv->dlen)
				rv->dpos = 0;
		} else {
			uint64_t off = (uint64_t)i * x->chunk;
			uint64_t bad = canary_check(p, canary_owner(x->pair, rr->seq), off, len);
			if (bad != len && !rv->res->errors++)
				snprintf(rv->res->msg, sizeof(rv->res->msg),
					 "receiver %u: room %llu chunk %u: wrong byte at offset "
					 "%llu",
					 x->pair, (unsigned long long)rr->seq, i,
					 (unsigned long long)(off + bad));
		}
	}
	return 0;
}

int local_receiver(struct lctx *x, int desc_wr, int ready_wr, int go_rd, int done_wr)
{
	struct lshared *sh = x->sh;
	struct receiver rv = { .x = x, .res = &sh->rx[x->pair] };
	const struct bench_opts *o = x->o;
	int rc = kvs_connect(x->rx_sock, &rv.c);
	if (rc < 0)
		return fail(rv.res, "receiver %u: kvs_connect: %s", x->pair, kvs_strerror(rc));
	if (kvs_slot_size(rv.c) != x->chunk)
		return fail(rv.res, "receiver %u: the proxy's slot size changed", x->pair);
	if (o->payload == PAYLOAD_COPY) {
		/* Copy out into a private ring larger than the cache, as an
		 * engine's KV pages would be. */
		rv.dlen = (o->wset / x->chunk < 2 ? 2 : o->wset / x->chunk) * x->chunk;
		rv.dst = bench_alloc(rv.dlen, false);
		if (!rv.dst)
			return fail(rv.res, "receiver %u: cannot allocate %zu bytes", x->pair,
				    rv.dlen);
	}
	rv.rooms = calloc(o->rooms, sizeof(*rv.rooms));
	rv.out = calloc(o->rooms, sizeof(*rv.out));
	struct kvs_event *ev = calloc(EV_BATCH, sizeof(*ev));
	if (!rv.rooms || !rv.out || !ev)
		return fail(rv.res, "receiver %u: out of memory", x->pair);
	ready_and_go(ready_wr, go_rd);

	for (unsigned i = 0; i < o->rooms; i++)
		if (rx_open(&rv, i))
			return 1;
	if (rx_flush(&rv, desc_wr))
		return 1;
	bool stop = false;
	while (rv.open) {
		int n = kvs_wait(rv.c, ev, WAIT_MS);
		if (n < 0)
			return fail(rv.res, "receiver %u: kvs_wait with %u rooms open: %s", x->pair,
				    rv.open, kvs_strerror(n));
		int more = kvs_poll(rv.c, ev + 1, EV_BATCH - 1);
		if (more > 0)
			n += more;
		/* The time the events were seen: later ones in this batch
		 * waited behind the consumption of earlier ones, which is
		 * what a room's latency under load is. */
		uint64_t t_seen = now_ns();
		for (int k = 0; k < n; k++) {
			if (ev[k].type != KVS_EV_RECV_DONE || ev[k].user_data >= o->rooms)
				return fail(rv.res, "receiver %u: room %llu ended with %s: %s",
					    x->pair, (unsigned long long)ev[k].user_data,
					    ev_name(ev[k].type), kvs_strerror(ev[k].status));
			unsigned idx = (unsigned)ev[k].user_data;
			struct rroom *rr = &rv.rooms[idx];
			if (rx_consume(&rv, rr))
				return 1;
			rc = kvs_room_close(rr->r);
			if (rc < 0)
				return fail(rv.res, "receiver %u: kvs_room_close: %s", x->pair,
					    kvs_strerror(rc));
			rv.open--;
			__atomic_store_n(&rv.res->p_bytes, rv.res->p_bytes + x->room_bytes,
					 __ATOMIC_RELAXED);
			uint64_t t = now_ns();
			if (!rv.warm && ++rv.completed >= o->rooms && t >= sh->t_warm) {
				rv.warm = true;
				if (__atomic_add_fetch(&sh->nwarm, 1, __ATOMIC_ACQ_REL) ==
				    sh->pairs)
					__atomic_store_n(&sh->t_meas, t, __ATOMIC_RELEASE);
			}
			uint64_t t_meas = __atomic_load_n(&sh->t_meas, __ATOMIC_ACQUIRE);
			if (t_meas && t_seen >= t_meas) {
				rv.res->bytes += x->room_bytes;
				rv.res->chunks += x->room_chunks;
				rv.res->rooms++;
				rv.res->t_last = t;
				hist_add(&rv.res->h, t_seen - rr->t_open);
			}
			if (t_meas && !sh->target && t >= t_meas + (uint64_t)(o->duration * 1e9))
				stop = true;
			if (t_meas && sh->target &&
			    rv.res->bytes + (uint64_t)rv.open * x->room_bytes >= sh->target)
				stop = true;
			if (!stop && rx_open(&rv, idx))
				return 1;
		}
		if (rx_flush(&rv, desc_wr))
			return 1;
	}
	char b = 'd';
	kvs_write_full(done_wr, &b, 1);
	close(desc_wr); /* the sender's EOF */
	kvs_close(rv.c);
	free(ev);
	free(rv.rooms);
	free(rv.out);
	bench_free(rv.dst, rv.dlen);
	return rv.res->errors ? 1 : 0;
}

/* -------------------------------------------------------------- sender */

struct sroom {
	kvs_room *r;
	uint64_t t_last; /* its last kvs_send; 0 until then */
};

struct sender {
	struct lctx *x;
	struct child_res *res;
	kvs_client *c;
	struct sroom *rooms; /* indexed by user_data */
	unsigned *free_idx, nfree, nrooms;
	unsigned waiting; /* rooms fully sent, SEND_DONE not seen yet */
	struct kvs_lease *leases;
	unsigned max_leases;
	uint8_t *src;
	size_t slen, spos;
	struct kvs_event ev[EV_BATCH];
};

static int tx_event(struct sender *sv, const struct kvs_event *e, uint64_t t)
{
	struct lctx *x = sv->x;
	if (e->type != KVS_EV_SEND_DONE || e->user_data >= sv->nrooms)
		return fail(sv->res, "sender %u: room %llu: %s: %s", x->pair,
			    (unsigned long long)e->user_data, ev_name(e->type),
			    kvs_strerror(e->status));
	unsigned idx = (unsigned)e->user_data;
	struct sroom *s = &sv->rooms[idx];
	uint64_t t_meas = __atomic_load_n(&x->sh->t_meas, __ATOMIC_ACQUIRE);
	if (t_meas && t >= t_meas)
		hist_add(&sv->res->h, t - s->t_last);
	int rc = kvs_room_close(s->r);
	if (rc < 0)
		return fail(sv->res, "sender %u: kvs_room_close: %s", x->pair, kvs_strerror(rc));
	s->r = NULL;
	s->t_last = 0;
	sv->free_idx[sv->nfree++] = idx;
	sv->waiting--;
	return 0;
}

/* Handles whatever events are waiting, without blocking. */
static int tx_drain(struct sender *sv)
{
	for (;;) {
		int n = kvs_poll(sv->c, sv->ev, EV_BATCH);
		if (n < 0)
			return fail(sv->res, "sender %u: kvs_poll: %s", sv->x->pair,
				    kvs_strerror(n));
		if (!n)
			return 0;
		uint64_t t = now_ns();
		for (int k = 0; k < n; k++)
			if (tx_event(sv, &sv->ev[k], t))
				return 1;
		if (n < EV_BATCH)
			return 0;
	}
}

/* Blocks for one event, then handles every one waiting. */
static int tx_wait(struct sender *sv)
{
	int n = kvs_wait(sv->c, sv->ev, WAIT_MS);
	if (n < 0)
		return fail(sv->res, "sender %u: kvs_wait with %u rooms sent: %s", sv->x->pair,
			    sv->waiting, kvs_strerror(n));
	if (tx_event(sv, &sv->ev[0], now_ns()))
		return 1;
	return tx_drain(sv);
}

static int tx_open(struct sender *sv, const struct desc_msg *m, unsigned *idx_out)
{
	for (;;) {
		if (!sv->nfree) {
			/* Every handle waits for its SEND_DONE: it is on its way. */
			if (tx_wait(sv))
				return 1;
			continue;
		}
		unsigned idx = sv->free_idx[--sv->nfree];
		int rc = kvs_send_open(sv->c, &m->d, idx, &sv->rooms[idx].r);
		if (rc == 0) {
			*idx_out = idx;
			return 0;
		}
		sv->free_idx[sv->nfree++] = idx;
		if (rc == -EAGAIN || rc == -EMFILE) {
			/* Events waiting, or handles still held by rooms whose
			 * SEND_DONE we have not taken yet. */
			if (sv->waiting ? tx_wait(sv) : tx_drain(sv))
				return 1;
			continue;
		}
		return fail(sv->res, "sender %u: kvs_send_open: %s", sv->x->pair, kvs_strerror(rc));
	}
}

static int tx_acquire(struct sender *sv, unsigned n)
{
	uint64_t until = now_ns() + (uint64_t)WAIT_MS * 1000000;
	for (;;) {
		int rc = kvs_acquire(sv->c, n, sv->leases);
		if (rc == 0)
			return 0;
		if (rc != -ENOBUFS && rc != -EAGAIN)
			return fail(sv->res, "sender %u: kvs_acquire(%u): %s", sv->x->pair, n,
				    kvs_strerror(rc));
		/* The pool is sized for every room in flight, so this is
		 * another client's doing (an external proxy) or events to take. */
		if (tx_drain(sv))
			return 1;
		if (now_ns() > until)
			return fail(sv->res,
				    "sender %u: no %u free slots for %d ms: is another "
				    "client using the proxy?",
				    sv->x->pair, n, WAIT_MS);
		if (rc == -ENOBUFS)
			sleep_ns(20000);
	}
}

static int tx_fill_send(struct sender *sv, unsigned idx, const struct kvs_lease *l, uint64_t seq)
{
	struct lctx *x = sv->x;
	struct sroom *s = &sv->rooms[idx];
	for (unsigned i = 0; i < x->room_chunks; i++) {
		uint64_t off = (uint64_t)i * x->chunk;
		uint32_t len = chunk_len(x, i);
		if (x->o->payload != PAYLOAD_NONE) {
			uint8_t *p = kvs_lease_ptr(sv->c, &l[i]);
			if (!p)
				return fail(sv->res, "sender %u: a lease just acquired is not ours",
					    x->pair);
			if (x->o->payload == PAYLOAD_COPY || x->o->payload == PAYLOAD_IN) {
				memcpy(p, sv->src + sv->spos, len);
				sv->spos += x->chunk;
				if (sv->spos + x->chunk > sv->slen)
					sv->spos = 0;
			} else {
				canary_fill(p, canary_owner(x->pair, seq), off, len);
			}
		}
		int rc;
		while ((rc = kvs_send(s->r, &l[i], off, len)) == -EAGAIN)
			if (tx_drain(sv)) /* submission ring full for 1 ms: let it drain */
				return 1;
		if (rc < 0)
			return fail(sv->res, "sender %u: kvs_send: %s", x->pair, kvs_strerror(rc));
		if (i + 1 == x->room_chunks) {
			s->t_last = now_ns();
			sv->waiting++;
		}
		/* Take completions as they come, so a SEND_DONE is timed when
		 * it arrives, not after the whole batch. */
		if (tx_drain(sv))
			return 1;
	}
	return 0;
}

/* Opens, fills and sends the rooms of n descriptors, leasing slots for
 * several rooms per kvs_acquire. */
static int tx_batch(struct sender *sv, const struct desc_msg *m, unsigned n)
{
	unsigned cpr = sv->x->room_chunks;
	unsigned per = sv->max_leases / cpr; /* rooms per acquire, >= 1 */
	unsigned idx[DESC_BATCH];
	for (unsigned i = 0; i < n; i += per) {
		unsigned k = n - i < per ? n - i : per;
		for (unsigned j = 0; j < k; j++)
			if (tx_open(sv, &m[i + j], &idx[j]))
				return 1;
		if (tx_acquire(sv, k * cpr))
			return 1;
		for (unsigned j = 0; j < k; j++)
			if (tx_fill_send(sv, idx[j], sv->leases + j * cpr, m[i + j].seq))
				return 1;
	}
	return 0;
}

int local_sender(struct lctx *x, int desc_rd, int ready_wr, int go_rd)
{
	struct sender *sv = calloc(1, sizeof(*sv));
	struct child_res *res = &x->sh->tx[x->pair];
	if (!sv)
		return fail(res, "sender %u: out of memory", x->pair);
	sv->x = x;
	sv->res = res;
	const struct bench_opts *o = x->o;
	int rc = kvs_connect(x->tx_sock, &sv->c);
	if (rc < 0)
		return fail(res, "sender %u: kvs_connect: %s", x->pair, kvs_strerror(rc));
	sv->nrooms = kvs_max_rooms(sv->c);
	sv->rooms = calloc(sv->nrooms, sizeof(*sv->rooms));
	sv->free_idx = calloc(sv->nrooms, sizeof(*sv->free_idx));
	unsigned cpr = x->room_chunks;
	sv->max_leases = cpr > LEASE_BATCH ? cpr : LEASE_BATCH;
	if (sv->max_leases > kvs_slot_count(sv->c))
		sv->max_leases = cpr;
	sv->leases = calloc(sv->max_leases, sizeof(*sv->leases));
	struct desc_msg *buf = calloc(DESC_BATCH, sizeof(*buf));
	if (!sv->rooms || !sv->free_idx || !sv->leases || !buf)
		return fail(res, "sender %u: out of memory", x->pair);
	for (unsigned i = 0; i < sv->nrooms; i++)
		sv->free_idx[sv->nfree++] = sv->nrooms - 1 - i;
	if (o->payload == PAYLOAD_COPY || o->payload == PAYLOAD_IN) {
		sv->slen = (o->wset / x->chunk < 2 ? 2 : o->wset / x->chunk) * x->chunk;
		sv->src = bench_alloc(sv->slen, false);
		if (!sv->src)
			return fail(res, "sender %u: cannot allocate %zu bytes", x->pair, sv->slen);
	}
	ready_and_go(ready_wr, go_rd);
	fcntl(desc_rd, F_SETFL, fcntl(desc_rd, F_GETFL) | O_NONBLOCK);

	size_t have = 0; /* bytes of buf filled */
	bool eof = false;
	for (;;) {
		if (tx_drain(sv))
			return 1;
		if (!eof) {
			ssize_t k = read(desc_rd, (uint8_t *)buf + have,
					 DESC_BATCH * sizeof(*buf) - have);
			if (k > 0)
				have += (size_t)k;
			else if (k == 0)
				eof = true;
			else if (errno != EAGAIN && errno != EINTR)
				return fail(res, "sender %u: pipe: %s", x->pair, strerror(errno));
		}
		unsigned n = (unsigned)(have / sizeof(*buf));
		if (n) {
			if (tx_batch(sv, buf, n))
				return 1;
			have -= n * sizeof(*buf);
			memmove(buf, (uint8_t *)buf + n * sizeof(*buf), have);
			continue;
		}
		if (eof && !sv->waiting)
			break;
		if (sv->waiting || eof) {
			/* Wait for the SEND_DONEs owed rather than poll() the pipe
			 * and kvs_event_fd together: the event fd would make the
			 * proxy write an eventfd for every batch of events, a
			 * syscall on its core. On the local path the SEND_DONEs are
			 * microseconds away; new descriptors wait in the pipe. */
			if (tx_wait(sv))
				return 1;
			continue;
		}
		struct pollfd pf = { .fd = desc_rd, .events = POLLIN };
		int pr = poll(&pf, 1, WAIT_MS);
		if (pr == 0)
			return fail(res, "sender %u: no room descriptor for %d ms", x->pair,
				    WAIT_MS);
	}
	kvs_close(sv->c);
	bench_free(sv->src, sv->slen);
	free(buf);
	free(sv->leases);
	free(sv->rooms);
	free(sv->free_idx);
	free(sv);
	return 0;
}
