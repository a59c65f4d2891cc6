"""Latency quantiles over a sliding window, for Triton's summary metrics (``summary_latencies=true``).

Triton's ``nv_inference_*_summary_us`` are Prometheus summaries: quantiles of each successful request's
end-to-end, queue and compute durations over the last minute or so, with ``_count`` and ``_sum`` over
all time (matching ``nv_inference_request_success`` and the duration counters).  Here the window is a
ring of age buckets (``max_age_s`` split into ``age_buckets``); each bucket keeps the durations it saw,
at most ``max_samples`` of them (a uniform sample beyond that, each kept one weighing for those it
stands for), and a scrape computes weighted quantiles over the live buckets with numpy.  Exact while a
bucket holds every request; within sampling error beyond.

Off by default, as in Triton: when on, the statistics' existing folds hand each batch's durations
over (a list extend under the statistics lock they already hold); nothing else is added per request.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from edge_server.errors import InvalidArgument

# Triton's summary families, in the order of the durations handed to observe().
KINDS = ("request", "queue", "compute_input", "compute_infer", "compute_output")
# Triton's default quantiles and their allowed errors (``summary_quantiles``).
DEFAULT_QUANTILES = ((0.5, 0.05), (0.9, 0.01), (0.95, 0.001), (0.99, 0.001), (0.999, 0.0001))


@dataclass(frozen=True)
class SummaryOptions:
    """What the summaries report, and over how long.

    ``quantiles``: (quantile, allowed error) pairs; the error is accepted for Triton's syntax, and met
    exactly while a bucket holds at most ``max_samples`` requests.
    """

    quantiles: tuple[tuple[float, float], ...] = DEFAULT_QUANTILES
    max_age_s: float = 60.0
    age_buckets: int = 5
    max_samples: int = 4096  # per bucket and duration kind


def parse_quantiles(text: str) -> tuple[tuple[float, float], ...]:
    """Triton's ``summary_quantiles`` value: ``"0.5:0.05,0.9:0.01,0.99:0.001"``."""
    pairs = []
    for item in text.split(","):
        quantile, sep, error = item.strip().partition(":")
        try:
            q, e = float(quantile), float(error) if sep else 0.0
        except ValueError:
            raise InvalidArgument(
                f"summary_quantiles: {item!r} is not QUANTILE:ERROR (e.g. 0.5:0.05,0.99:0.001)"
            ) from None
        if not (0.0 < q < 1.0) or not (0.0 <= e < 1.0):
            raise InvalidArgument(f"summary_quantiles: {item!r}: quantile in (0, 1), error in [0, 1)")
        pairs.append((q, e))
    if not pairs:
        raise InvalidArgument("summary_quantiles: no quantiles given")
    return tuple(sorted(set(pairs)))


class _Bucket:
    """The durations seen in one age bucket: lists while they fit, then a fixed numpy reservoir."""

    __slots__ = ("full", "samples", "seen", "start")

    def __init__(self, start: float) -> None:
        self.start = start
        self.seen = 0  # requests this bucket heard of; kept() of them are kept
        self.samples: list[list[int]] = [[] for _ in KINDS]
        self.full: np.ndarray | None = None  # (kinds, max_samples) once the lists reached the cap

    def kept(self) -> int:
        return self.full.shape[1] if self.full is not None else len(self.samples[0])

    def values(self, kind: int) -> np.ndarray:
        if self.full is not None:
            return self.full[kind]
        return np.asarray(self.samples[kind], dtype=np.float64)


@dataclass(frozen=True)
class Summary:
    """One duration kind at one scrape.

    ``quantiles``: (q, ns) pairs, NaN with nothing in the window; ``count``/``sum_ns`` over all time.
    """

    count: int
    sum_ns: int
    quantiles: tuple[tuple[float, float], ...]


class LatencyWindow:
    """The window of one model version.  Not locked: its owner (``ModelStats``) calls it under its lock."""

    def __init__(self, options: SummaryOptions, clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options
        self._clock = clock
        self._width = options.max_age_s / options.age_buckets
        self._buckets: deque[_Bucket] = deque()
        self._count = 0
        self._sums = [0] * len(KINDS)
        self._random = np.random.default_rng()

    def observe(self, columns: Sequence[Sequence[int]]) -> None:
        """Successful requests' durations in ns: one sequence per kind of :data:`KINDS`, equal lengths."""
        n = len(columns[0])
        if n == 0:
            return
        self._count += n
        for i, column in enumerate(columns):
            self._sums[i] += sum(column)
        bucket = self._current()
        cap = self.options.max_samples
        if bucket.full is None:
            room = cap - len(bucket.samples[0])
            for kept, column in zip(bucket.samples, columns, strict=True):
                kept.extend(column[:room])
            bucket.seen += min(room, n)
            if room > n:
                return
            bucket.full = np.array(bucket.samples, dtype=np.float64)
            bucket.samples = []
            columns = [column[room:] for column in columns]
            n -= room
            if n == 0:
                return
        # Past the cap: reservoir sampling, vectorized.  The i-th request the bucket hears of replaces
        # a random kept one with probability cap / i, so each one heard of stays with equal chance.
        heard = bucket.seen + 1 + np.arange(n)
        slots = (self._random.random(n) * heard).astype(np.int64)
        full = bucket.full
        for j in np.nonzero(slots < cap)[0].tolist():  # few once the bucket heard many times its cap
            full[:, slots[j]] = [column[j] for column in columns]
        bucket.seen += n

    def summaries(self) -> dict[str, Summary]:
        """Each kind's quantiles over the window, and its all-time count and sum."""
        self._expire(self._clock())
        qs = [q for q, _ in self.options.quantiles]
        live = [b for b in self._buckets if b.kept()]
        out = {}
        for i, kind in enumerate(KINDS):
            if live:
                values = np.concatenate([b.values(i) for b in live])
                weights = np.concatenate([np.full(b.kept(), b.seen / b.kept()) for b in live])
                found = weighted_quantiles(values, weights, qs)
            else:
                found = [math.nan] * len(qs)
            out[kind] = Summary(self._count, self._sums[i], tuple(zip(qs, found, strict=True)))
        return out

    def _current(self) -> _Bucket:
        now = self._clock()
        self._expire(now)
        if not self._buckets or now - self._buckets[-1].start >= self._width:
            self._buckets.append(_Bucket(now))
        return self._buckets[-1]

    def _expire(self, now: float) -> None:
        """Drop buckets that ended more than ``max_age_s`` ago."""
        horizon = now - self.options.max_age_s
        while self._buckets and self._buckets[0].start + self._width <= horizon:
            self._buckets.popleft()


def weighted_quantiles(values: np.ndarray, weights: np.ndarray, qs: Sequence[float]) -> list[float]:
    """The smallest value whose cumulative weight reaches ``q`` of the total (the inverse CDF), per q.

    With equal weights this is numpy's ``inverted_cdf`` quantile.
    """
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    total = cumulative[-1]
    positions = np.searchsorted(cumulative, np.asarray(qs) * total, side="left")
    positions = np.minimum(positions, len(values) - 1)
    return [float(v) for v in values[order][positions]]
