"""Errors stay precise and small on every frontend: hostile shapes, values, versions and names.

Shapes past 2^63, typed contents out of their datatype's range and a 5,000-digit version are the
client's mistake (INVALID_ARGUMENT naming the tensor), never INTERNAL; a 60,000-character model name
is quoted back cut to the same short form by every frontend.
"""

from __future__ import annotations

import http.client
import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.daemon import RawPeer, header, ipc_repository, ipc_root
from tests.kserve_daemon import KServeDaemon, kserve

__all__ = ["ipc_repository", "ipc_root", "kserve"]

LONG_NAME = "m" * 60_000
LONG_VERSION = "9" * 5_000


def post(server: KServeDaemon, path: str, body: object) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        conn.request("POST", path, json.dumps(body).encode())
        reply = conn.getresponse()
        return reply.status, reply.read().decode()
    finally:
        conn.close()


def get(server: KServeDaemon, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        conn.request("GET", path)
        reply = conn.getresponse()
        return reply.status, reply.read().decode()
    finally:
        conn.close()


@pytest.mark.parametrize("shape", [[2**63], [2**62, 4], [2**32, 2**32], [0, 2**63], [0, 2**62, 2**62]])
@pytest.mark.parametrize("data", [[], [1.0]])
def test_http_shapes_past_2_63_are_invalid_arguments(
    kserve: KServeDaemon, shape: list[int], data: list[float]
) -> None:
    status, body = post(
        kserve,
        "/v2/models/identity/infer",
        {"inputs": [{"name": "INPUT0", "shape": shape, "datatype": "FP32", "data": data}]},
    )
    assert status == 400, body
    assert "INVALID_ARGUMENT" in body and "INPUT0" in body


def grpc_infer(
    server: KServeDaemon, model: str, tensor: service_pb2.ModelInferRequest.InferInputTensor
) -> object:
    import grpc

    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name=model, inputs=[tensor])
        try:
            stub.ModelInfer(request, timeout=30)
        except grpc.RpcError as exc:
            return exc.code().name, exc.details()
    return "OK", ""


@pytest.mark.parametrize("shape", [[2**62, 4], [0, 2**62, 2**62], [0, 2**40, 2**40]])
def test_grpc_shapes_past_2_63_are_invalid_arguments(kserve: KServeDaemon, shape: list[int]) -> None:
    contents = service_pb2.InferTensorContents(fp32_contents=[])
    tensor = service_pb2.ModelInferRequest.InferInputTensor(
        name="INPUT0", datatype="FP32", shape=shape, contents=contents
    )
    code, details = grpc_infer(kserve, "identity", tensor)
    assert code == "INVALID_ARGUMENT" and "INPUT0" in details, details


@pytest.mark.parametrize(
    ("datatype", "field", "value"), [("UINT8", "uint_contents", 300), ("INT8", "int_contents", -300)]
)
def test_grpc_typed_contents_out_of_range_are_invalid_arguments(
    kserve: KServeDaemon, datatype: str, field: str, value: int
) -> None:
    contents = service_pb2.InferTensorContents(**{field: [value]})
    tensor = service_pb2.ModelInferRequest.InferInputTensor(
        name="frame", datatype=datatype, shape=[1, 1, 1], contents=contents
    )
    code, details = grpc_infer(kserve, "frame", tensor)
    assert code == "INVALID_ARGUMENT", details
    assert "'frame'" in details and "out of range" in details


def test_a_5000_digit_version_is_an_invalid_argument_everywhere(kserve: KServeDaemon) -> None:
    peer = RawPeer(kserve.daemon.address)
    try:
        ready = peer.ask([header(op="ready", model="identity", version=LONG_VERSION)])
        config = peer.ask([header(op="config", model="identity", version=LONG_VERSION)])
        desc = {"name": "INPUT0", "datatype": "FP32", "shape": [1], "frame": 0}
        frames = [header(op="infer", model="identity", version=LONG_VERSION, inputs=[desc])]
        infer = peer.ask([*frames, np.zeros(1, np.float32).tobytes()])
    finally:
        peer.close()
    for reply in (ready, config, infer):
        assert reply["error"]["code"] == "INVALID_ARGUMENT", reply
        assert len(reply["error"]["message"]) < 300
    status, body = get(kserve, f"/v2/models/identity/versions/{LONG_VERSION}/config")
    assert status == 400 and "INVALID_ARGUMENT" in body and len(body) < 300
    grpc = grpcclient.InferenceServerClient(kserve.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as caught:
            grpc.get_model_config("identity", LONG_VERSION)
    finally:
        grpc.close()
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "Traceback" not in kserve.daemon.log()


def test_a_60000_character_model_name_is_echoed_cut_the_same_way_everywhere(kserve: KServeDaemon) -> None:
    messages = []
    peer = RawPeer(kserve.daemon.address)
    try:
        for op in ("load", "unload", "ready", "config"):
            reply = peer.ask([header(op=op, model=LONG_NAME)])
            if op not in ("ready", "unload"):  # unloading an unknown name is a no-op, as in Triton
                messages.append(reply["error"]["message"])
            if op == "unload":
                assert "error" not in reply, reply
    finally:
        peer.close()
    status, body = post(kserve, f"/v2/repository/models/{LONG_NAME}/load", {})
    assert status in (400, 404), body
    messages.append(json.loads(body)["error"])
    assert post(kserve, f"/v2/repository/models/{LONG_NAME}/unload", {})[0] == 200
    grpc = grpcclient.InferenceServerClient(kserve.grpc_url, verbose=False)
    try:
        for call in (grpc.load_model, grpc.get_model_metadata):
            with pytest.raises(InferenceServerException) as caught:
                call(LONG_NAME)
            messages.append(caught.value.message())
        grpc.unload_model(LONG_NAME)
    finally:
        grpc.close()
    for message in messages:
        assert len(message) < 500, message[:200]
        assert "'mmmmmmmm" in message and "(60000 chars)" in message, message


def test_one_echo_rule_for_client_text() -> None:
    """errors.shorten quotes a client's text the same way everywhere; no message outgrows the cap."""
    from edge_server.errors import MAX_MESSAGE, InvalidArgument, shorten

    assert shorten("identity") == "'identity'"
    cut = shorten("m" * 60_000)
    assert cut.startswith("'mmmm") and cut.endswith("... (60000 chars)") and len(cut) < 100
    assert shorten(b"x" * 1000).endswith("... (1000 bytes)")
    assert len(shorten(list(range(100_000)))) < 100  # never builds the whole repr
    assert len(InvalidArgument("x" * 100_000).message) <= MAX_MESSAGE


def test_the_in_process_api_parses_versions_the_same_way(tmp_path: object) -> None:
    import shutil
    from pathlib import Path

    from edge_server.errors import InvalidArgument
    from edge_server.server import Server
    from tests.daemon import EXAMPLES

    repo = Path(str(tmp_path)) / "repo"
    shutil.copytree(EXAMPLES / "identity", repo / "identity", ignore=shutil.ignore_patterns("samples"))
    x = {"INPUT0": np.zeros(2, np.float32)}
    with Server(repo, model_control_mode="explicit", load_models=["identity"]) as server:
        for call in (
            lambda: server.infer("identity", x, version=LONG_VERSION),  # type: ignore[arg-type]
            lambda: server.model_config("identity", LONG_VERSION),  # type: ignore[arg-type]
        ):
            with pytest.raises(InvalidArgument, match="model version must be") as caught:
                call()
            assert len(caught.value.message) < 300
        assert server.infer("identity", x, version=1)["OUTPUT0"].tolist() == [0, 0]
