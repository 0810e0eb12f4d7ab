/* SPDX-License-Identifier: MIT */
#include "peer/peer_auth.h"

#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <acl/libacl.h>
#include <sodium.h>
#include <sys/acl.h>

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
					   "%s: its ACL lets uid %u in; only ours (uid %u) may be named",
					   path, u ? (unsigned)*u : 0u, (unsigned)geteuid());
				ok = false;
			}
			acl_free(u);
		} else if ((tag == ACL_GROUP_OBJ || tag == ACL_GROUP || tag == ACL_OTHER) && any) {
			r = refuse(why, why_len, -EPERM,
				   "%s: its ACL lets %s in; chmod 600 it and drop the ACL (setfacl -b)",
				   path, tag == ACL_OTHER ? "others" : "a group");
			ok = false;
		}
	}
	acl_free(acl);
	return ok ? 1 : r ? r : 0;
}

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
				      "%s: is a symbolic link, which is not followed; name the file itself",
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
		r = refuse(why, why_len, -EPERM, "%s: owned by uid %u; it must be ours (uid %u) or root's",
			   path, (unsigned)st.st_uid, (unsigned)geteuid());
	} else if (st.st_mode & 077) {
		/* Group bits but no others': maybe an ACL's mask, not a group. */
		int acl = (st.st_mode & 007) ? 0 : acl_judge(fd, why, why_len, path);
		if (acl < 0) {
			r = acl;
		} else if (acl == 0) {
			const char *who, *what;
			mode_says(st.st_mode, &who, &what);
			r = refuse(why, why_len, -EPERM, "%s: mode %04o lets %s %s it; chmod 600 it",
				   path, (unsigned)(st.st_mode & 07777), who, what);
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

/* --------------------------------------------------------------- handshake */

/*
 * Every proof and key is HMAC-SHA256 under the master key of a label and
 * the transcript: the dialer's nonce, the listener's, the dialer's
 * instance, the listener's, in that order whoever computes. The labels
 * name the version, and for a proof the prover's role:
 *  - a replayed HELLO or PROOF fails: the other side's nonce is new, so
 *    a proof recorded on another connection is over another transcript;
 *  - a reflected proof (the peer's own sent back, or ours) fails: the
 *    label is the other role's;
 *  - a HELLO changed on the way fails at the next proof: every field of
 *    it is either checked for its one value or in the transcript;
 *  - a session key is never a proof (other labels), and each direction
 *    has its own, so a frame sent back to its sender fails its MAC.
 * Labels differ in length or in content, and what follows them is of
 * fixed length, so no two inputs are the same bytes.
 *
 * The listener proves first, to a dialer that has proven nothing: one of
 * the two must (that is the oracle peer_auth.h warns about), and it costs
 * a round trip less this way, since the listener's HELLO and PROOF go
 * together.
 */
static const char LABEL_PROOF_D[] = "kvstage v1 dialer proof";
static const char LABEL_PROOF_L[] = "kvstage v1 listener proof";
static const char LABEL_KEY_D2L[] = "kvstage v1 key dialer to listener";
static const char LABEL_KEY_L2D[] = "kvstage v1 key listener to dialer";

static void transcript_mac(const struct kvsp_auth *a, const char *label, size_t label_len,
			   uint8_t *out)
{
	crypto_auth_hmacsha256_state st;
	bool dialer = a->role == KVS_WIRE_DIALER;
	uint64_t id = htole64(dialer ? a->instance : a->peer_instance);
	uint64_t il = htole64(dialer ? a->peer_instance : a->instance);

	crypto_auth_hmacsha256_init(&st, a->secret->key, KVSP_KEY_SIZE);
	crypto_auth_hmacsha256_update(&st, (const unsigned char *)label, label_len);
	crypto_auth_hmacsha256_update(&st, dialer ? a->nonce : a->peer_nonce, 32);
	crypto_auth_hmacsha256_update(&st, dialer ? a->peer_nonce : a->nonce, 32);
	crypto_auth_hmacsha256_update(&st, (const unsigned char *)&id, 8);
	crypto_auth_hmacsha256_update(&st, (const unsigned char *)&il, 8);
	crypto_auth_hmacsha256_final(&st, out);
	sodium_memzero(&st, sizeof(st));
}

static void proof_of(const struct kvsp_auth *a, uint8_t prover, uint8_t *out)
{
	if (prover == KVS_WIRE_DIALER)
		transcript_mac(a, LABEL_PROOF_D, sizeof(LABEL_PROOF_D), out);
	else
		transcript_mac(a, LABEL_PROOF_L, sizeof(LABEL_PROOF_L), out);
}

static uint8_t peer_role(const struct kvsp_auth *a)
{
	return a->role == KVS_WIRE_DIALER ? KVS_WIRE_LISTENER : KVS_WIRE_DIALER;
}

static void wipe_secrets(struct kvsp_auth *a)
{
	sodium_memzero(a->nonce, sizeof(a->nonce));
	sodium_memzero(a->peer_nonce, sizeof(a->peer_nonce));
	sodium_memzero(&a->keys, sizeof(a->keys));
	a->have_keys = 0;
}

static int fail(struct kvsp_auth *a, int err)
{
	wipe_secrets(a);
	a->secret = NULL;
	a->step = KVSP_AUTH_FAILED;
	a->err = err;
	return err;
}

/* Both sides have proven the secret: the session keys, then nothing else
 * of the handshake is needed. */
static void finish(struct kvsp_auth *a)
{
	uint8_t *d2l = a->role == KVS_WIRE_DIALER ? a->keys.tx : a->keys.rx;
	uint8_t *l2d = a->role == KVS_WIRE_DIALER ? a->keys.rx : a->keys.tx;

	transcript_mac(a, LABEL_KEY_D2L, sizeof(LABEL_KEY_D2L), d2l);
	transcript_mac(a, LABEL_KEY_L2D, sizeof(LABEL_KEY_L2D), l2d);
	sodium_memzero(a->nonce, sizeof(a->nonce));
	sodium_memzero(a->peer_nonce, sizeof(a->peer_nonce));
	a->secret = NULL;
	a->have_keys = 1;
	a->step = KVSP_AUTH_DONE;
}

/* Checks the fixed part every handshake message starts with. */
static int check_head(const struct kvsp_auth *a, uint32_t magic, uint16_t version, uint16_t type,
		      uint32_t role, uint32_t rsvd, uint16_t want_type)
{
	if (le32toh(magic) != KVS_WIRE_HELLO_MAGIC)
		return -EPROTO;
	if (le16toh(version) != KVS_WIRE_VERSION)
		return -EPROTONOSUPPORT;
	if (le16toh(type) != want_type || le32toh(role) != peer_role(a) || rsvd != 0)
		return -EPROTO;
	return 0;
}

int kvsp_auth_start(struct kvsp_auth *a, const struct kvsp_secret *s, enum kvs_wire_role role,
		    uint64_t instance)
{
	memset(a, 0, sizeof(*a));
	if ((role != KVS_WIRE_DIALER && role != KVS_WIRE_LISTENER) || !s || !s->key)
		return fail(a, -EINVAL);
	if (sodium_init() < 0)
		return fail(a, -EIO);
	a->secret = s;
	a->role = (uint8_t)role;
	a->instance = instance;
	randombytes_buf(a->nonce, sizeof(a->nonce));
	a->step = role == KVS_WIRE_DIALER ? KVSP_AUTH_SEND_HELLO : KVSP_AUTH_RECV_HELLO;
	return 0;
}

enum kvsp_auth_step kvsp_auth_next(const struct kvsp_auth *a)
{
	return (enum kvsp_auth_step)a->step;
}

/* A call out of turn is the caller's mistake, not the peer's: -EINVAL,
 * and the handshake goes on. */
static int due(const struct kvsp_auth *a, enum kvsp_auth_step step)
{
	if (a->step == KVSP_AUTH_FAILED)
		return a->err;
	return a->step == step ? 0 : -EINVAL;
}

int kvsp_auth_hello(struct kvsp_auth *a, void *out)
{
	int r = due(a, KVSP_AUTH_SEND_HELLO);
	if (r < 0)
		return r;

	struct kvs_wire_hello h = {
		.magic = htole32(KVS_WIRE_HELLO_MAGIC),
		.version = htole16(KVS_WIRE_VERSION),
		.type = htole16(KVS_WIRE_HELLO),
		.role = htole32(a->role),
		.instance = htole64(a->instance),
	};
	memcpy(h.nonce, a->nonce, sizeof(h.nonce));
	memcpy(out, &h, sizeof(h));
	a->step = a->role == KVS_WIRE_DIALER ? KVSP_AUTH_RECV_HELLO : KVSP_AUTH_SEND_PROOF;
	return 0;
}

int kvsp_auth_on_hello(struct kvsp_auth *a, const void *in)
{
	struct kvs_wire_hello h;
	int r = due(a, KVSP_AUTH_RECV_HELLO);
	if (r < 0)
		return r;

	memcpy(&h, in, sizeof(h));
	r = check_head(a, h.magic, h.version, h.type, h.role, h.rsvd, KVS_WIRE_HELLO);
	if (r < 0)
		return fail(a, r);
	/* Our own nonce back is a reflection (an honest peer's is random):
	 * refused here rather than left to the labels alone. */
	if (sodium_memcmp(h.nonce, a->nonce, sizeof(h.nonce)) == 0)
		return fail(a, -EPROTO);
	/* A peer with our own instance is us. Were it let through, a man in
	 * the middle could join two of our connections, one we dialed and one
	 * he dialed to us, claiming our instance on both with our nonce from
	 * the first in the second: both transcripts would then be the same,
	 * each proof would verify on the other connection, and we would
	 * speak to ourselves thinking it a peer. Refusing our own instance
	 * makes the two transcripts differ. */
	a->peer_instance = le64toh(h.instance);
	if (a->peer_instance == a->instance)
		return fail(a, -ELOOP);
	memcpy(a->peer_nonce, h.nonce, sizeof(a->peer_nonce));
	a->step = a->role == KVS_WIRE_DIALER ? KVSP_AUTH_RECV_PROOF : KVSP_AUTH_SEND_HELLO;
	return 0;
}

int kvsp_auth_proof(struct kvsp_auth *a, void *out)
{
	int r = due(a, KVSP_AUTH_SEND_PROOF);
	if (r < 0)
		return r;

	struct kvs_wire_proof p = {
		.magic = htole32(KVS_WIRE_HELLO_MAGIC),
		.version = htole16(KVS_WIRE_VERSION),
		.type = htole16(KVS_WIRE_PROOF),
		.role = htole32(a->role),
	};
	proof_of(a, a->role, p.mac);
	memcpy(out, &p, sizeof(p));
	if (a->role == KVS_WIRE_DIALER)
		finish(a); /* the listener proved itself before we answered */
	else
		a->step = KVSP_AUTH_RECV_PROOF;
	return 0;
}

int kvsp_auth_on_proof(struct kvsp_auth *a, const void *in)
{
	struct kvs_wire_proof p;
	uint8_t want[crypto_auth_hmacsha256_BYTES];
	int r = due(a, KVSP_AUTH_RECV_PROOF);
	if (r < 0)
		return r;

	memcpy(&p, in, sizeof(p));
	r = check_head(a, p.magic, p.version, p.type, p.role, p.rsvd, KVS_WIRE_PROOF);
	if (r < 0)
		return fail(a, r);
	proof_of(a, peer_role(a), want);
	r = crypto_verify_32(want, p.mac);
	sodium_memzero(want, sizeof(want));
	if (r != 0)
		return fail(a, -EACCES);
	if (a->role == KVS_WIRE_LISTENER)
		finish(a);
	else
		a->step = KVSP_AUTH_SEND_PROOF;
	return 0;
}

int kvsp_auth_keys(struct kvsp_auth *a, struct kvsp_frame_keys *out)
{
	int r = due(a, KVSP_AUTH_DONE);
	if (r < 0)
		return r;
	if (!a->have_keys)
		return -EINVAL;
	memcpy(out, &a->keys, sizeof(*out));
	wipe_secrets(a);
	return 0;
}

uint64_t kvsp_auth_peer_instance(const struct kvsp_auth *a)
{
	return a->peer_instance;
}

void kvsp_auth_wipe(struct kvsp_auth *a)
{
	sodium_memzero(a, sizeof(*a));
	a->step = KVSP_AUTH_FAILED;
	a->err = -EPIPE;
}
