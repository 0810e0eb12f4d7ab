#!/usr/bin/env python3
"""kvstage PD demo: SGLang-shaped prefill and decode workers moving KV caches through one kvstaged.

    python3 python/examples/pd_demo.py                          # 2 prefill workers, 1 decode worker
    python3 python/examples/pd_demo.py --prefill 1 --decode 2   # the reverse

Every worker is a process that drives kvstage.sglang as SGLang's schedulers drive their transfer backend:
a KvstageKVManager per engine, a KvstageKVBootstrapServer per prefill server, a KvstageKVSender
(PrefillBootstrapQueue -> chunked forward -> send per chunk -> inflight queue) or KvstageKVReceiver
(DecodePreallocQueue: init, preallocate, send_metadata -> DecodeTransferQueue) per request, and a poll loop
over all of its requests at once. The KV caches are torch CPU tensors (K and V per layer, paged), with
aux rows (SGLang's MetadataBuffers) and one mamba-like state row per request.

This process is the router: it starts a kvstaged (unless --socket), the workers, and sends each request
to one prefill and one decode worker (the request names its prefill server's bootstrap address, as
SGLang's bootstrap_host/port/room do), keeping --concurrency requests in flight. A fraction of them is
aborted mid-way, by the prefill or by the decode side, at a random KVPoll state.

Checked: every completed request's decode pages, aux and state rows hold exactly the bytes its prefill
pages held (each page's words are stamped with the request's bootstrap room, the buffer and the page, so a
page from another request or another position is named); every aborted request with decode pages had
them released by clear(), and they are still untouched (marked, kept out of use) after every other
request ended; the pool ends free. Exit status: 0 all checked out, 1 otherwise, 2 bad command line.
"""
import argparse
import collections
import importlib.util
import json
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import random
import secrets
import select
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

PYDIR = Path(__file__).resolve().parent.parent  # python/: the kvstage package
ROOT = PYDIR.parent                             # the repository
if str(PYDIR) not in sys.path:
    sys.path.insert(0, str(PYDIR))
# kvstage.sglang builds on SGLang's base classes: the real ones when SGLang is importable, else the copies of
# their interface the tests use (python/tests/sglang_stubs); the demo says which in its report.
SGLANG_STUBS = PYDIR / "tests" / "sglang_stubs"
REAL_SGLANG = importlib.util.find_spec("sglang") is not None
if not REAL_SGLANG and str(SGLANG_STUBS) not in sys.path:
    sys.path.append(str(SGLANG_STUBS))

HERE = str(Path(__file__).resolve().parent)  # pd_sim.py: the engines' memory and allocator, shared with the tests
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from pd_sim import TAG_KV, Alloc, Cache, server_args, stamp  # noqa: E402

CORRUPT_ENV = "KVSTAGE_PD_DEMO_CORRUPT"  # test only: see --help
STATES = ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success")  # KVPoll's values 0..4
PREFILL_PLANS = ("Bootstrapping", "WaitingForInput", "Transferring")
DECODE_PLANS = ("Bootstrapping", "WaitingForInput", "Transferring", "mid")  # mid: after the prefill's first chunk


# ------------------------------------------------------------------------------------------------ command line
def parser():
    p = argparse.ArgumentParser(
        prog="pd_demo.py",
        description="""\
SGLang-shaped prefill and decode worker processes move KV caches through kvstaged (kvstage.sglang,
driven as SGLang's schedulers drive it); a fraction of the requests is aborted mid-way from either side.
Reports how many requests completed with every byte verified, how many were aborted by each side, how
many failed, the wall time and GB/s. Progress goes to stderr.""",
        epilog=f"""\
Exit status: 0 every completed request got exactly its own bytes, every aborted one's decode pages were
released by clear() and not written after it, the pool ended free; 1 otherwise (or a worker failed); 2 bad
command line. Needs torch and numpy (Debian: python3-torch python3-numpy) and a built tree (ninja -C build)
or an installed libkvstage.

Test only: {CORRUPT_ENV}=page:K[,late:K2] makes the decode worker overwrite page 0 of request K's KV
buffer 0 with another request's page after its transfer completed (page:K), or write into aborted request
K2's decode pages after clear() (late:K2); the report must then name those requests and the exit status
be 1. page:K acts only if request K completes, late:K2 only if K2 is aborted after its decode pages were
allocated.""",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("workers and requests")
    w.add_argument("--prefill", type=int, default=2, metavar="N", help="prefill worker processes (default 2)")
    w.add_argument("--decode", type=int, default=1, metavar="M", help="decode worker processes (default 1)")
    w.add_argument("--requests", type=int, default=200, metavar="R", help="requests to send (default 200)")
    w.add_argument("--abort-fraction", type=float, default=0.2, metavar="F",
                   help="fraction of the requests aborted mid-way, half by the prefill side, half by the decode "
                        "side, each at a random KVPoll state (default 0.2)")
    w.add_argument("--concurrency", type=int, default=16, metavar="C", help="requests in flight at once (default 16)")
    w.add_argument("--seed", type=int, default=1, help="seeds the requests, their workers and the aborts (default 1)")
    c = p.add_argument_group("KV cache (every worker's; torch CPU tensors)")
    c.add_argument("--layers", type=int, default=4, help="layers, each a K and a V buffer (default 4)")
    c.add_argument("--heads", type=int, default=8, help="KV heads (default 8)")
    c.add_argument("--head-dim", type=int, default=80, help="head dimension, fp16 (default 80)")
    c.add_argument("--page-size", type=int, default=16, metavar="TOKENS", help="tokens a page (default 16)")
    c.add_argument("--max-pages", type=int, default=48, metavar="P",
                   help="a request has 1 to P pages, uniformly (default 48)")
    c.add_argument("--chunk-pages", type=int, default=16, metavar="P",
                   help="chunked prefill: pages a send() (default 16)")
    k = p.add_argument_group("kvstaged")
    k.add_argument("--socket", metavar="PATH",
                   help="use the kvstaged already serving PATH (its pool must then end as it was) instead of "
                        "starting one")
    k.add_argument("--kvstaged", metavar="PATH",
                   help="the kvstaged to start (default $KVSTAGED, else build/proxy/kvstaged, else on PATH)")
    k.add_argument("--slots", type=int, metavar="N",
                   help="pool slots of the kvstaged started (default: enough for C requests of P pages)")
    k.add_argument("--slot-size", default="256K", metavar="BYTES",
                   help="slot size of the kvstaged started, K, M, G suffixes (default 256K)")
    t = p.add_argument_group("timeouts (seconds)")
    t.add_argument("--bootstrap-timeout", type=float, default=2.0, metavar="S",
                   help="prefill: a request no decode side asked for by then fails (SGLang's "
                        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT); a request the decode side aborted in "
                        "Bootstrapping ends on the prefill side only so (default 2)")
    t.add_argument("--waiting-timeout", type=float, default=60.0, metavar="S",
                   help="decode: a request not complete this long after init fails (default 60)")
    t.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="give up when no request has ended for S seconds (default 120)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the report as one JSON object")
    o.add_argument("-q", "--quiet", action="store_true", help="no progress line on stderr")
    return p


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = str(s).strip().upper().removesuffix("B").removesuffix("I")
    if s and s[-1] in mult:
        return int(s[:-1]) * mult[s[-1]]
    return int(s)


def parse_args(argv):
    p = parser()
    a = p.parse_args(argv)
    for name in ("prefill", "decode", "requests", "concurrency", "layers", "heads", "head_dim", "page_size",
                 "max_pages", "chunk_pages"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if a.prefill > 16 or a.decode > 16:
        p.error("at most 16 prefill and 16 decode workers")
    if not 0 <= a.abort_fraction <= 1:
        p.error("--abort-fraction must be between 0 and 1")
    if (a.page_size * a.heads * a.head_dim * 2) % 8:
        p.error("a page's bytes (page size x heads x head dim x 2) must be a multiple of 8")
    try:
        a.slot_bytes = parse_size(a.slot_size)
    except ValueError:
        p.error(f"--slot-size {a.slot_size!r}: not a size")
    if a.slot_bytes < 4096 or a.slot_bytes % 4096:
        p.error("--slot-size must be a multiple of 4K")
    if a.kvstaged and not os.access(a.kvstaged, os.X_OK):
        p.error(f"--kvstaged {a.kvstaged}: not an executable file")
    if a.slots is not None and a.slots < 1:
        p.error("--slots must be at least 1")
    for name in ("bootstrap_timeout", "waiting_timeout", "timeout"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    try:
        a.corrupt = parse_corrupt(os.environ.get(CORRUPT_ENV, ""))
    except ValueError as e:
        p.error(f"${CORRUPT_ENV}: {e}")
    return a


def parse_corrupt(s):
    """'page:K,late:K2' -> {'page': {K}, 'late': {K2}} (a bare K means page:K)."""
    out = {"page": set(), "late": set()}
    for part in filter(None, (x.strip() for x in s.split(","))):
        kind, _, k = part.rpartition(":")
        kind = kind or "page"
        if kind not in out or not k.isdigit():
            raise ValueError(f"{part!r}: expected page:K or late:K")
        out[kind].add(int(k))
    return out


# ------------------------------------------------------------------------------------------------ the requests
def geometry(a):
    """The KV cache's shape, shared by every worker (both sides must have the same layout)."""
    page_bytes = a.page_size * a.heads * a.head_dim * 2
    aux_row = [64, 32, 32]     # pd_sim.Cache's: int32 x 16, float32 x 8, int64 x 4: output ids, logprobs, cached tokens
    state_row = [256]          # pd_sim.Cache's: float32 x 64, one mamba-like state tensor
    return dict(layers=a.layers, heads=a.heads, head_dim=a.head_dim, page_size=a.page_size, page_bytes=page_bytes,
                aux_row=aux_row, state_row=state_row,
                request_max=a.max_pages * page_bytes * 2 * a.layers + sum(aux_row) + sum(state_row))


def make_requests(a):
    """Returns the R request specs: k, bootstrap room, prefill and decode worker, pages, chunks, plan."""
    rng = random.Random(a.seed)
    n_abort = round(a.requests * a.abort_fraction)
    aborted = rng.sample(range(a.requests), n_abort)
    plans = {}
    for i, k in enumerate(aborted):
        side = "prefill" if i < (n_abort + 1) // 2 else "decode"
        plans[k] = (side, rng.choice(PREFILL_PLANS if side == "prefill" else DECODE_PLANS))
    rooms, reqs = set(), []
    for k in range(a.requests):
        room = rng.getrandbits(62) | 1
        while room in rooms:
            room = rng.getrandbits(62) | 1
        rooms.add(room)
        plan = plans.get(k)
        npages = rng.randint(1, a.max_pages)
        mid = plan in (("prefill", "Transferring"), ("decode", "mid"))
        if mid:
            npages = max(npages, 2)  # stopped after the first chunk: there must be a second
        chunks = [min(a.chunk_pages, npages - i) for i in range(0, npages, a.chunk_pages)]
        if mid and len(chunks) == 1:
            chunks = [npages // 2, npages - npages // 2]
        reqs.append(dict(k=k, room=room, p=rng.randrange(a.prefill), d=rng.randrange(a.decode), npages=npages,
                         chunks=chunks, contiguous=rng.random() < 0.4, plan=plan))
    return reqs


def requests_for(argv):
    """The request specs a command line makes (for tests that must pick a request by its plan)."""
    return make_requests(parse_args(argv))


# ------------------------------------------------------------------------------------------------ the workers
IDLE_MIN, IDLE_MAX = 0.0005, 0.01  # a worker with nothing to do blocks on its events and its pipe this long


class Worker:
    """An engine's scheduler loop: takes requests from the router, polls every live request each pass, reports
    each one's end; when a pass changed nothing it blocks on the proxy's event fd and the router's pipe."""

    def __init__(self, role, index, conn, socket_path, geo, pages, rows, shared, opts):
        import torch
        from kvstage import sglang as ks
        torch.set_num_threads(1)
        self.torch, self.ks, self.KVPoll = torch, ks, ks.KVPoll
        self.role, self.index, self.conn, self.flags, self.acks = role, index, conn, shared[0], shared[1]
        self.opts = opts
        self.rng = random.Random(f"{opts['seed']}/{role}/{index}")
        self.cache = Cache(pages, rows, page_size=geo["page_size"], layers=geo["layers"], heads=geo["heads"],
                           head_dim=geo["head_dim"])
        assert [self.cache.aux_u8(a).shape[1] for a in range(len(self.cache.aux))] == geo["aux_row"]
        assert [self.cache.state_u8(0).shape[1]] == geo["state_row"]
        self.pages, self.rows = Alloc(pages, self.rng), Alloc(rows, self.rng)
        self.live = {}
        self.server = self.mgr = None
        if role == "prefill":
            self.server = ks.bootstrap_server_on_a_free_port("127.0.0.1")
            self.addr = f"127.0.0.1:{self.server.port}"
            self.mgr = ks.KvstageKVManager(self.cache.kv_args(), ks.DisaggregationMode.PREFILL,
                                           server_args(socket_path, self.server.port))
            self.mgr.bootstrap_timeout = opts["bootstrap_timeout"]
        else:
            self.addr = None
            self.mgr = ks.KvstageKVManager(self.cache.kv_args(), ks.DisaggregationMode.DECODE,
                                           server_args(socket_path, 0))
            self.mgr.waiting_timeout = opts["waiting_timeout"]

    def run(self):
        stopping, idle = False, IDLE_MIN
        while True:
            busy = False
            while self.conn.poll():
                msg = self.conn.recv()
                if msg[0] == "stop":
                    stopping = True
                else:
                    self.admit(msg[1])
                    busy = True
            for k in list(self.live):
                busy = self.step(self.live[k]) or busy
            if stopping and not self.live:
                return
            if busy:
                idle = IDLE_MIN
                continue
            self.mgr.pump()  # with no request to poll, nothing else would take the events that make the fd readable
            select.select([self.mgr.client().fileno(), self.conn], [], [], idle)
            idle = min(idle * 2, IDLE_MAX)

    def report(self, st, outcome, **kw):
        del self.live[st["r"]["k"]]
        self.conn.send(("done", st["r"]["k"], self.role, dict(outcome=outcome, aborted_at=st.get("aborted_at"), **kw)))

    def reason(self, obj):
        try:
            obj.failure_exception()
        except self.ks.KVTransferError as e:
            return e.failure_reason
        return None

    def close(self):
        if self.mgr is not None:
            self.mgr.close()
        if self.server is not None:
            self.server.close()


class PrefillWorker(Worker):
    """PrefillBootstrapQueue -> forward (one chunk a pass) -> send_kv_chunk -> inflight queue."""

    def admit(self, r):
        s = self.ks.KvstageKVSender(self.mgr, self.addr, r["room"], [0], 0)
        st = self.live[r["k"]] = dict(r=r, s=s, phase="bootstrap", pages=None, row=None, next=0, sent=0, last=None)
        if r["plan"] == ("prefill", "Bootstrapping"):
            self.abort(st, s.poll())

    def abort(self, st, state):
        st["aborted_at"] = STATES[state]
        st["s"].abort()

    def step(self, st):
        r, s, KVPoll = st["r"], st["s"], self.KVPoll
        k = r["k"]
        p = s.poll()
        changed, st["last"] = p != st["last"], p
        if p == KVPoll.WaitingForInput and st["phase"] == "bootstrap":
            if r["plan"] == ("prefill", "WaitingForInput"):
                self.abort(st, p)
                return True
            pages, row = self.pages.alloc(r["npages"], r["contiguous"]), self.rows.alloc(1)
            if pages is None or row is None:  # engine memory full: next pass
                self.pages.give_back(pages or [])
                self.rows.give_back(row or [])
                return changed
            st["pages"], st["row"] = pages, row[0]
            s.init(r["npages"] - s.pop_decode_prefix_len() // self.cache.page_size, st["row"])
            st["phase"] = "send"
            return True
        if st["phase"] == "send" and p in (KVPoll.WaitingForInput, KVPoll.Transferring):
            i = st["next"]
            if r["plan"] == ("decode", "mid") and i == 1 and not self.acks[k]:
                return changed  # the rest waits until the decode side has aborted mid-way
            n, last = r["chunks"][i], i == len(r["chunks"]) - 1
            chunk = st["pages"][st["sent"]:st["sent"] + n]
            self.cache.fill_pages(r["room"], chunk, st["sent"])  # this chunk's forward
            if last:
                self.cache.fill_rows(r["room"], st["row"])
            if s.should_send_kv_chunk(len(chunk), last):
                s.send(chunk, [[st["row"]]] if last else None)
            st["sent"] += n
            st["next"] += 1
            if i == 0:
                self.flags[k] = 1
            if last:
                st["phase"] = "inflight"
            elif i == 0 and r["plan"] == ("prefill", "Transferring"):
                self.abort(st, KVPoll.Transferring)
            return True
        if p in (KVPoll.Success, KVPoll.Failed):
            nbytes = s.get_transfer_metric().transfer_total_bytes if p == KVPoll.Success else None
            reason = self.reason(s) if p == KVPoll.Failed else None
            s.clear()
            if st["pages"] is not None:
                self.pages.give_back(st["pages"])
                self.rows.give_back([st["row"]])
            self.report(st, STATES[p], reason=reason, nbytes=nbytes)
            return True
        return changed

    def final(self):
        return {}


class DecodeWorker(Worker):
    """DecodePreallocQueue (init, preallocate, send_metadata) -> DecodeTransferQueue (poll until Success)."""

    def __init__(self, *a, rooms, corrupt, **kw):
        super().__init__(*a, **kw)
        self.whose = rooms                 # bootstrap room -> request number (to name a mixed-up page's owner)
        self.by_k = {k: room for room, k in rooms.items()}
        self.corrupt = corrupt
        self.quarantine = []               # (k, pages, row): an aborted request's marked pages, kept out of use

    def admit(self, r):
        rv = self.ks.KvstageKVReceiver(self.mgr, r["bootstrap_addr"], r["room"])
        st = self.live[r["k"]] = dict(r=r, rv=rv, pages=None, row=None, last=None)
        if r["plan"] == ("decode", "Bootstrapping"):
            self.abort(st, self.KVPoll.Bootstrapping)
        else:
            rv.init(0)

    def abort(self, st, state):
        st["aborted_at"] = STATES[state]
        st["rv"].abort()

    def step(self, st):
        r, rv, KVPoll = st["r"], st["rv"], self.KVPoll
        k = r["k"]
        p = rv.poll()
        changed, st["last"] = p != st["last"], p
        if p == KVPoll.WaitingForInput and st["pages"] is None:
            if r["plan"] == ("decode", "WaitingForInput"):
                self.abort(st, p)
                return True
            pages, row = self.pages.alloc(r["npages"]), self.rows.alloc(1)
            if pages is None or row is None:  # no room in the KV pool yet: next pass
                self.pages.give_back(pages or [])
                self.rows.give_back(row or [])
                return changed
            st["pages"], st["row"] = pages, row[0]
            rv.send_metadata(pages, st["row"], [[st["row"]]])
            if r["plan"] == ("decode", "Transferring"):
                self.abort(st, KVPoll.Transferring)
            return True
        if (p == KVPoll.Transferring and r["plan"] == ("decode", "mid") and self.flags[k] and not self.acks[k]):
            self.abort(st, p)  # the prefill side has sent its first chunk and holds the rest
            self.acks[k] = 1
            return True
        if p == KVPoll.Success:
            if k in self.corrupt["page"]:  # test only: a transfer that put another request's page here
                other = (k + 1) % len(self.by_k)
                t = self.cache.kv_u8(0)
                t[st["pages"][0]] = stamp(self.torch, self.by_k[other], TAG_KV, 0, [0], t.shape[1])[0]
            wrong = self.cache.check(r["room"], st["pages"], st["row"], self.whose)
            rv.clear()
            self.pages.give_back(st["pages"])
            self.rows.give_back([st["row"]])
            self.report(st, "Success", wrong=wrong)
            return True
        if p == KVPoll.Failed:
            reason = self.reason(rv)
            rv.clear()
            problem = None
            if st["pages"] is not None:
                if not rv.pages_released:  # the strict rule: only then may the pages go to another request
                    problem = "clear() returned, but pages_released is False"
                else:
                    self.cache.mark(st["pages"], st["row"], k)
                    self.quarantine.append((k, st["pages"], st["row"]))
                    if k in self.corrupt["late"]:  # test only: a copy-out that landed after clear()
                        self.cache.kv_u8(0)[st["pages"][-1], 24:32] = 0
            self.report(st, "Failed", reason=reason, problem=problem, had_pages=st["pages"] is not None)
            return True
        return changed

    def final(self):
        """After every request ended: the marked pages of aborted requests must be untouched."""
        bad = {}
        for k, pages, row in self.quarantine:
            where = self.cache.marked(pages, row, k)
            if where:
                bad[k] = f"decode pages written after clear(): {where}"
        return dict(quarantined=len(self.quarantine), bad_markers=bad)


def worker_main(role, index, conn, socket_path, geo, pages, rows, shared, opts, rooms=None, corrupt=None):
    """A worker process's body: 'ready' (with the prefill's bootstrap address), 'done' per request, then 'final'."""
    w = None
    try:
        if role == "prefill":
            w = PrefillWorker(role, index, conn, socket_path, geo, pages, rows, shared, opts)
        else:
            w = DecodeWorker(role, index, conn, socket_path, geo, pages, rows, shared, opts, rooms=rooms,
                             corrupt=corrupt)
        conn.send(("ready", w.addr))
        w.run()
        fin = w.final()
        w.close()
        w = None
        conn.send(("final", fin))
    except BaseException:
        try:
            conn.send(("error", f"{role} worker {index}:\n{traceback.format_exc()}"))
        except OSError:
            pass
    finally:
        if w is not None:
            w.close()
        conn.close()


# ------------------------------------------------------------------------------------------------ the proxy
def find_kvstaged(a):
    for cand in (a.kvstaged, os.environ.get("KVSTAGED"), str(ROOT / "build" / "proxy" / "kvstaged"),
                 shutil.which("kvstaged")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def find_stat(kvstaged):
    cands = [os.environ.get("KVSTAGE_STAT")]
    if kvstaged:
        here = Path(kvstaged).resolve().parent
        cands += [str(here.parent / "tools" / "kvstage-stat"), str(here / "kvstage-stat")]
    cands += [str(ROOT / "build" / "tools" / "kvstage-stat"), shutil.which("kvstage-stat")]
    for cand in cands:
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


class Proxy:
    """A kvstaged this demo started (--ready-fd handshake), in a temp dir; stop() sends SIGTERM."""

    def __init__(self, exe, slots, slot_size):
        self.dir = tempfile.mkdtemp(prefix="kvs-pd-")  # short: a socket path is at most 107 bytes
        self.socket = os.path.join(self.dir, "kvs.sock")
        self.log = os.path.join(self.dir, "kvstaged.log")
        self.proc = None
        from kvstage import daemon  # here: --help needs no library
        argv = ["--socket", self.socket, "--slots", str(slots), "--slot-size", str(slot_size),
                "--shutdown-grace", "1000"]
        try:
            with open(self.log, "wb") as log:
                self.proc = daemon.spawn(exe, argv, log)
        except BaseException as e:  # spawn stopped what it started
            tail = self.log_tail()
            self.remove()
            if isinstance(e, RuntimeError):
                raise RuntimeError(f"{e}; its log ends:\n{tail}") from None
            raise

    def log_tail(self, n=20):
        try:
            return "\n".join(Path(self.log).read_text(errors="replace").splitlines()[-n:])
        except OSError as e:
            return f"(no log: {e})"

    def stop(self):
        """SIGTERM, then SIGKILL after 5 s; returns the exit status."""
        from kvstage import daemon
        return daemon.stop(self.proc) if self.proc else None

    def remove(self):
        shutil.rmtree(self.dir, ignore_errors=True)


def own_peer_secret(a):
    """The engines' side channel needs the deployment's peer secret (kvstage.sidechannel). Without
    $KVSTAGE_PEER_SECRET_FILE or $KVSTAGE_PEER_SECRET the demo makes one of its own, in a 0600 file in a temp dir
    of its own that the workers inherit through $KVSTAGE_PEER_SECRET_FILE, and says so; returns that dir (None:
    the environment had one)."""
    if os.environ.get("KVSTAGE_PEER_SECRET_FILE") or os.environ.get("KVSTAGE_PEER_SECRET"):
        return None
    d = tempfile.mkdtemp(prefix="kvs-pd-secret-")
    path = os.path.join(d, "peer.secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    os.environ["KVSTAGE_PEER_SECRET_FILE"] = path
    if not a.quiet:
        print(f"pd_demo: no KVSTAGE_PEER_SECRET_FILE or KVSTAGE_PEER_SECRET: the workers' side channel uses a "
              f"secret of the demo's own ({path}, removed at the end)", file=sys.stderr)
    return d


def stat(exe, socket_path):
    out = subprocess.run([exe, "--socket", socket_path, "--json"], capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        raise RuntimeError(f"kvstage-stat failed: {out.stderr.strip()}")
    return json.loads(out.stdout.splitlines()[-1])


def pool_check(exe, socket_path, before, own, timeout=10):
    """Waits until the pool is free (own proxy: no client, no room, every slot free; else: as it was before the
    run); returns (ok, stat, words)."""
    deadline = time.monotonic() + timeout
    while True:
        s = stat(exe, socket_path)
        if own:
            ok = s["clients"]["now"] == 0 and s["rooms"]["open"] == 0 and s["slots"]["free"] == s["slot_count"]
        else:
            ok = s["rooms"]["open"] <= before["rooms"]["open"] and s["slots"]["free"] >= before["slots"]["free"]
        if ok or time.monotonic() > deadline:
            words = (f"{s['slots']['free']} of {s['slot_count']} slots free, {s['rooms']['open']} rooms open, "
                     f"{s['clients']['now']} clients")
            return ok, s, words
        time.sleep(0.05)  # the proxy reclaims a closed client's slots as it notices the close


# ------------------------------------------------------------------------------------------------ the router
class Progress:
    def __init__(self, quiet, total):
        self.on, self.total, self.tty = not quiet, total, sys.stderr.isatty()
        self.t0 = self.last = time.monotonic()
        self.shown = False

    def show(self, n, comp, abrt, fail, final=False):
        if not self.on:
            return
        now = time.monotonic()
        if not final and now - self.last < (0.25 if self.tty else 5.0):
            return
        self.last = now
        line = (f"pd_demo: {n}/{self.total} requests ended ({comp} completed, {abrt} aborted, {fail} failed), "
                f"{now - self.t0:.1f} s")
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if final else ""))
        elif not final or self.shown:
            sys.stderr.write(line + "\n")
        self.shown = True
        sys.stderr.flush()


def classify(r, res):
    """Returns (kind, problem): kind completed | aborted-prefill | aborted-decode | failed."""
    d, p = res.get("decode"), res.get("prefill")
    if d is None or p is None:
        return "failed", "never ended on the " + ("decode" if d is None else "prefill") + " side"
    if r["plan"] is None:
        if d["outcome"] != "Success" or p["outcome"] != "Success":
            return "failed", (f"not aborted, but ended decode {d['outcome']} ({d.get('reason')}), "
                              f"prefill {p['outcome']} ({p.get('reason')})")
        if d.get("wrong"):
            return "failed", d["wrong"]
        return "completed", None
    side = r["plan"][0]
    if d["outcome"] != "Failed" or p["outcome"] != "Failed":
        return "failed", f"aborted by the {side} side, but ended decode {d['outcome']}, prefill {p['outcome']}"
    if d.get("problem"):
        return "failed", d["problem"]
    return f"aborted-{side}", None


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    missing = [m for m in ("torch", "numpy") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"pd_demo: needs {' and '.join(missing)} (Debian: apt-get install "
              f"{' '.join('python3-' + m for m in missing)}), which {sys.executable} cannot import",
              file=sys.stderr)
        return 1
    t_start = time.monotonic()
    geo = geometry(a)
    reqs = make_requests(a)
    exe = find_kvstaged(a)
    stat_exe = find_stat(exe)
    if stat_exe is None:
        print("pd_demo: no kvstage-stat (set $KVSTAGE_STAT, or build: ninja -C build)", file=sys.stderr)
        return 1
    per_req_slots = math.ceil(geo["request_max"] / a.slot_bytes) + 2 * a.layers + 2
    slots = a.slots or max(64, a.concurrency * per_req_slots)
    if a.slots and a.slots < a.concurrency * per_req_slots and not a.socket:
        print(f"pd_demo: warning: --slots {a.slots} is less than {a.concurrency} requests of {a.max_pages} pages "
              f"may hold ({a.concurrency * per_req_slots}); requests that fill the pool wait for each other until "
              "kvstaged's room timeout", file=sys.stderr)
    proxy = None
    if a.socket:
        socket_path = a.socket
    else:
        if exe is None:
            print("pd_demo: no kvstaged (--kvstaged PATH, $KVSTAGED, or build it: ninja -C build)", file=sys.stderr)
            return 1
        try:
            proxy = Proxy(exe, slots, a.slot_bytes)
        except (OSError, RuntimeError) as e:
            print(f"pd_demo: starting {exe}: {e}", file=sys.stderr)
            return 1
        socket_path = proxy.socket
    procs, conns, problems, report = [], [], [], None
    secret_dir = own_peer_secret(a)
    try:
        before = stat(stat_exe, socket_path)
        report = run(a, geo, reqs, socket_path, procs, conns, problems, stat_exe, before, proxy is not None, t_start)
    except KeyboardInterrupt:
        problems.append("interrupted")
    except Exception as e:
        problems.append(f"{type(e).__name__}: {e}")
    finally:
        for c in conns:
            c.close()
        for pr in procs:
            pr.join(10)
            if pr.is_alive():
                pr.kill()
                pr.join()
        if proxy is not None:
            rc = proxy.stop()
            if rc != 0:
                problems.append(f"kvstaged exited with status {rc} at SIGTERM; its log ends:\n{proxy.log_tail()}")
            proxy.remove()
        if secret_dir is not None:
            shutil.rmtree(secret_dir, ignore_errors=True)
    if report is None:
        report = dict(requests=a.requests, ok=False)
    report["problems"] = report.get("problems", []) + problems
    report["ok"] = bool(report.get("ok")) and not problems
    report["kvstaged"] = "own" if proxy is not None else socket_path
    report["sglang"] = "real" if REAL_SGLANG else "its interface's stand-ins (python/tests/sglang_stubs)"
    print_report(a, geo, report, slots if proxy is not None else None)
    return 0 if report["ok"] else 1


def run(a, geo, reqs, socket_path, procs, conns, problems, stat_exe, before, own, t_start):
    ctx = mp.get_context("spawn")
    flags, acks = ctx.Array("b", len(reqs), lock=False), ctx.Array("b", len(reqs), lock=False)
    opts = dict(seed=a.seed, bootstrap_timeout=a.bootstrap_timeout, waiting_timeout=a.waiting_timeout)
    rooms = {r["room"]: r["k"] for r in reqs}
    workers = []  # (role, index, conn, proc)
    for role, n in (("prefill", a.prefill), ("decode", a.decode)):
        for i in range(n):
            mine = [r for r in reqs if r[role[0]] == i]
            quarantine = sum(r["npages"] for r in mine if r["plan"] is not None) if role == "decode" else 0
            pages = a.concurrency * a.max_pages + quarantine
            rows = a.concurrency + (sum(1 for r in mine if r["plan"]) if role == "decode" else 0) + 1
            here, there = ctx.Pipe()
            kw = dict(rooms=rooms, corrupt=a.corrupt) if role == "decode" else {}
            pr = ctx.Process(target=worker_main, name=f"pd-{role}-{i}", daemon=True,
                             args=(role, i, there, socket_path, geo, pages, rows, (flags, acks), opts), kwargs=kw)
            pr.start()
            there.close()
            procs.append(pr)
            conns.append(here)
            workers.append((role, i, here, pr))
    addrs = {}
    for role, i, conn, pr in workers:
        if not conn.poll(120):
            raise RuntimeError(f"the {role} worker {i} did not start within 120 s")
        tag, val = conn.recv()
        if tag != "ready":
            raise RuntimeError(val)
        if role == "prefill":
            addrs[i] = val
    pconn = {i: c for role, i, c, _ in workers if role == "prefill"}
    dconn = {i: c for role, i, c, _ in workers if role == "decode"}
    owner = {c: (role, i) for role, i, c, _ in workers}

    t0 = time.monotonic()
    results = collections.defaultdict(dict)
    pending, inflight = collections.deque(reqs), set()
    counts = collections.Counter()
    prog = Progress(a.quiet, len(reqs))
    finals, last_end, ended = {}, time.monotonic(), 0
    last_completed = t0
    while pending or inflight:
        while pending and len(inflight) < a.concurrency:
            r = pending.popleft()
            r = dict(r, bootstrap_addr=addrs[r["p"]])  # the request names its prefill server, as SGLang's do
            inflight.add(r["k"])
            pconn[r["p"]].send(("req", r))
            dconn[r["d"]].send(("req", r))
        ready = mp.connection.wait(list(owner) + [pr.sentinel for pr in procs], timeout=0.5)
        for c in sorted(ready, key=lambda c: c not in owner):  # a worker's last words before its exit
            if c not in owner:
                dead = next(pr for pr in procs if pr.sentinel == c)
                raise RuntimeError(f"worker {dead.name} exited before the end (status {dead.exitcode})")
            try:
                msg = c.recv()
            except EOFError:
                raise RuntimeError(f"the {owner[c][0]} worker {owner[c][1]} went away") from None
            if msg[0] == "error":
                raise RuntimeError(msg[1])
            _, k, side, res = msg
            results[k][side] = res
            if len(results[k]) == 2:
                inflight.discard(k)
                kind = classify(reqs[k], results[k])[0]
                counts[kind] += 1
                ended += 1
                last_end = time.monotonic()
                if kind == "completed":
                    last_completed = last_end
        prog.show(ended, counts["completed"], counts["aborted-prefill"] + counts["aborted-decode"], counts["failed"])
        if time.monotonic() - last_end > a.timeout:
            problems.append(f"no request ended for {a.timeout:g} s; {len(inflight)} in flight: "
                            + ", ".join(f"request {k}: {results[k]}" for k in sorted(inflight)[:5]))
            break
    t_req = time.monotonic() - t0
    if problems:  # the workers are stuck: stop them before looking at the pool
        for pr in procs:
            pr.kill()
            pr.join()
    prog.show(ended, counts["completed"], counts["aborted-prefill"] + counts["aborted-decode"], counts["failed"],
              final=True)
    if not problems:
        for role, i, conn, _ in workers:
            conn.send(("stop",))
        for role, i, conn, pr in workers:
            if not conn.poll(60):
                raise RuntimeError(f"the {role} worker {i} did not finish")
            tag, val = conn.recv()
            if tag != "final":
                raise RuntimeError(val)
            finals[(role, i)] = val
            pr.join(30)
            if pr.exitcode != 0:
                problems.append(f"the {role} worker {i} exited with status {pr.exitcode}")

    # the verdict, request by request
    late = {}
    for v in finals.values():
        late.update(v.get("bad_markers", {}))
    kinds = collections.Counter()
    at = {"prefill": collections.Counter(), "decode": collections.Counter()}
    failed, nbytes, checked_markers = [], 0, sum(v.get("quarantined", 0) for v in finals.values())
    for r in reqs:
        kind, why = classify(r, results[r["k"]])
        if kind.startswith("aborted") and r["k"] in late:
            kind, why = "failed", late[r["k"]]
        kinds[kind] += 1
        if kind == "completed":
            nbytes += results[r["k"]]["prefill"]["nbytes"] or 0
        elif kind == "failed":
            failed.append(dict(request=r["k"], prefill=r["p"], decode=r["d"], pages=r["npages"],
                               plan="/".join(r["plan"]) if r["plan"] else None, why=why))
        else:
            side = r["plan"][0]
            at[side][results[r["k"]][side].get("aborted_at") or "?"] += 1
    ok_pool, s, pool_words = pool_check(stat_exe, socket_path, before, own)
    report = dict(
        prefill_workers=a.prefill, decode_workers=a.decode, requests=len(reqs), concurrency=a.concurrency,
        seed=a.seed, completed=kinds["completed"], aborted_by_prefill=kinds["aborted-prefill"],
        aborted_by_decode=kinds["aborted-decode"], failed=kinds["failed"],
        aborted_at={side: dict(c) for side, c in at.items()}, verified_bytes=nbytes,
        aborted_pages_checked=checked_markers, pool_free=ok_pool, pool=pool_words,
        proxy_rooms=dict(done=s["rooms"]["done"] - before["rooms"]["done"],
                         aborted=s["rooms"]["aborted"] - before["rooms"]["aborted"],
                         failed=s["rooms"]["failed"] - before["rooms"]["failed"]),
        request_wall_s=round(t_req, 3), wall_s=round(time.monotonic() - t_start, 3),
        transfer_wall_s=round(last_completed - t0, 3),
        gb_per_s=round(nbytes / (last_completed - t0) / 1e9, 3) if last_completed > t0 else 0.0, failures=failed)
    ended_all = kinds["completed"] + kinds["aborted-prefill"] + kinds["aborted-decode"] == len(reqs)
    report["ok"] = ended_all and not failed and ok_pool
    if not ok_pool:
        report["problems"] = [f"the pool did not end free: {pool_words}"]
    return report


def plan_words(plan):
    side, state = plan.split("/")
    when = "mid-transfer (after the first chunk)" if state == "mid" else f"in {state}"
    return f"aborted by the {side} side {when}"


def mib(n):
    return f"{n / (1 << 20):.1f} MiB"


def print_report(a, geo, rep, slots):
    if a.json:
        print(json.dumps(rep, sort_keys=True))
        return
    out = []
    if "completed" in rep:
        per_page = geo["page_bytes"] * 2 * geo["layers"]
        out.append(f"kvstage PD demo: {rep['prefill_workers']} prefill -> {rep['decode_workers']} decode worker(s), "
                   f"{rep['requests']} requests, {rep['concurrency']} in flight, seed {rep['seed']}")
        out.append(f"  KV cache: {geo['layers']} layers x (K, V), {geo['heads']} heads x {geo['head_dim']} fp16, "
                   f"{geo['page_size']} tokens a page = {per_page >> 10} KiB a page; 1-{a.max_pages} pages a "
                   f"request, sent {a.chunk_pages} pages a chunk; aux and state rows")
        out.append("  kvstaged: " + (f"own, {slots} slots x {a.slot_bytes >> 10} KiB" if slots else rep["kvstaged"]))

        def split(d):
            return ", ".join(f"{k} {d[k]}" for k in ("Bootstrapping", "WaitingForInput", "Transferring", "?") if k in d)
        rows = [("requests", rep["requests"], ""),
                ("completed", rep["completed"], f"every byte verified: {mib(rep['verified_bytes'])}"),
                ("aborted by prefill", rep["aborted_by_prefill"], split(rep["aborted_at"]["prefill"])),
                ("aborted by decode", rep["aborted_by_decode"], split(rep["aborted_at"]["decode"])),
                ("failed", rep["failed"], "")]
        for name, n, note in rows:
            out.append(f"{name:<20}{n:>6}" + (f"   ({note})" if note else ""))
        out.append(f"{'aborted pages':<20}{rep['aborted_pages_checked']:>6}   (requests whose decode pages were "
                   f"released by clear() and untouched after it)")
        pr = rep["proxy_rooms"]
        out.append(f"{'pool':<20}{'free' if rep['pool_free'] else 'NOT FREE':>6}   ({rep['pool']}; the proxy saw "
                   f"{pr['done']} rooms done, {pr['aborted']} aborted, {pr['failed']} failed)")
        out.append(f"{'wall time':<20}{rep['request_wall_s']:>6.2f} s ({rep['wall_s']:.2f} s with start-up)")
        out.append(f"{'throughput':<20}{rep['gb_per_s']:>6.2f} GB/s (verified bytes over the "
                   f"{rep['transfer_wall_s']:.2f} s to the last completed request)")
        for f in rep["failures"][:20]:
            plan = f", {plan_words(f['plan'])}" if f["plan"] else ""
            out.append(f"FAILED request {f['request']} (prefill {f['prefill']} -> decode "
                       f"{f['decode']}, {f['pages']} page{'s' if f['pages'] != 1 else ''}{plan}): {f['why']}")
        if len(rep["failures"]) > 20:
            out.append(f"... and {len(rep['failures']) - 20} more failed requests")
    for p in rep["problems"]:
        out.append(f"PROBLEM: {p}")
    out.append("OK" if rep["ok"] else "FAILED")
    print("\n".join(out))


if __name__ == "__main__":
    sys.exit(main())
