/* SPDX-License-Identifier: MIT */
/* kvstaged: the proxy's lifetime, in the order its parts depend on each other. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "base/log.h"
#include "base/loop_fd.h"
#include "core/proxy.h"
#include "core/clients.h"
#include "core/pool.h"
#include "core/rooms.h"
#include "core/xport.h"
#include "host/loop.h"

extern struct kvsp *kvsp_signalled;

/* The transports, in the order open_send asks them to reach a descriptor:
 * the first carries rooms with both halves here (the local hand-off when
 * none is configured). Descriptors name the first endpoint one offers. */
static int transports_create(struct kvsp *p)
{
	static const struct kvsp_xport_conf local_only = { &kvsp_local_kind, NULL };
	unsigned n = p->cfg.nxports ? p->cfg.nxports : 1;
	for (unsigned k = 0; k < n; k++) {
		const struct kvsp_xport_conf *xc = p->cfg.nxports ? &p->cfg.xports[k] : &local_only;
		char why[256] = "";
		struct kvsp_transport *t = xc->kind->create(p, xc->opts, why, sizeof(why));
		if (!t) {
			LOG_ERR("%s", why);
			return -EINVAL;
		}
		int rc = kvsp_xport_register(p, t);
		if (rc < 0) {
			t->ops->destroy(t);
			return rc;
		}
		if (k == 0)
			p->local = t;
		if (!p->endpoint[0] && t->ops->endpoint) {
			snprintf(p->endpoint, sizeof(p->endpoint), "%s", t->ops->endpoint(t));
			/* Said by the endpoint's scheme ("tcp: listening, ..."): the
			 * line operators and dist/check-under-systemd.sh look for. */
			if (p->endpoint[0])
				LOG_INFO("%.*s: listening, descriptors name %s",
					 (int)strcspn(p->endpoint, ":"), p->endpoint, p->endpoint);
		}
	}
	return 0;
}

static uint32_t pow2_at_least(uint32_t v)
{
	uint32_t n = 1;
	while (n < v)
		n <<= 1;
	return n;
}

int kvsp_init(struct kvsp *p, const struct kvsp_config *cfg)
{
	memset(p, 0, sizeof(*p));
	p->cfg = *cfg;
	p->cfg.cq_count = pow2_at_least(2 * (cfg->client_rooms + 32));
	p->epfd = p->listen_fd = p->wake_fd = p->lock_fd = p->pool_fd = p->ctrl_fd = -1;
	p->spare_fd = -1;
	p->nfp = KVSP_FP_COUNT; /* the data paths' come after the fixed ones */
	kvsp_log_level = cfg->log_level;

	/* The cheap checks first: a bad socket path is said at once, not
	 * after minutes of populating a large pool. */
	int rc = 0;
	if (cfg->socket_path)
		rc = kvsp_socket_claim(p);
	if (rc == 0)
		rc = kvsp_pool_fits(cfg);
	if (rc == 0)
		rc = kvsp_pool_create(p);
	if (rc == 0)
		rc = kvsp_rooms_init(p);
	if (rc == 0)
		rc = kvsp_shares_init(&p->shares, p->cfg.max_clients, p->cfg.max_rooms,
				      p->cfg.uid_share_pct);
	if (rc == 0)
		rc = kvsp_listener_init(p);
	if (rc == 0)
		rc = kvsp_admin_init(p);
	if (rc < 0)
		return rc;
	p->clients = calloc(p->cfg.max_clients, sizeof(*p->clients));
	p->kicks = calloc(p->cfg.max_clients, sizeof(*p->kicks));
	p->xfers = calloc(p->cfg.slot_count, sizeof(*p->xfers));
	if (!p->clients || !p->kicks || !p->xfers)
		return -ENOMEM;
	p->epfd = epoll_create1(EPOLL_CLOEXEC);
	p->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (p->epfd < 0 || p->wake_fd < 0)
		return -errno;
	rc = kvsp_ep_add(p->epfd, p->wake_fd, EPOLLIN, kvsp_ep_tag(KVSP_EP_WAKE, 0, 0));
	if (rc < 0)
		return rc;
	p->now_ns = kvsp_now_ns();
	p->room_hist.upper_ns = kvsp_hist_room_ns;
	p->chunk_hist.upper_ns = kvsp_hist_chunk_ns;
	return transports_create(p); /* they may watch fds in the loop */
}

void kvsp_fini(struct kvsp *p)
{
	for (unsigned i = 0; p->clients && i < p->cfg.max_clients; i++)
		if (p->clients[i])
			kvsp_client_destroy(p, p->clients[i]);
	kvsp_admin_fini(p);
	for (unsigned k = 0; k < p->nxports; k++)
		p->xports[k]->ops->destroy(p->xports[k]);
	p->nxports = 0;
	p->local = NULL;
	free(p->xfers);
	kvsp_listener_fini(p);
	kvsp_rooms_fini(p);
	kvsp_shares_fini(&p->shares);
	kvsp_pool_destroy(p);
	free(p->clients);
	free(p->kicks);
	if (p->epfd >= 0)
		close(p->epfd);
	if (p->wake_fd >= 0)
		close(p->wake_fd);
	if (kvsp_signalled == p)
		kvsp_signalled = NULL;
}
