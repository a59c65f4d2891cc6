"""Prometheus metrics from the real daemon: parsed with prometheus-client's own parser, checked against
the statistics API, moved by real traffic; a Python model's custom metrics; device figures read from
recorded Jetson sysfs trees (the only test double: a Jetson cannot exist here)."""

from __future__ import annotations

import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edge_server.backends import pb_utils
from edge_server.backends.python_metrics import CustomMetrics, MetricFamily
from edge_server.client import Client
from edge_server.errors import EdgeServerError
from edge_server.metrics.device import DeviceCollector
from edge_server.metrics.endpoint import exposition, registry_with
from edge_server.scheduler.stats import ModelStats
from tests.daemon import ROOT, Daemon, free_port, start_pyzmq_gc

SYSFS = Path(__file__).parent / "data" / "jetson_sysfs"

COUNTED_CONFIG = """
name: "counted"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
"""
COUNTED_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.seen = pb_utils.MetricFamily(
            name="counted_requests", description="requests seen", kind=pb_utils.MetricFamily.COUNTER
        ).Metric(labels={"model": "counted"})
        self.sizes = pb_utils.MetricFamily(
            name="counted_input_size", description="input lengths", kind=pb_utils.MetricFamily.HISTOGRAM
        ).Metric(labels={"model": "counted"}, buckets=[1, 4, 16])
        self.last = pb_utils.MetricFamily(
            name="counted_last_sum", description="sum of the last input", kind=pb_utils.MetricFamily.GAUGE
        ).Metric(labels={"model": "counted"})

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            self.seen.increment(1)
            self.sizes.observe(len(x))
            self.last.set(float(x.sum()))
            print("model print: must not reach the CLI")
            if x.size and x[0] < 0:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative input")))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x * 2)]))
        return responses
"""


def scrape(port: int) -> tuple[str, dict[str, dict[tuple[tuple[str, str], ...], float]]]:
    """The raw text, and {sample name: {sorted labels: value}} as prometheus-client parses it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return text, samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[name][tuple(sorted(labels.items()))]


@pytest.fixture(scope="module")
def metrics_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, int]]:
    start_pyzmq_gc()
    root = tmp_path_factory.mktemp("metrics")
    repo = root / "repo"
    shutil.copytree(ROOT / "models" / "identity", repo / "identity")
    (repo / "counted" / "1").mkdir(parents=True)
    (repo / "counted" / "config.pbtxt").write_text(COUNTED_CONFIG)
    (repo / "counted" / "1" / "model.py").write_text(COUNTED_MODEL)
    port = free_port()
    daemon = Daemon(repo, f"ipc://{root}/m.sock", root / "m.log", "--allow-metrics", "true")
    daemon.args += ("--metrics-port", str(port))
    daemon.start()
    try:
        yield daemon, port
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_triton_counters_match_the_statistics_api_and_move_with_traffic(
    metrics_daemon: tuple[Daemon, int],
) -> None:
    daemon, port = metrics_daemon
    with Client(daemon.address, timeout=10) as client:
        _, before = scrape(port)
        labels = {"model": "identity", "version": "1"}
        start = value(before, "nv_inference_request_success_total", **labels)
        for _ in range(7):
            client.infer("identity", {"INPUT0": np.ones(4, np.float32)})
        for _ in range(3):
            client.infer("counted", {"INPUT0": np.ones(3, np.float32)})
        with pytest.raises(EdgeServerError):
            client.infer("counted", {"INPUT0": -np.ones(2, np.float32)})
        text, after = scrape(port)
        stats = {s["name"]: s for s in client.statistics()}
        assert value(after, "nv_inference_request_success_total", **labels) == start + 7
        for model in ("identity", "counted"):
            s, lab = stats[model]["inference_stats"], {"model": model, "version": "1"}
            assert value(after, "nv_inference_request_success_total", **lab) == s["success"]["count"]
            reasons = ("REJECTED", "CANCELED", "BACKEND", "OTHER")  # Triton's reason label, every one
            failed = sum(value(after, "nv_inference_request_failure_total", **lab, reason=r) for r in reasons)
            assert failed == s["fail"]["count"]
            assert value(after, "nv_inference_count_total", **lab) == stats[model]["inference_count"]
            assert value(after, "nv_inference_exec_count_total", **lab) == stats[model]["execution_count"]
            queue_us = (
                s["queue"]["ns"] / 1e3
            )  # microseconds as floats: equal up to the text format's rounding
            assert value(after, "nv_inference_queue_duration_us_total", **lab) == pytest.approx(queue_us)
            infer_us = value(after, "nv_inference_compute_infer_duration_us_total", **lab)
            assert infer_us == pytest.approx(s["compute_infer"]["ns"] / 1e3) and infer_us > 0
            request_us = (s["success"]["ns"] + s["fail"]["ns"]) / 1e3
            assert value(after, "nv_inference_request_duration_us_total", **lab) == pytest.approx(request_us)
            assert value(after, "nv_inference_pending_request_count", **lab) == 0
        counted = {"model": "counted", "version": "1"}
        assert value(after, "nv_inference_request_failure_total", **counted, reason="BACKEND") == 1
        assert 'nv_inference_request_failure{model="counted",reason="BACKEND",version="1"} 1.0' in text
        # Triton's exact names in the text: no _total on its counters.
        assert "# TYPE nv_inference_request_success counter\n" in text
        assert 'nv_inference_request_success{model="identity",version="1"}' in text
        batch = value(
            after, "edge_inference_batch_exec_count_total", model="counted", version="1", batch_size="1"
        )
        assert batch == stats["counted"]["execution_count"]
        busy = after["edge_instance_busy_seconds_total"]
        assert any(dict(k)["model"] == "counted" and v > 0 for k, v in busy.items())
        assert value(after, "edge_model_state", model="identity", version="1", state="READY") == 1
        assert value(after, "edge_model_loads_total", model="counted") == 1
        assert value(after, "edge_model_load_failures_total", model="counted") == 0
        assert value(after, "edge_ipc_clients") >= 1
        assert value(after, "edge_server_ready") == 1
        assert value(after, "process_resident_memory_bytes") > 0
        assert "process_cpu_seconds_total" in after


def test_python_model_custom_metrics_appear(metrics_daemon: tuple[Daemon, int]) -> None:
    daemon, port = metrics_daemon
    with Client(daemon.address, timeout=10) as client:
        _, before = scrape(port)
        seen = before.get("counted_requests_total", {}).get((("model", "counted"),), 0.0)
        client.infer("counted", {"INPUT0": np.arange(5, dtype=np.float32)})
        text, after = scrape(port)
    assert value(after, "counted_requests_total", model="counted") == seen + 1
    assert value(after, "counted_last_sum", model="counted") == 10.0
    assert value(after, "counted_input_size_bucket", model="counted", le="16") >= 1
    assert value(after, "counted_input_size_bucket", model="counted", le="4") < value(
        after, "counted_input_size_count", model="counted"
    )
    # As Triton writes a model's metrics (L0_backend_python custom_metrics): a counter without
    # _total, bucket bounds without a trailing .0
    assert "# TYPE counted_requests counter\n" in text
    assert 'counted_requests{model="counted"} ' in text
    assert 'counted_input_size_bucket{le="16",model="counted"} ' in text


def test_only_metrics_is_served(metrics_daemon: tuple[Daemon, int]) -> None:
    _, port = metrics_daemon
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=10)
    assert info.value.code == 404


def test_metric_family_rules() -> None:
    """Misuse raises TritonModelException, as in Triton (L0_backend_python custom_metrics)."""
    registry = CustomMetrics()
    counter = MetricFamily("c", "a counter", MetricFamily.COUNTER, registry=registry)
    assert MetricFamily("c", "a counter", MetricFamily.COUNTER, registry=registry) is counter
    with pytest.raises(pb_utils.TritonModelException, match="another kind"):
        MetricFamily("c", "x", MetricFamily.GAUGE, registry=registry)
    with pytest.raises(pb_utils.TritonModelException, match="invalid metric family name"):
        MetricFamily("bad name", "x", MetricFamily.GAUGE, registry=registry)
    series = counter.Metric(labels={"k": "v"})
    assert counter.Metric(labels={"k": "v"}) is series
    series.increment(2)
    with pytest.raises(pb_utils.TritonModelException, match="cannot decrease"):
        series.increment(-1)
    with pytest.raises(pb_utils.TritonModelException, match="gauge"):
        series.set(3)
    assert series.value() == 2
    hist = MetricFamily("h", "a histogram", MetricFamily.HISTOGRAM, registry=registry)
    with pytest.raises(pb_utils.TritonModelException, match="needs buckets"):
        hist.Metric(labels={})
    assert hist.Metric(labels={"only": "inf"}, buckets=[]) is not None  # +Inf alone, as in Triton
    h = hist.Metric(labels={}, buckets=[1.0, 2.0])
    for v in (0.5, 1.0, 1.5, 3.0):
        h.observe(v)
    families = {f.name: f for f in registry.collect()}
    samples = {(s.name, s.labels.get("le")): s.value for s in families["h"].samples}
    assert samples[("h_bucket", "1")] == 2  # le is inclusive
    assert samples[("h_bucket", "2")] == 3
    assert samples[("h_bucket", "+Inf")] == 4
    assert samples[("h_count", None)] == 4 and samples[("h_sum", None)] == 6.0
    assert pb_utils.MetricFamily is MetricFamily


@pytest.mark.parametrize("device", ["agx_orin", "orin_nano", "xavier_nx"])
def test_device_metrics_from_recorded_sysfs(device: str) -> None:
    registry = registry_with(device_root=str(SYSFS / device))
    samples = {}
    for family in text_string_to_metric_families(exposition(registry).decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    assert samples["edge_temperature_celsius"]
    assert all(0 < s.value < 120 for s in samples["edge_temperature_celsius"])
    assert "edge_gpu_utilization_percent" in samples
    assert len(samples["edge_power_mode"]) == 1


def test_device_metrics_absent_off_jetson(tmp_path: Path) -> None:
    assert list(DeviceCollector(tmp_path).collect()) == []


def test_failures_are_counted_by_tritons_reason() -> None:
    """A queue-policy timeout is REJECTED, a cancel CANCELED, anything else that did not run OTHER."""
    stats = ModelStats("m", 1)
    stats.record_failure(5, 5, "REJECTED")
    stats.record_failure(5, 5, "CANCELED")
    stats.record_failure(5, 5)
    stats.record_failure(5, 5, "no such reason")
    assert stats.failure_reasons() == {"REJECTED": 1, "CANCELED": 1, "BACKEND": 0, "OTHER": 2}
    assert stats.as_dict()["inference_stats"]["fail"]["count"] == 4
