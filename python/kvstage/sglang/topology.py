"""kvstage.sglang: attention-TP sizes that differ - which prefill ranks serve a decode rank, and which heads each
pair moves. Both are SGLang's rules at 8905cbd42f4a: CommonKVManager._resolve_rank_mapping (common/conn.py) for the
ranks, MooncakeKVManager.send_kvcache_slice (mooncake/conn.py) for the head ranges. kvstage moves each pair's share
through a room of its own; nothing of it writes an engine page except the receiving side's copy-out."""
from __future__ import annotations


def tp_sizes_unsupported(prefill_tp, decode_tp):
    """Returns why the kvstage backend cannot pair these attention-TP sizes (None: it can): one must be the other
    times a power of two."""
    lo, hi = sorted((int(prefill_tp), int(decode_tp)))
    if lo < 1:
        return "an attention-TP size below 1"
    if hi % lo or (hi // lo) & (hi // lo - 1):
        return "one attention-TP size must be the other times a power of two"
    return None


def rank_mapping(prefill_tp, decode_tp, decode_rank, is_mla):
    """SGLang's _resolve_rank_mapping, TP part: returns (target_tp_rank, target_tp_ranks, required_dst_info_num,
    required_prefill_response_num) for decode rank decode_rank (engine_rank; taken modulo decode_tp). For MLA with
    the prefill side wider, only target_tp_rank sends; the other target ranks are SGLang's dummy ranks."""
    P, D = int(prefill_tp), int(decode_tp)
    d = int(decode_rank) % D
    if D == P:
        return d, [d], 1, 1
    if D > P:
        return d // (D // P), [d // (D // P)], D // P, 1
    k = P // D
    ranks = list(range(d * k, (d + 1) * k))
    return ranks[0], ranks, 1, 1 if is_mla else k


def decode_slices(prefill_tp, decode_tp, prefill_rank, kv_item_lens, page_size, is_mla):
    """The part of each of its tokens a decode rank expects from prefill rank prefill_rank: per KV buffer
    [offset, length] in bytes of its token (kv_item_lens[b] // page_size bytes). A decode rank does not know the
    model's KV head count (SGLang gives it only with its staging buffer), so it assumes no GQA replication on the
    prefill side: prefill_tp / decode_tp prefill ranks each fill an equal part, in rank order. The prefill rank
    checks this against Mooncake's arithmetic with the head count (prefill_slices) and refuses what differs."""
    P, D, ps = int(prefill_tp), int(decode_tp), int(page_size)
    out = []
    for b, item in enumerate(kv_item_lens):
        if ps < 1 or item % ps:
            raise ValueError(f"KV buffer {b}: item of {item} bytes is not {ps} tokens")
        tok = item // ps
        if is_mla or D >= P:
            out.append([0, tok])
            continue
        k = P // D
        if tok % k:
            raise ValueError(f"KV buffer {b}: a {tok}-byte token cannot take {k} prefill ranks' heads")
        out.append([(prefill_rank % k) * (tok // k), tok // k])
    return out


def head_slice(total_heads, prefill_tp, prefill_rank, decode_tp, decode_rank, src_token, dst_token):
    """Mooncake's send_kvcache_slice for one KV buffer: returns (src_off, dst_off, nbytes), the bytes of each token
    prefill rank prefill_rank sends to decode rank decode_rank (at src_off of its token, src_token bytes) and where
    they go in the decode rank's token (dst_off, dst_token bytes). Raises ValueError when the tokens do not split into
    heads the same way on both sides (another dtype, head size or head count)."""
    H, P, D = int(total_heads), int(prefill_tp), int(decode_tp)
    p, d = int(prefill_rank) % P, int(decode_rank) % D
    src_heads, dst_heads = max(1, H // P), max(1, H // D)
    head = dst_token // dst_heads
    if head < 1 or dst_token % dst_heads or src_token != src_heads * head:
        raise ValueError(f"tokens of {src_token} bytes here ({src_heads} heads) and {dst_token} bytes on the decode "
                         f"side ({dst_heads} heads) are not the same heads: another dtype, head size or head count")
    if P > D:
        src_start, count = 0, src_heads
        dst_start = ((p // max(1, P // H)) * src_heads) % dst_heads
    else:  # consecutive decode ranks share a KV head when H < D (QKVParallelLinear: tp_rank // replicas)
        src_start = ((d // max(1, D // H)) * dst_heads) % src_heads
        count, dst_start = dst_heads, 0
    if (dst_start + count) * head > dst_token:
        raise ValueError(f"{count} heads from head {dst_start} do not fit a {dst_token}-byte token")
    return src_start * head, dst_start * head, count * head
