"""Python models behave as in Triton's python_backend where Triton's own QA models rely on it.

What Triton's QA expects (L0_backend_python: python_test, decoupled, lifecycle, response_sender,
parameters):
* a TYPE_STRING output may hold any objects: what is not bytes leaves as ``str(item)`` in UTF-8;
* an output leaves with the type the model gave it (an int64 array for a TYPE_INT32 output reaches
  the client as INT64: Triton does not cast);
* ``exec(decoupled=True)`` returns an iterator with ``cancel()``: the called model sees
  ``is_cancelled()``, and what it still sends (a CANCELLED error, or more responses when it ignores
  the cancellation) is still delivered; the same from ``await async_exec(decoupled=True)`` and from a
  model in its own process;
* a decoupled model whose ``execute`` returns responses gets Triton's error to its client (no hang);
* ``TritonError.UNKNOWN`` is gRPC UNKNOWN, ``ALREADY_EXISTS`` is ALREADY_EXISTS;
* ``pb_utils.Logger.INFO`` and the other levels; ``InferenceRequest(model_name=...)`` takes the
  ``bytes`` that ``as_numpy()[0]`` gives for a TYPE_STRING input;
* BLS responses carry the called model's response parameters.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from edge_server import Server
from edge_server.client import Client
from edge_server.errors import EdgeServerError
from tests.daemon import Daemon, free_port, kserve_flags

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

STRINGLY = (
    """
name: "stringly"
backend: "python"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [
  { name: "TEXT", data_type: TYPE_STRING, dims: [ 5 ] },
  { name: "WIDE", data_type: TYPE_INT32, dims: [ 2 ] }
]
""",
    """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        pb_utils.Logger.log("levels are on the class", pb_utils.Logger.WARNING)
        pb_utils.Logger.log("and the enum", pb_utils.Logger.LogLevel.INFO)
        text = np.array([1, 2.5, None, "x", b"y"], dtype=np.object_)
        wide = np.array([1, 2 ** 40])  # int64, for a TYPE_INT32 output
        return [pb_utils.InferenceResponse([pb_utils.Tensor("TEXT", text), pb_utils.Tensor("WIDE", wide)])
                for _ in requests]
""",
)

# Repeats INPUT every DELAY ms until cancelled (then a CANCELLED error, final) or COUNT responses.
UNTIL_CANCELLED = (
    """
name: "until_cancelled"
backend: "python"
max_batch_size: 0
input [
  { name: "INPUT", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "COUNT", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "IGNORE_CANCEL", data_type: TYPE_BOOL, dims: [ 1 ] }
]
output [ { name: "OUTPUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
instance_group [ { count: 3, kind: KIND_CPU } ]
""",
    """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            ignore = bool(pb_utils.get_input_tensor_by_name(request, "IGNORE_CANCEL").as_numpy()[0])
            sender = request.get_response_sender()
            for sent in range(count):
                if not ignore and request.is_cancelled():
                    error = pb_utils.TritonError("request has been cancelled", pb_utils.TritonError.CANCELLED)
                    sender.send(pb_utils.InferenceResponse(error=error),
                                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    break
                response = pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", value)])
                last = sent + 1 == count
                sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0)
                time.sleep(0.02)
        return None
""",
)

# Sums until_cancelled's responses; cancels the stream once the sum reaches MAX_SUM and reads on.
BLS_CANCEL_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [
  { name: "MAX_SUM", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "IGNORE_CANCEL", data_type: TYPE_BOOL, dims: [ 1 ] },
  { name: "TARGET", data_type: TYPE_STRING, dims: [ 1 ] }
]
output [
  { name: "SUM", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "IS_CANCELLED", data_type: TYPE_BOOL, dims: [ 1 ] }
]
{extra}
"""
BLS_CANCEL_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    DEF execute(self, requests):
        request = requests[0]
        max_sum = int(pb_utils.get_input_tensor_by_name(request, "MAX_SUM").as_numpy()[0])
        ignore = pb_utils.get_input_tensor_by_name(request, "IGNORE_CANCEL")
        target = pb_utils.get_input_tensor_by_name(request, "TARGET").as_numpy()[0]  # bytes
        call = pb_utils.InferenceRequest(
            model_name=target,
            inputs=[pb_utils.Tensor("INPUT", np.array([1], np.int32)),
                    pb_utils.Tensor("COUNT", np.array([20], np.int32)), ignore],
            requested_output_names=["OUTPUT"])
        stream = AWAIT call.EXEC(decoupled=True)
        total, cancelled = 0, False
        for response in stream:
            if response.has_error():
                cancelled = response.error().code() == pb_utils.TritonError.CANCELLED
                break
            if not response.output_tensors():
                break  # the bare final response
            total += int(pb_utils.get_output_tensor_by_name(response, "OUTPUT").as_numpy()[0])
            if total >= max_sum:
                stream.cancel()
        return [pb_utils.InferenceResponse([
            pb_utils.Tensor("SUM", np.array([total], np.int32)),
            pb_utils.Tensor("IS_CANCELLED", np.array([cancelled])),
        ])]
"""

RETURNS_IN_DECOUPLED = (
    """
name: "returns_in_decoupled"
backend: "python"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "Y", data_type: TYPE_INT32, dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
""",
    """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "X")]) for r in requests]
""",
)

ERROR_CODE = (
    """
name: "error_code"
backend: "python"
max_batch_size: 0
input [ { name: "CODE", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "Y", data_type: TYPE_INT32, dims: [ 1 ] } ]
""",
    """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            name = pb_utils.get_input_tensor_by_name(request, "CODE").as_numpy()[0].decode()
            error = pb_utils.TritonError("error code: " + name, getattr(pb_utils.TritonError, name))
            responses.append(pb_utils.InferenceResponse(error=error))
        return responses
""",
)

# Calls "params" (a model that answers with response parameters) and reports what BLS handed back.
PARAMS_BLS = (
    """
name: "params_bls"
backend: "python"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "PARAMS", data_type: TYPE_STRING, dims: [ 1 ] } ]
""",
    """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        x = pb_utils.Tensor("X", np.array([1], np.int32))
        call = pb_utils.InferenceRequest(model_name="params", inputs=[x], requested_output_names=["Y"])
        response = call.exec()
        if response.has_error():
            raise pb_utils.TritonModelException(response.error().message())
        text = response.parameters()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PARAMS", np.array([text], dtype=np.object_))])
                for _ in requests]
""",
)
PARAMS = (
    """
name: "params"
backend: "python"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "Y", data_type: TYPE_INT32, dims: [ 1 ] } ]
""",
    """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        x = [pb_utils.get_input_tensor_by_name(r, "X").as_numpy() for r in requests]
        params = {"int": 2048, "str": "hello"}
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", v)], parameters=params) for v in x]
""",
)

# async def execute that answers from a task it leaves running after execute returned (Triton's
# loop keeps running between executions)
ASYNC_LATER = (
    """
name: "async_later"
backend: "python"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "Y", data_type: TYPE_INT32, dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
""",
    """
import asyncio

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.tasks = set()

    async def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            task = asyncio.create_task(self.later(request.get_response_sender(), x))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        return None

    async def later(self, sender, x):
        await asyncio.sleep(0.2)
        pb_utils.Logger.log_info("answering after execute returned")
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x + 1)]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
""",
)

# A non-decoupled model that answers through its response sender (MODE picks how)
SENDER = (
    """
name: "sender"
backend: "python"
max_batch_size: 0
input [ { name: "MODE", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "Y", data_type: TYPE_INT32, dims: [ 1 ] } ]
""",
    """
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def answer(value):
    return pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([value], np.int32))])


class TritonPythonModel:
    def execute(self, requests):
        returned = []
        for request in requests:
            mode = int(pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy()[0])
            sender = request.get_response_sender()
            if mode == 0:  # one response, then the final flag alone; execute returns None
                sender.send(answer(10))
                sender.send(flags=FINAL)
                return None
            elif mode == 1:  # the final flag with no response before it: Triton's error
                sender.send(flags=FINAL)
            elif mode == 2:  # a second response raises; the first one stays the answer
                sender.send(answer(20), flags=FINAL)
                sender.send(answer(21))
            elif mode == 3:  # sent and returned: the sent one answers
                sender.send(answer(30), flags=FINAL)
                returned.append(answer(31))
            elif mode == 4:  # answered after execute returned, from a thread of the model
                threading.Thread(target=later, args=(sender,)).start()
                returned.append(None)
            else:  # a sender taken and dropped unused: an error, not a request waiting forever
                returned.append(None)
        return returned


def later(sender):
    time.sleep(0.2)
    sender.send(answer(40))
    sender.send(flags=FINAL)  # the final flag after the answer is fine, also after execute returned
""",
)

ISOLATED = 'parameters [ { key: "isolation", value: { string_value: "process" } } ]'


def _write(root: Path, name: str, config: str, model: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(textwrap.dedent(config))
    (root / name / "1" / "model.py").write_text(textwrap.dedent(model))


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("frictions") / "repo"
    for name, (config, model) in {
        "stringly": STRINGLY,
        "until_cancelled": UNTIL_CANCELLED,
        "returns_in_decoupled": RETURNS_IN_DECOUPLED,
        "error_code": ERROR_CODE,
        "params_bls": PARAMS_BLS,
        "params": PARAMS,
        "async_later": ASYNC_LATER,
        "sender": SENDER,
    }.items():
        _write(root, name, config, model)
    plain = BLS_CANCEL_MODEL.replace("DEF ", "def ").replace("AWAIT ", "").replace("EXEC", "exec")
    coroutine = BLS_CANCEL_MODEL.replace("DEF ", "async def ").replace("AWAIT ", "await ")
    coroutine = coroutine.replace("EXEC", "async_exec")
    for name, model, extra in [
        ("bls_cancel", plain, ""),
        ("bls_async_cancel", coroutine, ""),
        ("bls_cancel_isolated", plain, ISOLATED),
    ]:
        _write(root, name, BLS_CANCEL_CONFIG.replace("{name}", name).replace("{extra}", extra), model)
    return root


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[Server]:
    with Server(repository) as srv:
        yield srv


def test_string_outputs_take_any_object_and_types_are_not_cast(server: Server) -> None:
    out = server.infer("stringly", {"X": np.zeros(1, np.int32)})
    assert out["TEXT"].tolist() == [b"1", b"2.5", b"None", b"x", b"y"]
    assert out["WIDE"].dtype == np.int64  # as the model made it, as Triton sends it
    assert out["WIDE"].tolist() == [1, 2**40]


@pytest.mark.parametrize("model", ["bls_cancel", "bls_async_cancel", "bls_cancel_isolated"])
def test_a_bls_stream_can_be_cancelled(server: Server, model: str) -> None:
    inputs = {"MAX_SUM": np.array([5], np.int32), "TARGET": np.array([b"until_cancelled"], dtype=np.object_)}
    out = server.infer(model, {**inputs, "IGNORE_CANCEL": np.array([False])})
    assert out["IS_CANCELLED"].tolist() == [True]  # the called model saw the cancellation
    # and stopped before its 20: how many it sent before the cancel reached it depends on the machine's
    # load (the model sleeps 20 ms between responses; an isolated model's cancel crosses a process)
    assert 5 <= out["SUM"][0] < 20
    out = server.infer(model, {**inputs, "IGNORE_CANCEL": np.array([True])})
    assert out["IS_CANCELLED"].tolist() == [False]  # a model that ignores it: everything still comes
    assert out["SUM"].tolist() == [20]


def test_a_decoupled_model_that_returns_responses_gets_an_error(server: Server) -> None:
    stream = server.stream("returns_in_decoupled", {"X": np.ones(1, np.int32)}, timeout=30)
    with pytest.raises(
        EdgeServerError, match="using the decoupled mode and the execute function must return None"
    ):
        next(iter(stream))
    stream.close()


def test_an_async_model_answers_from_a_task_that_outlives_execute(server: Server) -> None:
    responses = list(server.stream("async_later", {"X": np.array([41], np.int32)}, timeout=30))
    assert [r["Y"].tolist() for r in responses] == [[42]]


def test_a_non_decoupled_model_may_answer_through_its_sender(server: Server) -> None:
    def answer(mode: int) -> list[int]:
        return server.infer("sender", {"MODE": np.array([mode], np.int32)})["Y"].tolist()

    assert answer(0) == [10]
    with pytest.raises(
        EdgeServerError, match="Non-decoupled model cannot send complete final before sending a response"
    ):
        answer(1)
    assert answer(2) == [20]
    assert answer(3) == [30]
    assert answer(4) == [40]  # Triton's response_sender QA: a response sent after execute returned
    with pytest.raises(EdgeServerError, match="the request's response sender sent no response"):
        answer(5)


def test_bls_responses_carry_the_called_models_parameters(server: Server) -> None:
    import json

    (text,) = server.infer("params_bls", {"X": np.ones(1, np.int32)})["PARAMS"]
    assert json.loads(text) == {"int": 2048, "str": "hello"}


@pytest.fixture(scope="module")
def daemon(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, int]]:
    root = tmp_path_factory.mktemp("sock")
    grpc_port = free_port()
    proc = Daemon(repository, f"ipc://{root}/f.sock", root / "f.log", *kserve_flags(free_port(), grpc_port))
    proc.start()
    try:
        yield proc, grpc_port
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("UNKNOWN", "StatusCode.UNKNOWN"),
        ("INTERNAL", "StatusCode.INTERNAL"),
        ("NOT_FOUND", "StatusCode.NOT_FOUND"),
        ("INVALID_ARG", "StatusCode.INVALID_ARGUMENT"),
        ("UNAVAILABLE", "StatusCode.UNAVAILABLE"),
        ("UNSUPPORTED", "StatusCode.UNIMPLEMENTED"),
        ("ALREADY_EXISTS", "StatusCode.ALREADY_EXISTS"),
        ("CANCELLED", "StatusCode.CANCELLED"),
    ],
)
def test_triton_error_codes_reach_grpc_clients(daemon: tuple[Daemon, int], code: str, status: str) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{daemon[1]}")
    tensor = grpcclient.InferInput("CODE", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([code.encode()], dtype=np.object_))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("error_code", [tensor])
    client.close()
    assert caught.value.status() == status
    assert f"error code: {code}" in caught.value.message()


def test_the_decoupled_error_and_the_cancel_over_ipc(daemon: tuple[Daemon, int]) -> None:
    with Client(daemon[0].address, timeout=30) as client:
        with pytest.raises(EdgeServerError, match="execute function must return None"):
            list(client.stream("returns_in_decoupled", {"X": np.ones(1, np.int32)}))
        inputs = {
            "MAX_SUM": np.array([3], np.int32),
            "IGNORE_CANCEL": np.array([False]),
            "TARGET": np.array([b"until_cancelled"], dtype=np.object_),
        }
        out = client.infer("bls_cancel_isolated", inputs)
        assert out["IS_CANCELLED"].tolist() == [True]
        # stopped before its 20; responses sent before the cancel reached the called model's process
        # are still read (as in test_a_bls_stream_can_be_cancelled): 3 on a quiet box, once 4 in CI
        assert 3 <= out["SUM"][0] < 20


def test_every_streamed_grpc_response_says_whether_it_is_the_final_one(daemon: tuple[Daemon, int]) -> None:
    # Triton sets triton_final_response on each streamed response, asked for or not
    results: list[object] = []
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{daemon[1]}")
    client.start_stream(callback=lambda result, error: results.append(error or result))
    inputs = []
    for name, array in [
        ("INPUT", np.array([7], np.int32)),
        ("COUNT", np.array([3], np.int32)),
        ("IGNORE_CANCEL", np.array([True])),
    ]:
        tensor = grpcclient.InferInput(name, [1], "BOOL" if array.dtype == bool else "INT32")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client.async_stream_infer("until_cancelled", inputs)
    client.stop_stream()  # waits for the stream to end
    client.close()
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r in results]  # type: ignore[attr-defined]
    assert finals == [False, False, True]


@pytest.mark.parametrize(
    ("parameters", "text"),
    [
        ({"f": 1.5}, "Expect parameters values to have type bool/int/str, found type <class 'float'>"),
        ({1: "x"}, "Expect parameters keys to have type str, found type <class 'int'>"),
        ([1], "Expect parameters to be a dict, got <class 'list'>"),
    ],
)
def test_response_parameter_errors_have_tritons_texts(parameters: object, text: str) -> None:
    from edge_server.backends import pb_utils

    with pytest.raises(pb_utils.TritonModelException) as caught:
        pb_utils.InferenceResponse(parameters=parameters)  # type: ignore[arg-type]
    assert str(caught.value) == text
