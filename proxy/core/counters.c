/* SPDX-License-Identifier: MIT */
/*
 * The counter block (shm/layout.h, struct kvs_counters): named records in
 * the control segment, as Aeron's counters file holds them. The proxy is
 * the only writer; a reader trusts a record once counter_count covers it.
 */
#include <errno.h>
#include <string.h>

#include "core/counters.h"
#include "core/proxy.h"
#include "statnames.h"

/* Returns true if s fits a field of n bytes with its NUL. */
static bool fits(const char *s, size_t n)
{
	return s && strnlen(s, n) < n;
}

int kvsp_counters_add(struct kvsp *p, const struct kvsp_counter_def *defs, uint64_t **values)
{
	struct kvs_ctrl *c = p->ctrl;
	struct kvs_counters *b = (struct kvs_counters *)((uint8_t *)c + c->counters_off);
	uint32_t have = c->counter_count, n = 0; /* ours: no other writer */
	for (; defs[n].name; n++) {
		const struct kvsp_counter_def *d = &defs[n];
		if (!fits(d->name, sizeof(b->rec[0].name)) ||
		    !fits(d->metric, sizeof(b->rec[0].metric)) ||
		    !fits(d->help, sizeof(b->rec[0].help)))
			return -EINVAL;
		/* One name, one counter: a barrier or a reader finds the first. */
		if (kvs_stat_at(c, p->ctrl_size, d->name))
			return -EEXIST;
		for (uint32_t k = 0; k < n; k++)
			if (!strcmp(defs[k].name, d->name))
				return -EEXIST;
	}
	if (n > KVS_COUNTERS_MAX - have)
		return -ENOSPC;
	for (uint32_t k = 0; k < n; k++) {
		struct kvs_counter *r = &b->rec[have + k];
		r->kind = defs[k].gauge ? KVS_GAUGE : KVS_COUNTER;
		strcpy(r->name, defs[k].name);
		strcpy(r->metric, defs[k].metric);
		strcpy(r->help, defs[k].help);
		b->value[have + k] = 0;
	}
	/* Release: a reader that sees the count sees the records it covers. */
	__atomic_store_n(&c->counter_count, have + n, __ATOMIC_RELEASE);
	*values = &b->value[have];
	return 0;
}
