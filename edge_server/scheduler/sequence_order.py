"""``preserve_ordering`` for the sequence batcher's ``oldest`` strategy: answers in arrival order.

Requests of different sequences run on different instances, in batches formed as their sequences
become ready, so they finish out of the order they came in.  With ``preserve_ordering`` an answer is
held until every earlier request that can run has been answered: those queued on a sequence that
holds a candidate place and those executing.  A sequence waiting in the backlog for a place does not
hold anyone back (its requests are ordered once it has one): a client that waits for an answer before
it sends its sequence's next request would otherwise wait on a sequence that waits for that client's
place, as Triton's oldest strategy avoids too.

No thread waits for its turn: the worker that finishes a batch leaves its answers here and goes back
to work; whichever worker finds answers that may leave delivers them, one worker at a time, so that
they reach their futures (and a stream's wire) in order.  Everything but the delivery itself is
called with the batcher's lock held.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from edge_server.request import Result
from edge_server.scheduler.sequence_table import SequenceRequest

_NONE_WAITING = 1 << 62


@dataclass(order=True)
class _Answer:
    arrival: int
    request: SequenceRequest = field(compare=False)
    result: Result = field(compare=False)


class ArrivalOrder:
    """The answers of one version held back until the earlier requests are answered (lock held)."""

    def __init__(self) -> None:
        self._arrivals = itertools.count()
        self._running: dict[int, int] = {}  # id(request) -> arrival, of requests executing
        self._finished: list[_Answer] = []  # a heap by arrival
        self._delivering = False

    def arrived(self, request: SequenceRequest) -> None:
        request.arrival = next(self._arrivals)

    def running(self, requests: Iterable[SequenceRequest]) -> None:
        for request in requests:
            self._running[id(request)] = request.arrival

    def finished(self, request: SequenceRequest, result: Result | None) -> None:
        """``request`` stopped executing; ``result``: its answer, or None (cancelled, or queued again)."""
        self._running.pop(id(request), None)
        if result is not None:
            heapq.heappush(self._finished, _Answer(request.arrival, request, result))

    def take(self, first_queued: int | None) -> list[tuple[SequenceRequest, Result]] | None:
        """The answers that may leave now, in order; None while another thread delivers (it takes these).

        The caller delivers them, then calls :meth:`delivered`.  ``first_queued``: the arrival of the
        earliest request queued on a sequence with a place.
        """
        if self._delivering:
            return None
        floor = min(self._running.values(), default=_NONE_WAITING)
        if first_queued is not None:
            floor = min(floor, first_queued)
        out = []
        while self._finished and self._finished[0].arrival < floor:
            answer = heapq.heappop(self._finished)
            out.append((answer.request, answer.result))
        self._delivering = bool(out)
        return out

    def delivered(self) -> None:
        self._delivering = False
