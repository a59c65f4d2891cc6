"""Decoupled models as ensemble steps: every response of the step flows on alone; the ensemble streams.

``inc`` (+1) -> ``count`` (decoupled: n -> responses 0 .. n-1) -> ``tenx`` (x10): a request with
n answers ``[10 * i for i in range(n + 1)]``, one response each, through the in-process API, the IPC
client and a BLS ``exec(decoupled=True)``.
"""

from __future__ import annotations

import queue
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from edge_server import Server
from edge_server.client import Client
from edge_server.errors import EdgeServerError, InvalidArgument, ModelNotReady
from edge_server.status_index import ModelState
from tests.daemon import Daemon, build_repository, free_port, kserve_flags, start_daemon, stop_daemon
from tests.test_ensemble import add_ensemble, ensemble_config, step

INT = '{ name: "%s", data_type: TYPE_INT32, dims: [ 1 ] }'

MEMBER = """
name: "%(name)s"
backend: "python"
max_batch_size: 0
%(policy)s
input [ { name: "X", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "Y", data_type: TYPE_INT32, dims: [ 1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
"""

ELEMENTWISE = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", (%(expr)s).astype(np.int32))]))
        return out
"""

COUNT = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "X").as_numpy()[0])
            sender = request.get_response_sender()
            if n > 90:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("too many: " + str(n))))
            for i in range(min(n, 90)):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([i], np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

CHAIN = [
    step("inc", {"X": "IN"}, {"Y": "n"}),
    step("count", {"X": "n"}, {"Y": "i"}),
    step("tenx", {"X": "i"}, {"Y": "OUT"}),
]

BLS = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            call = pb_utils.InferenceRequest(
                model_name="counted", inputs=[pb_utils.get_input_tensor_by_name(request, "IN")],
                requested_output_names=["OUT"],
            )
            values = [
                int(pb_utils.get_output_tensor_by_name(r, "OUT").as_numpy()[0])
                for r in call.exec(decoupled=True) if r.output_tensors()
            ]
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array(values, np.int32))]))
        return out
"""


def add_python(repo: Path, name: str, code: str, *, decoupled: bool = False, config: str = MEMBER) -> None:
    (repo / name / "1").mkdir(parents=True)
    policy = "model_transaction_policy { decoupled: true }" if decoupled else ""
    (repo / name / "config.pbtxt").write_text(config % {"name": name, "policy": policy})
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(code))


def add_counted(repo: Path) -> None:
    add_python(repo, "inc", ELEMENTWISE % {"expr": "x + 1"})
    add_python(repo, "count", COUNT, decoupled=True)
    add_python(repo, "tenx", ELEMENTWISE % {"expr": "x * 10"})
    config = ensemble_config("counted", CHAIN, inputs=INT % "IN", outputs=INT % "OUT")
    add_ensemble(repo, "counted", config.replace("max_batch_size: 8", "max_batch_size: 0"))
    (repo / "collect" / "1").mkdir(parents=True)
    (repo / "collect" / "config.pbtxt").write_text(
        'name: "collect"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]\n'
        'output [ { name: "OUT", data_type: TYPE_INT32, dims: [ -1 ] } ]\n'
    )
    (repo / "collect" / "1" / "model.py").write_text(textwrap.dedent(BLS))


def n(value: int) -> dict[str, np.ndarray]:
    return {"IN": np.array([value], np.int32)}


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    add_counted(repo)
    return repo


def test_every_response_of_a_decoupled_step_flows_through_the_next_steps(repo: Path) -> None:
    with Server(repo) as server:
        assert server.model_config("counted").decoupled  # it streams because a step does
        outs = [int(r["OUT"][0]) for r in server.stream("counted", n(3), timeout=10)]
        assert outs == [0, 10, 20, 30]
        assert list(server.stream("counted", n(-1), timeout=10)) == []  # zero responses, then the final
        (stats,) = server.statistics("tenx")
        assert stats["inference_stats"]["success"]["count"] == 4  # one request per response
        with pytest.raises(InvalidArgument, match="decoupled"):
            server.infer("counted", n(1))


def test_an_error_response_of_the_step_ends_the_stream_with_the_step_named(repo: Path) -> None:
    with Server(repo) as server:
        with pytest.raises(
            EdgeServerError, match=r"^in ensemble 'counted', .*too many: 101.* \(step 1 \(model 'count'\)\)"
        ):
            list(server.stream("counted", n(100), timeout=10))
        assert [int(r["OUT"][0]) for r in server.stream("counted", n(1), timeout=10)] == [0, 10]


def test_a_bls_call_streams_a_decoupled_ensemble(repo: Path) -> None:
    with Server(repo) as server:
        np.testing.assert_array_equal(server.infer("collect", n(2))["OUT"], [0, 10, 20])


def test_a_step_beside_a_decoupled_step_is_refused_at_load(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    add_counted(repo)
    beside = [*CHAIN[:2], step("tenx", {"X": "IN"}, {"Y": "OUT"}), step("inc", {"X": "i"}, {"Y": "OUT2"})]
    outputs = f"{INT % 'OUT'}, {INT % 'OUT2'}"
    config = ensemble_config("bad", beside, inputs=INT % "IN", outputs=outputs)
    add_ensemble(repo, "bad", config.replace("max_batch_size: 8", "max_batch_size: 0"))
    with Server(repo) as server:
        (row,) = [s for s in server.models() if s.name == "bad"]
        assert row.state is ModelState.UNAVAILABLE
        assert "step 1 (model 'count') is decoupled" in row.reason
        assert "step 2 (model 'tenx') runs beside it" in row.reason
        with pytest.raises(ModelNotReady):
            list(server.stream("bad", n(1), timeout=10))


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    repo = build_repository(tmp_path)
    add_counted(repo)
    proc = start_daemon(tmp_path, repo, "d.sock")
    try:
        yield proc
    finally:
        assert stop_daemon(proc) == 0, proc.log()


def test_a_decoupled_ensemble_streams_over_ipc(daemon: Daemon) -> None:
    with Client(daemon.address, timeout=30) as client:
        outs = [int(r["OUT"][0]) for r in client.stream("counted", n(4))]
        assert outs == [0, 10, 20, 30, 40]
        assert list(client.stream("counted", n(-1))) == []
        with pytest.raises(EdgeServerError, match="too many"):
            list(client.stream("counted", n(95)))
        np.testing.assert_array_equal(client.infer("collect", n(1))["OUT"], [0, 10])


SQUARE = """
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            x = int(pb_utils.get_input_tensor_by_name(request, "X").as_numpy()[0])
            threading.Thread(target=self.answer, args=(request.get_response_sender(), x)).start()
        return None  # the responses follow from the thread, after execute returned

    def answer(self, sender, x):
        for _ in range(x):
            time.sleep(0.001)
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([x], np.int32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""


def add_nested(repo: Path) -> None:
    """``nested`` (Triton's ``nested_square``): the decoupled ensemble ``counted`` as a step of another
    ensemble, then ``square``, decoupled too, answering from a thread: ``x`` responses of ``x``."""
    add_python(repo, "square", SQUARE, decoupled=True)
    steps = [step("counted", {"IN": "IN"}, {"OUT": "c"}), step("square", {"X": "c"}, {"Y": "OUT"})]
    config = ensemble_config("nested", steps, inputs=INT % "IN", outputs=INT % "OUT")
    add_ensemble(repo, "nested", config.replace("max_batch_size: 8", "max_batch_size: 0"))


def test_a_nested_decoupled_ensemble_streams_over_grpc_to_its_final_response(tmp_path: Path) -> None:
    """Triton's L0_decoupled ``nested_square``: several requests on one gRPC stream, each with its
    responses and then its final response (``enable_empty_final_response``), or its error, round after
    round on one long-lived server."""
    repo = build_repository(tmp_path)
    add_counted(repo)
    add_nested(repo)
    http_port, grpc_port = free_port(), free_port()
    daemon = Daemon(repo, f"ipc://{tmp_path}/d.sock", tmp_path / "d.log", *kserve_flags(http_port, grpc_port))
    daemon.start()
    try:
        for _ in range(3):  # a long-lived server: the same answers each round
            got: queue.Queue[tuple[object, object]] = queue.Queue()
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
            client.start_stream(callback=lambda result, error, got=got: got.put((result, error)))
            try:
                counts = {"0": 3, "1": 0, "2": 5, "3": 1}
                failing = {"4": 95}  # the inner step fails: an error is that request's final answer
                for request_id, count in {**counts, **failing}.items():
                    tensor = grpcclient.InferInput("IN", [1], "INT32")
                    tensor.set_data_from_numpy(np.array([count], np.int32))
                    client.async_stream_infer(
                        "nested", [tensor], request_id=request_id, enable_empty_final_response=True
                    )
                outs: dict[str, list[int]] = {request_id: [] for request_id in counts}
                finals: set[str] = set()
                errors: list[str] = []
                while finals != set(counts) or not errors:
                    result, error = got.get(timeout=60)
                    if error is not None:
                        errors.append(error.message())  # type: ignore[attr-defined]
                        continue
                    response = result.get_response()  # type: ignore[attr-defined]
                    if response.outputs:
                        outs[response.id].append(int(result.as_numpy("OUT")[0]))  # type: ignore[attr-defined]
                    if response.parameters["triton_final_response"].bool_param:
                        finals.add(response.id)
                assert len(errors) == 1 and "too many: 96" in errors[0], errors
                for request_id, count in counts.items():
                    assert sorted(outs[request_id]) == [
                        10 * i for i in range(count + 1) for _ in range(10 * i)
                    ]
            finally:
                client.stop_stream()
                client.close()
    finally:
        assert daemon.stop() == 0, daemon.log()
