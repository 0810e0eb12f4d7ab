/* SPDX-License-Identifier: MIT */
/* kvstaged --metrics-listen: the HTTP side (libmicrohttpd). The page: metrics_page.c. */
#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/log.h"
#include "daemon/metrics.h"
#include "parse.h"
#include "core/proxy.h"
#include "peer/endpoint.h"

/* A scraper needs one connection; a few more let a curl in beside it.
 * Past these, connections are refused, never queued for ever. */
#define METRICS_MAX_CONNS 16
#define METRICS_PER_IP 8
#define METRICS_IDLE_S 10u

struct kvsp_metrics {
	struct MHD_Daemon *d;
};

int kvsp_metrics_parse(const char *s, struct kvsp_endpoint *ep)
{
	uint64_t port;
	if (kvs_parse_uint(s, 65535, &port) == 0) {
		char buf[32];
		snprintf(buf, sizeof(buf), "127.0.0.1:%u", (unsigned)port);
		return kvsp_endpoint_parse(buf, ep);
	}
	return kvsp_endpoint_parse(s, ep);
}

static enum MHD_Result answer(struct MHD_Connection *conn, unsigned code, const char *type, char *body,
			      size_t len, enum MHD_ResponseMemoryMode mode)
{
	struct MHD_Response *r = MHD_create_response_from_buffer(len, body, mode);
	if (!r) {
		if (mode == MHD_RESPMEM_MUST_FREE)
			free(body);
		return MHD_NO; /* out of memory: MHD closes the connection */
	}
	MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
	if (code == MHD_HTTP_METHOD_NOT_ALLOWED)
		MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
	enum MHD_Result rc = MHD_queue_response(conn, code, r);
	MHD_destroy_response(r);
	return rc;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
				  const char *method, const char *version, const char *upload,
				  size_t *upload_len, void **req)
{
	(void)version;
	(void)upload;
	const struct kvsp *p = cls;
	static const char text[] = "text/plain; charset=utf-8";
	if (strcmp(method, MHD_HTTP_METHOD_GET) && strcmp(method, MHD_HTTP_METHOD_HEAD)) {
		static char msg[] = "only GET and HEAD: try GET /metrics\n";
		return answer(conn, MHD_HTTP_METHOD_NOT_ALLOWED, text, msg, sizeof(msg) - 1,
			      MHD_RESPMEM_PERSISTENT);
	}
	if (*upload_len) {
		/* A GET with a body: nothing to read in it. */
		*upload_len = 0;
		return MHD_YES;
	}
	if (!*req) {
		/* The first call has the headers only: answer on the next, so a
		 * body (if any) has been seen and discarded first. */
		*req = (void *)1;
		return MHD_YES;
	}
	if (strcmp(url, "/metrics")) {
		static char msg[] = "not found: the metrics are at /metrics\n";
		return answer(conn, MHD_HTTP_NOT_FOUND, text, msg, sizeof(msg) - 1,
			      MHD_RESPMEM_PERSISTENT);
	}
	char *page = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&page, &len);
	if (!f)
		return MHD_NO;
	int rc = kvsp_metrics_render(p, f);
	if (fclose(f) || rc < 0) {
		free(page);
		static char msg[] = "could not build the page\n";
		return answer(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, text, msg, sizeof(msg) - 1,
			      MHD_RESPMEM_PERSISTENT);
	}
	return answer(conn, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", page, len,
		      MHD_RESPMEM_MUST_FREE);
}

/* libmicrohttpd's complaints (a connection past the limit, a bad request)
 * are a remote client's doing: at most METRICS_LOG_BURST lines a minute,
 * then one saying how many were kept back. Only the server's thread logs
 * here, so the window needs no lock. */
#define METRICS_LOG_BURST 5
#define METRICS_LOG_WINDOW_NS (60ull * 1000000000)

static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
	(void)cls;
	static uint64_t window_ns, held;
	static unsigned said;
	uint64_t now = kvsp_now_ns();
	if (now - window_ns >= METRICS_LOG_WINDOW_NS) {
		if (held)
			LOG_WARN("metrics: %llu more such lines in the last minute",
				 (unsigned long long)held);
		window_ns = now;
		said = 0;
		held = 0;
	}
	if (said >= METRICS_LOG_BURST) {
		held++;
		return;
	}
	said++;
	char msg[256];
	vsnprintf(msg, sizeof(msg), fmt, ap);
	msg[strcspn(msg, "\n")] = 0;
	LOG_WARN("metrics: %s", msg);
}

int kvsp_metrics_start(struct kvsp *p, const char *listen)
{
	struct kvsp_endpoint ep;
	if (kvsp_metrics_parse(listen, &ep) < 0) {
		LOG_ERR("metrics: bad address '%s'", listen);
		return -EINVAL;
	}
	struct kvsp_metrics *m = calloc(1, sizeof(*m));
	if (!m)
		return -ENOMEM;
	unsigned flags = MHD_USE_AUTO_INTERNAL_THREAD | MHD_USE_ERROR_LOG;
	if (ep.sa.ss_family == AF_INET6)
		flags |= MHD_USE_IPv6;
	/* The server's thread takes no signal: SIGTERM and SIGINT are the
	 * loop's, which would not wake if this thread caught them. */
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	m->d = MHD_start_daemon(flags, 0, NULL, NULL, on_request, p,
				MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, NULL, /* first, or MHD warns */
				MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ep.sa,
				MHD_OPTION_CONNECTION_LIMIT, (unsigned)METRICS_MAX_CONNS,
				MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)METRICS_PER_IP,
				MHD_OPTION_CONNECTION_TIMEOUT, METRICS_IDLE_S,
				MHD_OPTION_END);
	int err = errno;
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (!m->d) {
		free(m);
		LOG_ERR("metrics: cannot serve on %s: %s", ep.text,
			err ? strerror(err) : "libmicrohttpd refused");
		return err ? -err : -EINVAL;
	}
	const union MHD_DaemonInfo *bound = MHD_get_daemon_info(m->d, MHD_DAEMON_INFO_BIND_PORT);
	char host[64];
	snprintf(host, sizeof(host), "%s", ep.text);
	char *colon = strrchr(host, ':');
	if (colon)
		*colon = 0;
	LOG_INFO("metrics: serving http://%s:%u/metrics", host, bound ? bound->port : 0);
	p->metrics = m;
	return 0;
}

void kvsp_metrics_stop(struct kvsp *p)
{
	if (!p->metrics)
		return;
	MHD_stop_daemon(p->metrics->d);
	free(p->metrics);
	p->metrics = NULL;
}
