#!/usr/bin/env python3
"""A/B: two builds of kvstage, one kvstage-bench command, runs alternated.

  tools/bench/ab.py [-n RUNS] A B -- KVSTAGE-BENCH-ARGS...

A and B are each a build directory (holding proxy/kvstaged and tools/bench/kvstage-bench)
or a git commit, which is built first in build-ab/COMMIT (meson, the same options as
tools/setup.sh). Each side runs its own kvstage-bench, which starts its own kvstaged: the
client library and the proxy are both that side's. Runs go A, B, A, B, ... (RUNS each,
default 7), so that a machine that drifts drifts for both; each is given --json.

Prints, for every figure of every point (chunk size; latency mode: its one result), each side's runs, their medians,
B's median over A's, and the median of the pairs' ratios (run i of B over run i of A, taken one after the other).
A figure that moves less than the runs spread says nothing: the runs are printed so that the spread can be seen.

Each run's raw rte_ring round trip between two processes (the bench's own baseline, p50) is printed first: it is the
host's cross-CPU latency at that moment. A VM's vCPUs can move between host cores that share a cache and ones that do
not; then the round trip jumps (0.23 against 1.0 us on the machine this was written on) and every figure with it.
Runs taken in different states compare the host, not the builds: each figure's line ends with the median
ratio over the pairs whose two round trips agree (within 1.5x), and how many did.

  tools/bench/ab.py --callgrind A B -- KVSTAGE-BENCH-ARGS...

runs each side once under valgrind's callgrind instead (--bytes gives both the same work;
every figure is per chunk or per call either way) and prints instructions per chunk: the proxy's loop (kvsp_run,
inclusive) and its op path (kvsp_client_op), over the chunks it was sent (kvsp_room_send's
calls), and per call of the clients' non-blocking libkvstage calls. Instructions are not
time (a cache miss or a division costs more than its count), but they do not move with
the host's load: where timed runs scatter, they still show which side does more work.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# Two runs saw the same host when their raw ring round trips are within this factor: the
# regimes differ by 4x (0.22 against 0.9 us), a regime's runs by well under 1.5x.
AGREE = 1.5

# (label, path into a point, better when higher)
FIGURES = [
    ("GB/s", ("gbps",), True),
    ("chunks/s", ("chunks_per_s",), True),
    ("rooms/s", ("rooms_per_s",), True),
    ("chunk p50 us", ("chunk_latency_us", "p50"), False),
    ("chunk p99 us", ("chunk_latency_us", "p99"), False),
    ("room p50 us", ("room_latency_us", "p50"), False),
    ("latency p50 us", ("latency_us", "p50"), False),
    ("handoffs/s", ("handoffs_per_s",), True),
    ("acquire p50 us", ("acquire_latency_us", "p50"), False),
    ("proxy cpu %", ("proxy_cpu_pct",), False),
    ("proxy A cpu %", ("proxy_a_cpu_pct",), False),
    ("proxy B cpu %", ("proxy_b_cpu_pct",), False),
]


def build_of(side):
    """A build directory for side: itself, or a fresh build of a commit."""
    if os.path.isfile(os.path.join(side, "tools", "bench", "kvstage-bench")):
        return side
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--verify", side + "^{commit}"],
                            capture_output=True, text=True)
    if commit.returncode:
        sys.exit(f"ab: {side} is neither a build directory (tools/bench/kvstage-bench) nor a commit")
    sha = commit.stdout.strip()
    tree = os.path.join(ROOT, "build-ab", sha[:12])
    src, bld = tree + "-src", tree
    if not os.path.isdir(src):
        print(f"ab: checking out {sha[:12]} in {src}", file=sys.stderr)
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", src, sha], check=True,
                       stdout=subprocess.DEVNULL)
    if not os.path.isfile(os.path.join(bld, "build.ninja")):
        print(f"ab: configuring {bld}", file=sys.stderr)
        subprocess.run(["meson", "setup", bld, src, "--buildtype=debugoptimized", "-Dtests=false"],
                       check=True, stdout=subprocess.DEVNULL)
    print(f"ab: building {bld}", file=sys.stderr)
    subprocess.run(["ninja", "-C", bld, "tools/bench/kvstage-bench", "proxy/kvstaged"], check=True,
                   stdout=subprocess.DEVNULL)
    return bld


def run(build, args):
    bench = os.path.join(build, "tools", "bench", "kvstage-bench")
    env = dict(os.environ, KVSTAGED=os.path.join(build, "proxy", "kvstaged"))
    r = subprocess.run([bench, "--json", *args], capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit(f"ab: {bench} {' '.join(args)} failed ({r.returncode}):\n{r.stderr}")
    return json.loads(r.stdout)


PROXY_FNS = ("kvsp_run", "kvsp_client_poll", "kvsp_client_op", "kvsp_room_send")
CLIENT_FNS = ("kvs_acquire", "kvs_send", "kvs_release", "kvs_poll", "kvs_wait", "kvs_room_lease",
              "kvs_send_open", "kvs_recv_open", "kvs_room_close")


def callgrind_costs(path, names):
    """{name: (inclusive Ir, calls)} for the named functions in one callgrind output file, summed over the calls
    made to them (each call's line in the file carries its inclusive cost). Not callgrind_annotate's rows: those
    split a function by the source file of each instruction, so code inlined from a header would be left out."""
    ir, calls, ids, cur, take = dict.fromkeys(names, 0), dict.fromkeys(names, 0), {}, None, None
    with open(path) as f:
        for line in f:
            if take is not None:  # the cost line after calls=: "position Ir"
                parts = line.split()
                if len(parts) >= 2 and parts[-1].isdigit():
                    ir[take] += int(parts[-1])
                take = None
                continue
            m = re.match(r"c?fn=\((\d+)\)(?: (.*))?", line)
            if m:
                if m.group(2):
                    ids[m.group(1)] = m.group(2).strip()
                cur = ids.get(m.group(1)) if line.startswith("cfn=") else None
                continue
            m = re.match(r"calls=(\d+)", line)
            if m and cur in calls:
                calls[cur] += int(m.group(1))
                take, cur = cur, None
    return {n: (ir[n], calls[n]) for n in names}


def callgrind_side(build, args, outdir):
    """Runs the bench once under callgrind; returns (proxy costs, summed client costs)."""
    os.makedirs(outdir, exist_ok=True)
    for old in os.listdir(outdir):
        os.unlink(os.path.join(outdir, old))
    bench = os.path.join(build, "tools", "bench", "kvstage-bench")
    env = dict(os.environ, KVSTAGED=os.path.join(build, "proxy", "kvstaged"))
    r = subprocess.run(["valgrind", "--tool=callgrind", "--trace-children=yes",
                        f"--callgrind-out-file={outdir}/cg.%p", bench, "-q", *args],
                       capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit(f"ab: callgrind of {bench} {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    proxy, clients = None, {n: [0, 0] for n in CLIENT_FNS}
    for name in sorted(os.listdir(outdir)):
        path = os.path.join(outdir, name)
        with open(path) as f:
            head = f.read(4096)
        if "proxy/kvstaged" in head:
            proxy = callgrind_costs(path, PROXY_FNS)
        else:
            for n, (ir, calls) in callgrind_costs(path, CLIENT_FNS).items():
                clients[n][0] += ir
                clients[n][1] += calls
    if not proxy:
        sys.exit(f"ab: no kvstaged among the callgrind outputs in {outdir} (is the mode one that starts it?)")
    return proxy, clients


def callgrind_main(o, bench_args):
    if not shutil.which("valgrind"):
        sys.exit("ab: --callgrind needs valgrind (Debian: apt-get install valgrind)")
    sides = {"A": build_of(o.a), "B": build_of(o.b)}
    res = {}
    for s in ("A", "B"):
        print(f"ab: callgrind {s}", file=sys.stderr)
        res[s] = callgrind_side(sides[s], bench_args, os.path.join(ROOT, "build-ab", f"callgrind-{s}"))
    print(f"A = {o.a} ({sides['A']})\nB = {o.b} ({sides['B']})\n"
          f"kvstage-bench {' '.join(bench_args)} under callgrind, once each")
    chunks = {s: res[s][0]["kvsp_room_send"][1] for s in res}
    print(f"\nproxy, instructions per chunk sent (chunks: A {chunks['A']}, B {chunks['B']})")
    for n in PROXY_FNS:
        per = {s: res[s][0][n][0] / chunks[s] if chunks[s] else float("nan") for s in res}
        print(f"  {n:18s} A {per['A']:8.1f}  B {per['B']:8.1f}  B/A {per['B'] / per['A']:.3f}"
              if per["A"] else f"  {n:18s} A -  B {per['B']:8.1f}")
    print("\nclients, instructions per call (every sender and receiver process)")
    for n in CLIENT_FNS:
        per = {s: res[s][1][n][0] / res[s][1][n][1] if res[s][1][n][1] else None for s in res}
        if per["A"] is None or per["B"] is None:
            continue
        print(f"  {n:18s} A {per['A']:8.1f}  B {per['B']:8.1f}  B/A {per['B'] / per['A']:.3f}"
              f"  (calls A {res['A'][1][n][1]}, B {res['B'][1][n][1]})")
    return 0


def figure(point, path):
    v = point
    for k in path:
        if not isinstance(v, dict) or k not in v:
            return None
        v = v[k]
    return v if isinstance(v, (int, float)) else None


def host_rtt(report):
    """The run's raw rte_ring ping-pong round trip p50 (us), or None where the mode does not measure it."""
    return figure(report, ("baselines", "ring", "pingpong_rtt_us", "p50"))


def agreeing_pairs(va, vb, rtt):
    """The median ratio over the pairs whose two runs saw the same host (round trips within
    AGREE of each other), as a suffix; "" where the mode has no round trip or no pair agrees."""
    if any(v is None for v in rtt["A"] + rtt["B"]) or not all(va):
        return ""
    same = [b / a for a, b, ra, rb in zip(va, vb, rtt["A"], rtt["B"])
            if max(ra, rb) <= AGREE * min(ra, rb)]
    if not same:
        return ", no pair's round trips agree"
    return f", pairs whose round trips agree {statistics.median(same):.3f} ({len(same)} of {len(va)})"


def points(report):
    """A report's points: its "points" (the throughput modes), or its one "result" (latency mode)."""
    if "points" in report:
        return report["points"]
    return [report["result"]] if "result" in report else []


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], usage=__doc__.split("\n\n")[1])
    ap.add_argument("-n", "--runs", type=int, default=7)
    ap.add_argument("--callgrind", action="store_true")
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("bench", nargs=argparse.REMAINDER)
    o = ap.parse_args()
    bench_args = o.bench[1:] if o.bench[:1] == ["--"] else o.bench
    if o.runs < 1 or not bench_args:
        ap.error("want RUNS >= 1 and a kvstage-bench command after --")
    if o.callgrind:
        return callgrind_main(o, bench_args)
    sides = {"A": build_of(o.a), "B": build_of(o.b)}
    runs = {"A": [], "B": []}
    for i in range(o.runs):
        for s in ("A", "B"):
            print(f"ab: run {i + 1}/{o.runs} {s}", file=sys.stderr)
            runs[s].append(run(sides[s], bench_args))
    print(f"A = {o.a} ({sides['A']})\nB = {o.b} ({sides['B']})\n"
          f"kvstage-bench {' '.join(bench_args)}, {o.runs} runs each, alternated")
    npoints = len(points(runs["A"][0]))
    if not npoints:
        sys.exit("ab: the bench's JSON has neither points nor a result: nothing to compare")
    rtt = {s: [host_rtt(r) for r in runs[s]] for s in runs}
    if not any(v is None for v in rtt["A"] + rtt["B"]):
        print("\nhost: raw rte_ring round trip p50 us, each run's own baseline (the host's cross-CPU latency)")
        for s in ("A", "B"):
            print(f"  {'':15s} {s} {' '.join(f'{v:.3g}' for v in rtt[s])}")
    for k in range(npoints):
        p0 = points(runs["A"][0])[k]
        print(f"\npoint {k}: chunk {p0.get('chunk_bytes', '?')} bytes")
        for label, path, higher in FIGURES:
            va = [figure(points(r)[k], path) for r in runs["A"]]
            vb = [figure(points(r)[k], path) for r in runs["B"]]
            if any(v is None for v in va + vb):
                continue
            ma, mb = statistics.median(va), statistics.median(vb)
            ratio = mb / ma if ma else float("nan")
            better = "better" if (ratio > 1) == higher else "worse"
            print(f"  {label:15s} A {' '.join(f'{v:.4g}' for v in va)}  median {ma:.4g}")
            pairs = statistics.median(b / a for a, b in zip(va, vb)) if all(va) else float("nan")
            print(f"  {'':15s} B {' '.join(f'{v:.4g}' for v in vb)}  median {mb:.4g}  "
                  f"B/A {ratio:.3f} ({better if abs(ratio - 1) > 0.005 else 'same'}), pairs {pairs:.3f}"
                  + agreeing_pairs(va, vb, rtt))
    return 0


if __name__ == "__main__":
    sys.exit(main())
