"""``--engine-build on-load``: rebuild a stale or missing plan from the ONNX beside it, in the background.

While the build runs the version serves its ONNX through ONNX Runtime (``fallback.py``); when the plan
is written (atomically, with its engine record) ``on_built(model)`` asks the repository to load the model
again, and this time the plan serves.  One build at a time (a Jetson has one GPU and builds take
minutes); a request for a plan already queued is ignored.  Under systemd, each 15 s of building sends
``EXTEND_TIMEOUT_USEC`` so that a start-up or stop that waits on it is not killed.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edge_server.backends.tensorrt import cache
from edge_server.backends.tensorrt.builder import BuildOptions, BuildResult

log = logging.getLogger(__name__)

ENGINE_BUILD_MODES = ("none", "on-load")


@dataclass(frozen=True)
class Job:
    model: str
    onnx: Path
    plan: Path
    device: str  # for the engine record
    options: BuildOptions
    batch: tuple[int, int, int] = (1, 1, 1)  # (min, opt, max) batch of the profile


Build = Callable[[Job, Callable[[str], None]], BuildResult]


def sd_notify(message: str) -> None:
    """Send one line to systemd's notification socket when running under it (no-op otherwise)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(message.encode(), address)
    except OSError as exc:
        log.debug("sd_notify failed: %s", exc)


def _default_build(job: Job, progress: Callable[[str], None]) -> BuildResult:
    """Build with TensorRT (GPU only): the batch range becomes a profile on every dynamic-batch input."""
    from edge_server.backends.tensorrt import builder

    profile = builder.profile_shapes(builder.network_inputs(job.onnx), job.batch)
    options = dataclasses.replace(job.options, profile=profile)
    return builder.build(job.onnx, options, progress)


class EngineRebuilder:
    """A background builder thread and its queue of plans to rebuild."""

    def __init__(self, on_built: Callable[[str], None], *, build: Build | None = None) -> None:
        self._on_built = on_built
        self._build = build or _default_build
        self._cond = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self._pending: set[Path] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="edge-engine-build", daemon=True)
        self._thread.start()

    def request(self, job: Job) -> bool:
        """Queue ``job``; False when that plan is already queued or building, or after close."""
        with self._cond:
            if self._closed or job.plan in self._pending:
                return False
            self._pending.add(job.plan)
            self._queue.append(job)
            self._cond.notify()
        log.info("%s: rebuilding %s from %s in the background", job.model, job.plan, job.onnx.name)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking jobs; a build under way is left to finish (TensorRT cannot be interrupted)."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
            try:
                self._build_one(job)
            except Exception:  # the builder thread survives any failure; the ONNX keeps serving
                log.exception("%s: rebuilding %s failed; the ONNX keeps serving", job.model, job.plan)
            finally:
                with self._cond:
                    self._pending.discard(job.plan)

    def _build_one(self, job: Job) -> None:
        def progress(line: str) -> None:
            log.info("%s: %s", job.model, line)
            sd_notify("EXTEND_TIMEOUT_USEC=30000000")

        digest = cache.sha256_file(job.onnx)
        result = self._build(job, progress)
        temp = job.plan.with_name(f".{job.plan.name}.tmp")
        temp.write_bytes(result.plan)
        # The record first: a watcher that sees the new plan must not pair it with the old record.
        cache.write_record(
            job.plan, cache.EngineKey(job.device, job.options.dla_core, result.tensorrt, digest)
        )
        os.replace(temp, job.plan)
        log.info(
            "%s: %s rebuilt in %.0f s with TensorRT %s", job.model, job.plan, result.seconds, result.tensorrt
        )
        with self._cond:
            closed = self._closed
        if not closed:
            self._on_built(job.model)
