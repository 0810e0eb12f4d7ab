"""Fixtures for the NIXL backend's tests (tests/nixl/run.sh sets the environment): kvstaged proxies, the peer
secret, and engine processes (engine.py) that each hold a nixl_agent with the KVSTAGE backend.

Environment: KVSTAGED (the kvstaged to start), NIXL_PLUGIN_DIR (where libplugin_KVSTAGE.so is), and NIXL's
LD_LIBRARY_PATH / PYTHONPATH (kvstage-nixl.env), PYTHONPATH also holding python/ (kvstage.daemon)."""
import json
import multiprocessing
import os
import shutil
import tempfile
import time

import pytest

from kvstage.daemon import DaemonError, spawn, stop

SLOTS, SLOT_SIZE = 64, 65536  # a 4 MiB pool: a room holds 1 MiB by default (a quarter)
_ctx = multiprocessing.get_context("spawn")


class Proxy:
    """A kvstaged with the peer plane on loopback (--listen 127.0.0.1:0, tcp): .socket, .dir, .log."""

    def __init__(self, secret_file, slots=SLOTS, slot_size=SLOT_SIZE, extra=()):
        exe = os.environ.get("KVSTAGED")
        if not exe or not os.access(exe, os.X_OK):
            pytest.fail(f"no kvstaged at {exe!r} (tests/nixl/run.sh sets KVSTAGED)")
        self.dir = tempfile.mkdtemp(prefix="kvsnx-")
        self.socket = os.path.join(self.dir, "kvs.sock")
        self.log = os.path.join(self.dir, "kvstaged.log")
        args = ["--socket", self.socket, "--slots", str(slots), "--slot-size", str(slot_size),
                "--shutdown-grace", "1000", "--listen", "127.0.0.1:0", "--transport", "tcp",
                "--peer-secret-file", secret_file, *extra]
        with open(self.log, "wb") as log:
            try:
                self.proc = spawn(exe, args, log)
            except DaemonError as e:
                pytest.fail(f"kvstaged did not start: {e}\n{self.text()}")

    def text(self):
        try:
            with open(self.log, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def close(self):
        rc = stop(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)
        return rc


class Engine:
    """An engine process: call(op, **kw) runs engine._Engine.op there and returns its result."""

    def __init__(self, name, env):
        self.name = name
        self.conn, child = _ctx.Pipe()
        from engine import main
        self.proc = _ctx.Process(target=main, args=(child, env), daemon=True)
        self.proc.start()
        child.close()
        self.stats_file = env.get("KVSTAGE_NIXL_STATS")

    def call(self, op, wait_s=None, **kw):
        """Runs op(**kw) in the engine; fails the test if no answer comes within wait_s (default: 120 s more
        than the op's own timeout)."""
        wait_s = wait_s or kw.get("timeout", 0) + 120
        self.conn.send((op, kw))
        if not self.conn.poll(wait_s):
            pytest.fail(f"engine {self.name}: no answer to {op} within {wait_s} s")
        status, val = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine {self.name}: {op}: {val}")
        return val

    def send(self, op, **kw):
        """Starts op without waiting; answer() takes its result."""
        self.conn.send((op, kw))

    def answer(self, timeout=120):
        if not self.conn.poll(timeout):
            pytest.fail(f"engine {self.name}: no answer within {timeout} s")
        status, val = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine {self.name}: {val}")
        return val

    def stats(self):
        with open(self.stats_file) as f:
            return json.load(f)

    def wait_stats(self, pred, timeout=30):
        """Waits until pred(stats) holds (the stats file is rewritten as counters change)."""
        end = time.monotonic() + timeout
        last = None
        while time.monotonic() < end:
            try:
                last = self.stats()
                if pred(last):
                    return last
            except (OSError, ValueError):
                pass
            time.sleep(0.01)
        pytest.fail(f"engine {self.name}: stats never matched; last {last}")

    def close(self):
        try:
            self.conn.send(("quit", {}))
            self.conn.poll(30)
        except (OSError, EOFError):
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        return self.proc.exitcode


@pytest.fixture
def both_plugins(tmp_path):
    """A NIXL_PLUGIN_DIR holding libplugin_KVSTAGE.so and the test-only libplugin_KVSZCOPY.so
    ($KVSTAGE_NIXL_ZCOPY, tests/nixl/run.sh sets it)."""
    d = tmp_path / "plugins"
    d.mkdir()
    zc = os.environ.get("KVSTAGE_NIXL_ZCOPY")
    if not zc or not os.path.exists(zc):
        pytest.fail(f"no test-only zero-copy plugin at {zc!r} (tests/nixl/run.sh builds it)")
    os.symlink(zc, d / "libplugin_KVSZCOPY.so")
    os.symlink(os.path.join(os.environ["NIXL_PLUGIN_DIR"], "libplugin_KVSTAGE.so"), d / "libplugin_KVSTAGE.so")
    return str(d)


@pytest.fixture
def secret_file(tmp_path):
    p = tmp_path / "peer.secret"
    p.write_bytes(os.urandom(32).hex().encode())
    p.chmod(0o600)
    return str(p)


@pytest.fixture
def two_proxies(secret_file):
    """(A, B): two kvstaged proxies, each listening for the other (the prefill's and the decode's hosts)."""
    a, b = Proxy(secret_file), Proxy(secret_file)
    yield a, b
    for px in (a, b):
        px.close()


@pytest.fixture
def make_engine(tmp_path, secret_file, two_proxies):
    """make_engine(name, proxy, **env) starts an engine process on proxy's socket, the KVSTAGE backend's
    parameters all from the environment, as vLLM's agent creates it; closed at teardown."""
    engines = []

    def make(name, proxy, **env):
        e = {
            "KVSTAGE_SOCKET": proxy.socket,
            "KVSTAGE_PEER_SECRET_FILE": secret_file,
            "KVSTAGE_NIXL_LISTEN": "127.0.0.1:0",
            "KVSTAGE_NIXL_STATS": str(tmp_path / f"{name}.stats.json"),
        }
        e.update({k: str(v) for k, v in env.items()})
        eng = Engine(name, e)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.close()
