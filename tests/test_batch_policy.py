"""The batching decision and the request queue, without threads: made-up requests and clocks."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import pytest

from edge_server.config.model import QueuePolicy
from edge_server.errors import QueueFull, RequestTimeout
from edge_server.request import BatchItem, ClientKey
from edge_server.scheduler.policy import BatchSettings, Decision, next_batch
from edge_server.scheduler.queue import QueuedRequest, RequestQueue, timed_out


@dataclass
class R:
    batch_size: int
    enqueue_ns: int = 0
    shape_key: tuple = ()


MAX8 = BatchSettings(max_batch_size=8, max_queue_delay_ns=1_000_000)


def test_empty_queue_waits_for_anything() -> None:
    assert next_batch([], 0, MAX8) == Decision(0, 0)


def test_without_dynamic_batching_each_request_runs_alone() -> None:
    settings = BatchSettings(max_batch_size=8, batching=False)
    assert next_batch([R(2), R(2)], 0, settings) == Decision(1)


def test_full_batch_is_sent_at_once_and_never_split() -> None:
    queue = [R(4), R(2), R(2), R(6), R(2)]
    assert next_batch(queue, 0, MAX8) == Decision(3)  # 4+2+2 = 8
    assert next_batch(queue[3:], 0, MAX8) == Decision(2)  # 6+2 = 8


def test_batch_that_cannot_grow_is_sent() -> None:
    assert next_batch([R(4), R(6)], 0, MAX8) == Decision(1)  # 4+6 > 8
    assert next_batch([R(2), R(2, shape_key=("x", (3,)))], 0, MAX8) == Decision(1)  # other shapes


def test_partial_batch_waits_for_the_delay_of_its_oldest_request() -> None:
    queue = [R(2, enqueue_ns=100), R(2, enqueue_ns=500)]
    assert next_batch(queue, 600, MAX8) == Decision(0, 1_000_000 - 500)
    assert next_batch(queue, 100 + 1_000_000, MAX8) == Decision(2)


def test_zero_delay_sends_whatever_is_queued() -> None:
    settings = BatchSettings(max_batch_size=8, max_queue_delay_ns=0)
    assert next_batch([R(1), R(1)], 0, settings) == Decision(2)


def test_preferred_size_is_sent_at_once_largest_first() -> None:
    settings = BatchSettings(
        max_batch_size=16, preferred_batch_sizes=frozenset({4, 8}), max_queue_delay_ns=10**9
    )
    assert next_batch([R(2), R(2)], 0, settings) == Decision(2)
    assert next_batch([R(4), R(2), R(2), R(1)], 0, settings) == Decision(3)  # 8 beats 4
    assert next_batch([R(3), R(3)], 0, settings) == Decision(0, 10**9)  # 6 is not preferred: wait


def _request(
    level: int, enqueue: int, deadline: int = 0, action: str = "REJECT", client: ClientKey | None = None
) -> QueuedRequest:
    item = BatchItem(inputs={"x": np.zeros(1)}, batch_size=1, requested_outputs=(), client=client)
    return QueuedRequest(
        item=item,
        shape_key=(),
        level=level,
        enqueue_ns=enqueue,
        future=Future(),
        deadline_ns=deadline,
        timeout_action=action,
    )


def test_queue_orders_by_priority_then_arrival() -> None:
    queue = RequestQueue(2, {1: QueuePolicy(), 2: QueuePolicy()})
    low, high1, high2 = _request(2, 1), _request(1, 2), _request(1, 3)
    for r in (low, high1, high2):
        queue.push(r)
    assert queue.head(10) == [high1, high2, low]
    assert queue.pop(2) == [high1, high2]
    assert len(queue) == 1


def test_queue_full_is_rejected_per_level() -> None:
    queue = RequestQueue(2, {1: QueuePolicy(max_queue_size=1), 2: QueuePolicy()})
    queue.push(_request(1, 0))
    with pytest.raises(QueueFull, match="max_queue_size"):
        queue.push(_request(1, 1))
    queue.push(_request(2, 1))  # another level has its own limit


def test_timeouts_reject_or_delay() -> None:
    queue = RequestQueue(1, {1: QueuePolicy()})
    rejected = _request(1, 0, deadline=100, action="REJECT")
    delayed = _request(1, 1, deadline=100, action="DELAY")
    fresh = _request(1, 2, deadline=10_000)
    for r in (rejected, delayed, fresh):
        queue.push(r)
    assert queue.expire(50) == []
    assert queue.expire(200) == [rejected]
    # The queue never completes a future (it runs under the scheduler's lock); the scheduler does,
    # after releasing it, with this error.
    assert not rejected.future.done()
    assert isinstance(timed_out(rejected, 200), RequestTimeout)
    assert queue.head(10) == [fresh, delayed]  # delayed goes behind what has not expired
    assert queue.pop(2) == [fresh, delayed]
    assert queue.expire(10**9) == []


def test_after_the_delay_everything_pending_goes_not_just_the_preferred_prefix() -> None:
    settings = BatchSettings(max_batch_size=8, preferred_batch_sizes=frozenset({2}), max_queue_delay_ns=1000)
    queue = [R(1, enqueue_ns=0) for _ in range(7)]
    assert next_batch(queue, 500, settings) == Decision(2)  # preferred size reached, delay not yet
    assert next_batch(queue, 1000, settings) == Decision(7)  # Triton: one batch of 7, not 2, 2, 2, 1


def test_prefix_before_overflowing_the_largest_preferred_size_is_sent() -> None:
    settings = BatchSettings(
        max_batch_size=16, preferred_batch_sizes=frozenset({4}), max_queue_delay_ns=10**9
    )
    assert next_batch([R(3), R(3)], 0, settings) == Decision(1)  # 3 + 3 would pass 4: send the 3
    assert next_batch([R(3)], 0, settings) == Decision(0, 10**9)


def test_delayed_requests_stay_within_their_priority_level() -> None:
    queue = RequestQueue(2, {1: QueuePolicy(max_queue_size=2), 2: QueuePolicy()})
    high_late = _request(1, 0, deadline=100, action="DELAY")
    high_fresh = _request(1, 1)
    low = _request(2, 2)
    for r in (high_late, high_fresh, low):
        queue.push(r)
    queue.expire(200)
    assert queue.head(10) == [high_fresh, high_late, low]  # Triton: behind its level, ahead of level 2
    with pytest.raises(QueueFull):  # the delayed request still counts against max_queue_size
        queue.push(_request(1, 3))


def test_clients_take_turns_and_keep_their_own_order() -> None:
    queue = RequestQueue(1, {1: QueuePolicy()})
    a, b = ("a", 1), ("b", 2)
    flood = [_request(1, i, client=a) for i in range(5)]
    for r in flood:
        queue.push(r)
    lone = _request(1, 9, client=b)
    queue.push(lone)
    assert queue.head(3) == [flood[0], lone, flood[1]]  # one of the burst, then the newcomer
    assert queue.pop(3) == [flood[0], lone, flood[1]]
    assert queue.pop(10) == flood[2:]  # the burst's own order is kept
    assert len(queue) == 0


def test_head_is_what_pop_takes_whatever_the_rotation() -> None:
    queue = RequestQueue(1, {1: QueuePolicy()})
    clients = [(0, "c1"), (0, "c2"), (1, "d1"), (None, None)]
    for i in range(40):
        queue.push(_request(1, i, client=clients[(i * 7) % 4] if i % 3 else clients[0]))
        if i % 5 == 4:
            head = queue.head(3)
            assert queue.pop(3) == head
    while len(queue):
        head = queue.head(4)
        assert queue.pop(4) == head


def test_one_users_connections_share_its_turn() -> None:
    """Opening more connections buys a user no more turns: user 0's two connections alternate in its turn."""
    queue = RequestQueue(1, {1: QueuePolicy()})
    c1 = [_request(1, i, client=(0, "c1")) for i in range(3)]
    c2 = [_request(1, 10 + i, client=(0, "c2")) for i in range(3)]
    other = [_request(1, 20 + i, client=(1, "d")) for i in range(3)]
    for r in (*c1, *c2, *other):
        queue.push(r)
    assert queue.head(6) == [c1[0], other[0], c2[0], other[1], c1[1], other[2]]


def test_priority_comes_before_turns_and_timeouts_keep_the_client() -> None:
    queue = RequestQueue(2, {1: QueuePolicy(), 2: QueuePolicy()})
    low = _request(2, 0, client=("b", 1))
    late = _request(1, 1, deadline=100, action="DELAY", client=("a", 1))
    gone = _request(1, 2, deadline=100, client=("a", 1))
    high = _request(1, 3, client=("b", 1))
    for r in (low, late, gone, high):
        queue.push(r)
    assert queue.expire(200) == [gone]
    assert queue.head(10) == [high, late, low]
    assert late.item.client == ("a", 1)
