/* SPDX-License-Identifier: MIT */
#include "parse.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>

int kvs_parse_size(const char *s, uint64_t *out)
{
	if (!s || *s < '0' || *s > '9') /* no sign, no space: strtoull would take them */
		return -EINVAL;
	char *end;
	errno = 0;
	unsigned long long v = strtoull(s, &end, 10);
	if (errno)
		return -EINVAL;
	unsigned shift = 0;
	switch (*end) {
	case 'k': case 'K': shift = 10; end++; break;
	case 'm': case 'M': shift = 20; end++; break;
	case 'g': case 'G': shift = 30; end++; break;
	}
	if (shift && (*end == 'i' || *end == 'I'))
		end++;
	if (*end == 'B' || *end == 'b')
		end++;
	if (*end || (shift && v > (ULLONG_MAX >> shift)))
		return -EINVAL;
	*out = (uint64_t)v << shift;
	return 0;
}
