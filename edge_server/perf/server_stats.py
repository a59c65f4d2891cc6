"""The daemon's side of a measurement: deltas of the model's statistics across a window.

Triton's statistics are cumulative counters; perf_analyzer reads them before and after a window and
reports the difference per request.  Every source (IPC, in-process, HTTP JSON, gRPC as JSON, where
64-bit counters arrive as strings) is normalised to :class:`Snapshot` first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any


def _int(value: Any) -> int:
    return int(value or 0)


def _duration(stats: Mapping[str, Any], key: str) -> tuple[int, int]:
    entry = stats.get(key) or {}
    return _int(entry.get("count")), _int(entry.get("ns"))


@dataclass(frozen=True)
class Snapshot:
    """One model's counters (summed over the versions asked for)."""

    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    queue_ns: int = 0
    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0
    inference_count: int = 0
    execution_count: int = 0
    batches: dict[int, int] = field(default_factory=dict)  # batch size -> executions

    @classmethod
    def from_versions(cls, versions: Iterable[Mapping[str, Any]]) -> Snapshot:
        total: dict[str, int] = {f.name: 0 for f in fields(cls) if f.name != "batches"}
        batches: dict[int, int] = {}
        for stats in versions:
            inference = stats.get("inference_stats") or {}
            success = _duration(inference, "success")
            total["success_count"] += success[0]
            total["success_ns"] += success[1]
            total["fail_count"] += _duration(inference, "fail")[0]
            for key in ("queue", "compute_input", "compute_infer", "compute_output"):
                total[f"{key}_ns"] += _duration(inference, key)[1]
            total["inference_count"] += _int(stats.get("inference_count"))
            total["execution_count"] += _int(stats.get("execution_count"))
            for batch in stats.get("batch_stats") or []:
                size = _int(batch.get("batch_size"))
                batches[size] = batches.get(size, 0) + _duration(batch, "compute_infer")[0]
        return cls(**total, batches=batches)

    def __sub__(self, before: Snapshot) -> Snapshot:
        values = {
            f.name: getattr(self, f.name) - getattr(before, f.name)
            for f in fields(self)
            if f.name != "batches"
        }
        batches = {k: v - before.batches.get(k, 0) for k, v in self.batches.items()}
        return Snapshot(**values, batches={k: v for k, v in batches.items() if v})

    def __add__(self, other: Snapshot) -> Snapshot:
        values = {
            f.name: getattr(self, f.name) + getattr(other, f.name)
            for f in fields(self)
            if f.name != "batches"
        }
        batches = dict(self.batches)
        for k, v in other.batches.items():
            batches[k] = batches.get(k, 0) + v
        return Snapshot(**values, batches=batches)

    def per_request_us(self, total_ns: int) -> float:
        """A summed duration as microseconds per successful request.

        Triton charges each request the compute time of its whole batch, so these add up to the
        request's own time on the server.
        """
        return total_ns / 1000 / self.success_count if self.success_count else 0.0

    def summary(self) -> dict[str, Any]:
        """The figures a report shows: per request averages in microseconds, counts, batch sizes."""
        return {
            "request_count": self.success_count,
            "failed_count": self.fail_count,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "queue_us": self.per_request_us(self.queue_ns),
            "compute_input_us": self.per_request_us(self.compute_input_ns),
            "compute_infer_us": self.per_request_us(self.compute_infer_ns),
            "compute_output_us": self.per_request_us(self.compute_output_ns),
            "request_us": self.per_request_us(self.success_ns),
            "batch_sizes": {str(k): v for k, v in sorted(self.batches.items())},
        }
