"""The anchor workloads of bench_triton.py as one Triton model repository, served unchanged by both servers.

Three ONNX graphs with seeded weights, each served twice from the same file:

* ``<name>_py``: a Triton python_backend model (``1/model.py``) that runs ``1/model.onnx`` with an ONNX
  Runtime session at its defaults.  Triton runs it in its python_backend stub process; edge-server runs
  the very same file in its own process.  This is the like-for-like comparison.
* ``<name>_onnx``: ``backend: "onnxruntime"`` on the same file, for edge-server only (the Triton build
  that PyTriton ships has no onnxruntime backend): what a user of our ONNX backend gets.

The workloads (the ones issue #16 anchors its figures on):

* ``tiny``: FP32 [B, 16] -> [B, 16] (a 16 x 16 matrix product plus bias): the cost of a round trip;
* ``cnn``: FP32 [1, 3, 224, 224] -> [1, 10], five 3x3 conv/ReLU/max-pool stages and a linear head,
  about 1.4 GFLOP per image: a model whose compute dominates;
* ``frame``: a 1080p RGB UINT8 frame [1080, 1920, 3] -> its three channel means: the cost of moving
  6.2 MB into the model.

And one ``model.py`` without a graph, ``accel_py`` (:func:`accelerator_model`): the CNN's input and output,
and :data:`ACCEL_MS` of work off the CPU (it sleeps with the GIL released), standing in for a TensorRT
engine on a Jetson's GPU or DLA, where the CPU is the servers' own and not the model's.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SEED = 0
CNN_SIZE = 224
CNN_CHANNELS = (3, 32, 64, 128, 128, 256)  # each conv is followed by a 2x2 max pool: 224 -> 7
CNN_CLASSES = 10
FRAME_SHAPE = (1080, 1920, 3)

MODEL_PY = '''
"""Runs the ONNX file beside this one with ONNX Runtime at its defaults, one request at a time."""
import json
import os

import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
        self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        self.input = config["input"][0]["name"]
        self.output = config["output"][0]["name"]
        self.feed_name = self.session.get_inputs()[0].name

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, self.input).as_numpy()
            y = self.session.run([self.output], {self.feed_name: x})[0]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(self.output, y)]))
        return responses
'''

CONFIG = """
name: "{name}"
backend: "{backend}"
max_batch_size: 0
input [ {{ name: "{input}", data_type: {in_type}, dims: {in_dims} }} ]
output [ {{ name: "{output}", data_type: TYPE_FP32, dims: {out_dims} }} ]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
"""


ACCEL = "accel_py"
#: The accelerator stand-in's time per request: about what a small detector takes on an Orin's GPU.
ACCEL_MS = 4.0
ACCEL_PY = """
\"\"\"Stands in for a model whose work runs on an accelerator: it sleeps, the CPU and the GIL free.\"\"\"
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "input").as_numpy()
            time.sleep({seconds})  # the accelerator's time: the CPU and the GIL are free meanwhile
            y = np.full((1, 10), float(x[0, 0, 0, 0]), np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("logits", y)]))
        return responses
"""


@dataclass(frozen=True)
class Workload:
    name: str
    input: str
    output: str
    in_type: str
    in_dims: str
    out_dims: str


WORKLOADS = (
    Workload("tiny", "INPUT", "OUTPUT", "TYPE_FP32", "[ -1, 16 ]", "[ -1, 16 ]"),
    Workload("cnn", "input", "logits", "TYPE_FP32", f"[ 1, 3, {CNN_SIZE}, {CNN_SIZE} ]", "[ 1, 10 ]"),
    Workload("frame", "frame", "means", "TYPE_UINT8", "[ -1, -1, 3 ]", "[ 3 ]"),
)


def _init(name: str, array: np.ndarray):
    from onnx import numpy_helper

    return numpy_helper.from_array(np.asarray(array, np.float32), name)


def _save(graph, path: Path) -> None:
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # onnxruntime >= 1.11 loads IR 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())


def tiny_graph(path: Path) -> None:
    from onnx import TensorProto, helper

    rng = np.random.default_rng(SEED)
    nodes = [
        helper.make_node("MatMul", ["INPUT", "w"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["OUTPUT"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, ["batch", 16])],
        [_init("w", rng.normal(size=(16, 16))), _init("b", rng.normal(size=16))],
    )
    _save(graph, path)


def cnn_flops(size: int = CNN_SIZE, channels: tuple[int, ...] = CNN_CHANNELS) -> float:
    """Multiply-adds x 2 of the convolutions and the head, per image."""
    flops = 0.0
    for cin, cout in zip(channels[:-1], channels[1:], strict=True):
        flops += 2 * size * size * cout * cin * 9
        size //= 2
    return flops + 2 * channels[-1] * CNN_CLASSES


def cnn_graph(
    path: Path, size: int = CNN_SIZE, channels: tuple[int, ...] = CNN_CHANNELS, batch: int | str = 1
) -> None:
    """The anchor CNN; other sizes, channels and a named (dynamic) batch axis for bench_batch_cost.py."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(SEED)
    nodes, inits, x = [], [], "input"
    for i, (cin, cout) in enumerate(zip(channels[:-1], channels[1:], strict=True), start=1):
        w = rng.normal(0.0, np.sqrt(2.0 / (cin * 9)), size=(cout, cin, 3, 3))
        inits += [_init(f"conv{i}.w", w), _init(f"conv{i}.b", np.zeros(cout))]
        nodes += [
            helper.make_node(
                "Conv", [x, f"conv{i}.w", f"conv{i}.b"], [f"conv{i}"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]
            ),
            helper.make_node("Relu", [f"conv{i}"], [f"relu{i}"]),
            helper.make_node("MaxPool", [f"relu{i}"], [f"pool{i}"], kernel_shape=[2, 2], strides=[2, 2]),
        ]
        x = f"pool{i}"
    fc_w = rng.normal(0.0, np.sqrt(2.0 / channels[-1]), size=(CNN_CLASSES, channels[-1]))
    inits += [_init("fc.w", fc_w), _init("fc.b", np.zeros(CNN_CLASSES))]
    nodes += [
        helper.make_node("GlobalAveragePool", [x], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["features"], axis=1),
        helper.make_node("Gemm", ["features", "fc.w", "fc.b"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, channels[0], size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, CNN_CLASSES])],
        inits,
    )
    _save(graph, path)


def frame_graph(path: Path) -> None:
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Cast", ["frame"], ["pixels"], to=TensorProto.FLOAT),
        helper.make_node("ReduceMean", ["pixels"], ["means"], axes=[0, 1], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "frame",
        [helper.make_tensor_value_info("frame", TensorProto.UINT8, ["h", "w", 3])],
        [helper.make_tensor_value_info("means", TensorProto.FLOAT, [3])],
    )
    _save(graph, path)


GRAPHS = {"tiny": tiny_graph, "cnn": cnn_graph, "frame": frame_graph}


def build_repository(repo: Path, onnx_backend: bool = True) -> Path:
    """Write the repository under ``repo``: ``<name>_py`` for each workload, and ``<name>_onnx`` too."""
    for workload in WORKLOADS:
        kinds = [("py", "python")] + ([("onnx", "onnxruntime")] if onnx_backend else [])
        for suffix, backend in kinds:
            name = f"{workload.name}_{suffix}"
            version = repo / name / "1"
            GRAPHS[workload.name](version / "model.onnx")
            if backend == "python":
                (version / "model.py").write_text(textwrap.dedent(MODEL_PY).lstrip())
            (repo / name / "config.pbtxt").write_text(
                CONFIG.format(
                    name=name,
                    backend=backend,
                    input=workload.input,
                    output=workload.output,
                    in_type=workload.in_type,
                    in_dims=workload.in_dims,
                    out_dims=workload.out_dims,
                )
            )
    accelerator_model(repo)
    return repo


def accelerator_model(repo: Path, name: str = ACCEL, compute_ms: float = ACCEL_MS) -> Path:
    """Write ``name``: the CNN's input and output, ``compute_ms`` off the CPU, answering ``x[0, 0, 0, 0]``."""
    cnn = next(w for w in WORKLOADS if w.name == "cnn")
    (repo / name / "1").mkdir(parents=True)
    source = ACCEL_PY.format(seconds=compute_ms / 1000)
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(source).lstrip())
    (repo / name / "config.pbtxt").write_text(
        CONFIG.format(
            name=name,
            backend="python",
            input=cnn.input,
            output=cnn.output,
            in_type=cnn.in_type,
            in_dims=cnn.in_dims,
            out_dims=cnn.out_dims,
        )
    )
    return repo / name


def python_models() -> list[str]:
    return [f"{w.name}_py" for w in WORKLOADS] + [ACCEL]


def sample_inputs(seed: int = 1) -> dict[str, np.ndarray]:
    """One input per workload, in the shapes the configs declare."""
    rng = np.random.default_rng(seed)
    return {
        "tiny": rng.standard_normal((1, 16)).astype(np.float32),
        "cnn": rng.standard_normal((1, 3, CNN_SIZE, CNN_SIZE)).astype(np.float32),
        "frame": rng.integers(0, 256, FRAME_SHAPE, dtype=np.uint8),
    }
