/* SPDX-License-Identifier: MIT */
/* Canary payloads: every 8-byte word names its owner and offset, so a
 * misplaced or foreign byte is caught and attributed. */
#ifndef KVS_TOOLS_CANARY_H
#define KVS_TOOLS_CANARY_H

#include <stdint.h>
#include <string.h>

static inline uint64_t canary_word(uint64_t owner, uint64_t off)
{
	uint64_t x = owner * 0x9e3779b97f4a7c15ull ^ off;
	x ^= x >> 29;
	x *= 0xbf58476d1ce4e5b9ull;
	return x ^ (x >> 32);
}

/* Fills len bytes of p, the chunk at byte offset off of owner's payload. */
static inline void canary_fill(void *p, uint64_t owner, uint64_t off, uint64_t len)
{
	uint8_t *b = p;
	uint64_t i = 0;
	for (; i + 8 <= len; i += 8) {
		uint64_t w = canary_word(owner, off + i);
		memcpy(b + i, &w, 8);
	}
	if (i < len) {
		uint64_t w = canary_word(owner, off + i);
		memcpy(b + i, &w, len - i);
	}
}

/* Returns the offset of the first wrong 8-byte word within len (a multiple of 8),
 * or len if every byte is right. */
static inline uint64_t canary_check(const void *p, uint64_t owner, uint64_t off, uint64_t len)
{
	const uint8_t *b = p;
	uint64_t i = 0;
	for (; i + 8 <= len; i += 8) {
		uint64_t w = canary_word(owner, off + i);
		if (memcmp(b + i, &w, 8))
			return i;
	}
	if (i < len) {
		uint64_t w = canary_word(owner, off + i);
		if (memcmp(b + i, &w, len - i))
			return i;
	}
	return len;
}

#endif
