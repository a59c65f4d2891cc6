"""One instance with requests always waiting: how close it runs to back-to-back executions.

    .venv/bin/python bench/bench_busy_instance.py --quick                 # ~1 minute
    .venv/bin/python bench/bench_busy_instance.py --before /tmp/before    # side by side with a checkout

The model stands in for one whose work runs off the CPU (a TensorRT engine on the GPU or a DLA): a
``model.py`` that takes a CNN's 224x224 input and sleeps ``--compute-ms`` with the GIL released.  A
second model is loaded beside it, as on any box that serves more than one (the daemon's only model may
run on the frontend's thread instead of its instance's worker; a TensorRT model never does); with
``--alone`` it is the daemon's only model, as on a camera box that serves one.  Client
processes (``--clients``, each with one request in flight) keep its queue full over gRPC
(``tritonclient``) and over IPC (``edge_server.client``), in rounds that alternate the checkouts.

Per checkout and transport: inferences per second, the instance's *gap* per execution (wall time per
execution less the model's own compute, from the daemon's statistics: what the instance spends between
batches, delivering the last one and taking the next), and the throughput as a share of the ceiling
``1 / compute``.  A worker that completes its batch's futures itself spends the frontend's reply there
(a gRPC answer is encoded and started in that thread); one that hands the delivery off
(``edge_server/scheduler/handoff.py``) takes the next batch at once.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tests.daemon as test_daemon  # noqa: E402
from bench.triton_models import accelerator_model  # noqa: E402

MODELS = ("accel", "beside")
#: The clients' first and last half second are left out: they do not start and stop all at once.
EDGE_S = 0.5


def build(repo: Path, compute_ms: float, alone: bool) -> Path:
    for name in MODELS[:1] if alone else MODELS:
        accelerator_model(repo, name, compute_ms)
    return repo


def client(transport: str, address: str, seconds: float, start: Any, counts: Any) -> None:
    """One client process: one request in flight, for ``seconds`` from ``start``; puts its count."""
    import numpy as np

    x = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
    if transport == "gRPC":
        import tritonclient.grpc as grpcclient

        grpc = grpcclient.InferenceServerClient(address)
        tensor = grpcclient.InferInput("input", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)

        def call() -> None:
            grpc.infer("accel", [tensor])
    else:
        from edge_server.client import Client

        ipc = Client(address, timeout=60)

        def call() -> None:
            ipc.infer("accel", {"input": x})

    call()
    start.wait()
    stop, n = time.monotonic() + seconds, 0
    while time.monotonic() < stop:
        call()
        n += 1
    counts.put(n)


def one_round(
    ctx: Any, transport: str, address: str, ipc: str, clients: int, seconds: float
) -> tuple[float, float, float]:
    """(inferences/s, gap per execution in µs, mean compute per execution in µs) of one round.

    The daemon's statistics, read twice inside the clients' window, give all three.
    """
    from edge_server.client import Client

    start, counts = ctx.Event(), ctx.Queue()
    work = (transport, address, seconds, start, counts)
    procs = [ctx.Process(target=client, args=work) for _ in range(clients)]
    for proc in procs:
        proc.start()
    time.sleep(2.0)  # every client connected and warm
    with Client(ipc, timeout=60) as control:
        start.set()
        time.sleep(EDGE_S)  # measured inside the clients' window, while every one of them is sending
        before, t0 = control.statistics("accel")[0], time.monotonic()
        time.sleep(seconds - 2 * EDGE_S)
        after, t1 = control.statistics("accel")[0], time.monotonic()
        for _ in procs:
            counts.get(timeout=seconds + 60)
    for proc in procs:
        proc.join()
    executions = after["execution_count"] - before["execution_count"]
    compute_ns = (
        after["inference_stats"]["compute_infer"]["ns"] - before["inference_stats"]["compute_infer"]["ns"]
    )
    compute_us = compute_ns / max(executions, 1) / 1000
    period_us = (t1 - t0) * 1e6 / max(executions, 1)
    return 1e6 / period_us, period_us - compute_us, compute_us


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="two rounds of 3 s")
    parser.add_argument("--before", type=Path, help="a checkout to measure side by side (a git worktree)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--compute-ms", type=float, default=4.0)
    parser.add_argument("--alone", action="store_true", help="the model is the daemon's only one")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--seconds", type=float)
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    seconds = max(args.seconds or (3.0 if args.quick else 5.0), 3 * EDGE_S)
    checkouts = {"this checkout": ROOT}
    if args.before is not None:
        checkouts = {"before": args.before.resolve(), "after": ROOT}
    ctx = multiprocessing.get_context("spawn")
    samples: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-busy-") as tmp, ExitStack() as stack:
        root = Path(tmp)
        repo = build(root / "repo", args.compute_ms, args.alone)
        addresses = {}
        for label, checkout in checkouts.items():
            http, grpc = test_daemon.free_port(), test_daemon.free_port()
            name = label.replace(" ", "-")
            daemon = test_daemon.Daemon(
                repo,
                f"ipc://{root}/{name}.sock",
                root / f"{name}.log",
                *test_daemon.kserve_flags(http, grpc),
                checkout=checkout,
            )
            stack.callback(daemon.stop)
            daemon.start(timeout=120)
            addresses[label] = {"gRPC": f"127.0.0.1:{grpc}", "IPC": daemon.address}
        cases = [(label, transport) for label in checkouts for transport in ("gRPC", "IPC")]
        for number in range(rounds):
            random.shuffle(cases)
            for label, transport in cases:
                ipc = addresses[label]["IPC"]
                sample = one_round(ctx, transport, addresses[label][transport], ipc, args.clients, seconds)
                samples.setdefault((label, transport), []).append(sample)
            print(f"round {number + 1}/{rounds} done", file=sys.stderr, flush=True)
    company = "the daemon's only model" if args.alone else "another model beside it"
    print(
        f"\n{args.clients} client processes, one request in flight each; model: {args.compute_ms:g} ms "
        f"off the CPU per request, {company}; {rounds} rounds of {seconds:g} s; medians over rounds\n"
    )
    print("| checkout | transport | inferences/s | gap per execution, µs | share of 1/compute |")
    print("|---|---|---|---|---|")
    for label in checkouts:
        for transport in ("gRPC", "IPC"):
            rows = samples[(label, transport)]
            rate = statistics.median(r[0] for r in rows)
            gap = statistics.median(r[1] for r in rows)
            compute = statistics.median(r[2] for r in rows)
            print(f"| {label} | {transport} | {rate:,.1f} | {gap:,.0f} | {rate * compute / 1e6:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
