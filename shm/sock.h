/* SPDX-License-Identifier: MIT */
/* Unix SOCK_SEQPACKET messages with fds attached (SCM_RIGHTS). */
#ifndef KVS_SHM_SOCK_H
#define KVS_SHM_SOCK_H

#include <stddef.h>
#include <sys/types.h>

struct pollfd;

#define KVS_MAX_FDS 8

/* Sends one message with nfds fds. Returns 0, or -errno. */
int kvs_sock_send(int sock, const void *buf, size_t len, const int *fds, int nfds);
/* Receives one message into buf; fds into fds[*nfds] (CLOEXEC). Returns its length, 0 on hang-up, or -errno. */
ssize_t kvs_sock_recv(int sock, void *buf, size_t len, int *fds, int *nfds, int flags);
/* Writes all n bytes to a stream, retrying short writes and EINTR. Returns 0, or -errno (-EPIPE if nothing more could be written). */
int kvs_write_full(int fd, const void *b, size_t n);
/* Reads exactly n bytes from a stream. Returns 1, 0 on EOF before any byte, or -errno (-EPIPE on EOF midway). */
int kvs_read_full(int fd, void *b, size_t n);
/* poll() until an event or timeout_ms (< 0: for ever) from now; a signal does not restart the wait. Returns poll's count, 0 at the deadline, or -errno. */
int kvs_poll_for(struct pollfd *p, unsigned n, int timeout_ms);
/* Connects a SOCK_SEQPACKET socket to path. Returns the fd, or -errno. */
int kvs_sock_connect(const char *path);

#endif
