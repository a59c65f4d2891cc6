"""Per model-version scheduler: one queue, one worker thread per instance.

An idle worker forms the next batch itself (``policy.next_batch`` under the queue's lock) and runs it
on its own backend instance, so a request passes through exactly one thread hand-off on its way in and
one future on its way out.  Because only idle instances form batches, a freed instance takes the
largest batch the queue holds at that moment, as Triton's dynamic batcher does.

Whether a request runs in the caller's own thread instead (a cheap model, the daemon's only model, a
pipeline's next step) is decided by one :class:`~edge_server.scheduler.inline.InlinePolicy`, for the
budget the caller states (:meth:`ModelScheduler.submit`); this scheduler lends it an idle instance from
the pool when it says yes.

The instances, their workers, restarts after a fault, busy time and the stop belong to the
:class:`~edge_server.scheduler.pool.InstancePool` that the sequence batcher uses too; this module keeps
what the dynamic batcher alone does: form a batch (:meth:`ModelScheduler.form`) and deliver it
(:meth:`ModelScheduler.run`), and the inline runs.

Lock order: the pool's lock (this scheduler's too) is never held while a backend runs or a future is
completed.  A future's done-callbacks run in the thread that completes it, and a pipeline's callback
submits the next step, maybe to this very scheduler: completing under the lock would deadlock on it.
So requests that leave without running (timed out in the queue, failed at stop) are collected under
the lock and failed after it is released.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Hashable, Sequence
from concurrent.futures import Future

import numpy as np

from edge_server.backends.base import Backend, BatchItem, Result, Timing
from edge_server.config.model import ModelConfig, QueuePolicy
from edge_server.errors import (
    InvalidArgument,
    ModelExecutionError,
    ServerShuttingDown,
    Unavailable,
)
from edge_server.scheduler.inline import (  # noqa: F401  (re-exported: tests and benchmarks read them)
    INLINE_BUDGET_NS,
    QUEUE_ONLY,
    SOLE_VERSION_INLINE_BUDGET_NS,
    Budget,
    InlinePolicy,
)
from edge_server.scheduler.policy import BatchSettings, next_batch
from edge_server.scheduler.pool import InstancePool, Restart, complete, restart_backoff
from edge_server.scheduler.queue import QueuedRequest, RequestQueue, timed_out
from edge_server.scheduler.stats import ModelStats

log = logging.getLogger(__name__)


class SchedulerClosed(ServerShuttingDown):
    """The version stopped taking requests (being replaced or unloaded); route to another."""


def batch_settings(config: ModelConfig) -> BatchSettings:
    db = config.dynamic_batching
    if config.max_batch_size == 0 or db is None:
        return BatchSettings(max_batch_size=max(config.max_batch_size, 1), batching=False)
    return BatchSettings(
        max_batch_size=config.max_batch_size,
        preferred_batch_sizes=frozenset(db.preferred_batch_size),
        max_queue_delay_ns=db.max_queue_delay_microseconds * 1000,
    )


@dataclasses.dataclass(slots=True)
class _Expired:
    """Requests the queue rejected for their timeout, to be failed after the lock is released."""

    requests: list[QueuedRequest]
    now_ns: int


@dataclasses.dataclass(slots=True)
class _Batch:
    """A batch taken from the queue, and its place in the delivery order (``preserve_ordering``)."""

    requests: list[QueuedRequest]
    seq: int


_Work = _Batch | _Expired


class ModelScheduler:
    def __init__(
        self,
        config: ModelConfig,
        instances: list[tuple[str, Backend]],
        stats: ModelStats,
        *,
        restart: Restart | None = None,
    ) -> None:
        """Start one worker per instance.

        ``restart(index)`` loads (and warms up) a fresh instance in place of instance ``index`` after
        it failed unrecoverably (:class:`InstanceFailed`); without it such an instance leaves service.
        """
        self._backoff_s = restart_backoff(config)  # first: a bad value fails the load, nothing started
        self._config = config
        self._stats = stats
        self._settings = batch_settings(config)
        # While draining, queued requests go at once: no batching delay, no preferred sizes.
        self._flush = dataclasses.replace(
            self._settings, preferred_batch_sizes=frozenset(), max_queue_delay_ns=0
        )
        db = config.dynamic_batching
        self._levels = db.priority_levels if db and db.priority_levels else 0
        self._default_level = (db.default_priority_level or 1) if db and self._levels else 1
        self._policies = {
            level: (db.queue_policy(level) if db else QueuePolicy())
            for level in range(1, max(self._levels, 1) + 1)
        }
        self._override_allowed = db is None
        self._preserve_ordering = bool(db and db.preserve_ordering)
        self._output_dims = {t.name: t.dims for t in config.outputs if t.reshape is not None}
        # The pool's lock is this scheduler's: a plain lock (entered directly on the request path) and
        # a condition over it for the workers.
        self._pool: InstancePool[_Work] = InstancePool(
            config.name, instances, self, restart=restart, backoff_s=restart_backoff(config)
        )
        self._lock = self._pool.lock
        self._cond = self._pool.cond
        self._queue = RequestQueue(self._levels, self._policies)
        self._accepting = True
        self._in_flight = 0
        self._next_seq = 0
        self._delivered_seq = 0
        self._inline = InlinePolicy(
            [backend for _, backend in instances],
            batching=self._settings.batching,
            preserve_ordering=self._preserve_ordering,
        )
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
        """Queue a validated request, or run it now in this thread where ``budget`` allows it.

        The model's :class:`InlinePolicy` answers for ``budget`` (see the module doc); a request it
        lets run here gets an idle instance lent, and its future is done when this returns.
        """
        level = self._level(priority) if priority or self._levels else 1
        now = time.monotonic_ns()
        here = budget is not QUEUE_ONLY and self._inline.pays(budget, item)
        future: Future[dict] = Future()
        with self._lock:
            if not self._accepting:
                raise SchedulerClosed(f"model {self._config.name!r} is unloading")
            if self._pool.unavailable:
                raise Unavailable(self._pool.unavailable)
            lent = self._pool.lend() if here and not self._queue.size else None
            if lent is None:
                self._queue.push(self._queued(item, shape_key, level, now, future, timeout_us))
                # Every waiter: one woken at random may be a worker whose instance is lent out, or one
                # waiting for its turn to deliver (preserve_ordering), and could not take the request.
                self._cond.notify_all()
                return future
            self._in_flight += 1
        try:
            result = self._run_inline(lent, item, now)
        finally:
            with self._lock:
                self._pool.give_back(lent)
                self._in_flight -= 1
                if self._queue.size or not self._accepting:
                    self._cond.notify_all()  # the instance's worker may be waiting for it
        complete(future, result)
        return future

    def _queued(
        self,
        item: BatchItem,
        shape_key: Hashable,
        level: int,
        now: int,
        future: Future[dict],
        timeout_us: int | None,
    ) -> QueuedRequest:
        policy = self._policies[level]
        timeout = policy.default_timeout_microseconds
        if timeout_us is not None and (policy.allow_timeout_override or self._override_allowed):
            timeout = timeout_us
        return QueuedRequest(
            item=item,
            shape_key=shape_key,
            level=level,
            enqueue_ns=now,
            future=future,
            deadline_ns=now + timeout * 1000 if timeout > 0 else 0,
            timeout_action=policy.timeout_action,
        )

    def _level(self, priority: int) -> int:
        if priority < 0:
            raise InvalidArgument(f"priority must be >= 0, got {priority}")
        if not self._levels:
            return 1
        if priority == 0:
            return self._default_level
        if priority > self._levels:  # Triton's rule: out of range means the default level
            return self._default_level
        return priority

    def set_sole_version(self, sole: bool) -> None:
        """Whether this is the only model version the daemon serves (see the module doc)."""
        self._inline.set_sole_version(sole and self._pool.size == 1)

    def queue_size(self) -> int:
        with self._lock:
            return len(self._queue)

    def liveness(self) -> tuple[int, bool]:
        """(executions finished so far, whether requests are queued or running): see service.liveness."""
        with self._lock:
            return self._pool.progress, bool(len(self._queue) or self._in_flight)

    def readiness(self) -> list[Future[bool]]:
        return self._pool.readiness()

    def instance_busy_ns(self) -> dict[str, int]:
        """Nanoseconds each instance has spent executing, by instance name (a utilisation figure)."""
        return self._pool.busy_ns()

    # -- lifecycle ------------------------------------------------------------------------------

    def close_intake(self, *, finish_sequences: bool = False) -> None:
        """Take no new requests; queued ones are sent without waiting for a batching delay."""
        with self._lock:
            self._accepting = False
            self._cond.notify_all()

    def drain(self, deadline: float) -> bool:
        """Close intake and wait, until ``deadline`` (monotonic), for queued and running requests.

        Returns False if the deadline passed first.
        """
        self.close_intake()
        return self._pool.drain(deadline, lambda: bool(len(self._queue) or self._in_flight))

    def stop(self, grace: float = 2.0) -> None:
        """Stop the workers, fail whatever is still queued, and close every instance.

        A worker still inside its backend after ``grace`` seconds (a stuck user model) is left behind,
        logged, and its instance is not closed under it; the caller is never held longer than that.
        """
        with self._lock:
            self._accepting = False
            leftover = self._queue.drain()
            self._pool.mark_stopping()
        for request in leftover:
            if request.future.set_running_or_notify_cancel():
                request.future.set_exception(
                    ServerShuttingDown(f"model {self._config.name!r} was unloaded before the request ran")
                )
        self._pool.stop(grace)

    # -- the pool's batcher: form a batch, run and deliver it --------------------------------------

    def waiting(self) -> int:
        return self._queue.size

    def form(self, index: int) -> tuple[_Work | None, float | None]:
        """The next batch and its sequence number, or requests to fail (timed out); pool lock held."""
        now = time.monotonic_ns()
        expired = self._queue.expire(now)
        if expired:  # failed by the worker once the lock is released (see the module doc)
            return _Expired(expired, now), None
        settings = self._settings if self._accepting else self._flush
        decision = next_batch(self._queue.head(settings.max_batch_size + 1), now, settings)
        if decision.count:
            batch = self._queue.pop(decision.count)
            seq = self._next_seq
            self._next_seq += 1
            self._in_flight += len(batch)
            return _Batch(batch, seq), None
        return None, (decision.wait_ns / 1e9 if decision.wait_ns else None)

    def run(self, backend: Backend, work: _Work) -> None:
        if isinstance(work, _Expired):
            self._fail_expired(work)
        else:
            self._run(backend, work.requests, work.seq)

    def all_down(self, why: str) -> None:
        """Every instance is down and restarting failed: what waits fails now, UNAVAILABLE."""
        with self._lock:
            leftover = self._queue.drain()
        for request in leftover:
            if request.future.set_running_or_notify_cancel():
                request.future.set_exception(Unavailable(why))

    def _fail_expired(self, expired: _Expired) -> None:
        """Fail requests that timed out in the queue (REJECT); called without the lock."""
        now = expired.now_ns
        for request in expired.requests:
            self._stats.record_failure(now - request.enqueue_ns, now - request.enqueue_ns, "REJECTED")
            if request.future.set_running_or_notify_cancel():
                request.future.set_exception(timed_out(request, now))

    def _run(self, backend: Backend, batch: list[QueuedRequest], seq: int) -> None:
        """Run a batch, then deliver it, here or handed off (:meth:`InstancePool.deliver`).

        With ``preserve_ordering`` it is delivered here, in ``seq`` order.
        """
        start = time.monotonic_ns()
        live: list[QueuedRequest] = []
        results: list[Result] = []
        timing = Timing()
        try:
            live = [r for r in batch if r.future.set_running_or_notify_cancel()]
            if len(live) == 1:
                cpu = self._inline.cpu_mark()
                results = self._compute(backend, [live[0].item], timing)
                self._inline.observe(time.monotonic_ns() - start, live[0].item, results[0], cpu)
            elif live:
                results = self._compute(backend, [r.item for r in live], timing)
        except Exception as exc:  # a bug of ours: every request of the batch still gets an answer
            log.exception("running a batch of %r failed unexpectedly", self._config.name)
            live, results = [], []
            self._fail_undone(batch, exc)
        finish = functools.partial(self._finish, batch, live, results, timing, start, seq)
        if self._preserve_ordering:
            finish()
        else:
            self._pool.deliver(finish)

    def _finish(
        self,
        batch: list[QueuedRequest],
        live: list[QueuedRequest],
        results: list[Result],
        timing: Timing,
        start: int,
        seq: int,
    ) -> None:
        """Deliver a run batch's results, record its statistics, and let it leave the in-flight count."""
        try:
            if self._preserve_ordering:
                with self._lock:
                    while self._delivered_seq != seq:
                        self._cond.wait()
            end = time.monotonic_ns()
            if live:  # counted before its answers leave: a client that reads statistics next sees it
                self._stats.record_batch(
                    batch_size=sum(r.batch_size for r in live),
                    queue_ns=[start - r.enqueue_ns for r in live],
                    request_ns=[end - r.enqueue_ns for r in live],
                    succeeded=[not isinstance(res, Exception) for res in results],
                    timing=timing,
                )
            for request, result in zip(live, results, strict=True):
                self._deliver(request.future, result)
        except Exception as exc:  # a bug of ours: every request of the batch still gets an answer
            log.exception("delivering a batch of %r failed unexpectedly", self._config.name)
            self._fail_undone(batch, exc)
        finally:
            with self._lock:
                self._in_flight -= len(batch)
                self._delivered_seq += 1
                if self._preserve_ordering or not self._accepting:
                    self._cond.notify_all()

    @staticmethod
    def _fail_undone(batch: list[QueuedRequest], exc: Exception) -> None:
        for request in batch:
            if not request.future.done():
                request.future.set_exception(ModelExecutionError(f"internal error: {exc!r}"))

    def _restore_output_shapes(self, outputs: dict[str, np.ndarray]) -> Result:
        """Undo ``reshape`` on outputs: the backend produced the reshape shape, clients expect ``dims``."""
        batched = self._config.max_batch_size > 0
        for name, dims in self._output_dims.items():
            if name in outputs:
                array = outputs[name]
                try:
                    outputs[name] = array.reshape((array.shape[0], *dims) if batched else dims)
                except (ValueError, IndexError):
                    return ModelExecutionError(
                        f"model {self._config.name!r} output {name!r} has shape {list(array.shape)}, which "
                        f"cannot be reshaped to its config dims {list(dims)}"
                    )
        return outputs

    def _run_inline(self, backend: Backend, item: BatchItem, enqueue_ns: int) -> Result:
        """One request on a lent instance, in the caller's thread: :meth:`_run` without a queue."""
        start = time.monotonic_ns()
        cpu = self._inline.cpu_mark()
        timing = Timing()
        try:
            (result,) = self._compute(backend, (item,), timing)
            if self._output_dims and not isinstance(result, Exception):
                result = self._restore_output_shapes(result)
        except Exception as exc:  # the caller must get an answer, whatever broke
            log.exception("inline execution of %r failed unexpectedly", self._config.name)
            result = ModelExecutionError(f"model {self._config.name!r} failed: {exc!r}")
        end = time.monotonic_ns()
        self._inline.observe(end - start, item, result, cpu)
        ok = not isinstance(result, Exception)
        self._stats.record_one(item.batch_size, start - enqueue_ns, end - enqueue_ns, ok, timing, end)
        return result

    def _compute(self, backend: Backend, items: Sequence[BatchItem], timing: Timing) -> list[Result]:
        """One result per item (the pool's execute: faults, busy time, the worker's mark)."""
        return self._pool.execute(backend, items, timing)

    def _deliver(self, future: Future[dict], result: Result) -> None:
        if self._output_dims and not isinstance(result, Exception):
            result = self._restore_output_shapes(result)
        complete(future, result)
