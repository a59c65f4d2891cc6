"""Before/after for the KServe frontends: two daemons, two checkouts, the same tritonclient calls, one run.

    git worktree add /tmp/before <commit>
    .venv/bin/python bench/bench_kserve_ab.py /tmp/before --quick     # ~1 minute
    .venv/bin/python bench/bench_kserve_ab.py /tmp/before              # the numbers in a report

Starts one daemon from the checkout given (``python -m edge_server`` with that checkout as its working
directory) and one from this checkout, on the same repository (bench/triton_models.py's ``tiny_py``,
``tiny_onnx`` and ``frame_py``, and ``frametx``: the tests' frame model, which reads only a frame's shape
and its first and last bytes, so that its row is the transport alone).  Every case runs in blocks, in a
shuffled order per block, so that a busy machine and whatever ran just before weigh on both sides alike;
medians over every call, and for each case the daemon's CPU and minor page faults per call (from
``/proc/PID/stat`` over the timed calls: what a frame's buffers cost when glibc hands out new pages).
IPC (``edge_server.client.Client``) runs beside HTTP and gRPC.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tests.daemon as test_daemon  # noqa: E402
from bench.bench_kserve_cost import process_cpu  # noqa: E402
from bench.triton_models import build_repository, sample_inputs  # noqa: E402
from edge_server.client import Client  # noqa: E402

TRANSPORTS = ("HTTP", "gRPC", "IPC")

TENSORS = {"tiny": ("INPUT", "OUTPUT", "FP32"), "frame": ("frame", "means", "UINT8")}
TENSORS["frametx"] = ("frame", "shape", "UINT8")


def main(argv: list[str] | None = None) -> int:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("before", type=Path, help="the checkout to compare against (a git worktree)")
    parser.add_argument("--quick", action="store_true", help="four blocks, fewer calls")
    parser.add_argument("--blocks", type=int, default=None)
    parser.add_argument("--models", default="tiny_py,tiny_onnx,frametx,frame_py")
    args = parser.parse_args(argv)
    blocks = args.blocks or (4 if args.quick else 8)
    calls = {"tiny": 100 if args.quick else 200, "frame": 5 if args.quick else 10}
    models = args.models.split(",")
    inputs = sample_inputs()
    inputs["frametx"] = inputs["frame"]
    daemons = {}
    clients: list[Client] = []
    with tempfile.TemporaryDirectory(prefix="bench-kserve-ab-") as tmp:
        root = Path(tmp)
        repo = build_repository(root / "repo")
        test_daemon.frame_model(repo / "frametx" / "1" / "model.onnx")
        config = test_daemon.FRAME_CONFIG.replace('name: "frame"', 'name: "frametx"', 1)
        (repo / "frametx" / "config.pbtxt").write_text(config)
        try:
            for label, checkout in (("before", args.before.resolve()), ("after", ROOT)):
                http_port, grpc_port = test_daemon.free_port(), test_daemon.free_port()
                daemon = test_daemon.Daemon(
                    repo,
                    f"ipc://{root}/{label}.sock",
                    root / f"{label}.log",
                    *test_daemon.kserve_flags(http_port, grpc_port),
                    checkout=checkout,
                )
                daemons[label] = (daemon.start(timeout=180), http_port, grpc_port)
            cases: dict[tuple[str, str, str], Callable[[], Any]] = {}
            for label, (daemon, http_port, grpc_port) in daemons.items():
                hc = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
                gc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
                ipc = Client(daemon.address, timeout=120)
                clients.append(ipc)
                for model in models:
                    kind = model if model == "frametx" else model.split("_")[0]
                    name, out, datatype = TENSORS[kind]
                    x = inputs[kind]
                    hin = httpclient.InferInput(name, list(x.shape), datatype)
                    hin.set_data_from_numpy(x, binary_data=True)
                    hout = [httpclient.InferRequestedOutput(out, binary_data=True)]
                    gin = grpcclient.InferInput(name, list(x.shape), datatype)
                    gin.set_data_from_numpy(x)
                    cases[(model, "HTTP", label)] = lambda hc=hc, m=model, i=hin, o=hout: hc.infer(
                        m, [i], outputs=o
                    )
                    cases[(model, "gRPC", label)] = lambda gc=gc, m=model, i=gin: gc.infer(m, [i])
                    cases[(model, "IPC", label)] = lambda c=ipc, m=model, n=name, x=x: c.infer(m, {n: x})
            samples: dict[tuple[str, str, str], list[float]] = {key: [] for key in cases}
            cost = {key: [0.0, 0] for key in cases}  # daemon CPU seconds, minor faults
            pids = {label: daemon.pid for label, (daemon, _, _) in daemons.items()}
            rng = random.Random(7)
            for block in range(blocks):
                order = list(cases.items())
                rng.shuffle(order)
                for key, call in order:
                    for _ in range(3):
                        call()
                    pid = pids[key[2]]
                    cpu, faults = process_cpu(pid), test_daemon.minor_faults(pid)
                    for _ in range(calls["tiny" if key[0].startswith("tiny") else "frame"]):
                        start = time.perf_counter()
                        call()
                        samples[key].append(time.perf_counter() - start)
                    cost[key][0] += process_cpu(pid) - cpu
                    cost[key][1] += test_daemon.minor_faults(pid) - faults
                print(f"block {block + 1}/{blocks} done", file=sys.stderr, flush=True)
        finally:
            for client in clients:
                client.close()
            for daemon, _, _ in daemons.values():
                daemon.stop()
    print(f"\n{blocks} blocks, shuffled order per block; medians over every call, µs; daemon per call\n")
    print(
        "| model | transport | before | after | after/before | daemon CPU µs, before / after "
        "| page faults, before / after |\n|---|---|---|---|---|---|---|"
    )
    for model in models:
        for transport in TRANSPORTS:
            keys = [(model, transport, s) for s in ("before", "after")]
            before, after = (statistics.median(samples[k]) * 1e6 for k in keys)
            cpu = " / ".join(f"{cost[k][0] / len(samples[k]) * 1e6:,.0f}" for k in keys)
            faults = " / ".join(f"{cost[k][1] / len(samples[k]):,.0f}" for k in keys)
            ratio = after / before
            row = f"| {model} | {transport} | {before:,.0f} | {after:,.0f} | {ratio:.2f} | {cpu} | {faults} |"
            print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
