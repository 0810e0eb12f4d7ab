"""Hostile input to a KVSTAGE backend's control channel (a raw client, nxwire.py, against a target engine's
listener): descriptors outside the regions the target registered, forged and replayed frames, clients without
the peer secret. Each is refused and counted (the backend's stats file), and nothing is copied: the target's
gather and scatter counters stay at 0 and its pages keep their bytes. A backend without a secret refuses to
start, saying why."""
import os

import pytest

import kvstage
import nxwire

REGIONS, BLOCKS, BLOCK_LEN = 2, 16, 65536


@pytest.fixture
def target(make_engine, two_proxies, secret_file):
    """(engine, bases, key, port): a prefill-like engine on proxy A with two 1 MiB regions registered."""
    a, _ = two_proxies
    eng = make_engine("target", a)
    eng.call("init", name="target-0")
    bases = eng.call("alloc", regions=REGIONS, blocks=BLOCKS, block_len=BLOCK_LEN, seed=7)
    st = eng.wait_stats(lambda s: s["port"] > 0)
    with open(secret_file, "rb") as f:
        key = nxwire.derive_key(f.read().rstrip(b"\n"))
    return eng, bases, key, st["port"]


@pytest.fixture
def receiver(two_proxies):
    """A kvstage client of proxy B with a real receiving room of 1 MiB: what a hostile initiator would point
    the target at. Returns (client, room, desc bytes)."""
    _, b = two_proxies
    with kvstage.Client(b.socket) as c:
        room, desc = c.recv_open(BLOCK_LEN * BLOCKS)
        yield c, room, bytes(desc)
        room.close()


def _nothing_copied(eng):
    st = eng.stats()
    assert st["chunks_gathered"] == 0 and st["chunks_scattered"] == 0, st
    return st


@pytest.mark.parametrize("case", ["below", "past_end", "straddles", "other_dev", "wraps", "one_bad_of_many"])
def test_read_outside_registered_regions_is_refused(target, receiver, case):
    """A READ naming bytes the target never registered (below a region, past its end, across its end, on another
    device, an address range that wraps, or one bad descriptor among good ones): DONE with -EACCES, counted as
    refused_descs, the room pointed at never joined, not a byte gathered."""
    eng, bases, key, port = target
    _, room, desc = receiver
    size = BLOCKS * BLOCK_LEN
    spans = {
        "below": [(bases[0] - 4096, 4096, 0)],
        "past_end": [(bases[1] + size, 4096, 0)],
        "straddles": [(bases[0] + size - 100, 4096, 0)],
        "other_dev": [(bases[0], 4096, 1)],
        "wraps": [(2**64 - 100, 4096, 0)],
        "one_bad_of_many": [(bases[0] + i * 4096, 4096, 0) for i in range(100)] + [(bases[1] - 4096, 4096, 0)],
    }[case]
    total = sum(s[1] for s in spans)
    d = nxwire.Dialer("127.0.0.1", port, key)
    d.send(nxwire.req(1, nxwire.OP_READ, total, len(spans), notif=b"evil:1"))
    d.send(nxwire.descs(1, spans))
    d.send(nxwire.room(1, 0, total, desc))
    body = d.recv()
    assert body is not None and nxwire.parse_done(body) == (1, -13)  # -EACCES
    st = eng.wait_stats(lambda s: s["refused_descs"] == 1)
    _nothing_copied(eng)
    assert st["serves"] == 0 and st["rooms"] == 0
    assert eng.call("notifs", want=1, timeout=0) == []
    d.close()


def test_write_outside_registered_regions_is_refused(target):
    """A WRITE aimed past the target's regions: refused before any room is opened; its pages keep their bytes."""
    eng, bases, key, port = target
    before = eng.call("digest", block_ids=list(range(BLOCKS)))
    d = nxwire.Dialer("127.0.0.1", port, key)
    spans = [(bases[0] + BLOCKS * BLOCK_LEN, BLOCK_LEN, 0)]
    d.send(nxwire.req(2, nxwire.OP_WRITE, BLOCK_LEN, 1, notif=b"evil-w"))
    d.send(nxwire.descs(2, spans))
    body = d.recv()
    assert nxwire.parse_done(body) == (2, -13)
    st = eng.wait_stats(lambda s: s["refused_descs"] == 1)
    assert st["rooms"] == 0
    _nothing_copied(eng)
    assert eng.call("digest", block_ids=list(range(BLOCKS))) == before
    d.close()


def test_deregistered_region_is_outside(target, receiver):
    """Memory the target has deregistered is outside too."""
    eng, bases, key, port = target
    _, room, desc = receiver
    eng.call("dereg")
    d = nxwire.Dialer("127.0.0.1", port, key)
    d.send(nxwire.req(3, nxwire.OP_READ, 4096, 1))
    d.send(nxwire.descs(3, [(bases[0], 4096, 0)]))
    assert nxwire.parse_done(d.recv()) == (3, -13)
    eng.wait_stats(lambda s: s["refused_descs"] == 1)
    _nothing_copied(eng)


def test_honest_raw_client_is_served(target, receiver):
    """The control: the same raw client, asking for bytes inside a region, is served (the room fills with the
    target's bytes): the refusals above are the checks', not the client's."""
    eng, bases, key, port = target
    c, room, desc = receiver
    size = BLOCKS * BLOCK_LEN
    d = nxwire.Dialer("127.0.0.1", port, key)
    d.send(nxwire.req(4, nxwire.OP_READ, size, 1, notif=b"ok:1"))
    d.send(nxwire.descs(4, [(bases[1], size, 0)]))
    d.send(nxwire.room(4, 0, size, desc))
    assert nxwire.parse_done(d.recv()) == (4, 0)
    ev = c.wait(10)
    assert [e.type for e in ev] == [kvstage.EventType.RECV_DONE]
    got = b"".join(bytes(room.lease(i).view()[:BLOCK_LEN]) for i in range(room.chunks))
    assert got == eng.call("read_blocks", block_ids=list(range(BLOCKS)))[size:]
    assert eng.call("notifs", want=1) == [("hostile", b"ok:1")]
    d.close()


def test_forged_frame_is_refused(target, receiver):
    """A frame MACed with another key (a client that got through the handshake, e.g. by relaying, but does not
    hold the secret): the connection is dropped, counted as bad_mac, the request never seen."""
    eng, bases, key, port = target
    _, room, desc = receiver
    d = nxwire.Dialer("127.0.0.1", port, key)
    d.send(nxwire.req(5, nxwire.OP_READ, 4096, 1), key=b"k" * 32)
    assert d.closed()
    st = eng.wait_stats(lambda s: s["bad_mac"] == 1)
    assert st["serves"] == 0
    _nothing_copied(eng)


def test_replayed_frames_are_refused(target, receiver, two_proxies):
    """Frames recorded from an honest connection, replayed: within that connection (the same sequence number
    again) and on a new one (other nonces): each drops its connection as bad_mac; only the original request is
    served, once."""
    eng, bases, key, port = target
    c, room, desc = receiver
    size = BLOCKS * BLOCK_LEN
    d = nxwire.Dialer("127.0.0.1", port, key)
    f1 = d.send(nxwire.req(6, nxwire.OP_READ, size, 1, notif=b"once:1"))
    f2 = d.send(nxwire.descs(6, [(bases[0], size, 0)]))
    f3 = d.send(nxwire.room(6, 0, size, desc))
    assert nxwire.parse_done(d.recv()) == (6, 0)
    eng.wait_stats(lambda s: s["served_read"] == 1)
    # the same bytes again on the same connection: sequence 0 is long past
    d.s.sendall(f1)
    assert d.closed()
    eng.wait_stats(lambda s: s["bad_mac"] == 1)
    # and on a new connection: other nonces
    d2 = nxwire.Dialer("127.0.0.1", port, key)
    d2.s.sendall(f1 + f2 + f3)
    assert d2.closed()
    st = eng.wait_stats(lambda s: s["bad_mac"] == 2)
    assert st["served_read"] == 1 and st["chunks_gathered"] == BLOCKS
    assert eng.call("notifs", want=2, timeout=0) == [("hostile", b"once:1")]


def test_clients_without_the_secret_are_refused(target):
    """No magic (not this protocol), and a dialer that cannot prove the secret (its proof is random): dropped
    before anything is read as a frame, counted as bad_magic and bad_proof; a listener without the secret
    (another key) is refused by the dialer."""
    eng, bases, key, port = target
    import socket
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET / HTTP/1.1\r\n\r\n")
    s.settimeout(10)
    assert s.recv(100) == b""
    eng.wait_stats(lambda st: st["bad_magic"] == 1)
    # a dialer without the secret: it cannot check the listener's proof, and sends a guess
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(nxwire.MAGIC + os.urandom(16))
    reply = s.recv(48)
    assert len(reply) == 48
    s.sendall(os.urandom(32) + nxwire.req(7, nxwire.OP_READ, 4096, 1))
    s.settimeout(10)
    assert s.recv(100) == b""
    st = eng.wait_stats(lambda st: st["bad_proof"] == 1)
    assert st["serves"] == 0 and st["handshakes"] == 0
    with pytest.raises(ConnectionError):
        nxwire.Dialer("127.0.0.1", port, b"x" * 32)
    _nothing_copied(eng)


def test_malformed_and_oversized_frames_are_refused(target):
    """With the secret but nonsense: a length past 1 MiB (bad_length), an unknown message type, a message too
    short (malformed): each drops its connection; nothing is served."""
    eng, bases, key, port = target
    d = nxwire.Dialer("127.0.0.1", port, key)
    d.s.sendall((2 << 20).to_bytes(4, "big"))
    assert d.closed()
    eng.wait_stats(lambda s: s["bad_length"] == 1)
    for body in (b"\x63" + b"\x00" * 8, b"\x01\x00"):
        d = nxwire.Dialer("127.0.0.1", port, key)
        d.send(body)
        assert d.closed()
    st = eng.wait_stats(lambda s: s["malformed"] == 2)
    assert st["serves"] == 0
    _nothing_copied(eng)


def test_backend_without_a_secret_refuses_to_start(make_engine, two_proxies, capfd):
    """No KVSTAGE_PEER_SECRET_FILE, no KVSTAGE_PEER_SECRET, no parameter: the backend is not created, and its log
    line says what to set."""
    a, _ = two_proxies
    eng = make_engine("nosecret", a, KVSTAGE_PEER_SECRET_FILE="")
    with pytest.raises(RuntimeError):
        eng.call("init", name="nosecret-0")
    eng.close()
    err = capfd.readouterr().err
    assert "no peer secret" in err and "KVSTAGE_PEER_SECRET_FILE" in err, err


def test_bad_secret_file_refused(make_engine, two_proxies, tmp_path, capfd):
    """A secret file others can read is refused, as kvstaged and the side channel refuse it."""
    a, _ = two_proxies
    p = tmp_path / "loose.secret"
    p.write_bytes(b"0123456789abcdef0123")
    p.chmod(0o644)
    eng = make_engine("loose", a, KVSTAGE_PEER_SECRET_FILE=str(p))
    with pytest.raises(RuntimeError):
        eng.call("init", name="loose-0")
    eng.close()
    assert "chmod 600" in capfd.readouterr().err
