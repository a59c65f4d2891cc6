"""One table: the same models over IPC, KServe HTTP, KServe gRPC and a plain FastAPI server, side by side.

    .venv/bin/python bench/bench_kserve.py --quick        # (or --short) 2 rounds, few requests: ~1 minute
    .venv/bin/python bench/bench_kserve.py --rounds 5     # the numbers in docs/benchmarks.md

Starts the real daemon (IPC, HTTP, gRPC, client shared memory on) on a temporary repository (``identity``
and ``frame``, see bench_ipc.py) and, beside it, the baseline teams write when they have no server: a
FastAPI app under uvicorn that runs the same ONNX files with ONNX Runtime, tensors as a raw binary body
with the shape in a header (``pip install -e '.[bench]'``).  Then, per request:

* ``tiny``: identity, 16 x FP32, one request at a time: IPC ``Client``; tritonclient HTTP (binary
  extension) and gRPC; a bare ``http.client`` POST of the same KServe binary body to our HTTP and of the
  raw body to FastAPI (the same client on both, so the servers are compared, not the client libraries);
* ``frame``: a 1080x1920x3 UINT8 frame inline over each, and through system shared memory over IPC,
  HTTP and gRPC (the frame already in the region, as a camera writes it).

Every request is timed on its own.  A round runs each group's cases in interleaved blocks (the order
rotating from block to block) so that noise on the machine falls on all of them alike, and takes each
case's median request; the table shows the median of those round medians, their range, and ratios:
each case against IPC (``x IPC``) and the FastAPI baseline against it (``FastAPI / case``, above 1:
faster than FastAPI), the FastAPI server measured with the same bare client as ours.
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_ipc import repository  # noqa: E402
from edge_server.client import Client  # noqa: E402
from tests.daemon import Daemon, free_port, kserve_flags  # noqa: E402

FASTAPI_APP = textwrap.dedent(
    """
    import sys
    import numpy as np
    import onnxruntime as ort
    import uvicorn
    from fastapi import FastAPI, Request, Response

    repo, port = sys.argv[1], int(sys.argv[2])
    sessions = {
        name: ort.InferenceSession(f"{repo}/{name}/1/model.onnx", providers=["CPUExecutionProvider"])
        for name in ("identity", "frame")
    }
    app = FastAPI()

    @app.post("/infer/{model}")
    async def infer(model: str, request: Request) -> Response:
        session = sessions[model]
        shape = [int(d) for d in request.headers["x-shape"].split(",")]
        data = np.frombuffer(await request.body(), dtype=request.headers["x-dtype"]).reshape(shape)
        out = session.run(None, {session.get_inputs()[0].name: data})[0]
        return Response(out.tobytes(), media_type="application/octet-stream",
                        headers={"x-shape": ",".join(map(str, out.shape))})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    """
)


def wait_http(port: int, path: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", path)
            conn.getresponse().read()
            conn.close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing answered on port {port}")


class RawPost:
    """One keep-alive connection; POST a prebuilt body, read the whole answer."""

    def __init__(self, port: int, path: str, body: bytes, headers: dict[str, str]) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port)
        self.path, self.body, self.headers = path, body, headers

    def __call__(self) -> bytes:
        self.conn.request("POST", self.path, self.body, self.headers)
        response = self.conn.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"{self.path}: {response.status} {data[:200]!r}")
        return data


def kserve_binary(name: str, array: np.ndarray, datatype: str) -> tuple[bytes, dict[str, str]]:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "shape": list(array.shape),
                    "datatype": datatype,
                    "parameters": {"binary_data_size": array.nbytes},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    return header + array.tobytes(), {"Inference-Header-Content-Length": str(len(header))}


def cases(
    daemon: Daemon, http_port: int, grpc_port: int, fastapi_port: int, stack: list[Any]
) -> dict[str, Any]:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    import tritonclient.utils.shared_memory as tshm

    small = np.arange(16, dtype=np.float32)
    frame = np.random.default_rng(0).integers(0, 255, (1080, 1920, 3), dtype=np.uint8)

    ipc = Client(daemon.address)
    stack.append(ipc.close)
    ring = ipc.create_shm_ring(2, frame.nbytes)
    stack.append(ring.close)
    slot = ring.next()
    slot.array(np.uint8, frame.shape)[...] = frame
    ipc_frame_ref = slot.tensor(np.uint8, frame.shape)

    hc = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
    gc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    stack.extend([hc.close, gc.close])
    key = f"/edge-bench-{os.getpid()}"
    handle = tshm.create_shared_memory_region("frame", key, frame.nbytes)
    stack.append(lambda: tshm.destroy_shared_memory_region(handle))
    tshm.set_shared_memory_region(handle, [frame])
    hc.register_system_shared_memory("frame", key, frame.nbytes)
    stack.append(hc.unregister_system_shared_memory)

    def http_in(name: str, array: np.ndarray, datatype: str) -> Any:
        t = httpclient.InferInput(name, list(array.shape), datatype)
        t.set_data_from_numpy(array, binary_data=True)
        return t

    def grpc_in(name: str, array: np.ndarray, datatype: str) -> Any:
        t = grpcclient.InferInput(name, list(array.shape), datatype)
        t.set_data_from_numpy(array)
        return t

    http_shm = httpclient.InferInput("frame", list(frame.shape), "UINT8")
    http_shm.set_shared_memory("frame", frame.nbytes)
    grpc_shm = grpcclient.InferInput("frame", list(frame.shape), "UINT8")
    grpc_shm.set_shared_memory("frame", frame.nbytes)
    http_small, http_frame = http_in("INPUT0", small, "FP32"), http_in("frame", frame, "UINT8")
    grpc_small, grpc_frame = grpc_in("INPUT0", small, "FP32"), grpc_in("frame", frame, "UINT8")
    http_out = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)]

    body, headers = kserve_binary("INPUT0", small, "FP32")
    raw_ours = RawPost(http_port, "/v2/models/identity/infer", body, headers)
    raw_fastapi = RawPost(
        fastapi_port, "/infer/identity", small.tobytes(), {"x-shape": "16", "x-dtype": "float32"}
    )
    frame_body, frame_headers = kserve_binary("frame", frame, "UINT8")
    raw_ours_frame = RawPost(http_port, "/v2/models/frame/infer", frame_body, frame_headers)
    raw_fastapi_frame = RawPost(
        fastapi_port, "/infer/frame", frame.tobytes(), {"x-shape": "1080,1920,3", "x-dtype": "uint8"}
    )
    return {
        "tiny": {
            "ipc Client": lambda: ipc.infer("identity", {"INPUT0": small}),
            "http tritonclient": lambda: hc.infer("identity", [http_small], outputs=http_out),
            "grpc tritonclient": lambda: gc.infer("identity", [grpc_small]),
            "http http.client (ours)": raw_ours,
            "http http.client (FastAPI+ORT)": raw_fastapi,
        },
        "frame": {
            "ipc inline": lambda: ipc.infer("frame", {"frame": frame}),
            "ipc shm": lambda: ipc.infer("frame", {"frame": ipc_frame_ref}),
            "http tritonclient binary": lambda: hc.infer("frame", [http_frame]),
            "http tritonclient shm": lambda: hc.infer("frame", [http_shm]),
            "grpc tritonclient raw": lambda: gc.infer("frame", [grpc_frame]),
            "grpc tritonclient shm": lambda: gc.infer("frame", [grpc_shm]),
            "http http.client (ours)": raw_ours_frame,
            "http http.client (FastAPI+ORT)": raw_fastapi_frame,
        },
    }


def timed_us(call: Callable[[], Any], count: int) -> list[float]:
    """Each request's own time, in microseconds."""
    clock = time.perf_counter_ns
    times = []
    for _ in range(count):
        start = clock()
        call()
        times.append((clock() - start) / 1000)
    return times


def measure(
    table: dict[str, dict[str, Callable[[], Any]]], args: argparse.Namespace
) -> dict[str, list[float]]:
    """Each case's median request per round, over interleaved rounds."""
    counts = {"tiny": args.requests, "frame": args.frames}
    results: dict[str, list[float]] = {}
    for group, group_cases in table.items():
        for name, call in group_cases.items():
            timed_us(call, max(counts[group] // 10, 3))  # warm-up
            results[f"{group}: {name}"] = []
    blocks = 5
    for round_ in range(args.rounds):
        for group, group_cases in table.items():
            names = list(group_cases)
            samples: dict[str, list[float]] = {name: [] for name in names}
            count = max(counts[group] // blocks, 1)
            for block in range(blocks):
                shift = (block + round_) % len(names)
                for name in names[shift:] + names[:shift]:
                    samples[name].extend(timed_us(group_cases[name], count))
            for name in names:
                results[f"{group}: {name}"].append(statistics.median(samples[name]))
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", "--short", action="store_true", dest="quick", help="2 rounds, few requests (~1 minute)"
    )
    parser.add_argument("--rounds", "--runs", type=int, default=5, dest="rounds", help="interleaved rounds")
    parser.add_argument("--requests", type=int, default=2000, help="tiny requests per case and round")
    parser.add_argument("--frames", type=int, default=100, help="frames per case and round")
    parser.add_argument("--json", type=Path, default=None, help="each case's round medians, as JSON")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests, args.frames = 2, 500, 20
    missing = [m for m in ("fastapi", "uvicorn", "tritonclient") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"bench_kserve: needs {', '.join(missing)}: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        repo = repository(root)
        http_port, grpc_port, fastapi_port = free_port(), free_port(), free_port()
        daemon = Daemon(
            repo,
            f"ipc://{root}/bench.sock",
            root / "daemon.log",
            *kserve_flags(http_port, grpc_port),
            "--allow-client-shm",
            "true",
        )
        (root / "fastapi_app.py").write_text(FASTAPI_APP)
        fastapi = subprocess.Popen(
            [sys.executable, str(root / "fastapi_app.py"), str(repo), str(fastapi_port)]
        )
        stack: list[Callable[[], Any]] = []
        try:
            daemon.start()
            wait_http(fastapi_port, "/docs")
            results = measure(cases(daemon, http_port, grpc_port, fastapi_port, stack), args)
        finally:
            for undo in reversed(stack):
                try:
                    undo()
                except Exception as exc:  # noqa: BLE001 - clean up what can be cleaned up
                    print(f"cleanup: {exc}", file=sys.stderr)
            fastapi.terminate()
            fastapi.wait()
            daemon.stop()
    report(results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


BASES = {  # group -> (the IPC case, the FastAPI case) the ratios are taken against
    "tiny": ("tiny: ipc Client", "tiny: http http.client (FastAPI+ORT)"),
    "frame": ("frame: ipc inline", "frame: http http.client (FastAPI+ORT)"),
}


def report(results: dict[str, list[float]]) -> None:
    rounds = len(next(iter(results.values())))
    medians = {name: statistics.median(values) for name, values in results.items()}
    print(
        f"\nKServe benchmark: per-request latency, median over {rounds} interleaved rounds of each "
        "round's median request (range: the rounds' medians)\n"
    )
    print("| case | median us | range us | x IPC | FastAPI / case |")
    print("|---|---|---|---|---|")
    for name, value in medians.items():
        ipc_case, fastapi_case = BASES[name.split(":", 1)[0]]
        low, high = min(results[name]), max(results[name])
        print(
            f"| {name} | {value:.1f} | {low:.0f}-{high:.0f} | {value / medians[ipc_case]:.2f} | "
            f"{medians[fastapi_case] / value:.2f} |"
        )
    ours, theirs = medians["tiny: http http.client (ours)"], medians["tiny: http http.client (FastAPI+ORT)"]
    ipc, http, grpc = (
        medians[f"tiny: {c}"] for c in ("ipc Client", "http tritonclient", "grpc tritonclient")
    )
    print(
        f"\ntiny, same bare client: our HTTP {ours:.0f} us vs FastAPI {theirs:.0f} us ({theirs / ours:.2f}x)"
    )
    print(f"tiny: IPC {ipc:.0f} us; tritonclient HTTP {http / ipc:.1f}x and gRPC {grpc / ipc:.1f}x IPC")
    print(f"tiny: IPC vs our HTTP, same bare http.client: {ours / ipc:.1f}x")


if __name__ == "__main__":
    sys.exit(main())
