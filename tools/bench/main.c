/* SPDX-License-Identifier: MIT */
/* kvstage-bench: the command line, then one mode. */
#include <stdlib.h>
#include <string.h>

#include "bench.h"

int main(int argc, char **argv)
{
	/* getopt_long permutes argv; --json reports the command as given. */
	char **orig = calloc((size_t)argc + 1, sizeof(*orig));
	if (!orig)
		return 1;
	memcpy(orig, argv, (size_t)argc * sizeof(*orig));

	struct bench_opts o;
	int rc = bench_opts_parse(argc, argv, &o);
	if (rc) {
		free(orig);
		return rc == 1 ? 0 : rc;
	}
	o.argv = orig;
	if (o.mode != MODE_GPU)
		pin_init(&o);
	setvbuf(stdout, NULL, _IOLBF, 0);
	switch (o.mode) {
	case MODE_LOCAL:
		rc = run_local(&o);
		break;
	case MODE_TCP:
	case MODE_VERBS:
		rc = run_tcp(&o);
		break;
	case MODE_LATENCY:
		rc = run_latency(&o);
		break;
	case MODE_IDLE:
		rc = run_idle(&o);
		break;
	case MODE_BASELINE:
		rc = run_baseline(&o);
		break;
	case MODE_GPU:
		rc = run_gpu(&o);
		break;
	case MODE_ABORT:
		rc = run_abort(&o);
		break;
	}
	free(orig);
	return rc;
}
