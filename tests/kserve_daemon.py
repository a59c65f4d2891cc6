"""The real daemon with its KServe frontends on free ports, for the HTTP, gRPC and shared-memory tests.

PYTEST_DONT_REWRITE
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.daemon import Daemon, free_port, kserve_flags, start_daemon, start_pyzmq_gc, stop_daemon
from tests.decoupled_models import add_decoupled_models, add_params_model


@dataclass
class KServeDaemon:
    daemon: Daemon
    http_port: int
    grpc_port: int

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


def start_kserve_daemon(root: Path, repository: Path, name: str, *args: str) -> KServeDaemon:
    http_port, grpc_port = free_port(), free_port()
    proc = start_daemon(root, repository, name, *kserve_flags(http_port, grpc_port), *args)
    return KServeDaemon(proc, http_port, grpc_port)


@pytest.fixture(scope="module")
def kserve(ipc_root: Path, ipc_repository: Path) -> Iterator[KServeDaemon]:
    """One daemon per module with HTTP and gRPC (and client shared memory) on; the decoupled models and
    the parameter echo model join the IPC tests' repository."""
    start_pyzmq_gc()
    if not (ipc_repository / "repeat").exists():
        add_decoupled_models(ipc_repository, ipc_root / "repeat.log")
        add_params_model(ipc_repository)
    server = start_kserve_daemon(ipc_root, ipc_repository, "k.sock", "--allow-client-shm", "true")
    try:
        yield server
    finally:
        status = stop_daemon(server.daemon)
        assert status == 0, f"the daemon exited with {status}:\n{server.daemon.log()}"


def ort_run(repository: Path, model: str, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The same model through ONNX Runtime directly: what every frontend's answer must equal."""
    import onnxruntime as ort

    session = ort.InferenceSession(
        str(repository / model / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    return session.run(None, inputs)
