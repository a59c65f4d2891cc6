"""``pb_utils.MetricFamily`` and ``Metric``: Python models publish their own Prometheus metrics, as in Triton.

A model creates a family once (``initialize``) and a metric per label set, then counts on the request
path with a lock-protected add; the daemon's ``/metrics`` endpoint reads every family when scraped.

Triton's API gives a model no handle to the server, so families live in one registry per process
(:data:`REGISTRY`), as they do in Triton.  Creating a family that exists with the same kind and
description returns it; a different kind is an error, as is a name that Prometheus would reject.
Misuse raises ``TritonModelException``, as Triton's does.
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from collections.abc import Iterator, Mapping, Sequence

from prometheus_client.metrics_core import Metric as _PromMetric

from edge_server.backends.pb_tensor import TritonModelException

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


class Metric:
    """One time series of a family (one label set).  Counters only go up; histograms only observe."""

    def __init__(
        self, family: MetricFamily, labels: Mapping[str, str], buckets: Sequence[float] | None
    ) -> None:
        self.family = family
        self.labels = dict(labels)
        self._lock = threading.Lock()
        self._value = 0.0
        self._buckets: list[float] = []
        self._counts: list[int] = []
        self._count = 0
        if family.kind == MetricFamily.HISTOGRAM:
            if buckets is None:  # an empty list is allowed: +Inf alone, as in Triton
                raise TritonModelException(f"histogram metric {family.name!r} needs buckets")
            edges = [float(b) for b in buckets]
            if edges != sorted(set(edges)):
                raise TritonModelException(
                    f"histogram {family.name!r}: buckets must increase, got {list(buckets)}"
                )
            self._buckets = edges
            self._counts = [0] * (len(edges) + 1)  # the last one: above every bucket (+Inf)
        elif buckets is not None:
            raise TritonModelException(f"metric {family.name!r}: only histograms take buckets")

    def increment(self, value: float) -> None:
        if self.family.kind == MetricFamily.HISTOGRAM:
            raise TritonModelException(f"histogram {self.family.name!r}: use observe()")
        if self.family.kind == MetricFamily.COUNTER and value < 0:
            raise TritonModelException(f"counter {self.family.name!r} cannot decrease (increment by {value})")
        with self._lock:
            self._value += value

    def set(self, value: float) -> None:
        if self.family.kind != MetricFamily.GAUGE:
            raise TritonModelException(f"metric {self.family.name!r} is not a gauge: set() is for gauges")
        with self._lock:
            self._value = float(value)

    def observe(self, value: float) -> None:
        if self.family.kind != MetricFamily.HISTOGRAM:
            raise TritonModelException(
                f"metric {self.family.name!r} is not a histogram: observe() is for histograms"
            )
        with self._lock:
            self._counts[bisect.bisect_left(self._buckets, value)] += 1
            self._count += 1
            self._value += value

    def value(self) -> float:
        if self.family.kind == MetricFamily.HISTOGRAM:
            raise TritonModelException(f"histogram {self.family.name!r} has no single value")
        with self._lock:
            return self._value

    def _samples(self) -> list[tuple[str, dict[str, str], float]]:
        name = self.family.name
        with self._lock:
            if self.family.kind != MetricFamily.HISTOGRAM:  # a counter without _total, as in Triton
                return [(name, self.labels, self._value)]
            samples = []
            cumulative = 0
            for edge, count in zip([*self._buckets, math.inf], self._counts, strict=True):
                cumulative += count
                le = "+Inf" if edge == math.inf else repr(edge).removesuffix(".0")  # Triton's "1", "2.5"
                samples.append((name + "_bucket", {**self.labels, "le": le}, float(cumulative)))
            samples.append((name + "_count", self.labels, float(self._count)))
            samples.append((name + "_sum", self.labels, self._value))
            return samples


_Series = Metric  # the method MetricFamily.Metric hides the class name inside the class body


class MetricFamily:
    """Triton's ``pb_utils.MetricFamily(name, description, kind)``; ``Metric(labels, buckets)``: a series."""

    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2
    _TYPES = {COUNTER: "counter", GAUGE: "gauge", HISTOGRAM: "histogram"}

    def __new__(
        cls, name: str, description: str, kind: int, *, registry: CustomMetrics | None = None
    ) -> MetricFamily:
        return (registry or REGISTRY).family(cls, name, description, kind)

    def _setup(self, name: str, description: str, kind: int) -> None:
        self.name = name  # samples carry it as given, as Triton's do (a counter gets no _total)
        self.description = description
        self.kind = kind
        self._lock = threading.Lock()
        self._metrics: dict[tuple[tuple[str, str], ...], _Series] = {}

    def __init__(
        self, name: str, description: str, kind: int, *, registry: CustomMetrics | None = None
    ) -> None:
        pass  # set up once, by the registry, in __new__

    def Metric(  # noqa: N802 (Triton's name)
        self, labels: Mapping[str, str] | None = None, buckets: Sequence[float] | None = None
    ) -> _Series:
        """The series for ``labels`` (the same object for the same labels)."""
        labels = dict(labels or {})
        for key, value in labels.items():
            if not isinstance(key, str) or not _LABEL.match(key) or key.startswith("__") or key == "le":
                raise TritonModelException(f"metric {self.name!r}: invalid label name {key!r}")
            if not isinstance(value, str):
                raise TritonModelException(
                    f"metric {self.name!r}: label {key!r} must be a string, got {value!r}"
                )
        series_key = tuple(sorted(labels.items()))
        with self._lock:
            metric = self._metrics.get(series_key)
            if metric is None:
                metric = self._metrics[series_key] = _Series(self, labels, buckets)
            return metric

    def _collect(self) -> _PromMetric:
        family = _PromMetric(self.name, self.description, self._TYPES[self.kind])
        with self._lock:
            metrics = list(self._metrics.values())
        for metric in metrics:
            for sample_name, labels, value in metric._samples():
                family.add_sample(sample_name, labels, value)
        return family


class CustomMetrics:
    """Every family the Python models of this process made; a prometheus-client collector."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._families: dict[str, MetricFamily] = {}

    def family(self, cls: type[MetricFamily], name: str, description: str, kind: int) -> MetricFamily:
        if kind not in MetricFamily._TYPES:
            raise TritonModelException(
                f"metric family {name!r}: kind must be COUNTER, GAUGE or HISTOGRAM, not {kind!r}"
            )
        if not isinstance(name, str) or not _NAME.match(name):
            raise TritonModelException(f"invalid metric family name {name!r}")
        with self._lock:
            family = self._families.get(name)
            if family is not None:
                if family.kind != kind:
                    raise TritonModelException(f"metric family {name!r} exists with another kind")
                return family
            family = object.__new__(cls)
            family._setup(name, description, kind)
            self._families[name] = family
            return family

    def counter_names(self) -> list[str]:
        """The counters' names: the exposition writes their HELP/TYPE lines without ``_total``."""
        with self._lock:
            return [f.name for f in self._families.values() if f.kind == MetricFamily.COUNTER]

    def collect(self) -> Iterator[_PromMetric]:
        with self._lock:
            families = list(self._families.values())
        for family in families:
            yield family._collect()


REGISTRY = CustomMetrics()
