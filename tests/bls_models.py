"""Python models that call other models (BLS), written the way Triton's python_backend BLS examples are.

* ``affine``: ONNX, ``OUTPUT0 = 2 * INPUT0 + 1`` (FP32 [4], batched up to 8 with dynamic batching).
* ``caller`` / ``caller2`` (the same code): ``OUTPUT0 = <target>(INPUT0) + 1`` through
  ``InferenceRequest(...).exec()``.  Request parameters steer it: ``target`` (default ``affine``),
  ``timeout_us`` for the BLS call, and ``next``: the target of the target (passed on as its
  parameters, so two callers can call each other).  A failed call's error is returned as the response.
* ``async_caller``: the same as ``caller`` with ``async def execute`` and ``await async_exec()``,
  every request of the batch in flight at once.
* ``stream_caller``: IN (INT32 [1]) = n -> ``square`` through ``exec(decoupled=True)``: COUNT of
  non-empty responses, SUM of their outputs, EMPTY: how many came without outputs (the bare final).
* ``async_stream_caller``: ``stream_caller`` with ``async def execute`` and
  ``await async_exec(decoupled=True)``.
* ``thread_caller``: decoupled; ``execute`` starts a thread that makes the BLS call to ``affine``
  and sends its answer (+1) after ``execute`` returned: BLS from the model's own threads.
* ``control``: per request parameter ``op`` (``ready``, ``load``, ``unload``) on model ``name``:
  READY (BOOL [1]) is ``is_model_ready`` afterwards; a refused operation is the response's error.
"""

from __future__ import annotations

from pathlib import Path

from tests.decoupled_models import add_decoupled_models
from tests.onnx_factory import affine_model

AFFINE_CONFIG = """
name: "affine"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
dynamic_batching { max_queue_delay_microseconds: 2000 }
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""

CALLER_CONFIG = """
name: "%(name)s"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1, 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1, 4 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""

CALLER_MODEL = """
import json

import triton_python_backend_utils as pb_utils


def bls_request(request):
    params = json.loads(request.parameters())
    x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
    passed_on = {}
    if "next" in params:
        passed_on = {"target": params["next"], "next": params["target"]}
        if "timeout_us" in params:
            passed_on["timeout_us"] = params["timeout_us"]
    return pb_utils.InferenceRequest(
        model_name=params.get("target", "affine"),
        requested_output_names=["OUTPUT0"],
        inputs=[pb_utils.Tensor("INPUT0", x)],
        parameters=passed_on,
        timeout=int(params.get("timeout_us", 0)),
    )


def answer(response):
    if response.has_error():
        return pb_utils.InferenceResponse(error=response.error())
    out = pb_utils.get_output_tensor_by_name(response, "OUTPUT0").as_numpy()
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT0", out + 1)])


class TritonPythonModel:
    def execute(self, requests):
        return [answer(bls_request(request).exec()) for request in requests]
"""

ASYNC_CALLER_MODEL = """
import asyncio
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        calls = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            calls.append(pb_utils.InferenceRequest(
                model_name="affine",
                requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.Tensor("INPUT0", x)],
            ).async_exec())
        responses = []
        for response in await asyncio.gather(*calls):
            if response.has_error():
                responses.append(pb_utils.InferenceResponse(error=response.error()))
                continue
            out = response.output_tensors()[0].as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out + 1)]))
        return responses
"""

STREAM_CALLER_CONFIG = """
name: "stream_caller"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [
  { name: "COUNT", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "SUM", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "EMPTY", data_type: TYPE_INT32, dims: [ 1 ] }
]
"""

STREAM_CALLER_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            n = pb_utils.get_input_tensor_by_name(request, "IN")
            call = pb_utils.InferenceRequest(
                model_name="square", requested_output_names=["OUT"], inputs=[n])
            count = total = empty = 0
            for response in call.exec(decoupled=True):
                if response.has_error():
                    raise pb_utils.TritonModelException(response.error().message())
                if not response.output_tensors():
                    empty += 1
                    continue
                count += 1
                total += int(pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()[0])
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("COUNT", np.array([count], np.int32)),
                pb_utils.Tensor("SUM", np.array([total], np.int32)),
                pb_utils.Tensor("EMPTY", np.array([empty], np.int32)),
            ]))
        return responses
"""

ASYNC_STREAM_CALLER_MODEL = STREAM_CALLER_MODEL.replace(
    "    def execute(self, requests):", "    async def execute(self, requests):"
).replace("call.exec(decoupled=True)", "await call.async_exec(decoupled=True)")

THREAD_CALLER_CONFIG = """
name: "thread_caller"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1, 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1, 4 ] } ]
"""

THREAD_CALLER_MODEL = """
import threading

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.threads = []

    def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            thread = threading.Thread(target=self.answer, args=(request.get_response_sender(), x))
            thread.start()
            self.threads.append(thread)
        return None

    def answer(self, sender, x):
        response = pb_utils.InferenceRequest(
            model_name="affine", requested_output_names=["OUTPUT0"], inputs=[pb_utils.Tensor("INPUT0", x)]
        ).exec()
        if response.has_error():
            sender.send(pb_utils.InferenceResponse(error=response.error()))
        else:
            out = response.output_tensors()[0].as_numpy() + 1
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", out)]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for thread in self.threads:
            thread.join()
"""

CONTROL_CONFIG = """
name: "control"
backend: "python"
max_batch_size: 0
input [ { name: "DUMMY", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "READY", data_type: TYPE_BOOL, dims: [ 1 ] } ]
"""

CONTROL_MODEL = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            params = json.loads(request.parameters())
            name = params["name"]
            try:
                if params["op"] == "load":
                    pb_utils.load_model(model_name=name)
                elif params["op"] == "unload":
                    pb_utils.unload_model(model_name=name)
            except pb_utils.TritonModelException as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
                continue
            ready = pb_utils.is_model_ready(model_name=name)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("READY", np.array([ready], np.bool_))]))
        return responses
"""


def _write(repo: Path, name: str, config: str, model: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    (repo / name / "1" / "model.py").write_text(model)


def add_bls_models(repo: Path, log: Path) -> None:
    """Write ``affine``, the callers, ``control`` and the decoupled models into ``repo``."""
    (repo / "affine").mkdir(parents=True)
    (repo / "affine" / "config.pbtxt").write_text(AFFINE_CONFIG)
    affine_model(repo / "affine" / "1" / "model.onnx", scale=2.0, offset=1.0)
    for name in ("caller", "caller2"):
        _write(repo, name, CALLER_CONFIG % {"name": name}, CALLER_MODEL)
    _write(repo, "async_caller", CALLER_CONFIG % {"name": "async_caller"}, ASYNC_CALLER_MODEL)
    _write(repo, "stream_caller", STREAM_CALLER_CONFIG, STREAM_CALLER_MODEL)
    async_config = STREAM_CALLER_CONFIG.replace('"stream_caller"', '"async_stream_caller"')
    _write(repo, "async_stream_caller", async_config, ASYNC_STREAM_CALLER_MODEL)
    _write(repo, "thread_caller", THREAD_CALLER_CONFIG, THREAD_CALLER_MODEL)
    _write(repo, "control", CONTROL_CONFIG, CONTROL_MODEL)
    add_decoupled_models(repo, log)
