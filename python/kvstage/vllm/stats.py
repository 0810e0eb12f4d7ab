"""kvstage.vllm: vLLM's KVConnectorStats (per worker, aggregated across workers by vLLM) and the vllm:kvstage_*
Prometheus families."""
from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # type: ignore
    KVConnectorPromMetrics, KVConnectorStats)


_STAT_KEYS = ("bytes_sent", "bytes_received", "num_failed_transfers", "num_stale_rejections", "abort_to_free_seconds",
              "num_checksum_failures")


@dataclasses.dataclass
class KvstageKVConnectorStats(KVConnectorStats):
    """One worker's observations since its last report, as lists (NixlKVConnectorStats' shape, so vLLM's
    KVOutputAggregator and stat loggers aggregate and reduce them): bytes_sent (one entry per request whose staged KV
    the decode side received), bytes_received (per load copied into its blocks), num_failed_transfers (1 per stage or
    load that failed: refused, expired, timed out, lost), num_stale_rejections (1 per chunk the proxy refused as stale
    or not ours), abort_to_free_seconds (per aborted or preempted request: from the scheduler's request_finished, or
    the preemption, to the worker reporting its blocks free), num_checksum_failures (1 per load whose room differed
    from its end-to-end checksums: kvstage_checksum; it counts in num_failed_transfers too)."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {k: [] for k in _STAT_KEYS}

    def clone_and_reset(self):
        old = KvstageKVConnectorStats(data={k: list(v) for k, v in self.data.items()})
        self.reset()
        return old

    def is_empty(self):
        return not any(self.data.get(k) for k in _STAT_KEYS)

    def aggregate(self, other):
        if not other.is_empty():
            for k, v in other.data.items():
                self.data.setdefault(k, []).extend(v)
        return self

    def reduce(self):
        d = {k: self.data.get(k, []) for k in _STAT_KEYS}
        waits = d["abort_to_free_seconds"]
        return {
            "Num transfers sent": len(d["bytes_sent"]),
            "Num transfers received": len(d["bytes_received"]),
            "MB sent": round(sum(d["bytes_sent"]) / 2 ** 20, 3),
            "MB received": round(sum(d["bytes_received"]) / 2 ** 20, 3),
            "Num failed transfers": len(d["num_failed_transfers"]),
            "Num stale rejections": len(d["num_stale_rejections"]),
            "Num checksum failures": len(d["num_checksum_failures"]),
            "Num aborts freed": len(waits),
            "Max abort-to-free (ms)": round(max(waits) * 1e3, 3) if waits else 0,
        }


class KvstagePromMetrics(KVConnectorPromMetrics):
    """vllm:kvstage_* families in vLLM's /metrics, one child per engine (vLLM's labelnames and per-engine values):
    transfers_sent, transfers_received, bytes_sent, bytes_received, num_failed_transfers, num_stale_rejections
    (counters: prometheus_client shows them with _total), abort_to_free_seconds (histogram)."""

    COUNTERS = (  # (family, documentation, stats key, value added per entry: None = the entry itself)
        ("vllm:kvstage_transfers_sent", "Requests whose KV the decode side received from kvstage slots.",
         "bytes_sent", 1),
        ("vllm:kvstage_transfers_received", "Requests whose KV was loaded from kvstage into their blocks.",
         "bytes_received", 1),
        ("vllm:kvstage_bytes_sent", "Bytes of KV sent through kvstage.", "bytes_sent", None),
        ("vllm:kvstage_bytes_received", "Bytes of KV received through kvstage.", "bytes_received", None),
        ("vllm:kvstage_num_failed_transfers", "kvstage stages or loads that failed.", "num_failed_transfers", 1),
        ("vllm:kvstage_num_stale_rejections", "Chunks the kvstage proxy refused (stale lease or epoch).",
         "num_stale_rejections", 1),
        ("vllm:kvstage_num_checksum_failures", "kvstage loads whose bytes failed their end-to-end checksum.",
         "num_checksum_failures", 1),
    )
    ABORT_BUCKETS = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric):  # vllm/v1/metrics/utils.py create_metric_per_engine
            return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

        self.counters = [(key, add, per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames)))
                         for name, doc, key, add in self.COUNTERS]
        self.abort_to_free = per_engine(self._histogram_cls(
            name="vllm:kvstage_abort_to_free_seconds",
            documentation="Time from a request's abort (or preemption) to its KV blocks being free, with kvstage.",
            buckets=self.ABORT_BUCKETS, labelnames=labelnames))

    def observe(self, transfer_stats_data, engine_idx=0):
        for key, add, metric in self.counters:
            vals = transfer_stats_data.get(key) or ()
            n = len(vals) if add == 1 else sum(vals)
            if n:
                metric[engine_idx].inc(n)
        for v in transfer_stats_data.get("abort_to_free_seconds") or ():
            self.abort_to_free[engine_idx].observe(v)
