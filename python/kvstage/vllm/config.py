"""kvstage.vllm: what a connector is configured with - vLLM's config and kv_connector_extra_config read once
(_Settings), the KV cache groups it moves, and how TP ranks pair (tp_shares)."""
from __future__ import annotations

import os
import typing

from .. import checksum as _crc
from .. import lifecycle as _lc
from .layout import _cdiv

STAGE_TIMEOUT_S = 120.0
LOAD_TIMEOUT_S = 120.0


def _float(v, what):
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number of seconds, not {v!r}") from None
    if not f > 0:
        raise ValueError(f"{what} must be > 0, not {v!r}")
    return f


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


def mla_reader(prefill_rank, prefill_tp, decode_tp):
    """MLA: the decode rank that opens a request's shared room and pulls it from prefill rank prefill_rank, the one
    that staged it (the prefill side spreads its requests over its ranks: mla_stager). A rank pair of NixlConnector's
    TransferTopology @ 003df2961dd8 (kv_connector/utils.py target_remote_ranks: decode rank r reads prefill rank
    r // (D/P) when D >= P, ranks r*k .. r*k+k-1 when P = k x D): with D >= P the first of the decode ranks that read
    prefill rank p there (p*D/P; NIXL maps decode rank r to prefill rank r*P/D), with P > D the decode rank whose ranks
    include p (p // k; NIXL's MLA reads only the first of them, kvstage reads each in turn, request by request, so
    every prefill rank copies). Sizes of which neither divides the other (NIXL refuses them): floor(p*D/P)."""
    return int(prefill_rank) * int(decode_tp) // int(prefill_tp)


def mla_stager(n, prefill_tp):
    """MLA: the prefill rank that stages a prefill instance's n-th hand-off (0, 1, ...): its ranks in turn, so no one
    GPU does every copy into slots."""
    return int(n) % int(prefill_tp)


def head_shares(layout, rank, tp, remote_tp):
    """tp_shares of this rank's KV heads (layout.kv_heads). Raises ValueError for a cache without KV heads to split,
    or heads that do not split."""
    if not layout.kv_heads:
        raise ValueError("a cache without KV heads to split (a state or MLA layer) moves between equal TP sizes only")
    return tp_shares(rank, tp, remote_tp, layout.kv_heads)


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
        # MLA (vLLM's model_config.use_mla, NixlConnector's is_mla): every TP rank holds the same KV; one prefill rank
        # stages a request once (its ranks in turn: mla_stager), the decode ranks read it from one room they share
        # (Client.recv_open(readers=n), join), opened by the decode rank paired with that prefill rank (mla_reader)
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
        # lifecycle events (kvstage.lifecycle): on with vLLM's own key above 0; where they go: kvstage_trace
        self.trace_rate = _lc.sample_rate_of(extra.get(_lc.SAMPLE_RATE_KEY,
                                                       os.environ.get("KVSTAGE_TRACE_SAMPLE_RATE", 0.0)))
        self.trace_sink = extra.get("kvstage_trace") or None
        self.trace_buffer = extra.get("kvstage_trace_buffer")
        # end-to-end checksums (kvstage.checksum): both sides of a deployment alike
        self.checksum = _crc.setting(extra.get("kvstage_checksum", os.environ.get("KVSTAGE_CHECKSUM")),
                                     "kvstage_checksum")
        self.groups = _groups(kv_cache_config, self.block_size)
        # grouped: block ids per group everywhere (several groups, or one sliding-window group); else plain lists
        self.grouped = len(self.groups) > 1 or self.groups[0].kind != "full"
        # a state (Mamba) group: as NixlConnector @ 9aaf83ef502f (nixl/scheduler.py _truncate_mamba_request_for_prefill,
        # _mamba_prefill_token_count), the prefill side computes and stages the prompt's first n - 1 tokens, the decode
        # side loads those and computes the last token itself (vLLM recomputes the last token of a full prompt hit,
        # which would advance a state already past it)
        self.state = any(g.kind == "mamba" for g in self.groups)

    def lifecycle_sink(self, component):
        """A new lifecycle sink for this side (NOOP when tracing is off); raises ValueError for a bad setting."""
        return _lc.create(connector="KvstageConnector", transfer_mode="pull", component=component,
                          sample_rate=self.trace_rate, sink=self.trace_sink, capacity=self.trace_buffer)

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
