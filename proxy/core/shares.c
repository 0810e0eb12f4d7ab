/* SPDX-License-Identifier: MIT */
/* A uid's share of the client places and of the rooms, and a process's of its uid's (shares.h). */
#include <errno.h>
#include <stdlib.h>

#include "core/shares.h"

/* pct% of n, at least 1; 0 or 100 and above: all of it. */
static uint32_t share_of_table(uint32_t n, unsigned pct)
{
	if (!pct || pct >= 100)
		return n;
	uint32_t v = (uint32_t)((uint64_t)n * pct / 100);
	return v ? v : 1;
}

int kvsp_shares_init(struct kvsp_shares *sh, uint32_t max_clients, uint32_t max_rooms, unsigned pct)
{
	/* A uid's entry outlives its clients while a room of theirs ends
	 * (tombstones wait on transports): room for as many such as live. */
	uint32_t n = 4 * max_clients; /* a uid's entry and a process's, each */
	sh->n = (uint16_t)(n < KVSP_NO_SHARE ? n : KVSP_NO_SHARE - 1);
	sh->tab = calloc(sh->n, sizeof(*sh->tab));
	if (!sh->tab)
		return -ENOMEM;
	sh->max_clients = share_of_table(max_clients, pct);
	sh->max_rooms = share_of_table(max_rooms, pct);
	sh->max_proc_clients = share_of_table(sh->max_clients, pct);
	sh->max_proc_rooms = share_of_table(sh->max_rooms, pct);
	return 0;
}

void kvsp_shares_fini(struct kvsp_shares *sh)
{
	free(sh->tab);
	sh->tab = NULL;
}

/* Linear: called at a client's start only (a room carries its index). */
uint16_t kvsp_share_of(struct kvsp_shares *sh, uid_t uid, uint64_t proc)
{
	uint16_t free_one = KVSP_NO_SHARE;
	for (uint16_t i = 0; i < sh->n; i++) {
		const struct kvsp_share *e = &sh->tab[i];
		bool used = e->clients || e->rooms;
		if (used && e->uid == uid && e->proc == proc)
			return i;
		if (!used && free_one == KVSP_NO_SHARE)
			free_one = i;
	}
	if (free_one != KVSP_NO_SHARE)
		sh->tab[free_one] = (struct kvsp_share){ .uid = uid, .proc = proc };
	return free_one;
}

bool kvsp_share_takes_client(const struct kvsp_shares *sh, uint16_t i)
{
	if (i == KVSP_NO_SHARE)
		return true;
	const struct kvsp_share *e = &sh->tab[i];
	return e->clients < (e->proc ? sh->max_proc_clients : sh->max_clients);
}

bool kvsp_share_takes_room(const struct kvsp_shares *sh, uint16_t i)
{
	if (i == KVSP_NO_SHARE)
		return true;
	const struct kvsp_share *e = &sh->tab[i];
	return e->rooms < (e->proc ? sh->max_proc_rooms : sh->max_rooms);
}
