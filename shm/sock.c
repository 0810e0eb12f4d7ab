/* SPDX-License-Identifier: MIT */
#include "sock.h"

#include <errno.h>
#include <poll.h>
#include <string.h>
#include <time.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

int kvs_sock_send(int sock, const void *buf, size_t len, const int *fds, int nfds)
{
	union {
		char buf[CMSG_SPACE(sizeof(int) * KVS_MAX_FDS)];
		struct cmsghdr align;
	} ctl;
	struct iovec iov = { .iov_base = (void *)buf, .iov_len = len };
	struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1 };

	if (nfds < 0 || nfds > KVS_MAX_FDS)
		return -EINVAL;
	if (nfds) {
		memset(&ctl, 0, sizeof(ctl));
		msg.msg_control = ctl.buf;
		msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
		struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
		cm->cmsg_level = SOL_SOCKET;
		cm->cmsg_type = SCM_RIGHTS;
		cm->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
		memcpy(CMSG_DATA(cm), fds, sizeof(int) * nfds);
	}
	ssize_t n;
	do
		n = sendmsg(sock, &msg, MSG_NOSIGNAL);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return -errno;
	return (size_t)n == len ? 0 : -EMSGSIZE;
}

ssize_t kvs_sock_recv(int sock, void *buf, size_t len, int *fds, int *nfds, int flags)
{
	union {
		char buf[CMSG_SPACE(sizeof(int) * KVS_MAX_FDS)];
		struct cmsghdr align;
	} ctl;
	struct iovec iov = { .iov_base = buf, .iov_len = len };
	struct msghdr msg = { .msg_iov = &iov,
			      .msg_iovlen = 1,
			      .msg_control = ctl.buf,
			      .msg_controllen = sizeof(ctl.buf) };
	int want = nfds ? *nfds : 0, got = 0;
	ssize_t n;

	do
		n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | flags);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return -errno;
	for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm)) {
		if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
			continue;
		int k = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
		int *in = (int *)CMSG_DATA(cm);
		for (int i = 0; i < k; i++) {
			if (got < want)
				fds[got++] = in[i];
			else
				close(in[i]); /* more than asked for: never leak them */
		}
	}
	if (nfds)
		*nfds = got;
	if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
		for (int i = 0; i < got; i++)
			close(fds[i]);
		if (nfds)
			*nfds = 0;
		return -EMSGSIZE;
	}
	return n;
}

int kvs_write_full(int fd, const void *b, size_t n)
{
	while (n) {
		ssize_t k = write(fd, b, n);
		if (k < 0 && errno == EINTR)
			continue;
		if (k < 0)
			return -errno;
		if (k == 0)
			return -EPIPE;
		b = (const char *)b + k;
		n -= (size_t)k;
	}
	return 0;
}

int kvs_read_full(int fd, void *b, size_t n)
{
	size_t got = 0;
	while (got < n) {
		ssize_t k = read(fd, (char *)b + got, n - got);
		if (k < 0 && errno == EINTR)
			continue;
		if (k < 0)
			return -errno;
		if (k == 0)
			return got ? -EPIPE : 0;
		got += (size_t)k;
	}
	return 1;
}

int kvs_sock_connect(const char *path)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	if (strlen(path) >= sizeof(sa.sun_path))
		return -ENAMETOOLONG;
	strcpy(sa.sun_path, path);
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		int err = -errno;
		close(fd);
		return err;
	}
	return fd;
}

int kvs_poll_for(struct pollfd *p, unsigned n, int timeout_ms)
{
	struct timespec t0;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	int left = timeout_ms;
	for (;;) {
		int rc = poll(p, n, left);
		if (rc >= 0)
			return rc;
		if (errno != EINTR)
			return -errno;
		if (timeout_ms < 0)
			continue;
		struct timespec t;
		clock_gettime(CLOCK_MONOTONIC, &t);
		long long spent = (t.tv_sec - t0.tv_sec) * 1000LL +
				  (t.tv_nsec - t0.tv_nsec) / 1000000;
		if (spent >= timeout_ms)
			return 0;
		left = (int)(timeout_ms - spent);
	}
}
