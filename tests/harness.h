/* SPDX-License-Identifier: MIT */
/*
 * Test harness: real kvstaged processes (killed in .fini, never holding the
 * test's stdout), child processes driven step by step over pipes, and
 * admin barriers. Nothing here orders events by time: waits have a
 * deadline only so that a broken build fails instead of hanging.
 */
#ifndef KVS_TEST_HARNESS_H
#define KVS_TEST_HARNESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "admin.h"
#include "kvstage.h"
#include "layout.h"

#define WAIT_MS 20000 /* failure guard for every barrier */

struct proxy {
	pid_t pid;
	int admin;		     /* admin connection, or -1 */
	const struct kvs_ctrl *ctrl; /* read-only control segment */
	size_t ctrl_len;
	char dir[64];
	char sock[128];
	char log[128];
	char netns[32]; /* "": the test's own network namespace */
	bool pidns; /* in a PID namespace of its own: every client's pid is 0 to it, as in a pod */
};

/* A proxy not yet started: its admin fd is -1, not 0, so stopping it closes
 * nothing (a zeroed struct would close fd 0, which is not stdin when the test
 * runs with stdin closed, as CI does). */
#define PROXY_INIT                    \
	{                             \
		.pid = 0, .admin = -1 \
	}

/* Starts bin (NULL: the normal kvstaged) with --socket, --failpoints and
 * args (NULL-terminated); returns once it serves. Aborts the test on failure. */
void proxy_start(struct proxy *px, const char *bin, const char *const *args);
/* As proxy_start (the normal kvstaged), inside network namespace netns (/run/netns/NAME). */
void proxy_start_in(struct proxy *px, const char *netns, const char *const *args);
/* As proxy_start, without --failpoints: no admin connection (px->admin is -1). */
void proxy_start_plain(struct proxy *px, const char *const *args);
/* Starts another proxy on px's socket path (after px died). */
void proxy_restart(struct proxy *px, const char *const *args);
/* Sends sig and reaps the proxy. Returns its wait status. */
int proxy_kill(struct proxy *px, int sig);
/* SIGSTOPs the proxy and returns once it is stopped, not just signalled. */
void proxy_freeze(struct proxy *px);
/* Kills (if alive) and cleans up; safe to call twice. */
void proxy_stop(struct proxy *px);
/* The vulnerable test-only build's path. */
const char *proxy_vulnerable_bin(void);
/* Reaps child pid (waitpid status in *status); if it has not exited within
 * WAIT_MS, kills it and returns -1 with errno ETIMEDOUT. Returns pid, or -1. */
pid_t reap(pid_t pid, int *status);
/* A binary of the build tree (tools/kvstage-stat, ...). */
const char *build_path(const char *rel);

/* Current value of a counter (statnames.h). */
uint64_t stat_get(struct proxy *px, const char *name);
/* Barrier: until counter name >= v (ge) or <= v. Asserts success. */
void stat_wait(struct proxy *px, const char *name, int ge, uint64_t v);
/* Barrier: every slot free, no room open, at most `clients` connected. */
void wait_idle(struct proxy *px, uint64_t clients);
/* Sets a failpoint; match NULL for all rooms. */
void fp_set(struct proxy *px, const char *name, const char *action, const uint64_t *match);
/* Barrier: failpoint hit at least hits times. */
void fp_wait(struct proxy *px, const char *name, uint64_t hits);
/* The published metadata of one slot. */
struct kvs_slot slot_pub(struct proxy *px, uint32_t slot);

/* Barrier: a sync op on c, answered only after every async op c sent before
 * it (send, abort, close) was processed. No assertion: children use it. */
void sync_barrier(kvs_client *c);
/* Connects, asserting success. */
kvs_client *connect_ok(struct proxy *px);
/* Waits for one event (WAIT_MS guard), asserting success. */
struct kvs_event wait_event(kvs_client *c);

/* A child process and two pipes: the parent steps it with chan_put/chan_get. */
struct child {
	pid_t pid;
	int to, from; /* parent's ends */
};
typedef int (*child_fn)(int rd, int wr, void *arg);
void child_start(struct child *ch, child_fn fn, void *arg);
/* Reaps the child; returns its exit code, or 128+signal. */
int child_wait(struct child *ch);
/* Whole-message pipe I/O; return 0, or -1 on EOF/error. */
int chan_put(int fd, const void *b, size_t n);
int chan_get(int fd, void *b, size_t n);

/* Runs argv, capturing stdout and stderr (NUL-terminated, truncated to cap). Returns the exit code. */
int run_cmd(const char *const *argv, char *out, size_t cap, char *err, size_t ecap);
/* Reads px's log so far into buf (NUL-terminated, truncated to cap); fails the test if it cannot. */
void proxy_log(const struct proxy *px, char *buf, size_t cap);
/* Returns how many times what occurs in px's log so far (its first MiB). */
unsigned proxy_log_count(const struct proxy *px, const char *what);

#endif
