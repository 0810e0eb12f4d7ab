/* SPDX-License-Identifier: MIT */
/*
 * kvstaged --metrics-listen: the HTTP side (libmicrohttpd), driven from a
 * thread of ours (MHD_run_wait) so that between two runs we can hold each
 * connection to a deadline for its whole request, which libmicrohttpd's
 * idle timeout is not: a client that sends a byte every second keeps an
 * idle timer young for ever. Past METRICS_MAX_CONNS a newcomer is refused
 * at once, never left waiting in the listen queue. The page: metrics_page.c.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "base/log.h"
#include "daemon/metrics.h"
#include "parse.h"
#include "core/proxy.h"
#include "peer/endpoint.h"

/* A scraper needs one connection; a few more let a curl in beside it.
 * Past these, connections are refused, never queued. */
#define METRICS_MAX_CONNS 16
#define METRICS_PER_IP 8
/* A request, from its connection's accept (or the answer before it on
 * that connection) to its answer: a page is built in milliseconds, so
 * this is only ever a slow or silent client's time. */
#define METRICS_REQUEST_NS (3ull * 1000000000)
#define METRICS_TICK_MS 100

/* One connection, on the server thread's list. */
struct mconn {
	struct mconn *next, **pprev;
	int fd;
	bool cut;
	uint64_t since_ns; /* accepted, or its last request answered */
};

struct kvsp_metrics {
	struct MHD_Daemon *d;
	pthread_t thread;
	bool stop;	     /* atomic: the loop's thread tells the server's */
	struct mconn *conns; /* the server thread's alone */
	unsigned nconns;
	uint64_t cut, refused;
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

static enum MHD_Result answer(struct MHD_Connection *conn, unsigned code, const char *type,
			      char *body, size_t len, enum MHD_ResponseMemoryMode mode)
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

static void on_mhd_log_line(const char *msg)
{
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
	LOG_WARN("metrics: %s", msg);
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
	(void)cls;
	char msg[256];
	vsnprintf(msg, sizeof(msg), fmt, ap);
	msg[strcspn(msg, "\n")] = 0;
	on_mhd_log_line(msg);
}

/* ------------------------------------------- connections and deadlines */

static enum MHD_Result on_accept(void *cls, const struct sockaddr *addr, socklen_t len)
{
	struct kvsp_metrics *m = cls;
	(void)addr;
	(void)len;
	if (m->nconns < METRICS_MAX_CONNS)
		return MHD_YES;
	m->refused++; /* closed at once: the scraper hears it now, not at its timeout */
	return MHD_NO;
}

static void on_connection(void *cls, struct MHD_Connection *conn, void **ctx,
			  enum MHD_ConnectionNotificationCode code)
{
	struct kvsp_metrics *m = cls;
	struct mconn *mc = *ctx;
	if (code == MHD_CONNECTION_NOTIFY_STARTED) {
		const union MHD_ConnectionInfo *ci =
			MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
		mc = calloc(1, sizeof(*mc));
		if (!mc || !ci) {
			free(mc);
			*ctx = NULL;
			return; /* untracked: the idle timeout still ends it */
		}
		mc->fd = ci->connect_fd;
		mc->since_ns = kvsp_now_ns();
		mc->next = m->conns;
		mc->pprev = &m->conns;
		if (m->conns)
			m->conns->pprev = &mc->next;
		m->conns = mc;
		m->nconns++;
		*ctx = mc;
	} else if (mc) { /* closed: called before libmicrohttpd closes the fd */
		*mc->pprev = mc->next;
		if (mc->next)
			mc->next->pprev = mc->pprev;
		m->nconns--;
		free(mc);
		*ctx = NULL;
	}
}

/* A request was answered: the next one on the connection gets its own time. */
static void on_completed(void *cls, struct MHD_Connection *conn, void **req,
			 enum MHD_RequestTerminationCode toe)
{
	(void)cls;
	(void)req;
	(void)toe;
	const union MHD_ConnectionInfo *ci =
		MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
	if (ci && ci->socket_context)
		((struct mconn *)ci->socket_context)->since_ns = kvsp_now_ns();
}

/* Cuts every connection past its request's deadline: libmicrohttpd sees
 * it end at its next run and frees its place. Same thread as the runs,
 * so the fd is still the connection's. */
static void cut_late(struct kvsp_metrics *m)
{
	uint64_t now = kvsp_now_ns();
	for (struct mconn *mc = m->conns; mc; mc = mc->next)
		if (!mc->cut && now - mc->since_ns > METRICS_REQUEST_NS) {
			shutdown(mc->fd, SHUT_RDWR);
			mc->cut = true;
			m->cut++;
		}
}

static void *serve(void *arg)
{
	struct kvsp_metrics *m = arg;
	uint64_t cut = 0, refused = 0;
	while (!__atomic_load_n(&m->stop, __ATOMIC_ACQUIRE)) {
		MHD_run_wait(m->d, METRICS_TICK_MS);
		cut_late(m);
		if (m->cut != cut || m->refused != refused) {
			/* the client's doing: through the same limit as libmicrohttpd's lines */
			char msg[128];
			snprintf(msg, sizeof(msg),
				 "%llu requests cut at their %llu s deadline, %llu "
				 "connections refused (%u open at most), so far",
				 (unsigned long long)m->cut,
				 (unsigned long long)(METRICS_REQUEST_NS / 1000000000),
				 (unsigned long long)m->refused, METRICS_MAX_CONNS);
			on_mhd_log_line(msg);
			cut = m->cut;
			refused = m->refused;
		}
	}
	return NULL;
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
	unsigned flags = MHD_USE_ERROR_LOG |
			 MHD_USE_EPOLL; /* runs: ours (MHD_run_wait), any fd number */
	if (ep.sa.ss_family == AF_INET6)
		flags |= MHD_USE_IPv6;
	m->d = MHD_start_daemon(flags, 0, on_accept, m, on_request, p, MHD_OPTION_EXTERNAL_LOGGER,
				on_mhd_log, NULL, /* first, or MHD warns */
				MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ep.sa,
				/* ours refuses first (on_accept); this one only backs it */
				MHD_OPTION_CONNECTION_LIMIT, (unsigned)METRICS_MAX_CONNS + 1,
				MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)METRICS_PER_IP,
				MHD_OPTION_CONNECTION_TIMEOUT,
				(unsigned)(METRICS_REQUEST_NS / 1000000000),
				MHD_OPTION_NOTIFY_CONNECTION, on_connection, m,
				MHD_OPTION_NOTIFY_COMPLETED, on_completed, m, MHD_OPTION_END);
	int err = errno;
	if (!m->d) {
		free(m);
		LOG_ERR("metrics: cannot serve on %s: %s", ep.text,
			err ? strerror(err) : "libmicrohttpd refused");
		return err ? -err : -EINVAL;
	}
	/* The server's thread takes no signal: SIGTERM and SIGINT are the
	 * loop's, which would not wake if this thread caught them. */
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	err = pthread_create(&m->thread, NULL, serve, m);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (err) {
		MHD_stop_daemon(m->d);
		free(m);
		LOG_ERR("metrics: no thread to serve from: %s", strerror(err));
		return -err;
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
	struct kvsp_metrics *m = p->metrics;
	if (!m)
		return;
	__atomic_store_n(&m->stop, true, __ATOMIC_RELEASE);
	pthread_join(m->thread, NULL); /* within a tick: its run waits that long at most */
	MHD_stop_daemon(m->d);	       /* closes what is left: each is told closed, and freed */
	free(m);
	p->metrics = NULL;
}
