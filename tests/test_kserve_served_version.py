"""A KServe response names the version that ran the request, even when a reload came in between.

A request for the latest version runs on v1; while it runs, v2 is loaded and takes over routing; the
answer that v1 then gives must still say ``model_version: "1"`` (HTTP and gRPC alike).
"""

from __future__ import annotations

import http.client
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.daemon import build_repository, start_pyzmq_gc, stop_daemon
from tests.kserve_daemon import start_kserve_daemon

grpcclient = pytest.importorskip("tritonclient.grpc")


class _Http:
    """Plain HTTP/1.1 calls (one connection per call, so threads can share it)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        host, port = self.url.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        try:
            payload = json.dumps(body).encode() if body is not None else None
            conn.request(method, path, body=payload, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
            return response.status, json.loads(data) if data else None
        finally:
            conn.close()

    def infer(self, x: np.ndarray) -> tuple[str, np.ndarray]:
        body = {
            "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": list(x.shape), "data": x.tolist()}]
        }
        status, reply = self._call("POST", "/v2/models/gate/infer", body)
        assert status == 200, reply
        return reply["model_version"], np.array(reply["outputs"][0]["data"], np.float32)

    def load(self) -> None:
        status, reply = self._call("POST", "/v2/repository/models/gate/load", {})
        assert status == 200, reply

    def ready(self, version: str) -> bool:
        return self._call("GET", f"/v2/models/gate/versions/{version}/ready")[0] == 200


class _Grpc:
    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)

    def infer(self, x: np.ndarray) -> tuple[str, np.ndarray]:
        tensor = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = self.client.infer("gate", [tensor])
        return result.get_response().model_version, result.as_numpy("OUTPUT0")

    def load(self) -> None:
        self.client.load_model("gate")

    def ready(self, version: str) -> bool:
        return bool(self.client.is_model_ready("gate", version))


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_the_response_names_the_version_that_served_it(tmp_path: Path, transport: str) -> None:
    start_pyzmq_gc()
    repo = build_repository(tmp_path)
    server = start_kserve_daemon(tmp_path, repo, "version.sock")
    gate = server.daemon.gate
    assert gate is not None
    client: _Http | _Grpc = _Http(server.http_url) if transport == "http" else _Grpc(server.grpc_url)
    try:
        x = np.arange(2, dtype=np.float32)
        answers: list[tuple[str, np.ndarray]] = []
        running = threading.Thread(target=lambda: answers.append(client.infer(x)))
        running.start()
        gate.wait_started(1)  # v1 runs it now
        shutil.copytree(repo / "gate" / "1", repo / "gate" / "2")
        loading = threading.Thread(target=client.load)  # returns once v1 drained
        loading.start()
        deadline = time.monotonic() + 60
        while not client.ready("2"):
            assert time.monotonic() < deadline, "v2 did not become ready"
            time.sleep(0.05)
        gate.release(1)
        running.join(30)
        loading.join(60)
        ((version, out),) = answers
        np.testing.assert_array_equal(out, x)
        assert version == "1"
    finally:
        assert stop_daemon(server.daemon) == 0, server.daemon.log()
