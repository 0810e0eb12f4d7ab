"""Test helpers for the vLLM connector: a small stand-in of a vLLM engine that drives kvstage.vllm.KvstageConnector
the way vLLM v1 does (vllm/v1/core/sched/scheduler.py and the model runner's KV-connector context, at the commits
named in kvstage/vllm/__init__.py; Engine(vllm=...) picks what differs between 9aaf83ef502f and 003df2961dd8, the
default: the handshake-metadata call at start, requires_kv_delivery at a preemption, the EAGLE prefix-cache choice).
One Engine is one vLLM instance: a scheduler-role connector and, per tensor-parallel rank, a worker-role connector
with that rank's own KV cache shard (tp=1: one worker, as vLLM's UniProcExecutor runs it; tp>1: the ranks' outputs
aggregated as vLLM's KVOutputAggregator does for MultiprocExecutor, each rank's metadata a pickled copy), real
torch CPU KV caches in vLLM's paged layout (per layer (2, num_blocks, block_size, heads, head_dim): K and V), a block
pool that hands a freed block out again first, chunked prefill, async loads
(WAITING_FOR_REMOTE_KVS), delayed frees, kv_load_failure_policy "fail".

A step is what EngineCore.step does: schedule (get_num_new_matched_tokens, allocate, update_state_after_alloc,
build_connector_meta), execute (bind_connector_metadata, start_load_kv, per layer wait_for_layer_load -> the
layer writes its KV -> save_kv_layer, wait_for_save, get_finished(finished_req_ids),
get_block_ids_with_load_errors, clear_connector_metadata; on every rank), update_from_output (invalid blocks fail
the async loads they belong to; finish requests: request_finished and free or delay; update_connector_output;
finished_sending frees; finished_recving readies a waiting request or frees a finished one). With
async_scheduling=True the step is vLLM's batch queue of two (EngineCore.step_with_batch_queue): schedule and execute a
step, then update from the one before, so a step's output arrives after the next schedule, which may have preempted
its request (preempt(): the next schedule preempts it first, as vLLM's does when its policy picks it; its blocks freed,
its in-flight output dropped with drop_stale_output = the connector's requires_kv_delivery @ 003df2961dd8, else
delivered). The "model" writes,
at every position, bytes that depend only on (request seed, TP rank, layer, K/V, position), so a decode engine can
check what each rank received. Importable by spawned children."""
import copy
import dataclasses
import enum
import pickle
import threading
import time
import traceback
import types
import uuid

import torch

import vllm_stubs  # noqa: F401 - vLLM's stand-ins where vllm is not importable, before kvstage.vllm
from kvstage import vllm as kv
from kvstage.plan import CopyHandle, CpuCopier

LAYERS, BLOCK_SIZE, HEADS, HEAD_DIM = 3, 4, 2, 16
NEW, OLD = "003df2961dd8", "9aaf83ef502f"  # the vLLM commits the stand-in engine can be
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
MAX_POS = 256  # positions of the model's content (a fixed shape: the same seed gives the same bytes everywhere)


class RequestStatus(enum.IntEnum):
    """vLLM's names (the connector only reads .name)."""
    WAITING = 1
    WAITING_FOR_REMOTE_KVS = 2
    RUNNING = 3
    PREEMPTED = 4
    FINISHED_STOPPED = 10
    FINISHED_LENGTH_CAPPED = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @staticmethod
    def is_finished(s):
        return s >= RequestStatus.FINISHED_STOPPED


class Request:
    """The fields of vllm.v1.request.Request the connector and this engine use."""

    def __init__(self, request_id, num_prompt, params, seed, max_tokens=1, prefix_blocks=0):
        self.request_id = request_id
        self.prompt_token_ids = [(seed + i) % 50000 for i in range(num_prompt)]
        self.num_prompt_tokens = num_prompt
        self.kv_transfer_params = params
        self.seed = seed
        self.max_tokens = max_tokens
        self.prefix_blocks = prefix_blocks  # blocks this engine already holds (its prefix cache), decode side
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.output = []
        self.blocks = []
        self.load_done = False
        # async scheduling (vllm/v1/request.py's names): tokens scheduled whose output has not come, outputs to come,
        # the in-flight tokens of before a preemption (their output is stale) and whether it is dropped
        self.num_in_flight_tokens = self.num_output_placeholders = self.num_stale_output_tokens = 0
        self.drop_stale_output = False
        self.num_preemptions = 0

    @property
    def num_tokens(self):
        return self.num_prompt_tokens + len(self.output)

    def is_finished(self):
        return RequestStatus.is_finished(self.status)


class KVCacheBlocks:
    def __init__(self, ids, unhashed):
        self.ids, self.unhashed = list(ids), list(unhashed)

    def get_block_ids(self):
        return (list(self.ids),)

    def get_unhashed_block_ids(self):
        return list(self.unhashed)


@dataclasses.dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list
    block_ids: tuple
    num_computed_tokens: int


@dataclasses.dataclass
class CachedRequestData:
    req_ids: list = dataclasses.field(default_factory=list)
    resumed_req_ids: set = dataclasses.field(default_factory=set)
    new_block_ids: list = dataclasses.field(default_factory=list)
    num_computed_tokens: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SchedulerOutput:
    scheduled_new_reqs: list = dataclasses.field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = dataclasses.field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict = dataclasses.field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set = dataclasses.field(default_factory=set)
    preempted_req_ids: set = dataclasses.field(default_factory=set)
    kv_connector_metadata: object = None


@dataclasses.dataclass
class KVConnectorOutput:
    finished_sending: set
    finished_recving: set
    invalid_block_ids: set


def vllm_config(socket_path, port, role="kv_both", tp=1, extra=None, mla=False, block_size=BLOCK_SIZE, eagle=False):
    """A stand-in of VllmConfig with the fields the connector reads (KVTransferConfig's names); eagle: an EAGLE
    speculative config, prefix caching on."""
    ex = {"kvstage_socket": socket_path, "kvstage_host": "127.0.0.1", "kvstage_port": port}
    ex.update(extra or {})
    kt = types.SimpleNamespace(
        kv_connector="KvstageConnector", kv_connector_module_path="kvstage.vllm", kv_role=role,
        engine_id=str(uuid.uuid4()), kv_ip="127.0.0.1", kv_port=14579, kv_buffer_device="cpu",
        kv_connector_extra_config=ex, is_kv_producer=role in ("kv_producer", "kv_both"),
        is_kv_consumer=role in ("kv_consumer", "kv_both"))
    kt.get_from_extra_config = lambda key, default: kt.kv_connector_extra_config.get(key, default)
    return types.SimpleNamespace(
        kv_transfer_config=kt, cache_config=types.SimpleNamespace(block_size=block_size),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, data_parallel_rank=0),
        scheduler_config=types.SimpleNamespace(disable_hybrid_kv_cache_manager=True),
        model_config=types.SimpleNamespace(use_mla=mla),
        speculative_config=types.SimpleNamespace(use_eagle=lambda: True) if eagle else None)


def is_eagle_prefix_cache_hashing_enabled(vllm_config, kv_connector=None):
    """vllm/distributed/kv_transfer/kv_connector/v1/prefix_cache.py @ 003df2961dd8, which the scheduler calls at
    start: successor-aware EAGLE prefix-cache keys only with EAGLE, and with a KV connector only if it supports them."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or not spec.use_eagle():
        return False
    if vllm_config.kv_transfer_config is not None:
        return bool(kv_connector is not None and kv_connector.supports_eagle_prefix_cache_hashing)
    return vllm_config.cache_config.enable_prefix_caching


def kv_cache_config(num_blocks, block_size=BLOCK_SIZE):
    return types.SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[
        types.SimpleNamespace(kv_cache_spec=types.SimpleNamespace(block_size=block_size))])


def rank_config(cfg, rank):
    """The config TP rank `rank`'s worker sees: the engine's, with the rank vLLM's parallel state would give it as the
    connector's fallback (kvstage_tp_rank) where vLLM is not importable."""
    kt = copy.copy(cfg.kv_transfer_config)
    kt.kv_connector_extra_config = dict(kt.kv_connector_extra_config, kvstage_tp_rank=rank)
    kt.get_from_extra_config = lambda key, default: kt.kv_connector_extra_config.get(key, default)
    out = copy.copy(cfg)
    out.kv_transfer_config = kt
    return out


class KVOutputAggregator:
    """vLLM's (vllm/distributed/kv_transfer/kv_connector/utils.py): the ranks' KVConnectorOutputs as one; a request
    is finished_sending (finished_recving) once every rank has reported it, in whatever steps they did; the invalid
    block ids of all ranks together."""

    def __init__(self, expected_finished_count):
        self._recv_remaining_count, self._send_remaining_count = {}, {}
        self._expected_finished_count = expected_finished_count

    def _update(self, req_ids, remaining, finished):
        for req_id in req_ids or ():
            n = remaining.get(req_id, self._expected_finished_count) - 1
            remaining[req_id] = n
            if n == 0:
                finished.add(req_id)
                del remaining[req_id]

    def aggregate(self, outputs):
        finished_sending, finished_recving, invalid = set(), set(), set()
        for out in outputs:
            self._update(out.finished_sending, self._send_remaining_count, finished_sending)
            self._update(out.finished_recving, self._recv_remaining_count, finished_recving)
            invalid |= out.invalid_block_ids
        return KVConnectorOutput(finished_sending, finished_recving, invalid)

    def pending(self):
        """Requests some but not all ranks reported: {req_id: ranks still to report} (sending, receiving)."""
        return dict(self._send_remaining_count), dict(self._recv_remaining_count)


def kv_cache(num_blocks, head_dim=HEAD_DIM, layout="kv-first", heads=HEADS, block_size=BLOCK_SIZE):
    """One layer's paged KV cache, indexed (K/V, block, position, head, dim) either way: "kv-first" is vLLM's
    (2, num_blocks, ...) in memory (a block's K one span, its V another, blocks item bytes apart); "block-first" is
    (num_blocks, 2, ...) in memory (a block's K then its V: the blocks of each part 2 x item bytes apart); "hnd" is
    vLLM's HND cache layout: the same logical shape, each block's heads outermost in memory; "flashinfer" is vLLM's
    FlashInfer shape (num_blocks, 2, block_size, heads, head_size) @ 9aaf83ef502f (v1/attention/backends/flashinfer.py
    get_kv_cache_shape): a block holds its K and then its V (Engine indexes it through a transposed view)."""
    if layout == "flashinfer":
        return torch.zeros((num_blocks, 2, block_size, heads, head_dim), dtype=torch.float16)
    if layout == "block-first":
        return torch.zeros((num_blocks, 2, block_size, heads, head_dim), dtype=torch.float16).transpose(0, 1)
    if layout == "hnd":
        return torch.zeros((2, num_blocks, heads, block_size, head_dim), dtype=torch.float16).transpose(2, 3)
    assert layout == "kv-first", layout
    return torch.zeros((2, num_blocks, block_size, heads, head_dim), dtype=torch.float16)


def mla_cache(num_blocks, head_dim=HEAD_DIM, block_size=BLOCK_SIZE):
    """One layer's MLA cache as vLLM's MLA backends shape it (num_blocks, block_size, head_size): no K/V parts, no
    heads; the same bytes on every TP rank."""
    return torch.zeros((num_blocks, block_size, head_dim), dtype=torch.float16)


def cdiv(a, b):
    return -(-a // b)


class GatedCopier(CpuCopier):
    """Copies as CpuCopier, but a copy job of a held request waits (queued, as behind a busy copy stream) until
    the test releases it; the agent thread runs released jobs in pump(). A job in fail raises (a device error on
    this rank) instead of copying. Thread-safe."""

    def __init__(self, hold=None, fail=None):
        self._lock = threading.Lock()
        self.handles = []
        self.hold = set(hold or ())  # (req_id, kind) or (req_id, None): held
        self.fail = set(fail or ())  # (req_id, kind): raises

    def _held(self, h):
        return (h.req_id, h.kind) in self.hold or (h.req_id, None) in self.hold

    def submit(self, job):
        if (job.req_id, job.kind) in self.fail:
            def failing():
                raise RuntimeError(f"injected copy failure ({job.req_id}, {job.kind})")
            failing.req_id, failing.kind = job.req_id, job.kind
            job = failing
        h = CopyHandle(job)
        h.req_id, h.kind = job.req_id, job.kind
        with self._lock:
            self.handles.append(h)
            held = self._held(h)
        if not held:
            h.run()
        return h

    def pump(self):
        with self._lock:
            run = [h for h in self.handles if h.state == "queued" and not self._held(h)]
        for h in run:
            h.run()

    def release(self, req_id, kind=None):
        """Lets req_id's jobs (of kind, or all) run at the agent's next pump."""
        with self._lock:
            self.hold = {(r, k) for r, k in self.hold if not (r == req_id and (kind is None or k in (kind, None)))}

    def of(self, req_id, kind=None):
        with self._lock:
            return [h for h in self.handles if h.req_id == req_id and (kind is None or h.kind == kind)]

    def queued(self, req_id, kind=None):
        return [h for h in self.of(req_id, kind) if h.state == "queued"]


class Engine:
    """One vLLM instance (scheduler + tp workers) around KvstageConnectors. .log records (step, what, req_id);
    .reports (step, rank, "finished_sending"/"finished_recving", req_id) what each rank's get_finished said.
    .worker, .kv, .agent are rank 0's; .workers, .kvs, .agents every rank's."""

    def __init__(self, socket_path, port, num_blocks, role="kv_both", connector_cls=kv.KvstageConnector,
                 chunk=8, budget=48, extra=None, max_running=64, head_dim=HEAD_DIM, kv_layout="kv-first", tp=1,
                 kv_heads=None, mla=False, block_size=BLOCK_SIZE, vllm=NEW, async_scheduling=False, eagle=False):
        self.head_dim, self.tp, self.mla, self.block_size = head_dim, tp, mla, block_size
        self.flashinfer = kv_layout == "flashinfer"
        # the model's KV heads (HEADS per rank unless given), each rank holding its tp-th of them as vLLM shards them
        self.kv_heads = 1 if mla else kv_heads or HEADS * tp
        self.heads = 1 if mla else None
        assert mla or self.kv_heads % tp == 0, (self.kv_heads, tp)
        self.heads = self.heads or self.kv_heads // tp
        self.cfg = vllm_config(socket_path, port, role, tp=tp, extra=extra, mla=mla, block_size=block_size, eagle=eagle)
        self.num_blocks = num_blocks
        kvcc = kv_cache_config(num_blocks, block_size)
        self.vllm, self.async_scheduling = vllm, async_scheduling
        self.sched = connector_cls(self.cfg, kv.KVConnectorRole.SCHEDULER, kvcc)
        # Scheduler.__init__ @ 003df2961dd8: whether a preempted request's in-flight output is dropped, and the
        # prefix-cache hash protocol (older vLLM: neither asked)
        self.requires_kv_delivery = bool(self.sched.requires_kv_delivery) if vllm == NEW else False
        self.use_eagle_prefix_cache_hashing = (is_eagle_prefix_cache_hashing_enabled(self.cfg, self.sched)
                                               if vllm == NEW else False)
        self.workers, self.kvs, self.agents = [], [], []
        for rank in range(tp):  # each worker process: its connector, then its shard of the KV cache registered
            self.workers.append(connector_cls(self.cfg if tp == 1 else rank_config(self.cfg, rank),
                                              kv.KVConnectorRole.WORKER, kvcc))
            sized = {} if block_size == BLOCK_SIZE else {"block_size": block_size}
            self.kvs.append({n: (mla_cache(num_blocks, head_dim, **sized) if mla
                                 else kv_cache(num_blocks, head_dim, kv_layout, self.heads, **sized))
                             for n in LAYER_NAMES})
            self.workers[-1].register_kv_caches(self.kvs[-1])
            self.agents.append(self.workers[-1].connector_worker.agent)
        self.worker, self.kv, self.agent = self.workers[0], self.kvs[0], self.agents[0]
        self._handshake()
        if self.use_eagle_prefix_cache_hashing:
            # the engine-wide protocol, to every connector (the base's set_eagle_prefix_cache_hashing @ 003df2961dd8;
            # its caller is not among the files read: the stand-in tells each connector at start)
            for c in [self.sched] + self.workers:
                c.set_eagle_prefix_cache_hashing(True)
        self.aggregator = KVOutputAggregator(tp) if tp > 1 else None
        self.reports = []
        self.free = list(range(num_blocks - 1, -1, -1))  # pop() takes the end: a freed block is handed out first
        self.chunk, self.budget, self.max_running = chunk, budget, max_running
        self.requests, self.waiting, self.running = {}, [], []
        self.finished_req_ids, self.finished_recving_kv = set(), set()
        self.delayed = set()
        self.done = {}            # req_id -> (status name, params) at request_finished
        self.done_req = {}        # req_id -> the Request
        self.freed = {}           # req_id -> (step, how): "at-finish", "finished_sending", "finished_recving"
        self.loaded = {}          # req_id -> None (exact) or what differs, checked when the load is reported
        self.double = []          # reports for requests whose blocks were already freed (a connector bug)
        self.on_free = None       # hook(request, how) -> True: keep the blocks out of the pool (quarantine)
        self.step_no = 0
        self.log = []
        self._content = {}
        self.inflight = None          # async scheduling: (scheduler output, its output) whose update is still to come
        self.preempt_next = []        # requests the next schedule preempts first (preempt())
        self.preempted_req_ids = set()

    def _handshake(self):
        """EngineCore @ 003df2961dd8, once the workers registered their KV caches: each worker's
        get_kv_connector_handshake_metadata ({(pp_rank, tp_rank): metadata}, or None for a connector without any),
        merged and handed to the scheduler's connector by set_xfer_handshake_metadata_pp_aware; @ 9aaf83ef502f keyed by
        tp_rank and handed over by set_xfer_handshake_metadata."""
        per_worker = []
        for rank, w in enumerate(self.workers):
            md = w.get_handshake_metadata()
            per_worker.append(None if md is None else {((0, rank) if self.vllm == NEW else rank): md})
        if per_worker:  # a list of the workers' answers, each None here: vLLM still calls it (with nothing)
            content = {}
            for d in per_worker:
                content.update(d or {})
            self.handshake = content
            if self.vllm == NEW:
                self.sched.set_xfer_handshake_metadata_pp_aware(content)
            else:
                self.sched.set_xfer_handshake_metadata(content)

    # -- the model -------------------------------------------------------------------------------
    def content(self, r, rank=0):
        """(layers, 2, positions, heads, head_dim) int16: what the model writes for r at each position on TP rank
        `rank`: its heads of the model's (other bytes on every rank; an engine of another TP size with as many KV heads
        has the same bytes at each head)."""
        c = self._content.get(r.seed)
        if c is None:
            g = torch.Generator().manual_seed(r.seed)
            c = self._content[r.seed] = torch.randint(
                -32768, 32767, (LAYERS, 1 if self.mla else 2, MAX_POS, self.kv_heads, self.head_dim),
                dtype=torch.int16, generator=g)
        assert r.num_tokens <= MAX_POS, r.num_tokens
        if self.mla:  # one latent "head", every rank's the same
            return c
        return c[:, :, :, rank * self.heads:(rank + 1) * self.heads]

    def _i16(self, t):
        """A layer's cache as int16 (K/V, block, position, head, dim); an MLA cache as one part of one head."""
        t = t.view(torch.int16)
        if self.flashinfer:
            return t.transpose(0, 1)
        return t.unsqueeze(0).unsqueeze(3) if self.mla else t

    def _where(self, blocks, c0, n):
        pos = torch.arange(c0, c0 + n)
        return torch.tensor(blocks, dtype=torch.long)[pos // self.block_size], pos % self.block_size

    def write(self, r, li, c0, n, blocks=None, rank=0):
        b, o = self._where(blocks if blocks is not None else r.blocks, c0, n)
        self._i16(self.kvs[rank][LAYER_NAMES[li]])[:, b, o] = self.content(r, rank)[li][:, c0:c0 + n]

    def holds(self, r, n=None, blocks=None, rank=None):
        """None if blocks hold r's KV at positions < n (default: its prompt) on `rank` (default: every rank, each its
        own), else what differs - naming the rank whose KV it is when it is another rank's."""
        n = r.num_prompt_tokens if n is None else n
        b, o = self._where(blocks if blocks is not None else r.blocks, 0, n)
        for k in (range(self.tp) if rank is None else [rank]):
            where = f"rank {k}: " if self.tp > 1 else ""
            for li in range(LAYERS):
                got = self._i16(self.kvs[k][LAYER_NAMES[li]])[:, b, o]
                want = self.content(r, k)[li][:, :n]
                if not torch.equal(got, want):
                    other = [j for j in range(self.tp) if j != k and torch.equal(got, self.content(r, j)[li][:, :n])]
                    if other:
                        return f"{where}layer {li}: holds rank {other[0]}'s KV"
                    bad = (got != want).reshape(got.shape[0], n, -1).any(-1).any(0).nonzero().flatten().tolist()
                    return f"{where}layer {li}: positions {bad[:8]}{'...' if len(bad) > 8 else ''} differ"
        return None

    def mark(self, blocks, value):
        idx = torch.tensor(blocks, dtype=torch.long)
        for kv_ in self.kvs:
            for n in LAYER_NAMES:
                self._i16(kv_[n])[:, idx] = value

    def marked(self, blocks, value):
        idx = torch.tensor(blocks, dtype=torch.long)
        return all(bool((self._i16(kv_[n])[:, idx] == value).all()) for kv_ in self.kvs for n in LAYER_NAMES)

    # -- requests --------------------------------------------------------------------------------
    def add(self, r):
        if r.prefix_blocks:  # the decode side's own prefix cache already has the first blocks
            r.blocks = self._alloc(r.prefix_blocks)
            for rank in range(self.tp):
                for li in range(LAYERS):
                    self.write(r, li, 0, r.prefix_blocks * self.block_size, rank=rank)
        self.requests[r.request_id] = r
        self.waiting.append(r)
        self.log.append((self.step_no, "add", r.request_id))

    def abort(self, req_id):
        r = self.requests.get(req_id)
        if r is not None and not r.is_finished():
            self._finish(r, RequestStatus.FINISHED_ABORTED)

    def _alloc(self, n):
        if n > len(self.free):
            return None
        return [self.free.pop() for _ in range(n)]

    def _finish(self, r, status):
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        delay = False
        if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:  # vLLM's own rule (finish_requests)
            delay = r.request_id not in self.finished_recving_kv
            self.finished_recving_kv.discard(r.request_id)
        r.status = status
        d2, params = self.sched.request_finished(r, list(r.blocks))
        self.finished_req_ids.add(r.request_id)
        self.done[r.request_id] = (status.name, params)
        self.done_req[r.request_id] = r
        self.log.append((self.step_no, "finished", r.request_id))
        if delay or d2:
            self.delayed.add(r.request_id)
        else:
            self._free(r, "at-finish")
        return params

    def _free(self, r, how):
        self.delayed.discard(r.request_id)
        del self.requests[r.request_id]
        self.freed[r.request_id] = (self.step_no, how)
        self.log.append((self.step_no, f"freed:{how}", r.request_id))
        keep = self.on_free is not None and self.on_free(r, how)
        if not keep:
            self.free.extend(reversed(r.blocks))

    # -- one step ----------------------------------------------------------------------------------
    def preempt(self, req_id):
        """The next schedule preempts req_id (running) before it schedules anything, as vLLM's does when blocks run out
        and its policy picks that request."""
        self.preempt_next.append(req_id)

    def _preempt(self, r):
        """Scheduler._preempt_request @ 003df2961dd8 (drop_stale_output=self.requires_kv_delivery): its blocks freed at
        once, back to waiting (first) with nothing computed; an output in flight is stale: dropped, or delivered."""
        assert r.status == RequestStatus.RUNNING, r.status
        self.running.remove(r)
        self.free.extend(reversed(r.blocks))
        r.blocks = []
        r.status = RequestStatus.PREEMPTED
        r.num_computed_tokens = 0
        r.drop_stale_output = self.requires_kv_delivery or (r.drop_stale_output and r.num_stale_output_tokens > 0)
        r.num_stale_output_tokens = r.num_in_flight_tokens
        r.num_output_placeholders = 0
        r.num_preemptions += 1
        self.waiting.insert(0, r)
        self.preempted_req_ids.add(r.request_id)
        self.log.append((self.step_no, "preempted", r.request_id))

    def schedule(self):
        so = SchedulerOutput()
        budget = self.budget
        self.scheduled = []
        preempted = []
        for rid in self.preempt_next:
            r = self.requests.get(rid)
            if r is not None and r.status == RequestStatus.RUNNING:
                self._preempt(r)
                preempted.append(r)
        self.preempt_next = []
        for r in list(self.running):
            if (self.async_scheduling and r.num_output_placeholders > 0
                    and r.num_computed_tokens + 2 - r.num_output_placeholders >= r.num_prompt_tokens + r.max_tokens):
                continue  # its last token is in flight already (async scheduling)
            prefill = r.num_computed_tokens < r.num_prompt_tokens
            n = min(self.chunk, r.num_prompt_tokens - r.num_computed_tokens) if prefill else 1
            if n > budget:
                continue
            need = cdiv(r.num_computed_tokens + n, self.block_size) - len(r.blocks)
            new = self._alloc(max(need, 0))
            if new is None:
                continue
            r.blocks += new
            cr = so.scheduled_cached_reqs
            cr.req_ids.append(r.request_id)
            cr.new_block_ids.append((new,) if new else None)
            cr.num_computed_tokens.append(r.num_computed_tokens)
            so.num_scheduled_tokens[r.request_id] = n
            self.scheduled.append((r, n, r.num_computed_tokens))
            budget -= n
        for r in ([] if preempted else list(self.waiting)):  # vLLM admits none in a step that preempted
            if r.num_stale_output_tokens > 0 and not r.drop_stale_output:
                continue  # its stale output, to be delivered, is still in flight
            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if r.request_id not in self.finished_recving_kv:
                    continue
                self.finished_recving_kv.discard(r.request_id)
                self.loaded[r.request_id] = self.holds(r)
                r.load_done = True
                n = min(len(r.blocks) * self.block_size, r.num_tokens)  # _update_waiting_for_remote_kv
                r.num_computed_tokens = n - 1 if n == r.num_tokens else n
                r.status = RequestStatus.WAITING
            if len(self.running) >= self.max_running or budget <= 0:
                break
            local = r.num_computed_tokens if r.load_done else r.prefix_blocks * self.block_size
            ext, load_async = self.sched.get_num_new_matched_tokens(r, local)
            if load_async:
                need = cdiv(local + ext, self.block_size) - len(r.blocks)
                new = self._alloc(need)
                if new is None:
                    continue
                r.blocks += new
                self.sched.update_state_after_alloc(r, KVCacheBlocks(r.blocks, new), ext)
                r.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                r.num_computed_tokens = local
                continue
            n = min(self.chunk, r.num_tokens - local, budget)
            need = cdiv(local + n, self.block_size) - len(r.blocks)
            new = self._alloc(max(need, 0))
            if new is None:
                continue
            r.blocks += new
            self.sched.update_state_after_alloc(r, KVCacheBlocks(r.blocks, new), 0)
            r.num_computed_tokens = local
            resumed = r.status == RequestStatus.PREEMPTED
            r.status = RequestStatus.RUNNING
            self.waiting.remove(r)
            self.running.append(r)
            if resumed:  # the v1 model runner's path: a cached request, resumed, with all its blocks
                cr = so.scheduled_cached_reqs
                cr.req_ids.append(r.request_id)
                cr.resumed_req_ids.add(r.request_id)
                cr.new_block_ids.append((list(r.blocks),))
                cr.num_computed_tokens.append(local)
            else:
                so.scheduled_new_reqs.append(NewRequestData(r.request_id, r.prompt_token_ids, (list(r.blocks),),
                                                            local))
            so.num_scheduled_tokens[r.request_id] = n
            self.scheduled.append((r, n, local))
            budget -= n
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        so.finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
        so.preempted_req_ids, self.preempted_req_ids = self.preempted_req_ids, set()
        so.kv_connector_metadata = self.sched.build_connector_meta(so)
        so.scheduled = list(self.scheduled)  # (request, tokens, first position): what execute and update take
        if self.async_scheduling:  # _update_after_schedule: computed at once; an output to come for a sampling step
            for r, n, _ in so.scheduled:
                r.num_computed_tokens += n
                r.num_in_flight_tokens += n
                if r.num_computed_tokens >= r.num_tokens + r.num_output_placeholders:
                    r.num_output_placeholders += 1
        return so

    def execute(self, so):
        outs = []
        for rank, w in enumerate(self.workers):  # each rank's forward (one after the other here, in parallel in vLLM)
            meta = so.kv_connector_metadata
            if self.tp > 1:  # MultiprocExecutor sends each worker process its own serialised copy
                meta = pickle.loads(pickle.dumps(meta))
            w.handle_preemptions(meta)  # gpu_model_runner / gpu/kv_connector.py pre_forward: before binding it
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            if so.scheduled:
                for li, name in enumerate(LAYER_NAMES):
                    w.wait_for_layer_load(name)
                    for r, n, c0 in so.scheduled:  # this layer's attention writes the new tokens' KV
                        self.write(r, li, c0, n, rank=rank)
                    w.save_kv_layer(name, self.kvs[rank][name], None)
            w.wait_for_save()
            fs, fr = w.get_finished(so.finished_req_ids)
            errs = w.get_block_ids_with_load_errors()
            w.clear_connector_metadata()
            outs.append(KVConnectorOutput(set(fs or ()), set(fr or ()), set(errs or ())))
            for how, ids in (("finished_sending", fs), ("finished_recving", fr)):
                self.reports.extend((self.step_no, rank, how, rid) for rid in sorted(ids or ()))
        return outs[0] if self.aggregator is None else self.aggregator.aggregate(outs)

    def update(self, so, out):
        failed = []
        if out.invalid_block_ids:  # _handle_invalid_blocks: the async loads these blocks belong to failed
            failed = [r for r in self.waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                      and set(r.blocks) & out.invalid_block_ids]
        for r, n, c0 in so.scheduled:
            if not self.async_scheduling:
                r.num_computed_tokens += n
                if r.num_computed_tokens >= r.num_tokens:
                    r.output.append(len(r.output))
                    if len(r.output) >= r.max_tokens:
                        self._finish(r, RequestStatus.FINISHED_LENGTH_CAPPED)
                continue
            # update_from_output @ 003df2961dd8 under async scheduling: the step's share of a stale output drains
            r.num_in_flight_tokens -= n
            stale = r.num_stale_output_tokens > 0
            if stale:
                r.num_stale_output_tokens -= n
            if self.requests.get(r.request_id) is not r or r.is_finished():
                continue  # finished (aborted) while the step ran
            if stale and r.drop_stale_output:
                self.log.append((self.step_no, "stale output dropped", r.request_id))
                continue  # its positions are computed again: the request is recomputed
            if c0 + n < r.num_prompt_tokens:
                continue  # a prefill chunk: no token sampled
            if not stale:
                r.num_output_placeholders = max(0, r.num_output_placeholders - 1)
            else:
                self.log.append((self.step_no, "stale output delivered", r.request_id))
            r.output.append(len(r.output))
            if len(r.output) >= r.max_tokens:  # a preempted (waiting) request too: vLLM stops it there
                self._finish(r, RequestStatus.FINISHED_LENGTH_CAPPED)
        for r in failed:  # kv_load_failure_policy "fail": finish_requests(FINISHED_ERROR), freed once reported
            self.loaded[r.request_id] = "load failed"
            self._finish(r, RequestStatus.FINISHED_ERROR)
        self.sched.update_connector_output(out)
        for rid in sorted(out.finished_recving):
            r = self.requests.get(rid)
            self.log.append((self.step_no, "finished_recving", rid))
            if r is None:
                self.double.append(("finished_recving", rid))
            elif r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv.add(rid)
            else:
                self._free(r, "finished_recving")
        for rid in sorted(out.finished_sending):
            r = self.requests.get(rid)
            self.log.append((self.step_no, "finished_sending", rid))
            if r is None:
                self.double.append(("finished_sending", rid))
            else:
                self._free(r, "finished_sending")
        return out

    def step(self):
        if not self.async_scheduling:
            so = self.schedule()
            out = self.update(so, self.execute(so))
            self.step_no += 1
            return so, out
        # EngineCore.step_with_batch_queue with two batches: this step is scheduled and runs before the one before
        # it is updated from (so the next schedule sees neither its tokens nor its output yet)
        so = self.schedule()
        out = self.execute(so)
        prev, self.inflight = self.inflight, (so, out)
        if prev is not None:
            self.update(*prev)
        self.step_no += 1
        return so, out

    def idle(self):
        """True if nothing was scheduled last step (a caller polling for progress paces itself then)."""
        return not self.scheduled

    def step_until(self, pred, timeout=10, what="condition"):
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not reached within {timeout}s")
            self.step()
            if self.idle():
                time.sleep(0.001)  # pacing an idle poll loop, not an ordering device

    def close(self):
        for w in self.workers:
            w.shutdown()
        self.sched.shutdown()


def wait_for(pred, timeout=10, what="condition"):
    """Waits for a condition another thread makes true (the agent's); returns it."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(0.001)  # a condition wait on the agent thread's progress, not an ordering device
    return True


class PD:
    """A prefill and a decode engine in this process on one proxy (each its own connection), or each on its own
    proxy (d_socket: the decode engine's; the proxies then move the bytes over tcp), and the router: route() hands
    every prefill response with params to the decode engine, as vLLM's disaggregated proxy does."""

    def __init__(self, socket_path, p_kw=None, d_kw=None, p_cls=kv.KvstageConnector, d_cls=kv.KvstageConnector,
                 d_socket=None):
        self.P = self.D = None
        self.P = Engine(socket_path, free_port((p_kw or {}).get("tp", 1)), connector_cls=p_cls, role="kv_producer",
                        **dict(dict(num_blocks=128), **(p_kw or {})))
        self.D = Engine(d_socket or socket_path, free_port((d_kw or {}).get("tp", 1)), connector_cls=d_cls,
                        role="kv_consumer", **dict(dict(num_blocks=128), **(d_kw or {})))
        self.routed = set()

    def add(self, k, n, seed=None, extra=None, max_tokens=1):
        r = Request(f"p{k}", n, prefill_params(extra), seed if seed is not None else 1000 + k, max_tokens=max_tokens)
        self.P.add(r)
        return r

    def route(self, prefix=None, d_extra=None):
        """Forwards every finished prefill request with params not forwarded yet (d_extra: more params, or k -> more
        params); returns the decode requests."""
        out = []
        for rid, (status, params) in list(self.P.done.items()):
            if rid in self.routed or params is None:
                continue
            self.routed.add(rid)
            k = int(rid[1:])
            src = self.P.done_req[rid]
            params = dict(params, **((d_extra(k) if callable(d_extra) else d_extra) or {}))
            r = Request(f"d{k}", src.num_prompt_tokens, params, src.seed, max_tokens=2,
                        prefix_blocks=(prefix or {}).get(k, 0))
            self.D.add(r)
            out.append(r)
        return out

    def run(self, until, timeout=20, what="condition", on_route=None, **route_kw):
        """Steps P, routes, steps D until until(); on_route(new decode requests) runs before D's step."""
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not reached within {timeout}s: P {sorted(self.P.requests)}, "
                                     f"D {sorted(self.D.requests)}")
            self.P.step()
            new = self.route(**route_kw)
            if on_route is not None:
                on_route(new)
            self.D.step()
            if self.P.idle() and self.D.idle():
                time.sleep(0.001)  # pacing an idle poll loop

    def close(self):
        for e in (self.P, self.D):
            if e is not None:
                e.close()


def free_port(n=1):
    """A port p such that p ... p + n - 1 are free now (a TP prefill engine listens on one per rank)."""
    import socket
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + n > 65536:
            continue
        socks = []
        try:
            for q in range(p, p + n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def prefill_params(extra=None):
    """What vLLM's disaggregated proxy sends the prefill instance (toy_proxy_server's shape)."""
    p = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
         "remote_host": None, "remote_port": None}
    p.update(extra or {})
    return p


# ------------------------------------------------------------------------------------------------
# Separate processes: a prefill engine, a decode engine, the test as the router between them.
# ------------------------------------------------------------------------------------------------
MARK = 0x5A5A  # int16 pattern an aborted decode request's blocks get once given back


def _prefill(conn, socket_path, port, plans, flags, acks, extra=None):
    eng = Engine(socket_path, port, num_blocks=192, role="kv_producer", extra=extra)
    agent = eng.agent
    pid = {}  # request id -> k
    gate = GatedCopier(hold={(f"p{k}", "stage") for k, plan in plans.items() if plan == "p-abort-staging"})
    agent.copier = gate

    def hold_send(req, chunk):
        k = pid.get(req)
        plan = plans.get(k)
        if plan in ("d-mid", "d-timeout") and chunk >= 1:
            flags[k] = 1  # the first chunk is in the room
            return not acks[k]
        return False
    agent.hold_send = hold_send
    conn.send(("ready", None))
    told, expired_told, stopping, staged_at_free = set(), set(), False, {}
    while True:
        while conn.poll(0):
            msg = conn.recv()
            if msg[0] == "add":
                _, k, n, seed, extra = msg
                r = Request(f"p{k}", n, prefill_params(extra), seed,
                            max_tokens=64 if plans[k] == "p-abort-staging" else 1)
                pid[r.request_id] = k
                eng.add(r)
            elif msg[0] == "stop":
                stopping = True
        for rid, r in list(eng.requests.items()):
            k = pid[rid]
            if (plans[k] == "p-abort-prefill" and 0 < r.num_computed_tokens < r.num_prompt_tokens
                    and not r.is_finished()):
                eng.abort(rid)
            elif (plans[k] == "p-abort-staging" and r.status == RequestStatus.RUNNING and r.output
                  and gate.queued(rid, "stage")):
                eng.abort(rid)  # its copies into slots wait behind the gate
        eng.step()
        for rid in eng.freed:
            if rid not in staged_at_free:
                staged_at_free[rid] = (eng.freed[rid][1], agent.stage_state(rid))
        for rid, (status, params) in eng.done.items():
            if rid not in told:
                told.add(rid)
                conn.send(("finished", pid[rid], status, params))
        for rid, k in pid.items():
            if plans[k] in ("never-decoded", "late-pull") and k not in expired_told:
                state, why = agent.stage_state(rid)
                if why and "expired" in str(why):
                    expired_told.add(k)
                    conn.send(("expired", k, why))
        if stopping and not eng.requests:
            break
        if eng.idle():
            time.sleep(0.001)  # pacing an idle poll loop
    summary = dict(double=eng.double, freed=dict(eng.freed), staged_at_free=staged_at_free,
                   ended={rid: agent.ended.get(rid) for rid in pid},
                   gate=[(h.req_id, h.kind, h.state) for h in gate.handles if (h.req_id, h.kind) in
                         {(f"p{k}", "stage") for k, p in plans.items() if p == "p-abort-staging"}],
                   free_blocks=len(eng.free), num_blocks=eng.num_blocks)
    eng.close()
    conn.send(("summary", summary))


def _decode(conn, socket_path, port, plans, flags, acks, extra=None):
    eng = Engine(socket_path, port, num_blocks=256, role="kv_consumer", extra=extra)
    agent = eng.agent
    did, quarantine, results = {}, [], {}

    def on_free(r, how):
        k = did[r.request_id]
        status, _ = eng.done[r.request_id]
        wrong = eng.loaded.get(r.request_id, "never loaded")
        if status == "FINISHED_ABORTED":
            eng.mark(r.blocks, MARK)  # the blocks are the engine's again; it writes them; nothing else may
            quarantine.append((k, list(r.blocks)))
            outcome = "ok+aborted" if r.load_done else "aborted"
        elif status == "FINISHED_ERROR":
            outcome = "load-failed"
        else:
            outcome = "ok"
        results[k] = dict(outcome=outcome, wrong=wrong if r.load_done else None, how=how,
                          why=agent.ended.get(r.request_id))
        conn.send(("result", k, results[k]))
        return status == "FINISHED_ABORTED"
    eng.on_free = on_free
    conn.send(("ready", None))
    stopping = False
    while True:
        while conn.poll(0):
            msg = conn.recv()
            if msg[0] == "add":
                _, k, n, seed, params = msg
                plan = plans[k]
                r = Request(f"d{k}", n, dict(params), seed, max_tokens=2,
                            prefix_blocks=(n // BLOCK_SIZE) // 2 if plan == "prefix" else 0)
                if plan == "d-timeout":
                    r.kv_transfer_params["kvstage_load_timeout"] = 1.0
                did[r.request_id] = k
                eng.add(r)
                if plan == "d-abort-waiting":
                    eng.abort(r.request_id)
            elif msg[0] == "stop":
                stopping = True
        for rid, r in list(eng.requests.items()):
            k = did[rid]
            if r.is_finished():
                continue
            if plans[k] == "d-mid" and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and flags[k] and not acks[k]:
                eng.abort(rid)  # the first chunk is in the room, the rest held back by the prefill side
                acks[k] = 1
            elif plans[k] == "d-after" and r.load_done and r.output:
                eng.abort(rid)
        eng.step()
        for rid, k in did.items():
            if plans[k] == "d-timeout" and not acks[k] and rid in eng.loaded:
                acks[k] = 1  # the load gave up: let the prefill side's held chunks go
        if stopping and not eng.requests:
            break
        if eng.idle():
            time.sleep(0.001)  # pacing an idle poll loop
    bad = [k for k, blocks in quarantine if not eng.marked(blocks, MARK)]
    summary = dict(double=eng.double, bad_markers=bad, n_marked=len(quarantine), results=results,
                   free_blocks=len(eng.free) + sum(len(b) for _, b in quarantine), num_blocks=eng.num_blocks)
    eng.close()
    conn.send(("summary", summary))


def _serve(fn, conn, *args):
    import logging
    logging.basicConfig(level=logging.INFO, format=f"%(relativeCreated)6d {fn.__name__[1:]} %(threadName)s %(message)s")
    try:
        fn(conn, *args)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def prefill_main(conn, socket_path, port, plans, flags, acks, extra=None):
    _serve(_prefill, conn, socket_path, port, plans, flags, acks, extra)


def decode_main(conn, socket_path, port, plans, flags, acks, extra=None):
    _serve(_decode, conn, socket_path, port, plans, flags, acks, extra)
