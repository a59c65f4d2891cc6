"""Decoupled (streaming) Python models with ``isolation: process``, through the in-process API.

The models of ``tests/decoupled_models.py`` (also run in the thread mode by ``test_decoupled.py``),
each in a process of its own, plus one that dies in the middle of a stream: the stream ends with
INSTANCE_FAILED after the responses that were sent, and the model streams again after its restart.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_server import Server
from edge_server.errors import InstanceFailed, ModelExecutionError
from tests.decoupled_models import add_decoupled_models

ISOLATED = '\nparameters [ { key: "isolation", value: { string_value: "process" } } ]\n'

DIES_CONFIG = """
name: "dies"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""

DIES_MODEL = """
import os
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            threading.Thread(target=self.respond, args=(request.get_response_sender(), n)).start()
        return None

    def respond(self, sender, n):
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([n], np.int32))]))
        if n == 13:
            os._exit(1)  # after one response, before the final flag
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("iso_decoupled")


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[Server]:
    repo = root / "repo"
    add_decoupled_models(repo, root / "repeat.log")
    for config in repo.glob("*/config.pbtxt"):
        config.write_text(config.read_text() + ISOLATED)
    with Server(repo) as server:
        yield server


def repeat_inputs(values: list[int], delay_ms: int = 0) -> dict[str, np.ndarray]:
    return {"IN": np.array(values, np.int32), "DELAY": np.full(len(values), delay_ms, np.uint32)}


def test_responses_sent_after_execute_returned_arrive_in_order(server: Server) -> None:
    responses = list(server.stream("repeat", repeat_inputs([4, 5, 6]), timeout=10))
    assert [int(r["OUT"][0]) for r in responses] == [4, 5, 6]
    assert [int(r["IDX"][0]) for r in responses] == [0, 1, 2]
    assert responses[0]["OUT"].dtype == np.int32


@pytest.mark.parametrize("n", [0, 1, 5])
def test_zero_one_or_many_responses(server: Server, n: int) -> None:
    outs = [int(r["OUT"][0]) for r in server.stream("square", {"IN": np.array([n], np.int32)}, timeout=10)]
    assert outs == [n * n] * n


def test_error_mid_stream_and_execute_raising(server: Server) -> None:
    stream = server.stream("flaky", {"IN": np.array([1], np.int32)}, timeout=10)
    assert int(next(stream)["OUT"][0]) == 1
    with pytest.raises(ModelExecutionError, match="second response failed"):
        next(stream)
    assert int(next(stream)["OUT"][0]) == 3
    with pytest.raises(StopIteration):
        next(stream)
    with pytest.raises(ModelExecutionError, match="negative input"):
        list(server.stream("flaky", {"IN": np.array([-1], np.int32)}, timeout=10))


def test_stopping_early_cancels_the_request(server: Server, root: Path) -> None:
    log = root / "repeat.log"
    log.unlink(missing_ok=True)  # written when a request's responder ends
    with server.stream("repeat", repeat_inputs(list(range(50)), delay_ms=20), timeout=10) as stream:
        assert int(next(stream)["OUT"][0]) == 0
    deadline = time.monotonic() + 10
    while (not log.exists() or len(log.read_text().split()) < 2) and time.monotonic() < deadline:
        time.sleep(0.02)  # the model writes the file when its responder thread ends
    sent, cancelled = map(int, log.read_text().split())
    assert cancelled == 1 and sent < 50


def test_a_process_that_dies_mid_stream_ends_it_with_instance_failed(tmp_path: Path) -> None:
    (tmp_path / "dies" / "1").mkdir(parents=True)
    (tmp_path / "dies" / "config.pbtxt").write_text(textwrap.dedent(DIES_CONFIG) + ISOLATED)
    (tmp_path / "dies" / "1" / "model.py").write_text(textwrap.dedent(DIES_MODEL))
    with Server(tmp_path) as server:  # its own: the restarted instance's threads end with it
        _dies_mid_stream(server)


def _dies_mid_stream(server: Server) -> None:
    stream = server.stream("dies", {"IN": np.array([13], np.int32)}, timeout=10)
    assert int(next(stream)["OUT"][0]) == 13
    with pytest.raises(InstanceFailed, match="exited with status 1"):
        next(stream)
    # The restarted instance streams again (a request sent meanwhile waits for it).
    again = list(server.stream("dies", {"IN": np.array([2], np.int32)}, timeout=15))
    assert [int(r["OUT"][0]) for r in again] == [2]
