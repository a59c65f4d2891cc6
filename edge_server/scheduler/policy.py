"""The dynamic batching decision, as a pure function of the queue and the clock.

Kept free of threads and locks so that every rule can be unit-tested with made-up timestamps.  The
decision order is Triton's:

1. Take requests in queue order while they fit: the summed batch size stays within ``max_batch_size``
   and every request has the same non-batch shapes as the first.  Requests are never split.
2. If a prefix of that reaches a preferred batch size, send the largest such prefix at once.
3. If the batch cannot grow (it is full, or the next request does not fit), send it.
4. If the oldest request in it has waited ``max_queue_delay`` (or the delay is 0), send it.
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
    total = 0
    count = 0
    oldest = pending[0].enqueue_ns
    best_preferred = 0
    blocked = False
    for request in pending:
        if total + request.batch_size > settings.max_batch_size or request.shape_key != key:
            blocked = count > 0
            if count == 0:  # validated requests always fit alone; guard against a broken caller
                return Decision(1)
            break
        total += request.batch_size
        count += 1
        oldest = min(oldest, request.enqueue_ns)
        if total in settings.preferred_batch_sizes:
            best_preferred = count
    if best_preferred:
        return Decision(best_preferred)
    if blocked or total >= settings.max_batch_size:
        return Decision(count)
    waited = now_ns - oldest
    if waited >= settings.max_queue_delay_ns:
        return Decision(count)
    return Decision(0, settings.max_queue_delay_ns - waited)
