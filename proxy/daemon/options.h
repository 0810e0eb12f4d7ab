/* SPDX-License-Identifier: MIT */
/* kvstaged's command line and --config file (options.c). */
#ifndef KVSP_DAEMON_OPTIONS_H
#define KVSP_DAEMON_OPTIONS_H

#include <stdint.h>

#include "core/config.h"
#include "peer/peer.h"

#define KVSP_ARGS_MAX_DPS 8

/* What the options said, over the defaults the caller set. */
struct kvsp_args {
	struct kvsp_config cfg;
	struct kvsp_peer_opts peer; /* its datapaths: this build's; dp_conf: below */
	const char *secret_path, *metrics_listen, *trace_file;
	uint32_t trace_buffer;
	int ready_fd;
	void *dp_conf[KVSP_ARGS_MAX_DPS]; /* each data path's options' values */
};

/* Fills a from --config's file, then argv. Returns -1 to go on, or the
 * exit code: 0 after --help or --version, 2 for bad input (said on
 * stderr, with "Try 'kvstaged --help'."), 1 out of memory. */
int kvsp_args_parse(struct kvsp_args *a, int argc, char **argv);

#endif
