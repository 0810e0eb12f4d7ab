/* SPDX-License-Identifier: MIT */
/*
 * The service manager's readiness protocol (systemd's Type=notify): a few
 * datagrams in a process's life (READY=1 once serving, STOPPING=1 when the
 * drain starts), never on the data path. Without $NOTIFY_SOCKET (not under
 * systemd) nothing is formatted or sent. A build without libsystemd
 * (meson_options.txt) sends nothing, and says so once if one was asked for.
 */
#include "base/notify.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvs_build.h"
#if KVS_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

#include "base/log.h"

void kvsp_notify(const char *fmt, ...)
{
	const char *sock = getenv("NOTIFY_SOCKET");
	if (!sock || !*sock)
		return;
#if KVS_HAVE_SYSTEMD
	char msg[1024];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (n < 0)
		return;
	/* The environment stays: STOPPING=1 comes later from the same process. */
	int rc = sd_notify(0, msg);
	if (rc < 0)
		LOG_WARN("sd_notify to %s: %s", sock, strerror(-rc));
#else
	(void)fmt;
	static bool said;
	if (!said)
		LOG_WARN(
			"$NOTIFY_SOCKET is set, but this build has no systemd support "
			"(libsystemd-dev "
			"missing at build time): the service manager is not told when we are ready "
			"or stopping (a Type=notify unit times out; use Type=simple)");
	said = true;
#endif
}
