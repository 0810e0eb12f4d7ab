/* SPDX-License-Identifier: MIT */
/*
 * libkvstage_cuda against a real kvstaged.
 *
 * Everywhere: every refusal comes before any CUDA work, with the CPU path's
 * answer (-ESTALE, -EPERM, -EBUSY, -EINVAL past the slot's end or for a
 * gather that overflows it). Without a device (this is what CI's machines
 * have): every entry point says -ENODEV and why, and nothing crashes. With a
 * device: bytes go device -> slot -> local room -> slot -> device, and
 * gather/scatter of a shuffled page table round-trip exactly, in every
 * gather mode. Tests that need the other kind of machine skip and say so.
 */
#include <criterion/criterion.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cuda_runtime_api.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "canary.h"
#include "harness.h"
#include "kvstage_cuda.h"

#define SLOTS 16
#define SLOT (256 * 1024)

static struct proxy px = PROXY_INIT;

static void setup(void)
{
	proxy_start(&px, NULL, (const char *[]){ "--slots", "16", "--slot-size", "256K", NULL });
}

static void teardown(void)
{
	proxy_stop(&px);
}

TestSuite(cuda, .init = setup, .fini = teardown, .timeout = 120);

/* Whether this machine has a CUDA device; *why says what CUDA answered.
 * Asked inside each test's own process (Criterion forks per test). */
static bool have_device(char *why, size_t cap)
{
	int n = 0;
	cudaError_t e = cudaGetDeviceCount(&n);
	if (e == cudaSuccess && n == 0)
		e = cudaErrorNoDevice;
	snprintf(why, cap, "%s (%s)", cudaGetErrorName(e), cudaGetErrorString(e));
	return e == cudaSuccess;
}

#define NEED_DEVICE(what)                     \
	char why_[256];                       \
	if (!have_device(why_, sizeof(why_))) \
	cr_skip_test("no CUDA device here (cudaGetDeviceCount: %s): not tested: %s", why_, what)

#define CK(call)                                                                        \
	do {                                                                            \
		cudaError_t e_ = (call);                                                \
		cr_assert_eq(e_, cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_)); \
	} while (0)

/* Addresses no copy may ever use: if a refused call queued anything with
 * them, CUDA would answer with its own error instead of ours. */
#define BOGUS ((void *)0xdead0000)

/* Every entry point that names a lease, on one lease: the answers in order
 * copy_to, copy_from, gather, scatter, gather_idx, scatter_idx. */
static void each_entry(kvs_client *c, const struct kvs_lease *l, void *dev, int out[6])
{
	const void *pages[2] = { dev, dev };
	void *wpages[2] = { dev, dev };
	const int32_t idx[2] = { 0, 1 };
	out[0] = kvs_cuda_copy_to_slot(c, l, 0, dev, 4096, NULL, NULL);
	out[1] = kvs_cuda_copy_from_slot(c, l, 0, dev, 4096, NULL, NULL);
	out[2] = kvs_cuda_gather(c, l, 0, pages, 2, 4096, NULL, NULL);
	out[3] = kvs_cuda_scatter(c, l, 0, wpages, 2, 4096, NULL, NULL);
	out[4] = kvs_cuda_gather_idx(c, l, 0, dev, idx, 2, 4096, NULL, NULL);
	out[5] = kvs_cuda_scatter_idx(c, l, 0, dev, idx, 2, 4096, NULL, NULL);
}

static const char *const entry_name[6] = { "copy_to_slot", "copy_from_slot", "gather",
					   "scatter",	   "gather_idx",     "scatter_idx" };

static void assert_all(const int got[6], int want, const char *what)
{
	for (int i = 0; i < 6; i++)
		cr_assert_eq(got[i], want, "%s: kvs_cuda_%s gave %d (%s), want %d (%s)", what,
			     entry_name[i], got[i], kvs_strerror(got[i]), want, kvs_strerror(want));
}

/* Every entry point refuses l with want, on the client's side alone: the
 * proxy counts no refusal for any of them. */
/* Every refusal the proxy counts, whatever its reason. */
static uint64_t refusals(void)
{
	return stat_get(&px, "rej_stale") + stat_get(&px, "rej_perm") + stat_get(&px, "rej_busy") +
	       stat_get(&px, "rej_inval");
}

static void refused(kvs_client *c, const struct kvs_lease *l, void *dev, int want, const char *what)
{
	uint64_t before = refusals();
	int got[6];
	each_entry(c, l, dev, got);
	assert_all(got, want, what);
	cr_assert_eq(refusals(), before, "%s: a refusal reached the proxy", what);
}

Test(cuda, without_a_device_every_entry_point_is_enodev)
{
	char why[256];
	if (have_device(why, sizeof(why)))
		cr_skip_test(
			"a CUDA device is present (%s): the no-device answers are not reachable "
			"on this machine",
			why);
	kvs_client *c = connect_ok(&px);
	struct kvs_lease l;
	cr_assert_eq(kvs_acquire(c, 1, &l), 0);

	cr_assert_eq(kvs_cuda_register(c), -ENODEV);
	const char *msg = kvs_cuda_last_error();
	cr_assert(strstr(msg, "no CUDA device") && strstr(msg, "cudaGetDeviceCount"),
		  "unclear message: \"%s\"", msg);
	cr_assert(strstr(msg, why) != NULL, "the message does not say what CUDA answered (%s): %s",
		  why, msg);

	int got[6];
	each_entry(c, &l, BOGUS, got);
	assert_all(got, -ENODEV, "a held lease, no device");
	cr_assert_eq(kvs_cuda_set_gather_mode(c, KVS_CUDA_GATHER_KERNEL), -ENODEV);
	/* Zero bytes and zero pages still need a device (they record an event). */
	cr_assert_eq(kvs_cuda_copy_to_slot(c, &l, 0, NULL, 0, NULL, NULL), -ENODEV);
	cr_assert_eq(kvs_cuda_gather(c, &l, 0, NULL, 0, 4096, NULL, NULL), -ENODEV);
	/* The last byte of the slot is in range: refused for the device alone. */
	cr_assert_eq(kvs_cuda_copy_to_slot(c, &l, SLOT - 1, BOGUS, 1, NULL, NULL), -ENODEV);
	cr_assert_eq(kvs_cuda_gather(c, &l, 0, (const void *[]){ BOGUS }, 1, SLOT, NULL, NULL),
		     -ENODEV, "a page the size of the slot fits");
	/* Nothing to undo: harmless, device or not. */
	cr_assert_eq(kvs_cuda_unregister(c), 0);

	/* The CPU path is untouched by all this. */
	cr_assert_not_null(kvs_lease_ptr(c, &l));
	cr_assert_eq(kvs_release(c, &l), 0);
	kvs_close(c);
	wait_idle(&px, 0);
}

Test(cuda, lease_refusals_come_first_and_match_the_cpu_path)
{
	char why[256];
	bool dev_ok = have_device(why, sizeof(why));
	kvs_client *a = connect_ok(&px), *b = connect_ok(&px);

	/* With a device, refusals are tried with real memory: were anything
	 * queued, it would land in b's slot, and the canary would show it. */
	void *dev = BOGUS;
	if (dev_ok) {
		CK(cudaMalloc(&dev, SLOT));
		CK(cudaMemset(dev, 0x5a, SLOT));
	}

	/* Stale: a's lease after it gave the slot back. */
	struct kvs_lease old;
	cr_assert_eq(kvs_acquire(a, 1, &old), 0);
	cr_assert_eq(kvs_release(a, &old), 0);
	cr_assert_eq(kvs_release(a, &old), -ESTALE);
	refused(a, &old, dev, -ESTALE, "an old epoch");

	/* Someone else's: b holds the slot, a names it. */
	struct kvs_lease bl;
	cr_assert_eq(kvs_acquire(b, 1, &bl), 0);
	canary_fill(kvs_lease_ptr(b, &bl), 77, 0, SLOT);
	cr_assert_eq(kvs_release(a, &bl), -EPERM);
	refused(a, &bl, dev, -EPERM, "b's slot named by a");
	cr_assert_eq(kvs_cuda_register(a), dev_ok ? 0 : -ENODEV);
	refused(a, &bl, dev, -EPERM, "b's slot named by a, a registered");

	/* No such slot. */
	struct kvs_lease none = { .slot = SLOTS + 3, .epoch = 1 };
	cr_assert_eq(kvs_release(a, &none), -EINVAL);
	refused(a, &none, dev, -EINVAL, "a slot past the pool");

	/* In flight: sent, and held inside the transport by a failpoint. */
	kvs_room *rr, *sr;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(b, SLOT, 1, &rr, &d), 0);
	cr_assert_eq(kvs_send_open(a, &d, 2, &sr), 0);
	struct kvs_lease fl;
	cr_assert_eq(kvs_acquire(a, 1, &fl), 0);
	canary_fill(kvs_lease_ptr(a, &fl), 78, 0, SLOT);
	uint64_t match = 2;
	fp_set(&px, "local.quiesce", "pause", &match);
	cr_assert_eq(kvs_send(sr, &fl, 0, SLOT), 0);
	fp_wait(&px, "local.quiesce", 1);
	cr_assert_eq(slot_pub(&px, fl.slot).state, KVS_SLOT_INFLIGHT);
	cr_assert_eq(kvs_release(a, &fl), -EBUSY);
	refused(a, &fl, dev, -EBUSY, "a slot in flight");
	fp_set(&px, "local.quiesce", "off", NULL);
	cr_assert_eq(wait_event(b).type, KVS_EV_RECV_DONE);
	cr_assert_eq(wait_event(a).type, KVS_EV_SEND_DONE);

	/* Handed over: the sender's lease is stale now, the bytes the receiver's. */
	refused(a, &fl, dev, -ESTALE, "a slot handed to the receiver");
	struct kvs_lease rl;
	cr_assert_eq(kvs_room_lease(rr, 0, &rl), 0);
	refused(a, &rl, dev, -EPERM, "the receiver's slot named by the sender");

	if (dev_ok)
		CK(cudaDeviceSynchronize());
	cr_assert_eq(canary_check(kvs_lease_ptr(b, &bl), 77, 0, SLOT), SLOT,
		     "a refused copy wrote into b's slot");
	cr_assert_eq(canary_check(kvs_lease_ptr(b, &rl), 78, 0, SLOT), SLOT,
		     "a refused copy wrote into the received slot");
	if (dev_ok)
		CK(cudaFree(dev));
	kvs_room_close(rr);
	kvs_room_close(sr);
	kvs_close(a);
	kvs_close(b);
	wait_idle(&px, 0);
}

Test(cuda, past_the_slot_end_is_einval_before_the_device)
{
	kvs_client *c = connect_ok(&px);
	struct kvs_lease l;
	cr_assert_eq(kvs_acquire(c, 1, &l), 0);
	void *p = BOGUS;
	cr_assert_eq(kvs_cuda_copy_to_slot(c, &l, 0, p, SLOT + 1, NULL, NULL), -EINVAL);
	cr_assert_eq(kvs_cuda_copy_to_slot(c, &l, 1, p, SLOT, NULL, NULL), -EINVAL);
	cr_assert_eq(kvs_cuda_copy_to_slot(c, &l, SLOT, p, 1, NULL, NULL), -EINVAL);
	cr_assert_eq(kvs_cuda_copy_to_slot(c, &l, SLOT + 1, p, 0, NULL, NULL), -EINVAL);
	cr_assert_eq(kvs_cuda_copy_from_slot(c, &l, 16, p, SIZE_MAX - 8, NULL, NULL), -EINVAL,
		     "off + len wraps");
	cr_assert_eq(kvs_cuda_copy_from_slot(c, &l, SIZE_MAX, p, 2, NULL, NULL), -EINVAL);
	cr_assert(strstr(kvs_cuda_last_error(), "past the slot's end") != NULL, "%s",
		  kvs_cuda_last_error());

	/* Gather into one slot must fit it. */
	enum { N = SLOT / 4096 };
	const void *pages[N + 1];
	void *wpages[N + 1];
	int32_t idx[N + 1];
	for (int i = 0; i <= N; i++) {
		pages[i] = wpages[i] = (char *)p + (size_t)i * 4096;
		idx[i] = i;
	}
	cr_assert_eq(kvs_cuda_gather(c, &l, 0, pages, N + 1, 4096, NULL, NULL), -EINVAL);
	cr_assert_eq(kvs_cuda_scatter(c, &l, 0, wpages, N + 1, 4096, NULL, NULL), -EINVAL);
	cr_assert_eq(kvs_cuda_gather_idx(c, &l, 0, p, idx, N + 1, 4096, NULL, NULL), -EINVAL);
	cr_assert_eq(kvs_cuda_scatter_idx(c, &l, 0, p, idx, N + 1, 4096, NULL, NULL), -EINVAL);
	cr_assert_eq(kvs_cuda_gather(c, &l, 1, pages, N, 4096, NULL, NULL), -EINVAL,
		     "one byte of offset pushes the last page out");
	cr_assert_eq(kvs_cuda_gather(c, &l, 0, pages, 3, SIZE_MAX / 2, NULL, NULL), -EINVAL,
		     "npages * page_size wraps");
	cr_assert_eq(kvs_cuda_gather(c, &l, SLOT + 4096, pages, 0, 4096, NULL, NULL), -EINVAL);
	cr_assert(strstr(kvs_cuda_last_error(), "do not fit") != NULL, "%s", kvs_cuda_last_error());

	char why[256];
	if (!have_device(why, sizeof(why))) {
		/* The ranges that do fit pass to the device check. */
		cr_assert_eq(kvs_cuda_gather(c, &l, 0, pages, N, 4096, NULL, NULL), -ENODEV);
		cr_assert_eq(kvs_cuda_gather(c, &l, 4096, pages, N - 1, 4096, NULL, NULL), -ENODEV);
		cr_assert_eq(kvs_cuda_copy_to_slot(c, &l, 0, p, SLOT, NULL, NULL), -ENODEV);
	}
	kvs_close(c);
	wait_idle(&px, 0);
}

Test(cuda, bad_arguments_are_einval_before_the_lease)
{
	kvs_client *c = connect_ok(&px);
	struct kvs_lease l, stale;
	cr_assert_eq(kvs_acquire(c, 1, &stale), 0);
	cr_assert_eq(kvs_release(c, &stale), 0);
	cr_assert_eq(kvs_acquire(c, 1, &l), 0);
	void *p = BOGUS;
	const void *pages[2] = { p, NULL };
	void *wpages[2] = { p, p };
	const int32_t idx[2] = { 0, -1 };
	const int32_t good[2] = { 0, 1 };

	cr_assert_eq(kvs_cuda_register(NULL), -EINVAL);
	cr_assert_eq(kvs_cuda_unregister(NULL), -EINVAL);
	cr_assert_eq(kvs_cuda_copy_to_slot(NULL, &l, 0, p, 1, NULL, NULL), -EINVAL);
	cr_assert_eq(kvs_cuda_copy_to_slot(c, NULL, 0, p, 1, NULL, NULL), -EINVAL);
	cr_assert_eq(kvs_cuda_copy_to_slot(c, &stale, 0, NULL, 1, NULL, NULL), -EINVAL,
		     "a NULL source is refused before the lease is looked at");
	cr_assert_eq(kvs_cuda_copy_from_slot(c, &stale, 0, NULL, 1, NULL, NULL), -EINVAL);
	cr_assert_eq(kvs_cuda_gather(c, &stale, 0, pages, 2, 4096, NULL, NULL), -EINVAL,
		     "a NULL page");
	cr_assert(strstr(kvs_cuda_last_error(), "page 1") != NULL, "%s", kvs_cuda_last_error());
	cr_assert_eq(kvs_cuda_gather(c, &l, 0, NULL, 2, 4096, NULL, NULL), -EINVAL);
	cr_assert_eq(kvs_cuda_gather(c, &l, 0, pages, 1, 0, NULL, NULL), -EINVAL, "page_size 0");
	cr_assert_eq(kvs_cuda_scatter(c, &l, 0, NULL, 1, 4096, NULL, NULL), -EINVAL);
	cr_assert_eq(kvs_cuda_gather_idx(c, &stale, 0, p, idx, 2, 4096, NULL, NULL), -EINVAL,
		     "a negative index");
	cr_assert_eq(kvs_cuda_scatter_idx(c, &l, 0, p, idx, 2, 4096, NULL, NULL), -EINVAL);
	cr_assert_eq(kvs_cuda_gather_idx(c, &l, 0, NULL, good, 2, 4096, NULL, NULL), -EINVAL,
		     "no base");
	cr_assert_eq(kvs_cuda_scatter_idx(c, &l, 0, p, NULL, 2, 4096, NULL, NULL), -EINVAL);
	cr_assert_eq(kvs_cuda_scatter(c, &stale, 0, wpages, 2, 4096, NULL, NULL), -ESTALE,
		     "good arguments reach the lease check");
	cr_assert_eq(kvs_cuda_set_gather_mode(NULL, KVS_CUDA_GATHER_AUTO), -EINVAL);
	cr_assert_eq(kvs_cuda_set_gather_mode(c, 3), -EINVAL);
	cr_assert_eq(kvs_cuda_set_gather_mode(c, -1), -EINVAL);
	kvs_close(c);
	wait_idle(&px, 0);
}

Test(cuda, a_fork_child_gets_echild_before_cuda)
{
	kvs_client *c = connect_ok(&px);
	struct kvs_lease l;
	cr_assert_eq(kvs_acquire(c, 1, &l), 0);
	fflush(NULL);
	pid_t pid = fork();
	if (pid == 0) {
		char buf[16];
		int bad = (kvs_cuda_register(c) != -ECHILD) + (kvs_cuda_unregister(c) != -ECHILD) +
			  (kvs_cuda_set_gather_mode(c, KVS_CUDA_GATHER_AUTO) != -ECHILD) +
			  (kvs_cuda_copy_to_slot(c, &l, 0, buf, 16, NULL, NULL) != -ECHILD);
		_exit(bad);
	}
	int st;
	cr_assert_eq(reap(pid, &st), pid);
	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%d calls were not -ECHILD",
		  WEXITSTATUS(st));
	kvs_close(c);
}

Test(cuda, unregister_without_register_is_harmless)
{
	kvs_client *c = connect_ok(&px);
	cr_assert_eq(kvs_cuda_unregister(c), 0);
	cr_assert_eq(kvs_cuda_unregister(c), 0);
	char why[256];
	if (have_device(why, sizeof(why))) {
		cr_assert_eq(kvs_cuda_register(c), 0);
		cr_assert_eq(kvs_cuda_register(c), 0, "idempotent");
		cr_assert_eq(kvs_cuda_unregister(c), 0);
		cr_assert_eq(kvs_cuda_unregister(c), 0);
		cr_assert_eq(kvs_cuda_register(c), 0, "again after unregister");
	} else {
		cr_assert_eq(kvs_cuda_register(c), -ENODEV);
		cr_assert_eq(kvs_cuda_unregister(c), 0, "a failed register leaves nothing to undo");
	}
	kvs_close(c); /* undoes a registration still in place */
	wait_idle(&px, 0);
}

/* ------------------------------------------------------------ device */

static uint64_t rng_state = 0x853c49e6748fea9bull;

static uint64_t rnd(void)
{
	uint64_t x = rng_state;
	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	return rng_state = x;
}

/* The offset of the first byte of p[0..len) that is not v, or len. */
static size_t all_bytes(const uint8_t *p, uint8_t v, size_t len)
{
	for (size_t i = 0; i < len; i++)
		if (p[i] != v)
			return i;
	return len;
}

static void fill_random(void *p, size_t len)
{
	uint8_t *b = p;
	for (size_t i = 0; i < len; i += 8) {
		uint64_t w = rnd();
		memcpy(b + i, &w, len - i < 8 ? len - i : 8);
	}
}

Test(cuda, device_bytes_through_a_room_and_back)
{
	NEED_DEVICE("device -> slot -> local room -> slot -> device, byte for byte");
	enum { CHUNKS = 3 };
	const size_t bytes = (size_t)CHUNKS * SLOT - 12345; /* a short last chunk */
	uint8_t *want = malloc(bytes), *back = malloc(bytes);
	cr_assert(want && back);
	fill_random(want, bytes);
	void *src, *dst;
	CK(cudaMalloc(&src, bytes));
	CK(cudaMalloc(&dst, bytes));
	CK(cudaMemcpy(src, want, bytes, cudaMemcpyHostToDevice));
	CK(cudaMemset(dst, 0xee, bytes));
	cudaStream_t s;
	cudaEvent_t done;
	/* A blocking stream: ordered after the set-up's cudaMemcpy/cudaMemset. */
	CK(cudaStreamCreate(&s));
	CK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));

	kvs_client *rx = connect_ok(&px), *tx = connect_ok(&px);
	cr_assert_eq(kvs_cuda_register(tx), 0, "%s", kvs_cuda_last_error());
	kvs_room *rr, *sr;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(rx, bytes, 1, &rr, &d), 0);
	cr_assert_eq(kvs_send_open(tx, &d, 2, &sr), 0);
	cr_assert_eq(kvs_room_chunks(sr), CHUNKS);
	struct kvs_lease l[CHUNKS];
	cr_assert_eq(kvs_acquire(tx, CHUNKS, l), 0);
	for (unsigned k = 0; k < CHUNKS; k++) {
		size_t off = (size_t)k * SLOT, len = bytes - off < SLOT ? bytes - off : SLOT;
		memset(kvs_lease_ptr(tx, &l[k]), 0, SLOT);
		/* Two halves at two slot offsets, the second half first. */
		size_t h = len / 2;
		cr_assert_eq(kvs_cuda_copy_to_slot(tx, &l[k], h, (char *)src + off + h, len - h, s,
						   NULL),
			     0, "%s", kvs_cuda_last_error());
		cr_assert_eq(kvs_cuda_copy_to_slot(tx, &l[k], 0, (char *)src + off, h, s, done), 0,
			     "%s", kvs_cuda_last_error());
		/* The lease is kept until the copy is done: then it is sent. */
		CK(cudaEventSynchronize(done));
		cr_assert(!memcmp(kvs_lease_ptr(tx, &l[k]), want + off, len),
			  "chunk %u differs in the slot", k);
		cr_assert_eq(kvs_send(sr, &l[k], off, (uint32_t)len), 0);
	}
	cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
	cr_assert_eq(wait_event(rx).type, KVS_EV_RECV_DONE);
	/* The receiver registers on its first copy. */
	for (unsigned k = 0; k < CHUNKS; k++) {
		size_t off = (size_t)k * SLOT, len = bytes - off < SLOT ? bytes - off : SLOT;
		struct kvs_lease got;
		cr_assert_eq(kvs_room_lease(rr, k, &got), 0);
		cr_assert_eq(kvs_cuda_copy_from_slot(rx, &got, 0, (char *)dst + off, len, s, NULL),
			     0, "%s", kvs_cuda_last_error());
		/* and the sender can no longer copy into what it gave away */
		cr_assert_eq(kvs_cuda_copy_to_slot(tx, &l[k], 0, src, 16, s, NULL), -ESTALE);
	}
	CK(cudaEventRecord(done, s));
	CK(cudaEventSynchronize(done));
	CK(cudaMemcpy(back, dst, bytes, cudaMemcpyDeviceToHost));
	cr_assert(!memcmp(back, want, bytes),
		  "device -> slot -> room -> slot -> device changed bytes");

	kvs_room_close(rr);
	kvs_room_close(sr);
	kvs_close(rx);
	kvs_close(tx);
	CK(cudaEventDestroy(done));
	CK(cudaStreamDestroy(s));
	CK(cudaFree(src));
	CK(cudaFree(dst));
	free(want);
	free(back);
	wait_idle(&px, 0);
}

/* One gather of n pages of table into l at off, then a scatter of the same
 * slot bytes into a poisoned second pool; both checked byte for byte. */
static void roundtrip(kvs_client *c, const struct kvs_lease *l, size_t off, size_t psz, unsigned n,
		      unsigned pool_pages, const int32_t *table, bool by_idx, cudaStream_t s,
		      const uint8_t *hpool, uint8_t *hback, void *dpool, void *dback,
		      const char *mode)
{
	const void **pages = malloc(n * sizeof(*pages));
	void **wpages = malloc(n * sizeof(*wpages));
	cr_assert(pages && wpages);
	for (unsigned k = 0; k < n; k++) {
		pages[k] = (const char *)dpool + (size_t)table[k] * psz;
		wpages[k] = (char *)dback + (size_t)table[k] * psz;
	}
	uint8_t *slot = kvs_lease_ptr(c, l);
	memset(slot, 0xa5, SLOT);
	int rc = by_idx ? kvs_cuda_gather_idx(c, l, off, dpool, table, n, psz, s, NULL)
			: kvs_cuda_gather(c, l, off, pages, n, psz, s, NULL);
	cr_assert_eq(rc, 0, "gather (%s, %zu-byte pages): %s", mode, psz, kvs_cuda_last_error());
	CK(cudaStreamSynchronize(s));
	for (unsigned k = 0; k < n; k++)
		cr_assert(
			!memcmp(slot + off + (size_t)k * psz, hpool + (size_t)table[k] * psz, psz),
			"gather (%s, %zu-byte pages, %s): page %u (pool page %d) differs", mode,
			psz, by_idx ? "indices" : "pointers", k, table[k]);
	cr_assert_eq(all_bytes(slot, 0xa5, off), off, "gather (%s) wrote before its offset", mode);
	size_t end = off + (size_t)n * psz;
	cr_assert_eq(all_bytes(slot + end, 0xa5, SLOT - end), SLOT - end,
		     "gather (%s) wrote past its pages", mode);

	CK(cudaMemset(dback, 0x3c, (size_t)pool_pages * psz));
	rc = by_idx ? kvs_cuda_scatter_idx(c, l, off, dback, table, n, psz, s, NULL)
		    : kvs_cuda_scatter(c, l, off, wpages, n, psz, s, NULL);
	cr_assert_eq(rc, 0, "scatter (%s): %s", mode, kvs_cuda_last_error());
	CK(cudaStreamSynchronize(s));
	CK(cudaMemcpy(hback, dback, (size_t)pool_pages * psz, cudaMemcpyDeviceToHost));
	uint8_t *hit = calloc(pool_pages, 1);
	cr_assert(hit);
	for (unsigned k = 0; k < n; k++)
		hit[table[k]] = 1;
	for (unsigned p = 0; p < pool_pages; p++) {
		const uint8_t *got = hback + (size_t)p * psz;
		if (hit[p]) {
			cr_assert(!memcmp(got, hpool + (size_t)p * psz, psz),
				  "scatter (%s, %zu-byte pages): pool page %u differs", mode, psz,
				  p);
		} else {
			cr_assert_eq(all_bytes(got, 0x3c, psz), psz,
				     "scatter (%s) wrote page %u, not in the table", mode, p);
		}
	}
	free(hit);
	free(pages);
	free(wpages);
}

Test(cuda, gather_scatter_of_a_shuffled_table_round_trips, .timeout = 300)
{
	NEED_DEVICE("gather/scatter of shuffled page tables, every mode, byte for byte");
	/* 16-byte pages make 16384-page tables (several launches of the
	 * kernel); 1000-byte pages are not 16-byte multiples (the copy engines
	 * even when the kernel is asked for). */
	static const size_t psizes[] = { 16, 64, 1000, 4096, 16384, 65536 };
	static const int modes[] = { KVS_CUDA_GATHER_COPY, KVS_CUDA_GATHER_KERNEL,
				     KVS_CUDA_GATHER_AUTO };
	static const char *const mname[] = { "auto", "copy", "kernel" };
	cudaStream_t s;
	/* A blocking stream: ordered after the set-up's cudaMemcpy/cudaMemset. */
	CK(cudaStreamCreate(&s));
	kvs_client *c = connect_ok(&px);
	struct kvs_lease l;
	cr_assert_eq(kvs_acquire(c, 1, &l), 0);

	for (size_t pi = 0; pi < sizeof(psizes) / sizeof(psizes[0]); pi++) {
		const size_t psz = psizes[pi];
		const size_t off = psz >= 4096 ? psz : 4096; /* pages start past slot_off */
		const unsigned n = (unsigned)((SLOT - off) / psz);
		const unsigned pool_pages = 3 * n;
		const size_t pool_bytes = (size_t)pool_pages * psz;
		uint8_t *hpool = malloc(pool_bytes), *hback = malloc(pool_bytes);
		int32_t *perm = malloc(pool_pages * sizeof(*perm));
		cr_assert(hpool && hback && perm);
		fill_random(hpool, pool_bytes);
		void *dpool, *dback;
		CK(cudaMalloc(&dpool, pool_bytes));
		CK(cudaMalloc(&dback, pool_bytes));
		CK(cudaMemcpy(dpool, hpool, pool_bytes, cudaMemcpyHostToDevice));
		/* The table's first half: pages of [0, 2n) shuffled; its second
		 * half: a run of neighbours from 2n on (what the copy engines
		 * merge into one copy). */
		for (unsigned i = 0; i < 2 * n; i++)
			perm[i] = (int32_t)i;
		for (unsigned i = 2 * n - 1; i > 0; i--) {
			unsigned j = (unsigned)(rnd() % (i + 1));
			int32_t t = perm[i];
			perm[i] = perm[j];
			perm[j] = t;
		}
		for (unsigned k = n / 2; k < n; k++)
			perm[k] = (int32_t)(2 * n + k - n / 2);
		for (size_t mi = 0; mi < 3; mi++) {
			cr_assert_eq(kvs_cuda_set_gather_mode(c, modes[mi]), 0);
			for (int by_idx = 0; by_idx < 2; by_idx++)
				roundtrip(c, &l, off, psz, n, pool_pages, perm, by_idx, s, hpool,
					  hback, dpool, dback, mname[modes[mi]]);
		}
		CK(cudaFree(dpool));
		CK(cudaFree(dback));
		free(hpool);
		free(hback);
		free(perm);
	}
	/* The legacy default stream (no batch copies there) and an event. */
	cudaEvent_t done;
	CK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
	void *d;
	CK(cudaMalloc(&d, 8 * 4096));
	CK(cudaMemset(d, 0x11, 8 * 4096));
	const void *pg[4];
	for (int k = 0; k < 4; k++)
		pg[k] = (char *)d + (size_t)(7 - 2 * k) * 4096;
	cr_assert_eq(kvs_cuda_set_gather_mode(c, KVS_CUDA_GATHER_COPY), 0);
	cr_assert_eq(kvs_cuda_gather(c, &l, 0, pg, 4, 4096, NULL, done), 0, "%s",
		     kvs_cuda_last_error());
	CK(cudaEventSynchronize(done));
	cr_assert_eq(all_bytes(kvs_lease_ptr(c, &l), 0x11, 4 * 4096), 4 * 4096);
	CK(cudaFree(d));
	CK(cudaEventDestroy(done));
	CK(cudaStreamDestroy(s));
	kvs_close(c);
	wait_idle(&px, 0);
}

Test(cuda, registration_is_ours_to_undo_only_when_we_made_it)
{
	NEED_DEVICE("cudaHostRegister of the pool: idempotent, adopted, undone");
	kvs_client *c = connect_ok(&px);
	size_t len;
	void *pool = kvs_pool_map(c, &len);
	struct cudaPointerAttributes a;
	cr_assert_eq(kvs_cuda_register(c), 0, "%s", kvs_cuda_last_error());
	CK(cudaPointerGetAttributes(&a, pool));
	cr_assert_eq(a.type, cudaMemoryTypeHost, "the pool is not registered");
	cr_assert_eq(kvs_cuda_register(c), 0);
	cr_assert_eq(kvs_cuda_unregister(c), 0);
	CK(cudaPointerGetAttributes(&a, pool));
	cr_assert_eq(a.type, cudaMemoryTypeUnregistered, "unregister left the pool registered");

	/* The application registered the mapping itself: we use it, and
	 * leave it registered when we let go. */
	CK(cudaHostRegister(pool, len, cudaHostRegisterPortable | cudaHostRegisterMapped));
	cr_assert_eq(kvs_cuda_register(c), 0, "%s", kvs_cuda_last_error());
	cr_assert_eq(cudaGetLastError(), cudaSuccess, "an error we handled was left behind");
	cr_assert_eq(kvs_cuda_unregister(c), 0);
	CK(cudaPointerGetAttributes(&a, pool));
	cr_assert_eq(a.type, cudaMemoryTypeHost, "we undid the application's registration");
	CK(cudaHostUnregister(pool));
	kvs_close(c);
	wait_idle(&px, 0);
}
