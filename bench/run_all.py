"""Run every benchmark in bench/, one after another, and print all their tables.

    .venv/bin/python bench/run_all.py              # short modes (~10-15 minutes on a 2-core box)
    .venv/bin/python bench/run_all.py --full       # the scripts' own defaults (much longer)
    .venv/bin/python bench/run_all.py --only bench_triton bench_ipc --out bench/results/all.md

Each script runs in its own process with this interpreter; its output is kept under ``bench/results/``
(or ``--results DIR``; one file per script) and printed under a heading.  Benchmarks run one at a time
because they measure the machine: running two at once would measure each other.  A script that fails is
reported and the rest still run; the exit status says whether all of them succeeded.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

# script -> (short-mode flags, full-mode flags)
BENCHMARKS: dict[str, tuple[list[str], list[str]]] = {
    "bench_ipc": (["--runs", "2", "--requests", "500", "--frames", "30", "--pipelined", "3000"], []),
    "bench_kserve": (["--short"], []),
    "bench_baselines": (["--quick"], []),
    "bench_triton": (["--quick"], []),
    "bench_batching": (["--seconds", "1.5"], []),
    "bench_batch_cost": (["--rounds", "1"], []),
    "bench_busy_instance": (["--quick"], []),
    "bench_cnn_runs": (["--seconds", "3", "--rounds", "1"], []),
    "bench_pipeline": (["--short"], []),
    "bench_ocr": (["--quick"], []),
    "bench_sequence": (["--short"], []),
    "bench_python_isolation": (["--quick"], []),
    "bench_reload": (["--reloads", "10", "--warmup", "1"], []),
    "bench_http_stacks": (["--short"], []),
    "bench_shm_outputs": (["--short"], []),
    "bench_soak": (["--quick"], []),
    "bench_hostile": (["--quick"], []),
}


def run(name: str, flags: list[str], timeout: float) -> tuple[bool, str, float]:
    script = ROOT / "bench" / f"{name}.py"
    if not script.is_file():
        return True, f"(skipped: {script.relative_to(ROOT)} is not in this checkout)\n", 0.0
    start = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, str(script), *flags], cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return False, f"{out}\n(timed out after {timeout:.0f} s)\n", time.monotonic() - start
    elapsed = time.monotonic() - start
    text = done.stdout
    if done.returncode != 0:
        text += f"\n(exit status {done.returncode}; last lines of stderr:)\n{done.stderr[-2000:]}"
    elif "skipped" in done.stderr.lower():
        text += "\n" + "\n".join(line for line in done.stderr.splitlines() if "skipped" in line.lower())
    return done.returncode == 0, text, elapsed


def main(argv: list[str] | None = None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--full", action="store_true", help="the scripts' default (long) runs")
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), help="run only these")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per script")
    parser.add_argument("--out", type=Path, default=None, help="also write everything to this file")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the folder of one file per script")
    args = parser.parse_args(argv)
    args.results.mkdir(parents=True, exist_ok=True)
    sections, failed = [], []
    for name, (short, full) in BENCHMARKS.items():
        if args.only and name not in args.only:
            continue
        flags = full if args.full else short
        print(f"running {name} {' '.join(flags)}", file=sys.stderr, flush=True)
        ok, text, elapsed = run(name, flags, args.timeout)
        (args.results / f"{name}.txt").write_text(text)
        if not ok:
            failed.append(name)
        status = f"{elapsed:.0f} s" + ("" if ok else ", FAILED")
        section = f"## {name} {' '.join(flags)} ({status})\n\n{text.strip()}\n"
        print(section, flush=True)
        sections.append(section)
    if args.out is not None:
        args.out.write_text("\n".join(sections))
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
