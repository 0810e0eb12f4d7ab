"""Client, leases, rooms and events over libkvstage (include/kvstage.h).

Safety rule: a slot's memory is never reachable from Python once its lease is
gone. Every memoryview handed out is tracked and released when its lease is
sent or released, or when its room or client closes; a call that would end a
lease while a buffer derived from one of its views (a slice, a cast, a numpy
array) is still alive raises BufferError instead and leaves the lease as it was.
(ctypes from_buffer/from_address keep raw pointers and are outside this rule.)

A Client, like a kvs_client, is not thread-safe: use one per thread.
"""
import builtins
import ctypes
import errno as _errno
import functools
import math
import os
import time
import weakref
from collections import namedtuple
from dataclasses import dataclass
from enum import IntEnum

from ._lib import KVS_MAX_READERS, KVS_ROOM_DESC_SIZE, kvs_event, kvs_lease, kvs_room_desc, lib
from .errors import KvstageError, check, error


class EventType(IntEnum):
    """KVS_EV_*: the kinds of struct kvs_event."""
    SEND_DONE = 1  # final: the receiver has every byte
    RECV_DONE = 2  # final: the room is complete; read it with room.lease(i)
    ABORTED = 3    # final: aborted, and nothing of the room is in flight any more
    FAILED = 4     # final: a transport or the proxy failed the room; status says why
    REJECTED = 5   # not final: the proxy refused one op and changed nothing


KVS_EV_SEND_DONE = EventType.SEND_DONE
KVS_EV_RECV_DONE = EventType.RECV_DONE
KVS_EV_ABORTED = EventType.ABORTED
KVS_EV_FAILED = EventType.FAILED
KVS_EV_REJECTED = EventType.REJECTED

LeaseId = namedtuple("LeaseId", "slot epoch")

_SLICE_S = 0.1  # wait() blocks in slices this long, so Python signal handlers run


def _uint(v, bits, what):
    """Returns v if it is an int in [0, 2**bits), raises TypeError/ValueError otherwise."""
    if not isinstance(v, int):
        raise TypeError(f"{what} must be an int, not {type(v).__name__}")
    if not 0 <= v < 1 << bits:
        raise ValueError(f"{what} out of range: {v}")
    return v


@functools.lru_cache(maxsize=None)
def _buf_type(n):
    """Returns a ctypes byte-array type of n bytes whose instances take weak references."""
    return type(f"_Slot{n}", (ctypes.c_ubyte * n,), {})


@dataclass(frozen=True)
class Event:
    """One struct kvs_event: type (EventType, or int if unknown), status (0 or -errno), user_data, bytes, lease."""
    type: int
    status: int
    user_data: int
    bytes: int
    lease: LeaseId

    @classmethod
    def _from(cls, ev):
        """Returns the Event for a struct kvs_event."""
        try:
            t = EventType(ev.type)
        except ValueError:
            t = ev.type
        return cls(t, ev.status, ev.user_data, ev.bytes, LeaseId(ev.lease.slot, ev.lease.epoch))

    @property
    def final(self):
        """Returns True for the one final event of a room's side (all but REJECTED)."""
        return self.type != EventType.REJECTED

    @property
    def error(self):
        """Returns the KvstageError that status names, or None when status is 0."""
        return error(self.status, f"event {getattr(self.type, 'name', self.type)}") if self.status else None


class Lease:
    """The right to write (leased) or read (received) one slot at one epoch; .slot, .epoch, .readonly."""

    __slots__ = ("_client", "_l", "readonly", "_room", "__weakref__")

    def __init__(self, client, slot, epoch, readonly=False, room=None):
        self._client = client
        self._l = kvs_lease(slot, epoch)
        self.readonly = readonly
        self._room = room  # a received lease keeps its room alive

    slot = property(lambda self: self._l.slot, doc="The slot's index in the pool.")
    epoch = property(lambda self: self._l.epoch, doc="The slot's epoch this lease names.")
    key = property(lambda self: (self._l.slot, self._l.epoch), doc="(slot, epoch).")

    def view(self):
        """Returns a memoryview of the slot (slot_size bytes; read-only if received), raises
        StaleLease/PermissionDenied/Busy if not held now."""
        room = self._client._held_check(self)
        ptr = lib.kvs_lease_ptr(self._client._h, ctypes.byref(self._l))
        if not ptr:
            raise error(-_errno.ESTALE, "kvs_lease_ptr")
        arr = _buf_type(self._client.slot_size).from_address(ptr)
        ref = weakref.ref(arr)
        mv = memoryview(arr).cast("B")
        if self.readonly or room is not None:
            mv = mv.toreadonly()
        del arr  # from now on only views (ours, or derived from ours) keep it alive
        self._client._views.setdefault(self.key, []).append((mv, ref))
        return mv

    @property
    def address(self):
        """The slot's address, with view()'s checks; for a C call that reads or writes it at once (a checksum), never
        to keep: a view is invalidated when the lease ends, an address is not."""
        self._client._held_check(self)
        ptr = lib.kvs_lease_ptr(self._client._h, ctypes.byref(self._l))
        if not ptr:
            raise error(-_errno.ESTALE, "kvs_lease_ptr")
        return ptr

    def __eq__(self, other):
        return isinstance(other, Lease) and other._client is self._client and other.key == self.key

    def __hash__(self):
        return hash((id(self._client), self.key))

    def __repr__(self):
        return f"Lease(slot={self.slot}, epoch={self.epoch}{', readonly' if self.readonly else ''})"


class Client:
    """A connection to kvstaged (kvs_connect); a context manager. Not thread-safe."""

    def __init__(self, socket_path=None):
        """Connects (None: $KVSTAGE_SOCKET, else the default socket); raises KvstageError (ENOENT, ECONNREFUSED, EACCES,
        ...)."""
        self._h = None
        h = ctypes.c_void_p()
        path = None if socket_path is None else os.fsencode(socket_path)
        check(lib.kvs_connect(path, ctypes.byref(h)), "kvs_connect")
        self._h = h.value
        self._views = {}  # (slot, epoch) -> [(memoryview, weakref to its exporter)]
        # (slot, epoch) -> None (from acquire) or the RecvRoom (from its lease(i)): what this
        # client holds and has not given away. A send or room close is async: until the proxy
        # takes it the slot table still says ours, so views are only made for what is here.
        self._holds = {}
        self._sent = {}  # slot -> epoch sent, until a REJECTED event gives it back or the slot comes back
        self._fd = None
        self._geometry = (lib.kvs_slot_size(self._h), lib.kvs_slot_count(self._h), lib.kvs_max_rooms(self._h))

    slot_size = property(lambda self: self._geometry[0], doc="Bytes in one slot (the chunk size of every room).")
    slot_count = property(lambda self: self._geometry[1], doc="Slots in the pool.")
    max_rooms = property(lambda self: self._geometry[2], doc="Rooms this connection may have open at once.")

    def _c(self):
        """Returns the kvs_client pointer, raises BadHandle if closed."""
        if self._h is None:
            raise error(-_errno.EBADF, None, "the client is closed")
        return self._h

    @property
    def closed(self):
        """True once close() has run."""
        return self._h is None

    def _own(self, lease):
        """Returns lease if it is this client's, raises TypeError/ValueError otherwise."""
        if not isinstance(lease, Lease):
            raise TypeError(f"expected a Lease, not {type(lease).__name__}")
        if lease._client is not self:
            raise ValueError(f"{lease!r} belongs to another Client")
        return lease

    def _held_check(self, lease):
        """Returns the RecvRoom lease came from (None if acquired), raises the slot table's verdict
        (StaleLease, PermissionDenied, Busy), else Busy if this client sent it, closed its room or never had it."""
        check(lib.kvs_lease_check(self._c(), ctypes.byref(lease._l)), "kvs_lease_check")
        try:
            return self._holds[lease.key]
        except KeyError:
            raise error(-_errno.EBUSY, None,
                        "not held: sent, its room closed, or never had from acquire() or room.lease()") from None

    def _got(self, slot, epoch, room):
        """Records a lease the proxy handed out (room: the RecvRoom, or None)."""
        self._holds[(slot, epoch)] = room
        self._sent.pop(slot, None)  # the slot is ours at a new epoch: that send was taken

    def _event(self, ev):
        """Returns the Event of struct ev; a REJECTED send gives its lease back to us."""
        e = Event._from(ev)
        if e.type == EventType.REJECTED and self._sent.get(e.lease.slot) == e.lease.epoch:
            self._got(e.lease.slot, e.lease.epoch, None)
        return e

    def _kill_views(self, keys):
        """Releases every view handed out for keys; raises BufferError (and keeps tracking) while a derived buffer
        lives."""
        alive = []
        for k in list(keys):
            for mv, ref in self._views.pop(k, ()):
                try:
                    mv.release()
                except BufferError:
                    pass  # exported itself; the weak reference below tells
                if ref() is not None:
                    alive.append((k, mv, ref))
        if alive:
            for k, mv, ref in alive:
                self._views.setdefault(k, []).append((mv, ref))
            raise BufferError(
                f"slot {alive[0][0][0]}: a buffer derived from its view (a slice, cast or numpy array)"
                " is still alive; delete it first (nothing was changed)")

    def set_sync_timeout(self, ms):
        """Bounds later sync calls to ms milliseconds (None or < 0: no bound); raises KvstageError (EINVAL for 0)."""
        ms = -1 if ms is None else ms
        if not isinstance(ms, int):
            raise TypeError("ms must be an int or None")
        check(lib.kvs_set_sync_timeout(self._c(), max(min(ms, 2**31 - 1), -1)), "kvs_set_sync_timeout")

    def acquire(self, n=1):
        """Returns n new Leases, raises PoolExhausted (none leased), KvstageError (EINVAL: n > slot_count), Again,
        NotConnected, Timeout."""
        _uint(n, 32, "n")
        arr = (kvs_lease * max(n, 1))()
        check(lib.kvs_acquire(self._c(), n, arr), "kvs_acquire")
        for i in range(n):
            self._got(arr[i].slot, arr[i].epoch, None)
        return [Lease(self, arr[i].slot, arr[i].epoch) for i in range(n)]

    def release(self, lease):
        """Gives lease back (its views die first), raises BufferError, StaleLease, PermissionDenied, Busy, Again,
        NotConnected, Timeout."""
        c = self._c()
        self._own(lease)
        self._kill_views([lease.key])
        check(lib.kvs_release(c, ctypes.byref(lease._l)), "kvs_release")
        self._holds.pop(lease.key, None)

    def recv_open(self, nbytes, user_data=0, readers=1):
        """Returns (RecvRoom, descriptor bytes) for a room of nbytes, raises KvstageError (EMFILE, EMSGSIZE, ENFILE,
        ESHUTDOWN, ...). readers > 1 (up to KVS_MAX_READERS): a shared room, whose bytes land once and which the
        other readers, clients of this proxy, join with join(descriptor); it completes once all have joined, an
        abort by any ends it for all, and its slots go back when the last reader closes it."""
        c = self._c()
        _uint(nbytes, 64, "nbytes")
        _uint(user_data, 64, "user_data")
        if not isinstance(readers, int) or isinstance(readers, bool) or not 1 <= readers <= KVS_MAX_READERS:
            raise ValueError(f"readers must be an integer from 1 to {KVS_MAX_READERS}, not {readers!r}")
        h, d = ctypes.c_void_p(), kvs_room_desc()
        check(lib.kvs_recv_open_shared(c, nbytes, readers, user_data, ctypes.byref(h), ctypes.byref(d)),
              "kvs_recv_open_shared")
        return RecvRoom(self, h.value, user_data), bytes(d.bytes)

    def _desc(self, desc):
        desc = bytes(desc)
        if len(desc) != KVS_ROOM_DESC_SIZE:
            raise ValueError(f"a descriptor is {KVS_ROOM_DESC_SIZE} bytes, not {len(desc)}")
        return kvs_room_desc.from_buffer_copy(desc)

    def join(self, desc, user_data=0):
        """Returns a RecvRoom: this client as one more reader of the shared room desc names (on this proxy); raises
        PermissionDenied (token), StaleLease (gone, or another proxy's), Aborted (it ended), KvstageError EINVAL
        (not shared) or EUSERS (every reader joined)."""
        c = self._c()
        d = self._desc(desc)
        _uint(user_data, 64, "user_data")
        h = ctypes.c_void_p()
        check(lib.kvs_recv_join(c, ctypes.byref(d), user_data, ctypes.byref(h)), "kvs_recv_join")
        return RecvRoom(self, h.value, user_data)

    def send_open(self, desc, user_data=0):
        """Returns the SendRoom for descriptor desc (128 bytes), raises PermissionDenied (token), StaleLease (room
        gone), Aborted, Busy, ..."""
        c = self._c()
        d = self._desc(desc)
        _uint(user_data, 64, "user_data")
        h = ctypes.c_void_p()
        check(lib.kvs_send_open(c, ctypes.byref(d), user_data, ctypes.byref(h)), "kvs_send_open")
        return SendRoom(self, h.value, user_data)

    def poll(self, max=64):
        """Returns up to max waiting Events without blocking ([] if none), raises NotConnected (proxy gone, none left),
        Timeout."""
        _uint(max, 32, "max")
        if max == 0:
            return []
        arr = (kvs_event * max)()
        n = check(lib.kvs_poll(self._c(), arr, max), "kvs_poll")
        return [self._event(arr[i]) for i in range(n)]

    def wait(self, timeout=None, max=64):
        """Returns up to max Events, blocking until one arrives or timeout seconds pass (None: for ever; then []),
        raises NotConnected."""
        evs = self.poll(max)
        if evs or max == 0:
            return evs
        deadline = None if timeout is None else time.monotonic() + builtins.max(timeout, 0)
        ev = kvs_event()
        while True:
            left = _SLICE_S if deadline is None else min(_SLICE_S, deadline - time.monotonic())
            rc = lib.kvs_wait(self._c(), ctypes.byref(ev), builtins.max(math.ceil(left * 1000), 0))
            if rc == 1:
                return [self._event(ev), *self.poll(max - 1)]
            if rc != -_errno.ETIMEDOUT:
                check(rc, "kvs_wait")
                continue
            if deadline is not None and time.monotonic() >= deadline:
                return []

    def fileno(self):
        """Returns the event fd (readable when events may wait or the proxy is gone; poll it, never read it), raises
        KvstageError."""
        if self._fd is None:
            self._fd = check(lib.kvs_event_fd(self._c()), "kvs_event_fd")
        return self._fd

    def close(self):
        """Closes (the proxy aborts our rooms, frees our slots); every view dies first; idempotent; raises BufferError
        (stays open)."""
        if self._h is None:
            return
        self._kill_views(list(self._views))
        h, self._h = self._h, None
        self._holds.clear()
        lib.kvs_close(h)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except BufferError:
            pass  # a derived view still lives: keep the pool mapped (leak) rather than unmap under it
        except Exception:
            pass

    def __repr__(self):
        state = "closed" if self._h is None else f"{self.slot_count} x {self.slot_size}"
        return f"<kvstage.Client {state}>"


class _Room:
    """One side of a room: .chunks, .nbytes, .user_data, chunk_len(i), abort(), abort_quietly(), close(); a context
    manager."""

    def __init__(self, client, handle, user_data):
        self._client = client
        self._h = handle
        self.user_data = user_data
        self.nbytes = lib.kvs_room_bytes(handle)
        self.chunks = lib.kvs_room_chunks(handle)

    def _room(self):
        """Returns the kvs_room handle, raises BadHandle if this room or its client is closed."""
        if self._h is None or self._client._h is None:
            raise error(-_errno.EBADF, None, "the room is closed" if self._h is None else "the client is closed")
        return self._h

    @property
    def closed(self):
        """True once this room or its client is closed."""
        return self._h is None or self._client._h is None

    def chunk_len(self, i):
        """Returns the bytes of chunk i (slot_size, the last one the rest), raises IndexError."""
        if not 0 <= i < self.chunks:
            raise IndexError(f"chunk {i} of {self.chunks}")
        return builtins.max(0, min(self._client.slot_size, self.nbytes - i * self._client.slot_size))

    def abort(self):
        """Aborts the room from this side (idempotent; an ABORTED event follows), raises BadHandle, NotConnected,
        Again."""
        check(lib.kvs_abort(self._room()), "kvs_abort")

    def abort_quietly(self):
        """abort() for a caller ending a request that must not fail on the way: a refusal (the room ended or was
        closed, the client is gone) is ignored, since the room's final, or the loss of the client, ends it anyway."""
        try:
            self.abort()
        except KvstageError:
            pass

    def close(self):
        """Closes (aborts if unfinished, frees what it holds; its views die first); idempotent; raises BufferError,
        Again."""
        if self.closed:
            self._h = None
            return
        holds = self._client._holds
        mine = [k for k, room in holds.items() if room is self]
        self._client._kill_views(mine)
        rc = lib.kvs_room_close(self._h)
        if rc == -_errno.EAGAIN:
            check(rc, "kvs_room_close")
        self._h = None
        for k in mine:  # the proxy frees them once it takes the close; they are not ours from now
            del holds[k]
        if rc < 0 and rc != -_errno.EBADF:
            check(rc, "kvs_room_close")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        return (f"<kvstage.{type(self).__name__} {self.nbytes} bytes, {self.chunks} chunks,"
                f" user_data={self.user_data}{' closed' if self.closed else ''}>")


class SendRoom(_Room):
    """The sending side of a room (Client.send_open)."""

    def send(self, lease, offset, length):
        """Hands lease (chunk at offset, length bytes) to the room; its views die first. Raises BufferError,
        KvstageError (EINVAL, EEXIST), StaleLease, PermissionDenied, Busy, BadHandle, AlreadyDone, the room's end,
        Again."""
        h = self._room()
        self._client._own(lease)
        _uint(offset, 64, "offset")
        _uint(length, 32, "length")
        self._client._held_check(lease)
        self._client._kill_views([lease.key])
        check(lib.kvs_send(h, ctypes.byref(lease._l), offset, length), "kvs_send")
        del self._client._holds[lease.key]
        self._client._sent[lease.slot] = lease.epoch


class RecvRoom(_Room):
    """The receiving side of a room (Client.recv_open)."""

    def lease(self, i):
        """Returns the read-only Lease of chunk i once RECV_DONE came, raises Again (not complete), KvstageError
        (ERANGE), BadHandle, the room's end."""
        h = self._room()
        _uint(i, 32, "i")
        out = kvs_lease()
        check(lib.kvs_room_lease(h, i, ctypes.byref(out)), "kvs_room_lease")
        self._client._got(out.slot, out.epoch, self)
        return Lease(self._client, out.slot, out.epoch, readonly=True, room=self)
