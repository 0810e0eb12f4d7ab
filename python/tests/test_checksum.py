"""End-to-end checksums (kvstage.checksum, kvstage_checksum): CRC32C of each chunk computed by the prefill engine's
copy into slots, carried in the room's trailer, checked by the decode engine before it copies anything out."""
import ctypes
import struct

import pytest

from kvstage import checksum as crc
from sglang_common import NEED_TORCH, assert_pool_free, kv_proxy, two_proxies  # noqa: F401 (fixtures)


def test_crc32c_and_the_trailer():
    buf = ctypes.create_string_buffer(b"123456789")
    assert crc.crc32c(ctypes.addressof(buf), 9) == 0xE3069283  # the CRC32C check value
    dst = ctypes.create_string_buffer(9)
    assert crc.copy_crc32c(ctypes.addressof(dst), ctypes.addressof(buf), 9) == 0xE3069283 and dst.raw == buf.raw[:9]
    a, b = crc.crc32c(ctypes.addressof(buf), 4), crc.crc32c(ctypes.addressof(buf) + 4, 5)
    assert crc.combine([(4, 5, b), (0, 4, a)], 9) == 0xE3069283  # pieces in any order
    with pytest.raises(ValueError, match="gap or overlap at byte 4"):
        crc.combine([(0, 4, a), (5, 4, b)], 9)
    with pytest.raises(ValueError, match="cover 4 of its 9"):
        crc.combine([(0, 4, a)], 9)
    assert crc.chunks(4096, 4096) == 1 and crc.chunks(4097, 4096) == 2
    assert crc.trailer_size(4097, 4096) == 16
    t = crc.trailer([1, 0xFFFFFFFF])
    assert t[:4] == b"KVSC" and struct.unpack("<III", t[4:]) == (2, 1, 0xFFFFFFFF)


def _pd(socket, d_socket=None, p_crc=True, d_crc=True, **kw):
    import vllm_engine as E
    return E.PD(socket, p_kw=dict(extra={"kvstage_checksum": p_crc}, **kw),
                d_kw=dict(extra={"kvstage_checksum": d_crc}, **kw), d_socket=d_socket)


@NEED_TORCH
def test_transfers_with_checksums(kv_proxy):
    """Prompts whose rooms end inside a slot, on a slot's end, one slot, many: with checksums on both sides every
    decode request's blocks are the prefill's, and each room carried its trailer (one CRC a chunk)."""
    sizes = [1, 5, 16, 17, 33, 52]
    pair = _pd(kv_proxy.socket)
    try:
        for k, n in enumerate(sizes):
            pair.add(k, n)
        pair.run(lambda: len(pair.D.freed) == len(sizes) and not pair.P.requests, what="all loaded")
        assert pair.D.loaded == {f"d{k}": None for k in range(len(sizes))}
        st = pair.D.agent.take_stats()
        assert st.data["num_checksum_failures"] == [] and len(st.data["bytes_received"]) == len(sizes)
    finally:
        pair.close()
    assert_pool_free(kv_proxy.socket)


@NEED_TORCH
def test_sides_that_differ_are_refused(kv_proxy):
    """Checksums on one side only: the prefill worker refuses the load, saying why; nothing is written."""
    import vllm_engine as E
    for p_crc, d_crc in ((True, False), (False, True)):
        pair = _pd(kv_proxy.socket, p_crc=p_crc, d_crc=d_crc)
        try:
            pair.add(0, 10)
            pair.run(lambda: "d0" in pair.D.freed, what="load failed")
            assert pair.D.loaded["d0"] == "load failed", pair.D.loaded
            assert "aborted by the prefill side" in pair.D.agent.ended["d0"]
            assert bool((pair.D.kv[E.LAYER_NAMES[0]] == 0).all())
        finally:
            pair.close()
        assert_pool_free(kv_proxy.socket)


def _corrupt_a_landed_byte(socket, d_socket, checksum):
    """A request whose decode copy-out is held (the test's gate) once its room landed; one byte of the landed
    slot changed meanwhile, as a transport or a proxy gone wrong would; then the copy-out let go. Returns (pair
    state after, what the decode side loaded, its stats)."""
    import vllm_engine as E
    pair = _pd(socket, d_socket, p_crc=checksum, d_crc=checksum)
    try:
        gate = E.GatedCopier(hold={("d0", "load")})
        pair.D.agent.copier = gate
        pair.add(0, 40)
        pair.run(lambda: gate.queued("d0", "load"), what="the room landed, its copy-out held")
        room = pair.D.agent._loads["d0"].shares[0].room
        addr = room.lease(1).address + 100  # a byte of the payload's second chunk
        byte = ctypes.c_ubyte.from_address(addr)
        byte.value ^= 0x5A
        gate.release("d0", "load")
        pair.run(lambda: "d0" in pair.D.freed, what="the load ended")
        return pair.D.loaded["d0"], pair.D.agent.ended.get("d0"), pair.D.agent.take_stats()
    finally:
        pair.close()


@NEED_TORCH
def test_a_byte_changed_in_a_landed_slot_fails_the_request(kv_proxy):
    """With checksums the changed byte is caught before any copy out: the load fails with its own reason and
    counter, and no byte of the request reaches the decode blocks. Without them (the red) it is delivered."""
    loaded, why, stats = _corrupt_a_landed_byte(kv_proxy.socket, None, True)
    assert loaded == "load failed" and "end-to-end checksum mismatch, nothing copied out: chunk 1 of" in why, why
    assert stats.data["num_checksum_failures"] == [1] and stats.data["num_failed_transfers"] == [1]
    assert stats.reduce()["Num checksum failures"] == 1
    assert_pool_free(kv_proxy.socket)
    loaded, why, stats = _corrupt_a_landed_byte(kv_proxy.socket, None, False)
    assert loaded is not None and "differ" in loaded, (loaded, why)  # the changed byte is in the blocks
    assert stats.data["num_checksum_failures"] == []
    assert_pool_free(kv_proxy.socket)


@NEED_TORCH
def test_checksums_across_two_proxies(two_proxies):
    """The same over tcp between two kvstaged (the default --peer-timeout): exact with checksums, and a byte
    changed in a slot landed on proxy B caught."""
    pa, pb = two_proxies
    pair = _pd(pa.socket, pb.socket)
    try:
        for k, n in enumerate([3, 16, 40]):
            pair.add(k, n)
        pair.run(lambda: len(pair.D.freed) == 3 and not pair.P.requests, what="all loaded")
        assert pair.D.loaded == {"d0": None, "d1": None, "d2": None}
    finally:
        pair.close()
    loaded, why, stats = _corrupt_a_landed_byte(pa.socket, pb.socket, True)
    assert loaded == "load failed" and "checksum mismatch" in why and stats.data["num_checksum_failures"] == [1]
    assert_pool_free(pa.socket)
    assert_pool_free(pb.socket)


@NEED_TORCH
@pytest.mark.parametrize("p_tp,d_tp,mla", [(2, 4, False), (4, 2, False), (2, 4, True)],
                         ids=["P2-D4", "P4-D2", "MLA-P2-D4"])
def test_checksums_with_head_shares_and_mla(kv_proxy, p_tp, d_tp, mla):
    """A room per rank pair (each its own trailer over its heads' share), and MLA's one shared room read by every
    decode rank (each checks it): exact on every rank."""
    import vllm_engine as E
    heads = {} if mla else {"kv_heads": 4}  # 4 KV heads: they split into either side's ranks
    pair = E.PD(kv_proxy.socket, p_kw=dict(tp=p_tp, mla=mla, extra={"kvstage_checksum": True,
                                                                    "kvstage_decode_tp_size": d_tp}, **heads),
                d_kw=dict(tp=d_tp, mla=mla, extra={"kvstage_checksum": True}, **heads))
    try:
        for k, n in enumerate([5, 17, 40]):
            pair.add(k, n)
        pair.run(lambda: len(pair.D.freed) == 3 and not pair.P.requests, what="all loaded")
        assert pair.D.loaded == {"d0": None, "d1": None, "d2": None}, pair.D.loaded
    finally:
        pair.close()
    assert_pool_free(kv_proxy.socket)


# ------------------------------------------------------------------------------------------ SGLang ($KVSTAGE_CHECKSUM)
def _sglang_pair(socket, monkeypatch, p_crc, d_crc):
    """A prefill and a decode manager on one proxy, each with its own $KVSTAGE_CHECKSUM."""
    from sglang_common import Pair
    monkeypatch.setenv("KVSTAGE_CHECKSUM", "1" if p_crc else "0")
    pair = Pair(socket)
    monkeypatch.setenv("KVSTAGE_CHECKSUM", "1" if d_crc else "0")
    try:
        pair.D.close()
        import sglang_engine as E
        from kvstage import sglang as ks
        pair.D = ks.KvstageKVManager(pair.dc.kv_args(), ks.DisaggregationMode.DECODE, E.server_args(socket, 0))
        assert pair.D.try_ensure_parallel_info(pair.addr)
    except BaseException:
        pair.close()
        raise
    return pair


@NEED_TORCH
@pytest.mark.parametrize("ppages,dpages,chunks", [([7], [3], ()), (list(range(10, 50)), list(range(0, 40)), (9, 9)),
                                                  ([9, 2, 33, 34, 35, 1, 60, 61], [8, 7, 6, 5, 4, 3, 2, 1], (1, 2))],
                         ids=["one-page", "many-slots", "scattered"])
def test_sglang_transfers_with_checksums(kv_proxy, monkeypatch, ppages, dpages, chunks):
    from kvstage.sglang import KVPoll
    from sglang_common import sender_done, start
    pair = _sglang_pair(kv_proxy.socket, monkeypatch, True, True)
    try:
        s, r = start(pair, 4242, ppages, dpages, 9, chunks=chunks, prow=3)
        assert pair.D.wait_until(lambda: r.poll() == KVPoll.Success, 10), r
        sender_done(s)
        assert pair.dc.check(4242, dpages, 9) is None
        sh = r._shares[0]
        assert sh.room_nbytes == sh.layout.nbytes + crc.trailer_size(sh.layout.nbytes, 4096) > sh.layout.nbytes
        r.clear()
        s.clear()
        assert pair.D.checksum_failures == 0
    finally:
        pair.close()
    assert_pool_free(kv_proxy.socket)


@NEED_TORCH
@pytest.mark.parametrize("checksum", [True, False], ids=["checked", "red-unchecked"])
def test_sglang_a_byte_changed_in_a_landed_slot(kv_proxy, monkeypatch, checksum):
    """The room lands, its copy-out held (a busy copy stream); a byte of the landed slot changes; the copy-out runs.
    Checked: the request fails with its reason, counted, its decode pages untouched. Unchecked (the red): the
    changed byte is in the decode pages."""
    import test_sglang_seed as seed
    from kvstage.sglang import KVPoll
    from sglang_common import sender_done, start
    pair = _sglang_pair(kv_proxy.socket, monkeypatch, checksum, checksum)
    try:
        gate = pair.D.copier = seed.GatedCopier()
        dpages = list(range(0, 40))
        s, r = start(pair, 77, list(range(10, 50)), dpages, 4)
        sender_done(s)
        assert pair.D.wait_until(lambda: gate.queued(77), 10)
        assert r._room.chunks > 1
        byte = ctypes.c_ubyte.from_address(r._room.lease(1).address + 100)
        byte.value ^= 0x5A
        gate.run(77)
        if checksum:
            assert r.poll() == KVPoll.Failed and "end-to-end checksum mismatch" in r._reason, r._reason
            assert pair.D.checksum_failures == 1
            assert all(bool((pair.dc.kv_u8(b)[dpages] == 0).all()) for b in range(len(pair.dc.kv)))
        else:
            assert r.poll() == KVPoll.Success and pair.dc.check(77, dpages, 4) is not None
        r.clear()
        s.clear()
    finally:
        pair.close()
    assert_pool_free(kv_proxy.socket)


@NEED_TORCH
def test_sglang_sides_that_differ_are_refused(kv_proxy, monkeypatch):
    from kvstage.sglang import KVPoll
    from kvstage import sglang as ks
    pair = _sglang_pair(kv_proxy.socket, monkeypatch, False, True)
    try:
        s = ks.KvstageKVSender(pair.P, pair.addr, 5, [0], 0)
        r = ks.KvstageKVReceiver(pair.D, pair.addr, 5)
        r.init(0)
        r.send_metadata([1, 2, 3], 1, [[1]])
        assert pair.P.wait_until(lambda: s.poll() == KVPoll.Failed, 10), s
        assert "checksums: on on the decode side, off here" in s._reason, s._reason
        assert pair.D.wait_until(lambda: r.poll() == KVPoll.Failed, 10), r
        r.clear()
        s.clear()
    finally:
        pair.close()
    assert_pool_free(kv_proxy.socket)
