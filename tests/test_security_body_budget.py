"""IPC and gRPC stream requests count in the same per-user (and daemon-wide) body budget as HTTP bodies.

Each IPC connection was bounded only by its own in-flight count, so one user with many connections,
each with large requests waiting in a model's queue, pinned their bodies without a per-user bound.
Now an IPC message counts in its uid's ``--max-client-body-bytes`` (and ``--max-body-bytes-in-flight``)
from when it is taken in until it is answered, next to that user's HTTP bodies, and one past it is
refused UNAVAILABLE, as HTTP answers 503.  A gRPC stream's requests (up to 16 in flight per stream,
32 streams per user) count the same way, until their final response, and so does a unary gRPC call's
body of 64 KiB or more (smaller ones are bounded by the gRPC workers' count alone, and skip the uid
lookup a count needs: tens of microseconds on a call of a few hundred).
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import numpy as np
import pytest

from edge_server.client import Client
from edge_server.errors import EdgeServerError
from tests.daemon import Gate, build_repository, free_port, kserve_flags, start_daemon, stop_daemon, wait_for

BUDGET = 8 << 20
BODY = 3 << 20  # three of them pass the budget, two do not


def _held(client: Client) -> int:
    return int(client.ipc_status()["limits"]["body_bytes_in_flight"])


def _http_infer(port: int, x: np.ndarray) -> tuple[int, str]:
    """A binary-tensor request over HTTP, as tritonclient sends one."""
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ]
        }
    ).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(
            "POST",
            "/v2/models/identity/infer",
            header + x.tobytes(),
            {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"},
        )
        reply = conn.getresponse()
        return reply.status, reply.read().decode(errors="replace")
    finally:
        conn.close()


def _grpc_stream_error(port: int, x: np.ndarray) -> str:
    """The error of a one-request gRPC stream ("" if it was answered)."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    request = service_pb2.ModelInferRequest(model_name="identity")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        (response,) = list(stub.ModelStreamInfer(iter([request])))
    return str(response.error_message)


def _grpc_unary_error(port: int, x: np.ndarray) -> str:
    """The error of one ``ModelInfer`` call with tritonclient ("" if it was answered)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    tensor = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    try:
        client.infer("identity", [tensor], client_timeout=60)
    except InferenceServerException as exc:
        return f"{exc.status()} {exc.message()}"
    finally:
        client.close()
    return ""


def test_ipc_bodies_count_in_the_users_body_budget(tmp_path: Path) -> None:
    http_port, grpc_port = free_port(), free_port()
    proc = start_daemon(
        tmp_path,
        build_repository(tmp_path),
        "b.sock",
        *kserve_flags(http_port, grpc_port),
        "--max-client-body-bytes",
        str(BUDGET),
    )
    gate = Gate(tmp_path)
    x = np.ones(BODY // 4, np.float32)
    try:
        with Client(proc.address, timeout=60) as first, Client(proc.address, timeout=60) as second:
            held = first.submit("gate", {"INPUT0": x})
            gate.wait_started(1, timeout=60)
            queued = first.submit("gate", {"INPUT0": x})
            wait_for(lambda: _held(second) >= 2 * BODY, 60, what="two bodies to be counted")
            # A third body of the same user, on another connection: past its budget, refused unread.
            with pytest.raises(EdgeServerError) as refused:
                second.infer("gate", {"INPUT0": x})
            assert refused.value.code == "UNAVAILABLE", refused.value
            assert "--max-client-body-bytes" in str(refused.value)
            # Over HTTP too: one budget for the user, whichever way its bodies come.
            status, text = _http_infer(http_port, x)
            assert status == 503 and "--max-client-body-bytes" in text, (status, text[:300])
            # And a gRPC stream's request.
            error = _grpc_stream_error(grpc_port, x)
            assert "--max-client-body-bytes" in error, error
            # And a unary gRPC call's (one of a few KiB is not counted: see the module's docstring).
            error = _grpc_unary_error(grpc_port, x)
            assert "UNAVAILABLE" in error and "--max-client-body-bytes" in error, error
            assert _grpc_unary_error(grpc_port, x[:16]) == ""
            gate.release(2)
            for future in (held, queued):
                np.testing.assert_array_equal(future.result(60)["OUTPUT0"], x)
            wait_for(lambda: _held(second) == 0, 60, what="the answered bodies to be given back")
            gate.release(1)
            np.testing.assert_array_equal(second.infer("gate", {"INPUT0": x})["OUTPUT0"], x)
            with second.stream("gate", {"INPUT0": x}) as responses:  # a stream's body too, until its end
                gate.release(1)
                for outputs in responses:
                    np.testing.assert_array_equal(outputs["OUTPUT0"], x)
            wait_for(lambda: _held(second) == 0, 60, what="the stream's body to be given back")
            assert _grpc_stream_error(grpc_port, x) == ""  # room again: answered
            assert _grpc_unary_error(grpc_port, x) == ""
            # a call's body leaves the count once its answer is with grpc, which the client may see first
            wait_for(lambda: _held(second) == 0, 60, what="the unary call's body to be given back")
    finally:
        gate.settle()
        gate.close()
        assert stop_daemon(proc) == 0, proc.log()
