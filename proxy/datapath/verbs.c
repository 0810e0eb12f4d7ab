/* SPDX-License-Identifier: MIT */
/* The RDMA device under the verbs data path (see verbs.h for the rules). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <sys/random.h>
#include <time.h>

#include "datapath/verbs.h"

#define QP_RD_ATOM 16 /* READs in flight per queue pair, each way (clamped to the device) */

/* The GID to speak RoCE v2 from: an IPv4-mapped one first (what a routed
 * RoCE fabric and rxe on an IPv4 netdev use), else any RoCE v2 one. */
static int pick_gid(struct kvsp_verbs *v, int tbl_len)
{
	int any = -1;
	for (int i = 0; i < tbl_len; i++) {
		struct ibv_gid_entry e;
		if (ibv_query_gid_ex(v->ctx, v->port, (uint32_t)i, &e, 0))
			continue;
		if (e.gid_type != IBV_GID_TYPE_ROCE_V2)
			continue;
		static const uint8_t v4mapped[12] = { [10] = 0xff, [11] = 0xff };
		if (!memcmp(e.gid.raw, v4mapped, sizeof(v4mapped)))
			return i;
		if (any < 0)
			any = i;
	}
	return any;
}

static int fail(char *why, size_t len, int err, const char *fmt, const char *arg)
{
	char what[160];
	snprintf(what, sizeof(what), fmt, arg);
	snprintf(why, len, "%s: %s", what, strerror(err));
	return -err;
}

uint32_t kvsp_verbs_keys_wire(const struct kvsp_verbs *v)
{
	return v->keys == KVSP_KEYS_REGION ? KVSP_KEYS_WIRE_REGION
	       : v->window_on_region	   ? KVSP_KEYS_WIRE_WINDOW_ON_REGION
					   : KVSP_KEYS_WIRE_WINDOW;
}

const char *kvsp_keys_wire_name(uint32_t w)
{
	return w == KVSP_KEYS_WIRE_WINDOW	      ? "windows"
	       : w == KVSP_KEYS_WIRE_REGION	      ? "regions"
	       : w == KVSP_KEYS_WIRE_WINDOW_ON_REGION ? "windows over chunk regions"
						      : "unknown keys";
}

/* Type-2 windows (2A or 2B: either binds through a queue pair, and only
 * that queue pair's peer may use the key). How many the device has is
 * found at allocation (rdma_send.c win_take): a chunk then waits for one
 * of its session's windows to come back, or fails over when it has none. */
static bool has_windows(const struct ibv_device_attr *da)
{
	uint64_t f = da->device_cap_flags;
	return (f & IBV_DEVICE_MEM_WINDOW) &&
	       (f & (IBV_DEVICE_MEM_WINDOW_TYPE_2A | IBV_DEVICE_MEM_WINDOW_TYPE_2B)) &&
	       da->max_mw > 0;
}

static struct ibv_qp *qp_make(struct kvsp_verbs *v, struct ibv_cq *cq, uint32_t depth,
			      struct kvsp_verbs_ep *ep);

/* One completion on cq within 2 s. Returns its status, or -1. */
static int one_completion(struct ibv_cq *cq)
{
	struct timespec t0, t;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (;;) {
		struct ibv_wc wc;
		int n = ibv_poll_cq(cq, 1, &wc);
		if (n < 0)
			return -1;
		if (n == 1)
			return (int)wc.status;
		clock_gettime(CLOCK_MONOTONIC, &t);
		if (t.tv_sec - t0.tv_sec > 2)
			return -1;
	}
}

/* Whether the device keeps a window's READs inside the window's bytes,
 * tried on two of its queue pairs connected to each other: a window over
 * the first half of a buffer, a READ of the second half with its key.
 * (rxe does not: it checks the READ against the region under the window,
 * so there each chunk gets a region of its own under its window.)
 * Returns 1 (it refused the READ), 0 (the READ got through), or -1
 * (the try did not come to an end: assume not). */
static int windows_confine(struct kvsp_verbs *v)
{
	enum { HALF = 4096 };
	int verdict = -1;
	uint8_t *buf = aligned_alloc(4096, 2 * HALF);
	struct ibv_mr *mr =
		buf ? ibv_reg_mr(v->pd, buf, 2 * HALF, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND)
		    : NULL;
	struct ibv_cq *cq = mr ? ibv_create_cq(v->ctx, 8, NULL, NULL, 0) : NULL;
	struct kvsp_verbs_ep ea, eb;
	struct ibv_qp *a = cq ? qp_make(v, cq, 4, &ea) : NULL;
	struct ibv_qp *b = a ? qp_make(v, cq, 4, &eb) : NULL;
	struct ibv_mw *mw = b ? ibv_alloc_mw(v->pd, IBV_MW_TYPE_2) : NULL;
	if (mw && !kvsp_verbs_qp_connect(v, a, &ea, &eb) &&
	    !kvsp_verbs_qp_connect(v, b, &eb, &ea)) {
		uint32_t key = mw->rkey;
		if (!kvsp_verbs_bind(v, a, 1, mw, mr, buf, HALF, &key) &&
		    one_completion(cq) == IBV_WC_SUCCESS) {
			struct ibv_sge sge = { (uint64_t)(uintptr_t)(buf + HALF), 64, mr->lkey };
			struct ibv_send_wr wr = { .wr_id = 2,
						  .sg_list = &sge,
						  .num_sge = 1,
						  .opcode = IBV_WR_RDMA_READ,
						  .send_flags = IBV_SEND_SIGNALED,
						  .wr.rdma = { (uint64_t)(uintptr_t)(buf + HALF),
							       key } },
					   *bad;
			if (!ibv_post_send(b, &wr, &bad)) {
				int st = one_completion(cq);
				verdict = st < 0 ? -1 : st != IBV_WC_SUCCESS;
			}
		}
	}
	if (a)
		kvsp_verbs_qp_error(a);
	if (b)
		kvsp_verbs_qp_error(b);
	/* The window first: a queue pair a window is bound through is not
	 * destroyed while it is (rxe waits for it, for ever). */
	if (mw)
		ibv_dealloc_mw(mw);
	kvsp_verbs_qp_destroy(a);
	kvsp_verbs_qp_destroy(b);
	if (cq)
		ibv_destroy_cq(cq);
	if (mr)
		ibv_dereg_mr(mr);
	free(buf);
	return verdict;
}

int kvsp_verbs_open(struct kvsp_verbs *v, const char *name, int gid_index, void *pool, size_t len,
		    uint32_t cq_depth, enum kvsp_keys keys, char *why, size_t why_len)
{
	memset(v, 0, sizeof(*v));
	v->gid_index = -1;
	int n = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	if (!list || n == 0) {
		if (list)
			ibv_free_device_list(list);
		snprintf(why, why_len, "no RDMA device (ibv_get_device_list found none)");
		return -ENODEV;
	}
	struct ibv_device *dev = NULL;
	for (int i = 0; i < n && !dev; i++)
		if (!name || !strcmp(ibv_get_device_name(list[i]), name))
			dev = list[i];
	if (!dev) {
		ibv_free_device_list(list);
		snprintf(why, why_len, "no RDMA device named '%s' (ibv_devices lists them)", name);
		return -ENODEV;
	}
	snprintf(v->name, sizeof(v->name), "%s", ibv_get_device_name(dev));
	v->ctx = ibv_open_device(dev);
	ibv_free_device_list(list);
	if (!v->ctx)
		return fail(why, why_len, errno ? errno : ENODEV, "ibv_open_device %s", v->name);

	struct ibv_device_attr da;
	if (ibv_query_device(v->ctx, &da)) {
		int e = errno ? errno : EIO;
		kvsp_verbs_close(v);
		return fail(why, why_len, e, "ibv_query_device %s", v->name);
	}
	if (keys == KVSP_KEYS_WINDOW && !has_windows(&da)) {
		snprintf(why, why_len, "%s has no type-2 memory windows (--rdma-keys windows)",
			 v->name);
		kvsp_verbs_close(v);
		return -EOPNOTSUPP;
	}
	v->keys = keys == KVSP_KEYS_REGION || !has_windows(&da) ? KVSP_KEYS_REGION
								: KVSP_KEYS_WINDOW;
	if ((int)cq_depth > da.max_cqe)
		cq_depth = (uint32_t)da.max_cqe;
	struct ibv_port_attr pa;
	for (uint8_t p = 1; p <= da.phys_port_cnt && !v->port; p++)
		if (!ibv_query_port(v->ctx, p, &pa) && pa.state == IBV_PORT_ACTIVE)
			v->port = p;
	if (!v->port) {
		kvsp_verbs_close(v);
		snprintf(why, why_len, "%s has no active port", v->name);
		return -ENETDOWN;
	}
	ibv_query_port(v->ctx, v->port, &pa);
	v->mtu = pa.active_mtu;
	v->gid_index = gid_index >= 0 ? gid_index : pick_gid(v, pa.gid_tbl_len);
	if (v->gid_index < 0 || ibv_query_gid(v->ctx, v->port, v->gid_index, &v->gid)) {
		kvsp_verbs_close(v);
		snprintf(why, why_len, "%s port %u: no usable RoCE v2 GID", v->name, v->port);
		return -EADDRNOTAVAIL;
	}
	v->pd = ibv_alloc_pd(v->ctx);
	/* Local write (READs land here), and windows may be bound over it;
	 * no remote access with the pool's own key: see verbs.h. */
	int access = IBV_ACCESS_LOCAL_WRITE |
		     (v->keys == KVSP_KEYS_WINDOW ? IBV_ACCESS_MW_BIND : 0);
	v->mr = v->pd ? ibv_reg_mr(v->pd, pool, len, access) : NULL;
	if (v->mr && v->keys == KVSP_KEYS_WINDOW) {
		v->window_confines = windows_confine(v);
		v->window_on_region = v->window_confines != 1;
	}
	v->chan = v->mr ? ibv_create_comp_channel(v->ctx) : NULL;
	v->cq_depth = cq_depth;
	v->cq = v->chan ? ibv_create_cq(v->ctx, (int)cq_depth, NULL, v->chan, 0) : NULL;
	if (!v->cq) {
		int e = errno ? errno : ENOMEM;
		const char *step = !v->pd     ? "ibv_alloc_pd"
				   : !v->mr   ? "ibv_reg_mr of the pool"
				   : !v->chan ? "ibv_create_comp_channel"
					      : "ibv_create_cq";
		kvsp_verbs_close(v);
		return fail(why, why_len, e, "%s", step);
	}
	fcntl(v->chan->fd, F_SETFL, fcntl(v->chan->fd, F_GETFL) | O_NONBLOCK);
	return 0;
}

void kvsp_verbs_close(struct kvsp_verbs *v)
{
	if (v->cq)
		ibv_destroy_cq(v->cq);
	if (v->chan)
		ibv_destroy_comp_channel(v->chan);
	if (v->mr)
		ibv_dereg_mr(v->mr);
	if (v->pd)
		ibv_dealloc_pd(v->pd);
	if (v->ctx)
		ibv_close_device(v->ctx);
	memset(v, 0, sizeof(*v));
}

static struct ibv_qp *qp_make(struct kvsp_verbs *v, struct ibv_cq *cq, uint32_t depth,
			      struct kvsp_verbs_ep *ep)
{
	struct ibv_qp_init_attr ia = {
		.send_cq = cq,
		.recv_cq = cq,
		.cap = { .max_send_wr = depth,
			 .max_recv_wr = 1,
			 .max_send_sge = 1,
			 .max_recv_sge = 1 },
		.qp_type = IBV_QPT_RC,
		.sq_sig_all = 0,
	};
	struct ibv_qp *qp = ibv_create_qp(v->pd, &ia);
	if (!qp)
		return NULL;
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT,
				 .pkey_index = 0,
				 .port_num = v->port,
				 .qp_access_flags = IBV_ACCESS_REMOTE_READ };
	if (ibv_modify_qp(qp, &a,
			  IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
		int e = errno;
		ibv_destroy_qp(qp);
		errno = e ? e : EINVAL;
		return NULL;
	}
	uint32_t psn = 0;
	if (getrandom(&psn, sizeof(psn), 0) != (ssize_t)sizeof(psn))
		psn = 0;
	*ep = (struct kvsp_verbs_ep){ .qpn = qp->qp_num,
				      .psn = psn & 0xffffff,
				      .pool_addr = (uint64_t)(uintptr_t)v->mr->addr,
				      .pool_len = v->mr->length,
				      .keys = kvsp_verbs_keys_wire(v),
				      .mtu = v->mtu };
	memcpy(ep->gid, v->gid.raw, sizeof(ep->gid));
	return qp;
}

struct ibv_qp *kvsp_verbs_qp_new(struct kvsp_verbs *v, uint32_t depth, struct kvsp_verbs_ep *ep)
{
	return qp_make(v, v->cq, depth, ep);
}

int kvsp_verbs_qp_connect(struct kvsp_verbs *v, struct ibv_qp *qp,
			  const struct kvsp_verbs_ep *local, const struct kvsp_verbs_ep *remote)
{
	struct ibv_device_attr da;
	int atom = QP_RD_ATOM;
	if (!ibv_query_device(v->ctx, &da)) {
		if (da.max_qp_rd_atom < atom)
			atom = da.max_qp_rd_atom;
		if (da.max_qp_init_rd_atom < atom)
			atom = da.max_qp_init_rd_atom;
	}
	struct ibv_qp_attr a = {
		.qp_state = IBV_QPS_RTR,
		.path_mtu = remote->mtu < local->mtu ? (enum ibv_mtu)remote->mtu
						     : (enum ibv_mtu)local->mtu,
		.dest_qp_num = remote->qpn,
		.rq_psn = remote->psn,
		.max_dest_rd_atomic = (uint8_t)atom,
		.min_rnr_timer = 12,
		.ah_attr = { .is_global = 1,
			     .port_num = v->port,
			     .grh = { .hop_limit = 64, .sgid_index = (uint8_t)v->gid_index } },
	};
	memcpy(a.ah_attr.grh.dgid.raw, remote->gid, sizeof(remote->gid));
	if (ibv_modify_qp(qp, &a,
			  IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
				  IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		return -(errno ? errno : EINVAL);
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTS,
				  .timeout = 14,
				  .retry_cnt = 7,
				  .rnr_retry = 7,
				  .sq_psn = local->psn,
				  .max_rd_atomic = (uint8_t)atom };
	if (ibv_modify_qp(qp, &a,
			  IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
				  IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
		return -(errno ? errno : EINVAL);
	return 0;
}

int kvsp_verbs_qp_error(struct ibv_qp *qp)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_ERR };
	return ibv_modify_qp(qp, &a, IBV_QP_STATE) ? -(errno ? errno : EINVAL) : 0;
}

void kvsp_verbs_qp_destroy(struct ibv_qp *qp)
{
	if (qp)
		ibv_destroy_qp(qp);
}

int kvsp_verbs_read(struct kvsp_verbs *v, struct ibv_qp *qp, uint64_t wr_id, void *dst,
		    uint32_t len, uint64_t raddr, uint32_t rkey)
{
	struct ibv_sge sge = { .addr = (uint64_t)(uintptr_t)dst,
			       .length = len,
			       .lkey = v->mr->lkey };
	struct ibv_send_wr wr = {
		.wr_id = wr_id,
		.sg_list = &sge,
		.num_sge = 1,
		.opcode = IBV_WR_RDMA_READ,
		.send_flags = IBV_SEND_SIGNALED,
		.wr.rdma = { .remote_addr = raddr, .rkey = rkey },
	}, *bad = NULL;
	int rc = ibv_post_send(qp, &wr, &bad);
	return rc ? -rc : 0;
}

int kvsp_verbs_sentinel(struct ibv_qp *qp, uint64_t wr_id)
{
	struct ibv_recv_wr wr = { .wr_id = wr_id, .sg_list = NULL, .num_sge = 0 }, *bad = NULL;
	int rc = ibv_post_recv(qp, &wr, &bad);
	return rc ? -rc : 0;
}

struct ibv_mw *kvsp_verbs_mw_new(struct kvsp_verbs *v)
{
	return ibv_alloc_mw(v->pd, IBV_MW_TYPE_2);
}

void kvsp_verbs_mw_free(struct ibv_mw *mw)
{
	if (mw)
		ibv_dealloc_mw(mw);
}

int kvsp_verbs_bind(struct kvsp_verbs *v, struct ibv_qp *qp, uint64_t wr_id, struct ibv_mw *mw,
		    struct ibv_mr *mr, void *addr, uint32_t len, uint32_t *rkey)
{
	/* A fresh tag each bind: a key of an earlier bind of this window
	 * names it no more. (Tags are 8 bits: after 256 binds of one window a
	 * tag comes back, but only for the chunk then bound, on the same
	 * peer's queue pair: never for bytes that peer was not sent.) */
	uint32_t key = ibv_inc_rkey(*rkey);
	struct ibv_send_wr wr = {
		.wr_id = wr_id,
		.opcode = IBV_WR_BIND_MW,
		.send_flags = IBV_SEND_SIGNALED,
		.bind_mw = { .mw = mw, .rkey = key,
			     .bind_info = { .mr = mr ? mr : v->mr, .addr = (uint64_t)(uintptr_t)addr,
					    .length = len,
					    .mw_access_flags = IBV_ACCESS_REMOTE_READ } },
	}, *bad = NULL;
	int rc = ibv_post_send(qp, &wr, &bad);
	if (rc)
		return -rc;
	/* The next bind names the window by this key: the provider sends
	 * mw->rkey, and the device checks it is the window's current one. */
	mw->rkey = key;
	*rkey = key;
	return 0;
}

int kvsp_verbs_invalidate(struct ibv_qp *qp, uint64_t wr_id, uint32_t rkey)
{
	struct ibv_send_wr wr = { .wr_id = wr_id,
				  .opcode = IBV_WR_LOCAL_INV,
				  .send_flags = IBV_SEND_SIGNALED,
				  .invalidate_rkey = rkey },
			   *bad = NULL;
	int rc = ibv_post_send(qp, &wr, &bad);
	return rc ? -rc : 0;
}

struct ibv_mr *kvsp_verbs_region_new(struct kvsp_verbs *v, void *addr, uint32_t len,
				     bool under_window)
{
	return ibv_reg_mr(v->pd, addr, len,
			  under_window ? IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND
				       : IBV_ACCESS_REMOTE_READ);
}

void kvsp_verbs_region_free(struct ibv_mr *mr)
{
	if (mr)
		ibv_dereg_mr(mr);
}

int kvsp_verbs_poll(struct kvsp_verbs *v, struct ibv_wc *wc, int n)
{
	int k = ibv_poll_cq(v->cq, n, wc);
	return k < 0 ? -EIO : k;
}

int kvsp_verbs_arm(struct kvsp_verbs *v)
{
	int rc = ibv_req_notify_cq(v->cq, 0);
	return rc ? -rc : 0;
}

void kvsp_verbs_ack(struct kvsp_verbs *v)
{
	struct ibv_cq *cq;
	void *ctx;
	while (!ibv_get_cq_event(v->chan, &cq, &ctx))
		ibv_ack_cq_events(cq, 1);
}
