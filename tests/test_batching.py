"""Dynamic batching, priorities, queue policy and instance groups through the real scheduler.

The probe model is a Python model that reports, for every request, the batch its call ran with, when
the call started and ended, and echoes the request's rows, so each rule can be checked from outside.
Timing is controlled by waiting for futures to be running (asking the server), not by sleeping.
"""

from __future__ import annotations

import textwrap
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from edge_server import Server
from edge_server.errors import ModelExecutionError, QueueFull, RequestTimeout

PROBE = '''
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """X rows are [value, sleep_ms]; negative values are rejected for that request only."""

    def initialize(self, args):
        self.calls = 0

    def execute(self, requests):
        self.calls += 1
        xs = [pb_utils.get_input_tensor_by_name(r, "X").as_numpy() for r in requests]
        total = sum(len(x) for x in xs)
        start = time.monotonic()
        time.sleep(max(float(x[:, 1].max()) for x in xs) / 1000.0)
        end = time.monotonic()
        responses = []
        for x in xs:
            if (x[:, 0] < 0).any():
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative value")))
                continue
            n = len(x)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("Y", x.copy()),
                pb_utils.Tensor("BATCH", np.full((n, 1), total, np.int32)),
                pb_utils.Tensor("START", np.full((n, 1), start)),
                pb_utils.Tensor("END", np.full((n, 1), end)),
                pb_utils.Tensor("CALL", np.full((n, 1), self.calls, np.int32)),
            ]))
        return responses
'''


def probe_repo(tmp_path: Path, *, max_batch_size: int = 8, extra: str = "") -> Path:
    root = tmp_path / "repo"
    model = root / "probe"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(PROBE)
    (model / "config.pbtxt").write_text(
        textwrap.dedent(
            f"""
            backend: "python"
            max_batch_size: {max_batch_size}
            input [ {{ name: "X", data_type: TYPE_FP32, dims: [ 2 ] }} ]
            output [
              {{ name: "Y", data_type: TYPE_FP32, dims: [ 2 ] }},
              {{ name: "BATCH", data_type: TYPE_INT32, dims: [ 1 ] }},
              {{ name: "START", data_type: TYPE_FP64, dims: [ 1 ] }},
              {{ name: "END", data_type: TYPE_FP64, dims: [ 1 ] }},
              {{ name: "CALL", data_type: TYPE_INT32, dims: [ 1 ] }}
            ]
            """
        )
        + textwrap.dedent(extra)
    )
    return root


def rows(n: int, first: float, sleep_ms: float = 0.0) -> np.ndarray:
    return np.array([[first + i, sleep_ms] for i in range(n)], np.float32)


def wait_running(future: Future, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not future.running() and not future.done():
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.001)


def test_requests_form_fewer_larger_batches_and_get_their_own_rows(tmp_path: Path) -> None:
    repo = probe_repo(tmp_path, extra="dynamic_batching { max_queue_delay_microseconds: 60000000 }")
    with Server(repo) as server:
        sizes = [4, 2, 2, 6, 2]
        inputs = [rows(n, first=100 * i) for i, n in enumerate(sizes)]
        futures = [server.submit("probe", {"X": x}) for x in inputs]
        # full batches go at once: after the 60 s delay, these 30 s would have run out
        results = [f.result(timeout=30) for f in futures]
    batches = [int(r["BATCH"][0, 0]) for r in results]
    assert batches == [8, 8, 8, 8, 8]
    assert [int(r["CALL"][0, 0]) for r in results] == [1, 1, 1, 2, 2]
    for x, r in zip(inputs, results, strict=True):
        np.testing.assert_array_equal(r["Y"], x)


def test_preferred_batch_size_is_sent_without_waiting(tmp_path: Path) -> None:
    repo = probe_repo(
        tmp_path,
        extra="dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 60000000 }",
    )
    with Server(repo) as server:
        futures = [server.submit("probe", {"X": rows(2, 0)}) for _ in range(2)]
        results = [f.result(timeout=30) for f in futures]  # not after the 60 s delay
    assert [int(r["BATCH"][0, 0]) for r in results] == [4, 4]


def test_lone_request_waits_for_the_delay(tmp_path: Path) -> None:
    repo = probe_repo(tmp_path, extra="dynamic_batching { max_queue_delay_microseconds: 200000 }")
    with Server(repo) as server:
        started = time.monotonic()
        result = server.infer("probe", {"X": rows(1, 0)})
        elapsed = time.monotonic() - started
    assert int(result["BATCH"][0, 0]) == 1
    assert elapsed >= 0.2  # held for the delay (how little longer is a timing claim: no test bounds it)


def test_one_bad_request_does_not_fail_its_batch_mates(tmp_path: Path) -> None:
    repo = probe_repo(tmp_path, extra="dynamic_batching { max_queue_delay_microseconds: 5000000 }")
    with Server(repo) as server:
        good = server.submit("probe", {"X": rows(4, 1)})
        bad = server.submit("probe", {"X": rows(4, -10)})
        result = good.result(timeout=30)
        with pytest.raises(ModelExecutionError, match="negative value"):
            bad.result(timeout=30)
    assert int(result["BATCH"][0, 0]) == 8  # they did run together


def test_queue_full_is_rejected_at_once(tmp_path: Path) -> None:
    repo = probe_repo(
        tmp_path,
        max_batch_size=1,
        extra="dynamic_batching { default_queue_policy { max_queue_size: 2 } }",
    )
    with Server(repo) as server:
        blocker = server.submit("probe", {"X": rows(1, 0, sleep_ms=300)})
        wait_running(blocker)
        queued = [server.submit("probe", {"X": rows(1, 1)}) for _ in range(2)]
        with pytest.raises(QueueFull, match="queue for priority level 1 is full"):
            server.submit("probe", {"X": rows(1, 2)})
        for f in [blocker, *queued]:
            f.result(timeout=30)


def test_queue_timeout_rejects_and_override_is_honoured(tmp_path: Path) -> None:
    repo = probe_repo(
        tmp_path,
        max_batch_size=1,
        extra="""
        dynamic_batching {
          default_queue_policy {
            timeout_action: REJECT default_timeout_microseconds: 50000 allow_timeout_override: true
          }
        }
        """,
    )
    with Server(repo) as server:
        blocker = server.submit("probe", {"X": rows(1, 0, sleep_ms=400)})
        wait_running(blocker)
        timed_out = server.submit("probe", {"X": rows(1, 1)})
        patient = server.submit("probe", {"X": rows(1, 2)}, timeout_us=20_000_000)
        with pytest.raises(RequestTimeout, match="timed out after"):
            timed_out.result(timeout=30)
        np.testing.assert_array_equal(patient.result(timeout=30)["Y"], rows(1, 2))
        blocker.result(timeout=30)
        (stats,) = server.statistics("probe")
        assert stats["inference_stats"]["fail"]["count"] == 1


def test_delay_action_keeps_expired_requests(tmp_path: Path) -> None:
    repo = probe_repo(
        tmp_path,
        max_batch_size=1,
        extra="""
        dynamic_batching {
          default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 20000 }
        }
        """,
    )
    with Server(repo) as server:
        blocker = server.submit("probe", {"X": rows(1, 0, sleep_ms=200)})
        wait_running(blocker)
        late = server.submit("probe", {"X": rows(1, 1)})
        np.testing.assert_array_equal(late.result(timeout=30)["Y"], rows(1, 1))


def test_higher_priority_runs_first(tmp_path: Path) -> None:
    repo = probe_repo(
        tmp_path,
        max_batch_size=1,
        extra="dynamic_batching { priority_levels: 2 default_priority_level: 2 }",
    )
    with Server(repo) as server:
        blocker = server.submit("probe", {"X": rows(1, 0, sleep_ms=300)})
        wait_running(blocker)
        low = server.submit("probe", {"X": rows(1, 1)})  # default level 2
        high = server.submit("probe", {"X": rows(1, 2)}, priority=1)
        low_call = int(low.result(timeout=30)["CALL"][0, 0])
        high_call = int(high.result(timeout=30)["CALL"][0, 0])
        blocker.result(timeout=30)
    assert high_call < low_call


def test_instances_run_concurrently(tmp_path: Path) -> None:
    repo = probe_repo(tmp_path, max_batch_size=1, extra="instance_group [ { kind: KIND_CPU count: 2 } ]")
    with Server(repo) as server:
        futures = [server.submit("probe", {"X": rows(1, i, sleep_ms=300)}) for i in range(2)]
        a, b = (f.result(timeout=30) for f in futures)
    # Two instances, two requests: their executions overlap in time.
    assert a["START"][0, 0] < b["END"][0, 0] and b["START"][0, 0] < a["END"][0, 0]
    assert a["CALL"][0, 0] == b["CALL"][0, 0] == 1  # each instance has its own model object


def test_preserve_ordering_returns_in_request_order(tmp_path: Path) -> None:
    repo = probe_repo(
        tmp_path,
        max_batch_size=1,
        extra="""
        instance_group [ { kind: KIND_CPU count: 2 } ]
        dynamic_batching { preserve_ordering: true }
        """,
    )
    with Server(repo) as server:
        order: list[int] = []
        slow = server.submit("probe", {"X": rows(1, 0, sleep_ms=300)})
        slow.add_done_callback(lambda _: order.append(0))
        wait_running(slow)
        fast = server.submit("probe", {"X": rows(1, 1)})
        fast.add_done_callback(lambda _: order.append(1))
        fast.result(timeout=30)
        slow.result(timeout=30)
        assert fast.result()["END"][0, 0] < slow.result()["END"][0, 0]  # it did finish first
    assert order == [0, 1]


def test_batch_statistics(tmp_path: Path) -> None:
    repo = probe_repo(tmp_path, extra="dynamic_batching { max_queue_delay_microseconds: 5000000 }")
    with Server(repo) as server:
        futures = [server.submit("probe", {"X": rows(n, 0)}) for n in (4, 4, 8)]
        for f in futures:
            f.result(timeout=30)
        (stats,) = server.statistics("probe")
    assert stats["inference_count"] == 16
    assert stats["execution_count"] == 2
    assert [b["batch_size"] for b in stats["batch_stats"]] == [8]
    assert stats["batch_stats"][0]["compute_infer"]["count"] == 2


def test_priority_beyond_the_levels_means_the_default_level(tmp_path: Path) -> None:
    repo = probe_repo(
        tmp_path,
        max_batch_size=1,
        extra="dynamic_batching { priority_levels: 2 default_priority_level: 2 }",
    )
    with Server(repo) as server:
        blocker = server.submit("probe", {"X": rows(1, 0, sleep_ms=300)})
        wait_running(blocker)
        beyond = server.submit("probe", {"X": rows(1, 1)}, priority=7)  # Triton: the default level, 2
        high = server.submit("probe", {"X": rows(1, 2)}, priority=1)
        assert int(high.result(timeout=30)["CALL"][0, 0]) < int(beyond.result(timeout=30)["CALL"][0, 0])
        blocker.result(timeout=30)


def test_expired_delay_request_goes_behind_one_that_has_not_expired(tmp_path: Path) -> None:
    repo = probe_repo(
        tmp_path,
        max_batch_size=1,
        extra="""
        dynamic_batching {
          default_queue_policy {
            timeout_action: DELAY default_timeout_microseconds: 20000 allow_timeout_override: true
          }
        }
        """,
    )
    with Server(repo) as server:
        blocker = server.submit("probe", {"X": rows(1, 0, sleep_ms=300)})
        wait_running(blocker)
        expired = server.submit("probe", {"X": rows(1, 1)})  # its 20 ms pass while the blocker runs
        patient = server.submit("probe", {"X": rows(1, 2)}, timeout_us=30_000_000)
        expired_call = int(expired.result(timeout=30)["CALL"][0, 0])  # delayed, not rejected
        assert int(patient.result(timeout=30)["CALL"][0, 0]) < expired_call
        blocker.result(timeout=30)


def test_unload_of_a_stuck_model_is_bounded_and_loses_nothing(tmp_path: Path) -> None:
    repo = probe_repo(tmp_path, max_batch_size=1)
    with Server(repo, model_control_mode="explicit", load_models=["probe"], drain_timeout=0.2) as server:
        stuck = server.submit("probe", {"X": rows(1, 0, sleep_ms=4000)})
        wait_running(stuck)
        server.unload_model("probe")  # drain deadline 0.2 s, then 2 s grace for the worker
        assert not stuck.done()  # the unload ended at its deadline, not when the 4 s execution did
        np.testing.assert_array_equal(stuck.result(timeout=30)["Y"], rows(1, 0, sleep_ms=4000))
