/* SPDX-License-Identifier: MIT */
/*
 * The RDMA READ data path as the plane knows it: one rail per device
 * (--rdma-device, repeatable), each a struct rdma with its own device,
 * completion queue and a queue pair per session (rdma.c, rdma_send.c,
 * rdma_recv.c). Rails pair by place: our second device's queue pairs
 * connect to the peer's second's, each said by an RDMA_HELLO naming its
 * rail; a session has a queue pair on every rail both ends have.
 *
 * This file names what the data path brings (its options, frame types,
 * counters, failpoint) and asks its rails: a chunk goes on the next rail,
 * in turn, that carries its session; the peer's frames go to the rail
 * they name (a CHUNK_ACK to the rail its chunk went on). A rail whose
 * queue pair fails takes only its own chunks with it: those it had not
 * announced go on another rail (or the stream), those announced are
 * fenced as on a lost link (rdma.c), and the other rails carry on.
 */
#include <endian.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <unistd.h>

#include "core/counters.h"
#include "datapath/rdma.h"
#include "parse.h"
#include "peer/conn.h"

struct rails {
	struct kvsp_dp dp;
	struct rdma *rail[RAILS_MAX];
	unsigned n;
	int epfd;		  /* every rail's completion channel, as one fd for the loop */
	uint8_t *rail_of;	  /* by our slot: the rail its chunk was announced on */
	unsigned turn[PSESS_MAX]; /* by session index: the rail its next chunk tries first */
	unsigned rr;		  /* the rail whose frames are asked first next */
};

static struct rails *rails_of(struct kvsp_dp *dp)
{
	return (struct rails *)dp;
}

/* ------------------------------------------------------------- options */

static int opt_device(void *conf, const char *val, const char **why)
{
	if (!*val) {
		*why = "want a device name (ibv_devices)";
		return -EINVAL;
	}
	struct rdma_conf *c = conf;
	for (unsigned i = 0; i < c->ndevices; i++)
		if (!strcmp(c->devices[i], val)) {
			*why = "named twice: each device is a rail of its own";
			return -EINVAL;
		}
	if (c->ndevices == RAILS_MAX) {
		*why = "at most 4 devices";
		return -EINVAL;
	}
	c->devices[c->ndevices++] = val;
	return 0;
}

static int opt_gid_index(void *conf, const char *val, const char **why)
{
	uint64_t v;
	if (kvs_parse_uint(val, 255, &v)) {
		*why = "want 0 to 255";
		return -EINVAL;
	}
	((struct rdma_conf *)conf)->gid_index = (int)v;
	return 0;
}

static int opt_keys(void *conf, const char *val, const char **why)
{
	static const char *const names[] = { [KVSP_KEYS_AUTO] = "auto",
					     [KVSP_KEYS_WINDOW] = "windows",
					     [KVSP_KEYS_REGION] = "regions" };
	for (unsigned k = 0; k < sizeof(names) / sizeof(names[0]); k++)
		if (!strcmp(val, names[k])) {
			((struct rdma_conf *)conf)->keys = (enum kvsp_keys)k;
			return 0;
		}
	*why = "want auto, windows or regions";
	return -EINVAL;
}

static const struct kvsp_dp_opt rdma_opts[] = {
	{ "rdma-device", "NAME",
	  "move chunks by RDMA READ on this device with peers\n"
	  "that have one too (the others: by TCP); the pool\n"
	  "is registered for local access only, and a peer\n"
	  "reads each chunk under a key of its own (see\n"
	  "--rdma-keys). Needs the peer secret (control\n"
	  "stays on TCP). Repeatable, up to 4: each device is\n"
	  "a rail, paired with the peer's device of the same\n"
	  "place; a session gets a queue pair on every rail\n"
	  "both have, and its chunks take turns on them",
	  opt_device },
	{ "rdma-gid-index", "N",
	  "the GID to use on each device (default: its first\n"
	  "RoCE v2 one, IPv4-mapped first)",
	  opt_gid_index },
	{ "rdma-keys", "KIND",
	  "how each chunk's key is made: auto | windows |\n"
	  "regions (default auto: windows if the device has\n"
	  "type-2 memory windows, else regions). windows: a\n"
	  "window bound on the peer's queue pair, invalidated\n"
	  "at the chunk's ack or its room's abort (the NIC\n"
	  "refuses it to any other peer); no RDMA on a\n"
	  "device without them. regions: a memory region\n"
	  "registered per chunk, deregistered at its end\n"
	  "(costs a registration per chunk; any peer with\n"
	  "the key may use it till then)",
	  opt_keys },
	{ 0 },
};

static void rdma_conf_init(void *conf)
{
	*(struct rdma_conf *)conf = (struct rdma_conf){ .gid_index = -1 };
}

/* RDMA rides on the peer plane's sessions: it needs the secret. */
static int rdma_conf_check(const void *conf, const struct kvsp_peer_opts *o, char *why, size_t len)
{
	const struct rdma_conf *c = conf;
	if (o->data == KVSP_DATA_STREAM && (c->ndevices || c->keys != KVSP_KEYS_AUTO)) {
		snprintf(why, len,
			 "--transport tcp never uses RDMA: drop %s, or say --transport "
			 "verbs or auto",
			 c->ndevices ? "--rdma-device" : "--rdma-keys");
		return -EINVAL;
	}
	if ((o->data == KVSP_DATA_VERBS || c->ndevices) && !o->secret) {
		snprintf(why, len,
			 "%s rides on the tcp transport's sessions: it needs the peer "
			 "secret (--peer-secret-file or $KVSTAGE_PEER_SECRET)",
			 o->data == KVSP_DATA_VERBS ? "--transport verbs" : "--rdma-device");
		return -EINVAL;
	}
	return 0;
}

/* ------------------------------------------------------------ lifetime */

static void rails_destroy(struct kvsp_dp *dp)
{
	struct rails *rl = rails_of(dp);
	for (unsigned i = 0; i < rl->n; i++)
		rl->rail[i]->dp.ops->destroy(&rl->rail[i]->dp);
	if (rl->epfd >= 0)
		close(rl->epfd);
	free(rl->rail_of);
	free(rl);
}

/* Rail r's own counters, rdma_rail<N>_*: what it carried. */
static int rail_counters(struct rdma *r)
{
	static const char *const what[RAIL_NCTR][3] = {
		[RAIL_CTR_SENT] = { "sent", "sent_total", "Chunks announced for READ on rail" },
		[RAIL_CTR_SENT_BYTES] = { "sent_bytes", "sent_bytes_total",
					  "Bytes announced for READ on rail" },
		[RAIL_CTR_READS] = { "reads", "reads_total", "Chunks pulled by READ on rail" },
		[RAIL_CTR_BYTES_RX] = { "bytes_rx", "received_bytes_total",
					"Bytes pulled by READ on rail" },
		[RAIL_CTR_LINKS_LOST] = { "links_lost", "links_lost_total",
					  "Queue pairs that failed under a live session on rail" },
		[RAIL_CTR_LINKS] = { "links", "links", "Sessions with a queue pair up on rail" },
	};
	char names[RAIL_NCTR][32], metrics[RAIL_NCTR][64], helps[RAIL_NCTR][128];
	struct kvsp_counter_def defs[RAIL_NCTR + 1] = { { 0 } };
	for (unsigned k = 0; k < RAIL_NCTR; k++) {
		snprintf(names[k], sizeof(names[k]), "rdma_rail%u_%s", r->rail, what[k][0]);
		snprintf(metrics[k], sizeof(metrics[k]), "kvstage_rdma_rail%u_%s", r->rail,
			 what[k][1]);
		snprintf(helps[k], sizeof(helps[k]), "%s %u (%s).", what[k][2], r->rail,
			 r->verbs.name);
		defs[k] = (struct kvsp_counter_def){ names[k], metrics[k], helps[k],
						     k == RAIL_CTR_LINKS };
	}
	return kvsp_counters_add(r->dp.p, defs, &r->rail_ctr);
}

/* --transport: opens the devices it names (or finds one, for auto).
 * Without one this proxy has no RDMA data path: what peers with one say
 * is answered by its type (peer/unowned.c: RDMA_HELLO ignored, CHUNK_READ
 * refused), and their chunks come by the stream. */
static struct kvsp_dp *rails_create(const struct kvsp_dp *base, const struct kvsp_peer_opts *o,
				    char *why, size_t len, int *err)
{
	const struct rdma_conf *c = base->conf;
	*err = 0;
	if (o->data == KVSP_DATA_STREAM) {
		LOG_INFO("peers: chunks by TCP (--transport tcp)");
		return NULL;
	}
	uint32_t slots = kvsp_slot_count(base->p);
	if (slots > SLOTS_MAX) {
		snprintf(why, len, "rdma data path: %u slots, more than work requests can name",
			 slots);
		*err = -E2BIG;
		return NULL;
	}
	struct rails *rl = calloc(1, sizeof(*rl));
	if (rl) {
		rl->dp = *base;
		rl->epfd = epoll_create1(EPOLL_CLOEXEC);
		rl->rail_of = calloc(slots, 1);
	}
	if (!rl || rl->epfd < 0 || !rl->rail_of) {
		snprintf(why, len, "rdma data path: %s",
			 rl ? strerror(errno ? errno : ENOMEM) : "out of memory");
		*err = -ENOMEM;
		if (rl)
			rails_destroy(&rl->dp);
		return NULL;
	}
	for (unsigned i = 0; i < (c->ndevices ? c->ndevices : 1); i++) {
		char e[256];
		int rc;
		struct rdma *r = rail_open(base, c->ndevices ? c->devices[i] : NULL, c->gid_index,
					   c->keys, i, e, sizeof(e), &rc);
		if (!r) {
			rails_destroy(&rl->dp);
			if (c->ndevices || o->data == KVSP_DATA_VERBS) {
				if (c->ndevices)
					snprintf(why, len, "--rdma-device %s: %s", c->devices[i],
						 e);
				else
					snprintf(why, len, "--transport verbs: %s", e);
				*err = rc;
				return NULL;
			}
			/* auto, no device named: a device that will not open costs
			 * this proxy RDMA, never its start. */
			if (rc == -ENODEV && strstr(e, "found none"))
				LOG_INFO("peers: chunks by TCP (--transport auto: no RDMA device "
					 "here)");
			else
				LOG_WARN("peers: chunks by TCP (--transport auto: %s)", e);
			return NULL;
		}
		r->rails = rl;
		rl->rail[rl->n++] = r;
		struct epoll_event ev = { .events = EPOLLIN, .data.u32 = i };
		int fd = r->dp.ops->loop_fd(&r->dp);
		rc = rail_counters(r);
		if (rc == 0 && fd >= 0 && epoll_ctl(rl->epfd, EPOLL_CTL_ADD, fd, &ev) < 0)
			rc = -errno;
		if (rc < 0) {
			snprintf(why, len, "rdma data path: rail %u: %s", i, strerror(-rc));
			*err = rc;
			rails_destroy(&rl->dp);
			return NULL;
		}
	}
	return &rl->dp;
}

/* ------------------------------------------------------------ sessions */

void rails_link(struct rails *rl, uint32_t sess, bool up)
{
	/* The session's queue pairs up now, the one that changed counted. */
	unsigned i = (sess & 0xff) % PSESS_MAX, n = 0;
	for (unsigned k = 0; k < rl->n; k++)
		n += rl->rail[k]->rs[i].id == sess && rl->rail[k]->rs[i].up;
	if (up && n == 1)
		KVS_STAT_ADD(rl->dp.ctr[RDMA_CTR_SESSIONS], 1);
	else if (!up && n == 0)
		KVS_STAT_SUB(rl->dp.ctr[RDMA_CTR_SESSIONS], 1);
}

static void rails_sess_up(struct kvsp_dp *dp, struct psess *s)
{
	struct rails *rl = rails_of(dp);
	for (unsigned i = 0; i < rl->n; i++)
		rl->rail[i]->dp.ops->sess_up(&rl->rail[i]->dp, s);
}

static bool rails_carries(const struct kvsp_dp *dp, const struct psess *s)
{
	const struct rails *rl = (const struct rails *)dp;
	for (unsigned i = 0; i < rl->n; i++)
		if (rl->rail[i]->dp.ops->carries(&rl->rail[i]->dp, s))
			return true;
	return false;
}

/* x on the next rail, from s's turn on, that carries s (but skip): one
 * whose device is on the NUMA node of x's slot first, if any. Returns 0,
 * or -EOPNOTSUPP (none does). */
static int send_on_a_rail(struct rails *rl, struct psess *s, struct kvsp_xfer *x,
			  const struct kvs_wire_room *room, const struct rdma *skip)
{
	unsigned *turn = &rl->turn[s->idx];
	int node = rl->n > 1 ? kvsp_slot_node(rl->dp.p, x->slot) : -1;
	for (unsigned k = 0; k < 2 * rl->n; k++) {
		struct rdma *r = rl->rail[(*turn + k) % rl->n];
		if (k < rl->n && node >= 0 && r->node != node)
			continue; /* the first round: the slot's node's rails */
		if (r == skip || !r->dp.ops->carries(&r->dp, s))
			continue;
		*turn = (r->rail + 1) % rl->n;
		rl->rail_of[x->slot] = (uint8_t)r->rail;
		return r->dp.ops->send(&r->dp, s, x, room);
	}
	return -EOPNOTSUPP;
}

static int rails_send(struct kvsp_dp *dp, struct psess *s, struct kvsp_xfer *x,
		      const struct kvs_wire_room *room)
{
	return send_on_a_rail(rails_of(dp), s, x, room, NULL);
}

int rails_elsewhere(struct rails *rl, struct rdma *from, struct psess *s, struct kvsp_xfer *x,
		    const struct kvs_wire_room *room)
{
	if (send_on_a_rail(rl, s, x, room, from) == 0)
		return 0;
	for (unsigned k = 0; k < *rl->dp.ndps; k++) { /* the next data path: the stream */
		struct kvsp_dp *d = rl->dp.dps[k];
		if (d != &rl->dp && d->ops->carries(d, s))
			return d->ops->send(d, s, x, room);
	}
	return -EOPNOTSUPP;
}

static void rails_cancel(struct kvsp_dp *dp, uint32_t room, uint32_t gen)
{
	struct rails *rl = rails_of(dp);
	for (unsigned i = 0; i < rl->n; i++)
		rl->rail[i]->dp.ops->cancel(&rl->rail[i]->dp, room, gen);
}

/* --------------------------------------------------------------- frames */

/* A peer's frame to the rail it is about: the one a HELLO or CHUNK_READ
 * names, or the one an ack's chunk was announced on. */
static int rails_on_frame(struct kvsp_dp *dp, struct psess *s, struct pconn *c,
			  const struct kvsp_frame *f)
{
	struct rails *rl = rails_of(dp);
	unsigned rail = 0;
	switch (f->type) {
	case KVS_WIRE_RDMA_HELLO:
		if (f->body.rdma_hello.rsvd)
			return -EPROTO;
		rail = f->body.rdma_hello.rail;
		if (rail >= rl->n) {
			if (c->stream != 0)
				return -EPROTO;
			/* a rail the peer has and we have not: no queue pair of ours answers */
			KVS_STAT_ADD(dp->st->peer_frames_ignored, 1);
			return 0;
		}
		break;
	case KVS_WIRE_CHUNK_READ:
		rail = le32toh(f->body.chunk_read.rail);
		if (rail >= rl->n)
			return -EPROTO; /* we said no HELLO on it */
		break;
	case KVS_WIRE_CHUNK_ACK: {
		uint32_t slot = (uint32_t)le64toh(f->body.chunk_ack.xfer_ref);
		rail = slot < kvsp_slot_count(dp->p) ? rl->rail_of[slot] : 0;
		break;
	}
	}
	struct rdma *r = rl->rail[rail];
	return r->dp.ops->on_frame(&r->dp, s, c, f);
}

static bool rails_next_control(struct kvsp_dp *dp, struct psess *s, struct kvsp_dp_frame *out)
{
	struct rails *rl = rails_of(dp);
	for (unsigned i = 0; i < rl->n; i++)
		if (rl->rail[i]->dp.ops->next_control(&rl->rail[i]->dp, s, out))
			return true;
	return false;
}

/* Each rail's frames in turn, so that one rail's acks and announcements
 * never wait behind another's whole window. */
static bool rails_next_frame(struct kvsp_dp *dp, struct psess *s, struct pconn *c,
			     struct kvsp_dp_frame *out)
{
	struct rails *rl = rails_of(dp);
	for (unsigned k = 0; k < rl->n; k++) {
		struct rdma *r = rl->rail[(rl->rr + k) % rl->n];
		if (r->dp.ops->next_frame(&r->dp, s, c, out)) {
			if (out)
				rl->rr = (r->rail + 1) % rl->n;
			return true;
		}
	}
	return false;
}

/* ------------------------------------------------------- a session's end */

static bool rails_sess_quiesce(struct kvsp_dp *dp, struct psess *s)
{
	struct rails *rl = rails_of(dp);
	bool busy = false;
	for (unsigned i = 0; i < rl->n; i++)
		busy |= rl->rail[i]->dp.ops->sess_quiesce(&rl->rail[i]->dp, s);
	return busy;
}

static void rails_sess_force(struct kvsp_dp *dp, struct psess *s)
{
	struct rails *rl = rails_of(dp);
	for (unsigned i = 0; i < rl->n; i++)
		rl->rail[i]->dp.ops->sess_force(&rl->rail[i]->dp, s);
}

static void rails_sess_free(struct kvsp_dp *dp, struct psess *s)
{
	struct rails *rl = rails_of(dp);
	for (unsigned i = 0; i < rl->n; i++)
		rl->rail[i]->dp.ops->sess_free(&rl->rail[i]->dp, s);
}

static void rails_tick(struct kvsp_dp *dp, uint64_t now, uint64_t timeout_ns)
{
	struct rails *rl = rails_of(dp);
	for (unsigned i = 0; i < rl->n; i++)
		rl->rail[i]->dp.ops->tick(&rl->rail[i]->dp, now, timeout_ns);
}

/* ---------------------------------------------------------- completions */

static int rails_poll(struct kvsp_dp *dp)
{
	struct rails *rl = rails_of(dp);
	int busy = KVSP_IDLE;
	for (unsigned i = 0; i < rl->n; i++)
		busy |= rl->rail[i]->dp.ops->poll(&rl->rail[i]->dp);
	return busy;
}

static bool rails_pending(const struct kvsp_dp *dp)
{
	const struct rails *rl = (const struct rails *)dp;
	for (unsigned i = 0; i < rl->n; i++)
		if (rl->rail[i]->dp.ops->pending(&rl->rail[i]->dp))
			return true;
	return false;
}

static int rails_loop_fd(const struct kvsp_dp *dp)
{
	return ((const struct rails *)dp)->epfd;
}

/* The rails whose completion channel raised an event hear it. */
static void rails_on_fd(struct kvsp_dp *dp)
{
	struct rails *rl = rails_of(dp);
	struct epoll_event ev[RAILS_MAX];
	int n = epoll_wait(rl->epfd, ev, RAILS_MAX, 0);
	for (int k = 0; k < n; k++)
		if (ev[k].data.u32 < rl->n)
			rl->rail[ev[k].data.u32]->dp.ops->on_fd(&rl->rail[ev[k].data.u32]->dp);
}

static const struct kvsp_dp_frame_type rdma_frames[] = {
	{ KVS_WIRE_RDMA_HELLO, 0, 0 },
	{ KVS_WIRE_CHUNK_READ, 0, 0 },
	{ KVS_WIRE_CHUNK_ACK, 0, 0 },
	{ 0, 0, 0 },
};

static const char *const rdma_failpoints[] = {
	[RDMA_FP_READ] = "rdma.read", /* receiving side: hold a READ, its slot posted */
	NULL,
};

/* Named as they were when they were fields of struct kvs_stats, so
 * kvstage-stat, --json, /metrics and barriers say what they said. */
static const struct kvsp_counter_def rdma_counters[RDMA_NCTR + 1] = {
	[RDMA_CTR_READS] = { "rdma_reads", "kvstage_rdma_reads_total",
			     "Chunks pulled by RDMA READ (landed or not).", false },
	[RDMA_CTR_BYTES_RX] = { "rdma_bytes_rx", "kvstage_rdma_received_bytes_total",
				"Bytes pulled by RDMA READ.", false },
	[RDMA_CTR_BINDS] = { "rdma_binds", "kvstage_rdma_window_binds_total",
			     "Chunk keys granted by binding a memory window.", false },
	[RDMA_CTR_INVALIDATES] = { "rdma_invalidates", "kvstage_rdma_window_invalidates_total",
				   "Window keys revoked by a local invalidate.", false },
	[RDMA_CTR_REGIONS] = { "rdma_regions", "kvstage_rdma_region_registrations_total",
			       "Chunk keys granted by registering a memory region (no windows).",
			       false },
	[RDMA_CTR_REGION_FREES] = { "rdma_region_frees",
				    "kvstage_rdma_region_deregistrations_total",
				    "Region keys revoked by deregistering.", false },
	[RDMA_CTR_READS_REFUSED] = { "rdma_reads_refused", "kvstage_rdma_reads_refused_total",
				     "Peers' READs our NIC refused: a key not held, or past its "
				     "chunk.",
				     false },
	[RDMA_CTR_LINKS_LOST] = { "rdma_links_lost", "kvstage_rdma_links_lost_total",
				  "Queue pairs that failed under a live session: its chunks went "
				  "by TCP until a new one was connected.",
				  false },
	[RDMA_CTR_SESSIONS] = { "rdma_sessions", "kvstage_rdma_sessions",
				"Peer sessions whose chunks go by RDMA READ now (on one rail or "
				"more).",
				true },
	[RDMA_NCTR] = { 0 },
};

const struct kvsp_dp_ops kvsp_dp_rdma = {
	.name = "rdma",
	.frames = rdma_frames,
	.opts = rdma_opts,
	.conf_size = sizeof(struct rdma_conf),
	.conf_init = rdma_conf_init,
	.conf_check = rdma_conf_check,
	.failpoints = rdma_failpoints,
	.counters = rdma_counters,
	.create = rails_create,
	.destroy = rails_destroy,
	.sess_up = rails_sess_up,
	.carries = rails_carries,
	.send = rails_send,
	.cancel = rails_cancel,
	.on_frame = rails_on_frame,
	.next_control = rails_next_control,
	.next_frame = rails_next_frame,
	.sess_quiesce = rails_sess_quiesce,
	.sess_force = rails_sess_force,
	.sess_free = rails_sess_free,
	.tick = rails_tick,
	.poll = rails_poll,
	.pending = rails_pending,
	.loop_fd = rails_loop_fd,
	.on_fd = rails_on_fd,
};
