/* SPDX-License-Identifier: MIT */
/*
 * The pool (slot payload) and the control segment (header, stats, slot
 * table, ring geometry, the peer and client tables, the counter block). Both are memfds
 * handed to clients; both are sealed against resizing so no client can
 * make the proxy fault, and the control segment is sealed against any new
 * writable mapping.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "kvs_build.h"
#include "parse.h"
#include "base/numa.h"
#include "core/pool.h"
#include "core/proxy.h"
#include "ring.h"

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif
#ifndef MFD_HUGETLB
#define MFD_HUGETLB 0x0004U
#endif

#define HUGE_2M (2u << 20)

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

/* The pool's parts: one per NUMA node with memory (at most
 * KVSP_SLOT_PARTS), each a run of slots that starts on a page of the
 * mapping (page bytes: 2 MiB with hugepages), as even as that allows.
 * Returns how many (1: not split), with part k's first slot in start[k]
 * and start[n] the slot count. */
static unsigned plan_parts(struct kvsp *p, size_t page, uint32_t *start)
{
	uint32_t count = p->cfg.slot_count;
	uint64_t size = p->cfg.slot_size;
	int n = kvsp_numa_nodes(p->node_ids, KVSP_SLOT_PARTS);
	p->nnodes = 1;
	if (n < 0)
		p->node_ids[0] = 0;
	if (n < 2)
		return 1;
	/* Slots per page-aligned step: the least multiple of the slot size
	 * that is a multiple of the page. */
	uint64_t step = 1;
	while (step * size % page)
		step++;
	/* Too few slots for a page-aligned run on each node: not split. */
	start[0] = 0;
	for (int k = 1; k < n; k++) {
		start[k] = (uint32_t)((uint64_t)count * (unsigned)k / (unsigned)n / step * step);
		if (start[k] <= start[k - 1])
			return 1;
	}
	if (count <= start[n - 1])
		return 1;
	start[n] = count;
	p->nnodes = (unsigned)n;
	for (int k = 0; k < n; k++)
		LOG_INFO("pool: slots %u to %u on NUMA node %u", start[k], start[k + 1] - 1,
			 p->node_ids[k]);
	return (unsigned)n;
}

/* Maps the pool's memfd, its parts (start, n of them) each preferring its
 * node's memory, and populates it. Returns the mapping, or MAP_FAILED with errno. */
static void *map_placed(struct kvsp *p, int fd, size_t len, const uint32_t *start, unsigned n)
{
	if (n < 2) /* With hugetlb, MAP_POPULATE reserves the pages now: when
		    * none are free this is where it fails, not at memfd_create. */
		return mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
	/* Each page's node is chosen when it is first touched: the policy
	 * first, then every page touched (a failure is an error, not a SIGBUS). */
	void *base = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (base == MAP_FAILED)
		return base;
	for (unsigned k = 0; k < n; k++) {
		size_t off = (size_t)start[k] * p->cfg.slot_size,
		       end = k + 1 == n ? len : (size_t)start[k + 1] * p->cfg.slot_size;
		int rc = kvsp_numa_prefer((uint8_t *)base + off, end - off, p->node_ids[k]);
		if (rc < 0)
			LOG_WARN("pool: slots %u to %u on NUMA node %u: %s (left where they fall)",
				 start[k], start[k + 1] - 1, p->node_ids[k], strerror(-rc));
	}
	if (madvise(base, len, MADV_POPULATE_WRITE) < 0) {
		int err = errno;
		munmap(base, len);
		errno = err;
		return MAP_FAILED;
	}
	return base;
}

static int pool_map(struct kvsp *p, bool huge, size_t len)
{
	unsigned flags = MFD_CLOEXEC | MFD_ALLOW_SEALING | (huge ? MFD_HUGETLB : 0);
	int fd = memfd_create("kvstage-pool", flags);
	if (fd < 0)
		return -errno;
	if (ftruncate(fd, (off_t)len) < 0) {
		int err = -errno;
		close(fd);
		return err;
	}
	uint32_t start[KVSP_SLOT_PARTS + 1];
	unsigned n = plan_parts(p, huge ? HUGE_2M : KVS_PAGE, start);
	void *base = map_placed(p, fd, len, start, n);
	if (base == MAP_FAILED) {
		int err = -errno;
		close(fd);
		return err;
	}
	if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
		int err = -errno;
		munmap(base, len);
		close(fd);
		return err;
	}
	memcpy(p->part_start, start, (n + 1) * sizeof(*start));
	p->pool_fd = fd;
	p->pool = base;
	p->pool_size = len;
	return 0;
}

/* The rte_ring geometry at the tail of page geom, and the header a fresh
 * ring body starts with. rte_ring_init does the work; we split its result. */
static int ring_geometry(uint8_t *geom, uint8_t *tmpl, unsigned count, const char *name)
{
	struct rte_ring *r = aligned_alloc(KVS_CACHE_LINE, sizeof(struct rte_ring));
	if (!r)
		return -ENOMEM;
	int rc = rte_ring_init(r, name, count, RING_F_SP_ENQ | RING_F_SC_DEQ);
	if (rc == 0) {
		memcpy(geom + KVS_PAGE - KVS_RING_SPLIT, r, KVS_RING_SPLIT);
		memcpy(tmpl, (uint8_t *)r + KVS_RING_SPLIT, sizeof(*r) - KVS_RING_SPLIT);
	}
	free(r);
	return rc;
}

/* Where the control segment's parts lie: a function of the configuration
 * only, so the proxy finds them without reading the segment back. */
struct ctrl_geom {
	size_t hdr, table, peers_off, clients_off, counters_off, len;
};

static void ctrl_geom(const struct kvsp_config *cfg, struct ctrl_geom *g)
{
	g->hdr = KVS_ALIGN_UP(sizeof(struct kvs_ctrl), KVS_PAGE);
	g->table = KVS_ALIGN_UP((size_t)cfg->slot_count * sizeof(struct kvs_slot), KVS_PAGE);
	size_t peers = KVS_ALIGN_UP(KVS_MAX_PEERS * sizeof(struct kvs_peer), KVS_PAGE);
	size_t clients =
		KVS_ALIGN_UP((size_t)cfg->max_clients * sizeof(struct kvs_client_row), KVS_PAGE);
	g->peers_off = g->hdr + g->table + 2 * KVS_PAGE;
	g->clients_off = g->peers_off + peers;
	g->counters_off = g->clients_off + clients;
	g->len = g->counters_off + KVS_ALIGN_UP(sizeof(struct kvs_counters), KVS_PAGE);
}

struct kvs_client_row *kvsp_client_rows(const struct kvsp *p)
{
	struct ctrl_geom g;
	ctrl_geom(&p->cfg, &g);
	return (struct kvs_client_row *)((uint8_t *)p->ctrl + g.clients_off);
}

static int ctrl_create(struct kvsp *p)
{
	const struct kvsp_config *cfg = &p->cfg;
	struct ctrl_geom g;
	ctrl_geom(cfg, &g);
	size_t hdr = g.hdr, table = g.table, len = g.len;
	int rc;

	int fd = memfd_create("kvstage-ctrl", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return -errno;
	if (ftruncate(fd, (off_t)len) < 0)
		goto fail;
	struct kvs_ctrl *c = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (c == MAP_FAILED)
		goto fail;
	p->ctrl_fd = fd;
	p->ctrl = c;
	p->ctrl_size = len;
	p->stats = &c->stats;

	c->abi = KVS_ABI;
	c->instance = p->instance;
	c->slot_size = cfg->slot_size;
	c->pool_size = p->pool_size;
	c->slot_count = cfg->slot_count;
	c->flags = (p->huge ? KVS_CTRL_HUGEPAGES : 0) | (p->locked ? KVS_CTRL_LOCKED : 0) |
		   (cfg->failpoints ? KVS_CTRL_FAILPOINTS : 0) |
		   (KVS_HAVE_VERBS ? 0 : KVS_CTRL_WITHOUT_VERBS) |
		   (KVS_HAVE_METRICS ? 0 : KVS_CTRL_WITHOUT_METRICS) |
		   (KVS_HAVE_SYSTEMD ? 0 : KVS_CTRL_WITHOUT_SYSTEMD) |
		   (KVS_HAVE_ACL ? 0 : KVS_CTRL_WITHOUT_ACL);
	c->max_rooms = cfg->max_rooms;
	c->client_rooms = cfg->client_rooms;
	c->sq_count = cfg->sq_count;
	c->cq_count = cfg->cq_count;
	c->slots_off = hdr;
	c->sq_geom_off = hdr + table;
	c->cq_geom_off = hdr + table + KVS_PAGE;
	c->peers_off = g.peers_off;
	c->peer_count = KVS_MAX_PEERS;
	c->clients_off = g.clients_off;
	c->client_count = cfg->max_clients;
	c->client_row_size = sizeof(struct kvs_client_row);
	c->counters_off = g.counters_off; /* its records come as their owners start */
	c->proxy_pid = getpid();
	c->ring_layout = kvs_ring_layout();
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	c->started_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;

	rc = ring_geometry((uint8_t *)c + c->sq_geom_off, p->sq_tmpl, cfg->sq_count, "kvs-sq");
	if (rc == 0)
		rc = ring_geometry((uint8_t *)c + c->cq_geom_off, p->cq_tmpl, cfg->cq_count,
				   "kvs-cq");
	if (rc < 0)
		return rc;
	p->tmpl_len = sizeof(struct rte_ring) - KVS_RING_SPLIT;
	/* Each instance starts its epochs at a random base: a lease kept
	 * across a restart is then all but certain to be stale, never equal
	 * to one the new instance hands out. */
	uint32_t base;
	if (getrandom(&base, sizeof(base), 0) != sizeof(base))
		return -EIO;
	rc = kvsp_slots_init(&p->slots, (struct kvs_slot *)((uint8_t *)c + hdr), cfg->slot_count,
			     c->stats.slots, &c->stats.tombstones_reaped, base);
	if (rc == 0 && p->nnodes > 1)
		rc = kvsp_slots_split(&p->slots, p->nnodes, p->part_start);
	if (rc < 0)
		return rc;
	/* Last: a client that sees the magic sees everything above. */
	__atomic_store_n(&c->magic, KVS_MAGIC_CTRL, __ATOMIC_RELEASE);

	/* Our mapping stays writable; nobody can make a new writable one. */
	if (fcntl(fd, F_ADD_SEALS,
		  F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) < 0)
		return -errno;
	return 0;
fail:
	rc = -errno;
	close(fd);
	return rc;
}

/* A number from a /proc or /sys file: the value after key (NULL: the file's
 * first word), times mult. Returns 0, or -1 if absent or not a number. */
static int read_num(const char *path, const char *key, uint64_t mult, uint64_t *out)
{
	FILE *f = fopen(path, "re");
	if (!f)
		return -1;
	char line[256];
	int rc = -1;
	while (fgets(line, sizeof(line), f)) {
		const char *v = line;
		if (key) {
			size_t k = strlen(key);
			if (strncmp(line, key, k))
				continue;
			v += k;
		}
		char *end;
		unsigned long long n = strtoull(v, &end, 10);
		if (end != v) {
			*out = n * mult;
			rc = 0;
		}
		break;
	}
	fclose(f);
	return rc;
}

/* The memory a new pool can take: what the kernel calls available, and
 * under a cgroup v2 limit, what is left of it. */
static uint64_t memory_left(const char **what)
{
	uint64_t avail = UINT64_MAX, max, cur;
	*what = "MemAvailable in /proc/meminfo";
	read_num("/proc/meminfo", "MemAvailable:", 1024, &avail);
	if (read_num("/sys/fs/cgroup/memory.max", NULL, 1, &max) == 0 &&
	    read_num("/sys/fs/cgroup/memory.current", NULL, 1, &cur) == 0) {
		uint64_t left = cur < max ? max - cur : 0;
		if (left < avail) {
			avail = left;
			*what = "the cgroup's memory.max less memory.current";
		}
	}
	return avail;
}

int kvsp_pool_fits(const struct kvsp_config *cfg)
{
	uint64_t want = (uint64_t)cfg->slot_count * cfg->slot_size;
	const char *what;
	uint64_t left = memory_left(&what);
	if (want <= left)
		return 0;
	char a[32], b[32];
	LOG_ERR("a pool of %s does not fit in the %s of memory left (%s): ask for fewer or "
		"smaller slots",
		kvs_format_size(want, a, sizeof(a)), kvs_format_size(left, b, sizeof(b)), what);
	return -ENOMEM;
}

int kvsp_pool_create(struct kvsp *p)
{
	const struct kvsp_config *cfg = &p->cfg;
	p->pool_fd = p->ctrl_fd = -1;
	if (getrandom(&p->instance, sizeof(p->instance), 0) != sizeof(p->instance))
		return -EIO;
	p->instance |= 1; /* never 0 */

	size_t want = (size_t)cfg->slot_count * cfg->slot_size;
	int rc = -EINVAL;
	if (cfg->huge != KVSP_HUGE_OFF) {
		rc = pool_map(p, true, KVS_ALIGN_UP(want, HUGE_2M));
		if (rc == 0) {
			p->huge = true;
		} else if (cfg->huge == KVSP_HUGE_ON) {
			char sz[32];
			LOG_ERR("--hugepages on: no %s of free 2 MiB hugepages (%s); reserve "
				"some in /proc/sys/vm/nr_hugepages",
				kvs_format_size(KVS_ALIGN_UP(want, HUGE_2M), sz, sizeof(sz)),
				strerror(-rc));
			return rc;
		} else {
			LOG_INFO("hugepages unavailable (%s): using normal pages", strerror(-rc));
		}
	}
	if (!p->huge) {
		rc = pool_map(p, false, KVS_ALIGN_UP(want, KVS_PAGE));
		if (rc < 0) {
			char sz[32];
			LOG_ERR("cannot map a %s pool: %s", kvs_format_size(want, sz, sizeof(sz)),
				strerror(-rc));
			return rc;
		}
		madvise(p->pool, p->pool_size, MADV_HUGEPAGE);
	}
	if (cfg->lock) {
		if (mlock(p->pool, p->pool_size) == 0)
			p->locked = true;
		else
			LOG_WARN("cannot lock the pool in memory (%s): raise RLIMIT_MEMLOCK or "
				 "run with --no-lock",
				 strerror(errno));
	}
	rc = ctrl_create(p);
	if (rc < 0)
		LOG_ERR("control segment: %s", strerror(-rc));
	return rc;
}

void kvsp_pool_destroy(struct kvsp *p)
{
	kvsp_slots_fini(&p->slots);
	if (p->ctrl)
		munmap(p->ctrl, p->ctrl_size);
	if (p->pool)
		munmap(p->pool, p->pool_size);
	if (p->ctrl_fd >= 0)
		close(p->ctrl_fd);
	if (p->pool_fd >= 0)
		close(p->pool_fd);
	p->ctrl = NULL;
	p->pool = NULL;
}
