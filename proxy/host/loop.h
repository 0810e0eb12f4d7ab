/* SPDX-License-Identifier: MIT */
/* The proxy's lifetime (proxy.c), the loop and what plugs into its epoll:
 * the listener and hello (listener.c), the admin protocol (admin.c), the
 * loop itself (poller.c). */
#ifndef KVSP_LOOP_H
#define KVSP_LOOP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct kvsp;
struct kvsp_config;

/* proxy.c */
/* Sets p up from cfg; with a socket path, claims it first. Returns 0, or -errno (logged). */
int kvsp_init(struct kvsp *p, const struct kvsp_config *cfg);
void kvsp_fini(struct kvsp *p);

/* poller.c */
/* Opens the socket and takes the signals. Returns 0, or -errno (logged). */
int kvsp_listen(struct kvsp *p);
/* Runs until drained or told twice. Returns the exit code. */
int kvsp_run(struct kvsp *p);

/* listener.c: the socket, access control, accept and hello */
/* Checks that the socket's file can admit everyone the access rule admits; why says what not. Returns 0, or -EINVAL. */
int kvsp_access_check(const struct kvsp_config *cfg, char *why, size_t len);
/* Claims cfg.socket_path before anything costly: its directory, its lock, what is there now. Returns 0, or -errno (logged). */
int kvsp_socket_claim(struct kvsp *p);
/* Binds and listens on the claimed path with its mode and group. Returns 0, or -errno (logged). */
int kvsp_listener_open(struct kvsp *p);
/* Stops listening; unlinks the socket only if it is still the one we made. */
void kvsp_listener_close(struct kvsp *p);
int kvsp_listener_init(struct kvsp *p);
void kvsp_listener_fini(struct kvsp *p);
void kvsp_on_accept(struct kvsp *p);
void kvsp_on_hello(struct kvsp *p, unsigned i);
bool kvsp_pending_valid(const struct kvsp *p, unsigned i, uint32_t id);
/* Drops handshakes past their time. Returns the next deadline. */
uint64_t kvsp_pending_expire(struct kvsp *p);
/* Answers a connection with status and msg, then closes it. */
void kvsp_refuse(struct kvsp *p, int fd, int status, const char *msg);

/* admin.c: failpoints and counter barriers */
int kvsp_admin_init(struct kvsp *p);
void kvsp_admin_fini(struct kvsp *p);
void kvsp_admin_welcome(struct kvsp *p, int fd);
void kvsp_admin_event(struct kvsp *p, unsigned i, uint32_t events);
/* Answers the barriers that now hold. */
void kvsp_admin_poll(struct kvsp *p);

#endif
