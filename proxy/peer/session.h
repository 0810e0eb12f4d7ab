/* SPDX-License-Identifier: MIT */
/*
 * Sessions: what the core calls a peer. A dialed session is --tcp-streams
 * connections made on demand to one endpoint (keyed by its address); an
 * accepted one is joined from the connections that name it (JOIN, the
 * first frame after the handshake, keyed by the peer's instance and the
 * dialer's session id). Every state has a deadline; the state machine and
 * its diagram are session.c's, and no other file changes a session's state.
 */
#ifndef KVSP_SESSION_H
#define KVSP_SESSION_H

#include <stdbool.h>
#include <stdint.h>

#include "core/xport.h"
#include "peer/endpoint.h"
#include "peer/peer.h"

struct kvsp;
struct kvsp_dp;
struct kvsp_frame;
struct kvsp_rl;
struct kvsp_transport;
struct kvs_peer;
struct kvs_stats;
struct pconn;
struct pconn_table;

#define PSESS_MAX 64		 /* KVS_MAX_PEERS: one published row each */
#define PSESS_DIALS_PER_CLIENT 8 /* sessions being dialed for one client at once */
#define PSESS_REDIALS 8		 /* streams of one dialed session dialed again (psess_redial) */

enum psess_state {
	PSESS_FREE = 0,
	PSESS_JOINING, /* its streams connect, prove the secret and join */
	PSESS_UP,      /* every stream joined: rooms ride on it */
	PSESS_DYING,   /* lost: sockets closed, waiting for its data paths to quiesce */
};

struct psess {
	uint32_t id; /* index | generation << 8: the core's name for the peer; never 0 */
	uint8_t state;
	uint8_t idx;
	bool dialer;
	bool bye;		 /* the peer is draining: open nothing new on it */
	bool retired;		 /* open nothing new on it: it closes once nothing rides on it */
	bool closing;		 /* our BYE (close) is on its way: then the sockets close */
	bool counted;		 /* in peer_sessions: it came up */
	struct kvsp_endpoint ep; /* dialed: whom we dial; accepted: its first stream's source */
	uint64_t instance;	 /* the peer's, once its first stream proved itself */
	uint64_t sid;		 /* the dialer's name for the session */
	struct kvsp_party party; /* dialed: whose room made us dial it */
	unsigned nstreams, njoined, rr;
	unsigned redials; /* dialed: streams dialed again while joining */
	struct pconn *conn[KVSP_PEER_MAX_STREAMS];
	uint64_t since_ns; /* in this state since */
	uint64_t last_rx_ns, last_tx_ns;
	uint64_t idle_since_ns; /* UP: since nothing rode on it (0: something does) */
	bool owe_ping, owe_pong, owe_bye;
	uint32_t bye_reason;
	uint64_t pong_value;
	int lost_status;
	struct kvs_peer *pub; /* its row in the published peer table */
};

struct psess_table {
	struct psess s[PSESS_MAX];
	uint32_t gen;
	unsigned ndying;
	struct kvsp *p;
	struct kvsp_transport *t;
	struct pconn_table *conns;
	struct kvsp_dp *const *dps;
	const unsigned *ndps;
	struct kvs_stats *st;
	struct kvs_peer *pub;
	struct kvsp_rl *rl_sess; /* session lines a peer can cause */
	unsigned streams;	 /* per session we dial */
	uint64_t timeout_ns;	 /* --peer-timeout: silence, answers owed, quiescence */
	uint64_t hs_ns;		 /* handshake and joining */
	uint64_t idle_ns;	 /* a dialed session with nothing on it closes after this */
	bool draining;
	/* How many rooms ride on each session (the room protocol's count, one
	 * look at every room): rides[i] for the session at index i. */
	void (*rooms_on)(void *arg, const struct psess_table *t, unsigned rides[]);
	void *rooms_arg;
};

/* The session with id, if it is joining or up; else NULL. */
struct psess *psess_get(struct psess_table *t, uint32_t id);
/* The up session with id, or NULL. */
struct psess *psess_up(struct psess_table *t, uint32_t id);
/* The session we dialed to ep that takes new rooms (joining or up, not
 * retired, not closing), or NULL. */
struct psess *psess_dialed(struct psess_table *t, const struct kvsp_endpoint *ep);

/* Dials ep for a room of who's (--tcp-streams connections). Returns the
 * new session (JOINING), or NULL with *err: -ENOSR (peer sessions full of
 * sessions in use, or who's connection dials too many at once), or
 * socket()'s, connect()'s -errno. */
struct psess *psess_dial(struct psess_table *t, const struct kvsp_endpoint *ep,
			 const struct kvsp_party *who, uint64_t now, int *err);
/* Dialed session s's stream c failed with status while joining, before the
 * listener said a word on it (its admission closed it to make way: not a
 * refusal of us). Dials that stream again, within the joining deadline, at
 * most PSESS_REDIALS times a session. Returns 0 if it did (c is closed;
 * s is lost instead if the new dial cannot start), or -1: c's failure is
 * the session's (psess_lost). */
int psess_redial(struct psess_table *t, struct psess *s, struct pconn *c, int status, uint64_t now);
/* c proved the secret. Dialed: it joins its session (JOIN sent), which is
 * up with its last stream. Accepted: it waits for JOIN. Returns 0, or
 * -errno (c's session is to be lost; c alone, accepted). */
int psess_authed(struct psess_table *t, struct pconn *c, uint64_t now);
/* An accepted connection's first frame f, which must be JOIN: it joins
 * (or starts) the session it names. Returns 0, or -errno (drop c). */
int psess_join(struct psess_table *t, struct pconn *c, const struct kvsp_frame *f, uint64_t now);
/* A frame on s about the session itself (PING, PONG, BYE). Returns 0, or -errno. */
int psess_on_frame(struct psess_table *t, struct psess *s, const struct kvsp_frame *f);
/* The session's own control frame owed on stream 0 into type and body;
 * body NULL: only whether there is one. Returns true if so. */
bool psess_next_frame(struct psess *s, uint64_t now, uint16_t *type, void *body);
/* s's BYE (close) left: its sockets close now, quietly. */
void psess_bye_sent(struct psess_table *t, struct psess *s);

/* s is lost (status, logged): its sockets close at once, its data paths
 * quiesce, then the core releases its pins and fails what rode on it. */
void psess_lost(struct psess_table *t, struct psess *s, int status);
/* No new room goes on s (the peer behind its address restarted); it
 * closes once nothing rides on it. */
void psess_retire(struct psess_table *t, struct psess *s);
/* The deadlines: handshakes are the connections' (peer/conn.h); joining,
 * silence, pings, idle sessions and dying ones here. Returns the sessions
 * it lost. */
unsigned psess_tick(struct psess_table *t, uint64_t now);
/* Ends the dying sessions whose data paths have quiesced. Returns KVSP_BUSY if it ended one. */
int psess_reap(struct psess_table *t, uint64_t now);
/* The proxy drains: every session says BYE (drain), and new ones will. */
void psess_drain(struct psess_table *t);
/* Ends every session, no call into the core (the proxy is going). */
void psess_fini(struct psess_table *t);

#endif
