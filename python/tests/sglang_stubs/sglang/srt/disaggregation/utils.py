"""Stand-in of sglang/srt/disaggregation/utils.py @ 8905cbd42f4a: the backend lookup (an if/elif over a closed enum)."""
from enum import Enum


class DisaggregationMode(Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


class TransferBackend(Enum):
    MOONCAKE = "mooncake"
    MORI = "mori"
    NIXL = "nixl"
    ASCEND = "ascend"
    FAKE = "fake"


class KVClassType(Enum):
    KVARGS = "kvargs"
    MANAGER = "manager"
    SENDER = "sender"
    RECEIVER = "receiver"
    BOOTSTRAP_SERVER = "bootstrap_server"


class _Builtin:
    """What SGLang's own backends would answer (their modules are not here)."""

    def __init__(self, backend, class_type):
        self.backend, self.class_type = backend, class_type

    def __repr__(self):
        return f"<builtin {self.backend.value} {self.class_type.value}>"


def get_kv_class(transfer_backend, class_type):
    if transfer_backend in (TransferBackend.MOONCAKE, TransferBackend.MORI, TransferBackend.ASCEND,
                            TransferBackend.NIXL, TransferBackend.FAKE):
        return _Builtin(transfer_backend, class_type)
    raise ValueError(f"Unsupported transfer backend: {transfer_backend}")
