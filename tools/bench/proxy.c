/* SPDX-License-Identifier: MIT */
/* Starting, attaching to and stopping kvstaged; its CPU use from /proc. */
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "admin.h"
#include "bench.h"
#include "kvstage.h"
#include "layout.h"

#define START_TIMEOUT_MS 30000
#define STOP_TIMEOUT_NS 10000000000ull

double proc_cpu_seconds(pid_t pid)
{
	char path[64], buf[1024];
	if (pid <= 0)
		return -1;
	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return -1;
	buf[n] = 0;
	/* comm may hold spaces and parentheses: fields restart after the last ')'. */
	char *p = strrchr(buf, ')');
	if (!p)
		return -1;
	/* After ')': state(3) ppid pgrp session tty_nr tpgid flags minflt
	 * cminflt majflt cmajflt utime(14) stime(15). */
	unsigned long long ut, st;
	if (sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
		return -1;
	return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

struct bench_pin g_pin = { .proxy_cpu = -1 };

static void cpuset_str(const cpu_set_t *set, char *buf, size_t len)
{
	size_t n = 0;
	buf[0] = 0;
	for (int c = 0; c < CPU_SETSIZE && n + 8 < len; c++)
		if (CPU_ISSET(c, set))
			n += (size_t)snprintf(buf + n, len - n, "%s%d", n ? "," : "", c);
}

void pin_init(const struct bench_opts *o)
{
	memset(&g_pin, 0, sizeof(g_pin));
	g_pin.proxy_cpu = g_pin.proxy2_cpu = -1;
	if (sched_getaffinity(0, sizeof(g_pin.all), &g_pin.all) < 0)
		return;
	/* tcp: two proxies, each on a CPU of its own, and two left for the
	 * clients; with fewer, nobody is pinned. */
	unsigned need = o->mode == MODE_TCP || o->mode == MODE_VERBS ? 4 : 2;
	if (o->no_pin || CPU_COUNT(&g_pin.all) < (int)need)
		return;
	g_pin.spread = true;
	for (int c = 0; c < CPU_SETSIZE; c++)
		if (CPU_ISSET(c, &g_pin.all)) {
			g_pin.proxy2_cpu = g_pin.proxy_cpu;
			g_pin.proxy_cpu = c;
		}
	g_pin.clients = g_pin.all;
	CPU_CLR(g_pin.proxy_cpu, &g_pin.clients);
	if (o->mode == MODE_TCP || o->mode == MODE_VERBS)
		CPU_CLR(g_pin.proxy2_cpu, &g_pin.clients);
	else
		g_pin.proxy2_cpu = -1;
	g_pin.on = true;
}

void pin_external(pid_t proxy_pid)
{
	if (!g_pin.on)
		return;
	g_pin.proxy_cpu = -1;
	cpu_set_t theirs, and_;
	/* Only if it keeps to some of our CPUs and leaves us others. */
	if (proxy_pid <= 0 || sched_getaffinity(proxy_pid, sizeof(theirs), &theirs) < 0) {
		g_pin.on = false;
		return;
	}
	CPU_AND(&and_, &theirs, &g_pin.all);
	if (!CPU_EQUAL(&and_, &theirs) || CPU_EQUAL(&theirs, &g_pin.all)) {
		g_pin.on = false;
		return;
	}
	CPU_XOR(&g_pin.clients, &g_pin.all, &theirs);
}

void pin_clients(void)
{
	if (g_pin.on)
		sched_setaffinity(0, sizeof(g_pin.clients), &g_pin.clients);
}

void pin_all(void)
{
	if (g_pin.on)
		sched_setaffinity(0, sizeof(g_pin.all), &g_pin.all);
}

void pin_one(int cpu)
{
	cpu_set_t one;
	if (cpu < 0)
		return;
	CPU_ZERO(&one);
	CPU_SET(cpu, &one);
	sched_setaffinity(0, sizeof(one), &one);
}

pid_t bench_fork(int cpu)
{
	fflush(NULL);
	pid_t pid = fork();
	if (pid == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		pin_one(cpu);
	}
	return pid;
}

const char *pin_desc(char *buf, size_t len)
{
	char cl[128];
	if (!g_pin.on) {
		snprintf(buf, len,
			 "not pinned (--no-pin, one CPU (tcp: fewer than 4), or an unpinned "
			 "external proxy)");
		return buf;
	}
	cpuset_str(&g_pin.clients, cl, sizeof(cl));
	if (g_pin.proxy2_cpu >= 0)
		snprintf(buf, len,
			 "sending proxy on CPU %d, receiving proxy on CPU %d, clients on CPU %s",
			 g_pin.proxy_cpu, g_pin.proxy2_cpu, cl);
	else if (g_pin.proxy_cpu >= 0)
		snprintf(buf, len, "proxy on CPU %d, clients on CPU %s", g_pin.proxy_cpu, cl);
	else
		snprintf(buf, len,
			 "clients on CPU %s (the external proxy's affinity excludes them)", cl);
	return buf;
}

uint32_t proxy_slots_for(uint64_t slot_size, uint64_t need)
{
	uint64_t n = (1ull << 30) / slot_size;
	if (n > 256)
		n = 256;
	if (n < need)
		n = need;
	if (n < 1)
		n = 1;
	return (uint32_t)n;
}

static bool is_exec(const char *p)
{
	return access(p, X_OK) == 0;
}

/* $KVSTAGED, else the build tree's proxy/kvstaged beside tools/bench/, else PATH. */
static int find_kvstaged(const struct bench_opts *o, char *out, size_t len)
{
	const char *e = o->kvstaged ? o->kvstaged : getenv("KVSTAGED");
	if (e && *e) {
		if (!is_exec(e)) {
			fprintf(stderr, "kvstage-bench: %s '%s' is not an executable file\n",
				o->kvstaged ? "--kvstaged" : "$KVSTAGED", e);
			return -1;
		}
		snprintf(out, len, "%s", e);
		return 0;
	}
	char self[PATH_MAX];
	ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
	if (n > 0) {
		self[n] = 0;
		snprintf(out, len, "%s/../../proxy/kvstaged", dirname(self));
		if (is_exec(out))
			return 0;
	}
	const char *path = getenv("PATH");
	if (path) {
		char *dup = strdup(path), *save = NULL;
		for (char *d = strtok_r(dup, ":", &save); d; d = strtok_r(NULL, ":", &save)) {
			snprintf(out, len, "%s/kvstaged", *d ? d : ".");
			if (is_exec(out)) {
				free(dup);
				return 0;
			}
		}
		free(dup);
	}
	fprintf(stderr, "kvstage-bench: cannot find kvstaged: set --kvstaged PATH or $KVSTAGED, "
			"or put it in PATH (or use --socket for a running proxy)\n");
	return -1;
}

static void print_log(const struct bench_proxy *px)
{
	char txt[4096];
	int fd = open(px->log, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return;
	ssize_t n = read(fd, txt, sizeof(txt) - 1);
	close(fd);
	if (n > 0) {
		txt[n] = 0;
		fprintf(stderr, "--- %s:\n%s", px->log, txt);
	}
}

static void cleanup_dir(struct bench_proxy *px)
{
	if (!px->dir[0])
		return;
	char lock[160];
	snprintf(lock, sizeof(lock), "%s.lock", px->sock);
	unlink(px->sock);
	unlink(lock);
	unlink(px->log);
	rmdir(px->dir);
	px->dir[0] = 0;
}

/* The pool of the proxy at px->sock, from its control segment, into px;
 * *pid (unless NULL) its own pid as it says it. Returns 0, or -errno. */
static int pool_of(struct bench_proxy *px, pid_t *pid)
{
	const struct kvs_ctrl *ctrl;
	size_t len;
	int rc = kvs_stat_map(px->sock, &ctrl, &len);
	if (rc < 0)
		return rc;
	px->slot_size = ctrl->slot_size;
	px->slots = ctrl->slot_count;
	if (pid)
		*pid = ctrl->proxy_pid;
	munmap((void *)ctrl, len);
	return 0;
}

int proxy_start(struct bench_proxy *px, const struct bench_opts *o, uint64_t slot_size,
		uint32_t slots)
{
	return proxy_start_ex(px, o, slot_size, slots, NULL, -1, NULL);
}

int proxy_start_ex(struct bench_proxy *px, const struct bench_opts *o, uint64_t slot_size,
		   uint32_t slots, const char *const *extra, int cpu, const char *netns)
{
	memset(px, 0, sizeof(*px));
	if (find_kvstaged(o, px->bin, sizeof(px->bin)) < 0)
		return -1;
	strcpy(px->dir, "/tmp/kvstage-bench.XXXXXX");
	if (!mkdtemp(px->dir)) {
		fprintf(stderr, "kvstage-bench: mkdtemp: %s\n", strerror(errno));
		px->dir[0] = 0;
		return -1;
	}
	snprintf(px->sock, sizeof(px->sock), "%s/kvstaged.sock", px->dir);
	snprintf(px->log, sizeof(px->log), "%s/kvstaged.log", px->dir);
	char nslots[16], size[32];
	snprintf(nslots, sizeof(nslots), "%u", slots);
	snprintf(size, sizeof(size), "%llu", (unsigned long long)slot_size);
	const char *argv[48] = { px->bin,	"--socket", px->sock,	  "--slots", nslots,
				 "--slot-size", size,	    "--ready-fd", "3" };
	unsigned argc = 9;
	for (unsigned i = 0; extra && extra[i] && argc < 30; i++)
		argv[argc++] = extra[i];
	for (unsigned i = 0; i < o->nproxy_args; i++)
		argv[argc++] = o->proxy_args[i];
	argv[argc] = NULL;

	int ready[2];
	if (pipe2(ready, O_CLOEXEC) < 0) {
		fprintf(stderr, "kvstage-bench: pipe: %s\n", strerror(errno));
		cleanup_dir(px);
		return -1;
	}
	fflush(NULL);
	pid_t pid = fork();
	if (pid < 0) {
		fprintf(stderr, "kvstage-bench: fork: %s\n", strerror(errno));
		close(ready[0]);
		close(ready[1]);
		cleanup_dir(px);
		return -1;
	}
	if (pid == 0) {
		/* A killed bench must not leave a proxy spinning on a core. */
		prctl(PR_SET_PDEATHSIG, SIGTERM);
		pin_one(cpu < 0 && g_pin.on ? g_pin.proxy_cpu : cpu);
		if (bench_enter_netns(netns) < 0) {
			dprintf(2, "kvstage-bench: cannot enter network namespace %s\n", netns);
			_exit(127);
		}
		int rfd = fcntl(ready[1], F_DUPFD, 10);
		int log = open(px->log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
		int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
		if (rfd < 0 || log < 0 || devnull < 0)
			_exit(127);
		dup2(devnull, 0);
		dup2(log, 1);
		dup2(log, 2);
		dup2(rfd, 3); /* dup2 clears CLOEXEC on the copy */
		execv(px->bin, (char *const *)argv);
		dprintf(2, "kvstage-bench: cannot run %s: %s\n", px->bin, strerror(errno));
		_exit(127);
	}
	close(ready[1]);
	char buf[8] = { 0 };
	struct pollfd pf = { .fd = ready[0], .events = POLLIN };
	ssize_t k = -1;
	if (poll(&pf, 1, START_TIMEOUT_MS) == 1)
		k = read(ready[0], buf, sizeof(buf) - 1);
	close(ready[0]);
	if (k != 6 || strcmp(buf, "ready\n")) {
		fprintf(stderr, "kvstage-bench: %s did not start (%u slots x %s bytes)\n", px->bin,
			slots, size);
		kill(pid, SIGKILL);
		waitpid(pid, NULL, 0);
		print_log(px);
		cleanup_dir(px);
		return -1;
	}
	px->pid = px->cpu_pid = pid;
	/* Its pool as it says, not as we asked: a --proxy-arg may have
	 * changed it (--slots, --slot-size), and the report says what ran. */
	int rc = pool_of(px, NULL);
	if (rc < 0) {
		fprintf(stderr, "kvstage-bench: cannot read the pool of the kvstaged at %s: %s\n",
			px->sock, kvs_strerror(rc));
		proxy_stop(px);
		return -1;
	}
	return 0;
}

int proxy_fits(const struct bench_proxy *px, uint64_t chunk, uint64_t need)
{
	if (px->slots >= need && px->slot_size == chunk)
		return 0;
	char a[16], b[16];
	fprintf(stderr,
		"kvstage-bench: kvstaged started with %u slots of %s (--proxy-arg); the run needs "
		"%llu of %s\n",
		px->slots, bench_size_str(px->slot_size, a, sizeof(a)), (unsigned long long)need,
		bench_size_str(chunk, b, sizeof(b)));
	return -1;
}

int proxy_attach(struct bench_proxy *px, const char *sock)
{
	memset(px, 0, sizeof(*px));
	snprintf(px->sock, sizeof(px->sock), "%s", sock);
	pid_t pid;
	int rc = pool_of(px, &pid);
	if (rc < 0) {
		fprintf(stderr, "kvstage-bench: no proxy at %s: %s\n", sock, kvs_strerror(rc));
		return -1;
	}
	/* The pid is the proxy's own view; from another pid namespace it
	 * names someone else, so trust it only if /proc agrees. */
	char path[64], comm[32] = { 0 };
	snprintf(path, sizeof(path), "/proc/%d/comm", (int)pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd >= 0) {
		ssize_t n = read(fd, comm, sizeof(comm) - 1);
		close(fd);
		if (n > 0 && !strncmp(comm, "kvstaged", 8))
			px->cpu_pid = pid;
	}
	snprintf(px->bin, sizeof(px->bin), "pid %d", (int)pid);
	return 0;
}

int proxy_open(struct bench_proxy *px, const struct bench_opts *o, uint64_t chunk, uint32_t slots)
{
	char a[16], b[16];
	if (!o->socket)
		return proxy_start(px, o, chunk, slots) < 0 ? 1 : 0;
	if (proxy_attach(px, o->socket) < 0)
		return 1;
	if (o->chunk_set && px->slot_size != chunk) {
		fprintf(stderr,
			"kvstage-bench: the proxy at %s has %s slots; --chunk %s must match it "
			"(or be left out)\n",
			o->socket, bench_size_str(px->slot_size, a, sizeof(a)),
			bench_size_str(chunk, b, sizeof(b)));
		return 2;
	}
	pin_external(px->cpu_pid);
	return 0;
}

void proxy_stop(struct bench_proxy *px)
{
	if (px->pid > 0) {
		kill(px->pid, SIGTERM);
		uint64_t until = now_ns() + STOP_TIMEOUT_NS;
		int st;
		for (;;) {
			pid_t r = waitpid(px->pid, &st, WNOHANG);
			if (r == px->pid || (r < 0 && errno != EINTR))
				break;
			if (now_ns() > until) {
				fprintf(stderr,
					"kvstage-bench: kvstaged (pid %d) ignored SIGTERM for "
					"10 s: killing it\n",
					(int)px->pid);
				kill(px->pid, SIGKILL);
				waitpid(px->pid, &st, 0);
				break;
			}
			sleep_ns(1000000);
		}
		px->pid = 0;
	}
	cleanup_dir(px);
}
