"""Inside the 8-client CNN row: ONNX Runtime's runs, and the gaps between them, under each server.

    .venv-bench/bin/python bench/bench_cnn_runs.py              # ~2 minutes with Triton
    .venv-bench/bin/python bench/bench_cnn_runs.py --clients 1  # the same runs with nobody waiting

bench_triton.py's row `CNN 224, 8 clients, gRPC` counts inferences per second. This script splits each
server's time per inference in two: the ONNX Runtime run itself, and the gap from one run's end to the
next one's start (the server's own work that the model waits for). Both servers get
bench/triton_models.py's ``cnn_py`` with two lines added that append each ``session.run``'s start and
end (``perf_counter_ns``) to a file: the same ``model.py`` in each, each with its own file. ``--clients``
``tritonclient`` gRPC threads keep one instance's queue full, and the servers take turns, round by round.

On a box whose cores ONNX Runtime's threads fill, what a server does during a run slows the run (one of
ONNX Runtime's threads is preempted mid-section and the other spins), and what it does between runs
idles the model: the two columns show which way each server pays (docs/benchmarks.md).

A second table gives the CPU each server's processes (Triton: ``tritonserver`` and the python_backend
stub) and this process (the clients) spent per inference.  Where every core is busy, the row's
inferences per second are the cores over the CPU of one inference, whoever spends it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_kserve_cost import process_cpu_by_command  # noqa: E402
from bench.bench_triton import throughput  # noqa: E402
from bench.triton_models import build_repository, python_models, sample_inputs  # noqa: E402
from bench.triton_server import Tritonserver, TritonUnavailable, find_tritonserver  # noqa: E402
from tests.daemon import Daemon, free_port, kserve_flags  # noqa: E402

MODEL = "cnn_py"
#: Runs this close to a round's start or end are left out: clients still starting, or already stopping.
EDGE_S = 0.5


def timed_repository(root: Path, times: Path) -> Path:
    """bench/triton_models.py's repository, its ``cnn_py`` writing each run's start and end to ``times``."""
    repo = build_repository(root, onnx_backend=False)
    path = repo / MODEL / "1" / "model.py"
    source = path.read_text()
    edits = [
        ("import os\n", "import os\nimport time\n"),
        (
            "        self.feed_name",
            f"        self.times = os.open({str(times)!r}, os.O_WRONLY | os.O_CREAT | os.O_APPEND)\n"
            "        self.feed_name",
        ),
        (
            "            y = self.session.run(",
            "            start = time.perf_counter_ns()\n            y = self.session.run(",
        ),
        (
            "[0]\n            responses.append",
            "[0]\n            os.write(self.times, b'%d %d\\n' % (start, time.perf_counter_ns()))\n"
            "            responses.append",
        ),
    ]
    for old, new in edits:
        if source.count(old) != 1:
            raise RuntimeError(f"bench/triton_models.py's model.py changed: {old.strip()!r} not found once")
        source = source.replace(old, new)
    path.write_text(source)
    return repo


def runs_between(times: Path, start_ns: int, end_ns: int) -> tuple[np.ndarray, np.ndarray]:
    """The runs (µs) that began and ended inside the window, and the gaps (µs) between consecutive ones."""
    rows = np.loadtxt(times, dtype=np.int64, ndmin=2)
    margin = int(EDGE_S * 1e9)
    rows = rows[(rows[:, 0] >= start_ns + margin) & (rows[:, 1] <= end_ns - margin)]
    if len(rows) < 2:
        raise RuntimeError(f"{len(rows)} runs recorded in {times} inside the window: give it more --seconds")
    return (rows[:, 1] - rows[:, 0]) / 1e3, (rows[1:, 0] - rows[:-1, 1]) / 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=6.0, help="per server and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tritonserver", default=None, help="binary (default: nvidia-pytriton's, or PATH)")
    args = parser.parse_args(argv)
    import onnxruntime as ort
    import tritonclient.grpc as grpcclient

    x = sample_inputs()["cnn"]
    with tempfile.TemporaryDirectory(prefix="bench-cnn-runs-") as tmp, ExitStack() as stack:
        root = Path(tmp)
        servers: dict[str, tuple[int, Path]] = {}  # name -> (gRPC port, its runs' file)
        pids: dict[str, int] = {}
        try:
            repo = timed_repository(root / "triton", root / "triton.times")
            triton = Tritonserver(
                find_tritonserver(args.tritonserver), repo, python_models(), root, free_port(), free_port()
            )
            stack.callback(triton.stop)
            triton.start()
            servers["triton"] = (triton.grpc_port, root / "triton.times")
            assert triton.proc is not None
            pids["triton"] = triton.proc.pid
        except TritonUnavailable as exc:
            print(f"Triton: SKIPPED, {str(exc).splitlines()[0]}")
        repo = timed_repository(root / "edge", root / "edge.times")
        grpc_port = free_port()
        flags = kserve_flags(free_port(), grpc_port)
        daemon = Daemon(repo, f"ipc://{root}/edge.sock", root / "edge.log", *flags)
        stack.callback(daemon.stop)
        daemon.start(timeout=180)
        servers["edge-server"] = (grpc_port, root / "edge.times")
        assert daemon.proc is not None
        pids["edge-server"] = daemon.proc.pid

        def client(port: int):  # type: ignore[no-untyped-def]
            connection = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
            stack.callback(connection.close)
            tensor = grpcclient.InferInput("input", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            return lambda: connection.infer(MODEL, [tensor]).as_numpy("logits")

        # The timed model.py must still be the model: each server's answer against ONNX Runtime's own.
        want = ort.InferenceSession(str(repo / MODEL / "1" / "model.onnx")).run(None, {"input": x})[0]
        for name, (port, _) in servers.items():
            got = client(port)()
            if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
                raise AssertionError(f"{name} answered {got}, ONNX Runtime {want}")

        results: dict[str, dict[str, list[float]]] = {name: {} for name in servers}
        cpu: dict[str, dict[str, list[float]]] = {name: {} for name in servers}  # ms per inference
        for r in range(args.rounds):
            for name in list(servers)[:: 1 if r % 2 == 0 else -1]:
                port, times = servers[name]
                before, mine = process_cpu_by_command(pids[name]), time.process_time()
                start = time.perf_counter_ns()
                rate = throughput(lambda port=port: client(port), args.clients, args.seconds)
                end = time.perf_counter_ns()
                after, mine = process_cpu_by_command(pids[name]), time.process_time() - mine
                # throughput() makes one untimed call per client first: counted with the CPU they cost
                inferences = rate * args.seconds + args.clients
                used = {process: after[process] - before.get(process, 0.0) for process in after}
                used["clients (this process)"] = mine
                for process, seconds in used.items():
                    cpu[name].setdefault(process, []).append(seconds / inferences * 1e3)
                cpu[name].setdefault("cores busy", []).append(sum(used.values()) / ((end - start) / 1e9))
                runs, gaps = runs_between(times, start, end)
                row = results[name]
                for key, value in (
                    ("rate", rate),
                    ("run", float(np.median(runs))),
                    ("gap", float(np.median(gaps))),
                    ("gap_mean", float(gaps.mean())),
                ):
                    row.setdefault(key, []).append(value)
                print(f"round {r + 1}/{args.rounds}: {name} done", file=sys.stderr, flush=True)

    rounds = f"{args.rounds} rounds of {args.seconds:g} s"
    print(f"\n{args.clients} gRPC clients, {rounds}; medians of the rounds\n")
    print("| server | inferences/s | run, median µs | gap, median µs | gap, mean µs | run + mean gap, µs |")
    print("|---|---|---|---|---|---|")
    for name, row in results.items():
        run, gap, gap_mean = (statistics.median(row[key]) for key in ("run", "gap", "gap_mean"))
        print(
            f"| {name} | {statistics.median(row['rate']):.1f} | {run:,.0f} | {gap:,.0f} | {gap_mean:,.0f} "
            f"| {run + gap_mean:,.0f} |"
        )
    print("\nCPU per inference, ms (/proc/PID/stat of each server's processes; this process's own)\n")
    print("| server | process | CPU per inference, ms |")
    print("|---|---|---|")
    for name, rows in cpu.items():
        for process, values in rows.items():
            if process != "cores busy":
                print(f"| {name} | {process} | {statistics.median(values):.2f} |")
        total = sum(statistics.median(values) for process, values in rows.items() if process != "cores busy")
        print(
            f"| {name} | **all**, on {statistics.median(rows['cores busy']):.2f} cores busy | {total:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
