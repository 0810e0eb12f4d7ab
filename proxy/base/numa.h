/* SPDX-License-Identifier: MIT */
/*
 * NUMA placement, read from sysfs and set with mbind(2) (numa.c): which
 * nodes the machine has, which node a process runs on, which node a device
 * hangs off. libnuma would bring a shared library for three sysfs reads
 * and one system call.
 */
#ifndef KVSP_NUMA_H
#define KVSP_NUMA_H

#include <stddef.h>
#include <sys/types.h>

#define KVSP_NUMA_MAX 8 /* nodes the pool is split over; more share the last's part */

/* The machine's NUMA nodes with memory, ascending, into ids[] (at most max).
 * Returns how many (1, node 0, where sysfs says nothing), or -errno. */
int kvsp_numa_nodes(unsigned *ids, unsigned max);
/* Returns the node every CPU pid may run on belongs to, or -1 (CPUs of
 * several nodes, or pid not known here). */
int kvsp_numa_of_pid(pid_t pid);
/* Returns the node the sysfs device at path (its "numa_node" file's
 * folder, such as /sys/class/infiniband/NAME/device) hangs off, or -1. */
int kvsp_numa_of_device(const char *path);
/* Asks that the pages of [addr, addr + len) (page aligned) come from node
 * when they are first touched, falling back to others when it has none.
 * Returns 0, or -errno. */
int kvsp_numa_prefer(void *addr, size_t len, unsigned node);

#endif
