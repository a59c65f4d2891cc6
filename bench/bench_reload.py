"""Hot-reload soak: N OTA drops renamed into a watched repository while clients keep sending requests.

    .venv/bin/python bench/bench_reload.py [--reloads 50] [--clients 4] [--target daemon|inprocess]

A model ``m`` whose version ``k`` answers ``x + k`` is served in poll mode.  For each reload the next
version is written to a staging directory on the same filesystem and renamed into ``m/<k>`` (the
recommended OTA procedure); the client threads record every answer with its arrival time.  Measured:

* failed requests (must be 0): any error a client gets during the whole run;
* the server's resident memory after each reload, under traffic: the median over the last tenth of the
  reloads against the median over the first tenth (growth under 10%), after one uncounted reload;
* the time from the rename to the first answer from the new version (median, p90, max).

Each version carries ``--weights-mb`` of weights that every request uses (``pad_bytes`` of
``tests/onnx_factory.py``), so each load allocates and each unload frees as much memory as a real model
of that size: that is what makes the RSS measurement mean something.

``--target daemon`` (default) starts the real daemon (``python -m edge_server serve --model-control-mode
poll --ipc ipc://...``) and drives it with one IPC client per thread; ``inprocess`` uses the in-process
API and measures this process.  Prints a Markdown table.
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
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.onnx_factory import affine_model  # noqa: E402
from tests.reload_helpers import answer, ipc_answer, wait_until, write_config  # noqa: E402


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Target:
    """What the clients talk to: infer() from many threads, models(), the PID whose memory counts."""

    pid: int

    def client(self) -> Callable[[], float]:
        raise NotImplementedError

    def states(self) -> list[tuple[int | None, str]]:
        raise NotImplementedError

    def serves_only(self, version: int) -> bool:
        """Whether ``version`` is the one version left: the one before it is drained and unloaded.

        An unloaded version stays in the index as ``UNAVAILABLE`` (as in Triton's).
        """
        return [state for state in self.states() if state[1] != "UNAVAILABLE"] == [(version, "READY")]

    def close(self) -> None:
        raise NotImplementedError


class InProcess(Target):
    def __init__(self, repo: Path, quiet: float) -> None:
        from edge_server import Server

        self.server = Server(repo, model_control_mode="poll", watch_quiet_s=quiet)
        self.pid = os.getpid()

    def client(self) -> Callable[[], float]:
        return lambda: answer(self.server)

    def states(self) -> list[tuple[int | None, str]]:
        return [(s.version, s.state.value) for s in self.server.models()]

    def close(self) -> None:
        self.server.close()


class DaemonTarget(Target):
    """The real daemon (``tests/daemon.py`` starts it and waits for readiness over IPC)."""

    def __init__(self, repo: Path, work: Path) -> None:
        from edge_server.client import Client
        from tests.daemon import Daemon

        self._client_cls = Client
        self._daemon = Daemon(
            repo, f"ipc://{work}/edge.sock", work / "daemon.log", "--model-control-mode", "poll"
        ).start()
        self.pid = self._daemon.pid
        self._clients: list[Any] = []
        self._control = self._new_client()

    def _new_client(self) -> Any:
        client = self._client_cls(self._daemon.address, timeout=30.0)
        self._clients.append(client)
        return client

    def client(self) -> Callable[[], float]:
        client = self._new_client()
        return lambda: ipc_answer(client)

    def states(self) -> list[tuple[int | None, str]]:
        return [(row["version"], row["state"]) for row in self._control.models()]

    def close(self) -> None:
        for client in self._clients:
            client.close()
        status = self._daemon.stop()
        if status != 0:
            raise RuntimeError(f"the daemon exited with {status}:\n{self._daemon.log()}")


class Clients:
    """Threads sending requests back to back; for each answer value, when it was first seen.

    Only counters and first arrivals are kept, so the in-process target's memory is the server's.
    """

    def __init__(self, target: Target, n: int) -> None:
        self._calls = [target.client() for _ in range(n)]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._first: dict[float, float] = {}
        self._count = 0
        self.errors: list[str] = []
        self._threads = [threading.Thread(target=self._run, args=(c,), daemon=True) for c in self._calls]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _run(self, call: Callable[[], float]) -> None:
        while not self._stop.is_set():
            try:
                value = call()
            except Exception as exc:  # every failure counts; keep the first few for the report
                with self._lock:
                    self.errors.append(repr(exc))
                continue
            now = time.monotonic()
            with self._lock:
                self._count += 1
                self._first.setdefault(value, now)

    def first_answer(self, value: float) -> float | None:
        with self._lock:
            return self._first.get(value)

    def count(self) -> int:
        with self._lock:
            return self._count


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reloads", type=int, default=50)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--target", choices=["daemon", "inprocess"], default="daemon")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of traffic before the first RSS")
    parser.add_argument("--weights-mb", type=float, default=16.0, help="size of each version's weights")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-reload-"))
    repo, staging = work / "repo", work / "staging"
    staging.mkdir(parents=True)
    write_config(repo / "m")
    pad_bytes = int(args.weights_mb * 2**20)
    affine_model(repo / "m" / "1" / "model.onnx", offset=1.0, pad_bytes=pad_bytes)
    quiet = 0.5  # the daemon's default quiet period
    target: Target = DaemonTarget(repo, work) if args.target == "daemon" else InProcess(repo, quiet)
    clients = Clients(target, args.clients)
    latencies: list[float] = []
    rss: list[int] = []  # after every counted reload, once the old version is unloaded

    def reload(version: int) -> float:
        """Drop ``version``, wait for its first answer and for the old version's unload."""
        staged = staging / f"{version}"
        affine_model(staged / "model.onnx", offset=float(version), pad_bytes=pad_bytes)
        renamed = time.monotonic()
        os.rename(staged, repo / "m" / str(version))
        first = wait_until(partial(clients.first_answer, float(version)), 10.0, f"v{version}")
        # the old version is drained and unloaded before the next drop
        wait_until(partial(target.serves_only, version), 10.0, f"v{version - 1} unloaded")
        shutil.rmtree(repo / "m" / str(version - 1))  # keep the disk use flat; v{version} serves on
        return first - renamed

    try:
        clients.start()
        time.sleep(args.warmup)  # traffic only: nothing to synchronise with
        reload(2)  # uncounted: the first load after start-up also frees what start-up left behind
        count_before = clients.count()
        started = time.monotonic()
        for version in range(3, args.reloads + 3):
            latencies.append(reload(version))
            rss.append(rss_bytes(target.pid))
        elapsed = time.monotonic() - started
        requests = clients.count() - count_before
    finally:
        clients.stop()
        target.close()
        shutil.rmtree(work, ignore_errors=True)

    # One reading moves by two versions' weights with the moment it is taken (a load may just have
    # allocated, an unload not yet been trimmed), so "before" and "after" are medians over the first and
    # the last tenth of the reloads (at least 5 each): growth that goes on shows between them.
    window = max(5, len(rss) // 10)
    rss_before, rss_after = statistics.median(rss[:window]), statistics.median(rss[-window:])
    growth = (rss_after - rss_before) / rss_before * 100
    ms = sorted(x * 1000 for x in latencies)
    rows = [
        ("target", args.target),
        ("reloads (renamed into the watched repository)", str(len(latencies))),
        ("client threads", str(args.clients)),
        ("weights per version (MB)", f"{args.weights_mb:g}"),
        ("requests answered during the reloads", f"{requests} ({requests / elapsed:.0f}/s)"),
        ("failed requests", str(len(clients.errors))),
        (f"server RSS, median after the first {window} reloads (MiB)", f"{rss_before / 2**20:.1f}"),
        (f"server RSS, median after the last {window} reloads (MiB)", f"{rss_after / 2**20:.1f}"),
        ("RSS growth", f"{growth:+.1f}%"),
        ("RSS after every 10th reload (MiB)", " ".join(f"{r / 2**20:.0f}" for r in rss[9::10])),
        ("rename -> first answer from new version, median (ms)", f"{statistics.median(ms):.0f}"),
        ("rename -> first answer from new version, p90 (ms)", f"{ms[int(0.9 * (len(ms) - 1))]:.0f}"),
        ("rename -> first answer from new version, max (ms)", f"{ms[-1]:.0f}"),
        ("quiet period before a change loads (ms)", f"{quiet * 1000:.0f}"),
    ]
    print("| measure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    if clients.errors:
        print("\nfirst errors:", *clients.errors[:5], sep="\n  ")
    ok = not clients.errors and growth < 10.0
    print(f"\n{'PASS' if ok else 'FAIL'}: 0 failed requests and RSS growth under 10% required")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
