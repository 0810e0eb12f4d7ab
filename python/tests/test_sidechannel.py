"""kvstage.sidechannel: the engines' authenticated side channel and its bounded listener. The MAC covers every
field; frames without the handshake, with another secret, tampered, replayed on another connection or reordered
are refused and change nothing (an engine-shaped exchange, SGLang and vLLM, still completes byte for byte); a
listener without the secret gets no descriptor; accept() hitting EMFILE does not end the listener; 200 idle
connections never hold more than 64; the handshake (default) and idle deadlines; the start-up refusal without a
secret; secret files others can read. Barriers are the listener's own counters (wait_stats), never sleeps."""
import json
import os
import queue
import select
import socket
import subprocess
import sys
import threading
import time

import pytest

from kvstage import sidechannel as sc
from conftest import ROOT
from sglang_common import NEED_TORCH, assert_pool_free, engines, kv_proxy  # noqa: F401 (fixtures)

KEY = sc.load_key()  # conftest's test secret (or the environment's)
WRONG = sc.derive_key(b"another-deployment's-secret-0123456789")
T = 30  # seconds a barrier waits at most (a failing test, not an ordering device)


class Sink:
    """deliver() for a listener: every message, and a condition to wait on."""

    def __init__(self):
        self.msgs, self.cv = [], threading.Condition()

    def __call__(self, m):
        with self.cv:
            self.msgs.append(m)
            self.cv.notify_all()

    def wait(self, n):
        with self.cv:
            return self.cv.wait_for(lambda: len(self.msgs) >= n, T)


@pytest.fixture
def lis():
    sink = Sink()
    L = sc.FrameListener("127.0.0.1", 0, sink, lambda m: True, "test", KEY)
    L.sink = sink
    yield L
    L.close()


def _raw(port):
    return socket.create_connection(("127.0.0.1", port), timeout=T)


def _raw_handshake(port):
    """A handshake done by hand (an attacker does not check the proof): returns (sock, cn, sn)."""
    s = _raw(port)
    cn = os.urandom(sc.NONCE_SIZE)
    s.sendall(sc.MAGIC + cn)
    reply = sc._recv_exact(s, sc.NONCE_SIZE + sc.MAC_SIZE)
    return s, cn, reply[:sc.NONCE_SIZE]


def _eof(s):
    """True once the listener closed s (reads until EOF)."""
    try:
        while s.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True


# ------------------------------------------------------------------------------------------------ the MAC
def test_mac_covers_every_field():
    cn, sn, seq, body = bytes(range(16)), bytes(range(16, 32)), 7, b'{"t":"abort","room":5}'
    hdr = sc._HDR.pack(len(body))
    base = sc.frame_mac(KEY, cn, sn, seq, hdr, body)
    fields = dict(cn=cn, sn=sn, hdr=hdr, body=body)
    for name, v in fields.items():
        for i in range(len(v)):
            for bit in (0, 7):
                b = bytearray(v)
                b[i] ^= 1 << bit
                args = dict(fields, **{name: bytes(b)})
                assert sc.frame_mac(KEY, args["cn"], args["sn"], seq, args["hdr"], args["body"]) != base, (name, i)
    for other in (0, 6, 8, 7 + (1 << 32), 7 + (1 << 56)):
        assert sc.frame_mac(KEY, cn, sn, other, hdr, body) != base
    assert sc.frame_mac(WRONG, cn, sn, seq, hdr, body) != base
    # the direction label: a frame's MAC is not the listener's proof, nor a reply's
    assert sc._mac(KEY, b"L", cn, sn) == sc.listener_proof(KEY, cn, sn) != sc._mac(KEY, b"C", cn, sn)
    assert sc._mac(KEY, b"R", cn, sn, sc._SEQ.pack(seq), hdr, body) != base
    for i in range(16):
        assert sc.listener_proof(KEY, cn[:i] + bytes([cn[i] ^ 1]) + cn[i + 1:], sn) != sc.listener_proof(KEY, cn, sn)
        assert sc.listener_proof(KEY, cn, sn[:i] + bytes([sn[i] ^ 1]) + sn[i + 1:]) != sc.listener_proof(KEY, cn, sn)
    import hashlib
    import hmac
    assert sc.derive_key(b"s" * 16) == hmac.new(b"s" * 16, b"kvstage side channel v1", hashlib.sha256).digest()


def test_messages_arrive_in_order(lis):
    c = sc.connect("127.0.0.1", lis.port, KEY)
    for k in range(5):
        c.send({"t": "abort", "room": k})
    assert lis.sink.wait(5)
    assert [m["room"] for m in lis.sink.msgs] == list(range(5))
    c.close()
    assert lis.wait_stats(lambda st: st["open"] == 0, T)
    assert lis.stats()["frames"] == 5 and lis.stats()["handshakes"] == 1


# ------------------------------------------------------------------------------------------------ refusals
def test_a_frame_without_the_handshake_is_refused(lis):
    s = _raw(lis.port)
    s.sendall(sc._frame({"t": "abort", "room": 5}))  # what the old side channel took
    assert lis.wait_stats(lambda st: st["bad_magic"] == 1, T)
    assert _eof(s) and lis.sink.msgs == []


def test_a_wrong_secret_is_refused_both_ways(lis):
    with pytest.raises(sc.HandshakeError, match="did not prove it holds the peer secret"):
        sc.connect("127.0.0.1", lis.port, WRONG)
    # one that ignores the proof and sends a frame MACed with its own key
    s, cn, sn = _raw_handshake(lis.port)
    s.sendall(sc.SideConnection(s, WRONG, cn, sn).seal({"t": "abort", "room": 5}))
    assert lis.wait_stats(lambda st: st["bad_mac"] == 1, T)
    assert _eof(s) and lis.sink.msgs == []


def test_tampered_replayed_and_reordered_frames_are_refused(lis):
    good = sc.connect("127.0.0.1", lis.port, KEY)
    good.send({"t": "abort", "room": 1})
    assert lis.sink.wait(1)
    # tampered: the room number changed in flight
    s, cn, sn = _raw_handshake(lis.port)
    f = bytearray(sc.SideConnection(s, KEY, cn, sn).seal({"t": "abort", "room": 2}))
    f[f.index(b"2")] = ord("3")
    s.sendall(bytes(f))
    assert lis.wait_stats(lambda st: st["bad_mac"] == 1, T) and _eof(s)
    # replayed: a frame recorded on one connection, sent on another (its nonces differ)
    a = sc.connect("127.0.0.1", lis.port, KEY)
    recorded = a.seal({"t": "abort", "room": 4})
    b = sc.connect("127.0.0.1", lis.port, KEY)
    b.sock.sendall(recorded)
    assert lis.wait_stats(lambda st: st["bad_mac"] == 2, T) and _eof(b.sock)
    a.close()
    # reordered: frame 1 before frame 0
    c = sc.connect("127.0.0.1", lis.port, KEY)
    f0, f1 = c.seal({"t": "abort", "room": 5}), c.seal({"t": "abort", "room": 6})
    c.sock.sendall(f1 + f0)
    assert lis.wait_stats(lambda st: st["bad_mac"] == 3, T) and _eof(c.sock)
    # a bad length
    d = sc.connect("127.0.0.1", lis.port, KEY)
    d.sock.sendall(sc._HDR.pack(sc._MAX_MSG + 1))
    assert lis.wait_stats(lambda st: st["bad_length"] == 1, T) and _eof(d.sock)
    assert [m["room"] for m in lis.sink.msgs] == [1]
    good.send({"t": "abort", "room": 7})  # the honest connection was never touched
    assert lis.sink.wait(2) and [m["room"] for m in lis.sink.msgs] == [1, 7]
    good.close()


def test_a_listener_without_the_secret_gets_no_descriptor():
    """An impostor listener (another secret, or none: it answers anything) reads the 24-byte hello and nothing else."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    got = queue.SimpleQueue()

    def impostor():
        conn, _ = srv.accept()
        with conn:
            conn.sendall(os.urandom(sc.NONCE_SIZE + sc.MAC_SIZE))
            data = b""
            while True:
                x = conn.recv(4096)
                if not x:
                    break
                data += x
            got.put(data)
    threading.Thread(target=impostor, daemon=True).start()
    with pytest.raises(sc.HandshakeError):
        sc.connect("127.0.0.1", srv.getsockname()[1], KEY)
    data = got.get(timeout=T)
    assert len(data) == len(sc.MAGIC) + sc.NONCE_SIZE and data.startswith(sc.MAGIC)
    srv.close()
    other = sc.FrameListener("127.0.0.1", 0, lambda m: None, lambda m: True, "other", WRONG)
    try:
        with pytest.raises(sc.HandshakeError):
            sc.connect("127.0.0.1", other.port, KEY)
        assert other.wait_stats(lambda st: st["handshakes"] == 1 and st["open"] == 0, T)
        assert other.stats()["frames"] == 0
    finally:
        other.close()


# ------------------------------------------------------------------------------------------------ the bound
def test_200_idle_connections_hold_at_most_64(lis):
    socks = [_raw(lis.port) for _ in range(200)]
    assert lis.wait_stats(lambda st: st["accepted"] == 200, T)
    st = lis.stats()
    assert st["max_open"] == 64 and st["open"] == 64 and st["evicted"] == 136
    c = sc.connect("127.0.0.1", lis.port, KEY)  # takes the place of the longest-idle half-open one
    c.send({"t": "abort", "room": 9})
    assert lis.sink.wait(1) and lis.stats()["max_open"] == 64
    for s in socks:
        s.close()
    c.close()


def test_a_listener_serves_its_65th_honest_worker(lis):
    """64 proven connections (64 decode workers, or a holder of the secret keeping them alive with a frame a minute)
    do not lock a listener at its default max_conns: the 65th worker is served, the connection heard from longest
    ago retires, and its worker's next message takes a new connection. No message is lost on the way."""
    assert lis.max_conns == sc.MAX_CONNS == 64
    workers = [sc.Peers(KEY) for _ in range(sc.MAX_CONNS + 1)]
    try:
        for k, w in enumerate(workers):
            w.send("127.0.0.1", lis.port, {"t": "abort", "room": k})
        assert lis.sink.wait(65) and lis.stats()["retired"] == 1
        for k, w in enumerate(workers):  # the retired one first: each reconnect retires the next longest quiet
            w.send("127.0.0.1", lis.port, {"t": "abort", "room": 100 + k})
        assert lis.sink.wait(130)
        assert sorted(m["room"] for m in lis.sink.msgs) == [*range(65), *range(100, 165)]
        assert lis.stats()["open"] <= 2 * sc.MAX_CONNS
    finally:
        for w in workers:
            w.close()


def test_a_frame_written_as_its_connection_retires_still_lands():
    """The listener shuts its side of the retiring connection and reads it for RETIRE_GRACE_S more: a connector
    that wrote before the FIN reached it (it looks for one before every send, as Peers does) loses nothing."""
    sink = Sink()
    L = sc.FrameListener("127.0.0.1", 0, sink, lambda m: True, "test", KEY, max_conns=2)
    try:
        old = sc.connect("127.0.0.1", L.port, KEY)
        old.send({"t": "abort", "room": 1})
        assert sink.wait(1)
        other = sc.connect("127.0.0.1", L.port, KEY)
        other.send({"t": "abort", "room": 2})
        assert sink.wait(2)
        new = sc.connect("127.0.0.1", L.port, KEY)
        new.send({"t": "abort", "room": 3})
        assert sink.wait(3) and L.stats()["retired"] == 1
        assert select.select([old], [], [], T)[0], "the retiring connection's FIN"
        old.send({"t": "abort", "room": 4})  # written anyway, inside the grace: it lands
        assert sink.wait(4) and [m["room"] for m in sink.msgs] == [1, 2, 3, 4]
        assert L.wait_stats(lambda st: st["open"] == 2, T)  # then it is closed
        for c in (old, other, new):
            c.close()
    finally:
        L.close()


def test_a_hello_without_a_frame_pins_nothing():
    """Anyone can send the 24-byte hello and get the answer: connections that stop there (no frame, so no proof of
    the secret) are evicted by a newcomer, as silent ones are, and meet the handshake deadline (at its default)."""
    sink = Sink()
    L = sc.FrameListener("127.0.0.1", 0, sink, lambda m: True, "test", KEY, max_conns=4)
    try:
        squat = []
        for _ in range(4):  # the hello, raw: no secret needed to get the listener's answer
            s = _raw(L.port)
            s.sendall(sc.MAGIC + bytes(sc.NONCE_SIZE))
            squat.append(s)
        assert L.wait_stats(lambda st: st["handshakes"] == 4, T)
        c = sc.connect("127.0.0.1", L.port, KEY)
        c.send({"t": "abort", "room": 1})
        assert sink.wait(1) and L.stats()["evicted"] == 1 and L.stats()["retired"] == 0
        assert L.wait_stats(lambda st: st["handshake_timeouts"] == 3, T)  # the 5 s deadline from their accept
        assert L.stats()["open"] == 1
        for s in squat:
            s.close()
        c.close()
    finally:
        L.close()


def test_deadlines():
    """The handshake deadline at its default (5 s); the idle deadline (60 s by default) at 1 s."""
    L = sc.FrameListener("127.0.0.1", 0, lambda m: None, lambda m: True, "test", KEY, idle_timeout=1)
    try:
        assert (sc.HANDSHAKE_TIMEOUT_S, sc.IDLE_TIMEOUT_S) == (5.0, 60.0)
        assert L.handshake_timeout == 5.0
        s = _raw(L.port)  # says nothing
        c = sc.connect("127.0.0.1", L.port, KEY)
        c.send({"t": "abort", "room": 1})
        assert L.wait_stats(lambda st: st["idle_timeouts"] == 1, T) and _eof(c.sock)
        assert L.wait_stats(lambda st: st["handshake_timeouts"] == 1, T) and _eof(s)
        s.close()
        c.close()
    finally:
        L.close()
    assert sc.FrameListener.__init__.__kwdefaults__["idle_timeout"] == 60.0


def test_close_does_not_hang_and_closes_everything(lis):
    half = _raw(lis.port)
    full = sc.connect("127.0.0.1", lis.port, KEY)
    assert lis.wait_stats(lambda st: st["open"] == 2, T)
    lis.close()
    assert not lis._thread.is_alive()
    assert _eof(half) and _eof(full.sock)
    with pytest.raises(OSError):
        sc.connect("127.0.0.1", lis.port, KEY, timeout=T)
    half.close()
    full.close()


_FLOOD_CHILD = r"""
import json, logging, os, resource, sys
from kvstage import sidechannel as sc
logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
L = sc.FrameListener("127.0.0.1", 0, lambda m: print("GOT", m["room"], flush=True), lambda m: True, "flood",
                     sc.load_key(), handshake_timeout=600)
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 6, hard))
print("PORT", L.port, flush=True)
assert L.wait_stats(lambda st: st["accept_errors"] >= 1, 60)
print("EMFILE", flush=True)
sys.stdin.read()
print("STATS", json.dumps(L.stats()), flush=True)
L.close()
"""


def test_accept_errors_do_not_end_the_listener():
    """accept() fails with EMFILE (RLIMIT_NOFILE lowered in the listener's process) while 60 connections flood
    in: the listener logs a bounded number of lines, and serves a legit connection once the flood subsides."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-c", _FLOOD_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    lines = queue.SimpleQueue()
    threading.Thread(target=lambda: [lines.put(x.split()) for x in p.stdout], daemon=True).start()
    try:
        w = lines.get(timeout=T)
        assert w[0] == "PORT", w
        port = int(w[1])
        flood = [_raw(port) for _ in range(60)]
        assert lines.get(timeout=T) == ["EMFILE"]
        for s in flood:
            s.close()
        c = sc.connect("127.0.0.1", port, KEY, timeout=T)
        c.send({"t": "abort", "room": 42})
        assert lines.get(timeout=T) == ["GOT", "42"]
        c.close()
        p.stdin.close()
        w = lines.get(timeout=T)
        assert w[0] == "STATS", w
        st = json.loads(" ".join(w[1:]))
        assert p.wait(T) == 0
        err = p.stderr.read()
        accept_lines = [x for x in err.splitlines() if "accept failed" in x]
        assert st["accept_errors"] >= 1 and st["accept_pauses"] >= 1 and st["frames"] == 1
        assert 1 <= len(accept_lines) <= 3 and len(err.splitlines()) <= 10, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


# ------------------------------------------------------------------------------------------------ the secret
NO_SECRET = ("kvstage side channel: no peer secret: set KVSTAGE_PEER_SECRET_FILE to a file only this user can read "
             "(16-4096 bytes; the deployment's peer secret, as kvstaged's --peer-secret-file), or KVSTAGE_PEER_SECRET")


def _no_secret(monkeypatch):
    monkeypatch.delenv("KVSTAGE_PEER_SECRET", raising=False)
    monkeypatch.delenv("KVSTAGE_PEER_SECRET_FILE", raising=False)


def test_no_secret_refuses_to_start(monkeypatch):
    _no_secret(monkeypatch)
    with pytest.raises(sc.SecretError) as e:
        sc.load_key()
    assert str(e.value) == NO_SECRET
    with pytest.raises(sc.SecretError) as e:
        sc.FrameListener("127.0.0.1", 0, lambda m: None, lambda m: True, "test")
    assert str(e.value) == NO_SECRET


@NEED_TORCH
def test_no_secret_refuses_the_engines_at_startup(monkeypatch, tmp_path):
    import sglang_engine as SE
    import vllm_engine as VE
    from kvstage import sglang as ks
    from kvstage import vllm as kv
    _no_secret(monkeypatch)
    for mode in (ks.DisaggregationMode.PREFILL, ks.DisaggregationMode.DECODE):
        with pytest.raises(sc.SecretError) as e:
            ks.KvstageKVManager(SE.KVCache(4).kv_args(), mode, SE.server_args(str(tmp_path / "none.sock"), 0))
        assert str(e.value) == NO_SECRET
    cfg = VE.vllm_config(str(tmp_path / "none.sock"), VE.free_port(), "kv_both")
    with pytest.raises(sc.SecretError) as e:
        kv.KvstageConnector(cfg, kv.KVConnectorRole.WORKER, VE.kv_cache_config(8))
    assert str(e.value) == NO_SECRET
    kv.KvstageConnector(cfg, kv.KVConnectorRole.SCHEDULER, VE.kv_cache_config(8))  # the scheduler needs none
    # vLLM's kv_connector_extra_config kvstage_peer_secret_file
    f = tmp_path / "peer.secret"
    f.write_bytes(b"s" * 32 + b"\n")
    f.chmod(0o600)
    cfg = VE.vllm_config(str(tmp_path / "none.sock"), VE.free_port(), "kv_both",
                         extra={"kvstage_peer_secret_file": str(f)})
    w = kv.KvstageConnector(cfg, kv.KVConnectorRole.WORKER, VE.kv_cache_config(8))
    assert w.connector_worker.side_key == sc.derive_key(b"s" * 32)


def test_secret_files(monkeypatch, tmp_path):
    f = tmp_path / "peer.secret"
    f.write_bytes(b"k" * 20 + b"\n")
    for mode, who in ((0o644, "its group and others"), (0o640, "its group"), (0o660, "its group"), (0o604, "others"),
                      (0o606, "others"), (0o666, "its group and others")):
        f.chmod(mode)
        with pytest.raises(sc.SecretError, match=f": {who} can read or write it"):
            sc.read_secret_file(str(f))
    f.chmod(0o600)
    assert sc.read_secret_file(str(f)) == b"k" * 20  # one trailing newline stripped
    f.write_bytes(b"k" * 15 + b"\n")
    with pytest.raises(sc.SecretError, match="15 bytes"):
        sc.read_secret_file(str(f))
    f.write_bytes(b"k" * 4097)
    with pytest.raises(sc.SecretError, match="4097 bytes"):
        sc.read_secret_file(str(f))
    with pytest.raises(sc.SecretError, match="not a regular file"):
        sc.read_secret_file(str(tmp_path))
    f.write_bytes(b"k" * 4096 + b"\n")
    monkeypatch.setenv("KVSTAGE_PEER_SECRET_FILE", str(f))
    assert sc.load_key() == sc.derive_key(b"k" * 4096)  # the file wins over $KVSTAGE_PEER_SECRET
    f.chmod(0o604)
    with pytest.raises(sc.SecretError, match="others can read or write it"):
        sc.load_key()
    monkeypatch.delenv("KVSTAGE_PEER_SECRET_FILE")
    monkeypatch.setenv("KVSTAGE_PEER_SECRET", "short")
    with pytest.raises(sc.SecretError, match="KVSTAGE_PEER_SECRET is 5 bytes"):
        sc.load_key()


def _with_acl(f, entries):
    """Gives file f (mode 0400) the ACL "u::r, <entries>, g::-, m::r, o::-" as the kernel stores it: its mode then
    shows the mask as group bits (0440), as systemd's LoadCredential= copies do."""
    import errno
    import struct
    f.chmod(0o400)
    none = 0xFFFFFFFF
    every = sorted([(0x01, 4, none), (0x04, 0, none), (0x10, 4, none), (0x20, 0, none)] + entries)  # the kernel's order
    x = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in every)
    try:
        os.setxattr(str(f), "system.posix_acl_access", x)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
        pytest.skip(f"no POSIX ACLs on {f.parent} ({e.strerror}): the ACL rule is not checked here")


def test_secret_file_acl_judged_by_its_entries_as_kvstaged_does(tmp_path):
    """systemd's credential copy (0440 by its ACL's mask, our uid named) loads, as kvstaged loads it; an ACL
    naming another uid or a group is refused with whom it lets in; group bits of the group's own are refused."""
    f = tmp_path / "peer.secret"
    f.write_bytes(b"k" * 20)
    _with_acl(f, [(0x02, 4, os.geteuid())])
    assert os.stat(f).st_mode & 0o777 == 0o440
    assert sc.read_secret_file(str(f)) == b"k" * 20
    for entries, says in (([(0x02, 4, 65534)], "its ACL lets uid 65534 in"),
                          ([(0x08, 4, 65534)], "its ACL lets a group in"),
                          ([(0x02, 2, 65534)], "its ACL lets uid 65534 in")):
        g = tmp_path / f"acl-{len(says)}-{entries[0][0]}-{entries[0][1]}"
        g.write_bytes(b"k" * 20)
        _with_acl(g, entries)
        with pytest.raises(sc.SecretError, match=says):
            sc.read_secret_file(str(g))
    h = tmp_path / "plain"
    h.write_bytes(b"k" * 20)
    h.chmod(0o440)
    with pytest.raises(sc.SecretError, match="its group can read or write it"):
        sc.read_secret_file(str(h))
    if os.geteuid() == 0:  # a file someone else owns can be changed by them: refused whatever its mode
        h.chmod(0o600)
        os.chown(h, 65534, -1)
        with pytest.raises(sc.SecretError, match="owned by uid 65534; it must be ours"):
            sc.read_secret_file(str(h))


# ------------------------------------------------------------------------------------------------ engine-shaped
def _attack(port, frames):
    """Sends every refused kind of frame an attacker could to a listener: no handshake, another secret, tampered,
    replayed from another connection, reordered. frames: the messages the attacker wants delivered."""
    for msg in frames:
        s = _raw(port)
        s.sendall(sc._frame(msg))
        _eof(s)
        s, cn, sn = _raw_handshake(port)
        s.sendall(sc.SideConnection(s, WRONG, cn, sn).seal(msg))
        _eof(s)
        a = sc.connect("127.0.0.1", port, KEY)  # a legit connection whose frames are captured, never sent by it
        f = a.seal(msg)
        b = sc.connect("127.0.0.1", port, KEY)
        b.sock.sendall(f)  # replayed on another connection
        _eof(b.sock)
        t = bytearray(a.seal(msg))
        t[sc._HDR.size + 2] ^= 0x20  # tampered
        a.sock.sendall(bytes(t))
        _eof(a.sock)
        c = sc.connect("127.0.0.1", port, KEY)
        c.seal({"t": "never-sent"})
        c.sock.sendall(c.seal(msg))  # reordered: frame 1 with no frame 0
        _eof(c.sock)
    return 5 * len(frames)


@NEED_TORCH
def test_sglang_abort_and_steer_attempts_change_nothing(engines):
    """An attacker who knows the bootstrap room sends the prefill rank an abort and a meta steering the KV to a
    room of its own, every refused way; the legit request then completes byte for byte."""
    from sglang_common import sender_done, start
    from kvstage.sglang import KVPoll
    pc, dc, P, D, addr = engines
    room, ppages, dpages = 5150, [3, 4, 9], [7, 1, 2]
    # a well-formed meta for the same room, with a descriptor of the attacker's own room
    theirs, desc = D.client().recv_open(4096, user_data=0)
    import base64
    steer = {"t": "meta", "room": room, "npages": 1, "aux": False, "state_counts": [], "nbytes": 4096,
             "prefix_len": 0, "layout": {"kv_item_lens": [], "aux_item_lens": [], "state_item_lens": [],
                                         "state_types": []}, "desc": base64.b64encode(desc).decode()}
    n = _attack(P.rank_port, [{"t": "abort", "room": room}, steer])
    L = P._listener
    assert L.wait_stats(lambda st: st["bad_magic"] + st["bad_mac"] == n and st["open"] == 0, T), L.stats()
    assert L.stats()["frames"] == 0
    P.pump()
    assert room not in P.tombstones and room not in P.pending_meta
    s, r = start(engines, room, ppages, dpages, 9, chunks=(1,), prow=3)
    assert D.wait_until(lambda: r.poll() == KVPoll.Success, 10), r
    sender_done(s)
    assert all(bool((dc.kv_u8(b)[dpages] == pc.kv_u8(b)[ppages]).all()) for b in range(len(dc.kv)))
    assert dc.check(room, dpages, 9) is None
    assert L.stats()["frames"] == 1  # the legit meta
    r.clear()
    s.clear()
    theirs.abort()
    theirs.close()


@NEED_TORCH
def test_vllm_drop_and_steer_attempts_change_nothing(kv_proxy):
    """The decode worker's pull/drop for a staged request, sent every refused way, release and steer nothing: the
    legit load then completes byte for byte."""
    import vllm_engine as E
    pd = E.PD(kv_proxy.socket)
    try:
        pd.P.add(E.Request("p0", 20, E.prefill_params(), 1000))
        for _ in range(1000):  # the prefill engine alone: nothing routed to the decode side yet
            if "p0" in pd.P.done:
                break
            pd.P.step()
        assert "p0" in pd.P.done
        import base64
        desc = b"\0" * 128  # the attacker's descriptor (any: nothing it sends is delivered)
        msgs = [{"t": "drop", "req": "p0", "tp_rank": 0},
                {"t": "pull", "req": "p0", "desc": base64.b64encode(desc).decode(), "nbytes": 4096,
                 "layout": pd.D.agent.layout.fingerprint(), "tp_rank": 0}]
        L = pd.P.agent._listener
        n = _attack(L.port, msgs)
        assert L.wait_stats(lambda st: st["bad_magic"] + st["bad_mac"] == n and st["open"] == 0, T), L.stats()
        assert L.stats()["frames"] == 0
        pd.run(lambda: "d0" in pd.D.freed and not pd.P.requests, what="loaded")
        assert pd.D.loaded == {"d0": None}
        assert pd.P.freed["p0"][1] == "finished_sending"
    finally:
        pd.close()
    assert_pool_free(kv_proxy.socket)


@NEED_TORCH
def test_sglang_failed_handshake_fails_the_request_cleanly(engines):
    """A prefill rank that does not prove the secret (here: the decode rank holds another one) gets nothing; the
    request fails with the reason, its room is aborted and its pages released; the pool ends free (fixture)."""
    from kvstage import sglang as ks
    from kvstage.sglang import KVPoll
    pc, dc, P, D, addr = engines
    D._peers.close()
    D._peers = sc.AsyncPeers(WRONG)  # the decode rank's connections made with another secret
    r = ks.KvstageKVReceiver(D, addr, 31)
    r.init(0)
    r.send_metadata([1, 2], 3, [[3]])  # queued: the handshake's refusal comes back to the scheduler's poll
    assert D.wait_until(lambda: r.poll() == KVPoll.Failed, T), r
    assert r.poll() == KVPoll.Failed and "side-channel handshake failed" in r._reason, r._reason
    r.clear()
    assert r.pages_released
    assert P._listener.wait_stats(lambda st: st["handshakes"] >= 1 and st["open"] == 0, T)
    assert P._listener.stats()["frames"] == 0


@NEED_TORCH
def test_vllm_a_pull_with_a_bad_descriptor_is_refused_and_changes_nothing(kv_proxy):
    """A pull from a holder of the secret whose desc is not a room descriptor (not base64, or the wrong size) is
    refused by the prefill worker with its reason; the staged request is untouched and the legit load completes."""
    import vllm_engine as E
    pd = E.PD(kv_proxy.socket)
    try:
        pd.P.add(E.Request("p0", 20, E.prefill_params(), 1000))
        for _ in range(1000):
            if "p0" in pd.P.done:
                break
            pd.P.step()
        assert "p0" in pd.P.done
        L = pd.P.agent._listener
        peers = sc.Peers(sc.load_key())
        for desc in ("!!! not base64 !!!", "AAAA", 7, None):
            peers.send("127.0.0.1", L.port, {"t": "pull", "req": "p0", "desc": desc, "nbytes": 4096,
                                             "layout": pd.D.agent.layout.fingerprint(), "tp_rank": 0})
        peers.close()
        assert L.wait_stats(lambda st: st["frames"] == 4, T), L.stats()
        pd.run(lambda: "d0" in pd.D.freed and not pd.P.requests, what="loaded")
        assert pd.D.loaded == {"d0": None}
        assert pd.P.freed["p0"][1] == "finished_sending"
    finally:
        pd.close()
    assert_pool_free(kv_proxy.socket)


@NEED_TORCH
def test_vllm_failed_handshake_fails_the_load_cleanly(kv_proxy):
    """A decode worker holding another secret: the prefill worker gets no pull, the load fails with the reason
    (vLLM recomputes it), both block pools and the kvstage pool end free."""
    import vllm_engine as E
    pd = E.PD(kv_proxy.socket)
    try:
        pd.D.agent._peers.close()
        pd.D.agent._peers = sc.AsyncPeers(WRONG)  # the decode worker's connections made with another secret
        pd.add(0, 10)
        pd.run(lambda: "d0" in pd.D.freed and "d0" in pd.D.agent.ended, what="failed")
        assert "side-channel handshake failed" in pd.D.agent.ended["d0"], pd.D.agent.ended
        assert pd.P.agent._listener.stats()["frames"] == 0
        pd.run(lambda: not pd.P.requests, what="prefill released")
    finally:
        pd.close()
    assert_pool_free(kv_proxy.socket)


def test_peers_replace_a_connection_quiet_for_half_the_idle_deadline(lis):
    """A connector's cached connection is reused while fresh; one quiet for half the listener's idle deadline is
    replaced before use (the listener may be closing it as the frame goes out, and that frame would be lost)."""
    fresh, stale = sc.Peers(KEY), sc.Peers(KEY, idle_timeout=0)
    for k in range(3):
        fresh.send("127.0.0.1", lis.port, {"t": "abort", "room": k})
    assert lis.sink.wait(3) and lis.stats()["handshakes"] == 1
    for k in range(3):
        stale.send("127.0.0.1", lis.port, {"t": "abort", "room": 10 + k})
    assert lis.sink.wait(6) and lis.stats()["handshakes"] == 4
    fresh.close()
    stale.close()


# ---------------------------------------------------------------------------------------------------------------
# AsyncPeers: an engine's thread never waits on a peer (issue 39, items 7 and 8)
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture
def silent():
    """An endpoint that takes the connection (the kernel's backlog) and never answers the hello: a hung host."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    yield s.getsockname()[1]
    s.close()


def test_async_send_to_a_silent_endpoint_delays_no_other(lis, silent):
    """Queued in microseconds; the silent endpoint's own thread waits out its handshake (5 s) while the honest
    endpoint's message lands: in that order, where one thread sending both (Peers) lands it only after."""
    order, done = [], threading.Event()
    peers = sc.AsyncPeers(KEY)
    try:
        def failed(e):
            order.append(("failed", type(e).__name__))
            done.set()
        peers.send("127.0.0.1", silent, {"t": "abort", "room": 1}, on_error=failed)
        peers.send("127.0.0.1", lis.port, {"t": "abort", "room": 2}, on_error=failed)
        assert lis.sink.wait(1)
        order.append(("landed", lis.sink.msgs[0]["room"]))
        assert done.wait(T)
        assert [o[0] for o in order] == ["landed", "failed"], order  # the handshake's timeout, or a refusal
        with pytest.raises(OSError, match="failed moments ago"):  # given up on for Peers.DEAD_S: at once
            peers.send("127.0.0.1", silent, {"t": "abort", "room": 3})
    finally:
        peers.close()


def test_async_queues_are_bounded_and_close_reports_what_waits(silent):
    peers = sc.AsyncPeers(KEY)
    peers.QUEUE_MAX = 3
    errors = []
    accepted = 0
    try:
        # QUEUE_MAX wait at most, and the endpoint's thread holds one more once it took it (its handshake waits)
        with pytest.raises(OSError, match="already wait"):
            for k in range(10):
                peers.send("127.0.0.1", silent, {"t": "abort", "room": k}, on_error=errors.append)
                accepted += 1
        assert 3 <= accepted <= 4, accepted
        with pytest.raises(ValueError):
            peers.send("127.0.0.1", silent, {"t": "x" * (sc._MAX_MSG + 1)})
    finally:
        peers.close(timeout=T)
    # each message once: the one in flight failed its handshake, the ones waiting failed with it or at the close
    assert len(errors) == accepted and all(isinstance(e, OSError) for e in errors), errors


def test_async_a_wrong_secret_fails_the_message_not_the_caller(lis):
    peers = sc.AsyncPeers(WRONG)
    got = queue.SimpleQueue()
    try:
        peers.send("127.0.0.1", lis.port, {"t": "abort", "room": 1}, on_error=got.put)
        e = got.get(timeout=T)
        assert isinstance(e, sc.HandshakeError) and "did not prove" in str(e)
        assert lis.sink.msgs == []
    finally:
        peers.close()


@NEED_TORCH
def test_vllm_a_silent_prefill_worker_stalls_no_other_load(kv_proxy, silent):
    """Two loads on one decode worker, d0's prefill worker silent (it takes the connection, never answers): d1's
    load completes while d0's pull still waits on its handshake, then d0 fails with the reason (issue 39, item 7:
    the agent thread ran each send inline, and every other load and handle_preemptions waited 5 s behind it)."""
    import vllm_engine as E
    pd = E.PD(kv_proxy.socket)
    route = dict(d_extra=lambda k: {"remote_port": silent} if k == 0 else {})
    try:
        pd.add(0, 10)
        pd.add(1, 10)
        pd.run(lambda: "d1" in pd.D.freed and "d1" in pd.D.agent.ended, what="the honest load", **route)
        assert "d0" not in pd.D.agent.ended, pd.D.agent.ended  # its handshake still waits (5 s): it stalled nothing
        pd.run(lambda: "d0" in pd.D.agent.ended and "d0" in pd.D.freed, timeout=30, what="the silent load failed",
               **route)
        assert "could not reach the prefill worker" in pd.D.agent.ended["d0"], pd.D.agent.ended
    finally:
        pd.close()
    assert_pool_free(kv_proxy.socket)
