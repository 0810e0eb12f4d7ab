/* SPDX-License-Identifier: MIT */
/* The handshake between proxies (peer/auth.h). */
#include "peer/auth.h"

#include <endian.h>
#include <errno.h>
#include <stdbool.h>
#include <string.h>

#include <sodium.h>

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
