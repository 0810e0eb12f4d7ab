"""kvstage.vllm: the worker's agent, one thread owning the kvstage connection (a Client is not thread-safe): it
stages a prefill's blocks into slots, serves the decode side's pulls, and loads rooms into a decode's blocks."""
from __future__ import annotations

import base64
import collections
import errno as _errno
import itertools
import logging
import os
import select
import threading
import time

from .. import sidechannel as _sidechannel
from ..client import Client, EventType
from ..errors import Again, KvstageError, NotConnected, PoolExhausted, Timeout
from ..plan import copy_room_out, needs_view, plan
from ..sidechannel import FrameListener
from .config import tp_shares
from .layout import _cdiv, _flat
from .stats import KvstageKVConnectorStats

logger = logging.getLogger("kvstage.vllm")  # one logger for the whole connector


class _Stage:
    """Prefill side of one request: its blocks copied into slots, waiting for (then handed to) its rooms.

    With the decode side's TP size this side's (shares None) one room holds the request's KV in the plain layout.
    Else one room per decode rank this rank serves (tp_shares), each holding that rank's heads of every block in the
    share layout (VllmLayout.share_extents); share j's bytes are slots [j * part_chunks, (j + 1) * part_chunks) of the
    stage, its room's chunk i slot j * part_chunks + i."""

    def __init__(self, spec, layout, ss, shares=None):
        self.req = spec.req_id
        grouped = bool(spec.block_ids) and isinstance(spec.block_ids[0], (list, tuple))
        self.blocks = [list(g) for g in spec.block_ids] if grouped else list(spec.block_ids)
        self.nblocks = tuple(len(g) for g in self.blocks) if grouped else len(self.blocks)
        self.shares = shares  # None, or [(decode rank, first head, end head)]
        self.decode_tp = spec.decode_tp
        if shares is None:
            self.part_nbytes = layout.nbytes(self.nblocks)
        else:  # every share has as many heads (tp_shares): as many bytes
            self.part_nbytes = layout.share_nbytes(self.nblocks, shares[0][1], shares[0][2])
        self.nparts = 1 if shares is None else len(shares)
        self.part_chunks = _cdiv(self.part_nbytes, ss)
        self.nbytes = self.part_nbytes * self.nparts
        self.chunks = self.part_chunks * self.nparts
        self.ss = ss
        self.deadline = time.monotonic() + spec.stage_timeout
        self.posted, self.pieces, self.sealed = set(), collections.deque(), False
        self.leases, self.views, self.jobs = None, {}, []
        self.written, self.full, self.sent = [0] * self.chunks, set(), set()
        self.rooms, self.finals = [None] * self.nparts, [None] * self.nparts
        self.uids = {}  # a room's user_data -> its share
        self.handoff, self.delayed, self.finish_known, self.reported = None, False, False, False
        self.state, self.why = "staging", None  # staging -> ready -> sending -> done; or failed
        self.starved = False

    def chunk_len(self, s):
        return min(self.ss, self.part_nbytes - (s % self.part_chunks) * self.ss)

    @property
    def room(self):
        """The plain layout's one room (tests, logs)."""
        return self.rooms[0]

    @property
    def all_final(self):
        return all(f is not None for f in self.finals)

    def unopened(self):
        """True while a share's room was never opened (and is not given up)."""
        return any(r is None and f is None for r, f in zip(self.rooms, self.finals))

    @property
    def copied(self):
        return self.sealed and not self.pieces and not self.jobs and len(self.full) == self.chunks

    @property
    def terminal(self):
        return self.state in ("done", "failed")


class _Share:
    """One room of a load: what one prefill rank sends this rank. plain: the request's whole KV in the plain layout
    (equal TP sizes); else heads [h0, h1) of this rank's blocks in the share layout."""
    __slots__ = ("rank", "h0", "h1", "plain", "endpoint", "nbytes", "room", "uid", "final", "job", "copied")

    def __init__(self, spec, layout, rank, h0=0, h1=0, plain=True, block_size=0):
        self.rank, self.h0, self.h1, self.plain = rank, h0, h1, plain
        self.endpoint = (spec.remote_host, spec.remote_port + rank)
        if spec.remote_block_size:  # the prefill's blocks, token-major: its plain layout
            self.nbytes = layout.token_nbytes(spec.num_blocks * spec.remote_block_size, block_size)
        elif plain:
            self.nbytes = layout.nbytes(spec.num_blocks)
        else:
            self.nbytes = layout.share_nbytes(spec.num_blocks, h0, h1)
        self.room = self.uid = self.final = self.job = None
        self.copied = False


class _Load:
    """Decode side of one request: its rooms (one per prefill rank holding some of this rank's heads: tp_shares),
    then each one's copy-out into its heads of the request's blocks. Done once every share is copied; one share
    failing fails the load."""

    def __init__(self, spec, layout, tp_rank, shares=None, block_size=0):
        self.spec = spec
        self.req = spec.req_id
        self.shares = shares or [_Share(spec, layout, tp_rank, block_size=block_size)]
        self.nbytes = sum(sh.nbytes for sh in self.shares)
        self.endpoint = self.shares[0].endpoint
        self.deadline = time.monotonic() + spec.load_timeout
        self.uids = {}  # a room's user_data -> its share
        self.state = "opening"  # opening -> open -> copying -> done; or failed
        self.aborted = self.failed = self.reported = False
        self.why = None

    @property
    def room(self):
        return self.shares[0].room

    def running(self):
        """True while a share's copy-out may still write the blocks."""
        return any(sh.job is not None and not sh.job.done() for sh in self.shares)


class _Agent:
    """A worker rank's kvstage side on its own thread: the connection, the prefill stages, the decode loads, the
    prefill's side-channel listener. The worker thread posts commands; results come back through take_finished().
    Test hooks: .copier (submit(job) -> CopyHandle, optional pump()), .hold_send(req_id, chunk) -> bool."""

    IDLE_S, BUSY_S = 0.05, 0.002
    tp_size = 1  # the instance's TP size (the worker side sets it)
    block_size = 0  # the instance's block size (the worker side sets it)
    mla = False  # replicated KV (the worker side sets it): prefill rank 0 stages, decode rank 0 opens a shared room
    JOINS_MAX = 4096

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
        self._peers = _sidechannel.Peers(self.side_key)  # one cached connection per prefill worker
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
            joining = ld.spec.mla and self.tp_size > 1 and self.tp_rank != 0  # woken by rank 0's descriptor
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
        self._peers.close()

    # -- prefill: stages -----------------------------------------------------------------------
    def cmd_stage(self, spec):
        if spec.req_id in self._stages:
            old = self._stages.pop(spec.req_id)  # a restage after a preemption
            self._stage_fail(old, "staged again", failure=False)
        try:
            c = self._c()
        except KvstageError as e:  # no proxy: nothing is staged (the blocks are freed when the request ends)
            logger.error("kvstage connector: cannot stage %s: %s", spec.req_id, e)
            return self._end(spec.req_id, f"no connection to kvstaged: {e}")
        if self.mla and self.tp_rank != 0:
            return self._end(spec.req_id, "MLA: prefill rank 0 stages the KV every rank holds")
        shares, why = None, None
        if spec.decode_tp and spec.decode_tp != self.tp_size:
            try:
                if not self.layout.kv_heads:
                    raise ValueError("a cache without KV heads to split (a state or MLA layer) moves between equal TP "
                                     "sizes only")
                shares = tp_shares(self.tp_rank, self.tp_size, spec.decode_tp, self.layout.kv_heads)
            except ValueError as e:
                why = f"refused: decode TP size {spec.decode_tp}, this side {self.tp_size}: {e}"
        st = _Stage(spec, self.layout, c.slot_size, shares)
        self._stages[st.req] = st
        if why is not None:
            return self._stage_fail(st, why)
        try:
            self.layout.check(st.blocks)
        except ValueError as e:
            return self._stage_fail(st, f"refused: {e}")
        if st.chunks > c.slot_count:
            self._stage_fail(st, f"{st.nbytes} bytes do not fit the pool ({c.slot_count} slots)")

    def cmd_barrier(self, event):
        """Sets event once every command posted before it has run (handle_preemptions waits on it)."""
        event.set()

    def cmd_unstage(self, req):
        st = self._stages.pop(req, None)
        if st is not None:
            self._stage_fail(st, "preempted: its blocks were freed", failure=False)
            self._end(req, "preempted")
        self._freed(req)  # no copy reads its blocks any more (_stage_fail cancelled or waited for them)

    def _post_layer(self, st, li):
        if li in st.posted:
            return
        st.posted.add(li)
        if st.shares is None:
            st.pieces.extend(self.layout.plan(st.nblocks, st.blocks, 0, st.ss, layer=li))
            return
        for j, (_, h0, h1) in enumerate(st.shares):  # share j from its first slot on
            st.pieces.extend(plan(self.layout.share_extents(st.nblocks, st.blocks, 0, h0, h1, layer=li,
                                                            room_off=j * st.part_chunks * st.ss), st.ss))

    def cmd_layer(self, li, reqs, event=None):
        if event is not None:
            self.copier.after(event)
        for req in reqs:
            st = self._stages.get(req)
            if st is not None and st.state == "staging" and not st.sealed:
                self._post_layer(st, li)

    def cmd_seal(self, reqs, event=None):
        if event is not None:
            self.copier.after(event)
        for req in reqs:
            st = self._stages.get(req)
            if st is not None and st.state == "staging" and not st.sealed:
                for li in range(len(self.layout.layer_names)):
                    self._post_layer(st, li)  # layers the forward did not announce: the forward is over
                st.sealed = True

    def cmd_finished(self, req, handoff, delayed):
        st = self._stages.get(req)
        if st is None:
            if delayed:
                with self._lock:
                    self._finished_sending.add(req)
            self._freed(req)
            return
        st.finish_known, st.handoff, st.delayed = True, handoff, delayed
        if not handoff:
            self._stage_fail(st, "the request ended without a hand-off", failure=False)
        self._stage_report(st)

    def _stage_progress(self, st):
        if st.terminal:
            return self._stage_report(st)
        c = self._c()
        st.starved = False
        if st.pieces and st.leases is None:
            try:
                st.leases = c.acquire(st.chunks)  # all or none: a half-staged request never holds slots
            except PoolExhausted:
                st.starved = True
                return
        if st.pieces:
            batch = []
            while st.pieces:
                p = st.pieces.popleft()
                s = p.slot
                view = st.views.get(s)
                if view is None and needs_view(p):
                    view = st.views[s] = st.leases[s].view()
                batch.append((st.leases[s], view, p))
            st.jobs.append(self.copier.submit(self._stage_job(st, batch)))
        for h in list(st.jobs):
            if h.done():
                st.jobs.remove(h)
                if h.error is not None:
                    return self._stage_fail(st, f"copying blocks into slots failed: {h.error!r}")
        if any(r is not None and f is None for r, f in zip(st.rooms, st.finals)):
            self._stage_send(st)
        self._stage_report(st)  # before the state says so: whoever sees "ready" knows the report is out
        if st.state == "staging" and st.copied:
            st.state = "ready"
        if st.state == "ready" and len(st.sent) == st.chunks:
            st.state = "sending"

    def _stage_job(self, st, batch):
        copier = self.copier

        def job():
            for lease, view, p in batch:
                copier.copy_in(lease, view, p)
            copier.sync()  # before any slot counts as full (and so can be sent)
            for _, _, p in batch:
                s = p.slot
                st.written[s] += p.nbytes
                if st.written[s] == st.chunk_len(s):
                    st.full.add(s)
        job.req_id, job.kind = st.req, "stage"
        return job

    def _stage_send(self, st):
        for s in sorted(st.full - st.sent):
            hold = self.hold_send
            if hold is not None and hold(st.req, s):
                return
            j, i = divmod(s, st.part_chunks)
            room = st.rooms[j]
            if room is None or st.finals[j] is not None:
                continue  # its decode rank has not asked yet
            st.views.pop(s, None)
            try:
                room.send(st.leases[s], i * st.ss, st.chunk_len(s))
            except Again:
                return  # ring full: the next step sends
            except (NotConnected, Timeout):
                raise
            except KvstageError as e:
                return self._stage_fail(st, f"sending a chunk failed: {e}")
            st.sent.add(s)

    def _stage_report(self, st):
        """finished_sending once the request's blocks cannot be read by a copy any more."""
        if st.finish_known and st.delayed and not st.reported and not st.jobs and (st.copied or st.terminal):
            st.reported = True
            with self._lock:  # one step for a reader: the report is out only once the state says so
                if st.state == "staging" and st.copied:
                    st.state = "ready"
                self._finished_sending.add(st.req)
            self._freed(st.req)
        if (st.terminal and st.all_final and (st.reported or (st.finish_known and not st.delayed))
                and self._stages.get(st.req) is st):
            del self._stages[st.req]

    def _stage_fail(self, st, why, failure=True):
        """Fails a stage; failure: it counts in num_failed_transfers (not for an abort, preemption or release)."""
        if st.terminal:
            return
        if failure:
            self._record("num_failed_transfers")
        logger.debug("kvstage connector: stage of %s failed: %s", st.req, why)
        st.state, st.why = "failed", why
        self._end(st.req, why)
        for h in st.jobs:
            h.cancel()  # queued copies never run; a copy runs only on this thread, so none is running
        st.jobs = []
        try:
            self.copier.sync()
        except Exception:
            pass
        st.views.clear()
        st.pieces.clear()
        if st.leases is not None and self._client is not None:
            for s, lease in enumerate(st.leases):
                if s not in st.sent:
                    try:
                        self._client.release(lease)
                    except KvstageError:
                        pass
        st.leases = None
        for j, room in enumerate(st.rooms):
            if room is not None and st.finals[j] is None:
                room.abort_quietly()  # its final event closes it
            if room is None:
                st.finals[j] = st.finals[j] or "no room"
        self._stage_report(st)

    def _stage_event(self, st, ev):
        if ev.type == EventType.REJECTED:
            lease = next((x for x in (st.leases or ()) if (x.slot, x.epoch) == tuple(ev.lease)), None)
            if lease is not None and self._client is not None:
                st.sent.discard(st.leases.index(lease))
            self._record("num_stale_rejections")
            return self._stage_fail(st, f"the proxy refused a chunk: {ev.error}")
        j = st.uids.pop(ev.user_data, None)
        if j is None:
            return
        st.finals[j] = ev
        if ev.type == EventType.SEND_DONE and not st.terminal:
            if all(f is not None and getattr(f, "type", None) == EventType.SEND_DONE for f in st.finals):
                st.state = "done"
                self._end(st.req, "sent")
                self._record("bytes_sent", st.nbytes)
        elif not st.terminal:
            # one share lost fails the request on its decode rank, and so on every rank (vLLM unites the invalid
            # blocks): the other shares are given up too
            why = ("aborted by the decode side, the proxy or a timeout" if ev.type == EventType.ABORTED
                   else f"failed: {ev.error}")
            room = "the room" if st.shares is None else f"decode rank {st.shares[j][0]}'s room"
            self._stage_fail(st, f"{room} was {why}", failure=ev.type != EventType.ABORTED)
        try:
            st.rooms[j].close()
        except Exception:
            pass
        st.rooms[j] = None
        self._by_uid.pop(ev.user_data, None)
        if st.all_final:
            st.leases = None  # every slot sent is its room's, every other one released
        self._stage_report(st)

    def _share_of(self, st, rank):
        """The index of the share of stage st that decode rank `rank` loads, or None (it loads none of this rank's)."""
        if self.mla:
            return 0  # the one stage every decode rank reads (through decode rank 0's shared room)
        if st.shares is None:
            return 0 if rank == self.tp_rank else None
        return next((j for j, (d, _, _) in enumerate(st.shares) if d == rank), None)

    def _on_side_msg(self, msg):
        if msg["t"] == "drop":
            st = self._stages.get(msg["req"])
            j = self._share_of(st, msg.get("tp_rank", self.tp_rank)) if st is not None else 0
            if j is None or (st is None and msg.get("tp_rank", self.tp_rank) != self.tp_rank
                             and msg.get("tp_size", self.tp_size) == self.tp_size):
                logger.warning("kvstage connector: a release of %s for TP rank %s reached rank %s: ignored",
                               msg["req"], msg.get("tp_rank"), self.tp_rank)
                return
            if st is not None and st.rooms[j] is None and st.finals[j] is None:
                self._stage_fail(st, "released: the decode side will not load it", failure=False)
            return
        if msg["t"] == "join":  # MLA: decode rank 0's shared room, for this rank's load of req to join
            self._joins[msg["req"]] = msg.get("desc")
            while len(self._joins) > self.JOINS_MAX:
                self._joins.popitem(last=False)
            return
        self._pull(msg)

    def _reject(self, msg, why):
        logger.info("kvstage connector: refusing the load of %s: %s", msg.get("req"), why)
        try:
            r = self._c().send_open(_sidechannel.desc_bytes(msg.get("desc")), user_data=0)
            r.abort()
            r.close()
        except (KvstageError, ValueError, KeyError, TypeError) as e:
            logger.debug("kvstage connector: the refused room was gone already: %s", e)

    def _pull(self, msg):
        d, dtp = msg.get("tp_rank"), msg.get("tp_size", self.tp_size)
        if self.mla:
            if d != 0 or self.tp_rank != 0:
                return self._reject(msg, f"MLA: decode rank 0 loads from prefill rank 0 alone, not decode rank {d} "
                                         f"from prefill rank {self.tp_rank} (remote_port misconfigured?)")
        elif dtp == self.tp_size and d != self.tp_rank:  # each rank holds its own shard: another's would load silently
            return self._reject(msg, f"a load for TP rank {d} reached rank {self.tp_rank} "
                                     "(kvstage_port or remote_port misconfigured?)")
        st = self._stages.get(msg["req"])
        if st is None:
            return self._reject(msg, f"no staged KV here ({self.ended.get(msg['req'], 'unknown request')})")
        if st.terminal:
            return self._reject(msg, st.why or st.state)
        staged_for = st.decode_tp or self.tp_size
        if dtp != staged_for and not self.mla:
            return self._reject(msg, f"staged for decode TP size {staged_for}, a load from a decode rank of TP size "
                                     f"{dtp}")
        j = self._share_of(st, d)
        if j is None:
            return self._reject(msg, f"a load for decode TP rank {d} reached prefill rank {self.tp_rank}, which "
                                     f"serves decode ranks {[r for r, _, _ in st.shares]} (remote_port misconfigured?)")
        if st.rooms[j] is not None or st.finals[j] is not None:
            return self._reject(msg, "a second load of the same request")
        if st.shares is None and msg.get("block_size", self.block_size) != self.block_size:
            mine = self.layout.token_fingerprint(self.block_size)
            if mine is None:
                return self._reject(msg, f"decode block size {msg.get('block_size')}, this side {self.block_size}: "
                                         "this side's blocks are not token-major (HND, or K and V in one block)")
            if msg.get("tokens") != mine:
                return self._reject(msg, f"token layouts differ: decode {msg.get('tokens')}, prefill {mine}")
        elif st.shares is None:
            if msg.get("layout") != self.layout.fingerprint():
                return self._reject(msg, f"cache layouts differ: decode {msg.get('layout')}, "
                                         f"prefill {self.layout.fingerprint()}")
        else:
            h = self.layout.kv_heads
            _, h0, h1 = st.shares[j]
            heads = [self.tp_rank * h + h0, self.tp_rank * h + h1]  # of the model's KV heads
            if msg.get("heads") != heads:
                return self._reject(msg, f"decode rank {d} expects KV heads {msg.get('heads')} from prefill rank "
                                         f"{self.tp_rank}, whose share for it is heads {heads}")
            mine = self.layout.share_fingerprint(h0, h1)
            if msg.get("share") != mine:
                return self._reject(msg, f"share layouts differ: decode {msg.get('share')}, prefill {mine}")
        if msg.get("nbytes") != st.part_nbytes:
            return self._reject(msg, f"the decode side expects {msg.get('nbytes')} bytes, {st.part_nbytes} staged")
        try:
            desc = _sidechannel.desc_bytes(msg.get("desc"))
        except ValueError as e:
            return self._reject(msg, str(e))
        try:
            uid = next(self._uids)
            room = self._c().send_open(desc, user_data=uid)
        except (NotConnected, Timeout):
            raise
        except KvstageError as e:
            if e.errno in (_errno.EMFILE, _errno.ENFILE, _errno.EAGAIN, _errno.ENOSR):
                self._pending_pulls.append((msg,))  # no handle, room or peer session free yet
                return
            return self._stage_fail(st, f"could not open the decode side's room: {e}")
        except (ValueError, TypeError) as e:
            return self._reject(msg, f"bad descriptor: {e}")
        if room.nbytes != st.part_nbytes:
            room.abort()
            room.close()
            return self._stage_fail(st, f"the room has {room.nbytes} bytes, {st.part_nbytes} staged")
        st.rooms[j] = room
        st.uids[uid] = j
        self._by_uid[uid] = st

    # -- decode: loads -------------------------------------------------------------------------
    def cmd_recv(self, spec):
        if spec.req_id in self._loads:
            return
        shares, why = None, None
        if spec.remote_tp and spec.remote_tp != self.tp_size:
            try:
                if not self.layout.kv_heads:
                    raise ValueError("a cache without KV heads to split (a state or MLA layer) moves between equal TP "
                                     "sizes only")
                shares = [_Share(spec, self.layout, rank, h0, h1, plain=False)
                          for rank, h0, h1 in tp_shares(self.tp_rank, self.tp_size, spec.remote_tp,
                                                        self.layout.kv_heads)]
            except ValueError as e:
                why = f"refused: prefill TP size {spec.remote_tp}, this side {self.tp_size}: {e}"
        ld = _Load(spec, self.layout, self.tp_rank, shares, self.block_size)
        self._loads[ld.req] = ld
        if spec.error or why:
            return self._refuse_load(ld, spec.error or why)
        try:
            self.layout.check(spec.local_block_ids)
        except ValueError as e:
            return self._refuse_load(ld, f"refused: {e}")
        if spec.remote_block_size:  # the room: the prefill's blocks' tokens; the last block here starts inside it
            tokens, mine = spec.num_blocks * spec.remote_block_size, spec.skip + len(spec.local_block_ids)
            if self.layout.token_fingerprint(self.block_size) is None:
                return self._refuse_load(ld, f"refused: prefill block size {spec.remote_block_size}, this side "
                                             f"{self.block_size}: this side's blocks are not token-major (HND, or K "
                                             "and V in one block)")
            fits = (mine - 1) * self.block_size < tokens and mine * self.block_size > tokens - spec.remote_block_size
        elif isinstance(spec.num_blocks, int):
            fits = spec.skip + len(spec.local_block_ids) == spec.num_blocks
        else:
            fits = len(spec.num_blocks) == len(spec.skip) == len(spec.local_block_ids) and all(
                s + len(b) == n for n, b, s in zip(spec.num_blocks, spec.local_block_ids, spec.skip))
        if not fits:
            return self._refuse_load(ld, f"{len(_flat(spec.local_block_ids))} blocks after {spec.skip} cached, the "
                                         f"room has {spec.num_blocks}")
        self._load_open(ld)

    def _refuse_load(self, ld, why):
        """Fails a load refused before any room opened, and tells the prefill rank(s) to release what they staged
        for it (they would hold it until the stage timeout)."""
        self._load_fail(ld, why)
        spec = ld.spec
        self.cmd_drop(spec.remote_host, spec.remote_port, spec.remote_request_id, 0 if spec.mla else spec.remote_tp)

    def _load_open(self, ld):
        if ld.spec.mla and self.tp_size > 1:
            return self._load_open_shared(ld)
        for sh in ld.shares:
            if sh.room is not None or sh.final is not None:
                continue
            try:
                uid = next(self._uids)
                self._by_uid[uid] = ld
                sh.room, desc = self._c().recv_open(sh.nbytes, user_data=uid)
            except KvstageError as e:
                self._by_uid.pop(uid, None)
                if e.errno in (_errno.EMFILE, _errno.ENFILE, _errno.EAGAIN):
                    return  # no room handle free yet: the next step tries again
                if isinstance(e, (NotConnected, Timeout)):
                    raise
                return self._load_fail(ld, f"could not open a room: {e}")
            sh.uid = uid
            ld.uids[uid] = sh
            msg = {"t": "pull", "req": ld.spec.remote_request_id, "desc": base64.b64encode(desc).decode(),
                   "nbytes": sh.nbytes, "tp_rank": self.tp_rank, "tp_size": self.tp_size}
            if ld.spec.remote_block_size:
                self._token_msg(msg)
            elif sh.plain:
                msg["layout"] = self.layout.fingerprint()
            else:  # which of the model's KV heads this share holds, and how a share of them is laid out
                first = self.tp_rank * self.layout.kv_heads
                msg["heads"] = [first + sh.h0, first + sh.h1]
                msg["share"] = self.layout.share_fingerprint(sh.h0, sh.h1)
            try:
                self._send_msg(sh.endpoint, msg)
            except OSError as e:
                return self._load_fail(ld, f"could not reach the prefill worker at {sh.endpoint[0]}:{sh.endpoint[1]}: "
                                           f"{e}")
        ld.state = "open"

    def _token_msg(self, msg):
        """A pull from a side of another block size: the room is the prefill's blocks as tokens, and what both sides'
        tokens must agree on replaces the plain layout."""
        msg.pop("layout", None)
        msg["block_size"] = self.block_size
        msg["tokens"] = self.layout.token_fingerprint(self.block_size)

    def _load_open_shared(self, ld):
        """MLA with several ranks: rank 0 opens one room for every rank (readers: the TP size), tells the others its
        descriptor over their side channels and asks prefill rank 0 for the KV; rank r > 0 joins that room once the
        descriptor came. The bytes land once; each rank copies them into its own blocks."""
        sh = ld.shares[0]
        if sh.room is not None or sh.final is not None:
            return
        uid = next(self._uids)
        self._by_uid[uid] = ld
        desc = None
        try:
            if self.tp_rank == 0:
                sh.room, desc = self._c().recv_open(sh.nbytes, user_data=uid, readers=self.tp_size)
            else:
                joined = self._joins.pop(ld.req, None)
                if joined is None:
                    self._by_uid.pop(uid, None)
                    return  # rank 0's descriptor has not come yet
                sh.room = self._c().join(_sidechannel.desc_bytes(joined), user_data=uid)
        except (NotConnected, Timeout):
            raise
        except (KvstageError, ValueError) as e:
            self._by_uid.pop(uid, None)
            if isinstance(e, KvstageError) and e.errno in (_errno.EMFILE, _errno.ENFILE, _errno.EAGAIN):
                return  # no room handle free yet: the next step tries again
            return self._load_fail(ld, f"could not {'open' if self.tp_rank == 0 else 'join'} the shared room: {e}")
        sh.uid = uid
        ld.uids[uid] = sh
        ld.state = "open"
        if self.tp_rank != 0:
            if sh.room.nbytes != sh.nbytes:
                self._load_fail(ld, f"the shared room has {sh.room.nbytes} bytes, this rank expects {sh.nbytes}")
            return
        b64 = base64.b64encode(desc).decode()
        host, base = self._listen[0], self._listen[1] - self.tp_rank
        try:
            for rank in range(1, self.tp_size):
                self._send_msg((host, base + rank), {"t": "join", "req": ld.req, "desc": b64})
        except OSError as e:
            return self._load_fail(ld, f"could not tell decode rank {rank} the shared room (at {host}:{base + rank}): "
                                       f"{e}")
        msg = {"t": "pull", "req": ld.spec.remote_request_id, "desc": b64, "nbytes": sh.nbytes, "tp_rank": 0,
               "tp_size": self.tp_size, "layout": self.layout.fingerprint()}
        if ld.spec.remote_block_size:
            self._token_msg(msg)
        try:
            self._send_msg(sh.endpoint, msg)
        except OSError as e:
            self._load_fail(ld, f"could not reach the prefill worker at {sh.endpoint[0]}:{sh.endpoint[1]}: {e}")

    def cmd_abort(self, req):
        ld = self._loads.get(req)
        if ld is None or ld.reported:
            self._abort_t.pop(req, None)
            return  # never had it, or already reported: the scheduler has its blocks already
        ld.aborted = True
        self._stop_load(ld)
        ld.state = ld.state if ld.state == "done" else "failed"
        ld.why = ld.why or "aborted"
        self._load_report(ld)

    def cmd_drop(self, host, port, remote_req, remote_tp=0):
        """Tells the prefill rank(s) holding this rank's heads of remote_req to release its slots."""
        tp, remote_tp = self.tp_size, remote_tp or self.tp_size
        if self.mla:  # prefill rank 0 staged it; decode rank 0 speaks for this instance
            ranks = [0] if self.tp_rank == 0 else []
        elif tp >= remote_tp:
            ranks = [self.tp_rank // (tp // remote_tp)]
        else:
            ranks = [self.tp_rank * (remote_tp // tp) + i for i in range(remote_tp // tp)]
        for rank in ranks:
            try:
                self._send_msg((host, port + rank), {"t": "drop", "req": remote_req, "tp_rank": self.tp_rank,
                                                     "tp_size": tp})
            except OSError as e:
                logger.debug("kvstage connector: could not tell %s:%s to release %s: %s", host, port + rank, remote_req,
                             e)

    def _load_event(self, ld, ev):
        if ev.type == EventType.REJECTED:
            self._record("num_stale_rejections")
            return
        sh = ld.uids.get(ev.user_data)
        if sh is None:
            return
        sh.final = ev
        if ev.type == EventType.RECV_DONE and not ld.aborted and not ld.failed:
            ld.state = "copying"
            sh.job = self.copier.submit(self._copy_out_job(ld, sh))
            return self._load_progress(ld)
        if ev.type != EventType.RECV_DONE and not ld.aborted and not ld.failed:
            why = ("aborted by the prefill side, the proxy or a timeout" if ev.type == EventType.ABORTED
                   else f"failed: {ev.error}")
            room = "the room" if sh.plain else f"prefill rank {sh.rank}'s room (heads [{sh.h0}, {sh.h1}) here)"
            self._load_fail(ld, f"{room} was {why}")
        self._load_report(ld)

    def _stop_load(self, ld):
        """Stops a load: its copy-outs not started, its rooms aborted (their finals still to come)."""
        for sh in ld.shares:
            if sh.job is not None and sh.job.cancel():
                sh.job = None
            if sh.room is not None and sh.final is None:
                sh.room.abort_quietly()
            if sh.room is None:
                sh.final = sh.final or "no room"

    def _copy_out_job(self, ld, sh):
        room, copier, ss = sh.room, self.copier, self._c().slot_size
        spec = ld.spec
        if spec.remote_block_size:  # the prefill's blocks' tokens into this side's blocks
            pieces = plan(self.layout.token_extents(spec.num_blocks * spec.remote_block_size, spec.local_block_ids,
                                                    spec.skip, self.block_size), ss)
        elif sh.plain:
            pieces = self.layout.plan(spec.num_blocks, spec.local_block_ids, spec.skip, ss)
        else:  # into this share's heads of each block only
            pieces = plan(self.layout.share_extents(spec.num_blocks, spec.local_block_ids, spec.skip, sh.h0, sh.h1),
                          ss)

        def job():
            copy_room_out(room, pieces, copier)
        job.req_id, job.kind = ld.req, "load"
        return job

    def _load_progress(self, ld):
        if ld.state == "opening" and not ld.failed and not ld.aborted:
            self._load_open(ld)
        ended = False
        for sh in ld.shares:
            j = sh.job
            if j is None or not j.done():
                continue
            sh.job, ended = None, True
            if j.error is not None:
                self._load_fail(ld, f"copying the room into the blocks failed: {j.error!r}")
            elif j.state == "done":
                sh.copied = True
        if (ended and not ld.aborted and not ld.failed and ld.state != "done"
                and all(sh.copied for sh in ld.shares)):
            ld.state = "done"
            self._end(ld.req, "loaded")
            self._record("bytes_received", ld.nbytes)
        if ended:
            self._load_report(ld)

    def _load_fail(self, ld, why):
        if ld.failed or ld.aborted or ld.reported:
            return
        logger.info("kvstage connector: load of %s failed: %s", ld.req, why)
        self._record("num_failed_transfers")
        ld.failed, ld.state, ld.why = True, "failed", why
        self._stop_load(ld)
        self._load_report(ld)

    def _load_report(self, ld):
        """finished_recving once nothing of this load can write its blocks: every share's final event in, no
        copy-out can run."""
        if ld.reported or any(sh.final is None for sh in ld.shares) or ld.running():
            return
        if ld.state not in ("done", "failed"):
            return
        ld.reported = True
        self._end(ld.req, ld.why or ld.state)
        self._freed(ld.req)
        with self._lock:
            self._finished_recving.add(ld.req)
            if ld.failed and not ld.aborted:
                self._load_errors.update(_flat(ld.spec.local_block_ids))
        for sh in ld.shares:
            if sh.room is not None:
                try:
                    sh.room.close()
                except Exception:
                    pass
                sh.room = None
            self._by_uid.pop(sh.uid, None)
        ld.uids.clear()
        if self._loads.get(ld.req) is ld:
            del self._loads[ld.req]

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
    def _send_msg(self, endpoint, msg):
        """Sends one message to the prefill worker at endpoint (host, port); raises OSError
        (sidechannel.HandshakeError when the worker did not prove it holds the peer secret); see sidechannel.Peers."""
        self._peers.send(endpoint[0], endpoint[1], msg)
