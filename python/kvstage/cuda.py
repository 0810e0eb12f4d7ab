"""Thin wrappers of libkvstage_cuda (include/kvstage_cuda.h): GPU memory into leased slots and out of received ones.

Device pointers, streams (cudaStream_t, e.g. torch's stream.cuda_stream) and
events (cudaEvent_t) are plain ints; 0/None is NULL (the legacy default stream,
no event). Keep the lease (no send, release or room close) until `done` fired or
the stream is synchronised. Without the library, or without a driver or device,
every call raises NoDevice saying which.
"""
import ctypes
import errno as _errno
from enum import IntEnum

from . import _lib
from .client import Lease, _uint
from .errors import NoDevice, error

KVS_CUDA_KERNEL_BELOW = 1 << 20


class GatherMode(IntEnum):
    """enum kvs_cuda_gather_mode."""
    AUTO = 0    # the kernel below KVS_CUDA_KERNEL_BELOW bytes a page, else the copy engines
    COPY = 1    # the copy engines: one copy per run of contiguous pages
    KERNEL = 2  # a kernel moving 16-byte words (unaligned pages: the copy engines)


def _cl():
    """Returns libkvstage_cuda, raises NoDevice("libkvstage_cuda not available: ...")."""
    try:
        return _lib.cuda()
    except OSError as e:
        raise NoDevice(-_errno.ENODEV, None, f"libkvstage_cuda not available: {e}") from None


def available():
    """Returns True if libkvstage_cuda loads (a device may still be absent)."""
    try:
        _cl()
        return True
    except NoDevice:
        return False


def last_error():
    """Returns what CUDA said about this thread's last failed kvs_cuda_* call ("" if none)."""
    return (_cl().kvs_cuda_last_error() or b"").decode(errors="replace")


def _check(rc, func):
    """Returns None for rc >= 0, raises NoDevice("no CUDA device: ...") for -ENODEV, else error(rc) with CUDA's
    words."""
    if rc >= 0:
        return
    why = last_error()
    if rc == -_errno.ENODEV:
        raise NoDevice(rc, func, f"no CUDA device: {why}" if why else "no CUDA device")
    base = _lib.lib.kvs_strerror(rc).decode(errors="replace")
    raise error(rc, func, f"{base}: {why}" if why else None)


def _ptr(v, what):
    """Returns v (an int address, None as 0), raises TypeError/ValueError."""
    if v is None:
        return 0
    if not isinstance(v, int) or v < 0 or v >= 1 << 64:
        raise (TypeError if not isinstance(v, int) else ValueError)(f"{what} must be an address (int)")
    return v


def _held(lease, write, **sizes):
    """Returns (kvs_client, lease struct) for a Lease, raises TypeError, BadHandle, Busy (sent), ValueError (write into
    a received one, a bad size)."""
    for what, v in sizes.items():
        _uint(v, 64, what)
    if not isinstance(lease, Lease):
        raise TypeError(f"expected a Lease, not {type(lease).__name__}")
    if write and lease.readonly:
        raise ValueError(f"{lease!r} was received: it is read-only")
    if lease._client._held_check(lease) is not None and write:
        raise ValueError(f"{lease!r} was received: it is read-only")
    return lease._client._h, ctypes.byref(lease._l)


def register(client):
    """Registers client's pool mapping with CUDA (idempotent; the first copy does it too), raises NoDevice,
    KvstageError."""
    _check(_cl().kvs_cuda_register(client._c()), "kvs_cuda_register")


def unregister(client):
    """Undoes register (close does it too), raises KvstageError."""
    _check(_cl().kvs_cuda_unregister(client._c()), "kvs_cuda_unregister")


def set_gather_mode(client, mode):
    """Sets how client's gathers and scatters move pages (GatherMode), raises NoDevice, KvstageError."""
    _check(_cl().kvs_cuda_set_gather_mode(client._c(), int(mode)), "kvs_cuda_set_gather_mode")


def copy_in_device(lease, dev_ptr, nbytes, slot_off=0, stream=None, done=None):
    """Queues nbytes from device dev_ptr into lease's slot at slot_off on stream, then records done; raises NoDevice,
    StaleLease, PermissionDenied, Busy, KvstageError."""
    cl = _cl()
    c, held = _held(lease, True, nbytes=nbytes, slot_off=slot_off)
    _check(cl.kvs_cuda_copy_to_slot(c, held, slot_off, _ptr(dev_ptr, "dev_ptr"), nbytes,
                                    _ptr(stream, "stream"), _ptr(done, "done")), "kvs_cuda_copy_to_slot")


def copy_out_device(lease, dev_ptr, nbytes, slot_off=0, stream=None, done=None):
    """Queues nbytes from lease's slot at slot_off to device dev_ptr on stream, then records done; raises as
    copy_in_device."""
    cl = _cl()
    c, held = _held(lease, False, nbytes=nbytes, slot_off=slot_off)
    _check(cl.kvs_cuda_copy_from_slot(c, held, slot_off, _ptr(dev_ptr, "dev_ptr"), nbytes,
                                      _ptr(stream, "stream"), _ptr(done, "done")), "kvs_cuda_copy_from_slot")


def _pages(dev_pages):
    """Returns (c array of device pointers, count)."""
    ptrs = [_ptr(p, "page") for p in dev_pages]
    return (ctypes.c_void_p * max(len(ptrs), 1))(*ptrs), len(ptrs)


def _idx(page_idx):
    """Returns (c array of int32 page indices, count), raises ValueError for a negative one."""
    idx = [int(i) for i in page_idx]
    if any(not 0 <= i < 1 << 31 for i in idx):
        raise ValueError("page indices must be in [0, 2**31)")
    return (ctypes.c_int32 * max(len(idx), 1))(*idx), len(idx)


def gather(lease, dev_pages, page_size, slot_off=0, stream=None, done=None):
    """Queues device pages dev_pages[k] into the slot at slot_off + k * page_size; raises as copy_in_device."""
    cl = _cl()
    c, held = _held(lease, True, page_size=page_size, slot_off=slot_off)
    arr, n = _pages(dev_pages)
    _check(cl.kvs_cuda_gather(c, held, slot_off, arr, n, page_size, _ptr(stream, "stream"), _ptr(done, "done")),
           "kvs_cuda_gather")


def scatter(lease, dev_pages, page_size, slot_off=0, stream=None, done=None):
    """Queues the slot from slot_off out to device pages dev_pages[k]; raises as copy_in_device."""
    cl = _cl()
    c, held = _held(lease, False, page_size=page_size, slot_off=slot_off)
    arr, n = _pages(dev_pages)
    _check(cl.kvs_cuda_scatter(c, held, slot_off, arr, n, page_size, _ptr(stream, "stream"), _ptr(done, "done")),
           "kvs_cuda_scatter")


def gather_idx(lease, dev_base, page_idx, page_size, slot_off=0, stream=None, done=None):
    """As gather, page k at dev_base + page_idx[k] * page_size; raises as copy_in_device, ValueError."""
    cl = _cl()
    c, held = _held(lease, True, page_size=page_size, slot_off=slot_off)
    arr, n = _idx(page_idx)
    _check(cl.kvs_cuda_gather_idx(c, held, slot_off, _ptr(dev_base, "dev_base"), arr, n, page_size,
                                  _ptr(stream, "stream"), _ptr(done, "done")), "kvs_cuda_gather_idx")


def scatter_idx(lease, dev_base, page_idx, page_size, slot_off=0, stream=None, done=None):
    """As scatter, page k at dev_base + page_idx[k] * page_size; raises as copy_in_device, ValueError."""
    cl = _cl()
    c, held = _held(lease, False, page_size=page_size, slot_off=slot_off)
    arr, n = _idx(page_idx)
    _check(cl.kvs_cuda_scatter_idx(c, held, slot_off, _ptr(dev_base, "dev_base"), arr, n, page_size,
                                   _ptr(stream, "stream"), _ptr(done, "done")), "kvs_cuda_scatter_idx")
