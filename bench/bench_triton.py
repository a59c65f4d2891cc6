"""Triton Inference Server and edge-server side by side, one run, the same models and the same client.

    pip install -e '.[bench]'                            # brings tritonserver (nvidia-pytriton)
    .venv/bin/python bench/bench_triton.py --quick       # ~1 minute
    .venv/bin/python bench/bench_triton.py               # the numbers in docs/benchmarks.md

Builds one Triton model repository in a temporary directory (bench/triton_models.py: a tiny FP32 [1, 16]
model, a ~1.4 GFLOP CNN at 224x224, a 1080p frame reduced to its channel means, each as a python_backend
``model.py`` running the ONNX file with ONNX Runtime, and as an ``onnxruntime`` backend model), starts
``tritonserver`` on the ``model.py`` models (CPU only) and an edge-server daemon on the whole repository,
unchanged.  Then, interleaved round by round so that a busy machine weighs on every case alike:

* per-request latency (median over every call) of each workload over KServe HTTP (binary tensors) and
  gRPC with ``tritonclient`` on both servers, through system shared memory (``tritonclient`` HTTP, input
  and output in registered regions) on both, and over edge-server's IPC, inline and through shared memory;
* throughput with 8 clients at once (gRPC on both; IPC on edge-server), median over rounds, of the CNN
  (its compute shares the 2 cores with the servers) and of an accelerator stand-in (the CNN's input and
  output, 4 ms off the CPU per request: the servers have the CPU to themselves, as beside a TensorRT
  engine on a Jetson's GPU or DLA).

The same ``tritonclient`` calls go to both servers, so the client's cost is the same on both sides.
When tritonserver is missing or cannot start, the reason is printed and edge-server is measured alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.triton_models import (  # noqa: E402
    ACCEL,
    ACCEL_MS,
    WORKLOADS,
    Workload,
    build_repository,
    cnn_flops,
    python_models,
)
from bench.triton_models import sample_inputs as make_inputs  # noqa: E402
from bench.triton_server import Tritonserver, TritonUnavailable, find_tritonserver  # noqa: E402
from edge_server.client import Client  # noqa: E402
from tests.daemon import Daemon, free_port, kserve_flags  # noqa: E402

COLUMNS = ("triton model.py", "edge model.py", "edge onnxruntime")
TRANSPORTS = {
    "tiny": ("HTTP", "gRPC", "HTTP + system shm", "IPC", "IPC + shm"),
    "cnn": ("HTTP", "gRPC", "IPC"),
    "frame": ("HTTP", "gRPC", "HTTP + system shm", "IPC", "IPC + shm"),
}
DTYPES = {"TYPE_FP32": "FP32", "TYPE_UINT8": "UINT8"}
DIRECT = "direct ONNX Runtime call"


@dataclass
class Endpoint:
    """One server: its KServe ports, its IPC address (edge-server only) and which columns it serves."""

    label: str
    http_port: int
    grpc_port: int
    ipc_address: str | None
    columns: dict[str, str]  # column -> model suffix
    clients: list[Any] = field(default_factory=list)


def reference_outputs(repo: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What a direct ONNX Runtime call gives, to check every path's answer before timing it."""
    import onnxruntime as ort

    out = {}
    for w in WORKLOADS:
        session = ort.InferenceSession(str(repo / f"{w.name}_py" / "1" / "model.onnx"))
        out[w.name] = session.run(None, {session.get_inputs()[0].name: inputs[w.name]})[0]
    return out


class CaseBuilder:
    """(endpoint, column, workload, transport) -> a zero-argument call, and how to read its answer."""

    def __init__(self, stack: ExitStack, inputs: dict[str, np.ndarray]) -> None:
        self.stack, self.inputs = stack, inputs
        self._http: dict[str, Any] = {}
        self._grpc: dict[str, Any] = {}
        self._ipc: dict[str, Client] = {}

    def http(self, ep: Endpoint) -> Any:
        import tritonclient.http as httpclient

        if ep.label not in self._http:
            client = httpclient.InferenceServerClient(f"127.0.0.1:{ep.http_port}")
            self.stack.callback(client.close)
            self._http[ep.label] = client
        return self._http[ep.label]

    def grpc(self, ep: Endpoint) -> Any:
        import tritonclient.grpc as grpcclient

        if ep.label not in self._grpc:
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{ep.grpc_port}")
            self.stack.callback(client.close)
            self._grpc[ep.label] = client
        return self._grpc[ep.label]

    def ipc(self, ep: Endpoint) -> Client:
        assert ep.ipc_address is not None
        if ep.label not in self._ipc:
            client = Client(ep.ipc_address, timeout=120)
            self.stack.callback(client.close)
            self._ipc[ep.label] = client
        return self._ipc[ep.label]

    def build(
        self, ep: Endpoint, model: str, w: Workload, transport: str
    ) -> tuple[Callable[[], Any], Callable[[Any], np.ndarray]]:
        import tritonclient.grpc as grpcclient
        import tritonclient.http as httpclient

        x = self.inputs[w.name]
        datatype = DTYPES[w.in_type]
        if transport == "HTTP":
            hc = self.http(ep)
            hin = httpclient.InferInput(w.input, list(x.shape), datatype)
            hin.set_data_from_numpy(x, binary_data=True)
            hout = [httpclient.InferRequestedOutput(w.output, binary_data=True)]
            return lambda: hc.infer(model, [hin], outputs=hout), lambda r: r.as_numpy(w.output)
        if transport == "gRPC":
            gc = self.grpc(ep)
            gin = grpcclient.InferInput(w.input, list(x.shape), datatype)
            gin.set_data_from_numpy(x)
            return lambda: gc.infer(model, [gin]), lambda r: r.as_numpy(w.output)
        if transport == "HTTP + system shm":
            return self._system_shm(ep, model, w)
        client = self.ipc(ep)
        if transport == "IPC":
            return lambda: client.infer(model, {w.input: x}), lambda r: r[w.output]
        if transport == "IPC + shm":
            ring = client.create_shm_ring(2, x.nbytes)
            self.stack.callback(ring.close)
            slot = ring.next()
            slot.array(x.dtype, x.shape)[...] = x  # the frame already in the region, as a camera writes it
            ref = slot.tensor(x.dtype, x.shape)
            return lambda: client.infer(model, {w.input: ref}), lambda r: r[w.output]
        raise ValueError(transport)

    def _system_shm(
        self, ep: Endpoint, model: str, w: Workload
    ) -> tuple[Callable[[], Any], Callable[[Any], np.ndarray]]:
        import tritonclient.http as httpclient
        import tritonclient.utils.shared_memory as tshm

        x = self.inputs[w.name]
        hc = self.http(ep)
        out_bytes = 4 * (16 if w.name == "tiny" else 10 if w.name == "cnn" else 3)
        handles = {}
        for role, size in (("in", x.nbytes), ("out", out_bytes)):
            name = f"{ep.label}-{model}-{role}"
            key = f"/es-bench-{os.getpid()}-{name}"
            handle = tshm.create_shared_memory_region(name, key, size)
            self.stack.callback(tshm.destroy_shared_memory_region, handle)
            hc.register_system_shared_memory(name, key, size)
            self.stack.callback(hc.unregister_system_shared_memory, name)
            handles[role] = (name, handle, size)
        tshm.set_shared_memory_region(handles["in"][1], [x])
        hin = httpclient.InferInput(w.input, list(x.shape), DTYPES[w.in_type])
        hin.set_shared_memory(handles["in"][0], x.nbytes)
        hout = httpclient.InferRequestedOutput(w.output, binary_data=True)
        hout.set_shared_memory(handles["out"][0], out_bytes)
        out_shape = [1, 16] if w.name == "tiny" else [1, 10] if w.name == "cnn" else [3]

        def fetch(_: Any) -> np.ndarray:
            return tshm.get_contents_as_numpy(handles["out"][1], np.float32, out_shape)

        return lambda: hc.infer(model, [hin], outputs=[hout]), fetch


def latency_cases(
    builder: CaseBuilder, endpoints: list[Endpoint], reference: dict[str, np.ndarray]
) -> dict[tuple[str, str, str], Callable[[], Any]]:
    """Every (workload, transport, column) that exists, each checked once against ONNX Runtime."""
    cases: dict[tuple[str, str, str], Callable[[], Any]] = {}
    for w in WORKLOADS:
        for transport in TRANSPORTS[w.name]:
            for ep in endpoints:
                if transport.startswith("IPC") and ep.ipc_address is None:
                    continue
                for column, suffix in ep.columns.items():
                    call, fetch = builder.build(ep, f"{w.name}_{suffix}", w, transport)
                    got = fetch(call())
                    if not np.allclose(got.reshape(-1), reference[w.name].reshape(-1), rtol=1e-3, atol=1e-3):
                        raise AssertionError(
                            f"{column} {w.name} over {transport}: {got} != {reference[w.name]}"
                        )
                    cases[(w.name, transport, column)] = call
    return cases


def direct_cases(repo: Path, inputs: dict[str, np.ndarray]) -> dict[tuple[str, str, str], Callable[[], Any]]:
    """The floor: the same ONNX file run by a default ONNX Runtime session in this process, no server."""
    import onnxruntime as ort

    cases: dict[tuple[str, str, str], Callable[[], Any]] = {}
    for w in WORKLOADS:
        session = ort.InferenceSession(str(repo / f"{w.name}_py" / "1" / "model.onnx"))
        feed = {session.get_inputs()[0].name: inputs[w.name]}
        cases[(w.name, DIRECT, DIRECT)] = lambda session=session, feed=feed: session.run(None, feed)
    return cases


#: Before each timed block: idle, then untimed calls of the block's own case (see measure_latency).
BLOCK_SETTLE_S = 0.2
BLOCK_UNTIMED_CALLS = 2


def measure_latency(
    cases: dict[tuple[str, str, str], Callable[[], Any]], counts: dict[str, int], rounds: int
) -> dict[tuple[str, str, str], float]:
    """Median microseconds per call; every case runs a block in every round, in turn."""
    samples: dict[tuple[str, str, str], list[float]] = {key: [] for key in cases}
    for key, call in cases.items():  # warm-up
        for _ in range(max(2, counts[key[0]] // 20)):
            call()
    for r in range(rounds):
        for key, call in cases.items():
            per_round = max(1, counts[key[0]] // rounds)
            # The other server's ONNX Runtime threads spin on for a while after its block, and on two
            # cores the next block's first calls would pay for it (a CNN call measured 2x for ~60 ms).
            time.sleep(BLOCK_SETTLE_S)
            for _ in range(BLOCK_UNTIMED_CALLS):
                call()
            for _ in range(per_round):
                t0 = time.perf_counter_ns()
                call()
                samples[key].append((time.perf_counter_ns() - t0) / 1000)
        print(f"latency round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    return {key: float(np.median(values)) for key, values in samples.items()}


def throughput(make_call: Callable[[], Callable[[], Any]], clients: int, seconds: float) -> float:
    """Inferences per second with ``clients`` threads, each with its own connection, calling in a loop."""
    calls = [make_call() for _ in range(clients)]
    for call in calls:
        call()
    stop = threading.Event()
    done = [0] * clients

    def loop(i: int) -> None:
        while not stop.is_set():
            calls[i]()
            done[i] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - start)


#: (model, transport, column) -> a factory of one client's call
Factories = dict[tuple[str, str, str], Callable[[], Callable[[], Any]]]
#: The throughput rows: the CNN (its compute on the CPU, beside the servers) and the accelerator stand-in
#: (its 4 ms off the CPU, which is left to the servers, as on a Jetson whose engine runs on the GPU or DLA).
CONCURRENT = {"cnn": "CNN 224", ACCEL: f"accelerator stand-in ({ACCEL_MS:g} ms off the CPU)"}


def concurrency_cases(
    endpoints: list[Endpoint], inputs: dict[str, np.ndarray], stack: ExitStack
) -> Factories:
    """(model, transport, column) -> a factory of one client's call (a new connection per client).

    The accelerator stand-in is a ``model.py`` only: the model.py columns serve it.  Each client's first
    call is checked (the stand-in answers its input's first value).
    """
    import tritonclient.grpc as grpcclient

    x = inputs["cnn"]
    want = np.full((1, 10), x.flat[0], np.float32)
    cases: Factories = {}

    def checked(call: Callable[[], np.ndarray], model: str) -> Callable[[], Any]:
        got = call()
        if model == ACCEL and not np.array_equal(got, want):
            raise AssertionError(f"{model} answered {got}, not {want}")
        return call

    def grpc_factory(port: int, model: str) -> Callable[[], Callable[[], Any]]:
        def make() -> Callable[[], Any]:
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
            stack.callback(client.close)
            gin = grpcclient.InferInput("input", list(x.shape), "FP32")
            gin.set_data_from_numpy(x)
            return checked(lambda: client.infer(model, [gin]).as_numpy("logits"), model)

        return make

    def ipc_factory(address: str, model: str) -> Callable[[], Callable[[], Any]]:
        def make() -> Callable[[], Any]:
            client = Client(address, timeout=120)
            stack.callback(client.close)
            return checked(lambda: client.infer(model, {"input": x})["logits"], model)

        return make

    for ep in endpoints:
        for column, suffix in ep.columns.items():
            for key in CONCURRENT:
                if key == ACCEL and suffix != "py":
                    continue
                model = ACCEL if key == ACCEL else f"cnn_{suffix}"
                cases[(key, "gRPC", column)] = grpc_factory(ep.grpc_port, model)
                if ep.ipc_address is not None:
                    cases[(key, "IPC", column)] = ipc_factory(ep.ipc_address, model)
    return cases


def measure_throughput(
    cases: Factories, clients: int, seconds: float, rounds: int
) -> dict[tuple[str, str, str], float]:
    results: dict[tuple[str, str, str], list[float]] = {key: [] for key in cases}
    for r in range(rounds):
        for key, factory in cases.items():
            results[key].append(throughput(factory, clients, seconds))
        print(f"throughput round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    return {key: statistics.median(values) for key, values in results.items()}


def ratio(theirs: float | None, ours: float | None, higher_is_better: bool = False) -> str:
    """How many times better edge-server is (>1: edge-server faster), or a dash."""
    if theirs is None or ours is None or not theirs or not ours:
        return "—"
    return f"{(ours / theirs if higher_is_better else theirs / ours):.2f}x"


def report(
    latency: dict[tuple[str, str, str], float],
    tput: dict[tuple[str, str, str], float],
    clients: int,
    triton_note: str,
) -> str:
    """One Markdown table; the last column compares the same model.py on the two servers."""

    def cell(value: float | None, digits: int = 0) -> str:
        return "—" if value is None else f"{value:,.{digits}f}"

    lines = [
        f"| workload | transport | {' | '.join(COLUMNS)} | edge-server model.py vs Triton |",
        "|---|---|---|---|---|---|",
    ]
    names = {
        "tiny": "tiny [1,16], µs",
        "cnn": f"CNN 224 ({cnn_flops() / 1e9:.2f} GFLOP), 1 stream, µs",
        "frame": "1080p frame -> means, µs",
    }
    for w in WORKLOADS:
        triton_best = min(
            (v for (name, _, col), v in latency.items() if name == w.name and col == COLUMNS[0]), default=None
        )
        for transport in TRANSPORTS[w.name]:
            values = [latency.get((w.name, transport, col)) for col in COLUMNS]
            if all(v is None for v in values):
                continue
            if transport.startswith("IPC"):
                versus = ratio(triton_best, values[1])
                versus = "—" if versus == "—" else f"{versus} (vs Triton's fastest)"
            else:
                versus = ratio(values[0], values[1])
            lines.append(
                f"| {names[w.name]} | {transport} | {' | '.join(cell(v) for v in values)} | {versus} |"
            )
    for key, label in CONCURRENT.items():
        triton_grpc = tput.get((key, "gRPC", COLUMNS[0]))
        for transport in ("gRPC", "IPC"):
            values = [tput.get((key, transport, col)) for col in COLUMNS]
            if all(v is None for v in values):
                continue
            versus = ratio(triton_grpc, values[1], higher_is_better=True)
            if transport == "IPC" and versus != "—":
                versus += " (vs Triton gRPC)"
            lines.append(
                f"| {label}, {clients} clients, inferences/s | {transport} | "
                f"{' | '.join(cell(v, 1) for v in values)} | {versus} |"
            )
    floor = ", ".join(
        f"{w.name} {latency[(w.name, DIRECT, DIRECT)]:,.0f} µs"
        for w in WORKLOADS
        if (w.name, DIRECT, DIRECT) in latency
    )
    return (
        "\n".join(lines) + f"\n\nFloor ({DIRECT} in the client, no server): {floor}\nTriton: {triton_note}\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="few calls, two rounds (~1 minute)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 4, quick 2)")
    parser.add_argument("--seconds", type=float, default=None, help="throughput window per case and round")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients on the CNN")
    parser.add_argument("--tritonserver", default=None, help="binary (default: nvidia-pytriton's, or PATH)")
    parser.add_argument("--no-triton", action="store_true", help="measure edge-server alone")
    parser.add_argument("--json", type=Path, default=None, help="also write the medians here")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 4)
    seconds = args.seconds or (1.5 if args.quick else 4.0)
    counts = {"tiny": 200, "cnn": 10, "frame": 8} if args.quick else {"tiny": 2000, "cnn": 80, "frame": 60}

    with tempfile.TemporaryDirectory(prefix="bench-triton-") as tmp, ExitStack() as stack:
        root = Path(tmp)
        repo = build_repository(root / "repo")
        inputs = make_inputs()
        reference = reference_outputs(repo, inputs)
        endpoints: list[Endpoint] = []
        triton_note = "measured (tritonserver from nvidia-pytriton, python_backend, CPU only)"
        try:
            if args.no_triton:
                raise TritonUnavailable("--no-triton given")
            binary = find_tritonserver(args.tritonserver)
            triton = Tritonserver(binary, repo, python_models(), root, free_port(), free_port())
            stack.callback(triton.stop)
            triton.start()
            triton_note += f"; binary {binary}"
            endpoints.append(Endpoint("triton", triton.http_port, triton.grpc_port, None, {COLUMNS[0]: "py"}))
        except TritonUnavailable as exc:
            triton_note = f"SKIPPED, {exc}"
            print(f"Triton skipped: {exc}\nmeasuring edge-server alone", file=sys.stderr, flush=True)
        http_port, grpc_port = free_port(), free_port()
        daemon = Daemon(
            repo, f"ipc://{root}/edge.sock", root / "daemon.log",
            *kserve_flags(http_port, grpc_port),
            "--allow-client-shm", "true", "--strict-readiness", "true",
        )  # fmt: skip
        stack.callback(daemon.stop)
        daemon.start(timeout=180)
        endpoints.append(
            Endpoint("edge", http_port, grpc_port, daemon.address, {COLUMNS[1]: "py", COLUMNS[2]: "onnx"})
        )
        builder = CaseBuilder(stack, inputs)
        cases = latency_cases(builder, endpoints, reference)
        cases.update(direct_cases(repo, inputs))
        latency = measure_latency(cases, counts, rounds)
        tput = measure_throughput(concurrency_cases(endpoints, inputs, stack), args.clients, seconds, rounds)

    mode = "quick" if args.quick else "full"
    print(
        f"\npython {sys.version.split()[0]}, {os.cpu_count()} cores, {mode} run, {rounds} rounds; "
        "interleaved; medians (latency: over every call; throughput: over rounds)\n"
    )
    print(report(latency, tput, args.clients, triton_note))
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "triton": triton_note,
                    "latency_us": {" | ".join(k): v for k, v in latency.items()},
                    "throughput_per_s": {" | ".join(k): v for k, v in tput.items()},
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
