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
