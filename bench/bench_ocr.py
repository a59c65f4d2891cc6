"""The OCR example (models_ocr/) against the package it comes from: frames/s and latency per frame.

    .venv/bin/python bench/bench_ocr.py [--rounds 5] [--seconds 10] [--cameras 1 4] [--json FILE]
    .venv/bin/python bench/bench_ocr.py --quick          # 3 rounds of 4 s per case

Cases, each run with 1 and 4 cameras (a camera is a thread that sends the next frame when the last
one was answered, cycling over the bundled sample frames, 320x240 BGR):

* ``package, defaults``: ``rapidocr_onnxruntime.RapidOCR()`` called in this process, as its README
  shows (ONNX Runtime's own threads: one intra-op thread per core, spinning, for each of its three
  sessions); the cameras share the one engine (its sessions are thread-safe);
* ``package, 1 thread/model``: ``RapidOCR(intra_op_num_threads=1, inter_op_num_threads=1)``;
* ``daemon, batching on``: the ``ocr`` model through a daemon over IPC, each camera's frames written
  into its own registered shared-memory region; the per-crop models batch as shipped (1 ms delay);
* ``daemon, batching off``: the same without ``dynamic_batching`` on the per-crop models.

Cases alternate within each round, so that noise from other processes falls on all of them alike;
the table shows medians over rounds of frames per second (all cameras together), the 50th and 99th
percentile of a frame's latency, and for the daemon the recogniser's and classifier's mean rows per
execution (from their statistics: how much dynamic batching merged).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cv2
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_server.client import Client  # noqa: E402
from tests.daemon import Daemon  # noqa: E402

PER_CROP = ("text_classification", "text_recognition")


def repository() -> Path:
    repo = ROOT / "models_ocr"
    if not (repo / "text_recognition" / "1" / "model.onnx").exists():
        subprocess.run([sys.executable, str(repo / "make_models.py")], check=True)
    return repo


def repositories(root: Path) -> dict[str, Path]:
    """The OCR repository as shipped, and a copy whose per-crop models do not batch."""
    shipped = repository()
    off = root / "batching-off"
    shutil.copytree(shipped, off, ignore=shutil.ignore_patterns("make_models.py", "__pycache__"))
    for name in PER_CROP:
        config = off / name / "config.pbtxt"
        config.write_text(re.sub(r"dynamic_batching \{[^}]*\}\n", "", config.read_text()))
    return {"daemon, batching on": shipped, "daemon, batching off": off}


def frames() -> list[np.ndarray]:
    paths = sorted((repository() / "ocr" / "samples").glob("frame_*.png"))
    return [cv2.imread(str(p), cv2.IMREAD_COLOR) for p in paths]


def run_cameras(
    cameras: int,
    seconds: float,
    make_sender: Callable[[], tuple[Callable[[np.ndarray], Any], Callable[[], None]]],
) -> tuple[float, list[float]]:
    """Frames per second over all cameras, and every frame's latency in seconds.

    ``make_sender`` (called on each camera's thread) returns (send one frame, close).
    """
    images = frames()
    latencies: list[list[float]] = [[] for _ in range(cameras)]
    ready, go = threading.Barrier(cameras + 1), threading.Barrier(cameras + 1)
    stop_at = [0.0]

    def camera(index: int) -> None:
        send, close = make_sender()
        try:
            send(images[index % len(images)])  # connected and warm
            ready.wait()
            go.wait()
            count = index
            while time.perf_counter() < stop_at[0]:
                began = time.perf_counter()
                send(images[count % len(images)])
                latencies[index].append(time.perf_counter() - began)
                count += 1
        finally:
            close()

    threads = [threading.Thread(target=camera, args=(i,)) for i in range(cameras)]
    for thread in threads:
        thread.start()
    ready.wait()
    begin = time.perf_counter()
    stop_at[0] = begin + seconds
    go.wait()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - begin
    flat = [t for per_camera in latencies for t in per_camera]
    return len(flat) / elapsed, flat


def package_sender(engine: Any) -> Callable[[], tuple[Callable[[np.ndarray], Any], Callable[[], None]]]:
    return lambda: (engine, lambda: None)


def daemon_sender(address: str) -> Callable[[], tuple[Callable[[np.ndarray], Any], Callable[[], None]]]:
    def make() -> tuple[Callable[[np.ndarray], Any], Callable[[], None]]:
        client = Client(address, timeout=120)
        region = client.create_shm_region(max(f.nbytes for f in frames()))

        def close() -> None:
            client.release_shm(region)
            client.close()

        return (lambda frame: client.infer("ocr", {"image": region.write(frame)})), close

    return make


def rows_per_execution(address: str) -> dict[str, tuple[int, int]]:
    """(rows, executions) of each per-crop model so far."""
    with Client(address, timeout=30) as client:
        return {
            name: (int(s["inference_count"]), int(s["execution_count"]))
            for name in PER_CROP
            for s in client.statistics(name)
        }


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=10.0, help="per case and round")
    parser.add_argument("--cameras", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 4 s per case")
    parser.add_argument("--json", type=Path, default=None, help="also write every round's figures here")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds = 3, 4.0
    from rapidocr_onnxruntime import RapidOCR

    senders: dict[str, Callable[[], tuple[Callable[[np.ndarray], Any], Callable[[], None]]]] = {
        "package, defaults": package_sender(RapidOCR()),
        "package, 1 thread/model": package_sender(RapidOCR(intra_op_num_threads=1, inter_op_num_threads=1)),
    }
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="es-ocr-") as tmp:
        daemons = {
            case: Daemon(repo, f"ipc://{tmp}/{i}.sock", Path(tmp) / f"{i}.log")
            for i, (case, repo) in enumerate(repositories(Path(tmp)).items())
        }
        try:
            for daemon in daemons.values():
                daemon.start(timeout=180)
            for case, daemon in daemons.items():
                senders[case] = daemon_sender(daemon.address)
            for _ in range(args.rounds):
                for cameras in args.cameras:
                    for case, sender in senders.items():
                        daemon = daemons.get(case)
                        before = rows_per_execution(daemon.address) if daemon else {}
                        fps, latencies = run_cameras(cameras, args.seconds, sender)
                        key = f"{case} x{cameras}"
                        results.setdefault(f"{key} fps", []).append(fps)
                        results.setdefault(f"{key} p50", []).append(percentile(latencies, 50) * 1e3)
                        results.setdefault(f"{key} p99", []).append(percentile(latencies, 99) * 1e3)
                        if daemon:
                            after = rows_per_execution(daemon.address)
                            for name in PER_CROP:
                                rows = after[name][0] - before[name][0]
                                runs = max(after[name][1] - before[name][1], 1)
                                results.setdefault(f"{key} {name} rows/run", []).append(rows / runs)
                        print(f"{key}: {fps:.2f} frames/s", file=sys.stderr, flush=True)
        finally:
            for daemon in daemons.values():
                daemon.stop()
    report(results, args, list(senders))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def report(results: dict[str, list[float]], args: argparse.Namespace, cases: list[str]) -> None:
    med = {key: statistics.median(values) for key, values in results.items()}
    print(
        f"\nmedians of {args.rounds} interleaved round(s), {args.seconds:g} s per case; {os.cpu_count()} CPUs"
    )
    print(
        "| case | cameras | frames/s | x package, 1 thread/model | p50 ms | p99 ms "
        "| cls rows/run | rec rows/run |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for cameras in args.cameras:
        base = med[f"package, 1 thread/model x{cameras} fps"]
        for case in cases:
            key = f"{case} x{cameras}"
            cls = med.get(f"{key} text_classification rows/run")
            rec = med.get(f"{key} text_recognition rows/run")
            print(
                f"| {case} | {cameras} | {med[f'{key} fps']:.2f} | {med[f'{key} fps'] / base:.2f}x "
                f"| {med[f'{key} p50']:.0f} | {med[f'{key} p99']:.0f} "
                f"| {'—' if cls is None else f'{cls:.1f}'} | {'—' if rec is None else f'{rec:.1f}'} |"
            )


if __name__ == "__main__":
    sys.exit(main())
