/* SPDX-License-Identifier: MIT */
/*
 * The pool by NUMA node: on a machine of two nodes a proxy splits its pool
 * in two runs of slots, each placed on its node's memory (mbind, checked in
 * /proc/PID/numa_maps), and a client leases from its own node's run: the
 * node every CPU it may run on belongs to. A client that may run on both
 * leases where most slots are free; rooms cross nodes as ever.
 *
 * tools/run-tests.sh runs this suite in the soft-RoCE guest, which qemu
 * gives two nodes (a vCPU and 1 GiB each); on a machine of one node every
 * case skips and says so.
 */
#include <criterion/criterion.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "xroom.h"

#define SLOTS 128

static struct proxy px = PROXY_INIT;

static void teardown(void)
{
	proxy_stop(&px);
}

TestSuite(numa, .fini = teardown, .timeout = 120);

/* The first CPU of node n, or -1 (no such node with CPUs). */
static int cpu_of_node(unsigned n)
{
	char path[96];
	snprintf(path, sizeof(path), "/sys/devices/system/node/node%u/cpulist", n);
	FILE *f = fopen(path, "re");
	int cpu = -1;
	if (f) {
		if (fscanf(f, "%d", &cpu) != 1)
			cpu = -1;
		fclose(f);
	}
	return cpu;
}

static void start(void)
{
	if (cpu_of_node(0) < 0 || cpu_of_node(1) < 0)
		cr_skip_test("one NUMA node here (no CPUs on node 1): tools/run-tests.sh runs this "
			     "suite in the soft-RoCE guest, which has two");
	proxy_start(&px, NULL, (const char *[]){ "--slots", "128", "--slot-size", "64K", NULL });
}

/* Runs this process on cpu alone (-1: on every CPU of nodes 0 and 1). */
static void pin(int cpu)
{
	cpu_set_t set;
	CPU_ZERO(&set);
	if (cpu >= 0) {
		CPU_SET(cpu, &set);
	} else {
		CPU_SET(cpu_of_node(0), &set);
		CPU_SET(cpu_of_node(1), &set);
	}
	cr_assert_eq(sched_setaffinity(0, sizeof(set), &set), 0);
}

/* The pool's pages on node 0 and node 1, from the proxy's numa_maps (each
 * node's run its own line: a run of another policy is its own mapping). */
static void pool_pages(unsigned long *n0, unsigned long *n1)
{
	char path[64], line[4096];
	snprintf(path, sizeof(path), "/proc/%d/numa_maps", (int)px.pid);
	FILE *f = fopen(path, "re");
	cr_assert_not_null(f, "%s", path);
	*n0 = *n1 = 0;
	while (fgets(line, sizeof(line), f)) {
		if (!strstr(line, "kvstage-pool"))
			continue;
		/* One line per policy: mbind split the mapping in two. */
		const char *a = strstr(line, " N0="), *b = strstr(line, " N1=");
		*n0 += a ? strtoul(a + 4, NULL, 10) : 0;
		*n1 += b ? strtoul(b + 4, NULL, 10) : 0;
	}
	fclose(f);
}

Test(numa, the_pool_is_split_by_node_and_clients_lease_from_their_own)
{
	start();
	char log[8192];
	proxy_log(&px, log, sizeof(log));
	cr_assert(strstr(log, "pool: slots 0 to 63 on NUMA node 0"), "%s", log);
	cr_assert(strstr(log, "pool: slots 64 to 127 on NUMA node 1"), "%s", log);
	unsigned long n0, n1;
	pool_pages(&n0, &n1);
	/* 8 MiB in 4 KiB pages (or 2 MiB ones): half of them on each node. */
	cr_assert(n0 > 0 && n1 > 0 && n0 == n1, "pages on node 0: %lu, node 1: %lu", n0, n1);

	for (unsigned node = 0; node < 2; node++) {
		pin(cpu_of_node(node));
		kvs_client *c = connect_ok(&px);
		struct kvs_lease l[16];
		cr_assert_eq(kvs_acquire(c, 16, l), 0);
		for (unsigned i = 0; i < 16; i++)
			cr_assert_eq(l[i].slot / (SLOTS / 2), node,
				     "a client on node %u leased slot %u", node, l[i].slot);
		for (unsigned i = 0; i < 16; i++)
			kvs_release(c, &l[i]);
		kvs_close(c);
	}

	/* On both nodes: where most are free. Node 0's run mostly leased by
	 * a client of node 0, an unpinned one gets node 1's. */
	pin(cpu_of_node(0));
	kvs_client *a = connect_ok(&px);
	struct kvs_lease la[48];
	cr_assert_eq(kvs_acquire(a, 48, la), 0);
	pin(-1);
	kvs_client *b = connect_ok(&px);
	struct kvs_lease lb;
	cr_assert_eq(kvs_acquire(b, 1, &lb), 0);
	cr_assert_geq(lb.slot, SLOTS / 2, "the fuller part's slot %u", lb.slot);
	/* A node's run used up: its client leases from the other's. */
	struct kvs_lease more[20];
	cr_assert_eq(kvs_acquire(a, 20, more), 0);
	cr_assert_geq(more[19].slot, SLOTS / 2, "past node 0's run: %u", more[19].slot);
	kvs_close(b);
	kvs_close(a);

	/* Rooms cross nodes as ever: a sender on node 0, a receiver on node 1. */
	pin(cpu_of_node(1));
	kvs_client *rx = connect_ok(&px);
	pin(cpu_of_node(0));
	kvs_client *tx = connect_ok(&px);
	one_room(rx, tx, 0x6100);
	kvs_close(tx);
	kvs_close(rx);
	wait_idle(&px, 0);
}
