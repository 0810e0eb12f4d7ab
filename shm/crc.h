/* SPDX-License-Identifier: MIT */
/* libkvstage's CRC32C (crc.c), what its tests reach besides the public functions. */
#ifndef KVS_SHM_CRC_H
#define KVS_SHM_CRC_H

#include <stddef.h>
#include <stdint.h>

/* The table path (CPUs without SSE4.2's crc32), raw register form: ~crc in, ~result out. */
uint32_t kvsc_crc32c_sw(uint32_t crc, const void *p, size_t n);
/* The crc32 instruction's path (x86-64 with SSE4.2 only), the same form. */
uint32_t kvsc_crc32c_hw(uint32_t crc, const void *p, size_t n);

#endif
