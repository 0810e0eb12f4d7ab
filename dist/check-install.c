/* SPDX-License-Identifier: MIT */
/*
 * dist/check-install.sh builds this against an installed libkvstage (its
 * pkg-config file and header, nothing of the source tree) and runs it
 * against an installed kvstaged: one room of one chunk, every byte checked.
 * Usage: check-install SOCKET [SENDER_SOCKET]: the receiver connects to
 * SOCKET, the sender to SENDER_SOCKET (another proxy, which then sends to
 * SOCKET's over TCP) or SOCKET. Exit 0: the bytes arrived; else says why.
 */
#include <kvstage.h>

#include <stdint.h>
#include <stdio.h>
#include <string.h>

static int fail(const char *what, int rc)
{
	fprintf(stderr, "check-install: %s: %s\n", what, rc ? kvs_strerror(rc) : "wrong");
	return 1;
}

static unsigned char pattern(uint64_t i)
{
	return (unsigned char)(i * 131 + (i >> 8) + 7);
}

int main(int argc, char **argv)
{
	if (argc != 2 && argc != 3) {
		fprintf(stderr, "usage: check-install SOCKET [SENDER_SOCKET]\n");
		return 2;
	}
	kvs_client *tx, *rx;
	int rc = kvs_connect(argv[1], &rx);
	if (rc)
		return fail("kvs_connect (receiver)", rc);
	if ((rc = kvs_connect(argv[argc - 1], &tx)))
		return fail("kvs_connect (sender)", rc);

	/* One chunk, shorter than a slot, so the length is carried too. */
	uint64_t bytes = kvs_slot_size(tx) - 100;
	kvs_room *rr, *sr;
	struct kvs_room_desc desc;
	if ((rc = kvs_recv_open(rx, bytes, 1, &rr, &desc)))
		return fail("kvs_recv_open", rc);
	if ((rc = kvs_send_open(tx, &desc, 2, &sr)))
		return fail("kvs_send_open", rc);
	if (kvs_room_chunks(sr) != 1)
		return fail("kvs_room_chunks", 0);
	struct kvs_lease l;
	if ((rc = kvs_acquire(tx, 1, &l)))
		return fail("kvs_acquire", rc);
	unsigned char *p = kvs_lease_ptr(tx, &l);
	if (!p)
		return fail("kvs_lease_ptr (sender)", 0);
	for (uint64_t i = 0; i < bytes; i++)
		p[i] = pattern(i);
	if ((rc = kvs_send(sr, &l, 0, (uint32_t)bytes)))
		return fail("kvs_send", rc);

	struct kvs_event ev;
	if ((rc = kvs_wait(tx, &ev, 20000)) != 1)
		return fail("kvs_wait (sender)", rc);
	if (ev.type != KVS_EV_SEND_DONE || ev.status || ev.user_data != 2)
		return fail("the sender's final event", ev.status);
	if ((rc = kvs_wait(rx, &ev, 20000)) != 1)
		return fail("kvs_wait (receiver)", rc);
	if (ev.type != KVS_EV_RECV_DONE || ev.status || ev.user_data != 1 || ev.bytes != bytes)
		return fail("the receiver's final event", ev.status);

	struct kvs_lease got;
	if ((rc = kvs_room_lease(rr, 0, &got)))
		return fail("kvs_room_lease", rc);
	const unsigned char *q = kvs_lease_ptr(rx, &got);
	if (!q)
		return fail("kvs_lease_ptr (receiver)", 0);
	for (uint64_t i = 0; i < bytes; i++)
		if (q[i] != pattern(i)) {
			fprintf(stderr, "check-install: byte %llu is %u, want %u\n",
				(unsigned long long)i, q[i], pattern(i));
			return 1;
		}
	if ((rc = kvs_room_close(sr)) || (rc = kvs_room_close(rr)))
		return fail("kvs_room_close", rc);
	kvs_close(tx);
	kvs_close(rx);
	printf("libkvstage %s: %llu bytes through kvstaged, every one right\n", kvs_version(),
	       (unsigned long long)bytes);
	return 0;
}
