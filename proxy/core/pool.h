/* SPDX-License-Identifier: MIT */
/* The pool and the control segment (pool.c). */
#ifndef KVSP_POOL_H
#define KVSP_POOL_H

struct kvsp;
struct kvsp_config;
struct kvs_client_row;

/* Refuses a pool that cannot fit in the memory left (RAM or cgroup). Returns 0, or -ENOMEM (logged). */
int kvsp_pool_fits(const struct kvsp_config *cfg);
int kvsp_pool_create(struct kvsp *p);
void kvsp_pool_destroy(struct kvsp *p);

/* The published clients table, one row per client index. */
struct kvs_client_row *kvsp_client_rows(const struct kvsp *p);

#endif
