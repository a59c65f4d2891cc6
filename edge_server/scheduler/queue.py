"""The per-model request queue: priority levels, clients' turns, Triton's queue policy (limits, timeouts).

Not thread-safe on its own: the scheduler calls it under its condition lock.  Nothing here completes a
future: a future's done-callbacks may submit more work (a pipeline's next step), and running them under
the scheduler's lock would deadlock; the queue hands requests back and the scheduler completes them
after releasing the lock.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

from edge_server.config.model import QueuePolicy
from edge_server.errors import QueueFull, RequestTimeout
from edge_server.request import BatchItem, ClientKey


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


T = TypeVar("T")


def _client_of_request(request: QueuedRequest) -> ClientKey | None:
    return request.item.client


class Turns(Generic[T]):
    """One queue whose clients take turns: user after user, and one user's connections in turn.

    Each connection's requests stay in arrival order; a user (or connection) that has a request
    waiting joins the end of the rotation, and goes back to its end each time one of its requests is
    taken.  So a client's burst delays another client by one of its requests per turn, not the whole
    burst, and a user cannot buy more turns by opening more connections.  Requests without a client
    (the in-process API) are one client: first in, first out, as without turns.

    ``client_of`` says whose an entry is (:func:`~edge_server.request.client_key`): the dynamic
    batcher queues requests, the sequence batcher its sequences waiting for a slot and their heads.
    """

    def __init__(self, client_of: Callable[[T], ClientKey | None]) -> None:
        self._client_of = client_of
        # user -> connection -> entries; both dicts in rotation order (next to serve first)
        self._users: dict[Hashable, dict[Hashable, deque[T]]] = {}
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def append(self, request: T) -> None:
        user, connection = self._client_of(request) or _NO_CLIENT
        lanes = self._users.get(user)
        if lanes is None:
            lanes = self._users[user] = {}
        lane = lanes.get(connection)
        if lane is None:
            lane = lanes[connection] = deque()
        lane.append(request)
        self.size += 1

    def __iter__(self) -> Iterator[T]:
        """Every request in the order :meth:`popleft` would take them (the queue left as it is)."""
        users = self._users
        if len(users) == 1:
            (lanes,) = users.values()
            if len(lanes) == 1:
                return iter(next(iter(lanes.values())))  # one client: its own order
        return _in_turn([_in_turn([iter(lane) for lane in lanes.values()]) for lanes in users.values()])

    def popleft(self) -> T:
        user, lanes = next(iter(self._users.items()))
        connection, lane = next(iter(lanes.items()))
        request = lane.popleft()
        del lanes[connection]
        if lane:
            lanes[connection] = lane  # to the end of its user's rotation
        del self._users[user]
        if lanes:
            self._users[user] = lanes  # to the end of the rotation
        self.size -= 1
        return request

    def clear(self) -> None:
        self._users.clear()
        self.size = 0

    def remove(self, entry: T) -> None:
        """Take ``entry`` out (it must be here); the rotation is kept."""
        taken = self.remove_if(lambda queued: queued is entry)
        assert taken, "not in the queue"

    def remove_if(self, expired: Callable[[T], bool]) -> list[T]:
        """Take out the requests ``expired`` accepts (in turn order by client); the rotation is kept."""
        taken: list[T] = []
        for user, lanes in list(self._users.items()):
            for connection, lane in list(lanes.items()):
                if not any(expired(r) for r in lane):
                    continue
                keep = deque(r for r in lane if not expired(r))
                taken.extend(r for r in lane if expired(r))
                if keep:
                    lanes[connection] = keep
                else:
                    del lanes[connection]
            if not lanes:
                del self._users[user]
        self.size -= len(taken)
        return taken


_NO_CLIENT = (None, None)


def _in_turn(iterators: list[Iterator[T]]) -> Iterator[T]:
    """One item from each iterator in turn, dropping the exhausted ones (round robin)."""
    turn = deque(iterators)
    while turn:
        iterator = turn.popleft()
        for request in iterator:
            yield request
            turn.append(iterator)
            break


class RequestQueue:
    """Requests by priority level (1 is the highest, as in Triton); within a level, clients take turns.

    As in Triton's policy queues, every level has a main queue and a delayed queue: a request whose
    timeout expired under the DELAY action moves to its level's delayed queue, served after that
    level's other requests and before the next level; under REJECT it leaves with a timeout error.
    ``max_queue_size`` counts both queues of a level.  Beyond Triton (first in, first out within a
    level), each queue serves its clients in turns (:class:`Turns`): one client's burst never makes
    the others wait for all of it, and batches still take requests of every client waiting.
    """

    def __init__(self, levels: int, policies: dict[int, QueuePolicy]) -> None:
        count = max(levels, 1)
        self._main = [Turns(_client_of_request) for _ in range(count)]
        self._delayed = [Turns(_client_of_request) for _ in range(count)]
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
        for main, delayed in zip(self._main, self._delayed, strict=True):
            for request in main.remove_if(lambda r: 0 < r.deadline_ns <= now_ns):
                self._with_deadline -= 1
                if request.timeout_action == "DELAY":
                    delayed.append(request)
                else:
                    rejected.append(request)
        self.size -= len(rejected)
        return rejected

    def _ordered(self) -> Iterator[Turns[QueuedRequest]]:
        for main, delayed in zip(self._main, self._delayed, strict=True):
            yield main
            yield delayed

    def head(self, limit: int) -> list[QueuedRequest]:
        """The first ``limit`` requests in the order they will be served."""
        taken: list[QueuedRequest] = []
        for turns in self._ordered():
            if turns.size:
                taken.extend(itertools.islice(turns, limit - len(taken)))
                if len(taken) == limit:
                    break
        return taken

    def pop(self, count: int) -> list[QueuedRequest]:
        """Remove the first ``count`` requests (in :meth:`head` order)."""
        taken: list[QueuedRequest] = []
        for main, delayed in zip(self._main, self._delayed, strict=True):
            while main.size and len(taken) < count:
                request = main.popleft()
                if request.deadline_ns:
                    self._with_deadline -= 1
                taken.append(request)
            while delayed.size and len(taken) < count:
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
