/* SPDX-License-Identifier: MIT */
/*
 * The admin protocol: failpoints, driven from outside the proxy (kvstage-ctl,
 * tests). Only a proxy started with --failpoints accepts it. Internal: not
 * part of the public client API.
 */
#ifndef KVS_SHM_ADMIN_H
#define KVS_SHM_ADMIN_H

#include <stddef.h>
#include <stdint.h>

enum kvs_admin_op {
	KVS_ADMIN_FP_SET = 1, /* set a failpoint's action */
	KVS_ADMIN_FP_WAIT,    /* answer once the failpoint has been hit `hits` times */
	KVS_ADMIN_FP_GET,     /* answer with its hit count now */
	KVS_ADMIN_STAT_WAIT,  /* answer once counter `name` is >= (action 0) or <= (1) `hits` */
	KVS_ADMIN_FP_RELEASE, /* let go of what the failpoint holds for matching rooms, keep holding others */
};

enum kvs_fp_action {
	KVS_FP_OFF = 0, /* pass; anything it holds is let go */
	KVS_FP_PAUSE,	/* hold whatever reaches it until set off */
	KVS_FP_FAIL,	/* fail whatever reaches it with err */
};

/* The proxy's own failpoints, by the names the admin protocol gives them
 * (the data paths name theirs in their module: peer/datapath.h):
 * X(ID, "name"), in the order the proxy numbers them (KVSP_FP_ID in
 * core/failpoint.h). */
#define KVS_FAILPOINTS(X)                                                                        \
	X(LOCAL_QUIESCE, "local.quiesce") /* local transport: hold or fail a chunk's hand-off */ \
	X(ACQUIRE, "acquire")		  /* fail acquires */                                    \
	X(RECV_OPEN, "recv_open")	  /* fail receiving-room opens */                        \
	X(TCP_PAYLOAD, "tcp.payload")	  /* tcp: hold a chunk's payload after its header */     \
	X(TCP_ZC_NOTIFY, "tcp.zc_notify") /* tcp: leave the kernel's zerocopy answers unread */  \
	X(PEER_ACCEPT,                                                                           \
	  "peer.accept") /* close an accepted peer connection unread (match: its number) */      \
	X(TRACE_WRITE, "trace.write") /* the trace's writer takes nothing from its ring (pause) */

#define KVS_FP_ONE_MORE(id, name) +1
enum { KVS_FP_COUNT = 0 KVS_FAILPOINTS(KVS_FP_ONE_MORE) };
#undef KVS_FP_ONE_MORE

/* The failpoints' names, in that order. */
extern const char *const kvs_fp_names[KVS_FP_COUNT];
/* Returns name's index in kvs_fp_names, or -ENOENT. */
int kvs_fp_find(const char *name);

struct kvs_admin_req {
	uint32_t op;	 /* enum kvs_admin_op */
	uint32_t action; /* enum kvs_fp_action */
	int32_t err;	 /* FAIL: the -errno to fail with */
	uint32_t match_set;
	uint64_t match; /* only rooms whose user_data (either side), masked, equals this */
	uint64_t hits;
	char name[32];
	uint64_t mask; /* applied to user_data before comparing; 0 means all bits */
};

struct kvs_admin_rep {
	int32_t status;
	uint32_t rsvd;
	uint64_t hits;
	char msg[96];
};

/* Set, release and get give -ETIMEDOUT if the proxy has not answered in 30 s;
 * after any -ETIMEDOUT the connection is out of step: close it. */

/* Connects to the proxy as an admin. Returns the fd, or -errno. */
int kvs_admin_connect(const char *socket_path);
/* Sets failpoint name to action ("off", "pause", "fail[=ERRNO]"), for rooms whose user_data is *match (NULL: all). Returns 0, or -errno. */
int kvs_admin_fp_set(int fd, const char *name, const char *action, const uint64_t *match);
/* As kvs_admin_fp_set, matching rooms whose (user_data & mask) == match. Returns 0, or -errno. */
int kvs_admin_fp_set_mask(int fd, const char *name, const char *action, uint64_t match,
			  uint64_t mask);
/* Lets go of what failpoint name holds for rooms whose (user_data & mask) == match (mask 0: all bits); hits reports how many. Returns 0, or -errno. */
int kvs_admin_fp_release(int fd, const char *name, uint64_t match, uint64_t mask,
			 uint64_t *released);
/* Waits until failpoint name has been hit hits times (timeout_ms < 0: for ever). Returns 0, -ETIMEDOUT, or -errno. */
int kvs_admin_fp_wait(int fd, const char *name, uint64_t hits, int timeout_ms);
/* Reads failpoint name's hit count into *hits. Returns 0, or -errno. */
int kvs_admin_fp_get(int fd, const char *name, uint64_t *hits);
/* Waits until counter name (see statnames.h) is >= value (ge) or <= value. Returns 0, -ETIMEDOUT, or -errno. */
int kvs_admin_stat_wait(int fd, const char *name, int ge, uint64_t value, int timeout_ms);
/* The message of the last failed call on this thread. */
const char *kvs_admin_msg(void);

struct kvs_ctrl;
/* Maps the proxy's control segment read-only (kvstage-stat, tests). Returns 0, or
 * -EBADMSG (what answered handed over a segment smaller than it said), -errno. */
int kvs_stat_map(const char *socket_path, const struct kvs_ctrl **ctrl, size_t *len);

#endif
