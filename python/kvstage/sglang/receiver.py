"""kvstage.sglang: the decode side - the receiver, one per request on each decode rank."""
from __future__ import annotations

import base64
import errno as _errno
import logging
import os
import socket
import time
from typing import List, Optional

import numpy as np

from .. import checksum as _crc
from .. import lifecycle as _lc
from .._lib import KVS_MAX_READERS, KVS_ROOM_DESC_SIZE
from ..client import EventType
from ..errors import KvstageError
from ..plan import copy_room_out, plan
from .base import BaseKVReceiver, KVPoll, KVTransferError
from .layout import RoomLayout, state_counts_of
from .topology import decode_slices, rank_mapping, tp_sizes_unsupported
from .manager import KvstageKVManager
from .sender import _first_share

logger = logging.getLogger("kvstage.sglang")


class _RecvShare:
    """One rank pair's share of a request on the decode side: the prefill rank it comes from, the room it lands in,
    its copy-out. Equal attention-TP sizes: the only one, whole pages."""

    def __init__(self, receiver, prefill_rank, endpoint, dummy):
        self.receiver = receiver
        self.prefill_rank = prefill_rank
        self.endpoint = endpoint
        self.dummy = dummy                # SGLang's dummy rank (MLA, the prefill side wider): told, sends nothing
        self.meta = None
        self.sent = False
        self.pending_open = False
        self.room = self.uid = self.final = self.layout = self.extents = self.job = None
        self.landed = False               # its bytes are in the decode pages (or it had none)
        self.readers, self.join = 1, False  # MLA read once: a shared room's reader count; join: not its opener
        self.reply_room = self.reply_uid = self.reply_final = None  # a joiner's room for the shared room's descriptor
        self.key = None                   # the room's key (lifecycle events)
        self.room_nbytes = 0              # the room's size: the layout's bytes, and the checksums' trailer if any

    def _on_event(self, ev):
        self.receiver._on_share_event(self, ev)

    def _lost(self, reason):
        self.final = self.final or "lost"
        if self.job is not None and self.job.cancel():
            self.job = None
        self.room = None
        self.receiver._fail(reason)


class _DescReply:
    """A joining decode rank's small room, into which its prefill rank writes the shared room's descriptor."""

    def __init__(self, sh):
        self.sh = sh

    def _on_event(self, ev):
        self.sh.receiver._on_reply_event(self.sh, ev)

    def _lost(self, reason):
        self.sh.reply_final = self.sh.reply_final or "lost"
        self.sh.reply_room = None
        self.sh.receiver._fail(reason)


class KvstageKVReceiver(BaseKVReceiver):
    """Decode side of one request: opens its room (one per prefill rank it takes heads from when the attention-TP
    sizes differ), tells the prefill rank(s), copies the room(s) into its pages."""

    def __init__(self, mgr: KvstageKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None, **_kw):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.conclude_state = None
        self.require_staging = False
        self.waiting_timeout = mgr.waiting_timeout
        self.clear_timeout = mgr.clear_timeout
        self.init_time = None
        self._status = KVPoll.Bootstrapping
        self._reason = None
        self._aborted = False
        self._shares: List[_RecvShare] = []
        self._cleared = False
        self._abort_ns = None  # monotonic_ns of the engine's abort (lifecycle events)

    # what tests and older callers read: the first share's
    _room, _final, _uid, _layout, _endpoint = (_first_share(n)
                                               for n in ("room", "final", "uid", "layout", "endpoint"))

    # SGLang's calls ------------------------------------------------------------------------
    def init(self, prefill_dp_rank: int):
        """Finds the prefill rank(s) of DP rank prefill_dp_rank through the bootstrap server (the prefill rank checks
        the layout at meta)."""
        if self._status != KVPoll.Bootstrapping:
            return
        mgr = self.kv_mgr
        try:
            known = mgr.try_ensure_parallel_info(self.bootstrap_addr)
        except RuntimeError as e:
            return self._fail(str(e))
        info = mgr.prefill_info_table.get(self.bootstrap_addr) if known else None
        if info is None:
            return self._fail(f"Prefill server with bootstrap_addr: {self.bootstrap_addr} is unknown or down")
        P, D = int(info.attn_tp_size), mgr.attn_tp_size
        why = tp_sizes_unsupported(P, D)
        if why:
            return self._fail(f"prefill attn_tp_size {P} and this side's {D}: {why}; not supported by the kvstage "
                              "backend")
        if int(info.pp_size) != 1 or int(info.attn_cp_size) != 1:
            return self._fail("prefill pipeline or context parallelism is not supported by the kvstage backend")
        dp_size = int(info.dp_size or 1)
        try:
            prefill_dp_rank = int(prefill_dp_rank)
        except (TypeError, ValueError):
            prefill_dp_rank = -1
        if not 0 <= prefill_dp_rank < dp_size:
            return self._fail(f"prefill_dp_rank {prefill_dp_rank} is not one of the prefill server's {dp_size} "
                              "DP ranks")
        self.prefill_dp_rank = prefill_dp_rank
        real, ranks, _, _ = rank_mapping(P, D, int(mgr.kv_args.engine_rank), mgr.is_mla_backend)
        for p in ranks:
            endpoint = mgr.rank_endpoint(self.bootstrap_addr, prefill_dp_rank, p)
            if endpoint is None:
                self._shares.clear()
                return self._fail(f"Could not fetch bootstrap info for prefill_dp_rank {prefill_dp_rank} "
                                  f"target_tp_rank {p} from {self.bootstrap_addr}")
            self._shares.append(_RecvShare(self, p, endpoint, mgr.is_mla_backend and p != real))
        k = D // P
        if mgr.is_mla_backend and k > 1 and os.environ.get("KVSTAGE_SGLANG_MLA_SHARED", "1") != "0":
            # MLA read once: the k decode ranks of a prefill rank read one shared room (on this proxy: see SGLANG.md)
            if k > KVS_MAX_READERS:
                return self._fail(f"a shared room has at most {KVS_MAX_READERS} readers, not {k}")
            self._shares[0].readers, self._shares[0].join = k, bool(int(mgr.kv_args.engine_rank) % D % k)
        self.init_time = time.monotonic()
        self._status = KVPoll.WaitingForInput

    def send_metadata(self, kv_indices, aux_index: Optional[int] = None, state_indices: Optional[List] = None,
                      decode_prefix_len: Optional[int] = None, **_kw):
        """Opens the request's room(s) and tells the prefill rank(s) the descriptor(s) (pages stay on this side)."""
        if self._status != KVPoll.WaitingForInput:
            if self._status != KVPoll.Failed:
                self._fail(f"send_metadata() in state {self._status}, not WaitingForInput")
            return
        mgr = self.kv_mgr
        info = mgr.prefill_info_table[self.bootstrap_addr]
        P, D = int(info.attn_tp_size), mgr.attn_tp_size
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        has_aux = aux_index is not None and bool(mgr.mem.aux)
        counts = state_counts_of(state_indices, len(mgr.mem.state))
        if P != D and any(counts):
            return self._fail(f"state (mamba and the like) between attention-TP sizes {P} and {D} is not supported "
                              "by the kvstage backend")
        ps = int(getattr(mgr.kv_args, "page_size", 1) or 1)
        fingerprint = mgr.mem.fingerprint()
        first = next(sh for sh in self._shares if not sh.dummy)  # aux rides with the first share that moves bytes
        for sh in self._shares:
            tp = {"prefill_rank": sh.prefill_rank, "prefill_tp": P, "decode_rank": int(mgr.kv_args.engine_rank) % D,
                  "decode_tp": D, "dummy": sh.dummy}
            if sh.readers > 1:
                tp.update(readers=sh.readers, join=sh.join)
            try:
                slices = decode_slices(P, D, sh.prefill_rank, fingerprint["kv_item_lens"], ps, mgr.is_mla_backend)
                tp["slices"] = slices
                if sh.dummy:
                    sh.layout, sh.extents = RoomLayout(mgr.mem, 0, False, []), []
                else:
                    aux = has_aux and sh is first
                    sh.layout = RoomLayout(mgr.mem, pages.size, aux, counts, slices if P != D else None, ps)
                    sh.extents = (sh.layout.kv_extents(pages, 0)
                                  + (sh.layout.aux_extents(int(aux_index)) if aux else [])
                                  + sh.layout.state_extents(list(state_indices or [])))
            except ValueError as e:
                return self._fail(f"bad indices: {e}")
            sh.room_nbytes = sh.layout.nbytes
            if mgr.checksum and sh.layout.nbytes:
                sh.room_nbytes += _crc.trailer_size(sh.layout.nbytes, mgr.client().slot_size)
            sh.meta = {"t": "meta", "room": int(self.bootstrap_room), "npages": int(pages.size),
                       "aux": sh.layout.has_aux, "state_counts": sh.layout.state_counts, "nbytes": sh.room_nbytes,
                       "crc": mgr.checksum,
                       "prefix_len": int(decode_prefix_len or 0), "layout": fingerprint,
                       "kv_cache_dtype": getattr(mgr.server_args, "kv_cache_dtype", None),
                       "from": f"{socket.gethostname()}:{os.getpid()}"}
            sh.meta["tp"] = tp
        self._status = KVPoll.Transferring
        for sh in self._shares:
            self._open_and_tell(sh)
            if self._status == KVPoll.Failed:
                return
        self._check_jobs()

    def poll(self) -> int:
        self.kv_mgr.pump()
        if self._status == KVPoll.Transferring:
            for sh in self._shares:
                if sh.pending_open:
                    self._open_and_tell(sh)
        self._check_jobs()
        if (self._status in (KVPoll.WaitingForInput, KVPoll.Transferring) and self.init_time is not None
                and time.monotonic() - self.init_time > self.waiting_timeout):
            self._fail(f"Request {self.bootstrap_room} timed out after {self.waiting_timeout:.1f}s in "
                       f"KVPoll.{'WaitingForInput' if self._status == KVPoll.WaitingForInput else 'Transferring'}")
        if self._status == KVPoll.Failed and any(sh.job is not None and not sh.job.done() for sh in self._shares):
            return KVPoll.Transferring  # a copy-out already running must finish before Failed lets the pages go
        return self._status

    def failure_exception(self):
        raise KVTransferError(self.bootstrap_room, self._reason or "unknown failure")

    def abort(self):
        if self._status != KVPoll.Failed:
            self._abort_ns = time.monotonic_ns()
            self._trace(_lc.ABORT, phase=self.kv_mgr.phase_name(self._status))
        self._fail("Aborted by AbortReq.")

    def _trace(self, event, **fields):
        self.kv_mgr.trace_event(event, self.bootstrap_room, "consumer", **fields)

    @property
    def pages_released(self):
        """True once nothing of this request can write its decode pages any more and its rooms are closed: every
        room's final event came (or there was no room) and no copy-out of any can run."""
        return (self._status in (KVPoll.Success, KVPoll.Failed)
                and all((sh.uid is None or sh.final is not None) and (sh.job is None or sh.job.done())
                        and (sh.reply_uid is None or sh.reply_final is not None) for sh in self._shares))

    def clear(self):
        """Waits (clear_timeout at most) until pages_released, then forgets the request (kvstage.sglang's docstring)."""
        self._cleared = True
        if self._status not in (KVPoll.Success, KVPoll.Failed):
            self._fail("cleared before it finished")
        if not self.kv_mgr.wait_until(lambda: self.pages_released, self.clear_timeout):
            logger.error("kvstage backend: bootstrap_room %s: the room's final event did not come within %.1fs; "
                         "it stays tracked, its pages are not released", self.bootstrap_room, self.clear_timeout)
            return
        if self._abort_ns is not None:
            self._trace(_lc.ABORT_TO_REUSABLE, elapsed_ns=time.monotonic_ns() - self._abort_ns)
        self._close_room()

    # inner workings -------------------------------------------------------------------------
    def _open_and_tell(self, sh):
        mgr = self.kv_mgr
        sh.pending_open = False
        desc = None
        if sh.layout.nbytes == 0:
            sh.landed = True  # nothing to move
        else:
            try:
                c = mgr.client()
                if sh.join:  # the shared room's descriptor comes through the prefill rank; join it then
                    sh.reply_uid = mgr._register_obj(_DescReply(sh))
                    sh.reply_room, desc = c.recv_open(KVS_ROOM_DESC_SIZE, user_data=sh.reply_uid)
                else:
                    sh.uid = mgr._register_obj(sh)
                    sh.room, desc = c.recv_open(sh.room_nbytes, user_data=sh.uid, readers=sh.readers)
                    sh.key = _lc.room_key(desc)
                    self._trace(_lc.ROOM_OPEN, room=sh.key, bytes=sh.layout.nbytes)
            except KvstageError as e:
                mgr._objs.pop(sh.uid, None)
                mgr._objs.pop(sh.reply_uid, None)
                sh.uid = sh.reply_uid = None
                if e.errno in (_errno.EMFILE, _errno.ENFILE, _errno.EAGAIN):
                    sh.pending_open = True  # no room handle free yet: the next poll tries again
                    return
                return self._fail(f"could not open a room: {e}")
        msg = dict(sh.meta, desc=base64.b64encode(desc).decode() if desc else None)
        try:
            mgr.send_to(sh.endpoint, msg, failing=self)
            sh.sent = True
            self._trace(_lc.TRANSFER_STARTED, room=sh.key, block_count=int(sh.meta.get("npages", 0)))
        except OSError as e:
            self._fail(f"could not reach the prefill rank at {sh.endpoint}: {e}")

    def _copy_out_job(self, sh):
        room, extents, copier = sh.room, sh.extents, self.kv_mgr.copier
        ss = self.kv_mgr.client().slot_size
        payload = sh.layout.nbytes if sh.room_nbytes != sh.layout.nbytes else None

        def job():
            if payload is not None:  # every chunk as the sending engine copied it, or nothing is copied out
                _crc.verify(room, 0, payload, ss)
            copy_room_out(room, plan(extents, ss), copier)
        job.bootstrap_room = self.bootstrap_room
        return job

    def _check_jobs(self):
        for sh in self._shares:
            j = sh.job
            if j is None or not j.done():
                continue
            sh.job = None
            if isinstance(j.error, _crc.ChecksumMismatch):
                self.kv_mgr.checksum_failures += 1
                self._fail(f"end-to-end checksum mismatch, nothing copied out: {j.error}", phase="checksum")
            elif j.error is not None:
                self._fail(f"copying the room into the decode pages failed: {j.error!r}")
            elif j.state == "done" and self._status != KVPoll.Failed:
                sh.landed = True
                self._trace(_lc.COPY_OUT_DONE, room=sh.key, bytes=sh.layout.nbytes)
            self._close_share(sh)
        if (self._status == KVPoll.Transferring and self._shares
                and all(sh.landed and not sh.pending_open for sh in self._shares)):
            self._status = KVPoll.Success  # every share landed: only now are the pages the request's KV
            self.conclude_state = KVPoll.Success
            self._trace(_lc.TRANSFER_COMPLETED, bytes=sum(sh.layout.nbytes for sh in self._shares if sh.layout))

    def _on_reply_event(self, sh, ev):
        """A joining rank's descriptor room ended: on RECV_DONE it joins the shared room the descriptor names."""
        if ev.type == EventType.REJECTED:
            return
        sh.reply_final = ev
        mgr = self.kv_mgr
        if ev.type == EventType.RECV_DONE and not self._aborted:
            try:
                view = sh.reply_room.lease(0).view()
                desc = bytes(view[:KVS_ROOM_DESC_SIZE])
                del view
                sh.uid = mgr._register_obj(sh)
                sh.room = mgr.client().join(desc, user_data=sh.uid)
                sh.key = _lc.room_key(desc)
                self._trace(_lc.ROOM_OPEN, room=sh.key, bytes=sh.room.nbytes)
            except KvstageError as e:
                mgr._objs.pop(sh.uid, None)
                sh.uid = None
                self._fail(f"could not join the shared room (MLA read once; every decode rank of a prefill rank must "
                           f"use one kvstaged): {e}")
        elif ev.type != EventType.RECV_DONE and not self._aborted:
            self._fail("the shared room's descriptor never came: its room was aborted by the prefill side, the proxy "
                       "or a timeout")
        self._close_reply(sh)

    def _close_reply(self, sh):
        if sh.reply_room is not None and sh.reply_final is not None:
            try:
                sh.reply_room.close()
            except Exception:
                pass
            sh.reply_room = None
            self.kv_mgr._objs.pop(sh.reply_uid, None)

    def _on_share_event(self, sh, ev):
        if ev.type == EventType.REJECTED:
            return
        sh.final = ev
        self._trace(_lc.ROOM_FINAL, room=sh.key, final=_lc.final_name(ev.type), status=ev.status)
        if self._abort_ns is not None and all(s.final is not None or s.uid is None for s in self._shares):
            self._trace(_lc.ABORT_TO_FINAL, elapsed_ns=time.monotonic_ns() - self._abort_ns)
        if ev.type == EventType.RECV_DONE and not self._aborted:
            sh.job = self.kv_mgr.copier.submit(self._copy_out_job(sh))
            return self._check_jobs()
        if ev.type != EventType.RECV_DONE and not self._aborted:
            why = ("aborted by the prefill side, the proxy or a timeout" if ev.type == EventType.ABORTED
                   else f"failed: {ev.error}")
            whose = f" (the share of prefill rank {sh.prefill_rank})" if len(self._shares) > 1 else ""
            self._fail(f"the room was {why}{whose}")
        if sh.job is None:
            self._close_share(sh)

    def _fail(self, reason, phase=None):
        """Fails the request on this rank: queued copy-outs are cancelled, every open room is aborted and every
        prefill rank whose share has not ended is told (so every rank of the request ends)."""
        if self._status == KVPoll.Failed:
            return
        logger.debug("kvstage backend: decode bootstrap_room %s failed: %s", self.bootstrap_room, reason)
        if self._abort_ns is None:
            self._trace(_lc.TRANSFER_FAILED, phase=phase or self.kv_mgr.phase_name(self._status))
        self._status, self._reason, self.conclude_state = KVPoll.Failed, reason, KVPoll.Failed
        self._aborted = True
        for sh in self._shares:
            sh.pending_open = False
            if sh.job is not None and sh.job.cancel():
                sh.job = None
            if sh.room is not None and sh.final is None:
                sh.room.abort_quietly()
            if sh.reply_room is not None and sh.reply_final is None:
                sh.reply_room.abort_quietly()
            if sh.endpoint is not None and sh.final is None:
                try:  # the room has not ended: the prefill rank learns now, even before it has opened the room
                    self.kv_mgr.send_to(sh.endpoint, {"t": "abort", "room": int(self.bootstrap_room)})
                except OSError:
                    pass

    def _lost(self, reason):
        for sh in self._shares:
            sh.final = sh.final or "lost"
            sh.reply_final = sh.reply_final or "lost"
            if sh.job is not None and sh.job.cancel():
                sh.job = None
            sh.room = sh.reply_room = None
        self._fail(reason)

    def _close_share(self, sh):
        if sh.room is not None and sh.final is not None and (sh.job is None or sh.job.done()):
            try:
                sh.room.close()
            except Exception:
                pass
            sh.room = None
            self.kv_mgr._objs.pop(sh.uid, None)

    def _close_room(self):
        for sh in self._shares:
            self._close_share(sh)
            self._close_reply(sh)

    def __repr__(self):
        return f"<KvstageKVReceiver room={self.bootstrap_room} status={self._status} {self._reason or ''}>"
