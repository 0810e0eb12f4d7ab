"""A throughput point of the KVSTAGE NIXL backend, beside kvstage-bench's local and tcp modes at the same sizes,
measured in the same run: tests/nixl/run.sh --bench (or this file, with run.sh's environment).

Two engine processes (nixl_agent, as in the tests) move R-byte requests of B-byte blocks, READ (decode pulls,
vLLM's way) and WRITE (prefill pushes), through one kvstaged (local: both engines on it) and through two over
TCP on loopback; each request is posted, then checked until DONE, one at a time and --depth at a time. The
backend copies every byte twice (gather from pages into slots, scatter from slots into pages); kvstage-bench
--payload copy makes the same two copies with one process per side, --payload none none: their ratio is what
the copies cost a plain kvstage room, and the backend's figure against --payload copy is what NIXL's API and the
backend's own thread add.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import Engine, Proxy  # noqa: E402


def bench_backend(mode, op, req_bytes, block, depth, seconds, secret, slots, slot_size):
    a = Proxy(secret, slots=slots, slot_size=slot_size)
    b = a if mode == "local" else Proxy(secret, slots=slots, slot_size=slot_size)
    env = {"KVSTAGE_PEER_SECRET_FILE": secret, "KVSTAGE_NIXL_LISTEN": "127.0.0.1:0"}
    prefill = Engine("prefill", dict(env, KVSTAGE_SOCKET=a.socket))
    decode = Engine("decode", dict(env, KVSTAGE_SOCKET=b.socket))
    try:
        prefill.call("init", name="prefill-b")
        decode.call("init", name="decode-b")
        regions = 8
        blocks = req_bytes // block // regions
        pbases = prefill.call("alloc", regions=regions, blocks=blocks * depth, block_len=block, seed=1)
        dbases = decode.call("alloc", regions=regions, blocks=blocks * depth, block_len=block, seed=None)
        init, peer, bases = (decode, prefill, pbases) if op == "READ" else (prefill, decode, dbases)
        remote = init.call("add_remote", md=peer.call("md"))
        lh = init.call("prep_local")
        rh = init.call("prep_remote", agent=remote, bases=bases, blocks=blocks * depth, block_len=block)
        nb = blocks * depth
        ids = [[r * nb + k * blocks + i for r in range(regions) for i in range(blocks)] for k in range(depth)]
        moved, t0, n = 0, time.monotonic(), 0
        while time.monotonic() - t0 < seconds or n == 0:
            xs = [init.call("xfer", kind=op, local=lh, local_ids=ids[k], remote=rh, remote_ids=ids[k],
                            notif=f"b{n}-{k}".encode())["id"] for k in range(depth)]
            for x in xs:
                if init.call("wait", xid=x) != "DONE":
                    raise RuntimeError(f"{mode} {op}: a transfer failed")
            moved += depth * req_bytes
            n += 1
        dt = time.monotonic() - t0
        return moved / dt / 1e9
    finally:
        prefill.close()
        decode.close()
        a.close()
        if b is not a:
            b.close()


def kvstage_bench(mode, payload, room_bytes, slot_size, rooms, seconds, slots):
    exe = os.environ["KVSTAGE_BENCH"]
    r = subprocess.run([exe, "--json", "-q", "-c", str(slot_size), "--room-bytes", str(room_bytes),
                        "--rooms", str(rooms), "--payload", payload, "-d", str(seconds),
                        f"--proxy-arg=--slots={slots}", mode],
                       capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise RuntimeError(f"kvstage-bench {mode}: {r.stderr[-2000:]}")
    return json.loads(r.stdout)["points"][0]["gbps"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--request", type=int, default=16 << 20, help="bytes per request (default 16 MiB)")
    ap.add_argument("--block", type=int, default=16384, help="bytes per descriptor (default 16 KiB)")
    ap.add_argument("--slot-size", type=int, default=1 << 20, help="the proxies' slot size (default 1 MiB)")
    ap.add_argument("--slots", type=int, default=256, help="slots per proxy (default 256)")
    ap.add_argument("--depth", type=int, default=2, help="requests in flight (default 2)")
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        secret = os.path.join(d, "secret")
        with open(secret, "w") as f:
            f.write(os.urandom(32).hex())
        os.chmod(secret, 0o600)
        print(f"# {os.uname().nodename}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}; requests of "
              f"{args.request >> 20} MiB in {args.block >> 10} KiB descriptors, {args.depth} in flight; slots "
              f"{args.slot_size >> 10} KiB x {args.slots}")
        print("| path | what | GB/s |")
        print("| --- | --- | --- |")
        for mode in ("local", "tcp"):
            for op in ("READ", "WRITE"):
                gbs = bench_backend(mode, op, args.request, args.block, args.depth, args.seconds, secret,
                                    args.slots, args.slot_size)
                print(f"| {mode} | NIXL KVSTAGE {op} (nixl_agent, two copies) | {gbs:.2f} |", flush=True)
            for payload in ("copy", "none"):
                gbs = kvstage_bench(mode, payload, args.request, args.slot_size, args.depth, args.seconds,
                                    args.slots)
                print(f"| {mode} | kvstage-bench {mode} --payload {payload} ({args.depth} rooms of the request's "
                      f"size in flight) | {gbs:.2f} |", flush=True)


if __name__ == "__main__":
    main()
