"""python/examples/pd_demo.py run as a user runs it (a subprocess, no PYTHONPATH): both topologies with aborts
from either side end with every completed request verified and the pool free; a test-only corruption of one
completed request's page and of one aborted request's pages after clear() makes it name them and exit 1;
a bad command line exits 2."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from sglang_common import NEED_TORCH

DEMO = ROOT / "python" / "examples" / "pd_demo.py"
SMALL = ["--requests", "30", "--abort-fraction", "0.3", "--concurrency", "8", "--max-pages", "24",
         "--chunk-pages", "8", "--slot-size", "64K", "--bootstrap-timeout", "1", "--timeout", "60", "--quiet"]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVSTAGE_PD_DEMO_CORRUPT")}
    env.update(extra)
    return env


def _demo(args, timeout=180, **env):
    return subprocess.run([sys.executable, str(DEMO), *args], capture_output=True, text=True, timeout=timeout,
                          env=_env(**env), cwd="/", stdin=subprocess.DEVNULL)


def _specs(args):
    sys.path.insert(0, str(DEMO.parent))
    try:
        import pd_demo
        return pd_demo.requests_for(args)
    finally:
        sys.path.remove(str(DEMO.parent))


@NEED_TORCH
@pytest.mark.parametrize("prefill,decode", [(2, 1), (1, 2)])
def test_demo_topologies(prefill, decode):
    args = SMALL + ["--prefill", str(prefill), "--decode", str(decode), "--seed", "5", "--json"]
    out = _demo(args)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    rep = json.loads(out.stdout)
    specs = _specs(args)
    planned = {side: sum(1 for r in specs if r["plan"] and r["plan"][0] == side) for side in ("prefill", "decode")}
    assert rep["ok"] is True and rep["problems"] == [] and rep["failures"] == []
    assert (rep["prefill_workers"], rep["decode_workers"], rep["requests"]) == (prefill, decode, 30)
    assert rep["failed"] == 0
    assert (rep["aborted_by_prefill"], rep["aborted_by_decode"]) == (planned["prefill"], planned["decode"]) == (5, 4)
    assert rep["completed"] == 30 - 9
    assert sum(rep["aborted_at"]["prefill"].values()) == 5 and sum(rep["aborted_at"]["decode"].values()) == 4
    assert rep["verified_bytes"] > 0 and rep["gb_per_s"] > 0
    assert rep["pool_free"] is True
    assert rep["proxy_rooms"]["done"] == rep["completed"]  # one room a completed request; aborted ones never done
    # every request used its workers: the requests spread over every prefill and every decode worker
    assert {r["p"] for r in specs} == set(range(prefill)) and {r["d"] for r in specs} == set(range(decode))


@NEED_TORCH
def test_demo_catches_a_wrong_page_and_a_late_write():
    args = SMALL + ["--seed", "5"]
    specs = _specs(args)
    done = next(r["k"] for r in specs if r["plan"] is None)
    late = next(r["k"] for r in specs
                if r["plan"] in (("prefill", "Transferring"), ("decode", "Transferring"), ("decode", "mid")))
    out = _demo(args, KVSTAGE_PD_DEMO_CORRUPT=f"page:{done},late:{late}")
    assert out.returncode == 1, f"exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    text = out.stdout
    other = (done + 1) % len(specs)
    assert f"FAILED request {done} " in text and f"holds request {other}'s kv buffer 0 page 0" in text, text
    assert f"FAILED request {late} " in text and "decode pages written after clear()" in text, text
    lines = dict(line.split(None, 1) for line in text.splitlines() if line[:1].isalpha() and " " in line)
    assert lines["failed"].split()[0] == "2", text
    assert lines["completed"].split()[0] == str(30 - 9 - 1), text
    assert text.rstrip().endswith("FAILED"), text


def test_demo_command_line():
    out = _demo(["--help"], timeout=60)
    assert out.returncode == 0 and "--abort-fraction" in out.stdout and "Exit status" in out.stdout, out
    for bad in (["--prefill", "0"], ["--abort-fraction", "1.5"], ["--slot-size", "5000"], ["--nonsense"]):
        out = _demo(bad, timeout=60)
        assert out.returncode == 2, (bad, out)
    out = _demo([], timeout=60, KVSTAGE_PD_DEMO_CORRUPT="bogus:1")
    assert out.returncode == 2 and "KVSTAGE_PD_DEMO_CORRUPT" in out.stderr, out
