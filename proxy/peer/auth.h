/* SPDX-License-Identifier: MIT */
/*
 * The mutual handshake between proxies: a state machine over the fixed-size
 * messages of peer/wire.h, pure code with no sockets. Either side proves the
 * deployment's secret (peer/secret.h) over both sides' fresh nonces and
 * instances, with a label naming its role, and both derive one session key
 * per direction for peer/frame.h:
 *
 *   dialer -> listener   HELLO(dialer, instance_d, nonce_d)
 *   listener -> dialer   HELLO(listener, instance_l, nonce_l), PROOF(listener)
 *   dialer -> listener   PROOF(dialer)        (after checking the listener's)
 *
 * kvsp_auth_next() says which step is due. Refusals are -errno the caller
 * counts: -EACCES a proof that does not verify (another secret, a replay
 * from an earlier connection, a reflected proof, a message changed on the
 * way), -EPROTONOSUPPORT another version, -ELOOP a peer naming our own
 * instance (ourselves, or two of our connections joined by someone in the
 * middle; so a proxy never dials itself), -EPROTO anything else malformed
 * (magic, type, role, reserved bits, our own nonce sent back). A refusal
 * ends the handshake; every later call returns it.
 */
#ifndef KVSP_AUTH_H
#define KVSP_AUTH_H

#include <stddef.h>
#include <stdint.h>

#include "peer/frame.h"
#include "peer/secret.h"
#include "peer/wire.h"

enum kvsp_auth_step {
	KVSP_AUTH_SEND_HELLO = 1, /* kvsp_auth_hello() */
	KVSP_AUTH_RECV_HELLO, /* kvsp_auth_on_hello() with the peer's KVS_WIRE_HELLO_SIZE bytes */
	KVSP_AUTH_SEND_PROOF, /* kvsp_auth_proof() */
	KVSP_AUTH_RECV_PROOF, /* kvsp_auth_on_proof() with the peer's KVS_WIRE_PROOF_SIZE bytes */
	KVSP_AUTH_DONE,	      /* kvsp_auth_keys() */
	KVSP_AUTH_FAILED,
};

#define KVS_WIRE_HELLO_SIZE sizeof(struct kvs_wire_hello)
#define KVS_WIRE_PROOF_SIZE sizeof(struct kvs_wire_proof)

struct kvsp_auth {
	const struct kvsp_secret *secret; /* the caller's, kept until the handshake ends */
	uint8_t role;			  /* enum kvs_wire_role: ours */
	uint8_t step;			  /* enum kvsp_auth_step */
	uint8_t have_keys;		  /* keys derived and not yet taken */
	int err;			  /* the refusal, once FAILED */
	uint64_t instance, peer_instance;
	uint8_t nonce[32], peer_nonce[32];
	struct kvsp_frame_keys keys;
};

/* Starts a handshake as role (KVS_WIRE_DIALER or KVS_WIRE_LISTENER) for our proxy
 * instance under s (which must outlive it), with a fresh nonce. Returns 0, or
 * -EINVAL (bad role, s not loaded), -EIO (libsodium failed to start). */
int kvsp_auth_start(struct kvsp_auth *a, const struct kvsp_secret *s, enum kvs_wire_role role,
		    uint64_t instance);
/* Returns what a's handshake needs next (enum kvsp_auth_step). */
enum kvsp_auth_step kvsp_auth_next(const struct kvsp_auth *a);
/* Writes our HELLO (KVS_WIRE_HELLO_SIZE bytes) to out. Returns 0, or -EINVAL (not due). */
int kvsp_auth_hello(struct kvsp_auth *a, void *out);
/* Takes the peer's HELLO (KVS_WIRE_HELLO_SIZE bytes at in). Returns 0, or -EPROTO,
 * -EPROTONOSUPPORT, -ELOOP (our own instance), -EINVAL (not due). */
int kvsp_auth_on_hello(struct kvsp_auth *a, const void *in);
/* Writes our PROOF (KVS_WIRE_PROOF_SIZE bytes) to out; the dialer's ends its
 * handshake. Returns 0, or -EINVAL (not due). */
int kvsp_auth_proof(struct kvsp_auth *a, void *out);
/* Takes and verifies the peer's PROOF (KVS_WIRE_PROOF_SIZE bytes at in); the
 * listener's ends its handshake. Returns 0, or -EACCES, -EPROTO,
 * -EPROTONOSUPPORT, -EINVAL (not due). */
int kvsp_auth_on_proof(struct kvsp_auth *a, const void *in);
/* Once done, moves the session keys (our tx, our rx) to *out and wipes a's
 * nonces and keys. Returns 0, or -EINVAL (not done, or taken already). */
int kvsp_auth_keys(struct kvsp_auth *a, struct kvsp_frame_keys *out);
/* Returns the peer's instance from its HELLO (authenticated once done), or 0 before it. */
uint64_t kvsp_auth_peer_instance(const struct kvsp_auth *a);
/* Wipes everything a holds; it is FAILED (-EPIPE) after. */
void kvsp_auth_wipe(struct kvsp_auth *a);

#endif
