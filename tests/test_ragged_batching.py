"""Ragged batching (``allow_ragged_batch``, ``batch_input``, ``batch_output``) as Triton does it.

From Triton's L0_batcher ``test_multi_batch_different_shape_allow_ragged``: requests whose shapes
differ only in an input that allows a ragged batch are batched together.  ONNX Runtime (and
TensorRT) models then get that input as one 1-D tensor of every request's elements, the
``batch_input`` tensors that say where each request's elements end, and give back outputs that a
``batch_output`` scatters by each request's input shape; a Python model gets each request as sent.
Checked through the daemon with ``tritonclient`` over gRPC; the gathering itself without sockets.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
from onnx import TensorProto, helper

from edge_server.backends.base import scatter
from edge_server.backends.ragged import RaggedPlan
from edge_server.config.parser import parse_config_text
from edge_server.errors import ConfigError
from edge_server.request import BatchItem
from tests.daemon import Daemon, free_port, kserve_flags

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

# Two requests meet at the preferred size 2; a request left alone would wait the whole delay.
BATCHING = "dynamic_batching { preferred_batch_size: [ 2 ], max_queue_delay_microseconds: 30000000 }"

ONNX_CONFIG = f"""
name: "ragged_onnx"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ], allow_ragged_batch: true }} ]
batch_input [
  {{ kind: BATCH_ACCUMULATED_ELEMENT_COUNT, target_name: "INDEX", data_type: TYPE_FP32,
     source_input: "INPUT0" }}
]
output [
  {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] }},
  {{ name: "ENDS", data_type: TYPE_FP32, dims: [ 1 ] }}
]
batch_output [
  {{ target_name: "OUTPUT0", kind: BATCH_SCATTER_WITH_INPUT_SHAPE, source_input: "INPUT0" }}
]
{BATCHING}
"""

PYTHON_CONFIG = f"""
name: "ragged_python"
backend: "python"
max_batch_size: 8
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ], allow_ragged_batch: true }} ]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] }} ]
{BATCHING}
"""
PYTHON_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]
            )
            for r in requests
        ]
"""


def _ragged_identity(path: Path) -> None:
    """OUTPUT0 = INPUT0 (1-D, every request's elements); ENDS = INDEX as a column, one row per request."""
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"]),
            helper.make_node("Unsqueeze", ["INDEX", "axis"], ["ENDS"]),
        ],
        "ragged",
        [
            helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["n"]),
            helper.make_tensor_value_info("INDEX", TensorProto.FLOAT, ["requests"]),
        ],
        [
            helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["n"]),
            helper.make_tensor_value_info("ENDS", TensorProto.FLOAT, ["requests", 1]),
        ],
        [helper.make_tensor("axis", TensorProto.INT64, [1], [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


@pytest.fixture(scope="module")
def grpc_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    repo = tmp_path_factory.mktemp("ragged") / "repo"
    (repo / "ragged_onnx").mkdir(parents=True)
    (repo / "ragged_onnx" / "config.pbtxt").write_text(textwrap.dedent(ONNX_CONFIG))
    _ragged_identity(repo / "ragged_onnx" / "1" / "model.onnx")
    (repo / "ragged_python" / "1").mkdir(parents=True)
    (repo / "ragged_python" / "config.pbtxt").write_text(textwrap.dedent(PYTHON_CONFIG))
    (repo / "ragged_python" / "1" / "model.py").write_text(textwrap.dedent(PYTHON_MODEL))
    root = tmp_path_factory.mktemp("sock")
    http_port, port = free_port(), free_port()
    daemon = Daemon(repo, f"ipc://{root}/r.sock", root / "r.log", *kserve_flags(http_port, port))
    daemon.start()
    try:
        yield port
    finally:
        assert daemon.stop() == 0, daemon.log()


def _send_two(port: int, model: str, sizes: tuple[int, int]) -> list[Any]:
    """Two requests of shapes [1, n] at once; their results in the order sent."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    answers: list[Any] = [None, None]
    try:
        futures = []
        for i, n in enumerate(sizes):
            tensor = grpcclient.InferInput("INPUT0", [1, n], "FP32")
            tensor.set_data_from_numpy(np.arange(n, dtype=np.float32).reshape(1, n) + 100 * i)
            done: list[Any] = []
            client.async_infer(
                model, [tensor], callback=lambda result, error, done=done: done.append(error or result)
            )
            futures.append(done)
        deadline = time.monotonic() + 60
        while not all(futures) and time.monotonic() < deadline:  # tritonclient's callbacks
            time.sleep(0.01)
        assert all(futures), "no answer within 60 s"
        answers = [done[0] for done in futures]
        stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    finally:
        client.close()
    for answer in answers:
        assert not isinstance(answer, Exception), answer
    batches = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats["batch_stats"]}
    assert batches == {2: 1}, stats  # one execution of both: batched although their shapes differ
    return answers


def test_an_onnx_model_gets_ragged_inputs_concatenated_with_their_ends(grpc_port: int) -> None:
    first, second = _send_two(grpc_port, "ragged_onnx", (16, 8))
    for i, (answer, n) in enumerate(((first, 16), (second, 8))):
        np.testing.assert_array_equal(
            answer.as_numpy("OUTPUT0"), np.arange(n, dtype=np.float32).reshape(1, n) + 100 * i
        )
    # INDEX holds where each request's elements end in the concatenated INPUT0, in batch order
    ends = sorted(float(a.as_numpy("ENDS")[0, 0]) for a in (first, second))
    assert ends in ([8.0, 24.0], [16.0, 24.0])


def test_a_python_model_gets_ragged_requests_batched_as_sent(grpc_port: int) -> None:
    first, second = _send_two(grpc_port, "ragged_python", (16, 8))
    assert first.as_numpy("OUTPUT0").shape == (1, 16)
    assert second.as_numpy("OUTPUT0").shape == (1, 8)


def _config(extra: str) -> Any:
    text = f"""
    name: "m"
    platform: "onnxruntime_onnx"
    max_batch_size: 8
    input [ {{ name: "X", data_type: TYPE_FP32, dims: [ -1, 2 ], allow_ragged_batch: true }} ]
    output [ {{ name: "Y", data_type: TYPE_FP32, dims: [ -1 ] }} ]
    {extra}
    """
    config, _ = parse_config_text(textwrap.dedent(text), source="m/config.pbtxt", default_name="m")
    return config


def _item(rows: int, length: int) -> BatchItem:
    return BatchItem(
        inputs={"X": np.ones((rows, length, 2), np.float32)}, batch_size=rows, requested_outputs=("Y",)
    )


@pytest.mark.parametrize(
    ("kind", "data_type", "expected"),
    [
        ("BATCH_ELEMENT_COUNT", "TYPE_INT32", [6, 16]),
        ("BATCH_ACCUMULATED_ELEMENT_COUNT", "TYPE_FP32", [6, 22]),
        ("BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO", "TYPE_INT32", [0, 6, 22]),
        ("BATCH_MAX_ELEMENT_COUNT_AS_SHAPE", "TYPE_INT32", [0] * 16),
        ("BATCH_ITEM_SHAPE", "TYPE_INT64", [[3, 2], [4, 2], [4, 2]]),
        ("BATCH_ITEM_SHAPE_FLATTEN", "TYPE_INT64", [3, 2, 4, 2, 4, 2]),
    ],
)
def test_each_batch_input_kind(kind: str, data_type: str, expected: list[Any]) -> None:
    config = _config(_batch_input(kind, "B", data_type, "X"))
    plan = RaggedPlan.of(config)
    assert plan is not None
    inputs = plan.gather([_item(1, 3), _item(2, 4)])
    assert inputs["X"].shape == (22,)  # ragged: every element of both requests, flattened
    assert inputs["B"].tolist() == expected
    assert (
        inputs["B"].dtype
        == {"TYPE_INT32": np.int32, "TYPE_FP32": np.float32, "TYPE_INT64": np.int64}[data_type]
    )


def test_a_batch_output_is_scattered_by_each_requests_input_shape() -> None:
    config = _config(
        'batch_output [ { target_name: "Y", kind: BATCH_SCATTER_WITH_INPUT_SHAPE, source_input: "X" } ]'
    )
    plan = RaggedPlan.of(config)
    assert plan is not None
    batch = [_item(1, 3), _item(2, 4)]
    results = scatter({"Y": np.arange(22, dtype=np.float32)}, batch, batched=True, by_shape=plan.by_shape)
    assert results[0]["Y"].shape == (1, 3, 2) and results[1]["Y"].shape == (2, 4, 2)
    assert results[1]["Y"].reshape(-1)[0] == 6


def _batch_input(kind: str, target: str, data_type: str, source: str) -> str:
    return (
        f'batch_input [ {{ kind: {kind}, target_name: "{target}", data_type: {data_type}, '
        f'source_input: "{source}" }} ]'
    )


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        (_batch_input("BATCH_ELEMENT_COUNT", "B", "TYPE_FP32", "Z"), "source_input"),
        (_batch_input("BATCH_ELEMENT_COUNT", "X", "TYPE_FP32", "X"), "target_name"),
        (_batch_input("BATCH_ELEMENT_COUNT", "B", "TYPE_STRING", "X"), "data_type"),
        (
            'batch_output [ { target_name: "Q", kind: BATCH_SCATTER_WITH_INPUT_SHAPE, source_input: "X" } ]',
            "target_name",
        ),
    ],
)
def test_batch_inputs_and_outputs_are_checked_at_load(extra: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        _config(extra)
