"""kvstage: Python binding of libkvstage (include/kvstage.h) over ctypes.

Client(socket) leases slots (acquire -> Lease; Lease.view() -> memoryview),
opens rooms (recv_open -> (RecvRoom, desc); send_open(desc) -> SendRoom), and
reads events (poll, wait, fileno). Errors are KvstageError (an OSError) and its
subclasses. A view never outlives its lease: see kvstage.client.
"""
from ._lib import KVS_DEFAULT_SOCKET, KVS_MAX_READERS, KVS_ROOM_DESC_SIZE, lib as _clib, lib_path as LIB_PATH
from .client import (KVS_EV_ABORTED, KVS_EV_FAILED, KVS_EV_RECV_DONE, KVS_EV_REJECTED, KVS_EV_SEND_DONE,
                     Client, Event, EventType, Lease, LeaseId, RecvRoom, SendRoom)
from .cuda import copy_in_device, copy_out_device
from .errors import (Aborted, AlreadyDone, Again, BadHandle, Busy, KvstageError, NoDevice, NotConnected,
                     PermissionDenied, PoolExhausted, StaleLease, Timeout, error)
from . import cuda

__version__ = _clib.kvs_version().decode()


def strerror(err):
    """Returns kvs_strerror's words for a (negative or positive) errno."""
    return _clib.kvs_strerror(-abs(err)).decode(errors="replace")


__all__ = [
    "Client", "Lease", "LeaseId", "RecvRoom", "SendRoom", "Event", "EventType",
    "KVS_EV_SEND_DONE", "KVS_EV_RECV_DONE", "KVS_EV_ABORTED", "KVS_EV_FAILED", "KVS_EV_REJECTED",
    "KVS_ROOM_DESC_SIZE", "KVS_MAX_READERS", "KVS_DEFAULT_SOCKET", "LIB_PATH",
    "KvstageError", "StaleLease", "PoolExhausted", "NotConnected", "PermissionDenied", "Timeout",
    "Again", "Busy", "BadHandle", "AlreadyDone", "Aborted", "NoDevice", "error", "strerror",
    "copy_in_device", "copy_out_device", "cuda", "__version__",
]
