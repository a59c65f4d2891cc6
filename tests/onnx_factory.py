"""Tiny ONNX models for tests, built with onnx.helper: ``y = x * scale + offset`` with a chosen shape."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def affine_model(
    path: Path,
    *,
    offset: float = 1.0,
    scale: float = 1.0,
    dims: tuple[int | str, ...] = ("batch", 4),
    input_name: str = "INPUT0",
    output_name: str = "OUTPUT0",
) -> Path:
    """Write ``output = input * scale + offset`` (FP32) to ``path``; string dims are symbolic axes."""
    inp = helper.make_tensor_value_info(input_name, TensorProto.FLOAT, list(dims))
    out = helper.make_tensor_value_info(output_name, TensorProto.FLOAT, list(dims))
    nodes = [
        helper.make_node("Mul", [input_name, "scale"], ["scaled"]),
        helper.make_node("Add", ["scaled", "offset"], [output_name]),
    ]
    inits = [
        numpy_helper.from_array(np.array(scale, dtype=np.float32), "scale"),
        numpy_helper.from_array(np.array(offset, dtype=np.float32), "offset"),
    ]
    graph = helper.make_graph(nodes, "affine", [inp], [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())
    return path
