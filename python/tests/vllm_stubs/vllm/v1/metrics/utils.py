"""Stand-in (tests only): vllm/v1/metrics/utils.py @ 9aaf83ef502f, create_metric_per_engine."""


def create_metric_per_engine(metric, per_engine_labelvalues):
    """Create a labeled metric child for each engine index."""
    return {idx: metric.labels(*labelvalues) for idx, labelvalues in per_engine_labelvalues.items()}
