"""Stand-in (tests only): vllm/v1/kv_cache_interface.py @ 9aaf83ef502f - the class names, hierarchy and fields of the
KV cache specs, groups and config that kvstage.vllm and the tests read (methods, page sizes and docstrings left out;
dtype is a torch dtype there, anything here)."""
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    dtype: object
    page_size_padded: int | None = None


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    head_size_v: int = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    attention_chunk_size: int


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int
    head_size_v: int = None


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    shapes: tuple
    dtypes: tuple
    page_size_padded: int | None = None
    mamba_type: object = "MAMBA2"  # MambaAttentionBackendEnum.MAMBA2 there
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0


@dataclass
class KVCacheTensor:
    size: int
    shared_by: list


@dataclass
class KVCacheGroupSpec:
    layer_names: list
    kv_cache_spec: KVCacheSpec
    is_eagle_group: bool = False


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list
    kv_cache_groups: list
