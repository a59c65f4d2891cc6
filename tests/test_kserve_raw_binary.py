"""Triton's raw binary HTTP request (``Inference-Header-Content-Length: 0``) and chunked bodies.

What Triton's QA expects (L0_http ``http_test.py``): with no JSON header the body is the data of the
model's only input, its shape deduced from the config (batch 1 for a batching model, the one ``-1``
from the body's size); the response carries every output in binary form; a ``TYPE_STRING`` input
with ``dims: [1]`` takes the whole body as its one element; a model with several inputs, several
variable dimensions or a longer string input is refused with Triton's texts (400).  A body sent with
``Transfer-Encoding: chunked`` is the same request.
"""

from __future__ import annotations

import socket
import textwrap
from collections.abc import Iterator

import numpy as np
import pytest

from tests.daemon import Daemon, free_port, kserve_flags
from tests.onnx_factory import affine_model

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

AFFINE = """
name: "affine"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
"""

IDENTITY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(
            r, "INPUT0").as_numpy())]) for r in requests]
"""


def _python_config(name: str, dtype: str, dims: str, inputs: int = 1) -> str:
    entries = ", ".join(
        f'{{ name: "INPUT{i}", data_type: {dtype}, dims: [ {dims} ] }}' for i in range(inputs)
    )
    return f"""
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {entries} ]
output [ {{ name: "OUTPUT0", data_type: {dtype}, dims: [ {dims} ] }} ]
"""


@pytest.fixture(scope="module")
def http_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    root = tmp_path_factory.mktemp("raw")
    repo = root / "repo"
    models = {
        "string_one": _python_config("string_one", "TYPE_STRING", "1"),
        "string_many": _python_config("string_many", "TYPE_STRING", "-1"),
        "two_variable": _python_config("two_variable", "TYPE_FP16", "-1, -1"),
        "three_inputs": _python_config("three_inputs", "TYPE_FP32", "8", inputs=3),
    }
    for name, config in models.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(textwrap.dedent(config))
        (repo / name / "1" / "model.py").write_text(textwrap.dedent(IDENTITY))
    (repo / "affine").mkdir(parents=True)
    (repo / "affine" / "config.pbtxt").write_text(textwrap.dedent(AFFINE))
    affine_model(repo / "affine" / "1" / "model.onnx", offset=0.0, dims=("batch", "n"))
    port = free_port()
    daemon = Daemon(repo, f"ipc://{root}/r.sock", root / "r.log", *kserve_flags(port, free_port()))
    daemon.start()
    try:
        yield port
    finally:
        assert daemon.stop() == 0, daemon.log()


def _post(port: int, model: str, body: bytes, *, chunked: bool = False) -> tuple[int, dict[str, str], bytes]:
    """One POST over a plain socket, so that the body can be sent chunk-encoded by hand."""
    head = [
        f"POST /v2/models/{model}/infer HTTP/1.1",
        "Host: 127.0.0.1",
        "Inference-Header-Content-Length: 0",
    ]
    if chunked:
        head.append("Transfer-Encoding: chunked")
        payload = f"{len(body):X}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    else:
        head.append(f"Content-Length: {len(body)}")
        payload = body
    head.append("Connection: close")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    header_block, _, content = data.partition(b"\r\n\r\n")
    lines = header_block.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        content = _unchunk(content)
    return status, headers, content


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_text, _, rest = data.partition(b"\r\n")
        size = int(size_text, 16)
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2 :]
    return out


@pytest.mark.parametrize("count", [8, 32])
@pytest.mark.parametrize("chunked", [False, True])
def test_the_body_is_the_only_inputs_data(http_port: int, count: int, chunked: bool) -> None:
    data = np.arange(count, dtype=np.float32).tobytes()
    status, headers, content = _post(http_port, "affine", data, chunked=chunked)
    assert status == 200, content
    header_length = int(headers["inference-header-content-length"])
    assert content[header_length:] == data  # the output, binary: x * 1 + 0


def test_a_string_input_takes_the_whole_body(http_port: int) -> None:
    status, headers, content = _post(http_port, "string_one", b"427")
    assert status == 200, content
    header_length = int(headers["inference-header-content-length"])
    assert content[header_length:] == len(b"427").to_bytes(4, "little") + b"427"  # BYTES: length-prefixed


@pytest.mark.parametrize(
    ("model", "body", "text"),
    [
        ("string_many", b"427", "For BYTE datatype raw input 'INPUT0', the model must have input shape [1]"),
        (
            "two_variable",
            np.ones(4, np.float16).tobytes(),
            "The shape of the raw input 'INPUT0' can not be deduced because there are more than one "
            "variable-sized dimension",
        ),
        (
            "three_inputs",
            np.arange(24, dtype=np.float32).tobytes(),
            "Raw request must only have 1 input (found 1) to be deduced but got 3 inputs in",
        ),
    ],
    ids=["long-string", "two-variable-dims", "three-inputs"],
)
def test_requests_that_cannot_be_deduced_are_refused(
    http_port: int, model: str, body: bytes, text: str
) -> None:
    status, _headers, content = _post(http_port, model, body)
    assert status == 400
    assert text in content.decode()


def test_a_size_that_does_not_fit_is_refused(http_port: int) -> None:
    status, _headers, content = _post(http_port, "affine", b"\x00" * 6)  # 1.5 floats
    assert status == 400
    assert "INPUT0" in content.decode()
