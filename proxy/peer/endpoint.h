/* SPDX-License-Identifier: MIT */
/*
 * Endpoints: where a proxy is reached, "IPV4:PORT" or "[IPV6]:PORT". Parsed
 * once, strictly, into an address; everything after that (sessions, the
 * peer table, log lines) uses the address and its one canonical spelling,
 * never the text it came as. So "127.0.0.1:17607" has no second spelling
 * that names another session, and no byte of a descriptor's endpoint
 * reaches a log line or kvstage-stat unchecked.
 */
#ifndef KVSP_ENDPOINT_H
#define KVSP_ENDPOINT_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>

/* Longest text an endpoint may have: "tcp:" and it fit a descriptor's 64 bytes. */
#define KVSP_ENDPOINT_MAX 59

struct kvsp_endpoint {
	struct sockaddr_storage sa; /* AF_INET or AF_INET6; an IPv4-mapped IPv6 address is AF_INET */
	socklen_t len;
	char text[64]; /* canonical: inet_ntop's address, ":", the port in decimal */
};

/* Parses s: a numeric IPv4 address (inet_pton's strict form) or a bracketed
 * IPv6 one, ':', and a port of 1 to 5 decimal digits without a sign or a
 * leading zero (only "0" itself), at most 65535. Nothing else is taken: no
 * whitespace, control or non-ASCII byte anywhere, no host name (the loop
 * never waits for DNS), no zone. Returns 0, or -EINVAL (*ep zeroed). */
int kvsp_endpoint_parse(const char *s, struct kvsp_endpoint *ep);
/* The endpoint of a peer's socket address (accept, getpeername). Returns 0, or -EAFNOSUPPORT. */
int kvsp_endpoint_of(struct kvsp_endpoint *ep, const struct sockaddr *sa, socklen_t len);
/* True if a and b are one address and one port. */
bool kvsp_endpoint_eq(const struct kvsp_endpoint *a, const struct kvsp_endpoint *b);
/* True if a and b are one address, whatever their ports. */
bool kvsp_endpoint_same_host(const struct kvsp_endpoint *a, const struct kvsp_endpoint *b);
/* The port. */
uint16_t kvsp_endpoint_port(const struct kvsp_endpoint *ep);

#endif
