"""The per-model request queue: priority levels, queue size limits and timeouts (Triton's queue policy).

Not thread-safe on its own: the scheduler calls it under its condition lock.  Nothing here completes a
future: a future's done-callbacks may submit more work (a pipeline's next step), and running them under
the scheduler's lock would deadlock; the queue hands requests back and the scheduler completes them
after releasing the lock.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Hashable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

from edge_server.config.model import QueuePolicy
from edge_server.errors import QueueFull, RequestTimeout
from edge_server.request import BatchItem


@dataclass(eq=False)
class QueuedRequest:
    """A validated request waiting for an instance; its future receives the outputs or the error."""

    item: BatchItem
    shape_key: Hashable
    level: int
    enqueue_ns: int
    future: Future[dict]
    deadline_ns: int = 0  # 0: no timeout
    timeout_action: str = "REJECT"

    @property
    def batch_size(self) -> int:
        return self.item.batch_size


class RequestQueue:
    """Requests by priority level (1 is the highest, as in Triton), FIFO within a level.

    As in Triton's policy queues, every level has a main queue and a delayed queue: a request whose
    timeout expired under the DELAY action moves to its level's delayed queue, served after that
    level's other requests and before the next level; under REJECT it leaves with a timeout error.
    ``max_queue_size`` counts both queues of a level.
    """

    def __init__(self, levels: int, policies: dict[int, QueuePolicy]) -> None:
        count = max(levels, 1)
        self._main = [deque[QueuedRequest]() for _ in range(count)]
        self._delayed = [deque[QueuedRequest]() for _ in range(count)]
        self._policies = policies
        self._with_deadline = 0  # requests in main queues with a deadline: skip expiry scans without
        #: requests queued at every level (a plain attribute: the scheduler asks it twice per request)
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def push(self, request: QueuedRequest) -> None:
        index = request.level - 1
        limit = self._policies[request.level].max_queue_size
        if limit and len(self._main[index]) + len(self._delayed[index]) >= limit:
            raise QueueFull(
                f"queue for priority level {request.level} is full ({limit} requests, max_queue_size); "
                "retry later"
            )
        self._main[index].append(request)
        self.size += 1
        if request.deadline_ns:
            self._with_deadline += 1

    def expire(self, now_ns: int) -> list[QueuedRequest]:
        """Apply timeouts; return the requests rejected, for the caller to fail with :func:`timed_out`.

        They are out of the queue but their futures are untouched: complete them only after the
        scheduler's lock is released.
        """
        if not self._with_deadline:
            return []
        rejected: list[QueuedRequest] = []
        for index, main in enumerate(self._main):
            if not any(r.deadline_ns and r.deadline_ns <= now_ns for r in main):
                continue
            keep: deque[QueuedRequest] = deque()
            for request in main:
                if not request.deadline_ns or request.deadline_ns > now_ns:
                    keep.append(request)
                    continue
                self._with_deadline -= 1
                if request.timeout_action == "DELAY":
                    self._delayed[index].append(request)
                    continue
                rejected.append(request)
            self._main[index] = keep
        self.size -= len(rejected)
        return rejected

    def _ordered(self) -> Iterator[deque[QueuedRequest]]:
        for main, delayed in zip(self._main, self._delayed, strict=True):
            yield main
            yield delayed

    def head(self, limit: int) -> list[QueuedRequest]:
        """The first ``limit`` requests in the order they will be served."""
        return list(itertools.islice(itertools.chain.from_iterable(self._ordered()), limit))

    def pop(self, count: int) -> list[QueuedRequest]:
        """Remove the first ``count`` requests (in :meth:`head` order)."""
        taken: list[QueuedRequest] = []
        for main, delayed in zip(self._main, self._delayed, strict=True):
            while main and len(taken) < count:
                request = main.popleft()
                if request.deadline_ns:
                    self._with_deadline -= 1
                taken.append(request)
            while delayed and len(taken) < count:
                taken.append(delayed.popleft())
            if len(taken) == count:
                break
        self.size -= len(taken)
        return taken

    def drain(self) -> list[QueuedRequest]:
        return self.pop(len(self))


def timed_out(request: QueuedRequest, now_ns: int) -> RequestTimeout:
    """The error of a request that :meth:`RequestQueue.expire` rejected."""
    waited_us = (now_ns - request.enqueue_ns) // 1000
    return RequestTimeout(f"request timed out after {waited_us} us in the queue")
