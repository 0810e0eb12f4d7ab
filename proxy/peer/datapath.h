/* SPDX-License-Identifier: MIT */
/*
 * Data paths: how a chunk's bytes travel between two proxies once the peer
 * plane has agreed on its room (the receiver acknowledged the OPEN). This
 * is the interface the peer plane calls them through; it lives with its
 * caller, and the data paths (datapath/, a folder above peer/) implement
 * it. One file per data path behind this table, listed in
 * datapath/datapath.c, which the daemon gives the plane (struct
 * kvsp_peer_opts's datapaths); the peer plane asks them in that order
 * which one carries a session's chunks (RDMA READ first; the stream last,
 * which carries every session).
 *
 * A data path speaks its own frame types on the session's connections
 * (stream: CHUNK and its payload; RDMA: RDMA_HELLO, CHUNK_READ, CHUNK_ACK),
 * keeps its own state per session (by session index, checked against the
 * session's id), and ends every transfer it took through the core
 * (kvsp_xfer_quiesced on the sending side; kvsp_chunk_land or
 * kvsp_chunk_discard on the receiving one). It never frees a slot itself:
 * a session's loss asks it to quiesce (its sockets are closed, its queue
 * pair moved to error), and only once it says nothing of it can touch our
 * memory does the core release the session's pins.
 *
 * A data path is a module: one file (or a folder's files) that defines
 * `const struct kvsp_dp_ops kvsp_dp_NAME` and declares in it all it brings:
 * its options (kvstaged's option table, --help and config file take them
 * from here), its frame types (the protocol's, or its own: peer/frame.h),
 * and its failpoints. The build lists the modules a kvstaged has
 * (proxy/meson.build's kvsp_datapaths; a test's kvstaged adds its own),
 * and the table it generates (datapath/table.c.in) is the order the plane
 * asks them in. A frame of a data path this proxy does not run is answered
 * by its type alone (peer/unowned.c).
 */
#ifndef KVSP_PEER_DATAPATH_H
#define KVSP_PEER_DATAPATH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "peer/wire.h"

struct kvsp;
struct kvsp_transport;
struct kvsp_xfer;
struct kvsp_frame;
struct kvsp_peer_opts;
struct kvsp_counter_def;
struct kvs_stats;
struct pconn;
struct pconn_table;
struct psess;
struct psess_table;

/* A frame type a data path reads: the protocol's (size 0: wire.h says
 * it), or its own, from KVSP_FRAME_OWN_MIN (frame.h), with its body's size
 * and KVSP_FRAME_* flags. */
struct kvsp_dp_frame_type {
	uint16_t type;
	uint32_t size;
	unsigned flags;
};

/* An option a data path takes: kvstaged's command line and config file
 * ("name = value") accept it, and --help shows it under the path's name. */
struct kvsp_dp_opt {
	const char *name; /* the long option, without "--" */
	const char *arg;  /* its argument as --help names it; NULL: a flag */
	const char *help; /* --help's text: lines of at most 50 columns, '\n' between */
	/* Takes val (NULL for a flag) into conf. Returns 0, or -EINVAL with
	 * *why saying what it wants ("want 0 to 255"). */
	int (*parse)(void *conf, const char *val, const char **why);
};

/* What every data path shares: the peer plane's parts it works with. */
struct kvsp_dp {
	const struct kvsp_dp_ops *ops;
	struct kvsp *p;
	struct kvsp_transport *t; /* the peer plane, as the core knows it */
	struct psess_table *sessions;
	struct pconn_table *conns;
	struct kvs_stats *st;
	struct kvsp_dp *const *dps; /* every data path of the plane, in order */
	const unsigned *ndps;
	const void *conf; /* its options' values (ops->conf_size bytes), or NULL */
	unsigned fp; /* its first failpoint's id: ops->failpoints[i] is fp + i (set before create) */
	/* Its ops->counters' values in the counter block, in their order (the
	 * plane registers them before create); NULL: it names none. */
	uint64_t *ctr;
};

/* A frame a data path has for a connection, and the payload after it. */
struct kvsp_dp_frame {
	uint16_t type;
	union kvs_wire_body body;
	const void *payload;
	uint32_t plen;
	struct kvsp_xfer *x; /* the payload's transfer */
};

struct kvsp_dp_ops {
	const char *name;
	const struct kvsp_dp_frame_type *frames; /* the frame types it reads; type 0 ends */
	const struct kvsp_dp_opt *opts;		 /* its options; name NULL ends; or NULL */
	size_t conf_size;			 /* its options' values, conf_init's defaults */
	void (*conf_init)(void *conf);
	/* Optional: its options together, and with the plane's (o). Returns 0,
	 * or -EINVAL with why said (kvstaged does not start). */
	int (*conf_check)(const void *conf, const struct kvsp_peer_opts *o, char *why, size_t len);
	const char *const *failpoints; /* its failpoints' names ("rdma.read"); NULL ends; or NULL */
	/* Makes this proxy's instance (a struct embedding *base first).
	 * Returns it; or NULL with *err 0 when this proxy has none (why says
	 * so, for the log), or *err < 0 when it was asked for and cannot be
	 * had (why says why: the proxy does not start). */
	struct kvsp_dp *(*create)(const struct kvsp_dp *base, const struct kvsp_peer_opts *o,
				  char *why, size_t len, int *err);
	void (*destroy)(struct kvsp_dp *dp);
	/* Session s came up (every stream joined). */
	void (*sess_up)(struct kvsp_dp *dp, struct psess *s);
	/* True if s's chunks go this way now. */
	bool (*carries)(const struct kvsp_dp *dp, const struct psess *s);
	/* Carries chunk x to s's peer, whose room is `room`. Returns 0 (it ends
	 * through the core), or -errno (nothing started). */
	int (*send)(struct kvsp_dp *dp, struct psess *s, struct kvsp_xfer *x,
		    const struct kvs_wire_room *room);
	/* Room (room, gen) aborts: what of it has not started is dropped, and
	 * what is being received no longer lands where it was going. */
	void (*cancel)(struct kvsp_dp *dp, uint32_t room, uint32_t gen);
	/* A frame of its types from s on c. Returns 0, or -errno (s is lost). */
	int (*on_frame)(struct kvsp_dp *dp, struct psess *s, struct pconn *c,
			const struct kvsp_frame *f);
	/* Optional: the payload its frame announced is all in (c->rx_*). */
	void (*payload_end)(struct kvsp_dp *dp, struct psess *s, struct pconn *c);
	/* Optional: a frame about s itself it owes on stream 0 (RDMA: its
	 * HELLO), into *out; out NULL: only whether. Said before any room's
	 * frame, so that a peer hears how to reach us before it hears that a
	 * room is open (and carries its first chunks the best way). */
	bool (*next_control)(struct kvsp_dp *dp, struct psess *s, struct kvsp_dp_frame *out);
	/* The next frame it owes on c (control on stream 0, then chunks),
	 * into *out; out NULL: only whether there is one. Returns true if so. */
	bool (*next_frame)(struct kvsp_dp *dp, struct psess *s, struct pconn *c,
			   struct kvsp_dp_frame *out);
	/* Optional: a frame of its with a payload left whole (x: its transfer). */
	void (*sent)(struct kvsp_dp *dp, struct psess *s, struct kvsp_xfer *x);
	/* s is lost and its sockets closed: its hardware must stop touching
	 * our slots for s. Returns true while that is still to happen. */
	bool (*sess_quiesce)(struct kvsp_dp *dp, struct psess *s);
	/* Optional: s's quiescence is overdue: make it stop now. */
	void (*sess_force)(struct kvsp_dp *dp, struct psess *s);
	/* s is ended: its state goes (no call into the core). */
	void (*sess_free)(struct kvsp_dp *dp, struct psess *s);
	/* Optional: every eighth of --peer-timeout (timeout_ns): a session whose
	 * peer owes this data path an answer longer than that is lost. */
	void (*tick)(struct kvsp_dp *dp, uint64_t now, uint64_t timeout_ns);
	/* Reaps completions. Returns KVSP_BUSY or KVSP_IDLE. */
	int (*poll)(struct kvsp_dp *dp);
	/* True while poll has work that needs no outside event. */
	bool (*pending)(const struct kvsp_dp *dp);
	/* Optional: an fd that wakes the loop for it (its device's completion
	 * channel), or -1; on_fd runs when it did. */
	int (*loop_fd)(const struct kvsp_dp *dp);
	void (*on_fd)(struct kvsp_dp *dp);
	/* Optional: the counters it keeps (core/counters.h; NULL-name
	 * terminated), published under these names while it exists. */
	const struct kvsp_counter_def *counters;
};

#endif
