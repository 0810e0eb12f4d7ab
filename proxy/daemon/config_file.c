/* SPDX-License-Identifier: MIT */
/*
 * kvstaged --config FILE: an INI file (inih) whose every "key = value" is
 * the long option of that name. The entries become arguments placed
 * before the command line's, so the command line overrides them (for a
 * repeatable option, both count). Each argument remembers its line, so a
 * bad value is reported where it was written.
 *
 * Lines reach inih one at a time, read whole here: one longer than inih
 * takes is refused with its own number (never cut in two, which once made
 * its tail a line of its own), and a comment after a value ('#' or ';'
 * after a blank) is dropped before inih sees the line, as
 * docs/operations.md says.
 */
#include <errno.h>
#include <ini.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/config_file.h"

struct conf;

struct reader {
	FILE *f;
	unsigned line;
	char *buf; /* getline's */
	size_t cap;
	struct conf *c;
};

struct conf {
	const struct option *opts;
	struct kvsp_conf_args *out;
	struct reader *rd;
	char *why;
	size_t why_len;
	const char *path;
	bool failed;
};

static int refuse(struct conf *c, const char *fmt, const char *a, const char *b);

/* Drops a comment: a line that starts with '#' or ';' (after blanks), or
 * one of them after a value with a blank before it. */
static void strip_comment(char *s)
{
	const char *first = s + strspn(s, " \t");
	if (*first == '#' || *first == ';') {
		*s = 0;
		return;
	}
	for (char *p = s + 1; *p; p++)
		if ((*p == '#' || *p == ';') && (p[-1] == ' ' || p[-1] == '\t')) {
			*p = 0;
			return;
		}
}

/* inih's line reader: one whole line each call (counting them gives each
 * entry its line), or NULL at the end and on a refusal. */
static char *read_line(char *str, int num, void *stream)
{
	struct reader *rd = stream;
	ssize_t n = getline(&rd->buf, &rd->cap, rd->f);
	if (n < 0)
		return NULL;
	rd->line++;
	if (n && rd->buf[n - 1] == '\n')
		rd->buf[--n] = 0;
	if (n && rd->buf[n - 1] == '\r')
		rd->buf[--n] = 0;
	if (memchr(rd->buf, 0, (size_t)n)) {
		refuse(rd->c, "a NUL byte in the line%s%s", "", "");
		return NULL;
	}
	strip_comment(rd->buf);
	size_t len = strlen(rd->buf);
	if (len + 2 > (size_t)num) { /* with its newline and NUL, as inih wants it */
		char max[16];
		snprintf(max, sizeof(max), "%d", num - 2);
		refuse(rd->c, "a line longer than %s bytes%s (values this long are not options)",
		       max, "");
		return NULL;
	}
	memcpy(str, rd->buf, len);
	str[len] = '\n';
	str[len + 1] = 0;
	return str;
}

static int refuse(struct conf *c, const char *fmt, const char *a, const char *b)
{
	if (!c->failed) {
		char msg[192];
		snprintf(msg, sizeof(msg), fmt, a, b);
		snprintf(c->why, c->why_len, "%s:%u: %s", c->path, c->rd->line, msg);
		c->failed = true;
	}
	return 0; /* inih: an error; it goes on, we keep the first */
}

static int add(struct conf *c, const char *arg)
{
	struct kvsp_conf_args *o = c->out;
	char **argv = realloc(o->argv, (size_t)(o->argc + 1) * sizeof(*argv));
	unsigned *line = realloc(o->line, (size_t)(o->argc + 1) * sizeof(*line));
	if (argv)
		o->argv = argv;
	if (line)
		o->line = line;
	char *dup = strdup(arg);
	if (!argv || !line || !dup) {
		free(dup);
		return refuse(c, "%s%s", "out of memory", "");
	}
	o->argv[o->argc] = dup;
	o->line[o->argc++] = c->rd->line;
	return 1;
}

static bool word_in(const char *v, const char *const *words)
{
	for (; *words; words++)
		if (!strcmp(v, *words))
			return true;
	return false;
}

static int on_entry(void *user, const char *section, const char *name, const char *value)
{
	struct conf *c = user;
	if (c->failed)
		return 1;
	if (*section && strcmp(section, "kvstaged"))
		return refuse(c, "unknown section [%s] (only [kvstaged], or none)%s", section, "");
	const struct option *o = NULL;
	for (const struct option *p = c->opts; p->name && !o; p++)
		if (!strcmp(p->name, name))
			o = p;
	if (!o || !strcmp(name, "help") || !strcmp(name, "version") || !strcmp(name, "config"))
		return refuse(
			c, "unknown key '%s'%s (keys are kvstaged's long options: kvstaged --help)",
			name, "");
	char arg[4096];
	if (o->has_arg == no_argument) {
		static const char *const yes[] = { "true", "yes", "on", "1", NULL };
		static const char *const no[] = { "false", "no", "off", "0", NULL };
		if (word_in(value, no))
			return 1;
		if (!word_in(value, yes))
			return refuse(c, "%s = '%s': want true or false", name, value);
		snprintf(arg, sizeof(arg), "--%s", name);
		return add(c, arg);
	}
	if (!*value)
		return refuse(c, "%s has no value%s", name, "");
	if ((size_t)snprintf(arg, sizeof(arg), "--%s=%s", name, value) >= sizeof(arg))
		return refuse(c, "%s: value too long%s", name, "");
	return add(c, arg);
}

int kvsp_conf_read(const char *path, const struct option *opts, struct kvsp_conf_args *out,
		   char *why, size_t why_len)
{
	memset(out, 0, sizeof(*out));
	struct reader rd = { .f = fopen(path, "re") };
	if (!rd.f) {
		snprintf(why, why_len, "%s: %s", path, strerror(errno));
		return -1;
	}
	struct conf c = { .opts = opts,
			  .out = out,
			  .rd = &rd,
			  .why = why,
			  .why_len = why_len,
			  .path = path };
	rd.c = &c;
	int rc = ini_parse_stream(read_line, &rd, on_entry, &c);
	bool io_error = ferror(rd.f);
	fclose(rd.f);
	free(rd.buf);
	if (!c.failed && io_error) {
		snprintf(why, why_len, "%s: read error", path);
		c.failed = true;
	}
	if (!c.failed && rc != 0) {
		/* inih's own refusal: a line that is no "key = value" nor [section] */
		snprintf(why, why_len, "%s:%d: not 'key = value', '[section]' or a comment", path,
			 rc);
		c.failed = true;
	}
	if (c.failed) {
		kvsp_conf_free(out);
		return -1;
	}
	return 0;
}

void kvsp_conf_free(struct kvsp_conf_args *a)
{
	for (int i = 0; i < a->argc; i++)
		free(a->argv[i]);
	free(a->argv);
	free(a->line);
	memset(a, 0, sizeof(*a));
}
