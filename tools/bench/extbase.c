/* SPDX-License-Identifier: MIT */
/*
 * Baselines measured by other tools, each a server and a client process
 * whose server is ready once its TCP port listens:
 *  - perftest's ib_read_bw (Debian's perftest) on the same device, RDMA
 *    READs of the chunk size: what the device gives the verbs data path,
 *    which also moves chunks by READ; the client's "BW average"
 *    (--report_gbits) is the figure;
 *  - UCX's ucx_perftest tag_bw (Debian's ucx-utils; what NIXL builds on)
 *    with UCX_TLS=tcp between the tcp mode's two endpoints: what a
 *    well-tuned user-space TCP transport gets from this host.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"

/* True once something listens on TCP port (v4 or v6) in the network
 * namespace of process pid (its /proc/PID/net). */
static bool listening(pid_t pid, unsigned port)
{
	const char *files[] = { "tcp", "tcp6" };
	char want[8];
	snprintf(want, sizeof(want), ":%04X", port);
	for (unsigned f = 0; f < 2; f++) {
		char path[64];
		snprintf(path, sizeof(path), "/proc/%d/net/%s", (int)pid, files[f]);
		FILE *fp = fopen(path, "re");
		char line[512];
		while (fp && fgets(line, sizeof(line), fp)) {
			char local[128], st[8];
			if (sscanf(line, " %*s %127s %*s %7s", local, st) == 2 &&
			    !strcmp(st, "0A") && strlen(local) > 5 &&
			    !strcmp(local + strlen(local) - 5, want)) {
				fclose(fp);
				return true;
			}
		}
		if (fp)
			fclose(fp);
	}
	return false;
}

/* Forks argv (on cpu, -1: anywhere, in network namespace ns, NULL: ours)
 * with stdout to out_fd (-1: /dev/null), stdin and stderr /dev/null. */
static pid_t run_in(const char *const *argv, int out_fd, int cpu, const char *ns)
{
	pid_t pid = bench_fork(cpu);
	if (pid == 0) {
		if (bench_enter_netns(ns) < 0)
			_exit(126);
		int null = open("/dev/null", O_RDWR | O_CLOEXEC);
		dup2(null, 0);
		dup2(out_fd >= 0 ? out_fd : null, 1);
		dup2(null, 2);
		execvp(argv[0], (char *const *)argv);
		_exit(127);
	}
	return pid;
}

/* Reads fd to its end into out (NUL-terminated). Returns the length. */
static size_t slurp(int fd, char *out, size_t len)
{
	size_t have = 0;
	ssize_t k;
	while (have < len - 1 && (k = read(fd, out + have, len - 1 - have)) > 0)
		have += (size_t)k;
	out[have] = 0;
	return have;
}

static double cpu_of(const struct rusage *ru)
{
	return (double)(ru->ru_utime.tv_sec + ru->ru_stime.tv_sec) +
	       (double)(ru->ru_utime.tv_usec + ru->ru_stime.tv_usec) / 1e6;
}

/* One server and one client run of a tool. */
struct ext_run {
	const char *const *srv, *const *cli; /* argv */
	int srv_cpu, cli_cpu;		     /* -1: anywhere */
	const char *srv_ns, *cli_ns;	     /* NULL: ours */
	unsigned port;			     /* the server's, to know it is up */
	bool srv_ends;			     /* the server exits with the test; else SIGTERM */
	/* out */
	char out[8192]; /* the client's stdout */
	size_t have;
	int srv_status; /* wait status, if it exited before it listened */
	int cli_status;
	double cpu_s; /* both processes' whole lives */
};

/* Starts e->srv, and once it listens runs e->cli to its end. Returns 0,
 * -1 (the server exited at once: srv_status), or -2 (it never listened). */
static int ext_run(struct ext_run *e)
{
	e->have = 0;
	e->out[0] = 0;
	e->cpu_s = 0;
	pid_t s = run_in(e->srv, -1, e->srv_cpu, e->srv_ns);
	if (s < 0)
		return -2;
	uint64_t until = now_ns() + 10000000000ull;
	bool up = false;
	while (!(up = listening(s, e->port)) && now_ns() < until) {
		if (waitpid(s, &e->srv_status, WNOHANG) == s)
			return -1;
		sleep_ns(5000000);
	}
	int pipefd[2];
	if (!up || pipe2(pipefd, O_CLOEXEC) < 0) {
		kill(s, SIGKILL);
		waitpid(s, NULL, 0);
		return -2;
	}
	pid_t c = run_in(e->cli, pipefd[1], e->cli_cpu, e->cli_ns);
	close(pipefd[1]);
	e->have = slurp(pipefd[0], e->out, sizeof(e->out));
	close(pipefd[0]);
	struct rusage rc = { 0 }, rs = { 0 };
	if (c > 0)
		wait4(c, &e->cli_status, 0, &rc);
	pid_t done = 0;
	for (int k = 0; e->srv_ends && k < 200 && !(done = wait4(s, NULL, WNOHANG, &rs)); k++)
		sleep_ns(10000000);
	if (!done) {
		kill(s, SIGTERM);
		wait4(s, NULL, 0, &rs);
	}
	e->cpu_s = cpu_of(&rc) + cpu_of(&rs);
	return 0;
}

/* The tail of what a tool said, for an error line: from its line at `at` if given. */
static const char *said(const struct ext_run *e, const char *at)
{
	return at ? at : e->have > 200 ? e->out + e->have - 200 : e->have ? e->out : "(no output)";
}

double baseline_ib_read_bw(const char *dev, int gid_index, uint64_t chunk, double sec, char *why,
			   size_t why_len)
{
	char size[24], dur[16], port[8], gid[16];
	unsigned p = 20000 + (unsigned)getpid() % 20000;
	snprintf(size, sizeof(size), "%llu", (unsigned long long)chunk);
	snprintf(dur, sizeof(dur), "%d", sec < 1 ? 1 : (int)lround(sec)); /* whole seconds only */
	snprintf(port, sizeof(port), "%u", p);
	snprintf(gid, sizeof(gid), "%d", gid_index < 0 ? 0 : gid_index);
	const char *srv[] = { "ib_read_bw", "-d", dev,
			      "-s",	    size, "-D",
			      dur,	    "-F", "--report_gbits",
			      "-p",	    port, gid_index >= 0 ? "-x" : NULL,
			      gid,	    NULL };
	const char *cli[] = { "ib_read_bw",	"-d", dev,  "-s", size, "-D",	     dur, "-F",
			      "--report_gbits", "-p", port, "-x", gid,	"127.0.0.1", NULL };
	if (gid_index < 0) { /* let perftest choose, as the server does */
		cli[11] = "127.0.0.1";
		cli[12] = NULL;
	}
	static struct ext_run e;
	e = (struct ext_run){ .srv = srv, .cli = cli, .srv_cpu = -1, .cli_cpu = -1, .port = p };
	int rc = ext_run(&e);
	if (rc == -1) {
		snprintf(why, why_len,
			 "ib_read_bw's server exited at once (is perftest installed? apt install "
			 "perftest; does -d %s exist?)",
			 dev);
		return -1;
	}
	if (rc < 0) {
		snprintf(why, why_len, "ib_read_bw's server never listened on port %u", p);
		return -1;
	}
	/* " #bytes #iterations BW peak[Gb/sec] BW average[Gb/sec] MsgRate[Mpps]", then the numbers */
	const char *h = strstr(e.out, "BW average[Gb/sec]");
	const char *row = h ? strchr(h, '\n') : NULL;
	unsigned long long bytes, iters;
	double peak, avg;
	if (!row || sscanf(row, " %llu %llu %lf %lf", &bytes, &iters, &peak, &avg) != 4 ||
	    avg <= 0) {
		/* Its result row if it printed one (a run that moved nothing in
		 * its window), else the end of what it said. */
		const char *say = said(&e, row ? row + 1 : NULL);
		snprintf(why, why_len, "ib_read_bw (exit %d) gave no bandwidth: %.*s",
			 WIFEXITED(e.cli_status) ? WEXITSTATUS(e.cli_status) : -1,
			 (int)strcspn(say, row ? "\n" : ""), say);
		return -1;
	}
	return avg / 8; /* Gb/s (1e9 bits) to GB/s (1e9 bytes) */
}

double baseline_ucx_tcp(const struct raw_tcp *r, uint64_t iters, double *cpu_s_per_gb, char *why,
			size_t why_len)
{
	char size[24], n[24], warm[24], port[8];
	unsigned p = 20000 + ((unsigned)getpid() * 7 + 13) % 20000;
	uint64_t w = iters / 10 < 100 ? 100 : iters / 10;
	snprintf(size, sizeof(size), "%llu", (unsigned long long)r->chunk);
	snprintf(n, sizeof(n), "%llu", (unsigned long long)iters);
	snprintf(warm, sizeof(warm), "%llu", (unsigned long long)w);
	snprintf(port, sizeof(port), "%u", p);
	const char *host = r->rx_ip ? r->rx_ip : "127.0.0.1";
	const char *srv[] = { "ucx_perftest", "-t", "tag_bw", "-s", size, "-n", n,
			      "-w",	      warm, "-p",     port, NULL };
	const char *cli[] = { "ucx_perftest", host, "-t", "tag_bw", "-s", size, "-n", n,
			      "-w",	      warm, "-p", port,	    "-f", "-v", NULL };
	*cpu_s_per_gb = -1;
	static struct ext_run e;
	e = (struct ext_run){ .srv = srv,
			      .cli = cli,
			      .srv_cpu = r->rx_cpu,
			      .cli_cpu = r->tx_cpu,
			      .srv_ns = r->rx_ns,
			      .cli_ns = r->tx_ns,
			      .port = p,
			      .srv_ends = true };
	/* Its TCP transport only, like ours: both children inherit it. */
	const char *had = getenv("UCX_TLS");
	char *saved = had ? strdup(had) : NULL;
	setenv("UCX_TLS", "tcp", 1);
	int rc = ext_run(&e);
	if (saved)
		setenv("UCX_TLS", saved, 1);
	else
		unsetenv("UCX_TLS");
	free(saved);
	if (rc == -1) {
		if (WIFEXITED(e.srv_status) && WEXITSTATUS(e.srv_status) == 127)
			snprintf(why, why_len,
				 "ucx_perftest is not installed (Debian: apt install ucx-utils)");
		else
			snprintf(why, why_len, "ucx_perftest's server exited at once (exit %d)",
				 WIFEXITED(e.srv_status) ? WEXITSTATUS(e.srv_status) : -1);
		return -1;
	}
	if (rc < 0) {
		snprintf(why, why_len, "ucx_perftest's server never listened on port %u", p);
		return -1;
	}
	/* -f -v: "iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,..."
	 * rows; overall_bw is MB/s meaning MiB/s. */
	double bw = -1;
	for (const char *line = e.out; line;
	     line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
		unsigned long long it;
		double f2, f3, f4, f5, f6;
		if (sscanf(line, "%llu,%lf,%lf,%lf,%lf,%lf", &it, &f2, &f3, &f4, &f5, &f6) == 6)
			bw = f6 * 1048576 / 1e9;
	}
	if (!(bw > 0)) {
		const char *say = said(&e, NULL);
		snprintf(why, why_len, "ucx_perftest (exit %d) gave no bandwidth: %.*s",
			 WIFEXITED(e.cli_status) ? WEXITSTATUS(e.cli_status) : -1,
			 (int)strcspn(say, "\n"), say);
		return -1;
	}
	*cpu_s_per_gb = e.cpu_s / ((double)(iters + w) * (double)r->chunk / 1e9);
	return bw;
}
