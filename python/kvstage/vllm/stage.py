"""kvstage.vllm: the agent's prefill half - stages (a request's blocks copied into leased slots, per layer), and the
pulls the decode side sends over the side channel, each given a room's sending half."""
from __future__ import annotations

import collections
import ctypes
import errno as _errno
import logging
import time

from .. import checksum as _crc
from .. import lifecycle as _lc
from .. import sidechannel as _sidechannel
from ..client import EventType
from ..errors import Again, KvstageError, NotConnected, PoolExhausted, Timeout
from ..plan import Extent, needs_view, plan
from .config import head_shares, mla_reader
from .layout import _cdiv

logger = logging.getLogger("kvstage.vllm")  # one logger for the whole connector


class _Stage:
    """Prefill side of one request: its blocks copied into slots, waiting for (then handed to) its rooms.

    With the decode side's TP size this side's (shares None) one room holds the request's KV in the plain layout.
    Else one room per decode rank this rank serves (tp_shares), each holding that rank's heads of every block in the
    share layout (VllmLayout.share_extents); share j's bytes are slots [j * part_chunks, (j + 1) * part_chunks) of the
    stage, its room's chunk i slot j * part_chunks + i."""

    def __init__(self, spec, layout, ss, shares=None, crc=False):
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
        # checksums (kvstage.checksum): each part's room is its payload, then the CRCs of the payload's chunks
        self.crc, self.payload = crc, self.part_nbytes
        if crc:
            self.part_nbytes += _crc.trailer_size(self.payload, ss)
        self.piece_crcs = collections.defaultdict(list)  # slot -> [(off, nbytes, CRC)] of payload pieces
        self.trailers = None  # each part's trailer, once every payload chunk's CRC is known (kept for the copy)
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
        self.keys = [None] * self.nparts  # each room's key (lifecycle events)
        self.abort_ns = None  # monotonic_ns of an abort (lifecycle events: abort_to_final)

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


class _StageSide:
    """The prefill half of _Agent (agent.py), which holds the state it uses (self._stages, the connection, ...)."""

    def cmd_stage(self, spec):
        if spec.req_id in self._stages:
            old = self._stages.pop(spec.req_id)  # a restage after a preemption
            self._stage_fail(old, "staged again", failure=False)
        try:
            c = self._c()
        except KvstageError as e:  # no proxy: nothing is staged (the blocks are freed when the request ends)
            logger.error("kvstage connector: cannot stage %s: %s", spec.req_id, e)
            return self._end(spec.req_id, f"no connection to kvstaged: {e}")
        if self.mla and self.tp_rank != spec.mla_rank:
            return self._end(spec.req_id, f"MLA: prefill rank {spec.mla_rank} stages this request (every rank holds "
                                          "its KV; the ranks take turns)")
        shares, why = None, None
        if spec.decode_tp and spec.decode_tp != self.tp_size:
            try:
                shares = head_shares(self.layout, self.tp_rank, self.tp_size, spec.decode_tp)
            except ValueError as e:
                why = f"refused: decode TP size {spec.decode_tp}, this side {self.tp_size}: {e}"
        st = _Stage(spec, self.layout, c.slot_size, shares, crc=self.checksum)
        self._stages[st.req] = st
        if why is not None:
            return self._stage_fail(st, why)
        try:
            self.layout.check(st.blocks)
        except ValueError as e:
            return self._stage_fail(st, f"refused: {e}")
        if st.chunks > c.slot_count:
            self._stage_fail(st, f"{st.nbytes} bytes do not fit the pool ({c.slot_count} slots)")

    def cmd_unstage(self, req):
        st = self._stages.pop(req, None)
        if st is not None:
            self._stage_fail(st, "preempted: its blocks were freed", failure=False)
            self._end(req, "preempted")
        self._freed(req)  # no copy reads its blocks any more (_stage_fail cancelled or waited for them)
        if st is not None and not st.reported:
            self._stage_reusable(st)

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
            self._stage_reap(st)  # a copy that ended after the stage did: its report waits for none
            return self._stage_report(st)
        c = self._c()
        st.starved = False
        if st.pieces and st.leases is None:
            try:
                st.leases = c.acquire(st.chunks)  # all or none: a half-staged request never holds slots
            except PoolExhausted:
                st.starved = True
                return
            self.trace.emit(_lc.SLOTS_LEASED, st.req, role="producer", chunks=st.chunks, bytes=st.nbytes,
                            tp_rank=self.tp_rank)
        self._stage_copy(st)
        if not self._stage_reap(st):
            return
        if st.crc and st.trailers is None and st.sealed and not st.pieces and not st.jobs and st.leases is not None:
            try:
                self._post_trailers(st)
            except ValueError as e:
                return self._stage_fail(st, f"internal error: the checksums of the copy into slots: {e}")
            self._stage_copy(st)
            if not self._stage_reap(st):
                return
        if any(r is not None and f is None for r, f in zip(st.rooms, st.finals)):
            self._stage_send(st)
        self._stage_report(st)  # before the state says so: whoever sees "ready" knows the report is out
        if st.state == "staging" and st.copied:
            self._stage_copied(st)
        if st.state == "ready" and len(st.sent) == st.chunks:
            st.state = "sending"

    def _stage_reap(self, st):
        """Forgets the stage's copy jobs that ran; fails the stage and returns False if one failed."""
        for h in list(st.jobs):
            if h.done():
                st.jobs.remove(h)
                if h.error is not None:
                    self._stage_fail(st, f"copying blocks into slots failed: {h.error!r}")
                    return False
        return True

    def _stage_copy(self, st):
        """Hands the stage's pieces waiting to be copied to the copier, as one job."""
        if not st.pieces:
            return
        batch = []
        while st.pieces:
            p = st.pieces.popleft()
            s = p.slot
            view = st.views.get(s)
            if view is None and needs_view(p):
                view = st.views[s] = st.leases[s].view()
            batch.append((st.leases[s], view, p))
        st.jobs.append(self.copier.submit(self._stage_job(st, batch)))

    def _post_trailers(self, st):
        """Every payload piece is in its slot: each part's trailer (its chunks' CRCs, combined from its pieces')
        becomes the pieces still to copy. Raises ValueError when a chunk's pieces do not tile it."""
        ss, pchunks = st.ss, _crc.chunks(st.payload, st.ss)
        st.trailers = []
        for j in range(st.nparts):
            crcs = []
            for i in range(pchunks):
                crcs.append(_crc.combine(st.piece_crcs.pop(j * st.part_chunks + i, ()),
                                         min(ss, st.payload - i * ss)))
            t = _crc.trailer(crcs)
            buf = (ctypes.c_ubyte * len(t)).from_buffer_copy(t)
            st.trailers.append(buf)
            st.pieces.extend(plan([Extent(j * st.part_chunks * ss + st.payload, ctypes.addressof(buf), len(t),
                                          len(t), (0,), False)], ss))

    def _stage_job(self, st, batch):
        copier = self.copier
        crcs = st.crc and st.trailers is None  # payload pieces: their CRCs go into the trailers

        def job():
            got = []
            for lease, view, p in batch:
                if crcs:
                    got.append(copier.copy_in_crc(lease, view, p))
                else:
                    copier.copy_in(lease, view, p)
            copier.sync()  # before any slot counts as full (and so can be sent)
            for (lease, _, p), c in zip(batch, got):
                if c is None:  # a device piece: its bytes are in the slot now
                    c = _crc.crc32c(lease.address + p.off, p.nbytes)
                st.piece_crcs[p.slot].append((p.off, p.nbytes, c))
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

    def _stage_copied(self, st):
        st.state = "ready"
        self.trace.emit(_lc.COPY_IN_DONE, st.req, role="producer", bytes=st.nbytes, tp_rank=self.tp_rank)

    def _stage_reusable(self, st):
        if st.abort_ns is not None:
            self.trace.emit(_lc.ABORT_TO_REUSABLE, st.req, role="producer",
                            elapsed_ns=time.monotonic_ns() - st.abort_ns, tp_rank=self.tp_rank)

    def _stage_report(self, st):
        """finished_sending once the request's blocks cannot be read by a copy any more."""
        if st.finish_known and st.delayed and not st.reported and not st.jobs and (st.copied or st.terminal):
            st.reported = True
            with self._lock:  # one step for a reader: the report is out only once the state says so
                if st.state == "staging" and st.copied:
                    self._stage_copied(st)
                self._finished_sending.add(st.req)
            self._freed(st.req)
            self._stage_reusable(st)
        if (st.terminal and st.all_final and (st.reported or (st.finish_known and not st.delayed))
                and self._stages.get(st.req) is st):
            del self._stages[st.req]

    def _stage_fail(self, st, why, failure=True):
        """Fails a stage; failure: it counts in num_failed_transfers (not for an abort, preemption or release)."""
        if st.terminal:
            return
        if failure:
            self._record("num_failed_transfers")
            self.trace.emit(_lc.TRANSFER_FAILED, st.req, role="producer", phase=st.state, tp_rank=self.tp_rank)
        else:  # preempted, released by the decode side, ended without a hand-off, staged again
            st.abort_ns = time.monotonic_ns()
            self.trace.emit(_lc.ABORT, st.req, role="producer", phase=st.state, tp_rank=self.tp_rank)
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
        if st.all_final and st.abort_ns is not None:  # no room was open: nothing to wait for
            self.trace.emit(_lc.ABORT_TO_FINAL, st.req, role="producer", elapsed_ns=time.monotonic_ns() - st.abort_ns,
                            tp_rank=self.tp_rank)
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
        aborted = st.abort_ns is not None  # before this final (an abort it causes traces its own)
        st.finals[j] = ev
        self.trace.emit(_lc.ROOM_FINAL, st.req, role="producer", room=st.keys[j], final=_lc.final_name(ev.type),
                        status=ev.status, tp_rank=self.tp_rank)
        if ev.type == EventType.SEND_DONE and not st.terminal:
            if all(f is not None and getattr(f, "type", None) == EventType.SEND_DONE for f in st.finals):
                st.state = "done"
                self._end(st.req, "sent")
                self._record("bytes_sent", st.nbytes)
                self.trace.emit(_lc.TRANSFER_COMPLETED, st.req, role="producer", bytes=st.nbytes,
                                tp_rank=self.tp_rank)
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
            if aborted:
                self.trace.emit(_lc.ABORT_TO_FINAL, st.req, role="producer",
                                elapsed_ns=time.monotonic_ns() - st.abort_ns, tp_rank=self.tp_rank)
        self._stage_report(st)

    def _share_of(self, st, rank):
        """The index of the share of stage st that decode rank `rank` loads, or None (it loads none of this rank's)."""
        if self.mla:
            return 0  # the one stage every decode rank reads (the shared room of the decode rank paired with this one)
        if st.shares is None:
            return 0 if rank == self.tp_rank else None
        return next((j for j, (d, _, _) in enumerate(st.shares) if d == rank), None)

    def _on_side_msg(self, msg):
        if msg["t"] == "drop":
            st = self._stages.get(msg["req"])
            j = self._share_of(st, msg.get("tp_rank", self.tp_rank)) if st is not None else 0
            if j is None or (st is None and not self.mla and msg.get("tp_rank", self.tp_rank) != self.tp_rank
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
        if self.mla:  # the decode rank paired with this one opens the shared room of what this rank staged
            want = mla_reader(self.tp_rank, self.tp_size, dtp) if isinstance(dtp, int) and dtp > 0 else None
            if d != want:
                return self._reject(msg, f"MLA: prefill rank {self.tp_rank} serves decode rank {want} of TP size "
                                         f"{dtp}, not decode rank {d} (remote_port misconfigured?)")
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
        if bool(msg.get("crc")) != st.crc:
            on = {True: "on", False: "off"}
            return self._reject(msg, f"end-to-end checksums: {on[bool(msg.get('crc'))]} on the decode side, "
                                     f"{on[st.crc]} here (kvstage_checksum must be the same on both)")
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
        st.keys[j] = _lc.room_key(desc)
        self.trace.emit(_lc.ROOM_OPEN, st.req, role="producer", room=st.keys[j], bytes=st.part_nbytes,
                        tp_rank=self.tp_rank)
        self.trace.emit(_lc.TRANSFER_STARTED, st.req, role="producer", room=st.keys[j], tp_rank=self.tp_rank)
