/* SPDX-License-Identifier: MIT */
#include "admin.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "layout.h"
#include "sock.h"

static __thread char last_msg[96];

const char *const kvs_fp_names[KVS_FP_COUNT] = {
#define KVS_FP_NAME(id, name) name,
	KVS_FAILPOINTS(KVS_FP_NAME)
#undef KVS_FP_NAME
};

int kvs_fp_find(const char *name)
{
	for (int i = 0; i < KVS_FP_COUNT; i++)
		if (!strcmp(name, kvs_fp_names[i]))
			return i;
	return -ENOENT;
}

/* Set, release and get are answered on the proxy's next turn; a proxy that
 * has not answered in this long is stopped or wedged. */
#define REPLY_MS 30000

const char *kvs_admin_msg(void)
{
	return last_msg;
}

int kvs_admin_connect(const char *path)
{
	int fd = kvs_sock_connect(path);
	if (fd < 0)
		return fd;
	struct kvs_hello h = { .magic = KVS_MAGIC_HELLO, .abi = KVS_ABI, .kind = KVS_HELLO_ADMIN };
	struct kvs_welcome w;
	int rc = kvs_sock_send(fd, &h, sizeof(h), NULL, 0);
	if (rc == 0 || rc == -EPIPE || rc == -ECONNRESET) { /* a refusal may be waiting */
		ssize_t n = kvs_sock_recv(fd, &w, sizeof(w), NULL, NULL, 0);
		rc = n < 0					    ? (int)n
		     : n != sizeof(w) || w.magic != KVS_MAGIC_HELLO ? -EPROTO
								    : w.status;
		if (n == sizeof(w)) {
			memcpy(last_msg, w.msg, sizeof(last_msg));
			last_msg[sizeof(last_msg) - 1] = 0;
		}
	}
	if (rc < 0) {
		close(fd);
		return rc;
	}
	return fd;
}

static int call(int fd, const struct kvs_admin_req *q, struct kvs_admin_rep *r, int timeout_ms)
{
	int rc = kvs_sock_send(fd, q, sizeof(*q), NULL, 0);
	if (rc < 0)
		return rc;
	struct pollfd pfd = { .fd = fd, .events = POLLIN };
	rc = kvs_poll_for(&pfd, 1, timeout_ms);
	if (rc < 0)
		return rc;
	if (rc == 0)
		return -ETIMEDOUT;
	ssize_t n = kvs_sock_recv(fd, r, sizeof(*r), NULL, NULL, 0);
	if (n < 0)
		return (int)n;
	if (n != sizeof(*r))
		return -ENOTCONN;
	memcpy(last_msg, r->msg, sizeof(last_msg));
	last_msg[sizeof(last_msg) - 1] = 0;
	return r->status;
}

static int set_name(struct kvs_admin_req *q, const char *name)
{
	if (!name || strlen(name) >= sizeof(q->name))
		return -EINVAL;
	strcpy(q->name, name);
	return 0;
}

static int fp_set(int fd, const char *name, const char *action, const uint64_t *match,
		  uint64_t mask)
{
	struct kvs_admin_req q = { .op = KVS_ADMIN_FP_SET, .mask = mask };
	struct kvs_admin_rep r;
	if (set_name(&q, name) < 0)
		return -EINVAL;
	if (!strcmp(action, "off")) {
		q.action = KVS_FP_OFF;
	} else if (!strcmp(action, "pause")) {
		q.action = KVS_FP_PAUSE;
	} else if (!strncmp(action, "fail", 4)) {
		q.action = KVS_FP_FAIL;
		q.err = -EIO;
		if (action[4] == '=') {
			char *end;
			long e = strtol(action + 5, &end, 10);
			if (*end || e <= 0 || e > 4095)
				return -EINVAL;
			q.err = (int32_t)-e;
		} else if (action[4]) {
			return -EINVAL;
		}
	} else {
		return -EINVAL;
	}
	if (match) {
		q.match_set = 1;
		q.match = *match;
	}
	return call(fd, &q, &r, REPLY_MS);
}

int kvs_admin_fp_set(int fd, const char *name, const char *action, const uint64_t *match)
{
	return fp_set(fd, name, action, match, 0);
}

int kvs_admin_fp_set_mask(int fd, const char *name, const char *action, uint64_t match,
			  uint64_t mask)
{
	return fp_set(fd, name, action, &match, mask);
}

int kvs_admin_fp_release(int fd, const char *name, uint64_t match, uint64_t mask,
			 uint64_t *released)
{
	struct kvs_admin_req q = { .op = KVS_ADMIN_FP_RELEASE,
				   .match_set = 1,
				   .match = match,
				   .mask = mask };
	struct kvs_admin_rep r;
	if (set_name(&q, name) < 0)
		return -EINVAL;
	int rc = call(fd, &q, &r, REPLY_MS);
	if (rc == 0 && released)
		*released = r.hits;
	return rc;
}

int kvs_admin_fp_wait(int fd, const char *name, uint64_t hits, int timeout_ms)
{
	struct kvs_admin_req q = { .op = KVS_ADMIN_FP_WAIT, .hits = hits };
	struct kvs_admin_rep r;
	if (set_name(&q, name) < 0)
		return -EINVAL;
	return call(fd, &q, &r, timeout_ms);
}

int kvs_admin_stat_wait(int fd, const char *name, int ge, uint64_t value, int timeout_ms)
{
	struct kvs_admin_req q = { .op = KVS_ADMIN_STAT_WAIT, .action = ge ? 0 : 1, .hits = value };
	struct kvs_admin_rep r;
	if (set_name(&q, name) < 0)
		return -EINVAL;
	return call(fd, &q, &r, timeout_ms);
}

int kvs_admin_fp_get(int fd, const char *name, uint64_t *hits)
{
	struct kvs_admin_req q = { .op = KVS_ADMIN_FP_GET };
	struct kvs_admin_rep r;
	if (set_name(&q, name) < 0)
		return -EINVAL;
	int rc = call(fd, &q, &r, REPLY_MS);
	if (rc == 0)
		*hits = r.hits;
	return rc;
}

int kvs_stat_map(const char *path, const struct kvs_ctrl **ctrl, size_t *len)
{
	int fd = kvs_sock_connect(path);
	if (fd < 0)
		return fd;
	struct kvs_hello h = { .magic = KVS_MAGIC_HELLO, .abi = KVS_ABI, .kind = KVS_HELLO_STAT };
	struct kvs_welcome w;
	int cfd = -1, nfds = 1;
	int rc = kvs_sock_send(fd, &h, sizeof(h), NULL, 0);
	if (rc == 0) {
		ssize_t n = kvs_sock_recv(fd, &w, sizeof(w), &cfd, &nfds, 0);
		rc = n < 0 ? (int)n : n != sizeof(w) ? -EPROTO : w.status < 0 ? w.status : 0;
		if (rc == 0 && nfds != 1)
			rc = -EPROTO;
	}
	close(fd);
	if (rc < 0) {
		if (cfd >= 0)
			close(cfd);
		return rc;
	}
	/* Mapping more than the file holds would fault (SIGBUS) at the first
	 * touch past its end: whoever answers at the socket says the size. */
	struct stat st;
	if (fstat(cfd, &st) < 0 || !S_ISREG(st.st_mode) || !w.ctrl_size ||
	    (uint64_t)st.st_size < w.ctrl_size) {
		close(cfd);
		return -EBADMSG;
	}
	void *m = mmap(NULL, w.ctrl_size, PROT_READ, MAP_SHARED, cfd, 0);
	close(cfd);
	if (m == MAP_FAILED)
		return -errno;
	*ctrl = m;
	*len = w.ctrl_size;
	return 0;
}
