/* SPDX-License-Identifier: MIT */
/*
 * The RDMA baseline: perftest's ib_read_bw (Debian's perftest) between a
 * server and a client process on the same device, RDMA READs of the chunk
 * size: what the device gives the verbs data path, which also moves chunks
 * by READ. The server is ready once its TCP port listens; the client's
 * "BW average" (--report_gbits) is the figure.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"

/* True once something listens on TCP port (v4 or v6). */
static bool listening(unsigned port)
{
	const char *files[] = { "/proc/net/tcp", "/proc/net/tcp6" };
	char want[8];
	snprintf(want, sizeof(want), ":%04X", port);
	for (unsigned f = 0; f < 2; f++) {
		FILE *fp = fopen(files[f], "re");
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

static pid_t run(const char *const *argv, int out_fd)
{
	pid_t pid = bench_fork(-1);
	if (pid == 0) {
		int null = open("/dev/null", O_RDWR | O_CLOEXEC);
		dup2(null, 0);
		dup2(out_fd >= 0 ? out_fd : null, 1);
		dup2(null, 2);
		execvp(argv[0], (char *const *)argv);
		_exit(127);
	}
	return pid;
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
	pid_t s = run(srv, -1);
	if (s < 0) {
		snprintf(why, why_len, "fork: %s", strerror(errno));
		return -1;
	}
	uint64_t until = now_ns() + 10000000000ull;
	while (!listening(p) && now_ns() < until) {
		if (waitpid(s, NULL, WNOHANG) == s) {
			snprintf(why, why_len,
				 "ib_read_bw's server exited at once (is perftest "
				 "installed? apt install perftest; does -d %s exist?)",
				 dev);
			return -1;
		}
		sleep_ns(5000000);
	}
	if (!listening(p)) {
		kill(s, SIGKILL);
		waitpid(s, NULL, 0);
		snprintf(why, why_len, "ib_read_bw's server never listened on port %u", p);
		return -1;
	}
	int pipefd[2];
	if (pipe2(pipefd, O_CLOEXEC) < 0) {
		kill(s, SIGKILL);
		waitpid(s, NULL, 0);
		return -1;
	}
	pid_t c = run(cli, pipefd[1]);
	close(pipefd[1]);
	char out[8192];
	size_t have = 0;
	ssize_t k;
	while (have < sizeof(out) - 1 &&
	       (k = read(pipefd[0], out + have, sizeof(out) - 1 - have)) > 0)
		have += (size_t)k;
	out[have] = 0;
	close(pipefd[0]);
	int st = 0;
	if (c > 0)
		waitpid(c, &st, 0);
	kill(s, SIGTERM);
	waitpid(s, NULL, 0);
	/* " #bytes #iterations BW peak[Gb/sec] BW average[Gb/sec] MsgRate[Mpps]", then the numbers */
	const char *h = strstr(out, "BW average[Gb/sec]");
	const char *row = h ? strchr(h, '\n') : NULL;
	unsigned long long bytes, iters;
	double peak, avg;
	if (!row || sscanf(row, " %llu %llu %lf %lf", &bytes, &iters, &peak, &avg) != 4 ||
	    avg <= 0) {
		/* Its result row if it printed one (a run that moved nothing in
		 * its window), else the end of what it said. */
		const char *say = row	       ? row + 1
				  : have > 200 ? out + have - 200
				  : have       ? out
					       : "(no output)";
		snprintf(why, why_len, "ib_read_bw (exit %d) gave no bandwidth: %.*s",
			 WIFEXITED(st) ? WEXITSTATUS(st) : -1, (int)strcspn(say, row ? "\n" : ""),
			 say);
		return -1;
	}
	return avg / 8; /* Gb/s (1e9 bits) to GB/s (1e9 bytes) */
}
