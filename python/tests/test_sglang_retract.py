"""PD retract rebootstrap: after pause_generation(mode="retract") SGLang's decode scheduler
bootstraps the retracted request again (a new receiver for the same bootstrap_room) and, right after its
send_metadata, calls kv_manager.submit_prefill_recompute(receiver, payload) unguarded (decode.py,
DecodePreallocQueue.pop_preallocated): the decode leader POSTs the payload to the prefill server's /generate, the
prefill recomputes the prefix KV and sends it into the new room. Here the prefill server's HTTP API is a
PrefillFrontend; its POST is the barrier after which the prefill side creates the request's sender again."""
import pytest

pytest.importorskip("numpy", reason="kvstage.sglang needs numpy (Debian: python3-numpy)")
pytest.importorskip("torch", reason="the SGLang engine tests keep their KV caches in torch tensors")

import sglang_engine as E  # noqa: E402
from sglang_common import Pair, adopted, assert_pool_free, kv_proxy, start  # noqa: E402,F401

from kvstage import sglang as ks  # noqa: E402
from kvstage.sglang import KVPoll  # noqa: E402

ROOM = 7001


@pytest.fixture
def frontend():
    fe = E.PrefillFrontend()
    yield fe
    fe.close()


@pytest.fixture
def pair(kv_proxy, frontend):
    p = Pair(kv_proxy.socket, prefill_args={"port": frontend.port})
    yield p
    p.close()
    assert_pool_free(kv_proxy.socket)


def first_transfer(pair, ppages, dpages, row):
    s, r = start(pair, ROOM, ppages, dpages, row)
    assert r.kv_mgr.wait_until(lambda: r.poll() == KVPoll.Success, 10), r
    assert s.poll() == KVPoll.Success, s
    s.clear()
    r.clear()


def test_retract_then_rebootstrap_recomputes_on_the_prefill(pair, frontend):
    pc, dc, P, D, addr = pair
    ppages, dpages, row = [1, 2, 3, 4, 9], [10, 11, 12, 13, 14], 3
    first_transfer(pair, ppages, dpages, row)
    assert dc.check(ROOM, dpages, row) is None
    # pause_generation(mode="retract"): the decode pages go back to the pool (another request writes them) ...
    dc.mark(dpages, row, 0x5A)
    # ... continue_generation: the request is bootstrapped again, into other pages
    dpages2, row2 = [20, 21, 22, 23, 24], 5
    r2 = ks.KvstageKVReceiver(D, addr, ROOM)
    r2.init(0)
    assert r2.poll() == KVPoll.WaitingForInput, r2
    r2.send_metadata(dpages2, row2, [[row2]])
    payload = E.rebootstrap_payload("rid-7001", ROOM, range(20))
    D.submit_prefill_recompute(r2, payload)
    path, got = frontend.requests.get(timeout=10)  # the prefill server's /generate: the barrier
    assert (path, got) == ("/generate", payload)
    assert r2.poll() == KVPoll.Transferring, r2
    # the prefill server recomputes (same tokens, same KV) and sends it into the new room
    s2 = ks.KvstageKVSender(P, addr, got["bootstrap_room"], [0], 0)
    adopted(s2)
    pc.fill(ROOM, ppages, row)
    s2.init(len(ppages), row)
    s2.send(ppages, [[row]])
    assert D.wait_until(lambda: r2.poll() == KVPoll.Success, 10), r2
    assert dc.check(ROOM, dpages2, row2) is None
    assert s2.poll() == KVPoll.Success or P.wait_until(lambda: s2.poll() == KVPoll.Success, 10), s2
    s2.clear()
    r2.clear()
    assert r2.pages_released


def test_rebootstrap_refused_by_the_prefill_fails_the_request(pair, frontend):
    pc, dc, P, D, addr = pair
    first_transfer(pair, [1, 2], [3, 4], 1)
    frontend.status = 503
    r2 = ks.KvstageKVReceiver(D, addr, ROOM)
    r2.init(0)
    r2.send_metadata([5, 6], 2, [[2]])
    D.submit_prefill_recompute(r2, E.rebootstrap_payload("rid-x", ROOM, [1, 2, 3]))
    frontend.requests.get(timeout=10)
    assert D.wait_until(lambda: r2.poll() == KVPoll.Failed, 10), r2
    with pytest.raises(ks.KVTransferError, match=r"rebootstrap /generate failed for rid=rid-x \(status=503\)"):
        r2.failure_exception()
    r2.clear()
    assert r2.pages_released


def test_rebootstrap_without_a_prefill_http_port_fails_at_once(kv_proxy):
    pair = Pair(kv_proxy.socket)  # the prefill registered no HTTP port (server_args.port None)
    try:
        pc, dc, P, D, addr = pair
        r = ks.KvstageKVReceiver(D, addr, ROOM)
        r.init(0)
        r.send_metadata([5, 6], 2, [[2]])
        D.submit_prefill_recompute(r, E.rebootstrap_payload("rid-y", ROOM, [1]))
        assert r.poll() == KVPoll.Failed, r
        with pytest.raises(ks.KVTransferError, match="could not resolve the prefill /generate URL"):
            r.failure_exception()
        r.clear()
    finally:
        pair.close()
    assert_pool_free(kv_proxy.socket)


def test_only_the_decode_leader_posts(pair, frontend, monkeypatch):
    pc, dc, P, D, addr = pair
    monkeypatch.setattr(D, "attn_tp_rank", 1)
    r = ks.KvstageKVReceiver(D, addr, ROOM)
    r.init(0)
    r.send_metadata([5, 6], 2, [[2]])
    D.submit_prefill_recompute(r, E.rebootstrap_payload("rid-z", ROOM, [1]))
    assert D._recompute_pool is None and frontend.requests.empty()  # decided synchronously: nothing was posted
    assert r.poll() == KVPoll.Transferring, r
    r.abort()
    r.clear()
