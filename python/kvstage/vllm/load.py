"""kvstage.vllm: the agent's decode half - loads (a room opened, its descriptor sent to the prefill rank, its bytes
copied into the request's blocks at RECV_DONE), and what aborts and drops them."""
from __future__ import annotations

import base64
import errno as _errno
import logging
import time

from .. import checksum as _crc
from .. import lifecycle as _lc
from .. import sidechannel as _sidechannel
from ..client import EventType
from ..errors import KvstageError, NotConnected, Timeout
from ..plan import copy_room_out, plan
from .config import head_shares
from .layout import _flat

logger = logging.getLogger("kvstage.vllm")  # one logger for the whole connector


class _Share:
    """One room of a load: what one prefill rank sends this rank. plain: the request's whole KV in the plain layout
    (equal TP sizes); else heads [h0, h1) of this rank's blocks in the share layout."""
    __slots__ = ("rank", "h0", "h1", "plain", "endpoint", "nbytes", "room", "uid", "final", "job", "copied", "key",
                 "payload")

    def __init__(self, spec, layout, rank, h0=0, h1=0, plain=True, block_size=0, crc_slot_size=0):
        self.rank, self.h0, self.h1, self.plain = rank, h0, h1, plain
        self.endpoint = (spec.remote_host, spec.remote_port + rank)
        if spec.remote_block_size:  # the prefill's blocks, token-major: its plain layout
            self.nbytes = layout.token_nbytes(spec.num_blocks * spec.remote_block_size, block_size)
        elif plain:
            self.nbytes = layout.nbytes(spec.num_blocks)
        else:
            self.nbytes = layout.share_nbytes(spec.num_blocks, h0, h1)
        self.payload = self.nbytes  # with checksums (crc_slot_size: the chunk size) the room has a trailer too
        if crc_slot_size:
            self.nbytes += _crc.trailer_size(self.payload, crc_slot_size)
        self.room = self.uid = self.final = self.job = self.key = None
        self.copied = False


class _Load:
    """Decode side of one request: its rooms (one per prefill rank holding some of this rank's heads: tp_shares),
    then each one's copy-out into its heads of the request's blocks. Done once every share is copied; one share
    failing fails the load."""

    def __init__(self, spec, layout, tp_rank, shares=None, block_size=0, crc_slot_size=0):
        self.spec = spec
        self.req = spec.req_id
        self.shares = shares or [_Share(spec, layout, tp_rank, block_size=block_size, crc_slot_size=crc_slot_size)]
        self.nbytes = sum(sh.nbytes for sh in self.shares)
        self.endpoint = self.shares[0].endpoint
        self.deadline = time.monotonic() + spec.load_timeout
        self.uids = {}  # a room's user_data -> its share
        self.state = "opening"  # opening -> open -> copying -> done; or failed
        self.aborted = self.failed = self.reported = False
        self.why = None
        self.abort_ns = None  # monotonic_ns of the abort (lifecycle events)

    @property
    def room(self):
        return self.shares[0].room

    def running(self):
        """True while a share's copy-out may still write the blocks."""
        return any(sh.job is not None and not sh.job.done() for sh in self.shares)


class _LoadSide:
    """The decode half of _Agent (agent.py), which holds the state it uses (self._loads, the connection, ...)."""

    def cmd_recv(self, spec):
        if spec.req_id in self._loads:
            return
        shares, why = None, None
        crc_ss = self._c().slot_size if self.checksum else 0
        if spec.remote_tp and spec.remote_tp != self.tp_size:
            try:
                shares = [_Share(spec, self.layout, rank, h0, h1, plain=False, crc_slot_size=crc_ss)
                          for rank, h0, h1 in head_shares(self.layout, self.tp_rank, self.tp_size, spec.remote_tp)]
            except ValueError as e:
                why = f"refused: prefill TP size {spec.remote_tp}, this side {self.tp_size}: {e}"
        # MLA: the one room comes from the prefill rank that staged it; else this rank's pair (equal TP sizes)
        ld = _Load(spec, self.layout, spec.mla_rank if spec.mla else self.tp_rank, shares, self.block_size, crc_ss)
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
        self._trace(_lc.TRANSFER_STAGED, ld, block_count=len(_flat(spec.local_block_ids)), bytes=ld.nbytes)
        self._load_open(ld)

    def _trace(self, event, ld, **fields):
        self.trace.emit(event, ld.req, role="consumer", remote_request_id=ld.spec.remote_request_id,
                        tp_rank=self.tp_rank, **fields)

    def _trace_open(self, ld, sh, desc):
        sh.key = _lc.room_key(desc)
        self._trace(_lc.ROOM_OPEN, ld, room=sh.key, bytes=sh.nbytes)

    def _refuse_load(self, ld, why):
        """Fails a load refused before any room opened, and tells the prefill rank(s) to release what they staged
        for it (they would hold it until the stage timeout)."""
        self._load_fail(ld, why)
        spec = ld.spec
        self.cmd_drop(spec.remote_host, spec.remote_port, spec.remote_request_id, 0 if spec.mla else spec.remote_tp,
                      spec.mla_rank)

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
            self._trace_open(ld, sh, desc)
            msg = {"t": "pull", "req": ld.spec.remote_request_id, "desc": base64.b64encode(desc).decode(),
                   "nbytes": sh.nbytes, "tp_rank": self.tp_rank, "tp_size": self.tp_size, "crc": self.checksum}
            if ld.spec.remote_block_size:
                self._token_msg(msg)
            elif sh.plain:
                msg["layout"] = self.layout.fingerprint()
            else:  # which of the model's KV heads this share holds, and how a share of them is laid out
                first = self.tp_rank * self.layout.kv_heads
                msg["heads"] = [first + sh.h0, first + sh.h1]
                msg["share"] = self.layout.share_fingerprint(sh.h0, sh.h1)
            try:
                self._send_msg(sh.endpoint, msg, failing=ld)
            except OSError as e:
                return self._load_fail(ld, f"could not reach the prefill worker at {sh.endpoint[0]}:{sh.endpoint[1]}: "
                                           f"{e}")
            self._trace(_lc.TRANSFER_STARTED, ld, room=sh.key)
        ld.state = "open"

    def _token_msg(self, msg):
        """A pull from a side of another block size: the room is the prefill's blocks as tokens, and what both sides'
        tokens must agree on replaces the plain layout."""
        msg.pop("layout", None)
        msg["block_size"] = self.block_size
        msg["tokens"] = self.layout.token_fingerprint(self.block_size)

    def _load_open_shared(self, ld):
        """MLA with several ranks: the leader (the decode rank paired with the prefill rank that staged the request,
        spec.mla_leader) opens one room for every rank (readers: the TP size), tells the others its descriptor over
        their side channels and asks that prefill rank for the KV; every other rank joins that room once the
        descriptor came. The bytes land once; each rank copies them into its own blocks."""
        sh = ld.shares[0]
        if sh.room is not None or sh.final is not None:
            return
        uid = next(self._uids)
        self._by_uid[uid] = ld
        desc = None
        leader = ld.spec.mla_leader
        try:
            if self.tp_rank == leader:
                sh.room, desc = self._c().recv_open(sh.nbytes, user_data=uid, readers=self.tp_size)
            else:
                joined = self._joins.pop(ld.req, None)
                if joined is None:
                    self._by_uid.pop(uid, None)
                    return  # rank 0's descriptor has not come yet
                desc = _sidechannel.desc_bytes(joined)
                sh.room = self._c().join(desc, user_data=uid)
        except (NotConnected, Timeout):
            raise
        except (KvstageError, ValueError) as e:
            self._by_uid.pop(uid, None)
            if isinstance(e, KvstageError) and e.errno in (_errno.EMFILE, _errno.ENFILE, _errno.EAGAIN):
                return  # no room handle free yet: the next step tries again
            return self._load_fail(ld, f"could not {'open' if self.tp_rank == leader else 'join'} the shared room: {e}")
        sh.uid = uid
        ld.uids[uid] = sh
        ld.state = "open"
        self._trace_open(ld, sh, desc)
        if self.tp_rank != leader:
            if sh.room.nbytes != sh.nbytes:
                self._load_fail(ld, f"the shared room has {sh.room.nbytes} bytes, this rank expects {sh.nbytes}")
            return
        b64 = base64.b64encode(desc).decode()
        host, base = self._listen[0], self._listen[1] - self.tp_rank
        try:
            for rank in range(self.tp_size):
                if rank != leader:
                    self._send_msg((host, base + rank), {"t": "join", "req": ld.req, "desc": b64}, failing=ld)
        except OSError as e:
            return self._load_fail(ld, f"could not tell decode rank {rank} the shared room (at {host}:{base + rank}): "
                                       f"{e}")
        msg = {"t": "pull", "req": ld.spec.remote_request_id, "desc": b64, "nbytes": sh.nbytes, "tp_rank": leader,
               "tp_size": self.tp_size, "layout": self.layout.fingerprint(), "crc": self.checksum}
        if ld.spec.remote_block_size:
            self._token_msg(msg)
        try:
            self._send_msg(sh.endpoint, msg, failing=ld)
        except OSError as e:
            return self._load_fail(ld, f"could not reach the prefill worker at {sh.endpoint[0]}:{sh.endpoint[1]}: {e}")
        self._trace(_lc.TRANSFER_STARTED, ld, room=sh.key)

    def cmd_abort(self, req):
        ld = self._loads.get(req)
        if ld is None or ld.reported:
            self._abort_t.pop(req, None)
            return  # never had it, or already reported: the scheduler has its blocks already
        ld.abort_ns = time.monotonic_ns()
        self._trace(_lc.ABORT, ld, phase=ld.state)
        ld.aborted = True
        self._stop_load(ld)
        if all(sh.final is not None for sh in ld.shares):  # no room was open: nothing to wait for
            self._trace(_lc.ABORT_TO_FINAL, ld, elapsed_ns=time.monotonic_ns() - ld.abort_ns)
        ld.state = ld.state if ld.state == "done" else "failed"
        ld.why = ld.why or "aborted"
        self._load_report(ld)

    def cmd_drop(self, host, port, remote_req, remote_tp=0, mla_rank=0):
        """Tells the prefill rank(s) holding this rank's heads of remote_req to release its slots (MLA: the one that
        staged it, mla_rank)."""
        tp, remote_tp = self.tp_size, remote_tp or self.tp_size
        if self.mla:  # one prefill rank staged it; decode rank 0 speaks for this instance
            ranks = [mla_rank] if self.tp_rank == 0 else []
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
        self._trace(_lc.ROOM_FINAL, ld, room=sh.key, final=_lc.final_name(ev.type), status=ev.status)
        if ld.abort_ns is not None and all(s.final is not None for s in ld.shares):
            self._trace(_lc.ABORT_TO_FINAL, ld, elapsed_ns=time.monotonic_ns() - ld.abort_ns)
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

        crc = sh.payload != sh.nbytes

        def job():
            if crc:  # every chunk as the sending engine copied it, or nothing is copied out
                _crc.verify(room, 0, sh.payload, ss)
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
            if isinstance(j.error, _crc.ChecksumMismatch):
                self._record("num_checksum_failures")
                self._load_fail(ld, f"end-to-end checksum mismatch, nothing copied out: {j.error}", phase="checksum")
            elif j.error is not None:
                self._load_fail(ld, f"copying the room into the blocks failed: {j.error!r}")
            elif j.state == "done":
                sh.copied = True
                self._trace(_lc.COPY_OUT_DONE, ld, room=sh.key, bytes=sh.nbytes)
        if (ended and not ld.aborted and not ld.failed and ld.state != "done"
                and all(sh.copied for sh in ld.shares)):
            ld.state = "done"
            self._end(ld.req, "loaded")
            self._record("bytes_received", ld.nbytes)
            self._trace(_lc.TRANSFER_COMPLETED, ld, bytes=ld.nbytes)
        if ended:
            self._load_report(ld)

    def _load_fail(self, ld, why, phase=None):
        if ld.failed or ld.aborted or ld.reported:
            return
        logger.info("kvstage connector: load of %s failed: %s", ld.req, why)
        self._record("num_failed_transfers")
        self._trace(_lc.TRANSFER_FAILED, ld, phase=phase or ld.state)
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
        if ld.abort_ns is not None:
            self._trace(_lc.ABORT_TO_REUSABLE, ld, elapsed_ns=time.monotonic_ns() - ld.abort_ns)
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
