"""Decoupled Python models written the way Triton's python_backend examples and QA models write them.

``repeat``: like Triton's ``repeat_int32`` example: IN (INT32 [n]) and DELAY (UINT32 [n], ms) ->
one response per element, OUT = that element and IDX = its index, sent from a thread of the model
*after* ``execute`` returned, then the final flag alone.  It stops early when the request is cancelled
and records (in a file named by the ``log`` parameter) how many responses it sent.

``square``: like Triton's ``square_int32``: IN (INT32 [1]) = n -> n responses with OUT = n * n, sent
inside ``execute``, the last one carrying the final flag; n = 0 sends the final flag alone.

``flaky``: one response, then an error response (``InferenceResponse(error=TritonError(...))``), then
another response and the final flag; IN < 0 makes ``execute`` raise before sending anything.
"""

from __future__ import annotations

from pathlib import Path

REPEAT_CONFIG = """
name: "repeat"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "IN", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "DELAY", data_type: TYPE_UINT32, dims: [ -1 ] }
]
output [
  { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "IDX", data_type: TYPE_UINT32, dims: [ 1 ] }
]
instance_group [ { count: 1, kind: KIND_CPU } ]
parameters [ { key: "log", value: { string_value: "%(log)s" } } ]
"""

REPEAT_MODEL = """
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.log = json.loads(args["model_config"])["parameters"]["log"]["string_value"]
        self.threads = []

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            delays = pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy()
            sender = request.get_response_sender()
            thread = threading.Thread(target=self.respond, args=(request, sender, values, delays))
            thread.start()
            self.threads.append(thread)
        return None

    def respond(self, request, sender, values, delays):
        sent = 0
        for index, (value, delay) in enumerate(zip(values, delays)):
            if request.is_cancelled():
                break
            time.sleep(delay / 1000.0)
            out = pb_utils.Tensor("OUT", np.array([value], dtype=np.int32))
            idx = pb_utils.Tensor("IDX", np.array([index], dtype=np.uint32))
            sender.send(pb_utils.InferenceResponse(output_tensors=[out, idx]))
            sent += 1
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        with open(self.log, "a") as f:
            f.write(f"{sent} {int(request.is_cancelled())}\\n")

    def finalize(self):
        for thread in self.threads:
            thread.join()
"""

SQUARE_CONFIG = """
name: "square"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
"""

SQUARE_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(n):
                out = pb_utils.Tensor("OUT", np.array([n * n], dtype=np.int32))
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if i == n - 1 else 0
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]), flags=flags)
            if n == 0:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

FLAKY_CONFIG = """
name: "flaky"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""

FLAKY_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            if n < 0:
                raise ValueError("negative input")
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1], np.int32))]))
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("second response failed")))
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([3], np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def add_decoupled_models(repo: Path, log: Path) -> None:
    """Write ``repeat``, ``square`` and ``flaky`` into ``repo``; ``repeat`` records into ``log``."""
    models = {
        "repeat": (REPEAT_CONFIG % {"log": log}, REPEAT_MODEL),
        "square": (SQUARE_CONFIG, SQUARE_MODEL),
        "flaky": (FLAKY_CONFIG, FLAKY_MODEL),
    }
    for name, (config, source) in models.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(config)
        (repo / name / "1" / "model.py").write_text(source)


PARAMS_CONFIG = """
name: "params"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "PARAMS", data_type: TYPE_STRING, dims: [ 1 ] } ]
"""

# Echoes what the request carried: parameters() (a JSON string, as in Triton), request_id(),
# correlation_id() and flags().
PARAMS_MODEL = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            seen = {
                "parameters": json.loads(request.parameters()),
                "request_id": request.request_id(),
                "correlation_id": request.correlation_id(),
                "flags": request.flags(),
            }
            out = np.array([json.dumps(seen).encode()], dtype=object)
            echoed = {"seen": len(seen["parameters"]), "model": "params", "echo": True}
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("PARAMS", out)], parameters=echoed))
        return responses
"""


def add_params_model(repo: Path) -> None:
    (repo / "params" / "1").mkdir(parents=True)
    (repo / "params" / "config.pbtxt").write_text(PARAMS_CONFIG)
    (repo / "params" / "1" / "model.py").write_text(PARAMS_MODEL)
