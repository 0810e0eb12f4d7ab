"""Fixtures: a real kvstaged per test, in a fresh temp dir, killed at teardown. Without a real SGLang,
the SGLang stand-ins (sglang_stubs/) go on sys.path: kvstage.sglang builds on SGLang's base classes."""
import importlib.util
import os
import shutil
import sys
import tempfile
import time
import weakref
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository
# The engines' side channel needs the deployment's peer secret: every test (and every process it starts) gets
# this one unless the environment names one; test_sidechannel.py takes it away or changes it where it tests that.
TEST_PEER_SECRET = "kvstage-test-peer-secret-not-for-production"
if not (os.environ.get("KVSTAGE_PEER_SECRET_FILE") or os.environ.get("KVSTAGE_PEER_SECRET")):
    os.environ["KVSTAGE_PEER_SECRET"] = TEST_PEER_SECRET
SLOTS, SLOT_SIZE = 64, 65536
SGLANG_STUBS = Path(__file__).resolve().parent / "sglang_stubs"
REAL_SGLANG = importlib.util.find_spec("sglang") is not None
if not REAL_SGLANG:
    sys.path.append(str(SGLANG_STUBS))
# the engine pieces the SGLang test engines share with python/examples/pd_demo.py (pd_sim.py)
sys.path.append(str(ROOT / "python" / "examples"))
# vLLM's and prometheus_client's stand-ins likewise (vllm_stubs/__init__.py; the modules spawned children import
# also import it, as conftest does not run there)
import vllm_stubs  # noqa: E402,F401


def kvstaged_path():
    """Returns the kvstaged binary: $KVSTAGED, else ../build/proxy/kvstaged."""
    return os.environ.get("KVSTAGED") or str(ROOT / "build" / "proxy" / "kvstaged")


_pending = weakref.WeakKeyDictionary()  # Client -> events taken by wait() but not yet looked at


def next_event(client, timeout=10, final=True):
    """Returns client's next event (only final ones when final), failing if none comes within timeout seconds."""
    q = _pending.setdefault(client, [])
    deadline = time.monotonic() + timeout
    while True:
        while q:
            ev = q.pop(0)
            if ev.final or not final:
                return ev
            pytest.fail(f"unexpected event {ev}")
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"no event within {timeout} s")
        q.extend(client.wait(left))


class Proxy:
    """A running kvstaged: .socket, .dir, .log (path), .proc."""

    def __init__(self, args=()):
        exe = kvstaged_path()
        if not os.access(exe, os.X_OK):
            pytest.fail(f"no kvstaged at {exe} (build it, or set $KVSTAGED)")
        self.dir = tempfile.mkdtemp(prefix="kvs-")  # short: a socket path is at most 107 bytes
        self.socket = os.path.join(self.dir, "kvs.sock")
        self.log = os.path.join(self.dir, "kvstaged.log")
        self.final_log = None
        self.proc = None
        argv = ["--socket", self.socket, "--slots", str(SLOTS), "--slot-size", str(SLOT_SIZE),
                "--shutdown-grace", "1000", *args]
        from kvstage.daemon import DaemonError, spawn
        with open(self.log, "wb") as log:
            try:
                self.proc = spawn(exe, argv, log)
            except DaemonError as e:
                self.fail(str(e))

    def log_text(self):
        """Returns the log so far (once stopped: what it was then)."""
        if self.final_log is not None:
            return self.final_log
        try:
            return Path(self.log).read_text(errors="replace")
        except OSError as e:
            return f"(no log: {e})"

    def fail(self, why):
        """Stops the proxy, removes its dir and fails the test with why and the log."""
        self.stop()
        text = self.log_text()
        shutil.rmtree(self.dir, ignore_errors=True)
        pytest.fail(f"{why}\n--- kvstaged log ---\n{text}")

    def stop(self):
        """SIGTERM, then SIGKILL after 5 s; returns the exit status (keeps the log text in .final_log)."""
        from kvstage.daemon import stop
        rc = stop(self.proc) if self.proc else None
        if self.final_log is None:
            self.final_log = self.log_text()
        return rc


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Adds the kvstaged log to the report of a failed test."""
    outcome = yield
    rep = outcome.get_result()
    px = getattr(item, "_kvstaged", None)
    if px is not None and rep.failed:
        rep.sections.append((f"kvstaged log ({rep.when})", px.log_text()))


@pytest.fixture
def proxy(request):
    """Returns a fresh Proxy (64 slots x 64 KiB); stops it and removes its dir at teardown."""
    px = Proxy()
    request.node._kvstaged = px
    yield px
    rc = px.stop()
    shutil.rmtree(px.dir, ignore_errors=True)
    assert rc == 0, f"kvstaged exited with status {rc} at SIGTERM"


@pytest.fixture
def client(proxy):
    """Returns a Client of proxy, closed at teardown."""
    import kvstage
    with kvstage.Client(proxy.socket) as c:
        yield c


@pytest.fixture
def pair(proxy):
    """Returns (sender, receiver): two Clients of proxy, closed at teardown."""
    import kvstage
    with kvstage.Client(proxy.socket) as tx, kvstage.Client(proxy.socket) as rx:
        yield tx, rx
