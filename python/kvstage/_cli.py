"""The console scripts of a wheel's install (pyproject.toml, [project.scripts]): kvstaged, kvstage-stat, ...

Each replaces its own process with the program of the same name in kvstage/_bin (os.execv, argv[0] the
command's name, the arguments as given), so the pid, signals, the environment and inherited fds (kvstaged
--ready-fd N) are the program's, as if it had been started directly; and it works wherever pip put the
package (a venv, --user, --target), as the programs are found next to this file, not on a path. A system
install (meson without -Dwheel) has no kvstage/_bin: its programs are in the prefix's bin directory.
"""
import os
import sys

_BIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bin")


def _exec(name):
    """Runs kvstage/_bin/NAME in this process with this command's arguments; returns 127/126 if it cannot."""
    exe = os.path.join(_BIN, name)
    if not os.access(exe, os.X_OK):
        print(f"{name}: no {exe}: this kvstage was not installed from its wheel (a system install's "
              f"programs are in its bin directory)", file=sys.stderr)
        return 127
    try:
        os.execv(exe, [name, *sys.argv[1:]])
    except OSError as e:
        print(f"{name}: cannot run {exe}: {e}", file=sys.stderr)
        return 126


def kvstaged():
    """The proxy daemon."""
    return _exec("kvstaged")


def kvstage_stat():
    """A proxy's state: slots, rooms, clients, peers."""
    return _exec("kvstage-stat")


def kvstage_ctl():
    """Failpoints of a kvstaged started with --failpoints."""
    return _exec("kvstage-ctl")


def kvstage_bench():
    """Benchmarks; the kvstaged it starts is this package's unless --kvstaged or $KVSTAGED names another.

    kvstage-bench looks for kvstaged as $KVSTAGED, then ../../proxy/kvstaged beside itself (a build tree),
    then PATH: neither of the last two finds _bin/kvstaged when the venv is not activated.
    """
    if not os.environ.get("KVSTAGED"):
        os.environ["KVSTAGED"] = os.path.join(_BIN, "kvstaged")
    return _exec("kvstage-bench")


def kvstage_demo():
    """A sender and a receiver process through a running proxy, every byte checked."""
    return _exec("kvstage-demo")
