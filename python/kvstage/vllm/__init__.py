"""vLLM KV connector over kvstage: ``kv_connector="KvstageConnector"``, ``kv_connector_module_path="kvstage.vllm"``.

Needs vLLM (importing this package without it raises ImportError); built against vllm-project/vllm @ 9aaf83ef502f
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
Read @ 003df2961dd8 (what it added; the connector defines each hook itself, so an older base works the same):
  vllm/distributed/kv_transfer/kv_connector/v1/base.py
      requires_kv_delivery (default: kv_transfer_config.is_kv_producer), supports_eagle_prefix_cache_hashing (default
      False), set_eagle_prefix_cache_hashing, set_xfer_handshake_metadata_pp_aware (keyed (pp_rank, tp_rank); the
      default refuses pp_rank > 0), has_pending_push_work, KVConnectorWorkerMetadata
  vllm/v1/core/sched/scheduler.py
      requires_kv_delivery read once at start; _preempt_request(..., drop_stale_output=self.requires_kv_delivery)
      frees the blocks and marks the in-flight output stale; update_from_output drops a stale output so marked (the
      request is recomputed), else delivers it (it may finish the preempted request); no waiting request admitted in
      a step that preempted; _connector_finished hands over the blocks of the computed tokens
  vllm/distributed/kv_transfer/kv_connector/v1/prefix_cache.py
      is_eagle_prefix_cache_hashing_enabled: with a connector, EAGLE's successor-aware keys only if it supports them
  EngineCore and the GPU worker (stored copies, not pinned to that commit): each worker's handshake metadata as
      {(pp_rank, tp_rank): metadata} or None, merged and handed to set_xfer_handshake_metadata_pp_aware
  NixlConnector's TransferTopology (kv_connector/utils.py target_remote_ranks, tp_ratio) and its worker's MLA read
      of the first remote rank when P > D (stored copies of recent vLLM: the index holds none at 003df2961dd8)

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
  * MLA (model_config.use_mla: every rank holds the same KV): one prefill rank stages a request, the others
    nothing; the prefill scheduler gives its hand-offs to its ranks in turn (config.mla_stager) and names the rank in
    the params (kvstage.mla_rank). The decode rank paired with it (config.mla_reader: p*D//P, a rank pair of
    NixlConnector's TransferTopology @ 003df2961dd8) opens one shared room (Client.recv_open(readers=decode TP size)),
    sends its descriptor to the other decode ranks' side channels (an MLA decode rank listens on its instance's
    kvstage_port + rank) and pulls from that prefill rank; the others join the room (Client.join): the bytes cross and
    land once, each rank copies them into its own blocks. Any TP sizes.

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
once no copy of those blocks into slots can run (queued copies cancelled, a running one finished). requires_kv_delivery
is True for a producer: vLLM @ 003df2961dd8 then drops the token of a prefill step in flight at the preemption and
recomputes the request, which is staged again; a vLLM that delivers that token finishes the request with its stage
void, and request_finished hands nothing off (the decode side computes the prompt).

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

Where each part lives: config.py (settings, KV cache groups, TP pairing), layout.py (VllmLayout), metadata.py (the
scheduler's metadata for the workers), scheduler.py (the scheduler side), agent.py (the worker's thread), stage.py (its
prefill half: stages, and the pulls it serves), load.py (its decode half), connector.py (KvstageConnector and its
worker side), stats.py (KVConnectorStats and Prometheus).
"""
from __future__ import annotations

# ---------------------------------------------------------------------------------------------
# vLLM's own base classes: kvstage.vllm is a vLLM connector and needs vLLM (the tests put a stand-in package,
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


from .agent import _Agent  # noqa: E402 - after the check above; tests subclass it
from .config import LOAD_TIMEOUT_S, STAGE_TIMEOUT_S, mla_reader, mla_stager, tp_shares  # noqa: E402
from .connector import KvstageConnector  # noqa: E402
from .layout import KVRegion, VllmLayout, _cdiv  # noqa: E402
from .metadata import KvstageConnectorMetadata, RecvSpec, SaveSpec  # noqa: E402
from .stats import KvstageKVConnectorStats, KvstagePromMetrics  # noqa: E402

__all__ = ["KvstageConnector", "KvstageConnectorMetadata", "SaveSpec", "RecvSpec", "VllmLayout", "KVRegion",
           "KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole", "KvstageKVConnectorStats",
           "KvstagePromMetrics", "tp_shares", "mla_reader", "mla_stager",
           "STAGE_TIMEOUT_S", "LOAD_TIMEOUT_S"]
