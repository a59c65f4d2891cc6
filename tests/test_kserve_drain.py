"""Stopping the daemon lets an HTTP or gRPC request already in a model finish (the drain), then exits 0."""

from __future__ import annotations

import json
import signal
import socket
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


def test_a_request_whose_body_arrives_at_sigterm_is_answered_then_closed(
    ipc_repository: Path, ipc_root: Path
) -> None:
    """A request whose headers came before the stop and its body after: answered, with ``connection: close``,
    whichever path answers it (the connection itself for a small inference, uvicorn's cycle otherwise)."""
    server = start_kserve_daemon(ipc_root, ipc_repository, "drain-body.sock")
    proc = server.daemon.proc
    assert proc is not None
    x = np.array([1.0, 2.0], np.float32)
    header = json.dumps(
        {
            "inputs": [
                {"name": "INPUT0", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 8}}
            ]
        }
    ).encode()
    body = header + x.tobytes()
    try:
        socks = []
        for encoding in (b"", b"Content-Encoding: identity\r\n"):  # the second goes through the ASGI app
            sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=30)
            socks.append(sock)
            sock.sendall(
                b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\n%sContent-Length: %d\r\n"
                b"Inference-Header-Content-Length: %d\r\n\r\n%s"
                % (encoding, len(body), len(header), body[:10])
            )
        proc.send_signal(signal.SIGTERM)
        wait_for(
            lambda: not accepting(httpclient, server.http_url), what="the frontend to stop taking new calls"
        )
        for sock in socks:
            sock.sendall(body[10:])
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
            head, _, answer = reply.partition(b"\r\n\r\n")
            assert b"connection: close" in head.lower(), (socks.index(sock), reply)
            if not head.startswith(b"HTTP/1.1 503"):  # (503: its models were unloaded first)
                assert head.startswith(b"HTTP/1.1 200"), reply
                assert json.loads(answer)["outputs"][0]["data"] == x.tolist()
            sock.close()
        assert proc.wait(30) == 0
    finally:
        server.daemon.kill()
