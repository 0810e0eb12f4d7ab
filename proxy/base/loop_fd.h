/* SPDX-License-Identifier: MIT */
/*
 * The loop's fds: what an fd in the loop's epoll is (the top byte of its
 * data), and its registration. Whoever gives the loop an fd does it here:
 * the core a transport's (core/xfer.c), host/ the socket's, the clients'
 * and the admin connections'. The loop (host/poller.c) reads the tag back.
 */
#ifndef KVSP_LOOP_FD_H
#define KVSP_LOOP_FD_H

#include <stdint.h>

enum kvsp_ep {
	KVSP_EP_LISTEN = 1,
	KVSP_EP_WAKE,
	KVSP_EP_PENDING,
	KVSP_EP_CLIENT,
	KVSP_EP_ADMIN,
	KVSP_EP_XPORT /* idx: the transport, id: its tag */
};

static inline uint64_t kvsp_ep_tag(unsigned type, unsigned idx, uint32_t id)
{
	return (uint64_t)type << 56 | (uint64_t)(idx & 0xffffff) << 32 | id;
}

/* Adds fd to the loop's epoll epfd, for events, with data (a kvsp_ep_tag).
 * Returns 0, or -errno. */
int kvsp_ep_add(int epfd, int fd, uint32_t events, uint64_t data);
/* Stops watching fd (before closing it). */
void kvsp_ep_del(int epfd, int fd);

#endif
