"""kvstage.sglang: SGLang's classes the backend builds on. Without SGLang the package still imports (its layout
pieces work), but the backend classes refuse to be instantiated. The test suite puts SGLang stand-ins on sys.path
instead (python/tests/sglang_stubs)."""
from __future__ import annotations

import dataclasses
import enum
import logging
import os
from typing import Optional


logger = logging.getLogger("kvstage.sglang")


try:
    from sglang.srt.disaggregation.base.conn import (  # type: ignore
        BaseKVBootstrapServer, BaseKVManager, BaseKVReceiver, BaseKVSender, KVArgs, KVPoll)
    try:
        from sglang.srt.disaggregation.base.conn import KVTransferMetric  # type: ignore
    except ImportError:  # older SGLang
        KVTransferMetric = None
    HAVE_SGLANG = True
    _NO_SGLANG = None
except Exception as _e:  # not installed, or it failed to import
    logger.debug("kvstage.sglang: SGLang not importable (%s); the backend classes are unusable", _e)
    HAVE_SGLANG = False
    _NO_SGLANG = f"{type(_e).__name__}: {_e}"

    class _NeedsSGLang:
        """Base of the backend classes when SGLang is not importable: instantiating one raises ImportError."""

        def __new__(cls, *a, **kw):
            raise ImportError(f"kvstage.sglang.{cls.__name__} is an SGLang transfer backend class and needs SGLang "
                              f"importable ({_NO_SGLANG}); python/SGLANG.md says which versions")

    BaseKVBootstrapServer = BaseKVManager = BaseKVReceiver = BaseKVSender = KVArgs = _NeedsSGLang
    KVPoll = None
    KVTransferMetric = None

if KVTransferMetric is None:
    @dataclasses.dataclass
    class KVTransferMetric:  # noqa: F811 - SGLang's shape
        transfer_latency_s: Optional[float] = None
        alloc_latency_s: Optional[float] = None
        transfer_total_bytes: Optional[int] = None

try:
    from sglang.srt.disaggregation.utils import DisaggregationMode  # type: ignore
except Exception:
    class DisaggregationMode(enum.Enum):
        NULL = "null"
        PREFILL = "prefill"
        DECODE = "decode"


# SGLang's common pieces (disaggregation/common/conn.py): the bootstrap server kvstage's prefill ranks register
# with (bootstrap.py), the prefill info the decode side reads, the failure exception.
try:
    from sglang.srt.disaggregation.common.conn import (  # type: ignore
        CommonKVBootstrapServer, KVTransferError, PrefillServerInfo)
    _NO_COMMON = None
except Exception as _e:  # no SGLang, or one older than common/conn.py (May 2025), or without aiohttp
    _NO_COMMON = f"{type(_e).__name__}: {_e}"

    class _NeedsCommon(Exception):
        """What CommonKVBootstrapServer, PrefillServerInfo and KVTransferError are without SGLang's
        common/conn.py: nothing of the backend runs then, and making one raises ImportError."""

        def __new__(cls, *a, **kw):
            raise ImportError(f"kvstage's bootstrap server is SGLang's own CommonKVBootstrapServer and needs SGLang "
                              f"with sglang.srt.disaggregation.common.conn importable ({_NO_COMMON})")

    CommonKVBootstrapServer = PrefillServerInfo = KVTransferError = _NeedsCommon  # type: ignore[misc]


def _env_float(name, default):
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise ValueError(f"${name} must be a number of seconds, not {os.environ[name]!r}") from None


def _mode(m):
    """Returns 'prefill' or 'decode' for a DisaggregationMode (any enum with that value) or string."""
    v = getattr(m, "value", m)
    if v not in ("prefill", "decode"):
        raise ValueError(f"unsupported DisaggregationMode: {m!r}")
    return v
