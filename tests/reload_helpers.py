"""Helpers for the hot-reload tests: a repository whose versions answer differently, load, waiting.

Version ``k`` of a model answers ``x + k`` (``OUTPUT0 = INPUT0 * 1 + k``), so every answer says which
version produced it.  Waits poll the server with a deadline; nothing sleeps to synchronise.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from edge_server import Server
from tests.onnx_factory import affine_bytes, affine_model

CONFIG = """
name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
version_policy: {policy}
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ {dims} ] }} ]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ {dims} ] }} ]
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}
"""
LATEST_1 = "{ latest: { num_versions: 1 } }"
ALL = "{ all: { } }"
ZEROS = np.zeros((1, 4), dtype=np.float32)
T = TypeVar("T")


def write_config(model_dir: Path, *, policy: str = LATEST_1, dims: int = 4, delay_us: int = 200) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    text = CONFIG.format(name=model_dir.name, policy=policy, dims=dims, delay_us=delay_us)
    (model_dir / "config.pbtxt").write_text(text)


def model_bytes(offset: float, *, dims: int = 4) -> bytes:
    """The serialized ``x + offset`` model; ``dims`` other than the config's 4 makes it disagree."""
    return affine_bytes(offset=offset, dims=("batch", dims))


def write_model(
    repo: Path, name: str = "m", versions: tuple[int, ...] = (1,), *, policy: str = LATEST_1
) -> Path:
    """A model directory with the given versions, each answering ``x + version``."""
    model_dir = repo / name
    write_config(model_dir, policy=policy)
    for version in versions:
        affine_model(model_dir / str(version) / "model.onnx", offset=float(version))
    return model_dir


def stage_version(
    staging: Path, version: int, *, offset: float | None = None, data: bytes | None = None
) -> Path:
    """A complete version directory written outside the repository, ready to be renamed into place."""
    target = staging / f"v{version}-{time.monotonic_ns()}"
    if data is None:
        affine_model(target / "model.onnx", offset=float(version if offset is None else offset))
    else:
        target.mkdir(parents=True)
        (target / "model.onnx").write_bytes(data)
    return target


def answer(server: Server, name: str = "m", version: int | None = None) -> float:
    return float(server.infer(name, {"INPUT0": ZEROS}, version=version)["OUTPUT0"][0, 0])


def wait_until(predicate: Callable[[], T | None], timeout: float = 10.0, what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy and return that; fails on the deadline.

    The one polling helper of the reload tests and ``bench/bench_reload.py``: the predicate asks the
    server (or a client's record), so nothing sleeps to synchronise.
    """
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)
    return result


def state_of(server: Server, name: str, version: int | None) -> tuple[str, str] | None:
    for status in server.models():
        if status.name == name and status.version == version:
            return status.state.value, status.reason
    return None


def reason_of(server: Server, name: str, version: int | None) -> str:
    found = state_of(server, name, version)
    return found[1] if found else ""


def loads_of(server: Server) -> list[int | None]:
    """The versions the server starts loading from now on, in order (a live list)."""
    versions: list[int | None] = []
    server.add_listener(lambda s: versions.append(s.version) if s.state.value == "LOADING" else None)
    return versions


class Load:
    """Client threads sending requests continuously; every answer and error is recorded with its time.

    ``call`` is shared by ``threads`` threads, or a list of calls gives each thread its own (one IPC
    client per thread).
    """

    def __init__(self, call: Callable[[], float] | list[Callable[[], float]], threads: int = 4) -> None:
        calls = call if isinstance(call, list) else [call] * threads
        self._stop = threading.Event()
        self._lock = threading.Lock()
        # (monotonic time the request was sent, value): a request sent before a swap may still be
        # answered by the old version after it; one sent after it never is
        self.answers: list[tuple[float, float]] = []
        self.errors: list[BaseException] = []
        self._done = [0] * len(calls)  # requests completed, per thread
        self._threads = [
            threading.Thread(target=self._run, args=(i, c), name=f"test-load-{i}", daemon=True)
            for i, c in enumerate(calls)
        ]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        wait_until(lambda: len(self.answers) >= len(self._threads), what="the first answers")
        return self

    def __exit__(self, *exc: object) -> None:
        # Every thread completes two more requests first: the second one started after this point,
        # so the answers always include what the server serves at the end of the test.
        with self._lock:
            marks = list(self._done)
        if exc[0] is None:
            wait_until(
                lambda: all(done >= mark + 2 for done, mark in zip(self._done, marks, strict=True)),
                what="the load threads' last requests",
            )
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _run(self, index: int, call: Callable[[], float]) -> None:
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                value = call()
            except BaseException as error:  # noqa: BLE001 - every failure is a test failure, kept for the report
                with self._lock:
                    self.errors.append(error)
                    self._done[index] += 1
                continue
            with self._lock:
                self.answers.append((sent, value))
                self._done[index] += 1

    def values_since(self, since: float) -> list[float]:
        with self._lock:
            return [v for t, v in self.answers if t >= since]

    def count(self) -> int:
        with self._lock:
            return len(self.answers)


def rename_into_place(staged: Path, target: Path) -> float:
    """The recommended OTA step: one rename on the same filesystem; returns when it happened."""
    now = time.monotonic()
    os.rename(staged, target)
    return now


def remove(path: Path) -> None:
    shutil.rmtree(path)


def ipc_answer(client: Any, name: str = "m") -> float:
    return float(client.infer(name, {"INPUT0": ZEROS})["OUTPUT0"][0, 0])


def live(rows: Any) -> list[Any]:
    """The index rows but those of versions unloaded (Triton keeps them, UNAVAILABLE "unloaded")."""
    return [r for r in rows if (r.get("reason") if isinstance(r, dict) else r.reason) != "unloaded"]


def ipc_state(client: Any, name: str, version: int | None) -> tuple[str, str] | None:
    for row in client.models():
        if row["name"] == name and row.get("version") == version:
            return str(row["state"]), str(row.get("reason", ""))
    return None
