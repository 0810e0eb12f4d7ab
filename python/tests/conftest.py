"""Fixtures: a real kvstaged per test, in a fresh temp dir, killed at teardown."""
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository
SLOTS, SLOT_SIZE = 64, 65536


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
        r, w = os.pipe()

        def ready_fd_3():
            os.dup2(w, 3) if w != 3 else os.set_inheritable(3, True)

        argv = [exe, "--socket", self.socket, "--slots", str(SLOTS), "--slot-size", str(SLOT_SIZE),
                "--ready-fd", "3", "--shutdown-grace", "1000", *args]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         close_fds=False, preexec_fn=ready_fd_3)
        os.close(w)
        try:
            got, deadline = b"", time.monotonic() + 20
            while not got.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([r], [], [], left)[0]:
                    self.fail("kvstaged did not say ready within 20 s")
                chunk = os.read(r, 64)
                if not chunk:
                    self.fail(f"kvstaged closed its ready fd without a word (exit {self.proc.poll()})")
                got += chunk
            if got != b"ready\n":
                self.fail(f"kvstaged wrote {got!r} on its ready fd")
        finally:
            os.close(r)

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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.final_log is None:
            self.final_log = self.log_text()
        return self.proc.returncode


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
