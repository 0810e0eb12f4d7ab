/* SPDX-License-Identifier: MIT */
/*
 * The RDMA device layer under the verbs data path (proxy/datapath/verbs.c), on a
 * real RDMA stack: two "proxies" in one process, each with its own pool
 * registered on the device and an RC queue pair connected to the other's.
 *
 * What the fence across hosts rests on, shown for real:
 *   - a READ under a chunk's key pulls exactly that chunk, byte for byte;
 *     the pool's own key, a revoked key, an earlier bind's key, a key used
 *     past its chunk or through another queue pair read nothing: the NIC
 *     refuses them, and the refusing queue pair's one receive flushes, so
 *     the proxy hears of it at once;
 *   - region keys (a device without windows) hold to their bytes and die
 *     with their deregistration;
 *   - moving a queue pair to the error state completes every outstanding
 *     READ (success or flush): once they are reaped, nothing of ours is
 *     written by that queue pair any more;
 *   - the pool takes no remote write.
 *
 * There is no RDMA device on the development or CI hosts: there every test
 * skips and says so, and tools/run-tests.sh runs this suite inside the
 * soft-RoCE guest (tests/rxe/run.sh), where rxe0 exists.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "canary.h"
#include "datapath/verbs.h"

#define SLOTS 16
#define SLOT (64 * 1024)
#define DEPTH 64

#define SENTINEL 0x5e

struct side {
	struct kvsp_verbs v;
	uint8_t *pool;
	struct ibv_qp *qp;
	struct kvsp_verbs_ep ep;
};

static struct side A, B, C;
static enum kvsp_keys keys = KVSP_KEYS_WINDOW;
/* Every window made, freed before any queue pair (verbs.h); then the
 * regions under them, or the pool's protection domain stays busy and its
 * close leaks (ASan sees it). */
static struct ibv_mw *windows[64];
static unsigned nwindows;
static struct ibv_mr *regions[64];
static unsigned nregions;

static void free_windows(void)
{
	while (nwindows)
		kvsp_verbs_mw_free(windows[--nwindows]);
	while (nregions)
		kvsp_verbs_region_free(regions[--nregions]);
}

static uint8_t *slot(struct side *s, unsigned i)
{
	return s->pool + (size_t)i * SLOT;
}

static void open_side(struct side *s)
{
	char why[256];
	s->pool = aligned_alloc(4096, (size_t)SLOTS * SLOT);
	cr_assert_not_null(s->pool);
	memset(s->pool, 0, (size_t)SLOTS * SLOT);
	const char *dev = getenv("RXE_DEV");
	int rc = kvsp_verbs_open(&s->v, dev && *dev ? dev : NULL, -1, s->pool, (size_t)SLOTS * SLOT,
				 4 * DEPTH, keys, why, sizeof(why));
	if (rc == -ENODEV)
		cr_skip_test("no RDMA device here (%s); tools/run-tests.sh runs this suite in the "
			     "soft-RoCE guest: tests/rxe/run.sh -- build/tests/test-verbs",
			     why);
	cr_assert_eq(rc, 0, "%s", why);
	cr_assert_eq(s->v.keys, keys, "the keys asked for are in force");
	s->qp = kvsp_verbs_qp_new(&s->v, DEPTH, &s->ep);
	cr_assert_not_null(s->qp, "ibv_create_qp: %s", strerror(errno));
	cr_assert_eq(kvsp_verbs_sentinel(s->qp, SENTINEL), 0);
}

/* Two sides, their queue pairs connected to each other. */
static void pair(void)
{
	open_side(&A);
	open_side(&B);
	cr_assert_eq(kvsp_verbs_qp_connect(&A.v, A.qp, &A.ep, &B.ep), 0);
	cr_assert_eq(kvsp_verbs_qp_connect(&B.v, B.qp, &B.ep, &A.ep), 0);
}

static void fini(void)
{
	free_windows();
	struct side *s[] = { &A, &B, &C };
	for (unsigned i = 0; i < 3; i++) {
		if (s[i]->qp) {
			kvsp_verbs_qp_error(s[i]->qp);
			kvsp_verbs_qp_destroy(s[i]->qp);
		}
		if (s[i]->v.ctx)
			kvsp_verbs_close(&s[i]->v);
		free(s[i]->pool);
	}
}

TestSuite(verbs, .fini = fini, .timeout = 60);

static uint64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* n completions on s's CQ, or the test fails after 20 s without them. */
static void reap(struct side *s, struct ibv_wc *wc, int n)
{
	uint64_t until = now_ms() + 20000;
	int got = 0;
	while (got < n) {
		int k = kvsp_verbs_poll(&s->v, wc + got, n - got);
		cr_assert_geq(k, 0);
		got += k;
		cr_assert(got == n || now_ms() < until, "%d of %d completions after 20 s", got, n);
	}
}

static uint64_t remote(const struct side *s, unsigned i)
{
	return s->ep.pool_addr + (uint64_t)i * SLOT;
}

/* A window of s's bound through qp over len bytes of its slot i, as the
 * proxy binds one: over a region of the chunk's own where the device does
 * not keep a READ inside a window (rxe), else over the pool's. Returns the
 * key, honoured once this returns (the bind completed). */
static uint32_t bind_on(struct side *s, struct ibv_qp *qp, struct ibv_mw **mw, unsigned i,
			uint32_t len)
{
	if (!*mw) {
		*mw = kvsp_verbs_mw_new(&s->v);
		cr_assert_not_null(*mw, "ibv_alloc_mw: %s", strerror(errno));
		windows[nwindows++] = *mw;
	}
	struct ibv_mr *under = NULL;
	if (s->v.window_on_region) {
		under = kvsp_verbs_region_new(&s->v, slot(s, i), len, true);
		cr_assert_not_null(under, "ibv_reg_mr: %s", strerror(errno));
		cr_assert_lt(nregions, 64);
		regions[nregions++] = under;
	}
	uint32_t key = (*mw)->rkey;
	cr_assert_eq(kvsp_verbs_bind(&s->v, qp, 0xb1, *mw, under, slot(s, i), len, &key), 0);
	struct ibv_wc wc;
	reap(s, &wc, 1);
	cr_assert_eq(wc.wr_id, 0xb1);
	cr_assert_eq(wc.status, IBV_WC_SUCCESS, "bind: %s", ibv_wc_status_str(wc.status));
	(*mw)->rkey = key;
	return key;
}

static void invalidate(struct side *s, uint32_t key)
{
	cr_assert_eq(kvsp_verbs_invalidate(s->qp, 0x1e, key), 0);
	struct ibv_wc wc;
	reap(s, &wc, 1);
	cr_assert_eq(wc.wr_id, 0x1e);
	cr_assert_eq(wc.status, IBV_WC_SUCCESS, "invalidate: %s", ibv_wc_status_str(wc.status));
}

/* B READs len bytes of A's at raddr with key into its slot 5. Returns the READ's status. */
static enum ibv_wc_status read_a(uint64_t raddr, uint32_t key, uint32_t len)
{
	canary_fill(slot(&B, 5), 0xB5, 0, SLOT);
	cr_assert_eq(kvsp_verbs_read(&B.v, B.qp, 7, slot(&B, 5), len, raddr, key), 0);
	struct ibv_wc wc;
	do
		reap(&B, &wc, 1);
	while (wc.wr_id == SENTINEL); /* B's own flushes once its READ failed */
	cr_assert_eq(wc.wr_id, 7);
	return wc.status;
}

/* A refused B's READ: the READ failed at B, A's slot 5 of B's is as it
 * was, and A's queue pair went to the error state, which flushed A's one
 * receive. */
static void refused(enum ibv_wc_status st, const char *what)
{
	cr_assert_neq(st, IBV_WC_SUCCESS, "%s: the READ succeeded", what);
	cr_log_info("%s: %s", what, ibv_wc_status_str(st));
	cr_assert_eq(canary_check(slot(&B, 5), 0xB5, 0, SLOT), SLOT, "%s: our slot was written",
		     what);
	struct ibv_wc wc;
	reap(&A, &wc, 1);
	cr_assert_eq(wc.wr_id, SENTINEL, "%s: the refusing side's first completion", what);
	cr_assert_eq(wc.status, IBV_WC_WR_FLUSH_ERR, "%s: its receive: %s", what,
		     ibv_wc_status_str(wc.status));
}

Test(verbs, a_window_key_reads_exactly_its_chunk_byte_for_byte)
{
	pair();
	canary_fill(slot(&A, 3), 0xA3, 0, SLOT);
	struct ibv_mw *mw = NULL;
	uint32_t key = bind_on(&A, A.qp, &mw, 3, SLOT);
	cr_assert_eq(read_a(remote(&A, 3), key, SLOT), IBV_WC_SUCCESS);
	cr_assert_eq(canary_check(slot(&B, 5), 0xA3, 0, SLOT), SLOT, "the slot holds A's bytes");
	cr_assert_eq(canary_check(slot(&A, 3), 0xA3, 0, SLOT), SLOT, "A's slot is unchanged");
	for (unsigned i = 0; i < SLOTS; i++)
		if (i != 5)
			cr_assert_eq(slot(&B, i)[0] | slot(&B, i)[SLOT - 1], 0,
				     "B's slot %u was written", i);
	invalidate(&A, key);
}

Test(verbs, the_pools_own_key_reads_nothing)
{
	pair();
	refused(read_a(remote(&A, 3), A.v.mr->rkey, 64), "the pool's key");
}

Test(verbs, a_revoked_window_key_reads_nothing)
{
	pair();
	struct ibv_mw *mw = NULL;
	uint32_t key = bind_on(&A, A.qp, &mw, 3, SLOT);
	invalidate(&A, key);
	refused(read_a(remote(&A, 3), key, 64), "a revoked key");
}

Test(verbs, an_earlier_binds_key_reads_nothing)
{
	pair();
	struct ibv_mw *mw = NULL;
	uint32_t old = bind_on(&A, A.qp, &mw, 3, SLOT);
	invalidate(&A, old);
	uint32_t key = bind_on(&A, A.qp, &mw, 3, SLOT);
	cr_assert_neq(key, old, "a fresh tag each bind");
	refused(read_a(remote(&A, 3), old, 64), "the earlier bind's key");
}

Test(verbs, a_window_key_reads_nothing_past_its_chunk)
{
	pair();
	struct ibv_mw *mw = NULL;
	uint32_t key = bind_on(&A, A.qp, &mw, 3, SLOT / 2);
	refused(read_a(remote(&A, 3), key, SLOT / 2 + 1), "one byte past the chunk");
}

Test(verbs, a_window_key_reads_nothing_before_its_chunk)
{
	pair();
	struct ibv_mw *mw = NULL;
	uint32_t key = bind_on(&A, A.qp, &mw, 3, SLOT);
	refused(read_a(remote(&A, 2), key, 64), "the slot before the chunk");
}

/* What open found by trying is what the device does: a window over the
 * pool's own region keeps a READ inside its bytes on a device that
 * confines windows, and not on one that does not (rxe checks only the
 * region under a window: kernel drivers/infiniband/sw/rxe/rxe_resp.c,
 * check_rkey). The proxy puts a region under each window there. */
Test(verbs, open_tells_whether_the_device_keeps_a_read_inside_its_window)
{
	pair();
	cr_assert_neq(A.v.window_confines, -1, "the trial at open did not finish");
	cr_assert_eq(A.v.window_on_region, A.v.window_confines != 1);
	struct ibv_mw *mw = kvsp_verbs_mw_new(&A.v);
	cr_assert_not_null(mw);
	windows[nwindows++] = mw;
	uint32_t key = mw->rkey;
	cr_assert_eq(kvsp_verbs_bind(&A.v, A.qp, 0xb1, mw, NULL, slot(&A, 3), SLOT, &key), 0);
	struct ibv_wc wc;
	reap(&A, &wc, 1);
	cr_assert_eq(wc.status, IBV_WC_SUCCESS);
	enum ibv_wc_status st = read_a(remote(&A, 4), key, 64); /* the slot after the window */
	cr_log_info("%s: a window over the pool's region, READ past it: %s", A.v.name,
		    ibv_wc_status_str(st));
	cr_assert_eq(st != IBV_WC_SUCCESS, A.v.window_confines == 1,
		     "open said the device %s a READ inside its window; the READ past it %s",
		     A.v.window_confines == 1 ? "keeps" : "does not keep",
		     st == IBV_WC_SUCCESS ? "got through" : "was refused");
}

/* A third side C has its own queue pair to A; a key A bound through the
 * queue pair B reads from is no use to C. */
Test(verbs, a_window_key_is_its_queue_pairs_alone)
{
	pair();
	open_side(&C);
	struct kvsp_verbs_ep a2;
	struct ibv_qp *qp2 = kvsp_verbs_qp_new(&A.v, DEPTH, &a2);
	cr_assert_not_null(qp2);
	cr_assert_eq(kvsp_verbs_sentinel(qp2, SENTINEL + 1), 0);
	cr_assert_eq(kvsp_verbs_qp_connect(&A.v, qp2, &a2, &C.ep), 0);
	cr_assert_eq(kvsp_verbs_qp_connect(&C.v, C.qp, &C.ep, &a2), 0);
	canary_fill(slot(&A, 3), 0xA3, 0, SLOT);
	struct ibv_mw *mw = NULL;
	uint32_t key = bind_on(&A, A.qp, &mw, 3, SLOT);
	canary_fill(slot(&C, 1), 0xC1, 0, SLOT);
	cr_assert_eq(kvsp_verbs_read(&C.v, C.qp, 9, slot(&C, 1), 64, remote(&A, 3), key), 0);
	struct ibv_wc wc;
	reap(&C, &wc, 1);
	cr_assert_eq(wc.wr_id, 9);
	cr_assert_neq(wc.status, IBV_WC_SUCCESS, "another queue pair read with B's key");
	cr_assert_eq(canary_check(slot(&C, 1), 0xC1, 0, SLOT), SLOT, "C's slot was written");
	reap(&A, &wc, 1);
	cr_assert_eq(wc.wr_id, SENTINEL + 1, "the queue pair C reads through refused it");
	/* B's, bound, still reads. */
	cr_assert_eq(read_a(remote(&A, 3), key, SLOT), IBV_WC_SUCCESS);
	cr_assert_eq(canary_check(slot(&B, 5), 0xA3, 0, SLOT), SLOT);
	kvsp_verbs_qp_error(qp2);
	free_windows();
	kvsp_verbs_qp_destroy(qp2);
}

/* No windows asked for: each chunk gets a region of its own. */
Test(verbs, a_region_key_reads_its_chunk_until_deregistered)
{
	keys = KVSP_KEYS_REGION;
	pair();
	canary_fill(slot(&A, 3), 0xA3, 0, SLOT);
	struct ibv_mr *mr = kvsp_verbs_region_new(&A.v, slot(&A, 3), SLOT / 2, false);
	cr_assert_not_null(mr, "ibv_reg_mr: %s", strerror(errno));
	cr_assert_eq(read_a(remote(&A, 3), mr->rkey, SLOT / 2), IBV_WC_SUCCESS);
	cr_assert_eq(canary_check(slot(&B, 5), 0xA3, 0, SLOT / 2), SLOT / 2);
	uint32_t key = mr->rkey;
	kvsp_verbs_region_free(mr);
	refused(read_a(remote(&A, 3), key, 64), "a deregistered region's key");
}

Test(verbs, a_region_key_reads_nothing_past_its_chunk)
{
	keys = KVSP_KEYS_REGION;
	pair();
	struct ibv_mr *mr = kvsp_verbs_region_new(&A.v, slot(&A, 3), SLOT / 2, false);
	cr_assert_not_null(mr);
	refused(read_a(remote(&A, 3), mr->rkey, SLOT / 2 + 1), "one byte past the region");
	kvsp_verbs_region_free(mr);
}

Test(verbs, the_error_state_completes_every_outstanding_read)
{
	pair();
	struct ibv_mw *mw[SLOTS] = { NULL };
	uint32_t key[SLOTS];
	for (unsigned i = 0; i < SLOTS; i++) {
		canary_fill(slot(&A, i), 0xA0 + i, 0, SLOT);
		key[i] = bind_on(&A, A.qp, &mw[i], i, SLOT);
	}
	enum { N = 48 };
	for (unsigned k = 0; k < N; k++)
		cr_assert_eq(kvsp_verbs_read(&B.v, B.qp, k, slot(&B, k % SLOTS), SLOT,
					     remote(&A, k % SLOTS), key[k % SLOTS]),
			     0);
	cr_assert_eq(kvsp_verbs_qp_error(B.qp), 0);
	struct ibv_wc wc[N + 1];
	reap(&B, wc, N + 1);
	unsigned ok = 0, flushed = 0;
	bool seen[N] = { false };
	for (unsigned k = 0; k < N + 1; k++) {
		if (wc[k].wr_id == SENTINEL) {
			cr_assert_eq(wc[k].status, IBV_WC_WR_FLUSH_ERR);
			continue;
		}
		cr_assert_lt(wc[k].wr_id, N);
		cr_assert(!seen[wc[k].wr_id], "READ %llu completed twice",
			  (unsigned long long)wc[k].wr_id);
		seen[wc[k].wr_id] = true;
		if (wc[k].status == IBV_WC_SUCCESS)
			ok++;
		else if (wc[k].status == IBV_WC_WR_FLUSH_ERR)
			flushed++;
		else
			cr_assert_fail("READ %llu: %s", (unsigned long long)wc[k].wr_id,
				       ibv_wc_status_str(wc[k].status));
	}
	cr_log_info("%u READs done, %u flushed by the error state", ok, flushed);
	/* Every one came back, and nothing more will: the queue pair is dead. */
	cr_assert_eq(kvsp_verbs_poll(&B.v, wc, N), 0);
	int rc = kvsp_verbs_read(&B.v, B.qp, 99, slot(&B, 0), SLOT, remote(&A, 0), key[0]);
	if (rc == 0) {
		reap(&B, wc, 1);
		cr_assert_eq(wc[0].status, IBV_WC_WR_FLUSH_ERR, "a READ after the error state ran");
	}
}

/* A's WRITE into B's slot 2 with key: refused, and the slot unchanged. */
static void write_refused(uint32_t key, const char *what)
{
	canary_fill(slot(&A, 1), 0xA1, 0, SLOT);
	canary_fill(slot(&B, 2), 0xB2, 0, SLOT);
	struct ibv_sge sge = { (uint64_t)(uintptr_t)slot(&A, 1), SLOT, A.v.mr->lkey };
	struct ibv_send_wr wr = { .wr_id = 1,
				  .sg_list = &sge,
				  .num_sge = 1,
				  .opcode = IBV_WR_RDMA_WRITE,
				  .send_flags = IBV_SEND_SIGNALED,
				  .wr.rdma = { remote(&B, 2), key } },
			   *bad;
	cr_assert_eq(ibv_post_send(A.qp, &wr, &bad), 0);
	struct ibv_wc wc;
	do
		reap(&A, &wc, 1);
	while (wc.wr_id == SENTINEL);
	cr_assert_neq(wc.status, IBV_WC_SUCCESS, "%s: a remote WRITE into the pool succeeded",
		      what);
	cr_assert_neq(wc.status, IBV_WC_WR_FLUSH_ERR, "%s: flushed, not refused", what);
	cr_log_info("%s: remote write refused: %s", what, ibv_wc_status_str(wc.status));
	cr_assert_eq(canary_check(slot(&B, 2), 0xB2, 0, SLOT), SLOT, "%s: B's slot changed", what);
}

Test(verbs, the_pool_takes_no_remote_write)
{
	pair();
	write_refused(B.v.mr->rkey, "the pool's key");
}

Test(verbs, a_window_key_takes_no_remote_write)
{
	pair();
	struct ibv_mw *mw = NULL;
	write_refused(bind_on(&B, B.qp, &mw, 2, SLOT), "a chunk's READ key");
}

Test(verbs, a_completion_wakes_the_channel)
{
	pair();
	struct ibv_mw *mw = NULL;
	uint32_t key = bind_on(&A, A.qp, &mw, 0, SLOT);
	cr_assert_eq(kvsp_verbs_arm(&B.v), 0);
	cr_assert_eq(kvsp_verbs_read(&B.v, B.qp, 1, slot(&B, 0), SLOT, remote(&A, 0), key), 0);
	struct pollfd pf = { .fd = B.v.chan->fd, .events = POLLIN };
	cr_assert_eq(poll(&pf, 1, 20000), 1, "the completion channel never woke");
	kvsp_verbs_ack(&B.v);
	struct ibv_wc wc;
	reap(&B, &wc, 1);
	cr_assert_eq(wc.status, IBV_WC_SUCCESS);
}

/* A refused READ wakes the refusing side's channel: its receive flushed. */
Test(verbs, a_refused_read_wakes_the_refusing_side)
{
	pair();
	cr_assert_eq(kvsp_verbs_arm(&A.v), 0);
	cr_assert_neq(read_a(remote(&A, 0), A.v.mr->rkey, 64), IBV_WC_SUCCESS);
	struct pollfd pf = { .fd = A.v.chan->fd, .events = POLLIN };
	cr_assert_eq(poll(&pf, 1, 20000), 1, "the refusing side's channel never woke");
	kvsp_verbs_ack(&A.v);
	struct ibv_wc wc;
	reap(&A, &wc, 1);
	cr_assert_eq(wc.wr_id, SENTINEL);
}

/* The peer's queue pair is gone (its proxy died): READs towards it get no
 * answer. Moving ours to the error state flushes every one of them, so the
 * slots they would have written can be reaped; none was written. */
Test(verbs, reads_towards_a_dead_peer_are_flushed_and_write_nothing)
{
	pair();
	struct ibv_mw *mw[SLOTS] = { NULL };
	uint32_t key[SLOTS];
	for (unsigned i = 0; i < SLOTS; i++) {
		canary_fill(slot(&A, i), 0xA0 + i, 0, SLOT);
		key[i] = bind_on(&A, A.qp, &mw[i], i, SLOT);
	}
	kvsp_verbs_qp_error(A.qp);
	free_windows();
	kvsp_verbs_qp_destroy(A.qp);
	A.qp = NULL;
	enum { N = 16 };
	for (unsigned k = 0; k < N; k++)
		cr_assert_eq(
			kvsp_verbs_read(&B.v, B.qp, k, slot(&B, k), SLOT, remote(&A, k), key[k]),
			0);
	cr_assert_eq(kvsp_verbs_qp_error(B.qp), 0);
	struct ibv_wc wc[N + 1];
	reap(&B, wc, N + 1);
	for (unsigned k = 0; k < N + 1; k++)
		cr_assert_neq(wc[k].status, IBV_WC_SUCCESS, "READ %llu from a dead peer succeeded",
			      (unsigned long long)wc[k].wr_id);
	for (unsigned i = 0; i < SLOTS; i++)
		cr_assert_eq(slot(&B, i)[0] | slot(&B, i)[SLOT / 2] | slot(&B, i)[SLOT - 1], 0,
			     "slot %u was written by a READ that failed", i);
}
