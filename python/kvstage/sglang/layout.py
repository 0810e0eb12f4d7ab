"""kvstage.sglang: where each byte sits in the room, and the copies that put it there."""
from __future__ import annotations

import dataclasses

import numpy as np

from ..plan import Extent


def _flat(x):
    """Returns one state component's indices as a flat int64 array (None: none)."""
    if x is None:
        return np.zeros(0, dtype=np.int64)
    if isinstance(x, (list, tuple)):
        parts = [np.asarray(e, dtype=np.int64).reshape(-1) for e in x if e is not None]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return np.asarray(x, dtype=np.int64).reshape(-1)


@dataclasses.dataclass(frozen=True)
class Region:
    """One engine buffer as KVArgs gives it: base address, length, item length, device or host."""
    ptr: int
    nbytes: int
    item: int
    device: bool


class MemoryMap:
    """A manager's own buffers: KV regions, aux regions, state components (lists of regions)."""

    def __init__(self, args, kv_device):
        kv_ptrs, kv_lens, kv_items = list(args.kv_data_ptrs), list(args.kv_data_lens), list(args.kv_item_lens)
        if not (len(kv_ptrs) == len(kv_lens) == len(kv_items)):
            raise ValueError("kv_data_ptrs, kv_data_lens and kv_item_lens differ in length")
        self.kv = [Region(int(p), int(n), int(i), kv_device) for p, n, i in zip(kv_ptrs, kv_lens, kv_items)]
        a_ptrs = list(getattr(args, "aux_data_ptrs", None) or [])
        a_lens = list(getattr(args, "aux_data_lens", None) or [])
        a_items = list(getattr(args, "aux_item_lens", None) or [])
        if not (len(a_ptrs) == len(a_lens) == len(a_items)):
            raise ValueError("aux_data_ptrs, aux_data_lens and aux_item_lens differ in length")
        self.aux = [Region(int(p), int(n), int(i), False) for p, n, i in zip(a_ptrs, a_lens, a_items)]
        s_ptrs = list(getattr(args, "state_data_ptrs", None) or [])
        s_lens = list(getattr(args, "state_data_lens", None) or [])
        s_items = list(getattr(args, "state_item_lens", None) or [])
        if s_ptrs and not isinstance(s_ptrs[0], (list, tuple)):  # an older flat list: one component
            s_ptrs, s_lens, s_items = [s_ptrs], [s_lens], [s_items]
        self.state = [[Region(int(p), int(n), int(i), kv_device) for p, n, i in zip(ps, ls, its)]
                      for ps, ls, its in zip(s_ptrs, s_lens, s_items)]
        self.state_types = [getattr(t, "value", t) for t in (getattr(args, "state_types", None) or [])]

    def fingerprint(self):
        """The layout facts both sides must share (the decode side sends its own in its meta message)."""
        return {"kv_item_lens": [r.item for r in self.kv], "aux_item_lens": [r.item for r in self.aux],
                "state_item_lens": [[r.item for r in comp] for comp in self.state],
                "state_types": [str(t) for t in self.state_types]}

    @staticmethod
    def mismatch(mine, theirs):
        """Returns why two fingerprints differ (None if they agree)."""
        for key in ("kv_item_lens", "aux_item_lens", "state_item_lens"):
            if mine.get(key) != theirs.get(key):
                return f"{key} differ: this side {mine.get(key)}, the prefill side {theirs.get(key)}"
        return None


class RoomLayout:
    """Offsets of a request's bytes in its room (see kvstage.sglang's docstring); .nbytes in all.

    kv_slices (attention-TP sizes that differ, one room per rank pair): per KV buffer (off, n), the bytes of each
    token this pair's share carries (a range of heads) at off in this side's token of item // page_size bytes; the
    room then holds, per buffer, token t of the request's page j at (j * page_size + t) * n. None: whole pages."""

    def __init__(self, mem, npages, has_aux, state_counts, kv_slices=None, page_size=1):
        self.npages = int(npages)
        self.has_aux = bool(has_aux)
        self.state_counts = [int(n) for n in state_counts]
        self.page_size = int(page_size)
        if len(self.state_counts) > len(mem.state):
            raise ValueError(f"{len(self.state_counts)} state components, this side has {len(mem.state)}")
        if kv_slices is not None and len(kv_slices) != len(mem.kv):
            raise ValueError(f"{len(kv_slices)} KV slices for {len(mem.kv)} KV buffers")
        self.kv_slices = [None if s is None or (s[0] == 0 and s[1] * self.page_size == r.item) else tuple(s)
                          for s, r in zip(kv_slices or [None] * len(mem.kv), mem.kv)]
        off = 0
        self.kv_off = []
        for r, sl in zip(mem.kv, self.kv_slices):
            self.kv_off.append(off)
            if sl is not None and (r.item % self.page_size or sl[0] + sl[1] > r.item // self.page_size):
                raise ValueError(f"KV slice {sl} does not fit a {r.item // self.page_size}-byte token")
            off += self.npages * (r.item if sl is None else sl[1] * self.page_size)
        self.aux_off = []
        for r in (mem.aux if self.has_aux else []):
            self.aux_off.append(off)
            off += r.item
        self.state_off = []
        for comp, n in zip(mem.state, self.state_counts):
            offs = []
            for r in comp:
                offs.append(off)
                off += n * r.item
            self.state_off.append(offs)
        self.nbytes = off
        self.mem = mem

    def kv_extents(self, pages, first_pos):
        """Returns the extents (kvstage.plan.Extent) of pages at request positions first_pos..., one per KV
        buffer; raises ValueError for a page past a buffer or more pages than the room was made for."""
        idx = _indices(pages, "page")
        if not idx:
            return []
        if first_pos + len(idx) > self.npages:
            raise ValueError(f"more pages than the {self.npages} the room was made for")
        out = []
        ps = self.page_size
        tokens = None
        for b, (r, sl) in enumerate(zip(self.mem.kv, self.kv_slices)):
            if (max(idx) + 1) * r.item > r.nbytes:
                raise ValueError(f"page {max(idx)} is past KV buffer {b} ({r.nbytes} bytes)")
            if sl is None:
                out.append(Extent(self.kv_off[b] + first_pos * r.item, r.ptr, r.item, r.item, idx, r.device))
                continue
            if tokens is None:  # each token's slice is an item: the heads of a token lie together, tokens apart
                tokens = tuple(p * ps + t for p in idx for t in range(ps))
            off, n = sl
            out.append(Extent(self.kv_off[b] + first_pos * ps * n, r.ptr + off, r.item // ps, n, tokens, r.device))
        return out

    def aux_extents(self, aux_index):
        out = []
        if not self.has_aux:
            return out
        for a, r in enumerate(self.mem.aux):
            if (aux_index + 1) * r.item > r.nbytes or aux_index < 0:
                raise ValueError(f"aux index {aux_index} is past aux buffer {a}")
            out.append(Extent(self.aux_off[a], r.ptr, r.item, r.item, (aux_index,), False))
        return out

    def state_extents(self, state_indices):
        out = []
        for c, (comp, offs, n) in enumerate(zip(self.mem.state, self.state_off, self.state_counts)):
            idx = _indices(_flat(state_indices[c]) if c < len(state_indices) else (), "state")
            if len(idx) != n:
                raise ValueError(f"state component {c}: {len(idx)} indices here, {n} on the other side")
            if not idx:
                continue
            for t, (r, base) in enumerate(zip(comp, offs)):
                if (max(idx) + 1) * r.item > r.nbytes:
                    raise ValueError(f"state index {max(idx)} is past state buffer {c}.{t}")
                out.append(Extent(base, r.ptr, r.item, r.item, idx, r.device))
        return out


def _indices(x, what):
    """Returns x (page or state indices: any int sequence or array) as a tuple of ints, raises ValueError for a
    negative one."""
    idx = tuple(int(i) for i in np.asarray(x, dtype=np.int64).reshape(-1))
    if idx and min(idx) < 0:
        raise ValueError(f"negative {what} index {min(idx)}")
    return idx


def state_counts_of(state_indices, ncomp):
    """Returns the item count of each of ncomp state components in SGLang's state_indices."""
    state_indices = list(state_indices or [])
    return [int(_flat(state_indices[c]).size) if c < len(state_indices) else 0 for c in range(ncomp)]
