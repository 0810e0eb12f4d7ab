/* SPDX-License-Identifier: MIT */
/*
 * libFuzzer target: the wire between proxies, with no sockets. The first
 * byte picks a mode, the next four seed the splits (how the stream is cut
 * into the pieces recv() would return, and which feeding call takes each):
 *
 *  0  raw bytes into the frame decoder, payloads taken as it asks;
 *  1  a script of frames, sealed under the session key, then changed
 *     (bytes flipped, the stream cut, frames repeated, swapped or
 *     dropped) on the way to the decoder;
 *  2  raw bytes as a peer's HELLO and PROOF, to a dialer and a listener;
 *  3  a real handshake with bytes of its messages changed on the way,
 *     or a message reflected back to the side that sent it.
 *
 * It must never crash; never hand back a frame whose MAC (computed here
 * anew) does not verify, or whose bytes are not those of the frame sealed
 * with its seq; stay dead once it refused; never complete a handshake it
 * was fed by the fuzzer, or one with a changed message; and complete
 * every untouched one with agreeing keys.
 */
#include <endian.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "peer/frame.h"
#include "peer/auth.h"

#define MAXP 96 /* the decoder's max_payload */
#define HDR sizeof(struct kvs_wire_frame_hdr)
#define MAXFRAMES 12
#define STREAM (MAXFRAMES * 2 * (KVS_WIRE_FRAME_MAX + MAXP))

static const uint8_t KEY[KVSP_KEY_SIZE] = "kvstage fuzz session key 32 byte";
static struct kvsp_secret secret;

static void die(const char *why)
{
	fprintf(stderr, "fuzz-frame: %s\n", why);
	abort();
}

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	char why[256];
	(void)argc;
	(void)argv;
	if (sodium_init() < 0 ||
	    kvsp_secret_load(NULL, "the fuzzer's deployment secret", &secret, why, sizeof(why)) < 0)
		die("setup");
	return 0;
}

/* The input, read front to back; past its end everything is 0. */
struct in {
	const uint8_t *p;
	size_t n;
};

static uint8_t byte(struct in *in)
{
	if (!in->n)
		return 0;
	in->n--;
	return *in->p++;
}

static uint32_t u32(struct in *in)
{
	uint32_t v = 0;
	for (int i = 0; i < 4; i++)
		v = v << 8 | byte(in);
	return v;
}

static uint64_t rng;
static uint64_t next(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return rng;
}

/* A piece size as recv() might give: mostly small, now and then large. */
static size_t piece(void)
{
	return 1 + (size_t)(next() % (1u << (next() % 10)));
}

/* What a frame the decoder handed back must be: its bytes verify under KEY
 * and carry the seq it was given. */
static void check_mac(const uint8_t *raw, const struct kvsp_frame *f)
{
	struct kvs_wire_frame_hdr h;
	uint8_t mac[KVS_WIRE_MAC_SIZE];
	crypto_generichash_state st;
	uint32_t len = kvsp_frame_body_size(f->type);

	memcpy(&h, raw, HDR);
	if (!len || le32toh(h.len) != len || le16toh(h.type) != f->type ||
	    le64toh(h.seq) != f->seq || le32toh(h.plen) != f->plen ||
	    le32toh(h.magic) != KVS_WIRE_FRAME_MAGIC || h.flags)
		die("a frame whose header is not what was handed back");
	if (f->plen > MAXP || (f->type != KVS_WIRE_CHUNK && f->plen))
		die("a payload the decoder should have refused");
	crypto_generichash_init(&st, KEY, KVSP_KEY_SIZE, KVS_WIRE_MAC_SIZE);
	crypto_generichash_update(&st, raw, offsetof(struct kvs_wire_frame_hdr, mac));
	crypto_generichash_update(&st, raw + HDR, len);
	crypto_generichash_final(&st, mac, KVS_WIRE_MAC_SIZE);
	if (memcmp(mac, h.mac, sizeof(mac)))
		die("a frame handed back whose MAC does not verify");
	if (memcmp(&f->body, raw + HDR, len))
		die("a body handed back that is not the one received");
	for (size_t i = len; i < sizeof(f->body); i++)
		if (f->body.bytes[i])
			die("bytes past the body");
}

/* The originals, for mode 1: frame k is sealed[k] (its bytes, then payload). */
struct orig {
	uint8_t bytes[KVS_WIRE_FRAME_MAX + MAXP];
	size_t n, plen;
};
static struct orig orig[MAXFRAMES];
static size_t norig;

/* Feeds stream[0..len) to a decoder in pieces, taking payloads as they are
 * owed, and checks every frame and every refusal. Returns the frames taken,
 * or -1 if it was refused. */
static long decode(const uint8_t *stream, size_t len, bool sealed)
{
	struct kvsp_frame_rx rx;
	struct kvsp_frame f;
	size_t pos = 0, start = 0;
	uint64_t frames = 0;
	int err = 0;

	kvsp_frame_rx_init(&rx, KEY, MAXP);
	while (pos < len) {
		size_t k = piece(), used;
		if (k > len - pos)
			k = len - pos;
		if (kvsp_frame_rx_owed(&rx)) {
			void *at;
			if (kvsp_frame_rx_feed(&rx, stream + pos, k, &used, &f) != -EBUSY || used)
				die("feed took bytes while a payload was owed");
			if (kvsp_frame_rx_want(&rx, &at) != 0)
				die("want offered bytes while a payload was owed");
			if (k > kvsp_frame_rx_owed(&rx))
				k = kvsp_frame_rx_owed(&rx);
			if (kvsp_frame_rx_payload(&rx, k) != 0)
				die("payload refused");
			pos += k;
			if (!kvsp_frame_rx_owed(&rx))
				start = pos;
			continue;
		}
		int r;
		if (next() & 1) {
			r = kvsp_frame_rx_feed(&rx, stream + pos, k, &used, &f);
			if (r == 0 && used != k)
				die("feed stopped early without a frame");
		} else {
			void *at;
			size_t w = kvsp_frame_rx_want(&rx, &at);
			if (w == 0 || w > KVS_WIRE_FRAME_MAX)
				die("want offered nothing, or too much");
			used = k < w ? k : w;
			memcpy(at, stream + pos, used);
			r = kvsp_frame_rx_wrote(&rx, used, &f);
		}
		if (used > k)
			die("took more than it was given");
		pos += used;
		if (r < 0) {
			err = r;
			break;
		}
		if (r == 1) {
			if (f.seq != frames)
				die("a frame out of sequence handed back");
			if (pos - start != HDR + kvsp_frame_body_size(f.type))
				die("a frame handed back from bytes that are not its own");
			check_mac(stream + start, &f);
			if (sealed) {
				if (f.seq >= norig || orig[f.seq].n != pos - start ||
				    memcmp(orig[f.seq].bytes, stream + start, pos - start))
					die("a frame taken that differs from the one sealed with "
					    "its seq");
			}
			frames++;
			start = pos;
			if (kvsp_frame_rx_owed(&rx) != f.plen)
				die("payload owed is not plen");
		}
	}
	if (err) {
		size_t used;
		void *at;
		static const int known[] = { -EPROTO, -ENOMSG, -EBADMSG,    -EMSGSIZE, -E2BIG,
					     -EACCES, -EILSEQ, -EOPNOTSUPP, -ERANGE };
		bool ok = false;
		for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
			ok |= err == known[i];
		if (!ok)
			die("a refusal that is not one of the decoder's");
		if (kvsp_frame_rx_feed(&rx, stream, len, &used, &f) != err || used ||
		    kvsp_frame_rx_want(&rx, &at) != 0 || kvsp_frame_rx_wrote(&rx, 1, &f) != err ||
		    kvsp_frame_rx_payload(&rx, 0) != err)
			die("a dead decoder came back to life");
		kvsp_frame_rx_wipe(&rx);
		return -1;
	}
	kvsp_frame_rx_wipe(&rx);
	return (long)frames;
}

static void mode_raw(struct in *in)
{
	decode(in->p, in->n, false);
}

/* Builds frames from the script, seals them, changes the stream as told,
 * and decodes it. An untouched stream must come through whole. */
static void mode_sealed(struct in *in)
{
	static uint8_t stream[STREAM], tmp[STREAM];
	struct kvsp_frame_tx tx;
	size_t len = 0;

	kvsp_frame_tx_init(&tx, KEY);
	norig = 1 + byte(in) % MAXFRAMES;
	for (size_t i = 0; i < norig; i++) {
		uint16_t type = (uint16_t)(byte(in) % KVS_WIRE_NTYPES);
		union kvs_wire_body body;
		uint32_t plen = 0;
		for (size_t k = 0; k < sizeof(body); k++)
			body.bytes[k] = byte(in);
		if (type == 0)
			type = KVS_WIRE_PING;
		if (type == KVS_WIRE_CHUNK) {
			plen = byte(in) % (MAXP + 1);
			body.chunk.len = htole32(plen);
		}
		/* Now and then a seal that must be refused, leaving seq alone. */
		uint64_t seq = tx.seq;
		uint8_t junk[KVS_WIRE_FRAME_MAX];
		if (type != KVS_WIRE_CHUNK && kvsp_frame_seal(&tx, type, &body, 1, junk) != -EINVAL)
			die("seal took a payload for a type without one");
		if (type == KVS_WIRE_CHUNK &&
		    kvsp_frame_seal(&tx, type, &body, plen + 1, junk) != -EINVAL)
			die("seal took a CHUNK whose len is not plen");
		if (tx.seq != seq)
			die("a refused seal used a seq");
		int n = kvsp_frame_seal(&tx, type, &body, plen, orig[i].bytes);
		if (n != (int)(HDR + kvsp_frame_body_size(type)))
			die("seal refused a good frame");
		orig[i].n = (size_t)n;
		orig[i].plen = plen;
		for (uint32_t k = 0; k < plen; k++)
			orig[i].bytes[n + k] = (uint8_t)next();
		memcpy(stream + len, orig[i].bytes, orig[i].n + plen);
		len += orig[i].n + plen;
	}
	kvsp_frame_tx_wipe(&tx);

	bool touched = false;
	unsigned changes = byte(in) % 5;
	for (unsigned c = 0; c < changes && len; c++) {
		uint8_t op = byte(in) % 5;
		size_t at = u32(in) % len;
		size_t a = byte(in) % norig, b = byte(in) % norig;
		size_t oa = 0, ob = 0;
		for (size_t i = 0; i < a; i++)
			oa += orig[i].n + orig[i].plen;
		for (size_t i = 0; i < b; i++)
			ob += orig[i].n + orig[i].plen;
		size_t la = orig[a].n + orig[a].plen;
		switch (op) {
		case 0: { /* flip bits of one byte */
			uint8_t x = byte(in);
			stream[at] ^= x;
			touched |= x != 0;
			break;
		}
		case 1: /* cut the stream short */
			len = at;
			touched = true;
			break;
		case 2: /* repeat frame a after frame b (in the original layout) */
			if (ob + orig[b].n + orig[b].plen <= len && len + la <= STREAM) {
				size_t end = ob + orig[b].n + orig[b].plen;
				memcpy(tmp, stream + end, len - end);
				memcpy(stream + end, orig[a].bytes, la);
				memcpy(stream + end + la, tmp, len - end);
				len += la;
				touched = true;
			}
			break;
		case 3: /* drop frame a */
			if (oa + la <= len) {
				memmove(stream + oa, stream + oa + la, len - oa - la);
				len -= la;
				touched = true;
			}
			break;
		case 4: /* swap frames a and a+1 */
			if (a + 1 < norig) {
				size_t lb = orig[a + 1].n + orig[a + 1].plen;
				if (oa + la + lb <= len) {
					memcpy(tmp, stream + oa, la);
					memmove(stream + oa, stream + oa + la, lb);
					memcpy(stream + oa + lb, tmp, la);
					touched = true;
				}
			}
			break;
		}
	}
	long got = decode(stream, len, true);
	if (!touched && got != (long)norig)
		die("an untouched stream did not come through whole");
}

static void check_refusal(int r)
{
	if (r != -EPROTO && r != -EPROTONOSUPPORT && r != -EACCES && r != -ELOOP)
		die("a handshake refusal that is not one of its own");
}

/* The fuzzer as the peer: it knows no secret, so no handshake may end. */
static void mode_peer(struct in *in)
{
	uint8_t hello[KVS_WIRE_HELLO_SIZE] = { 0 }, proof[KVS_WIRE_PROOF_SIZE] = { 0 };
	uint8_t out[KVS_WIRE_HELLO_SIZE];
	struct kvsp_auth a;
	int r;

	for (size_t i = 0; i < sizeof(hello); i++)
		hello[i] = byte(in);
	for (size_t i = 0; i < sizeof(proof); i++)
		proof[i] = byte(in);

	if (kvsp_auth_start(&a, &secret, KVS_WIRE_DIALER, 1) < 0 || kvsp_auth_hello(&a, out) < 0)
		die("dialer start");
	if ((r = kvsp_auth_on_hello(&a, hello)) == 0) {
		r = kvsp_auth_on_proof(&a, proof);
		if (r == 0)
			die("a dialer took the fuzzer's proof");
	}
	check_refusal(r);
	if (kvsp_auth_next(&a) != KVSP_AUTH_FAILED || kvsp_auth_proof(&a, out) != r)
		die("a failed dialer goes on");
	kvsp_auth_wipe(&a);

	if (kvsp_auth_start(&a, &secret, KVS_WIRE_LISTENER, 2) < 0)
		die("listener start");
	if ((r = kvsp_auth_on_hello(&a, hello)) == 0) {
		if (kvsp_auth_hello(&a, out) < 0 || kvsp_auth_proof(&a, out) < 0)
			die("listener answer");
		r = kvsp_auth_on_proof(&a, proof);
		if (r == 0)
			die("a listener took the fuzzer's proof");
	}
	check_refusal(r);
	kvsp_auth_wipe(&a);
}

static void set_role(uint8_t *msg, uint32_t role)
{
	uint32_t r = htole32(role);
	memcpy(msg + offsetof(struct kvs_wire_hello, role), &r, 4); /* same offset in a proof */
}

/* A real handshake whose messages are changed on the way as the input says. */
static void mode_handshake(struct in *in)
{
	uint8_t m[2 * KVS_WIRE_HELLO_SIZE + 2 * KVS_WIRE_PROOF_SIZE];
	uint8_t *hd = m, *hl = m + KVS_WIRE_HELLO_SIZE, *pl = hl + KVS_WIRE_HELLO_SIZE,
		*pd = pl + KVS_WIRE_PROOF_SIZE;
	uint8_t x[sizeof(m)] = { 0 };
	struct kvsp_auth d, l;
	struct kvsp_frame_keys kd, kl;
	bool touched = false;

	/* Reflections: the listener's own proof handed back to it as the
	 * dialer's, or the dialer's own hello as the listener's, with the role
	 * rewritten so only the labels, nonces and instances stand in the way. */
	uint8_t reflect = byte(in) % 3;
	unsigned changes = byte(in) % 4;
	for (unsigned c = 0; c < changes; c++) {
		size_t at = (size_t)(byte(in) << 8 | byte(in)) % sizeof(m);
		x[at] ^= byte(in);
	}
	touched = reflect != 0;
	for (size_t i = 0; i < sizeof(x); i++)
		touched |= x[i] != 0;
	bool before_last = reflect == 2;
	for (size_t i = 0; i < (size_t)(pd - m); i++)
		before_last |= x[i] != 0;

	if (kvsp_auth_start(&d, &secret, KVS_WIRE_DIALER, 10) < 0 ||
	    kvsp_auth_start(&l, &secret, KVS_WIRE_LISTENER, 20) < 0)
		die("start");
#define XOR(p, n)                        \
	for (size_t i = 0; i < (n); i++) \
	(p)[i] ^= x[(size_t)((p)-m) + i]
	int r = kvsp_auth_hello(&d, hd);
	XOR(hd, KVS_WIRE_HELLO_SIZE);
	if (r == 0)
		r = kvsp_auth_on_hello(&l, hd);
	if (r == 0 && (kvsp_auth_hello(&l, hl) < 0 || kvsp_auth_proof(&l, pl) < 0))
		die("listener answer");
	XOR(hl, KVS_WIRE_HELLO_SIZE);
	XOR(pl, KVS_WIRE_PROOF_SIZE);
	if (reflect == 2) {
		memcpy(hl, hd, KVS_WIRE_HELLO_SIZE);
		set_role(hl, KVS_WIRE_LISTENER);
	}
	if (r == 0)
		r = kvsp_auth_on_hello(&d, hl);
	if (r == 0)
		r = kvsp_auth_on_proof(&d, pl);
	if (r == 0)
		r = kvsp_auth_proof(&d, pd);
	XOR(pd, KVS_WIRE_PROOF_SIZE);
	if (reflect == 1) {
		memcpy(pd, pl, KVS_WIRE_PROOF_SIZE);
		set_role(pd, KVS_WIRE_DIALER);
	}
	if (r == 0)
		r = kvsp_auth_on_proof(&l, pd);
#undef XOR
	if (!touched) {
		if (r != 0 || kvsp_auth_keys(&d, &kd) || kvsp_auth_keys(&l, &kl) ||
		    memcmp(kd.tx, kl.rx, KVSP_KEY_SIZE) || memcmp(kd.rx, kl.tx, KVSP_KEY_SIZE))
			die("an untouched handshake failed, or its keys disagree");
		if (kvsp_auth_peer_instance(&d) != 20 || kvsp_auth_peer_instance(&l) != 10)
			die("instances");
	} else {
		if (r == 0)
			die("a handshake with a changed or reflected message completed");
		check_refusal(r);
		if (kvsp_auth_next(&l) == KVSP_AUTH_DONE)
			die("a listener finished a handshake with a changed message");
		if (before_last && kvsp_auth_next(&d) == KVSP_AUTH_DONE)
			die("a dialer finished a handshake with a changed message");
	}
	kvsp_auth_wipe(&d);
	kvsp_auth_wipe(&l);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct in in = { data, size };
	uint8_t mode = byte(&in);
	rng = (uint64_t)u32(&in) << 1 | 1; /* never 0: xorshift would stay there */
	rng ^= 0x9e3779b97f4a7c15ull;
	switch (mode % 4) {
	case 0:
		mode_raw(&in);
		break;
	case 1:
		mode_sealed(&in);
		break;
	case 2:
		mode_peer(&in);
		break;
	case 3:
		mode_handshake(&in);
		break;
	}
	return 0;
}
