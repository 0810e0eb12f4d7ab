/* SPDX-License-Identifier: MIT */
#include "base/numa.h"

#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MPOL_PREFERRED 1 /* linux/mempolicy.h: the node first, then any */

/* Reads a sysfs list ("0-3,8") into a bit set of at most 1024 bits.
 * Returns the bits set, or -errno. */
static int read_list(const char *path, unsigned long *bits, unsigned nbits)
{
	FILE *f = fopen(path, "re");
	if (!f)
		return -errno;
	char buf[4096];
	size_t n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = 0;
	memset(bits, 0, nbits / 8);
	int set = 0;
	for (char *s = buf; *s && *s != '\n';) {
		char *e;
		unsigned long a = strtoul(s, &e, 10), b = a;
		if (e == s)
			return -EINVAL;
		if (*e == '-')
			b = strtoul(e + 1, &e, 10);
		for (unsigned long i = a; i <= b && i < nbits; i++, set++)
			bits[i / (8 * sizeof(long))] |= 1ul << (i % (8 * sizeof(long)));
		s = *e == ',' ? e + 1 : e;
	}
	return set;
}

#define BITS 1024
#define TEST(b, i) ((b)[(i) / (8 * sizeof(long))] >> ((i) % (8 * sizeof(long))) & 1)

int kvsp_numa_nodes(unsigned *ids, unsigned max)
{
	unsigned long bits[BITS / (8 * sizeof(long))];
	int rc = read_list("/sys/devices/system/node/has_memory", bits, BITS);
	if (rc == -ENOENT) { /* a kernel without NUMA: one node */
		ids[0] = 0;
		return 1;
	}
	if (rc <= 0)
		return rc < 0 ? rc : -ENOENT;
	unsigned n = 0;
	for (unsigned i = 0; i < BITS && n < max; i++)
		if (TEST(bits, i))
			ids[n++] = i;
	return (int)n;
}

int kvsp_numa_of_pid(pid_t pid)
{
	cpu_set_t cpus;
	if (pid <= 0 || sched_getaffinity(pid, sizeof(cpus), &cpus) < 0)
		return -1;
	unsigned ids[KVSP_NUMA_MAX];
	int n = kvsp_numa_nodes(ids, KVSP_NUMA_MAX), node = -1;
	for (int k = 0; k < n; k++) {
		char path[96];
		unsigned long bits[BITS / (8 * sizeof(long))];
		snprintf(path, sizeof(path), "/sys/devices/system/node/node%u/cpulist", ids[k]);
		if (read_list(path, bits, BITS) <= 0)
			continue;
		for (unsigned c = 0; c < CPU_SETSIZE && c < BITS; c++) {
			if (!CPU_ISSET(c, &cpus) || !TEST(bits, c))
				continue;
			if (node >= 0 && node != (int)ids[k])
				return -1; /* it may run on two nodes: it has no one */
			node = (int)ids[k];
		}
	}
	return node;
}

int kvsp_numa_of_device(const char *path)
{
	char p[512];
	snprintf(p, sizeof(p), "%s/numa_node", path);
	FILE *f = fopen(p, "re");
	int node = -1;
	if (f) {
		if (fscanf(f, "%d", &node) != 1)
			node = -1;
		fclose(f);
	}
	return node;
}

int kvsp_numa_prefer(void *addr, size_t len, unsigned node)
{
	unsigned long mask[BITS / (8 * sizeof(long))] = { 0 };
	if (node >= BITS)
		return -EINVAL;
	mask[node / (8 * sizeof(long))] = 1ul << (node % (8 * sizeof(long)));
	if (syscall(SYS_mbind, addr, len, MPOL_PREFERRED, mask, (unsigned long)BITS, 0ul) < 0)
		return -errno;
	return 0;
}
