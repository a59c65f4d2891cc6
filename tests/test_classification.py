"""Triton's classification extension: an output asked for with ``class_count=N`` comes back as its top N
classes, ``"score:index[:label]"`` BYTES strings, the same over HTTP, gRPC, IPC and in-process.

What Triton's QA expects (L0_infer ``test_class_*``, L0_parameters ``class_count_test``): a BYTES
tensor of shape ``[batch, N]`` for a batching model and ``[N]`` for one without a batch axis, best
score first, scores as C++ ``std::to_string`` writes them (``1.000000``, ``7``), the label of that
index from the output's ``label_filename`` when there is one, N capped by the number of classes;
"class result not available for output due to unsupported type 'BYTES'" for a string output,
"classification output tensor too large" past a million classes, and no classification into shared
memory.
"""

from __future__ import annotations

import json
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.error import HTTPError

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from edge_server import Server
from edge_server.classification import MAX_ELEMENTS, classify
from edge_server.client import Client
from edge_server.errors import EdgeServerError, InvalidArgument
from tests.daemon import Daemon, free_port, kserve_flags
from tests.kserve_daemon import KServeDaemon
from tests.onnx_factory import affine_model

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

SCORES_CONFIG = """
name: "scores"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 6 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 6 ], label_filename: "labels.txt" } ]
"""
LABELS = "cat\ndog\r\nbird\n\nfish\n"  # index 3 has an empty line, index 5 no line: no label

PAIR_CONFIG = """
name: "pair"
backend: "python"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_INT32, dims: [ -1 ] } ]
output [
  { name: "A", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "B", data_type: TYPE_FP64, dims: [ -1 ] },
  { name: "S", data_type: TYPE_STRING, dims: [ -1 ] }
]
"""
PAIR_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            strings = np.array([str(v).encode() for v in x], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("A", x), pb_utils.Tensor("B", x * 0.5), pb_utils.Tensor("S", strings),
            ]))
        return responses
"""

ROWS = np.array([[0.1, 0.7, 0.2, 0.7, 0.0, 0.9], [5, 4, 3, 2, 1, 0]], dtype=np.float32)
# best first; the two 0.7 keep the lower index first; index 3 and 5 have no label
EXPECTED = [
    [b"0.900000:5", b"0.700000:1:dog", b"0.700000:3"],
    [b"5.000000:0:cat", b"4.000000:1:dog", b"3.000000:2:bird"],
]
X = np.array([3, -1, 7, 0], dtype=np.int32)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("classes") / "repo"
    _write(root / "scores" / "config.pbtxt", SCORES_CONFIG)
    (root / "scores" / "labels.txt").write_bytes(LABELS.encode())
    affine_model(root / "scores" / "1" / "model.onnx", offset=0.0, dims=("batch", 6))
    _write(root / "pair" / "config.pbtxt", PAIR_CONFIG)
    _write(root / "pair" / "1" / "model.py", PAIR_MODEL)
    return root


@pytest.fixture(scope="module")
def kserve(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KServeDaemon]:
    root = tmp_path_factory.mktemp("sock")
    http_port, grpc_port = free_port(), free_port()
    daemon = Daemon(repository, f"ipc://{root}/c.sock", root / "c.log", *kserve_flags(http_port, grpc_port))
    daemon.start()
    try:
        yield KServeDaemon(daemon, http_port, grpc_port)
    finally:
        assert daemon.stop() == 0, daemon.log()


# -- the rule itself ---------------------------------------------------------------------------


def test_top_classes_of_each_row_best_first() -> None:
    labels = ("cat", "dog", "bird", "", "fish")
    assert classify(ROWS, 3, batched=True, labels=labels).tolist() == EXPECTED
    flat = classify(X, 10, batched=False)  # N past the class count: every class, no batch axis
    assert flat.tolist() == [b"7:2", b"3:0", b"0:3", b"-1:1"]
    assert classify(np.zeros((0, 6), np.float32), 2, batched=True).shape == (0, 2)


@pytest.mark.parametrize(
    ("array", "name"),
    [
        (np.array([b"a"], dtype=np.object_), "BYTES"),
        (np.array([True]), "BOOL"),
        (np.array([1.0], dtype=np.float16), "FP16"),
    ],
)
def test_types_without_an_order_are_refused(array: np.ndarray, name: str) -> None:
    with pytest.raises(InvalidArgument, match=f"unsupported type '{name}'"):
        classify(array, 1, batched=False)


def test_more_than_a_million_classes_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="classification output tensor too large"):
        classify(np.ones((1, MAX_ELEMENTS + 1), np.float32), 5, batched=True)


# -- every way in --------------------------------------------------------------------------------


def test_the_same_classes_over_every_frontend(kserve: KServeDaemon, repository: Path) -> None:
    answers = {}
    for binary in (True, False):
        http = httpclient.InferenceServerClient(kserve.http_url)
        tensor = httpclient.InferInput("INPUT0", list(ROWS.shape), "FP32")
        tensor.set_data_from_numpy(ROWS, binary_data=binary)
        wanted = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary, class_count=3)]
        result = http.infer("scores", [tensor], outputs=wanted)
        assert result.get_output("OUTPUT0")["datatype"] == "BYTES"
        assert result.get_output("OUTPUT0")["shape"] == [2, 3]
        answers[f"http binary={binary}"] = result.as_numpy("OUTPUT0")
        http.close()
    grpc = grpcclient.InferenceServerClient(kserve.grpc_url)
    tensor = grpcclient.InferInput("INPUT0", list(ROWS.shape), "FP32")
    tensor.set_data_from_numpy(ROWS)
    result = grpc.infer(
        "scores", [tensor], outputs=[grpcclient.InferRequestedOutput("OUTPUT0", class_count=3)]
    )
    assert result.get_output("OUTPUT0").datatype == "BYTES"
    answers["grpc"] = result.as_numpy("OUTPUT0")
    grpc.close()
    with Client(kserve.daemon.address, timeout=30) as client:
        answers["ipc"] = client.infer("scores", {"INPUT0": ROWS}, classification={"OUTPUT0": 3})["OUTPUT0"]
    with Server(repository) as server:
        answers["in-process"] = server.infer("scores", {"INPUT0": ROWS}, classification={"OUTPUT0": 3})[
            "OUTPUT0"
        ]
    for way, answer in answers.items():
        assert answer.shape == (2, 3), way
        # tritonclient gives BYTES that came as JSON as str
        assert [[v.encode() if isinstance(v, str) else v for v in row] for row in answer] == EXPECTED, way


def test_only_the_outputs_asked_for_are_classified(kserve: KServeDaemon) -> None:
    http = httpclient.InferenceServerClient(kserve.http_url)
    tensor = httpclient.InferInput("X", [4], "INT32")
    tensor.set_data_from_numpy(X)
    wanted = [
        httpclient.InferRequestedOutput("A", class_count=2),
        httpclient.InferRequestedOutput("B"),
        httpclient.InferRequestedOutput("S"),
    ]
    result = http.infer("pair", [tensor], outputs=wanted)
    http.close()
    assert result.as_numpy("A").tolist() == [b"7:2", b"3:0"]  # no batch axis: shape [N]
    assert result.as_numpy("B").tolist() == [1.5, -0.5, 3.5, 0.0]
    assert result.as_numpy("S").tolist() == [b"3", b"-1", b"7", b"0"]
    with Client(kserve.daemon.address, timeout=30) as client:
        out = client.infer("pair", {"X": X}, outputs=["A", "B"], classification={"B": 1})
    assert out["A"].tolist() == X.tolist()
    assert out["B"].tolist() == [b"3.500000:2"]


def test_a_string_output_cannot_be_classified(kserve: KServeDaemon) -> None:
    text = "class result not available for output due to unsupported type 'BYTES'"
    http = httpclient.InferenceServerClient(kserve.http_url)
    tensor = httpclient.InferInput("X", [4], "INT32")
    tensor.set_data_from_numpy(X)
    with pytest.raises(InferenceServerException, match=text) as caught:
        http.infer("pair", [tensor], outputs=[httpclient.InferRequestedOutput("S", class_count=1)])
    assert caught.value.status() == "400"
    http.close()
    grpc = grpcclient.InferenceServerClient(kserve.grpc_url)
    tensor = grpcclient.InferInput("X", [4], "INT32")
    tensor.set_data_from_numpy(X)
    with pytest.raises(InferenceServerException, match=text) as caught:
        grpc.infer("pair", [tensor], outputs=[grpcclient.InferRequestedOutput("S", class_count=1)])
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    grpc.close()
    with Client(kserve.daemon.address, timeout=30) as client:
        with pytest.raises(EdgeServerError, match=text) as err:
            client.infer("pair", {"X": X}, classification={"S": 1})
        assert err.value.code == "INVALID_ARGUMENT"
        with pytest.raises(EdgeServerError, match="not a requested output"):
            client.infer("pair", {"X": X}, outputs=["A"], classification={"B": 1})


def test_classification_into_shared_memory_is_refused(kserve: KServeDaemon) -> None:
    body = {
        "inputs": [{"name": "X", "shape": [4], "datatype": "INT32", "data": X.tolist()}],
        "outputs": [
            {
                "name": "A",
                "parameters": {
                    "classification": 2,
                    "shared_memory_region": "r",
                    "shared_memory_byte_size": 64,
                },
            }
        ],
    }
    request = urllib.request.Request(
        f"http://{kserve.http_url}/v2/models/pair/infer", data=json.dumps(body).encode(), method="POST"
    )
    with pytest.raises(HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 400
    assert "Output can't set both 'shared_memory_region' and 'classification'" in caught.value.read().decode()
