/* SPDX-License-Identifier: MIT */
/*
 * The service manager's side of Type=notify, without systemd: the test
 * binds the datagram socket systemd would, starts kvstaged with
 * $NOTIFY_SOCKET naming it, and reads what arrives. READY=1 (with its
 * STATUS) once kvstaged serves, from kvstaged's own pid (NotifyAccess=main
 * accepts nothing else); STOPPING=1 (with STATUS=draining) when SIGTERM
 * starts the drain, which then ends in exit 0. Without $NOTIFY_SOCKET the
 * other suites run kvstaged as always.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

static struct proxy px = PROXY_INIT;
static int nfd = -1;
static char dir[64], path[96];

static void setup(void)
{
	strcpy(dir, "/tmp/kvstage-notify.XXXXXX");
	cr_assert_not_null(mkdtemp(dir));
	snprintf(path, sizeof(path), "%s/notify", dir);
	nfd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	cr_assert_geq(nfd, 0);
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	cr_assert_eq(bind(nfd, (struct sockaddr *)&sa, sizeof(sa)), 0, "bind %s: %s", path,
		     strerror(errno));
	/* The sender's credentials come with every datagram, as systemd asks. */
	int one = 1;
	cr_assert_eq(setsockopt(nfd, SOL_SOCKET, SO_PASSCRED, &one, sizeof(one)), 0);
}

static void teardown(void)
{
	proxy_stop(&px);
	unsetenv("NOTIFY_SOCKET");
	if (nfd >= 0)
		close(nfd);
	nfd = -1;
	if (path[0])
		unlink(path);
	if (dir[0])
		rmdir(dir);
	dir[0] = path[0] = 0;
}

TestSuite(notify, .init = setup, .fini = teardown, .timeout = 60);

/* One datagram (NUL-terminated) and its sender's pid; fails after WAIT_MS. */
static void notify_read(char *buf, size_t cap, pid_t *from)
{
	struct pollfd p = { nfd, POLLIN, 0 };
	cr_assert_eq(poll(&p, 1, WAIT_MS), 1, "no notification within %d ms", WAIT_MS);
	union {
		struct cmsghdr h;
		char b[CMSG_SPACE(sizeof(struct ucred))];
	} ctl;
	struct iovec iov = { buf, cap - 1 };
	struct msghdr m = { .msg_iov = &iov,
			    .msg_iovlen = 1,
			    .msg_control = &ctl,
			    .msg_controllen = sizeof(ctl) };
	ssize_t n = recvmsg(nfd, &m, MSG_DONTWAIT);
	cr_assert_geq(n, 0, "recvmsg: %s", strerror(errno));
	buf[n] = 0;
	*from = 0;
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
		if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_CREDENTIALS) {
			struct ucred u;
			memcpy(&u, CMSG_DATA(c), sizeof(u));
			*from = u.pid;
		}
}

/* The value of KEY= on a line of msg, or NULL. */
static const char *field(const char *msg, const char *key, char *out, size_t cap)
{
	size_t k = strlen(key);
	for (const char *l = msg; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
		if (!strncmp(l, key, k) && l[k] == '=') {
			size_t n = strcspn(l + k + 1, "\n");
			snprintf(out, cap, "%.*s", (int)n, l + k + 1);
			return out;
		}
	return NULL;
}

Test(notify, ready_then_stopping)
{
	cr_assert_eq(setenv("NOTIFY_SOCKET", path, 1), 0);
	proxy_start_plain(&px, (const char *[]){ "--slots", "8", "--slot-size", "64K", NULL });
	pid_t pid = px.pid; /* proxy_kill clears it */

	char msg[1024], v[512], want[512];
	pid_t from;
	/* --ready-fd said "ready" (proxy_start waits for it); the datagram went
	 * just before, so it is there now. */
	notify_read(msg, sizeof(msg), &from);
	cr_assert_eq(from, pid, "READY came from pid %d, not kvstaged's %d", (int)from, (int)pid);
	cr_assert_not_null(field(msg, "READY", v, sizeof(v)), "no READY in '%s'", msg);
	cr_assert_str_eq(v, "1");
	cr_assert_not_null(field(msg, "STATUS", v, sizeof(v)), "no STATUS in '%s'", msg);
	snprintf(want, sizeof(want), "serving %s: 8 slots x 64 KiB", px.sock);
	cr_assert_str_eq(v, want);

	/* A client still in: the drain starts (STOPPING) and ends at once,
	 * since it has no room open. */
	kvs_client *c = connect_ok(&px);
	cr_assert_eq(kill(pid, SIGTERM), 0);
	notify_read(msg, sizeof(msg), &from);
	cr_assert_eq(from, pid, "STOPPING came from pid %d, not kvstaged's %d", (int)from,
		     (int)pid);
	cr_assert_not_null(field(msg, "STOPPING", v, sizeof(v)), "no STOPPING in '%s'", msg);
	cr_assert_str_eq(v, "1");
	cr_assert_not_null(field(msg, "STATUS", v, sizeof(v)), "no STATUS in '%s'", msg);
	cr_assert_eq(strncmp(v, "draining: ", 10), 0, "STATUS '%s'", v);
	cr_assert_str_eq(v, "draining: 0 rooms active, 1 clients attached");

	int st = 0;
	cr_assert_eq(reap(pid, &st), pid, "kvstaged did not exit after SIGTERM");
	px.pid = 0;
	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "kvstaged's wait status %#x, want exit 0",
		  st);
	kvs_close(c);
	/* Nothing more was sent: one READY, one STOPPING. */
	struct pollfd p = { nfd, POLLIN, 0 };
	cr_assert_eq(poll(&p, 1, 0), 0, "a third notification");
}
