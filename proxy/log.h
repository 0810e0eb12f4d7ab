/* SPDX-License-Identifier: MIT */
#ifndef KVSP_LOG_H
#define KVSP_LOG_H

enum { KVSP_LOG_ERR = 0, KVSP_LOG_WARN, KVSP_LOG_INFO, KVSP_LOG_DEBUG };

extern int kvsp_log_level;

/* Logs one line to stderr when lvl <= kvsp_log_level. */
void kvsp_log(int lvl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Parses "error|warn|info|debug" or 0..3. Returns the level, or -1. */
int kvsp_log_parse(const char *s);

#define LOG_ERR(...) kvsp_log(KVSP_LOG_ERR, __VA_ARGS__)
#define LOG_WARN(...) kvsp_log(KVSP_LOG_WARN, __VA_ARGS__)
#define LOG_INFO(...) kvsp_log(KVSP_LOG_INFO, __VA_ARGS__)
#define LOG_DEBUG(...)                                                                     \
	do {                                                                               \
		if (kvsp_log_level >= KVSP_LOG_DEBUG)                                      \
			kvsp_log(KVSP_LOG_DEBUG, __VA_ARGS__);                             \
	} while (0)

#endif
