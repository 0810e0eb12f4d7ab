/* SPDX-License-Identifier: MIT */
/* The loop's fds (loop_fd.h). */
#include "base/loop_fd.h"

#include <errno.h>
#include <stddef.h>
#include <sys/epoll.h>

int kvsp_ep_add(int epfd, int fd, uint32_t events, uint64_t data)
{
	struct epoll_event ev = { .events = events, .data.u64 = data };
	return epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev) < 0 ? -errno : 0;
}

void kvsp_ep_del(int epfd, int fd)
{
	epoll_ctl(epfd, EPOLL_CTL_DEL, fd, NULL);
}
