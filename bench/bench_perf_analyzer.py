"""Triton's own perf_analyzer against the daemon's KServe ports: HTTP and gRPC, concurrency 1 and 4.

    .venv/bin/python bench/bench_perf_analyzer.py --quick     # ~30 s: short windows
    .venv/bin/python bench/bench_perf_analyzer.py             # the figures in docs/benchmarks.md

Where perf_analyzer comes from: ``--perf-analyzer PATH``, else ``$PERF_ANALYZER``, else ``perf_analyzer``
on ``PATH`` or in this Python's ``bin/`` (where a tritonclient wheel that ships it installs it).  The
tritonclient installed by our extras (>= 2.40) does not ship it: 2.36.0's wheel is the last that has it
(``tritonclient-2.36.0.data/data/bin/perf_analyzer``; the ``perf-analyzer`` package on the registry is a
placeholder without a binary).  That binary needs Debian's ``libb64-0d`` and ``libcudart.so.12``, which
the ``nvidia-cuda-runtime-cu12`` wheel has: the script adds its ``lib/`` to ``LD_LIBRARY_PATH`` when that
wheel is importable, and ``$PERF_ANALYZER_LIBRARY_PATH`` is added too.  Without a binary that runs, the
script says why and exits 0 (a skip, not a failure).

It starts the real daemon (HTTP and gRPC on free ports) on a temporary repository with the tiny
``identity`` model (16 x FP32, see bench_ipc.py), runs ``perf_analyzer -m identity --shape INPUT0:16
--concurrency-range 1:4:3 -f CSV --verbose-csv`` over each protocol, and prints one table from the CSVs.
Rows are perf_analyzer's own figures: throughput, p50/p99 and the average client latency, and the
server's queue plus compute per request as perf_analyzer reads it from our statistics.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_ipc import repository  # noqa: E402
from tests.daemon import Daemon, free_port, kserve_flags  # noqa: E402

LEVELS = (1, 4)


def find_perf_analyzer(given: str | None) -> Path | None:
    candidates = [given, os.environ.get("PERF_ANALYZER"), shutil.which("perf_analyzer")]
    candidates.append(str(Path(sysconfig.get_path("scripts")) / "perf_analyzer"))
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def library_path() -> str:
    """``LD_LIBRARY_PATH`` with the CUDA runtime wheel's libraries (perf_analyzer links libcudart)."""
    parts = [
        p for p in (os.environ.get("PERF_ANALYZER_LIBRARY_PATH"), os.environ.get("LD_LIBRARY_PATH")) if p
    ]
    for entry in sys.path:
        lib = Path(entry) / "nvidia" / "cuda_runtime" / "lib"
        if (lib / "libcudart.so.12").exists():
            parts.append(str(lib))
            break
    return os.pathsep.join(parts)


def usable(binary: Path, env: dict[str, str]) -> str | None:
    """None when the binary starts; else why not (a missing shared library, usually)."""
    try:
        answer = subprocess.run(
            [str(binary), "--version"], env=env, capture_output=True, text=True, timeout=30
        )
    except OSError as exc:
        return str(exc)
    text = (answer.stdout + answer.stderr).strip()
    if "error while loading shared libraries" in text:
        return text.splitlines()[-1]
    return None


def run_one(
    binary: Path, env: dict[str, str], protocol: str, port: int, csv_path: Path, args: argparse.Namespace
) -> str:
    """perf_analyzer's output; its CSV has the levels it measured (it stops at one that never settles)."""
    command = [
        str(binary),
        "-m",
        "identity",
        "-u",
        f"127.0.0.1:{port}",
        "-i",
        protocol,
        "--shape",
        "INPUT0:16",
        "--concurrency-range",
        f"{LEVELS[0]}:{LEVELS[-1]}:{LEVELS[-1] - LEVELS[0]}",
        "--measurement-interval",
        "500" if args.quick else "3000",
        "-f",
        str(csv_path),
        "--verbose-csv",
        "--stability-percentage",
        str(50 if args.quick else args.stability_percentage),
    ]
    if args.quick:
        command += ["--max-trials", "5"]
    print("$", " ".join(command), file=sys.stderr)
    answer = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    output = answer.stdout + answer.stderr
    if answer.returncode != 0 and "stable measurement" not in output:  # unsettled: noted in the table
        raise RuntimeError(
            f"perf_analyzer ({protocol}) failed:\n{answer.stdout[-2000:]}{answer.stderr[-2000:]}"
        )
    return output


def rows(csv_path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(csv_path.open()))


def report(
    results: dict[str, list[dict[str, str]]], version: str, notes: dict[str, str], stability: float
) -> None:
    print(f"\nperf_analyzer ({version}) against edge-server, identity 16 x FP32, inline tensors")
    print(f"(-s {stability:g}: a level is stable when its last 3 windows agree within that percentage)")
    print("| protocol | concurrency | infer/s | p50 us | p99 us | avg us | server queue+compute us |")
    print("|---|---|---|---|---|---|---|")
    for protocol, found in results.items():
        for row in sorted(found, key=lambda r: int(r["Concurrency"])):
            server = sum(
                int(row[k])
                for k in (
                    "Server Queue",
                    "Server Compute Input",
                    "Server Compute Infer",
                    "Server Compute Output",
                )
            )
            print(
                f"| {protocol} | {row['Concurrency']} | {float(row['Inferences/Second']):,.0f} | "
                f"{row['p50 latency']} | {row['p99 latency']} | {row.get('Avg latency', '-')} | {server} |"
            )
        measured = {int(r["Concurrency"]) for r in found}
        for level in LEVELS:
            if level not in measured:
                print(f"| {protocol} | {level} | not measured: {notes.get(protocol, '?')} | | | | |")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="short windows, loose stability (~30 s)")
    parser.add_argument("--perf-analyzer", default=None, metavar="PATH", help="the binary to run")
    parser.add_argument(
        "--stability-percentage",
        type=float,
        default=10.0,
        metavar="PCT",
        help="perf_analyzer's -s (default 10, its own; a loaded machine may need more)",
    )
    args = parser.parse_args()
    binary = find_perf_analyzer(args.perf_analyzer)
    if binary is None:
        print(
            "SKIP: no perf_analyzer binary (--perf-analyzer, $PERF_ANALYZER, PATH, this Python's bin/). The "
            "installed tritonclient does not ship one; tritonclient 2.36.0's wheel is the last that does "
            "(tritonclient-2.36.0.data/data/bin/perf_analyzer). `edge-server perf` measures the same way.",
        )
        return 0
    env = {**os.environ, "LD_LIBRARY_PATH": library_path()}
    problem = usable(binary, env)
    if problem is not None:
        print(
            f"SKIP: {binary} does not start: {problem}. It needs libb64-0d (apt) and libcudart.so.12 "
            "(pip install nvidia-cuda-runtime-cu12, or $PERF_ANALYZER_LIBRARY_PATH)."
        )
        return 0
    answer = subprocess.run([str(binary), "--version"], env=env, capture_output=True, text=True)
    version = (answer.stdout + answer.stderr).strip().splitlines()[0] if answer.stdout + answer.stderr else ""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        repo = repository(root)
        http_port, grpc_port = free_port(), free_port()
        daemon = Daemon(
            repo,
            f"ipc://{root}/pa.sock",
            root / "daemon.log",
            *kserve_flags(http_port, grpc_port),
        )
        results: dict[str, list[dict[str, str]]] = {}
        notes: dict[str, str] = {}
        try:
            daemon.start()
            for protocol, port in (("http", http_port), ("grpc", grpc_port)):
                path = root / f"{protocol}.csv"
                output = run_one(binary, env, protocol, port, path, args)
                results[protocol] = rows(path) if path.exists() else []
                unstable = [line.strip() for line in output.splitlines() if "stable" in line.lower()]
                notes[protocol] = unstable[-1] if unstable else "absent from perf_analyzer's CSV"
        finally:
            daemon.stop()
    report(results, version or str(binary), notes, 50 if args.quick else args.stability_percentage)
    return 0


if __name__ == "__main__":
    sys.exit(main())
