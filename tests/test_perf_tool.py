"""``edge-server perf`` against the real daemon over IPC, HTTP and gRPC, and in-process.

Each run is short (windows of 150-200 ms, one or two of them): the figures are not judged, only
whether they agree with the daemon's own statistics, whether the files are written, and whether every
bad command line gets one clear line and exit status 2.
"""

from __future__ import annotations

import csv
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_server.cli import main
from edge_server.client import Client
from edge_server.perf.measure import LevelResult, Window, is_stable, latency_summary
from edge_server.perf.options import PerfOptions, concurrency_range
from edge_server.perf.report import write_csv
from edge_server.perf.server_stats import Snapshot
from tests.daemon import EXAMPLES, gate_fifos, stop_daemon, wait_for
from tests.decoupled_models import add_decoupled_models
from tests.kserve_daemon import KServeDaemon, start_kserve_daemon
from tests.sequence_models import OLDEST, simple_sequence_config, simple_sequence_onnx, write_model

SHORT = ("-p", "150", "-r", "2")  # two windows of 150 ms: never stable (that needs 3), always quick
CSV_HEADER = [
    "Concurrency",
    "Inferences/Second",
    "Client Send",
    "Network+Server Send/Recv",
    "Server Queue",
    "Server Compute Input",
    "Server Compute Infer",
    "Server Compute Output",
    "Client Recv",
    "p50 latency",
    "p90 latency",
    "p95 latency",
    "p99 latency",
]


def _repository(root: Path) -> Path:
    if not (EXAMPLES / "digits" / "1" / "model.onnx").exists():
        pytest.skip("the example models are not built (models/make_models.py)")
    repo = root / "repo"
    for name in ("identity", "digits"):
        shutil.copytree(EXAMPLES / name, repo / name, ignore=shutil.ignore_patterns("samples"))
    write_model(repo, "seq", simple_sequence_config("seq", OLDEST), simple_sequence_onnx)
    add_decoupled_models(repo, root / "repeat.log")
    gate_fifos(root)
    return repo


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _repository(tmp_path_factory.mktemp("perf"))


@pytest.fixture(scope="module")
def kserve(repo: Path) -> Iterator[KServeDaemon]:
    server = start_kserve_daemon(repo.parent, repo, "perf.sock", "--allow-client-shm", "true")
    try:
        yield server
    finally:
        assert stop_daemon(server.daemon) == 0, server.daemon.log()


@pytest.fixture(scope="module")
def client(kserve: KServeDaemon) -> Iterator[Client]:
    with Client(kserve.daemon.address, timeout=30) as c:
        yield c


def perf(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["perf", *argv])
    except SystemExit as exc:  # argparse's own errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _where(kserve: KServeDaemon, repo: Path, transport: str) -> list[str]:
    return {
        "ipc": ["--ipc", kserve.daemon.address],
        "http": ["--http", f"http://{kserve.http_url}"],  # a scheme is accepted
        "grpc": ["--grpc", kserve.grpc_url],
        "local": ["--model-repository", str(repo)],
    }[transport]


def _requests(client: Client, model: str) -> int:
    return Snapshot.from_versions(client.statistics(model)).success_count


@pytest.mark.parametrize(
    ("transport", "shm"),
    [("ipc", False), ("ipc", True), ("http", False), ("http", True), ("grpc", False), ("grpc", True)],
)
def test_counts_agree_with_the_daemon(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    kserve: KServeDaemon,
    client: Client,
    repo: Path,
    transport: str,
    shm: bool,
) -> None:
    before = _requests(client, "digits")
    report = tmp_path / "r.json"
    argv = [*_where(kserve, repo, transport), "-b", "2", *SHORT, "--json", str(report)]
    code, out, err = perf(capsys, "digits", *argv, "--shared-memory", "system" if shm else "none")
    assert code == 0, err
    after = _requests(client, "digits")
    (level,) = json.loads(report.read_text())["levels"]
    check = level["level_check"]
    # every request sent was answered, and the daemon's own counters moved by exactly that many
    assert check["sent"] == check["answered"] == after - before > 0
    assert check["server"]["request_count"] == after - before
    assert check["server"]["inference_count"] == 2 * (after - before)  # batch size 2
    # each window: the daemon counted about what the client saw answered inside it
    for window in level["windows"]:
        assert window["requests"] > 0 and window["server_requests"] > 0
    server = level["server"]
    compute = server["compute_input_us"] + server["compute_infer_us"] + server["compute_output_us"]
    assert compute > 0
    # over the whole level (the same requests on both sides) each request's time in the daemon lies
    # inside its time at the client, so the averages keep that order whatever the machine's load
    total = check["server"]
    in_daemon = (
        total["queue_us"] + total["compute_input_us"] + total["compute_infer_us"] + total["compute_output_us"]
    )
    assert 0 < in_daemon < check["client_avg_us"]
    assert level["throughput"] == pytest.approx(2 * level["request_throughput"])
    assert "check" in out and "Concurrency" in out
    assert "not stable within 2 windows" in err  # 3 windows are needed: reported, never hidden


def test_in_process_counts_and_files(capsys: pytest.CaptureFixture[str], tmp_path: Path, repo: Path) -> None:
    local = tmp_path / "local"
    shutil.copytree(repo / "digits", local / "digits")
    csv_path, png, report = tmp_path / "o.csv", tmp_path / "o.png", tmp_path / "o.json"
    code, out, err = perf(
        capsys,
        "digits",
        "--model-repository",
        str(local),
        "--concurrency-range",
        "1:3:2",
        *SHORT,
        "-f",
        str(csv_path),
        "--plot",
        str(png),
        "--json",
        str(report),
        "--verbose",
    )
    assert code == 0, err
    levels = json.loads(report.read_text())["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 3]
    for level in levels:
        check = level["level_check"]
        assert check["sent"] == check["answered"] == check["server"]["request_count"] > 0
    rows = list(csv.reader(csv_path.open()))
    assert rows[0] == CSV_HEADER
    assert sorted(r[0] for r in rows[1:]) == ["1", "3"]
    assert [float(r[1]) for r in rows[1:]] == sorted(float(r[1]) for r in rows[1:])  # as perf_analyzer
    assert all(float(r[1]) > 0 and int(r[9]) <= int(r[12]) for r in rows[1:])  # p50 <= p99
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "window 1/2" in err  # --verbose: progress on stderr although it is not a terminal


def test_verbose_csv_as_model_analyzer_reads_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, kserve: KServeDaemon
) -> None:
    """Model Analyzer runs perf_analyzer with --verbose-csv and reads columns by name."""
    csv_path, report = tmp_path / "v.csv", tmp_path / "v.json"
    argv = ["--ipc", kserve.daemon.address, *SHORT, "--verbose-csv", "-f", str(csv_path)]
    code, _, err = perf(capsys, "digits", *argv, "--json", str(report))
    assert code == 0, err
    (row,) = list(csv.DictReader(csv_path.open()))
    assert list(row) == [*CSV_HEADER, "Avg latency", "request/response", "response wait"]
    (level,) = json.loads(report.read_text())["levels"]
    assert int(row["Avg latency"]) == int(level["latency_us"]["avg"]) > 0
    assert int(row["request/response"]) == 0 and int(row["response wait"]) == int(row["Avg latency"])
    parts = [
        "Client Send",
        "Network+Server Send/Recv",
        "Server Queue",
        "Server Compute Input",
        "Server Compute Infer",
        "Server Compute Output",
        "Client Recv",
    ]
    # the parts add up to the average (each truncated to whole microseconds, as perf_analyzer does)
    assert int(row["Avg latency"]) - 7 <= sum(int(row[k]) for k in parts) <= int(row["Avg latency"])


def _options(**changes: Any) -> PerfOptions:
    base: dict[str, Any] = dict(
        model="m",
        model_version=None,
        transport="ipc",
        address=None,
        repository=None,
        concurrency=(1, 2),
        request_rates=(),
        max_threads=1,
        batch_size=1,
        shared_memory="none",
        output_shared_memory_size=102400,
        input_data="random",
        shapes={},
        measurement_interval_ms=1000.0,
        percentile=None,
        stability_percentage=10.0,
        max_trials=3,
        sequence_length=None,
        streaming=False,
        csv=None,
        verbose_csv=False,
        plot=None,
        json=None,
        verbose=False,
    )
    return PerfOptions(**{**base, **changes})


def _level(level: int, latencies_us: list[float], responses: int = 0) -> LevelResult:
    server = Snapshot(success_count=len(latencies_us), queue_ns=10_000 * len(latencies_us))
    window = Window(0, 1_000_000_000, np.array(latencies_us), responses, server)
    return LevelResult(level, 1, [window], True, len(latencies_us), len(latencies_us), server)


def test_csv_columns_are_perf_analyzers(tmp_path: Path) -> None:
    """The header perf_analyzer's report writer builds for each combination of flags, and its values."""
    path = tmp_path / "c.csv"
    fast = _level(2, [100.0 + i for i in range(101)], responses=303)  # 101 inferences/s
    slow = _level(1, [500.0] * 10, responses=30)  # 10 inferences/s
    write_csv(_options(), [fast, slow], path)
    rows = list(csv.reader(path.open()))
    assert rows == [
        CSV_HEADER,
        ["1", "10", "0", "490", "10", "0", "0", "0", "0", "500", "500", "500", "500"],
        ["2", "101", "0", "140", "10", "0", "0", "0", "0", "150", "190", "195", "199"],
    ]
    write_csv(_options(verbose_csv=True), [slow], path)
    assert list(csv.reader(path.open()))[1][-3:] == ["500", "0", "500"]
    assert next(csv.reader(path.open()))[-3:] == ["Avg latency", "request/response", "response wait"]
    # --percentile: one more percentile in order, and no "Avg latency" (perf_analyzer's rule)
    write_csv(_options(verbose_csv=True, percentile=75), [fast], path)
    header, row = list(csv.reader(path.open()))
    assert header[9:] == [
        "p50 latency",
        "p75 latency",
        "p90 latency",
        "p95 latency",
        "p99 latency",
        "request/response",
        "response wait",
    ]
    assert row[9:14] == ["150", "175", "190", "195", "199"]
    # a decoupled model: responses per second beside inferences per second
    write_csv(_options(streaming=True, request_rates=(5.0,)), [fast], path, decoupled=True)
    header, row = list(csv.reader(path.open()))
    assert header[:4] == ["Request Rate", "Inferences/Second", "Response Throughput", "Client Send"]
    assert row[:3] == ["2", "101", "303"]


def test_percentiles_are_nearest_rank() -> None:
    """perf_analyzer's index: p / 100 * (n - 1) + 0.5, truncated; never an interpolation."""
    figures = latency_summary(np.array([40.0, 10.0, 30.0, 20.0]), 60)
    assert figures == {"avg": 25.0, "p50": 30.0, "p60": 30.0, "p90": 40.0, "p95": 40.0, "p99": 40.0}


def test_request_rate_mode(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, kserve: KServeDaemon, client: Client
) -> None:
    before = _requests(client, "digits")
    report, csv_path = tmp_path / "r.json", tmp_path / "r.csv"
    argv = ["--ipc", kserve.daemon.address, "--request-rate-range", "100:200:100", *SHORT]
    code, out, err = perf(capsys, "digits", *argv, "--json", str(report), "-f", str(csv_path))
    assert code == 0, err
    levels = json.loads(report.read_text())["levels"]
    sent = sum(lv["level_check"]["sent"] for lv in levels)
    assert sent == _requests(client, "digits") - before > 0
    assert next(csv.reader(csv_path.open()))[0] == "Request Rate"
    assert levels[1]["request_throughput"] > levels[0]["request_throughput"]


@pytest.mark.parametrize("transport", ["ipc", "grpc", "local"])
def test_sequences(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    kserve: KServeDaemon,
    client: Client,
    repo: Path,
    transport: str,
) -> None:
    if transport == "local":
        where = tmp_path / "local"
        shutil.copytree(repo / "seq", where / "seq")
        argv = ["--model-repository", str(where)]
    else:
        argv = _where(kserve, repo, transport)
    before = _requests(client, "seq")
    report = tmp_path / "s.json"
    code, out, err = perf(
        capsys,
        "seq",
        *argv,
        "--sequence-length",
        "3",
        "--concurrency-range",
        "2",
        *SHORT,
        "--json",
        str(report),
    )
    assert code == 0, err
    (level,) = json.loads(report.read_text())["levels"]
    check = level["level_check"]
    assert check["sent"] == check["answered"] == check["server"]["request_count"] > 0
    if transport != "local":
        assert check["sent"] == _requests(client, "seq") - before

        # every sequence was ended (the one in flight when the load stopped too): no slot stays taken
        def ended() -> bool:
            sequences = client.statistics("seq")[0]["sequence_stats"]
            return bool(sequences["active"] == 0 and sequences["backlog"] == 0)

        wait_for(ended, timeout=2.0, what="every sequence ended")


@pytest.mark.parametrize("transport", ["ipc", "grpc", "local"])
def test_streaming_a_decoupled_model(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    kserve: KServeDaemon,
    repo: Path,
    transport: str,
) -> None:
    data = tmp_path / "three.json"
    data.write_text(json.dumps({"data": [{"IN": [3]}]}))  # square: 3 responses a request
    if transport == "local":
        where = tmp_path / "local"
        shutil.copytree(repo / "square", where / "square")
        argv = ["--model-repository", str(where)]
    else:
        argv = _where(kserve, repo, transport)
    report = tmp_path / "d.json"
    code, out, err = perf(
        capsys, "square", *argv, "--streaming", "--input-data", str(data), *SHORT, "--json", str(report)
    )
    assert code == 0, err
    (level,) = json.loads(report.read_text())["levels"]
    assert all(w["responses"] == 3 * w["requests"] > 0 for w in level["windows"])
    check = level["level_check"]
    assert check["sent"] == check["answered"] == check["server"]["request_count"] > 0
    assert level["response_throughput"] == pytest.approx(3 * level["request_throughput"])
    assert "responses/s" in out


def test_input_data_directory_and_zero(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, kserve: KServeDaemon, repo: Path
) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "image").write_bytes(np.full((1, 8, 8), 0.5, np.float32).tobytes())
    for source in (str(folder), "zero"):
        code, _, err = perf(capsys, "digits", "--ipc", kserve.daemon.address, "--input-data", source, *SHORT)
        assert code == 0, err


BAD = [
    (["--concurrency-range", "4:2"], "END must not be below START"),
    (["--concurrency-range", "0"], "START must be greater than 0"),
    (["--concurrency-range", "1:x"], "expected START[:END[:STEP]] of integers"),
    (["--concurrency-range", "1:4:0"], "STEP must be greater than 0"),
    (["--request-rate-range", "-5"], "START must be greater than 0"),
    (["--concurrency-range", "1", "--request-rate-range", "10"], "not allowed with argument"),
    (["-b", "0"], "must be at least 1"),
    (["--percentile", "100"], "must be between 1 and 99"),
    (["--measurement-interval", "abc"], "expected a number"),
    (["--shared-memory", "cuda"], "invalid choice"),
    (["--output-shared-memory-size", "0"], "must be between 1 and"),
    (["--shape", "image"], "expected NAME:D1,D2"),
    (["--input-data", "/no/such/file.json"], "no such file or directory"),
    (["--plot", "/no/such/dir/p.png"], "is not a directory"),
    (["--model-repository", "/no/such/repo"], "is not a directory"),
    (["--ipc", "ipc:///x", "--http", "127.0.0.1:1"], "not allowed with argument"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_flags(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, out, err = perf(capsys, "digits", *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err and out == ""
    assert len([line for line in err.splitlines() if "error:" in line]) == 1


MODEL_BAD = [
    (["nope"], "model 'nope' cannot be measured"),
    (["identity"], "give --shape INPUT0:1"),
    (["identity", "--shape", "OTHER:4"], "the model's inputs are INPUT0"),
    (["identity", "--shape", "INPUT0:4", "-b", "2"], "does not batch"),
    (["digits", "-b", "16"], "exceeds model 'digits''s max_batch_size 8"),
    (["digits", "--sequence-length", "4"], "not a sequence model"),
    (["square"], "is decoupled"),
    (["seq", "--request-rate-range", "10"], "is a sequence model"),
]


@pytest.mark.parametrize(("argv", "message"), MODEL_BAD, ids=[" ".join(a) for a, _ in MODEL_BAD])
def test_bad_model_choices(
    capsys: pytest.CaptureFixture[str], kserve: KServeDaemon, argv: list[str], message: str
) -> None:
    code, out, err = perf(capsys, *argv, "--ipc", kserve.daemon.address, *SHORT)
    assert (code, out) == (2, "")
    assert message in err and "Traceback" not in err


def test_transport_specific_errors(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, kserve: KServeDaemon, repo: Path
) -> None:
    code, _, err = perf(capsys, "square", "--http", kserve.http_url, "--streaming")
    assert code == 2 and "HTTP cannot stream" in err
    code, _, err = perf(capsys, "digits", "--model-repository", str(repo), "--shared-memory", "system")
    assert code == 2 and "needs a daemon" in err
    code, _, err = perf(capsys, "digits", "--http", "127.0.0.1:1", *SHORT)
    assert code == 1 and "no KServe http server answers at 127.0.0.1:1" in err
    code, _, err = perf(capsys, "digits", "--ipc", f"ipc://{tmp_path}/absent.sock", *SHORT)
    assert code == 1 and "no edge-server daemon answers" in err
    # A daemon that does not take client shared memory over HTTP (the default): the flag is refused.
    plain = start_kserve_daemon(tmp_path, _plain_repository(tmp_path, repo), "plain.sock")
    try:
        for where in (["--http", plain.http_url], ["--grpc", plain.grpc_url]):
            code, _, err = perf(capsys, "digits", *where, "--shared-memory", "system", *SHORT)
            assert code == 2, err
            assert "--shared-memory system: the server refused the region" in err
            assert "--allow-client-shm" in err
    finally:
        assert stop_daemon(plain.daemon) == 0


@pytest.mark.parametrize("transport", ["ipc", "http", "grpc"])
def test_shared_memory_outputs_equal_inline(kserve: KServeDaemon, repo: Path, transport: str) -> None:
    """--shared-memory system: outputs written into the worker's region hold what inline ones do."""
    from edge_server.perf.command import open_target, plan
    from edge_server.perf.inputs import output_sizes
    from edge_server.perf.kserve_targets import response_json

    address = {"ipc": kserve.daemon.address, "http": kserve.http_url, "grpc": kserve.grpc_url}[transport]
    options = _options(model="digits", transport=transport, address=address, batch_size=2)
    seen: dict[str, dict[str, np.ndarray]] = {}
    for shared in (False, True):
        target, _ = open_target(options)
        try:
            info = target.model_info()
            steps, _ = plan(options, info)
            outputs = output_sizes(info.metadata, batched=True, batch_size=2, default_size=1)
            assert outputs == {"probabilities": 2 * 10 * 4}  # exactly the batch's bytes
            target.prepare(steps, shared_memory=shared, streaming=False, outputs=outputs if shared else None)
            worker = target.worker()
            try:
                worker.send(0, None)
                seen[str(shared)] = worker.last_outputs()
                if shared and transport == "ipc":  # the daemon wrote the output into our region
                    regions = target.client.shm_status()  # type: ignore[attr-defined]
                    assert sum(sum(r["outputs"].values()) for r in regions) == 1
                elif shared:  # the response describes the output and carries no data: it is in the region
                    (entry,) = response_json(worker._last)["outputs"]  # type: ignore[attr-defined]
                    assert (entry["name"], [int(d) for d in entry["shape"]]) == ("probabilities", [2, 10])
                    assert "data" not in entry and "binary_data_size" not in entry.get("parameters", {})
            finally:
                worker.close()
        finally:
            target.close()
    inline, shared_out = seen["False"]["probabilities"], seen["True"]["probabilities"]
    assert shared_out.shape == inline.shape == (2, 10)
    assert inline.any()  # a fresh region is zeros: equal values were written there
    np.testing.assert_array_equal(shared_out, inline)


def test_output_shared_memory_size_too_small(
    capsys: pytest.CaptureFixture[str], kserve: KServeDaemon
) -> None:
    """A variable-shape output gets --output-shared-memory-size bytes; one that does not fit is refused."""
    argv = ["--shape", "INPUT0:8", "--shared-memory", "system", *SHORT]
    code, _, err = perf(capsys, "identity", "--ipc", kserve.daemon.address, *argv)
    assert code == 0, err  # 32 bytes fit the default 102400
    code, _, err = perf(
        capsys, "identity", "--ipc", kserve.daemon.address, *argv, "--output-shared-memory-size", "16"
    )
    assert code == 1 and "requests failed" in err and "OUTPUT0" in err


def _plain_repository(root: Path, repo: Path) -> Path:
    plain = root / "plain"
    gate_fifos(root)
    shutil.copytree(repo / "digits", plain / "digits")
    return plain


def _window(throughput: float, latency_us: float) -> Window:
    count = int(throughput)
    return Window(0, 1_000_000_000, np.full(count, latency_us), count, Snapshot())


def test_stability_rule() -> None:
    steady = [_window(100, 1000), _window(104, 980), _window(97, 1020)]
    assert is_stable(steady, 10, None) and is_stable(steady, 10, 99)
    assert not is_stable(steady[:2], 10, None)  # three windows are needed
    assert not is_stable([_window(100, 1000), _window(130, 1000), _window(100, 1000)], 10, None)
    assert not is_stable([_window(100, 1000), _window(100, 1300), _window(100, 1000)], 10, None)
    assert is_stable([_window(50, 1), _window(100, 1000), _window(104, 980), _window(97, 1020)], 10, None)


def test_ranges_and_grpc_counters() -> None:
    assert concurrency_range("2").values() == [2]
    assert concurrency_range("1:8:3").values() == [1, 4, 7]
    grpc_json: dict[str, Any] = {  # gRPC's JSON: 64-bit counters as strings, zero fields left out
        "inference_count": "6",
        "execution_count": "3",
        "inference_stats": {"success": {"count": "3", "ns": "9000"}, "queue": {"count": "3", "ns": "3000"}},
        "batch_stats": [{"batch_size": "2", "compute_infer": {"count": "3", "ns": "300"}}],
    }
    snap = Snapshot.from_versions([grpc_json]) - Snapshot()
    assert (snap.success_count, snap.inference_count, snap.batches) == (3, 6, {2: 3})
    assert snap.summary()["queue_us"] == pytest.approx(1.0)


def test_daemon_found_as_status_finds_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, kserve: KServeDaemon
) -> None:
    monkeypatch.setenv("EDGE_SERVER_IPC", kserve.daemon.address)
    code, out, err = perf(capsys, "digits", *SHORT)
    assert code == 0, err
    assert kserve.daemon.address in out
