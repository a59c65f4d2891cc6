"""Triton's latency summaries (``--metrics-config summary_latencies=true``): the sliding window on its own
(a stepped clock, exact quantiles), then the real daemon scraped after real requests, its quantiles set
against what the client measured.  No timing thresholds: only orders that must hold (a server-side
duration lies inside the client's round trip; queue and compute lie inside the request)."""

from __future__ import annotations

import argparse
import math
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_server.client import Client
from edge_server.errors import InvalidArgument
from edge_server.metrics.options import metrics_config_item, summary_options
from edge_server.scheduler.summaries import (
    DEFAULT_QUANTILES,
    KINDS,
    LatencyWindow,
    SummaryOptions,
    parse_quantiles,
    weighted_quantiles,
)
from tests.daemon import ROOT, Daemon, free_port, start_pyzmq_gc
from tests.test_metrics import scrape, value

QS = [q for q, _ in DEFAULT_QUANTILES]
NAMES = {
    "request": "nv_inference_request_summary_us",
    "queue": "nv_inference_queue_summary_us",
    "compute_input": "nv_inference_compute_input_summary_us",
    "compute_infer": "nv_inference_compute_infer_summary_us",
    "compute_output": "nv_inference_compute_output_summary_us",
}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _columns(values: list[int]) -> list[list[int]]:
    return [[v * (k + 1) for v in values] for k in range(len(KINDS))]


def test_window_quantiles_are_exact_and_slide() -> None:
    clock = Clock()
    window = LatencyWindow(SummaryOptions(max_age_s=60, age_buckets=5), clock=clock)
    assert all(math.isnan(ns) for _, ns in window.summaries()["request"].quantiles)
    old = list(range(1, 1001))
    window.observe(_columns(old))
    got = window.summaries()
    for k, kind in enumerate(KINDS):
        want = np.quantile(np.array(old) * (k + 1), QS, method="inverted_cdf")
        assert [ns for _, ns in got[kind].quantiles] == pytest.approx(list(want))
        assert got[kind].count == 1000 and got[kind].sum_ns == sum(old) * (k + 1)
    clock.now += 30
    new = [5000] * 1000
    window.observe(_columns(new))
    both = window.summaries()["request"].quantiles
    assert [ns for _, ns in both] == list(np.quantile(old + new, QS, method="inverted_cdf"))
    clock.now += 45  # the first bucket (started 75 s ago, 12 s wide) has left the window
    only_new = window.summaries()["request"]
    assert [ns for _, ns in only_new.quantiles] == [5000.0] * len(QS)
    assert only_new.count == 2000  # count and sum are over all time, as Prometheus summaries
    clock.now += 100
    assert all(math.isnan(ns) for _, ns in window.summaries()["queue"].quantiles)
    assert window.summaries()["queue"].count == 2000


def test_window_samples_past_its_cap_and_weighs_what_it_kept() -> None:
    """More requests than a bucket keeps: count and sum stay exact, quantiles stay within sampling error,
    and a sampled bucket weighs as many requests as it saw beside a full one."""
    clock = Clock()
    window = LatencyWindow(SummaryOptions(max_samples=500), clock=clock)
    rng = np.random.default_rng(7)
    heavy = rng.integers(1, 10_001, 20_000)
    for chunk in np.array_split(heavy, 40):
        window.observe([chunk.tolist()] * len(KINDS))
    got = window.summaries()["request"]
    assert got.count == 20_000 and got.sum_ns == int(heavy.sum())
    for (q, ns), want in zip(got.quantiles, np.quantile(heavy, QS), strict=True):
        if q <= 0.95:
            assert abs(ns - want) < 1500, (q, ns, want)  # a uniform sample of 500 from 1..10000
    clock.now += 13  # a new bucket: 100 requests, all kept, at a value no sampled one has
    window.observe([[20_000] * 100] * len(KINDS))
    p50 = dict(window.summaries()["request"].quantiles)[0.5]
    assert p50 < 10_001  # 100 requests beside 20,000 do not move the median to themselves


def test_weighted_quantiles_match_numpy_with_equal_weights() -> None:
    values = np.array([5.0, 1.0, 3.0, 2.0, 4.0])
    assert weighted_quantiles(values, np.ones(5), [0.2, 0.5, 0.9, 0.999]) == list(
        np.quantile(values, [0.2, 0.5, 0.9, 0.999], method="inverted_cdf")
    )
    assert weighted_quantiles(values, np.array([1, 1, 1, 1, 100.0]), [0.5]) == [4.0]


def test_metrics_config_flag_mirrors_triton() -> None:
    assert summary_options([]) is None
    assert summary_options([("summary_latencies", "false")]) is None
    assert summary_options([("summary_latencies", "true")]) == SummaryOptions()
    custom = summary_options([("summary_latencies", "true"), ("summary_quantiles", "0.9:0.01,0.5:0.05")])
    assert custom is not None and custom.quantiles == ((0.5, 0.05), (0.9, 0.01))
    assert metrics_config_item("summary_latencies=true") == ("summary_latencies", "true")
    for bad in ("summary_latencies", "nope=1", "summary_latencies=maybe", "counter_latencies=false"):
        with pytest.raises(argparse.ArgumentTypeError):
            metrics_config_item(bad)
    assert parse_quantiles("0.99") == ((0.99, 0.0),)
    for bad in ("x:0.1", "1.5:0.1", "0.5:2", "0.5:x", "0:0.1"):
        with pytest.raises(InvalidArgument):
            parse_quantiles(bad)


@pytest.fixture(scope="module")
def summaries_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, int]]:
    start_pyzmq_gc()
    root = tmp_path_factory.mktemp("summaries")
    repo = root / "repo"
    for name in ("identity", "digits"):
        shutil.copytree(ROOT / "models" / name, repo / name, ignore=shutil.ignore_patterns("samples"))
    port = free_port()
    daemon = Daemon(repo, f"ipc://{root}/s.sock", root / "s.log", "--allow-metrics", "true")
    daemon.args += ("--metrics-port", str(port), "--metrics-config", "summary_latencies=true")
    daemon.start()
    try:
        yield daemon, port
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_summaries_after_real_requests(summaries_daemon: tuple[Daemon, int]) -> None:
    daemon, port = summaries_daemon
    labels = {"model": "identity", "version": "1"}
    measured_us: list[float] = []
    with Client(daemon.address, timeout=10) as client:
        text, before = scrape(port)
        assert "# TYPE nv_inference_request_summary_us summary\n" in text
        for name in NAMES.values():  # nothing yet: NaN quantiles, zero count
            assert value(before, name + "_count", **labels) == 0
            assert math.isnan(value(before, name, **labels, quantile="0.5"))
        x = np.arange(16, dtype=np.float32)
        for _ in range(200):
            began = time.perf_counter_ns()
            client.infer("identity", {"INPUT0": x})
            measured_us.append((time.perf_counter_ns() - began) / 1e3)
        _, after = scrape(port)
    success = value(after, "nv_inference_request_success_total", **labels)
    assert success == 200
    found: dict[str, list[float]] = {}
    for kind, name in NAMES.items():
        assert value(after, name + "_count", **labels) == success  # as Triton: _count matches the counter
        found[kind] = [value(after, name, **labels, quantile=f"{q:g}") for q in QS]
        assert found[kind] == sorted(found[kind]), (kind, found[kind])  # quantiles never decrease
        assert all(v >= 0 for v in found[kind])
    assert value(after, NAMES["request"] + "_sum", **labels) == pytest.approx(
        value(after, "nv_inference_request_duration_us_total", **labels)
    )
    assert value(after, NAMES["queue"] + "_sum", **labels) == pytest.approx(
        value(after, "nv_inference_queue_duration_us_total", **labels)
    )
    assert value(after, NAMES["compute_infer"] + "_sum", **labels) == pytest.approx(
        value(after, "nv_inference_compute_infer_duration_us_total", **labels)
    )
    # Each request's server time lies inside its client round trip, so every order statistic of the
    # server's durations is at most the client's; queue and compute time lie inside the request's.
    client_qs = np.quantile(measured_us, QS, method="inverted_cdf")
    for q, server_us, client_us in zip(QS, found["request"], client_qs, strict=True):
        assert 0 < server_us <= client_us, (q, server_us, client_us)
    for part in ("queue", "compute_infer"):
        assert all(p <= r for p, r in zip(found[part], found["request"], strict=True)), part
    assert found["compute_infer"][0] > 0
    # A model with no traffic has its series too, empty.
    assert value(after, NAMES["request"] + "_count", model="digits", version="1") == 0


def test_summaries_of_dynamically_batched_requests(summaries_daemon: tuple[Daemon, int]) -> None:
    """Requests in flight together, batched by the scheduler: each is counted once, charged its batch's
    compute time, and no server duration exceeds the burst's wall time."""
    daemon, port = summaries_daemon
    labels = {"model": "digits", "version": "1"}
    image = np.load(ROOT / "models" / "digits" / "samples" / "digit_3.npy").astype(np.float32)[None]
    with Client(daemon.address, timeout=10) as client:
        _, before = scrape(port)
        start = value(before, NAMES["request"] + "_count", **labels)
        began = time.perf_counter_ns()
        futures = [client.submit("digits", {"image": image}) for _ in range(32)]
        for future in futures:
            future.result(10)
        wall_us = (time.perf_counter_ns() - began) / 1e3
        _, after = scrape(port)
    assert value(after, NAMES["request"] + "_count", **labels) == start + 32
    assert value(after, "nv_inference_request_success_total", **labels) == start + 32
    found = {
        kind: [value(after, name, **labels, quantile=f"{q:g}") for q in QS] for kind, name in NAMES.items()
    }
    for kind, values in found.items():
        assert values == sorted(values), kind
    assert 0 < found["request"][-1] <= wall_us
    for part in ("queue", "compute_infer"):
        assert all(p <= r for p, r in zip(found[part], found["request"], strict=True)), part


def test_summaries_are_off_by_default(tmp_path: Path) -> None:
    """Triton's default: no summary families unless asked for."""
    start_pyzmq_gc()
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "models" / "identity", repo / "identity")
    port = free_port()
    daemon = Daemon(repo, f"ipc://{tmp_path}/o.sock", tmp_path / "o.log", "--allow-metrics", "true")
    daemon.args += ("--metrics-port", str(port))
    daemon.start()
    try:
        with Client(daemon.address, timeout=10) as client:
            client.infer("identity", {"INPUT0": np.ones(4, np.float32)})
        text, samples = scrape(port)
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert "summary_us" not in text
    assert value(samples, "nv_inference_request_success_total", model="identity", version="1") == 1
