"""kvstage.sglang: the prefill side - the sender, one per request on each prefill rank."""
from __future__ import annotations

import collections
import ctypes
import errno as _errno
import logging
import os
import time
from typing import List, Optional

import numpy as np

from .. import checksum as _crc
from .. import lifecycle as _lc
from .._lib import KVS_ROOM_DESC_SIZE
from ..client import EventType
from ..errors import KvstageError, NotConnected, PoolExhausted, Timeout
from ..plan import Extent, needs_view, plan
from ..sidechannel import desc_bytes
from .base import BaseKVSender, KVPoll, KVTransferError, KVTransferMetric
from .layout import RoomLayout
from .messages import _decode_rank_of, _http
from .manager import KvstageKVManager

logger = logging.getLogger("kvstage.sglang")


def _first_share(name):
    """A request's attribute that is its first share's (its only one when both sides have one TP size)."""
    return property(lambda self: getattr(self._shares[0], name) if self._shares else None)


class _SendShare:
    """One rank pair's share of a request on the prefill side: the decode rank's meta message, the room it opened,
    the slots being filled for it. Equal attention-TP sizes: the only one, whole pages."""

    def __init__(self, sender, meta):
        self.sender = sender
        self.meta = meta
        self.decode_rank = _decode_rank_of(meta)
        self.slices = None
        self.room = self.uid = self.final = self.layout = self.written = None
        self.next_chunk = 0               # the sender's chunks taken into extents so far
        self.extents = collections.deque()
        self.leases = {}                  # chunk -> Lease being filled
        self.views = {}
        self.unsent = []                  # chunks full but not yet taken (ring full)
        self.in_flight = {}               # (slot, epoch) -> Lease sent, until the room ends (a REJECTED one comes back)
        self.sent_chunks = 0
        self.done = False                 # SEND_DONE, or every byte of a room-less share handled
        tp = meta.get("tp") or {}
        self.join = bool(tp.get("join"))  # MLA read once: a reader of the shared room; its room takes the descriptor
        self.readers = int(tp.get("readers", 1))
        self.relayed = False
        self.key = None                   # the room's key (lifecycle events)
        self.crc = bool(meta.get("crc"))  # end-to-end checksums: the room ends with its chunks' CRCs
        self.piece_crcs = collections.defaultdict(list)  # slot -> [(off, nbytes, CRC)] of payload pieces
        self.crcs_owed = []               # (slot, off, nbytes) of device pieces, CRCed once their copy landed
        self.trailer = None               # the trailer's bytes once built (kept for its copy)

    def _on_event(self, ev):
        self.sender._on_share_event(self, ev)

    def _lost(self, reason):
        self.final = self.final or "lost"
        self.room = None
        self.sender._fail(reason)


class KvstageKVSender(BaseKVSender):
    """Prefill side of one request: copies its pages into slots of the decode side's room (one room per decode rank
    it serves when the attention-TP sizes differ, each its share of the heads)."""

    def __init__(self, mgr: KvstageKVManager, bootstrap_addr: str, bootstrap_room: int, dest_tp_ranks: List[int],
                 pp_rank: int, req_has_disagg_prefill_dp_rank: bool = False, **_kw):
        self.kv_mgr = mgr
        self.bootstrap_server_url = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.aux_index = None
        self.num_kv_indices = None
        self.curr_idx = 0
        self.conclude_state = None
        self.bootstrap_timeout = mgr.bootstrap_timeout
        self._status = KVPoll.Bootstrapping
        self._reason = None
        self._created = time.monotonic()
        self._shares: List[_SendShare] = []
        self._required = None             # decode ranks this rank sends the request to (from the first meta)
        self._chunks = []                 # (pages, first_pos, last, state_indices), every share takes each
        self._last_queued = False
        self._t_first = self._t_done = None
        self._abort_ns = None  # monotonic_ns of the engine's abort (lifecycle events)
        if bootstrap_room in mgr.senders:
            self._fail(f"a second sender for bootstrap_room {bootstrap_room} on this rank")
            return
        mgr.senders[bootstrap_room] = self
        if bootstrap_room in mgr.tombstones:
            self._fail("aborted by the decode side before the prefill side had the request")
            return
        dp_size = int(getattr(mgr.server_args, "dp_size", 1) or 1) if mgr.server_args is not None else 1
        if dp_size > 1 and not req_has_disagg_prefill_dp_rank:  # CommonKVSender.__init__'s rule, its words
            if getattr(mgr.server_args, "load_balance_method", "follow_bootstrap_room") != "follow_bootstrap_room":
                self._register_prefill_dp_rank()
            elif mgr.attn_dp_rank != bootstrap_room % dp_size:
                if os.environ.get("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK", "").lower() in (
                        "1", "true", "yes", "y", "on"):
                    self._register_prefill_dp_rank()
                else:
                    self._fail(f"follow_bootstrap_room conflict: dispatched to dp_rank {mgr.attn_dp_rank} but "
                               f"bootstrap_room {bootstrap_room} implies dp_rank {bootstrap_room % dp_size}. Set "
                               "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 to allow mixed routing.")
                    return
        pending = mgr.pending_meta.pop(bootstrap_room, None)
        for meta in (pending[0] if pending is not None else ()):
            self._offer(meta)

    def _register_prefill_dp_rank(self):
        """Tells the bootstrap server this request's DP rank (POST /register_dp_rank), for the decode side's
        /query_dp_ranks when rooms do not name DP ranks (load_balance_method other than follow_bootstrap_room)."""
        status, text = _http("POST", f"http://{self.bootstrap_server_url}/register_dp_rank",
                             {"bootstrap_room": self.bootstrap_room, "dp_rank": self.kv_mgr.attn_dp_rank})
        if status != 200:
            logger.error("kvstage backend: failed to register prefill dp_rank: %s, %s", status, text)

    # what tests and older callers read: the first share's
    _meta, _room, _final, _layout = (_first_share(n) for n in ("meta", "room", "final", "layout"))

    @property
    def _sent_chunks(self):
        return sum(sh.sent_chunks for sh in self._shares)

    # SGLang's calls ------------------------------------------------------------------------
    def init(self, num_kv_indices: int, aux_index: Optional[int] = None):
        """Sets the request's page count and aux row (after WaitingForInput)."""
        self.num_kv_indices = int(num_kv_indices)
        self.aux_index = aux_index
        for sh in self._shares:
            self._make_layout(sh)

    def pop_decode_prefix_len(self) -> int:
        return int(self._meta.get("prefix_len", 0)) if self._meta else 0

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk  # the last chunk carries aux and state even without pages

    def send(self, kv_indices, state_indices=None, token_position_offset: int = 0):
        """Queues one chunk of page indices (the last one also aux and state) and copies what it can now; never
        blocks."""
        if self._status == KVPoll.Failed:
            return
        if self.num_kv_indices is None:
            return self._fail("send() before init()")
        if self._last_queued:
            logger.warning("kvstage backend: bootstrap_room %s: send() after the last chunk ignored",
                           self.bootstrap_room)
            return
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        first = self.curr_idx
        self.curr_idx += int(pages.size)
        last = self.curr_idx >= self.num_kv_indices
        if self.curr_idx > self.num_kv_indices:
            return self._fail(f"{self.curr_idx} pages sent, init() said {self.num_kv_indices}")
        if self._t_first is None:
            self._t_first = time.monotonic()
            self._trace(_lc.TRANSFER_STARTED, block_count=self.num_kv_indices)
        self._last_queued = last
        self._chunks.append((pages, first, last, state_indices))
        if self._status == KVPoll.WaitingForInput:
            self._status = KVPoll.Transferring
        self._progress()

    def poll(self) -> int:
        self.kv_mgr.pump()
        if self._status == KVPoll.Bootstrapping and time.monotonic() - self._created > self.bootstrap_timeout:
            self._fail(f"Request {self.bootstrap_room} timed out after {self.bootstrap_timeout:.1f}s in "
                       "KVPoll.Bootstrapping")
        elif self._status in (KVPoll.WaitingForInput, KVPoll.Transferring):
            self._progress()
        return self._status

    def failure_exception(self):
        raise KVTransferError(self.bootstrap_room, self._reason or "unknown failure")

    def get_transfer_metric(self):
        lat = (self._t_done - self._t_first) if (self._t_done and self._t_first) else None
        nbytes = sum(sh.layout.nbytes for sh in self._shares if sh.layout is not None)
        return KVTransferMetric(transfer_latency_s=lat, transfer_total_bytes=nbytes if self._shares else None)

    def abort(self):
        if self._status != KVPoll.Failed:
            self._abort_ns = time.monotonic_ns()
            self._trace(_lc.ABORT, phase=self.kv_mgr.phase_name(self._status))
        self._fail("Aborted by AbortReq.")

    def _trace(self, event, **fields):
        self.kv_mgr.trace_event(event, self.bootstrap_room, "producer", **fields)

    def clear(self):
        """Forgets the request (its pages are the engine's again); an unfinished room is aborted."""
        mgr = self.kv_mgr
        if mgr.senders.get(self.bootstrap_room) is self:
            del mgr.senders[self.bootstrap_room]
            if self._status != KVPoll.Success:
                mgr.tombstones[self.bootstrap_room] = time.monotonic()
        if self._status not in (KVPoll.Success, KVPoll.Failed):
            self._fail("cleared before it finished")
        self._close_room()

    # inner workings -------------------------------------------------------------------------
    def _offer(self, meta):
        """A decode rank's meta message for this request: adopts its share (opens its room) or refuses it."""
        mgr = self.kv_mgr
        if self._status == KVPoll.Failed:
            return mgr._reject(meta, "the prefill side already aborted this request")
        d = _decode_rank_of(meta)
        if any(sh.decode_rank == d for sh in self._shares) or (
                self._required is not None and len(self._shares) >= self._required):
            return mgr._reject(meta, "a second transfer request for a room in use")
        sh = _SendShare(self, meta)
        self._shares.append(sh)
        if sh.crc != mgr.checksum and not sh.join and not (meta.get("tp") or {}).get("dummy"):
            on = {True: "on", False: "off"}
            return self._fail(f"end-to-end checksums: {on[sh.crc]} on the decode side, {on[mgr.checksum]} here "
                              "(KVSTAGE_CHECKSUM must be the same on both)", reject=True)
        try:
            sh.slices, required = mgr.share_for(meta)
        except ValueError as e:
            return self._fail(str(e), reject=True)
        if self._required is None:
            self._required = required
        elif required != self._required:
            return self._fail(f"misrouted share: decode ranks of different attention-TP sizes ask for this request "
                              f"({required} and {self._required} decode ranks per prefill rank)", reject=True)
        dummy = bool((meta.get("tp") or {}).get("dummy"))
        if meta.get("desc") and not dummy:
            try:
                sh.uid = mgr._register_obj(sh)
                sh.room = mgr.client().send_open(desc_bytes(meta["desc"]), user_data=sh.uid)
            except (KvstageError, ValueError) as e:
                mgr._objs.pop(sh.uid, None)  # no room: no final event will come for it
                sh.uid = None
                return self._fail(f"could not open the decode side's room: {e}")
            sh.key = _lc.room_key(desc_bytes(meta["desc"]))
            self._trace(_lc.ROOM_OPEN, room=sh.key, bytes=sh.room.nbytes)
            want = KVS_ROOM_DESC_SIZE if sh.join else int(meta["nbytes"])
            if sh.room.nbytes != want:
                return self._fail(f"the room has {sh.room.nbytes} bytes, the request {want}")
            sh.written = [0] * sh.room.chunks
        elif meta.get("desc"):
            return self._fail("misrouted share: a dummy share with a room", reject=True)
        if len(self._shares) == self._required and self._status == KVPoll.Bootstrapping:
            self._status = KVPoll.WaitingForInput
        self._make_layout(sh)
        if self._status == KVPoll.Transferring:
            self._progress()

    def _make_layout(self, sh):
        if sh.meta is None or self.num_kv_indices is None or sh.layout is not None or self._status == KVPoll.Failed:
            return
        m, mem = sh.meta, self.kv_mgr.mem
        if (m.get("tp") or {}).get("dummy") or sh.join:  # a dummy rank, or a reader of a shared room: no KV here
            sh.layout = RoomLayout(mem, 0, False, [])
            return
        if int(m["npages"]) != self.num_kv_indices:
            return self._fail(f"the decode side expects {m['npages']} pages, this side has {self.num_kv_indices}")
        if m["aux"] and not (self.aux_index is not None and mem.aux):
            return self._fail("the decode side expects aux and this side sends none")
        try:
            sh.layout = RoomLayout(mem, self.num_kv_indices, m["aux"], m["state_counts"], sh.slices,
                                   int(getattr(self.kv_mgr.kv_args, "page_size", 1) or 1))
        except ValueError as e:
            return self._fail(str(e))
        want = sh.layout.nbytes + (_crc.trailer_size(sh.layout.nbytes, self.kv_mgr.client().slot_size)
                                   if sh.crc and sh.layout.nbytes else 0)
        if want != int(m["nbytes"]):
            return self._fail(f"a room of {want} bytes here, the decode side made {m['nbytes']}")

    def _progress(self):
        """Copies queued chunks into slots and hands full slots to the rooms, as far as the pool allows."""
        if self._status == KVPoll.Failed or not self._shares or len(self._shares) != self._required:
            return
        for sh in self._shares:
            if sh.done or sh.join and sh.relayed:
                continue
            if sh.join:
                self._relay_shared_desc(sh)
            elif sh.layout is not None:
                self._progress_share(sh)
            if self._status == KVPoll.Failed:
                return
        self._check_done()

    def _check_done(self):
        if (self._status != KVPoll.Failed and len(self._shares) == self._required
                and all(sh.done for sh in self._shares)):
            self._status, self._t_done = KVPoll.Success, time.monotonic()
            self.conclude_state = KVPoll.Success
            self._trace(_lc.TRANSFER_COMPLETED, bytes=sum(sh.layout.nbytes for sh in self._shares if sh.layout))

    def _relay_shared_desc(self, sh):
        """MLA read once: writes the shared room's descriptor (the opening decode rank's) into the small room a joining
        decode rank opened for it; that rank then joins the shared room (one landing, every reader)."""
        opener = next((x for x in self._shares if x.readers > 1 and not x.join), None)
        if opener is None or sh.room is None:
            return
        if int(sh.meta["nbytes"]) != int(opener.meta["nbytes"]):
            return self._fail(f"misrouted share: decode rank {sh.decode_rank} expects {sh.meta['nbytes']} bytes, the "
                              f"shared room of decode rank {opener.decode_rank} has {opener.meta['nbytes']}")
        c = self.kv_mgr.client()
        try:
            (lease,) = c.acquire(1)
        except PoolExhausted:
            return  # retried at the next poll
        try:
            view = lease.view()
            view[:KVS_ROOM_DESC_SIZE] = desc_bytes(opener.meta["desc"])
            del view
            sh.room.send(lease, 0, KVS_ROOM_DESC_SIZE)
            sh.in_flight[lease.key] = lease
            sh.relayed = True
        except (NotConnected, Timeout) as e:
            self.kv_mgr._broken(e)
        except (KvstageError, ValueError) as e:
            try:
                c.release(lease)
            except KvstageError:
                pass
            if not (isinstance(e, KvstageError) and e.errno == _errno.EAGAIN):
                self._fail(f"sending the shared room's descriptor failed: {e}")

    def _progress_share(self, sh):
        lay = sh.layout
        try:
            while sh.next_chunk < len(self._chunks):
                pages, first, last, state_indices = self._chunks[sh.next_chunk]
                sh.next_chunk += 1
                sh.extents.extend(lay.kv_extents(pages, first) if lay.npages else ())  # a dummy share: no pages
                if last:
                    if self.aux_index is not None:
                        sh.extents.extend(lay.aux_extents(int(self.aux_index)))
                    sh.extents.extend(lay.state_extents(list(state_indices or [])))
                    sh.extents.append(None)  # end marker
        except ValueError as e:
            return self._fail(f"bad indices: {e}")
        if sh.room is None:  # a room of 0 bytes, or a dummy share: nothing to move
            if sh.extents and sh.extents[-1] is None:
                sh.extents.clear()
                sh.done = True
            return
        c = self.kv_mgr.client()
        ss = c.slot_size
        cp = self.kv_mgr.copier
        copied = False
        try:
            while sh.extents:
                head = sh.extents[0]
                if head is None and sh.crc and sh.trailer is None:  # every payload piece copied: the trailer next
                    if copied:
                        cp.sync()
                        copied = False
                        self._fill_crcs(sh)
                    self._queue_trailer(sh, ss)
                    continue
                if head is None:
                    sh.extents.popleft()
                    break
                if isinstance(head, Extent):  # its copies, each inside one slot
                    sh.extents.popleft()
                    sh.extents.extendleft(reversed(plan([head], ss)))
                    continue
                s = head.slot
                lease = sh.leases.get(s)
                if lease is None:
                    try:
                        (lease,) = c.acquire(1)
                    except PoolExhausted:
                        break  # retried at the next poll
                    sh.leases[s] = lease
                view = sh.views.get(s)
                if view is None and needs_view(head):
                    view = sh.views[s] = lease.view()
                if sh.crc and sh.trailer is None:
                    crc = cp.copy_in_crc(lease, view, head)
                    if crc is None:
                        sh.crcs_owed.append((s, head.off, head.nbytes))
                    else:
                        sh.piece_crcs[s].append((head.off, head.nbytes, crc))
                else:
                    cp.copy_in(lease, view, head)
                copied = True
                sh.extents.popleft()
                sh.written[s] += head.nbytes
                if sh.written[s] == sh.room.chunk_len(s):
                    sh.unsent.append(s)
            if copied:
                cp.sync()
                self._fill_crcs(sh)
            while sh.unsent:
                s = sh.unsent[0]
                sh.views.pop(s, None)
                lease = sh.leases[s]
                sh.room.send(lease, s * ss, sh.room.chunk_len(s))
                sh.in_flight[lease.key] = lease
                del sh.leases[s]
                sh.unsent.pop(0)
                sh.sent_chunks += 1
        except (NotConnected, Timeout) as e:
            self.kv_mgr._broken(e)
        except KvstageError as e:
            if e.errno == _errno.EAGAIN:
                return  # ring full: the next poll sends
            self._fail(f"sending a chunk failed: {e}")
        except (BufferError, RuntimeError, ValueError) as e:
            self._fail(f"copying pages failed: {e}")

    def _fill_crcs(self, sh):
        """The CRCs of device pieces, from their slots, once copied (before a slot of theirs is sent)."""
        for s, off, n in sh.crcs_owed:
            sh.piece_crcs[s].append((off, n, _crc.crc32c(sh.leases[s].address + off, n)))
        sh.crcs_owed.clear()

    def _queue_trailer(self, sh, ss):
        """Every payload piece is in its slot: the trailer (its chunks' CRCs) becomes the next pieces to copy, before
        the end marker."""
        payload = sh.layout.nbytes
        crcs = [_crc.combine(sh.piece_crcs.pop(i, ()), min(ss, payload - i * ss))
                for i in range(_crc.chunks(payload, ss))]
        t = _crc.trailer(crcs)
        sh.trailer = (ctypes.c_ubyte * len(t)).from_buffer_copy(t)
        sh.extents.extendleft(reversed(plan([Extent(payload, ctypes.addressof(sh.trailer), len(t), len(t), (0,),
                                                    False)], ss)))

    def _on_share_event(self, sh, ev):
        if ev.type == EventType.REJECTED:
            back = sh.in_flight.pop(tuple(ev.lease), None)  # the client gave it back to us: release it
            if back is not None:
                try:
                    self.kv_mgr.client().release(back)
                except KvstageError:
                    pass
            return self._fail(f"the proxy refused a chunk: {ev.error}")
        sh.final = ev
        sh.in_flight.clear()
        self._trace(_lc.ROOM_FINAL, room=sh.key, final=_lc.final_name(ev.type), status=ev.status)
        if self._abort_ns is not None and all(s.final is not None for s in self._shares):
            self._trace(_lc.ABORT_TO_FINAL, elapsed_ns=time.monotonic_ns() - self._abort_ns)
        if ev.type == EventType.SEND_DONE:
            sh.done = True
            self._check_done()
        elif self._status != KVPoll.Failed:
            why = ("aborted by the decode side, the proxy or a timeout" if ev.type == EventType.ABORTED
                   else f"failed: {ev.error}")
            whose = f" (the share of decode rank {sh.decode_rank})" if len(self._shares) > 1 else ""
            self._fail(f"the room was {why}{whose}")
        self._close_share(sh)

    def _fail(self, reason, reject=False):
        """Fails the request on this rank: every share's slots go back, every open room is aborted (so every decode
        rank it serves fails too), and a decode rank whose room this rank never opened has it aborted."""
        if self._status == KVPoll.Failed:
            return
        logger.debug("kvstage backend: prefill bootstrap_room %s failed: %s", self.bootstrap_room, reason)
        if self._abort_ns is None:
            self._trace(_lc.TRANSFER_FAILED, phase=self.kv_mgr.phase_name(self._status))
        self._status, self._reason, self.conclude_state = KVPoll.Failed, reason, KVPoll.Failed
        self._chunks.clear()
        c = self.kv_mgr._client
        for sh in self._shares:
            sh.extents.clear()
            sh.unsent.clear()
            sh.views.clear()
            for lease in sh.leases.values():
                try:
                    c.release(lease)
                except Exception:
                    pass
            sh.leases.clear()
            if sh.room is not None and sh.final is None:
                sh.room.abort_quietly()
            elif sh.room is None and sh.final is None and (reject or sh.meta.get("desc")):
                self.kv_mgr._reject(sh.meta, reason)

    def _lost(self, reason):
        for sh in self._shares:
            sh.final = sh.final or "lost"
            sh.room = None
        self._fail(reason)

    def _close_share(self, sh):
        if sh.room is None:
            return
        try:
            sh.room.close()  # unfinished: closing aborts it; its final event still comes, then it is forgotten
        except Exception:
            pass
        if sh.final is not None:
            sh.room = None
            self.kv_mgr._objs.pop(sh.uid, None)

    def _close_room(self):
        for sh in self._shares:
            self._close_share(sh)

    def __repr__(self):
        return f"<KvstageKVSender room={self.bootstrap_room} status={self._status} {self._reason or ''}>"
