"""A Python model's BLS calls wait their turn as the client whose request made them.

The calls used to be one anonymous client in the called model's queue: a user flooding a BLS model
put all its calls in that one lane, and every other user's calls through the same model waited behind
all of them (first come, first served within the lane).  Now a call takes the turns of the request the
model was working on (the one whose inputs it read), so another user's call waits for one of the
flood's per turn.  The order is read from the ``turns`` model's own execution counter, as in
``test_fair_queue.py``; the relay model runs in the daemon's process, and in a process of its own.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import numpy as np
import pytest

from edge_server.client import Client
from tests.daemon import EXAMPLES, Daemon, gate_fifos, start_daemon, stop_daemon, wait_for
from tests.test_fair_queue import TURNS_CONFIG, TURNS_MODEL

RELAY_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            answer = pb_utils.InferenceRequest(
                model_name="turns",
                requested_output_names=["Y", "CALL", "BATCH"],
                inputs=[pb_utils.Tensor("X", x)],
            ).exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            responses.append(pb_utils.InferenceResponse(answer.output_tensors()))
        return responses
"""

RELAY_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [
  { name: "Y", data_type: TYPE_FP32, dims: [ 1 ] },
  { name: "CALL", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "BATCH", data_type: TYPE_INT32, dims: [ 1 ] }
]
instance_group [ { kind: KIND_CPU, count: 4 } ]
parameters [ { key: "isolation", value: { string_value: "%(isolation)s" } } ]
"""

FLOOD = 3  # with the victim's call, every relay instance waits in a call to ``turns``


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("fairbls")
    repo = root / "repo"
    shutil.copytree(EXAMPLES / "identity", repo / "identity", ignore=shutil.ignore_patterns("samples"))
    gate_fifos(root)
    fields = {
        "max_batch_size": 0,
        "batching": "",
        "gate": root / "gate.fifo",
        "started": root / "started.fifo",
    }
    (repo / "turns" / "1").mkdir(parents=True)
    (repo / "turns" / "1" / "model.py").write_text(TURNS_MODEL)
    (repo / "turns" / "config.pbtxt").write_text(TURNS_CONFIG % fields)
    (repo / "relay" / "1").mkdir(parents=True)
    (repo / "relay" / "1" / "model.py").write_text(RELAY_MODEL)
    (repo / "relay" / "config.pbtxt").write_text(RELAY_CONFIG % {"isolation": request.param})
    daemon = start_daemon(root, repo, "b.sock")
    try:
        yield daemon
    finally:
        assert stop_daemon(daemon) == 0, daemon.log()


def _queued(client: Client, model: str) -> int:
    return next(row["queue_depth"] for row in client.status()["models"] if row["name"] == model)


def _x(value: float) -> dict[str, np.ndarray]:
    return {"X": np.array([value], np.float32)}


def test_bls_calls_wait_their_turn_as_their_clients(server: Daemon) -> None:
    """A flood of calls through ``relay`` from one connection, then one from another connection: the
    other's call runs after one of the flood's, not after all of them (it ran last before)."""
    gate = server.gate
    assert gate is not None
    with Client(server.address, timeout=60) as flooder, Client(server.address, timeout=60) as other:
        blocker = flooder.submit("turns", _x(-1))
        gate.wait_started(1, timeout=60)  # a bound for a loaded machine, not a timing
        flood = [flooder.submit("relay", _x(i)) for i in range(FLOOD)]
        wait_for(lambda: _queued(other, "turns") == FLOOD, 60, what="the flood's calls to be queued")
        lone = other.submit("relay", _x(100))
        wait_for(lambda: _queued(other, "turns") == FLOOD + 1, 60, what="the other client's call")
        gate.release(FLOOD + 2)
        blocker.result(60)
        flood_calls = [int(f.result(60)["CALL"][0]) for f in flood]
        lone_call = int(lone.result(60)["CALL"][0])
    gate.settle()
    # (the flood's calls reach ``turns`` from three relay instances at once: in any order)
    assert lone_call < sorted(flood_calls)[1], (flood_calls, lone_call)
