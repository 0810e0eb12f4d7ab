"""kvstage.vllm: the scheduler side - which requests load, which stage, and what the workers are told."""
from __future__ import annotations

import logging
import time

from .. import lifecycle as _lc
from .config import _float, _tp_pair, _Settings, mla_reader, mla_stager
from .layout import _cdiv, _flat
from .metadata import SaveSpec, RecvSpec, KvstageConnectorMetadata

logger = logging.getLogger("kvstage.vllm")  # one logger for the whole connector

_HANDOFF = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")  # RequestStatus names that hand the KV to decode


def _status(s):
    return getattr(s, "name", str(s))


def _group0(ids):
    """Returns the first KV cache group's block ids of a vLLM block-id value (tuple of lists, or a flat list)."""
    if ids is None:
        return None
    ids = list(ids)
    if ids and isinstance(ids[0], (list, tuple)):
        return list(ids[0])
    return ids


def _unhashed_groups(blocks):
    """Per KV cache group, the block ids of a KVCacheBlocks that hold no cached content and are not vLLM's null
    (skipped) block: the ones a load fills."""
    f = getattr(blocks, "get_unhashed_block_ids_all_groups", None)
    if f is not None:
        return [list(g) for g in f()]
    return [list(g) for g in blocks.get_block_ids()]


def _unhashed(blocks):
    """Returns the block ids of a KVCacheBlocks that hold no cached content (the ones a load fills)."""
    f = getattr(blocks, "get_unhashed_block_ids", None)
    if f is not None:
        return list(f())
    f = getattr(blocks, "get_unhashed_block_ids_all_groups", None)
    if f is not None:
        return _group0(f()) or []
    return _group0(blocks.get_block_ids()) or []


class _PReq:
    __slots__ = ("request", "blocks", "saved", "mla_rank")

    def __init__(self, request, blocks):
        self.request, self.blocks, self.saved = request, list(blocks or []), False
        self.mla_rank = None  # MLA: the prefill rank that stages it, chosen at its first stage (kept at a restage)


class _SchedulerSide:
    def __init__(self, s: _Settings):
        self.s = s
        self._p = {}              # prefill requests being computed: req_id -> _PReq
        self._p_delayed = {}      # prefill requests whose blocks wait for finished_sending: req_id -> handoff
        self._d_loading = set()   # decode requests whose load the worker has not reported yet
        self._warned = set()
        self._mla_handoffs = 0    # MLA: stages chosen so far (the next one's rank: mla_stager)
        self.trace = s.lifecycle_sink("scheduler")
        self._reset()

    def _reset(self):
        self._saves, self._finished, self._unstage = {}, {}, set()
        self._recv, self._aborts, self._drops = {}, set(), []
        self._abort_times = {}

    @staticmethod
    def _num_prompt(request):
        n = getattr(request, "num_prompt_tokens", None)
        return int(n) if n is not None else len(request.prompt_token_ids or [])

    def _remote(self, request):
        """Returns the prefill side's kvstage params of a decode request, or (None, why) when unusable."""
        p = request.kv_transfer_params or {}
        kv = p.get("kvstage")
        if not self.s.consumer:
            return None, "this instance's kv_role does not consume KV"
        if not isinstance(kv, dict):
            return None, "kv_transfer_params come from another connector (no 'kvstage')"
        for k in ("remote_request_id", "remote_host", "remote_port"):
            if p.get(k) is None:
                return None, f"kv_transfer_params lack {k}"
        try:  # MLA: any sizes pair (prefill rank 0 holds it all)
            remote_tp = _tp_pair(p.get("tp_size", 1), 1 if self.s.mla else self.s.tp_size,
                                 "the prefill side's TP size")
        except ValueError as e:
            return None, str(e)
        remote_bs, bs = int(kv.get("block_size", -1)), self.s.block_size
        if remote_bs != bs:  # NixlConnector's block_size_ratio: one divides the other
            if remote_bs <= 0 or (remote_bs % bs and bs % remote_bs):
                return None, f"prefill block size {kv.get('block_size')}, this side {bs}: one must divide the other"
            if self.s.grouped:
                return None, (f"prefill block size {remote_bs}, this side {bs}: blocks of another size move with one "
                              "full-attention KV cache group only")
            if remote_tp != self.s.tp_size and not self.s.mla:
                return None, (f"prefill block size {remote_bs} and TP size {remote_tp}, this side {bs} and "
                              f"{self.s.tp_size}: block sizes and TP sizes do not both differ")
        if bool(kv.get("mla", False)) != self.s.mla:
            return None, f"the prefill side's model {'is' if kv.get('mla') else 'is not'} MLA, this side's " + (
                "is" if self.s.mla else "is not")
        if self.s.mla and self._mla_rank(kv, remote_tp) is None:
            return None, (f"the prefill side (TP size {remote_tp}) names prefill rank {kv.get('mla_rank')!r} as the "
                          "one that staged it")
        staged_for = int(kv.get("decode_tp_size", remote_tp))
        if staged_for != self.s.tp_size and not self.s.mla:
            return None, (f"the prefill side (TP size {remote_tp}) staged its KV for decode TP size {staged_for}, this "
                          f"side has {self.s.tp_size} (kvstage_decode_tp_size of the prefill instance)")
        n = self._staged(request)
        if n <= 0:
            return None, "a one-token prompt of a model with a state (Mamba) group is computed here"
        if int(kv.get("num_tokens", -1)) != n or int(kv.get("num_blocks", -1)) != _cdiv(n, remote_bs):
            return None, (f"the prefill side staged {kv.get('num_tokens')} tokens, this side expects {n} "
                          f"(a prompt of {self._num_prompt(request)})")
        want = [[first, end] for first, end in self.s.group_blocks(n)] if self.s.grouped else None
        if kv.get("groups") != want:
            return None, f"the prefill side staged KV cache groups {kv.get('groups')}, this side has {want}"
        return kv, None

    @staticmethod
    def _mla_rank(kv, remote_tp):
        """MLA: the prefill rank that staged a request, as its params name it (kvstage.mla_rank; absent: 0, as a
        prefill instance before the ranks took turns staged on rank 0), or None when that is no rank of remote_tp."""
        v = kv.get("mla_rank", 0) if isinstance(kv, dict) else 0
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < int(remote_tp):
            return None
        return v

    def _staged(self, request):
        """Decode side: the prompt tokens the prefill side staged for this request (settings.staged_tokens)."""
        return self.s.staged_tokens(self._num_prompt(request))

    def _truncate_for_state(self, request):
        """Prefill side with a state group: drop the prompt's last token, once (NixlConnector's
        _truncate_mamba_request_for_prefill @ 9aaf83ef502f), so the state staged is that before the last token, which
        the decode side computes; the prefill request produces one token."""
        p = request.kv_transfer_params
        if p.get("_p_side_truncated") or self._num_prompt(request) <= 1:
            return
        if getattr(request, "prompt_token_ids", None) is not None:
            request.prompt_token_ids.pop()
        elif getattr(request, "prompt_embeds", None) is not None:
            request.prompt_embeds = request.prompt_embeds[:-1]
        else:
            return
        all_ids = getattr(request, "_all_token_ids", None)
        if all_ids is not None:
            all_ids.pop()
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        p["_p_side_truncated"] = True

    def _warn(self, request, why):
        if request.request_id not in self._warned:
            self._warned.add(request.request_id)
            logger.warning("kvstage connector: request %s: no remote KV load: %s", request.request_id, why)

    def _drop(self, request):
        p = request.kv_transfer_params or {}
        if isinstance(p.get("kvstage"), dict) and p.get("remote_request_id") and p.get("remote_host"):
            drop = (str(p["remote_host"]), int(p["remote_port"]), str(p["remote_request_id"]))
            remote_tp = int(p.get("tp_size", self.s.tp_size) or self.s.tp_size)
            if self.s.mla:  # the prefill rank that staged it (an unusable name: rank 0, as before the turns)
                self._drops.append(drop + (0, self._mla_rank(p["kvstage"], remote_tp) or 0))
                return
            self._drops.append(drop if remote_tp == self.s.tp_size else drop + (remote_tp,))

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        p = request.kv_transfer_params
        if p and p.get("do_remote_prefill"):
            kv, why = self._remote(request)
            if kv is None:
                self._warn(request, why)
                return 0, False
            count = self._staged(request) - num_computed_tokens
            if count > 0:
                return count, True
        if p and p.get("do_remote_decode") and self.s.state and self.s.producer:
            self._truncate_for_state(request)
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        p = request.kv_transfer_params
        if not p:
            return
        rid = request.request_id
        if p.get("do_remote_decode") and self.s.producer and rid not in self._p:
            self._p[rid] = _PReq(request, self._ids(blocks.get_block_ids() if blocks is not None else None))
        if p.get("do_remote_prefill"):
            p["do_remote_prefill"] = False  # one load per request (also after a preemption)
            kv, why = self._remote(request)
            if kv is None or num_external_tokens <= 0:
                self._drop(request)  # the prefill side can release its slots now
                return
            timeout = _float(p.get("kvstage_load_timeout", self.s.load_timeout), "kvstage_load_timeout")
            remote_bs = int(kv["block_size"])
            if self.s.grouped:
                count, local, skip, err = self._recv_groups(request, blocks)
            else:
                local = tuple(_unhashed(blocks))
                count = int(kv["num_blocks"])  # the room's: the prefill side's blocks
                mine = count if remote_bs == self.s.block_size else _cdiv(self._staged(request), self.s.block_size)
                skip = mine - len(local)
                err = None if 0 <= skip else f"{len(local)} blocks to fill, the prefill side staged {kv['num_blocks']}"
                skip = max(skip, 0)
            remote_tp = int(p.get("tp_size", self.s.tp_size))
            mla_rank = self._mla_rank(kv, remote_tp) if self.s.mla else 0  # _remote checked it
            self._recv[rid] = RecvSpec(rid, str(p["remote_request_id"]), str(p["remote_host"]), int(p["remote_port"]),
                                       count, local, skip, timeout, err,
                                       remote_tp if remote_tp != self.s.tp_size and not self.s.mla else 0,
                                       self.s.mla, remote_bs if remote_bs != self.s.block_size else 0,
                                       mla_rank, mla_reader(mla_rank, remote_tp, self.s.tp_size) if self.s.mla else 0)
            self._d_loading.add(rid)
            self.trace.emit(_lc.BLOCKS_MATCHED, rid, role="consumer", remote_request_id=str(p["remote_request_id"]),
                            block_count=len(_flat(local)))

    def _ids(self, ids):
        """vLLM block ids (a tuple of per-group lists, or a flat list; None: none) as kept here: one list per group
        when grouped, else group 0's list."""
        if not self.s.grouped:
            return _group0(ids) or []
        ids = list(ids or ())
        if ids and not isinstance(ids[0], (list, tuple)):
            raise ValueError(f"kvstage connector: one block list for {len(self.s.groups)} KV cache groups")
        return [list(g) for g in ids] + [[] for _ in range(len(self.s.groups) - len(ids))]

    def _recv_groups(self, request, blocks):
        """(room blocks per group, local block ids per group, skip per group, error) of a grouped load: in each
        group the room holds the blocks group_blocks names; the unhashed ones fill its last positions."""
        unhashed = _unhashed_groups(blocks)
        counts, locals_, skips, err = [], [], [], None
        for g, (first, end) in enumerate(self.s.group_blocks(self._staged(request))):
            k = end - first
            loc = unhashed[g] if g < len(unhashed) else []
            if self.s.groups[g].kind == "mamba" and len(loc) < k:
                err = f"{len(loc)} state blocks to fill in group {g}, the prefill side staged {k}"
            if self.s.groups[g].kind != "full":
                loc = loc[max(0, len(loc) - k):]  # the window's (the chunk's) blocks only; the state block
            elif len(loc) > k:
                err = f"{len(loc)} blocks to fill in group {g}, the prefill side staged {k}"
            counts.append(k)
            locals_.append(tuple(loc))
            skips.append(max(0, k - len(loc)))
        return tuple(counts), tuple(locals_), tuple(skips), err

    def _maybe_save(self, st, computed, scheduled):
        if st.saved:
            return
        n = self._num_prompt(st.request)
        if computed + scheduled < n:
            return
        if self.s.grouped:
            spans = self.s.group_blocks(n)
            for g, (first, end) in enumerate(spans):
                if len(st.blocks[g]) < end:
                    logger.error("kvstage connector: request %s has %d blocks of group %d for %d tokens; not staged",
                                 st.request.request_id, len(st.blocks[g]), g, n)
                    return
            ids = tuple(tuple(st.blocks[g][first:end]) for g, (first, end) in enumerate(spans))
        else:
            nb = _cdiv(n, self.s.block_size)
            if len(st.blocks) < nb:
                logger.error("kvstage connector: request %s has %d blocks for %d tokens; not staged",
                             st.request.request_id, len(st.blocks), n)
                return
            ids = tuple(st.blocks[:nb])
        p = st.request.kv_transfer_params or {}
        timeout = _float(p.get("kvstage_stage_timeout", self.s.stage_timeout), "kvstage_stage_timeout")
        decode_tp = self._decode_tp(st.request)
        if decode_tp == self.s.tp_size or self.s.mla:
            decode_tp = 0  # the plain layout
        if self.s.mla and st.mla_rank is None:  # one rank stages it; the ranks take turns
            st.mla_rank = mla_stager(self._mla_handoffs, self.s.tp_size)
            self._mla_handoffs += 1
        st.saved = True
        self._saves[st.request.request_id] = SaveSpec(st.request.request_id, ids, n, timeout, decode_tp,
                                                      st.mla_rank or 0)

    def _decode_tp(self, request):
        """The decode TP size a prefill request is staged for: its kv_transfer_params' kvstage_decode_tp_size (a
        router that knows where it sends it), else the instance's; one that does not pair with this side's TP size
        falls back to the instance's (logged)."""
        v = (request.kv_transfer_params or {}).get("kvstage_decode_tp_size")
        if v is None or self.s.mla:
            return self.s.decode_tp
        try:
            return _tp_pair(v, self.s.tp_size, "kvstage_decode_tp_size")
        except ValueError as e:
            logger.warning("kvstage connector: request %s: %s; staged for decode TP size %d", request.request_id, e,
                           self.s.decode_tp)
            return self.s.decode_tp

    def build_connector_meta(self, scheduler_output):
        so = scheduler_output
        nsched = getattr(so, "num_scheduled_tokens", None) or {}
        preempted = set(getattr(so, "preempted_req_ids", None) or ())
        for rid in preempted & set(self._p):
            if self._p[rid].saved:
                self._abort_times[rid] = time.time()
            self._restage(rid, self._ids(None))
        for new in getattr(so, "scheduled_new_reqs", None) or ():
            st = self._p.get(new.req_id)
            if st is not None:
                st.blocks = self._ids(new.block_ids)
                self._maybe_save(st, int(new.num_computed_tokens), int(nsched.get(new.req_id, 0)))
        cached = getattr(so, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed_ids = set(getattr(cached, "resumed_req_ids", None) or ())
            resumed_flags = getattr(cached, "resumed_from_preemption", None)
            for i, rid in enumerate(cached.req_ids):
                st = self._p.get(rid)
                if st is None:
                    continue
                resumed = rid in resumed_ids or bool(resumed_flags[i] if resumed_flags else False)
                nb = cached.new_block_ids[i] if cached.new_block_ids else None
                if resumed:
                    self._restage(rid, self._ids(nb))
                elif nb and self.s.grouped:
                    for g, new_ids in enumerate(self._ids(nb)):
                        st.blocks[g].extend(new_ids)
                elif nb:
                    st.blocks.extend(_group0(nb) or [])
                self._maybe_save(st, int(cached.num_computed_tokens[i]), int(nsched.get(rid, 0)))
        meta = KvstageConnectorMetadata(self._saves, self._finished, self._unstage, self._recv, self._aborts,
                                        self._drops, self._abort_times)
        self._reset()
        return meta

    def _restage(self, rid, blocks):
        """A preempted prefill request: its blocks were freed; what was staged from them is void."""
        st = self._p[rid]
        st.blocks = list(blocks)
        if st.saved:
            st.saved = False
            self._saves.pop(rid, None)
            self._unstage.add(rid)

    def request_finished(self, request, block_ids):
        rid = request.request_id
        p = request.kv_transfer_params or {}
        if rid in self._d_loading:
            # A load in flight: its blocks are given back when the worker reports it in finished_recving,
            # once the room's final event came and no copy-out can run (vLLM delays them too).
            self._d_loading.discard(rid)
            self._aborts.add(rid)
            self._abort_times[rid] = time.time()
            self.trace.emit(_lc.ABORT, rid, role="consumer", phase="loading",
                            remote_request_id=p.get("remote_request_id"))
            return True, None
        if p.get("do_remote_prefill"):  # aborted before it was ever scheduled
            p["do_remote_prefill"] = False
            self._drop(request)
            return False, None
        st = self._p.pop(rid, None)
        if not p.get("do_remote_decode") or st is None or not st.saved:
            if p.get("do_remote_decode") and _status(request.status) not in _HANDOFF:
                self.trace.emit(_lc.ABORT, rid, role="producer", phase="prefill")
            return False, None  # nothing of ours reads its blocks
        handoff = _status(request.status) in _HANDOFF
        self._finished[rid] = (handoff, True)
        self._p_delayed[rid] = handoff
        if not handoff:
            self._abort_times[rid] = time.time()
            self.trace.emit(_lc.ABORT, rid, role="producer", phase="staging")
            return True, None  # aborted while its copy may run: free once it cannot read the blocks any more
        n = self._num_prompt(request)
        nb = _cdiv(n, self.s.block_size)
        kvs = dict(version=1, num_blocks=nb, num_tokens=n, block_size=self.s.block_size)
        decode_tp = self._decode_tp(request)
        if self.s.mla:  # staged once, by one rank (mla_rank), for any decode TP size
            kvs["mla"], kvs["mla_rank"] = True, st.mla_rank or 0
        elif decode_tp != self.s.tp_size:  # the head slices its ranks' KV is staged in
            kvs["decode_tp_size"] = decode_tp
        if self.s.grouped:  # each group's staged positions [first, end); remote_block_ids: those blocks, as NIXL's
            spans = self.s.group_blocks(n)
            kvs["groups"] = [[first, end] for first, end in spans]
            ids = self._ids(block_ids)
            remote = [[int(b) for b in ids[g][first:end]] for g, (first, end) in enumerate(spans)]
        else:
            remote = [[int(b) for b in (_group0(block_ids) or [])]]
        # NixlConnector's keys with its meanings (nixl/scheduler.py request_finished @ 9aaf83ef502f), so routers and
        # vLLM's disaggregated-serving proxies pass them on unchanged; the decode side reads kvstage's own part.
        # remote_block_ids: the prefill's blocks per KV cache group (informational here: the bytes travel through
        # kvstage slots, not by block id); remote_num_tokens: the request's computed tokens at its finish.
        self.trace.emit(_lc.TRANSFER_STAGED, rid, role="producer", block_count=sum(len(g) for g in remote))
        return True, dict(do_remote_prefill=True, do_remote_decode=False,
                          remote_block_ids=remote,
                          remote_engine_id=self.s.engine_id, remote_request_id=rid, remote_host=self.s.host,
                          remote_port=self.s.base_port, tp_size=self.s.tp_size,
                          remote_num_tokens=int(getattr(request, "num_computed_tokens", 0) or 0),
                          kvstage=kvs)

    def update_connector_output(self, connector_output):
        for rid in getattr(connector_output, "finished_sending", None) or ():
            self._p_delayed.pop(rid, None)
        for rid in getattr(connector_output, "finished_recving", None) or ():
            self._d_loading.discard(rid)

    def has_pending_push_work(self):
        return bool(self._p_delayed)


# The side channel (decode worker -> prefill worker only) is kvstage.sidechannel's: authenticated by the peer secret.
