/* SPDX-License-Identifier: MIT */
/*
 * Who may reach the proxy, and what a local attacker or a careless operator
 * can make it do: the socket's path (links, files, squatted locks, shared
 * directories), access control with real uids and supplementary groups,
 * silent connections, log floods, pools that cannot fit, and a drain that
 * stays visible. Parts that take other uids need root and skip, saying so.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "sock.h"

static struct proxy px = PROXY_INIT;
static char dir[64];
static char out[16384], err[16384];

static void teardown(void)
{
	proxy_stop(&px);
	if (dir[0]) {
		char cmd[128];
		snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
		cr_assert_eq(system(cmd), 0);
		dir[0] = 0;
	}
}

TestSuite(access, .fini = teardown, .timeout = 120);

static const char *in_dir(const char *name)
{
	static char buf[4][128];
	static int k;
	k = (k + 1) % 4;
	if (!dir[0]) {
		strcpy(dir, "/tmp/kvstage-access.XXXXXX");
		cr_assert_not_null(mkdtemp(dir));
	}
	snprintf(buf[k], sizeof(buf[k]), "%s/%s", dir, name);
	return buf[k];
}

/* kvstaged with args (NULL-terminated, after --socket sock); returns its exit code. */
static int kvstaged(const char *sock, const char *const *args)
{
	const char *argv[32] = { build_path("proxy/kvstaged"), "--socket", sock, "--no-lock" };
	int n = 4;
	for (; args && *args && n < 31; args++)
		argv[n++] = *args;
	argv[n] = NULL;
	return run_cmd(argv, out, sizeof(out), err, sizeof(err));
}

static void need_root(void)
{
	if (geteuid() != 0)
		cr_skip_test("needs root to take other uids and groups");
}

/* kvs_connect as another user, in a child. Returns its result (0 or -errno). */
static int connect_as(uid_t uid, gid_t gid, const gid_t *groups, int ngroups)
{
	fflush(NULL);
	pid_t pid = fork();
	cr_assert_neq(pid, -1);
	if (pid == 0) {
		if (setgroups((size_t)ngroups, groups) || setgid(gid) || setuid(uid))
			_exit(100);
		kvs_client *c;
		int rc = kvs_connect(px.sock, &c);
		if (rc == 0)
			kvs_close(c);
		_exit(-rc);
	}
	int st;
	cr_assert_eq(reap(pid, &st), pid);
	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) != 100, "could not become uid %u", uid);
	return -WEXITSTATUS(st);
}

/* --------------------------------------------------------- the path */

Test(access, a_planted_lock_link_is_not_followed)
{
	const char *sock = in_dir("kvs.sock"), *victim = in_dir("victim");
	cr_assert_eq(symlink(victim, in_dir("kvs.sock.lock")), 0);
	cr_assert_eq(kvstaged(sock, NULL), 1);
	cr_assert(strstr(err, "symbolic link"), "%s", err);
	cr_assert_eq(access(victim, F_OK), -1, "the link's target was created");
	/* an existing target is left as it was */
	int fd = open(victim, O_WRONLY | O_CREAT, 0644);
	cr_assert_eq(write(fd, "keep", 4), 4);
	close(fd);
	cr_assert_eq(kvstaged(sock, NULL), 1);
	struct stat st;
	cr_assert_eq(stat(victim, &st), 0);
	cr_assert_eq(st.st_size, 4, "the link's target was truncated or written");
}

Test(access, a_lock_someone_else_holds_is_refused_clearly)
{
	need_root();
	const char *sock = in_dir("kvs.sock"), *lock = in_dir("kvs.sock.lock");
	int fd = open(lock, O_WRONLY | O_CREAT, 0600);
	cr_assert_geq(fd, 0);
	close(fd);
	cr_assert_eq(chown(lock, 4242, 4242), 0);
	cr_assert_eq(kvstaged(sock, NULL), 1);
	cr_assert(strstr(err, "not a plain file of ours") && strstr(err, "4242"), "%s", err);
}

Test(access, a_socket_path_naming_a_file_keeps_the_file)
{
	const char *sock = in_dir("precious");
	int fd = open(sock, O_WRONLY | O_CREAT, 0644);
	cr_assert_eq(write(fd, "data", 4), 4);
	close(fd);
	cr_assert_eq(kvstaged(sock, NULL), 1);
	cr_assert(strstr(err, "not a socket"), "%s", err);
	struct stat st;
	cr_assert_eq(stat(sock, &st), 0, "the file was deleted");
	cr_assert(S_ISREG(st.st_mode) && st.st_size == 4);
}

Test(access, a_directory_others_may_write_is_refused_unless_sticky)
{
	const char *sock = in_dir("kvs.sock");
	cr_assert_eq(chmod(dir, 0777), 0);
	cr_assert_eq(kvstaged(sock, NULL), 1);
	cr_assert(strstr(err, "another user replace"), "%s", err);
	cr_assert_eq(access(sock, F_OK), -1);
	/* with the sticky bit (as /tmp), others cannot remove what is ours */
	cr_assert_eq(chmod(dir, 01777), 0);
	/* past the directory's check, a 1 TiB pool is what stops it */
	cr_assert_eq(kvstaged(sock, (const char *[]){ "--slots", "16777216", "--slot-size", "64K",
						      NULL }),
		     1);
	cr_assert(strstr(err, "does not fit") && !strstr(err, "another user"), "%s", err);
}

/* ------------------------------------------------------ access control */

Test(access, an_allow_uid_the_socket_keeps_out_is_refused_at_start)
{
	const char *sock = in_dir("kvs.sock");
	cr_assert_eq(kvstaged(sock, (const char *[]){ "--allow-uid", "4242", NULL }), 2);
	cr_assert(strstr(err, "--allow-uid 4242") && strstr(err, "--socket-mode 0666"), "%s", err);
	cr_assert_eq(kvstaged(sock, (const char *[]){ "--allow-gid", "5000", NULL }), 2);
	cr_assert(strstr(err, "--socket-group 5000"), "%s", err);
	cr_assert_eq(kvstaged(sock, (const char *[]){ "--socket-mode", "0440", NULL }), 2);
	cr_assert(strstr(err, "owner"), "%s", err);
	cr_assert_eq(kvstaged(sock, (const char *[]){ "--socket-mode", "0999", NULL }), 2);
	cr_assert_eq(kvstaged(sock, (const char *[]){ "--socket-group", "no-such-group-x", NULL }),
		     2);
	cr_assert(strstr(err, "no such group"), "%s", err);
}

Test(access, allowed_uids_and_supplementary_groups_get_in_and_others_hear_why_not)
{
	need_root();
	/* the socket's group is 5000: members get in, primary or supplementary */
	proxy_start_plain(&px, (const char *[]){ "--slots", "2", "--slot-size", "4K",
						 "--socket-group", "5000", NULL });
	chmod(px.dir, 0755);
	struct stat st;
	cr_assert_eq(stat(px.sock, &st), 0);
	cr_assert_eq(st.st_gid, 5000);
	cr_assert_eq(st.st_mode & 0777, 0660);
	gid_t g5000 = 5000;
	int rc = connect_as(4243, 4243, &g5000, 1);
	cr_assert_eq(rc, 0, "a supplementary member: %s", kvs_strerror(rc));
	rc = connect_as(4244, 5000, NULL, 0);
	cr_assert_eq(rc, 0, "a primary member: %s", kvs_strerror(rc));
	rc = connect_as(4245, 4245, NULL, 0);
	cr_assert_eq(rc, -EACCES, "a stranger, kept out by the mode: %s", kvs_strerror(rc));
	proxy_stop(&px);

	/* an open socket, the proxy's rule behind it */
	proxy_start_plain(&px, (const char *[]){ "--slots", "2", "--slot-size", "4K",
						 "--socket-mode", "0666", "--allow-uid", "4242",
						 "--allow-gid", "5001", NULL });
	chmod(px.dir, 0755);
	rc = connect_as(4242, 4242, NULL, 0);
	cr_assert_eq(rc, 0, "--allow-uid: %s", kvs_strerror(rc));
	gid_t g5001 = 5001;
	rc = connect_as(4246, 4246, &g5001, 1);
	cr_assert_eq(rc, 0, "--allow-gid, supplementary: %s", kvs_strerror(rc));
	uint64_t refused = stat_get(&px, "clients_refused");
	rc = connect_as(4247, 4247, NULL, 0);
	cr_assert_eq(rc, -EACCES, "past the mode, the proxy refuses: %s", kvs_strerror(rc));
	cr_assert_eq(stat_get(&px, "clients_refused"), refused + 1);
	char log[8192] = { 0 };
	int fd = open(px.log, O_RDONLY);
	cr_assert_eq(read(fd, log, sizeof(log) - 1) > 0, 1);
	close(fd);
	cr_assert(strstr(log, "refused pid") && strstr(log, "uid 4247"), "%s", log);
}

/* As uid 4250 in a child: connects, and opens a room. Returns 0, or the
 * first -errno (connect's, or recv_open's + 1000). */
static int connect_and_open_as(uid_t uid)
{
	fflush(NULL);
	pid_t pid = fork();
	cr_assert_neq(pid, -1);
	if (pid == 0) {
		if (setgroups(0, NULL) || setgid(uid) || setuid(uid))
			_exit(255);
		kvs_client *c;
		int rc = kvs_connect(px.sock, &c);
		if (rc < 0)
			_exit(-rc);
		kvs_room *r;
		struct kvs_room_desc d;
		rc = kvs_recv_open(c, 4096, 1, &r, &d);
		kvs_close(c);
		_exit(rc < 0 ? 100 - rc : 0);
	}
	int st;
	cr_assert_eq(reap(pid, &st), pid);
	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) != 255, "could not become uid %u", uid);
	int v = WEXITSTATUS(st);
	return v >= 100 ? -(1000 + v - 100) : -v;
}

/* Another process holds places: n clients, rooms among them (at most 256
 * each, --client-rooms); says "ok" or "no", then holds on until its pipe closes. */
struct holding {
	unsigned clients, rooms;
};

static int holder(int rd, int wr, void *arg)
{
	const struct holding *h = arg;
	static kvs_client *c[256];
	for (unsigned i = 0; i < h->clients; i++)
		if (kvs_connect(px.sock, &c[i]) < 0)
			return chan_put(wr, "no", 2), 1;
	for (unsigned k = 0; k < h->rooms; k++) {
		kvs_room *r;
		struct kvs_room_desc d;
		if (kvs_recv_open(c[k / 256], 4096, k, &r, &d) < 0)
			return chan_put(wr, "no", 2), 1;
	}
	chan_put(wr, "ok", 2);
	char b;
	chan_get(rd, &b, 1); /* until the parent lets go */
	return 0;
}

static void hold(struct child *ch, unsigned clients, unsigned rooms)
{
	struct holding h = { clients, rooms };
	child_start(ch, holder, &h);
	char said[3] = { 0 };
	cr_assert_eq(chan_get(ch->from, said, 2), 0);
	cr_assert_str_eq(said, "ok", "another process could not hold %u clients, %u rooms", clients,
			 rooms);
}

static void let_go(struct child *ch)
{
	close(ch->to);
	cr_assert_eq(child_wait(ch), 0);
}

/* --uid-share at its default 75 %: of the default --max-clients (256), a
 * uid holds at most 192 places and one process at most 144 of those. */
enum { UID_CLIENTS = 256 * 75 / 100, PROC_CLIENTS = UID_CLIENTS * 75 / 100 };
enum { UID_ROOMS = 4096 * 75 / 100, PROC_ROOMS = UID_ROOMS * 75 / 100 };

/* The kernel names a process across PID namespaces (SO_PEERPIDFD, pidfs). */
static bool pidfs_names_processes(void)
{
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
		return false;
	int pidfd = -1;
	socklen_t len = sizeof(pidfd);
	struct statfs fs;
	bool ok = getsockopt(sv[0], SOL_SOCKET, 77 /* SO_PEERPIDFD */, &pidfd, &len) == 0 &&
		  fstatfs(pidfd, &fs) == 0 && fs.f_type == 0x50494446 /* PIDFS_MAGIC */;
	if (pidfd >= 0)
		close(pidfd);
	close(sv[0]);
	close(sv[1]);
	return ok;
}

/* pod: the proxy in a PID namespace of its own, where every client's pid
 * is 0 (a pod's sidecar); the kernel's pidfs still names each process. */
static void shared_proxy(bool pod)
{
	need_root();
	if (pod && !pidfs_names_processes())
		cr_skip_test("this kernel has no SO_PEERPIDFD with pidfs (Linux 6.9): a pod's "
			     "clients of one uid share their uid's places, as design note 42 says");
	px.pidns = pod;
	proxy_start_plain(&px,
			  (const char *[]){ "--slots", "16", "--slot-size", "4K", "--socket-mode",
					    "0666", "--allow-uid", "4250", NULL });
	chmod(px.dir, 0755);
}

/* No process takes every client place of its uid, and no uid every place
 * (issue 39, item 3). */
static void no_process_or_uid_takes_every_client_place(bool pod)
{
	shared_proxy(pod);
	static kvs_client *c[PROC_CLIENTS];
	for (int i = 0; i < PROC_CLIENTS; i++) {
		int rc = kvs_connect(px.sock, &c[i]);
		cr_assert_eq(rc, 0, "client %d of our process's share: %s", i, kvs_strerror(rc));
	}
	kvs_client *extra;
	int rc = kvs_connect(px.sock, &extra);
	cr_assert_eq(rc, -EUSERS, "past our process's share of places: %s", kvs_strerror(rc));
	cr_assert_eq(connect_and_open_as(0), 0, "another process of our uid still gets a place");
	struct child other;
	hold(&other, UID_CLIENTS - PROC_CLIENTS, 0); /* the rest of our uid's share */
	cr_assert_eq(connect_and_open_as(0), -EUSERS, "past our uid's share of places");
	cr_assert_eq(connect_and_open_as(4250), 0, "another uid still gets a place and a room");
	let_go(&other);
	cr_assert_eq(connect_and_open_as(0), 0, "a place given back is taken again");
	char log[65536];
	proxy_log(&px, log, sizeof(log));
	cr_assert(strstr(log, "holds its share of uid 0's client places"), "%s", log);
	cr_assert(strstr(log, "uid 0 holds its share of the client places"), "%s", log);
	cr_assert_eq(strstr(log, "attached: pid 0 ") != NULL, pod, "pod %d: %s", pod, log);
	for (int i = 0; i < PROC_CLIENTS; i++)
		kvs_close(c[i]);
}

Test(access, no_process_or_uid_takes_every_client_place)
{
	no_process_or_uid_takes_every_client_place(false);
}

Test(access, in_a_pod_no_process_or_uid_takes_every_client_place)
{
	no_process_or_uid_takes_every_client_place(true);
}

/* No process opens every room of its uid's share, and no uid every room
 * (issue 39, item 2): 256 a connection (--client-rooms). */
static void no_process_or_uid_opens_every_room(bool pod)
{
	shared_proxy(pod);
	static kvs_client *c[PROC_ROOMS / 256 + 1];
	for (unsigned i = 0; i < PROC_ROOMS / 256 + 1; i++)
		c[i] = connect_ok(&px);
	struct kvs_room_desc d;
	kvs_room *r;
	for (int k = 0; k < PROC_ROOMS; k++) {
		int rc = kvs_recv_open(c[k / 256], 4096, (uint64_t)k, &r, &d);
		cr_assert_eq(rc, 0, "room %d of our process's share: %s", k, kvs_strerror(rc));
	}
	int rc = kvs_recv_open(c[PROC_ROOMS / 256], 4096, 1, &r, &d);
	cr_assert_eq(rc, -ENFILE, "past our process's share of rooms: %s", kvs_strerror(rc));
	cr_assert_eq(connect_and_open_as(0), 0, "another process of our uid still opens a room");
	struct child other;
	hold(&other, 4, UID_ROOMS - PROC_ROOMS); /* the rest of our uid's share */
	cr_assert_eq(connect_and_open_as(0), -(1000 + ENFILE), "past our uid's share of rooms");
	cr_assert_eq(connect_and_open_as(4250), 0, "another uid still opens a room");
	let_go(&other);
	cr_assert_eq(connect_and_open_as(0), 0, "rooms given back are opened again");
	for (unsigned i = 0; i < PROC_ROOMS / 256 + 1; i++)
		kvs_close(c[i]);
}

Test(access, no_process_or_uid_opens_every_room)
{
	no_process_or_uid_opens_every_room(false);
}

Test(access, in_a_pod_no_process_or_uid_opens_every_room)
{
	no_process_or_uid_opens_every_room(true);
}

/* Silent connections (no hello) must not keep a client that talks out. */
Test(access, silent_connections_lock_nobody_out)
{
	proxy_start_plain(&px, (const char *[]){ "--slots", "2", "--slot-size", "4K", NULL });
	enum { SILENT = 100 };
	int silent[SILENT];
	for (int i = 0; i < SILENT; i++) {
		silent[i] = kvs_sock_connect(px.sock);
		cr_assert_geq(silent[i], 0, "connect %d: %s", i, kvs_strerror(silent[i]));
	}
	for (int k = 0; k < 4; k++) {
		kvs_client *c;
		int rc = kvs_connect(px.sock, &c);
		cr_assert_eq(rc, 0, "client %d behind %d silent connections: %s", k, SILENT,
			     kvs_strerror(rc));
		struct kvs_lease l;
		cr_assert_eq(kvs_acquire(c, 1, &l), 0);
		kvs_close(c);
	}
	cr_assert_geq(stat_get(&px, "clients_refused"), SILENT - 8,
		      "the silent ones beyond one uid's share were dropped");
	for (int i = 0; i < SILENT; i++)
		close(silent[i]);
}

/* ---------------------------------------------------------- the logs */

static unsigned log_count(const char *what)
{
	FILE *f = fopen(px.log, "r");
	cr_assert_not_null(f);
	char line[1024];
	unsigned n = 0;
	while (fgets(line, sizeof(line), f))
		n += strstr(line, what) != NULL;
	fclose(f);
	return n;
}

Test(access, a_client_cannot_flood_the_log)
{
	proxy_start(&px, NULL, (const char *[]){ "--slots", "2", "--slot-size", "4K", NULL });
	kvs_client *rx = connect_ok(&px), *tx = connect_ok(&px);
	kvs_room *r, *s;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(rx, 4096, 1, &r, &d), 0);
	struct kvs_desc_wire *w = (struct kvs_desc_wire *)d.bytes;
	w->token[0] ^= 1;
	enum { N = 3000 };
	for (int i = 0; i < N; i++)
		cr_assert_eq(kvs_send_open(tx, &d, 2, &s), -EPERM);
	cr_assert_eq(stat_get(&px, "rej_token"), N);
	unsigned lines = log_count("wrong token");
	cr_assert_leq(lines, 6, "%u log lines for %d refused ops", lines, N);
	cr_assert_geq(lines, 1, "nothing was logged at all");
	cr_assert_geq(stat_get(&px, "log_suppressed"), N - 6);
	kvs_close(tx); /* its summary: how many lines were held back */
	stat_wait(&px, "clients_closed", 1, 1);
	cr_assert_eq(log_count("more lines not logged"), 1);
	kvs_close(rx);
}

/* What an operator acts on is said at info: a client attaching and
 * closing, a room aborted and why. A client doing it in a loop is held to
 * the rate limit. */
Test(access, attaches_closes_and_aborts_are_logged_but_not_flooded)
{
	proxy_start(&px, NULL, (const char *[]){ "--slots", "2", "--slot-size", "4K", NULL });
	kvs_client *rx = connect_ok(&px);
	kvs_room *r;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(rx, 4096, 1, &r, &d), 0);
	cr_assert_eq(kvs_abort(r), 0);
	cr_assert_eq(wait_event(rx).type, KVS_EV_ABORTED);
	cr_assert_eq(kvs_room_close(r), 0);
	cr_assert_eq(log_count("attached: pid"), 1);
	cr_assert_eq(
		log_count("aborted: Operation canceled (0 chunks in flight, 1 slots posted)") +
			log_count(
				"aborted: Operation canceled (0 chunks in flight, 0 slots posted)"),
		1, "no line says the room was aborted and why");
	enum { N = 100 };
	for (int i = 0; i < N; i++) {
		kvs_client *c = connect_ok(&px);
		kvs_close(c);
	}
	stat_wait(&px, "clients_closed", 1, N);
	unsigned lines = log_count("attached: pid") + log_count(") closed, ");
	cr_assert_leq(lines, 6, "%u lines for %d clients", lines, N + 1);
	cr_assert_geq(stat_get(&px, "log_suppressed"), 2 * N + 1 - 6);
	for (int i = 0; i < N; i++) {
		cr_assert_eq(kvs_recv_open(rx, 4096, 2, &r, &d), 0);
		cr_assert_eq(kvs_abort(r), 0);
		cr_assert_eq(wait_event(rx).type, KVS_EV_ABORTED);
		cr_assert_eq(kvs_room_close(r), 0);
	}
	lines = log_count("aborted: ");
	cr_assert_leq(lines, 5, "%u lines for %d aborts", lines, N + 1);
	kvs_close(rx);
}

Test(access, a_burst_of_room_timeouts_is_summarised)
{
	proxy_start_plain(&px, (const char *[]){ "--slots", "2", "--slot-size", "4K",
						 "--room-timeout", "20", NULL });
	kvs_client *rx = connect_ok(&px);
	enum { N = 40 };
	for (int i = 0; i < N; i++) {
		kvs_room *r;
		struct kvs_room_desc d;
		cr_assert_eq(kvs_recv_open(rx, 4096, (uint64_t)i, &r, &d), 0);
	}
	for (int i = 0; i < N; i++)
		cr_assert_eq(wait_event(rx).status, -ETIMEDOUT);
	unsigned lines = log_count("no progress");
	cr_assert_leq(lines, 5, "%u lines for %d timeouts", lines, N);
	kvs_close(rx);
}

/* Out of client places or of descriptors: a clear error, a log line, and
 * the proxy goes on serving the clients it has. */
Test(access, running_out_of_clients_or_descriptors_is_said)
{
	struct rlimit old, low = { 48, 48 };
	cr_assert_eq(getrlimit(RLIMIT_NOFILE, &old), 0);
	low.rlim_max = old.rlim_max;
	cr_assert_eq(setrlimit(RLIMIT_NOFILE, &low), 0);
	proxy_start_plain(&px, (const char *[]){ "--slots", "2", "--slot-size", "4K",
						 "--max-clients", "30", NULL });
	cr_assert_eq(setrlimit(RLIMIT_NOFILE, &old), 0);
	kvs_client *c[30];
	int n = 0, rc = 0;
	while (n < 30 && (rc = kvs_connect(px.sock, &c[n])) == 0)
		n++;
	cr_assert_lt(n, 30, "48 descriptors held 30 clients?");
	cr_assert_geq(n, 1);
	cr_assert_eq(rc, -EUSERS, "client %d: %s", n, kvs_strerror(rc));
	cr_assert_geq(log_count("descriptors") + log_count("Too many open files"), 1,
		      "no log line says why");
	struct kvs_lease l;
	cr_assert_eq(kvs_acquire(c[0], 1, &l), 0, "the clients it has are still served");
	for (int i = 0; i < n; i++)
		kvs_close(c[i]);
	proxy_stop(&px);

	proxy_start_plain(&px, (const char *[]){ "--slots", "2", "--slot-size", "4K",
						 "--max-clients", "1", NULL });
	kvs_client *a = connect_ok(&px), *b;
	rc = kvs_connect(px.sock, &b);
	cr_assert_eq(rc, -EUSERS, "%s", kvs_strerror(rc));
	cr_assert(strstr(kvs_strerror(rc), "full"), "%s", kvs_strerror(rc));
	cr_assert_eq(log_count("too many clients (--max-clients 1)"), 1);
	kvs_close(a);
}

/* ------------------------------------------------ memory and start order */

static uint64_t mem_total(void)
{
	FILE *f = fopen("/proc/meminfo", "r");
	cr_assert_not_null(f);
	char line[256];
	unsigned long long kb = 0;
	while (fgets(line, sizeof(line), f))
		if (sscanf(line, "MemTotal: %llu kB", &kb) == 1)
			break;
	fclose(f);
	return kb * 1024;
}

Test(access, a_pool_larger_than_memory_is_refused_before_it_is_built)
{
	uint64_t want = 2 * mem_total();
	if (want > (1ull << 40))
		cr_skip_test(
			"this machine has more than 512 GiB: twice its memory is past the 1 TiB "
			"pool limit, refused earlier");
	char slots[32];
	snprintf(slots, sizeof(slots), "%llu", (unsigned long long)(want >> 30) + 1);
	const char *sock = in_dir("kvs.sock");
	cr_assert_eq(
		kvstaged(sock, (const char *[]){ "--slots", slots, "--slot-size", "1G", NULL }), 1);
	cr_assert(strstr(err, "does not fit"), "%s", err);
	/* a bad socket path is said before the pool's size is even looked at */
	cr_assert_eq(kvstaged("/nonexistent-kvstage-dir/kvs.sock",
			      (const char *[]){ "--slots", slots, "--slot-size", "1G", NULL }),
		     1);
	cr_assert(strstr(err, "/nonexistent-kvstage-dir") && !strstr(err, "does not fit"), "%s",
		  err);
}

/* ----------------------------------------------------------- draining */

Test(access, a_draining_proxy_stays_visible_and_says_what_it_waits_for)
{
	proxy_start(&px, NULL,
		    (const char *[]){ "--slots", "4", "--slot-size", "4K", "--shutdown-grace", "50",
				      NULL });
	kvs_client *rx = connect_ok(&px), *tx = connect_ok(&px);
	kvs_room *r, *s;
	struct kvs_room_desc d;
	cr_assert_eq(kvs_recv_open(rx, 4096, 7, &r, &d), 0);
	cr_assert_eq(kvs_send_open(tx, &d, 8, &s), 0);
	fp_set(&px, "local.quiesce", "pause", NULL);
	struct kvs_lease l;
	cr_assert_eq(kvs_acquire(tx, 1, &l), 0);
	cr_assert_eq(kvs_send(s, &l, 0, 4096), 0);
	fp_wait(&px, "local.quiesce", 1); /* held in flight */
	kill(px.pid, SIGTERM);
	stat_wait(&px, "draining", 1, 1);
	stat_wait(&px, "rooms_aborted", 1, 1); /* the grace is over, the chunk still held */
	struct stat st;
	cr_assert_eq(lstat(px.sock, &st), 0, "the socket is gone while draining");
	kvs_client *late;
	cr_assert_eq(kvs_connect(px.sock, &late), -ESHUTDOWN);
	const struct kvs_ctrl *ctrl;
	size_t len;
	cr_assert_eq(kvs_stat_map(px.sock, &ctrl, &len), 0, "kvstage-stat cannot reach it");
	cr_assert_eq(ctrl->stats.draining, 1);
	munmap((void *)ctrl, len);
	int admin = kvs_admin_connect(px.sock);
	cr_assert_geq(admin, 0, "the admin path is closed: %s", kvs_strerror(admin));
	close(admin);
	cr_assert_geq(log_count("waiting for transports"), 1, "nothing says what it waits for");
	fp_set(&px, "local.quiesce", "off", NULL);
	int wst;
	cr_assert_eq(reap(px.pid, &wst), px.pid);
	px.pid = 0;
	cr_assert(WIFEXITED(wst) && WEXITSTATUS(wst) == 0, "exit %d", wst);
	cr_assert_eq(lstat(px.sock, &st), -1, "the socket outlived the proxy");
	kvs_close(tx);
	kvs_close(rx);
}
