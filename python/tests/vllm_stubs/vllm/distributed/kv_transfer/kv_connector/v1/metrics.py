"""Stand-in (tests only): vllm/distributed/kv_transfer/kv_connector/v1/metrics.py @ 9aaf83ef502f - KVConnectorStats,
KVConnectorPromMetrics, and KVConnectorProm (how vLLM's stat loggers build and feed a connector's metrics)."""
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union

from prometheus_client import Counter, Gauge, Histogram

PromMetric = Union[Gauge, Counter, Histogram]
PromMetricT = TypeVar("PromMetricT", bound=PromMetric)


@dataclass
class KVConnectorStats:
    data: dict = field(default_factory=dict)

    def reset(self):
        raise NotImplementedError

    def aggregate(self, other: "KVConnectorStats") -> "KVConnectorStats":
        raise NotImplementedError

    def reduce(self) -> dict:
        raise NotImplementedError

    def is_empty(self) -> bool:
        raise NotImplementedError


class KVConnectorPromMetrics:
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._gauge_cls = metric_types[Gauge]
        self._counter_cls = metric_types[Counter]
        self._histogram_cls = metric_types[Histogram]
        self._labelnames = labelnames
        self.per_engine_labelvalues = per_engine_labelvalues

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        raise NotImplementedError


class KVConnectorProm:
    """vLLM's: connector_cls.build_prom_metrics(vllm_config, {Gauge: .., Counter: .., Histogram: ..}, labelnames,
    per_engine_labelvalues), then observe(stats data, engine_idx) per engine. (The real one finds connector_cls through
    KVConnectorFactory.get_connector_class; here the caller passes it.)"""
    _gauge_cls = Gauge
    _counter_cls = Counter
    _histogram_cls = Histogram

    def __init__(self, vllm_config, labelnames, per_engine_labelvalues, connector_cls):
        metric_types = {Gauge: self._gauge_cls, Counter: self._counter_cls, Histogram: self._histogram_cls}
        self.prom_metrics = connector_cls.build_prom_metrics(vllm_config, metric_types, labelnames,
                                                             per_engine_labelvalues)

    def observe(self, transfer_stats_data, engine_idx=0):
        if self.prom_metrics is None:
            return
        self.prom_metrics.observe(transfer_stats_data, engine_idx)
