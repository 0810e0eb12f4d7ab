"""Stand-in of sglang/srt/disaggregation/base/conn.py @ 8905cbd42f4a: names, values, abstract methods."""
import dataclasses
import enum
from abc import ABC, abstractmethod
from typing import List, Optional


class StateType(str, enum.Enum):
    MAMBA = "mamba"
    SWA = "swa"
    NSA = "nsa"


@dataclasses.dataclass
class KVTransferMetric:
    transfer_latency_s: Optional[float] = None
    alloc_latency_s: Optional[float] = None
    transfer_total_bytes: Optional[int] = None


class KVArgs:
    """A plain attribute bag the engine fills."""
    engine_rank: int
    kv_data_ptrs: List[int]
    kv_data_lens: List[int]
    kv_item_lens: List[int]
    aux_data_ptrs: List[int]
    aux_data_lens: List[int]
    aux_item_lens: List[int]
    state_types: List[StateType]
    state_data_ptrs: List[List[int]]
    state_data_lens: List[List[int]]
    state_item_lens: List[List[int]]
    ib_device: str
    ib_traffic_class: str
    gpu_id: int
    kv_head_num: int
    total_kv_head_num: int
    page_size: int
    system_dp_rank: int
    pp_rank: int
    prefill_start_layer: int
    dcp_size: int = 1
    dcp_rank: int = 0


class KVPoll:
    """Plain ints (SGLang MIN-reduces them across ranks)."""
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class BaseKVManager(ABC):
    @abstractmethod
    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False): ...

    @abstractmethod
    def register_to_bootstrap(self): ...


class BaseKVSender(ABC):
    @abstractmethod
    def __init__(self, mgr, bootstrap_addr, bootstrap_room, dest_tp_ranks, pp_rank,
                 req_has_disagg_prefill_dp_rank=False): ...

    @abstractmethod
    def init(self, num_kv_indices, aux_index=None): ...

    @abstractmethod
    def send(self, kv_indices, state_indices=None, token_position_offset=0): ...

    def pop_decode_prefix_len(self):
        return 0

    def should_send_kv_chunk(self, num_pages, last_chunk):
        return num_pages > 0

    @abstractmethod
    def get_transfer_metric(self): ...

    @abstractmethod
    def poll(self): ...

    @abstractmethod
    def failure_exception(self): ...

    def clear(self):
        pass

    def abort(self):
        pass


class BaseKVReceiver(ABC):
    @abstractmethod
    def __init__(self, mgr, bootstrap_addr, bootstrap_room=None): ...

    @abstractmethod
    def init(self, prefill_dp_rank): ...

    @abstractmethod
    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None): ...

    @abstractmethod
    def poll(self): ...

    @abstractmethod
    def failure_exception(self): ...

    def clear(self):
        pass

    def abort(self):
        pass


class BaseKVBootstrapServer(ABC):
    @abstractmethod
    def __init__(self, host, port): ...
