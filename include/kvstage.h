/* SPDX-License-Identifier: MIT */
/*
 * libkvstage: the client side of the kvstage staging proxy.
 *
 * A client leases fixed-size slots of the proxy's shared pool, fills them,
 * and hands them to a room; only the proxy's transports move slot bytes.
 * Every slot carries an epoch: a lease naming an old epoch is refused.
 *
 * Errors are 0 or a negative errno, liburing style; kvs_strerror() explains.
 * A kvs_client is not thread-safe: use one per thread (connections are cheap).
 *
 * Pointer arguments: a NULL one makes an int-returning call fail with
 * -EINVAL; a void call given NULL does nothing.
 *
 * fork(): a connection belongs to the process that made it. In a child,
 * every call on the parent's connections (and their rooms) fails with
 * -ECHILD and touches nothing the parent shares; kvs_close() there only
 * frees the child's copies. The child does not inherit the pool, nor the
 * rings the connection shares with the proxy (MADV_DONTFORK): a pointer
 * into a slot faults there instead of writing what was already sent. A
 * child that wants the proxy connects anew.
 *
 * Sync calls (acquire, release, the opens, kvs_room_lease past chunk 0)
 * wait for the proxy's answer. They return -EAGAIN while so many events
 * wait unread that the answer could not be told apart from them (call
 * kvs_poll, then again), and -ETIMEDOUT when a live proxy has not answered
 * within the connection's bound (kvs_set_sync_timeout, $KVSTAGE_SYNC_TIMEOUT_MS,
 * default 10000 ms): the connection is then out of step with the proxy and
 * every later call on it fails with -ETIMEDOUT; close it and connect anew.
 */
#ifndef KVSTAGE_H
#define KVSTAGE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVS_VERSION_MAJOR 0
#define KVS_VERSION_MINOR 1
#define KVS_VERSION_PATCH 0
#define KVS_VERSION_STRING "0.1.0"

#define KVS_ROOM_DESC_SIZE 128
#define KVS_DEFAULT_SOCKET "/run/kvstage/kvstaged.sock"

typedef struct kvs_client kvs_client;
typedef struct kvs_room kvs_room;

/* The right to write (sender) or read (receiver) one slot, at one epoch. */
struct kvs_lease {
	uint32_t slot;
	uint32_t epoch;
};

/* Opaque, serialisable; copy it as bytes through your own bootstrap channel. */
struct kvs_room_desc {
	uint8_t bytes[KVS_ROOM_DESC_SIZE];
};

struct kvs_event {
	uint32_t type;		/* KVS_EV_* */
	int32_t status;		/* 0, or -errno saying why */
	uint64_t user_data;	/* the room's, as given at open */
	uint64_t bytes;		/* bytes the room delivered; REJECTED: the refused send's offset */
	struct kvs_lease lease; /* RECV_DONE: chunk 0's slot; REJECTED: the lease the op named */
	uint64_t rsvd[4];	/* zero; later versions add fields here, not at the end */
};

enum {
	KVS_EV_SEND_DONE = 1, /* final: the receiver has every byte */
	KVS_EV_RECV_DONE,     /* final: the room is complete; read it with kvs_room_lease */
	KVS_EV_ABORTED,	      /* final: aborted, and nothing of the room is in flight any more */
	KVS_EV_FAILED,	      /* final: a transport or the proxy failed the room; status says why */
	KVS_EV_REJECTED,      /* not final: the proxy refused one op and changed nothing */
};

/* Connects to the proxy (NULL: $KVSTAGE_SOCKET, else KVS_DEFAULT_SOCKET). Returns 0, or
 * -ENOENT/-ECONNREFUSED (no proxy there), -EACCES (the socket's mode or the proxy refused
 * this uid/gid), -EUSERS (proxy full), -ESHUTDOWN (draining), -EPROTO (version), -ENOEXEC
 * (library and proxy built against DPDKs whose rte_ring differs), -errno. */
int kvs_connect(const char *socket_path, kvs_client **out);
/* Says goodbye and closes; the proxy aborts every room and frees every slot c still holds. */
void kvs_close(kvs_client *c);
/* Bounds every later sync call on c to timeout_ms (< 0: no bound). Returns 0, or -EINVAL. */
int kvs_set_sync_timeout(kvs_client *c, int timeout_ms);

/* Bytes in one slot (the chunk size of every room); 0 for NULL. */
size_t kvs_slot_size(const kvs_client *c);
/* Slots in the pool; 0 for NULL. */
uint32_t kvs_slot_count(const kvs_client *c);
/* Rooms this connection may have open at once; 0 for NULL. */
unsigned kvs_max_rooms(const kvs_client *c);

/* Leases n slots into out[]. Returns 0, or -ENOBUFS (none leased), -EINVAL, -EAGAIN, -ENOTCONN, -ETIMEDOUT. */
int kvs_acquire(kvs_client *c, unsigned n, struct kvs_lease *out);
/* Returns the slot's memory if c holds l now (leased or received), else NULL. */
void *kvs_lease_ptr(kvs_client *c, const struct kvs_lease *l);
/* Gives l back. Returns 0, or -ESTALE (old epoch), -EPERM (not c's), -EBUSY (in flight, or a
 * shared room's while another reader has it), -EINVAL, -EAGAIN, -ENOTCONN, -ETIMEDOUT. */
int kvs_release(kvs_client *c, const struct kvs_lease *l);

/* Opens a receiving room of bytes; fills desc for the sender. Returns 0, or -EMFILE (no room handle free), -EMSGSIZE, -ENFILE, -ESHUTDOWN, -EAGAIN, -errno. */
int kvs_recv_open(kvs_client *c, uint64_t bytes, uint64_t user_data, kvs_room **room,
		  struct kvs_room_desc *desc);
/* Readers a shared room may have, its opener included. */
#define KVS_MAX_READERS 8
/* As kvs_recv_open, for a room that readers clients of this proxy read (2 to KVS_MAX_READERS,
 * this one included; each other one joins with kvs_recv_join and desc): its bytes cross once
 * and land once. It completes (RECV_DONE to every reader) once every byte has landed and every
 * reader has joined; an abort by any reader ends it for all; its slots go back to the pool when
 * the last reader closes it. Returns as kvs_recv_open, or -EINVAL (readers out of range). */
int kvs_recv_open_shared(kvs_client *c, uint64_t bytes, unsigned readers, uint64_t user_data,
			 kvs_room **room, struct kvs_room_desc *desc);
/* Joins the shared room desc names, on c's proxy, as one of its readers. Returns 0, or -EPERM
 * (bad token), -ESTALE (room gone, or another proxy's), -ECANCELED (it ended), -EINVAL (not a
 * shared room), -EUSERS (every reader has joined), -EMFILE, -EAGAIN, -errno. */
int kvs_recv_join(kvs_client *c, const struct kvs_room_desc *desc, uint64_t user_data,
		  kvs_room **room);
/* Opens the sending side of the room desc names. Returns 0, or -EPERM (bad token), -ESTALE (room gone), -ECANCELED, -EBUSY (has a sender), -ENOSR (peer sessions full), -EAGAIN, -errno. */
int kvs_send_open(kvs_client *c, const struct kvs_room_desc *desc, uint64_t user_data,
		  kvs_room **room);
/* Hands leased slot l, holding the chunk at offset (len bytes), to the room; l is no longer c's.
 * Returns 0, or -EINVAL, -EEXIST (chunk sent), -ESTALE, -EPERM, -EBUSY, -EBADF (not an open
 * sending room), -EALREADY (the room is complete), the room's final status (it ended), -EAGAIN. */
int kvs_send(kvs_room *r, const struct kvs_lease *l, uint64_t offset, uint32_t len);
/* Aborts the room from either side; idempotent. Returns 0, or -EBADF, -ENOTCONN, -EAGAIN (ring full). */
int kvs_abort(kvs_room *r);
/* Receiver: the lease of the slot holding chunk i, once complete. Returns 0, or -EAGAIN (not complete), -ERANGE, -EBADF, the room's final status, -errno. */
int kvs_room_lease(kvs_room *r, unsigned i, struct kvs_lease *out);
/* Closes the room: aborts it if unfinished, releases what it still holds; r is invalid after
 * (a second close, or any call with r, is -EBADF). Returns 0, or -EBADF, -EAGAIN, -errno. */
int kvs_room_close(kvs_room *r);
/* Chunks in the room (bytes cut into slot-size pieces); 0 for a stale or NULL handle. */
unsigned kvs_room_chunks(const kvs_room *r);
/* Bytes of the room; 0 for a stale or NULL handle. */
uint64_t kvs_room_bytes(const kvs_room *r);

/* Takes up to max waiting events without blocking. Returns the count, or -ENOTCONN, -ETIMEDOUT, -EINVAL. */
int kvs_poll(kvs_client *c, struct kvs_event *ev, unsigned max);
/* Waits (blocked, not spinning) for one event until timeout_ms from now, signals or not.
 * Returns 1, or -ETIMEDOUT, -ENOTCONN, -EINVAL; timeout_ms < 0 waits for ever. */
int kvs_wait(kvs_client *c, struct kvs_event *ev, int timeout_ms);
/* An fd that is readable when events may be waiting or the proxy is gone (then call
 * kvs_poll, which says -ENOTCONN once it is gone); from the first call on, the proxy
 * signals it for every batch of events. Never read it yourself. Returns the fd, or -errno. */
int kvs_event_fd(kvs_client *c);

/*
 * For companion libraries (libkvstage_cuda, ...) that extend a connection.
 */
/* The pool as c maps it (slot i at i * kvs_slot_size(c)), for registering with a DMA API; len may be NULL. NULL for a NULL or forked c. */
void *kvs_pool_map(kvs_client *c, size_t *len);
/* Returns 0 if c holds l now (as kvs_lease_ptr sees it), or -EINVAL (no such slot), -ESTALE, -EPERM, -EBUSY (in flight), -ECHILD. */
int kvs_lease_check(kvs_client *c, const struct kvs_lease *l);
/* Attaches state under key; kvs_close calls fini(c, state) before it unmaps the pool. Returns 0, or -EEXIST, -ENOSPC, -EINVAL. */
int kvs_ext_attach(kvs_client *c, const void *key, void *state,
		   void (*fini)(kvs_client *c, void *state));
/* The state attached under key, or NULL. */
void *kvs_ext_get(const kvs_client *c, const void *key);

/*
 * End-to-end checksums an engine computes as it copies into slots and its peer checks before it
 * copies out: CRC32C (Castagnoli), chainable (crc 0 to start).
 */
/* Returns the CRC32C of n bytes at p, continuing crc. */
uint32_t kvs_crc32c(const void *p, size_t n, uint32_t crc);
/* Copies n bytes from src to dst (apart) in one pass over memory; returns their CRC32C, continuing crc. */
uint32_t kvs_copy_crc32c(void *dst, const void *src, size_t n, uint32_t crc);
/* Returns the CRC32C of A then B, from A's CRC, B's CRC and B's length. */
uint32_t kvs_crc32c_combine(uint32_t crc_a, uint32_t crc_b, size_t len_b);

/* A static string explaining a (negative) kvstage error code. */
const char *kvs_strerror(int err);
/* The library's version, KVS_VERSION_STRING at build time. */
const char *kvs_version(void);

#ifdef __cplusplus
}
#endif
#endif /* KVSTAGE_H */
