/* SPDX-License-Identifier: MIT */
/* The data paths, in the order the peer plane asks them (datapath.h). */
#include "datapath/datapath.h"

#include <stddef.h>

const struct kvsp_dp_ops *const kvsp_datapaths[] = {
	&kvsp_dp_rdma,	 /* with a device on both ends: the receiver pulls each chunk */
	&kvsp_dp_stream, /* every session: chunks after their frames on the sockets */
	NULL,
};
