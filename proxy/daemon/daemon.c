/* SPDX-License-Identifier: MIT */
/* kvstaged: its options checked as a whole, then the proxy made and run. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/proxy.h"
#include "core/rooms.h"
#include "host/loop.h"
#include "core/xport.h"
#include "daemon/daemon.h"
#include "daemon/options.h"
#include "base/log.h"
#include "daemon/metrics.h"
#include "datapath/datapath.h"
#include "base/notify.h"
#include "base/trace.h"
#include "kvs_build.h"
#include "kvstage.h"
#include "parse.h"
#include "peer/endpoint.h"
#include "peer/peer.h"
#include "peer/plane.h"
#include "peer/auth.h"

/* The defaults, before any option. */
static void defaults(struct kvsp_args *a)
{
	a->cfg = (struct kvsp_config){
		.socket_path = getenv("KVSTAGE_SOCKET"),
		.slot_count = 256,
		.slot_size = 1 << 20,
		.huge = KVSP_HUGE_AUTO,
		.lock = true,
		.log_level = KVSP_LOG_INFO,
		.max_rooms = 4096,
		.client_rooms = 256,
		.max_clients = 256,
		.uid_share_pct = 75,
		.sq_count = 1024,
		.room_timeout_ns = 30000ull * 1000000,
		.shutdown_grace_ns = 5000ull * 1000000,
		.spin_ns = 50000,
		.socket_mode = 0660,
		.socket_group = getegid(),
	};
	a->peer = (struct kvsp_peer_opts){
		.streams = 2,
		.peer_timeout_ns = 10000ull * 1000000,
	};
	a->trace_buffer = 16384;
	a->ready_fd = -1;
}

/* What no single option can judge: the options together, and the peer
 * secret. Returns -1 to go on, or the exit code (said on stderr). */
static int check(struct kvsp_args *a)
{
	char why[256];
	if (!a->cfg.socket_path || !*a->cfg.socket_path)
		a->cfg.socket_path = KVS_DEFAULT_SOCKET;
	/* The peer secret: never from the command line, where anyone reads it. */
	char *secret_env = getenv("KVSTAGE_PEER_SECRET");
	static struct kvsp_secret secret;
	if (a->secret_path || (secret_env && *secret_env)) {
		int rc = kvsp_secret_load(a->secret_path, secret_env, &secret, why, sizeof(why));
		/* Read once. The value lives where the process's environment
		 * does (what /proc/PID/environ shows), and unsetenv only drops
		 * the pointer to it: its bytes are wiped first. */
		if (secret_env)
			explicit_bzero(secret_env, strlen(secret_env));
		unsetenv("KVSTAGE_PEER_SECRET");
		if (rc < 0) {
			fprintf(stderr, "kvstaged: peer secret: %s\n", why);
			return 2;
		}
		a->peer.secret = &secret;
	} else if (a->peer.listen) {
		fprintf(stderr, "kvstaged: --listen needs the deployment's peer secret: "
				"--peer-secret-file PATH or $KVSTAGE_PEER_SECRET\nTry 'kvstaged "
				"--help'.\n");
		return 2;
	}
	for (unsigned k = 0; a->peer.datapaths[k]; k++) {
		const struct kvsp_dp_ops *dp = a->peer.datapaths[k];
		if (dp->conf_check && dp->conf_check(a->dp_conf[k], &a->peer, why, sizeof(why))) {
			fprintf(stderr, "kvstaged: %s\nTry 'kvstaged --help'.\n", why);
			return 2;
		}
	}
	if (a->peer.advertise && !a->peer.listen) {
		fprintf(stderr, "kvstaged: --advertise names where --listen is reached: give both\n"
				"Try 'kvstaged --help'.\n");
		return 2;
	}
	if (kvsp_access_check(&a->cfg, why, sizeof(why))) {
		fprintf(stderr, "kvstaged: %s\nTry 'kvstaged --help'.\n", why);
		return 2;
	}
	if (a->cfg.slot_size * a->cfg.slot_count / a->cfg.slot_count != a->cfg.slot_size ||
	    a->cfg.slot_size * a->cfg.slot_count > (1ull << 40)) {
		fprintf(stderr, "kvstaged: pool of %u x %llu bytes is larger than 1 TiB\n",
			a->cfg.slot_count, (unsigned long long)a->cfg.slot_size);
		return 2;
	}

	return -1;
}

/* Makes the proxy and runs it until it drains. Returns the exit code. */
static int serve(struct kvsp_args *a, const struct kvsp_daemon_hooks *hooks)
{
	char why[256];
	/* The trace's sink is opened before anything is set up: a path we
	 * cannot write is said at once, and nothing starts. */
	struct kvsp_trace *trace = NULL;
	if (a->trace_file) {
		trace = kvsp_trace_open(a->trace_file, a->trace_buffer, why, sizeof(why));
		if (!trace) {
			fprintf(stderr, "kvstaged: --trace-file %s: %s\n", a->trace_file, why);
			return 1;
		}
	}

	a->cfg.xports[a->cfg.nxports++] = (struct kvsp_xport_conf){ &kvsp_local_kind, NULL };
	if (a->peer.secret)
		a->cfg.xports[a->cfg.nxports++] =
			(struct kvsp_xport_conf){ &kvsp_peer_kind, &a->peer };
	if (!KVS_HAVE_VERBS && a->peer.secret) /* no module to say it: this build has none */
		LOG_INFO("peers: chunks by TCP (%s)",
			 a->peer.data == KVSP_DATA_STREAM
				 ? "--transport tcp"
				 : "this build has no RDMA: libibverbs-dev missing at build time");
	if (hooks && hooks->warning)
		LOG_WARN("%s", hooks->warning);
	if (hooks && hooks->configure)
		hooks->configure(&a->cfg);
	static struct kvsp p;
	int rc = kvsp_init(&p, &a->cfg);
	if (rc == 0 && hooks && hooks->started)
		hooks->started(&p);
	if (rc == 0 && trace) {
		struct kvsp_trace_conf tc = { .instance = p.instance,
					      .written = &p.stats->trace_written,
					      .dropped = &p.stats->trace_dropped,
					      .wake_fd = -1 };
		if (a->cfg.failpoints) { /* inert otherwise (invariant 8) */
			tc.hold = &p.fp[KVSP_FP_TRACE_WRITE].action;
			tc.hits = &p.fp[KVSP_FP_TRACE_WRITE].hits;
			tc.wake_fd = p.wake_fd;
		}
		rc = kvsp_rtrace_attach(&p, trace);
		if (rc == 0)
			rc = kvsp_trace_start(trace, &tc);
	}
	if (rc == 0 && a->metrics_listen)
		rc = kvsp_metrics_start(&p,
					a->metrics_listen); /* last: it reads everything above */
	if (rc == 0)
		rc = kvsp_listen(&p);
	if (rc < 0) {
		LOG_ERR("cannot start: %s", strerror(-rc));
		kvsp_metrics_stop(&p);
		kvsp_trace_close(trace); /* before its counters go with the control segment */
		p.trace = NULL;
		kvsp_fini(&p);
		return 1;
	}
	char slot[32], pool[32];
	LOG_INFO("serving %s: %u slots x %s = %s pool (hugepages %s, %slocked)%s",
		 a->cfg.socket_path, a->cfg.slot_count,
		 kvs_format_size(a->cfg.slot_size, slot, sizeof(slot)),
		 kvs_format_size(p.pool_size, pool, sizeof(pool)), p.huge ? "yes" : "no",
		 p.locked ? "" : "not ", a->cfg.failpoints ? ", failpoints on" : "");
	kvsp_notify("READY=1\nSTATUS=serving %s: %u slots x %s", a->cfg.socket_path,
		    a->cfg.slot_count, slot);
	if (a->ready_fd >= 0) {
		if (write(a->ready_fd, "ready\n", 6) != 6)
			LOG_WARN("--ready-fd: %s", strerror(errno));
		if (a->ready_fd > 2) /* stdin, stdout and stderr stay ours to use */
			close(a->ready_fd);
	}
	rc = kvsp_run(&p);
	/* What the loop queued is written before we go; what the fini below
	 * would trace (rooms of clients still connected) is not: the trace's
	 * counters live in the control segment that it unmaps. */
	kvsp_trace_close(p.trace);
	p.trace = NULL;
	if (rc != 0)
		return rc;     /* forced: leave memory a transport may touch mapped */
	kvsp_metrics_stop(&p); /* first: it reads what the rest frees */
	kvsp_fini(&p);
	return 0;
}

int kvsp_daemon_main(int argc, char **argv, const struct kvsp_daemon_hooks *hooks)
{
	static struct kvsp_args a; /* the proxy keeps pointers into it while it runs */
	defaults(&a);
	int rc = kvsp_args_parse(&a, argc, argv);
	if (rc < 0)
		rc = check(&a);
	return rc < 0 ? serve(&a, hooks) : rc;
}
