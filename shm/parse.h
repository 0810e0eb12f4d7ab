/* SPDX-License-Identifier: MIT */
/* Command-line numbers, parsed one way for kvstaged and every tool. */
#ifndef KVS_SHM_PARSE_H
#define KVS_SHM_PARSE_H

#include <stddef.h>
#include <stdint.h>

/* Parses decimal BYTES with an optional K, M or G suffix (powers of 1024;
 * "K", "Ki", "KiB", "KB" and "k" alike; a plain number may end in "B")
 * into *out. Returns 0, or -EINVAL. */
int kvs_parse_size(const char *s, uint64_t *out);
/* Parses a plain decimal number, digits only (no sign, space or suffix), at
 * most max, into *out. Returns 0, or -EINVAL. */
int kvs_parse_uint(const char *s, uint64_t max, uint64_t *out);
/* Writes bytes for people ("512 KiB", "1.5 GiB", "12 bytes") into buf. Returns buf. */
const char *kvs_format_size(uint64_t bytes, char *buf, size_t len);

#endif
