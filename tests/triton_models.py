"""Models written the way Triton's python_backend examples and QA models are written (our own copies).

Used by the pb_utils and string tests, in-process and through the daemon.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# Reports what Triton hands a model: args, request accessors, the model dir; fails with a chosen
# TritonError code; exercises Logger and DLPack.
PROBE_CONFIG = """
name: "probe"
backend: "python"
max_batch_size: 0
input [ { name: "CODE", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [
  { name: "INFO", data_type: TYPE_STRING, dims: [ 1 ] },
  { name: "DL", data_type: TYPE_FP32, dims: [ 3 ] }
]
instance_group [ { count: 2, kind: KIND_CPU } ]
model_transaction_policy { decoupled: false }
optimization { input_pinned_memory { enable: true } }
parameters { key: "greeting" value: { string_value: "hello" } }
"""

PROBE_MODEL = """
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.args = dict(args)
        self.config = json.loads(args["model_config"])
        self.dir_at_init = pb_utils.get_model_dir()
        pb_utils.Logger.log_info(f"initialized {args['model_instance_name']}")

    def execute(self, requests):
        responses = []
        for request in requests:
            code = int(pb_utils.get_input_tensor_by_name(request, "CODE").as_numpy()[0])
            pb_utils.Logger.log_warn(f"code {code}")
            pb_utils.Logger.log_verbose("verbose detail")
            pb_utils.Logger.log("at error level", pb_utils.Logger.LogLevel.ERROR)
            if code == -1:
                raise pb_utils.TritonModelException("the model gave up")
            if code > 0:
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError(f"code {code} asked for", code)))
                continue
            info = {
                "args": self.args,
                "config": self.config,
                "dir_at_init": self.dir_at_init,
                "dir": pb_utils.get_model_dir(),
                "request_id": request.request_id(),
                "flags": request.flags(),
                "correlation_id": request.correlation_id(),
                "timeout": request.timeout(),
                "requested": request.requested_output_names(),
            }
            source = pb_utils.Tensor("x", np.arange(3, dtype=np.float32))
            dl = pb_utils.Tensor.from_dlpack("DL", source.to_dlpack())
            assert dl.triton_dtype() == 11  # TYPE_FP32
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor("INFO", np.array([json.dumps(info).encode()], dtype=object)),
                    dl,
                ],
                parameters={"instance": self.args["model_instance_name"], "ok": True},
            ))
        return responses
"""

# Strings through a Python model: reports the element types it received, answers with str (which
# must reach the client as bytes).
UPPER_CONFIG = """
name: "upper"
backend: "python"
max_batch_size: 8
input [ { name: "TEXT", data_type: TYPE_STRING, dims: [ -1 ] } ]
output [
  { name: "UPPER", data_type: TYPE_STRING, dims: [ -1 ] },
  { name: "TYPES", data_type: TYPE_STRING, dims: [ -1 ] }
]
"""

UPPER_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            upper = np.array([[t.decode("utf-8").upper() for t in row] for row in text], dtype=object)
            types = np.array([[type(t).__name__ for t in row] for row in text], dtype=object)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("UPPER", upper), pb_utils.Tensor("TYPES", types)]))
        return responses
"""


def string_onnx_bytes() -> bytes:
    """``SAME = Identity(TEXT)`` and ``EXCLAIMED = StringConcat(TEXT, "!")`` on a [n] string tensor."""
    suffix = numpy_helper.from_array(np.array(["!"], dtype=object), "suffix")
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["TEXT"], ["SAME"]),
            helper.make_node("StringConcat", ["TEXT", "suffix"], ["EXCLAIMED"]),
        ],
        "strings",
        [helper.make_tensor_value_info("TEXT", TensorProto.STRING, ["n"])],
        [
            helper.make_tensor_value_info("SAME", TensorProto.STRING, ["n"]),
            helper.make_tensor_value_info("EXCLAIMED", TensorProto.STRING, ["n"]),
        ],
        [suffix],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model.SerializeToString()


STRING_ONNX_CONFIG = """
name: "strings_onnx"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "TEXT", data_type: TYPE_STRING, dims: [ -1 ] } ]
output [
  { name: "SAME", data_type: TYPE_STRING, dims: [ -1 ] },
  { name: "EXCLAIMED", data_type: TYPE_STRING, dims: [ -1 ] }
]
"""


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def build(root: Path) -> Path:
    """A repository with the probe, the Python string model and the ONNX string model."""
    write(root / "probe" / "config.pbtxt", PROBE_CONFIG)
    write(root / "probe" / "1" / "model.py", PROBE_MODEL)
    write(root / "upper" / "config.pbtxt", UPPER_CONFIG)
    write(root / "upper" / "1" / "model.py", UPPER_MODEL)
    write(root / "strings_onnx" / "config.pbtxt", STRING_ONNX_CONFIG)
    (root / "strings_onnx" / "1").mkdir(parents=True)
    (root / "strings_onnx" / "1" / "model.onnx").write_bytes(string_onnx_bytes())
    return root
