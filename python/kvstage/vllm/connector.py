"""kvstage.vllm: the connector vLLM loads (KvstageConnector) and its worker side."""
from __future__ import annotations

import os
import threading

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA  # type: ignore
from .. import sidechannel as _sidechannel
from ..plan import CpuCopier, CudaCopier
from .config import _Settings
from .layout import VllmLayout
from .metadata import KvstageConnectorMetadata
from .stats import KvstageKVConnectorStats, KvstagePromMetrics
from .scheduler import _SchedulerSide
from .agent import _Agent


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
        self.agent.trace = self.s.lifecycle_sink("worker")
        self.agent.checksum = self.s.checksum

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


def _is_scheduler(role):
    return getattr(role, "name", str(role)).upper().endswith("SCHEDULER")


class KvstageConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector moving KV between prefill and decode instances through kvstage (kvstage.vllm's docstring).

    SupportsHMA: vLLM keeps its hybrid KV cache manager on; full-attention, sliding-window, chunked-local and state
    (Mamba, without prefix caching or speculative state blocks) groups move (kvstage.vllm's docstring); another kind
    among several or an unsupported Mamba configuration is refused at construction."""

    agent_class = _Agent  # tests swap in a subclass

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        self._settings = _Settings(vllm_config, kv_cache_config)
        if not hasattr(self, "use_eagle_prefix_cache_hashing"):  # a base before 003df2961dd8 does not set it
            self.use_eagle_prefix_cache_hashing = False
        if _is_scheduler(role):
            self.connector_scheduler, self.connector_worker = _SchedulerSide(self._settings), None
        else:
            self.connector_scheduler, self.connector_worker = None, _WorkerSide(self._settings, self.agent_class)

    # ============================== what the engine asks of it ==============================
    # These exist in vLLM's base from 003df2961dd8 on; defined here (never through super()), so that an older base
    # without them works the same, and a vLLM that does not ask them is not affected.
    @property
    def requires_kv_delivery(self):
        """True for a producer (kv_producer, kv_both), as the base's default: a prefill's hand-off must be delivered.
        vLLM @ 003df2961dd8 then preempts with drop_stale_output: a request preempted while its last prefill step is in
        flight does not finish with that step's token (its blocks were freed at the preemption), it is recomputed, and
        staged again from its new blocks. What the connector does at the preemption is the same with any vLLM: the
        stage is void (the scheduler side's _restage), handle_preemptions stops every copy of the freed blocks; a vLLM
        that delivers the stale token instead finishes the request with no hand-off (request_finished: no stage, no
        params), so the decode side computes the prompt itself."""
        return self._settings.producer

    @property
    def supports_eagle_prefix_cache_hashing(self):
        """True: kvstage moves a request's blocks by position between two engines and never stores or looks up KV by
        block hash, so each engine may use the successor-aware EAGLE prefix-cache keys (vLLM's choice when a
        connector says so: prefix_cache.py is_eagle_prefix_cache_hashing_enabled); nothing here depends on them."""
        return True

    def set_eagle_prefix_cache_hashing(self, enabled):
        """The engine's prefix-cache hash protocol; kept (as the base does), used by nothing here."""
        self.use_eagle_prefix_cache_hashing = bool(enabled)

    def set_xfer_handshake_metadata(self, metadata):
        """Nothing to hand shake (get_handshake_metadata is None): the side channel's address travels in the params."""
        return None

    def set_xfer_handshake_metadata_pp_aware(self, metadata):
        """vLLM @ 003df2961dd8 hands the scheduler connector its workers' handshake metadata keyed (pp_rank, tp_rank).
        kvstage has none to hand out (its workers return None) and takes none; pipeline parallelism is refused at start
        (_Settings), so metadata of a pipeline stage past the first is refused here too, saying so."""
        later = sorted({k[0] if isinstance(k, tuple) else 0 for k in (metadata or {})} - {0})
        if later:
            raise ValueError(f"kvstage connector: handshake metadata of pipeline-parallel rank(s) {later}: kvstage "
                             "does not support pipeline parallelism (pipeline_parallel_size must be 1)")
        return None

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
        if self.connector_scheduler is not None:
            self.connector_scheduler.trace.close()

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
