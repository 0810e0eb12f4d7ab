"""Stand-in (tests only): vllm/distributed/kv_transfer/kv_connector/v1/__init__.py @ 9aaf83ef502f (its exports)."""
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: F401
    KVConnectorBase_V1, KVConnectorRole, SupportsHMA, supports_hma)
