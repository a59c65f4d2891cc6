"""Triton's quick-start repository and python_backend examples, tried as a Triton user would.

The configs are Triton's own files, unchanged (tests/data/triton_quickstart); the model files are
stand-ins with the same inputs and outputs, generated here (the real densenet/inception weights are
downloaded by Triton's fetch script).  Answers are compared with ONNX Runtime run directly on the
same files, and the python_backend examples with what their own client.py checks.
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edge_server import Server
from edge_server.client import Client
from edge_server.config import load_config_file
from tests.daemon import Daemon

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

CONFIGS = Path(__file__).parent / "data" / "triton_quickstart"
RNG = np.random.default_rng(3)


def _save(graph: onnx.GraphProto, path: Path, opset: int = 17) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())


def densenet_standin(path: Path) -> None:
    """data_0 [1, 3, 224, 224] -> fc6_1 [1, 1000, 1, 1]: pool, then a 1x1 convolution."""
    weights = numpy_helper.from_array(RNG.standard_normal((1000, 3, 1, 1)).astype(np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("GlobalAveragePool", ["data_0"], ["pooled"]),
            helper.make_node("Conv", ["pooled", "w"], ["fc6_1"]),
        ],
        "densenet_standin",
        [helper.make_tensor_value_info("data_0", TensorProto.FLOAT, [1, 3, 224, 224])],
        [helper.make_tensor_value_info("fc6_1", TensorProto.FLOAT, [1, 1000, 1, 1])],
        [weights],
    )
    _save(graph, path)


def inception_standin(path: Path) -> None:
    """input:0 [1, 299, 299, 3] (NHWC) -> InceptionV3/Predictions/Softmax:0 [1, 1001]."""
    weights = numpy_helper.from_array(RNG.standard_normal((3, 1001)).astype(np.float32), "w")
    axes = numpy_helper.from_array(np.array([1, 2], np.int64), "axes")
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["input:0", "axes"], ["mean"], keepdims=0),
            helper.make_node("MatMul", ["mean", "w"], ["logits"]),
            helper.make_node("Softmax", ["logits"], ["InceptionV3/Predictions/Softmax:0"], axis=1),
        ],
        "inception_standin",
        [helper.make_tensor_value_info("input:0", TensorProto.FLOAT, [1, 299, 299, 3])],
        [helper.make_tensor_value_info("InceptionV3/Predictions/Softmax:0", TensorProto.FLOAT, [1, 1001])],
        [weights, axes],
    )
    _save(graph, path, opset=18)


def add_sub_standin(path: Path, element: int) -> None:
    """Triton's ``simple`` models: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1, [batch, 16]."""
    shape = ["batch", 16]
    nodes = [
        helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
        helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
    ]
    inputs = [helper.make_tensor_value_info(n, element, shape) for n in ("INPUT0", "INPUT1")]
    if element == TensorProto.STRING:  # simple_string: numbers written as strings
        nodes = [
            helper.make_node("Cast", ["INPUT0"], ["a"], to=TensorProto.INT32),
            helper.make_node("Cast", ["INPUT1"], ["b"], to=TensorProto.INT32),
            helper.make_node("Add", ["a", "b"], ["sum"]),
            helper.make_node("Sub", ["a", "b"], ["difference"]),
            helper.make_node("Cast", ["sum"], ["OUTPUT0"], to=TensorProto.STRING),
            helper.make_node("Cast", ["difference"], ["OUTPUT1"], to=TensorProto.STRING),
        ]
    outputs = [helper.make_tensor_value_info(n, element, shape) for n in ("OUTPUT0", "OUTPUT1")]
    _save(helper.make_graph(nodes, "simple_standin", inputs, outputs), path)


# Written the way Triton's simple_identity and python_backend's add_sub model.py are written.
IDENTITY_MODEL = """
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])

    def execute(self, requests):
        responses = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", tensor.as_numpy())]))
        return responses
"""

ADD_SUB_MODEL = """
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.dtype0 = pb_utils.triton_string_to_numpy(
            pb_utils.get_output_config_by_name(config, "OUTPUT0")["data_type"])
        self.dtype1 = pb_utils.triton_string_to_numpy(
            pb_utils.get_output_config_by_name(config, "OUTPUT1")["data_type"])

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", (a + b).astype(self.dtype0)),
                pb_utils.Tensor("OUTPUT1", (a - b).astype(self.dtype1)),
            ]))
        return responses

    def finalize(self):
        pass
"""

# python_backend's auto_complete example: no config.pbtxt; the model says what it is.
AUTO_COMPLETE_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        names = {t["name"] for t in auto_complete_model_config.as_dict()["input"]}
        for name in ("INPUT0", "INPUT1"):
            if name not in names:
                auto_complete_model_config.add_input({"name": name, "data_type": "TYPE_FP32", "dims": [4]})
        for name in ("OUTPUT0", "OUTPUT1"):
            auto_complete_model_config.add_output({"name": name, "data_type": "TYPE_FP32", "dims": [4]})
        auto_complete_model_config.set_max_batch_size(MAX_BATCH_SIZE)
        if MAX_BATCH_SIZE:
            auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]))
        return responses
"""

# python_backend's decoupled "square" example: n responses for IN = [n], each OUT = [n], from a thread
# per request that sends after execute() returned, then the final flag.
SQUARE_MODEL = """
import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException("the square model must be decoupled")

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.respond, args=(request,), daemon=True).start()
        return None

    def respond(self, request):
        n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
        sender = request.get_response_sender()
        for _ in range(n):
            out = pb_utils.Tensor("OUT", np.array([n], np.int32))
            sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

# Triton's older quick-start had a TensorFlow model; a repository may hold one.
INCEPTION_GRAPHDEF = """
name: "inception_graphdef"
platform: "tensorflow_graphdef"
max_batch_size: 128
input [ { name: "input" data_type: TYPE_FP32 format: FORMAT_NHWC dims: [ 299, 299, 3 ] } ]
output [ { name: "InceptionV3/Predictions/Softmax" data_type: TYPE_FP32 dims: [ 1001 ]
           label_filename: "inception_labels.txt" } ]
"""

SERVED = ("densenet_onnx", "inception_onnx", "simple", "simple_int8", "simple_string", "simple_identity")


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("quickstart") / "model_repository"
    for name in (*SERVED, "add_sub", "square_int32"):
        shutil.copytree(CONFIGS / name, root / name)
    (root / "square_int32" / "1").mkdir()
    (root / "square_int32" / "1" / "model.py").write_text(SQUARE_MODEL)
    densenet_standin(root / "densenet_onnx" / "1" / "model.onnx")
    (root / "densenet_onnx" / "densenet_labels.txt").write_text("".join(f"c{i}\n" for i in range(1000)))
    inception_standin(root / "inception_onnx" / "1" / "model.onnx")
    (root / "inception_onnx" / "inception_labels.txt").write_text("".join(f"c{i}\n" for i in range(1001)))
    add_sub_standin(root / "simple" / "1" / "model.onnx", TensorProto.INT32)
    add_sub_standin(root / "simple_int8" / "1" / "model.onnx", TensorProto.INT8)
    add_sub_standin(root / "simple_string" / "1" / "model.onnx", TensorProto.STRING)
    (root / "simple_identity" / "1").mkdir()
    (root / "simple_identity" / "1" / "model.py").write_text(IDENTITY_MODEL)
    (root / "add_sub" / "1").mkdir()
    (root / "add_sub" / "1" / "model.py").write_text(ADD_SUB_MODEL)
    for name, batch in (("nobatch_auto_complete", 0), ("batch_auto_complete", 4)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(AUTO_COMPLETE_MODEL.replace("MAX_BATCH_SIZE", str(batch)))
    (root / "inception_graphdef" / "1").mkdir(parents=True)
    (root / "inception_graphdef" / "config.pbtxt").write_text(textwrap.dedent(INCEPTION_GRAPHDEF))
    (root / "inception_graphdef" / "1" / "model.graphdef").write_bytes(b"graphdef")
    return root


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[Server]:
    with Server(repository) as srv:
        yield srv


@pytest.fixture(scope="module")
def daemon(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("sock")
    proc = Daemon(repository, f"ipc://{root}/q.sock", root / "q.log").start()
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[Client]:
    with Client(daemon.address, timeout=30) as c:
        yield c


def direct(repository: Path, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(
        str(repository / model / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs), strict=True))


def test_every_supported_model_loads_and_the_tensorflow_one_says_why_not(server: Server) -> None:
    states = {s.name: (s.state.value, s.reason) for s in server.models()}
    for name in (*SERVED, "add_sub", "square_int32", "nobatch_auto_complete", "batch_auto_complete"):
        assert states[name][0] == "READY", (name, states[name])
    state, reason = states["inception_graphdef"]
    assert state == "UNAVAILABLE"
    assert "platform 'tensorflow_graphdef' (Triton's tensorflow backend) is not supported" in reason
    assert "convert the model to ONNX" in reason


def test_densenet_reshape_config_answers_as_onnxruntime(server: Server, repository: Path) -> None:
    image = RNG.standard_normal((3, 224, 224)).astype(np.float32)  # image_client's preprocessed CHW
    out = server.infer("densenet_onnx", {"data_0": image})["fc6_1"]
    assert out.shape == (1000,)  # the config's dims: the reshape is undone
    expected = direct(repository, "densenet_onnx", {"data_0": image[None]})["fc6_1"]
    np.testing.assert_array_equal(out, expected.reshape(1000))


def test_inception_reshape_config_answers_as_onnxruntime(server: Server, repository: Path) -> None:
    image = RNG.standard_normal((299, 299, 3)).astype(np.float32)
    out = server.infer("inception_onnx", {"input:0": image})["InceptionV3/Predictions/Softmax:0"]
    assert out.shape == (1001,)
    expected = direct(repository, "inception_onnx", {"input:0": image[None]})
    np.testing.assert_array_equal(out, expected["InceptionV3/Predictions/Softmax:0"].reshape(1001))


@pytest.mark.parametrize(("model", "dtype"), [("simple", np.int32), ("simple_int8", np.int8)])
def test_simple_models_answer_as_simple_client_expects(client: Client, model: str, dtype: type) -> None:
    # simple_http_infer_client.py: INPUT0 = 0..15, INPUT1 = ones; checks sum and difference.
    a = np.arange(16, dtype=dtype)[None]
    b = np.ones((1, 16), dtype=dtype)
    out = client.infer(model, {"INPUT0": a, "INPUT1": b})
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT1"], a - b)


def test_simple_string_answers_as_simple_string_client_expects(client: Client, server: Server) -> None:
    # simple_http_string_infer_client.py: numbers as strings in, sums and differences as strings out.
    a = np.array([[str(i).encode() for i in range(16)]], dtype=object)
    b = np.array([[b"1"] * 16], dtype=object)
    for out in (
        client.infer("simple_string", {"INPUT0": a, "INPUT1": b}),
        server.infer("simple_string", {"INPUT0": a, "INPUT1": b}),
    ):
        assert [type(x) for x in out["OUTPUT0"].reshape(-1)] == [bytes] * 16
        assert [int(x) for x in out["OUTPUT0"].reshape(-1)] == [i + 1 for i in range(16)]
        assert [int(x) for x in out["OUTPUT1"].reshape(-1)] == [i - 1 for i in range(16)]


def test_simple_identity_returns_its_strings(client: Client) -> None:
    text = np.array([[b"hello", "wörld".encode(), b""]], dtype=object)
    out = client.infer("simple_identity", {"INPUT0": text})["OUTPUT0"]
    assert out.tolist() == text.tolist()


def test_add_sub_example_gives_what_its_client_checks(client: Client) -> None:
    a = RNG.random(4).astype(np.float32)
    b = RNG.random(4).astype(np.float32)
    out = client.infer("add_sub", {"INPUT0": a, "INPUT1": b}, outputs=["OUTPUT0", "OUTPUT1"])
    assert np.allclose(a + b, out["OUTPUT0"]) and np.allclose(a - b, out["OUTPUT1"])


def test_auto_complete_example_configs_are_what_its_client_expects(server: Server) -> None:
    expected_io = [{"name": n, "data_type": "TYPE_FP32", "dims": [4]} for n in ("INPUT0", "INPUT1")]
    for name, batch in (("nobatch_auto_complete", 0), ("batch_auto_complete", 4)):
        config = server.model_config(name).to_triton_dict()
        assert config["max_batch_size"] == batch
        assert [{k: t[k] for k in ("name", "data_type", "dims")} for t in config["input"]] == expected_io
        assert [t["name"] for t in config["output"]] == ["OUTPUT0", "OUTPUT1"]
        assert ("dynamic_batching" in config) is bool(batch)
    out = server.infer(
        "batch_auto_complete", {"INPUT0": np.ones((2, 4), np.float32), "INPUT1": np.ones((2, 4), np.float32)}
    )
    np.testing.assert_array_equal(out["OUTPUT0"], np.full((2, 4), 2.0, np.float32))


@pytest.mark.parametrize("name", ["simple_sequence", "simple_dyna_sequence"])
def test_sequence_configs_parse_and_name_what_is_not_acted_on(name: str) -> None:
    config, warnings = load_config_file(CONFIGS / name / "config.pbtxt", default_name=name)
    assert config.inputs[0].name == "INPUT"
    assert any("'sequence_batching'" in w for w in warnings)


def test_decoupled_square_example_streams_what_its_client_expects(daemon: Daemon) -> None:
    # square_client.py: for IN = [n], n responses, each with OUT == [n].
    with Client(daemon.address, timeout=30) as client:
        for n in (0, 1, 4):
            with client.stream("square_int32", {"IN": np.array([n], np.int32)}) as responses:
                outs = [r["OUT"].tolist() for r in responses]
            assert outs == [[n]] * n
