/* SPDX-License-Identifier: MIT */
/*
 * The RDMA device layer under the verbs data path (proxy/datapath/verbs.c), on a
 * real RDMA stack: two "proxies" in one process, each with its own pool
 * registered on the device and an RC queue pair connected to the other's.
 *
 * What the fence across hosts rests on, shown for real:
 *   - a READ pulls a peer's slot into one of ours, byte for byte;
 *   - moving a queue pair to the error state completes every outstanding
 *     READ (success or flush): once they are reaped, nothing of ours is
 *     written by that queue pair any more;
 *   - the pool takes no remote write, and refuses a read outside itself.
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

struct side {
	struct kvsp_verbs v;
	uint8_t *pool;
	struct ibv_qp *qp;
	struct kvsp_verbs_ep ep;
};

static struct side A, B;

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
				 2 * DEPTH, why, sizeof(why));
	if (rc == -ENODEV)
		cr_skip_test("no RDMA device here (%s); tools/run-tests.sh runs this suite in the "
			     "soft-RoCE guest: tests/rxe/run.sh -- build/tests/test-verbs", why);
	cr_assert_eq(rc, 0, "%s", why);
	s->qp = kvsp_verbs_qp_new(&s->v, DEPTH, &s->ep);
	cr_assert_not_null(s->qp, "ibv_create_qp: %s", strerror(errno));
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
	struct side *s[] = { &A, &B };
	for (unsigned i = 0; i < 2; i++) {
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

Test(verbs, a_read_pulls_a_peer_slot_into_ours_byte_for_byte)
{
	pair();
	canary_fill(slot(&A, 3), 0xA3, 0, SLOT);
	cr_assert_eq(kvsp_verbs_read(&B.v, B.qp, 7, slot(&B, 5), SLOT, remote(&A, 3), A.ep.rkey), 0);
	struct ibv_wc wc;
	reap(&B, &wc, 1);
	cr_assert_eq(wc.status, IBV_WC_SUCCESS, "%s", ibv_wc_status_str(wc.status));
	cr_assert_eq(wc.wr_id, 7);
	cr_assert_eq(wc.opcode, IBV_WC_RDMA_READ);
	cr_assert_eq(canary_check(slot(&B, 5), 0xA3, 0, SLOT), SLOT, "the slot holds A's bytes");
	cr_assert_eq(canary_check(slot(&A, 3), 0xA3, 0, SLOT), SLOT, "A's slot is unchanged");
	for (unsigned i = 0; i < SLOTS; i++)
		if (i != 5)
			cr_assert_eq(slot(&B, i)[0] | slot(&B, i)[SLOT - 1], 0, "B's slot %u was written", i);
}

Test(verbs, the_error_state_completes_every_outstanding_read)
{
	pair();
	for (unsigned i = 0; i < SLOTS; i++)
		canary_fill(slot(&A, i), 0xA0 + i, 0, SLOT);
	enum { N = 48 };
	for (unsigned k = 0; k < N; k++)
		cr_assert_eq(kvsp_verbs_read(&B.v, B.qp, k, slot(&B, k % SLOTS), SLOT,
					     remote(&A, k % SLOTS), A.ep.rkey), 0);
	cr_assert_eq(kvsp_verbs_qp_error(B.qp), 0);
	struct ibv_wc wc[N];
	reap(&B, wc, N);
	unsigned ok = 0, flushed = 0;
	bool seen[N] = { false };
	for (unsigned k = 0; k < N; k++) {
		cr_assert_lt(wc[k].wr_id, N);
		cr_assert(!seen[wc[k].wr_id], "READ %llu completed twice", (unsigned long long)wc[k].wr_id);
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
	int rc = kvsp_verbs_read(&B.v, B.qp, 99, slot(&B, 0), SLOT, remote(&A, 0), A.ep.rkey);
	if (rc == 0) {
		reap(&B, wc, 1);
		cr_assert_eq(wc[0].status, IBV_WC_WR_FLUSH_ERR, "a READ after the error state ran");
	}
}

Test(verbs, the_pool_takes_no_remote_write)
{
	pair();
	canary_fill(slot(&A, 1), 0xA1, 0, SLOT);
	canary_fill(slot(&B, 2), 0xB2, 0, SLOT);
	struct ibv_sge sge = { (uint64_t)(uintptr_t)slot(&A, 1), SLOT, A.v.mr->lkey };
	struct ibv_send_wr wr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1,
				  .opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED,
				  .wr.rdma = { remote(&B, 2), B.ep.rkey } }, *bad;
	cr_assert_eq(ibv_post_send(A.qp, &wr, &bad), 0);
	struct ibv_wc wc;
	reap(&A, &wc, 1);
	cr_assert_neq(wc.status, IBV_WC_SUCCESS, "a remote WRITE into the pool succeeded");
	cr_log_info("remote write refused: %s", ibv_wc_status_str(wc.status));
	cr_assert_eq(canary_check(slot(&B, 2), 0xB2, 0, SLOT), SLOT, "B's slot changed");
}

Test(verbs, a_read_outside_the_peer_pool_is_refused)
{
	pair();
	canary_fill(slot(&B, 4), 0xB4, 0, SLOT);
	cr_assert_eq(kvsp_verbs_read(&B.v, B.qp, 3, slot(&B, 4), SLOT, remote(&A, SLOTS), A.ep.rkey), 0);
	struct ibv_wc wc;
	reap(&B, &wc, 1);
	cr_assert_neq(wc.status, IBV_WC_SUCCESS, "a READ past the peer's pool succeeded");
	cr_assert_eq(canary_check(slot(&B, 4), 0xB4, 0, SLOT), SLOT, "our slot changed");
}

Test(verbs, a_completion_wakes_the_channel)
{
	pair();
	cr_assert_eq(kvsp_verbs_arm(&B.v), 0);
	cr_assert_eq(kvsp_verbs_read(&B.v, B.qp, 1, slot(&B, 0), SLOT, remote(&A, 0), A.ep.rkey), 0);
	struct pollfd pf = { .fd = B.v.chan->fd, .events = POLLIN };
	cr_assert_eq(poll(&pf, 1, 20000), 1, "the completion channel never woke");
	kvsp_verbs_ack(&B.v);
	struct ibv_wc wc;
	reap(&B, &wc, 1);
	cr_assert_eq(wc.status, IBV_WC_SUCCESS);
}

/* The peer's queue pair is gone (its proxy died): READs towards it get no
 * answer. Moving ours to the error state flushes every one of them, so the
 * slots they would have written can be reaped; none was written. */
Test(verbs, reads_towards_a_dead_peer_are_flushed_and_write_nothing)
{
	pair();
	for (unsigned i = 0; i < SLOTS; i++)
		canary_fill(slot(&A, i), 0xA0 + i, 0, SLOT);
	kvsp_verbs_qp_error(A.qp);
	kvsp_verbs_qp_destroy(A.qp);
	A.qp = NULL;
	enum { N = 16 };
	for (unsigned k = 0; k < N; k++)
		cr_assert_eq(kvsp_verbs_read(&B.v, B.qp, k, slot(&B, k), SLOT, remote(&A, k), A.ep.rkey), 0);
	cr_assert_eq(kvsp_verbs_qp_error(B.qp), 0);
	struct ibv_wc wc[N];
	reap(&B, wc, N);
	for (unsigned k = 0; k < N; k++)
		cr_assert_neq(wc[k].status, IBV_WC_SUCCESS, "READ %llu from a dead peer succeeded",
			      (unsigned long long)wc[k].wr_id);
	for (unsigned i = 0; i < SLOTS; i++)
		cr_assert_eq(slot(&B, i)[0] | slot(&B, i)[SLOT / 2] | slot(&B, i)[SLOT - 1], 0,
			     "slot %u was written by a READ that failed", i);
}
