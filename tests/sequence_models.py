"""Stateful test models for the sequence batcher, and Triton's expected outputs for them.

* ``simple_sequence`` (ONNX): Triton's example of that name: INPUT, START and READY (INT32) ->
  ``OUTPUT = (INPUT + START) * READY``.  Triton's sequence clients send ``[0] + values`` and
  ``[100] + -values`` and expect ``1, values...`` and ``101, -values...``.
* ``accumulate`` (ONNX, implicit state): ``ACC_OUT = ACC_IN + INPUT``, ``OUTPUT = ACC_OUT``: the running
  sum of a sequence, with the state kept by the server (reset to zeros at START).
* ``smoother`` (ONNX, implicit state, FP32 [4]): ``S_OUT = 0.5 * S_IN + x``, ``y = 2 * S_OUT``; the
  test runs the same graph by hand, carrying the state, and compares.
* ``dyna`` (Python): START/END/READY/CORRID control inputs; a running sum per correlation id kept by
  the model itself, plus the correlation id on the END request (Triton's ``simple_dyna_sequence``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: Triton's sequence example values (simple_grpc_sequence_sync_infer_client.py).
VALUES = [11, 7, 5, 3, 2, 0, 1]


def triton_expected(first: int, values: list[int]) -> list[int]:
    """What Triton's simple_sequence returns for ``[first] + values``: first + 1, then each value."""
    return [first + 1, *values]


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def _int(name: str) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.INT32, ["batch", 1])


def simple_sequence_onnx(path: Path) -> Path:
    nodes = [
        helper.make_node("Add", ["INPUT", "START"], ["sum"]),
        helper.make_node("Mul", ["sum", "READY"], ["OUTPUT"]),
    ]
    graph = helper.make_graph(
        nodes, "simple_sequence", [_int("INPUT"), _int("START"), _int("READY")], [_int("OUTPUT")]
    )
    return _save(graph, path)


def accumulate_onnx(path: Path, *, offset: int = 0) -> Path:
    """``ACC_OUT = ACC_IN + INPUT``; ``OUTPUT = ACC_OUT + offset`` (a reload test tells versions apart)."""
    nodes = [
        helper.make_node("Add", ["ACC_IN", "INPUT"], ["ACC_OUT"]),
        helper.make_node("Add", ["ACC_OUT", "offset"], ["OUTPUT"]),
    ]
    init = [numpy_helper.from_array(np.array(offset, np.int32), "offset")]
    graph = helper.make_graph(
        nodes, "accumulate", [_int("INPUT"), _int("ACC_IN")], [_int("OUTPUT"), _int("ACC_OUT")], init
    )
    return _save(graph, path)


def smoother_graph() -> onnx.GraphProto:
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Mul", ["S_IN", "half"], ["decayed"]),
        helper.make_node("Add", ["decayed", "x"], ["S_OUT"]),
        helper.make_node("Mul", ["S_OUT", "two"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
    ]
    return helper.make_graph(
        nodes,
        "smoother",
        [
            helper.make_tensor_value_info("x", f, ["batch", 4]),
            helper.make_tensor_value_info("S_IN", f, ["batch", 4]),
        ],
        [
            helper.make_tensor_value_info("y", f, ["batch", 4]),
            helper.make_tensor_value_info("S_OUT", f, ["batch", 4]),
        ],
        inits,
    )


def smoother_onnx(path: Path) -> Path:
    return _save(smoother_graph(), path)


CONTROLS = """
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }
  ]
"""


def simple_sequence_config(
    name: str, strategy: str, *, max_batch_size: int = 8, idle_us: int = 5_000_000, count: int = 1
) -> str:
    return f"""
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: {max_batch_size}
sequence_batching {{
  max_sequence_idle_microseconds: {idle_us}
  {strategy}
  {CONTROLS}
}}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: {count} }} ]
"""


def accumulate_config(
    name: str,
    strategy: str,
    *,
    max_batch_size: int = 8,
    idle_us: int = 5_000_000,
    initial: str = "",
    count: int = 1,
) -> str:
    return f"""
name: "{name}"
backend: "onnxruntime"
max_batch_size: {max_batch_size}
sequence_batching {{
  max_sequence_idle_microseconds: {idle_us}
  {strategy}
  state [ {{ input_name: "ACC_IN" output_name: "ACC_OUT" data_type: TYPE_INT32 dims: [ 1 ] {initial} }} ]
}}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: {count} }} ]
"""


SMOOTHER_CONFIG = """
name: "smoother"
backend: "onnxruntime"
max_batch_size: 16
sequence_batching {
  oldest { max_candidate_sequences: 32 max_queue_delay_microseconds: 500 }
  state [ { input_name: "S_IN" output_name: "S_OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
}
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

DYNA_CONFIG = """
name: "dyna"
backend: "python"
max_batch_size: 4
sequence_batching {
  oldest { max_candidate_sequences: 8 }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END bool_false_true: [ false, true ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

DYNA_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            get = lambda name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()
            corrid = int(get("CORRID")[0, 0])
            assert corrid == request.correlation_id(), (corrid, request.correlation_id())
            start = get("START")[0, 0] == 1.0
            assert bool(start) == bool(request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START)
            end = bool(get("END")[0, 0])
            assert get("READY")[0, 0] == 1
            value = int(get("INPUT")[0, 0])
            total = value if start else self.sums[corrid] + value
            self.sums[corrid] = total
            if end:
                del self.sums[corrid]
                total += corrid
            out = np.array([[total]], dtype=np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        return responses
"""

DIRECT = "direct { }"
OLDEST = "oldest { max_candidate_sequences: 16 }"


def write_model(repo: Path, name: str, config: str, build: object = None, *, python: str = "") -> None:
    """``repo/name`` with ``config.pbtxt`` and version 1 built by ``build(path)`` or from ``python``."""
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    (repo / name / "config.pbtxt").write_text(config)
    if python:
        (repo / name / "1" / "model.py").write_text(python)
    elif callable(build):
        build(repo / name / "1" / "model.onnx")


def corrid_echo_onnx(path: Path) -> Path:
    """INPUT (INT32) -> OUTPUT; the string CORRID control input -> ECHO (the model sees the id)."""
    corrid = helper.make_tensor_value_info("CORRID", TensorProto.STRING, ["batch", 1])
    echo = helper.make_tensor_value_info("ECHO", TensorProto.STRING, ["batch", 1])
    nodes = [
        helper.make_node("Identity", ["INPUT"], ["OUTPUT"]),
        helper.make_node("Identity", ["CORRID"], ["ECHO"]),
    ]
    return _save(helper.make_graph(nodes, "echo", [_int("INPUT"), corrid], [_int("OUTPUT"), echo]), path)


CORRID_ECHO_CONFIG = """
name: "echo"
backend: "onnxruntime"
max_batch_size: 4
sequence_batching {
  control_input [ { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] } ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "ECHO" data_type: TYPE_STRING dims: [ 1 ] }
]
"""


def history_onnx(path: Path) -> Path:
    """A growing state: ``H_OUT = concat(H_IN, INPUT)`` (a column more each step); ``OUTPUT = sum(H_OUT)``."""
    history_in = helper.make_tensor_value_info("H_IN", TensorProto.INT32, ["batch", "steps"])
    history_out = helper.make_tensor_value_info("H_OUT", TensorProto.INT32, ["batch", "steps_out"])
    nodes = [
        helper.make_node("Concat", ["H_IN", "INPUT"], ["H_OUT"], axis=1),
        helper.make_node("ReduceSum", ["H_OUT", "axis"], ["OUTPUT"], keepdims=1),
    ]
    init = [numpy_helper.from_array(np.array([1], np.int64), "axis")]
    graph = helper.make_graph(
        nodes, "history", [_int("INPUT"), history_in], [_int("OUTPUT"), history_out], init
    )
    return _save(graph, path)


def history_config(strategy: str) -> str:
    return f"""
name: "history"
backend: "onnxruntime"
max_batch_size: 4
sequence_batching {{
  {strategy}
  state [ {{ input_name: "H_IN" output_name: "H_OUT" data_type: TYPE_INT32 dims: [ -1 ]
            initial_state {{ data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "empty" }} }} ]
}}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""
