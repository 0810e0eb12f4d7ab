"""kvstage-trace: one request's KV transfer followed across engines and proxies, from their lifecycle files.

Reads JSON lines of both schemas: the engines' (`vllm-kv-connector-v1`, kvstage.lifecycle; also a log's lines
carrying "KV_CONNECTOR_LIFECYCLE ") and kvstaged's (`kvstage-proxy-v1`, --trace-file), from any number of hosts'
files, and joins them into transfers: a prefill request (role producer), the decode requests whose
remote_request_id_hash names it (role consumer), and every proxy line naming a room one of them opened. Times are
each host's CLOCK_MONOTONIC (monotonic_ns) within a host, and wall_ns across hosts.

  kvstage-trace FILE...                       every transfer, one line each
  kvstage-trace --request ID FILE...          one request's timeline (ID hashed here, as the engines hash it)
  kvstage-trace --request-hash HASH FILE...   the same by its hash
  kvstage-trace --summary [--window S] FILE...  the stages' durations over the last S seconds: count, p50, p99, max
"""
from __future__ import annotations

import argparse
import collections
import json
import sys

from .lifecycle import LOG_PREFIX, SCHEMA, hash_request_id

PROXY_SCHEMA = "kvstage-proxy-v1"

# (stage, from event, to event): what each side's time went to, between two of its own events
_STAGES = (
    ("prefill: copy into slots", ("producer", "slots_leased"), ("producer", "copy_in_done")),
    ("prefill: staged until pulled", ("producer", "copy_in_done"), ("producer", "room_open")),
    ("decode: matched until room open", ("consumer", "blocks_matched"), ("consumer", "room_open")),
    ("decode: room open until landed", ("consumer", "room_open"), ("consumer", "room_final")),
    ("decode: copy out of slots", ("consumer", "room_final"), ("consumer", "copy_out_done")),
    ("proxies: first chunk queued until last landed", ("send", "chunk_queued"), ("recv", "chunk_landed")),
    ("end to end", ("producer", "transfer_staged"), ("consumer", "transfer_completed")),
)


def read_records(paths, errors):
    """The records of both schemas in the files (a path '-' is stdin); lines that are not one are counted in
    errors[path]."""
    out = []
    for path in paths:
        f = sys.stdin if path == "-" else open(path, encoding="utf-8", errors="replace")
        try:
            for line in f:
                i = line.find(LOG_PREFIX)
                text = line[i + len(LOG_PREFIX):] if i >= 0 else line
                text = text.strip()
                if not text:
                    continue
                try:
                    rec = json.loads(text)
                except ValueError:
                    errors[path] += 1
                    continue
                if not isinstance(rec, dict) or rec.get("schema") not in (SCHEMA, PROXY_SCHEMA):
                    errors[path] += 1
                    continue
                if not isinstance(rec.get("wall_ns"), int) or not isinstance(rec.get("monotonic_ns"), int):
                    errors[path] += 1
                    continue
                rec["_file"] = path
                out.append(rec)
        finally:
            if f is not sys.stdin:
                f.close()
    return out


class Transfer:
    """One prefill request and what joined it: its decode requests, their rooms and the proxies' lines of them."""

    def __init__(self, key):
        self.key = key  # the prefill request's hash (a decode request's own, when no prefill side is in the files)
        self.records = []
        self.rooms = set()

    @property
    def start_ns(self):
        return min(r["wall_ns"] for r in self.records)

    @property
    def outcome(self):
        ev = [r["event"] for r in self.records if r.get("schema") == SCHEMA]
        if "abort" in ev:
            return "aborted"
        if "transfer_failed" in ev:
            return "failed"
        if any(r["event"] == "transfer_completed" and r.get("role") == "consumer" for r in self.records):
            return "completed"
        if "transfer_completed" in ev:
            return "sent"
        return "open"

    def ordered(self):
        """Its records in time order: by wall_ns, then monotonic_ns (the same host's clock) for equal wall times."""
        return sorted(self.records, key=lambda r: (r["wall_ns"], r["monotonic_ns"]))

    def side(self, r):
        if r.get("schema") == PROXY_SCHEMA:
            return r.get("side", "?")
        return r.get("role", "?")

    def stages(self):
        """[(stage, ns)] for each of _STAGES whose two ends are in this transfer (the first from, the last to)."""
        firsts, lasts = {}, {}
        for r in self.ordered():
            k = (self.side(r), r["event"])
            firsts.setdefault(k, r)
            lasts[k] = r
        out = []
        for name, a, b in _STAGES:
            if a in firsts and b in lasts:
                ra, rb = firsts[a], lasts[b]
                ns = (rb["monotonic_ns"] - ra["monotonic_ns"] if ra["_file"] == rb["_file"]
                      else rb["wall_ns"] - ra["wall_ns"])
                if ns >= 0:
                    out.append((name, ns))
        for r in self.records:
            if r["event"] in ("abort_to_final", "abort_to_reusable") and isinstance(r.get("elapsed_ns"), int):
                out.append((f"{r.get('role', '?')}: {r['event'].replace('_', ' ')}", r["elapsed_ns"]))
        return out


def join(records):
    """{prefill request hash: Transfer}, and the proxy lines no engine line names a room of (a list)."""
    transfers = {}
    by_room = {}

    def transfer(key):
        t = transfers.get(key)
        if t is None:
            t = transfers[key] = Transfer(key)
        return t
    proxy = []
    for r in records:
        if r.get("schema") == PROXY_SCHEMA:
            proxy.append(r)
            continue
        key = (r.get("remote_request_id_hash") if r.get("role") == "consumer" and r.get("remote_request_id_hash")
               else r.get("request_id_hash"))
        t = transfer(key)
        t.records.append(r)
        if r.get("room"):
            t.rooms.add(r["room"])
            by_room[r["room"]] = t
    unjoined = []
    for r in proxy:
        t = by_room.get(r.get("room"))
        if t is None:
            unjoined.append(r)
        else:
            t.records.append(r)
    return transfers, unjoined


def _ms(ns):
    return f"{ns / 1e6:10.3f} ms"


def _detail(r):
    keys = ("phase", "final", "status", "room", "bytes", "chunks", "chunk", "block_count", "tp_rank", "elapsed_ns",
            "instance")
    parts = []
    for k in keys:
        v = r.get(k)
        if v is None:
            continue
        parts.append(f"elapsed={_ms(v).strip()}" if k == "elapsed_ns" else f"{k}={v}")
    return " ".join(parts)


def print_timeline(t, out):
    recs = t.ordered()
    t0 = recs[0]
    print(f"transfer {t.key}: {t.outcome}, {len(recs)} events, rooms {', '.join(sorted(t.rooms)) or 'none'}",
          file=out)
    for r in recs:
        off = (r["monotonic_ns"] - t0["monotonic_ns"] if r["_file"] == t0["_file"] else r["wall_ns"] - t0["wall_ns"])
        if r.get("schema") == PROXY_SCHEMA:
            who = f"proxy {r.get('instance', '?')[:8]} {r.get('side', '?')}"
        else:
            who = f"{r.get('role', '?')} {r.get('component', '?')}"
        print(f"  {_ms(off)}  {who:<28} {r['event']:<20} {_detail(r)}", file=out)
    st = t.stages()
    if st:
        print("  where the time went:", file=out)
        for name, ns in st:
            print(f"    {_ms(ns)}  {name}", file=out)


def _pct(sorted_ns, q):
    return sorted_ns[min(len(sorted_ns) - 1, int(q * (len(sorted_ns) - 1) + 0.5))]


def print_summary(transfers, window_s, out):
    if not transfers:
        print("no transfers", file=out)
        return
    end = max(t.start_ns for t in transfers.values())
    chosen = [t for t in transfers.values() if window_s is None or t.start_ns >= end - int(window_s * 1e9)]
    per = collections.defaultdict(list)
    outcomes = collections.Counter()
    for t in chosen:
        outcomes[t.outcome] += 1
        for name, ns in t.stages():
            per[name].append(ns)
    what = "every transfer" if window_s is None else f"transfers started in the last {window_s:g} s"
    print(f"{what}: {len(chosen)} ({', '.join(f'{n} {k}' for k, n in sorted(outcomes.items()))})", file=out)
    print(f"  {'stage':<48} {'count':>6} {'p50':>13} {'p99':>13} {'max':>13}", file=out)
    rows = sorted(per.items(), key=lambda kv: -max(kv[1]))
    for name, v in rows:
        v.sort()
        print(f"  {name:<48} {len(v):>6} {_ms(_pct(v, 0.5))} {_ms(_pct(v, 0.99))} {_ms(v[-1])}", file=out)


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="kvstage-trace", description="Joins the lifecycle events of engines (kvstage.lifecycle) and proxies "
        "(kvstaged --trace-file) from several hosts' files and prints transfers, one request's timeline, or the "
        "stages' durations.")
    ap.add_argument("files", nargs="+", metavar="FILE", help="JSON lines files ('-': stdin)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--request", metavar="ID", help="the timeline of the transfer of this request id (prefill or "
                   "decode), hashed here as the engines hash it")
    g.add_argument("--request-hash", metavar="HASH", help="the same, by its request_id_hash")
    g.add_argument("--summary", action="store_true", help="each stage's count, p50, p99 and max")
    ap.add_argument("--window", type=float, metavar="S", help="with --summary: only transfers started within S "
                    "seconds of the last one")
    a = ap.parse_args(argv)
    if a.window is not None and (not a.summary or not a.window > 0):
        ap.error("--window takes a number of seconds > 0, with --summary")
    errors = collections.Counter()
    try:
        records = read_records(a.files, errors)
    except OSError as e:
        print(f"kvstage-trace: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    for path, n in errors.items():
        print(f"kvstage-trace: {path}: {n} lines that are no lifecycle record, skipped", file=sys.stderr)
    transfers, unjoined = join(records)
    out = sys.stdout
    if a.request is not None or a.request_hash is not None:
        h = a.request_hash or hash_request_id(a.request)
        t = transfers.get(h) or next((t for t in transfers.values()
                                      if any(r.get("request_id_hash") == h for r in t.records)), None)
        if t is None:
            print(f"kvstage-trace: no transfer of request {a.request or h} in the files", file=sys.stderr)
            return 1
        print_timeline(t, out)
        return 0
    if a.summary:
        print_summary(transfers, a.window, out)
        return 0
    for t in sorted(transfers.values(), key=lambda t: t.start_ns):
        recs = t.ordered()
        span = recs[-1]["wall_ns"] - recs[0]["wall_ns"]
        print(f"{t.key}  {t.outcome:<9} {len(recs):>4} events  {_ms(span)}  rooms {len(t.rooms)}", file=out)
    if unjoined:
        print(f"({len(unjoined)} proxy lines name rooms no engine line names)", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
