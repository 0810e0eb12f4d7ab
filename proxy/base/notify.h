/* SPDX-License-Identifier: MIT */
#ifndef KVSP_NOTIFY_H
#define KVSP_NOTIFY_H

/* Tells the service manager fmt's "KEY=value" lines (sd_notify(3)); a no-op unless $NOTIFY_SOCKET is set. */
void kvsp_notify(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
