"""Requests Triton refuses are refused here too, with Triton's texts (its clients and QA match them);
requests Triton takes are taken.

From Triton's QA (L0_http ``http_test.py``, L0_input_validation, L0_infer_zero): an output asked for
twice ("output 'OUTPUT0' already exists in request", 400), a shape whose element count or byte size
passes a signed 64-bit integer ("causes total element count to exceed maximum size of", "byte size
overflow for input"), on HTTP and gRPC alike and, for the duplicate, in-process too; a request with
no inputs to a model whose inputs are all optional, and an empty BOOL tensor as a JSON ``[]``, run.
From L0_lifecycle, L0_infer, L0_input_validation and L0_shared_memory: a message is Triton's text with
nothing before it (our stable code rides in the HTTP body's ``code``), "Request for unknown model: ..."
(HTTP 400 / INVALID_ARGUMENT for a name not known at all), the input-count text, the model-name texts
of a load, and "failed to poll from model repository" (the shared-memory texts: test_kserve_shm.py).
"""

from __future__ import annotations

import json
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.error import HTTPError

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from edge_server import Server
from edge_server.errors import InvalidArgument
from tests.daemon import Daemon, free_port, kserve_flags
from tests.onnx_factory import affine_model

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

CONFIG = """
name: "affine"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""


OPTIONAL_CONFIG = """
name: "optional"
backend: "python"
max_batch_size: 0
input [ { name: "FLAGS", data_type: TYPE_BOOL, dims: [ -1 ], optional: true } ]
output [ { name: "COUNT", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""
OPTIONAL_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            flags = pb_utils.get_input_tensor_by_name(request, "FLAGS")
            count = -1 if flags is None else flags.as_numpy().size
            out = pb_utils.Tensor("COUNT", np.array([count], np.int32))
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
"""


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("texts") / "repo"
    (repo / "affine").mkdir(parents=True)
    (repo / "affine" / "config.pbtxt").write_text(textwrap.dedent(CONFIG))
    affine_model(repo / "affine" / "1" / "model.onnx")
    (repo / "optional" / "1").mkdir(parents=True)
    (repo / "optional" / "config.pbtxt").write_text(textwrap.dedent(OPTIONAL_CONFIG))
    (repo / "optional" / "1" / "model.py").write_text(textwrap.dedent(OPTIONAL_MODEL))
    (repo / "three" / "1").mkdir(parents=True)
    (repo / "three" / "config.pbtxt").write_text(textwrap.dedent(THREE_CONFIG))
    (repo / "three" / "1" / "model.py").write_text(textwrap.dedent(THREE_MODEL))
    (repo / "strings" / "1").mkdir(parents=True)
    (repo / "strings" / "config.pbtxt").write_text(textwrap.dedent(STRINGS_CONFIG))
    (repo / "strings" / "1" / "model.py").write_text(textwrap.dedent(THREE_MODEL))
    return repo


@pytest.fixture(scope="module")
def ports(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    root = tmp_path_factory.mktemp("sock")
    http_port, grpc_port = free_port(), free_port()
    flags = [*kserve_flags(http_port, grpc_port), "--model-control-mode", "explicit", "--load-model", "*"]
    daemon = Daemon(repository, f"ipc://{root}/t.sock", root / "t.log", *flags)
    daemon.start()
    try:
        yield http_port, grpc_port
    finally:
        assert daemon.stop() == 0, daemon.log()


THREE_CONFIG = """
name: "three"
backend: "python"
max_batch_size: 0
input [
  { name: "A", data_type: TYPE_FP32, dims: [ 1 ] },
  { name: "B", data_type: TYPE_FP32, dims: [ 1 ] },
  { name: "C", data_type: TYPE_FP32, dims: [ 1 ], optional: true }
]
output [ { name: "COUNT", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""
THREE_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = pb_utils.Tensor("COUNT", np.array([len(requests)], np.int32))
        return [pb_utils.InferenceResponse([out]) for _ in requests]
"""

STRINGS_CONFIG = """
name: "strings"
backend: "python"
max_batch_size: 8
input [
  { name: "INPUT0", data_type: TYPE_STRING, dims: [ -1 ] },
  { name: "INPUT1", data_type: TYPE_STRING, dims: [ -1 ] }
]
output [ { name: "COUNT", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""


def _post(port: int, body: dict, model: str = "affine") -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v2/models/{model}/infer", data=json.dumps(body).encode(), method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except HTTPError as exc:
        return exc.code, exc.read().decode()


def test_an_output_asked_for_twice_is_refused(ports: tuple[int, int], repository: Path) -> None:
    text = "output 'OUTPUT0' already exists in request"
    body = {
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}],
        "outputs": [{"name": "OUTPUT0"}, {"name": "OUTPUT0"}],
    }
    status, answer = _post(ports[0], body)
    assert (status, text in answer) == (400, True), answer
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{ports[1]}")
    tensor = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
    twice = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT0")]
    with pytest.raises(InferenceServerException, match=text):
        client.infer("affine", [tensor], outputs=twice)
    client.close()
    with Server(repository) as server, pytest.raises(InvalidArgument, match=text):
        server.infer("affine", {"INPUT0": np.ones((1, 4), np.float32)}, outputs=["OUTPUT0", "OUTPUT0"])


@pytest.mark.parametrize(
    ("shape", "text"),
    [
        ([2**4, 2**60 + 2], "causes total element count to exceed maximum size of"),
        ([2**2, 2**60 + 2], "byte size overflow for input 'INPUT0'"),
    ],
)
def test_shapes_past_64_bits_are_refused(ports: tuple[int, int], shape: list[int], text: str) -> None:
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": shape, "data": [1.0]}]}
    status, answer = _post(ports[0], body)
    assert status == 400
    assert text in answer


def test_no_inputs_when_all_are_optional_and_an_empty_bool_list(ports: tuple[int, int]) -> None:
    status, answer = _post(ports[0], {"inputs": []}, "optional")
    assert status == 200, answer
    assert json.loads(answer)["outputs"][0]["data"] == [-1]
    empty = {"inputs": [{"name": "FLAGS", "datatype": "BOOL", "shape": [0], "data": []}]}
    status, answer = _post(ports[0], empty, "optional")
    assert status == 200, answer
    assert json.loads(answer)["outputs"][0]["data"] == [0]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{ports[1]}")
    assert client.infer("optional", []).as_numpy("COUNT").tolist() == [-1]
    client.close()


def test_an_unknown_model_is_answered_with_tritons_text_and_status(ports: tuple[int, int]) -> None:
    text = "Request for unknown model: 'nope' is not found"
    status, answer = _post(ports[0], {"inputs": []}, "nope")
    assert (status, json.loads(answer)) == (400, {"error": text, "code": "MODEL_NOT_FOUND"})
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{ports[1]}")
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("nope")
    assert (info.value.status(), info.value.message()) == ("StatusCode.INVALID_ARGUMENT", text)
    with pytest.raises(InferenceServerException, match="'affine' version 7 is not found"):
        client.get_model_metadata("affine", "7")
    client.close()


def test_missing_inputs_are_counted_in_tritons_words(ports: tuple[int, int]) -> None:
    one = [{"name": "A", "datatype": "FP32", "shape": [1], "data": [1.0]}]
    status, answer = _post(ports[0], {"inputs": one}, "three")
    assert status == 400
    assert json.loads(answer)["error"] == (
        "expected number of inputs between 2 and 3 but got 1 inputs for model 'three'. Got input(s) "
        "['A'], but missing required input(s) ['B']. Please provide all required input(s)."
    )
    status, answer = _post(ports[0], {"inputs": []}, "affine")
    assert json.loads(answer)["error"].startswith("expected 1 inputs but got 0 inputs for model 'affine'")
    two = [*one, {"name": "B", "datatype": "FP32", "shape": [1], "data": [2.0]}]
    assert _post(ports[0], {"inputs": two}, "three")[0] == 200


def test_load_and_unload_names_get_tritons_texts(ports: tuple[int, int]) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{ports[1]}")
    for name in ("", " ", "\t"):
        with pytest.raises(
            InferenceServerException, match="Model name cannot be empty. Please enter a valid name"
        ):
            client.load_model(name)
    for name in ("../etc", "a/b", " .."):
        with pytest.raises(
            InferenceServerException, match="model name must not contain path traversal characters"
        ):
            client.load_model(name)
        client.unload_model(name)  # looked up, never joined to a path: unknown, so nothing to do
    with pytest.raises(
        InferenceServerException, match="failed to load 'model123', failed to poll from model repo"
    ):
        client.load_model("model123")
    for name in ("...", "..my_model"):  # Triton's valid names: not found here (hidden, never a model)
        with pytest.raises(InferenceServerException, match="failed to poll from model repository"):
            client.load_model(name)
    client.close()


def test_request_parameters_named_triton_underscore_are_refused(ports: tuple[int, int]) -> None:
    """Triton keeps ``triton_*`` request parameters for itself (L0_parameters); others reach the model."""
    body = {
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}],
        "parameters": {"triton_final_response": True},
    }
    status, answer = _post(ports[0], body)
    assert status == 400
    assert (
        "parameter keys starting with 'triton_' are reserved for Triton usage" in json.loads(answer)["error"]
    )
    body["parameters"] = {"triton_enable_empty_final_response": True}  # gRPC's only, as in Triton
    assert _post(ports[0], body)[0] == 400
    body["parameters"] = {"mine": "ok"}
    assert _post(ports[0], body)[0] == 200
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    request = service_pb2.ModelInferRequest(model_name="affine")  # tritonclient refuses it client-side
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(np.ones((1, 4), np.float32).tobytes())
    request.parameters["triton_injected_via_header"].string_param = "x"
    with grpc.insecure_channel(f"127.0.0.1:{ports[1]}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError, match="reserved for Triton usage"):
            stub.ModelInfer(request)


def test_a_body_over_the_limit_is_refused_with_tritons_text(ports: tuple[int, int]) -> None:
    """Refused on its Content-Length, before a byte of it is read (L0_http's oversized load)."""
    import socket

    with socket.create_connection(("127.0.0.1", ports[0]), timeout=30) as sock:
        sock.sendall(
            b"POST /v2/repository/models/affine/load HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 2863311617\r\n\r\n{"
        )
        reply = b""
        while b"}" not in reply.rpartition(b"\r\n\r\n")[2]:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    body = json.loads(reply.partition(b"\r\n\r\n")[2])
    assert reply.startswith(b"HTTP/1.1 413")
    assert body["error"].startswith(
        "request JSON size of 2863311617 bytes exceeds the maximum allowed input size of"
    )


def _strings(module: Any, sent: int, claimed: int) -> list[Any]:
    """Two BYTES inputs of ``sent`` elements each whose shape claims ``claimed`` (as Triton's QA sends)."""
    values = np.array([str(i).encode() for i in range(sent)], dtype=object).reshape(1, sent)
    tensors = []
    for name in ("INPUT0", "INPUT1"):
        tensor = module.InferInput(name, [1, sent], "BYTES")
        tensor.set_data_from_numpy(values)
        tensor.set_shape([1, claimed])
        tensors.append(tensor)
    return tensors


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_bytes_element_count_is_refused_in_tritons_words(ports: tuple[int, int], protocol: str) -> None:
    """L0_input_validation's string shapes: the text names input and model, and, as in Triton, the
    input reported is the last bad one of the request (Triton walks a request's inputs in its hash
    map's order, which for a request's few inputs is the reverse of the order they came in)."""
    if protocol == "grpc":
        module: Any = grpcclient
        client: Any = grpcclient.InferenceServerClient(f"127.0.0.1:{ports[1]}")
    else:
        module = httpclient
        client = httpclient.InferenceServerClient(f"127.0.0.1:{ports[0]}")
    try:
        with pytest.raises(InferenceServerException) as fewer:
            client.infer("strings", _strings(module, 14, 16))
        assert "expected 16 string elements for inference input 'INPUT1' for model 'strings', got 14" in str(
            fewer.value
        )
        with pytest.raises(InferenceServerException) as more:
            client.infer("strings", _strings(module, 18, 16))
        assert (
            "unexpected number of string elements 17 for inference input 'INPUT1' for model 'strings', "
            "expecting 16"
        ) in str(more.value)
        assert client.infer("strings", _strings(module, 16, 16)).as_numpy("COUNT").tolist() == [1]
    finally:
        client.close()
