"""Shared by the SGLang backend tests: the torch gate, a bigger proxy, and the pool-is-free check."""
import contextlib
import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import Proxy, kvstaged_path

try:
    import torch  # noqa: F401  (the KV caches are real tensors)
except ImportError:  # pragma: no cover - CI installs python3-torch
    torch = None

NEED_TORCH = pytest.mark.skipif(
    torch is None, reason="torch is not importable: the SGLang backend tests use real KV-cache tensors "
                          "(Debian: apt-get install python3-torch)")

SLOTS, SLOT_SIZE = 1024, 4096  # 4 MiB; pages (192 B) straddle slot boundaries


def stat(socket_path):
    """Returns kvstage-stat --json's object for the proxy at socket_path."""
    exe = Path(kvstaged_path()).resolve().parent.parent / "tools" / "kvstage-stat"
    out = subprocess.run([str(exe), "--socket", socket_path, "--json"], capture_output=True, text=True, timeout=10)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def assert_pool_free(socket_path, timeout=10):
    """Waits until no client is connected, no room open and every slot free (the proxy reclaims at close)."""
    deadline = time.monotonic() + timeout
    while True:
        s = stat(socket_path)
        if s["clients"]["now"] == 0 and s["rooms"]["open"] == 0 and s["slots"]["free"] == s["slot_count"]:
            return s
        if time.monotonic() > deadline:
            pytest.fail(f"the pool did not end free: slots {s['slots']}, rooms {s['rooms']}, clients {s['clients']}")
        time.sleep(0.02)  # a condition wait on the proxy's own counters, not an ordering device


@pytest.fixture
def kv_proxy(request):
    """A kvstaged with 1024 slots of 4 KiB, stopped at teardown."""
    px = Proxy(["--slots", str(SLOTS), "--slot-size", str(SLOT_SIZE)])
    request.node._kvstaged = px
    yield px
    rc = px.stop()
    shutil.rmtree(px.dir, ignore_errors=True)
    assert rc == 0, f"kvstaged exited with status {rc} at SIGTERM"


class Pair:
    """A prefill and a decode manager in this process, each with its own connection to one proxy, and the
    bootstrap server; .pc/.dc their KVCaches, .P/.D the managers, .addr the bootstrap address."""

    def __init__(self, socket_path, prefill_pages=64, decode_pages=64, prefill_cache=None, decode_cache=None,
                 prefill_args=None):
        import sglang_engine as E
        from kvstage import sglang as ks
        self.pc = prefill_cache or E.KVCache(prefill_pages)
        self.dc = decode_cache or E.KVCache(decode_pages)
        self.server = ks.bootstrap_server_on_a_free_port()
        self.addr = f"127.0.0.1:{self.server.port}"
        self.P = self.D = None
        self.P = ks.KvstageKVManager(self.pc.kv_args(), ks.DisaggregationMode.PREFILL,
                                     E.server_args(socket_path, self.server.port, **(prefill_args or {})))
        self.D = ks.KvstageKVManager(self.dc.kv_args(), ks.DisaggregationMode.DECODE, E.server_args(socket_path, 0))
        assert self.D.try_ensure_parallel_info(self.addr)

    def __iter__(self):  # pc, dc, P, D, addr = pair
        return iter((self.pc, self.dc, self.P, self.D, self.addr))

    def close(self):
        for m in (self.P, self.D):
            if m is not None:
                m.close()
        self.server.close()


@pytest.fixture
def engines(kv_proxy):
    """A Pair on kv_proxy; at teardown both managers close and the pool must end free."""
    pair = Pair(kv_proxy.socket)
    yield pair
    pair.close()
    assert_pool_free(kv_proxy.socket)


def start(engines, room, ppages, dpages, row, receiver_cls=None, chunks=(3,), prow=None):
    """Both sides of one request up to 'every chunk handed to the room' (chunks: sizes before the last);
    returns (sender, receiver)."""
    from kvstage import sglang as ks
    from kvstage.sglang import KVPoll
    pc, dc, P, D, addr = engines
    prow = row if prow is None else prow
    s = ks.KvstageKVSender(P, addr, room, [0], 0)
    r = (receiver_cls or ks.KvstageKVReceiver)(D, addr, room)
    r.init(0)
    assert r.poll() == KVPoll.WaitingForInput, r
    r.send_metadata(dpages, row, [[row]])
    adopted(s)
    pc.fill(room, ppages, prow)
    s.init(len(ppages), prow)
    at = 0
    for n in chunks:
        if at + n < len(ppages):
            s.send(ppages[at:at + n])
            at += n
    s.send(ppages[at:], [[prow]])
    return s, r


def adopted(s):
    """Waits until the prefill rank has the decode side's message (the side channel is a thread)."""
    from kvstage.sglang import KVPoll
    assert s.kv_mgr.wait_until(lambda: s.poll() != KVPoll.Bootstrapping, 10), s
    assert s.poll() == KVPoll.WaitingForInput, s


def sender_done(s):
    """Polls the prefill side only until SEND_DONE: the room is complete at the proxy, RECV_DONE waits unread."""
    from kvstage.sglang import KVPoll
    assert s.kv_mgr.wait_until(lambda: s.poll() == KVPoll.Success, 10), s


@contextlib.contextmanager
def proxy_pair(a_args=(), b_args=()):
    """Proxies A and B with one peer secret, B listening on 127.0.0.1, both with the default --peer-timeout
    (a_args, b_args: more options each); at the end both are stopped and must exit 0."""
    import os
    import tempfile
    d = tempfile.mkdtemp(prefix="kvs-secret-")
    secret = os.path.join(d, "peer.secret")
    with open(secret, "wb") as f:
        f.write(os.urandom(32))
    os.chmod(secret, 0o600)
    args = ["--slots", str(SLOTS), "--slot-size", str(SLOT_SIZE), "--peer-secret-file", secret]
    pa = pb = None
    rcs = []
    try:
        pa = Proxy(args + list(a_args))
        pb = Proxy(args + ["--listen", "127.0.0.1:0"] + list(b_args))
        yield pa, pb
    finally:
        for px in (pa, pb):
            if px is not None:
                rcs.append(px.stop())
                shutil.rmtree(px.dir, ignore_errors=True)
        shutil.rmtree(d, ignore_errors=True)
    assert rcs == [0, 0], f"kvstaged exited with status {rcs} at SIGTERM"


@pytest.fixture
def two_proxies():
    """proxy_pair()'s A and B."""
    with proxy_pair() as pair:
        yield pair
