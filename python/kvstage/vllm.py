"""vLLM KV connector over kvstage: ``kv_connector="KvstageConnector"``, ``kv_connector_module_path="kvstage.vllm"``.

Needs vLLM (importing this module without it raises ImportError); built against vllm-project/vllm @ 9aaf83ef502f
(May 2026), python/VLLM.md says what works with which vLLM. Read there:
  vllm/distributed/kv_transfer/kv_connector/v1/base.py
      KVConnectorBase_V1 (__init__(vllm_config, role, kv_cache_config): kv_cache_config required), handle_preemptions,
      get_kv_connector_stats, build_kv_connector_stats, build_prom_metrics; KVConnectorRole, KVConnectorMetadata;
      SupportsHMA / supports_hma (claimed: request_finished_all_groups)
  vllm/distributed/kv_transfer/kv_connector/factory.py
      an unregistered kv_connector is loaded with importlib.import_module(kv_connector_module_path) and
      getattr(module, kv_connector); a class whose constructor lacks kv_cache_config is refused; it is called
      (config, role, kv_cache_config); with the hybrid KV cache manager on, a class that is not SupportsHMA is refused
  vllm/config/vllm.py
      with no user preference, the hybrid KV cache manager is turned off for a connector that is not SupportsHMA
      (v1/core/kv_cache_utils.py then unifies sliding-window layers into one full-attention group)
  vllm/distributed/kv_transfer/kv_connector/v1/nixl/{connector,scheduler,stats}.py
      request_finished's hand-off rule (FINISHED_LENGTH_CAPPED, FINISHED_STOPPED) and kv_transfer_params
      (do_remote_prefill, do_remote_decode, remote_block_ids, remote_engine_id, remote_request_id, remote_host,
      remote_port, tp_size, remote_num_tokens), which the router hands to the decode instance; the stats and
      Prometheus classes' shape
  vllm/distributed/kv_transfer/kv_connector/v1/metrics.py, kv_connector/utils.py (KVOutputAggregator)
      KVConnectorStats (aggregate, reduce, is_empty), KVConnectorPromMetrics, how workers' stats are aggregated
  vllm/v1/core/sched/scheduler.py, vllm/v1/worker/gpu_model_runner.py, vllm/v1/worker/gpu/kv_connector.py
      how the scheduler drives a connector: update_state_after_alloc(request, get_blocks(id), n_external);
      _connector_finished -> remove_skipped_blocks, then request_finished_all_groups(request, block ids per group);
  vllm/v1/kv_cache_interface.py, vllm/v1/core/single_type_kv_cache_manager.py, kv_cache_manager.py
      KVCacheConfig.kv_cache_groups (layer_names, kv_cache_spec: FullAttentionSpec, SlidingWindowSpec, MambaSpec:
      shapes, dtypes, page_size_padded, mamba_cache_mode, num_speculative_blocks); MambaManager keeps the last computed
      token's state block; gpu_model_runner.py _reshape_kv_cache_tensors gives a Mamba layer's cache as a list of
      state tensors (num_blocks, *shape), page_size_bytes apart;
      a sliding window's skipped blocks (get_num_skipped_tokens(n) // block_size) are vLLM's null block;
      get_unhashed_block_ids_all_groups skips them. nixl/scheduler.py get_sw_clipped_blocks sends a window's last
      cdiv(window, block_size) + 1 blocks; kvstage sends the ones vLLM keeps (a subset that never includes a freed one)
      _preempt_request frees the blocks at once and names the request in preempted_req_ids; the worker calls
      handle_preemptions(metadata) before binding it and before the forward; finish_requests delays the blocks of a
      WAITING_FOR_REMOTE_KVS request until finished_recving names it; _update_from_kv_xfer_finished frees on
      finished_sending, and on finished_recving of a finished request

How a request moves (python/VLLM.md has the picture):
  prefill  The router sends the request with kv_transfer_params {"do_remote_decode": True}. In the forward
           that completes its prompt, save_kv_layer copies each layer's part of the request's blocks into
           leased kvstage slots (wait_for_save copies whatever layer was not announced). request_finished
           answers (True, params): the blocks stay the request's until get_finished reports it in
           finished_sending, which it does once every byte is in slots - not when the decode side has
           read them, nor at a timeout. The slots (not the blocks) wait for the decode side.
  decode   The router passes the prefill's params on. get_num_new_matched_tokens says (n, True): an async
           load; update_state_after_alloc gives the blocks to fill. The worker opens a kvstage room for the
           request and sends its descriptor (128 bytes, base64) to the prefill worker over a TCP side channel
           (remote_host:remote_port + tp_rank, from the params); the prefill worker opens the room's sending
           half and hands it the staged slots. On RECV_DONE the worker copies the room into the blocks and
           only then reports the request in finished_recving.
  Why a side channel: a kvstage descriptor is made by the receiver (kvs_recv_open), and the decode
  instance hears of the request only from the prefill's response, so the descriptor cannot ride in that
  response; the response carries where the prefill worker listens instead.

Room layout (both sides compute it from their registered KV caches and the block count; a fingerprint of
it travels with the descriptor and the prefill worker refuses a room whose layout differs):
    for each layer, in register_kv_caches order, for each of its parts (K then V for a (2, num_blocks, ...)
    cache; the whole block for a (num_blocks, ...) cache; each state tensor, in order, of a Mamba layer's list
    of (num_blocks, *shape) tensors, block_bytes its prod(shape) * element size):  num_blocks * block_bytes;
    the request's j-th block at j * block_bytes.
Chunk i of the room is slot i; the last one may be short.

Aborts and when blocks are free again:
  * prefill blocks: freed at finished_sending, which comes only once no copy into slots can read them
    (all copies done, or the queued ones cancelled). A request aborted on the prefill side after its copy
    began is delayed the same way; its slots are released.
  * decode blocks: the only writer is the copy-out, which runs only for a RECV_DONE of a load that is not
    aborted; an abort cancels a queued copy-out. An aborted load is reported in finished_recving (so vLLM
    frees the blocks) only after the room's final event came and no copy-out of it can run.
  * a load that fails (the prefill side refused it, its slots expired, a timeout, the proxy) is reported
    in finished_recving with its blocks in get_block_ids_with_load_errors (vLLM recomputes or fails it,
    by kv_load_failure_policy).
  * staged slots no decode side asks for are released after the stage timeout; a decode request aborted
    before its load started tells the prefill worker to release them at once.

Tensor parallelism: every rank's worker connector stages and loads its own shard; prefill rank p listens on
remote_port + p. vLLM's KVOutputAggregator reports a request to the scheduler once every rank has; a load failed on
one rank fails the request through the invalid block ids, which vLLM unites.
  * equal TP sizes: decode rank r pulls from prefill rank r, naming its rank; a prefill rank refuses a pull or
    release for another rank (the shards' layouts are equal).
  * TP sizes of which one divides the other (NixlConnector's TransferTopology @ 9aaf83ef502f, kv_connector/utils.py
    tp_ratio, target_remote_ranks; tp_shares here): decode TP = k x prefill TP: decode rank r loads from prefill rank
    r // k its KV heads, slice r % k of that rank's; prefill TP = k x decode TP: decode rank r loads from prefill ranks
    r*k .. r*k+k-1, the i-th share landing at heads [i*H/k, (i+1)*H/k) of its blocks. One room per rank pair, holding
    that pair's heads of every block in the share layout (VllmLayout.share_extents: per layer part, per row of a
    block, the row's heads of each block). A prefill instance stages before any decode side asks, so it is told the
    decode TP size: kv_connector_extra_config kvstage_decode_tp_size (default its own), or kvstage_decode_tp_size in
    a request's kv_transfer_params; its params name it (kvstage.decode_tp_size) and a decode instance of another TP
    size computes the prompt itself. A share is refused at open (its room aborted, never delivered) when it reaches
    a prefill rank that does not serve that decode rank, comes from another decode TP size, names other model KV
    heads than that rank's share, or its share layout (rows, a head's bytes, head count, dtype, memory order, layer
    count) differs. The request is loaded on a decode rank once every share has landed and been copied; one share
    failing fails the load (and the prefill stage: its other shares are given up); the blocks are reported once
    every room of the load has its final event.
  * MLA (model_config.use_mla: every rank holds the same KV): prefill rank 0 stages it, the other prefill ranks
    stage nothing; decode rank 0 opens one shared room (Client.recv_open(readers=decode TP size)), sends its
    descriptor to the other decode ranks' side channels (an MLA decode rank listens on its instance's kvstage_port +
    rank) and pulls from prefill rank 0; the others join the room (Client.join): the bytes cross and land once, each
    rank copies them into its own blocks. Any TP sizes.

Block sizes: the prefill and decode block sizes may differ, one dividing the other (NixlConnector's
block_size_ratio), with one full-attention KV cache group, equal TP sizes or MLA, and token-major blocks (vLLM's NHD
(block_size, heads, head_size) blocks and MLA's (block_size, head_size)): the room is the prefill's plain layout, read
as token positions (VllmLayout.token_extents); the decode rank writes each position into its own blocks, the last
one partly when the prefill's blocks end inside it. HND blocks and FlashInfer's (2, block_size, ...) blocks (K, then
V) are refused (the load fails with the reason).

Memory (kvstage.plan plans the copies): KV caches in host memory are copied by the CPU, one copy per run of blocks;
on a CUDA device through libkvstage_cuda (kvstage.cuda), per layer part and slot one gather (scatter) of its whole
blocks plus a plain copy for each part of a block a slot boundary cuts, or one plain copy per run of blocks, whichever
takes fewer calls (on a tie the plain copies); refused unless KVSTAGE_VLLM_CUDA=1: that path is written and checked
against a stand-in device, never run on a GPU.

Settings: kv_connector_extra_config keys kvstage_socket ($KVSTAGE_SOCKET), kvstage_host ($KVSTAGE_VLLM_HOST,
else kv_ip), kvstage_port (else kv_port), kvstage_stage_timeout, kvstage_load_timeout (s, default 120),
kvstage_peer_secret_file ($KVSTAGE_PEER_SECRET_FILE, else $KVSTAGE_PEER_SECRET: the deployment's peer secret, which
the side channel needs; without it the worker connector refuses to start, kvstage.sidechannel says how);
per request, kv_transfer_params may carry kvstage_stage_timeout (prefill) and kvstage_load_timeout (decode).

Preemption: vLLM frees a preempted request's blocks at once; handle_preemptions voids its stage and returns only
once no copy of those blocks into slots can run (queued copies cancelled, a running one finished).

Metrics: get_kv_connector_stats -> KvstageKVConnectorStats per worker (aggregated by vLLM); build_prom_metrics ->
vllm:kvstage_{transfers,bytes}_{sent,received}, vllm:kvstage_num_failed_transfers, vllm:kvstage_num_stale_rejections
(counters), vllm:kvstage_abort_to_free_seconds (histogram), per engine with vLLM's labels.

KV cache groups (SupportsHMA): full-attention, sliding-window and chunked-local-attention groups, each with its own
block ids and block size (a chunked-local group moves like a sliding one: the blocks vLLM keeps, from
get_num_skipped_tokens(n) // block_size on, with that kind's own count).
The room holds, per layer part, its group's blocks: all cdiv(n, block_size) of a full-attention group; of a
sliding-window group those from get_num_skipped_tokens(n) // block_size on (the blocks vLLM keeps; the prefill params
name them in kvstage.groups, which the decode side checks). With one group (any model run with the hybrid manager
off) everything is as before: plain block lists.
State (Mamba) groups (MambaSpec, mamba_cache_mode 'none': prefix caching off, one state block per request): the state
moves once. As NixlConnector @ 9aaf83ef502f (nixl/scheduler.py _truncate_mamba_request_for_prefill,
_mamba_prefill_token_count): the prefill side drops the prompt's last token (get_num_new_matched_tokens of a
do_remote_decode request; max_tokens 1) and computes and stages n - 1 tokens; the decode side loads n - 1 tokens and
computes the last one itself (vLLM recomputes the last token of a full prompt hit, which would step a state already
past it). Of a state group the room holds the block MambaManager keeps (get_num_skipped_tokens(n) = n - 1: the one
state block), each state tensor of each Mamba layer a part; the decode side writes it into the request's state block
and nothing else of that group. A one-token prompt is not loaded (the decode side computes it).

Not supported (refused with a reason): Mamba prefix caching (mamba_cache_mode 'all' or 'align') and speculative state
blocks (num_speculative_blocks), other group kinds among several (ValueError at start, naming the group), TP sizes
of which neither divides the other, KV heads replicated across ranks (fewer KV heads than ranks, without MLA), heads
that do not split into the shares, different TP sizes and block sizes together (without MLA), different block sizes
with several KV cache groups or HND blocks, other cache layouts, pipeline parallelism. A refused load is computed by
the decode side (the scheduler's checks) or fails by kv_load_failure_policy (the workers').
"""
from __future__ import annotations

import base64
import collections
import dataclasses
import errno as _errno
import itertools
import json
import logging
import os
import select
import threading
import time
import typing
from typing import Optional

from . import sidechannel as _sidechannel
from .client import Client, EventType
from .errors import Again, KvstageError, NotConnected, PoolExhausted, Timeout
from .plan import CpuCopier, CudaCopier, Extent, copy_room_out, needs_view, plan
from .sidechannel import FrameListener

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# vLLM's own base classes: this module is a vLLM connector and needs vLLM (the tests put a stand-in package,
# python/tests/vllm_stubs, on sys.path).
# ---------------------------------------------------------------------------------------------
try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore
        KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, SupportsHMA)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # type: ignore
        KVConnectorPromMetrics, KVConnectorStats)
except ImportError as _e:
    raise ImportError(
        f"kvstage.vllm is a vLLM KV connector and needs vLLM importable: {_e}. Install "
        "vLLM (python/VLLM.md says which versions), or use kvstage.client / kvstage.sglang without it.") from _e

STAGE_TIMEOUT_S = 120.0
LOAD_TIMEOUT_S = 120.0
_HANDOFF = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")  # RequestStatus names that hand the KV to decode


def _cdiv(a, b):
    return -(-a // b)


def _status(s):
    return getattr(s, "name", str(s))


def _group0(ids):
    """Returns the first KV cache group's block ids of a vLLM block-id value (tuple of lists, or a flat list)."""
    if ids is None:
        return None
    ids = list(ids)
    if ids and isinstance(ids[0], (list, tuple)):
        return list(ids[0])
    return ids


def _unhashed_groups(blocks):
    """Per KV cache group, the block ids of a KVCacheBlocks that hold no cached content and are not vLLM's null
    (skipped) block: the ones a load fills."""
    f = getattr(blocks, "get_unhashed_block_ids_all_groups", None)
    if f is not None:
        return [list(g) for g in f()]
    return [list(g) for g in blocks.get_block_ids()]


def _unhashed(blocks):
    """Returns the block ids of a KVCacheBlocks that hold no cached content (the ones a load fills)."""
    f = getattr(blocks, "get_unhashed_block_ids", None)
    if f is not None:
        return list(f())
    f = getattr(blocks, "get_unhashed_block_ids_all_groups", None)
    if f is not None:
        return _group0(f()) or []
    return _group0(blocks.get_block_ids()) or []


def _float(v, what):
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number of seconds, not {v!r}") from None
    if not f > 0:
        raise ValueError(f"{what} must be > 0, not {v!r}")
    return f


# ---------------------------------------------------------------------------------------------
# Layout: where each byte of a request sits in its room.
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# Metrics: vLLM's KVConnectorStats (per worker, aggregated across workers by vLLM) and vllm:kvstage_* families.
# ---------------------------------------------------------------------------------------------

_STAT_KEYS = ("bytes_sent", "bytes_received", "num_failed_transfers", "num_stale_rejections", "abort_to_free_seconds")


@dataclasses.dataclass
class KvstageKVConnectorStats(KVConnectorStats):
    """One worker's observations since its last report, as lists (NixlKVConnectorStats' shape, so vLLM's
    KVOutputAggregator and stat loggers aggregate and reduce them): bytes_sent (one entry per request whose staged KV
    the decode side received), bytes_received (per load copied into its blocks), num_failed_transfers (1 per stage or
    load that failed: refused, expired, timed out, lost), num_stale_rejections (1 per chunk the proxy refused as stale
    or not ours), abort_to_free_seconds (per aborted or preempted request: from the scheduler's request_finished, or
    the preemption, to the worker reporting its blocks free)."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {k: [] for k in _STAT_KEYS}

    def clone_and_reset(self):
        old = KvstageKVConnectorStats(data={k: list(v) for k, v in self.data.items()})
        self.reset()
        return old

    def is_empty(self):
        return not any(self.data.get(k) for k in _STAT_KEYS)

    def aggregate(self, other):
        if not other.is_empty():
            for k, v in other.data.items():
                self.data.setdefault(k, []).extend(v)
        return self

    def reduce(self):
        d = {k: self.data.get(k, []) for k in _STAT_KEYS}
        waits = d["abort_to_free_seconds"]
        return {
            "Num transfers sent": len(d["bytes_sent"]),
            "Num transfers received": len(d["bytes_received"]),
            "MB sent": round(sum(d["bytes_sent"]) / 2 ** 20, 3),
            "MB received": round(sum(d["bytes_received"]) / 2 ** 20, 3),
            "Num failed transfers": len(d["num_failed_transfers"]),
            "Num stale rejections": len(d["num_stale_rejections"]),
            "Num aborts freed": len(waits),
            "Max abort-to-free (ms)": round(max(waits) * 1e3, 3) if waits else 0,
        }


class KvstagePromMetrics(KVConnectorPromMetrics):
    """vllm:kvstage_* families in vLLM's /metrics, one child per engine (vLLM's labelnames and per-engine values):
    transfers_sent, transfers_received, bytes_sent, bytes_received, num_failed_transfers, num_stale_rejections
    (counters: prometheus_client shows them with _total), abort_to_free_seconds (histogram)."""

    COUNTERS = (  # (family, documentation, stats key, value added per entry: None = the entry itself)
        ("vllm:kvstage_transfers_sent", "Requests whose KV the decode side received from kvstage slots.",
         "bytes_sent", 1),
        ("vllm:kvstage_transfers_received", "Requests whose KV was loaded from kvstage into their blocks.",
         "bytes_received", 1),
        ("vllm:kvstage_bytes_sent", "Bytes of KV sent through kvstage.", "bytes_sent", None),
        ("vllm:kvstage_bytes_received", "Bytes of KV received through kvstage.", "bytes_received", None),
        ("vllm:kvstage_num_failed_transfers", "kvstage stages or loads that failed.", "num_failed_transfers", 1),
        ("vllm:kvstage_num_stale_rejections", "Chunks the kvstage proxy refused (stale lease or epoch).",
         "num_stale_rejections", 1),
    )
    ABORT_BUCKETS = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric):  # vllm/v1/metrics/utils.py create_metric_per_engine
            return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

        self.counters = [(key, add, per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames)))
                         for name, doc, key, add in self.COUNTERS]
        self.abort_to_free = per_engine(self._histogram_cls(
            name="vllm:kvstage_abort_to_free_seconds",
            documentation="Time from a request's abort (or preemption) to its KV blocks being free, with kvstage.",
            buckets=self.ABORT_BUCKETS, labelnames=labelnames))

    def observe(self, transfer_stats_data, engine_idx=0):
        for key, add, metric in self.counters:
            vals = transfer_stats_data.get(key) or ()
            n = len(vals) if add == 1 else sum(vals)
            if n:
                metric[engine_idx].inc(n)
        for v in transfer_stats_data.get("abort_to_free_seconds") or ():
            self.abort_to_free[engine_idx].observe(v)


# ---------------------------------------------------------------------------------------------
# Scheduler -> worker metadata.
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class SaveSpec:
    """Prefill: copy these blocks (the request's first num_blocks, in order) into slots in this forward."""
    req_id: str
    block_ids: tuple
    num_tokens: int
    stage_timeout: float
    decode_tp: int = 0  # the decode side's TP size it is staged for (0: this side's): its shares' head slices


@dataclasses.dataclass
class RecvSpec:
    """Decode: load the prefill request's room into local_block_ids (request positions skip...)."""
    req_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    num_blocks: int
    local_block_ids: tuple
    skip: int
    load_timeout: float
    error: Optional[str] = None  # set: fail the load at once (the scheduler found it unusable)
    remote_tp: int = 0  # the prefill side's TP size (0: this side's): which prefill ranks hold this rank's heads
    mla: bool = False  # replicated KV (MLA): rank 0 opens one room all this instance's ranks read (join)
    remote_block_size: int = 0  # the prefill side's block size (0: this side's): the room is its blocks' tokens


@dataclasses.dataclass
class KvstageConnectorMetadata(KVConnectorMetadata):
    reqs_to_save: dict = dataclasses.field(default_factory=dict)     # P: req_id -> SaveSpec
    reqs_finished: dict = dataclasses.field(default_factory=dict)    # P: req_id -> (handoff, delayed)
    reqs_to_unstage: set = dataclasses.field(default_factory=set)    # P: staged before a preemption: invalid
    reqs_to_recv: dict = dataclasses.field(default_factory=dict)     # D: req_id -> RecvSpec
    reqs_to_abort: set = dataclasses.field(default_factory=set)      # D: loads the scheduler gave up on
    reqs_to_drop: list = dataclasses.field(default_factory=list)     # D: (host, port, remote_request_id[, remote
    #                                                                    TP size where it differs]) never loaded
    abort_times: dict = dataclasses.field(default_factory=dict)      # P, D: req_id -> time.time() of its abort


# ---------------------------------------------------------------------------------------------
# Settings.
# ---------------------------------------------------------------------------------------------

class _Group(typing.NamedTuple):
    kind: str            # "full", "sw" (sliding window), "local" (chunked local attention) or "mamba" (state)
    block_size: int
    window: int          # tokens: the sliding window (sw), the attention chunk (local); 0 (full, mamba)
    layer_names: tuple

    def skipped(self, n):
        """vLLM's get_num_skipped_tokens(n) for this kind (v1/core/single_type_kv_cache_manager.py): the tokens
        whose blocks it has given back (made its null block) once n are computed. MambaManager keeps only the state
        of the last computed token: n - 1."""
        if self.kind == "sw":
            return max(0, n - self.window + 1)
        if self.kind == "local":
            return (n // self.window) * self.window
        if self.kind == "mamba":
            return max(0, n - 1)
        return 0


def _tp_pair(other, mine, what):
    """other as a TP size that pairs with this side's mine (one divides the other, as NixlConnector's tp_ratio
    asserts); raises ValueError."""
    try:
        other = int(other)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a TP size, not {other!r}") from None
    if other < 1 or (other % mine and mine % other):
        raise ValueError(f"{what} {other} and this side's TP size {mine}: one must divide the other")
    return other


def tp_shares(rank, tp, remote_tp, heads):
    """The shares of a rank's KV a prefill (decode) rank sends to (loads from) the other side's ranks, by
    NixlConnector's TransferTopology @ 9aaf83ef502f (kv_connector/utils.py tp_ratio, target_remote_ranks), seen from
    either side: [(other side's rank, first head, end head)], the heads of this rank's blocks that pair holds.
    With more ranks here than there (tp = k x remote_tp) rank r pairs with rank r // k only and holds all its own
    heads, slice r % k of that rank's; with fewer (remote_tp = k x tp) it pairs with ranks r*k .. r*k+k-1, the i-th
    holding heads [i*heads/k, (i+1)*heads/k) here. Raises ValueError when the heads do not split."""
    if tp >= remote_tp:
        return [(rank // (tp // remote_tp), 0, heads)]
    k = remote_tp // tp
    if not heads or heads % k:
        raise ValueError(f"{heads} KV heads per rank do not split into {k} ranks' shares (replicated KV heads "
                         "and MLA are not split)")
    per = heads // k
    return [(rank * k + i, i * per, (i + 1) * per) for i in range(k)]


def _spec_kind(spec):
    """A KVCacheSpec's kind by its class (vllm/v1/kv_cache_interface.py): mamba, sw, full, or its class name."""
    names = [c.__name__ for c in type(spec).__mro__]
    for name, kind in (("MambaSpec", "mamba"), ("SlidingWindowSpec", "sw"), ("ChunkedLocalAttentionSpec", "local"),
                       ("FullAttentionSpec", "full")):
        if name in names:
            return kind
    return type(spec).__name__


def _groups(kv_cache_config, block_size):
    """The KV cache groups as _Groups; raises ValueError (one line) for a group kind kvstage does not move."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not groups:
        return [_Group("full", block_size, 0, ())]
    out = []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        kind = _spec_kind(spec)
        names = tuple(getattr(g, "layer_names", None) or ())
        layers = ", ".join(names[:2]) + (", ..." if len(names) > 2 else "")
        where = f"KV cache group {i} ({type(spec).__name__}, layers {layers})"
        if kind == "mamba":
            # MambaSpec @ 9aaf83ef502f: mamba_cache_mode 'none' (prefix caching off; block_size max_model_len) gives a
            # request one state block; 'all' and 'align' (Mamba prefix caching) keep states at block boundaries and
            # move the live one between blocks; num_speculative_blocks adds blocks holding draft states.
            mode = str(getattr(spec, "mamba_cache_mode", "none") or "none")
            if mode != "none":
                raise ValueError(f"kvstage connector: {where} has mamba_cache_mode {mode!r} (Mamba prefix caching): "
                                 "kvstage moves a state group's one state block per request, mamba_cache_mode 'none' "
                                 "only; run vLLM without prefix caching (--no-enable-prefix-caching)")
            spec_blocks = int(getattr(spec, "num_speculative_blocks", 0) or 0)
            if spec_blocks:
                raise ValueError(f"kvstage connector: {where} has {spec_blocks} speculative state blocks "
                                 "(num_speculative_blocks, speculative decoding): kvstage moves a state group's one "
                                 "state block per request, without speculative decoding only")
        if kind not in ("full", "sw", "local", "mamba"):
            if len(groups) == 1:  # one group: its blocks are the request's positions, as full attention's
                kind = "full"
            else:
                raise ValueError(f"kvstage connector: {where} is not supported: kvstage moves full-attention, "
                                 "sliding-window, chunked-local and state (Mamba) KV cache groups only; run vLLM with "
                                 "--disable-hybrid-kv-cache-manager")
        bs = int(getattr(spec, "block_size", None) or block_size)
        window = {"sw": int(getattr(spec, "sliding_window", 0) or 0),
                  "local": int(getattr(spec, "attention_chunk_size", 0) or 0)}.get(kind, 0)
        if kind in ("sw", "local") and window <= 0:
            raise ValueError(f"kvstage connector: {where}: a window of {window} tokens")
        out.append(_Group(kind, bs, window, names))
    return out


class _Settings:
    def __init__(self, vllm_config, kv_cache_config):
        kt = vllm_config.kv_transfer_config
        extra = dict(getattr(kt, "kv_connector_extra_config", None) or {})
        self.extra = extra
        self.engine_id = str(getattr(kt, "engine_id", None) or "")
        role = getattr(kt, "kv_role", None) or "kv_both"
        self.producer = role in ("kv_producer", "kv_both")
        self.consumer = role in ("kv_consumer", "kv_both")
        self.block_size = int(vllm_config.cache_config.block_size)
        pc = getattr(vllm_config, "parallel_config", None)
        self.tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        # MLA (vLLM's model_config.use_mla, NixlConnector's is_mla): every TP rank holds the same KV; prefill rank 0
        # stages it once, the decode ranks read it from one room they share (Client.recv_open(readers=n), join)
        self.mla = bool(getattr(getattr(vllm_config, "model_config", None), "use_mla", False))
        # the decode instances' TP size (a prefill instance stages each rank's KV in the head slices of the decode
        # ranks it serves, before any decode side asks); a request's kv_transfer_params may name its own. MLA: any
        self.decode_tp = self.tp_size if self.mla else _tp_pair(
            extra.get("kvstage_decode_tp_size", self.tp_size), self.tp_size, "kvstage_decode_tp_size")
        if int(getattr(pc, "pipeline_parallel_size", 1) or 1) > 1:
            raise NotImplementedError("kvstage connector: pipeline parallelism is not supported")
        dp = 0
        for name in ("data_parallel_index", "data_parallel_rank"):
            v = getattr(pc, name, None)
            if isinstance(v, int):
                dp = v
                break
        self.dp_rank = dp
        self.socket_path = extra.get("kvstage_socket") or os.environ.get("KVSTAGE_SOCKET")
        self.peer_secret_file = extra.get("kvstage_peer_secret_file") or None
        self.host = str(extra.get("kvstage_host") or os.environ.get("KVSTAGE_VLLM_HOST")
                        or getattr(kt, "kv_ip", None) or "127.0.0.1")
        self.base_port = int(extra.get("kvstage_port", getattr(kt, "kv_port", 14579))) + dp * self.tp_size
        self.stage_timeout = _float(extra.get("kvstage_stage_timeout", STAGE_TIMEOUT_S), "kvstage_stage_timeout")
        self.load_timeout = _float(extra.get("kvstage_load_timeout", LOAD_TIMEOUT_S), "kvstage_load_timeout")
        self.num_blocks = getattr(kv_cache_config, "num_blocks", None)
        self.groups = _groups(kv_cache_config, self.block_size)
        # grouped: block ids per group everywhere (several groups, or one sliding-window group); else plain lists
        self.grouped = len(self.groups) > 1 or self.groups[0].kind != "full"
        # a state (Mamba) group: as NixlConnector @ 9aaf83ef502f (nixl/scheduler.py _truncate_mamba_request_for_prefill,
        # _mamba_prefill_token_count), the prefill side computes and stages the prompt's first n - 1 tokens, the decode
        # side loads those and computes the last token itself (vLLM recomputes the last token of a full prompt hit,
        # which would advance a state already past it)
        self.state = any(g.kind == "mamba" for g in self.groups)

    def staged_tokens(self, n):
        """Tokens of a prompt of n tokens the prefill side stages: n, or n - 1 with a state group (none of a
        one-token prompt: a decode side computes it)."""
        if self.state:
            return n - 1
        return n

    def group_blocks(self, n):
        """[(first, end)] per KV cache group: the request positions of the blocks a prompt of n tokens moves - all
        cdiv(n, block_size) of a full-attention group; of a sliding-window group those vLLM's SlidingWindowManager
        keeps once n tokens are computed (get_num_skipped_tokens(n) // block_size on: the blocks the last prompt
        token's window reads, and the ones both sides still hold)."""
        out = []
        for g in self.groups:
            nb = _cdiv(n, g.block_size)
            first = min(nb, g.skipped(n) // g.block_size)
            out.append((first, nb))
        return out

    def layer_groups(self):
        """layer name -> group index for the layout (None with one group)."""
        if not self.grouped:
            return None
        return {n: i for i, g in enumerate(self.groups) for n in g.layer_names}

    def tp_rank(self):
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank  # type: ignore
            return int(get_tensor_model_parallel_rank())
        except Exception:
            return int(self.extra.get("kvstage_tp_rank", 0))


# ---------------------------------------------------------------------------------------------
# Scheduler side.
# ---------------------------------------------------------------------------------------------

class _PReq:
    __slots__ = ("request", "blocks", "saved")

    def __init__(self, request, blocks):
        self.request, self.blocks, self.saved = request, list(blocks or []), False


class _SchedulerSide:
    def __init__(self, s: _Settings):
        self.s = s
        self._p = {}              # prefill requests being computed: req_id -> _PReq
        self._p_delayed = {}      # prefill requests whose blocks wait for finished_sending: req_id -> handoff
        self._d_loading = set()   # decode requests whose load the worker has not reported yet
        self._warned = set()
        self._reset()

    def _reset(self):
        self._saves, self._finished, self._unstage = {}, {}, set()
        self._recv, self._aborts, self._drops = {}, set(), []
        self._abort_times = {}

    @staticmethod
    def _num_prompt(request):
        n = getattr(request, "num_prompt_tokens", None)
        return int(n) if n is not None else len(request.prompt_token_ids or [])

    def _remote(self, request):
        """Returns the prefill side's kvstage params of a decode request, or (None, why) when unusable."""
        p = request.kv_transfer_params or {}
        kv = p.get("kvstage")
        if not self.s.consumer:
            return None, "this instance's kv_role does not consume KV"
        if not isinstance(kv, dict):
            return None, "kv_transfer_params come from another connector (no 'kvstage')"
        for k in ("remote_request_id", "remote_host", "remote_port"):
            if p.get(k) is None:
                return None, f"kv_transfer_params lack {k}"
        try:  # MLA: any sizes pair (prefill rank 0 holds it all)
            remote_tp = _tp_pair(p.get("tp_size", 1), 1 if self.s.mla else self.s.tp_size,
                                 "the prefill side's TP size")
        except ValueError as e:
            return None, str(e)
        remote_bs, bs = int(kv.get("block_size", -1)), self.s.block_size
        if remote_bs != bs:  # NixlConnector's block_size_ratio: one divides the other
            if remote_bs <= 0 or (remote_bs % bs and bs % remote_bs):
                return None, f"prefill block size {kv.get('block_size')}, this side {bs}: one must divide the other"
            if self.s.grouped:
                return None, (f"prefill block size {remote_bs}, this side {bs}: blocks of another size move with one "
                              "full-attention KV cache group only")
            if remote_tp != self.s.tp_size and not self.s.mla:
                return None, (f"prefill block size {remote_bs} and TP size {remote_tp}, this side {bs} and "
                              f"{self.s.tp_size}: block sizes and TP sizes do not both differ")
        if bool(kv.get("mla", False)) != self.s.mla:
            return None, f"the prefill side's model {'is' if kv.get('mla') else 'is not'} MLA, this side's " + (
                "is" if self.s.mla else "is not")
        staged_for = int(kv.get("decode_tp_size", remote_tp))
        if staged_for != self.s.tp_size and not self.s.mla:
            return None, (f"the prefill side (TP size {remote_tp}) staged its KV for decode TP size {staged_for}, this "
                          f"side has {self.s.tp_size} (kvstage_decode_tp_size of the prefill instance)")
        n = self._staged(request)
        if n <= 0:
            return None, "a one-token prompt of a model with a state (Mamba) group is computed here"
        if int(kv.get("num_tokens", -1)) != n or int(kv.get("num_blocks", -1)) != _cdiv(n, remote_bs):
            return None, (f"the prefill side staged {kv.get('num_tokens')} tokens, this side expects {n} "
                          f"(a prompt of {self._num_prompt(request)})")
        want = [[first, end] for first, end in self.s.group_blocks(n)] if self.s.grouped else None
        if kv.get("groups") != want:
            return None, f"the prefill side staged KV cache groups {kv.get('groups')}, this side has {want}"
        return kv, None

    def _staged(self, request):
        """Decode side: the prompt tokens the prefill side staged for this request (settings.staged_tokens)."""
        return self.s.staged_tokens(self._num_prompt(request))

    def _truncate_for_state(self, request):
        """Prefill side with a state group: drop the prompt's last token, once (NixlConnector's
        _truncate_mamba_request_for_prefill @ 9aaf83ef502f), so the state staged is that before the last token, which
        the decode side computes; the prefill request produces one token."""
        p = request.kv_transfer_params
        if p.get("_p_side_truncated") or self._num_prompt(request) <= 1:
            return
        if getattr(request, "prompt_token_ids", None) is not None:
            request.prompt_token_ids.pop()
        elif getattr(request, "prompt_embeds", None) is not None:
            request.prompt_embeds = request.prompt_embeds[:-1]
        else:
            return
        all_ids = getattr(request, "_all_token_ids", None)
        if all_ids is not None:
            all_ids.pop()
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        p["_p_side_truncated"] = True

    def _warn(self, request, why):
        if request.request_id not in self._warned:
            self._warned.add(request.request_id)
            logger.warning("kvstage connector: request %s: no remote KV load: %s", request.request_id, why)

    def _drop(self, request):
        p = request.kv_transfer_params or {}
        if isinstance(p.get("kvstage"), dict) and p.get("remote_request_id") and p.get("remote_host"):
            drop = (str(p["remote_host"]), int(p["remote_port"]), str(p["remote_request_id"]))
            remote_tp = int(p.get("tp_size", self.s.tp_size) or self.s.tp_size)
            self._drops.append(drop if remote_tp == self.s.tp_size else drop + (remote_tp,))

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        p = request.kv_transfer_params
        if p and p.get("do_remote_prefill"):
            kv, why = self._remote(request)
            if kv is None:
                self._warn(request, why)
                return 0, False
            count = self._staged(request) - num_computed_tokens
            if count > 0:
                return count, True
        if p and p.get("do_remote_decode") and self.s.state and self.s.producer:
            self._truncate_for_state(request)
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        p = request.kv_transfer_params
        if not p:
            return
        rid = request.request_id
        if p.get("do_remote_decode") and self.s.producer and rid not in self._p:
            self._p[rid] = _PReq(request, self._ids(blocks.get_block_ids() if blocks is not None else None))
        if p.get("do_remote_prefill"):
            p["do_remote_prefill"] = False  # one load per request (also after a preemption)
            kv, why = self._remote(request)
            if kv is None or num_external_tokens <= 0:
                self._drop(request)  # the prefill side can release its slots now
                return
            timeout = _float(p.get("kvstage_load_timeout", self.s.load_timeout), "kvstage_load_timeout")
            remote_bs = int(kv["block_size"])
            if self.s.grouped:
                count, local, skip, err = self._recv_groups(request, blocks)
            else:
                local = tuple(_unhashed(blocks))
                count = int(kv["num_blocks"])  # the room's: the prefill side's blocks
                mine = count if remote_bs == self.s.block_size else _cdiv(self._staged(request), self.s.block_size)
                skip = mine - len(local)
                err = None if 0 <= skip else f"{len(local)} blocks to fill, the prefill side staged {kv['num_blocks']}"
                skip = max(skip, 0)
            remote_tp = int(p.get("tp_size", self.s.tp_size))
            self._recv[rid] = RecvSpec(rid, str(p["remote_request_id"]), str(p["remote_host"]), int(p["remote_port"]),
                                       count, local, skip, timeout, err,
                                       remote_tp if remote_tp != self.s.tp_size and not self.s.mla else 0,
                                       self.s.mla, remote_bs if remote_bs != self.s.block_size else 0)
            self._d_loading.add(rid)

    def _ids(self, ids):
        """vLLM block ids (a tuple of per-group lists, or a flat list; None: none) as kept here: one list per group
        when grouped, else group 0's list."""
        if not self.s.grouped:
            return _group0(ids) or []
        ids = list(ids or ())
        if ids and not isinstance(ids[0], (list, tuple)):
            raise ValueError(f"kvstage connector: one block list for {len(self.s.groups)} KV cache groups")
        return [list(g) for g in ids] + [[] for _ in range(len(self.s.groups) - len(ids))]

    def _recv_groups(self, request, blocks):
        """(room blocks per group, local block ids per group, skip per group, error) of a grouped load: in each
        group the room holds the blocks group_blocks names; the unhashed ones fill its last positions."""
        unhashed = _unhashed_groups(blocks)
        counts, locals_, skips, err = [], [], [], None
        for g, (first, end) in enumerate(self.s.group_blocks(self._staged(request))):
            k = end - first
            loc = unhashed[g] if g < len(unhashed) else []
            if self.s.groups[g].kind == "mamba" and len(loc) < k:
                err = f"{len(loc)} state blocks to fill in group {g}, the prefill side staged {k}"
            if self.s.groups[g].kind != "full":
                loc = loc[max(0, len(loc) - k):]  # the window's (the chunk's) blocks only; the state block
            elif len(loc) > k:
                err = f"{len(loc)} blocks to fill in group {g}, the prefill side staged {k}"
            counts.append(k)
            locals_.append(tuple(loc))
            skips.append(max(0, k - len(loc)))
        return tuple(counts), tuple(locals_), tuple(skips), err

    def _maybe_save(self, st, computed, scheduled):
        if st.saved:
            return
        n = self._num_prompt(st.request)
        if computed + scheduled < n:
            return
        if self.s.grouped:
            spans = self.s.group_blocks(n)
            for g, (first, end) in enumerate(spans):
                if len(st.blocks[g]) < end:
                    logger.error("kvstage connector: request %s has %d blocks of group %d for %d tokens; not staged",
                                 st.request.request_id, len(st.blocks[g]), g, n)
                    return
            ids = tuple(tuple(st.blocks[g][first:end]) for g, (first, end) in enumerate(spans))
        else:
            nb = _cdiv(n, self.s.block_size)
            if len(st.blocks) < nb:
                logger.error("kvstage connector: request %s has %d blocks for %d tokens; not staged",
                             st.request.request_id, len(st.blocks), n)
                return
            ids = tuple(st.blocks[:nb])
        p = st.request.kv_transfer_params or {}
        timeout = _float(p.get("kvstage_stage_timeout", self.s.stage_timeout), "kvstage_stage_timeout")
        decode_tp = self._decode_tp(st.request)
        if decode_tp == self.s.tp_size or self.s.mla:
            decode_tp = 0  # the plain layout
        st.saved = True
        self._saves[st.request.request_id] = SaveSpec(st.request.request_id, ids, n, timeout, decode_tp)

    def _decode_tp(self, request):
        """The decode TP size a prefill request is staged for: its kv_transfer_params' kvstage_decode_tp_size (a
        router that knows where it sends it), else the instance's; one that does not pair with this side's TP size
        falls back to the instance's (logged)."""
        v = (request.kv_transfer_params or {}).get("kvstage_decode_tp_size")
        if v is None or self.s.mla:
            return self.s.decode_tp
        try:
            return _tp_pair(v, self.s.tp_size, "kvstage_decode_tp_size")
        except ValueError as e:
            logger.warning("kvstage connector: request %s: %s; staged for decode TP size %d", request.request_id, e,
                           self.s.decode_tp)
            return self.s.decode_tp

    def build_connector_meta(self, scheduler_output):
        so = scheduler_output
        nsched = getattr(so, "num_scheduled_tokens", None) or {}
        preempted = set(getattr(so, "preempted_req_ids", None) or ())
        for rid in preempted & set(self._p):
            if self._p[rid].saved:
                self._abort_times[rid] = time.time()
            self._restage(rid, self._ids(None))
        for new in getattr(so, "scheduled_new_reqs", None) or ():
            st = self._p.get(new.req_id)
            if st is not None:
                st.blocks = self._ids(new.block_ids)
                self._maybe_save(st, int(new.num_computed_tokens), int(nsched.get(new.req_id, 0)))
        cached = getattr(so, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed_ids = set(getattr(cached, "resumed_req_ids", None) or ())
            resumed_flags = getattr(cached, "resumed_from_preemption", None)
            for i, rid in enumerate(cached.req_ids):
                st = self._p.get(rid)
                if st is None:
                    continue
                resumed = rid in resumed_ids or bool(resumed_flags[i] if resumed_flags else False)
                nb = cached.new_block_ids[i] if cached.new_block_ids else None
                if resumed:
                    self._restage(rid, self._ids(nb))
                elif nb and self.s.grouped:
                    for g, new_ids in enumerate(self._ids(nb)):
                        st.blocks[g].extend(new_ids)
                elif nb:
                    st.blocks.extend(_group0(nb) or [])
                self._maybe_save(st, int(cached.num_computed_tokens[i]), int(nsched.get(rid, 0)))
        meta = KvstageConnectorMetadata(self._saves, self._finished, self._unstage, self._recv, self._aborts,
                                        self._drops, self._abort_times)
        self._reset()
        return meta

    def _restage(self, rid, blocks):
        """A preempted prefill request: its blocks were freed; what was staged from them is void."""
        st = self._p[rid]
        st.blocks = list(blocks)
        if st.saved:
            st.saved = False
            self._saves.pop(rid, None)
            self._unstage.add(rid)

    def request_finished(self, request, block_ids):
        rid = request.request_id
        p = request.kv_transfer_params or {}
        if rid in self._d_loading:
            # A load in flight: its blocks are given back when the worker reports it in finished_recving,
            # once the room's final event came and no copy-out can run (vLLM delays them too).
            self._d_loading.discard(rid)
            self._aborts.add(rid)
            self._abort_times[rid] = time.time()
            return True, None
        if p.get("do_remote_prefill"):  # aborted before it was ever scheduled
            p["do_remote_prefill"] = False
            self._drop(request)
            return False, None
        st = self._p.pop(rid, None)
        if not p.get("do_remote_decode") or st is None or not st.saved:
            return False, None  # nothing of ours reads its blocks
        handoff = _status(request.status) in _HANDOFF
        self._finished[rid] = (handoff, True)
        self._p_delayed[rid] = handoff
        if not handoff:
            self._abort_times[rid] = time.time()
            return True, None  # aborted while its copy may run: free once it cannot read the blocks any more
        n = self._num_prompt(request)
        nb = _cdiv(n, self.s.block_size)
        kvs = dict(version=1, num_blocks=nb, num_tokens=n, block_size=self.s.block_size)
        decode_tp = self._decode_tp(request)
        if self.s.mla:  # staged once, by rank 0, for any decode TP size
            kvs["mla"] = True
        elif decode_tp != self.s.tp_size:  # the head slices its ranks' KV is staged in
            kvs["decode_tp_size"] = decode_tp
        if self.s.grouped:  # each group's staged positions [first, end); remote_block_ids: those blocks, as NIXL's
            spans = self.s.group_blocks(n)
            kvs["groups"] = [[first, end] for first, end in spans]
            ids = self._ids(block_ids)
            remote = [[int(b) for b in ids[g][first:end]] for g, (first, end) in enumerate(spans)]
        else:
            remote = [[int(b) for b in (_group0(block_ids) or [])]]
        # NixlConnector's keys with its meanings (nixl/scheduler.py request_finished @ 9aaf83ef502f), so routers and
        # vLLM's disaggregated-serving proxies pass them on unchanged; the decode side reads kvstage's own part.
        # remote_block_ids: the prefill's blocks per KV cache group (informational here: the bytes travel through
        # kvstage slots, not by block id); remote_num_tokens: the request's computed tokens at its finish.
        return True, dict(do_remote_prefill=True, do_remote_decode=False,
                          remote_block_ids=remote,
                          remote_engine_id=self.s.engine_id, remote_request_id=rid, remote_host=self.s.host,
                          remote_port=self.s.base_port, tp_size=self.s.tp_size,
                          remote_num_tokens=int(getattr(request, "num_computed_tokens", 0) or 0),
                          kvstage=kvs)

    def update_connector_output(self, connector_output):
        for rid in getattr(connector_output, "finished_sending", None) or ():
            self._p_delayed.pop(rid, None)
        for rid in getattr(connector_output, "finished_recving", None) or ():
            self._d_loading.discard(rid)

    def has_pending_push_work(self):
        return bool(self._p_delayed)


# The side channel (decode worker -> prefill worker only) is kvstage.sidechannel's: authenticated by the peer secret.

# ---------------------------------------------------------------------------------------------
# The worker's agent: one thread owning the kvstage connection (a Client is not thread-safe).
# ---------------------------------------------------------------------------------------------

class _Stage:
    """Prefill side of one request: its blocks copied into slots, waiting for (then handed to) its rooms.

    With the decode side's TP size this side's (shares None) one room holds the request's KV in the plain layout.
    Else one room per decode rank this rank serves (tp_shares), each holding that rank's heads of every block in the
    share layout (VllmLayout.share_extents); share j's bytes are slots [j * part_chunks, (j + 1) * part_chunks) of the
    stage, its room's chunk i slot j * part_chunks + i."""

    def __init__(self, spec, layout, ss, shares=None):
        self.req = spec.req_id
        grouped = bool(spec.block_ids) and isinstance(spec.block_ids[0], (list, tuple))
        self.blocks = [list(g) for g in spec.block_ids] if grouped else list(spec.block_ids)
        self.nblocks = tuple(len(g) for g in self.blocks) if grouped else len(self.blocks)
        self.shares = shares  # None, or [(decode rank, first head, end head)]
        self.decode_tp = spec.decode_tp
        if shares is None:
            self.part_nbytes = layout.nbytes(self.nblocks)
        else:  # every share has as many heads (tp_shares): as many bytes
            self.part_nbytes = layout.share_nbytes(self.nblocks, shares[0][1], shares[0][2])
        self.nparts = 1 if shares is None else len(shares)
        self.part_chunks = _cdiv(self.part_nbytes, ss)
        self.nbytes = self.part_nbytes * self.nparts
        self.chunks = self.part_chunks * self.nparts
        self.ss = ss
        self.deadline = time.monotonic() + spec.stage_timeout
        self.posted, self.pieces, self.sealed = set(), collections.deque(), False
        self.leases, self.views, self.jobs = None, {}, []
        self.written, self.full, self.sent = [0] * self.chunks, set(), set()
        self.rooms, self.finals = [None] * self.nparts, [None] * self.nparts
        self.uids = {}  # a room's user_data -> its share
        self.handoff, self.delayed, self.finish_known, self.reported = None, False, False, False
        self.state, self.why = "staging", None  # staging -> ready -> sending -> done; or failed
        self.starved = False

    def chunk_len(self, s):
        return min(self.ss, self.part_nbytes - (s % self.part_chunks) * self.ss)

    @property
    def room(self):
        """The plain layout's one room (tests, logs)."""
        return self.rooms[0]

    @property
    def all_final(self):
        return all(f is not None for f in self.finals)

    def unopened(self):
        """True while a share's room was never opened (and is not given up)."""
        return any(r is None and f is None for r, f in zip(self.rooms, self.finals))

    @property
    def copied(self):
        return self.sealed and not self.pieces and not self.jobs and len(self.full) == self.chunks

    @property
    def terminal(self):
        return self.state in ("done", "failed")


class _Share:
    """One room of a load: what one prefill rank sends this rank. plain: the request's whole KV in the plain layout
    (equal TP sizes); else heads [h0, h1) of this rank's blocks in the share layout."""
    __slots__ = ("rank", "h0", "h1", "plain", "endpoint", "nbytes", "room", "uid", "final", "job", "copied")

    def __init__(self, spec, layout, rank, h0=0, h1=0, plain=True, block_size=0):
        self.rank, self.h0, self.h1, self.plain = rank, h0, h1, plain
        self.endpoint = (spec.remote_host, spec.remote_port + rank)
        if spec.remote_block_size:  # the prefill's blocks, token-major: its plain layout
            self.nbytes = layout.token_nbytes(spec.num_blocks * spec.remote_block_size, block_size)
        elif plain:
            self.nbytes = layout.nbytes(spec.num_blocks)
        else:
            self.nbytes = layout.share_nbytes(spec.num_blocks, h0, h1)
        self.room = self.uid = self.final = self.job = None
        self.copied = False


class _Load:
    """Decode side of one request: its rooms (one per prefill rank holding some of this rank's heads: tp_shares),
    then each one's copy-out into its heads of the request's blocks. Done once every share is copied; one share
    failing fails the load."""

    def __init__(self, spec, layout, tp_rank, shares=None, block_size=0):
        self.spec = spec
        self.req = spec.req_id
        self.shares = shares or [_Share(spec, layout, tp_rank, block_size=block_size)]
        self.nbytes = sum(sh.nbytes for sh in self.shares)
        self.endpoint = self.shares[0].endpoint
        self.deadline = time.monotonic() + spec.load_timeout
        self.uids = {}  # a room's user_data -> its share
        self.state = "opening"  # opening -> open -> copying -> done; or failed
        self.aborted = self.failed = self.reported = False
        self.why = None

    @property
    def room(self):
        return self.shares[0].room

    def running(self):
        """True while a share's copy-out may still write the blocks."""
        return any(sh.job is not None and not sh.job.done() for sh in self.shares)


class _Agent:
    """A worker rank's kvstage side on its own thread: the connection, the prefill stages, the decode loads, the
    prefill's side-channel listener. The worker thread posts commands; results come back through take_finished().
    Test hooks: .copier (submit(job) -> CopyHandle, optional pump()), .hold_send(req_id, chunk) -> bool."""

    IDLE_S, BUSY_S = 0.05, 0.002
    tp_size = 1  # the instance's TP size (the worker side sets it)
    block_size = 0  # the instance's block size (the worker side sets it)
    mla = False  # replicated KV (the worker side sets it): prefill rank 0 stages, decode rank 0 opens a shared room
    JOINS_MAX = 4096

    def __init__(self, socket_path, layout, copier, tp_rank, listen, stage_timeout, side_key=None):
        self.socket_path, self.layout, self.copier, self.tp_rank = socket_path, layout, copier, tp_rank
        self.side_key = side_key if side_key is not None else _sidechannel.load_key()
        self.stage_timeout = stage_timeout
        self.hold_send = None
        self._lock = threading.Lock()
        self._cmds, self._inbox = collections.deque(), collections.deque()
        self._finished_sending, self._finished_recving, self._load_errors = set(), set(), set()
        self._stages, self._loads, self._by_uid = {}, {}, {}
        self._pending_pulls = collections.deque()
        self._listen = listen
        self._joins = collections.OrderedDict()  # MLA decode rank > 0: req_id -> the shared room's descriptor
        self.ended = collections.OrderedDict()  # req_id -> why its stage or load ended (the last 4096)
        self.stats = KvstageKVConnectorStats()  # under _lock: taken by the worker thread (take_stats)
        # req_id -> time.time() of its abort or preemption (the scheduler's), till its blocks are free
        self._abort_t = {}
        self._uids = itertools.count(1)
        self._peers = _sidechannel.Peers(self.side_key)  # one cached connection per prefill worker
        self._client = None
        self._stop = False
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._started = threading.Event()
        self._start_error = None
        self._listener = None
        try:
            if listen is not None:
                self._listener = FrameListener(
                    listen[0], listen[1], self._on_msg,
                    lambda m: m.get("t") in ("pull", "drop", "join") and isinstance(m.get("req"), str), "vllm",
                    self.side_key)
            self._thread = threading.Thread(target=self._main, name="kvstage-vllm-agent", daemon=True)
            self._thread.start()
            self._started.wait()
        except BaseException:
            self._close_fds()
            raise
        if self._start_error is not None:
            self._close_fds()
            raise self._start_error

    # -- the worker thread's side ------------------------------------------------------------
    @property
    def listen_port(self):
        return self._listener.port if self._listener is not None else None

    def post(self, fn, *args):
        with self._lock:
            self._cmds.append((fn, args))
        self.wake()

    def wake(self):
        try:
            os.write(self._w, b"x")
        except OSError:
            pass

    def _on_msg(self, msg):
        with self._lock:
            self._inbox.append(msg)
        self.wake()

    def take_finished(self):
        """Returns (finished_sending, finished_recving, the failed loads' block ids) since the last call, at once:
        a failed load's blocks are reported in the same step as the load."""
        with self._lock:
            out = self._finished_sending, self._finished_recving, self._load_errors
            self._finished_sending, self._finished_recving, self._load_errors = set(), set(), set()
        return out

    def take_stats(self):
        """Returns the observations since the last call (a KvstageKVConnectorStats) or None if there are none."""
        with self._lock:
            return None if self.stats.is_empty() else self.stats.clone_and_reset()

    STATS_MAX = 65536  # entries per key kept between two takes (vLLM takes them every step)

    def _record(self, key, value=1):
        with self._lock:
            v = self.stats.data[key]
            v.append(value)
            if len(v) > self.STATS_MAX:
                del v[:len(v) - self.STATS_MAX]

    def cmd_abort_times(self, times):
        for rid, t in times.items():
            self._abort_t.setdefault(rid, t)

    def _freed(self, req):
        """req's blocks are free for vLLM now (reported, or no copy reads them after a preemption)."""
        t = self._abort_t.pop(req, None)
        if t is not None:
            self._record("abort_to_free_seconds", max(0.0, time.time() - t))

    def stage_state(self, req_id):
        """The prefill stage's state (staging, ready, sending, done, failed) or None, and why (tests, logs)."""
        with self._lock:
            st = self._stages.get(req_id)
            return (st.state, st.why) if st is not None else (None, self.ended.get(req_id))

    def load_state(self, req_id):
        ld = self._loads.get(req_id)
        return (ld.state, ld.why) if ld is not None else (None, self.ended.get(req_id))

    def close(self, timeout=10):
        self._stop = True
        self.wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("kvstage connector: the agent thread did not stop within %ss", timeout)
            return
        self._close_fds()

    def _close_fds(self):
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._r = self._w = -1

    # -- the agent thread ----------------------------------------------------------------------
    def _main(self):
        try:
            self._client = Client(self.socket_path)
        except Exception as e:
            self._start_error = e
            self._started.set()
            return
        self._started.set()
        while not self._stop:
            try:
                busy = self._step()
            except (NotConnected, Timeout) as e:
                self._broken(e)
                busy = False
            except Exception:  # never let the thread die: every request would hang
                logger.exception("kvstage connector: agent step failed")
                busy = False
            self._sleep(self.BUSY_S if busy else self.IDLE_S)
        self._teardown()

    def _sleep(self, timeout):
        fds = [self._r]
        if self._client is not None:
            try:
                fds.append(self._client.fileno())
            except KvstageError:
                pass
        try:
            select.select(fds, [], [], timeout)
        except (OSError, ValueError):
            time.sleep(timeout)
        try:
            while os.read(self._r, 4096):
                pass
        except OSError:
            pass

    def _c(self):
        if self._client is None:
            self._client = Client(self.socket_path)
        return self._client

    def _step(self):
        with self._lock:
            cmds, self._cmds = self._cmds, collections.deque()
            msgs, self._inbox = self._inbox, collections.deque()
        for fn, args in cmds:
            self._guarded(fn, *args)
        for m in msgs:
            self._guarded(self._on_side_msg, m)
        for _ in range(len(self._pending_pulls)):
            self._guarded(self._pull, *self._pending_pulls.popleft())
        self._pump()
        pump = getattr(self.copier, "pump", None)
        if pump is not None:
            pump()
        busy = bool(self._pending_pulls)
        for st in list(self._stages.values()):
            self._guarded(self._stage_progress, st, fail=self._stage_fail)
            busy = busy or st.starved or (st.state == "staging" and bool(st.pieces))
        for ld in list(self._loads.values()):
            self._guarded(self._load_progress, ld, fail=self._load_fail)
            joining = ld.spec.mla and self.tp_size > 1 and self.tp_rank != 0  # woken by rank 0's descriptor
            busy = busy or (ld.state == "opening" and not joining) or any(sh.job is not None for sh in ld.shares)
        self._timeouts()
        return busy

    def _guarded(self, fn, *args, fail=None):
        """Runs fn(*args); a lost connection fails everything, any other error only this command (and with fail,
        the stage or load it was about: fail(obj, why))."""
        try:
            fn(*args)
        except (NotConnected, Timeout) as e:
            self._broken(e)
        except Exception as e:
            logger.exception("kvstage connector: %s failed", getattr(fn, "__name__", fn))
            if fail is not None:
                try:
                    fail(args[0], f"internal error: {e!r}")
                except Exception:
                    logger.exception("kvstage connector: failing after an internal error")

    def _pump(self):
        if self._client is None:
            return
        while True:
            evs = self._client.poll(128)
            for ev in evs:
                obj = self._by_uid.get(ev.user_data)
                if isinstance(obj, _Stage):
                    self._stage_event(obj, ev)
                elif isinstance(obj, _Load):
                    self._load_event(obj, ev)
            if len(evs) < 128:
                return

    def _end(self, req, why):
        self.ended[req] = why
        while len(self.ended) > 4096:
            self.ended.popitem(last=False)

    def _broken(self, exc):
        """The connection is gone or out of step: nothing of it can move or land any more; fail everything."""
        logger.error("kvstage connector: connection to kvstaged lost (%s)", exc)
        for st in list(self._stages.values()):
            for h in st.jobs:
                h.cancel()
            st.jobs, st.views, st.leases = [], {}, None
            st.rooms = [None] * st.nparts
            st.finals = [f or "lost" for f in st.finals]
            st.uids.clear()
            self._stage_fail(st, f"connection to kvstaged lost: {exc}")
        for ld in list(self._loads.values()):
            for sh in ld.shares:
                if sh.job is not None:
                    sh.job.cancel()
                    sh.job = None
                sh.room, sh.final = None, sh.final or "lost"
            ld.uids.clear()
            self._load_fail(ld, f"connection to kvstaged lost: {exc}")
        self._by_uid.clear()
        c, self._client = self._client, None
        try:
            c.close()
        except Exception:
            pass

    def _teardown(self):
        for st in list(self._stages.values()):
            for h in st.jobs:
                h.cancel()
            st.jobs, st.views = [], {}
        for ld in list(self._loads.values()):
            for sh in ld.shares:
                if sh.job is not None:
                    sh.job.cancel()
        self._stages.clear()
        self._loads.clear()
        if self._client is not None:
            try:
                self._client.close()  # the proxy aborts our rooms and frees our slots
            except Exception:
                logger.exception("kvstage connector: closing the connection")
            self._client = None
        self._peers.close()

    # -- prefill: stages -----------------------------------------------------------------------
    def cmd_stage(self, spec):
        if spec.req_id in self._stages:
            old = self._stages.pop(spec.req_id)  # a restage after a preemption
            self._stage_fail(old, "staged again", failure=False)
        try:
            c = self._c()
        except KvstageError as e:  # no proxy: nothing is staged (the blocks are freed when the request ends)
            logger.error("kvstage connector: cannot stage %s: %s", spec.req_id, e)
            return self._end(spec.req_id, f"no connection to kvstaged: {e}")
        if self.mla and self.tp_rank != 0:
            return self._end(spec.req_id, "MLA: prefill rank 0 stages the KV every rank holds")
        shares, why = None, None
        if spec.decode_tp and spec.decode_tp != self.tp_size:
            try:
                if not self.layout.kv_heads:
                    raise ValueError("a cache without KV heads to split (a state or MLA layer) moves between equal TP "
                                     "sizes only")
                shares = tp_shares(self.tp_rank, self.tp_size, spec.decode_tp, self.layout.kv_heads)
            except ValueError as e:
                why = f"refused: decode TP size {spec.decode_tp}, this side {self.tp_size}: {e}"
        st = _Stage(spec, self.layout, c.slot_size, shares)
        self._stages[st.req] = st
        if why is not None:
            return self._stage_fail(st, why)
        try:
            self.layout.check(st.blocks)
        except ValueError as e:
            return self._stage_fail(st, f"refused: {e}")
        if st.chunks > c.slot_count:
            self._stage_fail(st, f"{st.nbytes} bytes do not fit the pool ({c.slot_count} slots)")

    def cmd_barrier(self, event):
        """Sets event once every command posted before it has run (handle_preemptions waits on it)."""
        event.set()

    def cmd_unstage(self, req):
        st = self._stages.pop(req, None)
        if st is not None:
            self._stage_fail(st, "preempted: its blocks were freed", failure=False)
            self._end(req, "preempted")
        self._freed(req)  # no copy reads its blocks any more (_stage_fail cancelled or waited for them)

    def _post_layer(self, st, li):
        if li in st.posted:
            return
        st.posted.add(li)
        if st.shares is None:
            st.pieces.extend(self.layout.plan(st.nblocks, st.blocks, 0, st.ss, layer=li))
            return
        for j, (_, h0, h1) in enumerate(st.shares):  # share j from its first slot on
            st.pieces.extend(plan(self.layout.share_extents(st.nblocks, st.blocks, 0, h0, h1, layer=li,
                                                            room_off=j * st.part_chunks * st.ss), st.ss))

    def cmd_layer(self, li, reqs, event=None):
        if event is not None:
            self.copier.after(event)
        for req in reqs:
            st = self._stages.get(req)
            if st is not None and st.state == "staging" and not st.sealed:
                self._post_layer(st, li)

    def cmd_seal(self, reqs, event=None):
        if event is not None:
            self.copier.after(event)
        for req in reqs:
            st = self._stages.get(req)
            if st is not None and st.state == "staging" and not st.sealed:
                for li in range(len(self.layout.layer_names)):
                    self._post_layer(st, li)  # layers the forward did not announce: the forward is over
                st.sealed = True

    def cmd_finished(self, req, handoff, delayed):
        st = self._stages.get(req)
        if st is None:
            if delayed:
                with self._lock:
                    self._finished_sending.add(req)
            self._freed(req)
            return
        st.finish_known, st.handoff, st.delayed = True, handoff, delayed
        if not handoff:
            self._stage_fail(st, "the request ended without a hand-off", failure=False)
        self._stage_report(st)

    def _stage_progress(self, st):
        if st.terminal:
            return self._stage_report(st)
        c = self._c()
        st.starved = False
        if st.pieces and st.leases is None:
            try:
                st.leases = c.acquire(st.chunks)  # all or none: a half-staged request never holds slots
            except PoolExhausted:
                st.starved = True
                return
        if st.pieces:
            batch = []
            while st.pieces:
                p = st.pieces.popleft()
                s = p.slot
                view = st.views.get(s)
                if view is None and needs_view(p):
                    view = st.views[s] = st.leases[s].view()
                batch.append((st.leases[s], view, p))
            st.jobs.append(self.copier.submit(self._stage_job(st, batch)))
        for h in list(st.jobs):
            if h.done():
                st.jobs.remove(h)
                if h.error is not None:
                    return self._stage_fail(st, f"copying blocks into slots failed: {h.error!r}")
        if any(r is not None and f is None for r, f in zip(st.rooms, st.finals)):
            self._stage_send(st)
        self._stage_report(st)  # before the state says so: whoever sees "ready" knows the report is out
        if st.state == "staging" and st.copied:
            st.state = "ready"
        if st.state == "ready" and len(st.sent) == st.chunks:
            st.state = "sending"

    def _stage_job(self, st, batch):
        copier = self.copier

        def job():
            for lease, view, p in batch:
                copier.copy_in(lease, view, p)
            copier.sync()  # before any slot counts as full (and so can be sent)
            for _, _, p in batch:
                s = p.slot
                st.written[s] += p.nbytes
                if st.written[s] == st.chunk_len(s):
                    st.full.add(s)
        job.req_id, job.kind = st.req, "stage"
        return job

    def _stage_send(self, st):
        for s in sorted(st.full - st.sent):
            hold = self.hold_send
            if hold is not None and hold(st.req, s):
                return
            j, i = divmod(s, st.part_chunks)
            room = st.rooms[j]
            if room is None or st.finals[j] is not None:
                continue  # its decode rank has not asked yet
            st.views.pop(s, None)
            try:
                room.send(st.leases[s], i * st.ss, st.chunk_len(s))
            except Again:
                return  # ring full: the next step sends
            except (NotConnected, Timeout):
                raise
            except KvstageError as e:
                return self._stage_fail(st, f"sending a chunk failed: {e}")
            st.sent.add(s)

    def _stage_report(self, st):
        """finished_sending once the request's blocks cannot be read by a copy any more."""
        if st.finish_known and st.delayed and not st.reported and not st.jobs and (st.copied or st.terminal):
            st.reported = True
            with self._lock:  # one step for a reader: the report is out only once the state says so
                if st.state == "staging" and st.copied:
                    st.state = "ready"
                self._finished_sending.add(st.req)
            self._freed(st.req)
        if (st.terminal and st.all_final and (st.reported or (st.finish_known and not st.delayed))
                and self._stages.get(st.req) is st):
            del self._stages[st.req]

    def _stage_fail(self, st, why, failure=True):
        """Fails a stage; failure: it counts in num_failed_transfers (not for an abort, preemption or release)."""
        if st.terminal:
            return
        if failure:
            self._record("num_failed_transfers")
        logger.debug("kvstage connector: stage of %s failed: %s", st.req, why)
        st.state, st.why = "failed", why
        self._end(st.req, why)
        for h in st.jobs:
            h.cancel()  # queued copies never run; a copy runs only on this thread, so none is running
        st.jobs = []
        try:
            self.copier.sync()
        except Exception:
            pass
        st.views.clear()
        st.pieces.clear()
        if st.leases is not None and self._client is not None:
            for s, lease in enumerate(st.leases):
                if s not in st.sent:
                    try:
                        self._client.release(lease)
                    except KvstageError:
                        pass
        st.leases = None
        for j, room in enumerate(st.rooms):
            if room is not None and st.finals[j] is None:
                room.abort_quietly()  # its final event closes it
            if room is None:
                st.finals[j] = st.finals[j] or "no room"
        self._stage_report(st)

    def _stage_event(self, st, ev):
        if ev.type == EventType.REJECTED:
            lease = next((x for x in (st.leases or ()) if (x.slot, x.epoch) == tuple(ev.lease)), None)
            if lease is not None and self._client is not None:
                st.sent.discard(st.leases.index(lease))
            self._record("num_stale_rejections")
            return self._stage_fail(st, f"the proxy refused a chunk: {ev.error}")
        j = st.uids.pop(ev.user_data, None)
        if j is None:
            return
        st.finals[j] = ev
        if ev.type == EventType.SEND_DONE and not st.terminal:
            if all(f is not None and getattr(f, "type", None) == EventType.SEND_DONE for f in st.finals):
                st.state = "done"
                self._end(st.req, "sent")
                self._record("bytes_sent", st.nbytes)
        elif not st.terminal:
            # one share lost fails the request on its decode rank, and so on every rank (vLLM unites the invalid
            # blocks): the other shares are given up too
            why = ("aborted by the decode side, the proxy or a timeout" if ev.type == EventType.ABORTED
                   else f"failed: {ev.error}")
            room = "the room" if st.shares is None else f"decode rank {st.shares[j][0]}'s room"
            self._stage_fail(st, f"{room} was {why}", failure=ev.type != EventType.ABORTED)
        try:
            st.rooms[j].close()
        except Exception:
            pass
        st.rooms[j] = None
        self._by_uid.pop(ev.user_data, None)
        if st.all_final:
            st.leases = None  # every slot sent is its room's, every other one released
        self._stage_report(st)

    def _share_of(self, st, rank):
        """The index of the share of stage st that decode rank `rank` loads, or None (it loads none of this rank's)."""
        if self.mla:
            return 0  # the one stage every decode rank reads (through decode rank 0's shared room)
        if st.shares is None:
            return 0 if rank == self.tp_rank else None
        return next((j for j, (d, _, _) in enumerate(st.shares) if d == rank), None)

    def _on_side_msg(self, msg):
        if msg["t"] == "drop":
            st = self._stages.get(msg["req"])
            j = self._share_of(st, msg.get("tp_rank", self.tp_rank)) if st is not None else 0
            if j is None or (st is None and msg.get("tp_rank", self.tp_rank) != self.tp_rank
                             and msg.get("tp_size", self.tp_size) == self.tp_size):
                logger.warning("kvstage connector: a release of %s for TP rank %s reached rank %s: ignored",
                               msg["req"], msg.get("tp_rank"), self.tp_rank)
                return
            if st is not None and st.rooms[j] is None and st.finals[j] is None:
                self._stage_fail(st, "released: the decode side will not load it", failure=False)
            return
        if msg["t"] == "join":  # MLA: decode rank 0's shared room, for this rank's load of req to join
            self._joins[msg["req"]] = msg.get("desc")
            while len(self._joins) > self.JOINS_MAX:
                self._joins.popitem(last=False)
            return
        self._pull(msg)

    def _reject(self, msg, why):
        logger.info("kvstage connector: refusing the load of %s: %s", msg.get("req"), why)
        try:
            r = self._c().send_open(_sidechannel.desc_bytes(msg.get("desc")), user_data=0)
            r.abort()
            r.close()
        except (KvstageError, ValueError, KeyError, TypeError) as e:
            logger.debug("kvstage connector: the refused room was gone already: %s", e)

    def _pull(self, msg):
        d, dtp = msg.get("tp_rank"), msg.get("tp_size", self.tp_size)
        if self.mla:
            if d != 0 or self.tp_rank != 0:
                return self._reject(msg, f"MLA: decode rank 0 loads from prefill rank 0 alone, not decode rank {d} "
                                         f"from prefill rank {self.tp_rank} (remote_port misconfigured?)")
        elif dtp == self.tp_size and d != self.tp_rank:  # each rank holds its own shard: another's would load silently
            return self._reject(msg, f"a load for TP rank {d} reached rank {self.tp_rank} "
                                     "(kvstage_port or remote_port misconfigured?)")
        st = self._stages.get(msg["req"])
        if st is None:
            return self._reject(msg, f"no staged KV here ({self.ended.get(msg['req'], 'unknown request')})")
        if st.terminal:
            return self._reject(msg, st.why or st.state)
        staged_for = st.decode_tp or self.tp_size
        if dtp != staged_for and not self.mla:
            return self._reject(msg, f"staged for decode TP size {staged_for}, a load from a decode rank of TP size "
                                     f"{dtp}")
        j = self._share_of(st, d)
        if j is None:
            return self._reject(msg, f"a load for decode TP rank {d} reached prefill rank {self.tp_rank}, which "
                                     f"serves decode ranks {[r for r, _, _ in st.shares]} (remote_port misconfigured?)")
        if st.rooms[j] is not None or st.finals[j] is not None:
            return self._reject(msg, "a second load of the same request")
        if st.shares is None and msg.get("block_size", self.block_size) != self.block_size:
            mine = self.layout.token_fingerprint(self.block_size)
            if mine is None:
                return self._reject(msg, f"decode block size {msg.get('block_size')}, this side {self.block_size}: "
                                         "this side's blocks are not token-major (HND, or K and V in one block)")
            if msg.get("tokens") != mine:
                return self._reject(msg, f"token layouts differ: decode {msg.get('tokens')}, prefill {mine}")
        elif st.shares is None:
            if msg.get("layout") != self.layout.fingerprint():
                return self._reject(msg, f"cache layouts differ: decode {msg.get('layout')}, "
                                         f"prefill {self.layout.fingerprint()}")
        else:
            h = self.layout.kv_heads
            _, h0, h1 = st.shares[j]
            heads = [self.tp_rank * h + h0, self.tp_rank * h + h1]  # of the model's KV heads
            if msg.get("heads") != heads:
                return self._reject(msg, f"decode rank {d} expects KV heads {msg.get('heads')} from prefill rank "
                                         f"{self.tp_rank}, whose share for it is heads {heads}")
            mine = self.layout.share_fingerprint(h0, h1)
            if msg.get("share") != mine:
                return self._reject(msg, f"share layouts differ: decode {msg.get('share')}, prefill {mine}")
        if msg.get("nbytes") != st.part_nbytes:
            return self._reject(msg, f"the decode side expects {msg.get('nbytes')} bytes, {st.part_nbytes} staged")
        try:
            desc = _sidechannel.desc_bytes(msg.get("desc"))
        except ValueError as e:
            return self._reject(msg, str(e))
        try:
            uid = next(self._uids)
            room = self._c().send_open(desc, user_data=uid)
        except (NotConnected, Timeout):
            raise
        except KvstageError as e:
            if e.errno in (_errno.EMFILE, _errno.ENFILE, _errno.EAGAIN, _errno.ENOSR):
                self._pending_pulls.append((msg,))  # no handle, room or peer session free yet
                return
            return self._stage_fail(st, f"could not open the decode side's room: {e}")
        except (ValueError, TypeError) as e:
            return self._reject(msg, f"bad descriptor: {e}")
        if room.nbytes != st.part_nbytes:
            room.abort()
            room.close()
            return self._stage_fail(st, f"the room has {room.nbytes} bytes, {st.part_nbytes} staged")
        st.rooms[j] = room
        st.uids[uid] = j
        self._by_uid[uid] = st

    # -- decode: loads -------------------------------------------------------------------------
    def cmd_recv(self, spec):
        if spec.req_id in self._loads:
            return
        shares, why = None, None
        if spec.remote_tp and spec.remote_tp != self.tp_size:
            try:
                if not self.layout.kv_heads:
                    raise ValueError("a cache without KV heads to split (a state or MLA layer) moves between equal TP "
                                     "sizes only")
                shares = [_Share(spec, self.layout, rank, h0, h1, plain=False)
                          for rank, h0, h1 in tp_shares(self.tp_rank, self.tp_size, spec.remote_tp,
                                                        self.layout.kv_heads)]
            except ValueError as e:
                why = f"refused: prefill TP size {spec.remote_tp}, this side {self.tp_size}: {e}"
        ld = _Load(spec, self.layout, self.tp_rank, shares, self.block_size)
        self._loads[ld.req] = ld
        if spec.error or why:
            return self._refuse_load(ld, spec.error or why)
        try:
            self.layout.check(spec.local_block_ids)
        except ValueError as e:
            return self._refuse_load(ld, f"refused: {e}")
        if spec.remote_block_size:  # the room: the prefill's blocks' tokens; the last block here starts inside it
            tokens, mine = spec.num_blocks * spec.remote_block_size, spec.skip + len(spec.local_block_ids)
            if self.layout.token_fingerprint(self.block_size) is None:
                return self._refuse_load(ld, f"refused: prefill block size {spec.remote_block_size}, this side "
                                             f"{self.block_size}: this side's blocks are not token-major (HND, or K "
                                             "and V in one block)")
            fits = (mine - 1) * self.block_size < tokens and mine * self.block_size > tokens - spec.remote_block_size
        elif isinstance(spec.num_blocks, int):
            fits = spec.skip + len(spec.local_block_ids) == spec.num_blocks
        else:
            fits = len(spec.num_blocks) == len(spec.skip) == len(spec.local_block_ids) and all(
                s + len(b) == n for n, b, s in zip(spec.num_blocks, spec.local_block_ids, spec.skip))
        if not fits:
            return self._refuse_load(ld, f"{len(_flat(spec.local_block_ids))} blocks after {spec.skip} cached, the "
                                         f"room has {spec.num_blocks}")
        self._load_open(ld)

    def _refuse_load(self, ld, why):
        """Fails a load refused before any room opened, and tells the prefill rank(s) to release what they staged
        for it (they would hold it until the stage timeout)."""
        self._load_fail(ld, why)
        spec = ld.spec
        self.cmd_drop(spec.remote_host, spec.remote_port, spec.remote_request_id, 0 if spec.mla else spec.remote_tp)

    def _load_open(self, ld):
        if ld.spec.mla and self.tp_size > 1:
            return self._load_open_shared(ld)
        for sh in ld.shares:
            if sh.room is not None or sh.final is not None:
                continue
            try:
                uid = next(self._uids)
                self._by_uid[uid] = ld
                sh.room, desc = self._c().recv_open(sh.nbytes, user_data=uid)
            except KvstageError as e:
                self._by_uid.pop(uid, None)
                if e.errno in (_errno.EMFILE, _errno.ENFILE, _errno.EAGAIN):
                    return  # no room handle free yet: the next step tries again
                if isinstance(e, (NotConnected, Timeout)):
                    raise
                return self._load_fail(ld, f"could not open a room: {e}")
            sh.uid = uid
            ld.uids[uid] = sh
            msg = {"t": "pull", "req": ld.spec.remote_request_id, "desc": base64.b64encode(desc).decode(),
                   "nbytes": sh.nbytes, "tp_rank": self.tp_rank, "tp_size": self.tp_size}
            if ld.spec.remote_block_size:
                self._token_msg(msg)
            elif sh.plain:
                msg["layout"] = self.layout.fingerprint()
            else:  # which of the model's KV heads this share holds, and how a share of them is laid out
                first = self.tp_rank * self.layout.kv_heads
                msg["heads"] = [first + sh.h0, first + sh.h1]
                msg["share"] = self.layout.share_fingerprint(sh.h0, sh.h1)
            try:
                self._send_msg(sh.endpoint, msg)
            except OSError as e:
                return self._load_fail(ld, f"could not reach the prefill worker at {sh.endpoint[0]}:{sh.endpoint[1]}: "
                                           f"{e}")
        ld.state = "open"

    def _token_msg(self, msg):
        """A pull from a side of another block size: the room is the prefill's blocks as tokens, and what both sides'
        tokens must agree on replaces the plain layout."""
        msg.pop("layout", None)
        msg["block_size"] = self.block_size
        msg["tokens"] = self.layout.token_fingerprint(self.block_size)

    def _load_open_shared(self, ld):
        """MLA with several ranks: rank 0 opens one room for every rank (readers: the TP size), tells the others its
        descriptor over their side channels and asks prefill rank 0 for the KV; rank r > 0 joins that room once the
        descriptor came. The bytes land once; each rank copies them into its own blocks."""
        sh = ld.shares[0]
        if sh.room is not None or sh.final is not None:
            return
        uid = next(self._uids)
        self._by_uid[uid] = ld
        desc = None
        try:
            if self.tp_rank == 0:
                sh.room, desc = self._c().recv_open(sh.nbytes, user_data=uid, readers=self.tp_size)
            else:
                joined = self._joins.pop(ld.req, None)
                if joined is None:
                    self._by_uid.pop(uid, None)
                    return  # rank 0's descriptor has not come yet
                sh.room = self._c().join(_sidechannel.desc_bytes(joined), user_data=uid)
        except (NotConnected, Timeout):
            raise
        except (KvstageError, ValueError) as e:
            self._by_uid.pop(uid, None)
            if isinstance(e, KvstageError) and e.errno in (_errno.EMFILE, _errno.ENFILE, _errno.EAGAIN):
                return  # no room handle free yet: the next step tries again
            return self._load_fail(ld, f"could not {'open' if self.tp_rank == 0 else 'join'} the shared room: {e}")
        sh.uid = uid
        ld.uids[uid] = sh
        ld.state = "open"
        if self.tp_rank != 0:
            if sh.room.nbytes != sh.nbytes:
                self._load_fail(ld, f"the shared room has {sh.room.nbytes} bytes, this rank expects {sh.nbytes}")
            return
        b64 = base64.b64encode(desc).decode()
        host, base = self._listen[0], self._listen[1] - self.tp_rank
        try:
            for rank in range(1, self.tp_size):
                self._send_msg((host, base + rank), {"t": "join", "req": ld.req, "desc": b64})
        except OSError as e:
            return self._load_fail(ld, f"could not tell decode rank {rank} the shared room (at {host}:{base + rank}): "
                                       f"{e}")
        msg = {"t": "pull", "req": ld.spec.remote_request_id, "desc": b64, "nbytes": sh.nbytes, "tp_rank": 0,
               "tp_size": self.tp_size, "layout": self.layout.fingerprint()}
        if ld.spec.remote_block_size:
            self._token_msg(msg)
        try:
            self._send_msg(sh.endpoint, msg)
        except OSError as e:
            self._load_fail(ld, f"could not reach the prefill worker at {sh.endpoint[0]}:{sh.endpoint[1]}: {e}")

    def cmd_abort(self, req):
        ld = self._loads.get(req)
        if ld is None or ld.reported:
            self._abort_t.pop(req, None)
            return  # never had it, or already reported: the scheduler has its blocks already
        ld.aborted = True
        self._stop_load(ld)
        ld.state = ld.state if ld.state == "done" else "failed"
        ld.why = ld.why or "aborted"
        self._load_report(ld)

    def cmd_drop(self, host, port, remote_req, remote_tp=0):
        """Tells the prefill rank(s) holding this rank's heads of remote_req to release its slots."""
        tp, remote_tp = self.tp_size, remote_tp or self.tp_size
        if self.mla:  # prefill rank 0 staged it; decode rank 0 speaks for this instance
            ranks = [0] if self.tp_rank == 0 else []
        elif tp >= remote_tp:
            ranks = [self.tp_rank // (tp // remote_tp)]
        else:
            ranks = [self.tp_rank * (remote_tp // tp) + i for i in range(remote_tp // tp)]
        for rank in ranks:
            try:
                self._send_msg((host, port + rank), {"t": "drop", "req": remote_req, "tp_rank": self.tp_rank,
                                                     "tp_size": tp})
            except OSError as e:
                logger.debug("kvstage connector: could not tell %s:%s to release %s: %s", host, port + rank, remote_req,
                             e)

    def _load_event(self, ld, ev):
        if ev.type == EventType.REJECTED:
            self._record("num_stale_rejections")
            return
        sh = ld.uids.get(ev.user_data)
        if sh is None:
            return
        sh.final = ev
        if ev.type == EventType.RECV_DONE and not ld.aborted and not ld.failed:
            ld.state = "copying"
            sh.job = self.copier.submit(self._copy_out_job(ld, sh))
            return self._load_progress(ld)
        if ev.type != EventType.RECV_DONE and not ld.aborted and not ld.failed:
            why = ("aborted by the prefill side, the proxy or a timeout" if ev.type == EventType.ABORTED
                   else f"failed: {ev.error}")
            room = "the room" if sh.plain else f"prefill rank {sh.rank}'s room (heads [{sh.h0}, {sh.h1}) here)"
            self._load_fail(ld, f"{room} was {why}")
        self._load_report(ld)

    def _stop_load(self, ld):
        """Stops a load: its copy-outs not started, its rooms aborted (their finals still to come)."""
        for sh in ld.shares:
            if sh.job is not None and sh.job.cancel():
                sh.job = None
            if sh.room is not None and sh.final is None:
                sh.room.abort_quietly()
            if sh.room is None:
                sh.final = sh.final or "no room"

    def _copy_out_job(self, ld, sh):
        room, copier, ss = sh.room, self.copier, self._c().slot_size
        spec = ld.spec
        if spec.remote_block_size:  # the prefill's blocks' tokens into this side's blocks
            pieces = plan(self.layout.token_extents(spec.num_blocks * spec.remote_block_size, spec.local_block_ids,
                                                    spec.skip, self.block_size), ss)
        elif sh.plain:
            pieces = self.layout.plan(spec.num_blocks, spec.local_block_ids, spec.skip, ss)
        else:  # into this share's heads of each block only
            pieces = plan(self.layout.share_extents(spec.num_blocks, spec.local_block_ids, spec.skip, sh.h0, sh.h1),
                          ss)

        def job():
            copy_room_out(room, pieces, copier)
        job.req_id, job.kind = ld.req, "load"
        return job

    def _load_progress(self, ld):
        if ld.state == "opening" and not ld.failed and not ld.aborted:
            self._load_open(ld)
        ended = False
        for sh in ld.shares:
            j = sh.job
            if j is None or not j.done():
                continue
            sh.job, ended = None, True
            if j.error is not None:
                self._load_fail(ld, f"copying the room into the blocks failed: {j.error!r}")
            elif j.state == "done":
                sh.copied = True
        if (ended and not ld.aborted and not ld.failed and ld.state != "done"
                and all(sh.copied for sh in ld.shares)):
            ld.state = "done"
            self._end(ld.req, "loaded")
            self._record("bytes_received", ld.nbytes)
        if ended:
            self._load_report(ld)

    def _load_fail(self, ld, why):
        if ld.failed or ld.aborted or ld.reported:
            return
        logger.info("kvstage connector: load of %s failed: %s", ld.req, why)
        self._record("num_failed_transfers")
        ld.failed, ld.state, ld.why = True, "failed", why
        self._stop_load(ld)
        self._load_report(ld)

    def _load_report(self, ld):
        """finished_recving once nothing of this load can write its blocks: every share's final event in, no
        copy-out can run."""
        if ld.reported or any(sh.final is None for sh in ld.shares) or ld.running():
            return
        if ld.state not in ("done", "failed"):
            return
        ld.reported = True
        self._end(ld.req, ld.why or ld.state)
        self._freed(ld.req)
        with self._lock:
            self._finished_recving.add(ld.req)
            if ld.failed and not ld.aborted:
                self._load_errors.update(_flat(ld.spec.local_block_ids))
        for sh in ld.shares:
            if sh.room is not None:
                try:
                    sh.room.close()
                except Exception:
                    pass
                sh.room = None
            self._by_uid.pop(sh.uid, None)
        ld.uids.clear()
        if self._loads.get(ld.req) is ld:
            del self._loads[ld.req]

    def _timeouts(self):
        now = time.monotonic()
        for st in list(self._stages.values()):
            if not st.terminal and st.unopened() and now > st.deadline:
                self._stage_fail(st, "expired: no decode side loaded it within the stage timeout")
        for ld in list(self._loads.values()):
            if (ld.state in ("opening", "open", "copying") and any(sh.final is None for sh in ld.shares)
                    and not ld.aborted and not ld.failed and now > ld.deadline):
                self._load_fail(ld, f"timed out after {ld.spec.load_timeout:.1f}s")

    # -- the side channel's sending end ----------------------------------------------------------
    def _send_msg(self, endpoint, msg):
        """Sends one message to the prefill worker at endpoint (host, port); raises OSError
        (sidechannel.HandshakeError when the worker did not prove it holds the peer secret); see sidechannel.Peers."""
        self._peers.send(endpoint[0], endpoint[1], msg)


# ---------------------------------------------------------------------------------------------
# Worker side.
# ---------------------------------------------------------------------------------------------

class _WorkerSide:
    def __init__(self, s: _Settings, agent_class):
        self.s = s
        self.agent_class = agent_class
        self.layout = None
        self.agent = None
        self.tp_rank = s.tp_rank()
        self._load_errors = set()
        self._preempted_done = None  # id of the metadata whose preemptions handle_preemptions has handled
        # the side channel's key: no peer secret (or a refused one) is a start-up error, not a per-request one
        self.side_key = _sidechannel.load_key(s.peer_secret_file)

    def register_kv_caches(self, kv_caches):
        if self.agent is not None:
            raise RuntimeError("kvstage connector: register_kv_caches called twice")
        self.layout = VllmLayout(kv_caches, self.s.num_blocks, self.s.layer_groups())
        if self.layout.device:
            if os.environ.get("KVSTAGE_VLLM_CUDA") != "1":
                raise RuntimeError(
                    "kvstage connector: the KV cache is on a CUDA device; the CUDA path (libkvstage_cuda) is written "
                    "but untested (no GPU on the development machine). Set KVSTAGE_VLLM_CUDA=1 to use it anyway.")
            tensors = [t for v in kv_caches.values() for t in (v if isinstance(v, (list, tuple)) else (v,))]
            gpu = next(t for t in tensors if getattr(t, "is_cuda", False)).device.index or 0
            copier = CudaCopier(gpu)  # a torch stream on that device
        else:
            copier = CpuCopier()
        # a prefill rank listens for loads; an MLA decode rank for its shared rooms (decode rank 0 tells the others)
        serves = self.s.producer or (self.s.mla and self.s.consumer and self.s.tp_size > 1)
        listen = (self.s.host, self.s.base_port + self.tp_rank) if serves else None
        self.agent = self.agent_class(self.s.socket_path, self.layout, copier, self.tp_rank, listen,
                                      self.s.stage_timeout, side_key=self.side_key)
        self.agent.tp_size, self.agent.mla, self.agent.block_size = self.s.tp_size, self.s.mla, self.s.block_size

    def _event(self):
        if not self.layout.device:
            return None
        import torch
        ev = torch.cuda.Event()
        ev.record()
        return ev

    PREEMPT_WAIT_S = 300.0

    def handle_preemptions(self, meta):
        """Before the forward that may reuse a preempted request's blocks (vLLM freed them when it preempted it):
        voids its stage and returns only once no copy reads those blocks - a queued copy cancelled, a running one
        finished (the CUDA copier's stream synchronised) - on the agent thread, which alone runs copies."""
        a = self.agent
        if a is None or meta is None or not meta.reqs_to_unstage:
            return
        done = threading.Event()
        if meta.abort_times:
            a.post(a.cmd_abort_times, dict(meta.abort_times))
        for rid in meta.reqs_to_unstage:
            a.post(a.cmd_unstage, rid)
        a.post(a.cmd_barrier, done)
        if not done.wait(self.PREEMPT_WAIT_S):  # never returns with a copy that may still read the blocks
            raise RuntimeError(f"kvstage connector: the agent did not stop the copies of preempted requests "
                               f"{sorted(meta.reqs_to_unstage)} within {self.PREEMPT_WAIT_S}s")
        self._preempted_done = id(meta)

    def start_load_kv(self, meta):
        a = self.agent
        if a is None or meta is None:
            return
        if self._preempted_done != id(meta):  # a vLLM that does not call handle_preemptions
            if meta.abort_times:
                a.post(a.cmd_abort_times, dict(meta.abort_times))
            for rid in meta.reqs_to_unstage:
                a.post(a.cmd_unstage, rid)
        self._preempted_done = None
        for spec in meta.reqs_to_save.values():
            a.post(a.cmd_stage, spec)
        for rid, (handoff, delayed) in meta.reqs_finished.items():
            a.post(a.cmd_finished, rid, handoff, delayed)
        for spec in meta.reqs_to_recv.values():
            a.post(a.cmd_recv, spec)
        for rid in meta.reqs_to_abort:
            a.post(a.cmd_abort, rid)
        for drop in meta.reqs_to_drop:
            a.post(a.cmd_drop, *drop)

    def save_kv_layer(self, meta, layer_name):
        if self.agent is None or meta is None or not meta.reqs_to_save:
            return
        li = self.layout.index.get(layer_name)
        if li is not None:
            self.agent.post(self.agent.cmd_layer, li, tuple(meta.reqs_to_save), self._event())

    def wait_for_save(self, meta):
        if self.agent is not None and meta is not None and meta.reqs_to_save:
            self.agent.post(self.agent.cmd_seal, tuple(meta.reqs_to_save), self._event())

    def get_finished(self):
        if self.agent is None:
            return None, None
        fs, fr, errs = self.agent.take_finished()
        self._load_errors |= errs  # vLLM asks for them right after, in the same step
        return (fs or None), (fr or None)

    def get_block_ids_with_load_errors(self):
        errs, self._load_errors = self._load_errors, set()
        return errs

    def get_kv_connector_stats(self):
        return self.agent.take_stats() if self.agent is not None else None

    def shutdown(self):
        if self.agent is not None:
            self.agent.close()
            self.agent = None


# ---------------------------------------------------------------------------------------------
# The connector vLLM loads.
# ---------------------------------------------------------------------------------------------

def _is_scheduler(role):
    return getattr(role, "name", str(role)).upper().endswith("SCHEDULER")


class KvstageConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector moving KV between prefill and decode instances through kvstage (module docstring).

    SupportsHMA: vLLM keeps its hybrid KV cache manager on; full-attention, sliding-window, chunked-local and state
    (Mamba, without prefix caching or speculative state blocks) groups move (module docstring); another kind among
    several or an unsupported Mamba configuration is refused at construction."""

    agent_class = _Agent  # tests swap in a subclass

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        self._settings = _Settings(vllm_config, kv_cache_config)
        if _is_scheduler(role):
            self.connector_scheduler, self.connector_worker = _SchedulerSide(self._settings), None
        else:
            self.connector_scheduler, self.connector_worker = None, _WorkerSide(self._settings, self.agent_class)

    # ============================== worker side ==============================
    def register_kv_caches(self, kv_caches):
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def _meta(self):
        m = self._connector_metadata
        return m if isinstance(m, KvstageConnectorMetadata) else None

    def handle_preemptions(self, kv_connector_metadata):
        """vLLM calls this before binding the step's metadata and before the forward: the blocks of requests preempted
        in this step were freed and may be written by this forward, so it returns only once no copy of a preempted
        request's blocks into slots can run any more (its stage is void; the request is staged again when
        recomputed)."""
        assert self.connector_worker is not None
        m = kv_connector_metadata
        self.connector_worker.handle_preemptions(m if isinstance(m, KvstageConnectorMetadata) else None)

    def start_load_kv(self, forward_context, **kwargs):
        """Hands this step's work to the agent: stages to make, loads to start, aborts, releases. Loads run
        between steps (the requests they fill are not in the batch), so nothing here blocks."""
        assert self.connector_worker is not None
        self.connector_worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name):
        """Nothing to wait for: a load fills blocks of requests that wait outside the batch (async load)."""
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        """Starts copying this layer's part of every request staged in this forward into its slots."""
        assert self.connector_worker is not None
        self.connector_worker.save_kv_layer(self._meta(), layer_name)

    def wait_for_save(self):
        """Seals this forward's stages (layers not announced are copied now). Does not block: the blocks stay the
        request's (request_finished delays them) until get_finished reports the copy done."""
        assert self.connector_worker is not None
        self.connector_worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids):
        """Returns (finished_sending, finished_recving): prefill requests whose blocks no copy reads any more,
        decode requests whose load ended (filled, failed - see get_block_ids_with_load_errors - or aborted)."""
        assert self.connector_worker is not None
        return self.connector_worker.get_finished()

    def get_block_ids_with_load_errors(self):
        return self.connector_worker.get_block_ids_with_load_errors() if self.connector_worker else set()

    def get_kv_connector_stats(self):
        """This worker's KvstageKVConnectorStats since the last call (None: nothing happened); vLLM aggregates the
        workers' (KVOutputAggregator), logs them and feeds build_prom_metrics' families."""
        return self.connector_worker.get_kv_connector_stats() if self.connector_worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return KvstageKVConnectorStats(data=data) if data is not None else KvstageKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvstagePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        if self.connector_worker is not None:
            self.connector_worker.shutdown()

    # ============================== scheduler side ==============================
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        assert self.connector_scheduler is not None
        return self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output):
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids):
        """SupportsHMA: vLLM's call with every KV cache group's block ids (after dropping a sliding window's skipped
        blocks); the same answer as request_finished."""
        return self.request_finished(request, block_ids)

    def has_pending_push_work(self):
        return self.connector_scheduler is not None and self.connector_scheduler.has_pending_push_work()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        return None  # any layout: both sides' layouts are compared instead


__all__ = ["KvstageConnector", "KvstageConnectorMetadata", "SaveSpec", "RecvSpec", "VllmLayout", "KVRegion",
           "KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole", "KvstageKVConnectorStats",
           "KvstagePromMetrics",
           "STAGE_TIMEOUT_S", "LOAD_TIMEOUT_S"]
