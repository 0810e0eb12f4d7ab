/* SPDX-License-Identifier: MIT */
/*
 * The local mode's two halves: the parent (local.c) forks a receiver and a
 * sender per pair (local_clients.c); they meet through these shared records.
 */
#ifndef KVS_BENCH_LOCAL_H
#define KVS_BENCH_LOCAL_H

#include "bench.h"
#include "kvstage.h"
#include "report.h"

/* What a receiver sends its sender: the room and a sequence number that
 * names the room's canary. */
struct desc_msg {
	struct kvs_room_desc d;
	uint64_t seq;
};

/* One child's figures, in shared memory: the parent reads them once it is reaped. */
struct child_res {
	uint64_t p_bytes;	       /* progress since go (receivers) */
	uint64_t bytes, chunks, rooms; /* completed in the measured window */
	uint64_t errors;	       /* verify: chunks with a wrong byte */
	uint64_t t_last;	       /* last counted completion */
	int failed;
	char msg[256];
	struct hist h; /* receiver: room latency; sender: hand-off latency */
};

/* The measured window opens (t_meas) once every receiver is past t_warm
 * and has completed its first --rooms rooms: by then every slot in flight
 * has been written and read once, so first-touch costs (page faults where
 * a pool mapping is not populated at connect, cold caches and TLBs) stay
 * out of the figures. */
struct lshared {
	uint64_t t0, t_warm;
	uint64_t nwarm;	 /* receivers past their warm-up */
	uint64_t t_meas; /* the window's start; 0 until every receiver is warm */
	uint64_t target; /* bytes per pair with --bytes, else 0 */
	unsigned pairs;
	struct child_res rx[BENCH_MAX_PAIRS], tx[BENCH_MAX_PAIRS];
};

/* What a child needs to know about its point and pair. */
struct lctx {
	const struct bench_opts *o;
	const char *rx_sock, *tx_sock; /* the receivers' proxy, the senders' (one in local mode) */
	uint64_t chunk, room_bytes;
	unsigned room_chunks;
	struct lshared *sh;
	unsigned pair;
};

/* Where one point runs: the proxy the receivers attach to and the one the
 * senders do (the same in local mode), with the pids whose CPU is read. */
struct bench_ends {
	const char *rx_sock, *tx_sock;
	pid_t rx_cpu_pid, tx_cpu_pid; /* 0: n/a */
	bool tcp_calls; /* two proxies over tcp: their syscalls per chunk (local_point's) */
};

/* Forks the pairs, runs one point, fills pt (proxy_cpu: the senders'
 * proxy; proxy_rx_cpu: the receivers', when it is another). Returns 0, or 1. */
int local_measure(const struct bench_opts *o, const struct bench_ends *e, uint64_t chunk,
		  struct local_point *pt);

/* SIGINT and SIGTERM end the run between points (and a point early). */
void local_catch_signals(void);
/* True once one of them came. */
bool local_interrupted(void);

/* A receiver: connects, says ready on ready_wr, waits for go_rd to close,
 * keeps --rooms rooms open (descriptors to desc_wr), writes a byte to
 * done_wr when its last room is consumed. Returns the exit code. */
int local_receiver(struct lctx *x, int desc_wr, int ready_wr, int go_rd, int done_wr);
/* A sender: connects, says ready, waits for go, then opens, fills and sends
 * every room whose descriptor arrives on desc_rd, until EOF. Returns the exit code. */
int local_sender(struct lctx *x, int desc_rd, int ready_wr, int go_rd);

/* The table's first line, "kvstage-bench VERSION " title ", N rooms in flight ...", and the
 * summary; for local and tcp. */
void local_doc_begin(struct doc *d, const struct bench_opts *o, unsigned n, const char *title);
/* A local or tcp point's name, heading (its slots "pool"), sizes, window and counts. */
void local_point_counts(struct point *p, const struct local_point *lp, const char *pool);
/* The table's note on verified bytes. */
void local_point_notes(const struct bench_opts *o, struct point *p, const struct local_point *lp);

/* tcp.c: what a run over two proxies sets up once: the peer secret and,
 * with --netns, the namespaces. */
struct tcp_env {
	char dir[64]; /* holds the peer secret */
	char secret[128];
	char ns[2][32]; /* --netns: A's and B's; "" otherwise */
	const char *ipbin;
	const char *b_ip; /* where B listens, and the raw receiver */
};
/* Makes the secret (and the namespaces with --netns). Returns 0, or -1 after saying why;
 * tcp_env_fini in either case. */
int tcp_env_init(const struct bench_opts *o, struct tcp_env *e);
/* Removes what tcp_env_init made. */
void tcp_env_fini(struct tcp_env *e);
/* Starts B (listens, the receivers' proxy) and A (dials B, the senders'), tcp or verbs
 * (--rdma-device) as the data path, each asked for slots x chunk and holding at least need
 * chunks. Returns 0, or -1 after saying why (neither left running). */
int tcp_proxies_start(const struct bench_opts *o, const struct tcp_env *e, bool verbs,
		      uint64_t chunk, uint32_t slots, uint64_t need, struct bench_proxy *a,
		      struct bench_proxy *b);

#endif
