#!/usr/bin/env python3
"""A prefill engine and a decode engine on two hosts (or pods), each with its own kvstaged, moving KV rooms
between their proxies: the decode side opens a receiving room per request and sends its descriptor to the prefill
side over the authenticated side channel (kvstage.sidechannel, as the SGLang backend and the vLLM connector do); the
prefill side fills slots with the request's bytes and sends them; its proxy carries them to the decode side's.
Every received byte is checked against what the request's seed makes. Some requests are aborted by the prefill
side after a chunk or two, some by the decode side as soon as they are asked for.

  pd_hosts.py prefill --listen 0.0.0.0:7700                  # runs until SIGTERM; a line per 1000 requests
  pd_hosts.py decode --prefill HOST:7700 --requests 200      # exits 0 iff every completed request was exact

Both need the deployment's peer secret ($KVSTAGE_PEER_SECRET_FILE or $KVSTAGE_PEER_SECRET), and each its own
kvstaged ($KVSTAGE_SOCKET or --socket); the decode side's kvstaged must --listen where the prefill side's can reach
it. The prefill side ends each request's room on its final event and keeps serving; SIGTERM or SIGINT ends it
after aborting what it still sends, and it prints its counts as one JSON line.
"""
import argparse
import base64
import hashlib
import json
import os
import queue
import random
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if (HERE.parent / "kvstage").is_dir() and str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))  # the source tree's package, when run from it
import kvstage  # noqa: E402
from kvstage import EventType, sidechannel  # noqa: E402


def pattern(seed, chunk, n):
    """Returns chunk's n bytes of the request seeded seed (SHAKE-256 of both): any byte out of place shows."""
    return hashlib.shake_256(b"%d/%d" % (seed, chunk)).digest(n)


def endpoint(s):
    host, _, port = s.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"want HOST:PORT, not {s!r}")
    return host, int(port)


def valid(msg):
    """The side channel's check of what the decode side may ask: a pull or a drop, well formed."""
    if not isinstance(msg, dict) or not isinstance(msg.get("req"), int):
        return False
    if msg.get("op") == "drop":
        return True
    if not (msg.get("op") == "pull" and isinstance(msg.get("seed"), int) and isinstance(msg.get("abort_after"), int)):
        return False
    try:
        sidechannel.desc_bytes(msg.get("desc"))
    except ValueError:
        return False
    return True


# ------------------------------------------------------------------------------------------------ prefill
class Prefill:
    """Serves pulls: one send room per request, filled chunk by chunk as slots come; aborts where asked."""

    def __init__(self, client):
        self.c = client
        self.rooms = {}      # req -> [SendRoom, next chunk, seed, abort_after]
        self.counts = dict.fromkeys(("pulls", "sent", "aborted_here", "dropped", "failed", "refused"), 0)

    def pull(self, msg):
        try:
            room = self.c.send_open(sidechannel.desc_bytes(msg["desc"]), user_data=msg["req"])
        except kvstage.KvstageError as e:
            self.counts["refused"] += 1
            print(f"prefill: request {msg['req']} refused: {e}", file=sys.stderr)
            return
        self.counts["pulls"] += 1
        self.rooms[msg["req"]] = [room, 0, msg["seed"], msg["abort_after"]]

    def drop(self, req):
        r = self.rooms.get(req)
        if r is not None:
            r[0].abort_quietly()

    def step(self):
        """Sends what slots allow; returns whether it did anything."""
        busy = False
        for req, r in list(self.rooms.items()):
            room, i, seed, abort_after = r
            if i == abort_after:
                room.abort_quietly()
                r[1] = room.chunks + 1  # nothing more to send; the final ends it
                self.counts["aborted_here"] += 1
                busy = True
                continue
            if i >= room.chunks:
                continue
            try:
                (lease,) = self.c.acquire(1)
            except (kvstage.PoolExhausted, kvstage.Again):
                return busy
            n = room.chunk_len(i)
            lease.view()[:n] = pattern(seed, i, n)
            try:
                room.send(lease, i * self.c.slot_size, n)
            except kvstage.KvstageError:  # the room ended under us (its final tells how)
                self.c.release(lease)
                r[1] = room.chunks + 1
                continue
            r[1] = i + 1
            busy = True
        return busy

    def final(self, ev):
        r = self.rooms.pop(ev.user_data, None)
        if r is None:
            return
        kind = {EventType.SEND_DONE: "sent", EventType.ABORTED: "dropped"}.get(ev.type, "failed")
        if kind == "dropped" and r[1] > r[0].chunks:  # our own abort
            kind = None
        if kind:
            self.counts[kind] += 1
        r[0].close()


def run_prefill(args):
    stop = []
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.append(1))
    msgs = queue.SimpleQueue()
    client = kvstage.Client(args.socket)
    p = Prefill(client)
    host, port = args.listen
    lis = sidechannel.FrameListener(host, port, msgs.put, valid, "pd-hosts")
    print(f"prefill: side channel on {host}:{lis.port}, kvstaged {client.slot_count} slots x {client.slot_size}",
          flush=True)
    shown = 0
    while not stop:
        busy = False
        while True:
            try:
                m = msgs.get_nowait()
            except queue.Empty:
                break
            busy = True
            p.pull(m) if m["op"] == "pull" else p.drop(m["req"])
        busy |= p.step()
        # Idle: block until an event (or a pull, within 50 ms); else just look.
        for ev in client.poll() if busy else client.wait(0.05):
            busy = True
            if ev.final:
                p.final(ev)
        done = sum(p.counts[k] for k in ("sent", "aborted_here", "dropped", "failed"))
        if done // 1000 > shown:
            shown = done // 1000
            print("prefill: " + json.dumps(p.counts), flush=True)
    for r in p.rooms.values():
        r[0].abort_quietly()
    lis.close()
    print("prefill: " + json.dumps(dict(p.counts, in_flight=len(p.rooms))), flush=True)
    client.close()
    return 0


# ------------------------------------------------------------------------------------------------ decode
def run_decode(args):
    rng = random.Random(args.seed)
    client = kvstage.Client(args.socket)
    peers = sidechannel.Peers(sidechannel.load_key())
    host, port = args.prefill
    nbytes = args.bytes or int(client.slot_size * 2.5)
    counts = dict.fromkeys(("exact", "wrong", "aborted_by_prefill", "aborted_here", "failed"), 0)
    open_rooms = {}   # req -> (RecvRoom, seed, who aborts)
    next_req, t0 = 0, time.monotonic()
    deadline = t0 + args.timeout
    while (next_req < args.requests or open_rooms) and time.monotonic() < deadline:
        while next_req < args.requests and len(open_rooms) < args.concurrency:
            req, seed = next_req, rng.getrandbits(48)
            who = rng.choices(("none", "prefill", "decode"),
                              (1 - 2 * args.abort_fraction, args.abort_fraction, args.abort_fraction))[0]
            room, desc = client.recv_open(nbytes, user_data=req)
            abort_after = rng.randrange(1, max(2, room.chunks)) if who == "prefill" else -1
            try:
                peers.send(host, port, {"op": "pull", "req": req, "seed": seed, "abort_after": abort_after,
                                        "desc": base64.b64encode(desc).decode()})
            except OSError as e:
                print(f"decode: cannot reach the prefill side at {host}:{port}: {e}", file=sys.stderr)
                room.close()
                return 1
            if who == "decode":
                room.abort()
                peers.send(host, port, {"op": "drop", "req": req})
            open_rooms[req] = (room, seed, who)
            next_req += 1
        for ev in client.wait(1.0):
            if not ev.final or ev.user_data not in open_rooms:
                continue
            room, seed, who = open_rooms.pop(ev.user_data)
            if ev.type == EventType.RECV_DONE:
                ok = all(bytes(room.lease(i).view()[:room.chunk_len(i)]) == pattern(seed, i, room.chunk_len(i))
                         for i in range(room.chunks))
                counts["exact" if ok and who == "none" else "wrong"] += 1
                if not ok:
                    print(f"decode: request {ev.user_data}: bytes differ", file=sys.stderr)
                elif who != "none":
                    print(f"decode: request {ev.user_data} completed though {who} aborted it", file=sys.stderr)
            elif ev.type == EventType.ABORTED and who != "none":
                counts["aborted_here" if who == "decode" else "aborted_by_prefill"] += 1
            else:
                counts["failed"] += 1
                print(f"decode: request {ev.user_data} ({who} aborts): {getattr(ev.type, 'name', ev.type)} "
                      f"{kvstage.strerror(ev.status) if ev.status else ''}", file=sys.stderr)
            room.close()
            done = sum(counts.values())
            if done == args.first_line_at:
                print(f"decode: {done} requests ended", flush=True)
    secs = time.monotonic() - t0
    left = len(open_rooms) + args.requests - next_req
    for room, _, _ in open_rooms.values():
        room.close()
    peers.close()
    client.close()
    report = dict(counts, requests=args.requests, unfinished=left, bytes_per_request=nbytes, seconds=round(secs, 3))
    print("decode: " + json.dumps(report), flush=True)
    return 0 if counts["wrong"] == 0 and counts["failed"] == 0 and left == 0 else 1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--socket", default=None, help="this side's kvstaged (default $KVSTAGE_SOCKET, else "
                   f"{kvstage.KVS_DEFAULT_SOCKET})")
    sub = p.add_subparsers(dest="role", required=True)
    pf = sub.add_parser("prefill", help="serve pulls until SIGTERM")
    pf.add_argument("--listen", type=endpoint, default=("0.0.0.0", 7700), metavar="HOST:PORT",
                    help="the side channel's address (default 0.0.0.0:7700)")
    dc = sub.add_parser("decode", help="ask for --requests rooms and check every byte")
    dc.add_argument("--prefill", type=endpoint, required=True, metavar="HOST:PORT", help="the prefill side channel")
    dc.add_argument("--requests", type=int, default=200, help="requests (default 200)")
    dc.add_argument("--bytes", type=int, default=0, help="bytes a request (default 2.5 slots)")
    dc.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    dc.add_argument("--abort-fraction", type=float, default=0.1,
                    help="fraction aborted by each side (default 0.1, at most 0.5)")
    dc.add_argument("--seed", type=int, default=1)
    dc.add_argument("--timeout", type=float, default=300.0, help="give up after S seconds (default 300)")
    dc.add_argument("--first-line-at", type=int, default=1, metavar="N",
                    help="print 'decode: N requests ended' when N have (default 1: a barrier for tests)")
    args = p.parse_args(argv)
    if args.role == "decode" and not (args.requests > 0 and 0 <= args.abort_fraction <= 0.5
                                      and args.concurrency > 0):
        p.error("--requests and --concurrency must be > 0, --abort-fraction within [0, 0.5]")
    try:
        return run_prefill(args) if args.role == "prefill" else run_decode(args)
    except (kvstage.KvstageError, sidechannel.SecretError) as e:
        print(f"pd_hosts.py {args.role}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
