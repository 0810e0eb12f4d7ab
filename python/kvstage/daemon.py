"""Starting a kvstaged from Python (tests, examples, a supervisor): the --ready-fd handshake.

spawn(exe, args, log) starts kvstaged with --ready-fd and returns once it
serves, or raises DaemonError saying why; stop(proc) ends it with SIGTERM
(its drain), then SIGKILL. find_kvstaged() says which kvstaged to start.
"""
import os
import select
import shutil
import signal
import subprocess
import time

# A wheel's install carries its programs in the package (meson -Dwheel=true; kvstage/_cli.py).
_PKG_KVSTAGED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bin", "kvstaged")


def find_kvstaged():
    """Returns the kvstaged to start: $KVSTAGED, else this package's own (a wheel's install), else the first
    on PATH; None if none. The package's own is the binary itself, not the console script that execs it."""
    if os.environ.get("KVSTAGED"):
        return os.environ["KVSTAGED"]
    if os.access(_PKG_KVSTAGED, os.X_OK):
        return _PKG_KVSTAGED
    return shutil.which("kvstaged")


class DaemonError(RuntimeError):
    """kvstaged did not come up: why, in words."""


def spawn(exe, args, log, timeout=20.0):
    """Starts exe (a kvstaged) with args and --ready-fd; returns the Popen once it says ready.

    log: a file object its stdout and stderr go to. Raises DaemonError (the
    process is gone by then) if it exits, says something else, or says nothing
    within timeout seconds.
    """
    r, w = os.pipe()
    try:
        proc = subprocess.Popen([exe, *args, "--ready-fd", str(w)], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, pass_fds=(w,))
    finally:
        os.close(w)
    try:
        got, deadline = b"", time.monotonic() + timeout
        while not got.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                raise DaemonError(f"kvstaged did not say ready within {timeout:g} s")
            chunk = os.read(r, 64)
            if not chunk:
                code = proc.poll()
                raise DaemonError("kvstaged closed its ready fd without a word ("
                                  + (f"exit {code})" if code is not None else "still running)"))
            got += chunk
        if got != b"ready\n":
            raise DaemonError(f"kvstaged wrote {got!r} on its ready fd")
    except BaseException:
        stop(proc)
        raise
    finally:
        os.close(r)
    return proc


def stop(proc, grace=5.0):
    """SIGTERM (kvstaged drains), then SIGKILL after grace seconds; returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
