"""kvstage.vllm piece by piece: the interface against vLLM's (names, signatures, loading through
kv_connector_module_path under a stand-in vllm package, new and old base signatures), the room layout, the
scheduler side's decisions and kv_transfer_params, and transfers between two engines in one process (every
prompt shape, decode prefix hits, pool pressure, a request larger than the pool, refused parameters and
layouts, a proxy killed mid-transfer)."""
import inspect
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvstage import vllm as kv
from kvstage.sglang import _host
from conftest import Proxy
from sglang_common import NEED_TORCH, assert_pool_free, kv_proxy  # noqa: F401 (fixture)

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

# KVConnectorBase_V1's methods as vllm/distributed/kv_transfer/kv_connector/v1/base.py @ 003df2961dd8 has them
VLLM_SIGNATURES = {
    "__init__": ["self", "vllm_config", "role", "kv_cache_config"],
    "register_kv_caches": ["self", "kv_caches"],
    "start_load_kv": ["self", "forward_context", "kwargs"],
    "wait_for_layer_load": ["self", "layer_name"],
    "save_kv_layer": ["self", "layer_name", "kv_layer", "attn_metadata", "kwargs"],
    "wait_for_save": ["self"],
    "get_finished": ["self", "finished_req_ids"],
    "get_block_ids_with_load_errors": ["self"],
    "shutdown": ["self"],
    "get_num_new_matched_tokens": ["self", "request", "num_computed_tokens"],
    "update_state_after_alloc": ["self", "request", "blocks", "num_external_tokens"],
    "build_connector_meta": ["self", "scheduler_output"],
    "update_connector_output": ["self", "connector_output"],
    "request_finished": ["self", "request", "block_ids"],
    "request_finished_all_groups": ["self", "request", "block_ids"],  # SupportsHMA
    "has_pending_push_work": ["self"],
    "get_required_kvcache_layout": ["vllm_config"],  # a classmethod
}


def test_interface_matches_vllm():
    C = kv.KvstageConnector
    assert issubclass(C, kv.KVConnectorBase_V1) and issubclass(C, kv.SupportsHMA)
    assert not getattr(C, "__abstractmethods__", None)
    for name, params in VLLM_SIGNATURES.items():
        assert list(inspect.signature(getattr(C, name)).parameters) == params, name
    assert issubclass(kv.KvstageConnectorMetadata, kv.KVConnectorMetadata)
    assert [r.name for r in kv.KVConnectorRole] == ["SCHEDULER", "WORKER"]
    # factory.py: importlib.import_module(kv_connector_module_path), getattr(module, kv_connector)
    import importlib
    assert getattr(importlib.import_module("kvstage.vllm"), "KvstageConnector") is C


STAND_IN_BASE = '''
import enum
from abc import ABC, abstractmethod
class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1
class KVConnectorMetadata(ABC):
    pass
class KVConnectorBase_V1(ABC):
    def __init__(self, vllm_config, role{kw}):
        self._connector_metadata = None
        self._vllm_config = vllm_config
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._role = role
        self.stand_in = True
    @property
    def role(self):
        return self._role
    def bind_connector_metadata(self, m):
        self._connector_metadata = m
    def clear_connector_metadata(self):
        self._connector_metadata = None
    @abstractmethod
    def start_load_kv(self, forward_context, **kwargs): ...
    @abstractmethod
    def wait_for_layer_load(self, layer_name): ...
    @abstractmethod
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs): ...
    @abstractmethod
    def wait_for_save(self): ...
    @abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens): ...
    @abstractmethod
    def update_state_after_alloc(self, request, blocks, num_external_tokens): ...
    @abstractmethod
    def build_connector_meta(self, scheduler_output): ...
{hma}
'''
HMA = '''
class SupportsHMA(ABC):
    @abstractmethod
    def request_finished_all_groups(self, request, block_ids): ...
'''
# factory.py's loading of an unregistered connector, and its HMA check (a4cd9d0d28bd)
LOADER = '''
import importlib, inspect, sys, types
sys.path.insert(0, {tests!r})
import vllm_engine as E
from vllm.distributed.kv_transfer.kv_connector.v1 import base
kt = E.vllm_config("/nonexistent", 0).kv_transfer_config
module = importlib.import_module(kt.kv_connector_module_path)
cls = getattr(module, kt.kv_connector)
assert module.HAVE_VLLM and issubclass(cls, base.KVConnectorBase_V1), cls.__mro__
compat = "kv_cache_config" not in inspect.signature(cls).parameters
assert not compat
if hasattr(base, "SupportsHMA"):
    assert issubclass(cls, base.SupportsHMA)
c = cls(E.vllm_config("/nonexistent", 0), base.KVConnectorRole.SCHEDULER, E.kv_cache_config(16))
assert c.stand_in and c.role is base.KVConnectorRole.SCHEDULER
print("loaded", cls.__name__, [b.__module__ for b in cls.__mro__[1:3]])
'''


@NEED_TORCH
@pytest.mark.parametrize("variant", ["current", "old-base"])
def test_loads_under_a_stand_in_vllm(tmp_path, variant):
    """kvstage.vllm takes vLLM's own base classes when vllm imports (here a stand-in package), for the current
    base (__init__ takes kv_cache_config, SupportsHMA exists) and an older one (neither)."""
    pkg = tmp_path / "vllm" / "distributed" / "kv_transfer" / "kv_connector" / "v1"
    pkg.mkdir(parents=True)
    d = tmp_path
    for part in pkg.relative_to(tmp_path).parts:
        d = d / part
        (d / "__init__.py").write_text("")
    kw = ", kv_cache_config" if variant == "current" else ""
    (pkg / "base.py").write_text(STAND_IN_BASE.format(kw=kw, hma=HMA if variant == "current" else ""))
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}:{here.parent}")
    out = subprocess.run([sys.executable, "-c", LOADER.format(tests=str(here))], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "loaded KvstageConnector ['vllm.distributed.kv_transfer.kv_connector.v1.base'" in out.stdout, out.stdout


# ----------------------------------------------------------------------------------------------------------- layout
@NEED_TORCH
def test_layout_regions_and_extents():
    nb, bs, h, d = 10, 4, 2, 8
    caches = {f"l{i}": torch.zeros((2, nb, bs, h, d), dtype=torch.float16) for i in range(2)}
    lay = kv.VllmLayout(caches, nb)
    item = bs * h * d * 2
    assert [(r.layer, r.item, r.stride, r.nblocks) for r in lay.regions] == [(0, item, item, nb)] * 2 + [(1, item, item, nb)] * 2
    assert lay.regions[1].ptr == caches["l0"].data_ptr() + nb * item  # V after K
    assert lay.nbytes(3) == 4 * 3 * item
    # blocks 5,6 (one run) then 2, for a 3-block room; layer 1 only: its K region starts after layer 0's 2 regions
    ext = lay.extents(3, [5, 6, 2], 0, layer=1)
    base = caches["l1"].data_ptr()
    assert ext == [(2 * 3 * item, base + 5 * item, 2 * item, False), (2 * 3 * item + 2 * item, base + 2 * item, item, False),
                   (3 * 3 * item, base + nb * item + 5 * item, 2 * item, False),
                   (3 * 3 * item + 2 * item, base + nb * item + 2 * item, item, False)]
    assert lay.extents(3, [7], 2, layer=0) == [(2 * item, caches["l0"].data_ptr() + 7 * item, item, False),
                                               (3 * item + 2 * item, caches["l0"].data_ptr() + nb * item + 7 * item, item, False)]
    with pytest.raises(ValueError):
        lay.extents(3, [10], 0)           # past the cache
    with pytest.raises(ValueError):
        lay.extents(3, [1, 2], 2)         # more blocks than the room
    # (num_blocks, 2, ...): K and V of a block together, one region per layer
    flat = kv.VllmLayout({"l": torch.zeros((nb, 2, bs, h, d), dtype=torch.float16)}, nb)
    assert [(r.item, r.stride) for r in flat.regions] == [(2 * item, 2 * item)]
    # HND (a permuted view): each block still one span, but not the same bytes as NHD: the fingerprints differ
    hnd = {f"l{i}": torch.zeros((2, nb, h, bs, d), dtype=torch.float16).permute(0, 1, 3, 2, 4) for i in range(2)}
    lh = kv.VllmLayout(hnd, nb)
    assert lh.nbytes(3) == lay.nbytes(3) and lh.fingerprint() != lay.fingerprint()
    assert lay.fingerprint() == kv.VllmLayout({k: v.clone() for k, v in caches.items()}, nb).fingerprint()
    with pytest.raises(ValueError, match="not one span"):
        kv.VllmLayout({"l": torch.zeros((2, nb, bs, h, 2 * d), dtype=torch.float16)[..., :d]}, nb)
    with pytest.raises(ValueError, match="no dimension"):
        kv.VllmLayout({"l": torch.zeros((3, nb + 1, bs, h, d), dtype=torch.float16)}, nb)


# ----------------------------------------------------------------------------------------------- scheduler side
def _sched(role="kv_both", **extra):
    import vllm_engine as E
    return kv.KvstageConnector(E.vllm_config("/nonexistent", 7600, role, extra=extra), kv.KVConnectorRole.SCHEDULER,
                               E.kv_cache_config(64))


def _step(c, new=(), cached=(), finished=()):
    """build_connector_meta for new [(req, blocks, computed, n)] and cached [(req, new_blocks, computed, n)]."""
    import vllm_engine as E
    so = E.SchedulerOutput(finished_req_ids=set(finished))
    for r, blocks, computed, n in new:
        so.scheduled_new_reqs.append(E.NewRequestData(r.request_id, r.prompt_token_ids, (list(blocks),), computed))
        so.num_scheduled_tokens[r.request_id] = n
    for r, blocks, computed, n in cached:
        cr = so.scheduled_cached_reqs
        cr.req_ids.append(r.request_id)
        cr.new_block_ids.append((list(blocks),) if blocks else None)
        cr.num_computed_tokens.append(computed)
        so.num_scheduled_tokens[r.request_id] = n
    return c.build_connector_meta(so)


@NEED_TORCH
def test_scheduler_side_prefill():
    import vllm_engine as E
    c = _sched(kvstage_stage_timeout=30)
    r = E.Request("p1", 10, E.prefill_params(), 1)
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)
    c.update_state_after_alloc(r, E.KVCacheBlocks([3, 9], [3, 9]), 0)
    m = _step(c, new=[(r, [3, 9], 0, 8)])
    assert m.reqs_to_save == {} and isinstance(m, kv.KVConnectorMetadata)
    m = _step(c, cached=[(r, [4], 8, 2)])  # the prompt completes in this forward: stage all three blocks
    assert m.reqs_to_save == {"p1": kv.SaveSpec("p1", (3, 9, 4), 10, 30.0)}
    assert _step(c, cached=[(r, [], 10, 1)]).reqs_to_save == {}  # once
    r.status = E.RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = c.request_finished(r, [3, 9, 4])
    assert delay is True and c.has_pending_push_work()
    assert params == dict(do_remote_prefill=True, do_remote_decode=False, remote_engine_id=c._settings.engine_id,
                          remote_request_id="p1", remote_host="127.0.0.1", remote_port=7600, tp_size=1,
                          kvstage=dict(version=1, num_blocks=3, num_tokens=10, block_size=4))
    assert _step(c, finished=["p1"]).reqs_finished == {"p1": (True, True)}
    c.update_connector_output(E.KVConnectorOutput({"p1"}, set(), set()))
    assert not c.has_pending_push_work()
    # aborted after its copy began: delayed, without params; aborted before: freed at once
    a = E.Request("p2", 3, E.prefill_params(), 2)
    c.update_state_after_alloc(a, E.KVCacheBlocks([5], [5]), 0)
    assert _step(c, new=[(a, [5], 0, 3)]).reqs_to_save["p2"].block_ids == (5,)
    a.status = E.RequestStatus.FINISHED_ABORTED
    assert c.request_finished(a, [5]) == (True, None)
    assert _step(c).reqs_finished == {"p2": (False, True)}
    b = E.Request("p3", 30, E.prefill_params(), 3)
    c.update_state_after_alloc(b, E.KVCacheBlocks([6, 7], [6, 7]), 0)
    _step(c, new=[(b, [6, 7], 0, 8)])
    b.status = E.RequestStatus.FINISHED_ABORTED
    assert c.request_finished(b, [6, 7]) == (False, None)
    # preempted after its stage was scheduled: the stage is void, staged again when recomputed
    p = E.Request("p4", 5, E.prefill_params(), 4, max_tokens=8)
    c.update_state_after_alloc(p, E.KVCacheBlocks([8, 11], [8, 11]), 0)
    assert "p4" in _step(c, new=[(p, [8, 11], 0, 5)]).reqs_to_save
    so = E.SchedulerOutput(preempted_req_ids={"p4"})
    m = c.build_connector_meta(so)
    assert m.reqs_to_unstage == {"p4"}
    so = E.SchedulerOutput()
    so.scheduled_cached_reqs.req_ids.append("p4")
    so.scheduled_cached_reqs.resumed_req_ids.add("p4")
    so.scheduled_cached_reqs.new_block_ids.append(([12, 13],))
    so.scheduled_cached_reqs.num_computed_tokens.append(0)
    so.num_scheduled_tokens["p4"] = 6
    assert c.build_connector_meta(so).reqs_to_save["p4"].block_ids == (12, 13)
    # requests without our params are not ours
    n = E.Request("x", 5, None, 5)
    assert c.get_num_new_matched_tokens(n, 0) == (0, False) and c.request_finished(n, [1]) == (False, None)
    # one KV cache group only
    assert c.request_finished_all_groups(n, ([1],)) == (False, None)
    with pytest.raises(NotImplementedError):
        c.request_finished_all_groups(n, ([1], [2]))
    cfg = E.kv_cache_config(8)
    cfg.kv_cache_groups.append(cfg.kv_cache_groups[0])
    with pytest.raises(NotImplementedError, match="hybrid"):
        kv.KvstageConnector(E.vllm_config("/x", 1), kv.KVConnectorRole.SCHEDULER, cfg)


def _decode_params(**kw):
    p = dict(do_remote_prefill=True, do_remote_decode=False, remote_engine_id="e", remote_request_id="p1",
             remote_host="10.0.0.1", remote_port=7600, tp_size=1,
             kvstage=dict(version=1, num_blocks=3, num_tokens=10, block_size=4))
    p.update(kw)
    return p


@NEED_TORCH
def test_scheduler_side_decode():
    import vllm_engine as E
    c = _sched(kvstage_load_timeout=9)
    r = E.Request("d1", 10, _decode_params(), 1)
    assert c.get_num_new_matched_tokens(r, 4) == (6, True)  # one block cached here: load the rest
    assert c.get_num_new_matched_tokens(r, 4) == (6, True)  # side-effect free
    c.update_state_after_alloc(r, E.KVCacheBlocks([7, 8, 1], [8, 1]), 6)
    assert r.kv_transfer_params["do_remote_prefill"] is False
    m = _step(c)
    assert m.reqs_to_recv == {"d1": kv.RecvSpec("d1", "p1", "10.0.0.1", 7600, 3, (8, 1), 1, 9.0, None)}
    c.update_state_after_alloc(r, E.KVCacheBlocks([7, 8, 1], []), 0)  # the second call, after the load
    assert _step(c).reqs_to_recv == {}
    # aborted while loading: delayed; the worker is told
    r.status = E.RequestStatus.FINISHED_ABORTED
    assert c.request_finished(r, [7, 8, 1]) == (True, None)
    assert _step(c).reqs_to_abort == {"d1"}
    # loaded, then finished: freed at once
    r2 = E.Request("d2", 10, _decode_params(remote_request_id="p2", kvstage_load_timeout=2), 2)
    c.update_state_after_alloc(r2, E.KVCacheBlocks([2, 3, 4], [2, 3, 4]), 10)
    assert _step(c).reqs_to_recv["d2"].load_timeout == 2.0
    c.update_connector_output(E.KVConnectorOutput(set(), {"d2"}, set()))
    r2.status = E.RequestStatus.FINISHED_LENGTH_CAPPED
    assert c.request_finished(r2, [2, 3, 4]) == (False, None)
    # aborted before it was scheduled: the prefill side is told to release its slots
    r3 = E.Request("d3", 10, _decode_params(remote_request_id="p3"), 3)
    r3.status = E.RequestStatus.FINISHED_ABORTED
    assert c.request_finished(r3, []) == (False, None)
    assert _step(c).reqs_to_drop == [("10.0.0.1", 7600, "p3")]
    # unusable params: no remote load (vLLM computes the prompt here), and the prefill side releases its slots
    for bad in (dict(tp_size=2), dict(kvstage=dict(version=1, num_blocks=3, num_tokens=10, block_size=16)),
                dict(kvstage=dict(version=1, num_blocks=2, num_tokens=8, block_size=4))):
        rb = E.Request("d4", 10, _decode_params(remote_request_id="p4", **bad), 4)
        assert c.get_num_new_matched_tokens(rb, 0) == (0, False)
        c.update_state_after_alloc(rb, E.KVCacheBlocks([5, 6, 9], [5, 6, 9]), 0)
        assert _step(c).reqs_to_drop == [("10.0.0.1", 7600, "p4")]
    nixl = E.Request("d5", 10, dict(do_remote_prefill=True, remote_block_ids=[1], remote_engine_id="e",
                                    remote_host="h", remote_port=1), 5)
    assert c.get_num_new_matched_tokens(nixl, 0) == (0, False)
    c.update_state_after_alloc(nixl, E.KVCacheBlocks([1], [1]), 0)
    assert _step(c).reqs_to_drop == []
    # a producer-only instance takes no loads
    assert _sched("kv_producer").get_num_new_matched_tokens(E.Request("d6", 10, _decode_params(), 6), 0) == (0, False)


# ------------------------------------------------------------------------------------------ transfers in one process
@pytest.fixture
def pd(kv_proxy):
    import vllm_engine as E
    pair = E.PD(kv_proxy.socket)
    yield pair
    pair.close()
    assert_pool_free(kv_proxy.socket)


@NEED_TORCH
def test_transfers_of_every_shape(pd):
    """Prompts of 1 token to 13 blocks, block multiples and not, one forward or many; half of them with part of
    the prompt already cached on the decode side; all at once. Every decode request's blocks are the prefill's."""
    sizes = [1, 3, 4, 5, 8, 9, 16, 17, 31, 32, 33, 52]
    for k, n in enumerate(sizes):
        pd.add(k, n)
    prefix = {k: (n // 4) // 2 for k, n in enumerate(sizes) if k % 2}
    pd.run(lambda: len(pd.D.freed) == len(sizes) and not pd.P.requests, prefix=prefix, what="all loaded")
    assert pd.D.loaded == {f"d{k}": None for k in range(len(sizes))}
    assert all(how == "finished_sending" for _, how in pd.P.freed.values())
    assert all(how == "at-finish" for _, how in pd.D.freed.values())
    assert pd.P.double == pd.D.double == [] and len(pd.P.free) == len(pd.D.free) == 128


@NEED_TORCH
def test_refused_params_fall_back_to_a_local_prefill(pd):
    """The decode side refuses params it cannot serve (a prefill TP size it does not have): vLLM then computes the
    prompt itself, and the prefill side is told at once to release what it staged."""
    pd.add(0, 10)
    pd.run(lambda: "d0" in pd.D.freed, d_extra={"tp_size": 2}, what="computed locally")
    assert "d0" not in pd.D.loaded and pd.D.done["d0"][0] == "FINISHED_LENGTH_CAPPED"
    import vllm_engine as E
    E.wait_for(lambda: "released" in str(pd.P.agent.stage_state("p0")[1]), what="the stage released")


@NEED_TORCH
def test_layout_mismatch_is_refused(kv_proxy):
    """A decode engine whose cache layout differs (head size 8, the prefill's 16): the prefill worker refuses the
    room; the load fails and is reported with its blocks as load errors; nothing is written."""
    import vllm_engine as E
    pair = E.PD(kv_proxy.socket, d_kw=dict(head_dim=8))
    try:
        pair.add(0, 10)
        pair.run(lambda: "d0" in pair.D.freed, what="load failed")
        assert pair.D.loaded["d0"] == "load failed" and pair.D.done["d0"][0] == "FINISHED_ERROR"
        assert "aborted by the prefill side" in pair.D.agent.ended["d0"]
        assert bool((pair.D.kv[E.LAYER_NAMES[0]] == 0).all())
    finally:
        pair.close()
    assert_pool_free(kv_proxy.socket)


@NEED_TORCH
def test_pool_pressure_and_a_request_larger_than_the_pool():
    """8 slots of 4 KiB, requests of 4 slots: at most two staged at once; the rest wait for slots with their
    blocks held (freed only once copied), and all complete exact. A request of 10 slots can never be staged:
    its blocks are freed at once, and its load fails."""
    import vllm_engine as E
    px = Proxy(["--slots", "8", "--slot-size", "4096"])
    pair = None
    try:
        pair = E.PD(px.socket, p_kw=dict(num_blocks=192, budget=400, chunk=64), d_kw=dict(num_blocks=192))
        for k in range(8):
            pair.add(k, 40)
        most = [0]

        def until():
            most[0] = max(most[0], len(pair.P.delayed))
            return len(pair.D.freed) == 8 and not pair.P.requests
        pair.run(until, what="all loaded")
        assert most[0] >= 3, most[0]  # blocks held while their copies waited for slots
        assert pair.D.loaded == {f"d{k}": None for k in range(8)}
        assert all(how == "finished_sending" for _, how in pair.P.freed.values())
        pair.add(8, 100)  # 25 blocks: 6 x 25 x 256 bytes = 10 slots
        pair.run(lambda: "d8" in pair.D.freed, what="the big one ended")
        assert pair.P.freed["p8"][1] == "finished_sending" and "do not fit the pool" in pair.P.agent.ended["p8"]
        assert pair.D.loaded["d8"] == "load failed"
    finally:
        if pair is not None:
            pair.close()
        assert_pool_free(px.socket)
        px.stop()
        shutil.rmtree(px.dir, ignore_errors=True)


@NEED_TORCH
def test_proxy_killed_mid_transfer():
    """kvstaged dies with a load in flight: both sides fail it (the decode one with load errors), every block comes
    back, and a request after that fails at once instead of hanging."""
    import vllm_engine as E
    px = Proxy(["--slots", "256", "--slot-size", "4096"])
    pair = None
    try:
        pair = E.PD(px.socket)
        pair.P.agent.hold_send = lambda req, chunk: chunk >= 1
        pair.add(0, 40)
        pair.run(lambda: pair.D.agent.load_state("d0")[0] == "open" and pair.P.agent.stage_state("p0")[0] == "ready",
                 what="load open, first chunk sent")
        px.proc.send_signal(signal.SIGKILL)
        px.proc.wait()
        pair.run(lambda: "d0" in pair.D.freed and "p0" in pair.P.freed, what="both ended")
        assert pair.D.loaded["d0"] == "load failed", (pair.D.loaded, pair.D.agent.ended, pair.P.agent.ended)
        assert "connection to kvstaged lost" in pair.D.agent.ended["d0"], (pair.D.agent.ended, pair.P.agent.ended)
        assert "connection to kvstaged lost" in pair.P.agent.ended["p0"]
        pair.add(1, 10)
        pair.run(lambda: "p1" in pair.P.freed and "d1" in pair.D.freed, what="a request after the proxy died")
        assert pair.P.done["p1"][0] == "FINISHED_LENGTH_CAPPED" and "no connection" in pair.P.agent.ended["p1"]
        assert pair.D.loaded["d1"] == "load failed" and "could not open a room" in pair.D.agent.ended["d1"]
        assert len(pair.P.free) == len(pair.D.free) == 128
    finally:
        if pair is not None:
            pair.close()
        px.stop()
        shutil.rmtree(px.dir, ignore_errors=True)


# ------------------------------------------------------------------------------- the CUDA path (no GPU here)
class _FakeCuda:
    """Stands in for kvstage.cuda on host memory: 'device' pointers are host addresses."""

    def __init__(self):
        self.calls = []

    def copy_in_device(self, lease, dev_ptr, nbytes, slot_off=0, stream=None, done=None):
        self.calls.append(("in", nbytes, stream))
        lease.view()[slot_off:slot_off + nbytes] = _host(dev_ptr, nbytes)

    def copy_out_device(self, lease, dev_ptr, nbytes, slot_off=0, stream=None, done=None):
        self.calls.append(("out", nbytes, stream))
        _host(dev_ptr, nbytes)[:] = lease.view()[slot_off:slot_off + nbytes]


class _FakeStream:
    cuda_stream = 0x5151

    def __init__(self):
        self.syncs, self.waited = 0, []

    def synchronize(self):
        self.syncs += 1

    def wait_event(self, ev):
        self.waited.append(ev)


def test_fake_cuda_matches_kvstage_cuda():
    import kvstage.cuda
    for name in ("copy_in_device", "copy_out_device"):
        assert (list(inspect.signature(getattr(kvstage.cuda, name)).parameters)
                == list(inspect.signature(getattr(_FakeCuda, name)).parameters)[1:])


@NEED_TORCH
def test_cuda_copier_plan(pd):
    """The CUDA path's plan - every block run through copy_in_device / copy_out_device on the copier's stream,
    the stream synchronised before a slot is counted full and before a load is reported - against a stand-in
    device on host memory; the bytes must come out as the CPU path's. Untested on a GPU."""
    import dataclasses
    fake, ps, ds = _FakeCuda(), _FakeStream(), _FakeStream()
    for eng, st in ((pd.P, ps), (pd.D, ds)):
        eng.agent.copier = kv._CudaCopier(cuda_api=fake, stream=st)
        eng.agent.layout.regions = [dataclasses.replace(r, device=True) for r in eng.agent.layout.regions]
    pd.add(0, 22)
    pd.add(1, 5)
    pd.run(lambda: {"d0", "d1"} <= set(pd.D.freed), what="loaded")
    assert pd.D.loaded == {"d0": None, "d1": None}
    ins, outs = [c for c in fake.calls if c[0] == "in"], [c for c in fake.calls if c[0] == "out"]
    lay = pd.P.agent.layout
    assert sum(n for _, n, _ in ins) == lay.nbytes(6) + lay.nbytes(2) == sum(n for _, n, _ in outs)
    assert all(s == 0x5151 for _, _, s in fake.calls) and ps.syncs >= 2 and ds.syncs == 2
    ev = object()
    pd.P.agent.copier.after(ev)  # ordered after the forward's stream (save_kv_layer's event)
    assert ps.waited == [ev]


@NEED_TORCH
def test_device_kv_refused_without_opt_in(monkeypatch):
    import vllm_engine as E

    class OnDevice:  # a CPU tensor that says it is on a CUDA device
        is_cuda = True

        def __init__(self, t):
            self._t = t

        def __getattr__(self, name):
            return getattr(self._t, name)

        def __getitem__(self, i):
            return self._t[i]
    monkeypatch.delenv("KVSTAGE_VLLM_CUDA", raising=False)
    w = kv.KvstageConnector(E.vllm_config("/nonexistent", 0, "kv_consumer"), kv.KVConnectorRole.WORKER,
                            E.kv_cache_config(4))
    with pytest.raises(RuntimeError, match="KVSTAGE_VLLM_CUDA=1"):
        w.register_kv_caches({"l": OnDevice(torch.zeros((2, 4, 4, 2, 8), dtype=torch.float16))})
