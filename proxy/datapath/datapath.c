/* SPDX-License-Identifier: MIT */
/* The data paths, in the order the peer plane asks them (datapath.h). */
#include "datapath/datapath.h"

#include <errno.h>

const struct kvsp_dp_ops *const kvsp_datapaths[] = {
	&kvsp_dp_rdma,	 /* with a device on both ends: the receiver pulls each chunk */
	&kvsp_dp_stream, /* every session: chunks after their frames on the sockets */
	NULL,
};

int kvsp_dp_carry(struct kvsp_dp *const *dps, unsigned n, struct psess *s, struct kvsp_xfer *x,
		  const struct kvs_wire_room *room)
{
	for (unsigned k = 0; k < n; k++)
		if (dps[k]->ops->carries(dps[k], s))
			return dps[k]->ops->send(dps[k], s, x, room);
	return -EOPNOTSUPP;
}
