"""Test helpers for the SGLang backend: KV caches as torch CPU tensors, and prefill/decode loops that drive
kvstage.sglang the way SGLang's scheduler does (PrefillBootstrapQueue / inflight queue on one side,
DecodePreallocQueue / DecodeTransferQueue on the other). Importable by spawned children (no pytest here)."""
import random
import time
import traceback

import torch

from kvstage import sglang as ks
from kvstage.sglang import KVPoll
from pd_sim import Alloc, Cache, server_args  # noqa: F401 (server_args: the tests' too)

STATE = {KVPoll.Failed: "Failed", KVPoll.Bootstrapping: "Bootstrapping", KVPoll.WaitingForInput: "WaitingForInput",
         KVPoll.Transferring: "Transferring", KVPoll.Success: "Success"}


def KVCache(pool_pages, head_dim=12):
    """A test engine's memory (pd_sim.Cache): pool_pages pages of 4 tokens, 3 layers, 2 heads; 64 aux rows in 4
    buffers and 64 rows of one state component of 2 tensors, of sizes no other buffer has (a 20-byte row)."""
    return Cache(pool_pages, rows=64, head_dim=head_dim,
                 aux=[((16,), torch.int32), ((16,), torch.int32), ((24,), torch.float16), ((8,), torch.int64)],
                 state=[[((3, 8), torch.float32), ((20,), torch.uint8)]])


def make_requests(n, seed, plans):
    """Returns n request specs (dicts): bootstrap room, page count, page layout, chunking, plan."""
    rng = random.Random(seed)
    reqs = []
    for k in range(n):
        npages = rng.choice([1, 2, 3, 7, 12, 20, 33])
        cuts = sorted(rng.sample(range(1, npages), min(rng.choice([0, 1, 2, 3]), npages - 1))) if npages > 1 else []
        chunks = [b - a for a, b in zip([0] + cuts, cuts + [npages])]
        plan = plans[k] if k < len(plans) else None
        if plan in (("decode", "mid"), ("prefill", "Transferring"), ("timeout", "stall")):
            npages, chunks = 33, [24, 9]  # the first chunk fills whole slots: some are in flight when it stops
        reqs.append(dict(k=k, room=rng.getrandbits(62) | 1, npages=npages, chunks=chunks,
                         contiguous=rng.random() < 0.4, plan=plan))
    return reqs


# --------------------------------------------------------------------------------------------
# Prefill: PrefillBootstrapQueue -> forward -> send_kv_chunk -> inflight queue.
# --------------------------------------------------------------------------------------------

def run_prefill(mgr, cache, reqs, flags, acks, bootstrap_addr, deadline_s=40):
    """Drives one sender per request until every request ended; returns {k: result dict}."""
    rng = random.Random(7)
    pages, rows = Alloc(cache.pages, rng), Alloc(cache.rows, rng)
    live, out = {}, {}
    for r in reqs:
        if r["plan"] == ("timeout", "decode-waiting"):
            out[r["k"]] = dict(outcome="absent", states=[])
            continue  # this request never reaches the prefill server
        s = ks.KvstageKVSender(mgr, bootstrap_addr, r["room"], [0], 0)
        if r["plan"] in (("timeout", "prefill-bootstrap"), ("decode", "Bootstrapping")):
            s.bootstrap_timeout = 1.0
        st = dict(req=r, s=s, states=[], phase="bootstrap", pages=None, next_chunk=0, sent=0)
        live[r["k"]] = st
        if r["plan"] == ("prefill", "Bootstrapping"):
            st["states"].append("Bootstrapping")
            s.abort()
    deadline = time.monotonic() + deadline_s
    while live:
        if time.monotonic() > deadline:
            raise AssertionError(f"prefill: requests never ended: {[(k, v['s']) for k, v in live.items()]}")
        for k, st in list(live.items()):
            r, s = st["req"], st["s"]
            p = s.poll()
            if not st["states"] or st["states"][-1] != STATE[p]:
                st["states"].append(STATE[p])
            if p == KVPoll.WaitingForInput and st["phase"] == "bootstrap":
                if r["plan"] == ("prefill", "WaitingForInput"):
                    s.abort()
                    continue
                got = pages.alloc(r["npages"], r["contiguous"])
                row = rows.alloc(1)
                if got is None or row is None:
                    continue  # engine memory full: try again later
                st["pages"], st["row"] = got, row[0]
                cache.fill(r["room"], got, st["row"])
                s.init(r["npages"] - s.pop_decode_prefix_len() // cache.page_size, st["row"])
                st["phase"] = "send"
            elif st["phase"] == "send" and p in (KVPoll.WaitingForInput, KVPoll.Transferring):
                if r["plan"] == ("timeout", "stall") and st["next_chunk"] == 1:
                    continue  # the forward hangs after one chunk
                if r["plan"] == ("decode", "mid") and st["next_chunk"] == 1 and not acks[k]:
                    continue  # hold the rest until the decode side has aborted
                i = st["next_chunk"]
                n = r["chunks"][i]
                last = i == len(r["chunks"]) - 1
                chunk = st["pages"][st["sent"]:st["sent"] + n]
                if s.should_send_kv_chunk(len(chunk), last):
                    s.send(chunk, [[st["row"]]] if last else None)
                st["sent"] += n
                st["next_chunk"] += 1
                if i == 0:
                    flags[k] = 1
                if last:
                    st["phase"] = "inflight"
                if i == 0 and r["plan"] == ("prefill", "Transferring") and not last:
                    s.abort()
            elif p == KVPoll.Success:
                if r["plan"] == ("prefill", "Success") and "aborted" not in st:
                    st["aborted"] = True
                    s.abort()
                    continue
                out[k] = dict(outcome="Success", states=st["states"],
                              metric=s.get_transfer_metric().transfer_total_bytes)
            elif p == KVPoll.Failed:
                try:
                    s.failure_exception()
                except ks.KVTransferError as e:
                    reason = e.failure_reason
                out[k] = dict(outcome="Success+aborted" if "aborted" in st else "Failed", reason=reason,
                              states=st["states"])
            if k in out:
                s.clear()
                if st["pages"] is not None:
                    pages.give_back(st["pages"])
                    rows.give_back([st["row"]])
                del live[k]
    return out


# --------------------------------------------------------------------------------------------
# Decode: DecodePreallocQueue (handshake, prealloc, send_metadata) -> DecodeTransferQueue.
# --------------------------------------------------------------------------------------------

def run_decode(mgr, cache, reqs, flags, acks, bootstrap_addr, concurrency=16, deadline_s=40):
    """Drives one receiver per request (at most `concurrency` at once); returns ({k: result}, marker problems)."""
    rng = random.Random(11)
    pages, rows = Alloc(cache.pages, rng), Alloc(cache.rows, rng)
    waiting = [r for r in reqs if r["plan"] != ("timeout", "prefill-bootstrap")]
    out = {r["k"]: dict(outcome="absent", states=[]) for r in reqs if r["plan"] == ("timeout", "prefill-bootstrap")}
    live, quarantine = {}, []
    deadline = time.monotonic() + deadline_s
    while not mgr.try_ensure_parallel_info(bootstrap_addr):
        if time.monotonic() > deadline:
            raise AssertionError("decode: the bootstrap server never answered")
    while live or waiting:
        if time.monotonic() > deadline:
            raise AssertionError(f"decode: requests never ended: {[(k, v['rv']) for k, v in live.items()]}")
        while waiting and len(live) < concurrency:
            r = waiting.pop(0)
            rv = ks.KvstageKVReceiver(mgr, bootstrap_addr, r["room"])
            st = live[r["k"]] = dict(req=r, rv=rv, states=[], pages=None)
            if r["plan"] in (("timeout", "decode-waiting"), ("timeout", "stall")):
                rv.waiting_timeout = 1.0
            if r["plan"] == ("decode", "Bootstrapping"):
                st["states"].append("Bootstrapping")
                rv.abort()
            else:
                rv.init(0)
        for k, st in list(live.items()):
            r, rv = st["req"], st["rv"]
            p = rv.poll()
            if not st["states"] or st["states"][-1] != STATE[p]:
                st["states"].append(STATE[p])
            if p == KVPoll.WaitingForInput and st["pages"] is None:
                if r["plan"] == ("decode", "WaitingForInput"):
                    rv.abort()
                    continue
                got = pages.alloc(r["npages"])
                row = rows.alloc(1)
                if got is None or row is None:
                    if got:
                        pages.give_back(got)
                    continue
                st["pages"], st["row"] = got, row[0]
                rv.send_metadata(got, st["row"], [[st["row"]]])
                if r["plan"] == ("decode", "Transferring"):
                    assert rv.poll() in (KVPoll.Transferring, KVPoll.Success)
                    st["states"].append("Transferring")
                    rv.abort()
            elif p == KVPoll.Transferring and r["plan"] == ("decode", "mid") and flags[k] and not acks[k]:
                rv.abort()  # the first chunk is in the room, the rest is held back by the prefill side
                acks[k] = 1
            elif p == KVPoll.Success:
                if "verified" not in st:
                    st["verified"] = cache.check(r["room"], st["pages"], st["row"])
                if r["plan"] == ("decode", "Success") and "aborted" not in st:
                    st["aborted"] = True
                    rv.abort()
                    continue
                out[k] = dict(outcome="Success", states=st["states"], wrong=st["verified"])
            elif p == KVPoll.Failed:
                try:
                    rv.failure_exception()
                except ks.KVTransferError as e:
                    reason = e.failure_reason
                out[k] = dict(outcome="Success+aborted" if "aborted" in st else "Failed", reason=reason,
                              states=st["states"], wrong=st.get("verified"))
            if k in out:
                rv.clear()
                if st["pages"] is not None:
                    if out[k]["outcome"] == "Success":
                        pages.give_back(st["pages"])
                        rows.give_back([st["row"]])
                    else:
                        # the abort rule: once clear() returned, nothing writes these pages; mark them and keep them
                        assert rv.pages_released, rv
                        cache.mark(st["pages"], st["row"], k)
                        quarantine.append((k, st["pages"], st["row"]))
                del live[k]
    # every other request is done: the marked pages of aborted ones must be untouched
    bad = [k for k, pg, row in quarantine if cache.marked(pg, row, k) is not None]
    return out, bad, len(quarantine)


def _serve(role, conn, socket_path, reqs, flags, acks, cache_pages, extra):
    """Child process body: makes the engine's manager (the prefill also its bootstrap server), runs its loop."""
    mgr = server = None
    try:
        cache = KVCache(cache_pages)
        if role == "prefill":
            server = ks.bootstrap_server_on_a_free_port()
            addr = f"127.0.0.1:{server.port}"
            mgr = ks.KvstageKVManager(cache.kv_args(), ks.DisaggregationMode.PREFILL,
                                      server_args(socket_path, server.port))
            conn.send(("ready", addr))
            result = run_prefill(mgr, cache, reqs, flags, acks, addr)
        else:
            addr = extra["bootstrap_addr"]
            mgr = ks.KvstageKVManager(cache.kv_args(), ks.DisaggregationMode.DECODE, server_args(socket_path, 0))
            conn.send(("ready", addr))
            result = run_decode(mgr, cache, reqs, flags, acks, addr)
        mgr.close()
        mgr = None
        conn.send(("result", result))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        if mgr is not None:
            mgr.close()
        if server is not None:
            server.close()
        conn.close()


def prefill_main(conn, socket_path, reqs, flags, acks, cache_pages):
    _serve("prefill", conn, socket_path, reqs, flags, acks, cache_pages, {})


def decode_main(conn, socket_path, reqs, flags, acks, cache_pages, bootstrap_addr):
    _serve("decode", conn, socket_path, reqs, flags, acks, cache_pages, {"bootstrap_addr": bootstrap_addr})


class PrefillFrontend:
    """The prefill server's HTTP API as far as a PD retract rebootstrap uses it (SGLang's decode leader POSTs the
    retracted request to http://<bootstrap host>:<prefill port>/generate): each POST /generate body goes to
    .requests (a queue.Queue: the test's barrier), answered with .status (200). .port, close()."""

    def __init__(self, status=200):
        import json
        import queue
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        self.requests, self.status = queue.Queue(), status
        fe = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fe.requests.put((self.path, json.loads(body)))
                out = json.dumps({"text": ""}).encode()
                self.send_response(fe.status)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self._httpd.shutdown()
        self._httpd.server_close()


def rebootstrap_payload(rid, room, input_ids):
    """What Req.build_rebootstrap_payload gives SGLang's decode scheduler (the fields a prefill /generate needs)."""
    return {"rid": rid, "input_ids": list(input_ids), "sampling_params": {"max_new_tokens": 0},
            "bootstrap_host": "127.0.0.1", "bootstrap_room": room, "stream": False}
