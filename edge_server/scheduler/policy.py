"""The dynamic batching decision, as a pure function of the queue and the clock.

Kept free of threads and locks so that every rule can be unit-tested with made-up timestamps.  The
rules are Triton's (``DynamicBatchScheduler::GetDynamicBatch``):

1. Take requests in queue order while they fit: the summed batch size stays within ``max_batch_size``
   and every request has the same non-batch shapes as the first.  Requests are never split.  Where
   the next request would take the batch past the largest preferred size, the prefix so far is marked.
2. A prefix that reaches a preferred batch size is marked too; the largest mark wins.  If there is a
   mark and the oldest request has not yet waited ``max_queue_delay``, the marked prefix goes at once.
3. If the batch cannot grow (the next request does not fit) or has reached the largest preferred size
   (``max_batch_size`` when none is given), everything taken goes now.
4. If the oldest request has waited the delay (or the delay is 0), everything taken goes now.
5. Otherwise wait until the oldest request's delay runs out, or until something new arrives.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol


class Queued(Protocol):
    @property
    def batch_size(self) -> int: ...

    @property
    def shape_key(self) -> Hashable: ...

    @property
    def enqueue_ns(self) -> int: ...


@dataclass(frozen=True)
class BatchSettings:
    max_batch_size: int  # >= 1; a model without batching uses 1 and batch-size-1 requests
    preferred_batch_sizes: frozenset[int] = frozenset()
    max_queue_delay_ns: int = 0
    batching: bool = True  # False: every request runs alone (Triton's default scheduler)


@dataclass(frozen=True)
class Decision:
    """Take ``count`` requests from the head now; or, when count is 0, wait ``wait_ns`` (0: queue empty)."""

    count: int
    wait_ns: int = 0


def next_batch(pending: Sequence[Queued], now_ns: int, settings: BatchSettings) -> Decision:
    """Decide what to send next from ``pending`` (in queue order)."""
    if not pending:
        return Decision(0)
    if not settings.batching:
        return Decision(1)
    key = pending[0].shape_key
    largest_preferred = max(settings.preferred_batch_sizes, default=settings.max_batch_size)
    total = 0
    count = 0
    oldest = pending[0].enqueue_ns
    marked = 0
    blocked = False
    for request in pending:
        if count:
            grown = total + request.batch_size
            if grown > largest_preferred and not marked:
                marked = count
            if grown > settings.max_batch_size or request.shape_key != key:
                blocked = True
                break
        total += request.batch_size
        count += 1
        oldest = min(oldest, request.enqueue_ns)
        if total in settings.preferred_batch_sizes:
            marked = count
    waited = now_ns - oldest
    delay_exceeded = settings.max_queue_delay_ns > 0 and waited >= settings.max_queue_delay_ns
    if marked and not delay_exceeded:
        return Decision(marked)
    if blocked or total >= largest_preferred or delay_exceeded or settings.max_queue_delay_ns == 0:
        return Decision(count)
    return Decision(0, settings.max_queue_delay_ns - waited)
