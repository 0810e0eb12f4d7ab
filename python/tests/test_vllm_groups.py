"""Several KV cache groups (vLLM's hybrid KV cache manager on; the connector is SupportsHMA): a full-attention group
and a sliding-window group, as vLLM @ 9aaf83ef502f lays them out (kv_cache_interface.py KVCacheConfig: one tensor
shared by a layer of each group, one block pool, block 0 the null block that stands for a sliding window's skipped
blocks; scheduler.py: block ids per group in update_state_after_alloc, SchedulerOutput and
request_finished_all_groups after remove_skipped_blocks); and a full-attention + Mamba (state) model, whose state
block moves once. Real kvstaged, real connectors on both sides, created through vLLM's factory with the hybrid
manager on."""
import pytest

import vllm_stubs  # noqa: F401 - vLLM's stand-ins where vllm is not importable, before kvstage.vllm
from kvstage import vllm as kv
from sglang_common import NEED_TORCH, assert_pool_free, kv_proxy  # noqa: F401 (fixture)

SW = 6  # tokens of the sliding window
CHUNK = 8  # tokens of a chunked local attention's chunk (Llama 4's layers are of this kind)


def _config(nblocks, third=None, second="sw"):
    import vllm_engine as E
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec, KVCacheTensor, SlidingWindowSpec)
    L0, L1, L2 = E.LAYER_NAMES
    a = dict(block_size=E.BLOCK_SIZE, num_kv_heads=E.HEADS, head_size=E.HEAD_DIM, dtype="float16")
    spec = (SlidingWindowSpec(sliding_window=SW, **a) if second == "sw"
            else ChunkedLocalAttentionSpec(attention_chunk_size=CHUNK, **a))
    groups = [KVCacheGroupSpec([L0, L2], FullAttentionSpec(**a)), KVCacheGroupSpec([L1], spec)]
    if third is not None:
        groups.append(third)
    return KVCacheConfig(nblocks, [KVCacheTensor(0, [L0, L1]), KVCacheTensor(0, [L2])], groups)


class _Blocks:
    """vLLM's KVCacheBlocks as the connector reads it: per group, the null block 0 never unhashed."""

    def __init__(self, groups, unhashed):
        self.groups, self.unhashed = groups, unhashed

    def get_block_ids(self):
        return tuple(list(g) for g in self.groups)

    def get_unhashed_block_ids_all_groups(self):
        return [list(g) for g in self.unhashed]


class Side:
    """One engine of a two-group model: scheduler and worker connectors (vLLM's factory, hybrid manager on), its KV
    caches as vLLM allocates them (layers 0 and 1 - one of each group - share a tensor), a block pool without 0."""

    def __init__(self, socket_path, role, nblocks=64, second="sw"):
        import vllm_engine as E
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        self.E = E
        self.cfg = E.vllm_config(socket_path, E.free_port(), role)
        self.cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
        kvcc = _config(nblocks, second=second)
        self.second = second
        self.sched = KVConnectorFactory.create_connector(self.cfg, kv.KVConnectorRole.SCHEDULER, kvcc)
        self.worker = KVConnectorFactory.create_connector(self.cfg, kv.KVConnectorRole.WORKER, kvcc)
        t0, t1 = E.kv_cache(nblocks), E.kv_cache(nblocks)
        L0, L1, L2 = E.LAYER_NAMES
        self.kv = {L0: t0, L1: t0, L2: t1}
        self.group_of = {L0: 0, L1: 1, L2: 0}
        self.worker.register_kv_caches(self.kv)
        self.free = list(range(nblocks - 1, 0, -1))  # block 0: vLLM's null block
        self.sent, self.recvd = set(), set()

    def alloc(self, n):
        return [self.free.pop() for _ in range(n)]

    def step(self, so=None, forward=False):
        E = self.E
        so = so or E.SchedulerOutput()
        meta = self.sched.build_connector_meta(so)
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        if forward:
            for name in E.LAYER_NAMES:
                w.save_kv_layer(name, self.kv[name], None)
        w.wait_for_save()
        fs, fr = w.get_finished(set())
        w.clear_connector_metadata()
        self.sent |= set(fs or ())
        self.recvd |= set(fr or ())
        self.sched.update_connector_output(E.KVConnectorOutput(set(fs or ()), set(fr or ()), set()))

    def until(self, pred, what):
        E = self.E
        E.wait_for(lambda: (self.step(), pred())[1], timeout=20, what=what)

    def close(self):
        self.worker.shutdown()
        self.sched.shutdown()


def _content(seed, n):
    import torch
    import vllm_engine as E
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-32768, 32767, (E.LAYERS, 2, n, E.HEADS, E.HEAD_DIM), dtype=torch.int16, generator=g)


def _where(blocks, c0, n):
    import torch
    import vllm_engine as E
    pos = torch.arange(c0, n)
    return torch.tensor(blocks, dtype=torch.long)[pos // E.BLOCK_SIZE], pos % E.BLOCK_SIZE


def _first_sw(n, second="sw"):
    """The second group's first block kept: vLLM's get_num_skipped_tokens(n) // block_size, by its manager."""
    import vllm_engine as E
    if second == "sw":
        return max(0, n - SW + 1) // E.BLOCK_SIZE  # SlidingWindowManager
    return (n // CHUNK) * CHUNK // E.BLOCK_SIZE  # ChunkedLocalAttentionManager


def _prefill(P, rid, n, seed, status="FINISHED_LENGTH_CAPPED"):
    """A one-step prefill of n tokens: both groups' blocks written, staged; request_finished_all_groups with the
    sliding window's skipped blocks nulled (and given back to the pool, then overwritten by another request)."""
    E = P.E
    r = E.Request(rid, n, E.prefill_params(), seed)
    nb = E.cdiv(n, E.BLOCK_SIZE)
    groups = [P.alloc(nb), P.alloc(nb)]
    c = _content(seed, n)
    for li, name in enumerate(E.LAYER_NAMES):
        b, o = _where(groups[P.group_of[name]], 0, n)
        P.kv[name].view(__import__("torch").int16)[:, b, o] = c[li]
    assert P.sched.get_num_new_matched_tokens(r, 0) == (0, False)
    P.sched.update_state_after_alloc(r, _Blocks(groups, groups), 0)
    so = E.SchedulerOutput()
    so.scheduled_new_reqs.append(E.NewRequestData(rid, r.prompt_token_ids, tuple(list(g) for g in groups), 0))
    so.num_scheduled_tokens[rid] = n
    P.step(so, forward=True)
    r.num_computed_tokens, r.output = n, [0]
    r.status = getattr(E.RequestStatus, status)
    first = _first_sw(n, P.second)
    skipped, groups[1][:first] = groups[1][:first], [0] * first  # remove_skipped_blocks(num_computed_tokens)
    return r, groups, skipped, c


@NEED_TORCH
@pytest.mark.parametrize("second", ["sw", "local"], ids=["sliding-window", "chunked-local"])
def test_two_groups_moved_byte_exact(kv_proxy, second):
    """Full attention + sliding window: the decode side's blocks of the full group equal the prefill's at every
    prompt position; of the sliding-window group at the positions the window keeps (get_num_skipped_tokens(n) //
    block_size on), the only ones sent; the blocks outside the window (freed on the prefill side and overwritten by
    another request before the copy could run; vLLM's null block on the decode side) are neither sent nor written.
    The same with a chunked-local-attention group in place of the sliding one: its kept blocks are those of the
    current chunk, none at all when the prompt ends on a chunk's edge (24 tokens)."""
    import torch
    P = Side(kv_proxy.socket, "kv_producer", second=second)
    D = Side(kv_proxy.socket, "kv_consumer", second=second)
    E = P.E
    try:
        for k, n in enumerate((22, 7, 24)):
            rid = f"p{k}"
            r, pgroups, skipped, c = _prefill(P, rid, n, 500 + k)
            for name in E.LAYER_NAMES:  # another request reuses the freed blocks at once
                P.kv[name].view(torch.int16)[:, skipped] = 4242
            delay, params = P.sched.request_finished_all_groups(r, tuple(pgroups))
            first = _first_sw(n, second)
            assert delay and params["remote_block_ids"] == [pgroups[0], pgroups[1][first:]], params
            assert params["kvstage"]["groups"] == [[0, E.cdiv(n, E.BLOCK_SIZE)], [first, E.cdiv(n, E.BLOCK_SIZE)]]
            P.until(lambda: rid in P.sent, "finished_sending")
            # the decode side: the router hands the params on
            d = E.Request(f"d{k}", n, dict(params), 500 + k)
            ext, load = D.sched.get_num_new_matched_tokens(d, 0)
            assert (ext, load) == (n, True)
            nb = E.cdiv(n, E.BLOCK_SIZE)
            dg = [D.alloc(nb), [0] * first + D.alloc(nb - first)]  # allocate_new_computed_blocks: nulls, then new
            for name in E.LAYER_NAMES:
                D.kv[name].view(torch.int16)[:, 0] = 777  # the null block: never written
            D.sched.update_state_after_alloc(d, _Blocks(dg, [dg[0], dg[1][first:]]), ext)
            D.until(lambda: d.request_id in D.recvd, "finished_recving")
            assert D.worker.connector_worker.agent.ended.get(d.request_id) == "done"
            for li, name in enumerate(E.LAYER_NAMES):
                g = D.group_of[name]
                lo = 0 if g == 0 else first * E.BLOCK_SIZE
                b, o = _where(dg[g], lo, n)
                assert torch.equal(D.kv[name].view(torch.int16)[:, b, o], c[li][:, lo:]), (n, name)
                assert bool((D.kv[name].view(torch.int16)[:, 0] == 777).all()), (n, name)
            P.free.extend(b for grp in pgroups for b in grp if b)
            P.free.extend(skipped)
            D.free.extend(b for grp in dg for b in grp if b)
    finally:
        P.close()
        D.close()
    assert_pool_free(kv_proxy.socket)


@NEED_TORCH
@pytest.mark.parametrize("who", ["prefill", "decode"])
def test_aborts_end_with_the_pool_free(kv_proxy, who):
    """An abort on the prefill side after its copy began (freed at finished_sending, nothing handed off), or on the
    decode side while its load is open (its blocks given back at finished_recving): both pools' slots free after."""
    P = Side(kv_proxy.socket, "kv_producer")
    D = Side(kv_proxy.socket, "kv_consumer")
    E = P.E
    try:
        n = 21
        if who == "prefill":
            r, pgroups, _, _ = _prefill(P, "a0", n, 9, status="FINISHED_ABORTED")
            assert P.sched.request_finished_all_groups(r, tuple(pgroups)) == (True, None)
            P.until(lambda: "a0" in P.sent, "finished_sending of the aborted prefill")
        else:
            r, pgroups, _, _ = _prefill(P, "a1", n, 9)
            _, params = P.sched.request_finished_all_groups(r, tuple(pgroups))
            P.until(lambda: "a1" in P.sent, "finished_sending")
            d = E.Request("e1", n, dict(params), 9)
            first, nb = _first_sw(n), E.cdiv(n, E.BLOCK_SIZE)
            D.sched.get_num_new_matched_tokens(d, 0)
            dg = [D.alloc(nb), [0] * first + D.alloc(nb - first)]
            D.sched.update_state_after_alloc(d, _Blocks(dg, [dg[0], dg[1][first:]]), n)
            agent = D.worker.connector_worker.agent
            D.until(lambda: agent.load_state("e1")[0] in ("open", "copying", None), "the load open")
            d.status = E.RequestStatus.FINISHED_ABORTED
            assert D.sched.request_finished_all_groups(d, tuple(dg)) == (True, None)
            D.until(lambda: "e1" in D.recvd, "finished_recving of the aborted load")
            P.until(lambda: P.worker.connector_worker.agent.stage_state("a1")[0] is None, "the stage over")
    finally:
        P.close()
        D.close()
    assert_pool_free(kv_proxy.socket)


@NEED_TORCH
def test_hybrid_config_accepted_by_vllms_factory():
    """factory.py @ 9aaf83ef502f refuses a connector that is not SupportsHMA when the hybrid manager is on; this one
    is SupportsHMA, so a full + sliding-window config starts with the manager on (vLLM keeps two groups)."""
    import vllm_engine as E
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
    cfg = E.vllm_config("/nonexistent", E.free_port(), "kv_consumer")
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    assert supports_hma(KVConnectorFactory.get_connector_class(cfg.kv_transfer_config))
    c = KVConnectorFactory.create_connector(cfg, kv.KVConnectorRole.SCHEDULER, _config(16))
    assert [g.kind for g in c._settings.groups] == ["full", "sw"]


# ---------------------------------------------------------------------------------------------
# A state (Mamba) group: vLLM @ 9aaf83ef502f gives a Mamba layer's cache to register_kv_caches as a list of state
# tensors (gpu_model_runner.py _reshape_kv_cache_tensors: each torch.as_strided over the layer's raw tensor,
# (num_blocks, *shape), block stride page_size_bytes, the tensors one after another in a page); with prefix caching
# off (mamba_cache_mode 'none', block_size max_model_len) a request holds one state block (MambaManager).
# ---------------------------------------------------------------------------------------------

M_SHAPES, M_DTYPES = ((3, 20), (2, 4, 8)), ("float16", "float32")  # a conv state and an ssm state
M_PAGE = 512  # page_size_padded: 3*20*2 + 2*4*8*4 = 376 bytes of state, padded (to the attention page, in vLLM)
M_MARK = 0x77


def _mamba_spec(**kw):
    import vllm_engine as E
    from vllm.v1.kv_cache_interface import MambaSpec
    return MambaSpec(block_size=E.MAX_POS, shapes=M_SHAPES, dtypes=M_DTYPES, page_size_padded=M_PAGE, **kw)


def _state_config(nblocks, **kw):
    """Full attention (layers 0, 2) + one Mamba layer (1), as vLLM groups a hybrid model."""
    import vllm_engine as E
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    L0, L1, L2 = E.LAYER_NAMES
    a = dict(block_size=E.BLOCK_SIZE, num_kv_heads=E.HEADS, head_size=E.HEAD_DIM, dtype="float16")
    groups = [KVCacheGroupSpec([L0, L2], FullAttentionSpec(**a)), KVCacheGroupSpec([L1], _mamba_spec(**kw))]
    return KVCacheConfig(nblocks, [KVCacheTensor(0, [L0]), KVCacheTensor(0, [L1]), KVCacheTensor(0, [L2])], groups)


def _state_tensors(nblocks):
    """(raw bytes, [state tensors]) of one Mamba layer, built as gpu_model_runner.py builds them."""
    import torch
    raw = torch.full((nblocks * M_PAGE,), M_MARK, dtype=torch.uint8)
    out, off = [], 0
    for shape, dt in zip(M_SHAPES, M_DTYPES):
        dtype = getattr(torch, dt)
        size = torch.empty((), dtype=dtype).element_size()
        stride = torch.empty((nblocks, *shape)).stride()
        out.append(torch.as_strided(raw.view(dtype), (nblocks, *shape), (M_PAGE // size, *stride[1:]), off // size))
        off += stride[0] * size
    return raw, out


class StateSide(Side):
    """An engine of a full-attention + Mamba model: layer 1's cache is a list of state tensors."""

    def __init__(self, socket_path, role, nblocks=64):
        import vllm_engine as E
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        self.E = E
        self.cfg = E.vllm_config(socket_path, E.free_port(), role)
        self.cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
        kvcc = _state_config(nblocks)
        self.sched = KVConnectorFactory.create_connector(self.cfg, kv.KVConnectorRole.SCHEDULER, kvcc)
        self.worker = KVConnectorFactory.create_connector(self.cfg, kv.KVConnectorRole.WORKER, kvcc)
        L0, L1, L2 = E.LAYER_NAMES
        self.raw, states = _state_tensors(nblocks)
        self.kv = {L0: E.kv_cache(nblocks), L1: states, L2: E.kv_cache(nblocks)}
        self.group_of = {L0: 0, L1: 1, L2: 0}
        self.worker.register_kv_caches(self.kv)
        self.free = list(range(nblocks - 1, 0, -1))  # block 0: vLLM's null block
        self.sent, self.recvd = set(), set()

    def step(self, so=None, forward=False):
        E = self.E
        so = so or E.SchedulerOutput()
        meta = self.sched.build_connector_meta(so)
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        if forward:  # vLLM's attention layers announce themselves; the Mamba layer does not (wait_for_save copies it)
            for name in E.LAYER_NAMES:
                if self.group_of[name] == 0:
                    w.save_kv_layer(name, self.kv[name], None)
        w.wait_for_save()
        fs, fr = w.get_finished(set())
        w.clear_connector_metadata()
        self.sent |= set(fs or ())
        self.recvd |= set(fr or ())
        self.sched.update_connector_output(E.KVConnectorOutput(set(fs or ()), set(fr or ()), set()))


def _state_prefill(P, rid, n_prompt, seed, status="FINISHED_LENGTH_CAPPED"):
    """A one-step prefill of a prompt of n_prompt tokens on a full-attention + Mamba model: the connector truncates
    the request to n_prompt - 1 tokens (NixlConnector's rule), whose full-attention blocks and state block are
    written, then staged. Returns the request, its blocks per group, the attention content, the state written."""
    import torch
    E = P.E
    r = E.Request(rid, n_prompt, E.prefill_params(), seed)
    assert P.sched.get_num_new_matched_tokens(r, 0) == (0, False)
    n = n_prompt - 1
    assert (r.num_prompt_tokens, len(r.prompt_token_ids), r.max_tokens) == (n, n, 1)
    groups = [P.alloc(E.cdiv(n, E.BLOCK_SIZE)), P.alloc(1)]
    c = _content(seed, n)
    for li, name in enumerate(E.LAYER_NAMES):
        if P.group_of[name] == 0:
            b, o = _where(groups[0], 0, n)
            P.kv[name].view(torch.int16)[:, b, o] = c[li]
    g = torch.Generator().manual_seed(seed + 1)
    state = [torch.randint(-1000, 1000, t.shape[1:], generator=g).to(t.dtype) for t in P.kv[E.LAYER_NAMES[1]]]
    for t, v in zip(P.kv[E.LAYER_NAMES[1]], state):
        t[groups[1][0]] = v
    P.sched.update_state_after_alloc(r, _Blocks(groups, groups), 0)
    so = E.SchedulerOutput()
    so.scheduled_new_reqs.append(E.NewRequestData(rid, r.prompt_token_ids, tuple(list(x) for x in groups), 0))
    so.num_scheduled_tokens[rid] = n
    P.step(so, forward=True)
    r.num_computed_tokens, r.output = n, [0]
    r.status = getattr(E.RequestStatus, status)
    return r, groups, c, state


@NEED_TORCH
def test_state_group_moved_byte_exact(kv_proxy):
    """Full attention + Mamba: the prefill side computes the prompt less its last token (which the decode side computes,
    as with NixlConnector); the decode's full-attention blocks equal the prefill's at every position staged, its
    state block equals the prefill's state block byte for byte in every state tensor; no other byte of the Mamba
    layer's cache (other blocks, the null block, a page's padding) is written. A one-token prompt is not loaded."""
    import torch
    P = StateSide(kv_proxy.socket, "kv_producer")
    D = StateSide(kv_proxy.socket, "kv_consumer")
    E = P.E
    L1 = E.LAYER_NAMES[1]
    try:
        for k, N in enumerate((22, 9, 2)):
            rid = f"m{k}"
            r, pgroups, c, state = _state_prefill(P, rid, N, 700 + k)
            n = N - 1
            delay, params = P.sched.request_finished_all_groups(r, tuple(pgroups))
            assert delay and params["remote_block_ids"] == [pgroups[0], pgroups[1]], params
            assert params["kvstage"]["num_tokens"] == n
            assert params["kvstage"]["groups"] == [[0, E.cdiv(n, E.BLOCK_SIZE)], [0, 1]]
            P.until(lambda: rid in P.sent, "finished_sending")
            for t in P.kv[L1]:  # the block is free again and another request's state lands in it
                t[pgroups[1][0]] = 5
            d = E.Request(f"dm{k}", N, dict(params), 700 + k)
            assert D.sched.get_num_new_matched_tokens(d, 0) == (n, True)
            dg = [D.alloc(E.cdiv(n, E.BLOCK_SIZE)), D.alloc(1)]
            before = D.raw.clone()
            D.sched.update_state_after_alloc(d, _Blocks(dg, dg), n)
            D.until(lambda: d.request_id in D.recvd, "finished_recving")
            assert D.worker.connector_worker.agent.ended.get(d.request_id) == "done"
            for li, name in enumerate(E.LAYER_NAMES):
                if D.group_of[name] == 0:
                    b, o = _where(dg[0], 0, n)
                    assert torch.equal(D.kv[name].view(torch.int16)[:, b, o], c[li]), (N, name)
            for t, v in zip(D.kv[L1], state):
                assert torch.equal(t[dg[1][0]], v), (N, t.dtype)
            written = torch.zeros_like(D.raw, dtype=torch.bool)
            page = dg[1][0] * M_PAGE
            written[page:page + sum(t[0].numel() * t.element_size() for t in D.kv[L1])] = True
            assert torch.equal(D.raw[~written], before[~written]), N
            P.free.extend(b for grp in pgroups for b in grp)
            D.free.extend(b for grp in dg for b in grp)
        # a one-token prompt: not truncated, and nothing before its last token to load: the decode side computes it
        r = E.Request("m1tok", 1, E.prefill_params(), 1)
        assert P.sched.get_num_new_matched_tokens(r, 0) == (0, False) and r.num_prompt_tokens == 1
        one = dict(params["kvstage"], num_tokens=1, num_blocks=1, groups=[[0, 1], [0, 1]])
        d = E.Request("dm1tok", 1, dict(params, kvstage=one), 1)
        assert D.sched.get_num_new_matched_tokens(d, 0) == (0, False)
    finally:
        P.close()
        D.close()
    assert_pool_free(kv_proxy.socket)


@NEED_TORCH
@pytest.mark.parametrize("who", ["prefill", "decode"])
def test_state_group_aborts_end_with_the_pool_free(kv_proxy, who):
    """Full attention + Mamba: an abort on the prefill side after its copy began, or on the decode side while its load
    is open: both end with the pool's slots free; an aborted load writes no state."""
    P = StateSide(kv_proxy.socket, "kv_producer")
    D = StateSide(kv_proxy.socket, "kv_consumer")
    E = P.E
    try:
        N = 21
        if who == "prefill":
            r, pgroups, _, _ = _state_prefill(P, "ma0", N, 9, status="FINISHED_ABORTED")
            assert P.sched.request_finished_all_groups(r, tuple(pgroups)) == (True, None)
            P.until(lambda: "ma0" in P.sent, "finished_sending of the aborted prefill")
        else:
            r, pgroups, _, _ = _state_prefill(P, "ma1", N, 9)
            _, params = P.sched.request_finished_all_groups(r, tuple(pgroups))
            P.until(lambda: "ma1" in P.sent, "finished_sending")
            d = E.Request("me1", N, dict(params), 9)
            assert D.sched.get_num_new_matched_tokens(d, 0) == (N - 1, True)
            dg = [D.alloc(E.cdiv(N - 1, E.BLOCK_SIZE)), D.alloc(1)]
            D.sched.update_state_after_alloc(d, _Blocks(dg, dg), N - 1)
            agent = D.worker.connector_worker.agent
            D.until(lambda: agent.load_state("me1")[0] in ("open", "copying", None), "the load open")
            d.status = E.RequestStatus.FINISHED_ABORTED
            assert D.sched.request_finished_all_groups(d, tuple(dg)) == (True, None)
            D.until(lambda: "me1" in D.recvd, "finished_recving of the aborted load")
            P.until(lambda: P.worker.connector_worker.agent.stage_state("ma1")[0] is None, "the stage over")
    finally:
        P.close()
        D.close()
    assert_pool_free(kv_proxy.socket)


@NEED_TORCH
@pytest.mark.parametrize("kw,why", [
    (dict(mamba_cache_mode="all"), r"has mamba_cache_mode 'all' \(Mamba prefix caching\)"),
    (dict(mamba_cache_mode="align"), r"has mamba_cache_mode 'align' \(Mamba prefix caching\)"),
    (dict(num_speculative_blocks=2),
     r"has 2 speculative state blocks \(num_speculative_blocks, speculative decoding\)"),
], ids=["prefix-caching-all", "prefix-caching-align", "speculative"])
def test_unsupported_state_configs_refused_with_their_reason(kw, why):
    """A Mamba group with prefix caching (mamba_cache_mode 'all'/'align': states at block boundaries, the live one moved
    between blocks) or speculative state blocks is refused at start, one line naming the group and why; the plain
    one (mode 'none') starts."""
    import vllm_engine as E
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    cfg = E.vllm_config("/nonexistent", E.free_port(), "kv_consumer")
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    c = KVConnectorFactory.create_connector(cfg, kv.KVConnectorRole.SCHEDULER, _state_config(16))
    assert [g.kind for g in c._settings.groups] == ["full", "mamba"]
    for role in (kv.KVConnectorRole.SCHEDULER, kv.KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match=r"^kvstage connector: KV cache group 1 \(MambaSpec, layers "
                                             r"model.layers.1.self_attn.attn\) " + why + r": kvstage moves a state "
                                             r"group's one state block per request"):
            KVConnectorFactory.create_connector(cfg, role, _state_config(16, **kw))
