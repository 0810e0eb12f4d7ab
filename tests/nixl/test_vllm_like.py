"""NIXL's agent API through its Python bindings, driven the way vLLM's NixlConnector drives it, in two processes
on two kvstaged proxies over TCP: the decode engine pulls (READ) the prefill's blocks with the request id as the
notification, and a push (WRITE) for SGLang's and TRT-LLM's direction; every byte compared, every
notification checked. The backends are created with no parameters (vLLM's nixl_agent_config(backends=[...])):
everything comes from the environment."""
import pytest

REGIONS, BLOCKS, BLOCK_LEN = 8, 64, 16384  # 8 regions (4 layers, K and V) of 64 blocks of 16 KiB


def _pair(make_engine, two_proxies, **env):
    a, b = two_proxies
    prefill = make_engine("prefill", a, **env)
    decode = make_engine("decode", b, **env)
    p = prefill.call("init", name="prefill-0")
    d = decode.call("init", name="decode-0")
    assert p["name"] == "prefill-0" and d["name"] == "decode-0"
    pbases = prefill.call("alloc", regions=REGIONS, blocks=BLOCKS, block_len=BLOCK_LEN, seed=1)
    dbases = decode.call("alloc", regions=REGIONS, blocks=BLOCKS, block_len=BLOCK_LEN, seed=None)
    return prefill, decode, pbases, dbases


def _ids(block_ids):
    return [r * BLOCKS + b for r in range(REGIONS) for b in block_ids]


def test_read_pull_across_two_proxies(make_engine, two_proxies):
    """vLLM's pull: decode reads 16 scattered prefill blocks of every region (2 MiB, two rooms of 1 MiB) into its
    blocks 0..15; DONE means the bytes are in decode's pages; prefill gets the request id as its notification."""
    prefill, decode, pbases, dbases = _pair(make_engine, two_proxies)
    remote = decode.call("add_remote", md=prefill.call("md"))
    assert remote == "prefill-0"
    local_h = decode.call("prep_local")
    remote_h = decode.call("prep_remote", agent=remote, bases=pbases, blocks=BLOCKS, block_len=BLOCK_LEN)
    src = [3 * i + 1 for i in range(16)]
    dst = list(range(16))
    x = decode.call("xfer", kind="READ", local=local_h, local_ids=_ids(dst), remote=remote_h,
                    remote_ids=_ids(src), notif=b"req-1:1")
    assert x["state"] in ("PROC", "DONE")
    assert decode.call("wait", xid=x["id"]) == "DONE"
    assert decode.call("read_blocks", block_ids=dst) == prefill.call("read_blocks", block_ids=src)
    assert decode.call("digest", block_ids=[16]) == decode.call("digest", block_ids=[17])  # untouched: zeros
    assert prefill.call("notifs", want=1) == [("decode-0", b"req-1:1")]
    st = decode.stats()
    assert st["completed"] == 1 and st["failed"] == 0
    ps = prefill.wait_stats(lambda s: s["served_read"] == 1)
    assert ps["refused_descs"] == 0 and ps["bad_mac"] == 0


def test_many_reads_in_flight(make_engine, two_proxies):
    """Eight requests posted before any is checked (vLLM posts every ready request in one step), each to its own
    blocks with its own notification: all complete, byte-exact, eight notifications."""
    prefill, decode, pbases, dbases = _pair(make_engine, two_proxies)
    remote = decode.call("add_remote", md=prefill.call("md"))
    local_h = decode.call("prep_local")
    remote_h = decode.call("prep_remote", agent=remote, bases=pbases, blocks=BLOCKS, block_len=BLOCK_LEN)
    xs = []
    for k in range(8):
        src, dst = [63 - 2 * k, 62 - 2 * k], [2 * k, 2 * k + 1]
        x = decode.call("xfer", kind="READ", local=local_h, local_ids=_ids(dst), remote=remote_h,
                        remote_ids=_ids(src), notif=f"req-{k}:1".encode())
        xs.append((x["id"], src, dst))
    for xid, src, dst in xs:
        assert decode.call("wait", xid=xid) == "DONE"
        assert decode.call("read_blocks", block_ids=dst) == prefill.call("read_blocks", block_ids=src)
    got = prefill.call("notifs", want=8)
    assert sorted(got) == sorted(("decode-0", f"req-{k}:1".encode()) for k in range(8))


def test_more_in_flight_than_the_pools_hold(make_engine, two_proxies):
    """Four READs of 2 MiB each posted at once against 4 MiB pools (eight rooms of 1 MiB): receiving rooms are
    opened only while half the pool covers them, so every request completes, byte-exact, none waiting on a room
    that cannot fill."""
    prefill, decode, pbases, dbases = _pair(make_engine, two_proxies)
    remote = decode.call("add_remote", md=prefill.call("md"))
    local_h = decode.call("prep_local")
    remote_h = decode.call("prep_remote", agent=remote, bases=pbases, blocks=BLOCKS, block_len=BLOCK_LEN)
    xs = []
    for k in range(4):
        src, dst = [(5 * k + 3 * i) % BLOCKS for i in range(16)], list(range(16 * k, 16 * k + 16))
        x = decode.call("xfer", kind="READ", local=local_h, local_ids=_ids(dst), remote=remote_h,
                        remote_ids=_ids(src), notif=f"big-{k}:1".encode())
        xs.append((x["id"], src, dst))
    for xid, src, dst in xs:
        assert decode.call("wait", xid=xid) == "DONE"
        assert decode.call("read_blocks", block_ids=dst) == prefill.call("read_blocks", block_ids=src)
    assert sorted(m for _, m in prefill.call("notifs", want=4)) == [f"big-{k}:1".encode() for k in range(4)]


def test_write_push_across_two_proxies(make_engine, two_proxies):
    """A push: prefill WRITEs 8 blocks of every region (1 MiB: one room) into decode's pages; DONE means the bytes
    are in decode's pages; decode gets the notification; blocks outside the request stay as they were."""
    prefill, decode, pbases, dbases = _pair(make_engine, two_proxies)
    remote = prefill.call("add_remote", md=decode.call("md"))
    assert remote == "decode-0"
    local_h = prefill.call("prep_local")
    remote_h = prefill.call("prep_remote", agent=remote, bases=dbases, blocks=BLOCKS, block_len=BLOCK_LEN)
    decode.call("fill", block_ids=list(range(BLOCKS)), value=0x5A)
    src, dst = [5, 9, 11, 20, 21, 22, 40, 63], [1, 2, 3, 4, 10, 11, 12, 13]
    x = prefill.call("xfer", kind="WRITE", local=local_h, local_ids=_ids(src), remote=remote_h,
                     remote_ids=_ids(dst), notif=b"push-7")
    assert prefill.call("wait", xid=x["id"]) == "DONE"
    assert decode.call("read_blocks", block_ids=dst) == prefill.call("read_blocks", block_ids=src)
    assert decode.call("read_blocks", block_ids=[0, 5]) == b"\x5a" * (2 * REGIONS * BLOCK_LEN)
    assert decode.call("notifs", want=1) == [("prefill-0", b"push-7")]
    decode.wait_stats(lambda s: s["served_write"] == 1)


def test_write_larger_than_a_room_is_refused(make_engine, two_proxies):
    """A WRITE is all or nothing: the target scatters one complete room, so one larger than a room (1 MiB here)
    is refused (ERR), and nothing lands in the target's pages."""
    prefill, decode, pbases, dbases = _pair(make_engine, two_proxies)
    remote = prefill.call("add_remote", md=decode.call("md"))
    local_h = prefill.call("prep_local")
    remote_h = prefill.call("prep_remote", agent=remote, bases=dbases, blocks=BLOCKS, block_len=BLOCK_LEN)
    blocks = list(range(9))  # 9 x 8 x 16 KiB > 1 MiB
    before = decode.call("digest", block_ids=list(range(BLOCKS)))
    x = prefill.call("xfer", kind="WRITE", local=local_h, local_ids=_ids(blocks), remote=remote_h,
                     remote_ids=_ids(blocks), notif=b"too-big")
    assert prefill.call("wait", xid=x["id"]) == "ERR"
    assert decode.call("digest", block_ids=list(range(BLOCKS))) == before
    decode.wait_stats(lambda s: s["refused_other"] == 1 and s["serves"] == 0)
    assert decode.call("notifs", want=1, timeout=0) == []


def test_vllm_sized_descriptor_lists(make_engine, two_proxies):
    """About 128 k descriptors in one request, as vLLM posts for a 64-layer model (layers x K/V x blocks): 128
    regions of 1024 blocks of 64 bytes, every other block (so NIXL cannot merge neighbours): the descriptor list
    (3 MiB) is streamed to the target in bounded frames; every byte arrives."""
    a, b = two_proxies
    prefill = make_engine("prefill", a)
    decode = make_engine("decode", b)
    prefill.call("init", name="prefill-1")
    decode.call("init", name="decode-1")
    regions, blocks, blen = 128, 2048, 64
    pbases = prefill.call("alloc", regions=regions, blocks=blocks, block_len=blen, seed=3)
    decode.call("alloc", regions=regions, blocks=blocks, block_len=blen, seed=None)
    remote = decode.call("add_remote", md=prefill.call("md"))
    local_h = decode.call("prep_local", wait_s=300)
    remote_h = decode.call("prep_remote", agent=remote, bases=pbases, blocks=blocks, block_len=blen, wait_s=300)
    sel = list(range(0, blocks, 2))
    ids = [r * blocks + b for r in range(regions) for b in sel]
    assert len(ids) == 131072
    x = decode.call("xfer", kind="READ", local=local_h, local_ids=ids, remote=remote_h, remote_ids=ids,
                    notif=b"big:1", wait_s=300)
    assert decode.call("wait", xid=x["id"], timeout=300) == "DONE"
    assert decode.call("digest", block_ids=sel) == prefill.call("digest", block_ids=sel)
    assert decode.call("digest", block_ids=[1]) != prefill.call("digest", block_ids=[1])
    assert prefill.call("notifs", want=1) == [("decode-1", b"big:1")]


def test_notification_without_transfer(make_engine, two_proxies):
    """vLLM's full prefix-cache hit: send_notif alone; the target's get_new_notifs has it."""
    prefill, decode, pbases, dbases = _pair(make_engine, two_proxies)
    remote = decode.call("add_remote", md=prefill.call("md"))
    decode.call("send_notif", agent=remote, msg=b"req-9:1")
    assert prefill.call("notifs", want=1) == [("decode-0", b"req-9:1")]


@pytest.mark.parametrize("kind", ["READ", "WRITE"])
def test_loopback_in_one_agent(make_engine, two_proxies, kind):
    """An agent to itself (NIXL's loopback: prep_xfer_dlist with its own name) through its own control listener
    and one proxy."""
    a, _ = two_proxies
    eng = make_engine("solo", a)
    eng.call("init", name="solo-0")
    bases = eng.call("alloc", regions=2, blocks=16, block_len=4096, seed=5)
    local_h = eng.call("prep_local")
    self_h = eng.call("prep_remote", agent="solo-0", bases=bases, blocks=16, block_len=4096)
    src, dst = [0, 1, 2], [10, 11, 12]

    def ids(bl):
        return [r * 16 + b for r in range(2) for b in bl]

    if kind == "READ":  # local dst <- "remote" src
        x = eng.call("xfer", kind="READ", local=local_h, local_ids=ids(dst), remote=self_h, remote_ids=ids(src),
                     notif=b"self")
    else:  # local src -> "remote" dst
        x = eng.call("xfer", kind="WRITE", local=local_h, local_ids=ids(src), remote=self_h, remote_ids=ids(dst),
                     notif=b"self")
    assert eng.call("wait", xid=x["id"]) == "DONE"
    assert eng.call("read_blocks", block_ids=dst) == eng.call("read_blocks", block_ids=src)
    assert eng.call("notifs", want=1) == [("solo-0", b"self")]


def test_no_kvstaged_no_backend(make_engine, two_proxies, tmp_path, capfd):
    """Without a kvstaged at its socket the backend is not created, and its log line names the socket."""
    a, _ = two_proxies
    eng = make_engine("orphan", a, KVSTAGE_SOCKET=str(tmp_path / "none.sock"))
    with pytest.raises(RuntimeError):
        eng.call("init", name="orphan-0")
    eng.close()
    assert f"kvstaged at {tmp_path / 'none.sock'}" in capfd.readouterr().err
