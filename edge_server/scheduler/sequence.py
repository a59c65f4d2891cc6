"""Triton's sequence batcher: stateful models, one correlation id per stream, requests in order.

Every request carries a correlation id; the first of a sequence sets START, the last END.  A sequence
has at most one request executing at a time, and its requests run in the order they arrived, so a
model (or the implicit state the server keeps for it) sees a stream step by step.  Sequences of
different streams batch together, one request of each per batch.  Two strategies, as in Triton:

* ``direct``: a sequence is pinned, for its lifetime, to one batch slot of one instance
  (``max_batch_size`` slots per instance, one for a model that does not batch).  Each instance's
  worker builds its batch from its own slots: row ``j`` is slot ``j``; a slot whose sequence has no
  request ready (or no sequence) is filled with a READY=0 row up to the highest ready slot.
  Sequences that find every slot taken wait in a backlog until a slot frees.
* ``oldest``: any idle instance takes the oldest head requests of up to ``max_batch_size``
  different sequences (dynamic batching across sequences, ``preferred_batch_size`` and
  ``max_queue_delay_microseconds`` as for the dynamic batcher), among at most
  ``max_candidate_sequences`` sequences; later sequences wait in a backlog.

A sequence with nothing queued or running for ``max_sequence_idle_microseconds`` is released (its
slot and state freed); its next request is an error, as in Triton.  A sequence also ends after its
END request ran.  A START on a live correlation id ends that sequence early and starts it again in its
place, as Triton does: the requests it already queued run first, the START with fresh state.

Next to strangers (beyond Triton, whose correlation ids are global): a sequence belongs to the owner
of its START request (``BatchItem.owner``: the client's uid, which the frontend learned from the
kernel; None for the in-process API), and sequences are kept by (owner, correlation id).  Another
user's request for that id is told the sequence is not in progress (for it), so it can neither read
nor end someone else's stream, and may start its own under the same id.  A sequence that finds every
slot (direct) or candidate place (oldest) taken waits in the backlog at most its START request's
timeout, or else ``max_sequence_idle_microseconds``, then its requests fail with QUEUE_FULL: a client
that keeps every slot busy cannot make another's start wait without end.

The instances, their workers, restarts after a fault (an isolated model's process that died), busy
time and the stop belong to the :class:`~edge_server.scheduler.pool.InstancePool` the dynamic batcher
uses too; which sequences are live and where they sit (slots, candidate places, the backlog, idle
release) belongs to the :class:`~edge_server.scheduler.sequence_table.SequenceTable`.  This module
takes requests in, forms a batch from the sequences (:meth:`SequenceScheduler.form`), and runs and
delivers it (:meth:`SequenceScheduler.run`).

Lock order: one lock (the pool's); backends run and futures complete outside it.  A sequence is ``busy`` while
one of its requests executes, which is what keeps its requests one at a time and its state
consistent: the state is written back before ``busy`` is cleared.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Hashable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from edge_server.backends.base import Backend, BatchItem, Result, Timing
from edge_server.config.model import ModelConfig
from edge_server.errors import (
    Cancelled,
    ModelExecutionError,
    QueueFull,
    RequestTimeout,
    ServerShuttingDown,
    Unavailable,
    shorten,
)
from edge_server.request import REQUEST_FLAG_SEQUENCE_END, REQUEST_FLAG_SEQUENCE_START, Rescheduled
from edge_server.scheduler.inline import QUEUE_ONLY, Budget
from edge_server.scheduler.policy import BatchSettings, next_batch
from edge_server.scheduler.pool import InstancePool, Restart, complete, restart_backoff
from edge_server.scheduler.queue import Turns
from edge_server.scheduler.scheduler import SchedulerClosed
from edge_server.scheduler.sequence_order import ArrivalOrder
from edge_server.scheduler.sequence_table import Sequence, SequenceRequest, SequenceTable
from edge_server.scheduler.sequence_tensors import SequenceTensors
from edge_server.scheduler.stats import ModelStats

log = logging.getLogger(__name__)

#: Live sequences one version holds at most (each holds its state): a client that starts sequences
#: without end cannot grow the daemon without bound before they idle out.
MAX_SEQUENCES = 16384


class _Head:
    """A sequence's next request as :func:`next_batch` sees it (batch size 1, its shape, its age)."""

    __slots__ = ("seq", "shape_key", "enqueue_ns", "batch_size")

    def __init__(self, seq: Sequence, shape_key: Hashable) -> None:
        self.seq = seq
        self.shape_key = shape_key
        self.enqueue_ns = seq.pending[0].enqueue_ns
        self.batch_size = 1


def in_turns(heads: list[_Head]) -> list[_Head]:
    """``heads`` (oldest first) in the order users, and each user's connections, take turns."""
    if len(heads) < 2:
        return heads
    turns: Turns[_Head] = Turns(lambda head: head.seq.client)
    for head in heads:
        turns.append(head)
    return list(turns)


# A batch as taken from the queues: per row, the sequence and its request (None: a filler row).
_Row = tuple[Sequence | None, SequenceRequest | None]


class SequenceScheduler:
    """The scheduler of a model version with ``sequence_batching``; same interface as ModelScheduler."""

    def __init__(
        self,
        config: ModelConfig,
        instances: list[tuple[str, Backend]],
        stats: ModelStats,
        model_dir: Path,
        *,
        restart: Restart | None = None,
    ) -> None:
        seq = config.sequence_batching
        assert seq is not None
        self._config = config
        self._name = config.name
        self._stats = stats
        self._tensors = SequenceTensors(config, model_dir)
        self._direct = seq.strategy == "direct"
        self._idle_ns = seq.max_sequence_idle_microseconds * 1000
        self._delay_ns = seq.max_queue_delay_microseconds * 1000
        self._min_utilization = seq.minimum_slot_utilization
        self._slots_per_instance = max(config.max_batch_size, 1)
        self._settings = BatchSettings(
            max_batch_size=self._slots_per_instance,
            preferred_batch_sizes=frozenset(seq.preferred_batch_size),
            max_queue_delay_ns=self._delay_ns,
        )
        # oldest's preserve_ordering: answers in the order the requests came (sequence_order)
        self._order = ArrivalOrder() if not self._direct and seq.preserve_ordering else None
        self._pool: InstancePool[list[_Row]] = InstancePool(
            config.name, instances, self, restart=restart, backoff_s=restart_backoff(config)
        )
        self._lock = self._pool.lock
        self._cond = self._pool.cond
        self._table = SequenceTable(
            config.name,
            direct=self._direct,
            instances=len(instances),
            slots_per_instance=self._slots_per_instance,
            max_candidates=seq.max_candidate_sequences,
            idle_ns=self._idle_ns,
            max_sequences=MAX_SEQUENCES,
        )
        self._refused: list[SequenceRequest] = []  # backlogged past their bound: failed outside the lock
        self._queued = 0
        self._in_flight = 0
        self._accepting = True
        self._finish_sequences = False  # the drain waits for live sequences too (close_intake)
        stats.sequence_stats = self.sequence_stats
        self._pool.start()

    # -- request side ---------------------------------------------------------------------------

    def submit(
        self,
        item: BatchItem,
        shape_key: Hashable,
        *,
        priority: int = 0,
        timeout_us: int | None = None,
        budget: Budget = QUEUE_ONLY,
    ) -> Future[dict]:
        """Queue a request behind the earlier ones of its sequence; errors for a wrong sequence raise.

        Never in the caller's thread, whatever its ``budget``: a sequence's requests run on its slots.
        """
        corrid = item.correlation_id
        key = (item.owner, corrid)
        start = bool(item.flags & REQUEST_FLAG_SEQUENCE_START)
        end = bool(item.flags & REQUEST_FLAG_SEQUENCE_END)
        now = time.monotonic_ns()
        future: Future[dict] = Future()
        with self._lock:
            if self._pool.stopping:
                raise SchedulerClosed(f"model {self._name!r} was unloaded")
            if self._pool.unavailable:
                raise Unavailable(self._pool.unavailable)
            table = self._table
            seq = table.live.get(key)
            restarts = start and seq is not None
            if start and seq is not None:
                # Triton's rule: a START on a live id ends that sequence early and starts it again in
                # its place (slot or backlog): what it queued runs first, this request with fresh state.
                table.restart(seq)
            elif start:
                if not self._accepting:
                    raise SchedulerClosed(f"model {self._name!r} is being replaced or unloaded")
                state = self._tensors.initial_state()
                seq = table.start(key, now, state, timeout_us or item.timeout_us, item.client)
            elif seq is None:
                raise table.unknown(key)
            assert seq is not None
            if end:
                table.end(key, seq)
            request = SequenceRequest(item, shape_key, future, now, restarts=restarts)
            if self._order is not None:
                self._order.arrived(request)
            seq.pending.append(request)
            seq.last_ns = now
            self._queued += 1
            self._cond.notify_all()
        return future

    def holds(self, corrid: int | str, owner: int | None = None) -> bool:
        """Whether ``owner``'s ``corrid`` is a live sequence here (a reload lets it finish here)."""
        return (owner, corrid) in self._table.live

    def queue_size(self) -> int:
        with self._lock:
            return self._queued

    def set_sole_version(self, sole: bool) -> None:
        """Nothing to change: a sequence's requests always run on its slots' workers."""

    def liveness(self) -> tuple[int, bool]:
        """(executions finished, whether one is running): see service.liveness.

        Queued requests alone do not count: a sequence may wait for a slot that an idle sequence holds
        until it expires, which is not a hang.
        """
        with self._lock:
            return self._pool.progress, bool(self._in_flight)

    def readiness(self) -> list[Future[bool]]:
        return self._pool.readiness()

    def instance_busy_ns(self) -> dict[str, int]:
        return self._pool.busy_ns()

    def sequence_stats(self) -> dict[str, Any]:
        """Sequence counts and slot occupancy for the statistics."""
        with self._lock:
            return self._table.stats(self._pool.names())

    # -- releasing sequences (lock held) ---------------------------------------------------------

    def _release(self, seq: Sequence, *, expired: bool) -> None:
        self._table.release(seq, expired=expired)
        self._cond.notify_all()

    def _fail_refused(self) -> None:
        """Answer the requests of refused sequences (called with the lock held; completes outside it)."""
        refused, self._refused = self._refused, []
        where = "slot" if self._direct else "candidate place"
        self._lock.release()
        try:
            for request in refused:
                if request.future.set_running_or_notify_cancel():
                    request.future.set_exception(
                        QueueFull(
                            f"model {self._name!r}: sequence {shorten(request.item.correlation_id)} "
                            f"found no free {where} in time: every one is held by a live sequence (they "
                            "free when a sequence ends or stays idle for max_sequence_idle_microseconds); "
                            "start it again later"
                        )
                    )
        finally:
            self._lock.acquire()

    # -- lifecycle ------------------------------------------------------------------------------

    def close_intake(self, *, finish_sequences: bool = False) -> None:
        """Start no new sequences; live ones go on until they end or idle out.

        ``finish_sequences`` (a reload, where the data plane keeps routing their requests here): the
        drain also waits for every live sequence to end or idle out.
        """
        with self._lock:
            self._accepting = False
            self._finish_sequences = self._finish_sequences or finish_sequences
            self._cond.notify_all()

    def drain(self, deadline: float) -> bool:
        """Close intake and wait, until ``deadline`` (monotonic), for queued and running requests.

        Returns False if the deadline passed first.
        """
        self.close_intake()
        return self._pool.drain(
            deadline,
            lambda: bool(self._queued or self._in_flight or (self._finish_sequences and self._table.held)),
        )

    def stop(self, grace: float = 2.0) -> None:
        """Stop the workers, fail what is still queued, close the instances (see ModelScheduler.stop)."""
        with self._lock:
            self._accepting = False
            self._pool.mark_stopping()
            leftover = self._take_all_pending()
            for seq in list(self._table.held):  # a busy one's worker finds it released when its batch ends
                self._table.release(seq, expired=False)
            self._table.backlog.clear()
            self._cond.notify_all()
        self._fail(leftover, ServerShuttingDown(f"model {self._name!r} was unloaded before the request ran"))
        self._pool.stop(grace)

    def _take_all_pending(self) -> list[SequenceRequest]:
        """Every queued request, taken off its sequence, and those refused a slot (lock held)."""
        leftover = [r for seq in self._table.held for r in seq.pending] + self._refused
        self._refused = []
        for seq in self._table.held:
            seq.pending.clear()
        self._queued = 0
        return leftover

    @staticmethod
    def _fail(requests: list[SequenceRequest], error: Exception) -> None:
        for request in requests:
            if request.rescheduled or request.future.set_running_or_notify_cancel():
                request.future.set_exception(error)

    # -- the pool's batcher: form a batch, run and deliver it --------------------------------------

    def waiting(self) -> int:
        return self._queued

    def all_down(self, why: str) -> None:
        """Every instance is down and restarting failed: queued requests fail now, UNAVAILABLE."""
        with self._lock:
            leftover = self._take_all_pending()
            self._cond.notify_all()
        self._fail(leftover, Unavailable(why))

    def form(self, index: int) -> tuple[list[_Row] | None, float | None]:
        """Rows for instance ``index`` (its slots, or the oldest sequences), or how long to wait."""
        now = time.monotonic_ns()
        reap_ns, refused = self._table.reap(now)
        if refused:
            self._queued -= len(refused)
            self._refused += refused
            self._cond.notify_all()  # a drain waiting for the queue to empty
        if self._refused:
            self._fail_refused()  # lets go of the lock while it answers: look again afterwards
            return None, 0.0
        rows, wait_ns = self._form_direct(index, now) if self._direct else self._form_oldest(index, now)
        if rows:
            for seq, request in rows:
                if seq is not None and request is not None:
                    seq.busy = True
                    seq.pending.popleft()
                    self._queued -= 1
                    self._in_flight += 1
            if self._order is not None:
                self._order.running(request for _, request in rows if request is not None)
            return rows, None
        waits = [w for w in (wait_ns, reap_ns) if w]
        return None, (min(waits) / 1e9 if waits else None)

    def _ready(self, candidates: list[Sequence]) -> list[Sequence]:
        return [s for s in candidates if s.pending and not s.busy]

    def _key(self, seq: Sequence) -> Hashable:
        """What rows must share to be stacked: the head's input shapes, and a growing state's shapes."""
        key = seq.pending[0].shape_key
        if self._tensors.variable_state and seq.state is not None:  # not busy: nobody writes it now
            return (key, tuple(v.shape for v in seq.state.values()))
        return key

    def _form_direct(self, instance: int, now: int) -> tuple[list[_Row], int]:
        slots = self._table.slots[instance]
        ready = self._ready([s for s in slots if s is not None])
        if not ready:
            return [], 0
        oldest = min(ready, key=lambda s: s.pending[0].enqueue_ns)
        key = self._key(oldest)
        ready = [s for s in ready if self._key(s) == key]
        waited = now - oldest.pending[0].enqueue_ns
        full_enough = len(ready) >= self._min_utilization * len(slots)
        if self._delay_ns and self._accepting and not full_enough and waited < self._delay_ns:
            return [], self._delay_ns - waited
        chosen = set(ready)
        last = max(s.slot[1] for s in ready if s.slot is not None)
        rows: list[_Row] = []
        for row in range(last + 1):
            holder = slots[row]
            if holder is not None and holder in chosen:
                rows.append((holder, holder.pending[0]))
            else:
                rows.append((holder, None))  # filler: READY=0, the slot's state passes through
        return rows, 0

    def _form_oldest(self, instance: int, now: int) -> tuple[list[_Row], int]:
        ready = self._ready(self._table.candidates[instance])
        if not ready:
            return [], 0
        # oldest first, users (and their connections) in turn: one user's many sequences take one turn
        heads = in_turns(sorted((_Head(s, self._key(s)) for s in ready), key=lambda h: h.enqueue_ns))
        settings = self._settings if self._accepting else BatchSettings(self._settings.max_batch_size)
        decision = next_batch(heads, now, settings)
        if not decision.count:
            return [], decision.wait_ns
        return [(h.seq, h.seq.pending[0]) for h in heads[: decision.count]], 0

    # -- execution ------------------------------------------------------------------------------

    def run(self, backend: Backend, rows: list[_Row]) -> None:
        start_ns = time.monotonic_ns()
        live: list[tuple[Sequence, SequenceRequest]] = []
        cancelled: list[tuple[Sequence, SequenceRequest]] = []
        for seq, request in rows:
            if seq is not None and request is not None:
                if request.rescheduled or request.future.set_running_or_notify_cancel():
                    live.append((seq, request))
                else:
                    cancelled.append((seq, request))
        results: list[Result] = []
        timing = Timing()
        if live:
            try:
                results = self._execute(backend, rows, live, timing)
            except Exception as exc:  # whatever broke, every request gets an answer and its sequence goes on
                log.exception("sequence batch of %r failed unexpectedly", self._name)
                results = [ModelExecutionError(f"model {self._name!r} failed: {exc!r}")] * len(live)
        end_ns = time.monotonic_ns()
        results = [self._end_reschedule(r, res, end_ns) for (_, r), res in zip(live, results, strict=True)]
        answers: list[tuple[SequenceRequest, Result]] = []  # Rescheduled ones queued again have none
        with self._lock:
            for (seq, request), result in zip(live, results, strict=True):
                if not isinstance(result, Rescheduled):
                    answers.append((request, result))
                elif seq in self._table.held:  # the same request runs again, first of its sequence
                    request.rescheduled = True
                    seq.pending.appendleft(request)
                    self._queued += 1
                else:  # unloaded while it ran
                    unloaded = f"model {self._name!r} was unloaded; the request was rescheduled"
                    answers.append((request, ServerShuttingDown(unloaded)))
            for seq, _ in live + cancelled:
                seq.busy = False
                seq.last_ns = end_ns
                self._in_flight -= 1
                if seq.ending and not seq.pending and seq in self._table.held:
                    self._release(seq, expired=False)
            self._cond.notify_all()
            if self._order is not None:
                done = dict(answers)
                for _, request in live + cancelled:
                    self._order.finished(request, done.get(request))
                answers = self._order.take(self._first_queued()) or []
        if live:  # counted before its answers leave: a client that reads statistics next sees it
            self._stats.record_batch(
                batch_size=len(live),
                queue_ns=[start_ns - r.enqueue_ns for _, r in live],
                request_ns=[end_ns - r.enqueue_ns for _, r in live],
                succeeded=[not isinstance(r, Exception) for r in results],
                timing=timing,
            )
        if self._order is None:  # here, or handed off while requests wait (InstancePool.deliver)
            self._pool.deliver(functools.partial(_answer, answers))
            return
        while answers:
            _answer(answers)
            with self._lock:  # earlier ones may have finished on another instance meanwhile
                self._order.delivered()
                answers = self._order.take(self._first_queued()) or []

    def _first_queued(self) -> int | None:
        """The arrival of the earliest request queued on a sequence with a candidate place (lock held)."""
        heads = [s.pending[0].arrival for places in self._table.candidates for s in places if s.pending]
        return min(heads, default=None)

    def _end_reschedule(self, request: SequenceRequest, result: Result, now: int) -> Result:
        """What becomes of a request the model rescheduled: run again, or end it (its answer here).

        It ends when its stream is already finished (the model sent the final response), when the
        client cancelled its stream, or when the request's timeout passed since it was queued: an
        endless reschedule loop is bounded by the request's own timeout or cancellation.
        """
        if not isinstance(result, Rescheduled):
            return result
        item = request.item
        stream = item.stream
        if stream is not None and stream.finished:
            return {}
        if stream is not None and stream.cancelled:
            return Cancelled(f"model {self._name!r}: the request was cancelled while being rescheduled")
        if item.timeout_us and now - request.enqueue_ns >= item.timeout_us * 1000:
            return RequestTimeout(
                f"model {self._name!r}: the request's timeout of {item.timeout_us} us passed while the "
                "model rescheduled it"
            )
        return result

    def _execute(
        self, backend: Backend, rows: list[_Row], live: list[tuple[Sequence, SequenceRequest]], timing: Timing
    ) -> list[Result]:
        """Run the rows (fillers included) and keep each live sequence's new state; its results in order."""
        tensors = self._tensors
        like = live[0][1].item
        like_state = live[0][0].state
        chosen = {id(request) for _, request in live}
        batch: list[BatchItem] = []
        real: list[int] = []  # positions of the live requests in the batch
        for seq, request in rows:
            if request is not None and request.restarts and seq is not None:  # busy: ours to write
                seq.state = tensors.initial_state()
                request.restarts = False  # once, not again if the model reschedules it
            state = seq.state if seq is not None else None
            if request is not None and id(request) in chosen:
                real.append(len(batch))
                batch.append(tensors.row(request.item, ready=True, state=state))
            elif self._direct:  # a slot without a ready request: READY=0, its state passes through
                batch.append(tensors.filler(like, tensors.stackable(state, like_state)))
        all_results = self._pool.execute(backend, batch, timing)
        results = [all_results[i] for i in real]
        if tensors.has_state:
            for (seq, request), result in zip(live, results, strict=True):
                if not isinstance(result, Exception | Rescheduled) and seq.state is not None:
                    seq.state.update(tensors.take_state(result, request.item.requested_outputs))
        return results


def _answer(answers: list[tuple[SequenceRequest, Result]]) -> None:
    for request, result in answers:
        complete(request.future, result)
