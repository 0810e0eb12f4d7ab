"""kvstage.sglang piece by piece: the room layout (host runs, device gathers), the bootstrap server's routes,
transfers of every shape in one process, decode prefixes, refusals (layout, topology, unknown prefill), pool
pressure, clear() after an abort, the CUDA copier's gathers and scatters (against a stand-in device), a proxy
that dies, and rooms across two proxies (tcp)."""
import inspect
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
import types
from pathlib import Path

import pytest

import kvstage
from kvstage import sglang as ks
from kvstage.plan import Copy, CudaCopier, Extent, host_bytes, plan
from kvstage.sglang import KVPoll
from conftest import Proxy, kvstaged_path
from sglang_common import (NEED_TORCH, Pair, adopted, assert_pool_free, engines, kv_proxy,  # noqa: F401 (fixtures)
                           sender_done, start, stat)


# ---------------------------------------------------------------------------------------------- layout (no proxy)
def _mem(kv=((0x10000, 1000, 100), (0x20000, 600, 60)), aux=((0x30000, 160, 16), (0x40000, 80, 8)),
         state=(((0x50000, 120, 12), (0x60000, 40, 4)),), kv_device=False):
    a = types.SimpleNamespace(
        kv_data_ptrs=[p for p, _, _ in kv], kv_data_lens=[n for _, n, _ in kv], kv_item_lens=[i for _, _, i in kv],
        aux_data_ptrs=[p for p, _, _ in aux], aux_data_lens=[n for _, n, _ in aux],
        aux_item_lens=[i for _, _, i in aux],
        state_data_ptrs=[[p for p, _, _ in c] for c in state], state_data_lens=[[n for _, n, _ in c] for c in state],
        state_item_lens=[[i for _, _, i in c] for c in state], state_types=["mamba"])
    return ks.MemoryMap(a, kv_device=kv_device)


def test_layout_offsets_and_extents():
    mem = _mem()
    lay = ks.RoomLayout(mem, npages=3, has_aux=True, state_counts=[2])
    assert lay.kv_off == [0, 300] and lay.aux_off == [480, 496] and lay.state_off == [[504, 528]]
    assert lay.nbytes == 536
    # one extent per buffer, buffer by buffer, the pages in the request's order
    assert lay.kv_extents([4, 5, 9], 0) == [Extent(0, 0x10000, 100, 100, (4, 5, 9), False),
                                            Extent(300, 0x20000, 60, 60, (4, 5, 9), False)]
    assert lay.kv_extents([7], 2) == [Extent(200, 0x10000, 100, 100, (7,), False),
                                      Extent(420, 0x20000, 60, 60, (7,), False)]
    assert lay.kv_extents([], 3) == []
    assert lay.aux_extents(3) == [Extent(480, 0x30000, 16, 16, (3,), False), Extent(496, 0x40000, 8, 8, (3,), False)]
    assert lay.state_extents([[6, 7]]) == [Extent(504, 0x50000, 12, 12, (6, 7), False),
                                           Extent(528, 0x60000, 4, 4, (6, 7), False)]
    # planned for 4096-byte slots: pages 4,5 (one run) then 9, one copy per run and buffer
    assert plan(lay.kv_extents([4, 5, 9], 0), 4096) == [
        Copy(0, 0, 0x10000 + 400, 200, False), Copy(0, 200, 0x10000 + 900, 100, False),
        Copy(0, 300, 0x20000 + 240, 120, False), Copy(0, 420, 0x20000 + 540, 60, False)]
    for bad in (lambda: lay.kv_extents([10], 0),         # past the 1000-byte buffer
                lambda: lay.kv_extents([1, 2], 2),       # more pages than the room holds
                lambda: lay.kv_extents([1, -1], 0),      # a negative page
                lambda: lay.aux_extents(10),
                lambda: lay.state_extents([[1]]),        # 1 state index where the room has 2
                lambda: lay.state_extents([[9, 10]]),    # past the state buffer
                lambda: lay.state_extents([[-1, 0]])):   # a negative state index
        with pytest.raises(ValueError):
            bad()
    assert ks.RoomLayout(mem, 0, False, [0]).nbytes == 0
    assert ks.state_counts_of([[[3]], None], 2) == [1, 0] and ks.state_counts_of(None, 1) == [0]


def test_head_sliced_layout_and_rank_pairs():
    """Attention-TP sizes that differ: a room per rank pair carries, per KV buffer, each token's share (a strided
    extent: one item per token); SGLang's rank mapping and Mooncake's head ranges, also with GQA replication."""
    mem = _mem()  # KV items of 100 and 60 bytes: pages of 4 tokens of 25 and 15 bytes
    lay = ks.RoomLayout(mem, npages=2, has_aux=False, state_counts=[0], kv_slices=[(5, 10), (0, 15)], page_size=4)
    assert lay.kv_off == [0, 80] and lay.nbytes == 80 + 120
    assert lay.kv_extents([3, 1], 0) == [Extent(0, 0x10000 + 5, 25, 10, (12, 13, 14, 15, 4, 5, 6, 7), False),
                                         Extent(80, 0x20000, 60, 60, (3, 1), False)]  # a whole token: whole pages
    assert lay.kv_extents([2], 1) == [Extent(40, 0x10005, 25, 10, (8, 9, 10, 11), False),
                                      Extent(140, 0x20000, 60, 60, (2,), False)]
    with pytest.raises(ValueError):
        ks.RoomLayout(mem, 1, False, [0], kv_slices=[(20, 10), None], page_size=4)  # past the 25-byte token
    assert ks.rank_mapping(1, 4, 3, False) == (0, [0], 4, 1)
    assert ks.rank_mapping(4, 2, 1, False) == (2, [2, 3], 1, 2)
    assert ks.rank_mapping(4, 2, 1, True) == (2, [2, 3], 1, 1)
    assert ks.tp_sizes_unsupported(2, 6) and ks.tp_sizes_unsupported(3, 1) and not ks.tp_sizes_unsupported(8, 2)
    # 8 heads of 16 bytes: prefill 2 ranks (64-byte tokens), decode 4 (32-byte): decode rank 3 takes heads 6, 7
    assert ks.head_slice(8, 2, 1, 4, 3, 64, 32) == (32, 0, 32)
    assert ks.decode_slices(2, 4, 1, [128], 4, False) == [[0, 32]]
    # the reverse: prefill rank 3 of 4 fills the second half of decode rank 1's token
    assert ks.head_slice(8, 4, 3, 2, 1, 32, 64) == (0, 32, 32) and ks.decode_slices(4, 2, 3, [256], 4, False) == [
        [32, 32]]
    # 2 heads, 4 decode ranks: ranks 2 and 3 both hold head 1 (QKVParallelLinear: rank // replicas)
    assert [ks.head_slice(2, 1, 0, 4, d, 32, 16)[0] for d in range(4)] == [0, 0, 16, 16]
    with pytest.raises(ValueError, match="not the same heads"):
        ks.head_slice(8, 2, 0, 4, 0, 64, 24)


def test_fingerprint_mismatch():
    a, b = _mem().fingerprint(), _mem(kv=((0x10000, 1000, 100), (0x20000, 600, 64))).fingerprint()
    assert ks.MemoryMap.mismatch(a, a) is None
    assert "kv_item_lens" in ks.MemoryMap.mismatch(a, b)


def test_kv_class_mapping():
    import enum

    class KVClassType(enum.Enum):  # SGLang's names
        KVARGS = "kvargs"
        MANAGER = "manager"
        SENDER = "sender"
        RECEIVER = "receiver"
        BOOTSTRAP_SERVER = "bootstrap_server"
    assert ks.kv_class(KVClassType.MANAGER) is ks.KvstageKVManager
    assert ks.kv_class(KVClassType.SENDER) is ks.KvstageKVSender
    assert ks.kv_class(KVClassType.RECEIVER) is ks.KvstageKVReceiver
    assert ks.kv_class(KVClassType.BOOTSTRAP_SERVER) is ks.KvstageKVBootstrapServer
    assert ks.kv_class(KVClassType.KVARGS) is ks.KVArgs
    assert ((KVPoll.Failed, KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success)
            == (0, 1, 2, 3, 4))
    for cls, base in ((ks.KvstageKVManager, ks.BaseKVManager), (ks.KvstageKVSender, ks.BaseKVSender),
                      (ks.KvstageKVReceiver, ks.BaseKVReceiver),
                      (ks.KvstageKVBootstrapServer, ks.BaseKVBootstrapServer)):
        assert issubclass(cls, base) and not getattr(cls, "__abstractmethods__", None), cls
    # SGLang's call signatures, parameter for parameter
    assert (list(inspect.signature(ks.KvstageKVManager).parameters)[:4]
            == ["args", "disaggregation_mode", "server_args", "is_mla_backend"])
    assert list(inspect.signature(ks.KvstageKVSender).parameters)[:6] == [
        "mgr", "bootstrap_addr", "bootstrap_room", "dest_tp_ranks", "pp_rank", "req_has_disagg_prefill_dp_rank"]
    assert list(inspect.signature(ks.KvstageKVReceiver).parameters)[:3] == ["mgr", "bootstrap_addr", "bootstrap_room"]
    assert list(inspect.signature(ks.KvstageKVSender.send).parameters) == ["self", "kv_indices", "state_indices",
                                                                           "token_position_offset"]
    assert list(inspect.signature(ks.KvstageKVSender.init).parameters) == ["self", "num_kv_indices", "aux_index"]
    assert list(inspect.signature(ks.KvstageKVReceiver.init).parameters) == ["self", "prefill_dp_rank"]
    assert list(inspect.signature(ks.KvstageKVReceiver.send_metadata).parameters)[:5] == [
        "self", "kv_indices", "aux_index", "state_indices", "decode_prefix_len"]
    assert list(inspect.signature(ks.KvstageKVBootstrapServer).parameters) == ["host", "port"]


# ------------------------------------------------------------------------------------- bootstrap server (SGLang's)
def test_the_bootstrap_server_is_sglangs():
    """kvstage adds no bootstrap server of its own: the class the backend names is SGLang's
    CommonKVBootstrapServer with nothing overridden, so SGLang's routes, health check and checks apply."""
    from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer
    assert ks.KvstageKVBootstrapServer.__mro__[1] is CommonKVBootstrapServer
    assert [k for k in vars(ks.KvstageKVBootstrapServer) if not k.startswith(("__", "_abc_"))] == []


@NEED_TORCH
def test_registration_is_what_sglangs_server_reads(kv_proxy):
    """A prefill rank registers with the payload SGLang's CommonKVManager sends: the server counts it, the
    decode side reads the server's info and the rank's side-channel address from it; one field short and
    SGLang's server refuses the registration (500: its handler reads every field)."""
    import sglang_engine as E
    srv = ks.bootstrap_server_on_a_free_port()
    base = f"http://127.0.0.1:{srv.port}"
    P = D = None
    try:
        q = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
        assert ks._http("GET", base + q)[0] == 503  # nobody registered yet
        cache = E.KVCache(8)
        P = ks.KvstageKVManager(cache.kv_args(), ks.DisaggregationMode.PREFILL,
                                E.server_args(kv_proxy.socket, srv.port, port=30000, kv_cache_dtype="fp8_e4m3"))
        st, info = ks._http("GET", base + q)
        assert st == 200 and (info["attn_tp_size"], info["dp_size"], info["page_size"]) == (1, 1, cache.page_size)
        assert (info["kv_cache_dtype"], info["prefill_http_port"]) == ("fp8_e4m3", 30000)
        st, rank = ks._http("GET", base + "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0"
                                          "&target_pp_rank=0")
        assert st == 200 and (rank["rank_ip"], rank["rank_port"]) == (P.local_ip, P.rank_port)
        D = ks.KvstageKVManager(cache.kv_args(), ks.DisaggregationMode.DECODE,
                                E.server_args(kv_proxy.socket, 0, kv_cache_dtype="fp8_e4m3"))
        assert D.try_ensure_parallel_info(f"127.0.0.1:{srv.port}")
        assert D.rank_endpoint(f"127.0.0.1:{srv.port}", 0, 0) == f"{P.local_ip}:{P.rank_port}"
        D.prefill_info_table.clear()
        D.server_args.kv_cache_dtype = "auto"
        with pytest.raises(RuntimeError, match="KV cache dtype mismatch"):  # SGLang's check and words
            D.try_ensure_parallel_info(f"127.0.0.1:{srv.port}")
        reg = dict(attn_tp_size=1, attn_tp_rank=0, attn_cp_size=1, attn_cp_rank=0, attn_dp_size=1, attn_dp_rank=0,
                   pp_size=1, pp_rank=0, system_dp_size=1, system_dp_rank=0, rank_ip="10.1.2.3", rank_port=4567,
                   page_size=4, kv_cache_dtype="auto")
        del reg["system_dp_size"]
        assert ks._http("PUT", base + "/route", reg)[0] == 500
    finally:
        for m in (P, D):
            if m is not None:
                m.close()
        srv.close()


@NEED_TORCH
def test_a_silent_prefill_rank_stops_nothing_else(engines):
    """A rank the bootstrap server names that takes the connection and never answers (a hung host; its PUT /route
    needs no secret): the decode scheduler's send_metadata only queues, another request to an honest rank completes
    while the silent one's handshake still waits, and then the silent one fails with the reason (issue 39, item 8:
    send_metadata ran the connect and handshake on the scheduler's thread, 5 s a request)."""
    import socket
    pc, dc, P, D, addr = engines
    srv = ks.bootstrap_server_on_a_free_port()
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    reg = dict(attn_tp_size=1, attn_tp_rank=0, attn_cp_size=1, attn_cp_rank=0, attn_dp_size=1, attn_dp_rank=0,
               pp_size=1, pp_rank=0, system_dp_size=1, system_dp_rank=0, rank_ip="127.0.0.1",
               rank_port=hung.getsockname()[1], page_size=dc.page_size, kv_cache_dtype="auto")
    try:
        assert ks._http("PUT", f"http://127.0.0.1:{srv.port}/route", reg)[0] == 200
        stuck = ks.KvstageKVReceiver(D, f"127.0.0.1:{srv.port}", 77)
        stuck.init(0)
        stuck.send_metadata([1, 2], 3, [[3]])  # only queues the message: the rank's own thread waits on it
        s, r = start(engines, 4243, [0, 1, 2], [5, 6, 7], 9)
        assert D.wait_until(lambda: r.poll() == KVPoll.Success, 10), r
        assert stuck.poll() == KVPoll.Transferring, stuck  # its handshake still waits (5 s): it cost nobody else
        sender_done(s)
        assert dc.check(4243, [5, 6, 7], 9) is None
        r.clear()
        s.clear()
        assert D.wait_until(lambda: stuck.poll() == KVPoll.Failed, 30), stuck
        assert "could not reach the prefill rank" in stuck._reason, stuck._reason
        stuck.clear()
        assert stuck.pages_released
    finally:
        hung.close()
        srv.close()


def test_the_prefill_inbox_holds_senders_back_and_loses_nothing(engines):
    """A holder of the secret floods a prefill rank whose scheduler is busy (no pump): past INBOX_MAX messages the
    listener stops reading (TCP holds the sender back) instead of queuing without bound; once the scheduler pumps,
    every message arrives (issue 39, item 9)."""
    from kvstage import sidechannel as sc
    pc, dc, P, D, addr = engines
    c = sc.connect("127.0.0.1", P.rank_port, sc.load_key())
    try:
        n = P.INBOX_MAX + 50
        for k in range(n):  # aborts for rooms this rank never had: each leaves a tombstone once taken
            c.send({"t": "abort", "room": 900000 + k})
        # the barrier: the listener counted the frame it now waits to queue (the inbox full)
        assert P._listener.wait_stats(lambda st: st["frames"] >= P.INBOX_MAX + 1, 30)
        assert P._inbox.qsize() == P.INBOX_MAX and P._listener.stats()["frames"] == P.INBOX_MAX + 1
        end = time.monotonic() + 30
        while P._listener.stats()["frames"] < n and time.monotonic() < end:
            P.pump()
        P.pump()
        assert all(900000 + k in P.tombstones for k in range(n)), len(P.tombstones)
    finally:
        c.close()


def test_pending_rooms_are_bounded_oldest_first(engines):
    """Messages for rooms this prefill rank does not have (yet) are kept till the bootstrap timeout: at most
    ROOMS_MAX rooms of them, the oldest refused first (its decode room aborted, so that request fails at once)."""
    pc, dc, P, D, addr = engines
    P.ROOMS_MAX = 2
    rs = []
    for k in range(3):
        r = ks.KvstageKVReceiver(D, addr, 5000 + k)
        r.init(0)
        r.send_metadata([1 + k], 3, [[3]])
        rs.append(r)
    end = time.monotonic() + 30
    while P._listener.stats()["frames"] < 3:
        P.pump()
        assert time.monotonic() < end, (P.pending_meta.keys(), P._listener.stats())
    P.pump()
    assert sorted(P.pending_meta) == [5001, 5002]
    assert D.wait_until(lambda: rs[0].poll() == KVPoll.Failed, 10), rs[0]
    assert all(r.poll() != KVPoll.Failed for r in rs[1:])
    for r in rs:
        r.clear()
    P.pending_meta.clear()  # their requests never come: the pool must end free (fixture)


# ------------------------------------------------------------------------------------------ transfers in one process
@NEED_TORCH
@pytest.mark.parametrize("ppages,dpages,chunks", [
    ([7], [3], ()),                                              # one page
    (list(range(10, 30)), list(range(40, 60)), (5, 5, 5)),       # contiguous runs on both sides, 4 chunks
    ([9, 2, 33, 34, 35, 1, 60, 61], [8, 7, 6, 5, 4, 3, 2, 1], (1, 2)),  # scattered, reversed
    (list(range(0, 62, 2)), list(range(1, 63, 2)), (10,)),      # 31 pages, every one its own run
], ids=["one-page", "contiguous", "scattered", "strided"])
def test_transfer_shapes(engines, ppages, dpages, chunks):
    pc, dc, P, D, addr = engines
    s, r = start(engines, 4242, ppages, dpages, 9, chunks=chunks, prow=3)
    assert D.wait_until(lambda: r.poll() == KVPoll.Success, 10), r
    sender_done(s)
    got = [dc.kv_u8(b)[dpages] for b in range(len(dc.kv))]
    want = [pc.kv_u8(b)[ppages] for b in range(len(pc.kv))]
    assert all(bool((g == w).all()) for g, w in zip(got, want))
    assert dc.check(4242, dpages, 9) is None  # kv, aux and state rows, byte for byte
    lay = r._layout
    assert s.get_transfer_metric().transfer_total_bytes == lay.nbytes > 0
    r.clear()
    s.clear()
    assert r.pages_released and not D._objs and not P._objs and not P.senders


@NEED_TORCH
@pytest.mark.parametrize("prefix_pages", [2, 5])
def test_decode_prefix(engines, prefix_pages):
    """The decode side already has the first pages (its radix cache): it asks only for the rest."""
    pc, dc, P, D, addr = engines
    ppages, dpages = [11, 12, 13, 14, 15], [20, 21, 22, 23, 24]
    page = pc.page_size
    s = ks.KvstageKVSender(P, addr, 99, [0], 0)
    r = ks.KvstageKVReceiver(D, addr, 99)
    r.init(0)
    r.send_metadata(dpages[prefix_pages:], 4, [[4]], decode_prefix_len=prefix_pages * page)
    adopted(s)
    assert s.pop_decode_prefix_len() == prefix_pages * page
    pc.fill(99, ppages, 2)
    rest = ppages[s.pop_decode_prefix_len() // page:]
    s.init(len(rest), 2)
    assert s.should_send_kv_chunk(len(rest), True)
    s.send(rest, [[2]])  # all prefix: a last chunk of 0 pages that carries aux and state
    assert D.wait_until(lambda: r.poll() == KVPoll.Success, 10), r
    for b in range(len(dc.kv)):
        assert bool((dc.kv_u8(b)[dpages[prefix_pages:]] == pc.kv_u8(b)[rest]).all())
        assert bool((dc.kv_u8(b)[dpages[:prefix_pages]] == 0).all())  # the prefix pages are left alone
    assert bool((dc.aux_u8(0)[4] == pc.aux_u8(0)[2]).all()) and bool((dc.state_u8(1)[4] == pc.state_u8(1)[2]).all())
    r.clear()
    sender_done(s)
    s.clear()


@NEED_TORCH
def test_layout_mismatch_is_refused(kv_proxy):
    import sglang_engine as E
    pair = Pair(kv_proxy.socket, decode_cache=E.KVCache(64, head_dim=8))  # 128-byte pages against 192
    try:
        pc, dc, P, D, addr = pair
        s = ks.KvstageKVSender(P, addr, 5, [0], 0)
        r = ks.KvstageKVReceiver(D, addr, 5)
        r.init(0)
        assert r.poll() == KVPoll.WaitingForInput  # the layout travels in the decode side's message
        r.send_metadata([1, 2], 3, [[3]])
        assert P.wait_until(lambda: s.poll() == KVPoll.Failed, 10), s
        with pytest.raises(ks.KVTransferError, match="layout mismatch with the decode side.*kv_item_lens"):
            s.failure_exception()
        assert D.wait_until(lambda: r.poll() == KVPoll.Failed, 10), r  # refused: its room aborted at once
        r.clear()
        assert r.pages_released
        s.clear()
    finally:
        pair.close()
    assert_pool_free(kv_proxy.socket)


@NEED_TORCH
def test_topology_and_unknown_prefill_are_refused(engines):
    pc, dc, P, D, addr = engines
    D.attn_tp_size = 3  # this decode rank thinks attention TP is 3, the prefill server registered 1
    r = ks.KvstageKVReceiver(D, addr, 6)
    r.init(0)
    assert r.poll() == KVPoll.Failed and "attn_tp_size" in r._reason and "power of two" in r._reason
    r.clear()
    D.attn_tp_size = 1
    r = ks.KvstageKVReceiver(D, addr, 5)
    r.init(1)  # the prefill server has one DP rank
    assert r.poll() == KVPoll.Failed and "prefill_dp_rank 1 is not one of the prefill server's 1 DP ranks" in r._reason
    r.clear()
    D.attn_tp_size = 1
    import socket
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{free.getsockname()[1]}"
    assert not D.try_ensure_parallel_info(dead)
    r = ks.KvstageKVReceiver(D, dead, 7)
    r.init(0)
    assert r.poll() == KVPoll.Failed
    with pytest.raises(ks.KVTransferError, match="unknown or down"):
        r.failure_exception()
    r.clear()


@NEED_TORCH
def test_unreachable_prefill_rank(engines):
    """The bootstrap server names a rank whose side channel is gone: the request fails with the reason (at the
    scheduler's next poll: the message went out on the rank's own thread), its room is aborted, and the next one to
    that rank fails at once instead of waiting out a connect timeout."""
    import socket
    import sglang_engine as E
    pc, dc, P, D, addr = engines
    srv = ks.bootstrap_server_on_a_free_port()
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    reg = dict(attn_tp_size=1, attn_tp_rank=0, attn_cp_size=1, attn_cp_rank=0, attn_dp_size=1, attn_dp_rank=0,
               pp_size=1, pp_rank=0, system_dp_size=1, system_dp_rank=0, rank_ip="127.0.0.1", rank_port=port,
               page_size=dc.page_size, kv_cache_dtype="auto")
    try:
        assert ks._http("PUT", f"http://127.0.0.1:{srv.port}/route", reg)[0] == 200
        gone = f"127.0.0.1:{srv.port}"
        for k in (1, 2):
            r = ks.KvstageKVReceiver(D, gone, 40 + k)
            r.init(0)
            assert r.poll() == KVPoll.WaitingForInput
            t0 = time.monotonic()
            r.send_metadata([1, 2], 3, [[3]])
            assert D.wait_until(lambda: r.poll() == KVPoll.Failed, 10), r
            assert "could not reach the prefill rank" in r._reason, r._reason
            if k == 2:
                assert "failed moments ago" in r._reason and time.monotonic() - t0 < 1
            r.clear()
            assert r.pages_released
    finally:
        srv.close()


@NEED_TORCH
def test_device_memory_needs_the_flag(kv_proxy, monkeypatch):
    import sglang_engine as E
    monkeypatch.delenv("KVSTAGE_SGLANG_CUDA", raising=False)
    cache = E.KVCache(8)
    with pytest.raises(RuntimeError, match="untested"):
        ks.KvstageKVManager(cache.kv_args(), ks.DisaggregationMode.DECODE,
                            E.server_args(kv_proxy.socket, 0, device="cuda"))
    with pytest.raises(RuntimeError, match="not supported"):
        ks.KvstageKVManager(cache.kv_args(), ks.DisaggregationMode.DECODE,
                            E.server_args(kv_proxy.socket, 0, device="npu"))


# ------------------------------------------------------------------------------------------ pressure, aborts, clear
@NEED_TORCH
def test_pool_pressure_waits_then_completes(engines, kv_proxy):
    """With the pool held by someone else the sender keeps its chunks and waits (no failure, no blocking);
    once slots come back it finishes, byte for byte."""
    pc, dc, P, D, addr = engines
    hog = kvstage.Client(kv_proxy.socket)
    held = hog.acquire(hog.slot_count - 2)
    ppages, dpages = list(range(0, 60)), list(range(60, 0, -1))[:60]
    s, r = start(engines, 31337, ppages, dpages, 1, chunks=(20, 20))  # ~22 slots, 2 free
    for _ in range(20):
        assert s.poll() == KVPoll.Transferring and r.poll() == KVPoll.Transferring
    assert stat(kv_proxy.socket)["slots"]["free"] == 0
    for lease in held:
        hog.release(lease)
    hog.close()
    assert D.wait_until(lambda: s.poll() == KVPoll.Success and r.poll() == KVPoll.Success, 10), (s, r)
    assert dc.check(31337, dpages, 1) is None
    r.clear()
    s.clear()


def _ctl(socket_path, *args):
    exe = Path(kvstaged_path()).resolve().parent.parent / "tools" / "kvstage-ctl"
    out = subprocess.run([str(exe), "-s", socket_path, "-t", "10000", *args], capture_output=True, text=True,
                         timeout=20)
    assert out.returncode == 0, out.stderr


@NEED_TORCH
@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_clear_waits_for_the_aborted_room(side):
    """An abort while a chunk is held in flight (failpoint local.quiesce): Failed at once on the aborting side;
    the room's ABORTED cannot come before the chunk quiesces, so clear() waits, gives up at clear_timeout with
    pages_released still False and keeps tracking the room; once the chunk is let go, ABORTED comes, the room is
    closed in the background and pages_released turns True. Nothing reaches the decode pages."""
    px = Proxy(["--slots", "256", "--slot-size", "4096", "--failpoints"])
    pair = None
    try:
        pair = Pair(px.socket)
        pc, dc, P, D, addr = pair
        ppages, dpages = list(range(0, 40)), list(range(20, 60))
        s = ks.KvstageKVSender(P, addr, 8, [0], 0)
        r = ks.KvstageKVReceiver(D, addr, 8)
        r.init(0)
        r.send_metadata(dpages, 2, [[2]])
        adopted(s)
        _ctl(px.socket, "set", "local.quiesce", "pause", "--match", str(r._uid))
        pc.fill(8, ppages, 2)
        s.init(len(ppages), 2)
        s.send(ppages[:30])  # several slots complete and sent; the rest waits for the last chunk
        assert s._sent_chunks > 0
        _ctl(px.socket, "wait", "local.quiesce", "1")  # one hand-off is held in flight
        (r if side == "decode" else s).abort()
        assert (r if side == "decode" else s).poll() == KVPoll.Failed
        if side == "prefill":
            s.clear()
            assert r.poll() == KVPoll.Transferring  # the decode side hears only once the room has ended
            assert not D.wait_until(lambda: r.poll() == KVPoll.Failed, 0.2)
            _ctl(px.socket, "set", "local.quiesce", "off")
            assert D.wait_until(lambda: r.poll() == KVPoll.Failed, 10)
            assert "aborted by the prefill side" in r._reason
            r.clear()
            assert r.pages_released and r._final.type == kvstage.EventType.ABORTED and not D._objs
        else:
            _decode_abort_then_clear(px, P, D, s, r)
        assert bool((dc.kv_u8(0)[dpages] == 0).all())  # nothing of it reached the decode pages
    finally:
        if pair is not None:
            pair.close()
            assert_pool_free(px.socket)
        px.stop()
        shutil.rmtree(px.dir, ignore_errors=True)


def _decode_abort_then_clear(px, P, D, s, r):
    r.clear_timeout = 0.3
    t0 = time.monotonic()
    r.clear()
    assert time.monotonic() - t0 >= 0.3  # it waited for the room's end
    assert not r.pages_released and r._final is None and D._objs  # gave up waiting, still tracked
    _ctl(px.socket, "set", "local.quiesce", "off")
    assert D.wait_until(lambda: r.pages_released, 10)
    assert r._final.type == kvstage.EventType.ABORTED and not D._objs and r.poll() == KVPoll.Failed
    assert P.wait_until(lambda: s.poll() == KVPoll.Failed, 10)
    s.clear()


@NEED_TORCH
def test_second_request_for_a_room_is_refused(engines):
    """A forged or repeated transfer request for a bootstrap room already in use gets its room aborted."""
    pc, dc, P, D, addr = engines
    s, r = start(engines, 321, [1, 2, 3, 4], [5, 6, 7, 8], 1)
    r2 = ks.KvstageKVReceiver(D, addr, 321)  # same bootstrap_room, another decode request
    r2.init(0)
    r2.send_metadata([9, 10], 2, [[2]])
    assert D.wait_until(lambda: s.poll() == KVPoll.Success and r.poll() == KVPoll.Success
                        and r2.poll() == KVPoll.Failed, 10), (s, r, r2)
    assert dc.check(321, [5, 6, 7, 8], 1) is None
    for x in (r, r2, s):
        x.clear()


# ----------------------------------------------------------------------------------------------------- CUDA copier
class _FakeStream:
    """A stream of the stand-in device: its copies land only when it is synchronised."""

    def __init__(self, fake, handle):
        self.fake, self.cuda_stream, self.syncs = fake, handle, 0

    def synchronize(self):
        self.syncs += 1
        for op in self.fake.queued.pop(self.cuda_stream, []):
            op()


class _FakeCuda:
    """Stands in for kvstage.cuda on host memory: 'device' pointers are host addresses. A call checks what
    include/kvstage_cuda.h says the library checks (the range inside the slot, no write into a received slot,
    no NULL page, int32 indices >= 0) and queues its copy on the stream; the copy lands at the stream's
    synchronize (a send before it would find the lease gone and the slot unwritten). .calls: what was asked."""

    def __init__(self):
        self.calls, self.queued = [], {}

    def _queue(self, kind, lease, slot_off, page_size, pages, stream, write):
        pages = [int(p) for p in pages]
        view = lease.view()
        if write and view.readonly:
            raise ValueError(f"{kind}: {lease!r} is read-only")
        if slot_off + len(pages) * page_size > len(view) or not all(pages):
            raise ValueError(f"{kind}: past the slot's end or a NULL page")  # -EINVAL
        del view
        self.calls.append(types.SimpleNamespace(kind=kind, slot=lease.slot, off=slot_off, page_size=page_size,
                                                pages=pages, nbytes=len(pages) * page_size, stream=stream))

        def land():
            v = lease.view()  # raises if the lease is no longer held (sent, released)
            for k, p in enumerate(pages):
                at = slot_off + k * page_size
                if write:
                    v[at:at + page_size] = host_bytes(p, page_size)
                else:
                    host_bytes(p, page_size)[:] = v[at:at + page_size]
        self.queued.setdefault(stream, []).append(land)

    @staticmethod
    def _at(dev_base, page_idx, page_size):
        idx = [int(i) for i in page_idx]
        if any(not 0 <= i < 1 << 31 for i in idx):
            raise ValueError("page indices must be in [0, 2**31)")
        return [dev_base + i * page_size for i in idx]

    def copy_in_device(self, lease, dev_ptr, nbytes, slot_off=0, stream=None, done=None):
        self._queue("in", lease, slot_off, nbytes, [dev_ptr], stream, True)

    def copy_out_device(self, lease, dev_ptr, nbytes, slot_off=0, stream=None, done=None):
        self._queue("out", lease, slot_off, nbytes, [dev_ptr], stream, False)

    def gather(self, lease, dev_pages, page_size, slot_off=0, stream=None, done=None):
        self._queue("gather", lease, slot_off, page_size, dev_pages, stream, True)

    def scatter(self, lease, dev_pages, page_size, slot_off=0, stream=None, done=None):
        self._queue("scatter", lease, slot_off, page_size, dev_pages, stream, False)

    def gather_idx(self, lease, dev_base, page_idx, page_size, slot_off=0, stream=None, done=None):
        self._queue("gather_idx", lease, slot_off, page_size, self._at(dev_base, page_idx, page_size), stream, True)

    def scatter_idx(self, lease, dev_base, page_idx, page_size, slot_off=0, stream=None, done=None):
        self._queue("scatter_idx", lease, slot_off, page_size, self._at(dev_base, page_idx, page_size), stream, False)


def test_fake_cuda_matches_kvstage_cuda():
    for name in ("copy_in_device", "copy_out_device", "gather", "scatter", "gather_idx", "scatter_idx"):
        assert (list(inspect.signature(getattr(kvstage.cuda, name)).parameters)
                == list(inspect.signature(getattr(_FakeCuda, name)).parameters)[1:]), name


def test_device_layout_extents():
    """Device KV and state buffers: device extents, the same offsets and checks as host ones; aux stays host."""
    lay = ks.RoomLayout(_mem(kv_device=True), npages=3, has_aux=True, state_counts=[2])
    assert lay.kv_extents([9, 4, 5], 0) == [Extent(0, 0x10000, 100, 100, (9, 4, 5), True),
                                            Extent(300, 0x20000, 60, 60, (9, 4, 5), True)]
    assert lay.kv_extents([7], 2) == [Extent(200, 0x10000, 100, 100, (7,), True),
                                      Extent(420, 0x20000, 60, 60, (7,), True)]
    assert lay.kv_extents([], 3) == []
    assert lay.aux_extents(3) == [Extent(480, 0x30000, 16, 16, (3,), False), Extent(496, 0x40000, 8, 8, (3,), False)]
    assert lay.state_extents([[7, 6]]) == [Extent(504, 0x50000, 12, 12, (7, 6), True),
                                           Extent(528, 0x60000, 4, 4, (7, 6), True)]
    for bad in (lambda: lay.kv_extents([10], 0), lambda: lay.kv_extents([1, 2], 2),
                lambda: lay.state_extents([[9, 10]])):
        with pytest.raises(ValueError):
            bad()


def _device_regions(lay):
    """[(room_off, nbytes, item)] of the room's device regions (KV buffers, state tensors)."""
    out = [(off, lay.npages * r.item, r.item) for off, r in zip(lay.kv_off, lay.mem.kv)]
    for comp, offs, n in zip(lay.mem.state, lay.state_off, lay.state_counts):
        out += [(off, n * r.item, r.item) for off, r in zip(offs, comp)]
    return out


def _expected_scatter_calls(lay, ss):
    """(gathers, partial-page copies) a copy-out of lay takes: for every device region and slot it touches, one
    gather of its whole pages there, and one copy for each page cut by the slot's start or end."""
    gathers = partials = 0
    for off, n, item in _device_regions(lay):
        for s in range(off // ss, (off + n - 1) // ss + 1) if n else ():
            lo, hi = max(off, s * ss) - off, min(off + n, (s + 1) * ss) - off
            whole = hi // item - -(-lo // item)
            gathers += whole > 0
            partials += (lo % item != 0) + (hi % item != 0) if whole >= 0 else 1
    return gathers, partials


_rng = random.Random(5)
CUDA_CASES = {  # (prefill pages, decode pages, chunks, head_dim: 12 makes 192-byte pages, 16 256-byte ones)
    "scattered": ([9, 2, 33, 34, 35, 1, 60, 61, 17, 18, 40, 5], [8, 7, 6, 5, 4, 3, 2, 1, 30, 31, 32, 50], (3, 4), 12),
    "shuffled": (_rng.sample(range(64), 40), _rng.sample(range(64), 40), (13, 13), 12),
    "contiguous": (list(range(10, 50)), list(range(20, 60)), (16,), 12),
    "contiguous-aligned": (list(range(10, 50)), list(range(20, 60)), (16,), 16),
    "shuffled-aligned": (_rng.sample(range(64), 40), _rng.sample(range(64), 40), (13, 13), 16),
}


@NEED_TORCH
@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_cuda_copier_calls(kv_proxy, case):
    """The CUDA path's plan against a stand-in device on host memory whose copies land only at a stream sync:
    a gather_idx / scatter_idx per (buffer, slot), a plain copy for a page cut by a slot boundary, the bytes
    exactly as the CPU path's (every decode tensor equal, decode pages equal to the prefill pages in the lists'
    order), every call on the copier's stream, a sync before every send and before Success. Not on a GPU."""
    import sglang_engine as E
    ppages, dpages, chunks, head_dim = CUDA_CASES[case]
    pair = Pair(kv_proxy.socket, prefill_cache=E.KVCache(64, head_dim=head_dim),
                decode_cache=E.KVCache(64, head_dim=head_dim))
    try:
        _cuda_copier_calls(pair, case, ppages, dpages, chunks)
    finally:
        pair.close()
    assert_pool_free(kv_proxy.socket)


def _cuda_copier_calls(engines, case, ppages, dpages, chunks):
    import torch
    pc, dc, P, D, addr = engines

    def tensors(c):  # every byte of a cache (as bytes: a float16 NaN is not equal to itself)
        return [t.reshape(-1).view(torch.uint8) for t in c.kv + c.aux + [t for comp in c.state for t in comp]]

    # the CPU path first
    s, r = start(engines, 777, ppages, dpages, 6, chunks=chunks)
    assert D.wait_until(lambda: r.poll() == KVPoll.Success, 10), r
    sender_done(s)
    cpu = [t.clone() for t in tensors(dc)]
    host_lay = r._layout
    r.clear()
    s.clear()
    for t in tensors(dc):
        t.zero_()
    # then the same request through the CUDA copier
    fake = _FakeCuda()
    ps, ds = _FakeStream(fake, 0x5151), _FakeStream(fake, 0x5152)
    P.copier, D.copier = CudaCopier(cuda_api=fake, stream=ps), CudaCopier(cuda_api=fake, stream=ds)
    P.mem, D.mem = ks.MemoryMap(pc.kv_args(), kv_device=True), ks.MemoryMap(dc.kv_args(), kv_device=True)
    s, r = start(engines, 777, ppages, dpages, 6, chunks=chunks)
    assert D.wait_until(lambda: r.poll() == KVPoll.Success, 10), r
    sender_done(s)
    assert dc.check(777, dpages, 6) is None
    assert all(torch.equal(a, b) for a, b in zip(cpu, tensors(dc)))  # as the CPU path's, nothing else touched
    for b in range(len(dc.kv)):
        assert torch.equal(dc.kv_u8(b)[dpages], pc.kv_u8(b)[ppages])  # decode page k holds prefill page k
    assert not fake.queued and ps.syncs >= 1 and ds.syncs == 1
    assert {c.stream for c in fake.calls} == {0x5151, 0x5152}

    ss = P.client().slot_size
    lay = r._layout
    ins = [c for c in fake.calls if c.stream == 0x5151]
    outs = [c for c in fake.calls if c.stream == 0x5152]
    assert {c.kind for c in ins} <= {"gather_idx", "in"} and {c.kind for c in outs} <= {"scatter_idx", "out"}
    # every device byte of the room (KV and state; aux is host memory, the CPU copies it) once, on both sides
    device_bytes = sum(n for _, n, _ in _device_regions(lay))
    for side in (ins, outs):
        spans = sorted((c.slot * ss + c.off, c.nbytes) for c in side)
        assert sum(n for _, n in spans) == device_bytes
        assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))
    # the decode side, per (device region, slot): one scatter of its whole pages plus a copy per cut page, or one
    # copy per run of adjacent pages, whichever is fewer; so never more than either form in all
    gathers, partials = _expected_scatter_calls(lay, ss)
    assert sum(c.kind == "scatter_idx" for c in outs) <= gathers and len(outs) <= gathers + partials
    # what one copy per run of pages takes (the CPU path's plan): the host layout's runs, cut at slots
    before_out = len(plan(host_lay.kv_extents(dpages, 0) + host_lay.state_extents([[6]]), ss))
    before_in, at = 0, 0
    for n in list(chunks) + [len(ppages)]:
        n = min(n, len(ppages) - at)
        last = at + n == len(ppages)
        ext = host_lay.kv_extents(ppages[at:at + n], at) + (host_lay.state_extents([[6]]) if last else [])
        before_in += len(plan(ext, ss))
        at += n
        if last:
            break
    print(f"{case}: prefill calls {before_in} -> {len(ins)} ({sum(c.kind == 'gather_idx' for c in ins)} gather_idx), "
          f"decode calls {before_out} -> {len(outs)} ({sum(c.kind == 'scatter_idx' for c in outs)} scatter_idx)")
    assert len(ins) <= before_in and len(outs) <= before_out  # never more calls than a copy per run
    if case.startswith("contiguous"):  # one run a buffer: a plain copy a slot, as before, cut pages and all
        assert (len(ins), len(outs)) == (before_in, before_out)
        assert not [c for c in fake.calls if c.kind.endswith("_idx")]
    else:
        assert len(outs) < before_out and len(ins) < before_in
    r.clear()
    s.clear()


# ----------------------------------------------------------------------------------------------- a proxy that dies
@NEED_TORCH
def test_proxy_killed_mid_transfer():
    px = Proxy(["--slots", "256", "--slot-size", "4096"])
    pair = None
    try:
        pair = Pair(px.socket)
        pc, dc, P, D, addr = pair
        s = ks.KvstageKVSender(P, addr, 1, [0], 0)
        r = ks.KvstageKVReceiver(D, addr, 1)
        r.init(0)
        r.send_metadata(list(range(30)), 1, [[1]])
        adopted(s)
        pc.fill(1, list(range(30)), 1)
        s.init(30, 1)
        s.send(list(range(20)))
        px.proc.send_signal(signal.SIGKILL)
        px.proc.wait()
        assert D.wait_until(lambda: r.poll() == KVPoll.Failed, 10)
        assert P.wait_until(lambda: s.poll() == KVPoll.Failed, 10)
        assert "connection to kvstaged lost" in r._reason and "connection to kvstaged lost" in s._reason
        s.send(list(range(20, 30)), [[1]])  # the scheduler may still send: ignored
        r.clear()
        s.clear()
        assert r.pages_released
        r2 = ks.KvstageKVReceiver(D, addr, 2)  # a new request: no proxy to reconnect to
        r2.init(0)
        r2.send_metadata([1], 2, [[2]])
        assert r2.poll() == KVPoll.Failed and "could not open a room" in r2._reason
        r2.clear()
        assert bool((dc.kv_u8(0)[list(range(30))] == 0).all())
    finally:
        if pair is not None:
            pair.close()
        px.stop()
        shutil.rmtree(px.dir, ignore_errors=True)


# ------------------------------------------------------------------------------------- across two proxies over tcp
@NEED_TORCH
def test_across_two_proxies_over_tcp():
    """Prefill on proxy A, decode on proxy B (it listens); descriptors name B, A dials it. The backend is
    unchanged: each manager talks only to its own proxy."""
    d = tempfile.mkdtemp(prefix="kvs-secret-")
    secret = os.path.join(d, "peer.secret")
    with open(secret, "wb") as f:
        f.write(os.urandom(32))
    os.chmod(secret, 0o600)
    args = ["--slots", "256", "--slot-size", "4096", "--peer-secret-file", secret]
    pa = pb = pair = None
    try:
        pa = Proxy(args)
        pb = Proxy(args + ["--listen", "127.0.0.1:0"])
        import sglang_engine as E
        pc, dc = E.KVCache(64), E.KVCache(64)
        server = ks.bootstrap_server_on_a_free_port()
        addr = f"127.0.0.1:{server.port}"
        pair = types.SimpleNamespace(pc=pc, dc=dc, addr=addr, server=server,
                                     P=ks.KvstageKVManager(pc.kv_args(), ks.DisaggregationMode.PREFILL,
                                                           E.server_args(pa.socket, server.port)),
                                     D=ks.KvstageKVManager(dc.kv_args(), ks.DisaggregationMode.DECODE,
                                                           E.server_args(pb.socket, 0)))
        P, D = pair.P, pair.D
        assert D.try_ensure_parallel_info(addr)
        eng = (pc, dc, P, D, addr)
        done = []
        for k, (pp, dp) in enumerate([([1, 2, 3], [7, 8, 9]), (list(range(10, 40)), list(range(30, 60))),
                                      ([5], [4])]):
            s, r = start(eng, 500 + k, pp, dp, k, chunks=(10,))
            done.append((s, r, pp, dp, k))
        # and one the decode side aborts with chunks on the wire
        s_ab = ks.KvstageKVSender(P, addr, 600, [0], 0)
        r_ab = ks.KvstageKVReceiver(D, addr, 600)
        r_ab.init(0)
        r_ab.send_metadata(list(range(0, 30)), 9, [[9]])
        adopted(s_ab)
        pc.fill(600, list(range(30, 60)), 9)
        s_ab.init(30, 9)
        s_ab.send(list(range(30, 50)))
        r_ab.abort()
        for s, r, pp, dp, k in done:
            assert D.wait_until(lambda: r.poll() == KVPoll.Success, 20), r
            assert P.wait_until(lambda: s.poll() == KVPoll.Success, 20), s
            assert dc.check(500 + k, dp, k) is None
            r.clear()
            s.clear()
        r_ab.clear()
        assert r_ab.pages_released
        assert P.wait_until(lambda: s_ab.poll() == KVPoll.Failed, 20)
        s_ab.clear()
        tcp = stat(pa.socket).get("tcp")  # (a kvstage-stat older than the tcp counters has none)
        assert tcp is None or (tcp["peers"] == 1 and tcp["bytes_tx"] > 0)
    finally:
        if pair is not None:
            pair.P.close()
            pair.D.close()
            pair.server.close()
        for px in (pa, pb):
            if px is not None:
                assert_pool_free(px.socket)
                px.stop()
                shutil.rmtree(px.dir, ignore_errors=True)
        shutil.rmtree(d, ignore_errors=True)
