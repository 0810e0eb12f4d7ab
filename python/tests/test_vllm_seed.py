"""The connector's two release rules as red/green pairs, deterministic (the test alone decides when a copy may run:
GatedCopier holds the agent's copy jobs until released; PausableAgent holds its kvstage events; no sleeps).

Prefill: a request's blocks are freed when kvstage says the bytes left them - every copy into slots done - never
earlier. Green: request_finished delays the free; get_finished reports finished_sending at the first step after
the copies ran, once. Red (FreesPrefillAtFinish, test only): the blocks are freed in request_finished; the
next request gets them and its forward writes them; then the copy runs and the decode side receives the other
request's bytes.

Decode: an aborted request's blocks are given back (finished_recving) only after the room's final event, with
every copy-out of it cancelled or done. Red (FreesDecodeAtAbort, test only): finished_recving at the abort;
the engine writes the blocks it got back; the queued copy-out, or a RECV_DONE read after the abort, lands in them.
Both pairs also through TP sizes that differ (one room per rank pair): prefill 2 -> decode 4 with one prefill rank's
copies into slots queued at the finish; 2 -> 4 and 4 -> 2 with the last decode rank's share in flight at the abort,
the other ranks' loaded.

Both engines run in this process, each with its own connector pair and kvstage connection to one real kvstaged."""
import pytest

import vllm_stubs  # noqa: F401 - vLLM's stand-ins where vllm is not importable, before kvstage.vllm
from kvstage import vllm as kv
from sglang_common import NEED_TORCH, assert_pool_free, kv_proxy  # noqa: F401 (fixture)

pytestmark = NEED_TORCH


class FreesPrefillAtFinish(kv.KvstageConnector):
    """TEST ONLY - frees a prefill request's blocks in request_finished, while its copies into slots may still run."""

    def request_finished(self, request, block_ids):
        delay, params = super().request_finished(request, block_ids)
        sc, rid = self.connector_scheduler, request.request_id
        if rid in sc._finished:
            sc._finished[rid] = (sc._finished[rid][0], False)  # so the worker does not report it either
            sc._p_delayed.pop(rid, None)
        return False, params


class PausableAgent(kv._Agent):
    """Takes no kvstage events while .paused (as an agent that has not come round to them yet)."""
    paused = False

    def _pump(self):
        if not self.paused:
            super()._pump()


class _ReportsAtAbort(PausableAgent):
    """TEST ONLY - the seed bug: an aborted load is reported (its blocks given back) at once; its queued copy-out is
    not cancelled, and a RECV_DONE that comes after the abort is still copied out."""

    def cmd_abort(self, req):
        ld = self._loads.get(req)
        if ld is None or ld.reported:
            return
        ld.reported = True
        with self._lock:
            self._finished_recving.add(req)


class Green(kv.KvstageConnector):
    agent_class = PausableAgent


class FreesDecodeAtAbort(kv.KvstageConnector):
    agent_class = _ReportsAtAbort


@pytest.fixture
def pd(kv_proxy, request):
    import vllm_engine as E
    p_cls, d_cls = request.param
    pair = E.PD(kv_proxy.socket, p_cls=p_cls, d_cls=d_cls)
    yield pair
    pair.close()
    assert_pool_free(kv_proxy.socket)


@pytest.mark.parametrize("pd,variant",
                         [((kv.KvstageConnector, Green), "green"), ((FreesPrefillAtFinish, Green), "red")],
                         indirect=["pd"], ids=["green", "red"])
def test_prefill_blocks_freed_once_copied(pd, variant):
    import vllm_engine as E
    P, D = pd.P, pd.D
    gate = P.agent.copier = E.GatedCopier(hold={("p0", "stage")})
    x = pd.add(0, 22)                                   # 6 blocks, three prefill chunks
    P.step_until(lambda: "p0" in P.done, what="X finished")
    assert P.done["p0"][0] == "FINISHED_LENGTH_CAPPED" and P.done["p0"][1]["do_remote_prefill"] is True
    E.wait_for(lambda: gate.queued("p0", "stage"), what="X's copies queued")  # behind the gate: not run
    xblocks = list(x.blocks)
    if variant == "green":
        assert "p0" in P.delayed and "p0" not in P.freed and P.sched.has_pending_push_work()
        for _ in range(20):  # however long the copies wait, the blocks stay X's
            P.step()
            assert "p0" not in P.freed and P.agent.stage_state("p0")[0] == "staging"
    else:
        assert P.freed["p0"][1] == "at-finish"
    y = pd.add(1, 22)                                   # Y comes next and gets the freed blocks first
    P.step_until(lambda: "p1" in P.done, what="Y finished")  # Y's forward wrote its blocks
    assert bool(set(y.blocks) & set(xblocks)) == (variant == "red")
    if variant == "green":
        P.step_until(lambda: "p1" in P.freed, what="Y freed")  # (Y's copies are not held)
    gate.release("p0")
    P.agent.wake()
    E.wait_for(lambda: P.agent.stage_state("p0")[0] == "ready", what="X copied into slots")
    if variant == "green":
        assert "p0" not in P.freed  # copied just now; freed at the next step, by finished_sending, once
        step = P.step_no
        P.step()
        assert P.freed["p0"] == (step, "finished_sending") and "p0" not in P.sched.connector_scheduler._p_delayed
        for _ in range(5):
            P.step()
        assert P.double == [] and [e for e in P.log if e[1] == "finished_sending" and e[2] == "p0"] == [
            (step, "finished_sending", "p0")]
        z = pd.add(2, 22)  # now X's blocks are free: Z gets them and writes them, before the decode side loads X
        P.step_until(lambda: "p2" in P.done, what="Z finished")
        assert set(z.blocks) == set(xblocks)
    pd.run(lambda: {"d0", "d1"} <= set(D.freed) and (variant == "red" or "d2" in D.freed), what="loaded")
    assert D.loaded["d1"] is None and D.loaded.get("d2") is None
    if variant == "green":
        assert D.loaded["d0"] is None, D.loaded["d0"]
    else:  # X's slots were filled from blocks Y had overwritten
        assert D.loaded["d0"] is not None and "differ" in D.loaded["d0"]
        # ... with Y's bytes (but the last token, which the decode side computes itself)
        assert D.holds(D.done_req["d1"], n=21, blocks=D.done_req["d0"].blocks) is None


def _quarantine(D, E):
    """Marks an aborted request's blocks when they are given back (the engine writes them) and keeps them."""
    got = {}

    def on_free(r, how):
        if D.done[r.request_id][0] != "FINISHED_ABORTED":
            return False
        D.mark(r.blocks, E.MARK)
        got[r.request_id] = (list(r.blocks), how)
        return True
    D.on_free = on_free
    return got


@pytest.mark.parametrize("pd,variant", [((kv.KvstageConnector, Green), "green"),
                                        ((kv.KvstageConnector, FreesDecodeAtAbort), "red")],
                         indirect=["pd"], ids=["green", "red"])
def test_decode_queued_copy_out_after_abort(pd, variant):
    """X's room completes and its copy-out is queued (a copy stream behind); the engine aborts X. Green: its blocks
    come back only after the copy-out is cancelled, and stay as the engine wrote them. Red: they come back at once,
    the copy-out runs later and overwrites them."""
    import vllm_engine as E
    D = pd.D
    gate = D.agent.copier = E.GatedCopier(hold={("d0", "load")})
    got = _quarantine(D, E)
    pd.add(0, 22)
    pd.run(lambda: gate.queued("d0", "load"), what="X's copy-out queued")
    x = D.requests["d0"]
    assert x.status == E.RequestStatus.WAITING_FOR_REMOTE_KVS
    D.abort("d0")
    assert "d0" not in D.freed  # vLLM's own rule: a load in flight keeps its blocks
    D.step_until(lambda: "d0" in D.freed, what="X's blocks given back")
    assert D.freed["d0"][1] == "finished_recving" and D.marked(got["d0"][0], E.MARK)
    gate.release("d0")
    D.agent.wake()
    E.wait_for(lambda: all(h.done() for h in gate.of("d0", "load")), what="the copy stream drained")
    if variant == "green":
        assert [h.state for h in gate.of("d0", "load")] == ["cancelled"]
        assert D.marked(got["d0"][0], E.MARK), "decode blocks written after they were given back"
    else:
        assert [h.state for h in gate.of("d0", "load")] == ["done"]
        assert not D.marked(got["d0"][0], E.MARK) and D.holds(x) is None  # X's late copy landed
    D.step()
    assert D.double == []


@pytest.mark.parametrize("pd,variant", [((kv.KvstageConnector, Green), "green"),
                                        ((kv.KvstageConnector, FreesDecodeAtAbort), "red")],
                         indirect=["pd"], ids=["green", "red"])
def test_decode_recv_done_read_after_abort(pd, variant):
    """X's room completes at the proxy while the decode agent takes no events; the engine aborts X; only then does
    the agent read the RECV_DONE. Green: no copy-out, blocks given back after that final event, untouched.
    Red: given back at the abort; the late RECV_DONE is copied into them."""
    import vllm_engine as E
    P, D = pd.P, pd.D
    got = _quarantine(D, E)
    D.agent.paused = True
    pd.add(0, 22)
    pd.run(lambda: P.agent.stage_state("p0") == (None, "sent"), what="X sent: complete at the proxy")
    x = D.requests["d0"]
    assert x.status == E.RequestStatus.WAITING_FOR_REMOTE_KVS
    D.abort("d0")
    if variant == "green":
        D.step()  # hands the abort to the agent
        E.wait_for(lambda: D.agent._loads["d0"].aborted, what="the agent took the abort")
        for _ in range(10):
            D.step()
        assert "d0" not in D.freed, "given back before the room's final event was read"
    else:
        D.step_until(lambda: "d0" in D.freed, what="X's blocks given back")
        assert D.freed["d0"][1] == "finished_recving"
    D.agent.paused = False
    D.agent.wake()
    D.step_until(lambda: "d0" in D.freed, what="X's blocks given back")
    E.wait_for(lambda: D.agent.load_state("d0")[0] in (None, "done"), what="the agent took the RECV_DONE")
    assert D.loaded.get("d0") is None and "d0" not in D.loaded  # never reported as loaded to the engine
    if variant == "green":
        assert D.agent.load_state("d0") == (None, "aborted")
        assert D.marked(got["d0"][0], E.MARK), "decode blocks written after they were given back"
    else:
        assert not D.marked(got["d0"][0], E.MARK) and D.holds(x) is None


# Both pairs again through TP sizes that differ (one room per rank pair, each a share of the KV heads: prefill TP
# 2 -> decode TP 4, each decode rank one share of a prefill rank's; and 4 -> 2, each decode rank two shares). In the
# decode pair the last decode rank's share(s) are the ones in flight at the abort; every other decode rank has loaded
# and reported its own, so vLLM's KVOutputAggregator gives the blocks back at the last rank's report: the red one's
# at the abort.
TP_PATHS = [(2, 4), (4, 2)]
KV_HEADS = 4


def _het_pd(kv_proxy, p_tp, d_tp, d_cls):
    import vllm_engine as E
    return E.PD(kv_proxy.socket, p_kw=dict(tp=p_tp, kv_heads=KV_HEADS, extra={"kvstage_decode_tp_size": d_tp}),
                d_kw=dict(tp=d_tp, kv_heads=KV_HEADS), d_cls=d_cls)


def _recv_reported(D, rid):
    """The decode ranks whose get_finished reported rid's load."""
    return {rank for _, rank, how, r in D.reports if how == "finished_recving" and r == rid}


def _marked_on(D, E, blocks, rank):
    import torch
    idx = torch.tensor(blocks, dtype=torch.long)
    return all(bool((D._i16(D.kvs[rank][n])[:, idx] == E.MARK).all()) for n in E.LAYER_NAMES)


@pytest.mark.parametrize("variant", ["green", "red"])
def test_prefill_blocks_freed_once_every_rank_copied(kv_proxy, variant):
    """Prefill TP 2 staging for decode TP 4 (prefill rank 1 holds the shares of decode ranks 2 and 3): X finishes
    with rank 0's copies into slots done and rank 1's queued. Green: X's blocks stay X's until rank 1's copies ran,
    freed at the next step by finished_sending, once; every decode rank loads X exact. Red (freed in
    request_finished): Y gets X's blocks and writes them; rank 1's copies then stage Y's bytes: decode ranks 2 and
    3 receive Y's KV as X's, ranks 0 and 1 X's own."""
    import vllm_engine as E
    p_cls = kv.KvstageConnector if variant == "green" else FreesPrefillAtFinish
    pd = E.PD(kv_proxy.socket, p_kw=dict(tp=2, kv_heads=KV_HEADS, extra={"kvstage_decode_tp_size": 4}),
              d_kw=dict(tp=4, kv_heads=KV_HEADS), p_cls=p_cls)
    P, D = pd.P, pd.D
    try:
        gate = P.agents[1].copier = E.GatedCopier(hold={("p0", "stage")})
        x = pd.add(0, 22)
        P.step_until(lambda: "p0" in P.done, what="X finished")
        E.wait_for(lambda: gate.queued("p0", "stage") and P.agents[0].stage_state("p0")[0] == "ready",
                   what="rank 0's copies done, rank 1's queued")
        xblocks = list(x.blocks)
        if variant == "green":
            for _ in range(20):  # however long rank 1's copies wait, the blocks stay X's
                P.step()
                assert "p0" not in P.freed and P.agents[1].stage_state("p0")[0] == "staging"
        else:
            assert P.freed["p0"][1] == "at-finish"
        y = pd.add(1, 22)  # Y comes next and gets the freed blocks first
        P.step_until(lambda: "p1" in P.done, what="Y finished")  # Y's forward wrote its blocks on both ranks
        assert bool(set(y.blocks) & set(xblocks)) == (variant == "red")
        gate.release("p0")
        P.agents[1].wake()
        E.wait_for(lambda: P.agents[1].stage_state("p0")[0] == "ready", what="rank 1 copied X into slots")
        if variant == "green":
            assert "p0" not in P.freed  # copied just now; freed at the next step, by finished_sending, once
            step = P.step_no
            P.step()
            assert P.freed["p0"] == (step, "finished_sending")
        pd.run(lambda: {"d0", "d1"} <= set(D.freed), what="loaded")
        assert D.loaded["d1"] is None and P.double == [] and D.double == []
        d0, d1 = D.done_req["d0"], D.done_req["d1"]
        if variant == "green":
            assert D.loaded["d0"] is None, D.loaded["d0"]
        else:  # the shares rank 1 staged late hold Y's bytes (but the last token, which the decode side computes)
            assert D.loaded["d0"] is not None and "differ" in D.loaded["d0"]
            assert all(D.holds(d0, n=21, rank=r) is None for r in (0, 1))
            assert all(D.holds(d1, n=21, blocks=d0.blocks, rank=r) is None for r in (2, 3))
    finally:
        pd.close()
    assert_pool_free(kv_proxy.socket)


@pytest.mark.parametrize("d_cls,variant", [(Green, "green"), (FreesDecodeAtAbort, "red")], ids=["green", "red"])
@pytest.mark.parametrize("p_tp,d_tp", TP_PATHS, ids=[f"P{p}-D{d}" for p, d in TP_PATHS])
def test_decode_share_copy_out_queued_at_abort(kv_proxy, p_tp, d_tp, d_cls, variant):
    """Prefill TP p_tp, decode TP d_tp: X's shares land; the last decode rank's copy-out of its share(s) is queued (a
    copy stream behind), every other rank's done and reported; the engine aborts X. Green: the blocks come back only
    after the last rank's copy-outs are cancelled, and stay as the engine wrote them on every rank. Red: they come
    back at the abort; the queued copy-outs run later and write the last rank's heads of X into them."""
    import vllm_engine as E
    pd = _het_pd(kv_proxy, p_tp, d_tp, d_cls)
    D, last = pd.D, d_tp - 1
    n_shares = max(1, p_tp // d_tp)  # the prefill ranks holding some of a decode rank's heads
    try:
        gate = D.agents[last].copier = E.GatedCopier(hold={("d0", "load")})
        got = _quarantine(D, E)
        pd.add(0, 22)
        pd.run(lambda: len(gate.queued("d0", "load")) == n_shares and _recv_reported(D, "d0") == set(range(last)),
               what="the last rank's copy-outs queued, the others' loads reported")
        x = D.requests["d0"]
        assert x.status == E.RequestStatus.WAITING_FOR_REMOTE_KVS
        D.abort("d0")
        assert "d0" not in D.freed  # vLLM's own rule: a load in flight keeps its blocks
        D.step_until(lambda: "d0" in D.freed, what="X's blocks given back")
        assert D.freed["d0"][1] == "finished_recving" and D.marked(got["d0"][0], E.MARK)
        gate.release("d0")
        D.agents[last].wake()
        E.wait_for(lambda: all(h.done() for h in gate.of("d0", "load")), what="the copy stream drained")
        states = [h.state for h in gate.of("d0", "load")]
        if variant == "green":
            assert states == ["cancelled"] * n_shares, states
            assert D.marked(got["d0"][0], E.MARK), "decode blocks written after they were given back"
        else:
            assert states == ["done"] * n_shares, states
            # the last rank's heads of X landed in blocks given back; the other ranks' stay as the engine wrote them
            assert not _marked_on(D, E, got["d0"][0], last) and D.holds(x, rank=last) is None
            assert all(_marked_on(D, E, got["d0"][0], rank) for rank in range(last))
        D.step()
        assert D.double == [] and D.aggregator.pending() == ({}, {})
    finally:
        pd.close()
    assert_pool_free(kv_proxy.socket)


@pytest.mark.parametrize("d_cls,variant", [(Green, "green"), (FreesDecodeAtAbort, "red")], ids=["green", "red"])
@pytest.mark.parametrize("p_tp,d_tp", TP_PATHS, ids=[f"P{p}-D{d}" for p, d in TP_PATHS])
def test_decode_share_recv_done_read_after_abort(kv_proxy, p_tp, d_tp, d_cls, variant):
    """Prefill TP p_tp, decode TP d_tp: every share of X completes at the proxy; the last decode rank's agent takes
    no events meanwhile (the other ranks load and report theirs); the engine aborts X; only then does the last
    rank's agent read its RECV_DONE(s). Green: no copy-out, the blocks given back after that final event, untouched.
    Red: given back at the abort; the late RECV_DONE is copied into them on the last rank."""
    import vllm_engine as E
    pd = _het_pd(kv_proxy, p_tp, d_tp, d_cls)
    P, D = pd.P, pd.D
    last = D.agents[-1]
    try:
        got = _quarantine(D, E)
        last.paused = True
        pd.add(0, 22)
        pd.run(lambda: all(a.stage_state("p0") == (None, "sent") for a in P.agents)
               and _recv_reported(D, "d0") == set(range(d_tp - 1)),
               what="X sent by every prefill rank, every decode rank but the last reported")
        x = D.requests["d0"]
        assert x.status == E.RequestStatus.WAITING_FOR_REMOTE_KVS
        D.abort("d0")
        if variant == "green":
            D.step()  # hands the abort to the agents
            E.wait_for(lambda: last._loads["d0"].aborted, what="the last rank's agent took the abort")
            for _ in range(10):
                D.step()
            assert "d0" not in D.freed, "given back before the last rank's rooms' final events were read"
        else:
            D.step_until(lambda: "d0" in D.freed, what="X's blocks given back")
            assert D.freed["d0"][1] == "finished_recving"
        last.paused = False
        last.wake()
        D.step_until(lambda: "d0" in D.freed, what="X's blocks given back")
        E.wait_for(lambda: last.load_state("d0")[0] in (None, "done"), what="the last rank took its RECV_DONEs")
        assert "d0" not in D.loaded  # never reported as loaded to the engine
        if variant == "green":
            assert last.load_state("d0") == (None, "aborted")
            assert D.marked(got["d0"][0], E.MARK), "decode blocks written after they were given back"
        else:
            assert not _marked_on(D, E, got["d0"][0], d_tp - 1) and D.holds(x, rank=d_tp - 1) is None
            assert all(_marked_on(D, E, got["d0"][0], rank) for rank in range(d_tp - 1))
        D.step()
        assert D.double == [] and D.aggregator.pending() == ({}, {})
    finally:
        pd.close()
    assert_pool_free(kv_proxy.socket)
