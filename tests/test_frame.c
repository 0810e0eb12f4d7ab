/* SPDX-License-Identifier: MIT */
/*
 * The wire between proxies, with no sockets: the secret file's checks, the
 * handshake (agreement, wrong secrets, replays, reflections, messages
 * changed on the way), frames through the decoder in every split (bit
 * flips, replays, reordering, truncation, garbage, sizes), CHUNK payloads
 * handed to the caller, and CRC32C against published vectors.
 */
#include <criterion/criterion.h>
#include <sys/stat.h>
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <sodium.h>

#include "crc.h"
#include "kvs_build.h"
#include "kvstage.h"
#include "peer/frame.h"
#include "peer/auth.h"

#if KVS_HAVE_ACL
#include <sys/acl.h>
#else
#include <sys/xattr.h>
#endif

#define SECRET_A "correct horse battery staple, 32"
#define SECRET_B "another deployment's secret, 32b"
#define INST_D 0x1111222233334444ull
#define INST_L 0x5555666677778888ull
#define MAXP 4096

static void setup(void)
{
	cr_assert_geq(sodium_init(), 0);
}

TestSuite(frame, .init = setup);

static struct kvsp_secret secret(const char *s)
{
	struct kvsp_secret k = { 0 };
	char why[256];
	int r = kvsp_secret_load(NULL, s, &k, why, sizeof(why));
	cr_assert_eq(r, 0, "secret from a value: %d (%s)", r, why);
	return k;
}

/* ------------------------------------------------------------ secret files */

static char dir[64];

static void mkdir_tmp(void)
{
	strcpy(dir, "/tmp/kvstage-frame.XXXXXX");
	cr_assert_not_null(mkdtemp(dir));
}

static void rm_tmp(void)
{
	char cmd[128];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
	cr_assert_eq(system(cmd), 0);
}

static const char *file_with(const char *name, const void *bytes, size_t n, mode_t mode)
{
	static char path[128];
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	cr_assert_geq(fd, 0);
	cr_assert_eq(write(fd, bytes, n), (ssize_t)n);
	cr_assert_eq(fchmod(fd, mode), 0);
	close(fd);
	return path;
}

static int load(const char *path, const char *env, struct kvsp_secret *k, char *why, size_t n)
{
	memset(why, 0, n);
	return kvsp_secret_load(path, env, k, why, n);
}

static bool same_key(const struct kvsp_secret *a, const struct kvsp_secret *b)
{
	return !memcmp(a->key, b->key, KVSP_KEY_SIZE);
}

Test(frame, secret_file_0600_loads_same_key_as_env, .init = mkdir_tmp, .fini = rm_tmp)
{
	struct kvsp_secret f = { 0 }, e = { 0 };
	char why[256];
	const char *p = file_with("s", SECRET_A, strlen(SECRET_A), 0600);

	cr_assert_eq(load(p, NULL, &f, why, sizeof(why)), 0, "%s", why);
	cr_assert_eq(load(NULL, SECRET_A, &e, why, sizeof(why)), 0, "%s", why);
	cr_assert(same_key(&f, &e), "the file and the variable give different keys");
	kvsp_secret_free(&f);
	cr_assert_null(f.key);
	kvsp_secret_free(&f); /* twice is harmless */

	/* 0400 is stricter: fine. The path wins over the variable. */
	p = file_with("s2", SECRET_B, strlen(SECRET_B), 0400);
	cr_assert_eq(load(p, SECRET_A, &f, why, sizeof(why)), 0, "%s", why);
	cr_assert(!same_key(&f, &e), "the variable was used although a path was named");
	kvsp_secret_free(&f);
	kvsp_secret_free(&e);
}

Test(frame, secret_file_mode_refused_with_reason, .init = mkdir_tmp, .fini = rm_tmp)
{
	static const struct {
		mode_t mode;
		const char *says;
	} cases[] = {
		{ 0644, "mode 0644 lets its group and others read it; chmod 600 it" },
		{ 0640, "mode 0640 lets its group read it" },
		{ 0604, "mode 0604 lets others read it" },
		{ 0620, "mode 0620 lets its group change it" },
		{ 0666, "lets its group and others read and change it" },
		{ 0601, "mode 0601 lets others run it" },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		struct kvsp_secret k = { 0 };
		char why[256];
		const char *p = file_with("s", SECRET_A, strlen(SECRET_A), cases[i].mode);
		cr_assert_eq(load(p, SECRET_A, &k, why, sizeof(why)), -EPERM, "mode %04o",
			     cases[i].mode);
		cr_assert_null(k.key, "a refused load left a key");
		cr_assert(strstr(why, p) && strstr(why, cases[i].says), "mode %04o: \"%s\"",
			  cases[i].mode, why);
	}
}

#if KVS_HAVE_ACL
/* A 0400 file given ACL entries: its mode then shows the mask as group
 * bits. Returns the path. */
static const char *file_with_acl(const char *entries)
{
	const char *p = file_with("acl", SECRET_A, strlen(SECRET_A), 0400);
	char text[256];
	snprintf(text, sizeof(text), "u::r,g::---,o::---,%s", entries);
	acl_t a = acl_from_text(text);
	cr_assert_not_null(a, "acl_from_text(%s)", text);
	cr_assert_eq(acl_calc_mask(&a), 0);
	cr_assert_eq(acl_set_file(p, ACL_TYPE_ACCESS, a), 0, "acl_set_file: %s (no ACLs on %s?)",
		     strerror(errno), dir);
	acl_free(a);
	return p;
}

/* systemd's LoadCredential= copy on a file system with ACLs: root's, 0400,
 * plus an entry for the service's user, so ls shows 0440. The entries are
 * what count: ours alone loads; anyone else's, or a group's, is refused. */
Test(frame, secret_file_acl_judged_by_its_entries, .init = mkdir_tmp, .fini = rm_tmp)
{
	struct kvsp_secret k = { 0 }, e = { 0 };
	char why[256], mine[64];
	snprintf(mine, sizeof(mine), "u:%u:r", (unsigned)geteuid());
	const char *p = file_with_acl(mine);
	struct stat st;
	cr_assert_eq(stat(p, &st), 0);
	cr_assert_eq(st.st_mode & 0777, 0440, "the mask shows as group bits: %04o",
		     st.st_mode & 0777);
	cr_assert_eq(load(p, NULL, &k, why, sizeof(why)), 0, "%s", why);
	cr_assert_eq(load(NULL, SECRET_A, &e, why, sizeof(why)), 0, "%s", why);
	cr_assert(same_key(&k, &e));
	kvsp_secret_free(&k);
	kvsp_secret_free(&e);

	static const struct {
		const char *entries, *says;
	} bad[] = {
		{ "u:65534:r", "its ACL lets uid 65534 in" },
		{ "g:65534:r", "its ACL lets a group in" },
		{ "u:65534:w", "its ACL lets uid 65534 in" },
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		p = file_with_acl(bad[i].entries);
		cr_assert_eq(load(p, NULL, &k, why, sizeof(why)), -EPERM, "%s loaded",
			     bad[i].entries);
		cr_assert_null(k.key);
		cr_assert(strstr(why, bad[i].says), "%s: \"%s\"", bad[i].entries, why);
	}
	/* Group bits that are the group's own (no ACL): still refused by mode. */
	p = file_with("plain", SECRET_A, strlen(SECRET_A), 0440);
	cr_assert_eq(load(p, NULL, &k, why, sizeof(why)), -EPERM);
	cr_assert(strstr(why, "mode 0440 lets its group read it"), "\"%s\"", why);
}
#else
/* A 0400 file given the ACL "u::r, u:UID:r, g::-, m::r, o::-" as the kernel
 * stores it (system.posix_acl_access; no libacl in this build): its mode
 * then shows the mask as group bits. Returns the path. */
static const char *file_with_acl_of(uid_t uid)
{
	const char *p = file_with("acl", SECRET_A, strlen(SECRET_A), 0400);
	struct {
		uint16_t tag, perm;
		uint32_t id;
	} entries[] = { { 0x01, 4, UINT32_MAX },
			{ 0x02, 4, uid },
			{ 0x04, 0, UINT32_MAX },
			{ 0x10, 4, UINT32_MAX },
			{ 0x20, 0, UINT32_MAX } };
	uint8_t x[4 + sizeof(entries)];
	uint32_t version = htole32(2);
	memcpy(x, &version, 4);
	for (size_t i = 0; i < sizeof(entries) / sizeof(entries[0]); i++) {
		uint16_t tag = htole16(entries[i].tag), perm = htole16(entries[i].perm);
		uint32_t id = htole32(entries[i].id);
		memcpy(x + 4 + 8 * i, &tag, 2);
		memcpy(x + 6 + 8 * i, &perm, 2);
		memcpy(x + 8 + 8 * i, &id, 4);
	}
	cr_assert_eq(setxattr(p, "system.posix_acl_access", x, sizeof(x), 0), 0,
		     "setxattr: %s (no ACLs on %s?)", strerror(errno), dir);
	return p;
}

/* A build without libacl cannot read an ACL's entries: even systemd's
 * LoadCredential= copy (our uid's entry only) is refused, saying why; and a
 * plain 0440 file is refused by its mode as always. */
Test(frame, secret_file_acl_refused_without_libacl, .init = mkdir_tmp, .fini = rm_tmp)
{
	struct kvsp_secret k = { 0 };
	char why[256];
	const char *p = file_with_acl_of(geteuid());
	struct stat st;
	cr_assert_eq(stat(p, &st), 0);
	cr_assert_eq(st.st_mode & 0777, 0440, "the mask shows as group bits: %04o",
		     st.st_mode & 0777);
	cr_assert_eq(load(p, NULL, &k, why, sizeof(why)), -EPERM,
		     "an ACL nobody judged was loaded");
	cr_assert_null(k.key);
	cr_assert(strstr(why, "this build cannot judge one (libacl1-dev missing at build time)"),
		  "\"%s\"", why);
	p = file_with("plain", SECRET_A, strlen(SECRET_A), 0440);
	cr_assert_eq(load(p, NULL, &k, why, sizeof(why)), -EPERM);
	cr_assert(strstr(why, "mode 0440 lets its group read it"), "\"%s\"", why);
}
#endif

Test(frame, secret_symlink_dir_fifo_missing_refused, .init = mkdir_tmp, .fini = rm_tmp)
{
	struct kvsp_secret k = { 0 };
	char why[256], link[128], fifo[128];
	const char *p = file_with("real", SECRET_A, strlen(SECRET_A), 0600);

	snprintf(link, sizeof(link), "%s/link", dir);
	cr_assert_eq(symlink(p, link), 0);
	cr_assert_eq(load(link, NULL, &k, why, sizeof(why)), -ELOOP);
	cr_assert(strstr(why, link) && strstr(why, "symbolic link"), "\"%s\"", why);

	cr_assert_eq(load(dir, NULL, &k, why, sizeof(why)), -EINVAL);
	cr_assert(strstr(why, "not a regular file"), "\"%s\"", why);

	/* Opening a FIFO must not wait for a writer. */
	snprintf(fifo, sizeof(fifo), "%s/fifo", dir);
	cr_assert_eq(mkfifo(fifo, 0600), 0);
	cr_assert_eq(load(fifo, NULL, &k, why, sizeof(why)), -EINVAL);

	snprintf(fifo, sizeof(fifo), "%s/none", dir);
	cr_assert_eq(load(fifo, NULL, &k, why, sizeof(why)), -ENOENT);
	cr_assert(strstr(why, fifo) && strstr(why, "No such file"), "\"%s\"", why);
	cr_assert_null(k.key);
}

Test(frame, secret_owner_checked, .init = mkdir_tmp, .fini = rm_tmp)
{
	struct kvsp_secret k = { 0 };
	char why[256];
	const char *p = file_with("s", SECRET_A, strlen(SECRET_A), 0600);

	if (geteuid() != 0) {
		cr_log_warn(
			"not root: cannot give a file to another uid; owner check not exercised");
		return;
	}
	cr_assert_eq(chown(p, 65534, 65534), 0);
	cr_assert_eq(load(p, NULL, &k, why, sizeof(why)), -EPERM);
	cr_assert(strstr(why, "owned by uid 65534"), "\"%s\"", why);
	cr_assert_null(k.key);
}

Test(frame, secret_length_and_newline, .init = mkdir_tmp, .fini = rm_tmp)
{
	struct kvsp_secret k = { 0 }, ref = { 0 }, two = { 0 };
	char why[256];
	char big[KVSP_SECRET_MAX + 2];

	/* One "\n" or "\r\n" goes; the key is the one without it. */
	cr_assert_eq(load(NULL, SECRET_A, &ref, why, sizeof(why)), 0);
	const char *p = file_with("nl", SECRET_A "\n", strlen(SECRET_A) + 1, 0600);
	cr_assert_eq(load(p, NULL, &k, why, sizeof(why)), 0, "%s", why);
	cr_assert(same_key(&k, &ref), "trailing newline not stripped");
	kvsp_secret_free(&k);
	p = file_with("crlf", SECRET_A "\r\n", strlen(SECRET_A) + 2, 0600);
	cr_assert_eq(load(p, NULL, &k, why, sizeof(why)), 0, "%s", why);
	cr_assert(same_key(&k, &ref), "trailing CRLF not stripped");
	kvsp_secret_free(&k);
	cr_assert_eq(load(NULL, SECRET_A "\n", &k, why, sizeof(why)), 0);
	cr_assert(same_key(&k, &ref), "the variable's newline not stripped");
	kvsp_secret_free(&k);
	/* Only one: a second newline is the secret's. */
	p = file_with("nn", SECRET_A "\n\n", strlen(SECRET_A) + 2, 0600);
	cr_assert_eq(load(p, NULL, &k, why, sizeof(why)), 0, "%s", why);
	cr_assert_eq(load(NULL, SECRET_A "\n\n", &two, why, sizeof(why)), 0);
	cr_assert(!same_key(&k, &ref), "more than one newline stripped");
	cr_assert(same_key(&k, &two), "a file and a variable strip differently");
	kvsp_secret_free(&k);
	kvsp_secret_free(&two);

	/* 15 bytes (16 with the newline) is too short, in a file or a variable. */
	p = file_with("short", "fifteen bytes!!\n", 16, 0600);
	cr_assert_eq(load(p, NULL, &k, why, sizeof(why)), -EINVAL);
	cr_assert(strstr(why, p) && strstr(why, "15 bytes") && strstr(why, "at least 16"), "\"%s\"",
		  why);
	cr_assert_eq(load(NULL, "fifteen bytes!!", &k, why, sizeof(why)), -EINVAL);
	cr_assert(strstr(why, "$KVSTAGE_PEER_SECRET"), "\"%s\"", why);
	cr_assert_eq(load(NULL, "", &k, why, sizeof(why)), -EINVAL);
	p = file_with("empty", "", 0, 0600);
	cr_assert_eq(load(p, NULL, &k, why, sizeof(why)), -EINVAL);
	cr_assert_eq(load(NULL, "sixteen bytes!!!", &k, why, sizeof(why)), 0, "16 bytes refused");
	kvsp_secret_free(&k);

	/* The longest, and one more. */
	memset(big, 'x', sizeof(big));
	big[KVSP_SECRET_MAX] = '\n';
	p = file_with("max", big, KVSP_SECRET_MAX + 1, 0600);
	cr_assert_eq(load(p, NULL, &k, why, sizeof(why)), 0, "%s", why);
	kvsp_secret_free(&k);
	p = file_with("big", big, KVSP_SECRET_MAX + 2, 0600); /* "x"*4096 "\n" "x" */
	cr_assert_eq(load(p, NULL, &k, why, sizeof(why)), -EINVAL);
	cr_assert(strstr(why, "longer than 4096"), "\"%s\"", why);
	big[KVSP_SECRET_MAX + 1] = '\0';
	big[KVSP_SECRET_MAX] = 'x';
	cr_assert_eq(load(NULL, big, &k, why, sizeof(why)), -EINVAL);
	cr_assert_null(k.key);

	/* Nothing named at all. */
	cr_assert_eq(load(NULL, NULL, &k, why, sizeof(why)), -ENOKEY);
	cr_assert(strstr(why, "KVSTAGE_PEER_SECRET"), "\"%s\"", why);
	/* No room for a reason is fine. */
	cr_assert_eq(kvsp_secret_load(NULL, "short", &k, NULL, 0), -EINVAL);
	kvsp_secret_free(&ref);
}

static void on_segv(int sig)
{
	(void)sig;
	_exit(77);
}

Test(frame, secret_key_is_read_only)
{
	struct kvsp_secret k = secret(SECRET_A);
	/* The key's page is read-only: a stray write must fault, not change it. */
	pid_t pid = fork();
	cr_assert_geq(pid, 0);
	if (pid == 0) {
		signal(SIGSEGV, on_segv);
		((volatile uint8_t *)k.key)[0] ^= 1;
		_exit(0);
	}
	int st;
	cr_assert_eq(waitpid(pid, &st, 0), pid);
	/* 77: on_segv ran (ASan lets a handler of ours take SIGSEGV). */
	cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 77, "a write to the key did not fault");
	kvsp_secret_free(&k);
}

/* --------------------------------------------------------------- handshake */

struct msgs {
	uint8_t hello_d[KVS_WIRE_HELLO_SIZE], hello_l[KVS_WIRE_HELLO_SIZE];
	uint8_t proof_l[KVS_WIRE_PROOF_SIZE], proof_d[KVS_WIRE_PROOF_SIZE];
};

/* Flips bit `bit` of the flat byte view of m before it is delivered, when bit >= 0. */
static void flip(struct msgs *m, long bit, const uint8_t *msg, size_t len)
{
	long off = (long)(msg - (const uint8_t *)m);
	if (bit >= off * 8 && bit < (off + (long)len) * 8)
		((uint8_t *)m)[bit / 8] ^= (uint8_t)(1u << (bit % 8));
}

/* Runs one handshake between d and l, delivering each message as sent
 * (flipping bit `bit` of struct msgs on the way, if >= 0). Returns 0 once
 * both are done, or the first refusal; *who says which side refused. */
static int run_handshake(struct kvsp_auth *d, struct kvsp_auth *l, struct msgs *m, long bit,
			 char *who)
{
	int r;
	*who = '-';
	cr_assert_eq(kvsp_auth_next(d), KVSP_AUTH_SEND_HELLO);
	cr_assert_eq(kvsp_auth_next(l), KVSP_AUTH_RECV_HELLO);
	cr_assert_eq(kvsp_auth_hello(d, m->hello_d), 0);
	flip(m, bit, m->hello_d, sizeof(m->hello_d));
	*who = 'l';
	if ((r = kvsp_auth_on_hello(l, m->hello_d)) < 0)
		return r;
	cr_assert_eq(kvsp_auth_next(l), KVSP_AUTH_SEND_HELLO);
	cr_assert_eq(kvsp_auth_hello(l, m->hello_l), 0);
	cr_assert_eq(kvsp_auth_next(l), KVSP_AUTH_SEND_PROOF);
	cr_assert_eq(kvsp_auth_proof(l, m->proof_l), 0);
	cr_assert_eq(kvsp_auth_next(l), KVSP_AUTH_RECV_PROOF);
	flip(m, bit, m->hello_l, sizeof(m->hello_l));
	flip(m, bit, m->proof_l, sizeof(m->proof_l));
	*who = 'd';
	if ((r = kvsp_auth_on_hello(d, m->hello_l)) < 0)
		return r;
	cr_assert_eq(kvsp_auth_next(d), KVSP_AUTH_RECV_PROOF);
	if ((r = kvsp_auth_on_proof(d, m->proof_l)) < 0)
		return r;
	cr_assert_eq(kvsp_auth_next(d), KVSP_AUTH_SEND_PROOF);
	cr_assert_eq(kvsp_auth_proof(d, m->proof_d), 0);
	cr_assert_eq(kvsp_auth_next(d), KVSP_AUTH_DONE);
	flip(m, bit, m->proof_d, sizeof(m->proof_d));
	*who = 'l';
	if ((r = kvsp_auth_on_proof(l, m->proof_d)) < 0)
		return r;
	cr_assert_eq(kvsp_auth_next(l), KVSP_AUTH_DONE);
	*who = '-';
	return 0;
}

static void start_pair(struct kvsp_auth *d, struct kvsp_auth *l, const struct kvsp_secret *sd,
		       const struct kvsp_secret *sl)
{
	cr_assert_eq(kvsp_auth_start(d, sd, KVS_WIRE_DIALER, INST_D), 0);
	cr_assert_eq(kvsp_auth_start(l, sl, KVS_WIRE_LISTENER, INST_L), 0);
}

static bool all_zero(const void *p, size_t n)
{
	const uint8_t *b = p;
	for (size_t i = 0; i < n; i++)
		if (b[i])
			return false;
	return true;
}

/* Frames sealed with one side's tx key verify with the other's rx key, both ways. */
static void assert_keys_talk(const struct kvsp_frame_keys *a, const struct kvsp_frame_keys *b)
{
	for (int dir = 0; dir < 2; dir++) {
		const struct kvsp_frame_keys *s = dir ? b : a, *r = dir ? a : b;
		struct kvsp_frame_tx tx;
		struct kvsp_frame_rx rx;
		struct kvsp_frame f;
		uint8_t out[KVS_WIRE_FRAME_MAX];
		struct kvs_wire_ping ping = { .value = htole64(42 + (unsigned)dir) };
		size_t used;
		kvsp_frame_tx_init(&tx, s->tx);
		kvsp_frame_rx_init(&rx, r->rx, MAXP);
		int n = kvsp_frame_seal(&tx, KVS_WIRE_PING, &ping, 0, out);
		cr_assert_eq(kvsp_frame_rx_feed(&rx, out, (size_t)n, &used, &f), 1);
		cr_assert_eq(le64toh(f.body.ping.value), 42u + (unsigned)dir);
	}
}

Test(frame, handshake_agrees)
{
	struct kvsp_secret s = secret(SECRET_A);
	struct kvsp_auth d, l;
	struct kvsp_frame_keys kd, kl;
	struct msgs m;
	char who;

	start_pair(&d, &l, &s, &s);
	cr_assert_eq(kvsp_auth_peer_instance(&d), 0);
	cr_assert_eq(run_handshake(&d, &l, &m, -1, &who), 0);
	cr_assert_eq(kvsp_auth_peer_instance(&d), INST_L);
	cr_assert_eq(kvsp_auth_peer_instance(&l), INST_D);
	cr_assert_eq(kvsp_auth_keys(&d, &kd), 0);
	cr_assert_eq(kvsp_auth_keys(&l, &kl), 0);
	cr_assert(!memcmp(kd.tx, kl.rx, KVSP_KEY_SIZE), "dialer's tx is not the listener's rx");
	cr_assert(!memcmp(kd.rx, kl.tx, KVSP_KEY_SIZE), "dialer's rx is not the listener's tx");
	cr_assert(memcmp(kd.tx, kd.rx, KVSP_KEY_SIZE), "both directions share a key");
	cr_assert(!all_zero(kd.tx, KVSP_KEY_SIZE) && !all_zero(kd.rx, KVSP_KEY_SIZE));
	/* Keys are taken once; nonces and keys are gone from the state. */
	cr_assert_eq(kvsp_auth_keys(&d, &kd), -EINVAL);
	cr_assert(all_zero(d.nonce, 32) && all_zero(d.peer_nonce, 32) &&
		  all_zero(&d.keys, sizeof(d.keys)));
	cr_assert(all_zero(l.nonce, 32) && all_zero(l.peer_nonce, 32) &&
		  all_zero(&l.keys, sizeof(l.keys)));
	cr_assert_null(d.secret);
	assert_keys_talk(&kd, &kl);

	/* A second connection: fresh nonces, other keys. */
	struct kvsp_frame_keys kd2, kl2;
	start_pair(&d, &l, &s, &s);
	cr_assert_eq(run_handshake(&d, &l, &m, -1, &who), 0);
	cr_assert_eq(kvsp_auth_keys(&d, &kd2), 0);
	cr_assert_eq(kvsp_auth_keys(&l, &kl2), 0);
	cr_assert(memcmp(kd.tx, kd2.tx, KVSP_KEY_SIZE) && memcmp(kd.rx, kd2.rx, KVSP_KEY_SIZE),
		  "two connections got the same keys");
	kvsp_auth_wipe(&d);
	cr_assert_eq(kvsp_auth_next(&d), KVSP_AUTH_FAILED);
	cr_assert_eq(kvsp_auth_hello(&d, m.hello_d), -EPIPE);
	kvsp_secret_free(&s);
}

Test(frame, wrong_secret_refused_by_dialer)
{
	struct kvsp_secret a = secret(SECRET_A), b = secret(SECRET_B);
	struct kvsp_auth d, l;
	struct msgs m;
	char who;

	start_pair(&d, &l, &a, &b);
	cr_assert_eq(run_handshake(&d, &l, &m, -1, &who), -EACCES);
	cr_assert_eq(who, 'd', "the listener's proof was not the first refused");
	cr_assert_eq(kvsp_auth_next(&d), KVSP_AUTH_FAILED);
	/* Failure sticks, and a failed side has no keys. */
	struct kvsp_frame_keys k;
	cr_assert_eq(kvsp_auth_proof(&d, m.proof_d), -EACCES);
	cr_assert_eq(kvsp_auth_keys(&d, &k), -EACCES);
	cr_assert(all_zero(d.nonce, 32) && all_zero(d.peer_nonce, 32));
	kvsp_secret_free(&a);
	kvsp_secret_free(&b);
}

Test(frame, wrong_secret_refused_by_listener)
{
	/* A dialer with another secret that gets past its own check: it is
	 * shown a listener proof under its secret over the real listener's
	 * nonce (a second listener with that nonce, made by hand), answers
	 * with its proof, and the real listener must refuse that. */
	struct kvsp_secret a = secret(SECRET_A), b = secret(SECRET_B);
	struct kvsp_auth d, l, fake;
	struct msgs m;
	uint8_t fake_hello[KVS_WIRE_HELLO_SIZE], fake_proof[KVS_WIRE_PROOF_SIZE];

	cr_assert_eq(kvsp_auth_start(&d, &b, KVS_WIRE_DIALER, INST_D), 0);
	cr_assert_eq(kvsp_auth_start(&l, &a, KVS_WIRE_LISTENER, INST_L), 0);
	cr_assert_eq(kvsp_auth_start(&fake, &b, KVS_WIRE_LISTENER, INST_L), 0);
	memcpy(fake.nonce, l.nonce, 32);

	cr_assert_eq(kvsp_auth_hello(&d, m.hello_d), 0);
	cr_assert_eq(kvsp_auth_on_hello(&l, m.hello_d), 0);
	cr_assert_eq(kvsp_auth_on_hello(&fake, m.hello_d), 0);
	cr_assert_eq(kvsp_auth_hello(&l, m.hello_l), 0);
	cr_assert_eq(kvsp_auth_proof(&l, m.proof_l), 0);
	cr_assert_eq(kvsp_auth_hello(&fake, fake_hello), 0);
	cr_assert_eq(kvsp_auth_proof(&fake, fake_proof), 0);
	cr_assert(!memcmp(fake_hello, m.hello_l, sizeof(fake_hello)), "the fake's hello differs");
	cr_assert(memcmp(fake_proof, m.proof_l, sizeof(fake_proof)), "two secrets, one proof");

	cr_assert_eq(kvsp_auth_on_hello(&d, m.hello_l), 0);
	cr_assert_eq(kvsp_auth_on_proof(&d, m.proof_l), -EACCES, "the real proof passed under b");
	cr_assert_eq(kvsp_auth_start(&d, &b, KVS_WIRE_DIALER, INST_D), 0);
	/* Again, the dialer with the same nonce as before, fed the fake's proof. */
	struct kvs_wire_hello hd;
	memcpy(&hd, m.hello_d, sizeof(hd));
	memcpy(d.nonce, hd.nonce, 32);
	cr_assert_eq(kvsp_auth_hello(&d, m.hello_d), 0);
	cr_assert_eq(kvsp_auth_on_hello(&d, m.hello_l), 0);
	cr_assert_eq(kvsp_auth_on_proof(&d, fake_proof), 0);
	cr_assert_eq(kvsp_auth_proof(&d, m.proof_d), 0);
	cr_assert_eq(kvsp_auth_on_proof(&l, m.proof_d), -EACCES);
	cr_assert_eq(kvsp_auth_next(&l), KVSP_AUTH_FAILED);
	kvsp_auth_wipe(&fake);
	kvsp_secret_free(&a);
	kvsp_secret_free(&b);
}

Test(frame, replayed_handshake_refused)
{
	struct kvsp_secret s = secret(SECRET_A);
	struct kvsp_auth d, l;
	struct msgs rec, m;
	char who;

	start_pair(&d, &l, &s, &s);
	cr_assert_eq(run_handshake(&d, &l, &rec, -1, &who), 0);

	/* The dialer's messages played to a fresh listener. */
	cr_assert_eq(kvsp_auth_start(&l, &s, KVS_WIRE_LISTENER, INST_L), 0);
	cr_assert_eq(kvsp_auth_on_hello(&l, rec.hello_d), 0);
	cr_assert_eq(kvsp_auth_hello(&l, m.hello_l), 0);
	cr_assert_eq(kvsp_auth_proof(&l, m.proof_l), 0);
	cr_assert_eq(kvsp_auth_on_proof(&l, rec.proof_d), -EACCES);

	/* The listener's messages played to a fresh dialer. */
	cr_assert_eq(kvsp_auth_start(&d, &s, KVS_WIRE_DIALER, INST_D), 0);
	cr_assert_eq(kvsp_auth_hello(&d, m.hello_d), 0);
	cr_assert_eq(kvsp_auth_on_hello(&d, rec.hello_l), 0);
	cr_assert_eq(kvsp_auth_on_proof(&d, rec.proof_l), -EACCES);
	kvsp_secret_free(&s);
}

static void set_role(uint8_t *msg, uint32_t role)
{
	uint32_t r = htole32(role);
	memcpy(msg + offsetof(struct kvs_wire_hello, role), &r, 4); /* same offset in a proof */
}

Test(frame, reflected_proof_refused)
{
	struct kvsp_secret s = secret(SECRET_A);
	struct kvsp_auth d, l;
	struct msgs m;
	uint8_t p[KVS_WIRE_PROOF_SIZE];

	/* The listener's proof sent back to it: its role says listener. */
	start_pair(&d, &l, &s, &s);
	cr_assert_eq(kvsp_auth_hello(&d, m.hello_d), 0);
	cr_assert_eq(kvsp_auth_on_hello(&l, m.hello_d), 0);
	cr_assert_eq(kvsp_auth_hello(&l, m.hello_l), 0);
	cr_assert_eq(kvsp_auth_proof(&l, m.proof_l), 0);
	memcpy(p, m.proof_l, sizeof(p));
	cr_assert_eq(kvsp_auth_on_proof(&l, p), -EPROTO);
	/* With its role rewritten, the label still gives it away. */
	cr_assert_eq(kvsp_auth_start(&l, &s, KVS_WIRE_LISTENER, INST_L), 0);
	cr_assert_eq(kvsp_auth_on_hello(&l, m.hello_d), 0);
	cr_assert_eq(kvsp_auth_hello(&l, m.hello_l), 0);
	cr_assert_eq(kvsp_auth_proof(&l, m.proof_l), 0);
	memcpy(p, m.proof_l, sizeof(p));
	set_role(p, KVS_WIRE_DIALER);
	cr_assert_eq(kvsp_auth_on_proof(&l, p), -EACCES);

	/* The dialer's own HELLO sent back to it, as is and as a listener's. */
	cr_assert_eq(kvsp_auth_start(&d, &s, KVS_WIRE_DIALER, INST_D), 0);
	cr_assert_eq(kvsp_auth_hello(&d, m.hello_d), 0);
	cr_assert_eq(kvsp_auth_on_hello(&d, m.hello_d), -EPROTO);
	cr_assert_eq(kvsp_auth_start(&d, &s, KVS_WIRE_DIALER, INST_D), 0);
	cr_assert_eq(kvsp_auth_hello(&d, m.hello_d), 0);
	set_role(m.hello_d, KVS_WIRE_LISTENER);
	cr_assert_eq(kvsp_auth_on_hello(&d, m.hello_d), -EPROTO, "our own nonce was taken");
	kvsp_secret_free(&s);
}

Test(frame, two_connections_of_one_proxy_not_joined)
{
	/* P dials M; M dials P. M tells P, on each, that it is P (P's instance)
	 * and hands P's dialer nonce to P's listener: without the instance
	 * check both transcripts are one and each proof passes on the other
	 * connection. */
	struct kvsp_secret s = secret(SECRET_A);
	struct kvsp_auth pd, pl;
	uint8_t hd[KVS_WIRE_HELLO_SIZE], hl[KVS_WIRE_HELLO_SIZE];
	struct kvs_wire_hello h;

	cr_assert_eq(kvsp_auth_start(&pd, &s, KVS_WIRE_DIALER, INST_D), 0);
	cr_assert_eq(kvsp_auth_start(&pl, &s, KVS_WIRE_LISTENER, INST_D), 0);
	cr_assert_eq(kvsp_auth_hello(&pd, hd), 0);
	/* M's HELLO to P's listener: role dialer, P's instance, P's nonce. */
	cr_assert_eq(kvsp_auth_on_hello(&pl, hd), -ELOOP);

	/* And the other way: P's dialer hears P's own listener's HELLO. */
	cr_assert_eq(kvsp_auth_start(&pl, &s, KVS_WIRE_LISTENER, INST_D), 0);
	memcpy(&h, hd, sizeof(h));
	h.instance = htole64(INST_L);
	memcpy(hl, &h, sizeof(h));
	cr_assert_eq(kvsp_auth_on_hello(&pl, hl), 0);
	cr_assert_eq(kvsp_auth_hello(&pl, hl), 0);
	cr_assert_eq(kvsp_auth_on_hello(&pd, hl), -ELOOP);
	kvsp_secret_free(&s);
}

Test(frame, malformed_handshake_messages)
{
	struct kvsp_secret s = secret(SECRET_A);
	struct kvsp_auth d, l;
	struct msgs m;
	struct kvs_wire_hello h;

	start_pair(&d, &l, &s, &s);
	/* Out of turn: the caller's mistake, not fatal. */
	cr_assert_eq(kvsp_auth_on_proof(&l, m.proof_d), -EINVAL);
	cr_assert_eq(kvsp_auth_proof(&l, m.proof_l), -EINVAL);
	cr_assert_eq(kvsp_auth_hello(&l, m.hello_l), -EINVAL);
	cr_assert_eq(kvsp_auth_keys(&l, &(struct kvsp_frame_keys){ 0 }), -EINVAL);
	cr_assert_eq(kvsp_auth_on_hello(&d, m.hello_l), -EINVAL);
	cr_assert_eq(kvsp_auth_next(&l), KVSP_AUTH_RECV_HELLO);
	cr_assert_eq(kvsp_auth_hello(&d, m.hello_d), 0);

	static const struct {
		size_t off;
		uint32_t val;
		int size, err;
	} bad[] = {
		{ offsetof(struct kvs_wire_hello, magic), 0x12345678, 4, -EPROTO },
		{ offsetof(struct kvs_wire_hello, version), KVS_WIRE_VERSION + 1, 2,
		  -EPROTONOSUPPORT },
		{ offsetof(struct kvs_wire_hello, version), KVS_WIRE_VERSION - 1, 2,
		  -EPROTONOSUPPORT },
		{ offsetof(struct kvs_wire_hello, type), KVS_WIRE_PROOF, 2, -EPROTO },
		{ offsetof(struct kvs_wire_hello, role), KVS_WIRE_LISTENER, 4, -EPROTO },
		{ offsetof(struct kvs_wire_hello, role), 0, 4, -EPROTO },
		{ offsetof(struct kvs_wire_hello, rsvd), 1, 4, -EPROTO },
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		uint8_t msg[KVS_WIRE_HELLO_SIZE];
		memcpy(msg, m.hello_d, sizeof(msg));
		if (bad[i].size == 4) {
			uint32_t v = htole32(bad[i].val);
			memcpy(msg + bad[i].off, &v, 4);
		} else {
			uint16_t v = htole16((uint16_t)bad[i].val);
			memcpy(msg + bad[i].off, &v, 2);
		}
		cr_assert_eq(kvsp_auth_start(&l, &s, KVS_WIRE_LISTENER, INST_L), 0);
		cr_assert_eq(kvsp_auth_on_hello(&l, msg), bad[i].err, "case %zu", i);
		cr_assert_eq(kvsp_auth_next(&l), KVSP_AUTH_FAILED);
		cr_assert_eq(kvsp_auth_hello(&l, m.hello_l), bad[i].err, "failure did not stick");
	}
	/* A proof where a hello is due, and the other way. */
	cr_assert_eq(kvsp_auth_start(&l, &s, KVS_WIRE_LISTENER, INST_L), 0);
	uint8_t big[KVS_WIRE_HELLO_SIZE] = { 0 };
	struct kvs_wire_proof p = { .magic = htole32(KVS_WIRE_HELLO_MAGIC),
				    .version = htole16(KVS_WIRE_VERSION),
				    .type = htole16(KVS_WIRE_PROOF),
				    .role = htole32(KVS_WIRE_DIALER) };
	memcpy(big, &p, sizeof(p));
	cr_assert_eq(kvsp_auth_on_hello(&l, big), -EPROTO);
	cr_assert_eq(kvsp_auth_start(&l, &s, KVS_WIRE_LISTENER, INST_L), 0);
	cr_assert_eq(kvsp_auth_on_hello(&l, m.hello_d), 0);
	cr_assert_eq(kvsp_auth_hello(&l, m.hello_l), 0);
	cr_assert_eq(kvsp_auth_proof(&l, m.proof_l), 0);
	memcpy(&h, m.hello_d, sizeof(h)); /* a hello's first 48 bytes where the proof is due */
	cr_assert_eq(kvsp_auth_on_proof(&l, &h), -EPROTO);

	/* Bad arguments to start. */
	cr_assert_eq(kvsp_auth_start(&l, &s, 3, INST_L), -EINVAL);
	cr_assert_eq(kvsp_auth_start(&l, &(struct kvsp_secret){ 0 }, KVS_WIRE_DIALER, 1), -EINVAL);
	cr_assert_eq(kvsp_auth_start(&l, NULL, KVS_WIRE_DIALER, 1), -EINVAL);
	kvsp_secret_free(&s);
}

Test(frame, every_changed_bit_fails_the_handshake)
{
	struct kvsp_secret s = secret(SECRET_A);
	struct kvsp_auth d, l;
	struct msgs m;
	char who;
	long bits = (long)sizeof(struct msgs) * 8;

	static_assert(sizeof(struct msgs) == 2 * KVS_WIRE_HELLO_SIZE + 2 * KVS_WIRE_PROOF_SIZE,
		      "no padding in struct msgs");
	for (long bit = 0; bit < bits; bit++) {
		start_pair(&d, &l, &s, &s);
		int r = run_handshake(&d, &l, &m, bit, &who);
		cr_assert_lt(r, 0, "bit %ld changed, handshake still done", bit);
		cr_assert_neq(kvsp_auth_next(&l), KVSP_AUTH_DONE, "bit %ld: listener done", bit);
		/* Only a change to the dialer's last proof leaves the dialer done
		 * (it cannot know); the listener refuses that one. */
		bool last = bit >= (long)offsetof(struct msgs, proof_d) * 8;
		cr_assert_eq(kvsp_auth_next(&d) == KVSP_AUTH_DONE, last, "bit %ld", bit);
		cr_assert(r == -EACCES || r == -EPROTO || r == -EPROTONOSUPPORT || r == -ELOOP,
			  "bit %ld: %d", bit, r);
	}
	kvsp_secret_free(&s);
}

/* ------------------------------------------------------------------ frames */

static const uint8_t KEY[KVSP_KEY_SIZE] = "0123456789abcdef0123456789abcdef";
static const uint8_t KEY2[KVSP_KEY_SIZE] = "fedcba9876543210fedcba9876543210";

/* One sealed frame of each type, with payload for CHUNK. */
struct sealed {
	uint8_t bytes[KVS_WIRE_FRAME_MAX + 64];
	size_t n;      /* header + body */
	uint32_t plen; /* payload bytes after them, in bytes[n..] */
	uint16_t type;
	union kvs_wire_body body;
};

static struct kvs_wire_room room_of(uint32_t i)
{
	struct kvs_wire_room r = { .room = htole32(i), .gen = htole32(i * 7 + 1) };
	for (int k = 0; k < 16; k++)
		r.token[k] = (uint8_t)(i * 31 + (unsigned)k);
	return r;
}

static union kvs_wire_body body_of(uint16_t type, uint32_t i, uint32_t plen)
{
	union kvs_wire_body b;
	memset(&b, 0, sizeof(b));
	switch (type) {
	case KVS_WIRE_OPEN:
		b.open = (struct kvs_wire_open){ room_of(i), htole64(1000 + i), htole64(MAXP),
						 htole64(0xabc0 + i) };
		break;
	case KVS_WIRE_OPEN_ACK:
		b.open_ack = (struct kvs_wire_open_ack){ room_of(i), htole64(0xabc0 + i),
							 (int32_t)htole32((uint32_t)-ESTALE), 0 };
		break;
	case KVS_WIRE_CHUNK:
		b.chunk = (struct kvs_wire_chunk){ room_of(i),		htole32(i), htole32(plen),
						   htole64(0xdef0 + i), 0,	    0 };
		break;
	case KVS_WIRE_CHUNK_ACK:
		b.chunk_ack = (struct kvs_wire_chunk_ack){ room_of(i), htole32(i), 0, htole64(i) };
		break;
	case KVS_WIRE_ABORT:
		b.abort = (struct kvs_wire_abort){ room_of(i),
						   (int32_t)htole32((uint32_t)-ECANCELED), 0,
						   htole64(i) };
		break;
	case KVS_WIRE_DONE:
		b.done = (struct kvs_wire_done){ room_of(i), htole64(i) };
		break;
	case KVS_WIRE_PING:
	case KVS_WIRE_PONG:
		b.ping.value = htole64(0x1234567800000000ull + i);
		break;
	case KVS_WIRE_BYE:
		b.bye.reason = htole32(KVS_WIRE_BYE_DRAIN);
		break;
	}
	return b;
}

static void seal(struct kvsp_frame_tx *tx, uint16_t type, uint32_t i, uint32_t plen,
		 struct sealed *s)
{
	s->type = type;
	s->plen = type == KVS_WIRE_CHUNK ? plen : 0;
	s->body = body_of(type, i, s->plen);
	if (type == KVS_WIRE_CHUNK) {
		uint8_t *pay = s->bytes + sizeof(struct kvs_wire_frame_hdr) + sizeof(s->body.chunk);
		for (uint32_t k = 0; k < s->plen; k++)
			pay[k] = (uint8_t)(i + k * 13);
		s->body.chunk.crc32c = htole32(kvsp_crc32c(pay, s->plen, 0));
		s->body.chunk.flags = htole32(KVS_WIRE_CHUNK_CRC);
	}
	int n = kvsp_frame_seal(tx, type, &s->body, s->plen, s->bytes);
	cr_assert_eq(n, (int)(sizeof(struct kvs_wire_frame_hdr) + kvsp_frame_body_size(type)),
		     "seal type %u: %d", type, n);
	s->n = (size_t)n;
}

static void assert_frame_is(const struct kvsp_frame *f, const struct sealed *s, uint64_t seq)
{
	cr_assert_eq(f->type, s->type);
	cr_assert_eq(f->seq, seq);
	cr_assert_eq(f->plen, s->plen);
	uint32_t len = kvsp_frame_body_size(s->type);
	cr_assert(!memcmp(&f->body, &s->body, len), "type %u: body differs", s->type);
	cr_assert(all_zero(f->body.bytes + len, sizeof(f->body) - len), "bytes past the body");
}

static uint64_t rng = 88172645463325252ull;
static uint64_t xorshift(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return rng;
}

/* A stream of n frames, every type in turn, CHUNKs with payloads up to maxp bytes. */
static size_t stream_of(struct sealed *s, size_t n, uint32_t maxp, uint8_t *out)
{
	struct kvsp_frame_tx tx;
	size_t len = 0;
	kvsp_frame_tx_init(&tx, KEY);
	for (size_t i = 0; i < n; i++) {
		uint16_t type = (uint16_t)(1 + i % (KVS_WIRE_NTYPES - 1));
		seal(&tx, type, (uint32_t)i, (uint32_t)(xorshift() % (maxp + 1)), &s[i]);
		memcpy(out + len, s[i].bytes, s[i].n + s[i].plen);
		len += s[i].n + s[i].plen;
	}
	cr_assert_eq(tx.seq, n);
	kvsp_frame_tx_wipe(&tx);
	return len;
}

/* Feeds the stream in pieces of split() bytes, through feed() or want()/wrote()
 * in turn, takes each CHUNK's payload in pieces, and checks every frame. */
static void decode_all(const uint8_t *in, size_t len, const struct sealed *s, size_t n,
		       size_t (*split)(void))
{
	struct kvsp_frame_rx rx;
	struct kvsp_frame f;
	size_t pos = 0, got = 0;
	uint8_t payload[64];

	kvsp_frame_rx_init(&rx, KEY, 64);
	while (pos < len) {
		size_t k = split();
		if (k > len - pos)
			k = len - pos;
		int r;
		size_t used;
		if (kvsp_frame_rx_owed(&rx)) {
			cr_assert_eq(kvsp_frame_rx_feed(&rx, in + pos, k, &used, &f), -EBUSY);
			cr_assert_eq(used, 0);
			void *at;
			cr_assert_eq(kvsp_frame_rx_want(&rx, &at), 0);
			/* Half the time, the bytes past the tail go where the next
			 * frame's will be wanted, in the same piece (as one recvmsg). */
			void *next = NULL;
			size_t owed = kvsp_frame_rx_owed(&rx), more = 0;
			if (k > owed && xorshift() & 1) {
				more = kvsp_frame_rx_want_next(&rx, &next);
				cr_assert_eq(more, sizeof(struct kvs_wire_frame_hdr));
				more = k - owed < more ? k - owed : more;
				memcpy(next, in + pos + owed, more);
			}
			if (k > owed)
				k = owed;
			const struct sealed *c = &s[got - 1];
			size_t off = c->plen - owed;
			memcpy(payload + off, in + pos, k);
			cr_assert_eq(kvsp_frame_rx_payload(&rx, k), 0);
			pos += k;
			if (!kvsp_frame_rx_owed(&rx)) {
				cr_assert(!memcmp(payload, c->bytes + c->n, c->plen),
					  "payload differs");
				cr_assert_eq(kvsp_crc32c(payload, c->plen, 0),
					     le32toh(c->body.chunk.crc32c));
			}
			if (more) {
				void *at;
				cr_assert_eq(kvsp_frame_rx_want(&rx, &at),
					     sizeof(struct kvs_wire_frame_hdr));
				cr_assert_eq(at, next,
					     "the next frame's bytes are wanted where said");
				cr_assert_eq(kvsp_frame_rx_wrote(&rx, more, &f), 0,
					     "a header alone");
				pos += more;
			}
			continue;
		}
		if (xorshift() & 1) {
			r = kvsp_frame_rx_feed(&rx, in + pos, k, &used, &f);
			cr_assert(r != 0 || used == k, "took %zu of %zu without a frame", used, k);
		} else {
			void *at;
			size_t w = kvsp_frame_rx_want(&rx, &at);
			cr_assert_gt(w, 0);
			used = k < w ? k : w;
			memcpy(at, in + pos, used);
			r = kvsp_frame_rx_wrote(&rx, used, &f);
		}
		cr_assert_geq(r, 0, "refused at %zu: %d", pos, r);
		pos += used;
		if (r == 1) {
			cr_assert_lt(got, n);
			assert_frame_is(&f, &s[got], got);
			got++;
			cr_assert_eq(kvsp_frame_rx_owed(&rx), s[got - 1].plen);
		}
	}
	cr_assert_eq(got, n, "%zu frames of %zu", got, n);
	cr_assert_eq(kvsp_frame_rx_owed(&rx), 0);
	void *at;
	cr_assert_eq(kvsp_frame_rx_want(&rx, &at), sizeof(struct kvs_wire_frame_hdr));
	cr_assert_eq(kvsp_frame_rx_want_next(&rx, &at), 0, "no payload owed: no next frame yet");
	kvsp_frame_rx_wipe(&rx);
}

static size_t one(void)
{
	return 1;
}

static size_t random_split(void)
{
	return 1 + (size_t)(xorshift() % (1u << (xorshift() % 9)));
}

static size_t whole(void)
{
	return SIZE_MAX;
}

Test(frame, round_trip_every_split)
{
	struct sealed s[40];
	static uint8_t in[sizeof(s)];
	size_t len = stream_of(s, 40, 64, in);

	decode_all(in, len, s, 40, one);
	decode_all(in, len, s, 40, whole);
	for (int i = 0; i < 200; i++)
		decode_all(in, len, s, 40, random_split);
}

Test(frame, chunk_payload_handed_back)
{
	struct kvsp_frame_tx tx;
	struct kvsp_frame_rx rx;
	struct kvsp_frame f;
	struct sealed c, p;
	size_t used;
	uint8_t buf[sizeof(c.bytes) * 2];

	kvsp_frame_tx_init(&tx, KEY);
	kvsp_frame_rx_init(&rx, KEY, 64);
	seal(&tx, KVS_WIRE_CHUNK, 5, 50, &c);
	seal(&tx, KVS_WIRE_PING, 6, 0, &p);
	memcpy(buf, c.bytes, c.n + 50);
	memcpy(buf + c.n + 50, p.bytes, p.n);

	/* The whole stream offered at once: the decoder stops after the CHUNK's
	 * body and leaves the payload to us. */
	cr_assert_eq(kvsp_frame_rx_feed(&rx, buf, c.n + 50 + p.n, &used, &f), 1);
	cr_assert_eq(used, c.n);
	cr_assert_eq(f.type, KVS_WIRE_CHUNK);
	cr_assert_eq(f.plen, 50);
	cr_assert_eq(le32toh(f.body.chunk.len), 50);
	cr_assert_eq(le32toh(f.body.chunk.flags), KVS_WIRE_CHUNK_CRC);
	cr_assert_eq(kvsp_frame_rx_owed(&rx), 50);
	/* Nothing else is taken until the payload is. */
	cr_assert_eq(kvsp_frame_rx_feed(&rx, buf + used, 10, &used, &f), -EBUSY);
	cr_assert_eq(used, 0);
	void *at;
	cr_assert_eq(kvsp_frame_rx_want(&rx, &at), 0);
	cr_assert_null(at);
	uint32_t crc = kvsp_crc32c(buf + c.n, 20, 0);
	cr_assert_eq(kvsp_frame_rx_payload(&rx, 20), 0);
	crc = kvsp_crc32c(buf + c.n + 20, 30, crc);
	cr_assert_eq(kvsp_frame_rx_payload(&rx, 30), 0);
	cr_assert_eq(crc, le32toh(f.body.chunk.crc32c), "payload CRC");
	cr_assert_eq(kvsp_frame_rx_owed(&rx), 0);
	cr_assert_eq(kvsp_frame_rx_feed(&rx, buf + c.n + 50, p.n, &used, &f), 1);
	cr_assert_eq(f.type, KVS_WIRE_PING);
	cr_assert_eq(f.seq, 1);

	/* More payload than owed loses the stream. */
	struct sealed c2;
	seal(&tx, KVS_WIRE_CHUNK, 7, 8, &c2);
	cr_assert_eq(kvsp_frame_rx_feed(&rx, c2.bytes, c2.n, &used, &f), 1);
	cr_assert_eq(kvsp_frame_rx_payload(&rx, 9), -EINVAL);
	cr_assert_eq(kvsp_frame_rx_feed(&rx, p.bytes, p.n, &used, &f), -EINVAL);
	cr_assert_eq(kvsp_frame_rx_owed(&rx), 0);

	/* A zero-length CHUNK owes nothing. */
	kvsp_frame_rx_init(&rx, KEY, 64);
	kvsp_frame_tx_init(&tx, KEY);
	seal(&tx, KVS_WIRE_CHUNK, 8, 0, &c2);
	cr_assert_eq(kvsp_frame_rx_feed(&rx, c2.bytes, c2.n, &used, &f), 1);
	cr_assert_eq(f.plen, 0);
	cr_assert_eq(kvsp_frame_rx_owed(&rx), 0);
	cr_assert_eq(kvsp_frame_rx_want(&rx, &at), sizeof(struct kvs_wire_frame_hdr));
}

Test(frame, every_flipped_bit_refused)
{
	struct kvsp_frame_tx tx;
	struct kvsp_frame_rx rx;
	struct kvsp_frame f;
	size_t used;

	for (uint16_t type = 1; type < KVS_WIRE_NTYPES; type++) {
		struct sealed s;
		kvsp_frame_tx_init(&tx, KEY);
		seal(&tx, type, type, 16, &s);
		for (size_t bit = 0; bit < s.n * 8; bit++) {
			uint8_t b[sizeof(s.bytes)];
			memcpy(b, s.bytes, sizeof(b));
			b[bit / 8] ^= (uint8_t)(1u << (bit % 8));
			kvsp_frame_rx_init(&rx, KEY, 64);
			memset(&f, 0xa5, sizeof(f));
			int r = kvsp_frame_rx_feed(&rx, b, s.n + s.plen, &used, &f);
			cr_assert_lt(r, 0, "type %u bit %zu: %d", type, bit, r);
			cr_assert_eq(f.type, 0xa5a5, "type %u bit %zu: a frame came out", type,
				     bit);
			size_t byte = bit / 8;
			if (byte < 4)
				cr_assert_eq(r, -EPROTO);
			else if (byte >= 24)
				cr_assert_eq(r, -EACCES, "type %u bit %zu: %d", type, bit, r);
			/* Dead: the untouched frame is refused after it. */
			cr_assert_eq(kvsp_frame_rx_feed(&rx, s.bytes, s.n, &used, &f), r);
		}
	}
}

Test(frame, replayed_reordered_dropped_refused)
{
	struct sealed s[4];
	uint8_t in[sizeof(s)];
	struct kvsp_frame_rx rx;
	struct kvsp_frame f;
	size_t used;

	stream_of(s, 4, 0, in); /* no payloads */
	/* replay */
	kvsp_frame_rx_init(&rx, KEY, 64);
	cr_assert_eq(kvsp_frame_rx_feed(&rx, s[0].bytes, s[0].n, &used, &f), 1);
	cr_assert_eq(kvsp_frame_rx_feed(&rx, s[0].bytes, s[0].n, &used, &f), -EILSEQ);
	cr_assert_eq(kvsp_frame_rx_feed(&rx, s[1].bytes, s[1].n, &used, &f), -EILSEQ, "not dead");
	/* reorder */
	kvsp_frame_rx_init(&rx, KEY, 64);
	cr_assert_eq(kvsp_frame_rx_feed(&rx, s[1].bytes, s[1].n, &used, &f), -EILSEQ);
	/* drop */
	kvsp_frame_rx_init(&rx, KEY, 64);
	cr_assert_eq(kvsp_frame_rx_feed(&rx, s[0].bytes, s[0].n, &used, &f), 1);
	cr_assert_eq(kvsp_frame_rx_feed(&rx, s[2].bytes, s[2].n, &used, &f), -EILSEQ);
	/* another key (another connection, or our own frames sent back) */
	kvsp_frame_rx_init(&rx, KEY2, 64);
	cr_assert_eq(kvsp_frame_rx_feed(&rx, s[0].bytes, s[0].n, &used, &f), -EACCES);
	/* the same frames on a second connection under the same key still run in order */
	kvsp_frame_rx_init(&rx, KEY, 64);
	for (int i = 0; i < 4; i++)
		cr_assert_eq(kvsp_frame_rx_feed(&rx, s[i].bytes, s[i].n, &used, &f), 1);
}

Test(frame, truncated_input_waits)
{
	struct sealed s[2];
	uint8_t in[sizeof(s)];
	struct kvsp_frame_rx rx;
	struct kvsp_frame f;
	size_t used;

	stream_of(s, 2, 0, in);
	for (size_t cut = 0; cut < s[0].n; cut++) {
		kvsp_frame_rx_init(&rx, KEY, 64);
		cr_assert_eq(kvsp_frame_rx_feed(&rx, s[0].bytes, cut, &used, &f), 0, "cut %zu",
			     cut);
		cr_assert_eq(used, cut);
		void *at;
		cr_assert_gt(kvsp_frame_rx_want(&rx, &at), 0);
		cr_assert_eq(kvsp_frame_rx_feed(&rx, s[0].bytes + cut, s[0].n - cut, &used, &f), 1);
		cr_assert_eq(used, s[0].n - cut);
		assert_frame_is(&f, &s[0], 0);
	}
	/* want() never offers past the frame, even with the body to come. */
	kvsp_frame_rx_init(&rx, KEY, 64);
	void *at;
	cr_assert_eq(kvsp_frame_rx_want(&rx, &at), sizeof(struct kvs_wire_frame_hdr));
	memcpy(at, s[0].bytes, sizeof(struct kvs_wire_frame_hdr));
	cr_assert_eq(kvsp_frame_rx_wrote(&rx, sizeof(struct kvs_wire_frame_hdr), &f), 0);
	size_t w = kvsp_frame_rx_want(&rx, &at);
	cr_assert_eq(w, s[0].n - sizeof(struct kvs_wire_frame_hdr));
	cr_assert_eq(kvsp_frame_rx_wrote(&rx, 0, &f), 0);
	/* Saying more was written than was offered loses the stream. */
	cr_assert_eq(kvsp_frame_rx_wrote(&rx, w + 1, &f), -EINVAL);
	cr_assert_eq(kvsp_frame_rx_want(&rx, &at), 0);
}

/* A frame MACed the way wire.h says, with whatever header the test wants:
 * the decoder's checks after the MAC can only be reached this way, and the
 * decoder taking a good one shows it MACs what wire.h says. */
static size_t hand_seal(const uint8_t *key, struct kvs_wire_frame_hdr h, const void *body,
			uint32_t len, uint8_t *out)
{
	crypto_generichash_state st;
	crypto_generichash_init(&st, key, KVSP_KEY_SIZE, KVS_WIRE_MAC_SIZE);
	crypto_generichash_update(&st, (const uint8_t *)&h,
				  offsetof(struct kvs_wire_frame_hdr, mac));
	crypto_generichash_update(&st, body, len);
	crypto_generichash_final(&st, h.mac, KVS_WIRE_MAC_SIZE);
	memcpy(out, &h, sizeof(h));
	memcpy(out + sizeof(h), body, len);
	return sizeof(h) + len;
}

static int feed_one(const uint8_t *b, size_t n, uint32_t maxp)
{
	struct kvsp_frame_rx rx;
	struct kvsp_frame f;
	size_t used;
	kvsp_frame_rx_init(&rx, KEY, maxp);
	return kvsp_frame_rx_feed(&rx, b, n, &used, &f);
}

Test(frame, sizes_and_fields_refused)
{
	uint8_t b[256];
	union kvs_wire_body body = body_of(KVS_WIRE_CHUNK, 1, 64);
	struct kvs_wire_frame_hdr h = { .magic = htole32(KVS_WIRE_FRAME_MAGIC),
					.type = htole16(KVS_WIRE_CHUNK),
					.len = htole32(sizeof(struct kvs_wire_chunk)),
					.plen = htole32(64) };
	size_t n;

	/* as wire.h says: taken */
	n = hand_seal(KEY, h, &body, sizeof(body.chunk), b);
	cr_assert_eq(feed_one(b, n, 64), 1);
	/* payload above the limit, judged from the header before the MAC */
	cr_assert_eq(feed_one(b, n, 63), -E2BIG);
	struct kvs_wire_frame_hdr x = h;
	x.plen = htole32(UINT32_MAX);
	cr_assert_eq(feed_one(b, hand_seal(KEY, x, &body, sizeof(body.chunk), b), UINT32_MAX - 1),
		     -E2BIG);
	/* a body length other than the type's, either way */
	x = h;
	uint8_t longer[sizeof(body) + 8] = { 0 };
	memcpy(longer, &body, sizeof(body));
	x.len = htole32(sizeof(longer));
	cr_assert_eq(feed_one(b, hand_seal(KEY, x, longer, sizeof(longer), b), 64), -EBADMSG);
	x.len = htole32(UINT32_MAX);
	memcpy(b, &x, sizeof(x));
	cr_assert_eq(feed_one(b, sizeof(x), 64), -EBADMSG, "a huge len made it wait");
	x.len = 0;
	cr_assert_eq(feed_one(b, hand_seal(KEY, x, &body, 0, b), 64), -EBADMSG);
	/* payload on a type that has none */
	x = h;
	x.type = htole16(KVS_WIRE_OPEN);
	x.len = htole32(sizeof(struct kvs_wire_open));
	cr_assert_eq(feed_one(b, hand_seal(KEY, x, &body, sizeof(body.open), b), 64), -EMSGSIZE);
	/* unknown types */
	uint16_t types[] = { 0, KVS_WIRE_NTYPES, 0xffff };
	for (size_t i = 0; i < 3; i++) {
		x = h;
		x.type = htole16(types[i]);
		x.plen = 0;
		cr_assert_eq(feed_one(b, hand_seal(KEY, x, &body, sizeof(body.chunk), b), 64),
			     -ENOMSG);
	}
	/* header flags, MACed right */
	x = h;
	x.flags = htole16(1);
	cr_assert_eq(feed_one(b, hand_seal(KEY, x, &body, sizeof(body.chunk), b), 64), -EOPNOTSUPP);
	/* a CHUNK whose body disagrees with its header about the payload */
	union kvs_wire_body y = body;
	y.chunk.len = htole32(63);
	cr_assert_eq(feed_one(b, hand_seal(KEY, h, &y, sizeof(y.chunk), b), 64), -ERANGE);
	/* seq from the future, MACed right */
	x = h;
	x.seq = htole64(1);
	cr_assert_eq(feed_one(b, hand_seal(KEY, x, &body, sizeof(body.chunk), b), 64), -EILSEQ);

	/* The sealer refuses what the decoder would. */
	struct kvsp_frame_tx tx;
	kvsp_frame_tx_init(&tx, KEY);
	cr_assert_eq(kvsp_frame_seal(&tx, 0, &body, 0, b), -EINVAL);
	cr_assert_eq(kvsp_frame_seal(&tx, KVS_WIRE_NTYPES, &body, 0, b), -EINVAL);
	cr_assert_eq(kvsp_frame_seal(&tx, KVS_WIRE_PING, &body, 1, b), -EINVAL);
	cr_assert_eq(kvsp_frame_seal(&tx, KVS_WIRE_CHUNK, &body, 63, b), -EINVAL);
	cr_assert_eq(tx.seq, 0, "a refused seal used a seq");
	cr_assert_eq(kvsp_frame_seal(&tx, KVS_WIRE_CHUNK, &body, 64, b), 88);
	cr_assert_eq(tx.seq, 1);
	cr_assert_eq(hand_seal(KEY, h, &body, sizeof(body.chunk), b + 100), 88);
	cr_assert(!memcmp(b, b + 100, 88), "the sealer's frame is not the one wire.h describes");
}

/* A data path's own type (48 to 63): registered with its size and flags,
 * then sealed and decoded as the protocol's are; its payload's length
 * checked against its body as a CHUNK's. What the table cannot hold, or
 * holds already as something else, is refused and changes nothing. */
Test(frame, a_data_path_registers_its_own_type)
{
	enum { OWN = KVSP_FRAME_OWN_MIN + 3 };
	cr_assert_eq(kvsp_frame_body_size(OWN), 0, "unknown before it is registered");
	cr_assert_eq(kvsp_frame_register(KVS_WIRE_CHUNK, 48, 0), -EINVAL, "the protocol's");
	cr_assert_eq(kvsp_frame_register(KVSP_FRAME_TYPES, 48, 0), -EINVAL);
	cr_assert_eq(kvsp_frame_register(OWN, 0, 0), -EINVAL);
	cr_assert_eq(kvsp_frame_register(OWN, KVS_WIRE_BODY_MAX + 8, 0), -EINVAL);
	cr_assert_eq(kvsp_frame_register(OWN, 12, 0), -EINVAL, "not a multiple of 8");
	cr_assert_eq(kvsp_frame_register(OWN, 16, KVSP_FRAME_PAYLOAD), -EINVAL,
		     "a payload's body starts as a CHUNK's");
	cr_assert_eq(kvsp_frame_register(OWN, 48, 0x100), -EINVAL);
	cr_assert_eq(kvsp_frame_body_size(OWN), 0, "a refusal changed the table");
	cr_assert_eq(kvsp_frame_register(OWN, 48, KVSP_FRAME_PAYLOAD), 0);
	cr_assert_eq(kvsp_frame_register(OWN, 48, KVSP_FRAME_PAYLOAD), 0, "again, the same");
	cr_assert_eq(kvsp_frame_register(OWN, 56, KVSP_FRAME_PAYLOAD), -EEXIST);
	cr_assert_eq(kvsp_frame_body_size(OWN), 48);
	cr_assert_eq(kvsp_frame_kind(OWN)->flags, KVSP_FRAME_PAYLOAD | KVSP_FRAME_DATAPATH);
	cr_assert_eq(kvsp_frame_kind(KVS_WIRE_CHUNK_READ)->flags,
		     KVSP_FRAME_DATAPATH | KVSP_FRAME_ASKS, "RDMA's READ is answered when unowned");
	cr_assert_null(kvsp_frame_kind(OWN + 1));

	union kvs_wire_body body = body_of(KVS_WIRE_CHUNK, 1, 64);
	uint8_t b[KVS_WIRE_FRAME_MAX];
	struct kvsp_frame_tx tx;
	kvsp_frame_tx_init(&tx, KEY);
	cr_assert_eq(kvsp_frame_seal(&tx, OWN, &body, 63, b), -EINVAL, "len is not plen");
	int n = kvsp_frame_seal(&tx, OWN, &body, 64, b);
	cr_assert_eq(n, (int)(sizeof(struct kvs_wire_frame_hdr) + 48));
	struct kvsp_frame_rx rx;
	struct kvsp_frame f;
	size_t used;
	kvsp_frame_rx_init(&rx, KEY, 64);
	cr_assert_eq(kvsp_frame_rx_feed(&rx, b, (size_t)n, &used, &f), 1);
	cr_assert_eq(f.type, OWN);
	cr_assert_eq(f.plen, 64);
	cr_assert_eq(kvsp_frame_rx_owed(&rx), 64, "its payload is owed as a CHUNK's");
	cr_assert_eq(memcmp(&f.body.chunk, &body.chunk, sizeof(body.chunk)), 0);
}

Test(frame, garbage_refused)
{
	uint8_t b[1024];
	int seen[256] = { 0 };

	for (int i = 0; i < 2000; i++) {
		for (size_t k = 0; k < sizeof(b); k++)
			b[k] = (uint8_t)xorshift();
		/* Each a step further: the right magic, a known type, its length
		 * and no payload, so every check is reached. */
		uint32_t m = htole32(KVS_WIRE_FRAME_MAGIC);
		uint16_t t = (uint16_t)(1 + xorshift() % (KVS_WIRE_NTYPES - 1));
		uint32_t l = kvsp_frame_body_size(t);
		if (i % 4 >= 1)
			memcpy(b, &m, 4);
		if (i % 4 >= 2) {
			t = htole16(t);
			memcpy(b + 4, &t, 2);
			if (le32toh(*(uint32_t *)(b + 8)) == l)
				b[8] ^= 1;
		}
		if (i % 4 == 3) {
			l = htole32(l);
			memcpy(b + 8, &l, 4);
			memset(b + 12, 0, 4);
		}
		int r = feed_one(b, sizeof(b), 64);
		cr_assert_lt(r, 0, "garbage taken as a frame");
		seen[-r & 0xff]++;
	}
	cr_assert(seen[EPROTO] && seen[ENOMSG] && seen[EBADMSG] && seen[EACCES]);
	memset(b, 0, sizeof(b));
	cr_assert_eq(feed_one(b, sizeof(b), 64), -EPROTO);
}

/* ------------------------------------------------------------------ CRC32C */

/* Bit by bit, as the definition goes: the oracle the library is checked against. */
static uint32_t crc_ref(const uint8_t *p, size_t n, uint32_t crc)
{
	crc = ~crc;
	while (n--) {
		crc ^= *p++;
		for (int k = 0; k < 8; k++)
			crc = (crc >> 1) ^ (0x82f63b78u & (0u - (crc & 1)));
	}
	return ~crc;
}

Test(frame, crc32c_vectors)
{
	uint8_t b[48];

	cr_assert_eq(kvsp_crc32c("123456789", 9, 0), 0xe3069283u);
	cr_assert_eq(kvsp_crc32c("", 0, 0), 0);
	cr_assert_eq(kvsp_crc32c("a", 1, 0), 0xc1d04330u);
	/* RFC 3720, B.4 */
	memset(b, 0, 32);
	cr_assert_eq(kvsp_crc32c(b, 32, 0), 0x8a9136aau);
	memset(b, 0xff, 32);
	cr_assert_eq(kvsp_crc32c(b, 32, 0), 0x62a8ab43u);
	for (int i = 0; i < 32; i++)
		b[i] = (uint8_t)i;
	cr_assert_eq(kvsp_crc32c(b, 32, 0), 0x46dd794eu);
	for (int i = 0; i < 32; i++)
		b[i] = (uint8_t)(31 - i);
	cr_assert_eq(kvsp_crc32c(b, 32, 0), 0x113fdb5cu);
	static const uint8_t scsi[48] = {
		0x01, 0xc0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
		0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0x00,
		0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x18, 0x28, 0x00, 0x00, 0x00,
		0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
	};
	cr_assert_eq(kvsp_crc32c(scsi, 48, 0), 0xd9963a56u);
}

Test(frame, crc32c_any_length_offset_and_chain)
{
	static uint8_t b[4096 + 16];
	for (size_t i = 0; i < sizeof(b); i++)
		b[i] = (uint8_t)xorshift();
	for (int i = 0; i < 2000; i++) {
		size_t off = xorshift() % 16, n = xorshift() % 4097;
		if (i < 64)
			n = (size_t)i; /* every tail shape */
		uint32_t want = crc_ref(b + off, n, 0);
		cr_assert_eq(kvsp_crc32c(b + off, n, 0), want, "off %zu n %zu", off, n);
		size_t cut = n ? xorshift() % n : 0;
		cr_assert_eq(kvsp_crc32c(b + off + cut, n - cut, kvsp_crc32c(b + off, cut, 0)),
			     want, "chained at %zu of %zu", cut, n);
	}
}

/* libkvstage's CRC32C (shm/crc.c: the engines' end-to-end checksum, which the proxy's chunk CRC
 * calls too) against the bit-by-bit definition, on each of its paths: the tables, and the crc32
 * instruction's three chains a 4 KiB block; chained, combined and fused with a copy. */
Test(frame, library_crc32c_every_path)
{
	static uint8_t b[3 * 4096 + 16], d[sizeof(b)];
	for (size_t i = 0; i < sizeof(b); i++)
		b[i] = (uint8_t)xorshift();
	cr_assert_eq(kvs_crc32c("123456789", 9, 0), 0xe3069283u);
	cr_assert_eq(~kvsc_crc32c_sw(~0u, "123456789", 9), 0xe3069283u);
	for (int i = 0; i < 2000; i++) {
		size_t off = xorshift() % 16, n = xorshift() % (sizeof(b) - 16 + 1);
		if (i < 64)
			n = (size_t)i;
		uint32_t want = crc_ref(b + off, n, 0);
		cr_assert_eq(kvs_crc32c(b + off, n, 0), want, "off %zu n %zu", off, n);
		cr_assert_eq(~kvsc_crc32c_sw(~0u, b + off, n), want, "tables: off %zu n %zu", off,
			     n);
#if defined(__x86_64__)
		if (__builtin_cpu_supports("sse4.2")) /* three lanes a 4 KiB block, joined */
			cr_assert_eq(~kvsc_crc32c_hw(~0u, b + off, n), want, "crc32: off %zu n %zu",
				     off, n);
#endif
		size_t cut = n ? xorshift() % n : 0;
		uint32_t a = kvs_crc32c(b + off, cut, 0), z = kvs_crc32c(b + off + cut, n - cut, 0);
		cr_assert_eq(kvs_crc32c(b + off + cut, n - cut, a), want, "chained at %zu of %zu",
			     cut, n);
		cr_assert_eq(kvs_crc32c_combine(a, z, n - cut), want, "combined at %zu of %zu", cut,
			     n);
		size_t doff = xorshift() % 16;
		memset(d, 0, sizeof(d));
		cr_assert_eq(kvs_copy_crc32c(d + doff, b + off, n, 0), want,
			     "copied: off %zu n %zu", off, n);
		cr_assert(memcmp(d + doff, b + off, n) == 0 &&
			  (n + doff == sizeof(d) || d[doff + n] == 0));
	}
	cr_assert_eq(kvs_crc32c_combine(0x12345678u, 0, 0), 0x12345678u);
}
