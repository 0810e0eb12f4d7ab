/* SPDX-License-Identifier: MIT */
/*
 * --tcp-zerocopy (design note 36): the kernel's answers to a connection's
 * MSG_ZEROCOPY sendmsgs, read off its error queue, and the zombies: the
 * sockets of closed connections the kernel still reads slot bytes for,
 * purged and kept until it has answered for every call.
 */
#include "peer/conn.h"

#include <errno.h>
#include <time.h> /* linux/errqueue.h needs struct timespec */
#include <linux/errqueue.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "layout.h"

/* SO_ZEROCOPY on fd. It is set before connect and on the listener too (an
 * accepted socket inherits it), for a kernel that takes it only on a socket
 * not yet connected: then it is on already. Returns whether it is on.
 * Without it, fd copies, as by default. */
bool pconn_zc_set(int fd)
{
	int one = 1, on = 0;
	socklen_t len = sizeof(on);
	if (setsockopt(fd, SOL_SOCKET, SO_ZEROCOPY, &one, sizeof(one)) == 0)
		return true;
	return getsockopt(fd, SOL_SOCKET, SO_ZEROCOPY, &on, &len) == 0 && on;
}

void pconn_zc_prepare(const struct pconn_table *t, int fd)
{
	if (t->zerocopy)
		(void)pconn_zc_set(fd);
}

static bool zc_owed(const struct pconn_zc *z)
{
	return z->sent != z->done;
}

/* The kernel answered zerocopy call id. */
static void zc_mark(struct pconn_zc *z, uint32_t id)
{
	uint32_t d = id - z->done;
	if (d > PCONN_ZC_WINDOW)
		return; /* answered before (or no call of ours) */
	if (d) {
		z->ahead |= 1ull << (d - 1);
		return;
	}
	for (bool next = true; next;) {
		z->done++;
		next = z->ahead & 1;
		z->ahead >>= 1;
	}
}

/* Reads every answer on fd's error queue into z. Returns 0, or -errno. */
static int zc_read(struct pconn_table *t, int fd, struct pconn_zc *z)
{
	for (;;) {
		union {
			char buf[CMSG_SPACE(sizeof(struct sock_extended_err) + 64)];
			struct cmsghdr align;
		} ctl;
		struct msghdr m = { .msg_control = ctl.buf, .msg_controllen = sizeof(ctl.buf) };
		if (recvmsg(fd, &m, MSG_ERRQUEUE | MSG_DONTWAIT) < 0)
			return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -errno;
		for (struct cmsghdr *cm = CMSG_FIRSTHDR(&m); cm; cm = CMSG_NXTHDR(&m, cm)) {
			if (!((cm->cmsg_level == SOL_IP && cm->cmsg_type == IP_RECVERR) ||
			      (cm->cmsg_level == SOL_IPV6 && cm->cmsg_type == IPV6_RECVERR)))
				continue;
			struct sock_extended_err e;
			memcpy(&e, CMSG_DATA(cm), sizeof(e));
			if (e.ee_origin != SO_EE_ORIGIN_ZEROCOPY || e.ee_errno)
				continue;
			/* [ee_info, ee_data]: at most the window of ours, so
			 * a range past it is not ours to walk */
			uint32_t n = e.ee_data - e.ee_info + 1;
			if (n > PCONN_ZC_WINDOW)
				n = PCONN_ZC_WINDOW;
			if (e.ee_code & SO_EE_CODE_ZEROCOPY_COPIED) {
				KVS_STAT_ADD(t->ctr[PCONN_CTR_ZC_COPIED], n);
				z->copied_run += n;
			} else {
				z->copied_run = 0;
			}
			for (uint32_t k = 0; k < n; k++)
				zc_mark(z, e.ee_info + k);
		}
	}
}

bool pconn_zc_owed(const struct pconn *c)
{
	return zc_owed(&c->zc);
}

int pconn_zc_reap(struct pconn_table *t, struct pconn *c)
{
	int rc = zc_owed(&c->zc) ? zc_read(t, c->fd, &c->zc) : 0;
	if (c->zc_on && c->zc.copied_run >= PCONN_ZC_COPIED_RUN)
		c->zc_on = false; /* what is still owed is answered as before */
	return rc;
}

bool pconn_zombie_from(struct pconn_table *t, struct pconn *c)
{
	struct sockaddr un = { .sa_family = AF_UNSPEC };
	(void)connect(c->fd, &un, sizeof(un));
	for (unsigned i = 0; i < PCONN_MAX; i++) {
		struct pconn_zombie *z = &t->zombie[i];
		if (z->fd >= 0)
			continue;
		*z = (struct pconn_zombie){ .fd = c->fd, .sess = c->sess, .zc = c->zc };
		t->nzombies++;
		return true;
	}
	return false;
}

static void zombie_close(struct pconn_table *t, struct pconn_zombie *z)
{
	close(z->fd);
	z->fd = -1;
	t->nzombies--;
}

unsigned pconn_zombies_reap(struct pconn_table *t, uint32_t sess, bool read)
{
	unsigned left = 0;
	for (unsigned i = 0; t->nzombies && i < PCONN_MAX; i++) {
		struct pconn_zombie *z = &t->zombie[i];
		if (z->fd < 0 || (sess && z->sess != sess))
			continue;
		if (read)
			(void)zc_read(t, z->fd, &z->zc);
		if (zc_owed(&z->zc))
			left++;
		else
			zombie_close(t, z);
	}
	return left;
}

void pconn_zombies_close(struct pconn_table *t, uint32_t sess)
{
	for (unsigned i = 0; t->nzombies && i < PCONN_MAX; i++)
		if (t->zombie[i].fd >= 0 && (!sess || t->zombie[i].sess == sess))
			zombie_close(t, &t->zombie[i]);
}
