/* SPDX-License-Identifier: MIT */
#include "parse.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
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
	case 'k':
	case 'K':
		shift = 10;
		end++;
		break;
	case 'm':
	case 'M':
		shift = 20;
		end++;
		break;
	case 'g':
	case 'G':
		shift = 30;
		end++;
		break;
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

int kvs_parse_uint(const char *s, uint64_t max, uint64_t *out)
{
	if (!s || *s < '0' || *s > '9')
		return -EINVAL;
	char *end;
	errno = 0;
	unsigned long long v = strtoull(s, &end, 10);
	if (errno || *end || v > max)
		return -EINVAL;
	*out = v;
	return 0;
}

const char *kvs_format_size(uint64_t bytes, char *buf, size_t len)
{
	static const char *const unit[] = { "KiB", "MiB", "GiB", "TiB" };
	if (bytes < 1024) {
		snprintf(buf, len, "%llu bytes", (unsigned long long)bytes);
		return buf;
	}
	double v = (double)bytes / 1024;
	unsigned u = 0;
	while (v >= 1024 && u < 3) {
		v /= 1024;
		u++;
	}
	if (v == (double)(uint64_t)v)
		snprintf(buf, len, "%llu %s", (unsigned long long)v, unit[u]);
	else
		snprintf(buf, len, "%.1f %s", v, unit[u]);
	return buf;
}

/* Length of the valid UTF-8 sequence at p (1 to 4), or 0 if it is not one
 * (overlong forms, surrogates and code points above U+10FFFF are not). */
static int utf8_len(const unsigned char *p)
{
	unsigned char c = p[0];
	int n;
	unsigned char lo = 0x80, hi = 0xbf; /* the second byte's range */
	if (c >= 0xc2 && c <= 0xdf) {
		n = 2;
	} else if (c >= 0xe0 && c <= 0xef) {
		n = 3;
		if (c == 0xe0)
			lo = 0xa0; /* overlong */
		if (c == 0xed)
			hi = 0x9f; /* surrogates */
	} else if (c >= 0xf0 && c <= 0xf4) {
		n = 4;
		if (c == 0xf0)
			lo = 0x90; /* overlong */
		if (c == 0xf4)
			hi = 0x8f; /* above U+10FFFF */
	} else {
		return 0; /* a continuation byte, an overlong lead, or 0xf5 and up */
	}
	if (p[1] < lo || p[1] > hi)
		return 0;
	for (int i = 2; i < n; i++)
		if (p[i] < 0x80 || p[i] > 0xbf) /* the NUL terminator stops here too */
			return 0;
	return n;
}

int kvs_json_string(FILE *f, const char *s)
{
	if (!s)
		return fputs("null", f) == EOF ? -1 : 0;
	putc('"', f);
	for (const unsigned char *p = (const unsigned char *)s; *p;) {
		if (*p == '"' || *p == '\\') {
			putc('\\', f);
			putc(*p++, f);
		} else if (*p < 0x20 || *p == 0x7f) {
			fprintf(f, "\\u%04x", *p++);
		} else if (*p < 0x80) {
			putc(*p++, f);
		} else {
			int n = utf8_len(p);
			if (n) {
				fwrite(p, 1, (size_t)n, f);
				p += n;
			} else {
				fputs("\\ufffd", f);
				p++;
			}
		}
	}
	putc('"', f);
	return ferror(f) ? -1 : 0;
}
