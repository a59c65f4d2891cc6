"""No deadlocks by construction: every case ends in an error or a result within its timeout.

A future's done-callbacks run in the thread that completes it; a pipeline's callback submits the next
step.  The scheduler therefore completes no future while it holds its lock.  These tests would hang
(and fail on their own timeouts) if it did.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

from edge_server import Server
from edge_server.errors import RequestTimeout
from tests.test_batching import probe_repo, rows, wait_running


def test_a_callback_on_a_timed_out_request_may_submit_to_the_same_model(tmp_path: Path) -> None:
    repo = probe_repo(
        tmp_path,
        max_batch_size=1,
        extra="dynamic_batching { default_queue_policy { default_timeout_microseconds: 20000 } }",
    )
    with Server(repo) as server:
        blocker = server.submit("probe", {"X": rows(1, 0, sleep_ms=200)})
        wait_running(blocker)
        late = server.submit("probe", {"X": rows(1, 1)})
        resubmitted: Future[Future[dict]] = Future()
        # Runs on the model's worker thread when the queue rejects ``late``: it enters the scheduler.
        late.add_done_callback(lambda _: resubmitted.set_result(server.submit("probe", {"X": rows(1, 2)})))
        blocker.result(timeout=30)
        assert isinstance(late.exception(timeout=30), RequestTimeout)
        again = resubmitted.result(timeout=10).result(timeout=10)
        assert float(again["Y"][0, 0]) == 2.0
