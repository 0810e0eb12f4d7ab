"""kvstage.sglang: the manager - one kvstage connection per engine rank; every sender and receiver polls through
it."""
from __future__ import annotations

import dataclasses
import errno as _errno
import itertools
import logging
import os
import queue
import socket
import time
from typing import TYPE_CHECKING, Dict, Optional

from .. import checksum as _crc
from .. import lifecycle as _lc
from .. import sidechannel as _sidechannel
from ..client import Client
from ..errors import KvstageError, NotConnected, Timeout
from ..plan import CpuCopier, CudaCopier
from ..sidechannel import FrameListener, desc_bytes
from .base import _env_float, _mode, BaseKVManager, KVArgs, KVPoll, PrefillServerInfo
from .layout import MemoryMap
from .topology import head_slice, tp_sizes_unsupported
from .messages import _decode_rank_of, _http, _is_int, _url_host, check_side_message

if TYPE_CHECKING:  # the senders import this module
    from .sender import KvstageKVSender

logger = logging.getLogger("kvstage.sglang")


def _parallel(server_args, args):
    """Returns (attn_tp_size, attn_tp_rank, attn_dp_size, attn_dp_rank), from SGLang's runtime when it has one."""
    try:
        from sglang.srt.runtime_context import get_parallel  # type: ignore
        from sglang.srt.layers.dp_attention import get_attention_dp_rank, get_attention_dp_size  # type: ignore
        p = get_parallel()
        return p.attn_tp_size, p.attn_tp_rank, get_attention_dp_size(), get_attention_dp_rank()
    except Exception:
        pass
    try:
        from sglang.srt.layers.dp_attention import (  # type: ignore
            get_attention_dp_rank, get_attention_dp_size, get_attention_tp_rank, get_attention_tp_size)
        return get_attention_tp_size(), get_attention_tp_rank(), get_attention_dp_size(), get_attention_dp_rank()
    except Exception:
        pass
    tp = int(getattr(server_args, "tp_size", 1) or 1)
    dp = int(getattr(server_args, "dp_size", 1) or 1)
    attn_dp = dp if getattr(server_args, "enable_dp_attention", False) else 1
    attn_tp = max(tp // attn_dp, 1)
    rank = int(getattr(args, "engine_rank", 0) or 0)
    return attn_tp, rank % attn_tp, attn_dp, (rank // attn_tp) if attn_dp > 1 else 0


def _local_host(server_args):
    h = os.environ.get("KVSTAGE_SGLANG_HOST")
    if h:
        return h
    try:
        from sglang.srt.utils.network import get_local_ip_auto  # type: ignore
        return get_local_ip_auto()
    except Exception:
        pass
    h = getattr(server_args, "host", None)
    if h and h not in ("0.0.0.0", "::"):
        return h
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class KvstageKVManager(BaseKVManager):
    """One engine rank's side: its kvstage connection, its buffers (KVArgs), the bootstrap registration (prefill)
    or the prefill lookups (decode). Attributes the scheduler and tests may set: bootstrap_timeout, waiting_timeout,
    clear_timeout (seconds; each request copies them at creation), copier (CpuCopier or CudaCopier)."""

    INBOX_MAX = 256    # side-channel messages waiting for pump() (prefill)
    ROOMS_MAX = 65536  # rooms kept in pending_meta, and in tombstones, each (prefill)

    def __init__(self, args: KVArgs, disaggregation_mode, server_args, is_mla_backend: Optional[bool] = False):
        self.kv_args = args
        self.server_args = server_args
        self.disaggregation_mode = disaggregation_mode
        self.mode = _mode(disaggregation_mode)
        self.is_mla_backend = bool(is_mla_backend)
        if int(getattr(args, "dcp_size", 1) or 1) > 1:
            raise RuntimeError("kvstage backend: decode-context parallelism (dcp_size > 1) is not supported")
        # the side channel's key: no peer secret (or a refused one) is a start-up error, not a per-request one
        self._side_key = _sidechannel.load_key(getattr(server_args, "kvstage_peer_secret_file", None))
        kv_device = self._kv_on_device(server_args)
        self.mem = MemoryMap(args, kv_device)
        if kv_device:
            if os.environ.get("KVSTAGE_SGLANG_CUDA") != "1":
                raise RuntimeError(
                    f"kvstage backend: the KV cache is on device {getattr(server_args, 'device', 'cuda')!r}; the CUDA "
                    "path (libkvstage_cuda) is written but untested (no GPU on the development machine). "
                    "Set KVSTAGE_SGLANG_CUDA=1 to use it anyway, or run the KV cache in host memory.")
            self.copier = CudaCopier(int(getattr(args, "gpu_id", 0) or 0))
        else:
            self.copier = CpuCopier()
        self.bootstrap_timeout = _env_float("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300)
        self.waiting_timeout = _env_float("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300)
        self.clear_timeout = _env_float("KVSTAGE_SGLANG_CLEAR_TIMEOUT", 10)
        self.socket_path = getattr(server_args, "kvstage_socket", None) or os.environ.get("KVSTAGE_SOCKET")
        (self.attn_tp_size, self.attn_tp_rank, self.attn_dp_size, self.attn_dp_rank) = _parallel(server_args, args)
        self.attn_cp_size, self.attn_cp_rank = 1, 0
        self.pp_size = int(getattr(server_args, "pp_size", 1) or 1)
        self.pp_rank = int(getattr(args, "pp_rank", 0) or 0)
        self.system_dp_size = (1 if getattr(server_args, "enable_dp_attention", False)
                               else int(getattr(server_args, "dp_size", 1) or 1))
        self.system_dp_rank = int(getattr(args, "system_dp_rank", 0) or 0)
        self.bootstrap_host = getattr(server_args, "host", "127.0.0.1")
        self.bootstrap_port = getattr(server_args, "disaggregation_bootstrap_port", 8998)
        self._client = None
        self._uids = itertools.count(1)
        self._objs: Dict[int, object] = {}  # room user_data -> sender/receiver (kept until the room's final event)
        self.closed = False
        self.enable_staging = False
        if self.mode == "prefill":
            # Bounded: past INBOX_MAX messages the listener's thread waits for pump() to take some, reading
            # nothing meanwhile, and TCP holds the senders back; nothing is dropped (at most INBOX_MAX frames of
            # the side channel's 1 MiB each wait here)
            self._inbox = queue.Queue(maxsize=self.INBOX_MAX)
            self.local_ip = _local_host(server_args)
            self._listener = FrameListener(self.local_ip, 0, self._inbox_put,
                                           lambda m: True, "sglang",  # each message checked in _drain_inbox
                                           self._side_key)
            self.rank_port = self._listener.port
            self.senders: Dict[int, "KvstageKVSender"] = {}
            self.pending_meta: Dict[int, tuple] = {}   # bootstrap_room -> (meta, arrival time)
            self.tombstones: Dict[int, float] = {}     # bootstrap_room -> when it was aborted
            self.register_to_bootstrap()
        else:
            self.prefill_info_table: Dict[str, PrefillServerInfo] = {}
            self.connection_pool: Dict[str, dict] = {}
            # one connection and one sender thread per prefill rank: the scheduler's thread only queues (a silent
            # rank costs its own requests, never the scheduler's time)
            self._peers = _sidechannel.AsyncPeers(self._side_key)
            self._recompute_pool = None                # retract rebootstrap: POSTs /generate off the scheduler thread
            # (receiver, reason) from other threads (a failed rebootstrap, a side-channel message that could not be
            # delivered), applied by pump()
            self._recompute_failed = queue.SimpleQueue()
        self.client()  # connect now: a missing proxy is a start-up error, not a per-request one
        # lifecycle events ($KVSTAGE_TRACE_SAMPLE_RATE above 0; where: $KVSTAGE_TRACE), keyed by bootstrap_room,
        # which both sides of a request know
        self.trace = _lc.create(connector="KvstageKVManager", transfer_mode="push", component="worker")
        # end-to-end checksums (kvstage.checksum): both sides alike; loads that failed theirs
        self.checksum = _crc.setting(os.environ.get("KVSTAGE_CHECKSUM"), "$KVSTAGE_CHECKSUM")
        self.checksum_failures = 0

    @staticmethod
    def _kv_on_device(server_args):
        mem = os.environ.get("KVSTAGE_SGLANG_KV_MEMORY", "auto")
        if mem == "auto":
            mem = str(getattr(server_args, "device", "cuda") or "cuda")
        if mem == "cpu":
            return False
        if mem.startswith("cuda"):
            return True
        raise RuntimeError(f"kvstage backend: KV cache on device {mem!r} is not supported (cpu or cuda)")

    # -- the connection -------------------------------------------------------------------
    def client(self):
        """Returns the kvstage Client, connecting if needed; raises KvstageError."""
        if self.closed:
            raise KvstageError(-_errno.EBADF, None, "the kvstage manager is closed")
        if self._client is None:
            self._client = Client(self.socket_path)
        return self._client

    def _broken(self, exc):
        """The connection is gone or out of step: every open request fails (nothing of theirs can land), reconnect
        later."""
        logger.error("kvstage backend: connection to kvstaged lost (%s); failing %d requests", exc, len(self._objs))
        objs, self._objs = list(self._objs.values()), {}
        for o in objs:
            o._lost(f"connection to kvstaged lost: {exc}")
        c, self._client = self._client, None
        try:
            c.close()
        except Exception:
            pass

    def _register_obj(self, obj):
        uid = next(self._uids)
        self._objs[uid] = obj
        return uid

    def _dispatch(self, evs):
        for ev in evs:
            obj = self._objs.get(ev.user_data)
            if obj is not None:
                obj._on_event(ev)

    def pump(self):
        """Takes the side channel's messages and the proxy's events, and hands each to its request (never blocks)."""
        if self.mode == "prefill":
            self._drain_inbox()
        else:
            self._drain_recompute_failures()
        if self._client is None:
            return
        try:
            while True:
                evs = self._client.poll(128)
                self._dispatch(evs)
                if len(evs) < 128:
                    break
        except (NotConnected, Timeout) as e:
            self._broken(e)

    def wait_until(self, pred, timeout):
        """Pumps, blocking on the proxy's events, until pred() or timeout seconds; returns pred()."""
        deadline = time.monotonic() + timeout
        while True:
            self.pump()
            if pred():
                return True
            left = deadline - time.monotonic()
            if left <= 0 or self._client is None:
                return pred()
            try:
                self._dispatch(self._client.wait(min(left, 0.05)))
            except (NotConnected, Timeout) as e:
                self._broken(e)

    def close(self):
        """Fails what is left, closes the connection (the proxy reclaims everything) and the side channel."""
        if self.closed:
            return
        for o in list(self._objs.values()):
            o._lost("the kvstage manager closed")
        self._objs.clear()
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
            self._client = None
        self.closed = True
        self.trace.close()
        if self.mode == "prefill":
            self._listener.close()
        else:
            if self._recompute_pool is not None:
                self._recompute_pool.shutdown(wait=False, cancel_futures=True)
            self._peers.close(timeout=1.0)  # its threads are daemons: one stuck in a connect ends with it

    def trace_event(self, event, bootstrap_room, role, **fields):
        """Emits a lifecycle event of the request bootstrap_room (never blocks)."""
        self.trace.emit(event, str(bootstrap_room), role=role, tp_rank=self.attn_tp_rank, **fields)

    @staticmethod
    def phase_name(status):
        """A KVPoll state's name in a lifecycle event ("transferring", ...)."""
        for name in ("Bootstrapping", "WaitingForInput", "Transferring", "Success", "Failed"):
            if getattr(KVPoll, name, object()) == status:
                return name.lower()
        return str(status)

    # -- prefill side ---------------------------------------------------------------------
    def register_to_bootstrap(self):
        """Registers this prefill rank (its side channel's address) with the bootstrap server (PUT /route), with
        the payload SGLang's CommonKVManager sends (the server answers 500 to one that lacks a field)."""
        dist = getattr(self.server_args, "dist_init_addr", None)
        if dist:
            host = dist.rsplit(":", 1)[0].strip("[]")
        else:
            host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.bootstrap_host, self.bootstrap_host)
        url = f"http://{_url_host(host)}:{self.bootstrap_port}/route"
        payload = {
            "attn_tp_size": self.attn_tp_size, "attn_tp_rank": self.attn_tp_rank,
            "attn_cp_size": self.attn_cp_size, "attn_cp_rank": self.attn_cp_rank,
            "attn_dp_size": self.attn_dp_size, "attn_dp_rank": self.attn_dp_rank,
            "pp_size": self.pp_size, "pp_rank": self.pp_rank,
            "system_dp_size": self.system_dp_size, "system_dp_rank": self.system_dp_rank,
            "rank_ip": self.local_ip, "rank_port": self.rank_port,
            "page_size": getattr(self.kv_args, "page_size", None),
            "kv_cache_dtype": getattr(self.server_args, "kv_cache_dtype", None),
            "load_balance_method": getattr(self.server_args, "load_balance_method", "follow_bootstrap_room"),
            "enable_dsa_cache_layer_split": getattr(self.server_args, "enable_dsa_cache_layer_split", False),
            "prefill_http_port": getattr(self.server_args, "port", None),
        }
        delay = 0.5
        for attempt in range(6):
            status, text = _http("PUT", url, payload)
            if status == 200:
                return
            logger.warning("kvstage backend: registering with the bootstrap server %s failed (%s: %s), attempt %d",
                           url, status, text, attempt + 1)
            time.sleep(delay)
            delay = min(delay * 2, 8)
        logger.error("kvstage backend: this prefill rank could not register with the bootstrap server at %s", url)

    def _inbox_put(self, msg):
        """The listener's deliver(): waits while the inbox is full (back-pressure), never past close()."""
        while not self.closed:
            try:
                return self._inbox.put(msg, timeout=0.1)
            except queue.Full:
                continue

    def _remember(self, table, room, value):
        """Adds room to pending_meta or tombstones, which a holder of the secret could otherwise grow with a room id
        a message till the bootstrap timeout: past ROOMS_MAX the oldest goes (its messages refused, as at the
        timeout)."""
        table[room] = value
        while len(table) > self.ROOMS_MAX:
            old, v = next(iter(table.items()))
            del table[old]
            if table is self.pending_meta:
                for m in v[0]:
                    self._reject(m, f"more than {self.ROOMS_MAX} rooms wait for their request on this prefill rank: "
                                    "the oldest is dropped")

    def _drain_inbox(self):
        now = time.monotonic()
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
            why = check_side_message(msg)
            if why is not None:
                self._reject_malformed(msg, why)
                continue
            room = msg["room"]
            kind = msg.get("t")
            if kind == "meta":
                s = self.senders.get(room)
                if room in self.tombstones:
                    self._reject(msg, "the prefill side already aborted this request")
                elif s is not None:
                    s._offer(msg)
                else:  # the decode ranks may ask before this rank has the request: kept until its sender comes
                    if room not in self.pending_meta:
                        self._remember(self.pending_meta, room, ([], now))
                    waiting = self.pending_meta[room][0]
                    if any(_decode_rank_of(m) == _decode_rank_of(msg) for m in waiting):
                        self._reject(msg, "a second transfer request for a room in use")
                    else:
                        waiting.append(msg)
            elif kind == "abort":
                s = self.senders.get(room)
                pending = self.pending_meta.pop(room, None)
                for m in (pending[0] if pending is not None else ()):
                    self._reject(m, "aborted by the decode side")
                if s is None:
                    self._remember(self.tombstones, room, now)
                elif s._status != KVPoll.Success:  # a transfer that completed stays complete
                    s._fail("aborted by the decode side")
        for room, (msgs, t) in list(self.pending_meta.items()):  # decode asked, this rank never had the request
            if now - t > self.bootstrap_timeout:
                del self.pending_meta[room]
                for m in msgs:
                    self._reject(m, "no such request on this prefill rank before the bootstrap timeout")
        for room, t in list(self.tombstones.items()):
            if now - t > self.bootstrap_timeout:
                del self.tombstones[room]

    def kv_heads_total(self):
        """The model's KV head count (SGLang's KVArgs.total_kv_head_num, else kv_head_num per rank times the attention
        TP size, as Mooncake reads them), or None when KVArgs has neither."""
        total = int(getattr(self.kv_args, "total_kv_head_num", 0) or 0)
        if total > 0:
            return total
        per_rank = int(getattr(self.kv_args, "kv_head_num", 0) or 0)
        return per_rank * self.attn_tp_size if per_rank > 0 else None

    def share_for(self, meta):
        """Prefill side: checks that the share a decode rank asks for (its meta message) is this rank's to send and
        lands where the decode rank expects it; returns (kv_slices, senders_to): per KV buffer (offset, length) of
        this rank's tokens to send (None: whole pages), and how many decode ranks this rank sends the request to.
        Raises ValueError saying what is misrouted (rank, head range, layer count, dtype, layout)."""
        mine, theirs = self.mem.fingerprint(), meta.get("layout", {})
        dt, my_dt = meta.get("kv_cache_dtype"), getattr(self.server_args, "kv_cache_dtype", None)
        if dt is not None and my_dt is not None and str(dt) != str(my_dt):
            raise ValueError(f"misrouted share: KV cache dtype {dt} on the decode side, {my_dt} on this prefill rank")
        tp = meta.get("tp")
        if tp is None:  # a decode rank that names no rank pair: the same attention-TP size, whole pages
            why = MemoryMap.mismatch(mine, theirs)
            if why:
                raise ValueError(f"layout mismatch with the decode side: {why}")
            return None, 1
        P, p, D, d = self.attn_tp_size, self.attn_tp_rank, tp["decode_tp"], tp["decode_rank"]
        if (tp["prefill_tp"], tp["prefill_rank"]) != (P, p):
            raise ValueError(f"misrouted share: meant for prefill rank {tp['prefill_rank']} of attention TP "
                             f"{tp['prefill_tp']}, this is rank {p} of {P}")
        why = tp_sizes_unsupported(P, D)
        if why:
            raise ValueError(f"prefill attention TP {P}, decode {D}: {why}")
        if (d // (D // P) if D >= P else p // (P // D)) != (p if D >= P else d):
            raise ValueError(f"misrouted share: decode rank {d} of attention TP {D} does not take its KV from "
                             f"prefill rank {p} of {P}")
        if len(theirs.get("kv_item_lens", [])) != len(mine["kv_item_lens"]):
            raise ValueError(f"misrouted share: {len(theirs.get('kv_item_lens', []))} KV buffers (layers x K/V) on "
                             f"the decode side, {len(mine['kv_item_lens'])} on this prefill rank")
        if P == D:
            why = MemoryMap.mismatch(mine, theirs)
            if why:
                raise ValueError(f"layout mismatch with the decode side: {why}")
            return None, 1
        for key in ("aux_item_lens", "state_item_lens"):
            if mine.get(key) != theirs.get(key):
                raise ValueError(f"layout mismatch with the decode side: {key} differ: this side {mine.get(key)}, "
                                 f"the decode side {theirs.get(key)}")
        if any(meta.get("state_counts") or []):
            raise ValueError(f"state (mamba and the like) between attention-TP sizes {P} and {D} is not supported by "
                             "the kvstage backend")
        ps = int(getattr(self.kv_args, "page_size", 1) or 1)
        heads = self.kv_heads_total()
        if not self.is_mla_backend and heads is None:
            raise ValueError("attention-TP sizes differ and this prefill rank's KVArgs give no kv_head_num")
        slices = []
        for b, (mi, ti, want) in enumerate(zip(mine["kv_item_lens"], theirs["kv_item_lens"], tp["slices"])):
            src, dst = mi // ps, ti // ps
            if self.is_mla_backend:
                if src != dst:
                    raise ValueError(f"misrouted share: KV buffer {b}: MLA tokens of {src} bytes here, {dst} on the "
                                     "decode side")
                src_off, dst_off, n = 0, 0, src
            else:
                try:
                    src_off, dst_off, n = head_slice(heads, P, p, D, d, src, dst)
                except ValueError as e:
                    raise ValueError(f"misrouted share: KV buffer {b}: {e}") from None
            if list(want) != [dst_off, n]:
                raise ValueError(f"misrouted share: KV buffer {b}: the decode rank {d} expects bytes [{want[0]}, "
                                 f"{want[0] + want[1]}) of its {dst}-byte token from prefill rank {p}, which sends "
                                 f"[{dst_off}, {dst_off + n}) (heads {heads}, attention TP {P} -> {D})")
            slices.append((src_off, n))
        if len(tp["slices"]) != len(slices):
            raise ValueError("misrouted share: a head range per KV buffer expected")
        readers = tp.get("readers", 1)
        joins = bool(tp.get("join"))
        if readers > 1 and not (self.is_mla_backend and readers == D // P and joins == bool(d % readers)):
            raise ValueError(f"misrouted share: a shared room of {readers} readers from decode rank {d} of {D} "
                             f"(join {joins}), prefill attention TP {P}, MLA {self.is_mla_backend}")
        return slices, max(1, D // P)

    def _reject_malformed(self, msg, why):
        """A message that fails check_side_message: the request it names (if its descriptor can be read) is refused
        (its decode room aborted, so the decode side fails at once); nothing else changes on this rank."""
        room = msg.get("room") if isinstance(msg, dict) else None
        logger.warning("kvstage backend: refused a malformed side-channel message (bootstrap_room %.40r, "
                       "from %.80r): %s", room, msg.get("from") if isinstance(msg, dict) else None, why)
        if isinstance(msg, dict):  # a descriptor that cannot be read names no room: the decode side times out
            self._reject(msg, f"malformed transfer request: {why}")

    def _reject(self, msg, why):
        """Aborts the decode room a message names (so the decode side fails at once, not at its timeout)."""
        logger.info("kvstage backend: refusing the transfer of bootstrap_room %s: %s", msg.get("room"), why)
        desc = msg.get("desc")
        if not desc:
            return
        try:
            r = self.client().send_open(desc_bytes(desc), user_data=0)
            r.abort()
            r.close()
        except (KvstageError, ValueError) as e:
            logger.debug("kvstage backend: the refused room was gone already: %s", e)

    # -- decode side ----------------------------------------------------------------------
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """One non-blocking attempt to fetch and cache the prefill server's info; True once it is known."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        status, data = _http("GET", f"http://{bootstrap_addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
                                    f"&target_tp_rank=-1&target_pp_rank=-1")
        if status != 200 or not isinstance(data, dict):
            logger.debug("kvstage backend: prefill info from %s not available yet: %s %s", bootstrap_addr, status, data)
            return False
        fields = {f.name for f in dataclasses.fields(PrefillServerInfo)}
        info = PrefillServerInfo(**{k: v for k, v in data.items() if k in fields})
        ps = getattr(self.kv_args, "page_size", None)
        if info.page_size is not None and ps is not None and int(info.page_size) != int(ps):
            raise RuntimeError(f"Page size mismatch: prefill server has page_size={info.page_size}, but decode "
                               f"server has page_size={ps}. Both servers must use the same --page-size value.")
        dt = getattr(self.server_args, "kv_cache_dtype", None)
        if info.kv_cache_dtype is not None and dt is not None and info.kv_cache_dtype != dt:
            raise RuntimeError(f"KV cache dtype mismatch: prefill server has kv_cache_dtype={info.kv_cache_dtype}, "
                               f"but decode server has kv_cache_dtype={dt}. Both servers must use the same "
                               f"--kv-cache-dtype value.")
        self.prefill_info_table[bootstrap_addr] = info
        return True

    def rank_endpoint(self, bootstrap_addr, dp_rank, tp_rank):
        """Returns 'host:port' of a prefill rank's side channel (cached), or None."""
        key = f"{bootstrap_addr}_{dp_rank}_0_{tp_rank}"
        hit = self.connection_pool.get(key)
        if hit is None:
            status, data = _http("GET", f"http://{bootstrap_addr}/route?prefill_dp_rank={dp_rank}&prefill_cp_rank=0"
                                        f"&target_tp_rank={tp_rank}&target_pp_rank=0")
            if status != 200 or not isinstance(data, dict) or not _is_int(data.get("rank_port"), 1, 65535) \
                    or not isinstance(data.get("rank_ip"), str):
                logger.error("kvstage backend: no prefill rank dp=%s tp=%s at %s: %s %s",
                             dp_rank, tp_rank, bootstrap_addr, status, data)
                return None
            hit = self.connection_pool[key] = data
        return f"{_url_host(hit['rank_ip'])}:{hit['rank_port']}"

    def submit_prefill_recompute(self, kv_receiver, payload: dict) -> None:
        """PD retract rebootstrap (SGLang's CommonKVManager.submit_prefill_recompute; decode.py calls it right after
        send_metadata for a request bootstrapped again after pause_generation(mode="retract")): asks the original
        prefill server to recompute the request's prefix KV (POST payload to its /generate, at the bootstrap
        address's host and the HTTP port the prefill registered), which then sends it into the room kv_receiver
        has just opened. Never blocks: the POST runs on a small pool. Only the decode leader (attention TP/CP rank
        0, first PP stage) posts; the other ranks just receive. Any failure (no prefill HTTP port known, an HTTP
        error, no answer) fails kv_receiver through the usual path (poll() says Failed, the reason names the
        rebootstrap), unless its transfer has completed already."""
        if self.attn_tp_rank != 0 or self.attn_cp_rank != 0 or self.pp_rank != 0:
            return
        url = self._rebootstrap_prefill_url(kv_receiver)
        if not url:
            logger.error("kvstage backend: PD retract rebootstrap: no prefill /generate URL for bootstrap_room %s "
                         "(bootstrap_addr %s)", getattr(kv_receiver, "bootstrap_room", None),
                         getattr(kv_receiver, "bootstrap_addr", None))
            return kv_receiver._fail("PD retract rebootstrap could not resolve the prefill /generate URL from "
                                     "bootstrap info (the prefill server registered no HTTP port)")
        if self._recompute_pool is None:  # made here, by the scheduler's thread, the only one that calls this
            import concurrent.futures
            n = os.environ.get("SGLANG_DISAGGREGATION_THREAD_POOL_SIZE")
            self._recompute_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=max(1, int(n) if n and n.isdigit() else 16), thread_name_prefix="kvstage-rebootstrap")
        self._recompute_pool.submit(self._run_prefill_recompute, kv_receiver, url, payload)

    def _rebootstrap_prefill_url(self, kv_receiver):
        info = self.prefill_info_table.get(getattr(kv_receiver, "bootstrap_addr", None))
        if info is None or not info.prefill_http_port:
            return None
        host = kv_receiver.bootstrap_addr.rsplit(":", 1)[0]
        return f"http://{_url_host(host)}:{int(info.prefill_http_port)}"

    def _run_prefill_recompute(self, kv_receiver, url, payload):
        """A pool thread: the POST; a failure is handed to the scheduler thread (pump)."""
        rid = payload.get("rid") if isinstance(payload, dict) else None
        try:
            status, body = _http("POST", url + "/generate", payload, timeout=self.waiting_timeout)
        except Exception as e:  # e.g. a payload that is not JSON
            status, body = None, repr(e)
        if status is None or status >= 400:
            why = (f"PD retract rebootstrap /generate failed for rid={rid} (status={status})" if status is not None
                   else f"PD retract rebootstrap /generate request errored for rid={rid}: {body}")
            logger.error("kvstage backend: %s: %s", why, str(body)[:512])
            self._recompute_failed.put((kv_receiver, why))

    def _drain_recompute_failures(self):
        while True:
            try:
                r, why = self._recompute_failed.get_nowait()
            except queue.Empty:
                return
            if r._status != KVPoll.Success:  # a transfer that completed stays complete
                r._fail(why)

    def send_to(self, endpoint, msg, failing=None):
        """Queues one message for the prefill rank at endpoint ("host:port") and returns at once; raises OSError
        without queuing it when that rank failed moments ago or too much already waits for it (see
        sidechannel.AsyncPeers). One that cannot be delivered later (a silent rank, a refused handshake: the rank
        did not prove it holds the peer secret) fails the receiver failing, if given, on the scheduler's thread."""
        host, port = endpoint.rsplit(":", 1)
        on_error = None
        if failing is not None:
            def on_error(e):
                self._recompute_failed.put((failing, f"could not reach the prefill rank at {endpoint}: {e}"))
        self._peers.send(host, int(port), msg, on_error)
