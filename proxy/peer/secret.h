/* SPDX-License-Identifier: MIT */
/*
 * The deployment's shared secret, which peers (other proxies) prove before
 * any room traffic (DESIGN.md, "Across hosts"): from a file, or from the
 * value of $KVSTAGE_PEER_SECRET (wiped by its caller once read), never from
 * the command line (every user can read a command line in /proc). It
 * becomes a 32-byte master key at once; the raw bytes are wiped. peer/auth.h
 * proves it.
 *
 * The secret must be random (e.g. `openssl rand -base64 32`): either side
 * of a handshake shows a MAC over values an onlooker can see before the
 * other has proven anything, as any challenge-response over a shared key
 * does, so a secret that can be guessed can be tested offline.
 */
#ifndef KVSP_SECRET_H
#define KVSP_SECRET_H

#include <stddef.h>
#include <stdint.h>

#define KVSP_SECRET_MIN 16 /* bytes, after the trailing newline is stripped */
#define KVSP_SECRET_MAX 4096

struct kvsp_secret {
	/* The master key (KVSP_KEY_SIZE bytes) in sodium_malloc'd memory:
	 * guard pages, locked when RLIMIT_MEMLOCK allows, never in a core
	 * dump, read-only once made. NULL when not loaded. */
	const uint8_t *key;
};

/* Loads the secret from the file at path if path is not NULL, else from env_value
 * (the caller's $KVSTAGE_PEER_SECRET), and derives the master key into *out. The file
 * is opened without following a link and must be a regular file of our effective uid
 * (or root) that no one else may read or write. One trailing "\n" or "\r\n" is
 * stripped; KVSP_SECRET_MIN to KVSP_SECRET_MAX bytes must remain. Returns 0, or
 * -EPERM (mode or owner), -EINVAL (length, or not a regular file), -ENOKEY (no path
 * and no env_value), -ENOMEM, -EIO (libsodium failed to start), or open's or read's
 * -errno; on a refusal *out is untouched and why holds a sentence for people. */
int kvsp_secret_load(const char *path, const char *env_value, struct kvsp_secret *out, char *why,
		     size_t why_len);
/* Wipes and frees s's key (nothing if not loaded). */
void kvsp_secret_free(struct kvsp_secret *s);

#endif
