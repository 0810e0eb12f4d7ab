/* SPDX-License-Identifier: MIT */
/* The peer secret, loaded and judged (peer/secret.h). */
#include "peer/secret.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sodium.h>

#include "kvs_build.h"
#if KVS_HAVE_ACL
#include <acl/libacl.h>
#include <sys/acl.h>
#else
#include <sys/xattr.h>
#endif

#include "peer/frame.h"

/* ------------------------------------------------------------------ secret */

static int refuse(char *why, size_t why_len, int err, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));

static int refuse(char *why, size_t why_len, int err, const char *fmt, ...)
{
	va_list ap;

	if (why_len) {
		va_start(ap, fmt);
		vsnprintf(why, why_len, fmt, ap);
		va_end(ap);
	}
	return err;
}

/* What a mode's group and other bits let people do, for the refusal. */
static void mode_says(mode_t m, const char **who, const char **what)
{
	*who = (m & 070) && (m & 07) ? "its group and others" : (m & 070) ? "its group" : "others";
	if (m & 044)
		*what = (m & 022) ? "read and change" : "read";
	else
		*what = (m & 022) ? "change" : "run";
}

#if KVS_HAVE_ACL
/* A mode whose group bits are an ACL's mask (ls shows "+"): systemd's
 * LoadCredential= copies on a file system with ACLs are root's, 0400 plus
 * "user:kvstage:r", which reads as 0440. What counts is who the entries
 * let in: only the owner (root or us) and our own uid, no group, no
 * others. Returns 1 if that is all, 0 if there is no such ACL (the mode
 * means what it says), or -EPERM with why written. */
static int acl_judge(int fd, char *why, size_t why_len, const char *path)
{
	if (acl_extended_fd(fd) != 1)
		return 0;
	acl_t acl = acl_get_fd(fd);
	if (!acl)
		return 0;
	bool ok = true;
	int r = 0;
	acl_entry_t e;
	for (int w = ACL_FIRST_ENTRY; ok && acl_get_entry(acl, w, &e) == 1; w = ACL_NEXT_ENTRY) {
		acl_tag_t tag;
		acl_permset_t ps;
		if (acl_get_tag_type(e, &tag) < 0 || acl_get_permset(e, &ps) < 0) {
			ok = false;
			break;
		}
		bool any = acl_get_perm(ps, ACL_READ) == 1 || acl_get_perm(ps, ACL_WRITE) == 1 ||
			   acl_get_perm(ps, ACL_EXECUTE) == 1;
		if (tag == ACL_USER) {
			uid_t *u = acl_get_qualifier(e);
			if (any && (!u || *u != geteuid())) {
				r = refuse(why, why_len, -EPERM,
					   "%s: its ACL lets uid %u in; only ours (uid %u) may be "
					   "named",
					   path, u ? (unsigned)*u : 0u, (unsigned)geteuid());
				ok = false;
			}
			acl_free(u);
		} else if ((tag == ACL_GROUP_OBJ || tag == ACL_GROUP || tag == ACL_OTHER) && any) {
			r = refuse(why, why_len, -EPERM,
				   "%s: its ACL lets %s in; chmod 600 it and drop the ACL (setfacl "
				   "-b)",
				   path, tag == ACL_OTHER ? "others" : "a group");
			ok = false;
		}
	}
	acl_free(acl);
	return ok ? 1 : r ? r : 0;
}
#else
/* Built without libacl (meson_options.txt): an ACL can be seen, not read.
 * Returns 0 if the file has none (its mode means what it says), or -EPERM
 * with why written: whom it lets in is unknown here. */
static int acl_judge(int fd, char *why, size_t why_len, const char *path)
{
	if (fgetxattr(fd, "system.posix_acl_access", NULL, 0) < 0)
		return 0; /* none (ENODATA), or a file system without ACLs */
	return refuse(
		why, why_len, -EPERM,
		"%s: it has a POSIX ACL, and this build cannot judge one (libacl1-dev missing at "
		"build time); chmod 600 it and drop the ACL (setfacl -b)",
		path);
}
#endif

/* Reads path's bytes into buf (at most cap: more means too long) after
 * judging the file. Returns 0 with *n, or -errno with why written. */
static int read_file(const char *path, uint8_t *buf, size_t cap, size_t *n, char *why,
		     size_t why_len)
{
	struct stat st;
	int r = 0;

	/* No link is followed: a link could point us at a file someone else
	 * chose. O_NONBLOCK: opening a FIFO must not wait for a writer (it is
	 * then refused as not a regular file); a regular file ignores it. */
	int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
	if (fd < 0) {
		int e = errno;
		if (e == ELOOP)
			return refuse(why, why_len, -ELOOP,
				      "%s: is a symbolic link, which is not followed; name the "
				      "file itself",
				      path);
		return refuse(why, why_len, -e, "%s: %s", path, strerror(e));
	}
	if (fstat(fd, &st) < 0) {
		int e = errno;
		r = refuse(why, why_len, -e, "%s: %s", path, strerror(e));
	} else if (!S_ISREG(st.st_mode)) {
		r = refuse(why, why_len, -EINVAL, "%s: not a regular file", path);
	} else if (st.st_uid != geteuid() && st.st_uid != 0) {
		/* Anyone else who owns it can change it, or chmod it open. */
		r = refuse(why, why_len, -EPERM,
			   "%s: owned by uid %u; it must be ours (uid %u) or root's", path,
			   (unsigned)st.st_uid, (unsigned)geteuid());
	} else if (st.st_mode & 077) {
		/* Group bits but no others': maybe an ACL's mask, not a group. */
		int acl = (st.st_mode & 007) ? 0 : acl_judge(fd, why, why_len, path);
		if (acl < 0) {
			r = acl;
		} else if (acl == 0) {
			const char *who, *what;
			mode_says(st.st_mode, &who, &what);
			r = refuse(why, why_len, -EPERM,
				   "%s: mode %04o lets %s %s it; chmod 600 it", path,
				   (unsigned)(st.st_mode & 07777), who, what);
		}
	}
	*n = 0;
	while (r == 0 && *n < cap) {
		ssize_t k = read(fd, buf + *n, cap - *n);
		if (k < 0 && errno == EINTR)
			continue;
		if (k < 0) {
			int e = errno;
			r = refuse(why, why_len, -e, "%s: %s", path, strerror(e));
		} else if (k == 0) {
			break;
		} else {
			*n += (size_t)k;
		}
	}
	close(fd);
	return r;
}

/* BLAKE2b with a personalisation naming the protocol: the same secret
 * used for something else never gives this key. The secret is not
 * stretched (it must be random, not a password: see peer_auth.h). */
static int derive_master(const uint8_t *raw, size_t n, struct kvsp_secret *out, char *why,
			 size_t why_len)
{
	static const unsigned char personal[crypto_generichash_blake2b_PERSONALBYTES] =
		"kvstage peer v1";
	unsigned char *k = sodium_malloc(KVSP_KEY_SIZE);

	if (!k)
		return refuse(why, why_len, -ENOMEM, "no memory for the peer key");
	if (crypto_generichash_blake2b_salt_personal(k, KVSP_KEY_SIZE, raw, n, NULL, 0, NULL,
						     personal) != 0) {
		sodium_free(k);
		return refuse(why, why_len, -EIO, "libsodium could not derive the peer key");
	}
	sodium_mprotect_readonly(k);
	out->key = k;
	return 0;
}

int kvsp_secret_load(const char *path, const char *env_value, struct kvsp_secret *out, char *why,
		     size_t why_len)
{
	/* Room past the longest secret and its "\r\n", so a longer one shows. */
	uint8_t raw[KVSP_SECRET_MAX + 3];
	const char *src = path ? path : "$KVSTAGE_PEER_SECRET";
	size_t n = 0;
	int r = 0;

	if (why_len)
		why[0] = '\0';
	if (sodium_init() < 0)
		return refuse(why, why_len, -EIO, "libsodium failed to start");
	if (path) {
		r = read_file(path, raw, sizeof(raw), &n, why, why_len);
	} else if (env_value) {
		n = strnlen(env_value, sizeof(raw));
		memcpy(raw, env_value, n);
	} else {
		return refuse(why, why_len, -ENOKEY,
			      "no peer secret: name a secret file, or set $KVSTAGE_PEER_SECRET");
	}
	if (r == 0) {
		/* One line ending, as an editor or echo leaves it; nothing else is
		 * trimmed: every other byte is the secret's. */
		if (n && raw[n - 1] == '\n')
			n -= n >= 2 && raw[n - 2] == '\r' ? 2 : 1;
		if (n > KVSP_SECRET_MAX)
			r = refuse(why, why_len, -EINVAL,
				   "%s: longer than %d bytes; a peer secret is at most that", src,
				   KVSP_SECRET_MAX);
		else if (n < KVSP_SECRET_MIN)
			r = refuse(why, why_len, -EINVAL,
				   "%s: %zu bytes; a peer secret needs at least %d random ones "
				   "(openssl rand -base64 32 makes one)",
				   src, n, KVSP_SECRET_MIN);
		else
			r = derive_master(raw, n, out, why, why_len);
	}
	sodium_memzero(raw, sizeof(raw));
	return r;
}

void kvsp_secret_free(struct kvsp_secret *s)
{
	if (s->key)
		sodium_free((void *)s->key); /* zeroes it first */
	s->key = NULL;
}
