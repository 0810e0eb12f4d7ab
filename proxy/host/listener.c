/* SPDX-License-Identifier: MIT */
/*
 * The Unix socket clients reach us by: claiming its path without trusting
 * anything another user could have put there, access control, accepting,
 * the hello and every refusal.
 *
 * Access control is one rule, applied at accept from the kernel's word
 * (SO_PEERCRED, SO_PEERGROUPS): a peer is admitted if its uid is root, ours
 * or an --allow-uid, or if any of its groups (primary or supplementary) is
 * the socket's group or an --allow-gid. The socket file's owner, group and
 * mode are the kernel's gate in front of ours; kvsp_access_check refuses a
 * configuration in which the file would keep out someone the rule admits.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <libgen.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "base/log.h"
#include "base/loop_fd.h"
#include "core/proxy.h"
#include "core/clients.h"
#include "core/rooms.h"
#include "host/loop.h"
#include "ring.h"
#include "sock.h"

#ifndef SO_PEERGROUPS
#define SO_PEERGROUPS 59
#endif

#define HELLO_TIMEOUT_NS 5000000000ull
#define MAX_PENDING 64
#define MAX_PENDING_PER_UID 8 /* one user's silent connections leave the rest to others */
#define NO_PLACE MAX_PENDING
#define MAX_GROUPS 256 /* supplementary groups looked at, per peer */

struct kvsp_pending {
	int fd;
	pid_t pid;
	uid_t uid;
	uint64_t proc; /* the process, for its share (process_of) */
	uint32_t id; /* in its epoll tag: an event for an earlier holder of the place is not its */
	uint64_t since_ns;
};

/* ------------------------------------------------------ access control */

static bool in_groups(gid_t g, const gid_t *groups, int n)
{
	for (int i = 0; i < n; i++)
		if (groups[i] == g)
			return true;
	return false;
}

static bool admitted(const struct kvsp_config *cfg, uid_t uid, const gid_t *groups, int ngroups)
{
	if (uid == 0 || uid == geteuid())
		return true;
	for (unsigned i = 0; i < cfg->n_allow_uid; i++)
		if (cfg->allow_uid[i] == uid)
			return true;
	if (in_groups(cfg->socket_group, groups, ngroups))
		return true;
	for (unsigned i = 0; i < cfg->n_allow_gid; i++)
		if (in_groups(cfg->allow_gid[i], groups, ngroups))
			return true;
	return false;
}

/* Whether user uid is, by the system's databases, a member of group g. */
static bool user_in_group(uid_t uid, gid_t g)
{
	struct passwd pw, *res;
	char buf[4096];
	if (getpwuid_r(uid, &pw, buf, sizeof(buf), &res) || !res)
		return false; /* unknown users cannot be shown to be members */
	if (pw.pw_gid == g)
		return true;
	gid_t groups[MAX_GROUPS];
	int n = MAX_GROUPS;
	if (getgrouplist(pw.pw_name, pw.pw_gid, groups, &n) < 0)
		return false;
	return in_groups(g, groups, n);
}

int kvsp_access_check(const struct kvsp_config *cfg, char *why, size_t len)
{
	unsigned m = cfg->socket_mode;
	if ((m & 0600) != 0600) {
		snprintf(why, len,
			 "--socket-mode %04o: the owner (kvstaged's user) needs read and "
			 "write",
			 m);
		return -EINVAL;
	}
	if (m & 0002)
		return 0; /* anyone may connect; kvstaged's own check decides */
	gid_t g = cfg->socket_group;
	for (unsigned i = 0; i < cfg->n_allow_uid; i++) {
		uid_t u = cfg->allow_uid[i];
		if (u == 0 || u == geteuid() || ((m & 0020) && user_in_group(u, g)))
			continue;
		snprintf(why, len,
			 "--allow-uid %u: the socket (group %u, mode %04o) keeps that user "
			 "out before kvstaged can admit it; add the user to group %u, or give "
			 "--socket-mode 0666 (kvstaged still checks every client)",
			 (unsigned)u, (unsigned)g, m, (unsigned)g);
		return -EINVAL;
	}
	for (unsigned i = 0; i < cfg->n_allow_gid; i++) {
		gid_t a = cfg->allow_gid[i];
		if ((m & 0020) && a == g)
			continue;
		snprintf(why, len,
			 "--allow-gid %u: the socket (group %u, mode %04o) keeps that group "
			 "out before kvstaged can admit it; give --socket-group %u, or "
			 "--socket-mode "
			 "0666 (kvstaged still checks every client)",
			 (unsigned)a, (unsigned)g, m, (unsigned)a);
		return -EINVAL;
	}
	return 0;
}

/* ------------------------------------------------------ the socket path */

/* The directory must not let anyone else replace what we put in it:
 * owned by us or root, and writable by others only with the sticky bit. */
static int check_dir(const char *path)
{
	char copy[sizeof(((struct sockaddr_un *)0)->sun_path)];
	snprintf(copy, sizeof(copy), "%s", path);
	const char *dir = dirname(copy);
	struct stat st;
	if (stat(dir, &st) < 0) {
		int err = -errno;
		LOG_ERR("socket directory %s: %s (choose another with --socket PATH or "
			"$KVSTAGE_SOCKET)",
			dir, strerror(-err));
		return err;
	}
	if (!S_ISDIR(st.st_mode)) {
		LOG_ERR("socket directory %s is not a directory", dir);
		return -ENOTDIR;
	}
	bool shared = st.st_mode & (S_IWGRP | S_IWOTH);
	if (!(st.st_mode & S_ISVTX) && (shared || (st.st_uid != 0 && st.st_uid != geteuid()))) {
		LOG_ERR("socket directory %s (owner uid %u, mode %04o) lets another user replace "
			"the socket; use a directory only kvstaged's user can write, or one with "
			"the "
			"sticky bit",
			dir, (unsigned)st.st_uid, (unsigned)(st.st_mode & 07777));
		return -EPERM;
	}
	return 0;
}

/* Opens and locks PATH.lock: never through a link, and only a plain file
 * of ours, so a name planted by someone else is refused, not followed. */
static int lock_path(struct kvsp *p, const char *path)
{
	char lock[sizeof(((struct sockaddr_un *)0)->sun_path) + 8];
	snprintf(lock, sizeof(lock), "%s.lock", path);
	int fd = open(lock, O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0600);
	if (fd < 0) {
		int err = -errno;
		if (err == -ELOOP)
			LOG_ERR("%s is a symbolic link: refusing to follow it", lock);
		else
			LOG_ERR("cannot create %s: %s%s", lock, strerror(-err),
				err == -EACCES || err == -ENOENT || err == -EROFS
					? " (choose a writable place with --socket PATH or "
					  "$KVSTAGE_SOCKET)"
					: "");
		return err == -ELOOP ? -EPERM : err;
	}
	p->lock_fd = fd;
	struct stat st;
	if (fstat(fd, &st) < 0)
		return -errno;
	if (!S_ISREG(st.st_mode) || st.st_uid != geteuid() || st.st_nlink != 1) {
		LOG_ERR("%s is not a plain file of ours (owner uid %u, %lu links): someone else "
			"holds the name; remove it, or use a directory only kvstaged's user can "
			"write",
			lock, (unsigned)st.st_uid, (unsigned long)st.st_nlink);
		return -EPERM;
	}
	if (flock(fd, LOCK_EX | LOCK_NB) < 0) {
		int err = -errno;
		LOG_ERR("another kvstaged already serves %s (%s is locked)", path, lock);
		return err == -EWOULDBLOCK ? -EADDRINUSE : err;
	}
	return 0;
}

/* What is at path now may be replaced only if it is a socket of ours (a
 * dead proxy's: we hold the lock). Returns 0, or -errno (logged). */
static int check_stale(const char *path)
{
	struct stat st;
	if (lstat(path, &st) < 0)
		return errno == ENOENT ? 0 : -errno;
	if (!S_ISSOCK(st.st_mode)) {
		LOG_ERR("%s exists and is not a socket: refusing to replace it", path);
		return -EEXIST;
	}
	if (st.st_uid != geteuid()) {
		LOG_ERR("%s is a socket of uid %u, not ours: refusing to replace it", path,
			(unsigned)st.st_uid);
		return -EEXIST;
	}
	return 0;
}

int kvsp_socket_claim(struct kvsp *p)
{
	const char *path = p->cfg.socket_path;
	if (strlen(path) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
		LOG_ERR("socket path too long (max %zu bytes): %s",
			sizeof(((struct sockaddr_un *)0)->sun_path) - 1, path);
		return -ENAMETOOLONG;
	}
	if (!strcmp(path, KVS_DEFAULT_SOCKET))
		mkdir("/run/kvstage", 0755); /* may exist; check_dir reports the rest */
	int rc = check_dir(path);
	if (rc == 0)
		rc = lock_path(p, path);
	if (rc == 0)
		rc = check_stale(path);
	return rc;
}

int kvsp_listener_open(struct kvsp *p)
{
	const struct kvsp_config *cfg = &p->cfg;
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", cfg->socket_path);
	int rc = check_stale(cfg->socket_path); /* again: the lock is ours, the name may not be */
	if (rc < 0)
		return rc;
	unlink(cfg->socket_path);
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	/* Born 0600, then given its group and mode: never wider than meant. */
	mode_t old = umask(0177);
	rc = bind(fd, (struct sockaddr *)&sa, sizeof(sa));
	umask(old);
	struct stat st;
	if (rc < 0 || lstat(sa.sun_path, &st) < 0 ||
	    (cfg->socket_group != getegid() &&
	     chown(sa.sun_path, (uid_t)-1, cfg->socket_group) < 0) ||
	    chmod(sa.sun_path, cfg->socket_mode) < 0 || listen(fd, 128) < 0) {
		rc = -errno;
		LOG_ERR("cannot listen on %s: %s", sa.sun_path, strerror(-rc));
		close(fd);
		return rc;
	}
	p->sock_dev = st.st_dev;
	p->sock_ino = st.st_ino;
	p->listen_fd = fd;
	return kvsp_ep_add(p->epfd, fd, EPOLLIN, kvsp_ep_tag(KVSP_EP_LISTEN, 0, 0));
}

void kvsp_listener_close(struct kvsp *p)
{
	if (p->listen_fd < 0)
		return;
	close(p->listen_fd);
	p->listen_fd = -1;
	/* Only the socket we made: whatever else took the name since is not ours to remove. */
	struct stat st;
	if (lstat(p->cfg.socket_path, &st) == 0 && S_ISSOCK(st.st_mode) &&
	    st.st_dev == p->sock_dev && st.st_ino == p->sock_ino)
		unlink(p->cfg.socket_path);
}

/* ---------------------------------------------------- accept and hello */

int kvsp_listener_init(struct kvsp *p)
{
	p->pending = calloc(MAX_PENDING, sizeof(*p->pending));
	if (!p->pending)
		return -ENOMEM;
	for (unsigned i = 0; i < MAX_PENDING; i++)
		p->pending[i].fd = -1;
	p->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
	return 0;
}

void kvsp_listener_fini(struct kvsp *p)
{
	for (unsigned i = 0; p->pending && i < MAX_PENDING; i++)
		if (p->pending[i].fd >= 0)
			close(p->pending[i].fd);
	free(p->pending);
	p->pending = NULL;
	if (p->spare_fd >= 0)
		close(p->spare_fd);
	p->spare_fd = -1;
	kvsp_listener_close(p);
	/* Last: while we hold it, no other kvstaged takes the name. */
	if (p->lock_fd >= 0)
		close(p->lock_fd);
	p->lock_fd = -1;
}

void kvsp_refuse(struct kvsp *p, int fd, int status, const char *msg)
{
	/* Closing with the peer's hello unread would reset the connection,
	 * and the peer might read that instead of our reason. */
	char junk[64];
	while (recv(fd, junk, sizeof(junk), MSG_DONTWAIT) > 0)
		;
	struct kvs_welcome w = { .magic = KVS_MAGIC_HELLO, .abi = KVS_ABI, .status = status };
	snprintf(w.msg, sizeof(w.msg), "%s", msg);
	KVS_STAT_ADD(p->stats->clients_refused, 1); /* counted before anyone hears of it */
	kvs_sock_send(fd, &w, sizeof(w), NULL, 0);
	close(fd);
}

/* The peer's groups, primary first. Returns how many, at most max. */
static int peer_groups(int fd, gid_t primary, gid_t *groups, int max)
{
	groups[0] = primary;
	socklen_t len = (socklen_t)((max - 1) * sizeof(gid_t));
	if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups + 1, &len) < 0)
		return 1; /* ERANGE: more than we look at; the primary still counts */
	return 1 + (int)(len / sizeof(gid_t));
}

/* accept4 ran out of descriptors: give up the spare, take the connection
 * off the backlog with it and refuse it, so the loop does not spin on a
 * listener that stays readable. */
static void refuse_out_of_fds(struct kvsp *p, int err)
{
	kvsp_log_rl(&p->rl_full, p->now_ns, &p->stats->log_suppressed, KVSP_LOG_WARN,
		    "out of file descriptors (%s): refusing connections; raise the limit "
		    "(ulimit -n, LimitNOFILE=) or lower --max-clients",
		    strerror(err));
	if (p->spare_fd < 0)
		return;
	close(p->spare_fd);
	int fd = accept4(p->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
	if (fd >= 0)
		kvsp_refuse(p, fd, -EUSERS, "proxy out of file descriptors");
	p->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
}

static void refuse_peer(struct kvsp *p, int fd, const struct ucred *cr, int status, const char *why)
{
	kvsp_log_rl(&p->rl_refused, p->now_ns, &p->stats->log_suppressed, KVSP_LOG_WARN,
		    "refused pid %d (uid %u gid %u): %s", (int)cr->pid, (unsigned)cr->uid,
		    (unsigned)cr->gid, why);
	kvsp_refuse(p, fd, status, why);
}

#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77 /* Linux 6.5 */
#endif
#define PIDFS_MAGIC 0x50494446 /* Linux 6.9: a pidfd's inode names its process for the boot */

/* The process that connected fd, as the shares know it (core/shares.h): its
 * pidfs inode where the kernel has pidfs, which names it across PID
 * namespaces (a pod's other containers, whose SO_PEERCRED pid is 0); else
 * its pid, 0 when that is not ours to see. */
static uint64_t process_of(int fd, pid_t pid)
{
	int pidfd = -1;
	socklen_t len = sizeof(pidfd);
	if (getsockopt(fd, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) < 0 || pidfd < 0)
		return (uint64_t)pid;
	struct statfs fs;
	struct stat st;
	bool pidfs = fstatfs(pidfd, &fs) == 0 && fs.f_type == PIDFS_MAGIC && fstat(pidfd, &st) == 0;
	close(pidfd);
	return pidfs ? (uint64_t)st.st_ino | 1ull << 63 : (uint64_t)pid; /* never a pid */
}

/* True if the hello of the connection in place i has arrived. */
static bool hello_waiting(const struct kvsp *p, unsigned i)
{
	char b;
	return recv(p->pending[i].fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) > 0;
}

/*
 * A place for a new connection of uid. An honest client says hello at once,
 * so places are held for microseconds; one that stays silent holds one
 * until its hello timeout. When uid holds its share, or all are held, the
 * hellos already here are served first, then the longest-silent connection
 * (of uid, else of anyone) is dropped: silent connections can only crowd
 * out each other, never a client that talks.
 */
static unsigned take_place(struct kvsp *p, uid_t uid)
{
	for (int pass = 0; pass < 2; pass++) {
		unsigned free_i = NO_PLACE, n_uid = 0, oldest = NO_PLACE, oldest_uid = NO_PLACE;
		for (unsigned i = 0; i < MAX_PENDING; i++) {
			struct kvsp_pending *pd = &p->pending[i];
			if (pd->fd < 0) {
				if (free_i == NO_PLACE)
					free_i = i;
				continue;
			}
			if (oldest == NO_PLACE || pd->since_ns < p->pending[oldest].since_ns)
				oldest = i;
			if (pd->uid == uid) {
				n_uid++;
				if (oldest_uid == NO_PLACE ||
				    pd->since_ns < p->pending[oldest_uid].since_ns)
					oldest_uid = i;
			}
		}
		if (n_uid < MAX_PENDING_PER_UID && free_i != NO_PLACE)
			return free_i;
		if (pass == 0) {
			for (unsigned i = 0; i < MAX_PENDING; i++)
				if (p->pending[i].fd >= 0 && hello_waiting(p, i))
					kvsp_on_hello(p, i);
			continue;
		}
		unsigned drop = n_uid >= MAX_PENDING_PER_UID ? oldest_uid : oldest;
		struct kvsp_pending *pd = &p->pending[drop];
		kvsp_log_rl(&p->rl_refused, p->now_ns, &p->stats->log_suppressed, KVSP_LOG_WARN,
			    "dropped a connection of pid %d (uid %u) that said nothing for %llu ms",
			    (int)pd->pid, (unsigned)pd->uid,
			    (unsigned long long)((p->now_ns - pd->since_ns) / 1000000));
		KVS_STAT_ADD(p->stats->clients_refused, 1);
		close(pd->fd);
		pd->fd = -1;
		return drop;
	}
	return NO_PLACE;
}

void kvsp_on_accept(struct kvsp *p)
{
	for (;;) {
		int fd = accept4(p->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0) {
			int err = errno;
			if (err == EINTR || err == ECONNABORTED)
				continue;
			if (err == EMFILE || err == ENFILE)
				refuse_out_of_fds(p, err);
			return;
		}
		struct ucred cr;
		socklen_t len = sizeof(cr);
		if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) < 0) {
			close(fd);
			continue;
		}
		/* Judged now, before the peer holds any place of ours. */
		gid_t groups[MAX_GROUPS];
		int ng = peer_groups(fd, cr.gid, groups, MAX_GROUPS);
		if (!admitted(&p->cfg, cr.uid, groups, ng)) {
			refuse_peer(
				p, fd, &cr, -EACCES,
				"uid/gid not allowed (--allow-uid, --allow-gid, --socket-group)");
			continue;
		}
		unsigned i = take_place(p, cr.uid);
		if (i == NO_PLACE) { /* cannot happen: take_place drops one */
			refuse_peer(p, fd, &cr, -EUSERS, "too many connections in handshake");
			continue;
		}
		/* The hello is usually here already; otherwise it comes as an
		 * event. The reply is the client's, not the kernel's, so it
		 * can carry a reason. */
		p->pending[i] = (struct kvsp_pending){
			fd, cr.pid, cr.uid, process_of(fd, cr.pid), ++p->pending_ids, p->now_ns
		};
		if (hello_waiting(p, i)) {
			kvsp_on_hello(p, i);
		} else if (kvsp_ep_add(p->epfd, fd, EPOLLIN | EPOLLRDHUP,
				       kvsp_ep_tag(KVSP_EP_PENDING, i, p->pending[i].id)) < 0) {
			close(fd);
			p->pending[i].fd = -1;
		}
	}
}

static void welcome_client(struct kvsp *p, struct kvsp_pending *pd)
{
	int fd = pd->fd;
	if (p->draining) {
		kvsp_refuse(p, fd, -ESHUTDOWN, "proxy is shutting down");
		return;
	}
	struct kvsp_client *c = kvsp_client_new(p, fd, pd->pid, pd->uid, pd->proc);
	if (!c) {
		int err = errno;
		char why[96];
		if (err == EUSERS)
			snprintf(why, sizeof(why), "too many clients (--max-clients %u)",
				 p->cfg.max_clients);
		else if (err == EDQUOT)
			snprintf(why, sizeof(why),
				 "uid %u holds its share of the client places (%u of %u, "
				 "--uid-share)",
				 (unsigned)pd->uid, p->shares.max_clients, p->cfg.max_clients);
		else if (err == ETOOMANYREFS)
			snprintf(why, sizeof(why),
				 "process %d holds its share of uid %u's client places (%u of %u, "
				 "--uid-share)",
				 (int)pd->pid, (unsigned)pd->uid, p->shares.max_proc_clients,
				 p->shares.max_clients);
		else
			snprintf(why, sizeof(why), "cannot set up a client: %s", strerror(err));
		kvsp_log_rl(&p->rl_full, p->now_ns, &p->stats->log_suppressed, KVSP_LOG_WARN,
			    "refused pid %d (uid %u): %s", (int)pd->pid, (unsigned)pd->uid, why);
		/* Out of descriptors is the proxy being full, as far as the
		 * client can tell; -EMFILE would read as its own limit. */
		bool full = err == EUSERS || err == EDQUOT || err == ETOOMANYREFS ||
			    err == EMFILE || err == ENFILE;
		kvsp_refuse(p, fd, full ? -EUSERS : -err, why);
		return;
	}
	struct kvs_welcome w = { .magic = KVS_MAGIC_HELLO,
				 .abi = KVS_ABI,
				 .client_id = c->id,
				 .instance = p->instance,
				 .ctrl_size = p->ctrl_size,
				 .cmem_size = c->cmem_size };
	int fds[KVS_WELCOME_NFDS] = { p->pool_fd, p->ctrl_fd, c->cmem_fd, p->wake_fd, c->efd };
	if (kvs_sock_send(fd, &w, sizeof(w), fds, KVS_WELCOME_NFDS) < 0 ||
	    kvsp_ep_add(p->epfd, fd, EPOLLIN | EPOLLRDHUP,
			kvsp_ep_tag(KVSP_EP_CLIENT, c->idx, c->id)) < 0) {
		kvsp_client_destroy(p, c);
		return;
	}
	/* Who connects is an operator's question; a client reconnecting in a
	 * loop must not make it a flood. */
	kvsp_log_rl(&p->rl_attach, p->now_ns, &p->stats->log_suppressed, KVSP_LOG_INFO,
		    "client %u attached: pid %d uid %u", c->id, (int)pd->pid, (unsigned)pd->uid);
}

void kvsp_on_hello(struct kvsp *p, unsigned i)
{
	struct kvsp_pending pd = p->pending[i];
	p->pending[i].fd = -1;
	epoll_ctl(p->epfd, EPOLL_CTL_DEL, pd.fd, NULL); /* ENOENT when served at accept */
	struct kvs_hello h;
	ssize_t n = kvs_sock_recv(pd.fd, &h, sizeof(h), NULL, NULL, MSG_DONTWAIT);
	if (n != sizeof(h) || h.magic != KVS_MAGIC_HELLO) {
		close(pd.fd);
		return;
	}
	if (h.abi != KVS_ABI) {
		kvsp_refuse(p, pd.fd, -EPROTO, "ABI mismatch between libkvstage and kvstaged");
		return;
	}
	switch (h.kind) {
	case KVS_HELLO_CLIENT:
		if (h.ring_layout != kvs_ring_layout()) {
			/* Its rings would be read at other offsets than it writes them. */
			char why[96];
			snprintf(why, sizeof(why), "rte_ring layout %08x is not kvstaged's %08x",
				 (unsigned)h.ring_layout, (unsigned)kvs_ring_layout());
			kvsp_log_rl(
				&p->rl_refused, p->now_ns, &p->stats->log_suppressed, KVSP_LOG_WARN,
				"refused pid %d (uid %u): its libkvstage's %s: the two were built "
				"against different DPDK versions",
				(int)pd.pid, (unsigned)pd.uid, why);
			kvsp_refuse(p, pd.fd, -ENOEXEC, why);
			break;
		}
		welcome_client(p, &pd);
		break;
	case KVS_HELLO_STAT: {
		struct kvs_welcome w = { .magic = KVS_MAGIC_HELLO,
					 .abi = KVS_ABI,
					 .instance = p->instance,
					 .ctrl_size = p->ctrl_size };
		kvs_sock_send(pd.fd, &w, sizeof(w), &p->ctrl_fd, 1);
		close(pd.fd);
		break;
	}
	case KVS_HELLO_ADMIN:
		kvsp_admin_welcome(p, pd.fd);
		break;
	default:
		kvsp_refuse(p, pd.fd, -EPROTO, "unknown connection kind");
	}
}

uint64_t kvsp_pending_expire(struct kvsp *p)
{
	uint64_t next = UINT64_MAX;
	for (unsigned i = 0; i < MAX_PENDING; i++) {
		struct kvsp_pending *pd = &p->pending[i];
		if (pd->fd < 0)
			continue;
		if (p->now_ns - pd->since_ns > HELLO_TIMEOUT_NS) {
			close(pd->fd); /* never said hello */
			pd->fd = -1;
		} else if (pd->since_ns + HELLO_TIMEOUT_NS < next) {
			next = pd->since_ns + HELLO_TIMEOUT_NS;
		}
	}
	return next;
}

bool kvsp_pending_valid(const struct kvsp *p, unsigned i, uint32_t id)
{
	return i < MAX_PENDING && p->pending[i].fd >= 0 && p->pending[i].id == id;
}
