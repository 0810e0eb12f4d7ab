/* SPDX-License-Identifier: MIT */
/* kvstaged: the proxy's shared context. One thread owns all of it. */
#ifndef KVSP_PROXY_H
#define KVSP_PROXY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "failpoint.h"
#include "layout.h"
#include "log.h"
#include "ring.h"
#include "slots.h"

enum { KVSP_IDLE = 0, KVSP_BUSY = 1 };
enum kvsp_huge { KVSP_HUGE_AUTO, KVSP_HUGE_ON, KVSP_HUGE_OFF };

#define KVSP_MAX_ALLOW 16

struct kvsp_config {
	const char *socket_path;
	uint32_t slot_count;
	uint64_t slot_size;
	enum kvsp_huge huge;
	bool lock;            /* mlock the pool (best effort unless required) */
	uid_t allow_uid[KVSP_MAX_ALLOW];
	gid_t allow_gid[KVSP_MAX_ALLOW];
	unsigned n_allow_uid, n_allow_gid;
	unsigned socket_mode;  /* the socket file's permission bits */
	gid_t socket_group;    /* the socket file's group */
	int log_level;
	bool failpoints;
	uint32_t max_rooms;    /* rooms open at once, proxy-wide */
	uint32_t client_rooms; /* room handles per client */
	uint32_t max_clients;
	uint32_t sq_count, cq_count;
	uint64_t room_timeout_ns; /* 0: rooms never time out */
	uint64_t shutdown_grace_ns;
	uint64_t spin_ns;         /* busy-poll this long after the last work, then sleep */
};

/* ------------------------------------------------------------- clients */

enum kvsp_handle_state {
	KVSP_H_FREE = 0,
	KVSP_H_OPEN,    /* its final event is still owed */
	KVSP_H_ENDED,   /* final posted; waiting for CLOSE */
	KVSP_H_CLOSING, /* CLOSE seen; freed when the final is posted */
};
enum kvsp_role { KVSP_RECV = 1, KVSP_SEND = 2 };

struct kvsp_handle {
	uint8_t state;
	uint8_t role;
	uint32_t room;
	uint32_t gen; /* the library's generation for it, from the open; events echo it */
	uint64_t user_data;
};

/* Lines a client can cause at will, each kind rate-limited apart. */
enum { KVSP_RL_TOKEN, KVSP_RL_KINDS };

struct kvsp_client {
	uint32_t id;    /* unique for the proxy's life; the owner in slot metadata */
	uint16_t idx;   /* in p->clients */
	int sock, efd, cmem_fd;
	pid_t pid;
	struct kvs_cshm *cshm; /* client-writable: copy before trusting */
	size_t cmem_size;
	struct kvs_lease *reply_leases;
	struct kvs_ring sq, cq;
	struct kvsp_handle *handles;
	uint32_t finals_owed; /* one cq entry reserved for each */
	bool kick;  /* on p->kicks: its eventfd is due a look */
	bool dying; /* being reclaimed: posts nothing more */
	struct kvsp_rl rl[KVSP_RL_KINDS];
};

/* ----------------------------------------------------------------- rooms */

enum kvsp_room_state {
	KVSP_ROOM_FREE = 0,
	KVSP_ROOM_OPEN,
	KVSP_ROOM_ABORTING, /* waiting for its transfers to quiesce */
	KVSP_ROOM_ENDED,    /* final events posted */
};

/* One end of a room: a client's handle. cid 0: nobody attached. */
struct kvsp_side {
	uint32_t cid;
	uint16_t cidx;
	uint16_t handle;
	uint64_t user_data;
};

struct kvsp_room {
	uint32_t gen;
	uint8_t state;
	uint8_t final_type; /* KVS_EV_* when ENDED */
	int32_t status;
	uint8_t token[16];
	uint64_t bytes;
	uint32_t nchunks, placed, inflight;
	uint32_t placed_head, inflight_head; /* slot lists through kvsp_slot_priv */
	uint32_t chunk0;                     /* slot holding chunk 0, once placed */
	struct kvsp_side recv, send;
	uint64_t *claimed_bits;
	uint64_t progress_ns;
	uint32_t lru_prev, lru_next; /* open rooms, oldest progress first */
	uint32_t next_free;
	struct kvsp_transport *xport;
};

/* What a transport captured when it took a chunk: the fence compares it
 * with the present before anything lands. */
struct kvsp_xfer {
	uint32_t slot, epoch;
	uint32_t room, room_gen;
	uint32_t chunk;
};

/* ----------------------------------------------------------------- proxy */

struct kvsp_admin;
struct kvsp_pending;

struct kvsp {
	struct kvsp_config cfg;
	/* memory */
	int pool_fd, ctrl_fd;
	uint8_t *pool;
	size_t pool_size;
	struct kvs_ctrl *ctrl;
	size_t ctrl_size;
	struct kvs_stats *stats;
	bool huge, locked;
	uint8_t sq_tmpl[KVS_PAGE], cq_tmpl[KVS_PAGE]; /* a fresh ring body's header */
	size_t tmpl_len;
	struct kvsp_slots slots;
	/* rooms */
	struct kvsp_room *rooms;
	uint64_t *bits_arena;
	uint32_t bits_words;
	uint32_t room_free_head, room_free_tail;
	uint32_t lru_head, lru_tail;
	uint32_t rooms_active; /* OPEN or ABORTING */
	uint8_t rnd[4096];
	unsigned rnd_used;
	/* clients */
	struct kvsp_client **clients;
	uint32_t next_cid;
	unsigned clients_hi; /* clients[] is empty from here up: the loop stops here */
	uint16_t *kicks; /* clients with kick set, each once: never more than max_clients */
	unsigned nkicks;
	/* transports */
	struct kvsp_transport *local;
	/* failpoints */
	struct kvsp_fp fp[KVSP_FP_COUNT];
	/* event loop */
	int epfd, listen_fd, wake_fd, lock_fd;
	int spare_fd;              /* given up to accept (and refuse) when out of fds */
	uint64_t sock_dev, sock_ino; /* our socket file: only it is ever unlinked */
	struct kvsp_pending *pending;
	uint32_t pending_ids;
	struct kvsp_admin *admins;
	uint64_t now_ns, next_tick_ns;
	volatile int term;     /* set from the signal handler */
	int terms_seen;
	bool draining, aborted_all;
	uint64_t drain_deadline_ns, drain_report_ns;
	struct kvsp_rl rl_refused, rl_timeout, rl_died, rl_full;
	uint64_t instance;
	uint64_t spin_ns;     /* the adaptive spin budget, from cfg.spin_ns up */
};

uint64_t kvsp_now_ns(void);

/* pool.c */
/* Refuses a pool that cannot fit in the memory left (RAM or cgroup). Returns 0, or -ENOMEM (logged). */
int kvsp_pool_fits(const struct kvsp_config *cfg);
int kvsp_pool_create(struct kvsp *p);
void kvsp_pool_destroy(struct kvsp *p);

/* rooms.c */
int kvsp_rooms_init(struct kvsp *p);
void kvsp_rooms_fini(struct kvsp *p);
int kvsp_room_open_recv(struct kvsp *p, struct kvsp_client *c, uint16_t h, uint64_t bytes,
			uint64_t user_data, struct kvs_desc_wire *desc);
int kvsp_room_open_send(struct kvsp *p, struct kvsp_client *c, uint16_t h,
			const struct kvs_desc_wire *desc, uint64_t user_data, uint64_t *bytes);
int kvsp_room_send(struct kvsp *p, struct kvsp_client *c, uint16_t h, const struct kvs_lease *l,
		   uint64_t offset, uint64_t len);
void kvsp_room_abort_from(struct kvsp *p, struct kvsp_client *c, uint16_t h, int status);
void kvsp_room_detach(struct kvsp *p, struct kvsp_client *c, uint16_t h, int status);
int kvsp_room_map(struct kvsp *p, struct kvsp_client *c, uint16_t h, struct kvs_lease *out);
int kvsp_lease_release(struct kvsp *p, struct kvsp_client *c, const struct kvs_lease *l);
void kvsp_slot_drop(struct kvsp *p, uint32_t slot);
void kvsp_xfer_done(struct kvsp *p, const struct kvsp_xfer *x, int status);
uint64_t kvsp_rooms_tick(struct kvsp *p);
void kvsp_rooms_abort_all(struct kvsp *p, int status);

/* clients.c */
/* A new client on sock. Returns it, or NULL with errno EUSERS (--max-clients reached) or why. */
struct kvsp_client *kvsp_client_new(struct kvsp *p, int sock, pid_t pid);
/* The client is gone: aborts its rooms, frees its slots (tombstones where pinned). */
void kvsp_client_reclaim(struct kvsp *p, struct kvsp_client *c);
/* kvsp_client_reclaim, then frees the client itself. */
void kvsp_client_destroy(struct kvsp *p, struct kvsp_client *c);
struct kvsp_client *kvsp_client_get(struct kvsp *p, uint16_t cidx, uint32_t cid);
void kvsp_client_final(struct kvsp *p, const struct kvsp_side *s, uint16_t type, int status,
		       uint64_t bytes, uint32_t slot, uint32_t epoch);
void kvsp_client_reply(struct kvsp *p, struct kvsp_client *c, uint32_t seq, int status);
void kvsp_client_reject(struct kvsp *p, struct kvsp_client *c, uint16_t h, int status,
			const struct kvs_sqe *q);
int kvsp_client_poll(struct kvsp *p, struct kvsp_client *c);
void kvsp_client_op(struct kvsp *p, struct kvsp_client *c, const struct kvs_sqe *q);
void kvsp_kicks_flush(struct kvsp *p);
void kvsp_count_reject(struct kvsp *p, int err);

/* listener.c: the socket, access control, accept and hello */
/* Checks that the socket's file can admit everyone the access rule admits; why says what not. Returns 0, or -EINVAL. */
int kvsp_access_check(const struct kvsp_config *cfg, char *why, size_t len);
/* Claims cfg.socket_path before anything costly: its directory, its lock, what is there now. Returns 0, or -errno (logged). */
int kvsp_socket_claim(struct kvsp *p);
/* Binds and listens on the claimed path with its mode and group. Returns 0, or -errno (logged). */
int kvsp_listener_open(struct kvsp *p);
/* Stops listening; unlinks the socket only if it is still the one we made. */
void kvsp_listener_close(struct kvsp *p);
int kvsp_listener_init(struct kvsp *p);
void kvsp_listener_fini(struct kvsp *p);
void kvsp_on_accept(struct kvsp *p);
void kvsp_on_hello(struct kvsp *p, unsigned i);
bool kvsp_pending_valid(const struct kvsp *p, unsigned i, uint32_t id);
/* Drops handshakes past their time. Returns the next deadline. */
uint64_t kvsp_pending_expire(struct kvsp *p);
/* Answers a connection with status and msg, then closes it. */
void kvsp_refuse(struct kvsp *p, int fd, int status, const char *msg);

/* admin.c: failpoints and counter barriers */
int kvsp_admin_init(struct kvsp *p);
void kvsp_admin_fini(struct kvsp *p);
void kvsp_admin_welcome(struct kvsp *p, int fd);
void kvsp_admin_event(struct kvsp *p, unsigned i, uint32_t events);
/* Answers the barriers that now hold. */
void kvsp_admin_poll(struct kvsp *p);

/* poller.c: the loop */
/* What an fd in the loop's epoll is: the top byte of its data. */
enum kvsp_ep { KVSP_EP_LISTEN = 1, KVSP_EP_WAKE, KVSP_EP_PENDING, KVSP_EP_CLIENT, KVSP_EP_ADMIN };

static inline uint64_t kvsp_ep_tag(unsigned type, unsigned idx, uint32_t id)
{
	return (uint64_t)type << 56 | (uint64_t)(idx & 0xffffff) << 32 | id;
}

/* Adds fd to the loop's epoll. Returns 0, or -errno. */
int kvsp_ep_add(struct kvsp *p, int fd, uint32_t events, uint64_t data);
/* Sets p up from cfg; with a socket path, claims it first. Returns 0, or -errno (logged). */
int kvsp_init(struct kvsp *p, const struct kvsp_config *cfg);
int kvsp_listen(struct kvsp *p);
int kvsp_run(struct kvsp *p);
void kvsp_fini(struct kvsp *p);

#endif
