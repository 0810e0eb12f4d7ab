"""kvstage.vllm: where each byte of a request sits in its room (VllmLayout), from the registered KV caches."""
from __future__ import annotations

import dataclasses
import itertools
import json

from ..plan import Extent, plan


def _dense(sizes, strides):
    """True if a tensor of these sizes/strides (elements) covers one gap-free span of memory."""
    expect = 1
    for st, sz in sorted((st, sz) for sz, st in zip(sizes, strides) if sz != 1):
        if st != expect:
            return False
        expect *= sz
    return True


@dataclasses.dataclass(frozen=True)
class KVRegion:
    """One part of a layer's paged cache: block b at ptr + b * stride, item bytes long."""
    layer: int
    ptr: int
    stride: int
    item: int
    nblocks: int
    device: bool
    group: int = 0  # the KV cache group of its layer: its blocks are that group's block ids
    heads: int = 0  # KV heads in a block (an attention part of (block_size, heads, head_size) blocks); 0: none
    head_bytes: int = 0  # bytes between two heads of a block (a head's part of one row of the block)
    order: tuple = ()  # the block's dimensions, outermost in memory first (the fingerprint's)
    dtype: str = ""


def _flat(blocks):
    """Block ids of a flat list or of per-group lists, as one list."""
    blocks = list(blocks)
    if blocks and isinstance(blocks[0], (list, tuple)):
        return [b for g in blocks for b in g]
    return blocks


class VllmLayout:
    """The registered KV caches as regions (layer order, K before V), the room offsets of a request's blocks.

    With several KV cache groups (layer_groups: layer name -> group index), a room holds counts[g] blocks of each
    group g; a region's part of the room is counts[its group] x its block bytes, and the block arguments of nbytes,
    extents, plan are per group (counts, one block list per group, one first position per group). With one group
    they are plain (an int, a list, an int), as before."""

    def __init__(self, kv_caches, num_blocks=None, layer_groups=None):
        self.layer_names = list(kv_caches)
        self.index = {n: i for i, n in enumerate(self.layer_names)}
        if layer_groups is not None:
            missing = [n for n in self.layer_names if n not in layer_groups]
            if missing:
                raise ValueError(f"layer {missing[0]} is in no KV cache group of the KV cache config")
        groups = [int(layer_groups[n]) if layer_groups is not None else 0 for n in self.layer_names]
        self.ngroups = max(layer_groups.values(), default=0) + 1 if layer_groups is not None else 1
        self.regions, fp = [], []
        for li, name in enumerate(self.layer_names):
            v = kv_caches[name]
            if isinstance(v, (list, tuple)):  # a Mamba layer: its state tensors, each (num_blocks, *shape)
                if not v:
                    raise ValueError(f"layer {name}: an empty list of state tensors")
                parts = list(v)
                for t in parts:
                    if num_blocks is not None and (t.dim() < 1 or t.shape[0] != num_blocks):
                        raise ValueError(f"layer {name}: a state tensor of shape {tuple(t.shape)} has no dimension of "
                                         f"{num_blocks} blocks first")
            else:
                t = v
                kv_first = t.dim() >= 3 and t.shape[0] == 2 and (num_blocks is None or t.shape[1] == num_blocks)
                if not kv_first and num_blocks is not None and t.shape[0] != num_blocks:
                    raise ValueError(f"layer {name}: KV cache of shape {tuple(t.shape)} has no dimension of "
                                     f"{num_blocks} blocks first")
                parts = [t[0], t[1]] if kv_first else [t]  # (2, num_blocks, ...): K and V apart; (num_blocks, ...)
            for p in parts:
                t = p if isinstance(v, (list, tuple)) else v
                elt = t.element_size()
                sub = p[0]
                if not _dense(tuple(sub.shape), tuple(sub.stride())):
                    raise ValueError(f"layer {name}: a block of its KV cache is not one span of memory "
                                     f"(shape {tuple(t.shape)}, stride {tuple(t.stride())})")
                item = sub.numel() * elt
                stride = p.stride(0) * elt
                if stride < item:
                    raise ValueError(f"layer {name}: blocks overlap (stride {stride} < {item} bytes)")
                order = sorted(range(sub.dim()), key=lambda d: -sub.stride(d))
                # an attention block is (block_size, heads, head_size) in vLLM's logical order (FlashAttention's
                # get_kv_cache_shape (2, num_blocks, ...): K and V apart; HND caches differ in strides only), or
                # (2, block_size, heads, head_size) (FlashInfer's (num_blocks, 2, ...)): its heads split across TP
                attn = not isinstance(v, (list, tuple)) and sub.dim() >= 3
                self.regions.append(KVRegion(li, int(p.data_ptr()), stride, item, int(p.shape[0]),
                                             bool(getattr(t, "is_cuda", False)), groups[li],
                                             int(sub.shape[-2]) if attn else 0, sub.stride(-2) * elt if attn else 0,
                                             tuple(order), str(t.dtype)))
                fp.append([item, str(t.dtype), list(sub.shape), order])
        self.device = any(r.device for r in self.regions)
        self._fp = {"regions": fp, "layers": len(self.layer_names)}
        if self.ngroups > 1:
            self._fp["groups"] = groups
        self._off = list(itertools.accumulate([0] + [r.item for r in self.regions]))

    def fingerprint(self):
        """The layout facts both sides must share (JSON-native)."""
        return json.loads(json.dumps(self._fp))

    # -- a TP share: heads [h0, h1) of every block (prefill and decode with different TP sizes) --
    @property
    def kv_heads(self):
        """The KV heads of this rank's blocks (every region's the same), or 0 when a region has none (a state or MLA
        cache: nothing to split by head)."""
        hs = {r.heads for r in self.regions}
        return hs.pop() if len(hs) == 1 else 0

    def _share_geom(self, r, h0, h1):
        """(rows, pitch, offset, run) of heads [h0, h1) in a block of region r: the block is rows of all its heads,
        pitch bytes apart (block_size rows of a NHD block, one of a HND block); each row's share is run bytes from
        offset."""
        if not 0 <= h0 < h1 <= r.heads:
            raise ValueError(f"heads [{h0}, {h1}) of a block of {r.heads} heads (layer {r.layer})")
        pitch = r.heads * r.head_bytes
        return r.item // pitch, pitch, h0 * r.head_bytes, (h1 - h0) * r.head_bytes

    def share_fingerprint(self, h0, h1):
        """What a sending and a receiving share must agree on (JSON-native): per region its rows, a head's bytes in
        a row, the share's head count, the dtype and the block's memory order; the layer count; the groups."""
        fp = {"layers": len(self.layer_names),
              "regions": [[self._share_geom(r, h0, h1)[0], r.head_bytes, h1 - h0, r.dtype, list(r.order)]
                          for r in self.regions]}
        if self.ngroups > 1:
            fp["groups"] = self._fp["groups"]
        return json.loads(json.dumps(fp))

    # -- blocks of another size on the other side: the room as token positions --------------------------------
    def _token_bytes(self, r, k, block_size):
        """Bytes of one token position of region r's blocks (the k-th region), or 0 unless its blocks are token-major
        (a (block_size, ...) block whose first dimension is outermost in memory: vLLM's NHD and MLA caches; not
        HND, nor FlashInfer's (2, block_size, ...) blocks, whose K half comes before the V half)."""
        shape = self._fp["regions"][k][2]
        if (self.ngroups > 1 or r.group != 0 or not r.order or r.order[0] != 0 or len(shape) < 2
                or shape[0] != block_size):
            return 0
        return r.item // shape[0]

    def token_fingerprint(self, block_size):
        """What two sides with blocks of different sizes must agree on (JSON-native), or None when a region's blocks
        are not token-major: per region a token's bytes, the dtype, the rest of the block's shape and its memory
        order; the layer count."""
        regions = []
        for k, r in enumerate(self.regions):
            tok = self._token_bytes(r, k, block_size)
            if not tok:
                return None
            _, dtype, shape, order = self._fp["regions"][k]
            regions.append([tok, dtype, list(shape[1:]), list(order)])
        return json.loads(json.dumps({"layers": len(self.layer_names), "regions": regions}))

    def token_nbytes(self, tokens, block_size):
        """Bytes of a room of `tokens` token positions per region (the sender's blocks x its block size), for this
        side's blocks of block_size tokens."""
        return tokens * sum(self._token_bytes(r, k, block_size) for k, r in enumerate(self.regions))

    def token_extents(self, tokens, blocks, first_pos, block_size):
        """The extents of blocks (of block_size tokens) at request positions first_pos... in a room of `tokens` token
        positions per region, token-major: the bytes of a side with blocks of another size. A room of token-major
        blocks (the plain layout) is that room with tokens = its blocks x their size, so the sender's plain layout
        needs nothing else; a block the room ends inside takes only the positions it has."""
        ids = [int(b) for b in blocks]
        out, base = [], 0
        for k, r in enumerate(self.regions):
            tok = self._token_bytes(r, k, block_size)
            if not tok:
                raise ValueError(f"layer {r.layer}: its blocks are not token-major (HND, or K and V in one block): "
                                 "blocks of another size cannot be mapped")
            for b in ids:
                if not 0 <= b < r.nblocks:
                    raise ValueError(f"block {b} is outside the cache of layer {r.layer} ({r.nblocks} blocks)")
            full = [b for i, b in enumerate(ids) if (first_pos + i + 1) * block_size <= tokens]
            if full:
                out.append(Extent(base + first_pos * block_size * tok, r.ptr, r.stride, block_size * tok, tuple(full),
                                  r.device))
            if len(full) < len(ids):
                q = (first_pos + len(full)) * block_size
                if q < tokens:
                    out.append(Extent(base + q * tok, r.ptr, r.stride, (tokens - q) * tok, (ids[len(full)],),
                                      r.device))
            base += tokens * tok
        return out

    def _share_bases(self, counts, h0, h1):
        sizes = []
        for r in self.regions:
            rows, _, _, run = self._share_geom(r, h0, h1)
            sizes.append(rows * run * counts[r.group])
        return list(itertools.accumulate([0] + sizes))

    def share_nbytes(self, nblocks, h0, h1):
        """Bytes of a share room: heads [h0, h1) of nblocks blocks (per group: a tuple of counts)."""
        counts = (nblocks,) if isinstance(nblocks, int) else tuple(int(n) for n in nblocks)
        return self._share_bases(counts, h0, h1)[-1]

    def share_extents(self, nblocks, blocks, first_pos, h0, h1, layer=None, room_off=0):
        """The extents of heads [h0, h1) of blocks at request positions first_pos... in a share room at room_off. A
        share room holds, per region (layer order, K before V), per row of a block, the row's share of each of the
        room's blocks in request order: the layout both sides compute whatever their head counts."""
        counts, blocks, first = self._norm(nblocks, blocks, first_pos)
        bases = self._share_bases(counts, h0, h1)
        out = []
        for k, r in enumerate(self.regions):
            if layer is not None and r.layer != layer:
                continue
            rows, pitch, off, run = self._share_geom(r, h0, h1)
            ids = tuple(int(b) for b in blocks[r.group])
            for b in ids:
                if not 0 <= b < r.nblocks:
                    raise ValueError(f"block {b} is outside the cache of layer {r.layer} ({r.nblocks} blocks)")
            if not ids:
                continue
            n = counts[r.group]
            for t in range(rows):
                out.append(Extent(room_off + bases[k] + (t * n + first[r.group]) * run, r.ptr + t * pitch + off,
                                  r.stride, run, ids, r.device))
        return out

    def _norm(self, nblocks, blocks, first_pos):
        """(counts, per-group block lists, per-group first positions) of the plain (one group) or per-group form."""
        if isinstance(nblocks, int):
            if self.ngroups != 1:
                raise ValueError(f"{self.ngroups} KV cache groups: block counts, ids and positions go per group")
            counts, blocks, first = (nblocks,), ([int(b) for b in blocks],), (int(first_pos),)
        else:
            counts = tuple(int(n) for n in nblocks)
            blocks = tuple([int(b) for b in g] for g in blocks)
            first = (int(first_pos),) * len(counts) if isinstance(first_pos, int) else tuple(int(f) for f in first_pos)
            if not len(counts) == len(blocks) == len(first) == self.ngroups:
                raise ValueError(f"{len(counts)} block counts, {len(blocks)} block lists, {len(first)} positions for "
                                 f"{self.ngroups} KV cache groups")
        for g in range(len(counts)):
            if first[g] + len(blocks[g]) > counts[g]:
                raise ValueError(f"{first[g] + len(blocks[g])} blocks for a room of {counts[g]}"
                                 + (f" (group {g})" if len(counts) > 1 else ""))
        return counts, blocks, first

    def _bases(self, counts):
        """Room offset of each region's part for these per-group block counts."""
        return list(itertools.accumulate([0] + [r.item * counts[r.group] for r in self.regions]))

    def nbytes(self, nblocks):
        """Bytes of a room for nblocks blocks (per group: a tuple of counts)."""
        if isinstance(nblocks, int):
            return self._off[-1] * nblocks
        return self._bases(tuple(int(n) for n in nblocks))[-1]

    def extents(self, nblocks, blocks, first_pos=0, layer=None):
        """Returns the extents (kvstage.plan.Extent: one per region) of blocks at request positions first_pos...
        (one layer, or all); raises ValueError for a block outside a cache or more blocks than the room has."""
        counts, blocks, first = self._norm(nblocks, blocks, first_pos)
        bases = self._bases(counts)
        out = []
        for k, r in enumerate(self.regions):
            if layer is not None and r.layer != layer:
                continue
            out.extend(self._region_extents(k, bases[k], blocks[r.group], first[r.group]))
        return out

    def check(self, blocks):
        """Raises ValueError unless every block id (a list, or per-group lists) is an integer in [0, blocks of the
        smallest cache)."""
        blocks = _flat(blocks)
        for b in blocks:
            if isinstance(b, bool) or int(b) != b:
                raise ValueError(f"block id {b!r} is not an integer")
        for r in self.regions:
            bad = [int(b) for b in blocks if not 0 <= int(b) < r.nblocks]
            if bad:
                raise ValueError(f"block {bad[0]} is outside the cache of layer {r.layer} ({r.nblocks} blocks)")

    def _region_extents(self, k, base, blocks, first_pos):
        r = self.regions[k]
        blocks = tuple(int(b) for b in blocks)
        for b in blocks:  # every cache shape, before any address is computed (a strided cache's -1 is addressable)
            if not 0 <= b < r.nblocks:
                raise ValueError(f"block {b} is outside the cache of layer {r.layer} ({r.nblocks} blocks)")
        if not blocks:
            return []
        return [Extent(base + first_pos * r.item, r.ptr, r.stride, r.item, blocks, r.device)]

    def plan(self, nblocks, blocks, first_pos, slot_size, layer=None):
        """Returns the copies (kvstage.plan.plan) that move blocks at request positions first_pos... (one layer, or
        all) between their caches and the room's slots; raises ValueError as extents."""
        return plan(self.extents(nblocks, blocks, first_pos, layer), slot_size)


def _cdiv(a, b):
    return -(-a // b)
