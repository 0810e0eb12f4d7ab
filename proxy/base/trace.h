/* SPDX-License-Identifier: MIT */
/*
 * The lifecycle trace (--trace-file): fixed-size records that the loop
 * pushes into a single-producer, single-consumer rte_ring in our own
 * memory, and a writer thread that formats each as one JSON line and
 * writes it to a file or a unix socket (design note 45).
 *
 * The loop never waits on it: a full ring drops the record and counts it
 * (trace_dropped), and the one syscall the loop may make is a futex wake
 * when the writer sleeps on an empty ring. Everything slow (formatting,
 * write(), a socket's peer) is the writer's. Records name rooms by their
 * key (the receiving proxy's instance, the room and its generation), never
 * by their token.
 */
#ifndef KVSP_TRACE_H
#define KVSP_TRACE_H

#include <stddef.h>
#include <stdint.h>

/* Events, in the order of a room's life; kvstaged(8) maps each to the state machine. */
enum kvsp_trace_event {
	KVSP_TR_ROOM_OPENED = 0,
	KVSP_TR_CHUNK_QUEUED,
	KVSP_TR_CHUNK_SENT,
	KVSP_TR_CHUNK_LANDED,
	KVSP_TR_ROOM_FINAL,
	KVSP_TR_ROOM_FENCED,
	KVSP_TR_SLOT_TOMBSTONED,
	KVSP_TR_ROOM_REAPED,
	KVSP_TR_NEVENTS
};

enum kvsp_trace_side { KVSP_TR_RECV = 0, KVSP_TR_SEND };

/* What a record carries besides its event, side and room (has). */
#define KVSP_TR_BYTES 0x1u
#define KVSP_TR_CHUNK 0x2u
#define KVSP_TR_STATUS 0x4u
#define KVSP_TR_FINAL 0x8u

/* One event: 56 bytes, copied into the ring and out of it. */
struct kvsp_trace_rec {
	uint64_t wall_ns, mono_ns; /* stamped by kvsp_trace_push */
	uint64_t instance;	   /* the room key: the receiving proxy's instance, */
	uint32_t room, gen;	   /* ... its room index and generation */
	uint64_t bytes;
	uint32_t chunk;
	int32_t status;
	uint8_t event, side, has;
	uint8_t final; /* KVS_EV_SEND_DONE ... KVS_EV_FAILED */
	uint32_t rsvd;
};

struct kvsp_trace;

/* Where the writer reports, and what can hold it (all optional but the counters). */
struct kvsp_trace_conf {
	uint64_t instance; /* the proxy writing the lines */
	uint64_t *written; /* published counters: lines written (the writer's alone), */
	uint64_t *dropped; /* ... records dropped (ring full, or the sink failed) */
	/* Test-only (--failpoints): while *hold is 1 (KVS_FP_PAUSE) the writer
	 * takes nothing from the ring; when it first stops there it adds one to
	 * *hits. It writes wake_fd then and after each batch written, so the
	 * loop answers an admin barrier on the hold or the counters. */
	const uint8_t *hold;
	uint64_t *hits;
	int wake_fd;
};

/* Opens the sink (a file, appended to, or "unix:PATH", a stream or datagram
 * socket) and a ring of exactly records records. Returns NULL with why. */
struct kvsp_trace *kvsp_trace_open(const char *where, uint32_t records, char *why, size_t n);
/* Starts the writer thread. Returns 0, or -errno. */
int kvsp_trace_start(struct kvsp_trace *t, const struct kvsp_trace_conf *conf);
/* Stamps rec and queues it, or drops and counts it; never a syscall (the
 * writer is woken by kvsp_trace_flush). */
void kvsp_trace_push(struct kvsp_trace *t, struct kvsp_trace_rec *rec);
/* Wakes the writer if records were queued since the last call and it
 * sleeps: the loop calls it once a pass, so a busy pass costs one wakeup at
 * most, not one a record. */
void kvsp_trace_flush(struct kvsp_trace *t);
/* The hold may have changed: the writer looks again. */
void kvsp_trace_kick(struct kvsp_trace *t);
/* Lets the writer write everything queued (a hold no longer holds), stops
 * it, closes the sink and frees t. NULL: nothing. */
void kvsp_trace_close(struct kvsp_trace *t);
/* Formats rec as one JSON line (with its newline) into buf. Returns its length. */
size_t kvsp_trace_format(const struct kvsp_trace_rec *rec, uint64_t instance, char *buf, size_t n);

#endif
