/* SPDX-License-Identifier: MIT */
#ifndef KVSP_LOG_H
#define KVSP_LOG_H

#include <stdint.h>

enum { KVSP_LOG_ERR = 0, KVSP_LOG_WARN, KVSP_LOG_INFO, KVSP_LOG_DEBUG };

extern int kvsp_log_level;

/* Logs one line to stderr when lvl <= kvsp_log_level. */
void kvsp_log(int lvl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Parses "error|warn|info|debug" or 0..3. Returns the level, or -1. */
int kvsp_log_parse(const char *s);

#define LOG_ERR(...) kvsp_log(KVSP_LOG_ERR, __VA_ARGS__)
#define LOG_WARN(...) kvsp_log(KVSP_LOG_WARN, __VA_ARGS__)
#define LOG_INFO(...) kvsp_log(KVSP_LOG_INFO, __VA_ARGS__)
#define LOG_DEBUG(...)                                         \
	do {                                                   \
		if (kvsp_log_level >= KVSP_LOG_DEBUG)          \
			kvsp_log(KVSP_LOG_DEBUG, __VA_ARGS__); \
	} while (0)

/*
 * Lines a client or a peer can cause at will go through a rate limit: at
 * most KVSP_RL_BURST per KVSP_RL_WINDOW_NS from one source (a client and a
 * kind of line, or one kind proxy-wide). The rest are counted; the next
 * line logged, or kvsp_rl_flush once the window is over, says how many.
 */
#define KVSP_RL_BURST 5
#define KVSP_RL_WINDOW_NS 10000000000ull

struct kvsp_rl {
	uint64_t window_ns; /* start of the current window */
	uint32_t lines;	    /* logged in it */
	uint32_t held;	    /* kept back since the last line logged */
};

/* Logs one line through rl at now_ns, or counts it (and adds 1 to *suppressed). */
void kvsp_log_rl(struct kvsp_rl *rl, uint64_t now_ns, uint64_t *suppressed, int lvl,
		 const char *fmt, ...) __attribute__((format(printf, 5, 6)));
/* Once rl's window is over (or at once if force), logs how many lines it kept back, naming what. */
void kvsp_rl_flush(struct kvsp_rl *rl, uint64_t now_ns, int lvl, const char *what, int force);

#endif
