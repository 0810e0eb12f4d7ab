"""Topologies real SGLang deployments use, driven as SGLang's schedulers drive the backend: every rank of every
engine a manager in this process with its own connection to one real kvstaged, one bootstrap server per prefill
server (SGLang's CommonKVBootstrapServer or its stand-in), KV caches as torch CPU tensors.

* DP attention (--enable-dp-attention): two DP ranks on the prefill side, each its own scheduler, both registered
  with one bootstrap server; the decode side picks the prefill DP rank as decode.py's _resolve_prefill_dp_rank does
  (bootstrap_room % dp_size with follow_bootstrap_room, else /query_dp_ranks after the prefill sender's
  /register_dp_rank), and two decode DP ranks take requests in turn.
* Attention-TP sizes that differ (MHA/GQA): decode TP = k x prefill TP and the reverse, one kvstage room per rank
  pair carrying that pair's heads (Mooncake's send_kvcache_slice arithmetic, mooncake/conn.py @ 8905cbd42f4a).
* Across two proxies over tcp (the `across` fixture): the prefill ranks on proxy A, the decode ranks on proxy B,
  which listens; attention TP 2 -> 4 and 4 -> 2, DP attention 2 x 2, and MLA read once, whose latent crosses the
  wire once per prefill rank (both proxies' bytes_moved), not once per decode rank.

Each engine's ranks share one page allocator and poll as SGLang's poll_and_all_reduce does (the engine sees the
lowest KVPoll of its attention-TP ranks: one rank's Failed is the request's). A completed request's decode KV must
equal the prefill KV head for head (each rank's heads taken from the model's global KV, rank r of T holding heads
as QKVParallelLinear shards them); an aborted one's decode pages are marked once every rank's clear() has returned
(pages_released) and must still be marked at the end; the pool must end free. Where requests abort in Transferring,
heads are wide enough (WIDE_HEAD_DIM) that every room of the request has been sent slots by then."""
import os
import random
import shutil
import tempfile

import pytest

import kvstage
from kvstage import sglang as ks
from kvstage.sglang import KVPoll
from conftest import Proxy
from sglang_common import NEED_TORCH, SLOT_SIZE, SLOTS, assert_pool_free, kv_proxy, stat  # noqa: F401 (fixture)

pytestmark = NEED_TORCH

PAGE, HEAD_DIM, LAYERS = 4, 8, 2  # fp16: 16-byte heads, 2 layers of K and V
WIDE_HEAD_DIM = 256  # 512-byte heads: a share's first 3 pages of a KV buffer fill a 4 KiB slot


def heads_of(rank, tp, heads):
    """The global KV heads attention-TP rank `rank` of `tp` holds (SGLang's QKVParallelLinear: an equal run of heads,
    or, with fewer heads than ranks, head rank // (tp / heads) replicated)."""
    if tp <= heads:
        n = heads // tp
        return list(range(rank * n, (rank + 1) * n))
    return [rank // (tp // heads)]


class Engine:
    """One SGLang server of `dp` DP ranks x `tp` attention-TP ranks (a manager and a KV cache per rank), its
    allocators per DP rank (the ranks of a DP rank use the same page indices, as SGLang's SPMD schedulers do)."""

    def __init__(self, mode, socket_path, tp, dp, heads, bootstrap_port, pages, mla=False, head_dim=HEAD_DIM,
                 **server_kw):
        import pd_sim
        import sglang_engine as E
        self.tp, self.dp, self.heads = tp, dp, heads
        self.caches, self.mgrs = {}, {}
        self.pages = [pd_sim.Alloc(pages, random.Random(5 + d)) for d in range(dp)]
        self.rows = [pd_sim.Alloc(16, random.Random(9 + d)) for d in range(dp)]
        args = E.server_args(socket_path, bootstrap_port, tp_size=tp * dp, dp_size=dp, enable_dp_attention=dp > 1,
                             **server_kw)
        for d in range(dp):
            for r in range(tp):
                per_rank = 1 if mla else len(heads_of(r, tp, heads))
                cache = pd_sim.Cache(pages, rows=16, page_size=PAGE, layers=LAYERS, heads=per_rank, head_dim=head_dim)
                # prefill.py: engine_rank = tp_rank (global); decode.py: tp_rank % attn_tp_size
                kv = cache.kv_args(engine_rank=d * tp + r if mode == ks.DisaggregationMode.PREFILL else r)
                if mode == ks.DisaggregationMode.PREFILL and not mla:
                    # prefill.py sets both for non-MLA (decode.py only with its staging buffer)
                    kv.kv_head_num, kv.total_kv_head_num = per_rank, heads
                self.caches[d, r] = cache
                self.mgrs[d, r] = None
                self.mgrs[d, r] = ks.KvstageKVManager(kv, mode, args, is_mla_backend=mla)

    def close(self):
        for m in self.mgrs.values():
            if m is not None:
                m.close()


def global_kv(torch, room, npages, heads, head_dim=HEAD_DIM):
    """The model's KV of a request: per KV buffer [tokens, heads, head_dim] fp16 of random bits, seeded by room."""
    g = torch.Generator().manual_seed(room & 0xFFFFFFFF)
    return [torch.randint(-32768, 32767, (npages * PAGE, heads, head_dim), generator=g, dtype=torch.int16)
            .view(torch.float16) for _ in range(2 * LAYERS)]


def tokens(torch, pages):
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.long)


class Deployment:
    """A prefill and a decode Engine, one bootstrap server, the requests' loop (the decode engine on
    decode_socket's proxy when given, else both on socket_path's)."""

    def __init__(self, socket_path, ptp, dtp, pdp=1, ddp=1, heads=4, mla=False, pages=64, decode_socket=None,
                 head_dim=HEAD_DIM, **prefill_kw):
        import torch
        self.torch = torch
        self.server = ks.bootstrap_server_on_a_free_port()
        self.addr = f"127.0.0.1:{self.server.port}"
        self.P = self.D = None
        self.P = Engine(ks.DisaggregationMode.PREFILL, socket_path, ptp, pdp, heads, self.server.port, pages, mla,
                        head_dim, **prefill_kw)
        self.D = Engine(ks.DisaggregationMode.DECODE, decode_socket or socket_path, dtp, ddp, heads, 0, pages, mla,
                        head_dim)
        self.heads, self.mla, self.head_dim = heads, mla, head_dim

    def close(self):
        for e in (self.P, self.D):
            if e is not None:
                e.close()
        self.server.close()

    def prefill_dp_rank(self, room):
        """decode.py's _resolve_prefill_dp_rank, then its /query_dp_ranks (CommonKVReceiver.query_prefill_dp_ranks)
        for a request whose room does not name it; None: not known yet."""
        D0 = self.D.mgrs[0, 0]
        assert D0.try_ensure_parallel_info(self.addr)
        info = D0.prefill_info_table[self.addr]
        if info.dp_size == 1:
            return 0
        if info.follow_bootstrap_room:
            return room % info.dp_size
        st, got = ks._http("POST", f"http://{self.addr}/query_dp_ranks", {"bootstrap_rooms": [room]})
        return int(got[str(room)]) if st == 200 and str(room) in got else None

    def run(self, reqs, deadline_s=60, all_reduce=True):
        """Runs every request to its end on both engines; returns ({k: outcome dict}, marked pages written after
        clear(), how many requests' decode pages were marked). all_reduce: an engine sees the lowest poll of its ranks
        and ends a request when that is final (SGLang's poll_and_all_reduce); else only once every rank's own poll
        is final (what kvstage alone makes of an abort on one rank)."""
        import time
        torch = self.torch
        P, D = self.P, self.D
        live, out, quarantine = {}, {}, []
        for q in reqs:
            q.update(pdp=q["room"] % P.dp if q.get("pdp") is None else q["pdp"], ddp=q["k"] % D.dp, chunk=0,
                     sent=0, senders=None, receivers=None, ppages=None, dpages=None, kv=None, prow=None, drow=None,
                     out={})
            live[q["k"]] = q
        deadline = time.monotonic() + deadline_s
        final = (KVPoll.Success, KVPoll.Failed)
        while live:
            assert time.monotonic() < deadline, f"requests never ended: {list(live.values())}"
            for k, q in list(live.items()):
                self._step(q)
                for side, objs in (("prefill", q["senders"]), ("decode", q["receivers"])):
                    if objs is None or side in q["out"]:
                        continue
                    # each engine on its own: it clears its ranks once it sees the request end
                    if (self._engine_poll(objs) in final) if all_reduce else all(o.poll() in final for o in objs):
                        self._end(q, side, objs, quarantine)
                if "prefill" in q["out"] and "decode" in q["out"]:
                    out[k] = dict(q["out"]["decode"], prefill=q["out"]["prefill"]["outcome"],
                                  decode=q["out"]["decode"]["outcome"],
                                  reasons={**q["out"]["prefill"]["reasons"], **q["out"]["decode"]["reasons"]},
                                  ranks=q["out"]["prefill"]["ranks"] + q["out"]["decode"]["ranks"])
                    del live[k]
        bad = [(k, r, where) for k, pages, rows, mark in quarantine for r, c in D.caches.items() if r[0] == rows[0]
               for where in [c.marked(pages, rows[1], mark)] if where is not None]
        return out, bad, len(quarantine)

    @staticmethod
    def _engine_poll(objs):
        """poll_and_all_reduce: the lowest KVPoll of the engine's ranks (Failed is 0)."""
        if objs is None:
            return None
        return min(int(o.poll()) for o in objs)

    def _step(self, q):
        torch, P, D = self.torch, self.P, self.D
        plan = q.get("plan") or ()
        if q["senders"] is None:
            q["senders"] = [ks.KvstageKVSender(P.mgrs[q["pdp"], r], self.addr, q["room"], [0], 0)
                            for r in range(P.tp)]
            if plan[:2] == ("prefill", "Bootstrapping"):
                q["senders"][plan[2]].abort()
        if q["receivers"] is None:
            dp_rank = self.prefill_dp_rank(q["room"])
            if dp_rank is None:
                return
            q["receivers"] = [ks.KvstageKVReceiver(D.mgrs[q["ddp"], r], self.addr, q["room"]) for r in range(D.tp)]
            for rv in q["receivers"]:
                rv.init(dp_rank)
            if plan[:2] == ("decode", "WaitingForInput"):
                q["receivers"][plan[2]].abort()
        if q["dpages"] is None and self._engine_poll(q["receivers"]) == KVPoll.WaitingForInput:
            q["dpages"], q["drow"] = self._alloc(D, q["ddp"], q["npages"])
            for rv in q["receivers"] if q["dpages"] is not None else ():
                rv.send_metadata(q["dpages"], q["drow"], None)
        if q["ppages"] is None and self._engine_poll(q["senders"]) == KVPoll.WaitingForInput:
            q["ppages"], q["prow"] = self._alloc(P, q["pdp"], q["npages"])
            if q["ppages"] is None:
                return  # engine memory full: try again later
            q["kv"] = global_kv(torch, q["room"], q["npages"], self.heads, self.head_dim)
            idx = tokens(torch, q["ppages"])
            for (d, r), cache in P.caches.items():
                if d != q["pdp"]:
                    continue
                hs = list(range(self.heads)) if self.mla else heads_of(r, P.tp, self.heads)
                for b, t in enumerate(cache.kv):
                    t[idx] = q["kv"][b][:, [0] if self.mla else hs]
                cache.fill_rows(q["room"], q["prow"])
            for s in q["senders"]:
                s.init(q["npages"], q["prow"])
        elif q["ppages"] is not None and q["chunk"] < len(q["chunks"]) and \
                self._engine_poll(q["senders"]) in (KVPoll.WaitingForInput, KVPoll.Transferring):
            n = q["chunks"][q["chunk"]]
            part = q["ppages"][q["sent"]:q["sent"] + n]
            for s in q["senders"]:
                s.send(part)
            q["sent"] += n
            q["chunk"] += 1
            if q["chunk"] == 1 and plan[1:2] == ("Transferring",):
                # slots each room carrying KV was handed (a joining MLA reader's room takes a descriptor, a dummy
                # rank has none)
                q["sent_at_abort"] = [sh.sent_chunks for s in q["senders"] for sh in s._shares
                                      if sh.room is not None and not sh.join]
                (q["senders"] if plan[0] == "prefill" else q["receivers"])[plan[2]].abort()

    @staticmethod
    def _alloc(engine, dp, npages):
        """(pages, row) from a DP rank's allocators, or (None, None) while they have too few free."""
        pages, row = engine.pages[dp].alloc(npages), engine.rows[dp].alloc(1)
        if pages is None or row is None:
            engine.pages[dp].give_back(pages or [])
            engine.rows[dp].give_back(row or [])
            return None, None
        return pages, row[0]

    def _end(self, q, side, objs, quarantine):
        """One engine saw the request end (its lowest poll final): clear every rank; the decode side checks the bytes
        of a completed request, or marks an aborted one's pages once every rank's pages_released."""
        import pd_sim
        torch, P, D = self.torch, self.P, self.D
        outcome = self._engine_poll(objs)
        ranks = [int(o._status) for o in objs]  # each rank's own, before clear()
        reasons = {(side, r): o._reason for r, o in enumerate(objs) if o._status == KVPoll.Failed}
        for o in objs:
            o.clear()
        res = q["out"][side] = dict(outcome={KVPoll.Success: "Success", KVPoll.Failed: "Failed"}[outcome],
                                    reasons=reasons, ranks=ranks, wrong=None, released=True)
        if side == "prefill":
            if q["ppages"] is not None:
                P.pages[q["pdp"]].give_back(q["ppages"])
                P.rows[q["pdp"]].give_back([q["prow"]])
            return
        res["released"] = all(rv.pages_released for rv in objs)
        if outcome == KVPoll.Success:
            idx = tokens(torch, q["dpages"])
            for (d, r), cache in D.caches.items():
                if d != q["ddp"]:
                    continue
                hs = [0] if self.mla else heads_of(r, D.tp, self.heads)
                for b, t in enumerate(cache.kv):
                    got, want = t[idx].view(torch.int16), q["kv"][b][:, hs].view(torch.int16)
                    if not torch.equal(got, want):
                        res["wrong"] = res["wrong"] or f"decode rank {r} KV buffer {b} differs from heads {hs}"
                for a in range(len(cache.aux)):
                    row = cache.aux_u8(a)[q["drow"]]
                    if not torch.equal(row, pd_sim.stamp(torch, q["room"], pd_sim.TAG_AUX, a, [0], row.shape[0])[0]):
                        res["wrong"] = res["wrong"] or f"decode rank {r} aux buffer {a} differs"
            D.pages[q["ddp"]].give_back(q["dpages"])
            D.rows[q["ddp"]].give_back([q["drow"]])
        elif q["dpages"] is not None:
            assert res["released"], objs
            for (d, r), cache in D.caches.items():
                if d == q["ddp"]:
                    cache.mark(q["dpages"], q["drow"], q["k"])
            quarantine.append((q["k"], q["dpages"], (q["ddp"], q["drow"]), q["k"]))


def requests(n, seed, plans=()):
    rng = random.Random(seed)
    out = []
    for k in range(n):
        npages = rng.choice([1, 3, 7, 12])
        cut = rng.randrange(1, npages) if npages > 2 else npages
        plan = plans[k] if k < len(plans) else None
        if plan is not None and plan[1] == "Transferring":
            npages, cut = 7, 3  # aborted after the first chunk, before the last: the rooms cannot complete
        out.append(dict(k=k, room=rng.getrandbits(40) * 2 + (k % 2), npages=npages,
                        chunks=[cut, npages - cut] if cut < npages else [npages],
                        plan=plan))
    return out


@pytest.fixture
def deployment(kv_proxy, request):
    made = []

    def make(*a, **kw):
        made.append(Deployment(kv_proxy.socket, *a, **kw))
        return made[-1]
    yield make
    for d in made:
        d.close()
    assert_pool_free(kv_proxy.socket)


def check(out, bad, reqs):
    for q in reqs:
        o = out[q["k"]]
        if q["plan"] is None:
            assert (o["decode"], o["prefill"], o["wrong"]) == ("Success", "Success", None), (q, o)
        else:
            assert (o["decode"], o["prefill"]) == ("Failed", "Failed"), (q, o)
            assert o["released"], (q, o)
    assert not bad, f"aborted requests' decode pages written after clear(): {bad}"


def aborted_with_chunks_sent(reqs):
    """Every request aborted in Transferring had handed slots to each of its rooms before its abort (so the abort
    finds chunks in the rooms, or on the wire between two proxies)."""
    for q in reqs:
        if q["plan"] is not None and q["plan"][1] == "Transferring":
            assert q["sent_at_abort"] and all(q["sent_at_abort"]), q


# ------------------------------------------------------------------------------------------------- DP attention
@NEED_TORCH
@pytest.mark.parametrize("balance", ["follow_bootstrap_room", "round_robin"])
def test_dp_attention_two_dp_ranks_each_side(deployment, balance):
    """Two prefill DP ranks (one bootstrap server) and two decode DP ranks; every request reaches the prefill DP
    rank its room names (follow_bootstrap_room) or the one /query_dp_ranks answers (the sender registered it);
    aborts on either side at every phase end the request on both engines and nothing else."""
    aborted_with_chunks_sent(_dp_attention(deployment, balance, head_dim=WIDE_HEAD_DIM)[1])


def _dp_attention(make, balance, **kw):
    plans = [None, None, ("decode", "WaitingForInput", 0), ("decode", "Transferring", 0),
             ("prefill", "Bootstrapping", 0), ("prefill", "Transferring", 0), None, None, None, None, None, None]
    dep = make(1, 1, pdp=2, ddp=2, load_balance_method=balance, **kw)
    reqs = requests(len(plans), 3, plans)
    if balance != "follow_bootstrap_room":
        for q in reqs:
            q["pdp"] = (q["k"] // 2) % 2  # the router's own choice, not the room's
    out, bad, marked = dep.run(reqs)
    check(out, bad, reqs)
    assert marked == 3  # the requests aborted after send_metadata: their decode pages were handed out
    served = {q["pdp"] for q in reqs}
    assert served == {0, 1}
    for (d, r), mgr in dep.P.mgrs.items():
        assert not mgr.senders and not mgr.pending_meta  # no request ever reached the other DP rank
    if balance != "follow_bootstrap_room":
        st, got = ks._http("POST", f"http://{dep.addr}/query_dp_ranks", {"bootstrap_rooms": [q["room"] for q in reqs]})
        assert st == 200 and {int(k): v for k, v in got.items()} == {q["room"]: q["pdp"] for q in reqs}
    return dep, reqs


@NEED_TORCH
def test_dp_rank_conflict_and_misrouted_request(deployment, monkeypatch):
    """follow_bootstrap_room with a request dispatched to the other DP rank: CommonKVSender's conflict, in its
    words; with SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 it registers its DP rank instead. A decode side
    that names the wrong prefill DP rank never reaches the request's sender: both sides fail by their timeouts,
    and the other DP rank's rank refuses the transfer at its bootstrap timeout (the decode room aborted)."""
    dep = deployment(1, 1, pdp=2)
    P0, P1 = dep.P.mgrs[0, 0], dep.P.mgrs[1, 0]
    s = ks.KvstageKVSender(P0, dep.addr, 41, [0], 0)  # 41 % 2 == 1
    assert s.poll() == KVPoll.Failed and "follow_bootstrap_room conflict: dispatched to dp_rank 0" in s._reason
    s.clear()
    monkeypatch.setenv("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK", "1")
    s = ks.KvstageKVSender(P0, dep.addr, 43, [0], 0)
    assert s.poll() == KVPoll.Bootstrapping
    st, got = ks._http("POST", f"http://{dep.addr}/query_dp_ranks", {"bootstrap_rooms": [43]})
    assert got == {"43": 0}
    r = ks.KvstageKVReceiver(dep.D.mgrs[0, 0], dep.addr, 43)
    r.init(1)  # the wrong DP rank: its meta goes to P1, which never has the request
    r.send_metadata([1, 2], 0, None)
    s.bootstrap_timeout = P1.bootstrap_timeout = 0.3
    assert P1.wait_until(lambda: s.poll() == KVPoll.Failed and 43 not in P1.pending_meta, 10)
    assert "timed out" in s._reason
    assert dep.D.mgrs[0, 0].wait_until(lambda: r.poll() == KVPoll.Failed, 10)
    assert "aborted by the prefill side" in r._reason
    r.clear()
    s.clear()


# ---------------------------------------------------------------------------------------- attention-TP sizes differ
TP_PLANS = [None, ("decode", "WaitingForInput", -1), None, ("decode", "Transferring", 0), None,
            ("prefill", "Bootstrapping", -1), None, ("prefill", "Transferring", 0), None,
            ("decode", "Transferring", -1),
            None, ("prefill", "Transferring", -1), None, None]


def _plans(ptp, dtp, plans):
    """plans with rank -1 made the side's last rank."""
    return [p if p is None or p[2] >= 0 else (p[0], p[1], (ptp if p[0] == "prefill" else dtp) - 1) for p in plans]


@NEED_TORCH
@pytest.mark.parametrize("ptp,dtp,heads,dp", [(1, 2, 4, 1), (2, 4, 4, 1), (4, 2, 4, 1), (2, 1, 4, 1), (1, 4, 2, 1),
                                              (2, 4, 2, 1), (2, 1, 4, 2), (1, 2, 4, 2)],
                         ids=["1to2", "2to4", "4to2", "2to1", "1to4-gqa-replicated", "2to4-gqa-replicated",
                              "dp2x2to-dp2x1", "dp2x1to-dp2x2"])
def test_attention_tp_differs(deployment, ptp, dtp, heads, dp):
    """Decode TP = k x prefill TP and the reverse (MHA/GQA, `heads` KV heads, also fewer heads than decode ranks):
    one room per rank pair with that pair's heads; every completed request's decode KV equals the prefill KV head
    for head on every decode rank; aborts on one rank of either side at every phase end the request on both
    engines (SGLang's all-reduce of poll); aborted decode pages untouched after every rank's clear(); pool free.
    Also with two DP ranks on each side (DP attention and TP sizes that differ at once). Heads of WIDE_HEAD_DIM: an
    abort in Transferring comes once every room of the request has been sent slots."""
    aborted_with_chunks_sent(_attention_tp_differs(deployment, ptp, dtp, heads, dp, head_dim=WIDE_HEAD_DIM)[1])


def _attention_tp_differs(make, ptp, dtp, heads=4, dp=1, **kw):
    plans = _plans(ptp, dtp, TP_PLANS)
    dep = make(ptp, dtp, pdp=dp, ddp=dp, heads=heads, **kw)
    reqs = requests(len(plans), 17 + ptp * 8 + dtp, plans)
    out, bad, marked = dep.run(reqs)
    check(out, bad, reqs)
    assert marked == sum(1 for p in plans if p is not None and p[1] != "WaitingForInput")
    return dep, reqs


@NEED_TORCH
@pytest.mark.parametrize("ptp,dtp", [(1, 2), (1, 4), (2, 1), (4, 1)], ids=["1to2", "1to4", "2to1", "4to1"])
def test_an_abort_on_one_share_ends_every_rank(deployment, ptp, dtp):
    """Without SGLang's all-reduce: an abort on one rank, once the rooms are open, reaches every rank the request's
    rooms connect (a prefill rank aborts all its rooms, a decode rank all of its own and tells its prefill ranks),
    each rank failing on its own; each decode rank's pages are released only once every room it had has its final
    event. (With both sides wider than 1, e.g. 2 -> 4, the pairs form groups no room connects: {P0: D0, D1},
    {P1: D2, D3}; there SGLang's all-reduce of poll() across the attention-TP group ends the others, as
    test_attention_tp_differs runs it.)"""
    plans = _plans(ptp, dtp, [None, ("decode", "Transferring", 0), ("prefill", "Transferring", -1), None,
                              ("prefill", "Bootstrapping", 0), ("decode", "Transferring", -1), None])
    dep = deployment(ptp, dtp, head_dim=WIDE_HEAD_DIM)
    reqs = requests(len(plans), 5, plans)
    out, bad, marked = dep.run(reqs, all_reduce=False)
    check(out, bad, reqs)
    aborted_with_chunks_sent(reqs)
    for q in reqs:
        if q["plan"] is not None:
            assert set(out[q["k"]]["ranks"]) == {int(KVPoll.Failed)}, (q["plan"], out[q["k"]])


def _tampered(dep, tamper):
    """Makes every decode rank's meta message pass through tamper(msg) on its way (a misrouted or mismatched share
    as it would arrive)."""
    for m in dep.D.mgrs.values():
        orig = m.send_to
        m.send_to = lambda ep, msg, failing=None, orig=orig: orig(
            ep, tamper(dict(msg)) if msg.get("t") == "meta" else msg, failing)


def _slices(msg, f):
    msg["tp"] = dict(msg["tp"], slices=[f(sl) for sl in msg["tp"]["slices"]])
    return msg


@NEED_TORCH
@pytest.mark.parametrize("case,tamper,why", [
    ("rank", lambda m: dict(m, tp=dict(m["tp"], prefill_rank=1 - m["tp"]["prefill_rank"])),
     "misrouted share: meant for prefill rank"),
    ("decode-rank", lambda m: dict(m, tp=dict(m["tp"], decode_rank=(m["tp"]["decode_rank"] + 2) % 4)),
     "misrouted share: decode rank"),
    ("heads", lambda m: _slices(m, lambda sl: [sl[0] + 16, sl[1]]), "expects bytes"),
    ("head-count", lambda m: _slices(m, lambda sl: [sl[0], sl[1] // 2]), "expects bytes"),
    ("layers", lambda m: dict(m, layout=dict(m["layout"], kv_item_lens=m["layout"]["kv_item_lens"][:2])),
     "2 KV buffers (layers x K/V) on the decode side, 4 on this prefill rank"),
    ("dtype", lambda m: dict(m, kv_cache_dtype="fp8_e4m3"), "KV cache dtype fp8_e4m3 on the decode side"),
    ("shared-room", lambda m: dict(m, tp=dict(m["tp"], readers=2, join=bool(m["tp"]["decode_rank"] % 2))),
     "misrouted share: a shared room of 2 readers"),
    ("token-size", lambda m: dict(m, layout=dict(m["layout"],
                                                 kv_item_lens=[n * 2 for n in m["layout"]["kv_item_lens"]])),
     "not the same heads"),
])
def test_misrouted_share_is_refused(deployment, case, tamper, why):
    """2 -> 4: a share whose meta names another prefill rank, a decode rank this prefill rank does not serve, another
    head range, layer count, dtype or token size, or a shared room (MLA only) is refused at open: the prefill request
    fails saying what is misrouted, the decode rooms are aborted (every decode rank fails), nothing is written to a
    decode page."""
    dep = deployment(2, 4)
    _tampered(dep, tamper)
    reqs = requests(3, 23)
    for q in reqs:
        q["plan"] = "refused"
    out, bad, marked = dep.run(reqs)
    for q in reqs:
        o = out[q["k"]]
        assert (o["decode"], o["prefill"]) == ("Failed", "Failed"), o
        assert any(why in r for (side, _), r in o["reasons"].items() if side == "prefill"), o["reasons"]
    assert not bad and marked == len(reqs)


@NEED_TORCH
def test_prefill_side_gqa_replication_is_refused(deployment):
    """4 -> 2 with 2 KV heads: two prefill ranks hold each head (Mooncake sends it twice to the same place). A decode
    rank, which is not told the head count, expects each of its 2 prefill ranks to fill half its token; the prefill
    rank refuses the share naming the head ranges, and both engines fail the request at once."""
    dep = deployment(4, 2, heads=2)
    reqs = requests(2, 29)
    for q in reqs:
        q["plan"] = "refused"
    out, bad, marked = dep.run(reqs)
    for q in reqs:
        o = out[q["k"]]
        assert (o["decode"], o["prefill"]) == ("Failed", "Failed"), o
        assert any("expects bytes" in r and "heads 2, attention TP 4 -> 2" in r
                   for (side, _), r in o["reasons"].items() if side == "prefill"), o["reasons"]
    assert not bad


@NEED_TORCH
@pytest.mark.parametrize("ptp,dtp", [(1, 2), (2, 1), (4, 2)], ids=["1to2", "2to1", "4to2"])
def test_mla_attention_tp_differs(deployment, monkeypatch, ptp, dtp):
    """MLA (one latent KV per token, the same on every rank), a room per decode rank (KVSTAGE_SGLANG_MLA_SHARED=0):
    decode wider, each decode rank takes the whole token from its prefill rank (SGLang's send_kvcache, not the
    slice); prefill wider, only target_tp_rank sends and the other prefill ranks of the group are SGLang's dummy
    ranks (told, they send nothing and succeed)."""
    monkeypatch.setenv("KVSTAGE_SGLANG_MLA_SHARED", "0")
    plans = _plans(ptp, dtp, [None, ("decode", "Transferring", -1), None, ("prefill", "Transferring", 0), None,
                              ("prefill", "Bootstrapping", -1), None])
    dep = deployment(ptp, dtp, heads=1, mla=True, head_dim=WIDE_HEAD_DIM)
    reqs = requests(len(plans), 31, plans)
    out, bad, marked = dep.run(reqs)
    check(out, bad, reqs)
    aborted_with_chunks_sent(reqs)
    # with the prefill side wider only the first rank of each group moved bytes
    moved = [m._objs for m in dep.P.mgrs.values()]
    assert not any(moved)


@NEED_TORCH
@pytest.mark.parametrize("ptp,dtp", [(1, 2), (1, 4), (2, 4)], ids=["1to2", "1to4", "2to4"])
def test_mla_read_once(deployment, monkeypatch, ptp, dtp):
    """MLA with the decode side wider (the default, KVSTAGE_SGLANG_MLA_SHARED unset): the k decode ranks of a
    prefill rank read one shared room (Client.recv_open(readers=k), join()): the first opens it, the others get its
    descriptor through the prefill rank (a small room each) and join; the latent crosses once per prefill rank,
    every decode rank has it. An abort on any rank ends the request on all (a shared room aborted by one reader
    ends for every reader); aborted pages untouched; the pool free."""
    monkeypatch.delenv("KVSTAGE_SGLANG_MLA_SHARED", raising=False)  # the default
    aborted_with_chunks_sent(_mla_read_once_with_aborts(deployment(ptp, dtp, heads=1, mla=True,
                                                                   head_dim=WIDE_HEAD_DIM), ptp, dtp))


def _mla_read_once_with_aborts(dep, ptp, dtp, shared=True):
    """Runs requests with aborts at every phase on either side through an MLA deployment, wider on the decode side,
    and checks them: with shared rooms one data room per prefill rank however many decode ranks, else one per
    decode rank."""
    plans = _plans(ptp, dtp, [None, ("decode", "Transferring", -1), None, ("prefill", "Transferring", 0), None,
                              ("decode", "Transferring", 0), ("prefill", "Bootstrapping", -1), None,
                              ("decode", "WaitingForInput", -1), None])
    all_reduce = ptp != 1  # 2 -> 4: groups no room connects, SGLang all-reduces
    if not all_reduce:  # a rank aborted before send_metadata is known to no other rank: only the all-reduce ends them
        plans = [None if p is not None and p[1] == "WaitingForInput" else p for p in plans]
    reqs = requests(len(plans), 37, plans)
    out, bad, marked = dep.run(reqs, all_reduce=all_reduce)
    check(out, bad, reqs)
    for q in reqs:
        if q["plan"] is None:
            for s in q["senders"]:  # one room of KV per prefill rank, the other decode ranks took a descriptor
                data = [sh for sh in s._shares if sh.layout is not None and sh.layout.nbytes]
                assert len(s._shares) == dtp // ptp
                assert [sh.readers for sh in data] == ([dtp // ptp] if shared else [1] * (dtp // ptp))
        elif not all_reduce:
            assert set(out[q["k"]]["ranks"]) == {int(KVPoll.Failed)}, (q["plan"], out[q["k"]])
    return reqs


# ------------------------------------------------------------------------------------- across two proxies (tcp)
class _Logs:
    """Both proxies' logs in a failed test's report (conftest's hook reads node._kvstaged.log_text())."""

    def __init__(self, *named):
        self.named = named

    def log_text(self):
        return "\n".join(f"--- {name} ---\n{px.log_text()}" for name, px in self.named)


@pytest.fixture
def across(request):
    """Makes Deployments across two proxies over tcp: the prefill engine's ranks on proxy A, the decode engine's on
    proxy B (--listen 127.0.0.1:0), one peer secret (--peer-secret-file), their default --peer-timeout; the decode
    ranks' descriptors name B, A dials it. Each deployment gets .proxies = (A, B). At teardown every deployment
    closes and both pools must end free. Heads of WIDE_HEAD_DIM: an abort after a request's first chunk finds
    slots sent into every room, on the wire or landed."""
    d = tempfile.mkdtemp(prefix="kvs-secret-")
    secret = os.path.join(d, "peer.secret")
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32))
    os.close(fd)
    args = ["--slots", str(4 * SLOTS), "--slot-size", str(SLOT_SIZE), "--peer-secret-file", secret]
    proxies, made, rcs = [], [], []

    def make(*a, **kw):
        made.append(Deployment(proxies[0].socket, *a, decode_socket=proxies[1].socket, head_dim=WIDE_HEAD_DIM, **kw))
        made[-1].proxies = tuple(proxies)
        return made[-1]
    try:
        proxies.append(Proxy(args))
        proxies.append(Proxy(args + ["--listen", "127.0.0.1:0"]))
        request.node._kvstaged = _Logs(("proxy A (prefill)", proxies[0]), ("proxy B (decode, listening)", proxies[1]))
        yield make
        while made:
            made.pop().close()
        for px in proxies:
            assert_pool_free(px.socket)
    finally:
        while made:
            made.pop().close()
        for px in proxies:
            rcs.append(px.stop())
            shutil.rmtree(px.dir, ignore_errors=True)
        shutil.rmtree(d, ignore_errors=True)
    assert rcs == [0, 0], f"kvstaged exit statuses at SIGTERM (A, B): {rcs}"


def over_tcp(dep):
    """Both proxies' kvstage-stat objects, once they show that A dialed B and the bytes went that way: one peer
    session, never lost (the default --peer-timeout), bytes sent by A and received by B, none timed out."""
    a, b = (stat(px.socket) for px in dep.proxies)
    assert a["tcp"]["peers"] == 1 and a["tcp"]["lost"] == 0 and a["tcp"]["bytes_tx"] > 0, a["tcp"]
    assert b["tcp"]["lost"] == 0 and b["tcp"]["bytes_rx"] > 0, b["tcp"]
    assert a["rooms"]["timed_out"] == b["rooms"]["timed_out"] == 0, (a["rooms"], b["rooms"])
    return a, b


@NEED_TORCH
@pytest.mark.parametrize("ptp,dtp", [(2, 4), (4, 2)], ids=["2to4", "4to2"])
def test_across_two_proxies_attention_tp_differs(across, ptp, dtp):
    """test_attention_tp_differs with the prefill ranks on proxy A and the decode ranks on proxy B: each rank
    pair's room crosses the wire, aborts on one rank of either side at every phase (in Transferring once slots of
    every share's room were sent) end the request on both engines, decode KV equals the prefill KV head for head,
    aborted decode pages untouched after every rank's clear(), both pools free."""
    dep, reqs = _attention_tp_differs(across, ptp, dtp)
    aborted_with_chunks_sent(reqs)
    over_tcp(dep)


@NEED_TORCH
@pytest.mark.parametrize("balance", ["follow_bootstrap_room", "round_robin"])
def test_across_two_proxies_dp_attention(across, balance):
    """test_dp_attention_two_dp_ranks_each_side (2 prefill x 2 decode DP ranks) with the prefill DP ranks on proxy
    A and the decode DP ranks on proxy B."""
    dep, reqs = _dp_attention(across, balance)
    aborted_with_chunks_sent(reqs)
    over_tcp(dep)


@NEED_TORCH
@pytest.mark.parametrize("shared", [True, False], ids=["read-once", "room-per-rank"])
@pytest.mark.parametrize("ptp,dtp", [(1, 2), (2, 4)], ids=["1to2", "2to4"])
def test_across_two_proxies_mla_read_once(across, monkeypatch, ptp, dtp, shared):
    """MLA, the decode side wider, prefill on proxy A and decode on proxy B. With KVSTAGE_SGLANG_MLA_SHARED=1 the
    latent crosses the wire once per prefill rank: for requests that complete, the bytes A sent on its rooms and
    the bytes that landed in B's pool (bytes_moved of each) grow by exactly each request's latent and aux row once
    per prefill rank, plus one 128-byte descriptor per decode rank that joins; with a room per decode rank (the
    variable 0, Mooncake's way) they grow by the latent once per decode rank, which is what read once saves.
    Then requests with aborts on either side at every phase, as test_mla_read_once, every decode rank on B."""
    monkeypatch.setenv("KVSTAGE_SGLANG_MLA_SHARED", "1" if shared else "0")
    dep = across(ptp, dtp, heads=1, mla=True)
    before = [stat(px.socket) for px in dep.proxies]
    reqs = requests(6, 47)
    out, bad, marked = dep.run(reqs)
    check(out, bad, reqs)
    a, b = over_tcp(dep)
    layout = dep.D.caches[0, 0].kv_args()  # one decode rank's latent and aux, as the prefill rank sends them
    latent = [q["npages"] * sum(layout.kv_item_lens) + sum(layout.aux_item_lens) for q in reqs]
    if shared:
        want = sum(ptp * n + (dtp - ptp) * kvstage.KVS_ROOM_DESC_SIZE for n in latent)
    else:
        want = sum(dtp * n for n in latent)
    sent, landed = (x["bytes_moved"] - y["bytes_moved"] for x, y in zip((a, b), before))
    assert (sent, landed) == (want, want), f"per decode rank it would be {sum(dtp * n for n in latent)}"
    on_the_wire = a["tcp"]["bytes_tx"] - before[0]["tcp"]["bytes_tx"]
    assert on_the_wire >= want
    if shared:  # framing included, still less than the latent once per decode rank
        assert on_the_wire < sum(dtp * n for n in latent), on_the_wire
    aborted_with_chunks_sent(_mla_read_once_with_aborts(dep, ptp, dtp, shared))
    over_tcp(dep)
