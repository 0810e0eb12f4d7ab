"""Several KV cache groups (vLLM's hybrid KV cache manager on; the connector is SupportsHMA): a full-attention group
and a sliding-window group, as vLLM @ 9aaf83ef502f lays them out (kv_cache_interface.py KVCacheConfig: one tensor
shared by a layer of each group, one block pool, block 0 the null block that stands for a sliding window's skipped
blocks; scheduler.py: block ids per group in update_state_after_alloc, SchedulerOutput and
request_finished_all_groups after remove_skipped_blocks). Real kvstaged, real connectors on both sides, created
through vLLM's factory with the hybrid manager on."""
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


@NEED_TORCH
def test_state_group_refused_with_its_reason():
    """A Mamba (state) group is not moved yet: refused at start, one line naming the group and why."""
    import vllm_engine as E
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec
    cfg = E.vllm_config("/nonexistent", E.free_port(), "kv_consumer")
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    kvcc = _config(16, KVCacheGroupSpec(["model.layers.3.mixer"], MambaSpec(block_size=64, shapes=((4, 8),),
                                                                             dtypes=("float16",))))
    for role in (kv.KVConnectorRole.SCHEDULER, kv.KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match=r"^kvstage connector: KV cache group 2 \(MambaSpec, layers "
                                             r"model.layers.3.mixer\) holds per-request state \(Mamba\): kvstage "
                                             r"moves full-attention, sliding-window and chunked-local KV cache groups, not state groups"):
            KVConnectorFactory.create_connector(cfg, role, kvcc)
