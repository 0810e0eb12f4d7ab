"""SGLang PD-disaggregation transfer backend over kvstage (``--disaggregation-transfer-backend kvstage``).

SGLang's interface, mirrored name for name and signature for signature, as read from
sgl-project/sglang main (the stored copies this was written against):
  python/sglang/srt/disaggregation/base/conn.py    @ 0094505da74125a31ceb354f37ae7a1b6a97d3f5
      KVArgs, KVPoll, KVTransferMetric, BaseKVManager, BaseKVSender, BaseKVReceiver, BaseKVBootstrapServer
  python/sglang/srt/disaggregation/utils.py        @ 0094505da74125a31ceb354f37ae7a1b6a97d3f5
      TransferBackend, KVClassType, get_kv_class (the if/elif the shim wraps), DisaggregationMode
  python/sglang/srt/disaggregation/common/conn.py  @ 8905cbd42f4a
      CommonKVBootstrapServer (kvstage's bootstrap server is SGLang's own), PrefillServerInfo,
      KVTransferError, and CommonKVManager's register_to_bootstrap payload, try_ensure_parallel_info
      and submit_prefill_recompute (the manager itself is not subclassed: its constructor binds a
      ZMQ socket and registers that as the rank's address; kvstage's side channel is its own)
  python/sglang/srt/disaggregation/decode.py, prefill.py: stored copies whose commit the index did not name
      (same period: init(prefill_dp_rank) + send_metadata; that decode.py also passes send_metadata a
      spec_metadata= keyword, hence **_kw) - how the scheduler drives the classes: DecodePreallocQueue,
      DecodeTransferQueue (it frees decode pages on Failed, then calls clear()), PrefillBootstrapQueue
  python/sglang/srt/disaggregation/nixl/conn.py    @ 007ba532d3bee198c0fc40572df051fe423abac3 (a real backend's shape)

How it moves bytes. The decode side opens one kvstage room per request (recv_open) when SGLang
calls send_metadata, and sends the room's descriptor (128 bytes) to the prefill rank over a small
TCP side channel (kvstage.sidechannel: mutual handshake and per-message MACs keyed by the peer
secret); the prefill rank's address comes from the bootstrap server, which speaks SGLang's own
HTTP routes. The prefill side copies its pages into leased slots (kvstage.plan plans the copies)
and sends each slot once it is full; the proxy moves the slots; the decode side, on RECV_DONE,
copies them into its own pages and only then reports Success. Neither the proxy nor the side
channel ever learns an engine page address or index: only the two managers, each about its own
memory.

Room layout (both sides compute it from the same numbers: page count, item lengths, whether
there is aux, the state item counts):
    for each KV buffer b, in kv_data_ptrs order:   npages * kv_item_lens[b] bytes; the request's
                                                   j-th page at j * kv_item_lens[b]
    for each aux buffer a, in aux_data_ptrs order:  aux_item_lens[a] bytes (the aux_index row)
    for each state component c, each tensor t:      n_c * state_item_lens[c][t] bytes; the k-th
                                                   state index's item at k * item_len
Chunk i of the room is slot i (slot_size bytes; the last one the rest).

Abort and page release. The only writer of a decode page is this module's copy-out, and it
runs only for a RECV_DONE of a request that is not aborted; a queued copy-out is cancelled by
the abort. So:
  * abort() (or a timeout, or the prefill aborting) makes poll() say Failed at once; nothing
    writes the request's decode pages after poll() has said Failed (SGLang frees them there).
  * clear() returns once the room's final event (ABORTED, or a RECV_DONE that raced the abort,
    or FAILED) has come and no copy-out of it can run; then .pages_released is True and the
    room's slots are back in the pool. An engine that wants the strict rule frees the pages
    only then. clear() waits at most clear_timeout seconds (then logs, keeps tracking the room
    in the background; pages_released stays False).
The transport itself (local hand-off, tcp between proxies) only ever writes slots; a slot still
touched by a transport after its room ended is a tombstone in the proxy and never reaches an
engine (kvstage's own guarantee, README.md).

Memory. KV and state pages in host memory are copied by the CPU (kvstage.plan.CpuCopier), one
copy per run of contiguous pages. KV on a CUDA device needs libkvstage_cuda (kvstage.cuda) and is
refused with a clear error unless KVSTAGE_SGLANG_CUDA=1: that path is written but has never run
on a GPU. There (kvstage.plan.CudaCopier, on its stream) the pages of one buffer (KV buffer or
state tensor) that lie in one slot are one gather_idx (decode: scatter_idx) of the whole pages plus
a plain copy for each part of a page a slot boundary cuts, or one plain copy per run of contiguous
pages, whichever takes fewer calls (on a tie the plain copies: kvstage.plan says why). Aux
(SGLang's MetadataBuffers) is always host memory.

Topologies. DP attention on either side: the decode side's prefill_dp_rank (SGLang's scheduler picks it: the
bootstrap room modulo the DP size, or the bootstrap server's /query_dp_ranks after the prefill sender's
/register_dp_rank) selects the prefill ranks the bootstrap server registered for that DP rank. Attention-TP
sizes that differ by a power of two (SGLang's CommonKVManager._resolve_rank_mapping for which ranks pair up,
Mooncake's send_kvcache_slice for which heads each pair moves): one room per rank pair, carrying that pair's
heads of every token (MLA: the whole token, from one prefill rank; the others are SGLang's dummy ranks; with
the decode side wider, the decode ranks of a prefill rank read one shared room, the joiners getting its
descriptor through the prefill rank in a room of one descriptor each; KVSTAGE_SGLANG_MLA_SHARED=0: a room
per decode rank instead, as Mooncake sends). A
decode rank succeeds only once every room it has has landed; a failure of any fails the request on that rank,
which aborts all its rooms. The prefill rank checks each share (rank, head range, layer count, dtype, layout)
before it opens the room and refuses a misrouted one, naming what differs.

Not supported (refused with a reason, never silently wrong): attention-TP sizes that are not a power of two
apart, GQA replication on a wider prefill side (more prefill ranks than KV heads), state (mamba) between
different attention-TP sizes, prefill pipeline parallelism or context parallelism, layouts that differ
between the two sides (item lengths), decode-context parallelism (dcp_size > 1).

Settings (environment): KVSTAGE_SOCKET (the proxy; default /run/kvstage/kvstaged.sock),
KVSTAGE_SGLANG_HOST (the address the prefill rank's side channel binds and advertises),
KVSTAGE_PEER_SECRET_FILE or KVSTAGE_PEER_SECRET (the deployment's peer secret: the side channel, kvstage.sidechannel,
authenticates both ends and every message with it; without one the manager refuses to start),
KVSTAGE_SGLANG_CUDA=1, KVSTAGE_SGLANG_CLEAR_TIMEOUT (s, default 10), KVSTAGE_SGLANG_MLA_SHARED=0, and SGLang's own
SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT / SGLANG_DISAGGREGATION_WAITING_TIMEOUT (s, default 300).
See python/SGLANG.md.
"""
from __future__ import annotations

import base64
import collections
import dataclasses
import enum
import errno as _errno
import itertools
import json
import logging
import os
import queue
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Dict, List, Optional

import numpy as np

from . import sidechannel as _sidechannel
from ._lib import KVS_MAX_READERS, KVS_ROOM_DESC_SIZE
from .client import Client, EventType
from .errors import KvstageError, NotConnected, PoolExhausted, Timeout
from .plan import CpuCopier, CudaCopier, Extent, copy_room_out, needs_view, plan
from .sidechannel import FrameListener, desc_bytes

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# SGLang's base classes. Without SGLang this module still imports (its layout pieces work), but the
# backend classes refuse to be instantiated. The test suite puts SGLang stand-ins on sys.path instead
# (python/tests/sglang_stubs).
# ---------------------------------------------------------------------------------------------
try:
    from sglang.srt.disaggregation.base.conn import (  # type: ignore
        BaseKVBootstrapServer, BaseKVManager, BaseKVReceiver, BaseKVSender, KVArgs, KVPoll)
    try:
        from sglang.srt.disaggregation.base.conn import KVTransferMetric  # type: ignore
    except ImportError:  # older SGLang
        KVTransferMetric = None
    HAVE_SGLANG = True
    _NO_SGLANG = None
except Exception as _e:  # not installed, or it failed to import
    logger.debug("kvstage.sglang: SGLang not importable (%s); the backend classes are unusable", _e)
    HAVE_SGLANG = False
    _NO_SGLANG = f"{type(_e).__name__}: {_e}"

    class _NeedsSGLang:
        """Base of the backend classes when SGLang is not importable: instantiating one raises ImportError."""

        def __new__(cls, *a, **kw):
            raise ImportError(f"kvstage.sglang.{cls.__name__} is an SGLang transfer backend class and needs SGLang "
                              f"importable ({_NO_SGLANG}); python/SGLANG.md says which versions")

    BaseKVBootstrapServer = BaseKVManager = BaseKVReceiver = BaseKVSender = KVArgs = _NeedsSGLang
    KVPoll = None
    KVTransferMetric = None

if KVTransferMetric is None:
    @dataclasses.dataclass
    class KVTransferMetric:  # noqa: F811 - SGLang's shape
        transfer_latency_s: Optional[float] = None
        alloc_latency_s: Optional[float] = None
        transfer_total_bytes: Optional[int] = None

try:
    from sglang.srt.disaggregation.utils import DisaggregationMode  # type: ignore
except Exception:
    class DisaggregationMode(enum.Enum):
        NULL = "null"
        PREFILL = "prefill"
        DECODE = "decode"


# SGLang's common pieces (disaggregation/common/conn.py): the bootstrap server kvstage's prefill ranks register
# with (see "Bootstrap server" below), the prefill info the decode side reads, the failure exception.
try:
    from sglang.srt.disaggregation.common.conn import (  # type: ignore
        CommonKVBootstrapServer, KVTransferError, PrefillServerInfo)
    _NO_COMMON = None
except Exception as _e:  # no SGLang, or one older than common/conn.py (May 2025), or without aiohttp
    _NO_COMMON = f"{type(_e).__name__}: {_e}"

    class _NeedsCommon(Exception):
        """What CommonKVBootstrapServer, PrefillServerInfo and KVTransferError are without SGLang's
        common/conn.py: nothing of the backend runs then, and making one raises ImportError."""

        def __new__(cls, *a, **kw):
            raise ImportError(f"kvstage's bootstrap server is SGLang's own CommonKVBootstrapServer and needs SGLang "
                              f"with sglang.srt.disaggregation.common.conn importable ({_NO_COMMON})")

    CommonKVBootstrapServer = PrefillServerInfo = KVTransferError = _NeedsCommon  # type: ignore[misc]


def _env_float(name, default):
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise ValueError(f"${name} must be a number of seconds, not {os.environ[name]!r}") from None


def _mode(m):
    """Returns 'prefill' or 'decode' for a DisaggregationMode (any enum with that value) or string."""
    v = getattr(m, "value", m)
    if v not in ("prefill", "decode"):
        raise ValueError(f"unsupported DisaggregationMode: {m!r}")
    return v


# ---------------------------------------------------------------------------------------------
# Layout: where each byte sits in the room, and the copies that put it there.
# ---------------------------------------------------------------------------------------------

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
    """Offsets of a request's bytes in its room (see the module docstring); .nbytes in all.

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


# ---------------------------------------------------------------------------------------------
# Attention-TP sizes that differ: which prefill ranks serve a decode rank, and which heads each pair moves.
# Both are SGLang's rules at 8905cbd42f4a: CommonKVManager._resolve_rank_mapping (common/conn.py) for the ranks,
# MooncakeKVManager.send_kvcache_slice (mooncake/conn.py) for the head ranges. kvstage moves each pair's share
# through a room of its own; nothing of it writes an engine page except the receiving side's copy-out.
# ---------------------------------------------------------------------------------------------

def tp_sizes_unsupported(prefill_tp, decode_tp):
    """Returns why the kvstage backend cannot pair these attention-TP sizes (None: it can): one must be the other
    times a power of two."""
    lo, hi = sorted((int(prefill_tp), int(decode_tp)))
    if lo < 1:
        return "an attention-TP size below 1"
    if hi % lo or (hi // lo) & (hi // lo - 1):
        return "one attention-TP size must be the other times a power of two"
    return None


def rank_mapping(prefill_tp, decode_tp, decode_rank, is_mla):
    """SGLang's _resolve_rank_mapping, TP part: returns (target_tp_rank, target_tp_ranks, required_dst_info_num,
    required_prefill_response_num) for decode rank decode_rank (engine_rank; taken modulo decode_tp). For MLA with
    the prefill side wider, only target_tp_rank sends; the other target ranks are SGLang's dummy ranks."""
    P, D = int(prefill_tp), int(decode_tp)
    d = int(decode_rank) % D
    if D == P:
        return d, [d], 1, 1
    if D > P:
        return d // (D // P), [d // (D // P)], D // P, 1
    k = P // D
    ranks = list(range(d * k, (d + 1) * k))
    return ranks[0], ranks, 1, 1 if is_mla else k


def decode_slices(prefill_tp, decode_tp, prefill_rank, kv_item_lens, page_size, is_mla):
    """The part of each of its tokens a decode rank expects from prefill rank prefill_rank: per KV buffer
    [offset, length] in bytes of its token (kv_item_lens[b] // page_size bytes). A decode rank does not know the
    model's KV head count (SGLang gives it only with its staging buffer), so it assumes no GQA replication on the
    prefill side: prefill_tp / decode_tp prefill ranks each fill an equal part, in rank order. The prefill rank
    checks this against Mooncake's arithmetic with the head count (prefill_slices) and refuses what differs."""
    P, D, ps = int(prefill_tp), int(decode_tp), int(page_size)
    out = []
    for b, item in enumerate(kv_item_lens):
        if ps < 1 or item % ps:
            raise ValueError(f"KV buffer {b}: item of {item} bytes is not {ps} tokens")
        tok = item // ps
        if is_mla or D >= P:
            out.append([0, tok])
            continue
        k = P // D
        if tok % k:
            raise ValueError(f"KV buffer {b}: a {tok}-byte token cannot take {k} prefill ranks' heads")
        out.append([(prefill_rank % k) * (tok // k), tok // k])
    return out


def head_slice(total_heads, prefill_tp, prefill_rank, decode_tp, decode_rank, src_token, dst_token):
    """Mooncake's send_kvcache_slice for one KV buffer: returns (src_off, dst_off, nbytes), the bytes of each token
    prefill rank prefill_rank sends to decode rank decode_rank (at src_off of its token, src_token bytes) and where
    they go in the decode rank's token (dst_off, dst_token bytes). Raises ValueError when the tokens do not split into
    heads the same way on both sides (another dtype, head size or head count)."""
    H, P, D = int(total_heads), int(prefill_tp), int(decode_tp)
    p, d = int(prefill_rank) % P, int(decode_rank) % D
    src_heads, dst_heads = max(1, H // P), max(1, H // D)
    head = dst_token // dst_heads
    if head < 1 or dst_token % dst_heads or src_token != src_heads * head:
        raise ValueError(f"tokens of {src_token} bytes here ({src_heads} heads) and {dst_token} bytes on the decode "
                         f"side ({dst_heads} heads) are not the same heads: another dtype, head size or head count")
    if P > D:
        src_start, count = 0, src_heads
        dst_start = ((p // max(1, P // H)) * src_heads) % dst_heads
    else:  # consecutive decode ranks share a KV head when H < D (QKVParallelLinear: tp_rank // replicas)
        src_start = ((d // max(1, D // H)) * dst_heads) % src_heads
        count, dst_start = dst_heads, 0
    if (dst_start + count) * head > dst_token:
        raise ValueError(f"{count} heads from head {dst_start} do not fit a {dst_token}-byte token")
    return src_start * head, dst_start * head, count * head


# ---------------------------------------------------------------------------------------------
# What the decode side tells a prefill rank over the side channel (kvstage.sidechannel): meta and abort.
# ---------------------------------------------------------------------------------------------

# Bounds of a side-channel message's numbers: far above any real request, low enough that nothing computed from
# them (room bytes, layout offsets) can overflow or allocate absurdly.
_MAX_ROOM_ID = (1 << 63) - 1
_MAX_PAGES = 1 << 31
_MAX_NBYTES = 1 << 50
_MAX_LIST = 4096


def _is_int(v, lo=0, hi=_MAX_NBYTES):
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _int_list(v, hi=_MAX_NBYTES):
    return isinstance(v, list) and len(v) <= _MAX_LIST and all(_is_int(x, 0, hi) for x in v)


def check_side_message(msg):
    """Returns None if msg is a well-formed side-channel message (decode -> prefill rank), else why not.
    meta: {t, room, npages, aux, state_counts, nbytes, prefix_len, layout, desc, from}; abort: {t, room}.
    Every field is checked for presence, type and range, so nothing downstream can raise on a message."""
    if not isinstance(msg, dict):
        return "not a JSON object"
    if not _is_int(msg.get("room"), 0, _MAX_ROOM_ID):
        return f"room must be an integer in [0, 2^63), not {msg.get('room')!r:.40}"
    t = msg.get("t")
    if t == "abort":
        return None
    if t != "meta":
        return f"unknown message type {t!r:.40}"
    if not _is_int(msg.get("npages"), 0, _MAX_PAGES):
        return f"npages must be an integer in [0, 2^31], not {msg.get('npages')!r:.40}"
    if not isinstance(msg.get("aux"), bool):
        return f"aux must be true or false, not {msg.get('aux')!r:.40}"
    if not _int_list(msg.get("state_counts"), _MAX_PAGES):
        return "state_counts must be a list of integers in [0, 2^31]"
    if not _is_int(msg.get("nbytes")):
        return f"nbytes must be an integer in [0, 2^50], not {msg.get('nbytes')!r:.40}"
    if not _is_int(msg.get("prefix_len", 0), 0, _MAX_PAGES * 1024):
        return f"prefix_len must be a non-negative integer, not {msg.get('prefix_len')!r:.40}"
    lay = msg.get("layout")
    if not isinstance(lay, dict):
        return "layout must be an object"
    if not (_int_list(lay.get("kv_item_lens")) and _int_list(lay.get("aux_item_lens"))):
        return "layout.kv_item_lens and layout.aux_item_lens must be lists of non-negative integers"
    sil = lay.get("state_item_lens")
    if not (isinstance(sil, list) and len(sil) <= _MAX_LIST and all(_int_list(c) for c in sil)):
        return "layout.state_item_lens must be a list of lists of non-negative integers"
    st = lay.get("state_types", [])
    if not (isinstance(st, list) and len(st) <= _MAX_LIST and all(isinstance(x, str) for x in st)):
        return "layout.state_types must be a list of strings"
    if "from" in msg and not isinstance(msg["from"], str):
        return "from must be a string"
    if msg.get("kv_cache_dtype") is not None and not isinstance(msg["kv_cache_dtype"], str):
        return "kv_cache_dtype must be a string or null"
    tp = msg.get("tp")
    if tp is not None:
        if not isinstance(tp, dict):
            return "tp must be an object"
        for key in ("prefill_rank", "prefill_tp", "decode_rank", "decode_tp"):
            if not _is_int(tp.get(key), 0, 1 << 20):
                return f"tp.{key} must be an integer in [0, 2^20], not {tp.get(key)!r:.40}"
        if not (tp["prefill_rank"] < tp["prefill_tp"] and tp["decode_rank"] < tp["decode_tp"]):
            return "tp ranks must be below their TP sizes"
        sl = tp.get("slices")
        if not (isinstance(sl, list) and len(sl) <= _MAX_LIST
                and all(_int_list(x) and len(x) == 2 for x in sl)):
            return "tp.slices must be a list of [offset, length] pairs"
        if not isinstance(tp.get("dummy", False), bool) or not isinstance(tp.get("join", False), bool):
            return "tp.dummy and tp.join must be true or false"
        if not _is_int(tp.get("readers", 1), 1, KVS_MAX_READERS):
            return f"tp.readers must be an integer from 1 to {KVS_MAX_READERS}"
    d = msg.get("desc")
    if d is None:
        if msg["nbytes"]:
            return "desc missing for a room of more than 0 bytes"
    else:
        try:
            desc_bytes(d)
        except ValueError as e:
            return str(e)
    return None


def _decode_rank_of(meta):
    """The decode attention-TP rank a meta message comes from (None: a decode rank that names no rank pair)."""
    tp = meta.get("tp")
    return tp.get("decode_rank") if isinstance(tp, dict) else None


def _http(method, url, body=None, timeout=5.0):
    """Returns (status, parsed JSON or text) of one HTTP request; (None, reason) if it could not be made."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw, status = resp.read(), resp.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    except (OSError, ValueError) as e:
        return None, str(e)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def _url_host(host):
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


# ---------------------------------------------------------------------------------------------
# Bootstrap server: SGLang's own (disaggregation/common/conn.py), as Mooncake and NIXL use it, so its
# routes, health check, dp-rank registry and whatever SGLang adds there serve kvstage too. The prefill
# rank registers its side channel's address there; the layout both sides must share travels in the
# decode side's first side-channel message and is checked by the prefill rank (KvstageKVSender._adopt).
# ---------------------------------------------------------------------------------------------
class KvstageKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's CommonKVBootstrapServer, unchanged: kvstage's prefill ranks register their side-channel
    address with it (PUT /route) as Mooncake's and NIXL's register theirs."""


def bootstrap_server_on_a_free_port(host="127.0.0.1", tries=5, timeout=10.0):
    """Starts a KvstageKVBootstrapServer on a free port of host and returns it once its /health answers
    (.port is the port). For programs that play SGLang's launcher (python/examples/pd_demo.py, the tests):
    SGLang's server takes a port and listens from a thread it starts, so the port is found first; if another
    process takes it in between, another port is tried."""
    for _ in range(tries):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        server = KvstageKVBootstrapServer(host, port)
        deadline = time.monotonic() + timeout
        while server.thread.is_alive() and time.monotonic() < deadline:
            if _http("GET", f"http://{_url_host(host)}:{port}/health", timeout=1)[0] == 200:
                server.port = port
                return server
            time.sleep(0.01)  # a server that is starting: poll its readiness
        server.close()
    raise RuntimeError(f"the bootstrap server did not come up on {host} in {tries} tries")


# ---------------------------------------------------------------------------------------------
# The manager: one kvstage connection per engine rank; every sender/receiver polls through it.
# ---------------------------------------------------------------------------------------------

def _parallel(server_args, args):
    """Returns (attn_tp_size, attn_tp_rank, attn_dp_size, attn_dp_rank), from SGLang's runtime when it has one."""
    try:
        from sglang.srt.runtime_context import get_parallel  # type: ignore
        from sglang.srt.layers.dp_attention import get_attention_dp_rank, get_attention_dp_size  # type: ignore
        p = get_parallel()
        return p.attn_tp_size, p.attn_tp_rank, get_attention_dp_size(), get_attention_dp_rank()
    except Exception:
        pass
    try:
        from sglang.srt.layers.dp_attention import (  # type: ignore
            get_attention_dp_rank, get_attention_dp_size, get_attention_tp_rank, get_attention_tp_size)
        return get_attention_tp_size(), get_attention_tp_rank(), get_attention_dp_size(), get_attention_dp_rank()
    except Exception:
        pass
    tp = int(getattr(server_args, "tp_size", 1) or 1)
    dp = int(getattr(server_args, "dp_size", 1) or 1)
    attn_dp = dp if getattr(server_args, "enable_dp_attention", False) else 1
    attn_tp = max(tp // attn_dp, 1)
    rank = int(getattr(args, "engine_rank", 0) or 0)
    return attn_tp, rank % attn_tp, attn_dp, (rank // attn_tp) if attn_dp > 1 else 0


def _local_host(server_args):
    h = os.environ.get("KVSTAGE_SGLANG_HOST")
    if h:
        return h
    try:
        from sglang.srt.utils.network import get_local_ip_auto  # type: ignore
        return get_local_ip_auto()
    except Exception:
        pass
    h = getattr(server_args, "host", None)
    if h and h not in ("0.0.0.0", "::"):
        return h
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class KvstageKVManager(BaseKVManager):
    """One engine rank's side: its kvstage connection, its buffers (KVArgs), the bootstrap registration (prefill)
    or the prefill lookups (decode). Attributes the scheduler and tests may set: bootstrap_timeout, waiting_timeout,
    clear_timeout (seconds; each request copies them at creation), copier (CpuCopier or CudaCopier)."""

    def __init__(self, args: KVArgs, disaggregation_mode, server_args, is_mla_backend: Optional[bool] = False):
        self.kv_args = args
        self.server_args = server_args
        self.disaggregation_mode = disaggregation_mode
        self.mode = _mode(disaggregation_mode)
        self.is_mla_backend = bool(is_mla_backend)
        if int(getattr(args, "dcp_size", 1) or 1) > 1:
            raise RuntimeError("kvstage backend: decode-context parallelism (dcp_size > 1) is not supported")
        # the side channel's key: no peer secret (or a refused one) is a start-up error, not a per-request one
        self._side_key = _sidechannel.load_key(getattr(server_args, "kvstage_peer_secret_file", None))
        kv_device = self._kv_on_device(server_args)
        self.mem = MemoryMap(args, kv_device)
        if kv_device:
            if os.environ.get("KVSTAGE_SGLANG_CUDA") != "1":
                raise RuntimeError(
                    f"kvstage backend: the KV cache is on device {getattr(server_args, 'device', 'cuda')!r}; the CUDA "
                    "path (libkvstage_cuda) is written but untested (no GPU on the development machine). "
                    "Set KVSTAGE_SGLANG_CUDA=1 to use it anyway, or run the KV cache in host memory.")
            self.copier = CudaCopier(int(getattr(args, "gpu_id", 0) or 0))
        else:
            self.copier = CpuCopier()
        self.bootstrap_timeout = _env_float("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300)
        self.waiting_timeout = _env_float("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300)
        self.clear_timeout = _env_float("KVSTAGE_SGLANG_CLEAR_TIMEOUT", 10)
        self.socket_path = getattr(server_args, "kvstage_socket", None) or os.environ.get("KVSTAGE_SOCKET")
        (self.attn_tp_size, self.attn_tp_rank, self.attn_dp_size, self.attn_dp_rank) = _parallel(server_args, args)
        self.attn_cp_size, self.attn_cp_rank = 1, 0
        self.pp_size = int(getattr(server_args, "pp_size", 1) or 1)
        self.pp_rank = int(getattr(args, "pp_rank", 0) or 0)
        self.system_dp_size = (1 if getattr(server_args, "enable_dp_attention", False)
                               else int(getattr(server_args, "dp_size", 1) or 1))
        self.system_dp_rank = int(getattr(args, "system_dp_rank", 0) or 0)
        self.bootstrap_host = getattr(server_args, "host", "127.0.0.1")
        self.bootstrap_port = getattr(server_args, "disaggregation_bootstrap_port", 8998)
        self._client = None
        self._uids = itertools.count(1)
        self._objs: Dict[int, object] = {}  # room user_data -> sender/receiver (kept until the room's final event)
        self.closed = False
        self.enable_staging = False
        if self.mode == "prefill":
            self._inbox = queue.SimpleQueue()
            self.local_ip = _local_host(server_args)
            self._listener = FrameListener(self.local_ip, 0, self._inbox.put,
                                           lambda m: True, "sglang",  # each message checked in _drain_inbox
                                           self._side_key)
            self.rank_port = self._listener.port
            self.senders: Dict[int, "KvstageKVSender"] = {}
            self.pending_meta: Dict[int, tuple] = {}   # bootstrap_room -> (meta, arrival time)
            self.tombstones: Dict[int, float] = {}     # bootstrap_room -> when it was aborted
            self.register_to_bootstrap()
        else:
            self.prefill_info_table: Dict[str, PrefillServerInfo] = {}
            self.connection_pool: Dict[str, dict] = {}
            self._peers = _sidechannel.Peers(self._side_key)  # one cached connection per prefill rank
            self._recompute_pool = None                # retract rebootstrap: POSTs /generate off the scheduler thread
            self._recompute_failed = queue.SimpleQueue()  # (receiver, reason), applied by pump()
        self.client()  # connect now: a missing proxy is a start-up error, not a per-request one

    @staticmethod
    def _kv_on_device(server_args):
        mem = os.environ.get("KVSTAGE_SGLANG_KV_MEMORY", "auto")
        if mem == "auto":
            mem = str(getattr(server_args, "device", "cuda") or "cuda")
        if mem == "cpu":
            return False
        if mem.startswith("cuda"):
            return True
        raise RuntimeError(f"kvstage backend: KV cache on device {mem!r} is not supported (cpu or cuda)")

    # -- the connection -------------------------------------------------------------------
    def client(self):
        """Returns the kvstage Client, connecting if needed; raises KvstageError."""
        if self.closed:
            raise KvstageError(-_errno.EBADF, None, "the kvstage manager is closed")
        if self._client is None:
            self._client = Client(self.socket_path)
        return self._client

    def _broken(self, exc):
        """The connection is gone or out of step: every open request fails (nothing of theirs can land), reconnect
        later."""
        logger.error("kvstage backend: connection to kvstaged lost (%s); failing %d requests", exc, len(self._objs))
        objs, self._objs = list(self._objs.values()), {}
        for o in objs:
            o._lost(f"connection to kvstaged lost: {exc}")
        c, self._client = self._client, None
        try:
            c.close()
        except Exception:
            pass

    def _register_obj(self, obj):
        uid = next(self._uids)
        self._objs[uid] = obj
        return uid

    def _dispatch(self, evs):
        for ev in evs:
            obj = self._objs.get(ev.user_data)
            if obj is not None:
                obj._on_event(ev)

    def pump(self):
        """Takes the side channel's messages and the proxy's events, and hands each to its request (never blocks)."""
        if self.mode == "prefill":
            self._drain_inbox()
        else:
            self._drain_recompute_failures()
        if self._client is None:
            return
        try:
            while True:
                evs = self._client.poll(128)
                self._dispatch(evs)
                if len(evs) < 128:
                    break
        except (NotConnected, Timeout) as e:
            self._broken(e)

    def wait_until(self, pred, timeout):
        """Pumps, blocking on the proxy's events, until pred() or timeout seconds; returns pred()."""
        deadline = time.monotonic() + timeout
        while True:
            self.pump()
            if pred():
                return True
            left = deadline - time.monotonic()
            if left <= 0 or self._client is None:
                return pred()
            try:
                self._dispatch(self._client.wait(min(left, 0.05)))
            except (NotConnected, Timeout) as e:
                self._broken(e)

    def close(self):
        """Fails what is left, closes the connection (the proxy reclaims everything) and the side channel."""
        if self.closed:
            return
        for o in list(self._objs.values()):
            o._lost("the kvstage manager closed")
        self._objs.clear()
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
            self._client = None
        self.closed = True
        if self.mode == "prefill":
            self._listener.close()
        else:
            if self._recompute_pool is not None:
                self._recompute_pool.shutdown(wait=False, cancel_futures=True)
            self._peers.close()

    # -- prefill side ---------------------------------------------------------------------
    def register_to_bootstrap(self):
        """Registers this prefill rank (its side channel's address) with the bootstrap server (PUT /route), with
        the payload SGLang's CommonKVManager sends (the server answers 500 to one that lacks a field)."""
        dist = getattr(self.server_args, "dist_init_addr", None)
        if dist:
            host = dist.rsplit(":", 1)[0].strip("[]")
        else:
            host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.bootstrap_host, self.bootstrap_host)
        url = f"http://{_url_host(host)}:{self.bootstrap_port}/route"
        payload = {
            "attn_tp_size": self.attn_tp_size, "attn_tp_rank": self.attn_tp_rank,
            "attn_cp_size": self.attn_cp_size, "attn_cp_rank": self.attn_cp_rank,
            "attn_dp_size": self.attn_dp_size, "attn_dp_rank": self.attn_dp_rank,
            "pp_size": self.pp_size, "pp_rank": self.pp_rank,
            "system_dp_size": self.system_dp_size, "system_dp_rank": self.system_dp_rank,
            "rank_ip": self.local_ip, "rank_port": self.rank_port,
            "page_size": getattr(self.kv_args, "page_size", None),
            "kv_cache_dtype": getattr(self.server_args, "kv_cache_dtype", None),
            "load_balance_method": getattr(self.server_args, "load_balance_method", "follow_bootstrap_room"),
            "enable_dsa_cache_layer_split": getattr(self.server_args, "enable_dsa_cache_layer_split", False),
            "prefill_http_port": getattr(self.server_args, "port", None),
        }
        delay = 0.5
        for attempt in range(6):
            status, text = _http("PUT", url, payload)
            if status == 200:
                return
            logger.warning("kvstage backend: registering with the bootstrap server %s failed (%s: %s), attempt %d",
                           url, status, text, attempt + 1)
            time.sleep(delay)
            delay = min(delay * 2, 8)
        logger.error("kvstage backend: this prefill rank could not register with the bootstrap server at %s", url)

    def _drain_inbox(self):
        now = time.monotonic()
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
            why = check_side_message(msg)
            if why is not None:
                self._reject_malformed(msg, why)
                continue
            room = msg["room"]
            kind = msg.get("t")
            if kind == "meta":
                s = self.senders.get(room)
                if room in self.tombstones:
                    self._reject(msg, "the prefill side already aborted this request")
                elif s is not None:
                    s._offer(msg)
                else:  # the decode ranks may ask before this rank has the request: kept until its sender comes
                    waiting = self.pending_meta.setdefault(room, ([], now))[0]
                    if any(_decode_rank_of(m) == _decode_rank_of(msg) for m in waiting):
                        self._reject(msg, "a second transfer request for a room in use")
                    else:
                        waiting.append(msg)
            elif kind == "abort":
                s = self.senders.get(room)
                pending = self.pending_meta.pop(room, None)
                for m in (pending[0] if pending is not None else ()):
                    self._reject(m, "aborted by the decode side")
                if s is None:
                    self.tombstones[room] = now
                elif s._status != KVPoll.Success:  # a transfer that completed stays complete
                    s._fail("aborted by the decode side")
        for room, (msgs, t) in list(self.pending_meta.items()):  # decode asked, this rank never had the request
            if now - t > self.bootstrap_timeout:
                del self.pending_meta[room]
                for m in msgs:
                    self._reject(m, "no such request on this prefill rank before the bootstrap timeout")
        for room, t in list(self.tombstones.items()):
            if now - t > self.bootstrap_timeout:
                del self.tombstones[room]

    def kv_heads_total(self):
        """The model's KV head count (SGLang's KVArgs.total_kv_head_num, else kv_head_num per rank times the attention
        TP size, as Mooncake reads them), or None when KVArgs has neither."""
        total = int(getattr(self.kv_args, "total_kv_head_num", 0) or 0)
        if total > 0:
            return total
        per_rank = int(getattr(self.kv_args, "kv_head_num", 0) or 0)
        return per_rank * self.attn_tp_size if per_rank > 0 else None

    def share_for(self, meta):
        """Prefill side: checks that the share a decode rank asks for (its meta message) is this rank's to send and
        lands where the decode rank expects it; returns (kv_slices, senders_to): per KV buffer (offset, length) of
        this rank's tokens to send (None: whole pages), and how many decode ranks this rank sends the request to.
        Raises ValueError saying what is misrouted (rank, head range, layer count, dtype, layout)."""
        mine, theirs = self.mem.fingerprint(), meta.get("layout", {})
        dt, my_dt = meta.get("kv_cache_dtype"), getattr(self.server_args, "kv_cache_dtype", None)
        if dt is not None and my_dt is not None and str(dt) != str(my_dt):
            raise ValueError(f"misrouted share: KV cache dtype {dt} on the decode side, {my_dt} on this prefill rank")
        tp = meta.get("tp")
        if tp is None:  # a decode rank that names no rank pair: the same attention-TP size, whole pages
            why = MemoryMap.mismatch(mine, theirs)
            if why:
                raise ValueError(f"layout mismatch with the decode side: {why}")
            return None, 1
        P, p, D, d = self.attn_tp_size, self.attn_tp_rank, tp["decode_tp"], tp["decode_rank"]
        if (tp["prefill_tp"], tp["prefill_rank"]) != (P, p):
            raise ValueError(f"misrouted share: meant for prefill rank {tp['prefill_rank']} of attention TP "
                             f"{tp['prefill_tp']}, this is rank {p} of {P}")
        why = tp_sizes_unsupported(P, D)
        if why:
            raise ValueError(f"prefill attention TP {P}, decode {D}: {why}")
        if (d // (D // P) if D >= P else p // (P // D)) != (p if D >= P else d):
            raise ValueError(f"misrouted share: decode rank {d} of attention TP {D} does not take its KV from "
                             f"prefill rank {p} of {P}")
        if len(theirs.get("kv_item_lens", [])) != len(mine["kv_item_lens"]):
            raise ValueError(f"misrouted share: {len(theirs.get('kv_item_lens', []))} KV buffers (layers x K/V) on "
                             f"the decode side, {len(mine['kv_item_lens'])} on this prefill rank")
        if P == D:
            why = MemoryMap.mismatch(mine, theirs)
            if why:
                raise ValueError(f"layout mismatch with the decode side: {why}")
            return None, 1
        for key in ("aux_item_lens", "state_item_lens"):
            if mine.get(key) != theirs.get(key):
                raise ValueError(f"layout mismatch with the decode side: {key} differ: this side {mine.get(key)}, "
                                 f"the decode side {theirs.get(key)}")
        if any(meta.get("state_counts") or []):
            raise ValueError(f"state (mamba and the like) between attention-TP sizes {P} and {D} is not supported by "
                             "the kvstage backend")
        ps = int(getattr(self.kv_args, "page_size", 1) or 1)
        heads = self.kv_heads_total()
        if not self.is_mla_backend and heads is None:
            raise ValueError("attention-TP sizes differ and this prefill rank's KVArgs give no kv_head_num")
        slices = []
        for b, (mi, ti, want) in enumerate(zip(mine["kv_item_lens"], theirs["kv_item_lens"], tp["slices"])):
            src, dst = mi // ps, ti // ps
            if self.is_mla_backend:
                if src != dst:
                    raise ValueError(f"misrouted share: KV buffer {b}: MLA tokens of {src} bytes here, {dst} on the "
                                     "decode side")
                src_off, dst_off, n = 0, 0, src
            else:
                try:
                    src_off, dst_off, n = head_slice(heads, P, p, D, d, src, dst)
                except ValueError as e:
                    raise ValueError(f"misrouted share: KV buffer {b}: {e}") from None
            if list(want) != [dst_off, n]:
                raise ValueError(f"misrouted share: KV buffer {b}: the decode rank {d} expects bytes [{want[0]}, "
                                 f"{want[0] + want[1]}) of its {dst}-byte token from prefill rank {p}, which sends "
                                 f"[{dst_off}, {dst_off + n}) (heads {heads}, attention TP {P} -> {D})")
            slices.append((src_off, n))
        if len(tp["slices"]) != len(slices):
            raise ValueError("misrouted share: a head range per KV buffer expected")
        readers = tp.get("readers", 1)
        joins = bool(tp.get("join"))
        if readers > 1 and not (self.is_mla_backend and readers == D // P and joins == bool(d % readers)):
            raise ValueError(f"misrouted share: a shared room of {readers} readers from decode rank {d} of {D} "
                             f"(join {joins}), prefill attention TP {P}, MLA {self.is_mla_backend}")
        return slices, max(1, D // P)

    def _reject_malformed(self, msg, why):
        """A message that fails check_side_message: the request it names (if its descriptor can be read) is refused
        (its decode room aborted, so the decode side fails at once); nothing else changes on this rank."""
        room = msg.get("room") if isinstance(msg, dict) else None
        logger.warning("kvstage backend: refused a malformed side-channel message (bootstrap_room %.40r, "
                       "from %.80r): %s", room, msg.get("from") if isinstance(msg, dict) else None, why)
        if isinstance(msg, dict):  # a descriptor that cannot be read names no room: the decode side times out
            self._reject(msg, f"malformed transfer request: {why}")

    def _reject(self, msg, why):
        """Aborts the decode room a message names (so the decode side fails at once, not at its timeout)."""
        logger.info("kvstage backend: refusing the transfer of bootstrap_room %s: %s", msg.get("room"), why)
        desc = msg.get("desc")
        if not desc:
            return
        try:
            r = self.client().send_open(desc_bytes(desc), user_data=0)
            r.abort()
            r.close()
        except (KvstageError, ValueError) as e:
            logger.debug("kvstage backend: the refused room was gone already: %s", e)

    # -- decode side ----------------------------------------------------------------------
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """One non-blocking attempt to fetch and cache the prefill server's info; True once it is known."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        status, data = _http("GET", f"http://{bootstrap_addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
                                    f"&target_tp_rank=-1&target_pp_rank=-1")
        if status != 200 or not isinstance(data, dict):
            logger.debug("kvstage backend: prefill info from %s not available yet: %s %s", bootstrap_addr, status, data)
            return False
        fields = {f.name for f in dataclasses.fields(PrefillServerInfo)}
        info = PrefillServerInfo(**{k: v for k, v in data.items() if k in fields})
        ps = getattr(self.kv_args, "page_size", None)
        if info.page_size is not None and ps is not None and int(info.page_size) != int(ps):
            raise RuntimeError(f"Page size mismatch: prefill server has page_size={info.page_size}, but decode "
                               f"server has page_size={ps}. Both servers must use the same --page-size value.")
        dt = getattr(self.server_args, "kv_cache_dtype", None)
        if info.kv_cache_dtype is not None and dt is not None and info.kv_cache_dtype != dt:
            raise RuntimeError(f"KV cache dtype mismatch: prefill server has kv_cache_dtype={info.kv_cache_dtype}, "
                               f"but decode server has kv_cache_dtype={dt}. Both servers must use the same "
                               f"--kv-cache-dtype value.")
        self.prefill_info_table[bootstrap_addr] = info
        return True

    def rank_endpoint(self, bootstrap_addr, dp_rank, tp_rank):
        """Returns 'host:port' of a prefill rank's side channel (cached), or None."""
        key = f"{bootstrap_addr}_{dp_rank}_0_{tp_rank}"
        hit = self.connection_pool.get(key)
        if hit is None:
            status, data = _http("GET", f"http://{bootstrap_addr}/route?prefill_dp_rank={dp_rank}&prefill_cp_rank=0"
                                        f"&target_tp_rank={tp_rank}&target_pp_rank=0")
            if status != 200 or not isinstance(data, dict) or not _is_int(data.get("rank_port"), 1, 65535) \
                    or not isinstance(data.get("rank_ip"), str):
                logger.error("kvstage backend: no prefill rank dp=%s tp=%s at %s: %s %s",
                             dp_rank, tp_rank, bootstrap_addr, status, data)
                return None
            hit = self.connection_pool[key] = data
        return f"{_url_host(hit['rank_ip'])}:{hit['rank_port']}"

    def submit_prefill_recompute(self, kv_receiver, payload: dict) -> None:
        """PD retract rebootstrap (SGLang's CommonKVManager.submit_prefill_recompute; decode.py calls it right after
        send_metadata for a request bootstrapped again after pause_generation(mode="retract")): asks the original
        prefill server to recompute the request's prefix KV (POST payload to its /generate, at the bootstrap
        address's host and the HTTP port the prefill registered), which then sends it into the room kv_receiver
        has just opened. Never blocks: the POST runs on a small pool. Only the decode leader (attention TP/CP rank
        0, first PP stage) posts; the other ranks just receive. Any failure (no prefill HTTP port known, an HTTP
        error, no answer) fails kv_receiver through the usual path (poll() says Failed, the reason names the
        rebootstrap), unless its transfer has completed already."""
        if self.attn_tp_rank != 0 or self.attn_cp_rank != 0 or self.pp_rank != 0:
            return
        url = self._rebootstrap_prefill_url(kv_receiver)
        if not url:
            logger.error("kvstage backend: PD retract rebootstrap: no prefill /generate URL for bootstrap_room %s "
                         "(bootstrap_addr %s)", getattr(kv_receiver, "bootstrap_room", None),
                         getattr(kv_receiver, "bootstrap_addr", None))
            return kv_receiver._fail("PD retract rebootstrap could not resolve the prefill /generate URL from "
                                     "bootstrap info (the prefill server registered no HTTP port)")
        if self._recompute_pool is None:  # made here, by the scheduler's thread, the only one that calls this
            import concurrent.futures
            n = os.environ.get("SGLANG_DISAGGREGATION_THREAD_POOL_SIZE")
            self._recompute_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=max(1, int(n) if n and n.isdigit() else 16), thread_name_prefix="kvstage-rebootstrap")
        self._recompute_pool.submit(self._run_prefill_recompute, kv_receiver, url, payload)

    def _rebootstrap_prefill_url(self, kv_receiver):
        info = self.prefill_info_table.get(getattr(kv_receiver, "bootstrap_addr", None))
        if info is None or not info.prefill_http_port:
            return None
        host = kv_receiver.bootstrap_addr.rsplit(":", 1)[0]
        return f"http://{_url_host(host)}:{int(info.prefill_http_port)}"

    def _run_prefill_recompute(self, kv_receiver, url, payload):
        """A pool thread: the POST; a failure is handed to the scheduler thread (pump)."""
        rid = payload.get("rid") if isinstance(payload, dict) else None
        try:
            status, body = _http("POST", url + "/generate", payload, timeout=self.waiting_timeout)
        except Exception as e:  # e.g. a payload that is not JSON
            status, body = None, repr(e)
        if status is None or status >= 400:
            why = (f"PD retract rebootstrap /generate failed for rid={rid} (status={status})" if status is not None
                   else f"PD retract rebootstrap /generate request errored for rid={rid}: {body}")
            logger.error("kvstage backend: %s: %s", why, str(body)[:512])
            self._recompute_failed.put((kv_receiver, why))

    def _drain_recompute_failures(self):
        while True:
            try:
                r, why = self._recompute_failed.get_nowait()
            except queue.Empty:
                return
            if r._status != KVPoll.Success:  # a transfer that completed stays complete
                r._fail(why)

    def send_to(self, endpoint, msg):
        """Sends one message to a prefill rank at endpoint ("host:port"); raises OSError
        (sidechannel.HandshakeError when the rank did not prove it holds the peer secret); see sidechannel.Peers."""
        host, port = endpoint.rsplit(":", 1)
        self._peers.send(host, int(port), msg)


# ---------------------------------------------------------------------------------------------
# Prefill: the sender.
# ---------------------------------------------------------------------------------------------

def _first_share(name):
    """A request's attribute that is its first share's (its only one when both sides have one TP size)."""
    return property(lambda self: getattr(self._shares[0], name) if self._shares else None)


class _SendShare:
    """One rank pair's share of a request on the prefill side: the decode rank's meta message, the room it opened,
    the slots being filled for it. Equal attention-TP sizes: the only one, whole pages."""

    def __init__(self, sender, meta):
        self.sender = sender
        self.meta = meta
        self.decode_rank = _decode_rank_of(meta)
        self.slices = None
        self.room = self.uid = self.final = self.layout = self.written = None
        self.next_chunk = 0               # the sender's chunks taken into extents so far
        self.extents = collections.deque()
        self.leases = {}                  # chunk -> Lease being filled
        self.views = {}
        self.unsent = []                  # chunks full but not yet taken (ring full)
        self.in_flight = {}               # (slot, epoch) -> Lease sent, until the room ends (a REJECTED one comes back)
        self.sent_chunks = 0
        self.done = False                 # SEND_DONE, or every byte of a room-less share handled
        tp = meta.get("tp") or {}
        self.join = bool(tp.get("join"))  # MLA read once: a reader of the shared room; its room takes the descriptor
        self.readers = int(tp.get("readers", 1))
        self.relayed = False

    def _on_event(self, ev):
        self.sender._on_share_event(self, ev)

    def _lost(self, reason):
        self.final = self.final or "lost"
        self.room = None
        self.sender._fail(reason)


class KvstageKVSender(BaseKVSender):
    """Prefill side of one request: copies its pages into slots of the decode side's room (one room per decode rank
    it serves when the attention-TP sizes differ, each its share of the heads)."""

    def __init__(self, mgr: KvstageKVManager, bootstrap_addr: str, bootstrap_room: int, dest_tp_ranks: List[int],
                 pp_rank: int, req_has_disagg_prefill_dp_rank: bool = False, **_kw):
        self.kv_mgr = mgr
        self.bootstrap_server_url = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.aux_index = None
        self.num_kv_indices = None
        self.curr_idx = 0
        self.conclude_state = None
        self.bootstrap_timeout = mgr.bootstrap_timeout
        self._status = KVPoll.Bootstrapping
        self._reason = None
        self._created = time.monotonic()
        self._shares: List[_SendShare] = []
        self._required = None             # decode ranks this rank sends the request to (from the first meta)
        self._chunks = []                 # (pages, first_pos, last, state_indices), every share takes each
        self._last_queued = False
        self._t_first = self._t_done = None
        if bootstrap_room in mgr.senders:
            self._fail(f"a second sender for bootstrap_room {bootstrap_room} on this rank")
            return
        mgr.senders[bootstrap_room] = self
        if bootstrap_room in mgr.tombstones:
            self._fail("aborted by the decode side before the prefill side had the request")
            return
        dp_size = int(getattr(mgr.server_args, "dp_size", 1) or 1) if mgr.server_args is not None else 1
        if dp_size > 1 and not req_has_disagg_prefill_dp_rank:  # CommonKVSender.__init__'s rule, its words
            if getattr(mgr.server_args, "load_balance_method", "follow_bootstrap_room") != "follow_bootstrap_room":
                self._register_prefill_dp_rank()
            elif mgr.attn_dp_rank != bootstrap_room % dp_size:
                if os.environ.get("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK", "").lower() in (
                        "1", "true", "yes", "y", "on"):
                    self._register_prefill_dp_rank()
                else:
                    self._fail(f"follow_bootstrap_room conflict: dispatched to dp_rank {mgr.attn_dp_rank} but "
                               f"bootstrap_room {bootstrap_room} implies dp_rank {bootstrap_room % dp_size}. Set "
                               "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 to allow mixed routing.")
                    return
        pending = mgr.pending_meta.pop(bootstrap_room, None)
        for meta in (pending[0] if pending is not None else ()):
            self._offer(meta)

    def _register_prefill_dp_rank(self):
        """Tells the bootstrap server this request's DP rank (POST /register_dp_rank), for the decode side's
        /query_dp_ranks when rooms do not name DP ranks (load_balance_method other than follow_bootstrap_room)."""
        status, text = _http("POST", f"http://{self.bootstrap_server_url}/register_dp_rank",
                             {"bootstrap_room": self.bootstrap_room, "dp_rank": self.kv_mgr.attn_dp_rank})
        if status != 200:
            logger.error("kvstage backend: failed to register prefill dp_rank: %s, %s", status, text)

    # what tests and older callers read: the first share's
    _meta, _room, _final, _layout = (_first_share(n) for n in ("meta", "room", "final", "layout"))

    @property
    def _sent_chunks(self):
        return sum(sh.sent_chunks for sh in self._shares)

    # SGLang's calls ------------------------------------------------------------------------
    def init(self, num_kv_indices: int, aux_index: Optional[int] = None):
        """Sets the request's page count and aux row (after WaitingForInput)."""
        self.num_kv_indices = int(num_kv_indices)
        self.aux_index = aux_index
        for sh in self._shares:
            self._make_layout(sh)

    def pop_decode_prefix_len(self) -> int:
        return int(self._meta.get("prefix_len", 0)) if self._meta else 0

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk  # the last chunk carries aux and state even without pages

    def send(self, kv_indices, state_indices=None, token_position_offset: int = 0):
        """Queues one chunk of page indices (the last one also aux and state) and copies what it can now; never
        blocks."""
        if self._status == KVPoll.Failed:
            return
        if self.num_kv_indices is None:
            return self._fail("send() before init()")
        if self._last_queued:
            logger.warning("kvstage backend: bootstrap_room %s: send() after the last chunk ignored",
                           self.bootstrap_room)
            return
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        first = self.curr_idx
        self.curr_idx += int(pages.size)
        last = self.curr_idx >= self.num_kv_indices
        if self.curr_idx > self.num_kv_indices:
            return self._fail(f"{self.curr_idx} pages sent, init() said {self.num_kv_indices}")
        if self._t_first is None:
            self._t_first = time.monotonic()
        self._last_queued = last
        self._chunks.append((pages, first, last, state_indices))
        if self._status == KVPoll.WaitingForInput:
            self._status = KVPoll.Transferring
        self._progress()

    def poll(self) -> int:
        self.kv_mgr.pump()
        if self._status == KVPoll.Bootstrapping and time.monotonic() - self._created > self.bootstrap_timeout:
            self._fail(f"Request {self.bootstrap_room} timed out after {self.bootstrap_timeout:.1f}s in "
                       "KVPoll.Bootstrapping")
        elif self._status in (KVPoll.WaitingForInput, KVPoll.Transferring):
            self._progress()
        return self._status

    def failure_exception(self):
        raise KVTransferError(self.bootstrap_room, self._reason or "unknown failure")

    def get_transfer_metric(self):
        lat = (self._t_done - self._t_first) if (self._t_done and self._t_first) else None
        nbytes = sum(sh.layout.nbytes for sh in self._shares if sh.layout is not None)
        return KVTransferMetric(transfer_latency_s=lat, transfer_total_bytes=nbytes if self._shares else None)

    def abort(self):
        self._fail("Aborted by AbortReq.")

    def clear(self):
        """Forgets the request (its pages are the engine's again); an unfinished room is aborted."""
        mgr = self.kv_mgr
        if mgr.senders.get(self.bootstrap_room) is self:
            del mgr.senders[self.bootstrap_room]
            if self._status != KVPoll.Success:
                mgr.tombstones[self.bootstrap_room] = time.monotonic()
        if self._status not in (KVPoll.Success, KVPoll.Failed):
            self._fail("cleared before it finished")
        self._close_room()

    # inner workings -------------------------------------------------------------------------
    def _offer(self, meta):
        """A decode rank's meta message for this request: adopts its share (opens its room) or refuses it."""
        mgr = self.kv_mgr
        if self._status == KVPoll.Failed:
            return mgr._reject(meta, "the prefill side already aborted this request")
        d = _decode_rank_of(meta)
        if any(sh.decode_rank == d for sh in self._shares) or (
                self._required is not None and len(self._shares) >= self._required):
            return mgr._reject(meta, "a second transfer request for a room in use")
        sh = _SendShare(self, meta)
        self._shares.append(sh)
        try:
            sh.slices, required = mgr.share_for(meta)
        except ValueError as e:
            return self._fail(str(e), reject=True)
        if self._required is None:
            self._required = required
        elif required != self._required:
            return self._fail(f"misrouted share: decode ranks of different attention-TP sizes ask for this request "
                              f"({required} and {self._required} decode ranks per prefill rank)", reject=True)
        dummy = bool((meta.get("tp") or {}).get("dummy"))
        if meta.get("desc") and not dummy:
            try:
                sh.uid = mgr._register_obj(sh)
                sh.room = mgr.client().send_open(desc_bytes(meta["desc"]), user_data=sh.uid)
            except (KvstageError, ValueError) as e:
                mgr._objs.pop(sh.uid, None)  # no room: no final event will come for it
                sh.uid = None
                return self._fail(f"could not open the decode side's room: {e}")
            want = KVS_ROOM_DESC_SIZE if sh.join else int(meta["nbytes"])
            if sh.room.nbytes != want:
                return self._fail(f"the room has {sh.room.nbytes} bytes, the request {want}")
            sh.written = [0] * sh.room.chunks
        elif meta.get("desc"):
            return self._fail("misrouted share: a dummy share with a room", reject=True)
        if len(self._shares) == self._required and self._status == KVPoll.Bootstrapping:
            self._status = KVPoll.WaitingForInput
        self._make_layout(sh)
        if self._status == KVPoll.Transferring:
            self._progress()

    def _make_layout(self, sh):
        if sh.meta is None or self.num_kv_indices is None or sh.layout is not None or self._status == KVPoll.Failed:
            return
        m, mem = sh.meta, self.kv_mgr.mem
        if (m.get("tp") or {}).get("dummy") or sh.join:  # a dummy rank, or a reader of a shared room: no KV here
            sh.layout = RoomLayout(mem, 0, False, [])
            return
        if int(m["npages"]) != self.num_kv_indices:
            return self._fail(f"the decode side expects {m['npages']} pages, this side has {self.num_kv_indices}")
        if m["aux"] and not (self.aux_index is not None and mem.aux):
            return self._fail("the decode side expects aux and this side sends none")
        try:
            sh.layout = RoomLayout(mem, self.num_kv_indices, m["aux"], m["state_counts"], sh.slices,
                                   int(getattr(self.kv_mgr.kv_args, "page_size", 1) or 1))
        except ValueError as e:
            return self._fail(str(e))
        if sh.layout.nbytes != int(m["nbytes"]):
            return self._fail(f"layout of {sh.layout.nbytes} bytes, the decode side made {m['nbytes']}")

    def _progress(self):
        """Copies queued chunks into slots and hands full slots to the rooms, as far as the pool allows."""
        if self._status == KVPoll.Failed or not self._shares or len(self._shares) != self._required:
            return
        for sh in self._shares:
            if sh.done or sh.join and sh.relayed:
                continue
            if sh.join:
                self._relay_shared_desc(sh)
            elif sh.layout is not None:
                self._progress_share(sh)
            if self._status == KVPoll.Failed:
                return
        self._check_done()

    def _check_done(self):
        if (self._status != KVPoll.Failed and len(self._shares) == self._required
                and all(sh.done for sh in self._shares)):
            self._status, self._t_done = KVPoll.Success, time.monotonic()
            self.conclude_state = KVPoll.Success

    def _relay_shared_desc(self, sh):
        """MLA read once: writes the shared room's descriptor (the opening decode rank's) into the small room a joining
        decode rank opened for it; that rank then joins the shared room (one landing, every reader)."""
        opener = next((x for x in self._shares if x.readers > 1 and not x.join), None)
        if opener is None or sh.room is None:
            return
        if int(sh.meta["nbytes"]) != int(opener.meta["nbytes"]):
            return self._fail(f"misrouted share: decode rank {sh.decode_rank} expects {sh.meta['nbytes']} bytes, the "
                              f"shared room of decode rank {opener.decode_rank} has {opener.meta['nbytes']}")
        c = self.kv_mgr.client()
        try:
            (lease,) = c.acquire(1)
        except PoolExhausted:
            return  # retried at the next poll
        try:
            view = lease.view()
            view[:KVS_ROOM_DESC_SIZE] = desc_bytes(opener.meta["desc"])
            del view
            sh.room.send(lease, 0, KVS_ROOM_DESC_SIZE)
            sh.in_flight[lease.key] = lease
            sh.relayed = True
        except (NotConnected, Timeout) as e:
            self.kv_mgr._broken(e)
        except (KvstageError, ValueError) as e:
            try:
                c.release(lease)
            except KvstageError:
                pass
            if not (isinstance(e, KvstageError) and e.errno == _errno.EAGAIN):
                self._fail(f"sending the shared room's descriptor failed: {e}")

    def _progress_share(self, sh):
        lay = sh.layout
        try:
            while sh.next_chunk < len(self._chunks):
                pages, first, last, state_indices = self._chunks[sh.next_chunk]
                sh.next_chunk += 1
                sh.extents.extend(lay.kv_extents(pages, first) if lay.npages else ())  # a dummy share: no pages
                if last:
                    if self.aux_index is not None:
                        sh.extents.extend(lay.aux_extents(int(self.aux_index)))
                    sh.extents.extend(lay.state_extents(list(state_indices or [])))
                    sh.extents.append(None)  # end marker
        except ValueError as e:
            return self._fail(f"bad indices: {e}")
        if sh.room is None:  # a room of 0 bytes, or a dummy share: nothing to move
            if sh.extents and sh.extents[-1] is None:
                sh.extents.clear()
                sh.done = True
            return
        c = self.kv_mgr.client()
        ss = c.slot_size
        cp = self.kv_mgr.copier
        copied = False
        try:
            while sh.extents:
                head = sh.extents[0]
                if head is None:
                    sh.extents.popleft()
                    break
                if isinstance(head, Extent):  # its copies, each inside one slot
                    sh.extents.popleft()
                    sh.extents.extendleft(reversed(plan([head], ss)))
                    continue
                s = head.slot
                lease = sh.leases.get(s)
                if lease is None:
                    try:
                        (lease,) = c.acquire(1)
                    except PoolExhausted:
                        break  # retried at the next poll
                    sh.leases[s] = lease
                view = sh.views.get(s)
                if view is None and needs_view(head):
                    view = sh.views[s] = lease.view()
                cp.copy_in(lease, view, head)
                copied = True
                sh.extents.popleft()
                sh.written[s] += head.nbytes
                if sh.written[s] == sh.room.chunk_len(s):
                    sh.unsent.append(s)
            if copied:
                cp.sync()
            while sh.unsent:
                s = sh.unsent[0]
                sh.views.pop(s, None)
                lease = sh.leases[s]
                sh.room.send(lease, s * ss, sh.room.chunk_len(s))
                sh.in_flight[lease.key] = lease
                del sh.leases[s]
                sh.unsent.pop(0)
                sh.sent_chunks += 1
        except (NotConnected, Timeout) as e:
            self.kv_mgr._broken(e)
        except KvstageError as e:
            if e.errno == _errno.EAGAIN:
                return  # ring full: the next poll sends
            self._fail(f"sending a chunk failed: {e}")
        except (BufferError, RuntimeError, ValueError) as e:
            self._fail(f"copying pages failed: {e}")

    def _on_share_event(self, sh, ev):
        if ev.type == EventType.REJECTED:
            back = sh.in_flight.pop(tuple(ev.lease), None)  # the client gave it back to us: release it
            if back is not None:
                try:
                    self.kv_mgr.client().release(back)
                except KvstageError:
                    pass
            return self._fail(f"the proxy refused a chunk: {ev.error}")
        sh.final = ev
        sh.in_flight.clear()
        if ev.type == EventType.SEND_DONE:
            sh.done = True
            self._check_done()
        elif self._status != KVPoll.Failed:
            why = ("aborted by the decode side, the proxy or a timeout" if ev.type == EventType.ABORTED
                   else f"failed: {ev.error}")
            whose = f" (the share of decode rank {sh.decode_rank})" if len(self._shares) > 1 else ""
            self._fail(f"the room was {why}{whose}")
        self._close_share(sh)

    def _fail(self, reason, reject=False):
        """Fails the request on this rank: every share's slots go back, every open room is aborted (so every decode
        rank it serves fails too), and a decode rank whose room this rank never opened has it aborted."""
        if self._status == KVPoll.Failed:
            return
        logger.debug("kvstage backend: prefill bootstrap_room %s failed: %s", self.bootstrap_room, reason)
        self._status, self._reason, self.conclude_state = KVPoll.Failed, reason, KVPoll.Failed
        self._chunks.clear()
        c = self.kv_mgr._client
        for sh in self._shares:
            sh.extents.clear()
            sh.unsent.clear()
            sh.views.clear()
            for lease in sh.leases.values():
                try:
                    c.release(lease)
                except Exception:
                    pass
            sh.leases.clear()
            if sh.room is not None and sh.final is None:
                sh.room.abort_quietly()
            elif sh.room is None and sh.final is None and (reject or sh.meta.get("desc")):
                self.kv_mgr._reject(sh.meta, reason)

    def _lost(self, reason):
        for sh in self._shares:
            sh.final = sh.final or "lost"
            sh.room = None
        self._fail(reason)

    def _close_share(self, sh):
        if sh.room is None:
            return
        try:
            sh.room.close()  # unfinished: closing aborts it; its final event still comes, then it is forgotten
        except Exception:
            pass
        if sh.final is not None:
            sh.room = None
            self.kv_mgr._objs.pop(sh.uid, None)

    def _close_room(self):
        for sh in self._shares:
            self._close_share(sh)

    def __repr__(self):
        return f"<KvstageKVSender room={self.bootstrap_room} status={self._status} {self._reason or ''}>"


# ---------------------------------------------------------------------------------------------
# Decode: the receiver.
# ---------------------------------------------------------------------------------------------

class _RecvShare:
    """One rank pair's share of a request on the decode side: the prefill rank it comes from, the room it lands in,
    its copy-out. Equal attention-TP sizes: the only one, whole pages."""

    def __init__(self, receiver, prefill_rank, endpoint, dummy):
        self.receiver = receiver
        self.prefill_rank = prefill_rank
        self.endpoint = endpoint
        self.dummy = dummy                # SGLang's dummy rank (MLA, the prefill side wider): told, sends nothing
        self.meta = None
        self.sent = False
        self.pending_open = False
        self.room = self.uid = self.final = self.layout = self.extents = self.job = None
        self.landed = False               # its bytes are in the decode pages (or it had none)
        self.readers, self.join = 1, False  # MLA read once: a shared room's reader count; join: not its opener
        self.reply_room = self.reply_uid = self.reply_final = None  # a joiner's room for the shared room's descriptor

    def _on_event(self, ev):
        self.receiver._on_share_event(self, ev)

    def _lost(self, reason):
        self.final = self.final or "lost"
        if self.job is not None and self.job.cancel():
            self.job = None
        self.room = None
        self.receiver._fail(reason)


class _DescReply:
    """A joining decode rank's small room, into which its prefill rank writes the shared room's descriptor."""

    def __init__(self, sh):
        self.sh = sh

    def _on_event(self, ev):
        self.sh.receiver._on_reply_event(self.sh, ev)

    def _lost(self, reason):
        self.sh.reply_final = self.sh.reply_final or "lost"
        self.sh.reply_room = None
        self.sh.receiver._fail(reason)


class KvstageKVReceiver(BaseKVReceiver):
    """Decode side of one request: opens its room (one per prefill rank it takes heads from when the attention-TP
    sizes differ), tells the prefill rank(s), copies the room(s) into its pages."""

    def __init__(self, mgr: KvstageKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None, **_kw):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.conclude_state = None
        self.require_staging = False
        self.waiting_timeout = mgr.waiting_timeout
        self.clear_timeout = mgr.clear_timeout
        self.init_time = None
        self._status = KVPoll.Bootstrapping
        self._reason = None
        self._aborted = False
        self._shares: List[_RecvShare] = []
        self._cleared = False

    # what tests and older callers read: the first share's
    _room, _final, _uid, _layout, _endpoint = (_first_share(n)
                                               for n in ("room", "final", "uid", "layout", "endpoint"))

    # SGLang's calls ------------------------------------------------------------------------
    def init(self, prefill_dp_rank: int):
        """Finds the prefill rank(s) of DP rank prefill_dp_rank through the bootstrap server (the prefill rank checks
        the layout at meta)."""
        if self._status != KVPoll.Bootstrapping:
            return
        mgr = self.kv_mgr
        try:
            known = mgr.try_ensure_parallel_info(self.bootstrap_addr)
        except RuntimeError as e:
            return self._fail(str(e))
        info = mgr.prefill_info_table.get(self.bootstrap_addr) if known else None
        if info is None:
            return self._fail(f"Prefill server with bootstrap_addr: {self.bootstrap_addr} is unknown or down")
        P, D = int(info.attn_tp_size), mgr.attn_tp_size
        why = tp_sizes_unsupported(P, D)
        if why:
            return self._fail(f"prefill attn_tp_size {P} and this side's {D}: {why}; not supported by the kvstage "
                              "backend")
        if int(info.pp_size) != 1 or int(info.attn_cp_size) != 1:
            return self._fail("prefill pipeline or context parallelism is not supported by the kvstage backend")
        dp_size = int(info.dp_size or 1)
        try:
            prefill_dp_rank = int(prefill_dp_rank)
        except (TypeError, ValueError):
            prefill_dp_rank = -1
        if not 0 <= prefill_dp_rank < dp_size:
            return self._fail(f"prefill_dp_rank {prefill_dp_rank} is not one of the prefill server's {dp_size} "
                              "DP ranks")
        self.prefill_dp_rank = prefill_dp_rank
        real, ranks, _, _ = rank_mapping(P, D, int(mgr.kv_args.engine_rank), mgr.is_mla_backend)
        for p in ranks:
            endpoint = mgr.rank_endpoint(self.bootstrap_addr, prefill_dp_rank, p)
            if endpoint is None:
                self._shares.clear()
                return self._fail(f"Could not fetch bootstrap info for prefill_dp_rank {prefill_dp_rank} "
                                  f"target_tp_rank {p} from {self.bootstrap_addr}")
            self._shares.append(_RecvShare(self, p, endpoint, mgr.is_mla_backend and p != real))
        k = D // P
        if mgr.is_mla_backend and k > 1 and os.environ.get("KVSTAGE_SGLANG_MLA_SHARED", "1") != "0":
            # MLA read once: the k decode ranks of a prefill rank read one shared room (on this proxy: see SGLANG.md)
            if k > KVS_MAX_READERS:
                return self._fail(f"a shared room has at most {KVS_MAX_READERS} readers, not {k}")
            self._shares[0].readers, self._shares[0].join = k, bool(int(mgr.kv_args.engine_rank) % D % k)
        self.init_time = time.monotonic()
        self._status = KVPoll.WaitingForInput

    def send_metadata(self, kv_indices, aux_index: Optional[int] = None, state_indices: Optional[List] = None,
                      decode_prefix_len: Optional[int] = None, **_kw):
        """Opens the request's room(s) and tells the prefill rank(s) the descriptor(s) (pages stay on this side)."""
        if self._status != KVPoll.WaitingForInput:
            if self._status != KVPoll.Failed:
                self._fail(f"send_metadata() in state {self._status}, not WaitingForInput")
            return
        mgr = self.kv_mgr
        info = mgr.prefill_info_table[self.bootstrap_addr]
        P, D = int(info.attn_tp_size), mgr.attn_tp_size
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        has_aux = aux_index is not None and bool(mgr.mem.aux)
        counts = state_counts_of(state_indices, len(mgr.mem.state))
        if P != D and any(counts):
            return self._fail(f"state (mamba and the like) between attention-TP sizes {P} and {D} is not supported "
                              "by the kvstage backend")
        ps = int(getattr(mgr.kv_args, "page_size", 1) or 1)
        fingerprint = mgr.mem.fingerprint()
        first = next(sh for sh in self._shares if not sh.dummy)  # aux rides with the first share that moves bytes
        for sh in self._shares:
            tp = {"prefill_rank": sh.prefill_rank, "prefill_tp": P, "decode_rank": int(mgr.kv_args.engine_rank) % D,
                  "decode_tp": D, "dummy": sh.dummy}
            if sh.readers > 1:
                tp.update(readers=sh.readers, join=sh.join)
            try:
                slices = decode_slices(P, D, sh.prefill_rank, fingerprint["kv_item_lens"], ps, mgr.is_mla_backend)
                tp["slices"] = slices
                if sh.dummy:
                    sh.layout, sh.extents = RoomLayout(mgr.mem, 0, False, []), []
                else:
                    aux = has_aux and sh is first
                    sh.layout = RoomLayout(mgr.mem, pages.size, aux, counts, slices if P != D else None, ps)
                    sh.extents = (sh.layout.kv_extents(pages, 0)
                                  + (sh.layout.aux_extents(int(aux_index)) if aux else [])
                                  + sh.layout.state_extents(list(state_indices or [])))
            except ValueError as e:
                return self._fail(f"bad indices: {e}")
            sh.meta = {"t": "meta", "room": int(self.bootstrap_room), "npages": int(pages.size),
                       "aux": sh.layout.has_aux, "state_counts": sh.layout.state_counts, "nbytes": sh.layout.nbytes,
                       "prefix_len": int(decode_prefix_len or 0), "layout": fingerprint,
                       "kv_cache_dtype": getattr(mgr.server_args, "kv_cache_dtype", None),
                       "from": f"{socket.gethostname()}:{os.getpid()}"}
            sh.meta["tp"] = tp
        self._status = KVPoll.Transferring
        for sh in self._shares:
            self._open_and_tell(sh)
            if self._status == KVPoll.Failed:
                return
        self._check_jobs()

    def poll(self) -> int:
        self.kv_mgr.pump()
        if self._status == KVPoll.Transferring:
            for sh in self._shares:
                if sh.pending_open:
                    self._open_and_tell(sh)
        self._check_jobs()
        if (self._status in (KVPoll.WaitingForInput, KVPoll.Transferring) and self.init_time is not None
                and time.monotonic() - self.init_time > self.waiting_timeout):
            self._fail(f"Request {self.bootstrap_room} timed out after {self.waiting_timeout:.1f}s in "
                       f"KVPoll.{'WaitingForInput' if self._status == KVPoll.WaitingForInput else 'Transferring'}")
        if self._status == KVPoll.Failed and any(sh.job is not None and not sh.job.done() for sh in self._shares):
            return KVPoll.Transferring  # a copy-out already running must finish before Failed lets the pages go
        return self._status

    def failure_exception(self):
        raise KVTransferError(self.bootstrap_room, self._reason or "unknown failure")

    def abort(self):
        self._fail("Aborted by AbortReq.")

    @property
    def pages_released(self):
        """True once nothing of this request can write its decode pages any more and its rooms are closed: every
        room's final event came (or there was no room) and no copy-out of any can run."""
        return (self._status in (KVPoll.Success, KVPoll.Failed)
                and all((sh.uid is None or sh.final is not None) and (sh.job is None or sh.job.done())
                        and (sh.reply_uid is None or sh.reply_final is not None) for sh in self._shares))

    def clear(self):
        """Waits (clear_timeout at most) until pages_released, then forgets the request. See the module docstring."""
        self._cleared = True
        if self._status not in (KVPoll.Success, KVPoll.Failed):
            self._fail("cleared before it finished")
        if not self.kv_mgr.wait_until(lambda: self.pages_released, self.clear_timeout):
            logger.error("kvstage backend: bootstrap_room %s: the room's final event did not come within %.1fs; "
                         "it stays tracked, its pages are not released", self.bootstrap_room, self.clear_timeout)
            return
        self._close_room()

    # inner workings -------------------------------------------------------------------------
    def _open_and_tell(self, sh):
        mgr = self.kv_mgr
        sh.pending_open = False
        desc = None
        if sh.layout.nbytes == 0:
            sh.landed = True  # nothing to move
        else:
            try:
                c = mgr.client()
                if sh.join:  # the shared room's descriptor comes through the prefill rank; join it then
                    sh.reply_uid = mgr._register_obj(_DescReply(sh))
                    sh.reply_room, desc = c.recv_open(KVS_ROOM_DESC_SIZE, user_data=sh.reply_uid)
                else:
                    sh.uid = mgr._register_obj(sh)
                    sh.room, desc = c.recv_open(sh.layout.nbytes, user_data=sh.uid, readers=sh.readers)
            except KvstageError as e:
                mgr._objs.pop(sh.uid, None)
                mgr._objs.pop(sh.reply_uid, None)
                sh.uid = sh.reply_uid = None
                if e.errno in (_errno.EMFILE, _errno.ENFILE, _errno.EAGAIN):
                    sh.pending_open = True  # no room handle free yet: the next poll tries again
                    return
                return self._fail(f"could not open a room: {e}")
        msg = dict(sh.meta, desc=base64.b64encode(desc).decode() if desc else None)
        try:
            mgr.send_to(sh.endpoint, msg)
            sh.sent = True
        except OSError as e:
            self._fail(f"could not reach the prefill rank at {sh.endpoint}: {e}")

    def _copy_out_job(self, sh):
        room, extents, copier = sh.room, sh.extents, self.kv_mgr.copier
        ss = self.kv_mgr.client().slot_size

        def job():
            copy_room_out(room, plan(extents, ss), copier)
        job.bootstrap_room = self.bootstrap_room
        return job

    def _check_jobs(self):
        for sh in self._shares:
            j = sh.job
            if j is None or not j.done():
                continue
            sh.job = None
            if j.error is not None:
                self._fail(f"copying the room into the decode pages failed: {j.error!r}")
            elif j.state == "done" and self._status != KVPoll.Failed:
                sh.landed = True
            self._close_share(sh)
        if (self._status == KVPoll.Transferring and self._shares
                and all(sh.landed and not sh.pending_open for sh in self._shares)):
            self._status = KVPoll.Success  # every share landed: only now are the pages the request's KV
            self.conclude_state = KVPoll.Success

    def _on_reply_event(self, sh, ev):
        """A joining rank's descriptor room ended: on RECV_DONE it joins the shared room the descriptor names."""
        if ev.type == EventType.REJECTED:
            return
        sh.reply_final = ev
        mgr = self.kv_mgr
        if ev.type == EventType.RECV_DONE and not self._aborted:
            try:
                view = sh.reply_room.lease(0).view()
                desc = bytes(view[:KVS_ROOM_DESC_SIZE])
                del view
                sh.uid = mgr._register_obj(sh)
                sh.room = mgr.client().join(desc, user_data=sh.uid)
            except KvstageError as e:
                mgr._objs.pop(sh.uid, None)
                sh.uid = None
                self._fail(f"could not join the shared room (MLA read once; every decode rank of a prefill rank must "
                           f"use one kvstaged): {e}")
        elif ev.type != EventType.RECV_DONE and not self._aborted:
            self._fail("the shared room's descriptor never came: its room was aborted by the prefill side, the proxy "
                       "or a timeout")
        self._close_reply(sh)

    def _close_reply(self, sh):
        if sh.reply_room is not None and sh.reply_final is not None:
            try:
                sh.reply_room.close()
            except Exception:
                pass
            sh.reply_room = None
            self.kv_mgr._objs.pop(sh.reply_uid, None)

    def _on_share_event(self, sh, ev):
        if ev.type == EventType.REJECTED:
            return
        sh.final = ev
        if ev.type == EventType.RECV_DONE and not self._aborted:
            sh.job = self.kv_mgr.copier.submit(self._copy_out_job(sh))
            return self._check_jobs()
        if ev.type != EventType.RECV_DONE and not self._aborted:
            why = ("aborted by the prefill side, the proxy or a timeout" if ev.type == EventType.ABORTED
                   else f"failed: {ev.error}")
            whose = f" (the share of prefill rank {sh.prefill_rank})" if len(self._shares) > 1 else ""
            self._fail(f"the room was {why}{whose}")
        if sh.job is None:
            self._close_share(sh)

    def _fail(self, reason):
        """Fails the request on this rank: queued copy-outs are cancelled, every open room is aborted and every
        prefill rank whose share has not ended is told (so every rank of the request ends)."""
        if self._status == KVPoll.Failed:
            return
        logger.debug("kvstage backend: decode bootstrap_room %s failed: %s", self.bootstrap_room, reason)
        self._status, self._reason, self.conclude_state = KVPoll.Failed, reason, KVPoll.Failed
        self._aborted = True
        for sh in self._shares:
            sh.pending_open = False
            if sh.job is not None and sh.job.cancel():
                sh.job = None
            if sh.room is not None and sh.final is None:
                sh.room.abort_quietly()
            if sh.reply_room is not None and sh.reply_final is None:
                sh.reply_room.abort_quietly()
            if sh.endpoint is not None and sh.final is None:
                try:  # the room has not ended: the prefill rank learns now, even before it has opened the room
                    self.kv_mgr.send_to(sh.endpoint, {"t": "abort", "room": int(self.bootstrap_room)})
                except OSError:
                    pass

    def _lost(self, reason):
        for sh in self._shares:
            sh.final = sh.final or "lost"
            sh.reply_final = sh.reply_final or "lost"
            if sh.job is not None and sh.job.cancel():
                sh.job = None
            sh.room = sh.reply_room = None
        self._fail(reason)

    def _close_share(self, sh):
        if sh.room is not None and sh.final is not None and (sh.job is None or sh.job.done()):
            try:
                sh.room.close()
            except Exception:
                pass
            sh.room = None
            self.kv_mgr._objs.pop(sh.uid, None)

    def _close_room(self):
        for sh in self._shares:
            self._close_share(sh)
            self._close_reply(sh)

    def __repr__(self):
        return f"<KvstageKVReceiver room={self.bootstrap_room} status={self._status} {self._reason or ''}>"


# ---------------------------------------------------------------------------------------------
# For the shim: SGLang's KVClassType -> our classes.
# ---------------------------------------------------------------------------------------------
CLASSES = {
    "KVARGS": KVArgs,
    "MANAGER": KvstageKVManager,
    "SENDER": KvstageKVSender,
    "RECEIVER": KvstageKVReceiver,
    "BOOTSTRAP_SERVER": KvstageKVBootstrapServer,
}


def kv_class(class_type):
    """Returns the class for an SGLang KVClassType (member or its name/value), or None (as SGLang's mapping.get)."""
    name = getattr(class_type, "name", None) or str(class_type).upper()
    return CLASSES.get(name)


__all__ = ["KvstageKVManager", "KvstageKVSender", "KvstageKVReceiver", "KvstageKVBootstrapServer",
           "bootstrap_server_on_a_free_port", "KVArgs", "KVPoll", "KVTransferError", "KVTransferMetric",
           "PrefillServerInfo", "RoomLayout", "MemoryMap", "kv_class", "HAVE_SGLANG", "DisaggregationMode"]
