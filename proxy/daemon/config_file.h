/* SPDX-License-Identifier: MIT */
/* kvstaged --config FILE (config_file.c). */
#ifndef KVSP_CONFIG_FILE_H
#define KVSP_CONFIG_FILE_H

#include <getopt.h>
#include <stdbool.h>

/* A config file's entries as arguments, in file order. */
struct kvsp_conf_args {
	int argc;
	char **argv;	/* "--key=value", or "--key" for a flag set true */
	unsigned *line; /* the line each came from */
};

/* Reads the INI file at path: "key = value" lines, comments ('#' or ';'
 * starting a line, or after a value with a blank before it), an optional
 * [kvstaged] section; a line is at most 198 bytes once its comment is gone. Every key must be one of opts' long
 * options (not help, version or config); a flag takes true/false (yes/no,
 * on/off, 1/0). Returns 0, or -1 with "PATH:LINE: why" in why. */
int kvsp_conf_read(const char *path, const struct option *opts, struct kvsp_conf_args *out,
		   char *why, size_t why_len);
/* Frees what kvsp_conf_read filled. */
void kvsp_conf_free(struct kvsp_conf_args *a);

#endif
