/* SPDX-License-Identifier: MIT */
/*
 * The shared-memory format the proxy and libkvstage agree on. Versioned by
 * KVS_ABI; every record holds indices, never pointers.
 *
 * Three kinds of memory cross the boundary:
 *  - the pool (slots' payload): read-write for everyone, never interpreted;
 *  - the control segment: written by the proxy only, sealed
 *    (F_SEAL_FUTURE_WRITE) so clients can map it read-only and nothing else;
 *  - a per-client region: the client's rings, request and reply areas.
 *    The client can write all of it, so the proxy copies what it reads
 *    from there before validating it, and keeps each ring's geometry in
 *    the sealed control segment (see ring.h).
 */
#ifndef KVS_SHM_LAYOUT_H
#define KVS_SHM_LAYOUT_H

#include <stdbool.h>
#include <stdint.h>
#include <stddef.h>
#include <assert.h>

/* 3: the 32-byte kvs_sqe; 4: the data paths' counters in a named block
 * (struct kvs_counter), out of struct kvs_stats */
#define KVS_ABI 4
#define KVS_MAGIC_CTRL 0x4b565343u  /* "KVSC" */
#define KVS_MAGIC_HELLO 0x4b565348u /* "KVSH" */
#define KVS_MAGIC_DESC 0x4b565344u  /* "KVSD" */
#define KVS_PAGE 4096u
#define KVS_CACHE_LINE 64u

#define KVS_ALIGN_UP(x, a) (((x) + (a)-1) / (a) * (a))

/* ---------------------------------------------------------------- slots */

enum kvs_slot_state {
	KVS_SLOT_FREE = 0,
	KVS_SLOT_LEASED,      /* owner may write it */
	KVS_SLOT_INFLIGHT,    /* a transport holds it (pins > 0) */
	KVS_SLOT_TOMBSTONE,   /* owner gone, transport still pinned: never reused until quiesced */
	KVS_SLOT_RECV_POSTED, /* a transport may write it for a receiving room */
	KVS_SLOT_RECV_FILLED, /* owner (a receiver) may read it */
	KVS_SLOT_NSTATES,
};

/* One slot's published metadata: 16 bytes, written by the proxy only. */
struct kvs_slot {
	uint32_t epoch; /* bumped every time the slot changes owner */
	uint8_t state;	/* enum kvs_slot_state */
	uint8_t rsvd;
	uint16_t pins;	/* transport operations that may still touch it */
	uint32_t owner; /* client id, 0 = none */
	uint32_t room;	/* room index + 1 while a room holds it, else 0 */
};
static_assert(sizeof(struct kvs_slot) == 16, "slot metadata is 16 bytes");

/* Epochs start at a random base per proxy instance and wrap: compare them
 * as serial numbers. True when epoch a comes after b. */
#define KVS_EPOCH_AFTER(a, b) ((int32_t)((uint32_t)(a) - (uint32_t)(b)) > 0)

/* ------------------------------------------------------- control segment */

#define KVS_CTRL_HUGEPAGES 0x1u
#define KVS_CTRL_LOCKED 0x2u
#define KVS_CTRL_FAILPOINTS 0x4u
/* Parts the proxy was built without (meson_options.txt); an older proxy
 * publishes none of these bits, and has every part. */
#define KVS_CTRL_WITHOUT_VERBS 0x8u    /* no RDMA data path */
#define KVS_CTRL_WITHOUT_METRICS 0x10u /* no --metrics-listen */
#define KVS_CTRL_WITHOUT_SYSTEMD 0x20u /* no sd_notify */
#define KVS_CTRL_WITHOUT_ACL 0x40u     /* a peer secret with an ACL is refused, not judged */

/* Counters the proxy publishes (kvstage-stat reads them): the core's, the
 * peer plane's sessions and frames, the trace's. A data path's or the
 * socket layer's counters are named records in the counter block
 * (struct kvs_counter), registered by whoever counts them. */
struct kvs_stats {
	uint64_t slots[KVS_SLOT_NSTATES]; /* slots in each state, right now */
	uint64_t rooms_open;		  /* rooms not yet freed */
	uint64_t rooms_done, rooms_aborted, rooms_failed, rooms_timed_out;
	uint64_t clients, clients_total, clients_died, clients_refused;
	uint64_t clients_closed; /* said goodbye (kvs_close); clients_died: hung up without */
	uint64_t rej_stale, rej_perm, rej_busy, rej_inval, rej_token, rej_nobufs;
	uint64_t ops, events, events_dropped;
	uint64_t chunks_moved, bytes_moved;
	uint64_t tombstones_reaped;
	uint64_t sleeps;
	uint64_t draining;	   /* 1 once SIGTERM was seen */
	uint64_t log_suppressed;   /* log lines the rate limits kept back */
	uint64_t chunks_discarded; /* late or refused chunks the fence kept out */
	/* peers (the peer plane) */
	uint64_t peer_sessions;	   /* up now */
	uint64_t peer_lost;	   /* sessions lost: dropped, cut, silent past --peer-timeout */
	uint64_t peer_auth_failed; /* connections that did not prove the secret in time */
	uint64_t peer_refused; /* connections refused, or unproven ones dropped, for want of room */
	uint64_t peer_frames_refused; /* malformed, forged or replayed frames (connection dropped) */
	uint64_t peer_frames_ignored; /* authentic frames naming no room of ours (stale, wrong token) */
	uint64_t peer_crc_errors;     /* chunks whose payload failed --tcp-checksum */
	uint64_t peer_byes;	      /* peers that said they are draining */
	uint64_t peer_timeouts;	      /* sessions and handshakes lost at a deadline */
	uint64_t peer_evicted;	   /* joining or idle sessions dropped to make room for a new one */
	uint64_t peer_closed;	   /* sessions closed quietly: idle, or the peer restarted */
	uint64_t peer_pings;	   /* PINGs sent: a quiet session's keep-alive */
	uint64_t peer_epoll_waits; /* the peer plane's epoll_wait (kvstage-bench tcp: per chunk) */
	uint64_t peer_epoll_ctls;  /* ... and epoll_ctl (a full socket's EPOLLOUT, a pause) */
	/* The lifecycle trace (--trace-file): written by its writer thread,
	 * dropped by the loop (its ring full) or the writer (the sink failed),
	 * a locked add each. */
	uint64_t trace_written; /* lines written */
	uint64_t trace_dropped; /* records dropped, never waited for */
};

/* One named counter of the block: what it is called, in the block's
 * records; its value is the block's value[] at the same index, so that a
 * counter's owner adds to values[i] of one array, as to a struct's fields.
 * Names are NUL-terminated (the proxy cuts nothing: a name that does not
 * fit is refused when it is registered). */
enum kvs_counter_kind { KVS_COUNTER = 0, KVS_GAUGE = 1 };
struct kvs_counter {
	uint32_t kind; /* enum kvs_counter_kind */
	uint32_t rsvd;
	char name[32];	 /* kvstage-stat's, --json's and admin barriers' name: "rdma_reads" */
	char metric[64]; /* its Prometheus name: "kvstage_rdma_reads_total" */
	char help[152];	 /* its Prometheus help: one sentence */
};
static_assert(sizeof(struct kvs_counter) == 256, "a counter record is 256 bytes");

/* The counter block, at ctrl's counters_off: counter_count records are
 * published (the rest are zero). Its capacity is the ABI's: a reader
 * steps nothing by a size the proxy says. */
#define KVS_COUNTERS_MAX 64
struct kvs_counters {
	uint64_t value[KVS_COUNTERS_MAX];
	struct kvs_counter rec[KVS_COUNTERS_MAX];
};

/* The proxy is the counters' only writer, so a plain load and store (no
 * locked read-modify-write) is enough; readers see whole values. */
#define KVS_STAT_ADD(f, v) \
	__atomic_store_n(&(f), __atomic_load_n(&(f), __ATOMIC_RELAXED) + (v), __ATOMIC_RELAXED)
#define KVS_STAT_SUB(f, v) \
	__atomic_store_n(&(f), __atomic_load_n(&(f), __ATOMIC_RELAXED) - (v), __ATOMIC_RELAXED)

/* One session with another proxy (the tcp transport), as kvstage-stat shows it. */
enum kvs_peer_state { KVS_PEER_FREE = 0, KVS_PEER_JOINING, KVS_PEER_UP };
struct kvs_peer {
	char endpoint[64]; /* whom we dialed, or "accepted" */
	uint32_t state;	   /* enum kvs_peer_state */
	uint32_t streams;
	uint64_t instance; /* the peer's */
	uint64_t bytes_tx, bytes_rx;
	uint64_t chunks_sunk;	/* its chunks the fence kept out */
	uint32_t flags;		/* KVS_PEER_* */
	uint32_t reads_refused; /* its READs our NIC refused */
};
#define KVS_PEER_RDMA 1u	/* chunks from us to it go by its RDMA READ */
#define KVS_PEER_KEYS_WINDOW 2u /* ... each under a memory window's key */
#define KVS_PEER_KEYS_REGION \
	4u /* ... each under a region's key; with _WINDOW: the window is
				 * over a region of the chunk's own (the device does not keep
				 * a READ in a window's bytes) */
#define KVS_MAX_PEERS 64

/* One client attached to the proxy, as kvstage-stat shows it: row i is the
 * client at index i (kvstaged --max-clients rows). The proxy is the only
 * writer and never reads a row back: every field is one relaxed store of a
 * value it keeps itself. A client's id is stored last when it arrives
 * (release) and zeroed first when it leaves, so a reader that loads the id
 * (acquire), copies the row, fences (acquire) and finds the same non-zero
 * id again has that one client's values. What it holds is not here: the
 * slot table's owner field says whose each slot is. Readers step rows by
 * ctrl's client_row_size, so fields can be appended. */
struct kvs_client_row {
	uint32_t id;	   /* the client's id (the owner in struct kvs_slot); 0: none */
	int32_t pid;	   /* SO_PEERCRED, in the proxy's pid namespace */
	uint32_t uid, gid; /* SO_PEERCRED */
	uint64_t since_ns; /* CLOCK_REALTIME when it attached */
	uint64_t ops;	   /* submissions taken from its ring */
	uint64_t rejects;  /* ops refused (REJECTED events and failed sync replies) */
	uint64_t rooms;	   /* rooms it is in whose final event it is still owed */
	uint64_t rooms_done, rooms_aborted, rooms_failed; /* final events it was sent, by kind */
	uint64_t chunks_sent, bytes_sent;		  /* SENDs taken into an open room */
	uint64_t chunks_recv, bytes_recv; /* rooms it received whole, counted at RECV_DONE */
	uint64_t rsvd[3];
};
static_assert(sizeof(struct kvs_client_row) == 128, "a client row is two cache lines");

/* Copies the proxy's row s into d (readers: kvstage-stat, the metrics page).
 * Returns false if it holds no client, or if its client changed while it
 * was copied (the proxy writes the id last when a client arrives, first
 * when it leaves). */
static inline bool kvs_client_row_read(const struct kvs_client_row *s, struct kvs_client_row *d)
{
#define KVS_ROW_LD(x) __atomic_load_n(&(x), __ATOMIC_RELAXED)
	uint32_t id = __atomic_load_n(&s->id, __ATOMIC_ACQUIRE);
	if (!id)
		return false;
	*d = (struct kvs_client_row){
		.id = id,
		.pid = KVS_ROW_LD(s->pid),
		.uid = KVS_ROW_LD(s->uid),
		.gid = KVS_ROW_LD(s->gid),
		.since_ns = KVS_ROW_LD(s->since_ns),
		.ops = KVS_ROW_LD(s->ops),
		.rejects = KVS_ROW_LD(s->rejects),
		.rooms = KVS_ROW_LD(s->rooms),
		.rooms_done = KVS_ROW_LD(s->rooms_done),
		.rooms_aborted = KVS_ROW_LD(s->rooms_aborted),
		.rooms_failed = KVS_ROW_LD(s->rooms_failed),
		.chunks_sent = KVS_ROW_LD(s->chunks_sent),
		.bytes_sent = KVS_ROW_LD(s->bytes_sent),
		.chunks_recv = KVS_ROW_LD(s->chunks_recv),
		.bytes_recv = KVS_ROW_LD(s->bytes_recv),
	};
	/* Acquire: the copy above is done before the id is looked at again. */
	__atomic_thread_fence(__ATOMIC_ACQUIRE);
	return KVS_ROW_LD(s->id) == id;
#undef KVS_ROW_LD
}

struct kvs_ctrl {
	uint32_t magic;	   /* KVS_MAGIC_CTRL */
	uint32_t abi;	   /* KVS_ABI */
	uint64_t instance; /* random per proxy start: the proxy's generation */
	uint64_t slot_size;
	uint64_t pool_size;
	uint32_t slot_count;
	uint32_t flags; /* KVS_CTRL_* */
	uint32_t max_rooms;
	uint32_t client_rooms; /* handles per client */
	uint32_t sq_count, cq_count;
	uint64_t slots_off;		   /* struct kvs_slot[slot_count] */
	uint64_t sq_geom_off, cq_geom_off; /* pages whose tail holds the rings' geometry */
	int32_t proxy_pid;
	uint32_t ring_layout; /* kvs_ring_layout() of the proxy's build (ring.h) */
	uint64_t started_ns;  /* CLOCK_REALTIME */
	uint64_t peers_off;   /* struct kvs_peer[peer_count]: sessions with other proxies */
	uint32_t peer_count;
	/* Records of the counter block published (release; the proxy registers
	 * them all before it takes a connection, and never removes one). */
	uint32_t counter_count;
	/* struct kvs_client_row[client_count], client_row_size bytes apart. */
	uint64_t clients_off;
	uint32_t client_count;
	uint32_t client_row_size;

	/* Set while the proxy sleeps on its wake eventfd: clients kick it after
	 * enqueueing. Own cache line: it flips on every sleep. */
	uint32_t sleeping __attribute__((aligned(KVS_CACHE_LINE)));
	/* Where the counter block lies (struct kvs_counters). In sleeping's
	 * line, the header's first being full: written once before the loop
	 * runs, and read once a walk. */
	uint64_t counters_off;

	struct kvs_stats stats __attribute__((aligned(KVS_CACHE_LINE)));
};
/* Where ABI 2 put them: a reader of another ABI still finds magic and abi
 * (and refuses the segment) and nothing else moved with ABI 4. */
static_assert(offsetof(struct kvs_ctrl, sleeping) == 128, "ctrl header is two cache lines");
static_assert(offsetof(struct kvs_ctrl, stats) == 192, "stats stay where ABI 2 put them");

/* ---------------------------------------------------------------- rings */

/* Submission record, client -> proxy. 32 bytes, two to a cache line: no record straddles two, and each SEND
 * copies 8 words into the ring and out of it, not 10. The lease (SEND,
 * RELEASE) and user_data (the opens) share their place: no op takes both. */
struct kvs_sqe {
	uint8_t op;	 /* enum kvs_op */
	uint8_t readers; /* RECV_OPEN: readers of a shared room (0 or 1: not shared) */
	uint16_t handle; /* the client's room handle */
	uint32_t gen;	 /* the handle's generation in the library: opens set it,
			  * events about the handle echo it */
	union {
		struct {
			uint32_t slot; /* SEND, RELEASE: the lease */
			uint32_t epoch;
		};
		uint64_t arg2; /* RECV_OPEN, SEND_OPEN, RECV_JOIN: user_data */
	};
	uint64_t arg; /* ACQUIRE: n; SEND: offset; RECV_OPEN: bytes */
	uint32_t seq; /* sync ops: echoed in the reply */
	uint32_t len; /* SEND: the chunk's bytes */
};
static_assert(sizeof(struct kvs_sqe) == 32, "sqe is 32 bytes");

enum kvs_op {
	KVS_OP_NOP = 0,
	KVS_OP_ACQUIRE,	  /* sync: arg leases into the reply area */
	KVS_OP_RELEASE,	  /* sync */
	KVS_OP_RECV_OPEN, /* sync: descriptor into the reply */
	KVS_OP_SEND_OPEN, /* sync: descriptor from the request area */
	KVS_OP_SEND,	  /* async: errors come back as REJECTED events */
	KVS_OP_ABORT,	  /* async */
	KVS_OP_CLOSE,	  /* async */
	KVS_OP_ROOM_MAP,  /* sync: the room's chunk leases into the reply area */
	KVS_OP_RECV_JOIN, /* sync: descriptor from the request area */
	KVS_OP_MAX,
};

/* Completion record, proxy -> client: events only. 40 bytes. */
struct kvs_cqe {
	uint16_t type;	 /* KVS_EV_* */
	uint16_t handle; /* room handle, or KVS_NO_HANDLE */
	int32_t status;
	uint64_t user_data;
	uint64_t bytes;
	uint32_t slot, epoch;
	uint32_t gen; /* the handle's generation: a final, the open's; a
			  * rejection, the refused op's */
	uint32_t rsvd;
};
static_assert(sizeof(struct kvs_cqe) == 40, "cqe is 40 bytes");
#define KVS_NO_HANDLE 0xffffu

/* --------------------------------------------------------- client region */

/* Page 0 of the per-client region. The client can write all of it. */
struct kvs_cshm {
	/* client -> proxy hint: set while the client blocks on its eventfd */
	uint32_t waiting;
	uint32_t rsvd0;
	/* proxy -> client: the answer to the last sync op */
	struct {
		uint32_t seq; /* store-released last */
		int32_t status;
		uint32_t n; /* leases written to the reply area */
		uint32_t handle;
		uint64_t bytes;
		uint64_t slot_size;
		uint8_t desc[128];
	} reply __attribute__((aligned(KVS_CACHE_LINE)));
	/* client -> proxy: arguments too big for an sqe (copied, then checked) */
	uint8_t request[128] __attribute__((aligned(KVS_CACHE_LINE)));
};
static_assert(sizeof(struct kvs_cshm) <= KVS_PAGE, "client page fits");

/* Offsets inside the client region; both sides compute them from the counts. */
struct kvs_cmem_layout {
	size_t reply_off;      /* struct kvs_lease[slot_count] */
	size_t sq_off, cq_off; /* ring bodies (from rte_ring.prod on) */
	size_t size;
};

/* ------------------------------------------------------------ handshake */

enum kvs_hello_kind { KVS_HELLO_CLIENT = 1, KVS_HELLO_ADMIN = 2, KVS_HELLO_STAT = 3 };

/* A client's last message, sent by kvs_close: a hang-up without it is a
 * death (counted apart). Same shape as struct kvs_hello. */
#define KVS_MAGIC_BYE 0x4b565342u /* "KVSB" */

struct kvs_hello {
	uint32_t magic; /* KVS_MAGIC_HELLO */
	uint32_t abi;
	uint32_t kind;	      /* enum kvs_hello_kind */
	uint32_t ring_layout; /* CLIENT: kvs_ring_layout() of the library's build (ring.h) */
};

/* Reply to hello; fds follow with SCM_RIGHTS: CLIENT gets pool, ctrl,
 * client region, proxy wake eventfd, client eventfd; STAT gets ctrl. */
struct kvs_welcome {
	uint32_t magic;
	uint32_t abi;
	int32_t status; /* 0 or -errno; no fds when nonzero */
	uint32_t client_id;
	uint64_t instance;
	uint64_t ctrl_size;
	uint64_t cmem_size;
	char msg[96]; /* why, when status != 0 */
};
#define KVS_WELCOME_NFDS 5

/* -------------------------------------------------------- room descriptor */

/* Wire form of struct kvs_room_desc: 128 bytes, little-endian. */
struct kvs_desc_wire {
	uint32_t magic;	  /* KVS_MAGIC_DESC */
	uint16_t version; /* 1 */
	uint16_t flags;
	uint64_t instance; /* the receiving proxy */
	uint32_t room;	   /* room index there */
	uint32_t gen;	   /* room generation */
	uint8_t token[16]; /* getrandom, per room */
	uint64_t bytes;
	uint64_t slot_size; /* chunk size of the receiving pool */
	char endpoint[64];  /* receiving proxy's transport endpoint, "" if local only */
	uint8_t rsvd[8];
};
static_assert(sizeof(struct kvs_desc_wire) == 128, "descriptor is 128 bytes");

#endif
