"""edge-server against the floors it is measured by: one table, every case side by side in one run.

    .venv/bin/python bench/bench_baselines.py --quick      # ~2 minutes
    .venv/bin/python bench/bench_baselines.py --runs 3     # the numbers in the report

Starts, beside each other: a bare pyzmq ROUTER echo; a minimal hand-written zmq + ONNX Runtime server
(one thread, one ``InferenceSession`` per model with default ``SessionOptions``: what a team writes
when it has no server); the real daemon (IPC and HTTP) on a temporary repository of the models below;
and a second daemon serving only ``cnn``, with every setting at its default (the common single-model
box: its only model runs on the IPC thread, the scheduler's "alone" rule):

* ``tiny``: the [B,16] FP32 model of bench/triton_models.py (ONNX), and a Triton-style ``model.py``
  returning its input (thread isolation, the default);
* ``cnn``: bench/triton_models.py's ~1.4 GFLOP CNN at 224x224 with a dynamic batch axis, served with
  ONNX Runtime's default threads (what ``--onnxruntime-thread-policy auto`` gives a model alone on the
  box), with ``thread_policy: split`` (the CPU-saving setting ``auto`` picks once several models share
  the box), and with dynamic batching (max batch 8, 2 ms delay).

The first daemon runs with ``--onnxruntime-thread-policy default``: every model there gets the threads
it would have alone on the box (``--thread-policy auto`` shows the rule itself: the five models loaded
there share the box, so every one gets split threads, ``cnn`` included), but shares the daemon, so its
requests go through the model's worker thread.  The second daemon's ``cnn`` gets the same threads from
``auto`` and runs on the IPC thread.

Single-stream cases alternate in blocks within a round, each block after 100 ms of idle and a few
untimed requests of its own; the 8-client throughput cases (8 threads, each with its own connection)
alternate round by round.  Medians over rounds; ratios are of the medians.
Timing on a shared machine is noisy: compare within one table, not across tables.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_ipc import ECHO, per_request_us  # noqa: E402
from bench.bench_kserve import RawPost, kserve_binary, wait_http  # noqa: E402
from bench.triton_models import cnn_graph, tiny_graph  # noqa: E402
from edge_server.client import Client  # noqa: E402
from edge_server.examples.make_models import median_run_seconds  # noqa: E402
from tests.daemon import Daemon, free_port  # noqa: E402

CLIENTS = 8
SETTLE_S = 0.1  # idle before each timed block (see measure)

# One thread, default SessionOptions; request = [model name, raw little-endian FP32 bytes].
MINIMAL_SERVER = textwrap.dedent(
    """
    import sys, zmq, numpy as np, onnxruntime as ort
    shapes = {"tiny": (-1, 16), "cnn": (-1, 3, 224, 224)}
    sessions = {n: ort.InferenceSession(f"{sys.argv[2]}/{n}/1/model.onnx") for n in shapes}
    names = {n: s.get_inputs()[0].name for n, s in sessions.items()}
    ctx = zmq.Context(); sock = ctx.socket(zmq.ROUTER); sock.bind(sys.argv[1])
    print("ready", flush=True)
    while True:
        ident, name, data = sock.recv_multipart(copy=False)
        name = name.bytes.decode()
        if name == "quit":
            break
        x = np.frombuffer(data.buffer, np.float32).reshape(shapes[name])
        out = sessions[name].run(None, {names[name]: x})[0]
        sock.send_multipart([ident, out], copy=False)
    """
)

TINY_PY = textwrap.dedent(
    '''
    """Triton-style identity: OUTPUT = INPUT."""
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            return [
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUTPUT", pb_utils.get_input_tensor_by_name(r, "INPUT").as_numpy())]
                )
                for r in requests
            ]
    '''
)

TINY_CONFIG = """
name: "{name}"
backend: "{backend}"
max_batch_size: 8
input [ {{ name: "INPUT", data_type: TYPE_FP32, dims: [ 16 ] }} ]
output [ {{ name: "OUTPUT", data_type: TYPE_FP32, dims: [ 16 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
"""

CNN_CONFIG = """
name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "input", data_type: TYPE_FP32, dims: [ 3, 224, 224 ] }} ]
output [ {{ name: "logits", data_type: TYPE_FP32, dims: [ 10 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
{extra}
"""


def tiny_onnx(path: Path) -> None:
    """bench/triton_models.py's tiny model (docs/benchmarks.md's anchor): [B,16] FP32 MatMul + Add."""
    tiny_graph(path)


def cnn_onnx(path: Path) -> None:
    """bench/triton_models.py's ~1.4 GFLOP CNN at 224x224, with a dynamic batch axis for batching."""
    import onnx

    cnn_graph(path)
    model = onnx.load(str(path))
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.shape.dim[0].dim_param = "batch"
    onnx.save(model, str(path))


def alone_repository(root: Path, repo: Path) -> Path:
    """A repository of ``repo``'s ``cnn`` only (the same files, hard-linked: a model loads only files
    inside its own directory, so a symbolic link to another repository is refused)."""
    alone = root / "alone"
    (alone / "cnn" / "1").mkdir(parents=True)
    os.link(repo / "cnn" / "1" / "model.onnx", alone / "cnn" / "1" / "model.onnx")
    os.link(repo / "cnn" / "config.pbtxt", alone / "cnn" / "config.pbtxt")
    return alone


def repository(root: Path) -> Path:
    repo = root / "repo"
    tiny_onnx(repo / "tiny" / "1" / "model.onnx")
    (repo / "tiny" / "config.pbtxt").write_text(TINY_CONFIG.format(name="tiny", backend="onnxruntime"))
    (repo / "tiny_py" / "1").mkdir(parents=True)
    (repo / "tiny_py" / "1" / "model.py").write_text(TINY_PY)
    (repo / "tiny_py" / "config.pbtxt").write_text(TINY_CONFIG.format(name="tiny_py", backend="python"))
    cnn_onnx(repo / "cnn" / "1" / "model.onnx")
    extras = {
        "cnn": "",
        "cnn_split": 'parameters { key: "thread_policy" value: { string_value: "split" } }',
        "cnn_batch": "dynamic_batching { max_queue_delay_microseconds: 2000 }",
    }
    for name, extra in extras.items():
        if name != "cnn":
            (repo / name / "1").mkdir(parents=True)
            os.link(repo / "cnn" / "1" / "model.onnx", repo / name / "1" / "model.onnx")
        (repo / name / "config.pbtxt").write_text(CNN_CONFIG.format(name=name, extra=extra))
    return repo


class Raw:
    """A DEALER to the echo or the minimal server: send [name, bytes], wait for the answer."""

    def __init__(self, ctx: zmq.Context[Any], address: str, name: str, data: np.ndarray) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.RCVTIMEO, 120_000)  # a dead baseline process fails the run, not hangs it
        self.sock.connect(address)
        self.frames = [name.encode(), data]

    def __call__(self) -> Any:
        self.sock.send_multipart(self.frames, copy=False)
        return self.sock.recv_multipart(copy=False)

    def close(self) -> None:
        self.sock.close(0)


class KeptPost(RawPost):
    """RawPost that reconnects when the server closed the idle keep-alive connection (between rounds)."""

    def __call__(self) -> bytes:
        try:
            return super().__call__()
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            self.conn.close()
            return super().__call__()


def throughput(make: Callable[[], tuple[Callable[[], Any], Callable[[], None]]], seconds: float) -> float:
    """Inferences/s of CLIENTS threads, each with its own connection, calling for ``seconds``."""
    calls = [make() for _ in range(CLIENTS)]
    counts = [0] * CLIENTS
    start_gate = threading.Barrier(CLIENTS + 1)
    stop = threading.Event()

    def worker(i: int) -> None:
        call = calls[i][0]
        call()
        start_gate.wait()
        while not stop.is_set():
            call()
            counts[i] += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    start_gate.wait()
    begin = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - begin
    for _, close in calls:
        close()
    return sum(counts) / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="one round, few requests")
    parser.add_argument("--runs", type=int, default=3, help="rounds")
    parser.add_argument("--requests", type=int, default=2000, help="tiny requests per case and round")
    parser.add_argument("--cnn-requests", type=int, default=100, help="single-stream CNN requests per round")
    parser.add_argument("--seconds", type=float, default=6.0, help="per 8-client case and round")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--thread-policy",
        choices=["auto", "default", "split"],
        default="default",
        help="the daemon's --onnxruntime-thread-policy (auto: the models here share the box, so split)",
    )
    args = parser.parse_args()
    if args.quick:
        args.runs, args.requests, args.cnn_requests, args.seconds = 1, 400, 30, 2.0
    with tempfile.TemporaryDirectory(prefix="es-base-") as tmp:
        root = Path(tmp)
        repo = repository(root)
        http_port = free_port()
        daemon = Daemon(
            repo,
            f"ipc://{root}/d.sock",
            root / "daemon.log",
            "--allow-http",
            "true",
            "--http-port",
            str(http_port),
            "--onnxruntime-thread-policy",
            args.thread_policy,  # default: each model as if alone on the box; cnn_split says split itself
        )
        alone = Daemon(alone_repository(root, repo), f"ipc://{root}/alone.sock", root / "alone.log")
        procs = {
            "echo": [sys.executable, "-c", ECHO, f"ipc://{root}/echo.sock"],
            "minimal": [sys.executable, "-c", MINIMAL_SERVER, f"ipc://{root}/min.sock", str(repo)],
        }
        started = {}
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            for key, command in procs.items():
                # A session of its own: signals meant for the shell that started the benchmark stay there.
                started[key] = subprocess.Popen(command, stdout=subprocess.PIPE, start_new_session=True)
                out = started[key].stdout
                assert out is not None and out.readline().strip() == b"ready"
            daemon.start(timeout=120)
            alone.start(timeout=120)
            wait_http(http_port, "/v2/health/ready")
            results = measure(ctx, root, repo, daemon.address, alone.address, http_port, args)
        finally:
            for key in started:
                if started[key].poll() is not None:
                    print(f"{key} baseline exited early: {started[key].returncode}", file=sys.stderr)
                quit_sock = ctx.socket(zmq.DEALER)
                quit_sock.connect(procs[key][3])
                quit_sock.send_multipart([b"quit", b"quit"] if key == "minimal" else [b"quit"])
                quit_sock.close(1000)
                try:
                    started[key].wait(10)
                except subprocess.TimeoutExpired:
                    started[key].kill()
            ctx.destroy(linger=0)  # also the sockets of a run that raised
            daemon.stop()
            alone.stop()
    report(results, args)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def measure(
    ctx: zmq.Context[Any],
    root: Path,
    repo: Path,
    address: str,
    alone_address: str,
    http_port: int,
    args: argparse.Namespace,
) -> dict[str, list[float]]:
    tiny = np.arange(16, dtype=np.float32).reshape(1, 16)
    image = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
    echo_addr, min_addr = f"ipc://{root}/echo.sock", f"ipc://{root}/min.sock"
    client = Client(address, timeout=120)
    alone = Client(alone_address, timeout=120)
    body, headers = kserve_binary("INPUT", tiny, "FP32")
    raw = {
        "echo": Raw(ctx, echo_addr, "tiny", tiny),
        "min_tiny": Raw(ctx, min_addr, "tiny", tiny),
        "min_cnn": Raw(ctx, min_addr, "cnn", image),
    }
    single: dict[str, Callable[[], Any]] = {
        "echo": raw["echo"],
        "min_tiny": raw["min_tiny"],
        "es_tiny": lambda: client.infer("tiny", {"INPUT": tiny}),
        "es_tiny_py": lambda: client.infer("tiny_py", {"INPUT": tiny}),
        "http_tiny": KeptPost(http_port, "/v2/models/tiny/infer", body, headers),
        "min_cnn": raw["min_cnn"],
        "es_cnn_alone": lambda: alone.infer("cnn", {"input": image}),
        "es_cnn": lambda: client.infer("cnn", {"input": image}),
        "es_cnn_split": lambda: client.infer("cnn_split", {"input": image}),
    }
    cnn_cases = {"min_cnn", "es_cnn_alone", "es_cnn", "es_cnn_split"}

    def raw_maker() -> tuple[Callable[[], Any], Callable[[], None]]:
        r = Raw(ctx, min_addr, "cnn", image)
        return r, r.close

    def es_maker(model: str, at: str = address) -> Callable[[], tuple[Callable[[], Any], Callable[[], None]]]:
        def make() -> tuple[Callable[[], Any], Callable[[], None]]:
            c = Client(at, timeout=120)
            return (lambda: c.infer(model, {"input": image})), c.close

        return make

    multi = {
        "min_cnn_x8": raw_maker,
        "es_cnn_alone_x8": es_maker("cnn", alone_address),
        "es_cnn_x8": es_maker("cnn"),
        "es_cnn_batch_x8": es_maker("cnn_batch"),
        "es_cnn_split_x8": es_maker("cnn_split"),
    }
    for name, call in single.items():  # warm-up
        per_request_us(call, 5 if name in cnn_cases else 100)
    results: dict[str, list[float]] = {name: [] for name in [*single, *multi, "ort_row_1", "ort_row_8"]}
    # The bench's own session (ONNX Runtime's defaults, as the minimal server's): its cost per row.
    ort_cnn = ort.InferenceSession(str(repo / "cnn" / "1" / "model.onnx"))
    blocks = 5
    for run in range(args.runs):
        spent = dict.fromkeys(single, 0.0)
        done = dict.fromkeys(single, 0)
        for _ in range(blocks):
            for name, call in single.items():
                count = max((args.cnn_requests if name in cnn_cases else args.requests) // blocks, 1)
                # Each block starts from a settled machine.  Right after a server whose ONNX Runtime
                # workers were still spinning (they do after every run), the next case's CNN ran at
                # half speed for tens of milliseconds (its two intra-op threads on one core, as far as
                # we can tell, until the kernel spread them): one request in ten took twice as long,
                # a tax on whichever case came next, not a cost of it.  Then a few untimed requests.
                time.sleep(SETTLE_S)
                per_request_us(call, 3 if name in cnn_cases else 50)
                spent[name] += per_request_us(call, count) * count
                done[name] += count
        for name in single:
            results[name].append(spent[name] / done[name])
        order = list(multi) if run % 2 == 0 else list(reversed(multi))
        for name in order:
            results[name].append(throughput(multi[name], args.seconds))
        for rows, seconds in batch_costs(ort_cnn, image, budget=1.0 if args.quick else 2.0).items():
            results[f"ort_row_{rows}"].append(seconds * 1e6)
        print(f"round {run + 1}/{args.runs} done", file=sys.stderr)
    # How the batches of the 8-client batching case formed (only that case calls cnn_batch).
    (stats,) = client.statistics("cnn_batch")
    counts = {b["batch_size"]: int(b["compute_infer"]["count"]) for b in stats["batch_stats"]}
    results["cnn_batch sizes"] = [float(counts.get(size, 0)) for size in range(1, 9)]
    client.close()
    alone.close()
    for r in raw.values():
        r.close()
    return results


def batch_costs(session: Any, image: np.ndarray, budget: float) -> dict[int, float]:
    """Seconds per row of ONNX Runtime alone (default session) at batch 1 and 8, after 100 ms idle.

    The most a batching server can reach against an unbatched one is the batch-1 row's cost over the
    batch-8 row's: on this CPU a batch of 8 costs more per row, so 8 clients with batching cannot
    beat 8 without it by batching, only by noise.
    """
    name = session.get_inputs()[0].name
    costs = {}
    for rows in (1, 8):
        time.sleep(SETTLE_S)
        feed = {name: np.repeat(image, rows, axis=0)}
        costs[rows] = median_run_seconds(session, feed, budget / 2) / rows
    return costs


def report(results: dict[str, list[float]], args: argparse.Namespace) -> None:
    sizes = results.get("cnn_batch sizes", [])
    m = {name: statistics.median(values) for name, values in results.items() if name != "cnn_batch sizes"}
    rows: list[tuple[str, str, str, str]] = [
        ("bare pyzmq echo, tiny request", f"{m['echo']:.0f} us", "", ""),
        (
            "minimal zmq+ORT server, tiny",
            f"{m['min_tiny']:.0f} us",
            f"{m['min_tiny'] / m['echo']:.2f}x echo",
            "",
        ),
        (
            "edge-server IPC, tiny (ONNX)",
            f"{m['es_tiny']:.0f} us",
            f"{m['es_tiny'] / m['min_tiny']:.2f}x minimal",
            "",
        ),
        (
            "edge-server HTTP (KServe binary, http.client), tiny",
            f"{m['http_tiny']:.0f} us",
            f"{m['http_tiny'] / m['es_tiny']:.2f}x IPC",
            _target(m["http_tiny"] >= 5 * m["es_tiny"], "IPC 5x faster"),
        ),
        (
            "edge-server IPC, tiny as model.py (thread)",
            f"{m['es_tiny_py']:.0f} us",
            f"{m['es_tiny_py'] / m['es_tiny']:.2f}x ONNX",
            _target(m["es_tiny_py"] <= 1.3 * m["es_tiny"], "<= 1.3x"),
        ),
        ("minimal zmq+ORT server, CNN 224", f"{m['min_cnn'] / 1000:.2f} ms", "", ""),
        (
            "edge-server IPC, CNN 224, the daemon's only model (all defaults)",
            f"{m['es_cnn_alone'] / 1000:.2f} ms",
            f"{m['es_cnn_alone'] / m['min_cnn']:.2f}x minimal",
            _target(m["es_cnn_alone"] <= m["min_cnn"], "<= 1x"),
        ),
        (
            f"edge-server IPC, CNN 224 beside 4 models (--onnxruntime-thread-policy {args.thread_policy})",
            f"{m['es_cnn'] / 1000:.2f} ms",
            f"{m['es_cnn'] / m['min_cnn']:.2f}x minimal",
            "",
        ),
        (
            "edge-server IPC, CNN 224 (thread_policy split)",
            f"{m['es_cnn_split'] / 1000:.2f} ms",
            f"{m['es_cnn_split'] / m['min_cnn']:.2f}x minimal",
            "",
        ),
        (f"minimal zmq+ORT server, CNN 224, {CLIENTS} clients", f"{m['min_cnn_x8']:.1f} inf/s", "", ""),
    ]
    ceiling = m["ort_row_1"] / m["ort_row_8"]
    rows.append(
        (
            "ONNX Runtime alone, CNN 224: a batch-1 row's cost over a batch-8 row's (batching's ceiling)",
            f"{m['ort_row_1']:.0f} / {m['ort_row_8']:.0f} us",
            f"{ceiling:.2f}x",
            "",
        )
    )
    for name, label in (
        ("es_cnn_alone_x8", "no batching, the daemon's only model"),
        ("es_cnn_x8", "no batching, beside 4 models"),
        ("es_cnn_batch_x8", "dynamic batching"),
        ("es_cnn_split_x8", "no batching, split"),
    ):
        ratio = m[name] / m["min_cnn_x8"]
        target = _target(ratio >= 0.95, ">= 0.95x") if "split" not in name else ""
        if "batch" in name:
            target += f" ({ratio / ceiling:.2f}x of batching's ceiling)"
        rows.append(
            (
                f"edge-server IPC, CNN 224, {CLIENTS} clients, {label}",
                f"{m[name]:.1f} inf/s",
                f"{ratio:.2f}x minimal",
                target,
            )
        )
    print(
        f"\nBaselines: medians of {args.runs} round(s), {args.requests} tiny / {args.cnn_requests} CNN "
        f"requests per single-stream case, {args.seconds:g} s per {CLIENTS}-client case\n"
    )
    print("| case | median | ratio | target |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if sizes and sum(sizes):
        mean = sum((i + 1) * n for i, n in enumerate(sizes)) / sum(sizes)
        shown = ", ".join(f"{i + 1}: {int(n)}" for i, n in enumerate(sizes) if n)
        print(f"\ndynamic batching, {CLIENTS} clients: batches by size {{{shown}}}, mean {mean:.2f}")


def _target(met: bool, what: str) -> str:
    return f"{what}: {'met' if met else 'NOT met'}"


if __name__ == "__main__":
    sys.exit(main())
