/* SPDX-License-Identifier: MIT */
/* Command-line numbers, parsed one way for kvstaged and every tool. */
#ifndef KVS_SHM_PARSE_H
#define KVS_SHM_PARSE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* Parses decimal BYTES with an optional K, M or G suffix (powers of 1024;
 * "K", "Ki", "KiB", "KB" and "k" alike; a plain number may end in "B")
 * into *out. Returns 0, or -EINVAL. */
int kvs_parse_size(const char *s, uint64_t *out);
/* Parses a plain decimal number, digits only (no sign, space or suffix), at
 * most max, into *out. Returns 0, or -EINVAL. */
int kvs_parse_uint(const char *s, uint64_t max, uint64_t *out);
/* Writes bytes for people ("512 KiB", "1.5 GiB", "12 bytes") into buf. Returns buf. */
const char *kvs_format_size(uint64_t bytes, char *buf, size_t len);
/* Writes s to f as a JSON string (RFC 8259) in its double quotes: '"' and '\\'
 * backslash-escaped, control characters (and DEL) as \u00XX, valid UTF-8
 * as is, and each byte that is not part of valid UTF-8 as \ufffd (JSON text
 * must be UTF-8, a path need not be); NULL as null. Returns 0, or -1 if
 * writing failed. */
int kvs_json_string(FILE *f, const char *s);

#endif
