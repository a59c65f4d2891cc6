"""What running a Python model in its own process costs, against the daemon's thread, in one run.

    .venv/bin/python bench/bench_python_isolation.py [--quick]

The same ``model.py`` is served twice, with ``isolation`` ``thread`` and ``process``: a tiny model
(16 FP32 values -> the values + 1) and a camera frame (1080p RGB UINT8, 6.2 MB -> its mean, so the
cost is the frame's trip to the model).  Each is timed through the in-process API (``Server.infer``)
and over IPC (``Client.infer`` to a daemon started here), one request at a time, the two modes
interleaved in rounds so that a busy neighbour on a shared machine hits both alike.  Prints a Markdown
table of medians and 90th percentiles (microseconds) and the added cost of the process mode.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_server import Server  # noqa: E402
from edge_server.client import Client  # noqa: E402

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "IN", data_type: {dtype}, dims: {dims} }} ]
output [ {{ name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] }} ]
parameters [ {{ key: "isolation", value: {{ string_value: "{isolation}" }} }} ]
"""

MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            out = x + 1 if x.dtype == np.float32 else np.array([x.mean()], np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]))
        return responses
"""

CASES = {
    "tiny": ("TYPE_FP32", "[ -1 ]", np.arange(16, dtype=np.float32)),
    "frame": ("TYPE_UINT8", "[ -1, -1, 3 ]", np.zeros((1080, 1920, 3), np.uint8)),
}
MODES = ("thread", "process")


def build_repository(root: Path) -> Path:
    repo = root / "repo"
    for case, (dtype, dims, _) in CASES.items():
        for mode in MODES:
            name = f"{case}_{mode}"
            (repo / name / "1").mkdir(parents=True)
            (repo / name / "config.pbtxt").write_text(
                CONFIG.format(name=name, dtype=dtype, dims=dims, isolation=mode)
            )
            (repo / name / "1" / "model.py").write_text(textwrap.dedent(MODEL))
    return repo


def measure(call: Callable[[str], object], case: str, iterations: int, rounds: int) -> dict[str, list[float]]:
    """Per mode, the microseconds of every call; modes alternate round by round."""
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    for mode in MODES:  # warm up both
        for _ in range(max(3, iterations // 20)):
            call(f"{case}_{mode}")
    per_round = max(1, iterations // rounds)
    for _ in range(rounds):
        for mode in MODES:
            model = f"{case}_{mode}"
            for _ in range(per_round):
                t0 = time.perf_counter_ns()
                call(model)
                samples[mode].append((time.perf_counter_ns() - t0) / 1000)
    return samples


def start_daemon(repo: Path, address: str, log: Path) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "edge_server", "serve", "--model-repository", str(repo), "--ipc", address,
        "--allow-http", "false", "--allow-grpc", "false", "--allow-metrics", "false",
        "--max-message-bytes", str(64 << 20),
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    with Client(address, timeout=0.5) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the daemon exited:\n{log.read_text()[-3000:]}")
            try:
                if client.server_ready():
                    return proc
            except Exception:
                continue
    proc.kill()
    raise TimeoutError("the daemon was not ready in 120 s")


def row(where: str, case: str, samples: dict[str, list[float]]) -> str:
    thread, process = (np.asarray(samples[m]) for m in MODES)
    med_t, med_p = float(np.median(thread)), float(np.median(process))
    p90_t, p90_p = float(np.percentile(thread, 90)), float(np.percentile(process, 90))
    return (
        f"| {where} | {case} | {med_t:.0f} | {med_p:.0f} | {med_p - med_t:+.0f} | "
        f"{p90_t:.0f} | {p90_p:.0f} | {len(thread)} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few hundred calls (seconds, not minutes)")
    args = parser.parse_args()
    counts = {"tiny": 400, "frame": 40} if args.quick else {"tiny": 5000, "frame": 400}
    rounds = 4 if args.quick else 10
    mode = "quick" if args.quick else "full"
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores, {mode} run\n")
    print("| path | model | thread median µs | process median µs | added µs | thread p90 | process p90 | n |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="bench-iso-") as tmp:
        repo = build_repository(Path(tmp))
        with Server(repo) as server:
            for case, (_, _, x) in CASES.items():
                samples = measure(lambda m, x=x: server.infer(m, {"IN": x}), case, counts[case], rounds)
                print(row("in-process", case, samples), flush=True)
        address = f"ipc://{tmp}/bench.sock"
        proc = start_daemon(repo, address, Path(tmp) / "daemon.log")
        try:
            with Client(address, timeout=60) as client:
                for case, (_, _, x) in CASES.items():
                    samples = measure(lambda m, x=x: client.infer(m, {"IN": x}), case, counts[case], rounds)
                    print(row("IPC", case, samples), flush=True)
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
