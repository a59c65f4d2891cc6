"""Per model-version statistics in Triton's shape (``ModelStatistics`` of the KServe v2 extension)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from edge_server.backends.base import Timing


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
        self._queue = _Duration()
        self._compute_input = _Duration()
        self._compute_infer = _Duration()
        self._compute_output = _Duration()
        self._batches: dict[int, _BatchStats] = {}

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
        n = len(succeeded)
        with self._lock:
            self._count_execution(batch_size, n, timing)
            for q, total, ok in zip(queue_ns, request_ns, succeeded, strict=True):
                (self._success if ok else self._fail).add(total)
                self._queue.add(q)

    def record_one(
        self, *, batch_size: int, queue_ns: int, request_ns: int, succeeded: bool, timing: Timing
    ) -> None:
        """:meth:`record_batch` for a batch of one request (inline execution), without the lists."""
        with self._lock:
            self._count_execution(batch_size, 1, timing)
            outcome = self._success if succeeded else self._fail
            outcome.count += 1
            outcome.ns += request_ns
            self._queue.count += 1
            self._queue.ns += queue_ns

    def _count_execution(self, batch_size: int, requests: int, timing: Timing) -> None:
        self._last_inference_ms = int(time.time() * 1000)
        self._execution_count += 1
        self._inference_count += batch_size
        # Triton charges each request the full compute time of its batch.  (Attribute arithmetic, not
        # _Duration.add: every inline request comes through here, and a call costs more than the sum.)
        cin, cinf, cout = timing.compute_input_ns, timing.compute_infer_ns, timing.compute_output_ns
        self._compute_input.count += requests
        self._compute_input.ns += cin * requests
        self._compute_infer.count += requests
        self._compute_infer.ns += cinf * requests
        self._compute_output.count += requests
        self._compute_output.ns += cout * requests
        stats = self._batches.get(batch_size)
        if stats is None:
            stats = self._batches[batch_size] = _BatchStats()
        stats.compute_input.count += 1
        stats.compute_input.ns += cin
        stats.compute_infer.count += 1
        stats.compute_infer.ns += cinf
        stats.compute_output.count += 1
        stats.compute_output.ns += cout

    def record_failure(self, queue_ns: int, request_ns: int) -> None:
        """A request that failed without running (timeout, cancelled on shutdown)."""
        with self._lock:
            self._fail.add(request_ns)
            self._queue.add(queue_ns)

    def as_dict(self) -> dict[str, Any]:
        """Triton's statistics JSON for this version."""
        with self._lock:
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
