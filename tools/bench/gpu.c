/* SPDX-License-Identifier: MIT */
/*
 * kvstage-bench gpu: GPU memory into and out of leased slots through
 * libkvstage_cuda, each figure next to cudaMemcpy between the same device
 * and a cudaMallocHost buffer of the same size (the PCIe limit), measured
 * in the same run, interleaved with it, on the same stream.
 *
 * Slots come from a real kvstaged (started here unless --socket), through
 * real leases. Every figure's data path is also checked once, byte for byte.
 */
#include <cuda_runtime_api.h>
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "report.h"
#include "kvstage.h"
#include "kvstage_cuda.h"

#define TABLES 8 /* gather tables rotated through, each a different shuffle */

static const char *const mode_str[] = { "auto", "copy", "kernel" };

/* ------------------------------------------------------------ measuring */

struct gctx {
	const struct bench_opts *o;
	kvs_client *c;
	cudaStream_t s;
	cudaEvent_t e0, e1;
	struct kvs_lease l[2];	 /* two slots, used in turn */
	void *dsrc, *ddst;	 /* --size bytes each */
	void *hpin;		 /* cudaMallocHost, --size bytes at least */
	uint8_t *dpool, *dpool2; /* the engine's paged memory: gather from, scatter into */
	uint8_t *hpool;		 /* what dpool holds */
	/* the figure being measured */
	uint64_t bytes;
	size_t psize;
	unsigned npages;
	const void **tables[TABLES];
	void **wtables[TABLES];
	int32_t *idx[TABLES];
	int err; /* first failure of an op (kvstage or CUDA), 0 if none */
};

#define CK(call)                                                                   \
	do {                                                                       \
		cudaError_t e_ = (call);                                           \
		if (e_ != cudaSuccess) {                                           \
			fprintf(stderr, "kvstage-bench gpu: %s: %s (%s)\n", #call, \
				cudaGetErrorName(e_), cudaGetErrorString(e_));     \
			return -1;                                                 \
		}                                                                  \
	} while (0)

typedef int (*op_fn)(struct gctx *g, unsigned i);

static int op_base_d2h(struct gctx *g, unsigned i)
{
	(void)i;
	return cudaMemcpyAsync(g->hpin, g->dsrc, g->bytes, cudaMemcpyDeviceToHost, g->s) ? -EIO : 0;
}

static int op_base_h2d(struct gctx *g, unsigned i)
{
	(void)i;
	return cudaMemcpyAsync(g->ddst, g->hpin, g->bytes, cudaMemcpyHostToDevice, g->s) ? -EIO : 0;
}

static int op_to_slot(struct gctx *g, unsigned i)
{
	return kvs_cuda_copy_to_slot(g->c, &g->l[i & 1], 0, g->dsrc, g->bytes, g->s, NULL);
}

static int op_from_slot(struct gctx *g, unsigned i)
{
	return kvs_cuda_copy_from_slot(g->c, &g->l[i & 1], 0, g->ddst, g->bytes, g->s, NULL);
}

static int op_gather(struct gctx *g, unsigned i)
{
	return kvs_cuda_gather(g->c, &g->l[i & 1], 0, g->tables[i % TABLES], g->npages, g->psize,
			       g->s, NULL);
}

static int op_scatter(struct gctx *g, unsigned i)
{
	return kvs_cuda_scatter(g->c, &g->l[i & 1], 0, g->wtables[i % TABLES], g->npages, g->psize,
				g->s, NULL);
}

/* GB/s (1e9) of one timed run of op: iters ops back to back, timed by
 * events on the stream. < 0 on failure. */
static double timed(struct gctx *g, op_fn op)
{
	if (cudaEventRecord(g->e0, g->s))
		return -1;
	for (unsigned i = 0; i < g->o->iters; i++) {
		int rc = op(g, i);
		if (rc < 0) {
			g->err = rc;
			return -1;
		}
	}
	float ms = 0;
	if (cudaEventRecord(g->e1, g->s) || cudaEventSynchronize(g->e1) ||
	    cudaEventElapsedTime(&ms, g->e0, g->e1) || ms <= 0)
		return -1;
	return (double)g->bytes * g->o->iters / (ms * 1e6);
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static double median(double *v, unsigned n)
{
	qsort(v, n, sizeof(*v), cmp_double);
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

struct figure {
	const char *name; /* to_slot, from_slot, gather, scatter */
	const char *mode; /* gather mode, or NULL */
	uint64_t psize;	  /* 0 for slot copies */
	uint64_t bytes;
	double gbps, base_gbps, ratio;
	const char *base; /* "D2H" or "H2D" */
	bool verified;
};

/* One warm-up op of each, then reps runs of ours and of the baseline in
 * turn; the medians. */
static int measure(struct gctx *g, op_fn ours, op_fn base, struct figure *f)
{
	double a[1000], b[1000];
	if (ours(g, 0) < 0 || base(g, 0) < 0 || cudaStreamSynchronize(g->s))
		return -1;
	for (unsigned r = 0; r < g->o->reps; r++) {
		a[r] = timed(g, ours);
		b[r] = timed(g, base);
		if (a[r] < 0 || b[r] < 0)
			return -1;
	}
	f->gbps = median(a, g->o->reps);
	f->base_gbps = median(b, g->o->reps);
	f->ratio = f->gbps / f->base_gbps;
	return 0;
}

static uint64_t rng = 0x2545f4914f6cdd1dull;

static uint64_t next_rand(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return rng;
}

static void fill_random(void *p, size_t len)
{
	uint8_t *b = p;
	for (size_t i = 0; i < len; i += 8) {
		uint64_t w = next_rand();
		memcpy(b + i, &w, len - i < 8 ? len - i : 8);
	}
}

/* The byte checks: one op of the figure on fresh data, compared on the host. */
static int check_to_slot(struct gctx *g)
{
	uint8_t *want = malloc(g->bytes);
	if (!want)
		return -1;
	fill_random(want, g->bytes);
	CK(cudaMemcpy(g->dsrc, want, g->bytes, cudaMemcpyHostToDevice));
	uint8_t *slot = kvs_lease_ptr(g->c, &g->l[0]);
	memset(slot, 0, g->bytes);
	int rc = op_to_slot(g, 0);
	CK(cudaStreamSynchronize(g->s));
	rc = rc == 0 && !memcmp(slot, want, g->bytes) ? 0 : -1;
	free(want);
	return rc;
}

static int check_from_slot(struct gctx *g)
{
	uint8_t *slot = kvs_lease_ptr(g->c, &g->l[0]), *back = malloc(g->bytes);
	if (!back)
		return -1;
	fill_random(slot, g->bytes);
	CK(cudaMemset(g->ddst, 0, g->bytes));
	int rc = op_from_slot(g, 0);
	CK(cudaStreamSynchronize(g->s));
	CK(cudaMemcpy(back, g->ddst, g->bytes, cudaMemcpyDeviceToHost));
	rc = rc == 0 && !memcmp(slot, back, g->bytes) ? 0 : -1;
	free(back);
	return rc;
}

static int check_gather(struct gctx *g)
{
	uint8_t *slot = kvs_lease_ptr(g->c, &g->l[0]);
	memset(slot, 0xa5, g->bytes);
	int rc = op_gather(g, 0);
	CK(cudaStreamSynchronize(g->s));
	for (unsigned k = 0; rc == 0 && k < g->npages; k++)
		if (memcmp(slot + (size_t)k * g->psize, g->hpool + (size_t)g->idx[0][k] * g->psize,
			   g->psize))
			rc = -1;
	return rc;
}

static int check_scatter(struct gctx *g)
{
	uint8_t *slot = kvs_lease_ptr(g->c, &g->l[0]), *back = malloc(g->psize);
	if (!back)
		return -1;
	fill_random(slot, g->bytes);
	int rc = op_scatter(g, 0);
	CK(cudaStreamSynchronize(g->s));
	for (unsigned k = 0; rc == 0 && k < g->npages; k++) {
		CK(cudaMemcpy(back, g->wtables[0][k], g->psize, cudaMemcpyDeviceToHost));
		if (memcmp(back, slot + (size_t)k * g->psize, g->psize))
			rc = -1;
	}
	free(back);
	return rc;
}

/* TABLES page tables of npages distinct pages of the pool, each shuffled. */
static int make_tables(struct gctx *g, uint64_t pool_pages)
{
	uint32_t *perm = malloc(pool_pages * sizeof(*perm));
	if (!perm)
		return -1;
	for (uint64_t i = 0; i < pool_pages; i++)
		perm[i] = (uint32_t)i;
	for (unsigned t = 0; t < TABLES; t++) {
		g->tables[t] = malloc(g->npages * sizeof(*g->tables[t]));
		g->wtables[t] = malloc(g->npages * sizeof(*g->wtables[t]));
		g->idx[t] = malloc(g->npages * sizeof(*g->idx[t]));
		if (!g->tables[t] || !g->wtables[t] || !g->idx[t]) {
			free(perm);
			return -1;
		}
		/* a partial Fisher-Yates: the first npages entries are a fresh sample */
		for (unsigned k = 0; k < g->npages; k++) {
			uint64_t j = k + next_rand() % (pool_pages - k);
			uint32_t x = perm[k];
			perm[k] = perm[j];
			perm[j] = x;
			g->idx[t][k] = (int32_t)perm[k];
			g->tables[t][k] = g->dpool + (size_t)perm[k] * g->psize;
			g->wtables[t][k] = g->dpool2 + (size_t)perm[k] * g->psize;
		}
	}
	free(perm);
	return 0;
}

static void free_tables(struct gctx *g)
{
	for (unsigned t = 0; t < TABLES; t++) {
		free(g->tables[t]);
		free(g->wtables[t]);
		free(g->idx[t]);
		g->tables[t] = NULL;
		g->wtables[t] = NULL;
		g->idx[t] = NULL;
	}
}

/* The kernel page size backing the pool mapping (from /proc/self/smaps), in KiB; 0 if unknown. */
static unsigned long pool_page_kb(kvs_client *c)
{
	uintptr_t base = (uintptr_t)kvs_pool_map(c, NULL);
	FILE *f = fopen("/proc/self/smaps", "r");
	if (!f)
		return 0;
	char line[512];
	bool in = false;
	unsigned long kb = 0;
	while (fgets(line, sizeof(line), f)) {
		uintptr_t lo, hi;
		/* a mapping's first line: "lo-hi perms ..."; its fields: "Name: value" */
		if (sscanf(line, "%" SCNxPTR "-%" SCNxPTR " ", &lo, &hi) == 2) {
			in = base >= lo && base < hi;
			continue;
		}
		if (in && sscanf(line, "KernelPageSize: %lu kB", &kb) == 1)
			break;
	}
	fclose(f);
	return kb;
}

/* The target a figure is held to (printed, not enforced): its JSON member and table text. */
static void target(struct doc *d, struct point *t, const char *key, const char *txt,
		   const struct figure *f, double min)
{
	char k[72];
	if (!f) {
		CAT(d->tail, ", %s not measured (not in --page-size)", txt);
		return;
	}
	if (f->psize) {
		snprintf(k, sizeof(k), "targets.%s.mode", key);
		put_str(t, k, "%s", f->mode);
	}
	snprintf(k, sizeof(k), "targets.%s.min_ratio", key);
	put_num(t, k, min);
	snprintf(k, sizeof(k), "targets.%s.ratio", key);
	put_num(t, k, f->ratio);
	snprintf(k, sizeof(k), "targets.%s.met", key);
	put_bool(t, k, f->ratio >= min);
	CAT(d->tail, "%s%s%s%s %.3f (>= %.2f: %s)", d->tail[1] ? ", " : "targets: ", txt,
	    f->psize ? " " : "", f->psize ? f->mode : "", f->ratio, min,
	    f->ratio >= min ? "met" : "MISSED");
}

static void report_gpu(const struct bench_opts *o, const struct cudaDeviceProp *p, const char *pool,
		       double reg_ms, unsigned long page_kb, const struct figure *f, unsigned n)
{
	char b1[32];
	struct doc *d = doc_new(o, n);
	if (!d)
		return;
	struct point *pts = d->pt;
	struct point *t = &d->top;
	CAT(d->head,
	    "kvstage-bench gpu: %s (sm_%d%d, PCI %04x:%02x:%02x), %s per copy, %u copies "
	    "x %u runs (medians)\n",
	    p->name, p->major, p->minor, p->pciDomainID, p->pciBusID, p->pciDeviceID,
	    bench_size_str(o->gpu_size, b1, sizeof(b1)), o->iters, o->reps);
	CAT(d->head, "pool: %s, %lu KiB pages, registered with CUDA in %.1f ms\n", pool, page_kb,
	    reg_ms);
	CAT(d->head, "baseline: cudaMemcpy between the device and a cudaMallocHost buffer of the "
		     "same bytes, measured beside each figure\n");
	put_str(t, "mode", "gpu");
	put_str(t, "device.name", "%s", p->name);
	put_int(t, "device.sm", (uint64_t)(p->major * 10 + p->minor));
	put_str(t, "device.pci", "%04x:%02x:%02x", p->pciDomainID, p->pciBusID, p->pciDeviceID);
	put_int(t, "size", o->gpu_size);
	put_int(t, "iters", o->iters);
	put_int(t, "reps", o->reps);
	put_str(t, "pool", "%s", pool);
	put_int(t, "pool_page_kb", page_kb);
	put_num(t, "register_ms", reg_ms);
	put_str(t, "baseline", "cudaMemcpy device<->cudaMallocHost, same bytes");
	put(t, "results", U_POINTS);
	d->csv = "figure,page_size,gather_mode,bytes,gbps,baseline,baseline_gbps,ratio,verified";
	d->col0 = "figure";
	d->pt = pts;
	d->npt = n;
	const struct figure *to = NULL, *from = NULL, *g16 = NULL;
	for (unsigned i = 0; i < n; i++) {
		struct point *q = &pts[i];
		snprintf(q->name, sizeof(q->name), "%s", f[i].name);
		put_str(q, "figure", "%s", f[i].name);
		if (f[i].psize) {
			bench_size_str(f[i].psize, b1, sizeof(b1));
			cat(q->name, sizeof(q->name), " %s %s", b1, f[i].mode);
			put_int(q, "page_size", f[i].psize);
			put_str(q, "gather_mode", "%s", f[i].mode);
		}
		fig(q, NULL, "bytes", U_SIZE, (double)f[i].bytes, "bytes");
		struct fig *g = fig(q, NULL, "GB/s", U_NUM, f[i].gbps, "gbps");
		g->bcol = "base GB/s";
		vs(q, g, f[i].base_gbps, NULL, "baseline_gbps", "ratio");
		fig(q, NULL, "base", U_STR, 0, NULL)->s = f[i].base;
		put_str(q, "baseline", "%s", f[i].base);
		fig(q, NULL, "bytes checked", U_STR, 0, NULL)->s = f[i].verified ? "ok" : "WRONG";
		put_bool(q, "verified", f[i].verified);
		if (!strcmp(f[i].name, "to_slot"))
			to = &f[i];
		else if (!strcmp(f[i].name, "from_slot"))
			from = &f[i];
		else if (!strcmp(f[i].name, "gather") && f[i].psize == 16384 &&
			 (!g16 || !strcmp(f[i].mode, "auto")))
			g16 = &f[i];
	}
	CAT(d->tail, "\n");
	target(d, t, "to_slot", "device->slot", to, GPU_TARGET_SLOT);
	target(d, t, "from_slot", "slot->device", from, GPU_TARGET_SLOT);
	target(d, t, "gather_16k", "gather 16K", g16, GPU_TARGET_GATHER);
	CAT(d->tail, "\n");
	report(d);
	doc_free(d);
}

static int run(const struct bench_opts *o, struct gctx *g, struct figure *figs, unsigned *nfig)
{
	unsigned n = 0;
	g->bytes = o->gpu_size;
	struct figure *f = &figs[n++];
	*f = (struct figure){ .name = "to_slot", .bytes = o->gpu_size, .base = "D2H" };
	if (measure(g, op_to_slot, op_base_d2h, f) < 0)
		return -1;
	f->verified = check_to_slot(g) == 0;
	f = &figs[n++];
	*f = (struct figure){ .name = "from_slot", .bytes = o->gpu_size, .base = "H2D" };
	if (measure(g, op_from_slot, op_base_h2d, f) < 0)
		return -1;
	f->verified = check_from_slot(g) == 0;

	for (unsigned pi = 0; pi < o->npsizes; pi++) {
		g->psize = o->psizes[pi];
		g->npages = o->pages ? o->pages : (unsigned)(o->gpu_size / g->psize);
		g->bytes = (uint64_t)g->npages * g->psize;
		uint64_t pool_pages = o->pool / g->psize;
		if (!g->npages || g->npages > pool_pages) {
			fprintf(stderr,
				"kvstage-bench gpu: %" PRIu64 "-byte pages: %u per gather, the "
				"pool holds %" PRIu64 ": skipped\n",
				g->psize, g->npages, pool_pages);
			continue;
		}
		if (make_tables(g, pool_pages) < 0)
			return -1;
		for (int m = 0; m < 3; m++) {
			if (!o->gather_modes[m])
				continue;
			if (kvs_cuda_set_gather_mode(g->c, m) < 0)
				return -1;
			f = &figs[n++];
			*f = (struct figure){ .name = "gather",
					      .mode = mode_str[m],
					      .psize = g->psize,
					      .bytes = g->bytes,
					      .base = "D2H" };
			if (!o->quiet)
				fprintf(stderr,
					"kvstage-bench gpu: gather/scatter %" PRIu64
					"-byte pages, %s\n",
					g->psize, mode_str[m]);
			if (measure(g, op_gather, op_base_d2h, f) < 0)
				return -1;
			f->verified = check_gather(g) == 0;
			f = &figs[n++];
			*f = (struct figure){ .name = "scatter",
					      .mode = mode_str[m],
					      .psize = g->psize,
					      .bytes = g->bytes,
					      .base = "H2D" };
			if (measure(g, op_scatter, op_base_h2d, f) < 0)
				return -1;
			f->verified = check_scatter(g) == 0;
		}
		free_tables(g);
	}
	*nfig = n;
	return 0;
}

static int setup(const struct bench_opts *o, struct gctx *g, uint64_t slot)
{
	CK(cudaSetDevice(o->device));
	/* A blocking stream: the set-up and the byte checks fill buffers with
	 * cudaMemcpy/cudaMemset on the legacy stream, which it is ordered after. */
	CK(cudaStreamCreate(&g->s));
	CK(cudaEventCreate(&g->e0));
	CK(cudaEventCreate(&g->e1));
	CK(cudaMalloc(&g->dsrc, slot));
	CK(cudaMalloc(&g->ddst, slot));
	CK(cudaMallocHost(&g->hpin, slot));
	CK(cudaMalloc((void **)&g->dpool, o->pool));
	CK(cudaMalloc((void **)&g->dpool2, o->pool));
	g->hpool = malloc(o->pool);
	if (!g->hpool)
		return -1;
	fill_random(g->hpool, o->pool);
	CK(cudaMemcpy(g->dpool, g->hpool, o->pool, cudaMemcpyHostToDevice));
	CK(cudaMemset(g->dpool2, 0, o->pool));
	CK(cudaMemset(g->dsrc, 0x5a, slot));
	memset(g->hpin, 0x5a, slot);
	CK(cudaDeviceSynchronize());
	return 0;
}

static void teardown(struct gctx *g)
{
	free_tables(g);
	free(g->hpool);
	cudaFree(g->dpool);
	cudaFree(g->dpool2);
	cudaFreeHost(g->hpin);
	cudaFree(g->dsrc);
	cudaFree(g->ddst);
	if (g->e0)
		cudaEventDestroy(g->e0);
	if (g->e1)
		cudaEventDestroy(g->e1);
	if (g->s)
		cudaStreamDestroy(g->s);
}

int run_gpu(const struct bench_opts *o)
{
	int rc;

	/* No device: say so plainly and stop before starting anything. */
	int ndev = 0;
	cudaError_t e = cudaGetDeviceCount(&ndev);
	if (e != cudaSuccess || ndev == 0) {
		fprintf(stderr, "kvstage-bench gpu: no CUDA device: cudaGetDeviceCount: %s (%s)\n",
			e ? cudaGetErrorName(e) : "0 devices",
			e ? cudaGetErrorString(e) : "no device visible");
		return 2;
	}
	if (o->device >= ndev) {
		fprintf(stderr, "kvstage-bench gpu: --device %d: there are %d\n", o->device, ndev);
		return 2;
	}
	struct cudaDeviceProp prop;
	if (cudaGetDeviceProperties(&prop, o->device) != cudaSuccess)
		memset(&prop, 0, sizeof(prop));

	/* A slot holds one copy and one gather of every page size. */
	uint64_t slot = o->gpu_size;
	for (unsigned i = 0; i < o->npsizes; i++) {
		uint64_t b = (uint64_t)(o->pages ? o->pages : o->gpu_size / o->psizes[i]) *
			     o->psizes[i];
		if (b > slot)
			slot = b;
	}
	slot = (slot + 4095) / 4096 * 4096;

	struct bench_proxy px;
	char pooldesc[160];
	if ((rc = proxy_open(&px, o, slot, 4)))
		return rc;
	if (px.slot_size < slot) { /* a running one */
		fprintf(stderr,
			"kvstage-bench gpu: the proxy at %s has %" PRIu64 "-byte slots; this run "
			"needs %" PRIu64 "\n",
			o->socket, px.slot_size, slot);
		return 2;
	}
	snprintf(pooldesc, sizeof(pooldesc), "%u slots of %" PRIu64 " bytes (%s)", px.slots,
		 px.slot_size, o->socket ? o->socket : "kvstaged started here");

	struct gctx g = { .o = o };
	struct figure figs[2 + 16 * 6];
	unsigned nfig = 0;
	double reg_ms = 0;
	if ((rc = kvs_connect(px.sock, &g.c)) < 0) {
		fprintf(stderr, "kvstage-bench gpu: connect %s: %s\n", px.sock, kvs_strerror(rc));
		rc = 1;
		goto out;
	}
	rc = 1;
	if (kvs_acquire(g.c, 2, g.l) < 0) {
		fprintf(stderr, "kvstage-bench gpu: cannot lease 2 slots\n");
		goto out;
	}
	if (setup(o, &g, px.slot_size) < 0)
		goto out;
	uint64_t t0 = now_ns();
	int r = kvs_cuda_register(g.c);
	reg_ms = (double)(now_ns() - t0) / 1e6;
	if (r < 0) {
		fprintf(stderr, "kvstage-bench gpu: kvs_cuda_register: %s: %s\n", kvs_strerror(r),
			kvs_cuda_last_error());
		goto out;
	}
	unsigned long page_kb = pool_page_kb(g.c);
	if (run(o, &g, figs, &nfig) < 0) {
		fprintf(stderr, "kvstage-bench gpu: measurement failed%s%s\n", g.err ? ": " : "",
			g.err ? kvs_cuda_last_error() : "");
		goto out;
	}
	report_gpu(o, &prop, pooldesc, reg_ms, page_kb, figs, nfig);
	rc = 0;
	for (unsigned i = 0; i < nfig; i++)
		if (!figs[i].verified) {
			fprintf(stderr, "kvstage-bench gpu: %s %s: the bytes were WRONG\n",
				figs[i].name, figs[i].mode ? figs[i].mode : "");
			rc = 1;
		}
out:
	teardown(&g);
	kvs_close(g.c);
	proxy_stop(&px);
	return rc;
}
