"""Triton's metrics (names and ``model``/``version`` labels) plus ours, read from the server when scraped.

Nothing here runs on the request path: each scrape reads the per-version statistics the schedulers keep
anyway (``ModelStats.as_dict``), the queue lengths, the instances' busy time, the repository index,
the load counts that :class:`LoadCounter` hears from the model manager, and the IPC frontend's status.
Triton's counters keep Triton's exact names (no ``_total``), so its dashboards work unchanged; our own
metrics carry an ``edge_`` prefix.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client.metrics_core import Metric

from edge_server.scheduler.summaries import Summary
from edge_server.status_index import UNLOADED, ModelState, VersionStatus

if TYPE_CHECKING:
    from edge_server.server import Server
    from edge_server.service.states import ServiceState

# name: (help, path into the statistics dict, scale from ns or count)
TRITON_COUNTERS: dict[str, tuple[str, tuple[str, ...], float]] = {
    "nv_inference_request_success": (
        "Number of successful inference requests, all batch sizes",
        ("inference_stats", "success", "count"),
        1,
    ),
    "nv_inference_count": ("Number of inferences performed (batch items)", ("inference_count",), 1),
    "nv_inference_exec_count": ("Number of model executions performed", ("execution_count",), 1),
    "nv_inference_queue_duration_us": (
        "Cumulative inference queuing duration in microseconds",
        ("inference_stats", "queue", "ns"),
        1e-3,
    ),
    "nv_inference_compute_input_duration_us": (
        "Cumulative compute input duration in microseconds",
        ("inference_stats", "compute_input", "ns"),
        1e-3,
    ),
    "nv_inference_compute_infer_duration_us": (
        "Cumulative compute inference duration in microseconds",
        ("inference_stats", "compute_infer", "ns"),
        1e-3,
    ),
    "nv_inference_compute_output_duration_us": (
        "Cumulative inference compute output duration in microseconds",
        ("inference_stats", "compute_output", "ns"),
        1e-3,
    ),
}
REQUEST_DURATION = "nv_inference_request_duration_us"
FAILURE = "nv_inference_request_failure"  # Triton's, with its reason label (REJECTED, CANCELED, ...)
LABELS = ("model", "version")
# Triton's latency summaries (``--metrics-config summary_latencies=true``), by duration kind.
TRITON_SUMMARIES: dict[str, tuple[str, str]] = {
    "request": (
        "nv_inference_request_summary_us",
        "Summary of inference request duration in microseconds",
    ),
    "queue": ("nv_inference_queue_summary_us", "Summary of inference queuing duration in microseconds"),
    "compute_input": (
        "nv_inference_compute_input_summary_us",
        "Summary of compute input duration in microseconds",
    ),
    "compute_infer": (
        "nv_inference_compute_infer_summary_us",
        "Summary of compute inference duration in microseconds",
    ),
    "compute_output": (
        "nv_inference_compute_output_summary_us",
        "Summary of inference compute output duration in microseconds",
    ),
}


def _counter(name: str, documentation: str) -> Metric:
    return Metric(name, documentation, "counter")


def _gauge(name: str, documentation: str) -> Metric:
    return Metric(name, documentation, "gauge")


def _add_summaries(
    metrics: dict[str, Metric], labels: dict[str, str], found: dict[str, Summary] | None
) -> None:
    """One version's summaries: a sample per quantile (NaN with nothing in the window), _count, _sum."""
    if found is None:
        return
    for kind, metric in metrics.items():
        summary = found[kind]
        for quantile, ns in summary.quantiles:
            metric.add_sample(metric.name, {**labels, "quantile": _quantile_label(quantile)}, ns / 1e3)
        metric.add_sample(metric.name + "_count", labels, summary.count)
        metric.add_sample(metric.name + "_sum", labels, summary.sum_ns / 1e3)


def _quantile_label(quantile: float) -> str:
    return f"{quantile:g}"


class LoadCounter:
    """A model-manager listener: loads that reached READY and loads that failed, per model."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loading: set[tuple[str, int | None]] = set()
        self.loads: dict[str, int] = {}
        self.failures: dict[str, int] = {}

    def __call__(self, status: VersionStatus) -> None:
        key = (status.name, status.version)
        with self._lock:
            if status.state is ModelState.LOADING:
                self._loading.add(key)
                self.loads.setdefault(status.name, 0)
                self.failures.setdefault(status.name, 0)
            elif status.state is ModelState.READY and key in self._loading:
                self._loading.discard(key)
                self.loads[status.name] = self.loads.get(status.name, 0) + 1
            elif status.state is ModelState.UNAVAILABLE and status.reason != UNLOADED:
                self._loading.discard(key)
                self.failures[status.name] = self.failures.get(status.name, 0) + 1
                self.loads.setdefault(status.name, 0)

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.loads), dict(self.failures)


class ServerCollector:
    """A prometheus-client collector over one :class:`Server` (and, in the daemon, its service parts)."""

    def __init__(
        self,
        server: Server,
        *,
        loads: LoadCounter | None = None,
        service: ServiceState | None = None,
        frontends: Callable[[], Sequence[Any]] = list,
    ) -> None:
        self._server = server
        self._loads = loads
        self._service = service
        self._frontends = frontends

    def collect(self) -> Iterator[Metric]:
        yield from self._inference()
        yield from self._models()
        yield from self._ipc()

    def _inference(self) -> Iterator[Metric]:
        counters = {name: _counter(name, doc) for name, (doc, _, _) in TRITON_COUNTERS.items()}
        failure = _counter(FAILURE, "Number of failed inference requests, all batch sizes")
        duration = _counter(REQUEST_DURATION, "Cumulative inference request duration in microseconds")
        pending = _gauge("nv_inference_pending_request_count", "Instantaneous number of pending requests")
        batches = _counter(
            "edge_inference_batch_exec_count", "Model executions by batch size (the batch-size distribution)"
        )
        busy = _counter(
            "edge_instance_busy_seconds", "Time each model instance spent executing (its utilisation)"
        )
        active = _gauge("edge_sequence_active", "Live sequences of a sequence-batched model")
        backlog = _gauge("edge_sequence_backlog", "Sequences waiting for a slot or candidate place")
        occupied = _gauge("edge_sequence_slots_occupied", "Batch slots held by a sequence (direct strategy)")
        summaries = {kind: Metric(name, doc, "summary") for kind, (name, doc) in TRITON_SUMMARIES.items()}
        for name, versions in self._server.routing.serving().items():
            for version, loaded in versions.items():
                labels = {"model": name, "version": str(version)}
                stats = loaded.stats.as_dict()
                for metric_name, (_, path, scale) in TRITON_COUNTERS.items():
                    value: Any = stats
                    for key in path:
                        value = value[key]
                    counters[metric_name].add_sample(metric_name, labels, value * scale)
                for reason, count in loaded.stats.failure_reasons().items():
                    failure.add_sample(failure.name, {**labels, "reason": reason}, count)
                inference = stats["inference_stats"]
                request_ns = inference["success"]["ns"] + inference["fail"]["ns"]
                duration.add_sample(REQUEST_DURATION, labels, request_ns / 1e3)
                pending.add_sample(pending.name, labels, loaded.scheduler.queue_size())
                for batch in stats["batch_stats"]:
                    batches.add_sample(
                        "edge_inference_batch_exec_count_total",
                        {**labels, "batch_size": str(batch["batch_size"])},
                        batch["compute_infer"]["count"],
                    )
                sequences = stats.get("sequence_stats")
                if sequences:
                    active.add_sample(active.name, labels, sequences["active"])
                    backlog.add_sample(backlog.name, labels, sequences["backlog"])
                    for slot in sequences.get("slots", ()):
                        occupied.add_sample(
                            occupied.name, {**labels, "instance": slot["instance"]}, slot["occupied"]
                        )
                for instance, ns in loaded.scheduler.instance_busy_ns().items():
                    busy.add_sample(
                        "edge_instance_busy_seconds_total", {**labels, "instance": instance}, ns / 1e9
                    )
                _add_summaries(summaries, labels, loaded.stats.summaries())
        yield from counters.values()
        yield failure
        yield from (duration, pending, batches, busy, active, backlog, occupied)
        yield from (m for m in summaries.values() if m.samples)

    def _models(self) -> Iterator[Metric]:
        state = _gauge("edge_model_state", "1 for the state each known model version is in")
        for status in self._server.models():
            labels = {
                "model": status.name,
                "version": "" if status.version is None else str(status.version),
                "state": status.state.value,
            }
            state.add_sample(state.name, labels, 1)
        yield state
        if self._loads is not None:
            loads, failures = self._loads.snapshot()
            loaded = _counter(
                "edge_model_loads", "Model version loads that became ready (start-up and reloads)"
            )
            failed = _counter("edge_model_load_failures", "Model version loads that failed")
            for name in sorted(loads):
                loaded.add_sample("edge_model_loads_total", {"model": name}, loads[name])
                failed.add_sample("edge_model_load_failures_total", {"model": name}, failures.get(name, 0))
            yield from (loaded, failed)
        if self._service is not None:
            reloads, reload_failures = self._service.reload_counts()
            rescans = _counter("edge_repository_reloads", "Repository rescans asked for by SIGHUP")
            rescans.add_sample("edge_repository_reloads_total", {}, reloads)
            bad = _counter(
                "edge_repository_reload_failures", "SIGHUP rescans after which a model was not ready"
            )
            bad.add_sample("edge_repository_reload_failures_total", {}, reload_failures)
            uptime = _gauge("edge_uptime_seconds", "Seconds since the daemon started")
            uptime.add_sample(uptime.name, {}, self._service.uptime())
            ready = _gauge("edge_server_ready", "1 when the server answers ready (Triton's server readiness)")
            ready.add_sample(ready.name, {}, 1 if self._server.is_ready() else 0)
            yield from (rescans, bad, uptime, ready)

    def _ipc(self) -> Iterator[Metric]:
        frontends = self._frontends()
        if not frontends:
            return
        clients = _gauge("edge_ipc_clients", "IPC clients connected now")
        regions = _gauge("edge_ipc_shm_regions", "Shared-memory regions registered by IPC clients now")
        dropped = _counter("edge_ipc_dropped_replies", "Replies dropped because a client stopped reading")
        released = _counter("edge_ipc_released_clients", "IPC clients whose state was released (gone, bye)")
        for frontend in frontends:
            status = frontend.status()
            clients.add_sample(clients.name, {}, status["clients"])
            regions.add_sample(regions.name, {}, status["regions"])
            dropped.add_sample("edge_ipc_dropped_replies_total", {}, status["dropped_replies"])
            released.add_sample("edge_ipc_released_clients_total", {}, status["released_clients"])
        yield from (clients, regions, dropped, released)
