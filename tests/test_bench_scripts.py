"""bench/bench_triton.py without Triton, the Triton repository it generates on both servers, and
bench_hostile.py, bench_reload.py and every other script in bench/ run end to end.

No timing is asserted: the benchmark is run in its quick mode only to show that it runs end to end,
prints the table and says why Triton was skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from bench.triton_models import ACCEL, WORKLOADS, build_repository, python_models, sample_inputs
from bench.triton_server import Tritonserver, TritonUnavailable, find_tritonserver
from edge_server.client import Client
from tests.daemon import Daemon

ROOT = Path(__file__).resolve().parent.parent


def direct(repo: Path, name: str, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(repo / f"{name}_py" / "1" / "model.onnx"))
    return session.run(None, {session.get_inputs()[0].name: x})[0]


@pytest.mark.slow
def test_bench_triton_quick_measures_edge_server_and_says_why_triton_was_skipped(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "tritonserver"
    result = subprocess.run(
        [
            sys.executable, str(ROOT / "bench" / "bench_triton.py"), "--quick", "--rounds", "1",
            "--seconds", "0.2", "--clients", "2", "--tritonserver", str(missing),
            "--json", str(tmp_path / "out.json"),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Triton skipped: no tritonserver binary at {missing}" in result.stderr
    assert f"Triton: SKIPPED, no tritonserver binary at {missing}" in result.stdout
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| workload | transport | triton model.py | edge model.py | edge onnxruntime")
    ipc = [row for row in rows if "| IPC + shm |" in row]
    assert len(ipc) == 2  # tiny and frame
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2] == "—"  # no Triton column values
        assert float(cells[3].replace(",", "")) > 0  # edge-server's model.py was measured
    import json

    medians = json.loads((tmp_path / "out.json").read_text())
    assert medians["triton"].startswith("SKIPPED")
    assert not any(key.endswith("triton model.py") for key in medians["latency_us"])


def test_generated_triton_repository_is_served_unchanged_by_edge_server(tmp_path: Path) -> None:
    repo = build_repository(tmp_path / "repo", onnx_backend=False)  # exactly what tritonserver is given
    assert sorted(p.name for p in repo.iterdir()) == sorted(python_models())
    inputs = sample_inputs()
    daemon = Daemon(repo, f"ipc://{tmp_path}/d.sock", tmp_path / "daemon.log", "--strict-readiness", "true")
    daemon.start(timeout=120)
    try:
        with Client(daemon.address, timeout=60) as client:
            for w in WORKLOADS:
                out = client.infer(f"{w.name}_py", {w.input: inputs[w.name]})[w.output]
                np.testing.assert_allclose(out, direct(repo, w.name, inputs[w.name]), rtol=1e-5, atol=1e-5)
            x = inputs["cnn"]  # the accelerator stand-in answers its input's first value, ten times
            assert client.infer(ACCEL, {"input": x})["logits"].tolist() == [[float(x.flat[0])] * 10]
    finally:
        assert daemon.stop() == 0


def test_missing_tritonserver_is_reported_with_the_path(tmp_path: Path) -> None:
    with pytest.raises(TritonUnavailable, match="no tritonserver binary at"):
        find_tritonserver(str(tmp_path / "tritonserver"))


@pytest.mark.slow
def test_tritonserver_serves_the_same_repository_when_installed(tmp_path: Path) -> None:
    try:
        binary = find_tritonserver()
    except TritonUnavailable as exc:
        pytest.skip(str(exc))
    import tritonclient.http as httpclient

    from tests.daemon import free_port

    repo = build_repository(tmp_path / "repo", onnx_backend=False)
    triton = Tritonserver(binary, repo, ["tiny_py"], tmp_path, free_port(), free_port())
    try:
        try:
            triton.start(timeout=120)
        except TritonUnavailable as exc:
            pytest.skip(f"tritonserver is installed but cannot start here: {str(exc)[:500]}")
        x = sample_inputs()["tiny"]
        client = httpclient.InferenceServerClient(f"127.0.0.1:{triton.http_port}")
        tensor = httpclient.InferInput("INPUT", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        out = client.infer("tiny_py", [tensor]).as_numpy("OUTPUT")
        client.close()
        np.testing.assert_allclose(out, direct(repo, "tiny", x), rtol=1e-5, atol=1e-5)
    finally:
        triton.stop()


def _hostile_processes(run: str) -> set[int]:
    """This test's bench_hostile run's processes (daemons, attackers): they inherit ``run`` in their
    environment, so another bench_hostile on the machine is never counted."""
    found = set()
    marker = f"EDGE_TEST_RUN={run}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"bench-hostile-" not in cmdline and b"hostile_attacks.py" not in cmdline:
                continue
            if marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.add(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_bench_hostile_quick_measures_the_good_clients_beside_each_attack_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    """No timing is asserted (the fixes of issue 23 may not be merged here): two attacks, one over TCP
    and one over the descriptor hand-off, run for half a second each; the table has the idle row and
    one row per attack, the good clients were measured, and no daemon or attacker is left behind."""
    run = uuid.uuid4().hex
    result = subprocess.run(
        [
            sys.executable, str(ROOT / "bench" / "bench_hostile.py"), "--quick", "--seconds", "0.5",
            "--only", "slow-headers", "token-hoarding", "--json", str(tmp_path / "out.json"),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "EDGE_TEST_RUN": run},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| attack (issue 23 item) | p50 ms | p99 ms | p99 / idle | good ok / sent |")
    assert [row.split("|")[1].strip() for row in rows[1:4]] == [
        "idle (no attacker)", "slow-headers (2)", "token-hoarding (17)"
    ]  # fmt: skip
    import json

    measured = json.loads((tmp_path / "out.json").read_text())
    assert [row["attack"] for row in measured] == ["idle (no attacker)", "slow-headers", "token-hoarding"]
    for row in measured:  # both attacks can be made anywhere: neither may be skipped
        assert not row["skipped"] and row["sent"] > 0 and row["rss_start_mib"] > 0, row
    assert all(row["attacker"].startswith("as uid ") for row in measured[1:]), measured
    assert not _hostile_processes(run)


@pytest.mark.slow
def test_bench_reload_runs_its_reloads_end_to_end() -> None:
    """Two OTA drops under traffic, against the real daemon: no failed request, the table printed.

    It timed out waiting for the old version's unload once unloaded versions stayed in the index as
    ``UNAVAILABLE`` (as in Triton), and nothing ran it.
    """
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_reload.py"), "--reloads", "2", "--clients", "2",
         "--warmup", "0.5", "--weights-mb", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    assert "| failed requests | 0 |" in result.stdout, result.stdout
    assert "PASS" in result.stdout


def test_bench_kserve_cost_parts_times_each_step() -> None:
    """``--parts`` times edge-server's own steps in process; it called a method the service no longer had,
    and nothing ran it."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_kserve_cost.py"), "--parts", "--calls", "20"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and line[-3:-2].isdigit()]
    assert len(rows) == 9 and "tiny model.py through the data plane" in result.stdout, result.stdout


# -- every other script in bench/, in its smallest run --------------------------------------------------
# Nothing ran them, and a refactor could break one unseen (as it broke bench_reload and bench_kserve_cost).
# No timing is asserted: each runs once with small counts, exits 0 and prints its table; ``lines`` are
# the beginnings of lines its output must hold, in this order (the table's header and its rows).
QUICK_RUNS = [
    pytest.param(
        "bench_batch_cost", ["--rounds", "1", "--budget", "0.05"],
        ["model ", "digits (8x8 MLP)", "crop CNN (64x64)", "crop CNN (64x64)", "anchor CNN (224x224)"],
        id="batch_cost",
    ),
    pytest.param(
        "bench_batching", ["--seconds", "0.3", "--clients", "2"],
        ["| batch | median ms per call", "| 1 |", "| 8 |", "| batching | instances | req/s", "| off | 1 |",
         "| on | 1 |", "| off | 2 |", "| on | 2 |", "| path | µs per call", "| backend.execute directly",
         "| DataPlane.run_here", "| DataPlane.submit"],
        id="batching",
    ),
    pytest.param(
        "bench_busy_instance", ["--rounds", "1", "--seconds", "1.5", "--clients", "2"],
        ["2 client processes", "| checkout | transport | inferences/s | gap per execution",
         "| this checkout | gRPC |", "| this checkout | IPC |"],
        id="busy_instance",
    ),
    pytest.param(  # without Triton (no binary there): the timed model.py checked and measured on ours
        "bench_cnn_runs",
        ["--rounds", "1", "--seconds", "2", "--clients", "2", "--tritonserver", "/nonexistent"],
        ["Triton: SKIPPED, no tritonserver binary at /nonexistent", "2 gRPC clients, 1 rounds of 2 s",
         "| server | inferences/s | run, median µs | gap, median µs", "| edge-server |",
         "| edge-server | clients (this process) |", "| edge-server | **all**, on "],
        id="cnn_runs",
    ),
    pytest.param(
        "bench_busy_instance", ["--alone", "--rounds", "1", "--seconds", "1.5", "--clients", "2"],
        ["2 client processes", "| this checkout | gRPC |", "| this checkout | IPC |"],
        id="busy_instance_alone",
    ),
    pytest.param(
        "bench_http_stacks", ["--short"],
        ["aiohttp (asyncio loop)", "uvicorn+httptools (asyncio)", "uvicorn+httptools (uvloop)"] * 2,
        id="http_stacks",
    ),
    pytest.param(
        "bench_ipc", ["--runs", "1", "--requests", "100", "--frames", "5", "--pipelined", "300"],
        ["| case | median | ratio | target | met |", "| bare pyzmq", "| identity (16 x FP32) through Client",
         "| frame model, 64 B request", "| 1080x1920x3 UINT8 frame through shared memory",
         "| 1080p frame through shared memory, copying", "| 1080p frame inline", "| pipelined identity"],
        id="ipc",
    ),
    pytest.param(
        "bench_kserve_ab", [str(ROOT), "--blocks", "1", "--models", "tiny_py,frametx"],
        ["| model | transport | before | after |", "| tiny_py | HTTP |", "| tiny_py | gRPC |",
         "| tiny_py | IPC |", "| frametx | HTTP |", "| frametx | gRPC |", "| frametx | IPC |"],
        id="kserve_ab",  # this checkout against itself
    ),
    pytest.param(
        "bench_kserve_floor", ["--quick", "--rounds", "1"],
        ["| payload | transport | bare grpcio |", "| tiny | HTTP |", "| tiny | gRPC |", "| frame | HTTP |",
         "| frame | gRPC |"],
        id="kserve_floor",
    ),
    pytest.param(
        "bench_pipeline", ["--short", "--cameras", "1", "4"],
        ["plain in-process loop over ONNX Runtime", "classifier ", "batching on ", "batching on ",
         "batching, no delay ", "batching, no delay ", "batching off ", "batching off "],
        id="pipeline", marks=pytest.mark.slow,  # it failed reading a daemon thread that had just ended
    ),
    pytest.param(
        "bench_python_isolation", ["--quick"],
        ["| path | model | thread median", "| in-process | tiny |", "| in-process | frame |",
         "| IPC | tiny |", "| IPC | frame |"],
        id="python_isolation",
    ),
    pytest.param(
        "bench_sequence", ["--short", "--cameras", "4"],
        ["| variant | frames/s |", "| oldest, batch 16 |", "| oldest, batch 1 |", "| direct, batch 16 |",
         "| client state, no batching |", "| client state, dynamic batching |"],
        id="sequence",
    ),
    pytest.param(
        "bench_shm_outputs", ["--short"],
        ["1080p UINT8 frame in and out", "  backend: run + copy into shm", "  backend: IOBinding into shm",
         "  IPC: direct (IOBinding)", "  IPC: copied after the run", "  IPC: frontend pwrite",
         "  IPC: output inline", "  paths counted by the daemon"],
        id="shm_outputs",
    ),
    pytest.param(
        "bench_soak", ["--minutes", "0.15", "--clients", "2"],  # exits 1 on a lost reply, an unexpected code
        ["| what | count |", "| lost replies | 0 |", "| worker threads that never returned | 0 |",
         "| daemon exit status | 0 |", "| sender | code | count |", "| t (s) | RSS (MiB) | open fds |"],
        id="soak", marks=pytest.mark.slow,
    ),
    pytest.param(
        "bench_baselines", ["--runs", "1", "--requests", "50", "--cnn-requests", "5", "--seconds", "0.3"],
        ["| case | median | ratio | target |", "| bare pyzmq echo", "| minimal zmq+ORT server, tiny",
         "| edge-server IPC, tiny (ONNX)", "| edge-server HTTP",
         "| edge-server IPC, CNN 224, 8 clients, dynamic", "dynamic batching, 8 clients: batches by size"],
        id="baselines", marks=pytest.mark.slow,
    ),
    pytest.param(
        "run_all", ["--only", "bench_sequence"],
        ["## bench_sequence --short (", "| variant | frames/s |", "| oldest, batch 16 |"],
        id="run_all",
    ),
]  # fmt: skip


def run_bench(script: str, *args: str) -> str:
    """``bench/<script>.py args`` in this interpreter: its stdout, once it has exited 0."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{script}.py"), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    return result.stdout


def assert_lines_in_order(out: str, beginnings: list[str]) -> None:
    lines = iter(out.splitlines())
    for beginning in beginnings:
        assert any(line.startswith(beginning) for line in lines), (beginning, out)


@pytest.mark.parametrize(("script", "args", "lines"), QUICK_RUNS)
def test_bench_script_runs_end_to_end(script: str, args: list[str], lines: list[str], tmp_path: Path) -> None:
    if script == "run_all":  # its per-script files go here, not over the checkout's bench/results/
        args = [*args, "--results", str(tmp_path), "--out", str(tmp_path / "all.md")]
    out = run_bench(script, *args)
    assert_lines_in_order(out, lines)
    if script == "run_all":
        assert (tmp_path / "bench_sequence.txt").read_text().strip() in (tmp_path / "all.md").read_text()


@pytest.mark.slow
def test_bench_kserve_quick_compares_every_transport_with_fastapi() -> None:
    pytest.importorskip("fastapi", reason="bench_kserve's baseline needs fastapi: pip install -e '.[bench]'")
    out = run_bench("bench_kserve", "--quick", "--requests", "30", "--frames", "3")
    assert_lines_in_order(
        out,
        ["| case | median us | range us | x IPC | FastAPI / case |", "| tiny: ipc Client |",
         "| tiny: http http.client (FastAPI+ORT) |", "| frame: ipc shm |", "| frame: grpc tritonclient shm |",
         "| frame: http http.client (FastAPI+ORT) |", "tiny, same bare client: our HTTP"],
    )  # fmt: skip


@pytest.mark.slow
def test_bench_ocr_compares_the_daemon_with_the_package() -> None:
    pytest.importorskip("rapidocr_onnxruntime", reason="the OCR example's package (Python < 3.13)")
    out = run_bench("bench_ocr", "--rounds", "1", "--seconds", "1", "--cameras", "1")
    assert_lines_in_order(
        out,
        ["| case | cameras | frames/s |", "| package, defaults | 1 |", "| package, 1 thread/model | 1 |",
         "| daemon, batching on | 1 |", "| daemon, batching off | 1 |"],
    )  # fmt: skip


def test_bench_perf_analyzer_quick_measures_both_protocols_or_says_why_not() -> None:
    """perf_analyzer ships only in tritonclient 2.36.0's wheel (see the script): where none runs, the
    script's skip is this test's."""
    out = run_bench("bench_perf_analyzer", "--quick")
    if out.startswith("SKIP: "):
        pytest.skip(out.strip())
    header = "| protocol | concurrency | infer/s |"
    assert_lines_in_order(out, [header, "| http | 1 |", "| http | 4 |", "| grpc | 1 |", "| grpc | 4 |"])
