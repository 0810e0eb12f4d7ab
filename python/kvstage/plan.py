"""Copies between an engine's memory and kvstage slots, for both engine modules (kvstage.sglang, kvstage.vllm).

An engine module says where a request's bytes lie in its room as Extents: items of one engine buffer, item
idx[k] (item bytes at base + idx[k] * stride) at room_off + k * item of the room. plan() cuts them at slot
boundaries into the calls a copier makes, in room order, each inside one slot:
    Copy(slot, off, addr, nbytes, device)     one plain copy between addr and the slot's bytes from off
    Gather(slot, off, base, stride, item, idx) whole items of a device buffer in one slot: item idx[k] at
                                               off + k * item; one kvs_cuda_gather_idx / scatter_idx
                                               (stride == item), else kvs_cuda_gather / scatter (addresses)
A host extent is one Copy per run of adjacent items in a slot. A device extent is, per slot it touches,
whichever takes fewer calls: one Copy per run of adjacent items, or one Gather of the whole items plus one Copy
for each part of an item the slot's start or end cuts. On a tie, the plain copies: a Copy needs no list of
indices or addresses carried to the device before it can start, and one Copy of adjacent items is one
contiguous transfer, the copy engines' best case. Either way the same bytes move, each once.

Copiers (one protocol; an engine picks by where its buffers are): CpuCopier for host memory, CudaCopier for a
CUDA device through libkvstage_cuda (kvstage.cuda) on one stream, host pieces by the CPU. copy_in(lease, view, p)
copies piece p into the slot, copy_out(lease, view, p) out of it; view is a memoryview of the slot, needed only
for a host piece (None is fine for a device one: see needs_view); sync() returns once every queued copy has
landed; after(event) orders later copies after an engine's event; submit(job) runs a copy-out job and returns
its CopyHandle.
"""
from __future__ import annotations

import collections
import ctypes
import itertools
from typing import NamedTuple, Tuple

import numpy as np

__all__ = ["Extent", "Copy", "Gather", "runs", "plan", "needs_view", "copy_room_out", "CopyHandle", "CpuCopier",
           "CudaCopier"]


class Extent(NamedTuple):
    """Items of one engine buffer, back to back in the room: item idx[k], item bytes at base + idx[k] * stride,
    is the room's bytes at room_off + k * item. device: the buffer is device memory."""
    room_off: int
    base: int
    stride: int
    item: int
    idx: Tuple[int, ...]
    device: bool

    @property
    def nbytes(self):
        return len(self.idx) * self.item


class Copy(NamedTuple):
    """nbytes at addr to or from the bytes from off of slot `slot` (one copy)."""
    slot: int
    off: int
    addr: int
    nbytes: int
    device: bool


class Gather(NamedTuple):
    """Whole items of one device buffer in one slot: item idx[k] (at base + idx[k] * stride) at off + k * item of
    slot `slot` (one gather or scatter call)."""
    slot: int
    off: int
    base: int
    stride: int
    item: int
    idx: Tuple[int, ...]

    @property
    def nbytes(self):
        return len(self.idx) * self.item

    @property
    def device(self):
        return True


def runs(idx):
    """Returns [(pos, first, length)] for the runs of consecutive values in idx."""
    idx = np.asarray(idx, dtype=np.int64).reshape(-1)
    if idx.size == 0:
        return []
    brk = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [idx.size]))
    return [(int(s), int(idx[s]), int(e - s)) for s, e in zip(starts, ends)]


def _copies(ext, slot_size):
    """ext's bytes as one Copy per run of adjacent items (consecutive items of a buffer whose items are item bytes
    apart) cut at slot boundaries, in room order."""
    item = ext.item
    out = []
    for pos, first, k in runs(ext.idx) if ext.stride == item else [(j, b, 1) for j, b in enumerate(ext.idx)]:
        room, addr, n = ext.room_off + pos * item, ext.base + first * ext.stride, k * item
        while n:
            s, so = divmod(room, slot_size)
            m = min(n, slot_size - so)
            out.append(Copy(s, so, addr, m, ext.device))
            room, addr, n = room + m, addr + m, n - m
    return out


def _gathered(ext, s, so, pos, end):
    """ext's bytes [pos, end), all in slot s from so: a Gather of the whole items, and a Copy for each part of an
    item cut by the slot's start or end."""
    item, out = ext.item, []
    if pos % item:  # the rest of an item begun in the slot before
        j, into = divmod(pos, item)
        k = min(item - into, end - pos)
        out.append(Copy(s, so, ext.base + ext.idx[j] * ext.stride + into, k, True))
        so, pos = so + k, pos + k
    whole = (end - pos) // item
    if whole:
        j = pos // item
        out.append(Gather(s, so, ext.base, ext.stride, item, tuple(ext.idx[j:j + whole])))
        so, pos = so + whole * item, pos + whole * item
    if pos < end:  # the start of an item the next slot ends
        out.append(Copy(s, so, ext.base + ext.idx[pos // item] * ext.stride, end - pos, True))
    return out


def plan(extents, slot_size):
    """Returns the pieces (Copy, Gather) that move extents between engine memory and slots of slot_size bytes, in
    room order, each inside one slot (the module docstring says which form a device extent takes)."""
    out = []
    for ext in extents:
        copies = _copies(ext, slot_size)
        if not ext.device:
            out.extend(copies)
            continue
        for s, in_slot in itertools.groupby(copies, key=lambda c: c.slot):
            in_slot = list(in_slot)
            pos = s * slot_size + in_slot[0].off - ext.room_off  # the slot's part of the extent: [pos, end)
            end = pos + sum(c.nbytes for c in in_slot)
            gathered = _gathered(ext, s, in_slot[0].off, pos, end)
            out.extend(gathered if len(gathered) < len(in_slot) else in_slot)
    return out


def needs_view(p):
    """True if copying piece p takes a view of its slot (a host piece: the CPU copies it)."""
    return not p.device


def copy_room_out(room, pieces, copier):
    """Copies a received room into engine memory by a plan: each slot's lease once, each piece by copier.copy_out;
    then waits for the copies (copier.sync). Raises what the copier or the room raises."""
    by_slot = collections.defaultdict(list)
    for p in pieces:
        by_slot[p.slot].append(p)
    for s in sorted(by_slot):
        lease, view = room.lease(s), None
        for p in by_slot[s]:
            if view is None and needs_view(p):
                view = lease.view()
            copier.copy_out(lease, view, p)
        del view
    copier.sync()


def host_bytes(addr, n):
    """Returns a writable byte memoryview of n bytes of host memory at addr."""
    return memoryview((ctypes.c_ubyte * n).from_address(addr)).cast("B")


class CopyHandle:
    """One copy job: done() once it ran (error: what it raised) or was cancelled; cancel() stops it if not started."""

    def __init__(self, job):
        self._job = job
        self.state = "queued"  # queued, running, done, cancelled
        self.error = None

    def run(self):
        if self.state != "queued":
            return
        self.state = "running"
        try:
            self._job()
        except BaseException as e:  # reported through its engine's poll, never lost
            self.error = e
        finally:
            self._job = None
            self.state = "done"

    def done(self):
        return self.state in ("done", "cancelled")

    def cancel(self):
        """Returns True if the job will never run (it had not started, or was cancelled before)."""
        if self.state == "queued":
            self.state = "cancelled"
            self._job = None
        return self.state == "cancelled"


class CpuCopier:
    """Host pieces by the CPU (memoryview copies); runs each submitted job at once. The engine modules give device
    memory to CudaCopier, so every piece here is a host Copy."""

    def copy_in(self, lease, view, p):
        view[p.off:p.off + p.nbytes] = host_bytes(p.addr, p.nbytes)

    def copy_in_crc(self, lease, view, p):
        """copy_in, returning the piece's CRC32C computed as it copies (kvs_copy_crc32c: one pass over memory); None
        for a piece whose bytes land later (a device copy: its CRC is taken from the slot after sync())."""
        from .checksum import copy_crc32c
        return copy_crc32c(lease.address + p.off, p.addr, p.nbytes)

    def copy_out(self, lease, view, p):
        host_bytes(p.addr, p.nbytes)[:] = view[p.off:p.off + p.nbytes]

    def sync(self):
        pass

    def after(self, event):
        pass

    def submit(self, job):
        h = CopyHandle(job)
        h.run()
        return h


class CudaCopier(CpuCopier):
    """Device pieces through libkvstage_cuda on one stream (a torch stream, or anything with cuda_stream,
    synchronize() and wait_event(event)), host pieces by the CPU: a Gather is one gather_idx / scatter_idx when its
    items are item bytes apart, else one gather / scatter of their addresses (the library picks copy engines or its
    kernel); a device Copy one copy_in_device / copy_out_device. UNTESTED on a GPU: the development machine has
    none; the tests run it against a stand-in device."""

    def __init__(self, gpu_id=0, cuda_api=None, stream=None):
        if cuda_api is None:
            from . import cuda as cuda_api
        if stream is None:
            import torch
            stream = torch.cuda.Stream(device=gpu_id)
        self._api, self._stream = cuda_api, stream
        self._queued = False

    def after(self, event):
        self._stream.wait_event(event)

    def copy_in(self, lease, view, p):
        if not p.device:
            return super().copy_in(lease, view, p)
        stream, api = self._stream.cuda_stream, self._api
        if isinstance(p, Copy):
            api.copy_in_device(lease, p.addr, p.nbytes, slot_off=p.off, stream=stream)
        elif p.stride == p.item:
            api.gather_idx(lease, p.base, p.idx, p.item, slot_off=p.off, stream=stream)
        else:
            api.gather(lease, [p.base + i * p.stride for i in p.idx], p.item, slot_off=p.off, stream=stream)
        self._queued = True

    def copy_in_crc(self, lease, view, p):
        if not p.device:
            return super().copy_in_crc(lease, view, p)
        self.copy_in(lease, view, p)
        return None

    def copy_out(self, lease, view, p):
        if not p.device:
            return super().copy_out(lease, view, p)
        stream, api = self._stream.cuda_stream, self._api
        if isinstance(p, Copy):
            api.copy_out_device(lease, p.addr, p.nbytes, slot_off=p.off, stream=stream)
        elif p.stride == p.item:
            api.scatter_idx(lease, p.base, p.idx, p.item, slot_off=p.off, stream=stream)
        else:
            api.scatter(lease, [p.base + i * p.stride for i in p.idx], p.item, slot_off=p.off, stream=stream)
        self._queued = True

    def sync(self):
        if self._queued:
            self._stream.synchronize()
            self._queued = False
