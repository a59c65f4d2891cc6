"""The one builder of tiny ONNX models for tests and benchmarks: ``y = x * scale + offset`` (FP32).

Hot-reload tests and the reload benchmark give version ``k`` of a model ``offset=k``, so every answer
names the version that produced it; ``pad_bytes`` makes a model as large as a real one, in its file and
in the memory of the session that loads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def affine_bytes(
    *,
    offset: float = 1.0,
    scale: float = 1.0,
    dims: tuple[int | str, ...] = ("batch", 4),
    input_name: str = "INPUT0",
    output_name: str = "OUTPUT0",
    pad_bytes: int = 0,
) -> bytes:
    """The serialized model ``output = input * scale + offset``; string dims are symbolic axes.

    ``pad_bytes`` > 0 adds a weight matrix of about that many bytes (zeros, last dim a number).  The
    graph multiplies the input by it and adds the sum times 0: ONNX Runtime cannot fold an initializer
    that depends on the input away, so each load allocates the weights and each unload frees them, while
    the answer stays ``x * scale + offset`` for finite inputs.
    """
    inp = helper.make_tensor_value_info(input_name, TensorProto.FLOAT, list(dims))
    out = helper.make_tensor_value_info(output_name, TensorProto.FLOAT, list(dims))
    nodes = [helper.make_node("Mul", [input_name, "scale"], ["scaled"])]
    inits = [
        numpy_helper.from_array(np.array(scale, dtype=np.float32), "scale"),
        numpy_helper.from_array(np.array(offset, dtype=np.float32), "offset"),
    ]
    if pad_bytes > 0:
        rows = dims[-1]
        if not isinstance(rows, int):
            raise ValueError(f"pad_bytes needs a fixed last dimension, got dims {dims}")
        columns = max(1, pad_bytes // (4 * rows))
        nodes += [
            helper.make_node("MatMul", [input_name, "pad"], ["wide"]),
            helper.make_node("ReduceSum", ["wide", "last_axis"], ["summed"], keepdims=1),
            helper.make_node("Mul", ["summed", "zero"], ["nothing"]),
            helper.make_node("Add", ["scaled", "nothing"], ["padded"]),
        ]
        inits += [
            numpy_helper.from_array(np.zeros((rows, columns), dtype=np.float32), "pad"),
            numpy_helper.from_array(np.array([-1], dtype=np.int64), "last_axis"),
            numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero"),
        ]
    nodes.append(helper.make_node("Add", [nodes[-1].output[0], "offset"], [output_name]))
    graph = helper.make_graph(nodes, "affine", [inp], [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def affine_model(path: Path, **options: Any) -> Path:
    """Write :func:`affine_bytes` (same keyword options) to ``path``, creating its directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(affine_bytes(**options))
    return path
