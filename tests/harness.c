/* SPDX-License-Identifier: MIT */
#include "harness.h"

#include "kvs_build.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sock.h"
#include "statnames.h"

static const char *env_or(const char *name, const char *dflt)
{
	const char *v = getenv(name);
	return v && *v ? v : dflt;
}

const char *build_path(const char *rel)
{
	static char buf[4][512];
	static int k;
	k = (k + 1) % 4;
	snprintf(buf[k], sizeof(buf[k]), "%s/%s", env_or("KVSTAGE_BUILD_DIR", "."), rel);
	return buf[k];
}

pid_t reap(pid_t pid, int *status)
{
	int st = 0, pfd = (int)syscall(SYS_pidfd_open, pid, 0);
	if (pfd >= 0) {
		struct pollfd p = { pfd, POLLIN, 0 };
		int rc = kvs_poll_for(&p, 1, WAIT_MS);
		close(pfd);
		if (rc == 0) {
			kill(pid, SIGKILL);
			waitpid(pid, &st, 0);
			if (status)
				*status = st;
			errno = ETIMEDOUT;
			return -1;
		}
	}
	pid_t r = waitpid(pid, &st, 0);
	if (status)
		*status = st;
	return r;
}

const char *proxy_vulnerable_bin(void)
{
	return build_path("tests/kvstaged-vulnerable");
}

static void spawn(struct proxy *px, const char *bin, const char *const *args, bool failpoints)
{
	int nsfd = -1;
	if (px->netns[0]) {
		char path[96];
		snprintf(path, sizeof(path), "/run/netns/%s", px->netns);
		nsfd = open(path, O_RDONLY | O_CLOEXEC);
		cr_assert_geq(nsfd, 0, "netns %s: %s", px->netns, strerror(errno));
	}
	int ready[2];
	cr_assert_eq(pipe2(ready, O_CLOEXEC), 0);
	const char *argv[48];
	int n = 0;
	argv[n++] = bin;
	argv[n++] = "--socket";
	argv[n++] = px->sock;
	if (failpoints)
		argv[n++] = "--failpoints";
	argv[n++] = "--no-lock";
	argv[n++] = "--ready-fd";
	argv[n++] = "3";
	for (; args && *args && n < 40; args++)
		argv[n++] = *args;
	/* KVSTAGE_TEST_PROXY_ARGS: words every proxy gets too, so that one
	 * suite runs again with another data path (tools/run-tests.sh runs
	 * the tcp suites with --rdma-device rxe0 in the soft-RoCE guest). */
	static char extra[256];
	const char *e = getenv("KVSTAGE_TEST_PROXY_ARGS");
	snprintf(extra, sizeof(extra), "%s", e ? e : "");
	char *save = NULL;
	for (char *w = strtok_r(extra, " ", &save); w && n < 46; w = strtok_r(NULL, " ", &save))
		argv[n++] = w;
	argv[n] = NULL;

	/* A PID namespace of its own: fork, with the new namespace's pid 1 for the child. */
	fflush(NULL);
	pid_t pid = px->pidns ? (pid_t)syscall(SYS_clone, CLONE_NEWPID | SIGCHLD, 0, 0, 0, 0)
			      : fork();
	cr_assert_neq(pid, -1, "fork: %s", strerror(errno));
	if (pid == 0) {
		/* Die with the test process; never hold its stdout. */
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (nsfd >= 0 && setns(nsfd, CLONE_NEWNET) < 0)
			_exit(126);
		int rfd = fcntl(ready[1], F_DUPFD, 10); /* out of the way of 0..3 */
		int log = open(px->log, O_WRONLY | O_CREAT | O_APPEND, 0644);
		int devnull = open("/dev/null", O_RDONLY);
		dup2(devnull, 0);
		dup2(log, 1);
		dup2(log, 2);
		dup2(rfd, 3); /* the copy has no CLOEXEC */
		close(rfd);
		execv(bin, (char *const *)argv);
		_exit(127);
	}
	close(ready[1]);
	if (nsfd >= 0)
		close(nsfd);
	char buf[8] = { 0 };
	ssize_t k = -1;
	struct pollfd rp = { ready[0], POLLIN, 0 };
	if (poll(&rp, 1, WAIT_MS) == 1) /* until it serves or dies */
		k = read(ready[0], buf, sizeof(buf) - 1);
	close(ready[0]);
	if (k != 6 || strcmp(buf, "ready\n")) {
		char logtxt[2048] = { 0 };
		int lfd = open(px->log, O_RDONLY);
		if (lfd >= 0) {
			ssize_t r = read(lfd, logtxt, sizeof(logtxt) - 1);
			(void)r;
			close(lfd);
		}
		kill(pid, SIGKILL);
		waitpid(pid, NULL, 0);
		cr_assert_fail("kvstaged did not start (%s): %s", bin, logtxt);
	}
	px->pid = pid;
	if (failpoints) { /* without --failpoints the proxy refuses admins */
		int fd = kvs_admin_connect(px->sock);
		cr_assert_geq(fd, 0, "admin connect: %s", kvs_strerror(fd));
		px->admin = fd;
	}
	int rc = kvs_stat_map(px->sock, &px->ctrl, &px->ctrl_len);
	cr_assert_eq(rc, 0, "stat map: %s", kvs_strerror(rc));
}

static void start(struct proxy *px, const char *bin, const char *const *args, bool failpoints)
{
	char netns[32];
	snprintf(netns, sizeof(netns), "%s", px->netns); /* the two things a caller may preset */
	bool pidns = px->pidns;
	memset(px, 0, sizeof(*px));
	px->admin = -1;
	memcpy(px->netns, netns, sizeof(netns));
	px->pidns = pidns;
	strcpy(px->dir, "/tmp/kvstage-test.XXXXXX");
	cr_assert_not_null(mkdtemp(px->dir));
	snprintf(px->sock, sizeof(px->sock), "%s/kvstaged.sock", px->dir);
	snprintf(px->log, sizeof(px->log), "%s/kvstaged.log", px->dir);
	spawn(px, bin ? bin : build_path("proxy/kvstaged"), args, failpoints);
}

void proxy_start(struct proxy *px, const char *bin, const char *const *args)
{
	start(px, bin, args, true);
}

void proxy_start_in(struct proxy *px, const char *netns, const char *const *args)
{
	snprintf(px->netns, sizeof(px->netns), "%s", netns);
	start(px, NULL, args, true);
}

void proxy_start_plain(struct proxy *px, const char *const *args)
{
	start(px, NULL, args, false);
}

void proxy_restart(struct proxy *px, const char *const *args)
{
	if (px->ctrl)
		munmap((void *)px->ctrl, px->ctrl_len);
	px->ctrl = NULL;
	if (px->admin >= 0)
		close(px->admin);
	px->admin = -1;
	spawn(px, build_path("proxy/kvstaged"), args, true);
}

int proxy_kill(struct proxy *px, int sig)
{
	int st = 0;
	if (px->pid > 0) {
		kill(px->pid, sig);
		reap(px->pid, &st);
		px->pid = 0;
	}
	return st;
}

void proxy_freeze(struct proxy *px)
{
	int st;
	kill(px->pid, SIGSTOP);
	cr_assert_eq(waitpid(px->pid, &st, WUNTRACED), px->pid);
	cr_assert(WIFSTOPPED(st));
}

void proxy_stop(struct proxy *px)
{
	proxy_kill(px, SIGKILL);
	if (px->admin >= 0)
		close(px->admin);
	px->admin = -1;
	if (px->ctrl)
		munmap((void *)px->ctrl, px->ctrl_len);
	px->ctrl = NULL;
	if (px->dir[0]) {
		char lock[160];
		snprintf(lock, sizeof(lock), "%s.lock", px->sock);
		unlink(px->sock);
		unlink(lock);
		if (!getenv("KVSTAGE_KEEP_LOGS")) /* for a post-mortem */
			unlink(px->log);
		rmdir(px->dir);
		px->dir[0] = 0;
	}
}

uint64_t stat_get(struct proxy *px, const char *name)
{
	const uint64_t *v = kvs_stat_at(px->ctrl, px->ctrl_len, name);
	/* The RDMA data path's counters in a build without it (-Dverbs=disabled):
	 * none ever counted. Any other name is one the proxy publishes, or a
	 * test's typo. */
	if (!v && !strncmp(name, "rdma_", 5) && !KVS_HAVE_VERBS)
		return 0;
	cr_assert_not_null(v, "no counter %s", name);
	return __atomic_load_n(v, __ATOMIC_RELAXED);
}

void stat_wait(struct proxy *px, const char *name, int ge, uint64_t v)
{
	int rc = kvs_admin_stat_wait(px->admin, name, ge, v, WAIT_MS);
	cr_assert_eq(rc, 0, "barrier %s %s %llu: %s (now %llu)", name,
		     ge ? ">=" : "<=", (unsigned long long)v, kvs_strerror(rc),
		     (unsigned long long)stat_get(px, name));
}

void wait_idle(struct proxy *px, uint64_t clients)
{
	stat_wait(px, "clients", 0, clients);
	stat_wait(px, "rooms_open", 0, 0);
	stat_wait(px, "slots.free", 1, px->ctrl->slot_count);
}

void fp_set(struct proxy *px, const char *name, const char *action, const uint64_t *match)
{
	int rc = kvs_admin_fp_set(px->admin, name, action, match);
	cr_assert_eq(rc, 0, "failpoint %s %s: %s", name, action, kvs_strerror(rc));
}

void fp_wait(struct proxy *px, const char *name, uint64_t hits)
{
	int rc = kvs_admin_fp_wait(px->admin, name, hits, WAIT_MS);
	cr_assert_eq(rc, 0, "failpoint %s never hit %llu times: %s", name, (unsigned long long)hits,
		     kvs_strerror(rc));
}

struct kvs_slot slot_pub(struct proxy *px, uint32_t slot)
{
	const struct kvs_slot *t = (const void *)((const char *)px->ctrl + px->ctrl->slots_off);
	cr_assert_lt(slot, px->ctrl->slot_count);
	return t[slot];
}

void sync_barrier(kvs_client *c)
{
	struct kvs_lease none = { 0, 0 }; /* refused or not, its answer is the barrier */
	kvs_release(c, &none);
}

kvs_client *connect_ok(struct proxy *px)
{
	kvs_client *c;
	int rc = kvs_connect(px->sock, &c);
	cr_assert_eq(rc, 0, "connect: %s", kvs_strerror(rc));
	return c;
}

struct kvs_event wait_event(kvs_client *c)
{
	struct kvs_event ev;
	int rc = kvs_wait(c, &ev, WAIT_MS);
	cr_assert_eq(rc, 1, "no event: %s", kvs_strerror(rc));
	return ev;
}

void child_start(struct child *ch, child_fn fn, void *arg)
{
	int down[2], up[2];
	cr_assert_eq(pipe2(down, O_CLOEXEC), 0);
	cr_assert_eq(pipe2(up, O_CLOEXEC), 0);
	fflush(NULL);
	pid_t pid = fork();
	cr_assert_neq(pid, -1);
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		close(down[1]);
		close(up[0]);
		_exit(fn(down[0], up[1], arg));
	}
	close(down[0]);
	close(up[1]);
	ch->pid = pid;
	ch->to = down[1];
	ch->from = up[0];
}

int child_wait(struct child *ch)
{
	int st;
	if (ch->pid <= 0)
		return -1;
	reap(ch->pid, &st);
	ch->pid = 0;
	close(ch->to);
	close(ch->from);
	return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

int chan_put(int fd, const void *b, size_t n)
{
	return kvs_write_full(fd, b, n) < 0 ? -1 : 0;
}

int chan_get(int fd, void *b, size_t n)
{
	return kvs_read_full(fd, b, n) == 1 ? 0 : -1;
}

static void drain(int fd, char *buf, size_t cap, size_t *len, bool *open_)
{
	char tmp[4096];
	ssize_t k = read(fd, tmp, sizeof(tmp));
	if (k <= 0) {
		*open_ = false;
		return;
	}
	size_t take = (size_t)k;
	if (*len + take >= cap)
		take = cap - 1 - *len;
	memcpy(buf + *len, tmp, take);
	*len += take;
	buf[*len] = 0;
}

int run_cmd(const char *const *argv, char *out, size_t cap, char *err, size_t ecap)
{
	int o[2], e[2];
	cr_assert_eq(pipe2(o, O_CLOEXEC), 0);
	cr_assert_eq(pipe2(e, O_CLOEXEC), 0);
	pid_t pid = fork();
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		dup2(o[1], 1);
		dup2(e[1], 2);
		execv(argv[0], (char *const *)argv);
		_exit(127);
	}
	close(o[1]);
	close(e[1]);
	size_t ol = 0, el = 0;
	bool oo = true, eo = true;
	out[0] = err[0] = 0;
	while (oo || eo) {
		struct pollfd p[2] = { { oo ? o[0] : -1, POLLIN, 0 },
				       { eo ? e[0] : -1, POLLIN, 0 } };
		if (poll(p, 2, WAIT_MS) <= 0)
			break;
		if (p[0].revents)
			drain(o[0], out, cap, &ol, &oo);
		if (p[1].revents)
			drain(e[0], err, ecap, &el, &eo);
	}
	close(o[0]);
	close(e[0]);
	int st;
	if (oo || eo) /* it outlived the guard: a hang is a failure, not a wait */
		kill(pid, SIGKILL);
	waitpid(pid, &st, 0);
	return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

void proxy_log(const struct proxy *px, char *buf, size_t cap)
{
	FILE *f = fopen(px->log, "r");
	cr_assert_not_null(f, "%s: %s", px->log, strerror(errno));
	size_t n = fread(buf, 1, cap - 1, f);
	buf[n] = 0;
	fclose(f);
}

unsigned proxy_log_count(const struct proxy *px, const char *what)
{
	static char log[1 << 20];
	proxy_log(px, log, sizeof(log));
	unsigned n = 0;
	for (const char *p = log; (p = strstr(p, what)); p += strlen(what))
		n++;
	return n;
}
