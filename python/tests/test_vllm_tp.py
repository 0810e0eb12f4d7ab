"""Tensor parallelism 2 on both sides, as vLLM runs it (tests/vllm_engine.py with tp=2): per engine one
scheduler-role connector and one worker-role connector per rank, each rank with its own shard of the KV cache into
which the model writes other bytes than into the other rank's; each rank's metadata a pickled copy (as
MultiprocExecutor sends it); the ranks' finished_sending / finished_recving aggregated as vLLM's KVOutputAggregator
does (a request is reported to the scheduler once every rank has reported it), their invalid block ids together.
Prefill rank r listens on kvstage_port + r; decode rank r loads from it and from no other.

Then the topologies of other sizes: TP sizes of which one divides the other (NixlConnector's rank pairs and head
slices: one room per rank pair with that pair's KV heads), MLA (one room all decode ranks share, its bytes moved once
by the proxy's count), block sizes of which one divides the other (the room as token positions)."""
import collections
import logging
import random

import pytest

import vllm_stubs  # noqa: F401 - vLLM's stand-ins where vllm is not importable, before kvstage.vllm
from kvstage import vllm as kv
from sglang_common import NEED_TORCH, assert_pool_free, kv_proxy, two_proxies  # noqa: F401 (fixtures)

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

pytestmark = NEED_TORCH

N = 40
PLANS = {0: "prefix", 1: "prefix", 2: "d-abort-waiting", 3: "d-mid-r1", 4: "d-after", 5: "d-fail-r1",
         6: "p-abort-prefill", 7: "p-abort-staging-r1"}
# plan -> (prefill status at request_finished, decode outcome or None: never reaches the decode engine)
EXPECT = {
    None: ("FINISHED_LENGTH_CAPPED", "ok"),
    "prefix": ("FINISHED_LENGTH_CAPPED", "ok"),                  # half the blocks already cached on the decode side
    "d-abort-waiting": ("FINISHED_LENGTH_CAPPED", "aborted"),    # aborted before allocation: both ranks release
    "d-mid-r1": ("FINISHED_LENGTH_CAPPED", "aborted"),           # rank 0 loaded, rank 1's room held back: aborted
    "d-after": ("FINISHED_LENGTH_CAPPED", "ok+aborted"),         # aborted after the load, while decoding
    "d-fail-r1": ("FINISHED_LENGTH_CAPPED", "load-failed"),      # rank 1's copy into slots fails, rank 0's waits
    "p-abort-prefill": ("FINISHED_ABORTED", None),               # aborted between two prefill chunks
    "p-abort-staging-r1": ("FINISHED_ABORTED", None),            # aborted while rank 1's copies into slots wait
}


def _steps(eng, rid, how):
    """{rank: the step it reported rid in `how`} from the ranks' own get_finished."""
    return {rank: step for step, rank, h, r in eng.reports if r == rid and h == how}


def _record_decode_frees(D, E, k_of, results, quarantine):
    """The decode engine's on_free: each request's outcome into results; an aborted one's blocks marked (the engine's
    again, on every rank: nothing else may write them) and kept in quarantine to be checked at the end."""
    def d_free(r, how):
        k = k_of[r.request_id]
        status = D.done[r.request_id][0]
        if status == "FINISHED_ABORTED":
            D.mark(r.blocks, E.MARK)
            quarantine.append((k, list(r.blocks)))
            outcome = "ok+aborted" if r.load_done else "aborted"
        else:
            outcome = "load-failed" if status == "FINISHED_ERROR" else "ok"
        results[k] = dict(outcome=outcome, wrong=D.loaded.get(r.request_id) if r.load_done else None, how=how,
                          why=[a.ended.get(r.request_id) for a in D.agents])
        return status == "FINISHED_ABORTED"
    return d_free


def _assert_outcomes(P, D, plans, results, expect, n):
    """Each of n requests ended as expect[its plan] says on both engines (prefill status, decode outcome), every
    completed one's decode KV equals the prefill's, and at least 16 plain ones loaded without a failure: those."""
    problems = []
    for k in range(n):
        want_status, want_outcome = expect[plans[k]]
        if P.done[f"p{k}"][0] != want_status:
            problems.append(f"request {k} ({plans[k]}): prefill ended {P.done[f'p{k}'][0]}, expected {want_status}")
        got = results.get(k)
        if want_outcome is None:
            if got is not None or f"d{k}" in D.done:
                problems.append(f"request {k} ({plans[k]}): reached the decode engine: {got}")
        elif got is None or got["outcome"] != want_outcome:
            problems.append(f"request {k} ({plans[k]}): decode {got}, expected {want_outcome}")
        elif want_outcome.startswith("ok") and got["wrong"] is not None:
            problems.append(f"request {k} ({plans[k]}): decode blocks differ from the prefill's: {got['wrong']}")
    assert not problems, "\n".join(problems)
    normal = [k for k in range(n) if plans[k] in (None, "prefix")]
    assert len(normal) >= 16 and all(D.loaded[f"d{k}"] is None for k in normal)
    return normal


def test_tp2_engines_with_aborts(kv_proxy):
    """40 requests through a TP=2 prefill engine and a TP=2 decode engine: every completed request's decode blocks on
    each rank hold that rank's prefill KV (the ranks' KV differ, so never the other rank's); aborts on both sides at
    the points where the ranks disagree (one rank's load done, the other's held; one rank's copy failed, the other's
    waiting; one rank's copies into slots waiting at an abort); a request is freed only at the step its last rank
    reported it; every block and the kvstage pool free at the end."""
    import vllm_engine as E
    rng = random.Random(20250602)
    plans = {k: PLANS.get(k) for k in range(N)}
    sizes = {k: (40 if plans[k] in ("d-mid-r1", "d-fail-r1", "p-abort-prefill") else rng.randint(5, 40))
             for k in range(N)}
    seeds = {k: rng.getrandbits(40) for k in range(N)}
    pair = E.PD(kv_proxy.socket, p_kw=dict(tp=2, num_blocks=192), d_kw=dict(tp=2, num_blocks=256))
    P, D = pair.P, pair.D
    assert [a.tp_rank for a in P.agents + D.agents] == [0, 1, 0, 1]
    assert [a.listen_port - P.agents[0].listen_port for a in P.agents] == [0, 1]
    try:
        k_of = {f"p{k}": k for k in range(N)} | {f"d{k}": k for k in range(N)}
        gates = [E.GatedCopier(hold={("p5", "stage")}),
                 E.GatedCopier(hold={("p7", "stage")}, fail={("p5", "stage")})]
        for a, g in zip(P.agents, gates):
            a.copier = g
        P.agents[1].hold_send = lambda req, chunk: req == "p3" and chunk >= 1
        results, quarantine, p_at_free = {}, [], {}

        D.on_free = _record_decode_frees(D, E, k_of, results, quarantine)

        def p_free(r, how):
            p_at_free[r.request_id] = (how, [a.stage_state(r.request_id)[0] for a in P.agents])
            return False  # the blocks go back to the pool
        P.on_free = p_free

        def drive(new):
            for r in new:
                if plans[k_of[r.request_id]] == "d-abort-waiting":
                    D.abort(r.request_id)  # before the decode scheduler ever saw it
            for rid, r in list(P.requests.items()):
                plan = plans[k_of[rid]]
                if r.is_finished():
                    continue
                if plan == "p-abort-prefill" and 0 < r.num_computed_tokens < r.num_prompt_tokens:
                    P.abort(rid)
                elif plan == "p-abort-staging-r1" and r.output and gates[1].queued(rid, "stage"):
                    P.abort(rid)  # rank 0's copies done, rank 1's wait behind the gate
            recv = {(rank, rid) for _, rank, how, rid in D.reports if how == "finished_recving"}
            for rid, r in list(D.requests.items()):
                plan = plans[k_of[rid]]
                if r.is_finished():
                    continue
                if (plan == "d-mid-r1" and r.status == E.RequestStatus.WAITING_FOR_REMOTE_KVS and (0, rid) in recv
                        and (1, rid) not in recv):
                    D.abort(rid)  # rank 0 reported its load, rank 1's still open
                elif plan == "d-after" and r.load_done and r.output:
                    D.abort(rid)

        for k in range(N):
            pair.add(k, sizes[k], seed=seeds[k], max_tokens=64 if plans[k] == "p-abort-staging-r1" else 1)
        want = {k for k in range(N) if EXPECT[plans[k]][1] is not None}
        prefix = {k: (sizes[k] // E.BLOCK_SIZE) // 2 for k in range(N) if plans[k] == "prefix"}
        pair.run(lambda: set(results) == want and not P.requests and not D.requests, timeout=60,
                 what="every request ended", on_route=drive, prefix=prefix)

        normal = _assert_outcomes(P, D, plans, results, EXPECT, N)
        for k in range(N):  # what "each rank its own" rests on: the two ranks' KV of a request differ everywhere
            r = P.done_req[f"p{k}"]
            assert bool((P.content(r, 0) != P.content(r, 1)).float().mean() > 0.99)

        # aggregation: freed at the step the last rank reported, never before
        s = _steps(D, "d3", "finished_recving")
        assert s[0] < s[1] == D.freed["d3"][0] and D.freed["d3"][1] == "finished_recving", (s, D.freed["d3"])
        s = _steps(D, "d5", "finished_recving")  # rank 1 failed first: the request failed then, freed by rank 0's
        assert s[1] < s[0] == D.freed["d5"][0] and D.freed["d5"][1] == "finished_recving", (s, D.freed["d5"])
        assert "aborted by the prefill side" in results[5]["why"][1] and "aborted" in results[5]["why"][0], results[5]
        s = _steps(P, "p5", "finished_sending")  # rank 1's copy failed at once; rank 0's waited for the decode abort
        assert s[1] <= s[0] == P.freed["p5"][0], (s, P.freed["p5"])
        assert "copying blocks into slots failed" in P.agents[1].ended["p5"]
        s = _steps(P, "p7", "finished_sending")
        assert set(s) == {0, 1} and max(s.values()) == P.freed["p7"][0], (s, P.freed["p7"])
        assert gates[1].of("p7", "stage") and {h.state for h in gates[1].of("p7", "stage")} == {"cancelled"}
        for rank in (0, 1):  # the decode side aborted before allocating: each rank told its own prefill rank
            assert "released" in P.agents[rank].ended["p2"], P.agents[rank].ended["p2"]
        for eng in (P, D):
            twice = [key for key, n in collections.Counter((rk, h, rid) for _, rk, h, rid in eng.reports).items()
                     if n > 1]
            assert twice == [] and eng.aggregator.pending() == ({}, {}) and eng.double == []
        # prefill blocks: handed off or aborted after staging began -> freed by finished_sending, with no rank's
        # copy into slots still running; aborted between chunks -> at request_finished
        for k in range(N):
            how, states = p_at_free[f"p{k}"]
            if plans[k] == "p-abort-prefill":
                assert how == "at-finish", (k, how)
            else:
                assert how == "finished_sending" and "staging" not in states, (k, plans[k], how, states)
        assert len(quarantine) >= 3 and all(D.marked(b, E.MARK) for _, b in quarantine)
        assert len(P.free) == P.num_blocks and len(D.free) + sum(len(b) for _, b in quarantine) == D.num_blocks
    finally:
        pair.close()
    s = assert_pool_free(kv_proxy.socket)
    assert s["rooms"]["done"] >= 2 * len(normal)


def test_a_load_reaching_another_rank_is_refused(kv_proxy, caplog):
    """The two ranks' shards have the same layout, so only the rank tells them apart: a decode rank 0 load that
    reaches prefill rank 1's side channel (a remote_port one off) is refused by rank 1, whose staged KV stays for its
    own decode rank (loaded exact afterwards). Why it matters: a decode worker that takes itself for rank 1 loads rank
    1's shard into rank 0's cache, and the engines' check names it."""
    import vllm_engine as E
    caplog.set_level(logging.INFO, logger="kvstage.vllm")
    pair = E.PD(kv_proxy.socket, p_kw=dict(tp=2), d_kw=dict(tp=2))
    P, D = pair.P, pair.D
    try:
        for k in range(2):
            pair.add(k, 22)
        P.step_until(lambda: {"p0", "p1"} <= set(P.freed), what="staged on both ranks")
        pair.routed |= {"p0", "p1"}  # the test routes them itself
        base = P.cfg.kv_transfer_config.kv_connector_extra_config["kvstage_port"]
        nb = kv._cdiv(22, E.BLOCK_SIZE)
        blocks = D._alloc(2 * nb)
        a = D.agents[0]
        got = set()

        def ended(req):
            got.update(a.take_finished()[1])  # drained: these loads are not the decode scheduler's
            return req in got
        a.post(a.cmd_recv, kv.RecvSpec("x0", "p0", "127.0.0.1", base + 1, nb, tuple(blocks[:nb]), 0, 10.0))
        E.wait_for(lambda: ended("x0"), what="the misrouted load ended")
        assert "aborted by the prefill side" in a.ended["x0"], a.ended["x0"]
        assert any("a load for TP rank 0 reached rank 1" in m for m in caplog.messages), caplog.messages
        assert P.agents[1].stage_state("p0")[0] == "ready" and D.marked(blocks[:nb], 0)
        # red: rank 0's worker taking itself for rank 1 gets rank 1's shard, which the check tells apart
        a.tp_rank = 1
        try:
            a.post(a.cmd_recv, kv.RecvSpec("x1", "p1", "127.0.0.1", base, nb, tuple(blocks[nb:]), 0, 10.0))
            E.wait_for(lambda: ended("x1"), what="the lying load ended")
        finally:
            a.tp_rank = 0
        assert a.ended["x1"] == "done"
        assert D.holds(P.done_req["p1"], blocks=blocks[nb:], rank=0) == "rank 0: layer 0: holds rank 1's KV"
        D.free.extend(reversed(blocks))
        # p0, routed as it should be, loads exact on both ranks: rank 1's stage was left alone
        pair.routed.discard("p0")
        pair.run(lambda: "d0" in D.freed, what="d0 loaded")
        assert D.loaded["d0"] is None and D.done["d0"][0] == "FINISHED_LENGTH_CAPPED"
        assert D.double == [] and P.double == []
    finally:
        pair.close()
    assert_pool_free(kv_proxy.socket)


# Prefill and decode of different TP sizes (NixlConnector's TransferTopology @ 9aaf83ef502f): the model has KV_HEADS KV
# heads, each engine's rank r holds heads [r * KV_HEADS / tp, (r + 1) * KV_HEADS / tp); the prefill instance stages
# each rank's KV in the head slices of the decode ranks it serves (kvstage_decode_tp_size).
KV_HEADS = 4
HET = [(1, 2, "kv-first"), (2, 4, "kv-first"), (4, 2, "kv-first"), (2, 1, "kv-first"), (2, 4, "hnd"),
       (4, 2, "block-first"), (1, 2, "flashinfer")]
HET_PLANS = {0: "prefix", 1: "prefix", 2: "d-abort-waiting", 3: "d-mid", 4: "d-mid-share", 5: "d-fail",
             6: "d-after", 7: "p-abort-staging"}
HET_EXPECT = {
    None: ("FINISHED_LENGTH_CAPPED", "ok"),
    "prefix": ("FINISHED_LENGTH_CAPPED", "ok"),              # half the blocks already cached on the decode side
    "d-abort-waiting": ("FINISHED_LENGTH_CAPPED", "aborted"),  # aborted before allocation: every prefill rank told
    "d-mid": ("FINISHED_LENGTH_CAPPED", "aborted"),          # decode rank 0 loaded, the last one's copy-out held
    "d-mid-share": ("FINISHED_LENGTH_CAPPED", "aborted"),    # prefill rank 0's shares landed, the last rank's held
    "d-fail": ("FINISHED_LENGTH_CAPPED", "load-failed"),     # the last prefill rank's copy into slots fails
    "d-after": ("FINISHED_LENGTH_CAPPED", "ok+aborted"),     # aborted after the load, while decoding
    "p-abort-staging": ("FINISHED_ABORTED", None),           # aborted while the last rank's copies into slots wait
}


@pytest.mark.parametrize("p_tp,d_tp,layout", HET, ids=[f"P{p}-D{d}-{layout}" for p, d, layout in HET])
def test_tp_sizes_differ(kv_proxy, p_tp, d_tp, layout):
    """24 requests from a prefill engine of TP size p_tp to a decode engine of TP size d_tp, one room per rank pair
    carrying that pair's heads: every completed request's decode blocks hold, on each decode rank, exactly its heads
    of the prefill's KV; aborts from either side while shares are in flight (one decode rank done and another's share
    held; one prefill rank's shares landed and another's held; one prefill rank's copy failed); blocks of aborted
    requests untouched once given back; each rank pair's room ends done for a completed request; pools end free. With
vLLM's cache layouts: (2, num_blocks, block_size, heads, head_size), blocks first, and HND (a block's heads
outermost in memory: one run per head slice of a block instead of one per position)."""
    normal = _tp_sizes_differ(kv_proxy.socket, kv_proxy.socket, p_tp, d_tp, layout)
    s = assert_pool_free(kv_proxy.socket)
    assert s["rooms"]["done"] >= max(p_tp, d_tp) * normal  # one room per rank pair of a request


def _tp_sizes_differ(p_socket, d_socket, p_tp, d_tp, layout):
    """test_tp_sizes_differ's engines and checks, the prefill engine on the proxy at p_socket, the decode engine on
    the one at d_socket; returns how many requests completed without an abort."""
    import vllm_engine as E
    n = 24
    rng = random.Random(20261202 + 10 * p_tp + d_tp)
    plans = {k: HET_PLANS.get(k) for k in range(n)}
    if d_tp == 1:
        plans[3] = None  # one decode rank: no two to disagree
    if p_tp == 1:
        plans[4] = None  # one prefill rank: no other's share to land first
    sizes = {k: rng.randint(5, 40) for k in range(n)}
    seeds = {k: rng.getrandbits(40) for k in range(n)}
    pair = E.PD(p_socket,
                p_kw=dict(tp=p_tp, num_blocks=192, kv_heads=KV_HEADS, extra={"kvstage_decode_tp_size": d_tp},
                          kv_layout=layout),
                d_kw=dict(tp=d_tp, num_blocks=256, kv_heads=KV_HEADS, kv_layout=layout), d_socket=d_socket)
    P, D = pair.P, pair.D
    try:
        k_of = {f"p{k}": k for k in range(n)} | {f"d{k}": k for k in range(n)}
        p_gate = E.GatedCopier(hold={("p7", "stage")}, fail={("p5", "stage")})
        P.agents[-1].copier = p_gate
        if plans[4] == "d-mid-share":
            P.agents[-1].hold_send = lambda req, chunk: req == "p4"
        if d_tp > 1:
            D.agents[-1].copier = E.GatedCopier(hold={("d3", "load")})
        results, quarantine = {}, []

        D.on_free = _record_decode_frees(D, E, k_of, results, quarantine)

        def drive(new):
            for r in new:
                if plans[k_of[r.request_id]] == "d-abort-waiting":
                    D.abort(r.request_id)  # before the decode scheduler ever saw it
            for rid, r in list(P.requests.items()):
                if plans[k_of[rid]] == "p-abort-staging" and not r.is_finished() and r.output:
                    # its prompt's forward sealed the stage: the last rank's copies are (about to be) queued behind
                    # the gate, the other ranks' done; waited for here, or the request might finish first
                    E.wait_for(lambda: p_gate.queued(rid, "stage"), what="the last rank's copies queued")
                    P.abort(rid)
            recv = {(rank, rid) for _, rank, how, rid in D.reports if how == "finished_recving"}
            for rid, r in list(D.requests.items()):
                plan = plans[k_of[rid]]
                if r.is_finished():
                    continue
                waiting = r.status == E.RequestStatus.WAITING_FOR_REMOTE_KVS
                if plan == "d-mid" and waiting and (0, rid) in recv and (d_tp - 1, rid) not in recv:
                    D.abort(rid)  # decode rank 0 reported its load, the last rank's copy-out is held
                elif plan == "d-mid-share" and waiting and P.agents[0].ended.get("p4") == "sent":
                    D.abort(rid)  # prefill rank 0's shares landed; the last prefill rank's are held
                elif plan == "d-after" and r.load_done and r.output:
                    D.abort(rid)

        for k in range(n):
            pair.add(k, sizes[k], seed=seeds[k], max_tokens=64 if plans[k] == "p-abort-staging" else 1)
        want = {k for k in range(n) if HET_EXPECT[plans[k]][1] is not None}
        prefix = {k: (sizes[k] // E.BLOCK_SIZE) // 2 for k in range(n) if plans[k] == "prefix"}
        pair.run(lambda: set(results) == want and not P.requests and not D.requests, timeout=60,
                 what="every request ended", on_route=drive, prefix=prefix)

        normal = _assert_outcomes(P, D, plans, results, HET_EXPECT, n)
        if "d-fail" in plans.values():
            assert "copying blocks into slots failed" in P.agents[-1].ended["p5"]
        for rank in range(p_tp):  # the decode side aborted before allocating: every prefill rank was told
            assert "released" in P.agents[rank].ended["p2"], (rank, P.agents[rank].ended["p2"])
        for eng in (P, D):
            twice = [key for key, c in collections.Counter((rk, h, rid) for _, rk, h, rid in eng.reports).items()
                     if c > 1]
            assert twice == [] and eng.double == []
            assert eng.aggregator is None or eng.aggregator.pending() == ({}, {})
        assert len(quarantine) >= 3 and all(D.marked(b, E.MARK) for _, b in quarantine)
        assert len(P.free) == P.num_blocks and len(D.free) + sum(len(b) for _, b in quarantine) == D.num_blocks
    finally:
        pair.close()
    return len(normal)


def test_a_misrouted_share_is_refused(kv_proxy, caplog):
    """Prefill TP 2 staged for decode TP 4 (prefill rank 1 holds the shares of decode ranks 2 and 3): a share load
    that reaches the wrong prefill rank, comes from a decode instance of another TP size, or expects other heads (a
    decode model of another KV head count) is refused at open with the reason, its room aborted, nothing written into
    the decode blocks; the staged shares stay for their own decode ranks, which load them exact afterwards."""
    import vllm_engine as E
    caplog.set_level(logging.INFO, logger="kvstage.vllm")
    pair = E.PD(kv_proxy.socket, p_kw=dict(tp=2, kv_heads=KV_HEADS, extra={"kvstage_decode_tp_size": 4}),
                d_kw=dict(tp=4, kv_heads=KV_HEADS))
    P, D = pair.P, pair.D
    wrong = E.Engine(kv_proxy.socket, E.free_port(), 64, role="kv_consumer", tp=4, kv_heads=2 * KV_HEADS)
    narrow = E.Engine(kv_proxy.socket, E.free_port(), 64, role="kv_consumer", tp=4, kv_heads=KV_HEADS, head_dim=8)
    try:
        pair.add(0, 22)
        P.step_until(lambda: "p0" in P.freed, what="staged on both ranks")
        pair.routed.add("p0")  # the test routes it itself
        base = P.cfg.kv_transfer_config.kv_connector_extra_config["kvstage_port"]
        nb = kv._cdiv(22, E.BLOCK_SIZE)
        got = set()

        def load(eng, rank, spec, tp_size=None):
            a = eng.agents[rank]
            a.tp_size, saved = tp_size or a.tp_size, a.tp_size
            try:
                a.post(a.cmd_recv, spec)

                def ended():
                    got.update(a.take_finished()[1])  # drained: these loads are not the decode scheduler's
                    return spec.req_id in got
                E.wait_for(ended, what=f"load {spec.req_id} ended")
            finally:
                a.tp_size = saved
            return a.ended[spec.req_id]

        blocks = D._alloc(nb)
        # decode rank 0 (its heads are prefill rank 0's) at prefill rank 1's port
        why = load(D, 0, kv.RecvSpec("x0", "p0", "127.0.0.1", base + 1, nb, tuple(blocks), 0, 10.0, remote_tp=1))
        assert "aborted by the prefill side" in why, why
        # rank 0 of a decode instance of TP size 2 (as it takes itself): staged for 4
        why = load(D, 0, kv.RecvSpec("x1", "p0", "127.0.0.1", base, nb, tuple(blocks), 0, 10.0), tp_size=2)
        assert "aborted by the prefill side" in why, why
        # decode rank 0 of a model with twice the KV heads: it expects heads [0, 2) of prefill rank 0, which holds
        # heads [0, 1) for it
        wb = wrong._alloc(nb)
        why = load(wrong, 0, kv.RecvSpec("x2", "p0", "127.0.0.1", base, nb, tuple(wb), 0, 10.0, remote_tp=2))
        assert "aborted by the prefill side" in why, why
        # decode rank 1 of a model with other head sizes (its dtype, layer count would show the same way)
        nbk = narrow._alloc(nb)
        why = load(narrow, 1, kv.RecvSpec("x3", "p0", "127.0.0.1", base, nb, tuple(nbk), 0, 10.0, remote_tp=2))
        assert "aborted by the prefill side" in why, why
        msgs = "\n".join(caplog.messages)
        assert "share layouts differ" in msgs, msgs
        assert "a load for decode TP rank 0 reached prefill rank 1, which serves decode ranks [2, 3]" in msgs, msgs
        assert "staged for decode TP size 4, a load from a decode rank of TP size 2" in msgs, msgs
        assert "decode rank 0 expects KV heads [0, 2] from prefill rank 0, whose share for it is heads [0, 1]" in msgs
        assert D.marked(blocks, 0) and wrong.marked(wb, 0) and narrow.marked(nbk, 0)
        assert [a.stage_state("p0")[0] for a in P.agents] == ["ready", "ready"]
        D.free.extend(reversed(blocks))
        pair.routed.discard("p0")
        pair.run(lambda: "d0" in D.freed, what="d0 loaded")
        assert D.loaded["d0"] is None and D.done["d0"][0] == "FINISHED_LENGTH_CAPPED"
        assert D.double == [] and P.double == []
    finally:
        wrong.close()
        narrow.close()
        pair.close()
    assert_pool_free(kv_proxy.socket)


MLA_TP = [(2, 4), (1, 2), (2, 1), (2, 2), (3, 2), (4, 2)]


@pytest.mark.parametrize("p_tp,d_tp", MLA_TP, ids=[f"P{p}-D{d}" for p, d in MLA_TP])
def test_mla_kv_is_read_once(kv_proxy, p_tp, d_tp):
    """MLA (use_mla: every TP rank holds the same KV): one prefill rank stages a request, the ranks in turn (12
    requests: 12 / P each), no other prefill rank copies a byte of it; the decode rank paired with that prefill rank
    (kv.mla_reader, NixlConnector's pairs) opens one room that every decode rank reads (the others join it): by the
    proxy's own counters each request's bytes move once and in one room, whatever the TP sizes (P > D, P < D, P = D,
    neither dividing the other); every decode rank's blocks hold the prefill's KV. Then aborts: one decode rank's
    copy-out held when the request is aborted, a copy into slots failing (the load fails on every rank), an abort
    before the load; blocks given back untouched; the pool ends free."""
    _mla_read_once(kv_proxy.socket, kv_proxy.socket, p_tp, d_tp)
    assert_pool_free(kv_proxy.socket)


def _mla_read_once(p_socket, d_socket, p_tp, d_tp, on_loaded=None):
    """test_mla_kv_is_read_once's engines and checks, the prefill engine on the proxy at p_socket, the decode engine
    on the one at d_socket; on_loaded(total bytes of the requests, the prefill proxy's stats before and after) once
    every request without an abort has loaded."""
    import vllm_engine as E
    from sglang_common import stat
    pair = E.PD(p_socket, p_kw=dict(tp=p_tp, num_blocks=192, mla=True),
                d_kw=dict(tp=d_tp, num_blocks=256, mla=True), d_socket=d_socket)
    P, D = pair.P, pair.D
    try:
        sizes = {k: 5 + 3 * k for k in range(12)}
        nbytes = {k: P.agents[0].layout.nbytes(kv._cdiv(n, E.BLOCK_SIZE)) for k, n in sizes.items()}
        before, p_before = stat(d_socket), stat(p_socket)
        for k, n in sizes.items():
            pair.add(k, n)
        pair.run(lambda: {f"d{k}" for k in sizes} <= set(D.freed), what="every request loaded")
        after, p_after = stat(d_socket), stat(p_socket)
        assert all(D.loaded[f"d{k}"] is None and D.done[f"d{k}"][0] == "FINISHED_LENGTH_CAPPED" for k in sizes)
        # by the decode proxy's count (the one where the rooms land), once, not once per decode rank
        moved = after["bytes_moved"] - before["bytes_moved"]
        assert moved == sum(nbytes.values()), (moved, sum(nbytes.values()), d_tp)
        assert after["rooms"]["done"] - before["rooms"]["done"] == len(sizes)
        if on_loaded is not None:
            on_loaded(sum(nbytes.values()), p_before, p_after)
        # one prefill rank staged each request, the one its params name; the ranks took turns: 12 / P each
        stager = {k: P.done[f"p{k}"][1]["kvstage"]["mla_rank"] for k in sizes}
        for k, r in stager.items():
            assert P.agents[r].ended[f"p{k}"] == "sent", (k, r, P.agents[r].ended[f"p{k}"])
            assert all(f"prefill rank {r} stages" in P.agents[o].ended[f"p{k}"] for o in range(p_tp) if o != r)
        assert collections.Counter(stager.values()) == {r: len(sizes) // p_tp for r in range(p_tp)}, stager

        # aborts and failures: the copy into slots fails on whichever prefill rank stages p21
        for a in P.agents:
            a.copier = E.GatedCopier(fail={("p21", "stage")})
        if d_tp > 1:
            D.agents[-1].copier = E.GatedCopier(hold={("d20", "load")})
        results, quarantine = {}, []

        def d_free(r, how):
            status = D.done[r.request_id][0]
            if status == "FINISHED_ABORTED":
                D.mark(r.blocks, E.MARK)
                quarantine.append(list(r.blocks))
            results[r.request_id] = (status, r.load_done, [a.ended.get(r.request_id) for a in D.agents])
            return status == "FINISHED_ABORTED"
        D.on_free = d_free

        def drive(new):
            recv = {(rank, rid) for _, rank, how, rid in D.reports if how == "finished_recving"}
            for r in new:
                if r.request_id == "d22":
                    D.abort(r.request_id)
            r = D.requests.get("d20")
            if r is not None and not r.is_finished() and (0, "d20") in recv and d_tp > 1:
                D.abort("d20")  # rank 0 copied the shared room; the last rank's copy-out is held
        for k in (20, 21, 22, 23):
            pair.add(k, 30)
        pair.run(lambda: {f"d{k}" for k in (20, 21, 22, 23)} <= set(results) and not P.requests and not D.requests,
                 on_route=drive, what="the aborts ended")
        assert results["d20"][0] == ("FINISHED_ABORTED" if d_tp > 1 else "FINISHED_LENGTH_CAPPED"), results["d20"]
        assert results["d21"][0] == "FINISHED_ERROR", results["d21"]
        # the room ended for every reader, also one that came to join it after (its join refused: aborted, or gone
        # once the others closed it)
        assert all("aborted" in w or "ESTALE" in w for w in results["d21"][2]), results["d21"]
        p22 = P.done["p22"][1]["kvstage"]["mla_rank"]
        assert results["d22"][0] == "FINISHED_ABORTED" and "released" in P.agents[p22].ended["p22"]
        assert results["d23"][0] == "FINISHED_LENGTH_CAPPED" and D.loaded["d23"] is None
        assert all(D.marked(b, E.MARK) for b in quarantine)
        assert len(P.free) == P.num_blocks and len(D.free) + sum(map(len, quarantine)) == D.num_blocks
        assert D.double == [] and P.double == []
    finally:
        pair.close()


def test_mla_pull_from_another_decode_rank_is_refused(kv_proxy, caplog, monkeypatch):
    """MLA, prefill TP 2 -> decode TP 4: a decode instance that pairs every prefill rank with decode rank 0 (not
    mla_reader's p*D//P) gets the requests prefill rank 0 staged, exact; prefill rank 1 refuses the pulls for its own
    (it serves decode rank 2) with the reason, the loads fail on every decode rank (vLLM recomputes or fails them), the
    refused stages expire at the stage timeout and the pool ends free."""
    import vllm_engine as E
    caplog.set_level(logging.INFO, logger="kvstage.vllm")
    monkeypatch.setattr("kvstage.vllm.scheduler.mla_reader", lambda p, p_tp, d_tp: 0)  # the decode side's pairing
    pair = E.PD(kv_proxy.socket, p_kw=dict(tp=2, mla=True, extra={"kvstage_stage_timeout": 1.0}),
                d_kw=dict(tp=4, mla=True))
    P, D = pair.P, pair.D
    try:
        for k in range(4):
            pair.add(k, 9 + k)
        pair.run(lambda: {f"d{k}" for k in range(4)} <= set(D.freed), what="every load ended")
        stager = {k: P.done[f"p{k}"][1]["kvstage"]["mla_rank"] for k in range(4)}
        assert sorted(stager.values()) == [0, 0, 1, 1], stager
        for k, r in stager.items():
            if r == 0:
                assert D.done[f"d{k}"][0] == "FINISHED_LENGTH_CAPPED" and D.loaded[f"d{k}"] is None
            else:
                assert D.done[f"d{k}"][0] == "FINISHED_ERROR", (k, D.done[f"d{k}"])
        assert "MLA: prefill rank 1 serves decode rank 2 of TP size 4, not decode rank 0" in caplog.text
        E.wait_for(lambda: all("expired" in str(P.agents[1].ended.get(f"p{k}")) for k, r in stager.items() if r),
                   what="the refused stages expired")
    finally:
        pair.close()
    assert_pool_free(kv_proxy.socket)


# Prefill and decode of different block sizes (NixlConnector's block_size_ratio: one divides the other)
BS = [(4, 8, 1, 1, "kv-first"), (8, 4, 1, 1, "kv-first"), (4, 16, 2, 2, "block-first"), (8, 4, 2, 4, "mla")]


@pytest.mark.parametrize("p_bs,d_bs,p_tp,d_tp,layout", BS,
                         ids=[f"bs{p}-bs{d}-P{pt}-D{dt}-{layout}" for p, d, pt, dt, layout in BS])
def test_block_sizes_differ(kv_proxy, p_bs, d_bs, p_tp, d_tp, layout):
    """16 requests from a prefill engine of block size p_bs to a decode engine of block size d_bs: the room is the
    prefill's blocks as token positions, the decode rank writes each position into its own block at its own offset
    (the last block partly when the prefill's blocks end inside it): every completed request's decode blocks hold the
    prefill's KV position for position, with the decode side's prefix cache too; aborts before and after the load;
    pools end free."""
    import vllm_engine as E
    rng = random.Random(20261202 + p_bs * 100 + d_bs)
    mla = layout == "mla"
    kw = dict(mla=True) if mla else dict(kv_layout=layout)
    pair = E.PD(kv_proxy.socket, p_kw=dict(tp=p_tp, num_blocks=192, block_size=p_bs, **kw),
                d_kw=dict(tp=d_tp, num_blocks=256, block_size=d_bs, **kw))
    P, D = pair.P, pair.D
    try:
        plans = {k: {2: "d-abort-waiting", 3: "d-after", 4: "prefix", 5: "prefix"}.get(k) for k in range(16)}
        sizes = {k: rng.randint(5, 60) for k in range(16)}
        results = {}

        def d_free(r, how):
            results[r.request_id] = (D.done[r.request_id][0], r.load_done)
            return False
        D.on_free = d_free

        def drive(new):
            for r in new:
                if plans[int(r.request_id[1:])] == "d-abort-waiting":
                    D.abort(r.request_id)
            r = D.requests.get("d3")
            if r is not None and not r.is_finished() and r.load_done and r.output:
                D.abort("d3")
        for k, n in sizes.items():
            pair.add(k, n)
        prefix = {k: (sizes[k] // d_bs) // 2 for k in range(16) if plans[k] == "prefix"}
        pair.run(lambda: len(results) == 16 and not P.requests and not D.requests, on_route=drive, prefix=prefix,
                 what="every request ended")
        for k in range(16):
            status, loaded = results[f"d{k}"]
            if plans[k] == "d-abort-waiting":
                assert status == "FINISHED_ABORTED" and not loaded, (k, results[f"d{k}"])
                assert "released" in P.agents[0].ended[f"p{k}"], P.agents[0].ended[f"p{k}"]
            elif plans[k] == "d-after":
                assert status == "FINISHED_ABORTED" and loaded and D.loaded[f"d{k}"] is None, (k, D.loaded[f"d{k}"])
            else:
                assert status == "FINISHED_LENGTH_CAPPED" and D.loaded[f"d{k}"] is None, (
                    k, plans[k], status, D.loaded.get(f"d{k}"))
        assert any(D.done_req[f"d{k}"].prefix_blocks for k in prefix)
        assert len(P.free) == P.num_blocks and len(D.free) == D.num_blocks and D.double == [] and P.double == []
    finally:
        pair.close()
    assert_pool_free(kv_proxy.socket)


@pytest.mark.parametrize("layout", ["hnd", "flashinfer"])
def test_block_sizes_differ_with_blocks_not_token_major_fails_the_load(kv_proxy, caplog, layout):
    """HND blocks (a block's heads outermost) and FlashInfer's (a block's K, then its V) are not token-major: a block
    of another size is no run of the other side's bytes; the decode worker refuses the load with the reason (the
    request fails by vLLM's kv_load_failure_policy) and the prefill side releases its slots; the pool ends free."""
    import vllm_engine as E
    caplog.set_level(logging.INFO, logger="kvstage.vllm")
    pair = E.PD(kv_proxy.socket, p_kw=dict(block_size=4, kv_layout=layout), d_kw=dict(block_size=8, kv_layout=layout))
    P, D = pair.P, pair.D
    try:
        pair.add(0, 21)
        pair.run(lambda: "d0" in D.freed and not P.requests, what="d0 ended")
        assert D.done["d0"][0] == "FINISHED_ERROR" and D.loaded["d0"] == "load failed"
        assert "not token-major" in D.agent.ended["d0"], D.agent.ended["d0"]
        # told at once, not left to the stage timeout
        E.wait_for(lambda: "released" in (P.agent.ended.get("p0") or ""), what="the prefill side told to release p0")
    finally:
        pair.close()
    assert_pool_free(kv_proxy.socket)


def test_rank_pairs_are_nixl_rank_pairs():
    """kvstage.vllm.tp_shares pairs ranks as NixlConnector's TransferTopology @ 9aaf83ef502f (kv_connector/utils.py
    tp_ratio, target_remote_ranks: a decode rank reads remote rank r // ratio, or ranks r * |ratio| + i), seen from
    both sides: every (prefill rank, decode rank) pair one side names, the other names too, with the same model
    heads."""
    for p_tp, d_tp in ((1, 1), (1, 2), (2, 4), (1, 8), (4, 2), (8, 1), (2, 2), (4, 8)):
        heads = 8  # the model's KV heads
        hp, hd = heads // p_tp, heads // d_tp
        from_p = {(p, d, p * hp + h0, p * hp + h1)
                  for p in range(p_tp) for d, h0, h1 in kv.tp_shares(p, p_tp, d_tp, hp)}
        from_d = {(p, d, d * hd + h0, d * hd + h1)
                  for d in range(d_tp) for p, h0, h1 in kv.tp_shares(d, d_tp, p_tp, hd)}
        assert from_p == from_d, (p_tp, d_tp)
        for d in range(d_tp):  # NixlConnector's target_remote_ranks for decode rank d
            ratio = d_tp // p_tp if d_tp >= p_tp else -(p_tp // d_tp)
            nixl = [d // ratio] if ratio > 0 else [d * -ratio + i for i in range(-ratio)]
            assert sorted(p for p, dd, _, _ in from_d if dd == d) == nixl, (p_tp, d_tp, d)
        # each decode rank's heads exactly once
        assert sorted((d, g) for _, d, g0, g1 in from_d for g in range(g0, g1)) == [
            (d, g) for d in range(d_tp) for g in range(d * hd, (d + 1) * hd)]
    with pytest.raises(ValueError, match="do not split"):
        kv.tp_shares(0, 1, 4, 2)  # 2 KV heads on 4 decode ranks: vLLM replicates them


def test_mla_ranks_are_nixl_rank_pairs():
    """MLA: the decode rank that opens a request's shared room and pulls it from the prefill rank that staged it
    (kv.mla_reader) is one NixlConnector's TransferTopology pairs with it @ 003df2961dd8 (kv_connector/utils.py
    target_remote_ranks): with D >= P the first decode rank NIXL maps to that prefill rank (decode rank r reads prefill
    rank r * P / D), with P = k x D the decode rank whose k prefill ranks include it; every decode rank and every
    prefill rank has a partner; the prefill ranks stage in turn (kv.mla_stager)."""
    for p_tp, d_tp in ((1, 1), (1, 2), (2, 4), (1, 8), (4, 2), (8, 1), (2, 2), (4, 8), (8, 2)):
        for p in range(p_tp):
            d = kv.mla_reader(p, p_tp, d_tp)
            assert 0 <= d < d_tp
            ratio = d_tp // p_tp if d_tp >= p_tp else -(p_tp // d_tp)
            nixl = [d // ratio] if ratio > 0 else [d * -ratio + i for i in range(-ratio)]
            assert p in nixl, (p_tp, d_tp, p, d, nixl)
            if ratio > 0:  # the first of the decode ranks NIXL reads prefill rank p with: r * P // D == p
                assert d * p_tp // d_tp == p and (d == 0 or (d - 1) * p_tp // d_tp < p), (p_tp, d_tp, p, d)
        assert [kv.mla_stager(n, p_tp) for n in range(2 * p_tp)] == list(range(p_tp)) * 2
    # sizes of which neither divides the other (NIXL refuses them): still a decode rank for each prefill rank
    assert [kv.mla_reader(p, 3, 2) for p in range(3)] == [0, 0, 1]


def _through_room(extents_out, extents_in, nbytes):
    """Moves bytes from engine memory into a room by one side's extents and out of it by the other's (what the
    copies into slots and out of them do, slot boundaries aside); returns the room."""
    import ctypes
    room = (ctypes.c_char * nbytes)()
    at = ctypes.addressof(room)
    for e in extents_out:
        for k, b in enumerate(e.idx):
            assert e.room_off + (k + 1) * e.item <= nbytes
            ctypes.memmove(at + e.room_off + k * e.item, e.base + b * e.stride, e.item)
    for e in extents_in:
        for k, b in enumerate(e.idx):
            assert e.room_off + (k + 1) * e.item <= nbytes
            ctypes.memmove(e.base + b * e.stride, at + e.room_off + k * e.item, e.item)
    return room


@pytest.mark.parametrize("layout", ["kv-first", "hnd", "flashinfer"])
def test_shares_with_several_kv_cache_groups(layout):
    """The share layout with two KV cache groups (layers 0 and 2 full attention, layer 1 a sliding window: each group
    its own blocks and count), prefill TP 1 to decode TP 2 and back: each decode rank's blocks of each group get
    exactly its heads of the prefill's blocks of that group, in request order, after its cached blocks; both sides
    compute the same room size and share fingerprint."""
    import vllm_engine as E
    torch.manual_seed(7)
    groups = {n: (1 if i == 1 else 0) for i, n in enumerate(E.LAYER_NAMES)}
    nb, heads = 12, 4

    def caches(h):
        out = {}
        for n in E.LAYER_NAMES:
            t = E.kv_cache(nb, E.HEAD_DIM, layout, h)
            t.view(torch.int16).copy_(torch.randint(-32768, 32767, t.shape, dtype=torch.int16))
            out[n] = t
        return out

    def kv_view(t):  # (K/V, block, position, head, dim) whatever the layout, as int16 (random bits: NaNs as floats)
        return (t.transpose(0, 1) if layout == "flashinfer" else t).view(torch.int16)
    big = caches(heads)
    halves = [caches(heads // 2) for _ in range(2)]
    L = kv.VllmLayout(big, nb, groups)
    Ls = [kv.VllmLayout(c, nb, groups) for c in halves]
    counts = (3, 2)
    big_blocks = ([5, 1, 7], [2, 9])
    for r in range(2):
        small_blocks = ([3, 4, 6][1:], [8, 0])  # the decode side's first full-attention block cached: skip 1
        h0, h1 = 2 * r, 2 * r + 2
        assert L.share_fingerprint(h0, h1) == Ls[r].share_fingerprint(0, 2)
        n = L.share_nbytes(counts, h0, h1)
        assert n == Ls[r].share_nbytes(counts, 0, 2)
        _through_room(L.share_extents(counts, big_blocks, 0, h0, h1),
                      Ls[r].share_extents(counts, small_blocks, (1, 0), 0, 2), n)
        for li, name in enumerate(E.LAYER_NAMES):
            g = groups[name]
            src, dst = kv_view(big[name]), kv_view(halves[r][name])
            pairs = list(zip(big_blocks[g][1:] if g == 0 else big_blocks[g], small_blocks[g]))
            for pb, db in pairs:
                assert torch.equal(dst[:, db], src[:, pb, :, h0:h1]), (layout, r, li, pb, db)
            if g == 0:  # the cached block is not written
                assert not torch.equal(dst[:, 3], src[:, 5, :, h0:h1])
    # and back: two prefill ranks of 2 heads into one decode rank of 4, each at its head offset
    back = caches(heads)
    Lb = kv.VllmLayout(back, nb, groups)
    dst_blocks = ([0, 2, 11], [10, 4])
    for r in range(2):
        n = Ls[r].share_nbytes(counts, 0, 2)
        _through_room(Ls[r].share_extents(counts, ([3, 4, 6], [8, 0]), 0, 0, 2),
                      Lb.share_extents(counts, dst_blocks, 0, 2 * r, 2 * r + 2), n)
    for name in E.LAYER_NAMES:
        g = groups[name]
        for j, db in enumerate(dst_blocks[g]):
            sb = ([3, 4, 6], [8, 0])[g][j]
            for r in range(2):
                assert torch.equal(kv_view(back[name])[:, db, :, 2 * r:2 * r + 2], kv_view(halves[r][name])[:, sb])


def test_a_share_never_loaded_expires_and_frees_its_slots(kv_proxy):
    """Prefill TP 1 staged for decode TP 2: decode rank 0 loads its share, decode rank 1 never asks (its worker gone).
    At the stage timeout the stage fails and gives back the other share's slots; rank 0's share stays loaded exact;
    while every client is still connected, the proxy's pool is free again and no room is open."""
    import vllm_engine as E
    from sglang_common import stat
    pair = E.PD(kv_proxy.socket, p_kw=dict(tp=1, kv_heads=KV_HEADS, extra={"kvstage_decode_tp_size": 2}),
                d_kw=dict(tp=2, kv_heads=KV_HEADS))
    P, D = pair.P, pair.D
    try:
        pair.add(0, 30, extra={"kvstage_stage_timeout": 0.5})
        P.step_until(lambda: "p0" in P.freed, what="staged")
        pair.routed.add("p0")
        nb = kv._cdiv(30, E.BLOCK_SIZE)
        blocks = D._alloc(nb)
        a = D.agents[0]
        base = P.cfg.kv_transfer_config.kv_connector_extra_config["kvstage_port"]
        a.post(a.cmd_recv, kv.RecvSpec("x0", "p0", "127.0.0.1", base, nb, tuple(blocks), 0, 10.0, remote_tp=1))
        got = set()
        E.wait_for(lambda: (got.update(a.take_finished()[1]), "x0" in got)[1], what="rank 0's share loaded")
        assert a.ended["x0"] == "done"
        assert D.holds(P.done_req["p0"], blocks=blocks, rank=0) is None
        E.wait_for(lambda: "expired" in (P.agent.ended.get("p0") or ""), what="the stage expired")
        E.wait_for(lambda: P.agent.stage_state("p0")[0] is None, what="the stage gone")
        s = stat(kv_proxy.socket)
        assert s["slots"]["free"] == s["slot_count"] and s["rooms"]["open"] == 0, (s["slots"], s["rooms"])
        assert s["clients"]["now"] >= 3
    finally:
        pair.close()
    assert_pool_free(kv_proxy.socket)


# Prefill on proxy A, decode on proxy B (it listens on tcp): the rooms the decode ranks open name B, A dials it and
# every share crosses the wire (as test_sglang_backend.py's test_across_two_proxies_over_tcp, for the vLLM engines)
TCP_TP = [(2, 4), (4, 2)]


@pytest.mark.parametrize("p_tp,d_tp", TCP_TP, ids=[f"P{p}-D{d}" for p, d in TCP_TP])
def test_tp_sizes_differ_across_two_proxies_over_tcp(two_proxies, p_tp, d_tp):
    """test_tp_sizes_differ's 24 requests, with its aborts from either side while shares are in flight, the prefill
    engine on proxy A and the decode engine on proxy B: each decode rank's blocks hold exactly its heads of the
    prefill's KV, blocks of aborted requests untouched once given back; every share landed on B came over tcp from A;
    both pools end free."""
    from sglang_common import stat
    pa, pb = two_proxies
    a0, b0 = stat(pa.socket), stat(pb.socket)
    normal = _tp_sizes_differ(pa.socket, pb.socket, p_tp, d_tp, "kv-first")
    a1, b1 = assert_pool_free(pa.socket), assert_pool_free(pb.socket)
    assert b1["rooms"]["done"] - b0["rooms"]["done"] >= max(p_tp, d_tp) * normal  # one room per rank pair
    landed = b1["bytes_moved"] - b0["bytes_moved"]
    sent = a1["tcp"]["bytes_tx"] - a0["tcp"]["bytes_tx"]
    # what landed in B's slots left A's and went over the wire (A may have sent more: chunks of a room B aborted
    # while they were on the way are discarded there)
    left = a1["bytes_moved"] - a0["bytes_moved"]
    assert 0 < landed <= left <= sent, (landed, left, sent)
    assert a1["tcp"]["peers"] == 1 and a1["tcp"]["lost"] == 0, a1["tcp"]


def test_mla_kv_crosses_the_wire_once(two_proxies):
    """test_mla_kv_is_read_once for prefill TP 2 and decode TP 4, the prefill engine on proxy A and the decode engine
    on proxy B: each request's bytes cross the wire once (proxy A's tcp bytes sent grow by the requests' bytes and
    framing, not by four times them) and land once on B (its bytes moved grow by exactly their bytes), while all four
    decode ranks read them; the aborts as there; both pools end free."""
    pa, pb = two_proxies
    seen = []

    def on_loaded(total, p_before, p_after):
        seen.append((total, p_after["tcp"]["bytes_tx"] - p_before["tcp"]["bytes_tx"],
                     p_after["bytes_moved"] - p_before["bytes_moved"]))
    _mla_read_once(pa.socket, pb.socket, 2, 4, on_loaded)
    assert_pool_free(pa.socket)
    assert_pool_free(pb.socket)
    (total, sent, left), = seen
    # the bytes and their frames (a header per chunk, the session's handshake) once; a room per decode rank
    # would have sent four times the bytes
    assert left == total and total <= sent < 2 * total, (total, sent, left)
