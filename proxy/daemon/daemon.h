/* SPDX-License-Identifier: MIT */
/* kvstaged: the command line, then the loop (daemon.c). */
#ifndef KVSP_DAEMON_H
#define KVSP_DAEMON_H

struct kvsp;
struct kvsp_config;

/* What a test-only build of the daemon changes (tests/vulnerable.c): the
 * production kvstaged passes none. */
struct kvsp_daemon_hooks {
	const char *warning;			    /* logged at start */
	void (*configure)(struct kvsp_config *cfg); /* before the proxy is made */
	void (*started)(struct kvsp *p);	    /* once it is made */
};

/* Parses argv, runs the proxy until it drains. Returns the exit code. */
int kvsp_daemon_main(int argc, char **argv, const struct kvsp_daemon_hooks *hooks);

#endif
