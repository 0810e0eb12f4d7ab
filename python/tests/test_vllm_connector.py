"""kvstage.vllm piece by piece: the interface against vLLM's (names, signatures, loading through
kv_connector_module_path under a stand-in vllm package, new and old base signatures), the room layout, the
scheduler side's decisions and kv_transfer_params, and transfers between two engines in one process (every
prompt shape, decode prefix hits, pool pressure, a request larger than the pool, refused parameters and
layouts, a proxy killed mid-transfer)."""
import collections
import dataclasses
import inspect
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_stubs  # vLLM's stand-ins where vllm is not importable, before kvstage.vllm
from kvstage import vllm as kv
from kvstage.plan import Copy, CpuCopier, CudaCopier, Extent, Gather, host_bytes, needs_view
from conftest import Proxy
from sglang_common import NEED_TORCH, assert_pool_free, kv_proxy  # noqa: F401 (fixture)

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

# KVConnectorBase_V1's methods as vllm/distributed/kv_transfer/kv_connector/v1/base.py @ 9aaf83ef502f has them, and
# those @ 003df2961dd8 added (the connector has them whatever the base: test_vllm_hooks.py)
VLLM_SIGNATURES = {
    "__init__": ["self", "vllm_config", "role", "kv_cache_config"],
    "register_kv_caches": ["self", "kv_caches"],
    "handle_preemptions": ["self", "kv_connector_metadata"],
    "start_load_kv": ["self", "forward_context", "kwargs"],
    "wait_for_layer_load": ["self", "layer_name"],
    "save_kv_layer": ["self", "layer_name", "kv_layer", "attn_metadata", "kwargs"],
    "wait_for_save": ["self"],
    "get_finished": ["self", "finished_req_ids"],
    "get_block_ids_with_load_errors": ["self"],
    "get_kv_connector_stats": ["self"],
    "shutdown": ["self"],
    "get_num_new_matched_tokens": ["self", "request", "num_computed_tokens"],
    "update_state_after_alloc": ["self", "request", "blocks", "num_external_tokens"],
    "build_connector_meta": ["self", "scheduler_output"],
    "update_connector_output": ["self", "connector_output"],
    "request_finished": ["self", "request", "block_ids"],
    "has_pending_push_work": ["self"],  # in vLLM's base @ 003df2961dd8, not @ 9aaf83ef502f
    "set_xfer_handshake_metadata": ["self", "metadata"],
    "set_xfer_handshake_metadata_pp_aware": ["self", "metadata"],  # @ 003df2961dd8
    "set_eagle_prefix_cache_hashing": ["self", "enabled"],  # @ 003df2961dd8
    "get_required_kvcache_layout": ["vllm_config"],  # classmethods
    "build_kv_connector_stats": ["data"],
    "build_prom_metrics": ["vllm_config", "metric_types", "labelnames", "per_engine_labelvalues"],
}


def test_interface_matches_vllm():
    from vllm.distributed.kv_transfer.kv_connector.v1 import base
    C = kv.KvstageConnector
    assert C.__mro__[1] is base.KVConnectorBase_V1 and kv.KVConnectorBase_V1 is base.KVConnectorBase_V1
    assert not getattr(C, "__abstractmethods__", None)
    for name, params in VLLM_SIGNATURES.items():
        assert list(inspect.signature(getattr(C, name)).parameters) == params, name
        if hasattr(base.KVConnectorBase_V1, name):  # the same as the base's (the stand-in's where vllm is absent)
            assert list(inspect.signature(getattr(base.KVConnectorBase_V1, name)).parameters) == params, name
    for name in ("requires_kv_delivery", "supports_eagle_prefix_cache_hashing"):  # properties @ 003df2961dd8
        assert isinstance(getattr(C, name), property), name
        assert isinstance(getattr(base.KVConnectorBase_V1, name, property()), property), name
    # kv_cache_config is required, as vLLM's base has it (factory.py refuses a 2-argument constructor)
    assert inspect.signature(C.__init__).parameters["kv_cache_config"].default is inspect.Parameter.empty
    assert issubclass(kv.KvstageConnectorMetadata, base.KVConnectorMetadata)
    assert [r.name for r in kv.KVConnectorRole] == ["SCHEDULER", "WORKER"]
    import importlib
    assert getattr(importlib.import_module("kvstage.vllm"), "KvstageConnector") is C


@NEED_TORCH
def test_created_by_vllms_factory():
    """factory.py @ 9aaf83ef502f: loaded by kv_connector_module_path, kv_cache_config required, called with three
    arguments; with the hybrid KV cache manager explicitly on, the connector (SupportsHMA) is accepted too."""
    import vllm_engine as E
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    cfg = E.vllm_config("/nonexistent", 7600)
    assert KVConnectorFactory.get_connector_class(cfg.kv_transfer_config) is kv.KvstageConnector
    c = KVConnectorFactory.create_connector(cfg, kv.KVConnectorRole.SCHEDULER, E.kv_cache_config(16))
    assert isinstance(c, kv.KvstageConnector) and c._kv_cache_config.num_blocks == 16
    with pytest.raises(TypeError):
        kv.KvstageConnector(cfg, kv.KVConnectorRole.SCHEDULER)  # the two-argument form is gone from vLLM
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    assert isinstance(KVConnectorFactory.create_connector(cfg, kv.KVConnectorRole.SCHEDULER, E.kv_cache_config(16)),
                      kv.KvstageConnector)


@pytest.mark.skipif(not vllm_stubs.STAND_IN, reason="vLLM is installed: its absence cannot be shown")
def test_needs_vllm():
    """Without vLLM (and without the tests' stand-ins on the path) kvstage.vllm says it needs vLLM."""
    import kvstage
    env = dict(os.environ, PYTHONPATH=str(Path(kvstage.__file__).resolve().parent.parent))
    out = subprocess.run([sys.executable, "-c", "import kvstage.vllm"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "ImportError: kvstage.vllm is a vLLM KV connector and needs vLLM" in out.stderr, \
        out.stderr


# ----------------------------------------------------------------------------------------------------------- layout
@NEED_TORCH
def test_layout_regions_and_extents():
    nb, bs, h, d = 10, 4, 2, 8
    caches = {f"l{i}": torch.zeros((2, nb, bs, h, d), dtype=torch.float16) for i in range(2)}
    lay = kv.VllmLayout(caches, nb)
    item = bs * h * d * 2
    assert ([(r.layer, r.item, r.stride, r.nblocks) for r in lay.regions]
            == [(0, item, item, nb)] * 2 + [(1, item, item, nb)] * 2)
    assert lay.regions[1].ptr == caches["l0"].data_ptr() + nb * item  # V after K
    assert lay.nbytes(3) == 4 * 3 * item
    # blocks 5,6 then 2, for a 3-block room; layer 1 only: its K region starts after layer 0's 2 regions
    ext = lay.extents(3, [5, 6, 2], 0, layer=1)
    base = caches["l1"].data_ptr()
    assert ext == [Extent(2 * 3 * item, base, item, item, (5, 6, 2), False),
                   Extent(3 * 3 * item, base + nb * item, item, item, (5, 6, 2), False)]
    # planned: one copy per run of blocks (5,6 then 2) and region
    assert lay.plan(3, [5, 6, 2], 0, 1 << 20, layer=1) == [
        Copy(0, 2 * 3 * item, base + 5 * item, 2 * item, False),
        Copy(0, 2 * 3 * item + 2 * item, base + 2 * item, item, False),
        Copy(0, 3 * 3 * item, base + nb * item + 5 * item, 2 * item, False),
        Copy(0, 3 * 3 * item + 2 * item, base + nb * item + 2 * item, item, False)]
    l0 = caches["l0"].data_ptr()
    assert lay.extents(3, [7], 2, layer=0) == [Extent(2 * item, l0, item, item, (7,), False),
                                               Extent(3 * item + 2 * item, l0 + nb * item, item, item, (7,), False)]
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
                          remote_block_ids=[[3, 9, 4]], remote_num_tokens=0,
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
    # SupportsHMA: request_finished_all_groups answers as request_finished; a group of a kind it does not know
    # (here: a spec that is neither full attention nor a sliding window) among several is refused at start
    assert c.request_finished_all_groups(n, ([1],)) == (False, None)
    cfg = E.kv_cache_config(8)
    cfg.kv_cache_groups.append(cfg.kv_cache_groups[0])
    with pytest.raises(ValueError, match="KV cache group 0 .* not supported.*--disable-hybrid-kv-cache-manager"):
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
        # a prefill of another TP size: its ranks that hold this rank's heads are told
        assert _step(c).reqs_to_drop == [("10.0.0.1", 7600, "p4") + ((2,) if "tp_size" in bad else ())]
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
        # both sides: the decode side may see its load fail a step before the prefill side reports the free
        pair.run(lambda: "d8" in pair.D.freed and "p8" in pair.P.freed, what="the big one ended on both sides")
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
        # p0's blocks were freed once copied into slots, before the kill: its stage ends when the prefill side
        # next polls the dead connection, which a loaded machine may run after the decode side has failed
        pair.run(lambda: "d0" in pair.D.freed and "p0" in pair.P.freed and "p0" in pair.P.agent.ended,
                 what="both ended")
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
CUDA_CALLS = ("copy_in_device", "copy_out_device", "gather", "scatter", "gather_idx", "scatter_idx")


class _FakeCuda:
    """Stands in for kvstage.cuda on host memory ('device' pointers are host addresses), asynchronous as a CUDA stream
    is: a call checks what libkvstage_cuda checks (the slot held, a received one not written, the range inside the
    slot, no NULL page, indices in [0, 2**31)) and queues its copy on its stream; the stream runs them in order when
    synchronised (_FakeStream). A copy still queued when its slot is sent or its room closed finds its view of the
    slot released and raises, as a late GPU copy would land in a slot no longer ours. .calls: (name, pages or bytes,
    stream, first address) in stream order, with ("wait", event, stream, None) for the stream's event waits.
    sabotage: "order" (pages of a gather in reverse), "offset" (a gather one page off in the slot), "no-sync" (the
    stream never runs its copies) - the tests' proof that a wrong plan shows."""

    def __init__(self, sabotage=None):
        self.calls, self.queued, self.sabotage = [], collections.defaultdict(list), sabotage

    def _queue(self, name, lease, write, pages, page_size, slot_off, stream):
        if write and lease.readonly:
            raise PermissionError(f"{lease!r} was received: it is read-only")
        if not all(pages):
            raise ValueError("a NULL page")
        view = lease.view()  # raises, as the lease check does, for a slot not held now
        if slot_off + len(pages) * page_size > len(view):
            raise ValueError(f"{len(pages)} x {page_size} bytes from {slot_off} are past the slot's end ({len(view)})")
        self.calls.append((name, len(pages) if name not in CUDA_CALLS[:2] else page_size, stream,
                           pages[0] if pages else None))
        if name not in CUDA_CALLS[:2] and len(pages) > 1 and self.sabotage == "order":
            pages = pages[::-1]
        if name not in CUDA_CALLS[:2] and self.sabotage == "offset":
            slot_off += page_size if slot_off + (len(pages) + 1) * page_size <= len(view) else -page_size

        def run():
            for k, p in enumerate(pages):
                o = slot_off + k * page_size
                if write:
                    view[o:o + page_size] = host_bytes(p, page_size)
                else:
                    host_bytes(p, page_size)[:] = view[o:o + page_size]
        self.queued[stream].append(run)

    @staticmethod
    def _at(base, idx, page_size):
        idx = [int(i) for i in idx]
        if not all(0 <= i < 1 << 31 for i in idx):
            raise ValueError("page indices must be in [0, 2**31)")
        return [base + i * page_size for i in idx]

    def copy_in_device(self, lease, dev_ptr, nbytes, slot_off=0, stream=None, done=None):
        self._queue("copy_in_device", lease, True, [dev_ptr], nbytes, slot_off, stream)

    def copy_out_device(self, lease, dev_ptr, nbytes, slot_off=0, stream=None, done=None):
        self._queue("copy_out_device", lease, False, [dev_ptr], nbytes, slot_off, stream)

    def gather(self, lease, dev_pages, page_size, slot_off=0, stream=None, done=None):
        self._queue("gather", lease, True, list(dev_pages), page_size, slot_off, stream)

    def scatter(self, lease, dev_pages, page_size, slot_off=0, stream=None, done=None):
        self._queue("scatter", lease, False, list(dev_pages), page_size, slot_off, stream)

    def gather_idx(self, lease, dev_base, page_idx, page_size, slot_off=0, stream=None, done=None):
        self._queue("gather_idx", lease, True, self._at(dev_base, page_idx, page_size), page_size, slot_off, stream)

    def scatter_idx(self, lease, dev_base, page_idx, page_size, slot_off=0, stream=None, done=None):
        self._queue("scatter_idx", lease, False, self._at(dev_base, page_idx, page_size), page_size, slot_off, stream)

    def count(self, *names):
        return sum(1 for c in self.calls if c[0] in names)


class _FakeStream:
    """A torch.cuda.Stream stand-in on a _FakeCuda: synchronize() runs the copies queued on it."""

    def __init__(self, fake, handle=0x5151):
        self.fake, self.cuda_stream = fake, handle
        self.syncs, self.waited = 0, []

    def synchronize(self):
        self.syncs += 1
        if self.fake.sabotage == "no-sync":
            return
        q, self.fake.queued[self.cuda_stream] = self.fake.queued[self.cuda_stream], []
        for run in q:
            run()

    def wait_event(self, ev):
        self.waited.append(ev)
        self.fake.calls.append(("wait", ev, self.cuda_stream, None))


class _FakeEvent:
    """torch.cuda.Event stand-in: record() remembers what the forward had just written (tag, set by the test)."""
    tag = None

    def record(self, stream=None):
        self.tag = _FakeEvent.tag


def test_fake_cuda_matches_kvstage_cuda():
    import kvstage.cuda
    for name in CUDA_CALLS:
        real, fake = inspect.signature(getattr(kvstage.cuda, name)), inspect.signature(getattr(_FakeCuda, name))
        assert list(real.parameters) == list(fake.parameters)[1:], name
        assert [p.default for p in real.parameters.values()] == [p.default for p in fake.parameters.values()][1:], name


class _HostLease:
    """A slot in host memory for the plan tests (no proxy): view() as Lease.view."""

    def __init__(self, buf, readonly=False):
        self.buf, self.readonly = buf, readonly

    def view(self):
        mv = memoryview(self.buf)
        return mv.toreadonly() if self.readonly else mv


PLAN_SHAPES = {"kv-first": dict(head_dim=16, layout="kv-first"),        # blocks item bytes apart: gather_idx
               "block-first": dict(head_dim=16, layout="block-first"),  # 2 x item apart: gather with page pointers
               "straddle": dict(head_dim=12, layout="kv-first")}        # 192-byte blocks: slot boundaries cut some


def _caches(shape, nb, fill):
    import vllm_engine as E
    caches = {n: E.kv_cache(nb, **PLAN_SHAPES[shape]) for n in E.LAYER_NAMES}
    if fill:
        g = torch.Generator().manual_seed(11)
        for t in caches.values():
            t.view(torch.int16).copy_(torch.randint(-32768, 32767, t.shape, dtype=torch.int16, generator=g))
    return caches


def _on_device(lay, device=True):
    """lay with every region in device memory (or, device=False, in host memory): the same caches as the other
    path sees them."""
    import copy
    out = copy.copy(lay)
    out.regions = [dataclasses.replace(r, device=device) for r in lay.regions]
    out.device = device
    return out


def _layouts(caches, nb):
    """(the CPU path's layout, the same caches as the device path sees them)."""
    cpu = kv.VllmLayout(caches, nb)
    return cpu, _on_device(cpu)


def _device_copier(sabotage=None, cls=None):
    fake = _FakeCuda(sabotage)
    return (cls or CudaCopier)(cuda_api=fake, stream=_FakeStream(fake)), fake


def _copy_in(lay, copier, nblocks, blocks, ss):
    """Returns (the room's bytes after copying the blocks in layer by layer as a stage does, the plan's length)."""
    slots = [bytearray(ss) for _ in range(kv._cdiv(lay.nbytes(nblocks), ss))]
    calls = 0
    for li in range(len(lay.layer_names)):
        plan = lay.plan(nblocks, blocks, 0, ss, layer=li)
        calls += len(plan)
        for p in plan:
            lease = _HostLease(slots[p.slot])
            copier.copy_in(lease, lease.view() if needs_view(p) else None, p)
    copier.sync()
    return b"".join(slots)[:lay.nbytes(nblocks)], calls


def _copy_out(lay, copier, room, nblocks, blocks, skip, ss):
    """Copies a room's bytes into blocks (request positions skip...) as a load does; returns the plan's length."""
    slots = [bytearray(room[i:i + ss].ljust(ss, b"\0")) for i in range(0, len(room), ss)]
    plan = lay.plan(nblocks, blocks, skip, ss)
    for p in plan:
        lease = _HostLease(slots[p.slot], readonly=True)
        copier.copy_out(lease, lease.view() if needs_view(p) else None, p)
    copier.sync()
    return len(plan)


def _block_lists(nb, n):
    rng = random.Random(3)
    return {"contiguous": list(range(5, 5 + n)), "scattered": sorted(rng.sample(range(nb), n)),
            "shuffled": rng.sample(range(nb), n), "reversed": list(range(5 + n, 5, -1))}


@NEED_TORCH
@pytest.mark.parametrize("shape", list(PLAN_SHAPES))
def test_gather_plan_moves_the_bytes_the_cpu_path_does(shape):
    """The device path's plan (per layer part and slot a gather plus plain copies for the parts of a block a slot
    boundary cuts, or a plain copy per run where that is no more calls) on the stand-in device gives the room, byte
    for byte, that the CPU path's copy per run gives, for contiguous, scattered, shuffled and reversed blocks across
    3 layers; and a load's scatters put into the decode
    side's blocks (a prefix of 2 cached) what the CPU path's copies do. Far fewer calls than runs when the blocks are
    scattered; a plan that reorders pages, puts them one page off or is never synchronised gives another room."""
    nb, n, ss = 48, 20, 4096
    src = _caches(shape, nb, fill=True)
    cpu, dev = _layouts(src, nb)
    seen = collections.Counter()
    for what, blocks in _block_lists(nb, n).items():
        want, runs = _copy_in(cpu, CpuCopier(), n, blocks, ss)
        copier, fake = _device_copier()
        got, calls = _copy_in(dev, copier, n, blocks, ss)
        assert got == want, (shape, what)
        assert fake.count(*CUDA_CALLS) == calls and copier._stream.syncs == 1
        seen.update(c[0] for c in fake.calls)
        if what != "contiguous" or shape == "block-first":  # runs of one block (block-first: runs are blocks)
            assert calls < runs / 2, (shape, what, calls, runs)
        else:  # one run per layer part and slot: as many plain copies as runs (a tie goes to the plain copies)
            assert calls == runs, (shape, what, calls, runs)
            assert fake.count("copy_in_device") == calls and not fake.count("gather", "gather_idx"), (shape, what)
        # the load: into other, shuffled blocks of a fresh cache, the first 2 positions cached already
        dst = random.Random(len(what)).sample(range(nb), n - 2)
        outs = []
        for gather in (False, True):
            d = _caches(shape, nb, fill=False)
            dcpu, ddev = _layouts(d, nb)
            c = _device_copier()[0] if gather else CpuCopier()
            _copy_out(ddev if gather else dcpu, c, want, n, dst, 2, ss)
            outs.append(d)
        for name in src:
            assert torch.equal(outs[0][name].view(torch.int16), outs[1][name].view(torch.int16)), (shape, what, name)
            assert torch.equal(outs[1][name][:, dst].view(torch.int16), src[name][:, blocks[2:]].view(torch.int16))
    used, unused = ("gather", "gather_idx") if shape == "block-first" else ("gather_idx", "gather")
    assert seen[used] and not seen[unused]
    # plain device copies: kv-first's contiguous runs (the tie) and straddle's blocks cut by a slot boundary; every
    # block-first slot holds several strided blocks (no runs), one gather each
    assert bool(seen["copy_in_device"]) == (shape != "block-first"), shape
    # proof that the comparison bites: a wrong order, offset or stride, or no synchronisation, gives another room
    blocks = _block_lists(nb, n)["shuffled"]
    want, _ = _copy_in(cpu, CpuCopier(), n, blocks, ss)

    class StrideIgnored(CudaCopier):  # every Gather as base + idx * item, whatever the blocks' stride
        def copy_in(self, lease, view, p):
            super().copy_in(lease, view, p._replace(stride=p.item) if isinstance(p, Gather) else p)
    bad = [_device_copier(s) for s in ("order", "offset", "no-sync")]
    if shape == "block-first":
        bad.append(_device_copier(cls=StrideIgnored))
    for copier, fake in bad:
        try:
            got, _ = _copy_in(dev, copier, n, blocks, ss)
        except ValueError:  # one page off past the slot's end
            continue
        assert got != want, (shape, fake.sabotage)


def _tag_events(eng):
    """Tags each event the worker records with what the forward had written: the layer (save_kv_layer) or "seal"."""
    w = eng.worker
    save, seal = w.save_kv_layer, w.wait_for_save

    def save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs):
        _FakeEvent.tag = layer_name
        return save(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save():
        _FakeEvent.tag = "seal"
        return seal()
    w.save_kv_layer, w.wait_for_save = save_kv_layer, wait_for_save


@NEED_TORCH
@pytest.mark.parametrize("shape", list(PLAN_SHAPES))
def test_cuda_copier_plan(kv_proxy, monkeypatch, shape):
    """The CUDA path end to end against the stand-in device (asynchronous: copies run only when the stream is
    synchronised), both engines' blocks handed out shuffled: every layer part's blocks in a slot by one gather on the
    copier's stream, that stream waiting for the forward's event of that layer first; synchronised before a slot is
    counted full (else the copy meets a sent slot) and before a load is reported (else the blocks are still empty
    when vLLM reads them); every decode block as the prefill's; fewer calls than runs. Untested on a GPU."""
    import vllm_engine as E
    kw = dict(head_dim=PLAN_SHAPES[shape]["head_dim"], kv_layout=PLAN_SHAPES[shape]["layout"])
    pair = E.PD(kv_proxy.socket, p_kw=kw, d_kw=kw)
    try:
        monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
        fakes = {}
        for name, eng in (("P", pair.P), ("D", pair.D)):
            eng.agent.copier, fakes[name] = _device_copier()
            lay = eng.agent.layout
            cpu_regions = lay.regions
            lay.regions = [dataclasses.replace(r, device=True) for r in cpu_regions]
            lay.device = True  # the worker records the forward's events
            _tag_events(eng)
        rng = random.Random(5)
        rng.shuffle(pair.P.free)
        rng.shuffle(pair.D.free)
        sizes = [22, 5, 40, 33, 9, 17]
        for k, n in enumerate(sizes):
            pair.add(k, n)
        pair.run(lambda: len(pair.D.freed) == len(sizes) and not pair.P.requests, what="all loaded")
        assert pair.D.loaded == {f"d{k}": None for k in range(len(sizes))}
        ss = pair.P.agent._c().slot_size
        lay = pair.P.agent.layout
        host = _on_device(lay, False)  # the same caches as the CPU path plans them: one copy per run
        runs = calls = 0
        for k, n in enumerate(sizes):
            nb = kv._cdiv(n, E.BLOCK_SIZE)
            for blocks in (pair.P.done_req[f"p{k}"].blocks[:nb], pair.D.done_req[f"d{k}"].blocks[:nb]):
                runs += len(host.plan(nb, blocks, 0, ss))
                calls += len(lay.plan(nb, blocks, 0, ss))
        fp, fd = fakes["P"], fakes["D"]
        moved = (fp.count("gather", "gather_idx", "copy_in_device")
                 + fd.count("scatter", "scatter_idx", "copy_out_device"))
        assert moved == calls < runs / 2, (moved, calls, runs)
        assert fp.count("copy_out_device", "scatter", "scatter_idx") == 0
        assert fd.count("copy_in_device", "gather", "gather_idx") == 0
        assert {c[2] for c in fp.calls + fd.calls} == {0x5151}
        # ordered after the forward: each gather of layer L's blocks queued after a wait for an event recorded once
        # the forward had written layer L (save_kv_layer) or every layer (wait_for_save)
        layer_of = {}
        for r in lay.regions:
            layer_of[(r.ptr, r.ptr + r.nblocks * r.stride)] = E.LAYER_NAMES[r.layer]
        waited = set()
        for name, what, _, addr in fp.calls:
            if name == "wait":
                waited.add(what.tag)
                continue
            layer = next(v for (lo, hi), v in layer_of.items() if lo <= addr < hi)
            assert layer in waited or "seal" in waited, (name, layer, waited)
        assert waited == set(E.LAYER_NAMES) | {"seal"} and not fd.count("wait")
        assert pair.P.agent.copier._stream.syncs >= 1 and pair.D.agent.copier._stream.syncs == len(sizes)
    finally:
        pair.close()
    assert_pool_free(kv_proxy.socket)


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


@NEED_TORCH
def test_the_decode_tp_size_a_prefill_stages_for():
    """kvstage_decode_tp_size: the prefill instance's (a TP size one of whose sizes divides the other, else refused at
    start), or a request's own from the router; a request's that does not pair falls back to the instance's. The
    SaveSpec carries it (0: this side's own), the response names it; a decode instance of another size than the one
    staged for takes no load (it computes the prompt) and tells the prefill ranks that hold its heads to release."""
    import vllm_engine as E

    def sched(tp, role="kv_producer", **extra):
        cfg = E.vllm_config("/nonexistent", 7600, role, tp=tp, extra=extra)
        return kv.KvstageConnector(cfg, kv.KVConnectorRole.SCHEDULER, E.kv_cache_config(64))
    with pytest.raises(ValueError, match="one must divide the other"):
        sched(2, kvstage_decode_tp_size=3)
    c = sched(2, kvstage_decode_tp_size=4)
    got = {}
    for rid, extra in (("p1", None), ("p2", {"kvstage_decode_tp_size": 2}), ("p3", {"kvstage_decode_tp_size": 3})):
        r = E.Request(rid, 10, E.prefill_params(extra), 1)
        c.update_state_after_alloc(r, E.KVCacheBlocks([3, 9, 4], [3, 9, 4]), 0)
        spec = _step(c, new=[(r, [3, 9, 4], 0, 10)]).reqs_to_save[rid]
        r.status = E.RequestStatus.FINISHED_LENGTH_CAPPED
        got[rid] = (spec.decode_tp, c.request_finished(r, [3, 9, 4])[1]["kvstage"].get("decode_tp_size"))
    assert got == {"p1": (4, 4), "p2": (0, None), "p3": (4, 4)}
    # decode TP 1 against a prefill of TP 2 staged for 4: no load; prefill ranks 0 and 1 hold decode rank 0's heads
    d = sched(1, role="kv_consumer")
    params = _decode_params(tp_size=2, kvstage=dict(version=1, num_blocks=3, num_tokens=10, block_size=4,
                                                    decode_tp_size=4))
    r = E.Request("d1", 10, params, 1)
    assert d.get_num_new_matched_tokens(r, 0) == (0, False)
    d.update_state_after_alloc(r, E.KVCacheBlocks([5, 6, 9], [5, 6, 9]), 0)
    assert _step(d).reqs_to_drop == [("10.0.0.1", 7600, "p1", 2)]
    # a prefill of TP 4 staged for decode TP 2 (this side's): a load whose RecvSpec names the prefill's TP size
    d2 = sched(2, role="kv_consumer")
    r = E.Request("d2", 10, _decode_params(tp_size=4), 1)
    r.kv_transfer_params["kvstage"]["decode_tp_size"] = 2
    assert d2.get_num_new_matched_tokens(r, 0) == (10, True)
    d2.update_state_after_alloc(r, E.KVCacheBlocks([5, 6, 9], [5, 6, 9]), 10)
    spec = _step(d2).reqs_to_recv["d2"]
    assert (spec.remote_tp, spec.num_blocks, spec.local_block_ids, spec.skip) == (4, 3, (5, 6, 9), 0)
