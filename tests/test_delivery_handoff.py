"""An instance with requests waiting takes its next batch while its last one is being delivered.

Delivering a batch runs its futures' done-callbacks (a frontend's reply, a pipeline's next step, a
user's callback in process).  A worker used to run them itself, so its instance sat idle with requests
queued.  Each test holds one delivery in a callback and watches the model itself (its run log) carry
on, through the in-process API with a real ``model.py``, under the dynamic batcher and the sequence
batcher alike.
"""

from __future__ import annotations

import textwrap
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from edge_server import Server
from edge_server.scheduler.handoff import MAX_PENDING

# Each execution appends its input to runs.log beside the model; the request with input 0 waits for the
# file "open" there first, so that the test can queue others behind it.
MODEL = """
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.dir = os.path.join(args["model_repository"])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if int(x[0]) == 0:
                while not os.path.exists(os.path.join(self.dir, "open")):
                    time.sleep(0.005)
            with open(os.path.join(self.dir, "runs.log"), "a") as log:
                log.write(f"{int(x[0])}\\n")
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x.copy())]))
        return responses
"""

CONFIG = """
name: "gate"
backend: "python"
max_batch_size: 0
{batcher}
input [ {{ name: "IN", data_type: TYPE_INT32, dims: [ 1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
"""

SEQUENCE = """
sequence_batching {
  max_sequence_idle_microseconds: 60000000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY fp32_false_true: [ 0, 1 ] } ] }
  ]
}
"""

BATCHERS = {"dynamic": "", "sequence": SEQUENCE}


@pytest.fixture(params=list(BATCHERS))
def gate(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    model = tmp_path / "repo" / "gate"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(textwrap.dedent(MODEL))
    (model / "config.pbtxt").write_text(CONFIG.format(batcher=BATCHERS[request.param]))
    model.joinpath("sequence").write_text(request.param)
    return model


def _runs(model: Path) -> list[int]:
    log = model / "runs.log"
    return [int(line) for line in log.read_text().split()] if log.exists() else []


def _wait_for(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _submit(server: Server, model: Path, value: int) -> Future[dict[str, np.ndarray]]:
    options: dict = {}
    if model.joinpath("sequence").read_text() == "sequence":  # each request a sequence of its own
        options = {"correlation_id": 1000 + value, "sequence_start": True, "sequence_end": True}
    return server.submit("gate", {"IN": np.array([value], np.int32)}, **options)


def test_the_instance_runs_the_queued_requests_while_a_delivery_is_held(gate: Path) -> None:
    released = threading.Event()
    delivered: list[int] = []

    def held(future: Future[dict[str, np.ndarray]]) -> None:  # a slow done-callback: a user's, in process
        released.wait(60)
        delivered.append(int(future.result()["OUT"][0]))

    with Server(gate.parent) as server:
        first = _submit(server, gate, 0)
        first.add_done_callback(held)
        rest = [_submit(server, gate, value) for value in (1, 2)]
        for future in rest:
            future.add_done_callback(lambda f: delivered.append(int(f.result()["OUT"][0])))
        (gate / "open").touch()  # the first request runs now, with two queued behind it
        try:
            # Before the hand-off, the worker ran the callback itself: the queued requests waited for it.
            _wait_for(lambda: _runs(gate) == [0, 1, 2], "the queued requests to run while a delivery is held")
            assert not any(future.done() for future in rest), "deliveries kept their order"
        finally:
            released.set()
        assert [future.result(30)["OUT"].tolist() for future in rest] == [[1], [2]]
        _wait_for(lambda: len(delivered) == 3, "every delivery")
        assert delivered == [0, 1, 2]


def test_a_held_delivery_holds_the_instance_after_a_bounded_number_of_batches(gate: Path) -> None:
    released = threading.Event()
    with Server(gate.parent) as server:
        first = _submit(server, gate, 0)
        first.add_done_callback(lambda _: released.wait(60))
        rest = [_submit(server, gate, value) for value in range(1, MAX_PENDING + 6)]
        (gate / "open").touch()
        try:
            # The first is being delivered, MAX_PENDING wait for the delivering thread, and the worker
            # waits with one more finished batch: no unbounded list of finished results.
            bound = 2 + MAX_PENDING
            _wait_for(lambda: len(_runs(gate)) >= bound, "the batches up to the bound")
            time.sleep(0.5)  # would the worker run on?
            assert len(_runs(gate)) == bound
        finally:
            released.set()
        assert [f.result(30)["OUT"].tolist() for f in rest] == [[v] for v in range(1, MAX_PENDING + 6)]
        assert first.result(30)["OUT"].tolist() == [0]


def test_a_lone_request_is_delivered_by_its_instance_worker(gate: Path) -> None:
    """No requests waiting: no hand-off (a single stream pays no extra thread wake-up)."""
    (gate / "open").touch()
    threads: list[str] = []
    with Server(gate.parent) as server:
        for value in range(3):
            future = _submit(server, gate, value)
            done = threading.Event()

            def note(_: object, done: threading.Event = done) -> None:
                threads.append(threading.current_thread().name)
                done.set()

            future.add_done_callback(note)
            assert done.wait(30)
            assert future.result()["OUT"].tolist() == [value]
    assert threads and not any(name.endswith("-deliver") for name in threads), threads


def test_unloading_delivers_what_was_handed_off(gate: Path) -> None:
    released = threading.Event()
    with Server(gate.parent, model_control_mode="explicit", load_models=["gate"]) as server:
        first = _submit(server, gate, 0)
        first.add_done_callback(lambda _: released.wait(60))
        rest = [_submit(server, gate, value) for value in (1, 2, 3)]
        (gate / "open").touch()
        _wait_for(lambda: len(_runs(gate)) == 4, "every request to run")
        unloaded: Future[None] = Future()
        threading.Thread(target=lambda: unloaded.set_result(server.unload_model("gate"))).start()
        time.sleep(0.2)  # the unload waits for the held delivery (not asserted: a slow box may be later)
        released.set()
        unloaded.result(60)
        assert [f.result(30)["OUT"].tolist() for f in rest] == [[1], [2], [3]]
        assert not server.is_ready("gate")


def test_answers_arrive_when_the_delivering_thread_cannot_start(
    gate: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No thread to be had (a pids limit, memory): the worker delivers itself, as before the hand-off."""
    start = threading.Thread.start

    def no_delivering_thread(thread: threading.Thread) -> None:
        if thread.name.endswith("-deliver"):
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", no_delivering_thread)
    with Server(gate.parent) as server:
        futures = [_submit(server, gate, value) for value in (0, 1, 2)]
        (gate / "open").touch()
        assert [f.result(30)["OUT"].tolist() for f in futures] == [[0], [1], [2]]
