"""Stand-in (tests only) of prometheus_client's Counter, Gauge and Histogram, as far as vLLM's metrics use them:
a metric with labelnames, .labels(*values) -> its child, child.inc(n) / .set(v) / .observe(v); and
generate_latest(registry=None) -> the text exposition of every metric made (bytes). Values are kept exactly so a test
can read them: collect() -> [(name, labels dict, kind, value)]."""
import threading

REGISTRY = []
_lock = threading.Lock()
STAND_IN = True


class _Metric:
    kind = None

    def __init__(self, name, documentation, labelnames=(), buckets=None, **kw):
        if self.kind == "counter" and name.endswith("_total"):
            name = name[:-len("_total")]
        self._name, self._doc, self._labelnames = name, documentation, tuple(labelnames)
        self._buckets = sorted(buckets) if buckets is not None else None
        self._children = {}
        with _lock:
            if any(m._name == name for m in REGISTRY):
                raise ValueError(f"Duplicated timeseries in CollectorRegistry: {name}")
            REGISTRY.append(self)

    def labels(self, *values, **kw):
        if kw:
            values = tuple(kw[n] for n in self._labelnames)
        if len(values) != len(self._labelnames):
            raise ValueError("Incorrect label count")
        key = tuple(str(v) for v in values)
        with _lock:
            c = self._children.get(key)
            if c is None:
                c = self._children[key] = _Child(self)
        return c


class _Child:
    def __init__(self, parent):
        self.parent, self.value, self.count, self.obs = parent, 0.0, 0, []

    def inc(self, amount=1):
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount

    def set(self, value):
        self.value = float(value)

    def observe(self, amount):
        self.value += amount
        self.count += 1
        self.obs.append(amount)


class Counter(_Metric):
    kind = "counter"


class Gauge(_Metric):
    kind = "gauge"


class Histogram(_Metric):
    kind = "histogram"


def collect():
    out = []
    for m in list(REGISTRY):
        for key, c in m._children.items():
            labels = dict(zip(m._labelnames, key))
            if m.kind == "histogram":
                out.append((m._name + "_count", labels, m.kind, c.count))
                out.append((m._name + "_sum", labels, m.kind, c.value))
            elif m.kind == "counter":
                out.append((m._name + "_total", labels, m.kind, c.value))
            else:
                out.append((m._name, labels, m.kind, c.value))
    return out


def generate_latest(registry=None):
    lines = []
    for name, labels, _, v in collect():
        lab = ",".join(f'{k}="{val}"' for k, val in labels.items())
        lines.append(f"{name}{{{lab}}} {v}")
    return ("\n".join(lines) + "\n").encode()
