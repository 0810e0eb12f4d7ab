"""Lifecycle events (kvstage.lifecycle) and kvstage-trace (kvstage.timeline): vLLM's record shape, hashing and
sampling, the sinks and their bound, and one request followed across a prefill engine, two kvstaged over tcp and a
decode engine, with aborts at each phase (test_vllm_engines.py's plans)."""
import collections
import contextlib
import hashlib
import io
import json
import math
import os
import socket
import struct
import threading

import pytest

from kvstage import lifecycle as lc
from kvstage import timeline
from sglang_common import NEED_TORCH, two_proxies  # noqa: F401 (fixture)

ENGINE_FIELDS = {"schema", "event", "wall_ns", "monotonic_ns", "connector", "transfer_mode", "component", "role",
                 "request_id_hash", "request_group_id_hash", "remote_request_id_hash", "block_count", "room", "bytes",
                 "chunks", "tp_rank", "final", "status", "phase", "elapsed_ns"}


def _sink(path, **kw):
    kw.setdefault("sample_rate", 1.0)
    return lc.LifecycleSink(connector="KvstageConnector", transfer_mode="pull", component="worker", sink=str(path),
                            **kw)


def _lines(path):
    with open(path) as f:
        return [json.loads(ln) for ln in f]


def test_off_by_default(monkeypatch):
    monkeypatch.delenv("KVSTAGE_TRACE_SAMPLE_RATE", raising=False)
    monkeypatch.delenv("KVSTAGE_TRACE", raising=False)
    assert lc.create(connector="c", transfer_mode="pull", component="worker") is lc.NOOP
    assert lc.create(connector="c", transfer_mode="pull", component="worker", sample_rate=0, sink="/x") is lc.NOOP
    lc.NOOP.emit(lc.TRANSFER_STARTED, "private", role="consumer")  # nothing, no state
    import vllm_engine as E
    from kvstage.vllm.config import _Settings
    s = _Settings(E.vllm_config("/nonexistent", 1), E.kv_cache_config(8))
    assert s.lifecycle_sink("worker") is lc.NOOP and s.lifecycle_sink("scheduler") is lc.NOOP


def test_record_is_vllms_shape_and_privacy_safe(tmp_path):
    rid, remote = "request-private-aaaaaaaa", "request-private-bbbbbbbb"
    sink = _sink(tmp_path / "t.jsonl")
    sink.emit(lc.TRANSFER_STARTED, rid, role="consumer", remote_request_id=remote, block_count=7, room="ab.1.2")
    assert sink.flush(10)
    sink.close()
    text = (tmp_path / "t.jsonl").read_text()
    assert rid not in text and remote not in text and "request-private" not in text
    (rec,) = _lines(tmp_path / "t.jsonl")
    assert set(rec) <= ENGINE_FIELDS
    assert rec["schema"] == "vllm-kv-connector-v1" and rec["event"] == "transfer_started"
    assert (rec["connector"], rec["transfer_mode"], rec["component"], rec["role"]) == (
        "KvstageConnector", "pull", "worker", "consumer")
    assert rec["block_count"] == 7 and rec["room"] == "ab.1.2"
    assert isinstance(rec["wall_ns"], int) and isinstance(rec["monotonic_ns"], int)

    def vllm_hash(s):  # vLLM's: BLAKE2b, 8 bytes, person "vllm-kv-trace" (lifecycle.py in vLLM #52859)
        return hashlib.blake2b(s.encode(), digest_size=8, person=b"vllm-kv-trace").hexdigest()
    assert rec["request_id_hash"] == vllm_hash(rid) and rec["remote_request_id_hash"] == vllm_hash(remote)
    assert rec["request_group_id_hash"] == vllm_hash("request-private")  # without vLLM's random suffix


def test_related_ids_share_sampling_and_group_hash(tmp_path):
    sink = _sink(tmp_path / "t.jsonl", sample_rate=0.5)
    for g in range(200):
        for suffix in ("aaaaaaaa", "0123abcd"):
            sink.emit(lc.TRANSFER_STAGED, f"cmpl-{g}-{suffix}", role="producer")
    assert sink.flush(10)
    sink.close()
    groups = {}
    for rec in _lines(tmp_path / "t.jsonl"):
        groups.setdefault(rec["request_group_id_hash"], set()).add(rec["request_id_hash"])
    assert all(len(ids) == 2 for ids in groups.values())  # both of a group, or neither
    assert 60 < len(groups) < 140, len(groups)  # about half the groups


@pytest.mark.parametrize("rate", [-0.1, 1.1, float("nan"), "lots"])
def test_bad_sample_rate_refused(tmp_path, rate):
    with pytest.raises(ValueError, match="must be (between 0.0 and 1.0|a number)"):
        _sink(tmp_path / "t.jsonl", sample_rate=rate)
    import vllm_engine as E
    from kvstage.vllm.config import _Settings
    with pytest.raises(ValueError, match=lc.SAMPLE_RATE_KEY):
        _Settings(E.vllm_config("/nonexistent", 1, extra={lc.SAMPLE_RATE_KEY: rate}), E.kv_cache_config(8))


def test_bad_sinks_refused(tmp_path):
    with pytest.raises(ValueError, match="lifecycle trace file .*/nodir/t.jsonl"):
        _sink(tmp_path / "nodir" / "t.jsonl")
    with pytest.raises(ValueError, match="lifecycle trace sink unix:"):
        _sink(f"unix:{tmp_path}/nobody")
    with pytest.raises(ValueError, match="at least 1 record"):
        _sink(tmp_path / "t.jsonl", capacity=0)
    with pytest.raises(ValueError, match="a number of records"):
        lc.create(connector="c", transfer_mode="pull", component="worker", sample_rate=1, sink=str(tmp_path / "t"),
                  capacity="many")


class _GatedSink(lc.LifecycleSink):
    """A sink whose writer, on its first batch, says so and then waits for the test's gate."""

    def __init__(self, *a, **kw):
        self.entered, self.gate = threading.Event(), threading.Event()
        super().__init__(*a, **kw)

    def _write(self, lines):
        if not self.entered.is_set():
            self.entered.set()
            self.gate.wait()
        return super()._write(lines)


def test_full_sink_drops_and_counts_never_blocks(tmp_path):
    cap = 16
    sink = _GatedSink(connector="c", transfer_mode="pull", component="worker", sample_rate=1.0,
                      sink=str(tmp_path / "t.jsonl"), capacity=cap)
    sink.emit(lc.ROOM_OPEN, "r-first", role="consumer")
    assert sink.entered.wait(10)  # the writer holds that one, blocked in its write
    for i in range(cap + 5):  # every call returns: cap of them queued, 5 dropped
        sink.emit(lc.ROOM_OPEN, f"r{i}", role="consumer")
    assert (sink.dropped, sink.written) == (5, 0)
    sink.gate.set()
    assert sink.flush(10)
    sink.close()
    assert (sink.dropped, sink.written) == (5, cap + 1)
    assert len(_lines(tmp_path / "t.jsonl")) == cap + 1


def test_unix_socket_and_log_sinks(tmp_path, caplog):
    path = str(tmp_path / "s")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(path)
    try:
        sink = _sink(f"unix:{path}")
        for i in range(3):
            sink.emit(lc.ROOM_FINAL, f"r{i}", role="producer", final="send_done", status=0)
        assert sink.flush(10)
        sink.close()
        srv.settimeout(10)
        got = [json.loads(srv.recv(65536)) for _ in range(3)]
        assert [g["final"] for g in got] == ["send_done"] * 3 and sink.written == 3
    finally:
        srv.close()
    caplog.set_level("INFO", logger="kvstage.lifecycle")
    sink = lc.create(connector="c", transfer_mode="push", component="worker", sample_rate=1.0, sink="log")
    sink.emit(lc.ABORT, "r", role="consumer", phase="transferring")
    assert sink.flush(10)
    sink.close()
    (msg,) = [r.getMessage() for r in caplog.records if r.name == "kvstage.lifecycle"]
    assert msg.startswith(lc.LOG_PREFIX) and json.loads(msg[len(lc.LOG_PREFIX):])["phase"] == "transferring"


def test_room_key_is_the_descriptors_room_not_its_token(client):
    room, desc = client.recv_open(4096)
    try:
        _, _, _, instance, idx, gen = struct.unpack_from("<IHHQII", desc)
        key = lc.room_key(desc)
        assert key == f"{instance:016x}.{idx}.{gen}"
        assert desc[24:40].hex() not in key
    finally:
        room.abort()
        room.close()
    assert lc.room_key(b"\0" * 128) is None and lc.room_key(b"short") is None and lc.room_key(None) is None


# ------------------------------------------------------------------ one request, both engines, two proxies over tcp
# plan -> side -> chains: each chain's events in this order among that side's events (several chains: no order
# between them; a prefill side under pool pressure may open the decode side's room before its slots are leased)
_NORMAL = {"producer": [["slots_leased", "copy_in_done", "transfer_completed"],
                        ["room_open", "transfer_started", "room_final", "transfer_completed"]],
           "consumer": [["blocks_matched", "transfer_staged", "room_open", "transfer_started", "room_final",
                         "copy_out_done", "transfer_completed"]]}
EXPECT = {
    None: _NORMAL, "prefix": _NORMAL, "d-after": _NORMAL,
    # the decode engine aborts with the first chunk in the room; the prefill side then lets the rest go, which
    # over tcp may land before the decode worker hears of the abort: then the room completes (below)
    "d-mid": {"producer": [["room_open", "room_final"]], "consumer": [["room_open", "transfer_started", "abort"]]},
    # released by the decode side: its copy into slots may have ended (its blocks freed already), or not begun
    "d-abort-waiting": {"producer": [["abort", "abort_to_final"]]},
    "d-timeout": {"producer": [["room_open", "room_final", "abort"]],
                  "consumer": [["room_open", "transfer_started", "transfer_failed", "room_final"]]},
    "p-abort-prefill": {"producer": [["abort"]]},
    "p-abort-staging": {"producer": [["slots_leased", "abort", "abort_to_final"], ["abort", "abort_to_reusable"]]},
    "never-decoded": {"producer": [["copy_in_done", "transfer_failed"]]},
    "late-pull": {"producer": [["copy_in_done", "transfer_failed"]],
                  "consumer": [["room_open", "transfer_started", "room_final", "transfer_failed"]]},
}
NEVER = {None: {"abort", "transfer_failed"}, "prefix": {"abort", "transfer_failed"},
         "p-abort-staging": {"copy_in_done", "room_open"},
         "d-timeout": {"transfer_completed"}, "never-decoded": {"room_open"}, "d-abort-waiting": {"room_open"}}
# each proxy's lines of a room that completed (kvstaged --trace-file; design note 45)
PROXY_SEND = ["room_opened", "chunk_queued", "chunk_sent", "room_final", "room_reaped"]
PROXY_RECV = ["room_opened", "chunk_landed", "room_final", "room_reaped"]
ONCE = ("abort_to_final", "abort_to_reusable", "transfer_completed", "transfer_failed", "copy_in_done")


def _in_order(events, want):
    """True when want is a subsequence of events."""
    it = iter(events)
    return all(any(e == w for e in it) for w in want)


@NEED_TORCH
def test_vllm_requests_followed_across_two_proxies(tmp_path):
    """test_vllm_engines.py's 40 requests and plans (aborts from either side at every phase, a load timeout, stage
    expiry), the prefill engine on proxy A and the decode engine on proxy B (tcp, the default --peer-timeout),
    lifecycle events on at rate 1 into a file per process, and each proxy's --trace-file: every request's events
    are there, in order, on both sides; the decode side's room is the one the prefill side sent into, and the
    one both proxies' lines name; ids only hashed; kvstage-trace joins them all and prints a timeline and the
    stages' summary."""
    import test_vllm_engines as T
    from sglang_common import proxy_pair
    pattern = str(tmp_path / "trace-{pid}.jsonl")
    pfiles = [str(tmp_path / "proxy-a.jsonl"), str(tmp_path / "proxy-b.jsonl")]
    with proxy_pair(["--trace-file", pfiles[0]], ["--trace-file", pfiles[1]]) as (pa, pb):
        run = T.drive(pa.socket, pb.socket, extra={lc.SAMPLE_RATE_KEY: 1.0, "kvstage_trace": pattern})
        T.check(run)
    # the proxies stopped: their writers wrote every line
    files = sorted(str(tmp_path / f) for f in os.listdir(tmp_path) if f.startswith("trace-"))
    assert len(files) == 2, files  # one per engine process (scheduler and worker append to the same file)
    raw = "".join(open(f).read() for f in files + pfiles)
    errors = collections.Counter()
    recs = timeline.read_records(files + pfiles, errors)
    assert not errors, errors
    for r in recs:
        if r["schema"] == timeline.PROXY_SCHEMA:
            continue
        assert set(r) - {"_file"} <= ENGINE_FIELDS, r
        for k in ("request_id_hash", "request_group_id_hash", "remote_request_id_hash"):
            assert k not in r or (len(r[k]) == 16 and int(r[k], 16) >= 0), r
    for k in range(T.N):
        assert f'"p{k}"' not in raw and f'"d{k}"' not in raw
    transfers, unjoined = timeline.join(recs)
    h = lc.hash_request_id
    problems = []
    for k, plan in run["plans"].items():
        t = transfers.get(h(f"p{k}"))
        if t is None:
            problems.append(f"request {k} ({plan}): no events")
            continue
        by_side = {"producer": [], "consumer": [], "send": [], "recv": []}
        for r in sorted(t.records, key=lambda r: r["monotonic_ns"]):  # one host: one clock
            by_side[t.side(r)].append(r)
        if plan in (None, "prefix", "d-after"):  # each proxy's side of the room, by its key
            for side, want, f in (("send", PROXY_SEND, pfiles[0]), ("recv", PROXY_RECV, pfiles[1])):
                got = [r["event"] for r in by_side[side]]
                if not _in_order(got, want) or {r["_file"] for r in by_side[side]} != {f}:
                    problems.append(f"request {k} ({plan}) proxy {side}: {got}, wanted in order {want}")
        for side, chains in EXPECT[plan].items():
            got = [r["event"] for r in by_side[side]]
            for want in chains:
                if not _in_order(got, want):
                    problems.append(f"request {k} ({plan}) {side}: {got}, wanted in order {want}")
            twice = [e for e in ONCE if got.count(e) > 1]
            if twice:
                problems.append(f"request {k} ({plan}) {side}: {twice} more than once in {got}")
        for side in ("producer", "consumer"):
            bad = NEVER.get(plan, set()) & {r["event"] for r in by_side[side]}
            if bad:
                problems.append(f"request {k} ({plan}) {side}: unexpected {sorted(bad)}")
        if plan in (None, "prefix", "d-after"):
            pr = {r["room"] for r in by_side["producer"] if r["event"] == "room_open"}
            dr = [r for r in by_side["consumer"] if r["event"] == "room_open"]
            if len(pr) != 1 or {r["room"] for r in dr} != pr:
                problems.append(f"request {k} ({plan}): prefill rooms {pr}, decode rooms {[r['room'] for r in dr]}")
            elif dr[0]["monotonic_ns"] > next(r for r in by_side["producer"] if r["event"] == "room_open")[
                    "monotonic_ns"]:
                problems.append(f"request {k}: the prefill side sent into the room before the decode side opened it")
            finals = {(r["role"], r["final"]) for r in t.records if r["event"] == "room_final" and "role" in r}
            if finals != {("producer", "send_done"), ("consumer", "recv_done")}:
                problems.append(f"request {k} ({plan}): finals {finals}")
        if plan == "d-mid":
            phases = [(r["component"], r["phase"]) for r in by_side["consumer"] if r["event"] == "abort"]
            got = [r["event"] for r in by_side["consumer"]]
            if "transfer_completed" in got:  # the worker heard of the abort after the load
                want, pwant = ["room_final", "copy_out_done", "transfer_completed"], ["room_final",
                                                                                      "transfer_completed"]
                wphases = [("scheduler", "loading")]
            else:
                want = ["abort", "room_final", "abort_to_final", "abort_to_reusable"]
                # the prefill side's room may have had SEND_DONE (every byte at proxy B) before the decode's abort
                pwant = ["room_final"]
                wphases = [("scheduler", "loading"), ("worker", "open")]
            pgot = [r["event"] for r in by_side["producer"]]
            if sorted(phases) != wphases or not _in_order(got, want) or not _in_order(pgot, pwant):
                problems.append(f"request {k} (d-mid): abort phases {phases}, decode {got}, prefill {pgot}")
    assert not problems, "\n".join(problems)

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert timeline.main(["--request", "d0", *files, *pfiles]) == 0
    text = out.getvalue()
    assert text.startswith(f"transfer {h('p0')}: completed") and "where the time went" in text, text
    assert "decode: copy out of slots" in text and "end to end" in text, text
    assert "chunk_landed" in text and "proxies: first chunk queued until last landed" in text, text
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert timeline.main(["--summary", *files, *pfiles]) == 0
    text = out.getvalue()
    assert f"every transfer: {T.N} (" in text and "consumer: abort to reusable" in text, text
    assert math.isfinite(float(text.split("end to end")[1].split()[1])), text


@NEED_TORCH
def test_sglang_requests_followed_across_two_proxies(two_proxies, tmp_path, monkeypatch):
    """SGLang's backend, prefill on proxy A and decode on proxy B (tcp), events on ($KVSTAGE_TRACE_SAMPLE_RATE 1,
    $KVSTAGE_TRACE): three requests whole, one the decode side aborts with chunks on the wire, one the prefill side
    aborts before its last chunk; both sides' events of each, keyed by bootstrap_room, in order."""
    import sglang_engine as E
    from kvstage import sglang as ks
    from kvstage.sglang import KVPoll
    from sglang_common import adopted, start
    pa, pb = two_proxies
    path = tmp_path / "sglang.jsonl"
    monkeypatch.setenv("KVSTAGE_TRACE_SAMPLE_RATE", "1")
    monkeypatch.setenv("KVSTAGE_TRACE", str(path))
    pc, dc = E.KVCache(64), E.KVCache(64)
    server = ks.bootstrap_server_on_a_free_port()
    addr = f"127.0.0.1:{server.port}"
    P = D = None
    try:
        P = ks.KvstageKVManager(pc.kv_args(), ks.DisaggregationMode.PREFILL, E.server_args(pa.socket, server.port))
        D = ks.KvstageKVManager(dc.kv_args(), ks.DisaggregationMode.DECODE, E.server_args(pb.socket, 0))
        assert D.try_ensure_parallel_info(addr)
        eng = (pc, dc, P, D, addr)
        whole = [start(eng, 500 + k, pp, dp, k, chunks=(10,))
                 for k, (pp, dp) in enumerate([([1, 2, 3], [7, 8, 9]), (list(range(10, 40)), list(range(30, 60)))])]
        aborted = {}
        for room, side in ((600, "decode"), (601, "prefill")):
            s = ks.KvstageKVSender(P, addr, room, [0], 0)
            r = ks.KvstageKVReceiver(D, addr, room)
            r.init(0)
            r.send_metadata(list(range(0, 30)), 9, [[9]])
            adopted(s)
            pc.fill(room, list(range(30, 60)), 9)
            s.init(30, 9)
            s.send(list(range(30, 50)))
            (r if side == "decode" else s).abort()
            aborted[room] = (s, r)
        for s, r in whole:
            assert D.wait_until(lambda: r.poll() == KVPoll.Success, 20), r
            assert P.wait_until(lambda: s.poll() == KVPoll.Success, 20), s
            r.clear()
            s.clear()
        for s, r in aborted.values():
            assert D.wait_until(lambda: r.poll() == KVPoll.Failed, 20), r
            r.clear()
            assert r.pages_released
            assert P.wait_until(lambda: s.poll() == KVPoll.Failed, 20), s
            # the prefill side's clear() does not wait for the room's final; this test does, to see it
            assert P.wait_until(lambda: all(sh.final is not None for sh in s._shares), 20), s
            s.clear()
    finally:
        for m in (P, D):
            if m is not None:
                m.close()  # its sink writes what is queued
        server.close()
    errors = collections.Counter()
    transfers, _ = timeline.join(timeline.read_records([str(path)], errors))
    assert not errors
    want = {
        500: {"producer": [["room_open", "transfer_started", "room_final", "transfer_completed"]],
              "consumer": [["room_open", "transfer_started", "room_final", "copy_out_done", "transfer_completed"]]},
        # the decode side's abort message may reach the prefill rank before its room's final does
        600: {"producer": [["room_open", "transfer_started", "transfer_failed"], ["room_open", "room_final"]],
              "consumer": [["room_open", "transfer_started", "abort", "room_final", "abort_to_final",
                            "abort_to_reusable"]]},
        601: {"producer": [["room_open", "transfer_started", "abort", "room_final", "abort_to_final"]],
              "consumer": [["room_open", "transfer_started", "room_final", "transfer_failed"]]},
    }
    want[501] = want[500]
    problems = []
    for room, sides in want.items():
        t = transfers.get(lc.hash_request_id(str(room)))
        assert t is not None, (room, sorted(transfers))
        for side, chains in sides.items():
            got = [r["event"] for r in sorted(t.records, key=lambda r: r["monotonic_ns"]) if r["role"] == side]
            problems += [f"room {room} {side}: {got}, wanted in order {w}" for w in chains if not _in_order(got, w)]
        keys = {r["room"] for r in t.records if r["event"] == "room_open"}
        if len(keys) != 1:
            problems.append(f"room {room}: room keys {keys}")
        if room in (500, 501):
            finals = {(r["role"], r["final"]) for r in t.records if r["event"] == "room_final" and "role" in r}
            if finals != {("producer", "send_done"), ("consumer", "recv_done")}:
                problems.append(f"room {room}: finals {finals}")
    assert not problems, "\n".join(problems)
