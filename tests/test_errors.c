/* SPDX-License-Identifier: MIT */
/*
 * Refusals: a stale lease gets -ESTALE, someone else's -EPERM, a full pool
 * -ENOBUFS, a forged descriptor -EPERM, and none of them changes any
 * state. Raw records that bypass libkvstage's own checks meet the same
 * refusals in the proxy. The control segment cannot be written. A hello
 * from a library of another ABI or another rte_ring layout is refused, and
 * the library refuses a proxy of another ring layout.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <grp.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "canary.h"
#include "harness.h"
#include "rawclient.h"
#include "ring.h"
#include "sock.h"

#define SLOTS 32
#define SLOT (64 * 1024)

static struct proxy px = PROXY_INIT;

static void setup(void)
{
	proxy_start(&px, NULL,
		    (const char *[]){ "--slots", "32", "--slot-size", "64K", "--client-rooms", "4",
				      NULL });
}

static void teardown(void)
{
	proxy_stop(&px);
}

TestSuite(errors, .init = setup, .fini = teardown, .timeout = 60);

/* The whole published slot table, to prove a refusal changed nothing. */
static void table(struct kvs_slot *out)
{
	for (uint32_t i = 0; i < SLOTS; i++)
		out[i] = slot_pub(&px, i);
}

static void assert_table(const struct kvs_slot *before, const char *what)
{
	struct kvs_slot now[SLOTS];
	table(now);
	cr_assert(!memcmp(before, now, sizeof(now)), "%s changed the slot table", what);
}

Test(errors, stale_lease_refused_and_nothing_changes)
{
	kvs_client *c = connect_ok(&px);
	struct kvs_lease l[2];
	cr_assert_eq(kvs_acquire(c, 2, l), 0);
	cr_assert_eq(kvs_release(c, &l[0]), 0);
	struct kvs_slot before[SLOTS];
	table(before);
	uint64_t stale0 = stat_get(&px, "rej_stale");
	cr_assert_eq(kvs_release(c, &l[0]), -ESTALE);
	cr_assert_null(kvs_lease_ptr(c, &l[0]));
	struct kvs_lease old = { l[1].slot, l[1].epoch - 1 };
	cr_assert_eq(kvs_release(c, &old), -ESTALE);
	assert_table(before, "stale releases");
	cr_assert_eq(stat_get(&px, "rej_stale"), stale0 + 2);
	cr_assert_not_null(kvs_lease_ptr(c, &l[1]), "the live lease still works");
	/* and in a room */
	kvs_client *rx = connect_ok(&px);
	kvs_room *rr, *sr;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(rx, SLOT, 1, &rr, &d), 0);
	cr_assert_eq(kvs_send_open(c, &d, 2, &sr), 0);
	table(before);
	cr_assert_eq(kvs_send(sr, &l[0], 0, SLOT), -ESTALE);
	/* the raw record, past libkvstage's check, meets the proxy's */
	struct kvs_sqe q = { .op = KVS_OP_SEND,
			     .handle = 0,
			     .slot = l[0].slot,
			     .epoch = l[0].epoch,
			     .arg = 0,
			     .len = SLOT };
	for (unsigned h = 0; h < 4; h++)
		if (c->rooms[h].role == KVS_ROLE_SEND)
			q.handle = (uint16_t)h;
	cr_assert_eq(raw_submit(c, &q), 0);
	struct kvs_event ev = wait_event(c);
	cr_assert_eq(ev.type, KVS_EV_REJECTED);
	cr_assert_eq(ev.status, -ESTALE);
	cr_assert_eq(ev.user_data, 2);
	assert_table(before, "a stale send");
	/* the room is unharmed: the live lease completes it */
	cr_assert_eq(kvs_send(sr, &l[1], 0, SLOT), 0);
	cr_assert_eq(wait_event(rx).type, KVS_EV_RECV_DONE);
	kvs_close(c);
	kvs_close(rx);
	wait_idle(&px, 0);
}

Test(errors, foreign_lease_refused_and_nothing_changes)
{
	kvs_client *a = connect_ok(&px), *b = connect_ok(&px);
	struct kvs_lease l;
	cr_assert_eq(kvs_acquire(a, 1, &l), 0);
	canary_fill(kvs_lease_ptr(a, &l), 1, 0, SLOT);
	struct kvs_slot before[SLOTS];
	table(before);
	cr_assert_null(kvs_lease_ptr(b, &l), "b sees a's slot");
	cr_assert_eq(kvs_release(b, &l), -EPERM);
	kvs_room *rr, *sr;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(a, SLOT, 1, &rr, &d), 0);
	cr_assert_eq(kvs_send_open(b, &d, 2, &sr), 0);
	cr_assert_eq(kvs_send(sr, &l, 0, SLOT), -EPERM);
	struct kvs_sqe q = { .op = KVS_OP_SEND, .slot = l.slot, .epoch = l.epoch, .len = SLOT };
	q.handle = kvs_room_handle_idx(sr);
	q.gen = kvs_room_handle_gen(sr);
	cr_assert_eq(raw_submit(b, &q), 0);
	struct kvs_event ev = wait_event(b);
	cr_assert_eq(ev.type, KVS_EV_REJECTED);
	cr_assert_eq(ev.status, -EPERM);
	assert_table(before, "foreign leases");
	cr_assert_eq(canary_check(kvs_lease_ptr(a, &l), 1, 0, SLOT), SLOT);
	cr_assert_eq(kvs_release(a, &l), 0);
	kvs_close(a);
	kvs_close(b);
	wait_idle(&px, 0);
}

Test(errors, full_pool_gives_enobufs_and_recovers)
{
	kvs_client *c = connect_ok(&px);
	struct kvs_lease l[SLOTS];
	cr_assert_eq(kvs_acquire(c, SLOTS, l), 0);
	struct kvs_slot before[SLOTS];
	table(before);
	struct kvs_lease x;
	cr_assert_eq(kvs_acquire(c, 1, &x), -ENOBUFS);
	assert_table(before, "acquire from an empty pool");
	for (int i = 0; i < 3; i++)
		cr_assert_eq(kvs_release(c, &l[i]), 0);
	table(before);
	cr_assert_eq(kvs_acquire(c, 4, l), -ENOBUFS, "4 wanted, 3 free: none leased");
	assert_table(before, "a partial acquire");
	cr_assert_eq(stat_get(&px, "slots.free"), 3);
	cr_assert_eq(kvs_acquire(c, 3, l), 0, "capacity returned: it recovers");
	cr_assert_eq(kvs_acquire(c, 0, l), -EINVAL);
	cr_assert_eq(kvs_acquire(c, SLOTS + 1, l), -EINVAL, "more than the pool can ever hold");
	kvs_close(c);
	wait_idle(&px, 0);
}

Test(errors, forged_stale_and_garbage_descriptors)
{
	kvs_client *rx = connect_ok(&px), *tx = connect_ok(&px);
	kvs_room *rr, *sr;
	struct kvs_room_desc d, bad;
	cr_assert_eq(kvs_recv_open(rx, 10, 1, &rr, &d), 0);
	struct kvs_slot before[SLOTS];
	table(before);
	for (int byte = 24; byte < 40; byte++) { /* every byte of the token */
		bad = d;
		bad.bytes[byte] ^= 0x80;
		cr_assert_eq(kvs_send_open(tx, &bad, 2, &sr), -EPERM, "token byte %d", byte);
	}
	cr_assert_eq(stat_get(&px, "rej_token"), 16);
	bad = d;
	bad.bytes[20] ^= 1; /* generation */
	cr_assert_eq(kvs_send_open(tx, &bad, 2, &sr), -ESTALE);
	bad = d;
	bad.bytes[8] ^= 1; /* proxy instance */
	cr_assert_eq(kvs_send_open(tx, &bad, 2, &sr), -ESTALE);
	bad = d;
	bad.bytes[0] ^= 1; /* magic */
	cr_assert_eq(kvs_send_open(tx, &bad, 2, &sr), -EINVAL);
	memset(&bad, 0xff, sizeof(bad));
	memcpy(bad.bytes, d.bytes, 16);
	cr_assert_eq(kvs_send_open(tx, &bad, 2, &sr), -EINVAL, "room index out of range");
	assert_table(before, "bad descriptors");
	/* the room still works with the real one, once */
	cr_assert_eq(kvs_send_open(tx, &d, 2, &sr), 0);
	kvs_room *sr2;
	cr_assert_eq(kvs_send_open(tx, &d, 3, &sr2), -EBUSY);
	cr_assert_eq(kvs_abort(sr), 0);
	cr_assert_eq(wait_event(rx).type, KVS_EV_ABORTED);
	cr_assert_eq(wait_event(tx).type, KVS_EV_ABORTED);
	kvs_room_close(rr);
	kvs_room_close(sr);
	sync_barrier(rx);
	sync_barrier(tx);
	/* a closed room's descriptor is stale, even once its index is reused */
	kvs_room *again;
	struct kvs_room_desc d2;
	cr_assert_eq(kvs_recv_open(rx, 10, 4, &again, &d2), 0);
	cr_assert_eq(kvs_send_open(tx, &d, 5, &sr), -ESTALE);
	kvs_close(rx);
	kvs_close(tx);
	wait_idle(&px, 0);
}

Test(errors, bad_sends_are_refused_by_library_and_proxy)
{
	kvs_client *rx = connect_ok(&px), *tx = connect_ok(&px);
	kvs_room *rr, *sr;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(rx, 2 * SLOT + 10, 1, &rr, &d), 0);
	cr_assert_eq(kvs_send_open(tx, &d, 2, &sr), 0);
	struct kvs_lease l[3];
	cr_assert_eq(kvs_acquire(tx, 3, l), 0);
	struct kvs_slot before[SLOTS];
	table(before);
	/* the library's own checks */
	cr_assert_eq(kvs_send(sr, &l[0], 1, SLOT), -EINVAL, "misaligned");
	cr_assert_eq(kvs_send(sr, &l[0], 3 * SLOT, SLOT), -EINVAL, "past the end");
	cr_assert_eq(kvs_send(sr, &l[0], 0, SLOT - 1), -EINVAL, "short chunk");
	cr_assert_eq(kvs_send(sr, &l[0], 2 * SLOT, SLOT), -EINVAL, "last chunk is 10 bytes");
	cr_assert_eq(kvs_send(rr, &l[0], 0, SLOT), -EBADF, "sending on a receiving room");
	assert_table(before, "refused sends");
	/* the same, raw, to the proxy */
	uint16_t h = kvs_room_handle_idx(sr);
	struct kvs_sqe bad[] = {
		{ .op = KVS_OP_SEND,
		  .handle = h,
		  .slot = l[0].slot,
		  .epoch = l[0].epoch,
		  .arg = 1,
		  .len = SLOT },
		{ .op = KVS_OP_SEND,
		  .handle = h,
		  .slot = l[0].slot,
		  .epoch = l[0].epoch,
		  .arg = 3 * SLOT,
		  .len = SLOT },
		{ .op = KVS_OP_SEND,
		  .handle = h,
		  .slot = l[0].slot,
		  .epoch = l[0].epoch,
		  .arg = 0,
		  .len = SLOT + 1 },
		{ .op = KVS_OP_SEND,
		  .handle = h,
		  .slot = SLOTS + 5,
		  .epoch = 1,
		  .arg = 0,
		  .len = SLOT },
		{ .op = KVS_OP_SEND,
		  .handle = 999,
		  .slot = l[0].slot,
		  .epoch = l[0].epoch,
		  .len = SLOT },
		{ .op = 200, .handle = h },
		{ .op = KVS_OP_ABORT, .handle = 3 },
		{ .op = KVS_OP_CLOSE, .handle = 60000 },
	};
	const int want[] = {
		-EINVAL, -EINVAL, -EINVAL, -EINVAL, -EBADF, -EOPNOTSUPP, -EBADF, -EBADF
	};
	for (unsigned i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		cr_assert_eq(raw_submit(tx, &bad[i]), 0);
		struct kvs_event ev = wait_event(tx);
		cr_assert_eq(ev.type, KVS_EV_REJECTED, "record %u", i);
		cr_assert_eq(ev.status, want[i], "record %u: %d", i, ev.status);
	}
	assert_table(before, "hostile records");
	/* overlap: chunk 0 twice, the second from another slot */
	cr_assert_eq(kvs_send(sr, &l[0], 0, SLOT), 0);
	struct kvs_sqe dup = { .op = KVS_OP_SEND,
			       .handle = h,
			       .slot = l[1].slot,
			       .epoch = l[1].epoch,
			       .arg = 0,
			       .len = SLOT };
	cr_assert_eq(raw_submit(tx, &dup), 0);
	struct kvs_event ev = wait_event(tx);
	cr_assert_eq(ev.type, KVS_EV_REJECTED);
	cr_assert_eq(ev.status, -EEXIST);
	cr_assert_eq(kvs_send(sr, &l[1], 0, SLOT), -EEXIST, "the library knows too");
	cr_assert_not_null(kvs_lease_ptr(tx, &l[1]), "a refused send leaves the slot with us");
	/* the room completes normally */
	cr_assert_eq(kvs_send(sr, &l[1], SLOT, SLOT), 0);
	cr_assert_eq(kvs_send(sr, &l[2], 2 * SLOT, 10), 0);
	cr_assert_eq(wait_event(tx).type, KVS_EV_SEND_DONE);
	cr_assert_eq(wait_event(rx).type, KVS_EV_RECV_DONE);
	cr_assert_gt(stat_get(&px, "rej_inval"), 5);
	kvs_close(rx);
	kvs_close(tx);
	wait_idle(&px, 0);
}

Test(errors, hostile_sync_records)
{
	kvs_client *c = connect_ok(&px);
	struct kvs_sqe q[] = {
		{ .op = KVS_OP_ACQUIRE, .arg = 0 },
		{ .op = KVS_OP_ACQUIRE, .arg = 1ull << 40 },
		{ .op = KVS_OP_RELEASE, .slot = UINT32_MAX, .epoch = 1 },
		{ .op = KVS_OP_RECV_OPEN, .handle = 4, .arg = 10 },
		{ .op = KVS_OP_RECV_OPEN, .handle = 0, .arg = 0 },
		{ .op = KVS_OP_RECV_OPEN, .handle = 0, .arg = (uint64_t)SLOTS * SLOT + 1 },
		{ .op = KVS_OP_ROOM_MAP, .handle = 2 },
		{ .op = KVS_OP_SEND_OPEN, .handle = 7 },
	};
	const int want[] = { -EINVAL, -EINVAL, -EINVAL, -EBADF, -EINVAL, -EMSGSIZE, -EBADF, -EBADF };
	struct kvs_slot before[SLOTS];
	table(before);
	for (unsigned i = 0; i < sizeof(q) / sizeof(q[0]); i++)
		cr_assert_eq(raw_sync(c, &q[i]), want[i], "record %u", i);
	/* garbage in the request area */
	memset(c->cshm->request, 0xa5, sizeof(c->cshm->request));
	struct kvs_sqe so = { .op = KVS_OP_SEND_OPEN, .handle = 0 };
	cr_assert_eq(raw_sync(c, &so), -EINVAL);
	assert_table(before, "hostile sync records");
	cr_assert_eq(stat_get(&px, "rooms_open"), 0);
	/* handles run out: -EMFILE from the library */
	kvs_room *r[5];
	struct kvs_room_desc d;
	for (int i = 0; i < 4; i++)
		cr_assert_eq(kvs_recv_open(c, 10, (uint64_t)i, &r[i], &d), 0);
	cr_assert_eq(kvs_recv_open(c, 10, 9, &r[4], &d), -EMFILE);
	cr_assert_eq(kvs_room_lease(r[0], 0, &(struct kvs_lease){ 0 }), -EAGAIN, "not complete");
	kvs_close(c);
	wait_idle(&px, 0);
}

Test(errors, release_in_flight_is_busy)
{
	kvs_client *rx = connect_ok(&px), *tx = connect_ok(&px);
	kvs_room *rr, *sr;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(rx, SLOT, 1, &rr, &d), 0);
	cr_assert_eq(kvs_send_open(tx, &d, 2, &sr), 0);
	struct kvs_lease l;
	cr_assert_eq(kvs_acquire(tx, 1, &l), 0);
	fp_set(&px, "local.quiesce", "pause", NULL);
	cr_assert_eq(kvs_send(sr, &l, 0, SLOT), 0);
	fp_wait(&px, "local.quiesce", 1);
	struct kvs_slot before[SLOTS];
	table(before);
	cr_assert_eq(kvs_release(tx, &l), -EBUSY);
	cr_assert_eq(kvs_send(sr, &l, 0, SLOT), -EEXIST);
	assert_table(before, "releasing an in-flight slot");
	fp_set(&px, "local.quiesce", "off", NULL);
	cr_assert_eq(wait_event(rx).type, KVS_EV_RECV_DONE);
	cr_assert_eq(kvs_release(tx, &l), -ESTALE, "handed over: stale now");
	kvs_close(rx);
	kvs_close(tx);
	wait_idle(&px, 0);
}

/* The control segment is read-only by the kernel's word. */
#define FAULTED 42

static void on_segv(int sig)
{
	(void)sig;
	_exit(FAULTED);
}

static int write_ctrl(int rd, int wr, void *arg)
{
	(void)rd;
	(void)wr;
	/* our own handler, so sanitizers report the fault the same way */
	struct sigaction sa = { .sa_handler = on_segv };
	sigaction(SIGSEGV, &sa, NULL);
	volatile uint32_t *p = arg;
	*p = 0xdead; /* must fault */
	return 0;
}

Test(errors, control_segment_cannot_be_written)
{
	int fd = kvs_sock_connect(px.sock);
	cr_assert_geq(fd, 0);
	struct kvs_hello h = { .magic = KVS_MAGIC_HELLO, .abi = KVS_ABI, .kind = KVS_HELLO_STAT };
	cr_assert_eq(kvs_sock_send(fd, &h, sizeof(h), NULL, 0), 0);
	struct kvs_welcome w;
	int cfd = -1, n = 1;
	cr_assert_eq(kvs_sock_recv(fd, &w, sizeof(w), &cfd, &n, 0), (ssize_t)sizeof(w));
	cr_assert_eq(n, 1);
	close(fd);
	cr_assert_eq(mmap(NULL, w.ctrl_size, PROT_READ | PROT_WRITE, MAP_SHARED, cfd, 0),
		     MAP_FAILED);
	cr_assert_eq(errno, EPERM, "a writable mapping must be refused");
	void *ro = mmap(NULL, w.ctrl_size, PROT_READ, MAP_SHARED, cfd, 0);
	cr_assert_neq(ro, MAP_FAILED);
	cr_assert_eq(mprotect(ro, w.ctrl_size, PROT_READ | PROT_WRITE), -1);
	cr_assert_eq(errno, EACCES, "mprotect must not upgrade it");
	cr_assert_eq(pwrite(cfd, "x", 1, 0), -1);
	cr_assert_eq(errno, EPERM, "write() must be refused");
	cr_assert_eq(ftruncate(cfd, 0), -1, "nor may it shrink");
	struct child ch;
	child_start(&ch, write_ctrl, (void *)&((const struct kvs_ctrl *)ro)->sleeping);
	cr_assert_eq(child_wait(&ch), FAULTED, "writing the mapping must fault");
	/* and the same through a connected client's mapping */
	kvs_client *c = connect_ok(&px);
	child_start(&ch, write_ctrl, (void *)&c->ctrl->stats.slots[0]);
	cr_assert_eq(child_wait(&ch), FAULTED);
	cr_assert_eq(((const struct kvs_ctrl *)ro)->magic, KVS_MAGIC_CTRL);
	kvs_close(c);
	munmap(ro, w.ctrl_size);
	close(cfd);
}

/* Peer credentials: the socket's mode keeps strangers out; past it, the
 * proxy's own SO_PEERCRED check does. */
static int connect_as_nobody(int rd, int wr, void *arg)
{
	(void)rd;
	(void)arg;
	if (setgroups(0, NULL) || setresgid(65534, 65534, 65534) || setresuid(65534, 65534, 65534))
		return 100;
	kvs_client *c;
	int rc = kvs_connect(px.sock, &c);
	chan_put(wr, &rc, sizeof(rc));
	if (rc == 0)
		kvs_close(c);
	return 0;
}

static int try_nobody(void)
{
	struct child ch;
	child_start(&ch, connect_as_nobody, NULL);
	int rc = 1;
	cr_assert_eq(chan_get(ch.from, &rc, sizeof(rc)), 0, "child could not drop to nobody");
	cr_assert_eq(child_wait(&ch), 0);
	return rc;
}

Test(errors, peer_credentials_are_checked)
{
	if (geteuid() != 0)
		cr_skip_test("needs root to run a client as another uid (nobody)");
	struct stat st;
	cr_assert_eq(stat(px.sock, &st), 0);
	cr_assert_eq(st.st_mode & 0777, 0660, "the socket is mode 0660");
	chmod(px.dir, 0755); /* mkdtemp made it 0700 */
	cr_assert_eq(try_nobody(), -EACCES, "the file mode keeps nobody out");
	chmod(px.sock, 0666);
	uint64_t refused = stat_get(&px, "clients_refused");
	int rc = try_nobody();
	cr_assert_eq(rc, -EACCES, "past the mode, SO_PEERCRED refuses nobody: %s",
		     kvs_strerror(rc));
	cr_assert_eq(stat_get(&px, "clients_refused"), refused + 1, "refused %llu -> %llu",
		     (unsigned long long)refused,
		     (unsigned long long)stat_get(&px, "clients_refused"));
	proxy_stop(&px);
	/* --allow-uid needs a socket that lets the uid reach it (test-access
	 * shows a mode that would not is refused at start). */
	proxy_start(&px, NULL,
		    (const char *[]){ "--slots", "4", "--slot-size", "4K", "--allow-uid", "65534",
				      "--socket-mode", "0666", NULL });
	chmod(px.dir, 0755);
	cr_assert_eq(try_nobody(), 0, "--allow-uid admits it");
}

/* A raw CLIENT hello: its welcome into *w. Returns how many fds came with it
 * (closed). */
static int raw_hello(uint32_t abi, uint32_t ring_layout, struct kvs_welcome *w)
{
	int fd = kvs_sock_connect(px.sock);
	cr_assert_geq(fd, 0);
	struct kvs_hello h = { .magic = KVS_MAGIC_HELLO,
			       .abi = abi,
			       .kind = KVS_HELLO_CLIENT,
			       .ring_layout = ring_layout };
	cr_assert_eq(kvs_sock_send(fd, &h, sizeof(h), NULL, 0), 0);
	int fds[KVS_WELCOME_NFDS], n = KVS_WELCOME_NFDS;
	cr_assert_eq(kvs_sock_recv(fd, w, sizeof(*w), fds, &n, 0), (ssize_t)sizeof(*w));
	for (int i = 0; i < n; i++)
		close(fds[i]);
	close(fd);
	return n;
}

/* A library of another ABI, or built against a DPDK that lays rte_ring out
 * otherwise (it would read our indices where we do not write them), is
 * refused at its hello: no client, no fds, nothing in the slot table; the
 * proxy says why in its log, and the library's kvs_strerror says it too.
 * The same library with our layout then attaches. */
Test(errors, hello_of_another_abi_or_ring_layout_refused_and_nothing_changes)
{
	struct kvs_slot before[SLOTS];
	table(before);
	uint64_t refused = stat_get(&px, "clients_refused"), total = stat_get(&px, "clients_total");
	struct kvs_welcome w;

	cr_assert_eq(raw_hello(KVS_ABI + 1, kvs_ring_layout(), &w), 0, "fds came with a refusal");
	cr_assert_eq(w.status, -EPROTO, "another ABI: %d", w.status);
	cr_assert(strstr(w.msg, "ABI mismatch"), "%s", w.msg);

	uint32_t other = kvs_ring_layout() ^ 0x40u;
	cr_assert_eq(raw_hello(KVS_ABI, other, &w), 0, "fds came with a refusal");
	cr_assert_eq(w.status, -ENOEXEC, "another ring layout: %d (%s)", w.status, w.msg);
	char says[96];
	snprintf(says, sizeof(says), "rte_ring layout %08x is not kvstaged's %08x", (unsigned)other,
		 (unsigned)kvs_ring_layout());
	cr_assert(strstr(w.msg, says), "%s", w.msg);
	cr_assert_eq(raw_hello(KVS_ABI, 0, &w), 0, "a library too old to say its layout");
	cr_assert_eq(w.status, -ENOEXEC);
	cr_assert(strstr(kvs_strerror(-ENOEXEC), "rte_ring"), "%s", kvs_strerror(-ENOEXEC));

	cr_assert_eq(stat_get(&px, "clients_refused"), refused + 3);
	cr_assert_eq(stat_get(&px, "clients_total"), total, "a refused hello became a client");
	cr_assert_eq(stat_get(&px, "clients"), 0);
	assert_table(before, "a refused hello");
	cr_assert_eq(proxy_log_count(&px, "built against different DPDK versions"), 2,
		     "the log says why");

	kvs_client *c = connect_ok(&px);
	cr_assert_eq(stat_get(&px, "clients_total"), total + 1);
	kvs_close(c);
}

/* Something at the socket path welcomes a client with a control segment
 * whose rings another DPDK laid out: kvs_connect refuses it (-ENOEXEC)
 * before it maps anything else. */
static int other_layout_proxy(int rd, int wr, void *arg)
{
	(void)rd;
	const char *path = arg;
	int l = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	snprintf(a.sun_path, sizeof(a.sun_path), "%s", path);
	if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof(a)) < 0 || listen(l, 4) < 0)
		return 1;
	chan_put(wr, "ready", 5);
	int c = accept(l, NULL, NULL);
	struct kvs_hello h;
	if (c < 0 || recv(c, &h, sizeof(h), 0) != sizeof(h))
		return 2;
	int ctrl = memfd_create("ctrl", MFD_CLOEXEC), efd = eventfd(0, EFD_CLOEXEC);
	if (ctrl < 0 || efd < 0 || ftruncate(ctrl, 4096) < 0)
		return 3;
	struct kvs_ctrl *ctl = mmap(NULL, 4096, PROT_WRITE, MAP_SHARED, ctrl, 0);
	if (ctl == MAP_FAILED)
		return 4;
	*ctl = (struct kvs_ctrl){ .magic = KVS_MAGIC_CTRL,
				  .abi = KVS_ABI,
				  .instance = 7,
				  .ring_layout = h.ring_layout ^ 0x40u };
	struct kvs_welcome w = { .magic = KVS_MAGIC_HELLO,
				 .abi = KVS_ABI,
				 .client_id = 1,
				 .instance = 7,
				 .ctrl_size = 4096,
				 .cmem_size = 4096 };
	int fds[KVS_WELCOME_NFDS] = { ctrl, ctrl, ctrl, efd, efd };
	if (kvs_sock_send(c, &w, sizeof(w), fds, KVS_WELCOME_NFDS) < 0)
		return 5;
	char b;
	recv(c, &b, 1, 0); /* until the library hangs up */
	return 0;
}

Test(errors, library_refuses_a_proxy_of_another_ring_layout)
{
	char path[108];
	snprintf(path, sizeof(path), "/tmp/kvstage-layout-%d.sock", (int)getpid());
	unlink(path);
	struct child ch;
	child_start(&ch, other_layout_proxy, path);
	char ready[5];
	cr_assert_eq(chan_get(ch.from, ready, 5), 0);
	kvs_client *c = NULL;
	int rc = kvs_connect(path, &c);
	cr_assert_eq(rc, -ENOEXEC, "kvs_connect: %d (%s)", rc, kvs_strerror(rc));
	cr_assert_null(c);
	cr_assert_eq(child_wait(&ch), 0);
	unlink(path);
}
