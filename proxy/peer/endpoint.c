/* SPDX-License-Identifier: MIT */
#include "peer/endpoint.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>

/* The canonical text, from the address alone. */
static void canonical(struct kvsp_endpoint *ep)
{
	char host[INET6_ADDRSTRLEN];
	if (ep->sa.ss_family == AF_INET6) {
		const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)&ep->sa;
		inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
		snprintf(ep->text, sizeof(ep->text), "[%s]:%u", host, ntohs(a->sin6_port));
	} else {
		const struct sockaddr_in *a = (const struct sockaddr_in *)&ep->sa;
		inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
		snprintf(ep->text, sizeof(ep->text), "%s:%u", host, ntohs(a->sin_port));
	}
}

static void set_v4(struct kvsp_endpoint *ep, const void *addr4, uint16_t port)
{
	struct sockaddr_in *a = (struct sockaddr_in *)&ep->sa;
	a->sin_family = AF_INET;
	memcpy(&a->sin_addr, addr4, 4);
	a->sin_port = htons(port);
	ep->len = sizeof(*a);
}

/* An IPv4-mapped IPv6 address is the IPv4 one: one host, one key. */
static void set_v6(struct kvsp_endpoint *ep, const struct in6_addr *addr, uint16_t port)
{
	if (IN6_IS_ADDR_V4MAPPED(addr)) {
		set_v4(ep, addr->s6_addr + 12, port);
		return;
	}
	struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ep->sa;
	a->sin6_family = AF_INET6;
	a->sin6_addr = *addr;
	a->sin6_port = htons(port);
	ep->len = sizeof(*a);
}

static int parse_port(const char *s, uint16_t *port)
{
	size_t n = strlen(s);
	if (n < 1 || n > 5 || strspn(s, "0123456789") != n || (s[0] == '0' && n > 1))
		return -EINVAL;
	unsigned long v = 0;
	for (size_t i = 0; i < n; i++)
		v = v * 10 + (unsigned long)(s[i] - '0');
	if (v > 65535)
		return -EINVAL;
	*port = (uint16_t)v;
	return 0;
}

int kvsp_endpoint_parse(const char *s, struct kvsp_endpoint *ep)
{
	memset(ep, 0, sizeof(*ep));
	size_t n = strnlen(s, KVSP_ENDPOINT_MAX + 1);
	if (n == 0 || n > KVSP_ENDPOINT_MAX)
		return -EINVAL;
	for (size_t i = 0; i < n; i++)
		if ((unsigned char)s[i] <= ' ' || (unsigned char)s[i] >= 0x7f)
			return -EINVAL;
	const char *colon = strrchr(s, ':');
	if (!colon || colon == s)
		return -EINVAL;
	uint16_t port;
	if (parse_port(colon + 1, &port) < 0)
		return -EINVAL;
	char host[64];
	size_t hl = (size_t)(colon - s);
	memcpy(host, s, hl);
	host[hl] = 0;
	if (host[0] == '[') {
		struct in6_addr a6;
		if (hl < 3 || host[hl - 1] != ']')
			return -EINVAL;
		host[hl - 1] = 0;
		if (inet_pton(AF_INET6, host + 1, &a6) != 1)
			return -EINVAL;
		set_v6(ep, &a6, port);
	} else {
		struct in_addr a4;
		if (inet_pton(AF_INET, host, &a4) != 1)
			return -EINVAL;
		set_v4(ep, &a4, port);
	}
	canonical(ep);
	return 0;
}

int kvsp_endpoint_of(struct kvsp_endpoint *ep, const struct sockaddr *sa, socklen_t len)
{
	memset(ep, 0, sizeof(*ep));
	if (sa->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
		const struct sockaddr_in *a = (const struct sockaddr_in *)sa;
		set_v4(ep, &a->sin_addr, ntohs(a->sin_port));
	} else if (sa->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
		const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)sa;
		set_v6(ep, &a->sin6_addr, ntohs(a->sin6_port));
	} else {
		return -EAFNOSUPPORT;
	}
	canonical(ep);
	return 0;
}

uint16_t kvsp_endpoint_port(const struct kvsp_endpoint *ep)
{
	if (ep->sa.ss_family == AF_INET6)
		return ntohs(((const struct sockaddr_in6 *)&ep->sa)->sin6_port);
	return ntohs(((const struct sockaddr_in *)&ep->sa)->sin_port);
}

bool kvsp_endpoint_same_host(const struct kvsp_endpoint *a, const struct kvsp_endpoint *b)
{
	if (a->sa.ss_family != b->sa.ss_family)
		return false;
	if (a->sa.ss_family == AF_INET6)
		return !memcmp(&((const struct sockaddr_in6 *)&a->sa)->sin6_addr,
			       &((const struct sockaddr_in6 *)&b->sa)->sin6_addr,
			       sizeof(struct in6_addr));
	return ((const struct sockaddr_in *)&a->sa)->sin_addr.s_addr ==
	       ((const struct sockaddr_in *)&b->sa)->sin_addr.s_addr;
}

bool kvsp_endpoint_eq(const struct kvsp_endpoint *a, const struct kvsp_endpoint *b)
{
	return kvsp_endpoint_same_host(a, b) && kvsp_endpoint_port(a) == kvsp_endpoint_port(b);
}
