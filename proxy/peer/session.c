/* SPDX-License-Identifier: MIT */
/*
 * A session's life, and every deadline in it. No other file changes a
 * session's state.
 *
 *            dial (a client's room)            the last stream joined
 *   FREE ----------------------------> JOINING -----------------------> UP
 *     ^    JOIN (a peer's first stream)   |                             |
 *     |                                   | past the handshake time,    | silent past --peer-timeout,
 *     |                                   | a stream lost, evicted      | an answer owed past it
 *     |                                   v                             | (peer/room.c), a stream
 *     |              end                 lost <-------------------------+ lost, evicted when idle
 *     +------------------------------ DYING                             |
 *        (its data paths quiesced,      deadline: --peer-timeout,       | nothing on it for the
 *         then the core releases its    then forced (the queue pair     | idle time, or retired
 *         pins and fails its rooms)     is destroyed)                   v
 *     ^                                                               BYE (close) sent
 *     +-------------------------- closed quietly <-------------------------+
 *
 * Lost: its sockets close at once, so no byte for it can arrive or leave;
 * each data path quiesces (RDMA: its queue pair to the error state, every
 * READ posted flushed); only then does the core release exactly the pins
 * held for it (kvsp_peer_lost) and fail the rooms it carried.
 *
 * Room for a new session is never refused while an old one could give it,
 * and it is taken from whoever holds the most (design note 43): when the
 * table is full, a session still joining or an up one that carries nothing
 * is evicted, from the party holding the most places (a dialed session is
 * the local uid's whose room made us dial it, an accepted one its peer
 * address's), within it from the process holding the most, and within that
 * the joining one longest silent, else the up one longest idle. So a party
 * that fills the table only makes its own sessions take turns: another's
 * dial, or another peer's session, always finds a place. A client
 * connection makes us dial at most PSESS_DIALS_PER_CLIENT sessions at once.
 *
 * A dialed stream the listener closes before it said a word was refused a
 * place (its admission makes way for newcomers: peer/conn.h), not proven
 * wrong: it is dialed again, within the session's joining deadline and at
 * most PSESS_REDIALS times a session (psess_redial).
 */
#include "peer/session.h"

#include <endian.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <sodium.h>

#include "core/xport.h"
#include "base/log.h"
#include "layout.h"
#include "peer/conn.h"
#include "peer/datapath.h"

/* A published field, written by the loop, read by kvstage-stat. */
#define PUB(f, v) __atomic_store_n(&(f), (v), __ATOMIC_RELAXED)

#define SLOG(t, lvl, ...)                                                                \
	kvsp_log_rl((t)->rl_sess, kvsp_xport_now((t)->p), &(t)->st->log_suppressed, lvl, \
		    __VA_ARGS__)

static bool live(const struct psess *s)
{
	return s->state == PSESS_JOINING || s->state == PSESS_UP;
}

struct psess *psess_get(struct psess_table *t, uint32_t id)
{
	unsigned i = id & 0xff;
	if (!id || i >= PSESS_MAX || !live(&t->s[i]) || t->s[i].id != id)
		return NULL;
	return &t->s[i];
}

struct psess *psess_up(struct psess_table *t, uint32_t id)
{
	struct psess *s = psess_get(t, id);
	return s && s->state == PSESS_UP ? s : NULL;
}

struct psess *psess_dialed(struct psess_table *t, const struct kvsp_endpoint *ep)
{
	for (unsigned i = 0; i < PSESS_MAX; i++) {
		struct psess *s = &t->s[i];
		if (live(s) && s->dialer && !s->retired && !s->closing &&
		    kvsp_endpoint_eq(&s->ep, ep))
			return s;
	}
	return NULL;
}

static const char *who(const struct psess *s)
{
	return s->dialer ? "dialed" : "accepted";
}

/* ------------------------------------------------------------- the end */

/* The session's state goes; no call into the core. */
static void sess_free(struct psess_table *t, struct psess *s)
{
	for (unsigned k = 0; k < s->nstreams; k++)
		if (s->conn[k] && s->conn[k]->sess == s->id)
			pconn_close(t->conns, s->conn[k]);
	memset(s->conn, 0, sizeof(s->conn));
	for (unsigned k = 0; k < *t->ndps; k++)
		t->dps[k]->ops->sess_free(t->dps[k], s);
	if (s->counted)
		KVS_STAT_SUB(t->st->peer_sessions, 1);
	s->counted = false;
	if (s->state == PSESS_DYING)
		t->ndying--;
	s->state = PSESS_FREE;
	PUB(s->pub->state, KVS_PEER_FREE);
}

/* Dying, quiesced: the core releases what it held for it. */
static void sess_end(struct psess_table *t, struct psess *s)
{
	uint32_t id = s->id;
	int status = s->lost_status;
	sess_free(t, s);
	kvsp_peer_lost(t->p, t->t, id, status);
}

/* Sockets closed first: no byte for any of its transfers can arrive or
 * leave; then its data paths quiesce, and it ends when they have. */
static void sess_down(struct psess_table *t, struct psess *s, int status)
{
	for (unsigned k = 0; k < s->nstreams; k++)
		if (s->conn[k] && s->conn[k]->sess == s->id)
			pconn_close(t->conns, s->conn[k]);
	memset(s->conn, 0, sizeof(s->conn));
	s->state = PSESS_DYING;
	s->since_ns = kvsp_xport_now(t->p);
	s->lost_status = status;
	t->ndying++;
	PUB(s->pub->state, KVS_PEER_FREE);
	bool busy = false;
	for (unsigned k = 0; k < *t->ndps; k++)
		busy |= t->dps[k]->ops->sess_quiesce(t->dps[k], s);
	if (!busy)
		sess_end(t, s);
}

void psess_lost(struct psess_table *t, struct psess *s, int status)
{
	if (!live(s))
		return;
	SLOG(t, KVSP_LOG_INFO, "peer %s (%s) lost: %s", s->ep.text, who(s), strerror(-status));
	KVS_STAT_ADD(t->st->peer_lost, 1);
	if (status == -ETIMEDOUT)
		KVS_STAT_ADD(t->st->peer_timeouts, 1);
	sess_down(t, s, status);
}

/* Nothing rides on s: it goes without a word to the core's rooms. */
static void sess_close(struct psess_table *t, struct psess *s, const char *why)
{
	SLOG(t, KVSP_LOG_INFO, "peer %s (%s) closed: %s", s->ep.text, who(s), why);
	KVS_STAT_ADD(t->st->peer_closed, 1);
	sess_down(t, s, -ECONNRESET);
}

void psess_bye_sent(struct psess_table *t, struct psess *s)
{
	if (s->closing && live(s))
		sess_close(t, s, s->retired ? "retired, nothing on it" : "idle");
}

int psess_reap(struct psess_table *t, uint64_t now)
{
	if (!t->ndying)
		return KVSP_IDLE;
	int busy = KVSP_IDLE;
	for (unsigned i = 0; i < PSESS_MAX; i++) {
		struct psess *s = &t->s[i];
		if (s->state != PSESS_DYING)
			continue;
		bool waiting = false;
		for (unsigned k = 0; k < *t->ndps; k++)
			waiting |= t->dps[k]->ops->sess_quiesce(t->dps[k], s);
		if (waiting && now - s->since_ns > t->timeout_ns) {
			/* Our own hardware has not flushed in a peer timeout:
			 * make it stop (a destroyed queue pair touches nothing). */
			LOG_WARN("peer %s: its data path did not quiesce in %llu ms: forced",
				 s->ep.text, (unsigned long long)(t->timeout_ns / 1000000));
			KVS_STAT_ADD(t->st->peer_timeouts, 1);
			for (unsigned k = 0; k < *t->ndps; k++)
				if (t->dps[k]->ops->sess_force)
					t->dps[k]->ops->sess_force(t->dps[k], s);
			waiting = false;
		}
		if (!waiting) {
			sess_end(t, s);
			busy = KVSP_BUSY;
		}
	}
	return busy;
}

void psess_fini(struct psess_table *t)
{
	for (unsigned i = 0; i < PSESS_MAX; i++)
		if (t->s[i].state != PSESS_FREE)
			sess_free(t, &t->s[i]);
}

/* --------------------------------------------------------- a new one */

/* How many rooms ride on session s (one look at every room: not a pass's work). */
static unsigned rooms_on(struct psess_table *t, const struct psess *s)
{
	unsigned rides[PSESS_MAX];
	t->rooms_on(t->rooms_arg, t, rides);
	return rides[s->idx];
}

/* Whether a and b (both live) are one party's: a dialed session is the
 * local uid's whose room made us dial it, an accepted one its peer
 * address's (whatever port: one host). */
static bool same_party(const struct psess *a, const struct psess *b)
{
	if (a->dialer != b->dialer)
		return false;
	return a->dialer ? a->party.uid == b->party.uid : kvsp_endpoint_same_host(&a->ep, &b->ep);
}

/* Within one party: one process's (core/shares.h names it); a client
 * whose process is not known is its own connection; an address is one
 * process. */
static bool same_process(const struct psess *a, const struct psess *b)
{
	if (!a->dialer)
		return true;
	if (a->party.proc || b->party.proc)
		return a->party.proc == b->party.proc;
	return a->party.cid == b->party.cid;
}

/* The session to evict for a new one, of those it may be (joining, or up
 * with nothing on it): of the party holding the most places, of its
 * process holding the most, the joining one longest silent, else the up
 * one longest idle. *held: how many its party holds. */
static struct psess *victim(struct psess_table *t, unsigned *held)
{
	unsigned rides[PSESS_MAX], party[PSESS_MAX] = { 0 }, proc[PSESS_MAX] = { 0 };
	t->rooms_on(t->rooms_arg, t, rides);
	for (unsigned i = 0; i < PSESS_MAX; i++)
		for (unsigned j = 0; live(&t->s[i]) && j < PSESS_MAX; j++)
			if (live(&t->s[j]) && same_party(&t->s[i], &t->s[j])) {
				party[i]++;
				proc[i] += same_process(&t->s[i], &t->s[j]);
			}
	struct psess *v = NULL;
	unsigned vi = 0;
	for (unsigned i = 0; i < PSESS_MAX; i++) {
		struct psess *s = &t->s[i];
		bool joining = s->state == PSESS_JOINING;
		if (!joining && !(s->state == PSESS_UP && !rides[i]))
			continue;
		uint64_t since = joining ? s->since_ns : s->last_tx_ns;
		bool v_joining = v && v->state == PSESS_JOINING;
		uint64_t v_since = v ? (v_joining ? v->since_ns : v->last_tx_ns) : 0;
		if (!v || party[i] > party[vi] ||
		    (party[i] == party[vi] &&
		     (proc[i] > proc[vi] ||
		      (proc[i] == proc[vi] &&
		       (joining > v_joining || (joining == v_joining && since < v_since)))))) {
			v = s;
			vi = i;
		}
	}
	*held = v ? party[vi] : 0;
	return v;
}

static struct psess *sess_alloc(struct psess_table *t, uint64_t now)
{
	struct psess *s = NULL;
	for (unsigned i = 0; i < PSESS_MAX && !s; i++)
		if (t->s[i].state == PSESS_FREE)
			s = &t->s[i];
	if (!s) {
		unsigned held;
		struct psess *v = victim(t, &held);
		if (!v)
			return NULL;
		SLOG(t, KVSP_LOG_INFO,
		     "peer %s (%s, %s) evicted: peer sessions full, its party holds %u of them",
		     v->ep.text, who(v), v->state == PSESS_JOINING ? "joining" : "idle", held);
		KVS_STAT_ADD(t->st->peer_evicted, 1);
		sess_down(t, v, -ENOSR);
		if (v->state != PSESS_FREE)
			return NULL; /* its queue pair still flushes */
		s = v;
	}
	unsigned i = (unsigned)(s - t->s);
	memset(s, 0, sizeof(*s));
	t->gen = (t->gen + 1) & 0xffffff;
	if (!t->gen)
		t->gen = 1;
	s->id = i | t->gen << 8;
	s->idx = (uint8_t)i;
	s->state = PSESS_JOINING;
	s->since_ns = s->last_rx_ns = s->last_tx_ns = now;
	s->pub = &t->pub[i];
	memset(s->pub, 0, sizeof(*s->pub));
	PUB(s->pub->state, KVS_PEER_JOINING);
	return s;
}

static void sess_up(struct psess_table *t, struct psess *s, uint64_t now)
{
	s->state = PSESS_UP;
	s->since_ns = s->last_rx_ns = s->last_tx_ns = now;
	s->owe_bye = t->draining;
	s->bye_reason = KVS_WIRE_BYE_DRAIN;
	KVS_STAT_ADD(t->st->peer_sessions, 1);
	s->counted = true;
	/* One store of the canonical text: kvstage-stat never sees a peer's bytes. */
	snprintf(s->pub->endpoint, sizeof(s->pub->endpoint), "%s",
		 s->dialer ? s->ep.text : "accepted");
	PUB(s->pub->streams, s->nstreams);
	PUB(s->pub->instance, s->instance);
	PUB(s->pub->state, KVS_PEER_UP);
	SLOG(t, KVSP_LOG_INFO, "peer %s up (%s), %u streams", s->ep.text, who(s), s->nstreams);
	/* What its streams said after their JOIN waited in the sockets till now. */
	for (unsigned k = 0; k < s->nstreams; k++)
		pconn_rx_pause(t->conns, s->conn[k], false);
	for (unsigned k = 0; k < *t->ndps; k++)
		t->dps[k]->ops->sess_up(t->dps[k], s);
}

/* Stream k of dialed session s: a connect under way, its HELLO sent at
 * once where it can be. Returns 0, or -errno. */
static int dial_stream(struct psess_table *t, struct psess *s, unsigned k, uint64_t now)
{
	const struct kvsp_endpoint *ep = &s->ep;
	int fd = socket(ep->sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	pconn_zc_prepare(t->conns, fd);
	if (connect(fd, (const struct sockaddr *)&ep->sa, ep->len) < 0 && errno != EINPROGRESS) {
		int err = -errno;
		close(fd);
		return err;
	}
	struct pconn *c = pconn_new(t->conns, fd, true, ep, now);
	if (!c)
		return -EMFILE;
	c->sess = s->id;
	c->stream = k;
	s->conn[k] = c;
	pconn_dialed(t->conns, c);
	return 0;
}

struct psess *psess_dial(struct psess_table *t, const struct kvsp_endpoint *ep,
			 const struct kvsp_party *party, uint64_t now, int *err)
{
	unsigned mine = 0;
	for (unsigned i = 0; i < PSESS_MAX; i++)
		mine += t->s[i].state == PSESS_JOINING && t->s[i].dialer &&
			t->s[i].party.cid == party->cid;
	struct psess *s = mine < PSESS_DIALS_PER_CLIENT ? sess_alloc(t, now) : NULL;
	if (!s) {
		SLOG(t, KVSP_LOG_WARN, "cannot dial %s for client %u: %s", ep->text, party->cid,
		     mine < PSESS_DIALS_PER_CLIENT ? "peer sessions full, every one in use"
						   : "it has as many dials under way as it may");
		*err = -ENOSR;
		return NULL;
	}
	s->dialer = true;
	s->ep = *ep;
	s->party = *party;
	s->nstreams = t->streams;
	randombytes_buf(&s->sid, sizeof(s->sid));
	for (unsigned k = 0; k < s->nstreams; k++) {
		int rc = dial_stream(t, s, k, now);
		if (rc < 0) {
			*err = rc;
			sess_free(t, s);
			return NULL;
		}
	}
	LOG_DEBUG("peer %s: dialing, %u streams", ep->text, s->nstreams);
	return s;
}

int psess_redial(struct psess_table *t, struct psess *s, struct pconn *c, int status, uint64_t now)
{
	if (!s->dialer || s->state != PSESS_JOINING || c->sess != s->id || c->heard ||
	    (c->state != PCONN_CONNECTING && c->state != PCONN_HANDSHAKE) ||
	    (status != -ECONNRESET && status != -EPIPE) || s->redials >= PSESS_REDIALS ||
	    now - s->since_ns >= t->hs_ns)
		return -1;
	unsigned k = c->stream;
	pconn_close(t->conns, c);
	s->conn[k] = NULL;
	s->redials++;
	SLOG(t, KVSP_LOG_INFO, "peer %s: stream %u closed before the peer said a word: redialed",
	     s->ep.text, k);
	int rc = dial_stream(t, s, k, now);
	if (rc < 0)
		psess_lost(t, s, rc);
	return 0;
}

int psess_authed(struct psess_table *t, struct pconn *c, uint64_t now)
{
	if (!c->dialer) {
		pconn_authed(c, 0, 0); /* its first frame must say which session */
		return 0;
	}
	struct psess *s = psess_get(t, c->sess);
	if (!s || s->state != PSESS_JOINING)
		return -ECONNRESET;
	uint64_t inst = kvsp_auth_peer_instance(&c->auth);
	if (s->njoined && s->instance != inst)
		return -EPROTO; /* one session, one proxy */
	s->instance = inst;
	pconn_authed(c, s->id, c->stream);
	c->pub = s->pub;
	pconn_rx_pause(t->conns, c, true); /* nothing is read on it until the session is up */
	struct kvs_wire_join j = { htole64(s->sid), htole32(c->stream), htole32(s->nstreams) };
	int rc = pconn_put(c, KVS_WIRE_JOIN, &j, NULL, 0, NULL);
	if (rc < 0)
		return rc;
	if (++s->njoined == s->nstreams)
		sess_up(t, s, now);
	return 0;
}

int psess_join(struct psess_table *t, struct pconn *c, const struct kvsp_frame *f, uint64_t now)
{
	if (f->type != KVS_WIRE_JOIN)
		return -EPROTO;
	uint64_t sid = le64toh(f->body.join.sid);
	uint32_t stream = le32toh(f->body.join.stream), n = le32toh(f->body.join.nstreams);
	if (!n || n > KVSP_PEER_MAX_STREAMS || stream >= n)
		return -EPROTO;
	uint64_t inst = kvsp_auth_peer_instance(&c->auth);
	struct psess *s = NULL;
	for (unsigned i = 0; i < PSESS_MAX && !s; i++) {
		struct psess *x = &t->s[i];
		if (live(x) && !x->dialer && x->instance == inst && x->sid == sid)
			s = x;
	}
	if (s && s->state != PSESS_JOINING)
		return -EPROTO; /* every stream of it joined already */
	if (!s) {
		s = sess_alloc(t, now);
		if (!s) {
			KVS_STAT_ADD(t->st->peer_refused, 1);
			return -ENOSR;
		}
		s->instance = inst;
		s->sid = sid;
		s->nstreams = n;
		s->ep = c->from;
	}
	if (s->nstreams != n || s->conn[stream])
		return -EPROTO;
	s->conn[stream] = c;
	pconn_joined(c, s->id, stream, s->pub);
	pconn_rx_pause(t->conns, c, true); /* nothing is read on it until the session is up */
	if (++s->njoined == s->nstreams)
		sess_up(t, s, now);
	return 0;
}

/* --------------------------------------------------------- up, frames */

int psess_on_frame(struct psess_table *t, struct psess *s, const struct kvsp_frame *f)
{
	switch (f->type) {
	case KVS_WIRE_PING:
		s->owe_pong = true;
		s->pong_value = le64toh(f->body.ping.value);
		return 0;
	case KVS_WIRE_PONG:
		return 0; /* its arrival was the point */
	case KVS_WIRE_BYE:
		if (le32toh(f->body.bye.reason) == KVS_WIRE_BYE_CLOSE) {
			/* The dialer closes a session that carries nothing. */
			if (rooms_on(t, s))
				return -EPROTO;
			sess_close(t, s, "the peer closed it, nothing on it");
			return 0;
		}
		if (!s->bye) {
			s->bye = true;
			KVS_STAT_ADD(t->st->peer_byes, 1);
			SLOG(t, KVSP_LOG_INFO, "peer %s is draining", s->ep.text);
		}
		return 0;
	}
	return -EPROTO;
}

bool psess_next_frame(struct psess *s, uint64_t now, uint16_t *type, void *body)
{
	union kvs_wire_body *b = body;
	if (s->owe_pong) {
		*type = KVS_WIRE_PONG;
		if (b) {
			s->owe_pong = false;
			b->ping = (struct kvs_wire_ping){ htole64(s->pong_value) };
		}
		return true;
	}
	if (s->owe_ping) {
		*type = KVS_WIRE_PING;
		if (b) {
			s->owe_ping = false;
			b->ping = (struct kvs_wire_ping){ htole64(now) };
		}
		return true;
	}
	if (s->owe_bye) {
		*type = KVS_WIRE_BYE;
		if (b) {
			s->owe_bye = false;
			b->bye = (struct kvs_wire_bye){ htole32(s->bye_reason), 0 };
		}
		return true;
	}
	return false;
}

void psess_retire(struct psess_table *t, struct psess *s)
{
	if (s->retired)
		return;
	s->retired = true;
	SLOG(t, KVSP_LOG_INFO,
	     "peer %s: another proxy answers there now: this session takes no "
	     "new room and closes once it has none",
	     s->ep.text);
}

void psess_drain(struct psess_table *t)
{
	for (unsigned i = 0; i < PSESS_MAX; i++)
		if (t->s[i].state == PSESS_UP && !t->s[i].closing) {
			t->s[i].owe_bye = true;
			t->s[i].bye_reason = KVS_WIRE_BYE_DRAIN;
		}
	t->draining = true; /* sessions that come up from now on hear it too */
}

/* ----------------------------------------------------------- deadlines */

/* An up session: silence, pings, and what to do when nothing rides on it
 * (rides: how many rooms do). */
static bool up_tick(struct psess_table *t, struct psess *s, uint64_t now, unsigned rides)
{
	/* The peer speaks on stream 0 at least (PONG, PING): its silence
	 * anywhere but there says nothing. */
	uint64_t heard = s->last_rx_ns;
	for (unsigned k = 0; k < s->nstreams; k++)
		if (s->conn[k] && s->conn[k]->last_rx_ns > heard)
			heard = s->conn[k]->last_rx_ns;
	s->last_rx_ns = heard;
	if (now - heard > t->timeout_ns) {
		psess_lost(t, s, -ETIMEDOUT);
		return true;
	}
	if (now - s->last_tx_ns > t->timeout_ns / 4)
		s->owe_ping = true;
	if (s->closing)
		return false;
	if (rides) {
		s->idle_since_ns = 0;
		return false;
	}
	if (!s->idle_since_ns)
		s->idle_since_ns = now;
	/* The dialer closes what it no longer uses (the peer hears BYE and
	 * closes its side quietly); an accepted one waits twice as long. */
	uint64_t idle = s->dialer ? t->idle_ns : 2 * t->idle_ns;
	if (s->retired || now - s->idle_since_ns > idle) {
		s->closing = true;
		s->owe_bye = true;
		s->bye_reason = KVS_WIRE_BYE_CLOSE;
	}
	return false;
}

unsigned psess_tick(struct psess_table *t, uint64_t now)
{
	unsigned lost = 0, rides[PSESS_MAX];
	t->rooms_on(t->rooms_arg, t, rides);
	for (unsigned i = 0; i < PSESS_MAX; i++) {
		struct psess *s = &t->s[i];
		if (s->state == PSESS_JOINING && now - s->since_ns > t->hs_ns) {
			psess_lost(t, s, -ETIMEDOUT);
			lost++;
		} else if (s->state == PSESS_UP) {
			lost += up_tick(t, s, now, rides[i]);
		}
	}
	return lost;
}
