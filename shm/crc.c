/* SPDX-License-Identifier: MIT */
/*
 * libkvstage: CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the
 * checksum an engine's copy into slots computes and its peer checks before it
 * copies out, and the proxy's chunk CRC on the tcp path. DPDK's rte_hash_crc
 * computes the same with the same instruction, but its header needs
 * librte_eal (its CPU flag query), which a client library does not link, and
 * it runs one chain of it; this runs three.
 *
 * Standard form: start from ~0, end inverted, so kvs_crc32c(b, m,
 * kvs_crc32c(a, n, 0)) is the CRC of a then b.
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "crc.h"
#include "kvstage.h"

#define POLY 0x82F63B78u

/* crc32 has a latency of three cycles and a throughput of one: one chain
 * of it runs at a third of what the instruction can do. A block of BLOCK
 * bytes is CRCed as three lanes at once (LANE, LANE, LANE_C bytes) whose
 * CRCs are then joined by shifting (the CRC of n zero bytes, a table). */
#define BLOCK 4096
#define LANE 1360 /* a multiple of 8, BLOCK / 3 at most */
#define LANE_C (BLOCK - 2 * LANE)

static uint32_t table[8][256]; /* slicing by 8, when the CPU has no crc32 */
static uint32_t shift_lane[4][256], shift_lane_c[4][256];
static bool have_sse42;

/* GF(2) matrices of 32 x 32 bits, as zlib's crc32_combine: mat[i] is the
 * image of bit i. zeros_pow[k]: what 2^k zero bytes more do to a CRC (raw
 * or final: the same linear map), so n zero bytes cost one product per bit
 * of n. */
static uint32_t zeros_pow[64][32];

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec)
{
	uint32_t sum = 0;
	for (; vec; vec >>= 1, mat++)
		if (vec & 1)
			sum ^= *mat;
	return sum;
}

static void make_zeros_pow(void)
{
	uint32_t bit[32], two[32];
	bit[0] = POLY; /* one zero bit */
	for (int i = 1; i < 32; i++)
		bit[i] = 1u << (i - 1);
	for (int k = 0; k < 3; k++) { /* 2, 4, 8 bits: one byte */
		for (int i = 0; i < 32; i++)
			two[i] = gf2_times(bit, bit[i]);
		memcpy(bit, two, sizeof(bit));
	}
	memcpy(zeros_pow[0], bit, sizeof(bit));
	for (int k = 1; k < 64; k++)
		for (int i = 0; i < 32; i++)
			zeros_pow[k][i] = gf2_times(zeros_pow[k - 1], zeros_pow[k - 1][i]);
}

/* crc followed by n zero bytes. */
static uint32_t zeros(uint32_t crc, size_t n)
{
	for (int k = 0; n; n >>= 1, k++)
		if (n & 1)
			crc = gf2_times(zeros_pow[k], crc);
	return crc;
}

/* t: zeros(., n) as tables, a byte of the CRC at a time (four lookups). */
static void make_shift(uint32_t t[4][256], size_t n)
{
	uint32_t col[32];
	for (int i = 0; i < 32; i++)
		col[i] = zeros(1u << i, n);
	for (int k = 0; k < 4; k++)
		for (uint32_t b = 0; b < 256; b++)
			t[k][b] = gf2_times(col + 8 * k, b);
}

static inline uint32_t shift(const uint32_t t[4][256], uint32_t c)
{
	return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
}

__attribute__((constructor)) static void crc_init(void)
{
#if defined(__x86_64__)
	have_sse42 = __builtin_cpu_supports("sse4.2");
#endif
	for (uint32_t i = 0; i < 256; i++) {
		uint32_t c = i;
		for (int k = 0; k < 8; k++)
			c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
		table[0][i] = c;
	}
	for (uint32_t i = 0; i < 256; i++)
		for (int t = 1; t < 8; t++)
			table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xff];
	make_zeros_pow();
	make_shift(shift_lane, LANE);
	make_shift(shift_lane_c, LANE_C);
}

uint32_t kvsc_crc32c_sw(uint32_t crc, const void *p, size_t n)
{
	const uint8_t *b = p;

	for (; n >= 8; n -= 8, b += 8) {
		uint64_t w;
		memcpy(&w, b, 8); /* any alignment: UBSan-clean */
		w ^= crc;
		crc = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^ table[5][(w >> 16) & 0xff] ^
		      table[4][(w >> 24) & 0xff] ^ table[3][(w >> 32) & 0xff] ^
		      table[2][(w >> 40) & 0xff] ^ table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
	}
	while (n--)
		crc = (crc >> 8) ^ table[0][(crc ^ *b++) & 0xff];
	return crc;
}

#if defined(__x86_64__)
static inline uint64_t load64(const uint8_t *b)
{
	uint64_t w;
	memcpy(&w, b, 8);
	return w;
}

__attribute__((target("sse4.2"))) uint32_t kvsc_crc32c_hw(uint32_t crc, const void *p, size_t n)
{
	const uint8_t *b = p;
	uint64_t c = crc;

	for (; n >= BLOCK; n -= BLOCK, b += BLOCK) {
		/* Three independent chains; lanes B and C start from 0, and
		 * raw(A || B) = shift(raw(A), |B|) ^ raw(0, B). */
		uint64_t x = 0, y = 0;
		for (size_t i = 0; i < LANE; i += 8) {
			c = __builtin_ia32_crc32di(c, load64(b + i));
			x = __builtin_ia32_crc32di(x, load64(b + LANE + i));
			y = __builtin_ia32_crc32di(y, load64(b + 2 * LANE + i));
		}
		for (size_t i = LANE; i < LANE_C; i += 8)
			y = __builtin_ia32_crc32di(y, load64(b + 2 * LANE + i));
		c = shift(shift_lane_c, shift(shift_lane, (uint32_t)c) ^ (uint32_t)x) ^ (uint32_t)y;
	}
	for (; n >= 8; n -= 8, b += 8)
		c = __builtin_ia32_crc32di(c, load64(b));
	crc = (uint32_t)c;
	while (n--)
		crc = __builtin_ia32_crc32qi(crc, *b++);
	return crc;
}
#endif

static uint32_t crc_raw(uint32_t crc, const void *p, size_t n)
{
#if defined(__x86_64__)
	if (have_sse42)
		return kvsc_crc32c_hw(crc, p, n);
#endif
	return kvsc_crc32c_sw(crc, p, n);
}

uint32_t kvs_crc32c(const void *p, size_t n, uint32_t crc)
{
	return ~crc_raw(~crc, p, n);
}

/* The copy goes a block at a time, so the CRC reads back what it just wrote
 * from L1: one pass over memory. */
uint32_t kvs_copy_crc32c(void *dst, const void *src, size_t n, uint32_t crc)
{
	uint8_t *d = dst;
	const uint8_t *s = src;

	crc = ~crc;
	while (n) {
		size_t m = n < BLOCK ? n : BLOCK;
		memcpy(d, s, m);
		crc = crc_raw(crc, d, m);
		d += m, s += m, n -= m;
	}
	return ~crc;
}

uint32_t kvs_crc32c_combine(uint32_t crc_a, uint32_t crc_b, size_t len_b)
{
	return zeros(crc_a, len_b) ^ crc_b;
}
