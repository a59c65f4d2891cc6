"""Dynamic batching and instance groups on this machine, measured side by side in one run.

    .venv/bin/python bench/bench_batching.py [--seconds 5] [--clients 8]

Part 1 (issue 3's throughput target): the example CNN (models/cnn, dynamic batch axis) served through
the in-process API to N concurrent client threads, with batching off/on and 1/2 instances, against a
direct single-threaded onnxruntime loop.  Part 2: the scheduler's own overhead, the identity model
through ``Server.infer`` against calling the same backend instance directly.  Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_server import Server  # noqa: E402
from edge_server.backends.base import BatchItem, InstanceSpec, LoadContext, Timing  # noqa: E402
from edge_server.backends.onnxruntime import OnnxRuntimeBackend  # noqa: E402
from edge_server.config import load_config_file  # noqa: E402
from edge_server.request import InferRequest  # noqa: E402
from edge_server.scheduler import inline as scheduler_inline  # noqa: E402

CNN = ROOT / "models" / "cnn" / "1" / "model.onnx"
IDENTITY = ROOT / "models" / "identity"
DELAY_US = 2000

CNN_CONFIG = """
name: "cnn"
backend: "onnxruntime"
max_batch_size: 16
input [ {{ name: "input", data_type: TYPE_FP32, dims: [ 3, 64, 64 ] }} ]
output [ {{ name: "logits", data_type: TYPE_FP32, dims: [ 10 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: {count} }} ]
{batching}
"""


def _request(x: np.ndarray) -> InferRequest:
    return InferRequest(model="identity", inputs={"INPUT0": x})


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def direct_loop(seconds: float, batch: int) -> tuple[float, float]:
    """(requests/s counting rows, median ms per call) of a single-threaded onnxruntime loop."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(CNN), options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).random((batch, 3, 64, 64), dtype=np.float32)
    for _ in range(5):
        session.run(None, {"input": x})
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        session.run(None, {"input": x})
        times.append(time.perf_counter() - t0)
    return batch * len(times) / sum(times), statistics.median(times) * 1000


def serve_run(repo: Path, clients: int, seconds: float) -> tuple[float, float, float, float]:
    """(throughput req/s, p50 ms, p99 ms, mean batch) with ``clients`` threads sending batch-1 requests.

    Each thread is a client of its own (as cameras on their own connections are), so the queue serves
    them in turns: the batches measured here are formed across clients.
    """
    with Server(repo) as server:
        x = np.random.default_rng(1).random((1, 3, 64, 64), dtype=np.float32)
        for _ in range(10):
            server.infer("cnn", {"input": x})
        (before,) = server.statistics("cnn")
        latencies: list[list[float]] = [[] for _ in range(clients)]
        stop = threading.Event()

        def client(index: int, out: list[float]) -> None:
            request = InferRequest(model="cnn", inputs={"input": x}, client=(index, index))
            while not stop.is_set():
                t0 = time.perf_counter()
                server.dataplane.run_here(request, scheduler_inline.FRONTEND).result()  # Server.infer's path
                out.append(time.perf_counter() - t0)

        threads = [threading.Thread(target=client, args=(i, lat)) for i, lat in enumerate(latencies)]
        started = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - started
        (after,) = server.statistics("cnn")
    flat = [v * 1000 for lat in latencies for v in lat]
    executions = after["execution_count"] - before["execution_count"]
    inferences = after["inference_count"] - before["inference_count"]
    return len(flat) / elapsed, percentile(flat, 50), percentile(flat, 99), inferences / max(executions, 1)


def make_repo(base: Path, *, count: int, batching: bool) -> Path:
    repo = base / f"cnn_{count}_{'on' if batching else 'off'}"
    (repo / "cnn" / "1").mkdir(parents=True)
    shutil.copy(CNN, repo / "cnn" / "1" / "model.onnx")
    block = (
        f"dynamic_batching {{ preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: {DELAY_US} }}"
        if batching
        else ""
    )
    (repo / "cnn" / "config.pbtxt").write_text(CNN_CONFIG.format(count=count, batching=block))
    return repo


def overhead(runs: int = 5, calls: int = 3000) -> dict[str, float]:
    """Median µs per call (median of runs) of the identity model: the backend called directly, and
    the data plane's ``run_here`` with a frontend's budget (the request runs in the caller's thread, as
    ``Server.infer`` and the frontends do for a model this cheap), and its ``submit`` (through the queue
    and an instance's worker thread: what every batching model pays).
    """
    config, _ = load_config_file(IDENTITY / "config.pbtxt", default_name="identity")
    model_path = IDENTITY / "1" / "model.onnx"
    config = OnnxRuntimeBackend.complete_config(config, model_path)
    spec = InstanceSpec(name="identity_direct", kind="KIND_CPU", threads=1)
    backend = OnnxRuntimeBackend(
        LoadContext(
            config=config, version=1, version_dir=model_path.parent, model_path=model_path, instance=spec
        )
    )
    x = np.arange(16, dtype=np.float32)
    item = BatchItem(inputs={"INPUT0": x}, batch_size=1, requested_outputs=("OUTPUT0",))
    samples: dict[str, list[float]] = {"direct": [], "inline": [], "queued": []}

    def timed(call: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        return (time.perf_counter() - t0) / calls * 1e6

    with Server(ROOT / "models", model_control_mode="explicit", load_models=["identity"]) as server:
        dataplane = server.dataplane
        for _ in range(runs):
            samples["direct"].append(timed(lambda: backend.execute([item], Timing())))
            # A frontend's budget: the cheap model runs in this thread; with none, on its worker.
            samples["inline"].append(
                timed(lambda: dataplane.run_here(_request(x), scheduler_inline.FRONTEND).result())
            )
            samples["queued"].append(timed(lambda: dataplane.submit(_request(x)).result()))
    backend.close()
    result = {name: statistics.median(values) for name, values in samples.items()}
    for path in ("inline", "queued"):
        result[f"{path}_added"] = statistics.median(
            s - d for s, d in zip(samples[path], samples["direct"], strict=True)
        )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    if not CNN.exists():
        print("run models/make_models.py first (./run serve or ./run test do)", file=sys.stderr)
        return 1
    print(f"# Batching benchmark: {os.cpu_count()} cores, onnxruntime {ort.__version__}\n")
    b1_tput, b1_ms = direct_loop(args.seconds / 2, 1)
    b8_tput, b8_ms = direct_loop(args.seconds / 2, 8)
    ratio = b8_ms / (8 * b1_ms)
    print("## The model: models/cnn, direct onnxruntime, 1 thread\n")
    print("| batch | median ms per call | rows/s |")
    print("|---|---|---|")
    print(f"| 1 | {b1_ms:.3f} | {b1_tput:.0f} |")
    print(f"| 8 | {b8_ms:.3f} | {b8_tput:.0f} |")
    print(f"\nbatch-8 call / (8 x batch-1 call) = **{ratio:.2f}**\n")
    print(
        f"## {args.clients} concurrent clients, batch-1 requests, in-process API, {args.seconds:.0f} s each\n"
    )
    print("| batching | instances | req/s | x direct loop | p50 ms | p99 ms | mean batch |")
    print("|---|---|---|---|---|---|---|")
    results = {}
    with tempfile.TemporaryDirectory(dir=ROOT / "bench") as tmp:
        for count in (1, 2):
            for batching in (False, True):
                repo = make_repo(Path(tmp), count=count, batching=batching)
                tput, p50, p99, mean_batch = serve_run(repo, args.clients, args.seconds)
                results[(count, batching)] = (tput, p99)
                print(
                    f"| {'on' if batching else 'off'} | {count} | {tput:.0f} | {tput / b1_tput:.2f} | "
                    f"{p50:.2f} | {p99:.2f} | {mean_batch:.2f} |"
                )
    gain = results[(1, True)][0] / results[(1, False)][0]
    bound = DELAY_US / 1000 + 2 * b8_ms
    print(f"\nbatching on / off, 1 instance: **{gain:.2f}x** (target >= 1.5x)")
    print(
        f"p99 with batching, 1 instance: {results[(1, True)][1]:.2f} ms; bound max_queue_delay + 2 batch-8 "
        f"runs = {bound:.2f} ms"
    )
    cost = overhead()
    print("\n## Scheduler overhead, identity model (16 floats), median of 5 runs x 3000 calls\n")
    print("| path | µs per call | added by the server |")
    print("|---|---|---|")
    print(f"| backend.execute directly | {cost['direct']:.1f} | |")
    print(
        f"| DataPlane.run_here(FRONTEND): run in the caller's thread | {cost['inline']:.1f} | "
        f"**{cost['inline_added']:.1f}** |"
    )
    print(
        f"| DataPlane.submit: through the queue and a worker thread | {cost['queued']:.1f} | "
        f"**{cost['queued_added']:.1f}** (target < 50) |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
