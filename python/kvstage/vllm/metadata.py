"""kvstage.vllm: what the scheduler side hands the workers each step (KvstageConnectorMetadata)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata  # type: ignore


@dataclasses.dataclass
class SaveSpec:
    """Prefill: copy these blocks (the request's first num_blocks, in order) into slots in this forward."""
    req_id: str
    block_ids: tuple
    num_tokens: int
    stage_timeout: float
    decode_tp: int = 0  # the decode side's TP size it is staged for (0: this side's): its shares' head slices
    mla_rank: int = 0  # MLA: the one prefill rank that stages it (config.mla_stager); the others copy nothing


@dataclasses.dataclass
class RecvSpec:
    """Decode: load the prefill request's room into local_block_ids (request positions skip...)."""
    req_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    num_blocks: int
    local_block_ids: tuple
    skip: int
    load_timeout: float
    error: Optional[str] = None  # set: fail the load at once (the scheduler found it unusable)
    remote_tp: int = 0  # the prefill side's TP size (0: this side's): which prefill ranks hold this rank's heads
    mla: bool = False  # replicated KV (MLA): one rank opens one room all this instance's ranks read (join)
    remote_block_size: int = 0  # the prefill side's block size (0: this side's): the room is its blocks' tokens
    mla_rank: int = 0  # MLA: the prefill rank that staged it, which the room is pulled from
    mla_leader: int = 0  # MLA: the decode rank that opens the shared room and pulls (config.mla_reader)


@dataclasses.dataclass
class KvstageConnectorMetadata(KVConnectorMetadata):
    reqs_to_save: dict = dataclasses.field(default_factory=dict)     # P: req_id -> SaveSpec
    reqs_finished: dict = dataclasses.field(default_factory=dict)    # P: req_id -> (handoff, delayed)
    reqs_to_unstage: set = dataclasses.field(default_factory=set)    # P: staged before a preemption: invalid
    reqs_to_recv: dict = dataclasses.field(default_factory=dict)     # D: req_id -> RecvSpec
    reqs_to_abort: set = dataclasses.field(default_factory=set)      # D: loads the scheduler gave up on
    reqs_to_drop: list = dataclasses.field(default_factory=list)     # D: (host, port, remote_request_id[, remote
    #                                                                    TP size where it differs, or for MLA 0 and
    #                                                                    the prefill rank that staged it]) never loaded
    abort_times: dict = dataclasses.field(default_factory=dict)      # P, D: req_id -> time.time() of its abort
