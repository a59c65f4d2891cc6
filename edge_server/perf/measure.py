"""Measurement windows and perf_analyzer's stability rule, for one load level.

A level runs its load without pause while windows of ``--measurement-interval`` follow one another.
A window counts the requests *answered* inside it, their latencies, and the daemon's statistics
delta across it.  The level is stable when the last three windows' throughput and latency (the
``--percentile`` latency, else the average) are each within ``--stability-percentage`` of those three
windows' mean; the reported figures are those three windows together.  After ``--max-trials``
windows without that, the level is reported as unstable, from its last (up to) three windows.

The daemon's statistics are also read once before the load starts and once after it has stopped
and drained: that delta must count exactly the requests this level sent (unless someone else used
the model meanwhile), which the report shows as a check.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from edge_server.perf.load import Recorder
from edge_server.perf.server_stats import Snapshot
from edge_server.perf.targets import Target

STABLE_WINDOWS = 3  # perf_analyzer's


class Load(Protocol):
    recorder: Recorder

    def start(self) -> None: ...

    def stop(self) -> None: ...


@dataclass
class Window:
    start_ns: int
    end_ns: int
    latencies_us: np.ndarray
    responses: int
    server: Snapshot

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def throughput(self) -> float:
        return len(self.latencies_us) / self.seconds if self.seconds > 0 else 0.0


def latency_figure(latencies_us: np.ndarray, percentile: int | None) -> float:
    """The latency that stability is judged on: a percentile when asked, else the average."""
    if len(latencies_us) == 0:
        return 0.0
    if percentile is None:
        return float(latencies_us.mean())
    return latency_summary(latencies_us, percentile)[f"p{percentile}"]


def is_stable(windows: list[Window], percentage: float, percentile: int | None) -> bool:
    """The last three windows' throughput and latency each within ``percentage`` % of their mean."""
    if len(windows) < STABLE_WINDOWS:
        return False
    last = windows[-STABLE_WINDOWS:]
    tolerance = percentage / 100
    for values in (
        [w.throughput for w in last],
        [latency_figure(w.latencies_us, percentile) for w in last],
    ):
        mean = sum(values) / len(values)
        if mean <= 0 or any(abs(v - mean) > tolerance * mean for v in values):
            return False
    return True


@dataclass
class LevelResult:
    """One load level: the reported windows merged, and the whole level's counts for the check."""

    level: float
    batch_size: int
    windows: list[Window]
    stable: bool
    sent: int
    answered: int
    server_total: Snapshot
    error: str = ""
    late: int = 0
    client_avg_us: float = 0.0  # over every answered request of the level, as server_total counts them
    reported: list[Window] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reported = self.windows[-STABLE_WINDOWS:]

    @property
    def latencies_us(self) -> np.ndarray:
        if not self.reported:
            return np.zeros(0)
        return np.concatenate([w.latencies_us for w in self.reported])

    @property
    def request_throughput(self) -> float:
        """Requests answered per second."""
        seconds = sum(w.seconds for w in self.reported)
        return sum(len(w.latencies_us) for w in self.reported) / seconds if seconds else 0.0

    @property
    def throughput(self) -> float:
        """Inferences per second, as perf_analyzer counts them: a request of batch size b is b."""
        return self.request_throughput * self.batch_size

    @property
    def response_throughput(self) -> float:
        seconds = sum(w.seconds for w in self.reported)
        return sum(w.responses for w in self.reported) / seconds if seconds else 0.0

    @property
    def server(self) -> Snapshot:
        total = Snapshot()
        for window in self.reported:
            total = total + window.server
        return total

    def latency(self, percentile: int | None = None) -> dict[str, float]:
        """Average and p50/p90/p95/p99 (and ``p{percentile}``), in microseconds."""
        return latency_summary(self.latencies_us, percentile)


def percentiles(extra: int | None = None) -> list[int]:
    """The percentiles perf_analyzer reports: 50, 90, 95, 99, and ``--percentile`` among them."""
    return sorted({50, 90, 95, 99} | ({extra} if extra else set()))


def latency_summary(latencies_us: np.ndarray, extra: int | None = None) -> dict[str, float]:
    """perf_analyzer's figures: the mean, and each percentile as one sample, never an interpolation.

    The sample is the sorted one at ``round(p / 100 * (n - 1))`` (halves up), as perf_analyzer picks it.
    """
    keys = percentiles(extra)
    if len(latencies_us) == 0:
        return {"avg": 0.0, **{f"p{p}": 0.0 for p in keys}}
    ordered = np.sort(latencies_us)
    last = len(ordered) - 1
    figures = {f"p{p}": float(ordered[int(p / 100 * last + 0.5)]) for p in keys}
    return {"avg": float(ordered.mean()), **figures}


Progress = Callable[[float, int, Window, bool], Any]


def measure_level(
    target: Target,
    load: Load,
    level: float,
    *,
    batch_size: int,
    interval_ms: float,
    max_trials: int,
    stability_percentage: float,
    percentile: int | None,
    progress: Progress,
) -> LevelResult:
    """Run ``load`` through windows until stable or ``max_trials``; stop it; return the figures."""
    recorder = load.recorder
    before = target.statistics()
    load.start()
    windows: list[Window] = []
    try:
        for trial in range(1, max_trials + 1):
            stats_start = target.statistics()
            start = time.perf_counter_ns()
            recorder.failed.wait(interval_ms / 1000)
            end = time.perf_counter_ns()
            stats_end = target.statistics()
            if recorder.failed.is_set():
                break
            windows.append(_window(recorder, start, end, stats_end - stats_start))
            stable = is_stable(windows, stability_percentage, percentile)
            progress(level, trial, windows[-1], stable)
            if stable:
                break
    finally:
        load.stop()
    after = _settled(target, before, recorder.answered)
    records = recorder.records()
    client_avg_us = float((records[:, 1] - records[:, 0]).mean()) / 1000.0 if len(records) else 0.0
    return LevelResult(
        level=level,
        batch_size=batch_size,
        windows=windows,
        stable=is_stable(windows, stability_percentage, percentile),
        sent=recorder.sent,
        answered=recorder.answered,
        server_total=after - before,
        error=recorder.error,
        late=int(getattr(load, "late", 0)),
        client_avg_us=client_avg_us,
    )


def _settled(target: Target, before: Snapshot, answered: int, patience_s: float = 2.0) -> Snapshot:
    """The statistics once the daemon has counted every answered request.

    A daemon may send a reply a moment before it records the request in its statistics; the check
    against the client's count waits (briefly) for that, instead of reporting a false mismatch.
    """
    deadline = time.monotonic() + patience_s
    after = target.statistics()
    while (after - before).success_count < answered and time.monotonic() < deadline:
        time.sleep(0.01)
        after = target.statistics()
    return after


def _window(recorder: Recorder, start: int, end: int, server: Snapshot) -> Window:
    records = recorder.records()
    inside = records[(records[:, 1] >= start) & (records[:, 1] < end)]
    latencies = (inside[:, 1] - inside[:, 0]) / 1000.0
    return Window(start, end, latencies, int(inside[:, 2].sum()), server)
