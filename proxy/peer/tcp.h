/* SPDX-License-Identifier: MIT */
/*
 * The tcp transport's own parts, shared by its files:
 *   transport_tcp.c  the ops table, the loop's poll, creation and teardown
 *   tcp_sess.c       sessions (the connections to one peer): dial, accept,
 *                    join, lose; the timer
 *   tcp_room.c       rooms: the control frames they owe, what each frame
 *                    from a peer means
 *   tcp_conn.c       one connection: connect or accept, the handshake,
 *                    writing frames and payloads, reading them
 *
 * A session is what the core calls a peer: --tcp-streams connections to
 * one proxy, authenticated, joined under one session id. Control frames
 * go on stream 0, chunks round-robin on every stream. Losing any stream
 * loses the session: every room it carried fails, every pin it held is
 * released (kvsp_peer_lost), and only then are the sockets' slots reused.
 */
#ifndef KVSP_TCP_H
#define KVSP_TCP_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>

#include "peer/frame.h"
#include "peer/peer_auth.h"
#include "datapath/verbs.h"
#include "core/xport.h"
#include "peer/peer.h"

#define TCP_MAX_STREAMS KVSP_PEER_MAX_STREAMS
#define TCP_MAX_SESS 64
#define TCP_MAX_CONNS (TCP_MAX_SESS * 2 + 32) /* sessions both ways, and handshakes */
#define TCP_SINK_SIZE (64 * 1024)
#define TCP_REFUSALS 32
#define TCP_NONE UINT32_MAX /* the end of a list through slot or room indices */
/* CHUNK_READs a sender keeps unacknowledged on one session: bounds the
 * receiver's READs in flight and the acks it may owe at once. */
#define TCP_RDMA_WINDOW 128

struct tcp_ep {
	struct sockaddr_storage sa;
	socklen_t len;
	char text[64]; /* "HOST:PORT", as it goes into descriptors after "tcp:" */
};

/* Parses "IPV4:PORT" or "[IPV6]:PORT" (numeric: the loop never waits for
 * DNS). Returns 0, or -EINVAL. */
int tcp_ep_parse(const char *s, struct tcp_ep *ep);

enum tcp_conn_state {
	TCP_C_FREE = 0,
	TCP_C_CONNECTING, /* dialer: connect() in progress */
	TCP_C_AUTH,       /* handshake messages */
	TCP_C_JOINING,    /* listener: authenticated, waiting for JOIN */
	TCP_C_UP,
};

struct tcp_conn {
	int fd;
	uint8_t state;
	bool dialer;
	bool wblocked; /* the socket is full: wait for EPOLLOUT */
	uint16_t idx;
	uint32_t id;   /* epoll tag: idx and a generation */
	struct tcp_sess *sess;
	unsigned stream;
	uint64_t born_ns, last_rx_ns;
	/* handshake */
	struct kvsp_auth auth;
	uint8_t hs_in[128], hs_out[128];
	uint32_t hs_have, hs_need, hs_out_len, hs_out_off;
	/* frames */
	struct kvsp_frame_tx ftx;
	struct kvsp_frame_rx frx;
	/* what is being written: a frame, and a CHUNK's payload after it */
	uint8_t txbuf[KVS_WIRE_FRAME_MAX];
	uint32_t tx_len, tx_off;
	struct kvsp_xfer *tx_x;
	uint32_t tx_poff;
	bool tx_fp_checked, tx_held;
	uint32_t q_head, q_tail, qn; /* chunks to send, through tcp.xnext[] */
	/* what is being read: a CHUNK's payload, into a slot or the sink */
	struct kvsp_xfer *rx_x;
	uint8_t *rx_dst;
	uint32_t rx_len, rx_off, rx_crc, rx_want_crc;
	bool rx_sink, rx_has_crc;
};

/* DYING: lost, sockets closed, waiting for its READs to flush (tcp_rdma.c). */
enum tcp_sess_state { TCP_S_FREE = 0, TCP_S_JOINING, TCP_S_UP, TCP_S_DYING };

/* Control frames a room owes its peer, sent in this order on stream 0. */
enum { OWE_OPEN = 1, OWE_ACK = 2, OWE_ABORT = 4, OWE_DONE = 8, OWE_ENDED = 16 };

struct tcp_room {
	uint32_t gen;         /* the core room's generation this is about */
	uint32_t sess;        /* session id; 0: none */
	uint8_t owed;
	bool on_owe, acked, cancelled;
	uint32_t owe_next;
	int32_t ack_status, abort_status;
	struct kvs_wire_room name; /* the receiving room (ours, or the peer's from the descriptor) */
	uint64_t sender_ref;       /* the sending proxy's room: gen << 32 | index */
	uint64_t far_instance;     /* sending side: the descriptor's instance */
	uint32_t pend_head, pend_tail; /* sending side: chunks waiting for OPEN_ACK */
	uint32_t from;             /* which half we hold: KVS_WIRE_FROM_SEND or _RECV */
	uint64_t bytes;
};

struct tcp_sess {
	uint32_t id; /* the core's peer: index | generation << 8 */
	uint8_t state;
	bool dialer, bye;
	bool counted; /* in peer_sessions: it came up */
	struct tcp_ep ep;    /* dialer: whom we dial */
	uint64_t instance;   /* the peer's, once authenticated */
	uint64_t sid;        /* the dialer's random name for the session */
	unsigned nstreams, njoined, rr;
	struct tcp_conn *conn[TCP_MAX_STREAMS];
	uint32_t owe_head, owe_tail; /* rooms with control frames owed */
	bool owe_ping, owe_pong, owe_bye;
	uint64_t pong_value, last_tx_ns;
	struct kvs_peer *pub; /* its row in the published peer table */
	struct kvs_wire_open_ack refusals[TCP_REFUSALS]; /* OPENs refused, answers owed */
	unsigned refusal_head, nrefusals;
	/* RDMA (tcp_rdma.c): once both ends said RDMA_HELLO, chunks we send go
	 * as CHUNK_READ on stream 0 and the peer pulls them. */
	struct ibv_qp *qp;
	struct kvsp_verbs_ep rdma_local, rdma_peer;
	bool owe_rdma_hello, rdma_heard, rdma_up;
	unsigned reads_inflight;     /* sending: CHUNK_READs not yet acknowledged */
	unsigned reads_out;          /* receiving: READs posted on qp, not completed */
	uint32_t ack_head, ack_tail; /* receiving: our slots whose READ ended, CHUNK_ACK owed */
	uint32_t held_head, held_tail; /* receiving: READs the rdma.read failpoint holds (tests) */
	struct kvs_wire_chunk_ack nacks[TCP_RDMA_WINDOW]; /* CHUNK_READs refused, acks owed */
	unsigned nack_head, nnacks;
	int lost_status;             /* DYING: why it was lost */
};

/* Receiving side: a READ we posted into our slot, or its ack still owed. */
struct tcp_rread {
	struct kvs_wire_room name;
	uint64_t sender_ref;
	uint32_t sess, chunk;
	int32_t status;
	uint32_t next; /* the session's ack or held list */
	uint32_t len;
	void *dst;
	uint64_t raddr;
};

struct tcp {
	struct kvsp_transport t;
	struct kvsp *p;
	const struct kvsp_secret *secret;
	uint64_t instance;
	unsigned streams;
	bool checksum;
	uint64_t timeout_ns;
	int epfd, listen_fd, timer_fd;
	struct tcp_ep listen, advertise;
	char endpoint[64]; /* "tcp:" advertise */
	struct tcp_conn conn[TCP_MAX_CONNS];
	uint32_t conn_gen;
	unsigned conns_hi; /* conn[conns_hi..] are FREE: loops stop there; 0: no connection */
	bool woken;      /* our epoll fd woke the loop (the listener, the timer) */
	struct tcp_sess sess[TCP_MAX_SESS];
	uint32_t sess_gen;
	struct tcp_room *rooms; /* by core room index */
	uint32_t nrooms;
	uint32_t *xnext;        /* chunk queues through slot indices */
	uint8_t *sink;
	bool draining;
	struct kvsp_verbs *verbs; /* --rdma-device; NULL: chunks only by TCP */
	struct tcp_rread *rread;  /* by our slot index */
	uint8_t *rwait;           /* by our slot index: sent by CHUNK_READ, waiting for CHUNK_ACK */
	unsigned nheld;           /* READs held by rdma.read, every session: 0 on any real run */
	struct kvs_stats *st;
	struct kvs_peer *peers; /* published, one row per session index */
};

/* A published field, written by the loop, read by kvstage-stat. */
#define PEER_SET(f, v) __atomic_store_n(&(f), (v), __ATOMIC_RELAXED)

/* tcp_conn.c */
/* A new connection on fd (non-blocking), dialing or accepted. Returns it, or NULL (fd closed). */
struct tcp_conn *tcp_conn_new(struct tcp *tc, int fd, bool dialer, bool connecting);
/* Closes c's socket; what it held is the session's to release. */
void tcp_conn_close(struct tcp *tc, struct tcp_conn *c);
/* Moves the handshake on. Returns 0, or -errno (drop the connection). */
int tcp_conn_handshake(struct tcp *tc, struct tcp_conn *c);
/* Writes what c has to write until the socket is full. Returns KVSP_BUSY/IDLE, or -errno (lost). */
int tcp_conn_tx(struct tcp *tc, struct tcp_conn *c);
/* Reads what c's socket has, a bounded amount. Returns KVSP_BUSY/IDLE, or -errno (lost). */
int tcp_conn_rx(struct tcp *tc, struct tcp_conn *c);
/* Seals a frame into c's write buffer (which must be empty). Returns 0, or -errno. */
int tcp_conn_frame(struct tcp_conn *c, uint16_t type, const void *body);
/* Queues chunk x on c. */
void tcp_conn_queue(struct tcp *tc, struct tcp_conn *c, struct kvsp_xfer *x);
/* True while c has something it could write now. */
bool tcp_conn_wants_tx(const struct tcp *tc, const struct tcp_conn *c);

/* tcp_sess.c */
/* The live session with id, or NULL. */
struct tcp_sess *tcp_sess_get(struct tcp *tc, uint32_t id);
/* c failed: its session is lost (every room it carried fails), or, before
 * it joined one, it is closed and counted. */
void tcp_conn_fail(struct tcp *tc, struct tcp_conn *c, int status);
/* Starts a session to ep (--tcp-streams connections). Returns it, or NULL with *err set. */
struct tcp_sess *tcp_dial(struct tcp *tc, const struct tcp_ep *ep, int *err);
/* The listener is readable: accepts what it can, within MAX_HANDSHAKES. */
void tcp_on_accept(struct tcp *tc);
/* The timer fired: timeouts, pings. */
void tcp_on_timer(struct tcp *tc);
/* c's socket is ready for events. */
void tcp_on_conn_event(struct tcp *tc, struct tcp_conn *c, uint32_t events);
/* An accepted connection's first frame, which must be JOIN. Returns 0, or -errno. */
int tcp_on_join(struct tcp *tc, struct tcp_conn *c, const struct kvsp_frame *f);

/* The session is lost (status): see tcp_sess.c. */
void tcp_sess_lost(struct tcp *tc, struct tcp_sess *s, int status);
/* A DYING session's last READ flushed: the core releases its pins now. */
void tcp_sess_end(struct tcp *tc, struct tcp_sess *s);

/* tcp_rdma.c */
/* Opens the device of o->rdma_device over our pool. Returns 0, or -errno with why. */
int tcp_rdma_open(struct tcp *tc, const struct kvsp_peer_opts *o, char *why, size_t len);
/* --transport: opens the device it asks for (or finds one, for auto) and
 * says which data path peers get. Returns 0, or -errno with why (only where
 * a device was asked for and cannot open). */
int tcp_rdma_choose(struct tcp *tc, const struct kvsp_peer_opts *o, char *why, size_t len);
/* Closes it (every session gone). */
void tcp_rdma_close(struct tcp *tc);
/* s came up: with a device, makes its queue pair and owes RDMA_HELLO. */
void tcp_rdma_sess_up(struct tcp *tc, struct tcp_sess *s);
/* s is lost: its queue pair to the error state. Returns true if READs
 * are still to flush (the loss finishes in tcp_rdma_poll). */
bool tcp_rdma_sess_lost(struct tcp *tc, struct tcp_sess *s);
/* s is freed: its queue pair destroyed, its sending pins' marks cleared. */
void tcp_rdma_sess_free(struct tcp *tc, struct tcp_sess *s);
/* Completions. Returns KVSP_BUSY or KVSP_IDLE. */
int tcp_rdma_poll(struct tcp *tc);
/* True while any READ is in flight (the loop must not sleep). */
bool tcp_rdma_pending(const struct tcp *tc);
/* The connection chunks of s go on. */
struct tcp_conn *tcp_rdma_conn_for(struct tcp_sess *s);
/* c has no frame in progress: seals RDMA control owed (hello, acks). Returns true if it did. */
bool tcp_rdma_next_control(struct tcp *tc, struct tcp_conn *c);
/* Seals x as CHUNK_READ into c if the session reads by RDMA and c is its
 * stream 0 and the window has room. Returns 1 (sealed), 0 (send it by
 * TCP), or -1 (not now: the window is full). */
int tcp_rdma_chunk(struct tcp *tc, struct tcp_conn *c, struct kvsp_xfer *x);
/* Frames: RDMA_HELLO, CHUNK_READ, CHUNK_ACK. Returns 0, or -errno (drop the connection). */
int tcp_rdma_on_frame(struct tcp *tc, struct tcp_sess *s, const struct kvsp_frame *f);

/* tcp_room.c */
/* The core's name for a room a frame names. */
struct kvsp_room_name tcp_room_name(const struct kvs_wire_room *w);
/* Receiving side: our room the frame names through s, or NULL (the token is checked by the core). */
struct tcp_room *tcp_receiver_room(struct tcp *tc, struct tcp_sess *s,
				   const struct kvs_wire_room *name, uint32_t *idx);
/* Room i owes its peer the control frame what (OWE_*). */
void tcp_owe(struct tcp *tc, uint32_t i, uint8_t what);

/* for tcp_conn.c */
/* A verified frame from c. Returns 0, or -errno (drop the connection). */
int tcp_on_frame(struct tcp *tc, struct tcp_conn *c, const struct kvsp_frame *f);
/* c authenticated. Returns 0, or -errno. */
int tcp_on_authed(struct tcp *tc, struct tcp_conn *c);
/* c has no frame in progress: fills its buffer with the next control frame, if any. Returns true if it did. */
bool tcp_next_control(struct tcp *tc, struct tcp_conn *c);
/* True if x's room was cancelled (its chunk must not be sent). */
bool tcp_room_cancelled(const struct tcp *tc, const struct kvsp_xfer *x);
/* A CHUNK header from c: where its payload goes. */
void tcp_on_chunk(struct tcp *tc, struct tcp_conn *c, const struct kvsp_frame *f);

#endif
