"""The in-process API on a Triton-style repository written the way a Triton user writes one."""

from __future__ import annotations

import asyncio
import logging
import re
import textwrap
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from edge_server import ModelState, Server
from edge_server.errors import (
    InvalidArgument,
    ModelExecutionError,
    ModelNotFound,
    ModelNotReady,
    ServerShuttingDown,
    Unavailable,
)
from edge_server.request import InferRequest
from edge_server.scheduler import inline
from tests.onnx_factory import affine_model

ADDER_CONFIG = """
name: "adder"
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy: { latest: { num_versions: 2 } }
input [
  {
    name: "INPUT0"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
output [
  {
    name: "OUTPUT0"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
instance_group [ { count: 2, kind: KIND_CPU } ]
dynamic_batching { max_queue_delay_microseconds: 100 }
optimization { cuda { graphs: true } }
"""

PY_CONFIG = """
name: "pyscale"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
"""

PY_MODEL = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        out = pb_utils.get_output_config_by_name(config, "OUT")
        self.dtype = pb_utils.triton_string_to_numpy(out["data_type"])
        self.version = int(args["model_version"])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if x.size and x[0] < 0:
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError("negative input rejected")))
                continue
            if x.size and x[0] == 999:
                raise RuntimeError("user code blew up")
            out = pb_utils.Tensor("OUT", (x * 3).astype(self.dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses

    def finalize(self):
        pass
"""


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    write(root / "adder" / "config.pbtxt", ADDER_CONFIG)
    affine_model(root / "adder" / "1" / "model.onnx", offset=1.0)
    affine_model(root / "adder" / "2" / "model.onnx", offset=2.0)
    affine_model(root / "adder" / "3" / "model.onnx", offset=3.0)
    (root / "adder" / "notes").mkdir()  # non-numeric: ignored
    write(root / "pyscale" / "config.pbtxt", PY_CONFIG)
    write(root / "pyscale" / "1" / "model.py", PY_MODEL)
    # No config.pbtxt at all: completed from the ONNX graph.
    affine_model(root / "noconfig" / "1" / "model.onnx", offset=5.0, dims=("n", 3))
    # default_model_filename instead of model.onnx.
    write(
        root / "renamed" / "config.pbtxt",
        'platform: "onnxruntime_onnx"\ndefault_model_filename: "custom.onnx"\nmax_batch_size: 0\n',
    )
    affine_model(root / "renamed" / "1" / "custom.onnx", offset=7.0, dims=(2,))
    affine_model(root / ".hidden" / "1" / "model.onnx")
    return root


@pytest.fixture
def server(repo: Path):
    with Server(repo) as srv:
        yield srv


def direct(path: Path, name: str, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {name: x})[0]


def test_repository_loads_with_triton_layout(server: Server) -> None:
    states = {(s.name, s.version): s.state for s in server.models()}
    assert states == {
        ("adder", 3): ModelState.READY,
        ("adder", 2): ModelState.READY,
        ("noconfig", 1): ModelState.READY,
        ("pyscale", 1): ModelState.READY,
        ("renamed", 1): ModelState.READY,
    }


def test_outputs_equal_direct_onnxruntime_bit_for_bit(server: Server, repo: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    for version in (2, 3):
        got = server.infer("adder", {"INPUT0": x}, version=version)["OUTPUT0"]
        want = direct(repo / "adder" / str(version) / "model.onnx", "INPUT0", x)
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    latest = server.infer("adder", {"INPUT0": x})["OUTPUT0"]
    np.testing.assert_array_equal(latest, x + 3.0)
    y = rng.standard_normal(2).astype(np.float32)
    np.testing.assert_array_equal(server.infer("renamed", {"INPUT0": y})["OUTPUT0"], y + 7.0)


def test_config_completed_from_onnx_graph(server: Server) -> None:
    config = server.model_config("noconfig")
    assert config.max_batch_size == 4  # every axis 0 is dynamic: Triton's default-max-batch-size
    assert config.inputs[0].name == "INPUT0" and config.inputs[0].dims == (3,)
    assert config.inputs[0].data_type == "TYPE_FP32"
    assert config.platform == "onnxruntime_onnx"
    x = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(server.infer("noconfig", {"INPUT0": x})["OUTPUT0"], x + 5.0)
    meta = server.model_metadata("adder")
    assert meta["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 4]}]
    assert meta["versions"] == ["2", "3"]


def test_unsupported_triton_field_warns_by_name(repo: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING), Server(repo):
        pass
    assert any("optimization.cuda" in r.getMessage() for r in caplog.records)


def test_python_model_triton_interface(server: Server) -> None:
    out = server.infer("pyscale", {"IN": np.array([1.0, 2.0], np.float32)})
    np.testing.assert_array_equal(out["OUT"], np.array([3.0, 6.0], np.float32))


def test_python_model_errors_are_per_request(server: Server) -> None:
    with pytest.raises(ModelExecutionError, match="negative input rejected"):
        server.infer("pyscale", {"IN": np.array([-1.0], np.float32)})
    with pytest.raises(ModelExecutionError, match="user code blew up"):
        server.infer("pyscale", {"IN": np.array([999.0], np.float32)})
    # The model and the server keep serving.
    assert server.infer("pyscale", {"IN": np.array([2.0], np.float32)})["OUT"][0] == 6.0


@pytest.mark.parametrize(
    ("model", "inputs", "kwargs", "error", "message"),
    [
        (
            "nope",
            {"INPUT0": np.zeros((1, 4), np.float32)},
            {},
            ModelNotFound,
            "Request for unknown model: 'nope' is not found",
        ),
        (
            "adder",
            {"INPUT0": np.zeros((1, 4), np.float32)},
            {"version": 1},
            ModelNotFound,
            "'adder' version 1 is not found",
        ),
        ("adder", {}, {}, InvalidArgument, r"missing required input\(s\) \['INPUT0'\]"),
        (
            "adder",
            {"INPUT0": np.zeros((1, 4), np.float32), "EXTRA": np.zeros(1)},
            {},
            InvalidArgument,
            r"expected 1 inputs but got 2 inputs for model 'adder'\. Got input\(s\) \['INPUT0','EXTRA'\]",
        ),
        ("adder", {"INPUT0": np.zeros((1, 4), np.float64)}, {}, InvalidArgument, "expected TYPE_FP32"),
        ("adder", {"INPUT0": np.zeros(4, np.float32)}, {}, InvalidArgument, r"expected shape \[batch, 4\]"),
        ("adder", {"INPUT0": np.zeros((1, 5), np.float32)}, {}, InvalidArgument, r"got \[1, 5\]"),
        ("adder", {"INPUT0": np.zeros((9, 4), np.float32)}, {}, InvalidArgument, "batch size 9"),
        ("adder", {"INPUT0": [[0.0] * 4]}, {}, InvalidArgument, "expected a numpy array"),
        (
            "adder",
            {"INPUT0": np.zeros((1, 4), np.float32)},
            {"outputs": ["NOPE"]},
            InvalidArgument,
            "unexpected inference output 'NOPE' for model 'adder'",
        ),
        ("adder", {"INPUT0": np.zeros((1, 4), np.float32)}, {"priority": -1}, InvalidArgument, "priority"),
        ("pyscale", {"IN": np.zeros((2, 2), np.float32)}, {}, InvalidArgument, r"expected shape \[-1\]"),
    ],
)
def test_bad_requests_get_precise_errors(
    server: Server, model: str, inputs: dict, kwargs: dict, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        server.infer(model, inputs, **kwargs)
    assert server.infer("adder", {"INPUT0": np.zeros((1, 4), np.float32)})["OUTPUT0"][0, 0] == 3.0


@pytest.mark.parametrize(
    ("config", "files", "reason"),
    [
        ("max_batch_sizee: 8\n", True, "max_batch_sizee"),
        (
            'platform: "onnxruntime_onnx"\ninput [{ name: "INPUT0", data_type: TYPE_FLOAT33, dims: [4] }]\n',
            True,
            "TYPE_FLOAT33",
        ),
        ('platform: "onnxruntime_onnx"\nmax_batch_size: 8\n', False, "model file 'model.onnx' is missing"),
        (
            'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
            'input [{ name: "INPUT0", data_type: TYPE_FP32, dims: [5] }]\n'
            'output [{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [4] }]\n',
            True,
            r"dims \[5\] but the ONNX model has \[4\]",
        ),
        (
            'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
            'input [{ name: "INPUT0", data_type: TYPE_INT32, dims: [4] }]\n',
            True,
            "data_type TYPE_INT32 but the ONNX model has TYPE_FP32",
        ),
        ("", None, "no config.pbtxt naming a backend"),
    ],
)
def test_broken_model_fails_alone(repo: Path, config: str, files: bool | None, reason: str) -> None:
    broken = repo / "broken"
    write(broken / "config.pbtxt", config)
    if files:
        affine_model(broken / "1" / "model.onnx")
    else:
        (broken / "1").mkdir(parents=True)
        if files is None:
            (broken / "config.pbtxt").unlink()
    with Server(repo) as server:
        (status,) = [s for s in server.models() if s.name == "broken"]
        assert status.state == ModelState.UNAVAILABLE
        assert re.search(reason, status.reason), status.reason
        with pytest.raises(ModelNotReady):
            server.infer("broken", {"INPUT0": np.zeros((1, 4), np.float32)})
        assert server.infer("adder", {"INPUT0": np.zeros((1, 4), np.float32)})["OUTPUT0"][0, 0] == 3.0


def test_version_policies(repo: Path) -> None:
    config = repo / "adder" / "config.pbtxt"
    for policy, expected in (
        ("{ all: {} }", [3, 2, 1]),
        ("{ specific: { versions: [1, 3] } }", [3, 1]),
        ("{ latest: { num_versions: 1 } }", [3]),
    ):
        config.write_text(ADDER_CONFIG.replace("{ latest: { num_versions: 2 } }", policy))
        with Server(repo) as server:
            assert [s.version for s in server.models() if s.name == "adder"] == expected


def test_async_infer_many_in_flight(server: Server) -> None:
    async def run() -> list[dict[str, np.ndarray]]:
        tasks = [server.infer_async("adder", {"INPUT0": np.full((1, 4), i, np.float32)}) for i in range(50)]
        return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    for i, out in enumerate(results):
        np.testing.assert_array_equal(out["OUTPUT0"], np.full((1, 4), i + 3.0, np.float32))


def test_statistics_count_requests(server: Server) -> None:
    for _ in range(3):
        server.infer("adder", {"INPUT0": np.zeros((2, 4), np.float32)})
    (stats,) = server.statistics("adder", version=3)
    assert stats["inference_count"] == 6
    assert stats["inference_stats"]["success"]["count"] == 3
    assert stats["execution_count"] <= 3
    assert stats["inference_stats"]["compute_infer"]["ns"] > 0


def test_control_mode_none_refuses_load(server: Server) -> None:
    with pytest.raises(
        Unavailable, match="explicit model load / unload is not allowed if polling is enabled"
    ):
        server.load_model("adder")


def test_explicit_mode_loads_only_named_models(repo: Path) -> None:
    with Server(repo, model_control_mode="explicit", load_models=["pyscale"]) as server:
        assert {s.name for s in server.models()} == {"pyscale"}
        with pytest.raises(ModelNotFound):
            server.infer("adder", {"INPUT0": np.zeros((1, 4), np.float32)})
        server.load_model("adder")
        assert server.infer("adder", {"INPUT0": np.zeros((1, 4), np.float32)})["OUTPUT0"][0, 0] == 3.0
        server.unload_model("adder")
        with pytest.raises(ModelNotReady, match="unloaded"):
            server.infer("adder", {"INPUT0": np.zeros((1, 4), np.float32)})


def test_closed_server_refuses_requests(repo: Path) -> None:
    server = Server(repo)
    server.close()
    with pytest.raises(ServerShuttingDown):
        server.infer("adder", {"INPUT0": np.zeros((1, 4), np.float32)})
    server.close()  # idempotent


def test_example_repository_digits_are_classified(example_repository: Path) -> None:
    with Server(example_repository) as server:
        for label in (0, 3, 7):
            x = np.load(example_repository / "digits" / "samples" / f"digit_{label}.npy")[None]
            assert int(server.infer("digits", {"image": x})["probabilities"].argmax()) == label


def test_cheap_unbatched_model_runs_in_the_callers_thread(server: Server) -> None:
    x = np.ones(2, np.float32)
    (before,) = server.statistics("renamed")
    sent = 0
    for _ in range(20):  # the scheduler learns the model's execution time from the first requests
        server.infer("renamed", {"INPUT0": x})
        sent += 1
    # Its average must be under the 200 us budget: on a loaded machine a few slow runs can push it over
    # for a while, so ask again (each run, fast or not, moves the average) rather than once.
    for _ in range(500):
        future = server.submit("renamed", {"INPUT0": x})
        sent += 1
        if future.done():  # no hand-off: it ran before submit() returned
            break
        future.result(10)
    assert future.done(), "no request ran in the caller's thread in 500 tries"
    np.testing.assert_array_equal(future.result()["OUTPUT0"], x + 7.0)
    # Inline runs count in the statistics like queued ones.
    (stats,) = server.statistics("renamed")
    count = stats["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"]
    assert count == sent


RESHAPE_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 2, 2 ], reshape: { shape: [ 4 ] } } ]
"""

RESHAPE_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
        return responses
"""

AUTO_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [2]})
        config.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [2]})
        config.set_max_batch_size(4)
        config.set_dynamic_batching()
        return config

    def execute(self, requests):
        return [{"OUT": pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 2} for r in requests]
"""


def test_output_reshape_is_undone_and_a_wrong_size_fails_alone(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write(repo / "reshaper" / "config.pbtxt", RESHAPE_CONFIG)
    write(repo / "reshaper" / "1" / "model.py", RESHAPE_MODEL)
    with Server(repo) as server:
        out = server.infer("reshaper", {"IN": np.arange(4, dtype=np.float32)})["OUT"]
        np.testing.assert_array_equal(out, np.arange(4, dtype=np.float32).reshape(2, 2))
        with pytest.raises(ModelExecutionError, match=r"cannot be reshaped to its config dims \[2, 2\]"):
            server.infer("reshaper", {"IN": np.arange(3, dtype=np.float32)})


def test_python_auto_complete_config_with_dynamic_batching(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write(repo / "auto" / "config.pbtxt", 'backend: "python"\n')
    write(repo / "auto" / "1" / "model.py", AUTO_MODEL)
    with Server(repo) as server:
        config = server.model_config("auto")
        assert config.max_batch_size == 4 and config.dynamic_batching is not None
        out = server.infer("auto", {"IN": np.ones((3, 2), np.float32)})["OUT"]
        np.testing.assert_array_equal(out, np.full((3, 2), 2.0, np.float32))


def test_empty_output_list_means_every_output(server: Server) -> None:
    out = server.infer("adder", {"INPUT0": np.zeros((1, 4), np.float32)}, outputs=[])
    assert list(out) == ["OUTPUT0"]


def test_variable_spatial_dims_load_without_a_config(tmp_path: Path) -> None:
    """A conv net on any image size: nothing made-up is run at load (Triton does not either)."""
    from onnx import TensorProto, helper, numpy_helper

    weights = numpy_helper.from_array(np.ones((2, 3, 3, 3), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["image", "w"], ["features"], pads=[1, 1, 1, 1])],
        "conv",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["n", 3, "h", "w"])],
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["n", 2, "h", "w"])],
        [weights],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "repo" / "conv" / "1" / "model.onnx"
    path.parent.mkdir(parents=True)
    path.write_bytes(model.SerializeToString())
    with Server(tmp_path / "repo") as server:
        for h, w in ((5, 7), (16, 9)):
            out = server.infer("conv", {"image": np.ones((1, 3, h, w), np.float32)})["features"]
            assert out.shape == (1, 2, h, w)
            assert out[0, 0, 2, 2] == 27.0  # 3 channels x 3 x 3 ones, away from the border


def test_unloaded_model_stays_unloaded_across_rescans_until_loaded(repo: Path) -> None:
    with Server(repo, model_control_mode="poll", watch_quiet_s=0.2) as server:
        server.unload_model("pyscale")
        affine_model(repo / "pyscale_extra" / "1" / "model.onnx")  # other changes are still picked up
        server.rescan()
        states = {s.name: s.state for s in server.models()}
        assert states["pyscale"] == ModelState.UNAVAILABLE and states["pyscale_extra"] == ModelState.READY
        with pytest.raises(ModelNotReady, match="unloaded"):
            server.infer("pyscale", {"IN": np.ones(1, np.float32)})
        server.load_model("pyscale")
        assert server.infer("pyscale", {"IN": np.ones(1, np.float32)})["OUT"][0] == 3.0


def test_run_here_answers_cheap_models_at_once(server: Server) -> None:
    """What a frontend that can answer at once calls: a future, done on return when it ran here."""
    x = np.array([1.0, 2.0], np.float32)
    here = []
    for _ in range(200):
        future = server.dataplane.run_here(
            InferRequest(model="renamed", inputs={"INPUT0": x}), inline.FRONTEND
        )
        here.append(future.done())
        np.testing.assert_array_equal(future.result()["OUTPUT0"], x + 7.0)
        if here[-5:] == [True] * 5:
            break
    # The first requests go through the queue, until the scheduler's timing of this cheap model (a
    # moving average that starts from a cold first run) falls under the inline budget; then it stays.
    assert here[-5:] == [True] * 5, here
    assert not here[0]
    stats = server.statistics("renamed")[0]
    assert stats["inference_stats"]["success"]["count"] == len(here)  # inline runs are counted too
    queued = server.dataplane.run_here(InferRequest(model="renamed", inputs={"INPUT0": x}), inline.QUEUE_ONLY)
    np.testing.assert_array_equal(queued.result()["OUTPUT0"], x + 7.0)
    batched = server.dataplane.run_here(
        InferRequest(model="adder", inputs={"INPUT0": np.ones((1, 4), np.float32)}), inline.FRONTEND
    )
    np.testing.assert_array_equal(batched.result()["OUTPUT0"], np.full((1, 4), 4.0, np.float32))
    with pytest.raises(InvalidArgument, match="expected shape"):
        server.dataplane.run_here(
            InferRequest(model="renamed", inputs={"INPUT0": np.ones(3, np.float32)}), inline.FRONTEND
        )
