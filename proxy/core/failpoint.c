/* SPDX-License-Identifier: MIT */
#include "core/failpoint.h"

#include <errno.h>
#include <string.h>

const char *const kvsp_fp_names[KVSP_FP_COUNT] = {
	[KVSP_FP_LOCAL_QUIESCE] = "local.quiesce",
	[KVSP_FP_ACQUIRE] = "acquire",
	[KVSP_FP_RECV_OPEN] = "recv_open",
	[KVSP_FP_TCP_PAYLOAD] = "tcp.payload",
	[KVSP_FP_RDMA_READ] = "rdma.read",
};

int kvsp_fp_find(const char *name)
{
	for (int i = 0; i < KVSP_FP_COUNT; i++)
		if (!strcmp(name, kvsp_fp_names[i]))
			return i;
	return -ENOENT;
}
