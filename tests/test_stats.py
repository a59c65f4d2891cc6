"""Model statistics: inline requests are folded in batches and must add up as if counted one by one."""

from __future__ import annotations

import threading
import time

from edge_server.request import Timing
from edge_server.scheduler import stats as stats_module
from edge_server.scheduler.stats import ModelStats


def _timing(i: int) -> Timing:
    return Timing(compute_input_ns=i, compute_infer_ns=10 * i, compute_output_ns=100 * i)


def test_inline_records_add_up_like_batches_across_folds() -> None:
    folded, eager = ModelStats("m", 1), ModelStats("m", 1)
    count = stats_module._FOLD_EVERY * 2 + 17  # two automatic folds and a remainder folded on read
    for i in range(count):
        size = 1 if i % 3 else 4
        ok = i % 7 != 0
        now = time.monotonic_ns()
        folded.record_one(size, i, 2 * i, ok, _timing(i), now)
        timing = _timing(i)
        eager.record_batch(batch_size=size, queue_ns=[i], request_ns=[2 * i], succeeded=[ok], timing=timing)
    got, want = folded.as_dict(), eager.as_dict()
    assert abs(got.pop("last_inference") - want.pop("last_inference")) < 1000
    assert got == want
    assert got["inference_count"] == sum(1 if i % 3 else 4 for i in range(count))
    assert got["inference_stats"]["fail"]["count"] == len(range(0, count, 7))
    assert [b["batch_size"] for b in got["batch_stats"]] == [1, 4]


def test_records_from_many_threads_are_all_counted() -> None:
    stats = ModelStats("m", 1)

    def record() -> None:
        for _ in range(1000):
            stats.record_one(1, 1, 1, True, Timing(), time.monotonic_ns())

    threads = [threading.Thread(target=record) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert stats.as_dict()["inference_stats"]["success"]["count"] == 4000
