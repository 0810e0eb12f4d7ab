"""kvstage.vllm and the hooks vLLM's KVConnectorBase_V1 has @ 003df2961dd8 and not @ 9aaf83ef502f, driven as each
vLLM drives them (tests/vllm_engine.py, Engine(vllm=...)): requires_kv_delivery at a preemption under async
scheduling (a request preempted while its last prefill step is in flight: recomputed and handed off from its new
blocks @ 003df2961dd8; finished by its stale token with no hand-off @ 9aaf83ef502f; no copy ever reads the freed
blocks, which another request writes at once; red: a connector that ignores the preemption hands off the other
request's bytes), set_xfer_handshake_metadata_pp_aware (pipeline stage 0 taken, a later one refused, saying why), the
EAGLE prefix-cache hooks, and the connector on a base without any of them (a subprocess with the older stand-in)."""
import dataclasses
import os
import subprocess
import sys

import pytest

import vllm_stubs  # noqa: F401 - vLLM's stand-ins where vllm is not importable, before kvstage.vllm
from kvstage import vllm as kv
from sglang_common import NEED_TORCH, assert_pool_free, kv_proxy  # noqa: F401 (fixture)

pytestmark = NEED_TORCH


class IgnoresPreemptions(kv.KvstageConnector):
    """Red: a connector that neither voids a preempted request's stage nor stops its copies into slots (its scheduler
    side never hears of the preemption, its workers do nothing in handle_preemptions)."""

    def build_connector_meta(self, scheduler_output):
        return super().build_connector_meta(dataclasses.replace(scheduler_output, preempted_req_ids=set()))

    def handle_preemptions(self, kv_connector_metadata):
        return


CASES = [("003df2961dd8", 1, "green"), ("003df2961dd8", 2, "green"), ("9aaf83ef502f", 1, "green"),
         ("9aaf83ef502f", 1, "red")]


@pytest.mark.parametrize("vllm,tp,conn", CASES, ids=[f"{v}-tp{t}-{c}" for v, t, c in CASES])
def test_preempted_while_its_hand_off_is_pending(kv_proxy, vllm, tp, conn):
    """Async scheduling (two batches in flight): prefill request p0's last chunk runs (its copies into slots held in
    the queue), then the next schedule preempts it before that step's output came: its blocks are freed and request
    p1, running beside it, gets them and writes its own KV into them in that very step. Whatever vLLM does next, no
    copy reads the freed blocks: handle_preemptions cancelled the held copies before that forward.
    @ 003df2961dd8 (requires_kv_delivery: True for a producer): p0's stale token is dropped, p0 recomputed from new
    blocks, staged again and handed off; the decode side's blocks hold p0's KV exactly.
    @ 9aaf83ef502f: the stale token is delivered and finishes p0 while preempted; the connector hands nothing off (its
    stage was void), the decode side never hears of it (it would compute the prompt itself).
    Red (a connector that ignores the preemption, @ 9aaf83ef502f): the held copies run after p1 wrote the blocks and
    the decode side receives p1's bytes as p0's KV."""
    import vllm_engine as E
    red = conn == "red"
    pair = E.PD(kv_proxy.socket, p_kw=dict(num_blocks=64, tp=tp, vllm=vllm, async_scheduling=True),
                d_kw=dict(num_blocks=64, tp=tp), p_cls=IgnoresPreemptions if red else kv.KvstageConnector)
    P, D = pair.P, pair.D
    gates = []
    for a in P.agents:
        a.copier = E.GatedCopier(hold={("p0", "stage")})
        gates.append(a.copier)
    try:
        assert P.requires_kv_delivery is (vllm == E.NEW)  # what the scheduler read from the connector
        b = pair.add(1, 40)  # running beside p0 the whole time, 8 tokens (2 blocks) a step
        a = pair.add(0, 12)  # two chunks: 8, then the last 4
        for _ in range(2):
            P.step()
        assert a.num_computed_tokens == 12 and a.num_output_placeholders == 1 and P.inflight[0].scheduled
        assert not a.output  # its token is in flight
        for g in gates:
            E.wait_for(lambda: g.queued("p0", "stage"), what="p0's copies into slots queued (held)")
        freed = list(a.blocks)
        P.preempt("p0")
        P.step()  # the schedule preempts p0 and gives p1 the freed blocks; then the output of p0's last chunk comes
        assert a.num_preemptions == 1 and freed[:2] == b.blocks[-2:], (freed, b.blocks)
        for rank in range(tp):  # p1's KV is in what were p0's blocks
            assert P.holds(b, 24, rank=rank) is None
        first = [h for g in gates for h in g.of("p0", "stage")]
        if not red:  # handle_preemptions returned only once none of them could run
            assert first and all(h.state == "cancelled" for h in first), [h.state for h in first]
        if vllm == E.NEW:
            assert (P.step_no - 1, "stale output dropped", "p0") in P.log and not a.is_finished()
        else:
            assert (P.step_no - 1, "stale output delivered", "p0") in P.log
            assert P.done["p0"][0] == "FINISHED_LENGTH_CAPPED"
            assert (P.done["p0"][1] is None) is (not red), P.done["p0"]
        for g in gates:
            g.release("p0")
        pair.run(lambda: "d1" in D.freed and not P.requests and not D.requests and (
            "d0" in D.freed or P.done.get("p0", (None, 1))[1] is None), what="every request ended")
        assert D.loaded["d1"] is None and P.double == [] and D.double == []
        if red:  # the held copies ran after p1 wrote the blocks: p1's bytes delivered as p0's
            assert all(h.state == "done" for h in first), [h.state for h in first]
            assert D.loaded["d0"] is not None and "differ" in D.loaded["d0"], D.loaded["d0"]
        elif vllm == E.NEW:  # recomputed from scratch, staged again from its new blocks, handed off exactly
            assert a.num_preemptions == 1 and P.done["p0"][0] == "FINISHED_LENGTH_CAPPED" and P.done["p0"][1]
            assert D.loaded["d0"] is None and D.done["d0"][0] == "FINISHED_LENGTH_CAPPED"
        else:  # no hand-off: the decode side never got the request
            assert "d0" not in D.done and P.freed["p0"][1] == "at-finish"
        assert len(P.free) == P.num_blocks and len(D.free) == D.num_blocks
    finally:
        for g in gates:
            g.release("p0")
        pair.close()
    assert_pool_free(kv_proxy.socket)


def test_requires_kv_delivery_by_role():
    """A producer's hand-off must be delivered (kv_producer, kv_both: True, as the base's default); a consumer hands
    nothing off (False). The stand-in scheduler @ 003df2961dd8 reads it once, as vLLM's does."""
    import vllm_engine as E
    for role, want in (("kv_producer", True), ("kv_both", True), ("kv_consumer", False)):
        c = kv.KvstageConnector(E.vllm_config("/nonexistent", 7600, role), kv.KVConnectorRole.SCHEDULER,
                                E.kv_cache_config(16))
        assert c.requires_kv_delivery is want, role


def test_pp_aware_handshake_metadata(kv_proxy):
    """vLLM @ 003df2961dd8 hands the scheduler connector the workers' handshake metadata keyed (pp_rank, tp_rank)
    through set_xfer_handshake_metadata_pp_aware (@ 9aaf83ef502f: keyed by tp_rank, set_xfer_handshake_metadata).
    kvstage's workers have none, so an engine of either vLLM starts with an empty dict; metadata of pipeline stage 0 is
    taken (and needs nothing), a later stage's is refused with the reason: kvstage does not do pipeline parallelism,
    which it refuses at start too."""
    import vllm_engine as E
    for vllm in (E.NEW, E.OLD):
        P = E.Engine(kv_proxy.socket, E.free_port(2), num_blocks=16, role="kv_producer", tp=2, vllm=vllm)
        try:
            assert P.handshake == {}
        finally:
            P.close()
    c = kv.KvstageConnector(E.vllm_config("/nonexistent", 7600, "kv_producer", tp=2), kv.KVConnectorRole.SCHEDULER,
                            E.kv_cache_config(16))
    md = object()
    assert c.set_xfer_handshake_metadata_pp_aware({(0, 0): md, (0, 1): md}) is None
    assert c.set_xfer_handshake_metadata({0: md, 1: md}) is None
    with pytest.raises(ValueError, match=r"pipeline-parallel rank\(s\) \[1, 2\]: kvstage does not support pipeline "
                                         r"parallelism"):
        c.set_xfer_handshake_metadata_pp_aware({(0, 0): md, (1, 0): md, (2, 1): md})
    cfg = E.vllm_config("/nonexistent", 7600, "kv_producer")
    cfg.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(NotImplementedError, match="pipeline parallelism is not supported"):
        kv.KvstageConnector(cfg, kv.KVConnectorRole.SCHEDULER, E.kv_cache_config(16))


def test_eagle_prefix_cache_hashing(kv_proxy):
    """kvstage never looks KV up by block hash (a request's blocks move by position), so it lets each engine use the
    successor-aware EAGLE prefix-cache keys: with EAGLE, vLLM @ 003df2961dd8 turns them on for a kvstage engine
    (is_eagle_prefix_cache_hashing_enabled) where the base's default (False) keeps the old keys; every connector is
    told and keeps it; requests move as before, every byte exact."""
    import types
    import vllm_engine as E
    cfg = E.vllm_config("/nonexistent", 7600, eagle=True)
    assert E.is_eagle_prefix_cache_hashing_enabled(cfg, types.SimpleNamespace(
        supports_eagle_prefix_cache_hashing=False)) is False
    pair = E.PD(kv_proxy.socket, p_kw=dict(eagle=True), d_kw=dict(eagle=True))
    try:
        for eng in (pair.P, pair.D):
            assert eng.use_eagle_prefix_cache_hashing is True
            assert all(c.use_eagle_prefix_cache_hashing is True for c in [eng.sched] + eng.workers)
        for k in range(4):
            pair.add(k, 6 + 5 * k)
        pair.run(lambda: {f"d{k}" for k in range(4)} <= set(pair.D.freed), what="every request loaded")
        assert all(pair.D.loaded[f"d{k}"] is None for k in range(4))
    finally:
        pair.close()
    assert_pool_free(kv_proxy.socket)


OLDER_BASE = r"""
import vllm_stubs
from vllm.distributed.kv_transfer.kv_connector.v1 import base
for name in base.NEWER:
    assert not hasattr(base.KVConnectorBase_V1, name), name
from kvstage import vllm as kv
import vllm_engine as E
for role, want in (("kv_producer", True), ("kv_consumer", False)):
    c = kv.KvstageConnector(E.vllm_config("/nonexistent", 7600, role), kv.KVConnectorRole.SCHEDULER,
                            E.kv_cache_config(16))
    assert c.requires_kv_delivery is want and c.supports_eagle_prefix_cache_hashing is True
    assert c.use_eagle_prefix_cache_hashing is False
    c.set_eagle_prefix_cache_hashing(True)
    assert c.use_eagle_prefix_cache_hashing is True
    assert c.set_xfer_handshake_metadata_pp_aware({(0, 0): 1}) is None and not c.has_pending_push_work()
    try:
        c.set_xfer_handshake_metadata_pp_aware({(1, 0): 1})
        raise SystemExit("pp_rank 1 taken")
    except ValueError as e:
        assert "does not support pipeline parallelism" in str(e), e
print("older base: ok")
"""


def test_on_the_older_base():
    """On vLLM's base @ 9aaf83ef502f (the stand-in without the members 003df2961dd8 added: requires_kv_delivery,
    supports_eagle_prefix_cache_hashing, set_eagle_prefix_cache_hashing, set_xfer_handshake_metadata_pp_aware,
    has_pending_push_work) the connector has them all, with the same answers: it never reaches for the base's."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, KVSTAGE_TEST_VLLM_BASE="9aaf83ef502f",
               PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", OLDER_BASE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "older base: ok" in out.stdout, out.stdout + out.stderr
