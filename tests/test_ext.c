/* SPDX-License-Identifier: MIT */
/*
 * What libkvstage offers companion libraries (libkvstage_cuda): the pool
 * mapping, the lease check with the CPU path's answers, and per-client
 * state that kvs_close hands back while the pool is still mapped.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <string.h>

#include "canary.h"
#include "harness.h"

#define SLOTS 8
#define SLOT (64 * 1024)

static struct proxy px = PROXY_INIT;

static void setup(void)
{
	proxy_start(&px, NULL, (const char *[]){ "--slots", "8", "--slot-size", "64K", NULL });
}

static void teardown(void)
{
	proxy_stop(&px);
}

TestSuite(ext, .init = setup, .fini = teardown, .timeout = 60);

Test(ext, pool_map_is_where_the_slots_are)
{
	kvs_client *c = connect_ok(&px);
	size_t len = 0;
	char *base = kvs_pool_map(c, &len);
	cr_assert_not_null(base);
	/* every slot lies inside; a hugetlb pool is rounded up to its page size */
	cr_assert_geq(len, (size_t)SLOTS * SLOT);
	cr_assert_eq(len, px.ctrl->pool_size, "the whole mapping");
	cr_assert_eq(kvs_pool_map(c, NULL), base);
	struct kvs_lease l[3];
	cr_assert_eq(kvs_acquire(c, 3, l), 0);
	for (int i = 0; i < 3; i++)
		cr_assert_eq((char *)kvs_lease_ptr(c, &l[i]), base + (size_t)l[i].slot * SLOT);
	kvs_close(c);
	wait_idle(&px, 0);
}

Test(ext, lease_check_answers_as_release_does)
{
	kvs_client *a = connect_ok(&px), *b = connect_ok(&px);
	struct kvs_lease held, old, bs;
	cr_assert_eq(kvs_acquire(a, 1, &old), 0);
	cr_assert_eq(kvs_release(a, &old), 0);
	cr_assert_eq(kvs_acquire(a, 1, &held), 0);
	cr_assert_eq(kvs_acquire(b, 1, &bs), 0);

	cr_assert_eq(kvs_lease_check(a, &held), 0);
	cr_assert_eq(kvs_lease_check(a, &old), -ESTALE);
	cr_assert_eq(kvs_release(a, &old), -ESTALE);
	cr_assert_eq(kvs_lease_check(a, &bs), -EPERM);
	cr_assert_eq(kvs_release(a, &bs), -EPERM);
	struct kvs_lease none = { .slot = SLOTS, .epoch = 1 };
	cr_assert_eq(kvs_lease_check(a, &none), -EINVAL);
	cr_assert_eq(kvs_release(a, &none), -EINVAL);
	cr_assert_eq(kvs_lease_check(NULL, &held), -EINVAL);
	cr_assert_eq(kvs_lease_check(a, NULL), -EINVAL);

	/* In flight (held in the transport), then received. */
	kvs_room *rr, *sr;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(b, SLOT, 1, &rr, &d), 0);
	cr_assert_eq(kvs_send_open(a, &d, 2, &sr), 0);
	uint64_t match = 2;
	fp_set(&px, "local.quiesce", "pause", &match);
	cr_assert_eq(kvs_send(sr, &held, 0, SLOT), 0);
	fp_wait(&px, "local.quiesce", 1);
	cr_assert_eq(kvs_lease_check(a, &held), -EBUSY);
	cr_assert_eq(kvs_release(a, &held), -EBUSY);
	fp_set(&px, "local.quiesce", "off", NULL);
	cr_assert_eq(wait_event(b).type, KVS_EV_RECV_DONE);
	struct kvs_lease got;
	cr_assert_eq(kvs_room_lease(rr, 0, &got), 0);
	cr_assert_eq(kvs_lease_check(b, &got), 0, "a received slot is held");
	cr_assert_eq(kvs_lease_check(a, &held), -ESTALE, "handed over");
	kvs_room_close(rr);
	kvs_room_close(sr);
	kvs_close(a);
	kvs_close(b);
	wait_idle(&px, 0);
}

static const char key[3];
static int order[3], nfini;
static bool pool_readable;
static struct kvs_lease seen;

static void fini(kvs_client *c, void *state)
{
	int k = (int)((const char *)state - key);
	order[nfini++] = k;
	/* the pool is still mapped, and our lease still names its bytes */
	const void *p = kvs_lease_ptr(c, &seen);
	pool_readable = p && canary_check(p, 5, 0, SLOT) == SLOT;
}

Test(ext, state_attaches_once_per_key_and_close_hands_it_back_first)
{
	kvs_client *c = connect_ok(&px);
	cr_assert_eq(kvs_acquire(c, 1, &seen), 0);
	canary_fill(kvs_lease_ptr(c, &seen), 5, 0, SLOT);
	cr_assert_null(kvs_ext_get(c, &key[0]));
	for (int k = 0; k < 3; k++)
		cr_assert_eq(kvs_ext_attach(c, &key[k], (void *)&key[k], fini), 0);
	cr_assert_eq(kvs_ext_attach(c, &key[1], NULL, NULL), -EEXIST);
	cr_assert_eq(kvs_ext_get(c, &key[1]), &key[1]);
	cr_assert_eq(kvs_ext_attach(c, NULL, NULL, NULL), -EINVAL);
	cr_assert_eq(kvs_ext_attach(NULL, &key[0], NULL, NULL), -EINVAL);
	static const char other[2];
	cr_assert_eq(kvs_ext_attach(c, &other[0], NULL, NULL), 0, "a fourth, without fini");
	cr_assert_eq(kvs_ext_attach(c, &other[1], NULL, NULL), -ENOSPC);
	cr_assert_null(kvs_ext_get(c, &other[1]));
	cr_assert_null(kvs_ext_get(NULL, &key[0]));
	kvs_close(c);
	cr_assert_eq(nfini, 3);
	cr_assert(order[0] == 2 && order[1] == 1 && order[2] == 0, "not last attached first");
	cr_assert(pool_readable, "fini ran after the pool was unmapped");
	wait_idle(&px, 0);
}
