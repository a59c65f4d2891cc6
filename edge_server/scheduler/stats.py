"""Per model-version statistics in Triton's shape (``ModelStatistics`` of the KServe v2 extension)."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edge_server.request import Timing
from edge_server.scheduler.summaries import LatencyWindow, Summary, SummaryOptions


@dataclass(slots=True)
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def as_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class _BatchStats:
    compute_input: _Duration = field(default_factory=_Duration)
    compute_infer: _Duration = field(default_factory=_Duration)
    compute_output: _Duration = field(default_factory=_Duration)


# Inline requests are recorded by appending to a deque and folded into the counters in batches of
# this many, or when the statistics are read: a deque append is atomic, so no lock on the way.
_FOLD_EVERY = 256
# batch size, queue ns, request ns, succeeded, compute input/infer/output ns, end (monotonic ns)
_Inline = tuple[int, int, int, bool, int, int, int, int]


#: Triton's reasons for a failed request, the ``reason`` label of ``nv_inference_request_failure``.
FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")


class ModelStats:
    """Counters updated by the instances; read by frontends and metrics.  One lock, short sections."""

    def __init__(self, name: str, version: int) -> None:
        self.name = name
        self.version = version
        self._lock = threading.Lock()
        self._last_inference_ms = 0
        self._inference_count = 0
        self._execution_count = 0
        self._success = _Duration()
        self._fail = _Duration()
        # Triton's ``reason`` label of nv_inference_request_failure: how many failed for each reason
        self._fail_reasons = dict.fromkeys(FAILURE_REASONS, 0)
        self._queue = _Duration()
        self._compute_input = _Duration()
        self._compute_infer = _Duration()
        self._compute_output = _Duration()
        self._batches: dict[int, _BatchStats] = {}
        self._unfolded: collections.deque[_Inline] = collections.deque()
        # Triton's latency summaries (``--metrics-config summary_latencies=true``); None when off.
        self._window: LatencyWindow | None = None
        #: set by a sequence scheduler: its sequence counts and slot occupancy, read with the rest
        self.sequence_stats: Callable[[], dict[str, Any]] | None = None

    def record_batch(
        self,
        *,
        batch_size: int,
        queue_ns: list[int],
        request_ns: list[int],
        succeeded: list[bool],
        timing: Timing,
    ) -> None:
        """One executed batch: durations per request (queue, end to end) and for the whole batch."""
        with self._lock:
            self._last_inference_ms = int(time.time() * 1000)
            n = len(succeeded)
            self._execution_count += 1
            self._inference_count += batch_size
            for q, total, ok in zip(queue_ns, request_ns, succeeded, strict=True):
                (self._success if ok else self._fail).add(total)
                self._queue.add(q)
            self._fail_reasons["BACKEND"] += n - sum(succeeded)
            # Triton charges each request the full compute time of its batch.
            self._compute_input.add(timing.compute_input_ns * n, n)
            self._compute_infer.add(timing.compute_infer_ns * n, n)
            self._compute_output.add(timing.compute_output_ns * n, n)
            stats = self._batches.setdefault(batch_size, _BatchStats())
            stats.compute_input.add(timing.compute_input_ns)
            stats.compute_infer.add(timing.compute_infer_ns)
            stats.compute_output.add(timing.compute_output_ns)
            if self._window is not None:
                done = [i for i, good in enumerate(succeeded) if good]
                k = len(done)
                self._window.observe(
                    (
                        [request_ns[i] for i in done],
                        [queue_ns[i] for i in done],
                        [timing.compute_input_ns] * k,
                        [timing.compute_infer_ns] * k,
                        [timing.compute_output_ns] * k,
                    )
                )

    def record_one(
        self, batch_size: int, queue_ns: int, request_ns: int, succeeded: bool, timing: Timing, end_ns: int
    ) -> None:
        """A batch of one request (inline execution) that ended at ``end_ns`` (monotonic)."""
        unfolded = self._unfolded
        unfolded.append(
            (
                batch_size,
                queue_ns,
                request_ns,
                succeeded,
                timing.compute_input_ns,
                timing.compute_infer_ns,
                timing.compute_output_ns,
                end_ns,
            )
        )
        if len(unfolded) >= _FOLD_EVERY:
            with self._lock:
                self._fold()

    def _fold(self) -> None:
        """Count the requests recorded by :meth:`record_one`, column by column (lock held)."""
        unfolded = self._unfolded
        if not unfolded:
            return
        # Appends may go on meanwhile: they wait for the next fold.
        entries = [unfolded.popleft() for _ in range(len(unfolded))]
        sizes, queue_ns, request_ns, succeeded, cin, cinf, cout, end_ns = zip(*entries, strict=True)
        n = len(entries)
        self._execution_count += n
        self._inference_count += sum(sizes)
        self._queue.add(sum(queue_ns), n)
        if all(succeeded):
            self._success.add(sum(request_ns), n)
        else:
            for total, ok in zip(request_ns, succeeded, strict=True):
                (self._success if ok else self._fail).add(total)
            self._fail_reasons["BACKEND"] += n - sum(succeeded)
        # Each request is a batch of its own: it is charged its own compute time.
        self._compute_input.add(sum(cin), n)
        self._compute_infer.add(sum(cinf), n)
        self._compute_output.add(sum(cout), n)
        if min(sizes) == max(sizes):
            by_size = {sizes[0]: (n, sum(cin), sum(cinf), sum(cout))}
        else:
            by_size = {}
            for size, i, f, o in zip(sizes, cin, cinf, cout, strict=True):
                c, si, sf, so = by_size.get(size, (0, 0, 0, 0))
                by_size[size] = (c + 1, si + i, sf + f, so + o)
        for size, (count, si, sf, so) in by_size.items():
            stats = self._batches.setdefault(size, _BatchStats())
            stats.compute_input.add(si, count)
            stats.compute_infer.add(sf, count)
            stats.compute_output.add(so, count)
        ended_ms = (time.time_ns() - (time.monotonic_ns() - max(end_ns))) // 1_000_000
        self._last_inference_ms = max(self._last_inference_ms, ended_ms)
        if self._window is not None:
            if all(succeeded):
                self._window.observe((request_ns, queue_ns, cin, cinf, cout))
            else:
                ok = [i for i, good in enumerate(succeeded) if good]
                self._window.observe(
                    [[column[i] for i in ok] for column in (request_ns, queue_ns, cin, cinf, cout)]
                )

    def record_failure(self, queue_ns: int, request_ns: int, reason: str = "OTHER") -> None:
        """A request that failed without running: ``reason`` one of :data:`FAILURE_REASONS`.

        REJECTED: the queue policy refused it (its timeout passed); CANCELED: its caller cancelled it.
        """
        with self._lock:
            self._fail.add(request_ns)
            self._fail_reasons[reason if reason in self._fail_reasons else "OTHER"] += 1
            self._queue.add(queue_ns)

    def failure_reasons(self) -> dict[str, int]:
        """Failed requests by Triton's reason (REJECTED, CANCELED, BACKEND: the model failed, OTHER)."""
        with self._lock:
            self._fold()
            return dict(self._fail_reasons)

    def enable_summaries(self, options: SummaryOptions) -> None:
        """Keep latency quantiles from now on (set at load, before the version takes traffic)."""
        with self._lock:
            if self._window is None:
                self._window = LatencyWindow(options)

    def summaries(self) -> dict[str, Summary] | None:
        """The latency summaries (by kind: request, queue, compute_*), or None when they are off."""
        if self._window is None:
            return None
        with self._lock:
            self._fold()
            return self._window.summaries()

    def as_dict(self) -> dict[str, Any]:
        """Triton's statistics JSON for this version (plus ``sequence_stats`` for sequence models)."""
        out = self._as_dict()
        if self.sequence_stats is not None:
            out["sequence_stats"] = self.sequence_stats()
        return out

    def _as_dict(self) -> dict[str, Any]:
        with self._lock:
            self._fold()
            return {
                "name": self.name,
                "version": str(self.version),
                "last_inference": self._last_inference_ms,
                "inference_count": self._inference_count,
                "execution_count": self._execution_count,
                "inference_stats": {
                    "success": self._success.as_dict(),
                    "fail": self._fail.as_dict(),
                    "queue": self._queue.as_dict(),
                    "compute_input": self._compute_input.as_dict(),
                    "compute_infer": self._compute_infer.as_dict(),
                    "compute_output": self._compute_output.as_dict(),
                },
                "batch_stats": [
                    {
                        "batch_size": size,
                        "compute_input": s.compute_input.as_dict(),
                        "compute_infer": s.compute_infer.as_dict(),
                        "compute_output": s.compute_output.as_dict(),
                    }
                    for size, s in sorted(self._batches.items())
                ],
            }
