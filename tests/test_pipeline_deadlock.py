"""No deadlocks by construction: every case ends in an error or a result within its timeout.

A future's done-callbacks run in the thread that completes it; a pipeline's callback submits the next
step.  The scheduler therefore completes no future while it holds its lock.  These tests would hang
(and fail on their own timeouts) if it did.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from edge_server import Server
from edge_server.errors import RequestTimeout, Unavailable
from tests.bls_models import add_bls_models
from tests.test_batching import wait_running

SLOW_CONFIG = """
name: "slow"
backend: "python"
max_batch_size: 1
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
dynamic_batching { default_queue_policy { %s } }
"""

SLOW_MODEL = '''
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Sleeps INPUT0[0, 0] milliseconds, then echoes INPUT0.  Gates for the tests, as files beside the
    repository (outside it: a change inside is a reload): it touches <name>.started when a request
    starts, and waits while <name>.hold exists."""

    def initialize(self, args):
        outside = os.path.dirname(os.path.dirname(args["model_repository"]))
        self.mark = os.path.join(outside, args["model_name"])

    def execute(self, requests):
        responses = []
        for request in requests:
            open(self.mark + ".started", "a").close()
            while os.path.exists(self.mark + ".hold"):
                time.sleep(0.002)
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            time.sleep(float(x[0, 0]) / 1000)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return responses
'''


def add_slow_model(repo: Path, queue_policy: str) -> None:
    """The ``slow`` model in ``repo`` (its gates beside it, in ``repo``'s parent) with this queue policy."""
    (repo / "slow" / "1").mkdir(parents=True)
    (repo / "slow" / "config.pbtxt").write_text(SLOW_CONFIG % queue_policy)
    (repo / "slow" / "1" / "model.py").write_text(SLOW_MODEL)


@pytest.fixture
def bls_server(tmp_path: Path) -> Iterator[Server]:
    repo = tmp_path / "repo"
    add_bls_models(repo, tmp_path / "repeat.log")
    add_slow_model(repo, "max_queue_size: 1")
    with Server(repo) as server:
        yield server


def x(first: float = 0.0) -> np.ndarray:
    return np.array([[first, 1, 2, 3]], np.float32)


def test_a_callback_on_a_timed_out_request_may_submit_to_the_same_model(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    # Every request may wait 20 ms; the resubmitted one overrides that, for a loaded machine: it waits
    # for the worker thread that runs the callback to come back for it.
    add_slow_model(repo, "default_timeout_microseconds: 20000 allow_timeout_override: true")
    hold = tmp_path / "slow.hold"
    hold.touch()  # the running request stays in the model until late's 20 ms have surely passed
    with Server(repo) as server:
        try:
            blocker = server.submit("slow", {"INPUT0": x(0)})
            wait_running(blocker, timeout=60)
            late = server.submit("slow", {"INPUT0": x(1)})
            expired_at = time.monotonic() + 0.02  # its deadline is earlier: it was queued before now
            resubmitted: Future[Future[dict]] = Future()
            # Runs on the model's worker thread when the queue rejects ``late``: it enters the scheduler.
            late.add_done_callback(
                lambda _: resubmitted.set_result(
                    server.submit("slow", {"INPUT0": x(2)}, timeout_us=60_000_000)
                )
            )
            while time.monotonic() < expired_at:  # a lower bound: late must expire, not run
                time.sleep(0.005)
        finally:
            hold.unlink()
        blocker.result(timeout=60)
        assert isinstance(late.exception(timeout=60), RequestTimeout)
        again = resubmitted.result(timeout=60).result(timeout=60)
        np.testing.assert_array_equal(again["OUTPUT0"], x(2))


def test_a_model_calling_itself_from_its_only_instance_is_refused_at_once(bls_server: Server) -> None:
    # Refused up front (this error), not at a timeout: the call has none, so it would hang instead.
    with pytest.raises(Unavailable, match=r"calls itself from its only instance"):
        bls_server.infer("caller", {"INPUT0": x()}, parameters={"target": "caller"})  # no timeout


def test_a_self_call_that_cannot_be_refused_up_front_ends_at_its_timeout(bls_server: Server) -> None:
    # caller -> caller2 -> caller: caller's only instance is busy waiting; whichever wait ends first
    # (caller's for caller2, or caller2's for caller) ends the chain with TIMEOUT
    params = {"target": "caller2", "next": "caller", "timeout_us": 300_000}
    future = bls_server.submit("caller", {"INPUT0": x()}, parameters=params)
    with pytest.raises(Unavailable, match=r"\[TIMEOUT\] BLS call to model 'caller2?' got no answer"):
        future.result(timeout=60)
    # the timed-out call was cancelled: it never runs later, and the model serves again
    np.testing.assert_allclose(bls_server.infer("caller", {"INPUT0": x()})["OUTPUT0"], 2 * x() + 2)


def test_two_models_calling_each_other_end_in_an_error(bls_server: Server) -> None:
    params = {"target": "caller2", "next": "caller", "timeout_us": 300_000}
    future = bls_server.submit(
        "caller2", {"INPUT0": x()}, parameters={**params, "target": "caller", "next": "caller2"}
    )
    with pytest.raises(Unavailable, match=r"\[TIMEOUT\]"):
        future.result(timeout=60)
    np.testing.assert_allclose(bls_server.infer("caller2", {"INPUT0": x()})["OUTPUT0"], 2 * x() + 2)


def test_a_call_into_a_full_queue_fails_at_once(bls_server: Server, tmp_path: Path) -> None:
    hold = tmp_path / "slow.hold"
    hold.touch()  # the running request stays in the model until the test lets it go
    try:
        running = bls_server.submit("slow", {"INPUT0": x(0)})
        wait_running(running, timeout=60)
        queued = bls_server.submit("slow", {"INPUT0": x(0)})  # fills max_queue_size 1
        with pytest.raises(Unavailable, match=r"\[QUEUE_FULL\]"):
            bls_server.infer("caller", {"INPUT0": x()}, parameters={"target": "slow"})
        assert not running.done()  # refused while the running request still ran, not after it
    finally:
        hold.unlink()
    running.result(timeout=60)
    queued.result(timeout=60)
