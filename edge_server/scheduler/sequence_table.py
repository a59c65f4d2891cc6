"""Which sequences a sequence-batched version holds, and where: slots, candidate places, the backlog.

The sequence batcher (:mod:`~edge_server.scheduler.sequence`) forms and runs batches; this table keeps
who is where between them: the live sequences by (owner, correlation id), every sequence not yet
released, their batch slots (``direct``: a slot of one instance, for the sequence's lifetime) or
candidate places (``oldest``), the backlog of those that found none, the ids of sequences released
for idleness (for a precise error), and the counts the statistics show.  A sequence that waits in the
backlog past its bound is refused; one idle for ``max_sequence_idle_microseconds`` is released.

Every method is called with the batcher's lock held (the pool's); nothing here completes a future.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from edge_server.errors import InvalidArgument, QueueFull, shorten
from edge_server.request import BatchItem, ClientKey
from edge_server.scheduler.queue import Turns
from edge_server.scheduler.sequence_tensors import State

log = logging.getLogger(__name__)

_EXPIRED_REMEMBERED = 4096  # correlation ids of idled-out sequences kept for a precise error

#: A sequence's key: (its owner, its correlation id).
Key = tuple[int | None, int | str]


@dataclass(slots=True, eq=False)
class SequenceRequest:
    item: BatchItem
    shape_key: Hashable
    future: Future[dict]
    enqueue_ns: int
    rescheduled: bool = False  # the model released it with RESCHEDULE: its future is already running
    restarts: bool = False  # a START on a live sequence: its state starts afresh when it runs
    arrival: int = 0  # its place in arrival order, where preserve_ordering counts (sequence_order)

    @property
    def batch_size(self) -> int:
        return 1


@dataclass(eq=False)
class Sequence:
    corrid: int | str
    last_ns: int
    owner: int | None = None
    client: ClientKey | None = None  # who sent its START: its turn in the backlog and among heads
    backlog_until_ns: int = 0  # in the backlog: when its wait for a slot ends with QUEUE_FULL
    pending: collections.deque[SequenceRequest] = field(default_factory=collections.deque)
    busy: bool = False
    ending: bool = False  # END was submitted: no more requests
    admitted: bool = False  # holds a slot (direct) or a candidate place (oldest)
    slot: tuple[int, int] | None = None  # direct: (instance, row)
    instance: int = 0  # oldest: the instance whose candidates it is among, for its lifetime
    state: State | None = None


class SequenceTable:
    """The sequences of one version and their places (see the module doc); the caller holds the lock."""

    def __init__(
        self,
        model: str,
        *,
        direct: bool,
        instances: int,
        slots_per_instance: int,
        max_candidates: int,
        idle_ns: int,
        max_sequences: int,
    ) -> None:
        self._name = model
        self.direct = direct
        self._slots_per_instance = slots_per_instance
        self._max_candidates = max_candidates
        self.idle_ns = idle_ns
        self._max_sequences = max_sequences
        self.live: dict[Key, Sequence] = {}  # sequences that take requests (END not yet sent)
        self.held: set[Sequence] = set()  # every sequence not yet released (live or ending)
        self._expired: collections.OrderedDict[Key, None] = collections.OrderedDict()
        # waiting for a slot or place, users (and their connections) in turn: one user's flood of STARTs
        # does not make another's wait for all of it (the dynamic batcher's rule, scheduler.queue)
        self.backlog: Turns[Sequence] = Turns(client_of)
        # oldest: each instance's admitted sequences, in admission order.  As in Triton, a sequence
        # runs on one instance for its lifetime: a model may keep a sequence's state in the instance.
        self.candidates: list[list[Sequence]] = [[] for _ in range(instances)]
        self.slots: list[list[Sequence | None]] = [[None] * slots_per_instance for _ in range(instances)]
        self.counts = {"started": 0, "ended": 0, "expired": 0}

    def start(
        self, key: Key, now: int, state: State, timeout_us: int | None, client: ClientKey | None = None
    ) -> Sequence:
        """A new live sequence of ``client``, admitted or backlogged; QUEUE_FULL when the table is full."""
        if len(self.held) >= self._max_sequences:
            raise QueueFull(
                f"model {self._name!r} has {len(self.held)} live sequences, the most it keeps; "
                "end sequences (sequence_end) or let them idle out before starting more"
            )
        seq = Sequence(key[1], now, key[0], client, state=state)
        self.live[key] = seq
        self.held.add(seq)
        self._expired.pop(key, None)
        self.counts["started"] += 1
        self._admit(seq, now, timeout_us)
        return seq

    def restart(self, seq: Sequence) -> None:
        """A START on live ``seq``: the old sequence ends here, a new one goes on in its place."""
        log.warning(
            "%s: sequence %s started again before it ended; the old one ends here",
            self._name,
            shorten(seq.corrid),
        )
        self.counts["ended"] += 1
        self.counts["started"] += 1

    def end(self, key: Key, seq: Sequence) -> None:
        """END was submitted: no more requests for ``key``; released once its requests ran."""
        del self.live[key]
        seq.ending = True

    def unknown(self, key: Key) -> InvalidArgument:
        """The error for a request of a sequence not live here (for this owner)."""
        corrid = key[1]
        # Triton's text first (its clients match it), the same for every reason: whether another
        # user's sequence of that id exists is never told.
        start = (
            f"inference request for sequence {corrid if isinstance(corrid, int) else shorten(corrid)} "
            f"to model {self._name!r} must specify the START flag on the first request of the sequence"
        )
        if key in self._expired:
            return InvalidArgument(
                f"{start} (it was released after being idle for more than {self.idle_ns // 1000} us, "
                "max_sequence_idle_microseconds)"
            )
        return InvalidArgument(
            f"{start} (it is not in progress: never started, already ended, idled out, or refused for "
            "want of a slot; a sequence takes requests only from the user who started it)"
        )

    def stats(self, instance_names: list[str]) -> dict[str, Any]:
        """Sequence counts and slot occupancy for the statistics."""
        out: dict[str, Any] = {
            "strategy": "direct" if self.direct else "oldest",
            "active": len(self.held),
            "backlog": len(self.backlog),
            **self.counts,
        }
        if self.direct:
            out["slots"] = [
                {"instance": name, "total": len(slots), "occupied": sum(s is not None for s in slots)}
                for name, slots in zip(instance_names, self.slots, strict=True)
            ]
        else:
            out["candidates"] = sum(len(c) for c in self.candidates)
        return out

    def _admit(self, seq: Sequence, now: int = 0, timeout_us: int | None = None) -> None:
        """Give ``seq`` a slot (direct) or a candidate place (oldest), or put it in the backlog.

        In the backlog it waits at most ``timeout_us`` (its START request's), else the idle limit.
        """
        if self.direct:
            # Row by row across the instances, so that sequences spread over every instance first.
            for row in range(self._slots_per_instance):
                for instance, slots in enumerate(self.slots):
                    if slots[row] is None:
                        slots[row] = seq
                        seq.slot = (instance, row)
                        seq.admitted = True
                        return
        else:  # the instance with the fewest candidates, among those with a place left
            instance, places = min(enumerate(self.candidates), key=lambda c: len(c[1]))
            if not self._max_candidates or len(places) < self._max_candidates:
                places.append(seq)
                seq.instance = instance
                seq.admitted = True
                return
        if not seq.backlog_until_ns:
            bound_ns = timeout_us * 1000 if timeout_us else self.idle_ns
            seq.backlog_until_ns = (now or time.monotonic_ns()) + bound_ns
        self.backlog.append(seq)

    def release(self, seq: Sequence, *, expired: bool) -> None:
        """Free ``seq``'s place and state (it ended, idled out or the version stops); admit the next."""
        self.held.discard(seq)
        key = (seq.owner, seq.corrid)
        if self.live.get(key) is seq:
            del self.live[key]
        if expired:
            self.counts["expired"] += 1
            self._expired[key] = None
            while len(self._expired) > _EXPIRED_REMEMBERED:
                self._expired.popitem(last=False)
        else:
            self.counts["ended"] += 1
        seq.state = None
        if not seq.admitted:
            self.backlog.remove(seq)
            return
        if seq.slot is not None:
            instance, row = seq.slot
            self.slots[instance][row] = None
        else:
            self.candidates[seq.instance].remove(seq)
        seq.admitted = False
        if self.backlog:
            self._admit(self.backlog.popleft())

    def reap(self, now: int) -> tuple[int, list[SequenceRequest]]:
        """Release sequences idle for too long and refuse those backlogged past their bound.

        Returns (ns until the next one could be, 0: none; the refused sequences' requests, to fail).
        """
        soonest = 0
        refused: list[SequenceRequest] = []
        for seq in list(self.backlog):
            left = seq.backlog_until_ns - now
            if left <= 0:
                refused += self._refuse(seq)
            else:
                soonest = left if not soonest else min(soonest, left)
        for seq in list(self.held):
            if seq.busy or seq.pending:
                continue
            idle = now - seq.last_ns
            if idle >= self.idle_ns:
                log.info("%s: sequence %r idle for %d us; released", self._name, seq.corrid, idle // 1000)
                self.release(seq, expired=True)
            else:
                left = self.idle_ns - idle
                soonest = left if not soonest else min(soonest, left)
        return soonest, refused

    def _refuse(self, seq: Sequence) -> list[SequenceRequest]:
        """A backlogged sequence waited its bound for a slot: release it; its requests are to fail."""
        self.held.discard(seq)
        key = (seq.owner, seq.corrid)
        if self.live.get(key) is seq:
            del self.live[key]
        self.backlog.remove(seq)
        requests = list(seq.pending)
        seq.pending.clear()
        seq.state = None
        log.warning("%s: sequence %r found no free slot in time; refused", self._name, shorten(seq.corrid))
        return requests


def client_of(seq: Sequence) -> ClientKey | None:
    """Whose turn ``seq`` takes (:class:`~edge_server.scheduler.queue.Turns`)."""
    return seq.client
