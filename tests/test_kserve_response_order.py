"""The order of answers, as L0_sequence_batcher's ``SequenceBatcherPreserveOrderingTest`` needs it.

* On one gRPC stream, an ordinary (not decoupled) model's answers are written in the order the
  requests came, as Triton's stream handler does, whatever instance finishes first.
* The sequence batcher's ``oldest`` strategy keeps a sequence on one instance for its lifetime (its
  model, like Triton's ``sequence_py``, keeps the sequence's state in the instance); with
  ``preserve_ordering`` requests of different sequences are answered in the order they came, but for
  sequences still waiting for a place (a client waiting for an answer must not wait for them);
  without it, each as it finishes.

Timing is controlled with files the model writes and waits for, not with sleeps; checked over gRPC
with ``tritonclient``.
"""

from __future__ import annotations

import itertools
import queue
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from edge_server.client import Client
from tests.daemon import Daemon, free_port, kserve_flags, wait_for

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

SEQUENCE = """
sequence_batching {{
  oldest {{ max_candidate_sequences: {candidates}, preserve_ordering: {preserve} }}
  max_sequence_idle_microseconds: 10000000
}}
"""
CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 1
input [ {{ name: "ID", data_type: TYPE_INT32, dims: [ 1 ] }} ]
output [ {{ name: "STEP", data_type: TYPE_INT32, dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: {instances} }} ]
parameters {{ key: "dir", value: {{ string_value: "{folder}" }} }}
"""
MODEL = """
import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    \"\"\"ID > 0: say so (started-ID), wait for release-ID, answer.  Then, any ID: ran-|ID|.

    STEP counts a sequence's steps in the instance (as Triton's sequence_py keeps its state).
    \"\"\"

    def initialize(self, args):
        self.dir = json.loads(args["model_config"])["parameters"]["dir"]["string_value"]
        self.steps = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            rid = int(pb_utils.get_input_tensor_by_name(request, "ID").as_numpy()[0, 0])
            if rid > 0:
                open(os.path.join(self.dir, f"started-{rid}"), "w").close()
                while not os.path.exists(os.path.join(self.dir, f"release-{rid}")):
                    time.sleep(0.002)
            corrid = request.correlation_id()
            if request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                self.steps[corrid] = 0
            elif corrid and corrid not in self.steps:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("not started here")))
                continue
            self.steps[corrid] = self.steps.get(corrid, 0) + 1
            step = pb_utils.Tensor("STEP", np.array([[self.steps[corrid]]], np.int32))
            responses.append(pb_utils.InferenceResponse([step]))
            open(os.path.join(self.dir, f"ran-{abs(rid)}"), "w").close()
        return responses
"""

_ids = itertools.count(1)


def _write(repo: Path, folder: Path, name: str, *, scheduling: str = "", instances: int = 2) -> None:
    (repo / name / "1").mkdir(parents=True)
    config = CONFIG.format(name=name, instances=instances, folder=folder) + scheduling
    (repo / name / "config.pbtxt").write_text(textwrap.dedent(config))
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(MODEL))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path, str]]:
    repo = tmp_path_factory.mktemp("order") / "repo"
    folder = tmp_path_factory.mktemp("marks")
    _write(
        repo, folder, "plain", scheduling="dynamic_batching { }"
    )  # queued: never run in the reader's thread
    _write(repo, folder, "ordered", scheduling=SEQUENCE.format(candidates=4, preserve="true"))
    _write(repo, folder, "unordered", scheduling=SEQUENCE.format(candidates=4, preserve="false"))
    _write(repo, folder, "one_place", scheduling=SEQUENCE.format(candidates=1, preserve="true"), instances=1)
    root = tmp_path_factory.mktemp("sock")
    http_port, port = free_port(), free_port()
    daemon = Daemon(repo, f"ipc://{root}/o.sock", root / "o.log", *kserve_flags(http_port, port))
    daemon.start()
    try:
        yield port, folder, daemon.address
    finally:
        assert daemon.stop() == 0, daemon.log()


def _tensor(rid: int) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("ID", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[rid]], np.int32))
    return [tensor]


def _slow_then_fast(served: tuple[int, Path, str], model: str, via: str, *, fast_first: bool) -> list[str]:
    """A request held in the model, then one that runs at once on the other instance; the order of
    their answers once the first is let go (``fast_first``: the fast one must come before that).

    ``via``: ``stream`` (one gRPC stream), ``grpc`` (a call each) or ``ipc`` (one IPC connection,
    whose replies leave in the order the daemon answers).
    """
    port, folder, address = served
    slow, fast = next(_ids), next(_ids)
    answers: queue.Queue[Any] = queue.Queue()

    def on_answer(result: Any, error: Any) -> None:
        answers.put(error if result is None else result.get_response().id)

    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    ipc = Client(address)
    try:
        if via == "stream":
            grpc.start_stream(callback=on_answer)
        for rid in (slow, -fast):
            name = str(abs(rid))
            sequence = (
                {}
                if model == "plain"
                else {"sequence_id": 2 * abs(rid), "sequence_start": True, "sequence_end": True}
            )
            if via == "ipc":
                future = ipc.submit(model, {"ID": np.array([[rid]], np.int32)}, **sequence)
                future.add_done_callback(lambda f, name=name: answers.put(f.exception() or name))
            elif via == "stream":
                grpc.async_stream_infer(model, _tensor(rid), request_id=name, **sequence)
            else:
                grpc.async_infer(model, _tensor(rid), on_answer, request_id=name, **sequence)
            mark = folder / (f"started-{rid}" if rid > 0 else f"ran-{fast}")
            wait_for(mark.exists, timeout=30, what=mark.name)
        got = [answers.get(timeout=30)] if fast_first else []
        (folder / f"release-{slow}").touch()
        got += [answers.get(timeout=30) for _ in range(2 - len(got))]
    finally:
        (folder / f"release-{slow}").touch()  # never leave the model waiting
        if via == "stream":
            grpc.stop_stream()
        grpc.close()
        ipc.close()
    assert all(isinstance(answer, str) for answer in got), got
    return ["slow" if answer == str(slow) else "fast" for answer in got]


def test_a_stream_answers_an_ordinary_model_in_the_order_the_requests_came(
    served: tuple[int, Path, str],
) -> None:
    assert _slow_then_fast(served, "plain", "stream", fast_first=False) == ["slow", "fast"]
    assert _slow_then_fast(served, "plain", "grpc", fast_first=True) == ["fast", "slow"]  # a call each


def test_preserve_ordering_answers_sequences_in_the_order_the_requests_came(
    served: tuple[int, Path, str],
) -> None:
    assert _slow_then_fast(served, "ordered", "ipc", fast_first=False) == ["slow", "fast"]


def test_without_it_each_answer_goes_as_it_finishes(served: tuple[int, Path, str]) -> None:
    assert _slow_then_fast(served, "unordered", "ipc", fast_first=True) == ["fast", "slow"]


def test_a_sequence_stays_on_one_instance(served: tuple[int, Path, str]) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served[0]}")
    try:
        for step in range(1, 5):  # four sequences, interleaved step by step, over two instances
            for corrid in range(1001, 1005):
                result = client.infer(
                    "unordered",
                    _tensor(-next(_ids)),
                    sequence_id=corrid,
                    sequence_start=step == 1,
                    sequence_end=step == 4,
                )
                assert result.as_numpy("STEP")[0, 0] == step
    finally:
        client.close()


def test_a_sequence_waiting_for_a_place_holds_no_answer_back(served: tuple[int, Path, str]) -> None:
    """One candidate place: B's start waits for A's end, and A's next answers must not wait for B's."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served[0]}")
    waiting: queue.Queue[Any] = queue.Queue()
    try:
        client.infer("one_place", _tensor(-next(_ids)), sequence_id=1, sequence_start=True)
        client.async_infer(
            "one_place",
            _tensor(-next(_ids)),
            callback=lambda result, error: waiting.put(error or result),
            sequence_id=2,
            sequence_start=True,
            sequence_end=True,
        )
        with Client(served[2]) as ipc:  # B came first, and waits for A's place
            wait_for(lambda: ipc.statistics("one_place")[0]["sequence_stats"]["backlog"] == 1, what="B waits")
        client.infer("one_place", _tensor(-next(_ids)), sequence_id=1, client_timeout=30)
        assert waiting.empty()
        client.infer("one_place", _tensor(-next(_ids)), sequence_id=1, sequence_end=True, client_timeout=30)
        answer = waiting.get(timeout=30)
        assert not isinstance(answer, Exception), answer
    finally:
        client.close()
