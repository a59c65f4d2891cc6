"""A pipeline's next step runs on the pipeline's own worker thread when its model is idle.

Steps that exceed the inline budget (here: models that sleep 1 ms) still never run on a caller that
is not a scheduler worker (the application's thread here, the IPC frontend's in the daemon).
"""

from __future__ import annotations

import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_server import Server

# OUT names the thread that ran execute(); IN passes through as NEXT.  Sleeps: never cheap.
STEP = """
import threading
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.001)
        name = pb_utils.Tensor("OUT", np.array([threading.current_thread().name.encode()], object))
        inputs = [pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() for r in requests]
        return [pb_utils.InferenceResponse([name, pb_utils.Tensor("NEXT", x)]) for x in inputs]
"""

STEP_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: {max_batch}
input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ 2 ] }} ]
output [
  {{ name: "OUT", data_type: TYPE_STRING, dims: [ 1 ] }},
  {{ name: "NEXT", data_type: TYPE_FP32, dims: [ 2 ] }}
]
{extra}
"""

# BLS: calls ``callee`` and answers with its own thread's name and the callee's.
CALLER = """
import threading
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            target = "batched" if x[..., 0].item() > 0 else "step1"
            if target == "batched":
                x = x.reshape(1, 2)
            answer = pb_utils.InferenceRequest(
                model_name=target, inputs=[pb_utils.Tensor("IN", x)], requested_output_names=["OUT"]
            ).exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            theirs = pb_utils.get_output_tensor_by_name(answer, "OUT").as_numpy().reshape(1)
            mine = np.array([threading.current_thread().name.encode()], object)
            responses.append(
                pb_utils.InferenceResponse([pb_utils.Tensor("MINE", mine), pb_utils.Tensor("THEIRS", theirs)])
            )
        return responses
"""

CALLER_CONFIG = """
name: "caller"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [
  { name: "MINE", data_type: TYPE_STRING, dims: [ 1 ] },
  { name: "THEIRS", data_type: TYPE_STRING, dims: [ 1 ] }
]
"""

# BLS: returns what "step1" answers (the name of the thread that ran it); a step after step1 below.
BACK = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            answer = pb_utils.InferenceRequest(
                model_name="step1", inputs=[pb_utils.Tensor("IN", x)], requested_output_names=["OUT"],
                timeout=5_000_000,
            ).exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            out = pb_utils.get_output_tensor_by_name(answer, "OUT").as_numpy()
            tensors = [pb_utils.Tensor("OUT", out), pb_utils.Tensor("NEXT", x)]
            responses.append(pb_utils.InferenceResponse(tensors))
        return responses
"""

ENSEMBLE = """
name: "chain"
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 2 ] } ]
output [
  { name: "FIRST", data_type: TYPE_STRING, dims: [ 1 ] },
  { name: "SECOND", data_type: TYPE_STRING, dims: [ 1 ] }
]
ensemble_scheduling { step [
  { model_name: "step1" model_version: -1 input_map { key: "IN" value: "IN" }
    output_map { key: "OUT" value: "FIRST" } output_map { key: "NEXT" value: "mid" } },
  { model_name: "step2" model_version: -1 input_map { key: "IN" value: "mid" }
    output_map { key: "OUT" value: "SECOND" } }
] }
"""


def _write(repo: Path, name: str, config: str, source: str | None) -> None:
    (repo / name / "1").mkdir(parents=True)
    if source is not None:
        (repo / name / "1" / "model.py").write_text(textwrap.dedent(source))
    (repo / name / "config.pbtxt").write_text(config)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    for name in ("step1", "step2"):
        _write(tmp_path, name, STEP_CONFIG.format(name=name, max_batch=0, extra=""), STEP)
    batched = STEP_CONFIG.format(
        name="batched", max_batch=4, extra="dynamic_batching { max_queue_delay_microseconds: 100000 }"
    )
    _write(tmp_path, "batched", batched, STEP)
    _write(tmp_path, "caller", CALLER_CONFIG, CALLER)
    _write(tmp_path, "chain", ENSEMBLE, None)
    _write(tmp_path, "back", STEP_CONFIG.format(name="back", max_batch=0, extra=""), BACK)
    _write(tmp_path, "loop", ENSEMBLE.replace('"chain"', '"loop"').replace('"step2"', '"back"'), None)
    with Server(tmp_path) as srv:
        yield srv


def _infer(server: Server, model: str, x: np.ndarray) -> dict[str, np.ndarray]:
    return server.infer(model, {"IN": x})


def _name(array: np.ndarray) -> str:
    return bytes(array.reshape(-1)[0]).decode()


def test_costly_model_never_runs_on_an_application_thread(server: Server) -> None:
    x = np.zeros(2, np.float32)
    for _ in range(5):
        assert _name(_infer(server, "step1", x)["OUT"]) == "edge-step1_0"
    assert threading.current_thread().name != "edge-step1_0"


def test_python_step_after_a_step_goes_to_its_own_worker(server: Server) -> None:
    # A Python step may call models, so the worker that delivers step1 does not run it: it holds an
    # instance of step1 that the step could need (see test_step_that_calls_back_does_not_deadlock).
    x = np.zeros(2, np.float32)
    for _ in range(5):
        out = _infer(server, "chain", x)
        assert _name(out["FIRST"]) == "edge-step1_0"  # from the application thread: its worker
        assert _name(out["SECOND"]) == "edge-step2_0"
    (stats,) = server.statistics("step2")
    assert stats["inference_count"] == 5


def test_step_that_calls_back_does_not_deadlock(server: Server) -> None:
    # step1 (one instance) -> back, which calls step1: had back run on step1's worker, its call would
    # wait for that very instance.  It runs on its own worker, and its call to the idle step1 on it.
    for _ in range(3):
        out = _infer(server, "loop", np.zeros(2, np.float32))
        assert _name(out["FIRST"]) == "edge-step1_0"
        assert _name(out["SECOND"]) == "edge-back_0"


def test_bls_call_runs_on_the_calling_models_worker(server: Server) -> None:
    for _ in range(5):
        out = _infer(server, "caller", np.zeros(2, np.float32))
        assert _name(out["MINE"]) == "edge-caller_0"
        assert _name(out["THEIRS"]) == "edge-caller_0"


def test_idle_batching_model_called_from_a_pipeline_does_not_wait_for_its_delay(server: Server) -> None:
    # The 100 ms queue delay is not waited for: the idle instance runs the call on the caller's thread.
    for _ in range(3):
        out = _infer(server, "caller", np.ones(2, np.float32))
        assert _name(out["THEIRS"]) == "edge-caller_0"
    (stats,) = server.statistics("batched")
    assert stats["execution_count"] == 3
