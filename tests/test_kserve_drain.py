"""Stopping the daemon lets an HTTP or gRPC request already in a model finish (the drain), then exits 0."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.daemon import wait_for
from tests.kserve_daemon import start_kserve_daemon


def accepting(module: Any, url: str) -> bool:
    """Whether a new connection's health check is answered (asking the server, not sleeping)."""
    try:
        fresh = module.InferenceServerClient(url)
        try:
            return bool(fresh.is_server_live())
        finally:
            fresh.close()
    except Exception:  # noqa: BLE001 - refused or unavailable: it stopped taking calls
        return False


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_sigterm_drains_a_request_in_flight(ipc_repository: Path, ipc_root: Path, protocol: str) -> None:
    server = start_kserve_daemon(ipc_root, ipc_repository, f"drain-{protocol}.sock")
    gate = server.daemon.gate
    proc = server.daemon.proc
    assert gate is not None and proc is not None
    module: Any = httpclient if protocol == "http" else grpcclient
    url = server.http_url if protocol == "http" else server.grpc_url
    client = module.InferenceServerClient(url)
    result: list[Any] = []

    def call() -> None:
        tensor = module.InferInput("INPUT0", [2], "FP32")
        tensor.set_data_from_numpy(np.array([1.0, 2.0], np.float32))
        try:
            result.append(client.infer("gate", [tensor]).as_numpy("OUTPUT0").tolist())
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion
            result.append(exc)

    thread = threading.Thread(target=call)
    try:
        thread.start()
        gate.wait_started(1)  # the request is in the model
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: not accepting(module, url), what="the frontend to stop taking new calls")
        gate.release(1)
        thread.join(30)
        assert result == [[1.0, 2.0]]
        assert proc.wait(30) == 0
    finally:
        client.close()
        gate.settle()
        server.daemon.kill()
        gate.close()
