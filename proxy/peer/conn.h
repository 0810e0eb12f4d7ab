/* SPDX-License-Identifier: MIT */
/*
 * One connection between proxies: a TCP socket, the handshake over it,
 * then frames, some with a payload after them. It knows no session, room
 * or data path: what a frame means is its owner's (peer/plane.c), and
 * where a payload goes is the data path's (datapath/stream.c).
 *
 * Its one state machine, and the deadline of each state, are conn.c's.
 *
 * Admission (pconn_admit): accepted connections that have not joined a
 * session yet are at most PCONN_PER_SOURCE from one address and
 * PCONN_HANDSHAKES in all. A newcomer past either takes the place of the
 * longest-silent one (one that never said a byte before any that did),
 * never the other way round, so silent connections cannot keep a real
 * proxy out, even from its own address.
 *
 * Writes go straight from slot memory into the socket: a batch of sealed
 * frames, each with its payload after it, in one sendmsg (iovecs header,
 * payload, header, payload...). A frame joins the batch while it holds
 * fewer than PCONN_TX_FRAMES and less than PCONN_TX_BYTES of payload, and
 * its last frame has a payload (a frame without one, a control frame,
 * ends it: a BYE is the last thing said); so a control frame owed
 * meanwhile waits behind at most that much. Reads go straight from the
 * socket into the slot a payload is posted for, or into the sink.
 * Non-blocking throughout.
 *
 * With --tcp-zerocopy a batch holding payload goes with MSG_ZEROCOPY: the
 * kernel (and the NIC) reads the slot after sendmsg returns, until it
 * says on the socket's error queue that it is done with that call. A
 * frame is done (pconn_tx_done) only then, so its transfer quiesces only
 * then; its header stays in txbuf as long. A connection closed while the
 * kernel still holds such bytes is not closed: its queues are purged and
 * it waits, as a zombie of its session, until the kernel has said so for
 * every call (pconn_zombies_reap); the session is dying meanwhile.
 */
#ifndef KVSP_CONN_H
#define KVSP_CONN_H

#include <stdbool.h>
#include <stdint.h>

#include "core/counters.h"
#include "peer/endpoint.h"
#include "peer/frame.h"
#include "peer/auth.h"

struct kvsp_xfer;
struct kvs_peer;
struct kvs_stats;

/* The socket layer's counters in the counter block, as pconn_counters
 * names them (conn.c), in its order: values[PCONN_CTR_*]. */
enum pconn_ctr {
	PCONN_CTR_BYTES_TX,    /* bytes written to peer connections */
	PCONN_CTR_BYTES_RX,    /* ... read from them */
	PCONN_CTR_SEND_CALLS,  /* sendmsg/send, EAGAIN ones included */
	PCONN_CTR_RECV_CALLS,  /* recv/recvmsg, EAGAIN ones included */
	PCONN_CTR_LOWAT_CALLS, /* setsockopt(SO_RCVLOWAT) */
	PCONN_CTR_ZC_SENDS,    /* sendmsg with MSG_ZEROCOPY */
	PCONN_CTR_ZC_COPIED,   /* ... of them, the kernel copied anyway */
	PCONN_NCTR,
};
extern const struct kvsp_counter_def pconn_counters[PCONN_NCTR + 1];

#define PCONN_HANDSHAKES 256 /* accepted connections not joined yet, in all */
#define PCONN_PER_SOURCE 32  /* ... and from one address: a peer's streams (16) twice over */
#define PCONN_SINK_SIZE (64 * 1024)
#define PCONN_TX_FRAMES 8	    /* frames in one batch (one sendmsg) */
#define PCONN_TX_BYTES (256 * 1024) /* no frame joins a batch holding this much payload */
#define PCONN_NONE UINT32_MAX
#define PCONN_ZC_MIN (16 * 1024) /* a batch with less payload is copied: zerocopy costs more */
#define PCONN_ZC_WINDOW 64	 /* zerocopy sendmsgs a connection has unanswered, at most */
/* The kernel copied this many zerocopy sendmsgs in a row (to loopback or veth it
 * always does, at delivery, and slower than a plain send): the connection copies. */
#define PCONN_ZC_COPIED_RUN 64

enum pconn_state {
	PCONN_FREE = 0,
	PCONN_CONNECTING, /* dialer: connect() in progress */
	PCONN_HANDSHAKE,  /* proving the secret, both ways */
	PCONN_JOINING,	  /* accepted and proved: its first frame must be JOIN */
	PCONN_UP,	  /* in a session: frames */
};

/* What pconn_read found. */
enum { PCONN_NOTHING = 0, PCONN_FRAME, PCONN_DATA, PCONN_PAYLOAD_END };

/* A payload owing at least MIN bytes wakes the loop for up to MAX of them
 * at once (SO_RCVLOWAT; conn.c's rx_lowat). MAX: more made a 4 MiB chunk's
 * sender wait for the window on loopback (docs/benchmarks.md). */
#define PCONN_LOWAT_MIN (64u << 10)
#define PCONN_LOWAT_MAX (1u << 20)

/* A sealed frame being written (its bytes are txbuf's at the same index). */
struct pconn_tx {
	const uint8_t *payload;
	struct kvsp_xfer *x; /* the payload's transfer */
	uint32_t len, plen;  /* frame bytes, payload bytes */
	uint16_t type;
	bool zc;	 /* a zerocopy sendmsg carried some of its bytes ... */
	uint32_t zc_end; /* ... the last of them is the one before this id */
};

/* The kernel's answers to a connection's zerocopy sendmsgs (ids from 0, one
 * per call): every id below done is answered, and bit k of ahead says id
 * done + 1 + k is (answers may come out of order). */
struct pconn_zc {
	uint32_t sent, done;
	uint64_t ahead;
	uint32_t copied_run; /* answers in a row that say the kernel copied anyway */
};

/* A closed connection the kernel still reads slot bytes for (see above). */
struct pconn_zombie {
	int fd; /* -1: a free place */
	uint32_t sess;
	struct pconn_zc zc;
};

struct pconn {
	int fd;
	uint8_t state;
	bool dialer;
	bool wblocked;	/* the socket is full: wait for EPOLLOUT */
	bool tx_held;	/* the batch's last payload waits (test barrier, datapath/stream.c) */
	bool rx_paused; /* joined a session that is not up: its frames wait in the socket */
	bool heard;	/* it has said a byte */
	bool zc_on;	/* SO_ZEROCOPY is set: batches with payload go with MSG_ZEROCOPY */
	uint16_t idx;
	uint32_t id;   /* a generation: the epoll tag is id << 32 | idx */
	uint32_t sess; /* its session's id once JOINed; 0: none */
	unsigned stream;
	struct kvsp_endpoint from; /* accepted: the peer's address; dialed: whom we dial */
	uint64_t born_ns, last_rx_ns;
	struct kvs_peer *pub; /* its session's row in the peer table, once joined */
	/* handshake */
	struct kvsp_auth auth;
	uint8_t hs_in[128], hs_out[128];
	uint32_t hs_have, hs_out_len, hs_out_off;
	/* frames */
	struct kvsp_frame_tx ftx;
	struct kvsp_frame_rx frx;
	/* what is being written: a ring of sealed frames, each with its payload;
	 * tx[tx_head..] for tx_n, the first tx_sent of them all out */
	uint8_t txbuf[PCONN_TX_FRAMES][KVS_WIRE_FRAME_MAX];
	struct pconn_tx tx[PCONN_TX_FRAMES];
	uint8_t tx_head, tx_n, tx_sent;
	uint32_t tx_off; /* bytes of the first frame not all out that are (frame, then payload) */
	uint64_t tx_pbytes; /* payload bytes in the ring */
	/* what is being read: a payload, into a slot or the sink */
	uint16_t rx_type; /* the frame that announced it */
	struct kvsp_xfer *rx_x;
	uint8_t *rx_dst; /* NULL: the sink */
	uint32_t rx_len, rx_off, rx_crc, rx_want_crc;
	bool rx_has_crc;
	bool rx_ended;	   /* its owner ended its transfer already (pconn_payload_to_sink) */
	uint32_t rx_lowat; /* the socket's SO_RCVLOWAT (0: the kernel's 1; UINT32_MAX: unknown) */
	/* chunks queued to go on this connection (datapath/stream.c's list) */
	uint32_t q_head, q_tail, qn;
	struct pconn_zc zc;
};

#define PCONN_MAX (64 * 16 + PCONN_HANDSHAKES) /* every session's streams, and handshakes */

struct pconn_table {
	struct pconn conn[PCONN_MAX];
	unsigned hi; /* conn[hi..] are FREE: loops stop here; 0: none */
	uint32_t gen;
	int epfd; /* the peer plane's epoll: tags are id << 32 | idx */
	uint8_t *sink;
	uint32_t max_payload;
	uint64_t instance; /* ours, in every handshake */
	const struct kvsp_secret *secret;
	struct kvs_stats *st;
	uint64_t *ctr; /* its counters in the block: [PCONN_CTR_*] */
	bool zerocopy; /* --tcp-zerocopy */
	struct pconn_zombie zombie[PCONN_MAX];
	unsigned nzombies;
};

/* Sets t up (epfd is the plane's; ctr: pconn_counters' values, as
 * registered). Returns 0, or -ENOMEM. */
int pconn_table_init(struct pconn_table *t, int epfd, uint32_t max_payload, uint64_t instance,
		     const struct kvsp_secret *secret, struct kvs_stats *st, uint64_t *ctr,
		     bool zerocopy);
/* --tcp-zerocopy's part (zerocopy.c), design note 36. */
/* With --tcp-zerocopy: SO_ZEROCOPY on fd, a socket about to connect or
 * listen (for a kernel that takes it only then). */
void pconn_zc_prepare(const struct pconn_table *t, int fd);
/* SO_ZEROCOPY on fd. Returns whether it is on. */
bool pconn_zc_set(int fd);
/* c's socket still lends slot bytes to the kernel: its queues are purged
 * (connect AF_UNSPEC: the kernel drops what it held and answers for it;
 * the fd stays ours to hear that) and it waits as a zombie of c's session.
 * Returns false if it has no place (never: at most one per connection). */
bool pconn_zombie_from(struct pconn_table *t, struct pconn *c);
/* Closes every connection and zombie and frees t's memory. */
void pconn_table_fini(struct pconn_table *t);

/* Takes a place for a connection accepted from `from`, making one if
 * admission is full by closing the longest-silent of the unjoined ones (of
 * that address when it holds its share). Returns the closed one's index
 * (counted by the caller), or PCONN_NONE if there was a free place. */
uint32_t pconn_admit(struct pconn_table *t, const struct kvsp_endpoint *from);
/* A connection on fd (non-blocking, ours from now): dialing (connect in
 * progress) or accepted from `from`. Returns it, or NULL (fd closed, the table full). */
struct pconn *pconn_new(struct pconn_table *t, int fd, bool dialer,
			const struct kvsp_endpoint *from, uint64_t now);
/* Closes c's socket and frees its place; what it held is its owner's to
 * release. A socket the kernel still reads slot bytes for becomes a zombie
 * of c's session instead (purged, never written or read again). */
void pconn_close(struct pconn_table *t, struct pconn *c);
/* Reads the kernel's answers of sess's zombies (every zombie's, sess 0),
 * closing those answered in full; read false: only counts them. Returns
 * how many are left. */
unsigned pconn_zombies_reap(struct pconn_table *t, uint32_t sess, bool read);
/* Closes sess's zombies, answered or not (their wait is overdue). */
void pconn_zombies_close(struct pconn_table *t, uint32_t sess);
/* Reads the kernel's answers to c's zerocopy sendmsgs (EPOLLERR says some
 * wait); the frames they free are pconn_tx_done's. Returns 0, or -errno. */
int pconn_zc_reap(struct pconn_table *t, struct pconn *c);
/* True while the kernel owes c answers for zerocopy sendmsgs. */
bool pconn_zc_owed(const struct pconn *c);
/* The live connection an epoll tag names, or NULL. */
struct pconn *pconn_of_tag(struct pconn_table *t, uint64_t tag);

/* Moves the handshake on (CONNECTING, HANDSHAKE). Returns 1 once the
 * secret is proven both ways (keys in place; its owner says what it is
 * now), 0 while it waits, or -errno. */
int pconn_handshake(struct pconn_table *t, struct pconn *c, uint64_t now);
/* A dialer's connection just made: if its connect completed at once (on
 * loopback it does), its HELLO goes now. It is then in the listener's
 * socket before the listener accepts it, and read at the accept: it is
 * never taken for a silent one (pconn_admit). */
void pconn_dialed(struct pconn_table *t, struct pconn *c);
/* c proved itself: JOINING (accepted) or UP (dialer, as stream of session sess). */
void pconn_authed(struct pconn *c, uint32_t sess, unsigned stream);
/* c joined session sess as its stream (JOINING -> UP). */
void pconn_joined(struct pconn *c, uint32_t sess, unsigned stream, struct kvs_peer *pub);
/* While paused, nothing is read from c (its frames wait in the socket,
 * and the loop is not woken for them). */
void pconn_rx_pause(struct pconn_table *t, struct pconn *c, bool paused);
/* The socket is ready for events (EPOLLOUT ends a full socket's wait). */
void pconn_ready(struct pconn_table *t, struct pconn *c, uint32_t events);
/* Returns the time c is overdue from (compare with now), or UINT64_MAX if it has no deadline. */
uint64_t pconn_deadline(const struct pconn *c, uint64_t hs_ns, uint64_t timeout_ns);

/* Reads once from c (a frame's bytes or a payload's; a payload's tail with
 * the next frame's first bytes). Returns PCONN_FRAME with a verified frame
 * in *f, PCONN_DATA (bytes taken, more to come), PCONN_PAYLOAD_END (the
 * payload is all in: rx_x, rx_dst and the CRC say what came; then
 * pconn_rx_err), PCONN_NOTHING (the socket has nothing now), or -errno
 * (the connection is lost; a refused frame is counted). */
int pconn_read(struct pconn_table *t, struct pconn *c, struct kvsp_frame *f, uint64_t now);
/* Returns 0, or the refusal of a frame whose first bytes came with the tail of
 * the payload before it (counted then): c is to be failed with it once that
 * payload's end was heard. */
int pconn_rx_err(const struct pconn *c);
/* After a frame announcing plen payload bytes: they go to dst (a posted
 * slot, for transfer x) or, dst NULL, to the sink. crc: the frame's CRC32C
 * of them, checked at the end, when has_crc. */
void pconn_payload_into(struct pconn *c, struct kvsp_xfer *x, void *dst, uint32_t plen,
			bool has_crc, uint32_t crc);
/* What is left of the payload being read goes to the sink: no byte more
 * lands where it was going, and its transfer is the caller's to end now
 * (rx_ended says so at the payload's end). Returns it (NULL: none). */
struct kvsp_xfer *pconn_payload_to_sink(struct pconn *c);

/* True while a frame (or its payload) is still to be written. */
bool pconn_tx_busy(const struct pconn *c);
/* True if c can write something now. */
bool pconn_tx_ready(const struct pconn *c);
/* True if another frame may join c's batch (see the head of this file). */
bool pconn_tx_room(const struct pconn *c);
/* Seals a frame of type with body into c's batch (pconn_tx_room said so), with
 * plen payload bytes from payload after it (transfer x). Returns 0, or -errno. */
int pconn_put(struct pconn *c, uint16_t type, const void *body, const void *payload, uint32_t plen,
	      struct kvsp_xfer *x);
/* Writes what c's batch holds, in one sendmsg. Returns 1 if all it could
 * offer went, 0 if the socket is full (c waits for EPOLLOUT) or nothing
 * could go (the payload is held), or -errno (the connection is lost).
 * Frames all out are pconn_tx_done's. */
int pconn_write(struct pconn_table *t, struct pconn *c, uint64_t now);
/* Takes the oldest frame whose every byte left (the socket has its copy,
 * or for a zerocopy one, the kernel said it is done with them), oldest
 * first: its type and payload's transfer (NULL: none). Returns false when
 * there is none. */
bool pconn_tx_done(struct pconn *c, uint16_t *type, struct kvsp_xfer **x);

#endif
