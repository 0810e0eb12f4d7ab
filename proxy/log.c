/* SPDX-License-Identifier: MIT */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int kvsp_log_level = KVSP_LOG_INFO;

static const char *const names[] = { "error", "warn", "info", "debug" };

void kvsp_log(int lvl, const char *fmt, ...)
{
	if (lvl > kvsp_log_level)
		return;
	char buf[512];
	struct timespec ts;
	struct tm tm;
	clock_gettime(CLOCK_REALTIME, &ts);
	gmtime_r(&ts.tv_sec, &tm);
	int n = snprintf(buf, sizeof(buf), "%02d:%02d:%02d.%06ld kvstaged %s: ", tm.tm_hour,
			 tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000, names[lvl]);
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(buf + n, sizeof(buf) - (size_t)n - 1, fmt, ap);
	va_end(ap);
	strcat(buf, "\n");
	fputs(buf, stderr);
}

int kvsp_log_parse(const char *s)
{
	for (int i = 0; i < 4; i++)
		if (!strcmp(s, names[i]) || (s[0] == '0' + i && !s[1]))
			return i;
	return -1;
}
