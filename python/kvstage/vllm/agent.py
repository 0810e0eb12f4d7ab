"""kvstage.vllm: the worker's agent, one thread owning the kvstage connection (a Client is not thread-safe): it
stages a prefill's blocks into slots and serves the decode side's pulls (stage.py), and loads rooms into a decode's
blocks (load.py). This file: the thread, its commands' queue, its events, and the side channel."""
from __future__ import annotations

import collections
import itertools
import logging
import os
import select
import threading
import time

from .. import lifecycle as _lc
from .. import sidechannel as _sidechannel
from ..client import Client
from ..errors import KvstageError, NotConnected, Timeout
from ..sidechannel import FrameListener
from .load import _Load, _LoadSide
from .stage import _Stage, _StageSide
from .stats import KvstageKVConnectorStats

logger = logging.getLogger("kvstage.vllm")  # one logger for the whole connector


class _Agent(_StageSide, _LoadSide):
    """A worker rank's kvstage side on its own thread: the connection, the prefill stages, the decode loads, the
    prefill's side-channel listener. The worker thread posts commands; results come back through take_finished().
    Test hooks: .copier (submit(job) -> CopyHandle, optional pump()), .hold_send(req_id, chunk) -> bool."""

    IDLE_S, BUSY_S = 0.05, 0.002
    tp_size = 1  # the instance's TP size (the worker side sets it)
    block_size = 0  # the instance's block size (the worker side sets it)
    mla = False  # replicated KV (the worker side sets it): one prefill rank stages, one decode rank opens a shared room
    JOINS_MAX = 4096
    trace = _lc.NOOP  # the lifecycle events' sink (the worker side sets it)
    checksum = False  # end-to-end checksums in every room (kvstage.checksum; the worker side sets it)

    def __init__(self, socket_path, layout, copier, tp_rank, listen, stage_timeout, side_key=None):
        self.socket_path, self.layout, self.copier, self.tp_rank = socket_path, layout, copier, tp_rank
        self.side_key = side_key if side_key is not None else _sidechannel.load_key()
        self.stage_timeout = stage_timeout
        self.hold_send = None
        self._lock = threading.Lock()
        self._cmds, self._inbox = collections.deque(), collections.deque()
        self._finished_sending, self._finished_recving, self._load_errors = set(), set(), set()
        self._stages, self._loads, self._by_uid = {}, {}, {}
        self._pending_pulls = collections.deque()
        self._listen = listen
        self._joins = collections.OrderedDict()  # MLA decode rank > 0: req_id -> the shared room's descriptor
        self.ended = collections.OrderedDict()  # req_id -> why its stage or load ended (the last 4096)
        self.stats = KvstageKVConnectorStats()  # under _lock: taken by the worker thread (take_stats)
        # req_id -> time.time() of its abort or preemption (the scheduler's), till its blocks are free
        self._abort_t = {}
        self._uids = itertools.count(1)
        # one connection and one sender thread per prefill worker: this thread only queues (a silent worker costs its
        # own loads, never this thread's time: every other load and handle_preemptions wait on it)
        self._peers = _sidechannel.AsyncPeers(self.side_key)
        self._client = None
        self._stop = False
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._started = threading.Event()
        self._start_error = None
        self._listener = None
        try:
            if listen is not None:
                self._listener = FrameListener(
                    listen[0], listen[1], self._on_msg,
                    lambda m: m.get("t") in ("pull", "drop", "join") and isinstance(m.get("req"), str), "vllm",
                    self.side_key)
            self._thread = threading.Thread(target=self._main, name="kvstage-vllm-agent", daemon=True)
            self._thread.start()
            self._started.wait()
        except BaseException:
            self._close_fds()
            raise
        if self._start_error is not None:
            self._close_fds()
            raise self._start_error

    # -- the worker thread's side ------------------------------------------------------------
    @property
    def listen_port(self):
        return self._listener.port if self._listener is not None else None

    def post(self, fn, *args):
        with self._lock:
            self._cmds.append((fn, args))
        self.wake()

    def wake(self):
        try:
            os.write(self._w, b"x")
        except OSError:
            pass

    def _on_msg(self, msg):
        with self._lock:
            self._inbox.append(msg)
        self.wake()

    def take_finished(self):
        """Returns (finished_sending, finished_recving, the failed loads' block ids) since the last call, at once:
        a failed load's blocks are reported in the same step as the load."""
        with self._lock:
            out = self._finished_sending, self._finished_recving, self._load_errors
            self._finished_sending, self._finished_recving, self._load_errors = set(), set(), set()
        return out

    def take_stats(self):
        """Returns the observations since the last call (a KvstageKVConnectorStats) or None if there are none."""
        with self._lock:
            return None if self.stats.is_empty() else self.stats.clone_and_reset()

    STATS_MAX = 65536  # entries per key kept between two takes (vLLM takes them every step)

    def _record(self, key, value=1):
        with self._lock:
            v = self.stats.data[key]
            v.append(value)
            if len(v) > self.STATS_MAX:
                del v[:len(v) - self.STATS_MAX]

    def cmd_abort_times(self, times):
        for rid, t in times.items():
            self._abort_t.setdefault(rid, t)

    def _freed(self, req):
        """req's blocks are free for vLLM now (reported, or no copy reads them after a preemption)."""
        t = self._abort_t.pop(req, None)
        if t is not None:
            self._record("abort_to_free_seconds", max(0.0, time.time() - t))

    def stage_state(self, req_id):
        """The prefill stage's state (staging, ready, sending, done, failed) or None, and why (tests, logs)."""
        with self._lock:
            st = self._stages.get(req_id)
            return (st.state, st.why) if st is not None else (None, self.ended.get(req_id))

    def load_state(self, req_id):
        ld = self._loads.get(req_id)
        return (ld.state, ld.why) if ld is not None else (None, self.ended.get(req_id))

    def close(self, timeout=10):
        self._stop = True
        self.wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("kvstage connector: the agent thread did not stop within %ss", timeout)
            return
        self._close_fds()
        self.trace.close()

    def _close_fds(self):
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._r = self._w = -1

    # -- the agent thread ----------------------------------------------------------------------
    def _main(self):
        try:
            self._client = Client(self.socket_path)
        except Exception as e:
            self._start_error = e
            self._started.set()
            return
        self._started.set()
        while not self._stop:
            try:
                busy = self._step()
            except (NotConnected, Timeout) as e:
                self._broken(e)
                busy = False
            except Exception:  # never let the thread die: every request would hang
                logger.exception("kvstage connector: agent step failed")
                busy = False
            self._sleep(self.BUSY_S if busy else self.IDLE_S)
        self._teardown()

    def _sleep(self, timeout):
        fds = [self._r]
        if self._client is not None:
            try:
                fds.append(self._client.fileno())
            except KvstageError:
                pass
        try:
            select.select(fds, [], [], timeout)
        except (OSError, ValueError):
            time.sleep(timeout)
        try:
            while os.read(self._r, 4096):
                pass
        except OSError:
            pass

    def _c(self):
        if self._client is None:
            self._client = Client(self.socket_path)
        return self._client

    def _step(self):
        with self._lock:
            cmds, self._cmds = self._cmds, collections.deque()
            msgs, self._inbox = self._inbox, collections.deque()
        for fn, args in cmds:
            self._guarded(fn, *args)
        for m in msgs:
            self._guarded(self._on_side_msg, m)
        for _ in range(len(self._pending_pulls)):
            self._guarded(self._pull, *self._pending_pulls.popleft())
        self._pump()
        pump = getattr(self.copier, "pump", None)
        if pump is not None:
            pump()
        busy = bool(self._pending_pulls)
        for st in list(self._stages.values()):
            self._guarded(self._stage_progress, st, fail=self._stage_fail)
            busy = busy or st.starved or (st.state == "staging" and bool(st.pieces))
        for ld in list(self._loads.values()):
            self._guarded(self._load_progress, ld, fail=self._load_fail)
            # a joining MLA rank is woken by the leader's descriptor
            joining = ld.spec.mla and self.tp_size > 1 and self.tp_rank != ld.spec.mla_leader
            busy = busy or (ld.state == "opening" and not joining) or any(sh.job is not None for sh in ld.shares)
        self._timeouts()
        return busy

    def _guarded(self, fn, *args, fail=None):
        """Runs fn(*args); a lost connection fails everything, any other error only this command (and with fail,
        the stage or load it was about: fail(obj, why))."""
        try:
            fn(*args)
        except (NotConnected, Timeout) as e:
            self._broken(e)
        except Exception as e:
            logger.exception("kvstage connector: %s failed", getattr(fn, "__name__", fn))
            if fail is not None:
                try:
                    fail(args[0], f"internal error: {e!r}")
                except Exception:
                    logger.exception("kvstage connector: failing after an internal error")

    def _pump(self):
        if self._client is None:
            return
        while True:
            evs = self._client.poll(128)
            for ev in evs:
                obj = self._by_uid.get(ev.user_data)
                if isinstance(obj, _Stage):
                    self._stage_event(obj, ev)
                elif isinstance(obj, _Load):
                    self._load_event(obj, ev)
            if len(evs) < 128:
                return

    def _end(self, req, why):
        self.ended[req] = why
        while len(self.ended) > 4096:
            self.ended.popitem(last=False)

    def _broken(self, exc):
        """The connection is gone or out of step: nothing of it can move or land any more; fail everything."""
        logger.error("kvstage connector: connection to kvstaged lost (%s)", exc)
        for st in list(self._stages.values()):
            for h in st.jobs:
                h.cancel()
            st.jobs, st.views, st.leases = [], {}, None
            st.rooms = [None] * st.nparts
            st.finals = [f or "lost" for f in st.finals]
            st.uids.clear()
            self._stage_fail(st, f"connection to kvstaged lost: {exc}")
        for ld in list(self._loads.values()):
            for sh in ld.shares:
                if sh.job is not None:
                    sh.job.cancel()
                    sh.job = None
                sh.room, sh.final = None, sh.final or "lost"
            ld.uids.clear()
            self._load_fail(ld, f"connection to kvstaged lost: {exc}")
        self._by_uid.clear()
        c, self._client = self._client, None
        try:
            c.close()
        except Exception:
            pass

    def _teardown(self):
        for st in list(self._stages.values()):
            for h in st.jobs:
                h.cancel()
            st.jobs, st.views = [], {}
        for ld in list(self._loads.values()):
            for sh in ld.shares:
                if sh.job is not None:
                    sh.job.cancel()
        self._stages.clear()
        self._loads.clear()
        if self._client is not None:
            try:
                self._client.close()  # the proxy aborts our rooms and frees our slots
            except Exception:
                logger.exception("kvstage connector: closing the connection")
            self._client = None
        self._peers.close(timeout=1.0)  # its threads are daemons: one stuck in a connect ends with it

    def cmd_barrier(self, event):
        """Sets event once every command posted before it has run (handle_preemptions waits on it)."""
        event.set()

    def _timeouts(self):
        now = time.monotonic()
        for st in list(self._stages.values()):
            if not st.terminal and st.unopened() and now > st.deadline:
                self._stage_fail(st, "expired: no decode side loaded it within the stage timeout")
        for ld in list(self._loads.values()):
            if (ld.state in ("opening", "open", "copying") and any(sh.final is None for sh in ld.shares)
                    and not ld.aborted and not ld.failed and now > ld.deadline):
                self._load_fail(ld, f"timed out after {ld.spec.load_timeout:.1f}s")

    # -- the side channel's sending end ----------------------------------------------------------
    def _send_msg(self, endpoint, msg, failing=None):
        """Queues one message for the prefill worker at endpoint (host, port) and returns at once; raises OSError
        without queuing it when that worker failed moments ago or too much already waits for it (see
        sidechannel.AsyncPeers). One that cannot be delivered later (a silent worker, a refused handshake: the worker
        did not prove it holds the peer secret) fails the load failing, if given, on this thread."""
        on_error = None
        if failing is not None:
            def on_error(e):
                self.post(self._load_fail_late, failing,
                          f"could not reach the prefill worker at {endpoint[0]}:{endpoint[1]}: {e}")
        self._peers.send(endpoint[0], endpoint[1], msg, on_error)

    def _load_fail_late(self, ld, why):
        if self._loads.get(ld.req) is ld:  # still this load: not ended and replaced meanwhile
            self._load_fail(ld, why)
