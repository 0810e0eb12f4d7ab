/* SPDX-License-Identifier: MIT */
#include "base/log.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "layout.h"

int kvsp_log_level = KVSP_LOG_INFO;

static const char *const names[] = { "error", "warn", "info", "debug" };
static const int syslog_prio[] = { 3, 4, 6, 7 }; /* LOG_ERR, LOG_WARNING, LOG_INFO, LOG_DEBUG */

/* True when stderr is systemd's journal stream: $JOURNAL_STREAM names its
 * device and inode (systemd.exec(5)). The journal then reads a "<N>"
 * priority prefix and stamps the time itself. */
static bool to_journal(void)
{
	static int known = -1;
	if (known < 0) {
		unsigned long long dev, ino;
		const char *e = getenv("JOURNAL_STREAM");
		struct stat st;
		known = e && sscanf(e, "%llu:%llu", &dev, &ino) == 2 && fstat(2, &st) == 0 &&
			(unsigned long long)st.st_dev == dev &&
			(unsigned long long)st.st_ino == ino;
	}
	return known;
}

static void vlog(int lvl, const char *suffix, const char *fmt, va_list ap)
{
	char buf[640];
	int n;
	if (to_journal()) {
		n = snprintf(buf, sizeof(buf), "<%d>%s: ", syslog_prio[lvl], names[lvl]);
	} else {
		struct timespec ts;
		struct tm tm;
		clock_gettime(CLOCK_REALTIME, &ts);
		gmtime_r(&ts.tv_sec, &tm);
		n = snprintf(buf, sizeof(buf), "%02d:%02d:%02d.%06ld kvstaged %s: ", tm.tm_hour,
			     tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000, names[lvl]);
	}
	vsnprintf(buf + n, sizeof(buf) - (size_t)n - 128, fmt, ap);
	size_t len = strlen(buf);
	snprintf(buf + len, sizeof(buf) - len, "%s\n", suffix);
	fputs(buf, stderr);
}

void kvsp_log(int lvl, const char *fmt, ...)
{
	if (lvl > kvsp_log_level)
		return;
	va_list ap;
	va_start(ap, fmt);
	vlog(lvl, "", fmt, ap);
	va_end(ap);
}

void kvsp_log_rl(struct kvsp_rl *rl, uint64_t now_ns, uint64_t *suppressed, int lvl,
		 const char *fmt, ...)
{
	if (lvl > kvsp_log_level)
		return;
	if (now_ns - rl->window_ns >= KVSP_RL_WINDOW_NS) {
		rl->window_ns = now_ns;
		rl->lines = 0;
	}
	if (rl->lines >= KVSP_RL_BURST) {
		rl->held++;
		KVS_STAT_ADD(*suppressed, 1);
		return;
	}
	rl->lines++;
	char suffix[96] = "";
	if (rl->held)
		snprintf(suffix, sizeof(suffix), " (and %u more like it before, not logged)",
			 rl->held);
	rl->held = 0;
	va_list ap;
	va_start(ap, fmt);
	vlog(lvl, suffix, fmt, ap);
	va_end(ap);
}

void kvsp_rl_flush(struct kvsp_rl *rl, uint64_t now_ns, int lvl, const char *what, int force)
{
	if (!rl->held || (!force && now_ns - rl->window_ns < KVSP_RL_WINDOW_NS))
		return;
	kvsp_log(lvl, "%s: %u more lines not logged (rate limit: %u per %llu s)", what, rl->held,
		 KVSP_RL_BURST, KVSP_RL_WINDOW_NS / 1000000000ull);
	rl->held = 0;
	rl->window_ns = now_ns;
	rl->lines = 0;
}

int kvsp_log_parse(const char *s)
{
	for (int i = 0; i < 4; i++)
		if (!strcmp(s, names[i]) || (s[0] == '0' + i && !s[1]))
			return i;
	return -1;
}
