/* SPDX-License-Identifier: MIT */
#include "peer/frame.h"

#include <endian.h>
#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <string.h>

#include <sodium.h>

#include "kvstage.h"

#define HDR ((uint32_t)sizeof(struct kvs_wire_frame_hdr))
#define MACED ((uint32_t)offsetof(struct kvs_wire_frame_hdr, mac)) /* header bytes before the MAC */

static_assert(offsetof(struct kvs_wire_frame_hdr, mac) + KVS_WIRE_MAC_SIZE == 40,
	      "the MAC ends the header");

/* What the wire says of each type (frame.h's struct kvsp_frame_kind): the
 * protocol's, then those a data path outside it registered. No body is
 * empty: rx->need == HDR then means "header not judged yet", and a size of
 * 0 means an unknown type. */
#define DP KVSP_FRAME_DATAPATH
static struct kvsp_frame_kind kinds[KVSP_FRAME_TYPES] = {
	[KVS_WIRE_OPEN] = { sizeof(struct kvs_wire_open), 0 },
	[KVS_WIRE_OPEN_ACK] = { sizeof(struct kvs_wire_open_ack), 0 },
	[KVS_WIRE_CHUNK] = { sizeof(struct kvs_wire_chunk), DP | KVSP_FRAME_PAYLOAD },
	[KVS_WIRE_CHUNK_ACK] = { sizeof(struct kvs_wire_chunk_ack), DP },
	[KVS_WIRE_ABORT] = { sizeof(struct kvs_wire_abort), 0 },
	[KVS_WIRE_DONE] = { sizeof(struct kvs_wire_done), 0 },
	[KVS_WIRE_PING] = { sizeof(struct kvs_wire_ping), 0 },
	[KVS_WIRE_PONG] = { sizeof(struct kvs_wire_ping), 0 },
	[KVS_WIRE_BYE] = { sizeof(struct kvs_wire_bye), 0 },
	[KVS_WIRE_JOIN] = { sizeof(struct kvs_wire_join), 0 },
	[KVS_WIRE_ENDED] = { sizeof(struct kvs_wire_ended), 0 },
	[KVS_WIRE_RDMA_HELLO] = { sizeof(struct kvs_wire_rdma_hello), DP | KVSP_FRAME_ONCE },
	[KVS_WIRE_CHUNK_READ] = { sizeof(struct kvs_wire_chunk_read), DP | KVSP_FRAME_ASKS },
};
#undef DP

const struct kvsp_frame_kind *kvsp_frame_kind(uint32_t type)
{
	return type < KVSP_FRAME_TYPES && kinds[type].size ? &kinds[type] : NULL;
}

uint32_t kvsp_frame_body_size(uint32_t type)
{
	return type < KVSP_FRAME_TYPES ? kinds[type].size : 0;
}

int kvsp_frame_register(uint16_t type, uint32_t size, unsigned flags)
{
	if (type < KVSP_FRAME_OWN_MIN || type >= KVSP_FRAME_TYPES)
		return -EINVAL;
	if (!size || size > KVS_WIRE_BODY_MAX || size % 8 ||
	    (flags & KVSP_FRAME_PAYLOAD && size < sizeof(struct kvs_wire_chunk)) ||
	    (flags & KVSP_FRAME_ASKS && size < sizeof(struct kvs_wire_chunk_ack)) ||
	    (flags & ~(KVSP_FRAME_PAYLOAD | KVSP_FRAME_ASKS | KVSP_FRAME_ONCE)))
		return -EINVAL;
	if (kinds[type].size)
		return kinds[type].size == size &&
				       kinds[type].flags == (flags | KVSP_FRAME_DATAPATH)
			       ? 0
			       : -EEXIST;
	kinds[type] = (struct kvsp_frame_kind){ size, flags | KVSP_FRAME_DATAPATH };
	return 0;
}

static bool has_payload(uint16_t type)
{
	return type < KVSP_FRAME_TYPES && kinds[type].flags & KVSP_FRAME_PAYLOAD;
}

/* Keyed BLAKE2b-128 of the header up to its MAC, then the body. Both parts
 * have a fixed size per type (the type is in the header), so no two
 * different frames feed it the same bytes. */
static void frame_mac(const uint8_t *key, const void *hdr, const void *body, uint32_t len,
		      uint8_t *out)
{
	crypto_generichash_state st;

	crypto_generichash_init(&st, key, KVSP_KEY_SIZE, KVS_WIRE_MAC_SIZE);
	crypto_generichash_update(&st, hdr, MACED);
	crypto_generichash_update(&st, body, len);
	crypto_generichash_final(&st, out, KVS_WIRE_MAC_SIZE);
	sodium_memzero(&st, sizeof(st)); /* it holds the key's first block */
}

static uint32_t chunk_len(const void *body)
{
	struct kvs_wire_chunk c;
	memcpy(&c, body, sizeof(c));
	return le32toh(c.len);
}

/* ------------------------------------------------------------------ sender */

void kvsp_frame_tx_init(struct kvsp_frame_tx *tx, const uint8_t *key)
{
	memcpy(tx->key, key, KVSP_KEY_SIZE);
	tx->seq = 0;
}

void kvsp_frame_tx_wipe(struct kvsp_frame_tx *tx)
{
	sodium_memzero(tx, sizeof(*tx));
}

int kvsp_frame_seal(struct kvsp_frame_tx *tx, uint16_t type, const void *body, uint32_t plen,
		    void *out)
{
	uint32_t len = kvsp_frame_body_size(type);
	uint8_t *o = out;

	/* Refused here what the peer's decoder would refuse: a frame it kills
	 * the connection for must never leave us. */
	if (!len || (plen && !has_payload(type)))
		return -EINVAL;
	if (has_payload(type) && chunk_len(body) != plen)
		return -EINVAL;

	struct kvs_wire_frame_hdr h = {
		.magic = htole32(KVS_WIRE_FRAME_MAGIC),
		.type = htole16(type),
		.flags = 0,
		.len = htole32(len),
		.plen = htole32(plen),
		.seq = htole64(tx->seq),
	};
	/* MACed from the copy in out, so what is sent is what was MACed even
	 * if the caller's body changes meanwhile. */
	memcpy(o + HDR, body, len);
	frame_mac(tx->key, &h, o + HDR, len, h.mac);
	memcpy(o, &h, HDR);
	tx->seq++;
	return (int)(HDR + len);
}

/* ----------------------------------------------------------------- receiver */

void kvsp_frame_rx_init(struct kvsp_frame_rx *rx, const uint8_t *key, uint32_t max_payload)
{
	memset(rx, 0, sizeof(*rx));
	memcpy(rx->key, key, KVSP_KEY_SIZE);
	rx->max_payload = max_payload;
	rx->need = HDR;
}

/* Kills the decoder with err: nothing it held is of use any more. */
static int die(struct kvsp_frame_rx *rx, int err)
{
	sodium_memzero(rx, sizeof(*rx));
	rx->err = err;
	return err;
}

void kvsp_frame_rx_wipe(struct kvsp_frame_rx *rx)
{
	die(rx, -EPIPE);
}

size_t kvsp_frame_rx_want(struct kvsp_frame_rx *rx, void **at)
{
	if (rx->err || rx->owed) {
		*at = NULL;
		return 0;
	}
	*at = rx->buf + rx->have;
	return rx->need - rx->have;
}

size_t kvsp_frame_rx_want_next(struct kvsp_frame_rx *rx, void **at)
{
	if (rx->err || !rx->owed) {
		*at = NULL;
		return 0;
	}
	/* judge_frame left the next frame's header to come: have 0, need HDR. */
	*at = rx->buf + rx->have;
	return rx->need - rx->have;
}

int kvsp_frame_rx_err(const struct kvsp_frame_rx *rx)
{
	return rx->err;
}

uint32_t kvsp_frame_rx_owed(const struct kvsp_frame_rx *rx)
{
	return rx->err ? 0 : rx->owed;
}

/* The header is in: decides how long the frame is, or refuses it. Nothing
 * here is trusted yet; it only bounds what we read before the MAC. */
static int judge_header(struct kvsp_frame_rx *rx)
{
	struct kvs_wire_frame_hdr h;
	memcpy(&h, rx->buf, HDR);

	if (le32toh(h.magic) != KVS_WIRE_FRAME_MAGIC)
		return -EPROTO;
	uint16_t type = le16toh(h.type);
	uint32_t len = kvsp_frame_body_size(type);
	if (!len)
		return -ENOMSG;
	if (le32toh(h.len) != len)
		return -EBADMSG;
	uint32_t plen = le32toh(h.plen);
	if (plen && !has_payload(type))
		return -EMSGSIZE;
	if (plen > rx->max_payload)
		return -E2BIG;
	rx->need = HDR + len;
	return 0;
}

/* Header and body are in: verifies the MAC first, so every later refusal
 * reports what an authenticated peer sent (a replay is -EILSEQ, a forgery
 * -EACCES, whatever its seq says). Returns 1 with *f, or -errno. */
static int judge_frame(struct kvsp_frame_rx *rx, struct kvsp_frame *f)
{
	struct kvs_wire_frame_hdr h;
	uint32_t len = rx->need - HDR;
	const uint8_t *body = rx->buf + HDR;
	uint8_t mac[KVS_WIRE_MAC_SIZE];

	memcpy(&h, rx->buf, HDR);
	frame_mac(rx->key, rx->buf, body, len, mac);
	if (crypto_verify_16(mac, h.mac) != 0)
		return -EACCES;
	if (le64toh(h.seq) != rx->seq)
		return -EILSEQ;
	if (h.flags)
		return -EOPNOTSUPP;
	uint16_t type = le16toh(h.type);
	uint32_t plen = le32toh(h.plen);
	if (has_payload(type) && chunk_len(body) != plen)
		return -ERANGE;

	memset(f, 0, sizeof(*f));
	f->type = type;
	f->plen = plen;
	f->seq = rx->seq;
	memcpy(&f->body, body, len);
	rx->seq++;
	rx->have = 0;
	rx->need = HDR;
	rx->owed = plen;
	return 1;
}

int kvsp_frame_rx_wrote(struct kvsp_frame_rx *rx, size_t n, struct kvsp_frame *f)
{
	if (rx->err)
		return rx->err;
	/* More than was offered has overwritten what lies past the buffer's
	 * frame, or is payload read as header: the stream is lost either way. */
	if (rx->owed || n > rx->need - rx->have)
		return die(rx, -EINVAL);
	rx->have += (uint32_t)n;
	if (rx->have < rx->need)
		return 0;
	if (rx->need == HDR) {
		int r = judge_header(rx);
		if (r < 0)
			return die(rx, r);
		return 0; /* the body is still to come */
	}
	int r = judge_frame(rx, f);
	return r < 0 ? die(rx, r) : r;
}

int kvsp_frame_rx_feed(struct kvsp_frame_rx *rx, const void *bytes, size_t n, size_t *used,
		       struct kvsp_frame *f)
{
	const uint8_t *b = bytes;
	size_t took = 0;
	int r = 0;

	*used = 0;
	if (rx->err)
		return rx->err;
	if (rx->owed)
		return -EBUSY;
	while (took < n) {
		void *at;
		size_t w = kvsp_frame_rx_want(rx, &at);
		if (w > n - took)
			w = n - took;
		memcpy(at, b + took, w);
		took += w;
		r = kvsp_frame_rx_wrote(rx, w, f);
		if (r != 0)
			break;
	}
	*used = took;
	return r;
}

int kvsp_frame_rx_payload(struct kvsp_frame_rx *rx, size_t n)
{
	if (rx->err)
		return rx->err;
	if (n > rx->owed)
		return die(rx, -EINVAL);
	rx->owed -= (uint32_t)n;
	return 0;
}

/* ------------------------------------------------------------------ CRC32C */

/* libkvstage's (shm/crc.c): the engines' end-to-end checksum is the same
 * function, three crc32 chains a 4 KiB block. */
uint32_t kvsp_crc32c(const void *p, size_t n, uint32_t crc)
{
	return kvs_crc32c(p, n, crc);
}
