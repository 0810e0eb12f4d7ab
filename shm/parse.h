/* SPDX-License-Identifier: MIT */
/* Command-line numbers, parsed one way for kvstaged and every tool. */
#ifndef KVS_SHM_PARSE_H
#define KVS_SHM_PARSE_H

#include <stdint.h>

/* Parses decimal BYTES with an optional K, M or G suffix (powers of 1024;
 * "K", "Ki", "KiB", "KB" and "k" alike; a plain number may end in "B")
 * into *out. Returns 0, or -EINVAL. */
int kvs_parse_size(const char *s, uint64_t *out);

#endif
