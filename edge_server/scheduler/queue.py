"""The per-model request queue: priority levels, queue size limits and timeouts (Triton's queue policy).

Not thread-safe on its own: the scheduler calls it under its condition lock.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Hashable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from edge_server.backends.base import BatchItem
from edge_server.config.model import QueuePolicy
from edge_server.errors import QueueFull, RequestTimeout


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
    delayed: bool = field(default=False)

    @property
    def batch_size(self) -> int:
        return self.item.batch_size


class RequestQueue:
    """Requests by priority level (1 is the highest, as in Triton), FIFO within a level.

    Requests whose timeout expired under the DELAY action move behind every request that has not
    expired; under REJECT they leave the queue with a timeout error.
    """

    def __init__(self, levels: int, policies: dict[int, QueuePolicy]) -> None:
        self._levels = [deque[QueuedRequest]() for _ in range(max(levels, 1))]
        self._delayed: deque[QueuedRequest] = deque()
        self._policies = policies
        self._with_deadline = 0

    def __len__(self) -> int:
        return sum(len(level) for level in self._levels) + len(self._delayed)

    def push(self, request: QueuedRequest) -> None:
        level = self._levels[request.level - 1]
        limit = self._policies[request.level].max_queue_size
        if limit and len(level) >= limit:
            raise QueueFull(
                f"queue for priority level {request.level} is full ({limit} requests, max_queue_size); "
                "retry later"
            )
        level.append(request)
        if request.deadline_ns:
            self._with_deadline += 1

    def expire(self, now_ns: int) -> list[QueuedRequest]:
        """Apply timeouts; return the requests rejected (already failed with RequestTimeout)."""
        if not self._with_deadline:
            return []
        rejected: list[QueuedRequest] = []
        for index, level in enumerate(self._levels):
            if not any(r.deadline_ns and r.deadline_ns <= now_ns for r in level):
                continue
            keep: deque[QueuedRequest] = deque()
            for request in level:
                if not request.deadline_ns or request.deadline_ns > now_ns:
                    keep.append(request)
                    continue
                self._with_deadline -= 1
                if request.timeout_action == "DELAY":
                    request.delayed = True
                    self._delayed.append(request)
                else:
                    waited_us = (now_ns - request.enqueue_ns) // 1000
                    if request.future.set_running_or_notify_cancel():
                        request.future.set_exception(
                            RequestTimeout(f"request timed out after {waited_us} us in the queue")
                        )
                    rejected.append(request)
            self._levels[index] = keep
        return rejected

    def head(self, limit: int) -> list[QueuedRequest]:
        """The first ``limit`` requests in the order they will be served."""
        ordered: Iterator[QueuedRequest] = itertools.chain(*self._levels, self._delayed)
        return list(itertools.islice(ordered, limit))

    def pop(self, count: int) -> list[QueuedRequest]:
        """Remove the first ``count`` requests (in :meth:`head` order)."""
        taken: list[QueuedRequest] = []
        for level in (*self._levels, self._delayed):
            while level and len(taken) < count:
                request = level.popleft()
                if request.deadline_ns and not request.delayed:
                    self._with_deadline -= 1
                taken.append(request)
        return taken

    def drain(self) -> list[QueuedRequest]:
        return self.pop(len(self))
