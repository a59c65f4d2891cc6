"""Per model-version scheduler: one queue, one worker thread per instance.

An idle worker forms the next batch itself (``policy.next_batch`` under the queue's lock) and runs it
on its own backend instance, so a request passes through exactly one thread hand-off on its way in and
one future on its way out.  Because only idle instances form batches, a freed instance takes the
largest batch the queue holds at that moment, as Triton's dynamic batcher does.

A model without dynamic batching whose executions are cheap (a moving average under
``INLINE_BUDGET_NS``) runs a request in the caller's own thread when an instance is idle and nothing is
queued: a thread hand-off costs more than such a model, and the caller would only wait for it anyway.
The idle instance is lent for that one request; its worker does not touch it meanwhile.  The
daemon's only model, when it has one instance, does so up to ``ALONE_INLINE_BUDGET_NS``: no other
model's requests can wait behind it on a frontend thread, and its own would wait for the instance
anyway, so it serves as a hand-written receive-run-reply loop does, without the two thread wake-ups
(a tenth of a millisecond each on a loaded 2-core box) that a worker costs every request.

A request submitted from another scheduler's worker thread (a pipeline: an ensemble's next step,
submitted from the done-callback of the step before it, or a BLS call from inside a Python model's
``execute``) runs inline whenever an instance is idle and nothing is queued, whatever its cost, and
with dynamic batching too: that thread is a pipeline's own, so blocking it stalls no frontend (the
IPC frontend's thread is never a worker and keeps the budget), and handing the request to another
thread would only make it wait for the answer.  A worker does this only while it is inside its own
``execute`` (its instance is busy anyway), or, while it delivers a finished batch, when its own queue
is empty (it holds no one up) and the callee cannot call models (a BLS model could need the very
instance this worker would hold while running it: a deadlock no thread hand-off would have had).
A detect-then-classify frame, whose steps all run inside the BLS model's ``execute``, thus walks
them in one thread while their instances are free, and hands off only where a step is busy: there
it queues, and batches with what else is queued.

An instance whose backend raises :class:`InstanceFailed` (its process died, its device context is
lost) is taken out of service: its worker closes it and asks the ``restart`` callback for a new one
in its place, after a back-off (1 s, 2 s, 4 s ... ``RESTART_BACKOFF_MAX_S``; the first wait is the model's
``instance_restart_backoff_s`` parameter where set), while the other instances keep serving.
See :meth:`ModelScheduler._replace`.

Lock order: the scheduler's lock is never held while a backend runs or a future is completed.  A
future's done-callbacks run in the thread that completes it, and a pipeline's callback submits the next
step, maybe to this very scheduler: completing under the lock would deadlock on it.  So requests that
leave without running (timed out in the queue, failed at stop) are collected under the lock and failed
after it is released.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future

import numpy as np

from edge_server.backends.base import Backend, BatchItem, Result, Timing
from edge_server.config.model import ModelConfig, QueuePolicy
from edge_server.errors import (
    ConfigError,
    EdgeServerError,
    InstanceFailed,
    InvalidArgument,
    ModelExecutionError,
    ServerShuttingDown,
    Unavailable,
)
from edge_server.scheduler.policy import BatchSettings, next_batch
from edge_server.scheduler.queue import QueuedRequest, RequestQueue, timed_out
from edge_server.scheduler.stats import ModelStats

log = logging.getLogger(__name__)

# A request runs in the caller's thread only for models whose executions average less than this:
# about what two thread hand-offs cost in CPython, and short enough not to stall an IPC frontend.
INLINE_BUDGET_NS = 100_000
# The daemon's only model (one instance) may hold the caller's thread longer: a frame period at 50 fps,
# the longest that control requests (status, health over IPC, shared-memory registration) wait
# behind it; beyond it the two wake-ups saved are under 2% of the run.
ALONE_INLINE_BUDGET_NS = 20_000_000
# ... and only for requests not much larger than those the average was measured on: a request far
# larger than usual (a 4K frame to a model measured on thumbnails) could hold a frontend thread, and
# every other client and model behind it, for its whole execution.  It goes to a worker instead.
INLINE_SIZE_FACTOR = 2.0
INLINE_SIZE_SLACK = 16 * 1024
_EMA_WEIGHT = 0.2

# Replacing failed instances: the n-th restart in a row waits RESTART_BACKOFF_S * 2**(n-1), at most
# RESTART_BACKOFF_MAX_S; the count starts again once an instance has served for RESTART_RESET_S.
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
RESTART_RESET_S = 60.0
# The config parameter that sets the first wait (seconds): a model that must come back sooner, or a
# test that crashes instances on purpose and should not wait the real back-off out.
RESTART_BACKOFF_KEY = "instance_restart_backoff_s"

#: Builds a new, warmed-up backend for the instance at this index (the loader's); raises if it cannot.
Restart = Callable[[int], Backend]


def restart_backoff(config: ModelConfig) -> float:
    """The first restart's wait for this model: ``instance_restart_backoff_s``, or RESTART_BACKOFF_S."""
    raw = config.parameters.get(RESTART_BACKOFF_KEY)
    if raw is None:
        return RESTART_BACKOFF_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= RESTART_BACKOFF_MAX_S:
        raise ConfigError(
            f"{config.source or config.name}: parameters {{ key: {RESTART_BACKOFF_KEY!r} }} must be a number "
            f"of seconds from 0 to {RESTART_BACKOFF_MAX_S:g}, got {raw!r}"
        )
    return value


def _input_bytes(item: BatchItem) -> int:
    total = 0
    for array in item.inputs.values():
        total += array.nbytes
    return total


def close_instances(
    threads: Sequence[threading.Thread],
    instances: Sequence[tuple[str, Backend]],
    deadline: float,
    state: Callable[[threading.Thread, Backend], tuple[bool, bool]],
) -> None:
    """Join each instance's worker until ``deadline`` and close its backend, at stop.

    ``state`` says whether an instance is still busy (its worker stuck in user code: it is logged and
    left running, never closed under it) or already closed.  The caller is held no longer than that.
    """
    for thread, (name, backend) in zip(threads, instances, strict=True):
        thread.join(max(0.0, deadline - time.monotonic()))
        busy, closed = state(thread, backend)
        if busy:
            log.error("instance %s is still executing after the drain deadline; left running", name)
            continue
        if closed:
            continue
        try:
            backend.close()
        except Exception:
            log.exception("closing instance %s failed", name)


class _Worker(threading.Thread):
    """An instance's worker thread: requests submitted from it may run inline (see the module doc)."""

    def __init__(self, scheduler: ModelScheduler, index: int, name: str) -> None:
        super().__init__(target=scheduler._worker, args=(index,), name=name, daemon=True)
        self.scheduler = scheduler
        self.executing = False  # inside its own backend's execute: its instance is busy anyway

    def run(self) -> None:
        _name_os_thread(self.name)
        super().run()


def _name_os_thread(name: str) -> None:
    """Give the OS thread the worker's name (first 15 bytes), for ``top -H``, ``perf`` and /proc."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # not Linux: the name is only a convenience
        pass


def _pipeline_caller(callee_calls_models: bool) -> bool:
    """Whether this thread is a worker free to run another model's request (see the module doc)."""
    caller = threading.current_thread()
    if type(caller) is not _Worker:
        return False
    if caller.executing:  # its instance is busy anyway: running the callee here holds nothing more
        return True
    # Delivering a finished batch: its instance is free, but would stay held while the callee runs
    # here.  A callee that may call models (a BLS model) could need that very instance (A's step
    # done -> B inline -> B calls A) and wait for it forever: it goes to its own worker instead.
    return not callee_calls_models and not caller.scheduler._queue.size  # a benign race: a hint only


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
        # A plain lock (entered directly on the request path) and a condition over it for the workers.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue = RequestQueue(self._levels, self._policies)
        self._accepting = True
        self._stopping = False
        self._in_flight = 0
        self._next_seq = 0
        self._delivered_seq = 0
        self._instances = instances
        # Watched, not used: finished executions (the watchdog's progress counter) and the time each
        # instance spent executing (metrics).  Each instance is used by one thread at a time.
        self._progress = 0
        self._busy_ns: collections.defaultdict[Backend, int] = collections.defaultdict(int)  # restarts too
        # Inline execution is an explicit opt-in of each backend (TensorRT opts out: never on a frontend).
        self._inline_capable = not self._settings.batching and all(
            backend.allows_inline for _, backend in instances
        )
        self._budget_ns = INLINE_BUDGET_NS  # ALONE_INLINE_BUDGET_NS while the daemon's only model
        self._compute_ema_ns = float("inf")  # moving average of one request's execution
        self._bytes_ema = 0.0  # moving average of the input bytes of the requests measured
        self._waiting: set[Backend] = set()  # instances whose worker is idle, waiting for work
        self._borrowed: set[Backend] = set()  # idle instances lent to a caller's thread
        # Unrecoverable instance faults (see _replace): failed instances wait here for their worker.
        self._restart = restart
        self._failed: set[Backend] = set()
        self._restarts = [0] * len(instances)  # consecutive restarts per instance (the back-off)
        self._since = [time.monotonic()] * len(instances)  # when each instance entered service
        self._unavailable = ""  # why requests are refused: every instance is down and restarts fail
        for _, backend in instances:
            backend.watch(functools.partial(self._lost, backend))
        # Any instance may be lent to a pipeline's worker thread (see the module doc), TensorRT's not.
        # Not with preserve_ordering: an inline answer could overtake a batch running on another instance.
        self._pipeline_inline = not self._preserve_ordering and all(
            backend.allows_inline for _, backend in instances
        )
        self._calls_models = any(getattr(backend, "calls_models", False) for _, backend in instances)
        self._threads = [_Worker(self, index, f"edge-{name}") for index, (name, _) in enumerate(instances)]
        for thread in self._threads:
            thread.start()

    # -- request side ---------------------------------------------------------------------------

    def submit(
        self, item: BatchItem, shape_key: Hashable, *, priority: int = 0, timeout_us: int | None = None
    ) -> Future[dict]:
        """Queue a validated request; the future gets its outputs or its error."""
        outcome = self.dispatch(item, shape_key, priority=priority, timeout_us=timeout_us)
        if isinstance(outcome, Future):
            return outcome
        future: Future[dict] = Future()
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
        return future

    def dispatch(
        self, item: BatchItem, shape_key: Hashable, *, priority: int = 0, timeout_us: int | None = None
    ) -> Result | Future[dict]:
        """Run the request now in this thread if that pays (see the module doc), else queue it.

        Returns the result (outputs or error) when it ran here, or the future of the queued request: a
        frontend that answers inline results at once saves a future per request.
        """
        level = self._level(priority) if priority or self._levels else 1
        now = time.monotonic_ns()
        pipeline = self._pipeline_inline and _pipeline_caller(self._calls_models)
        nbytes = _input_bytes(item) if self._inline_capable and not pipeline else 0
        with self._lock:
            if not self._accepting:
                raise SchedulerClosed(f"model {self._config.name!r} is unloading")
            if self._unavailable:
                raise Unavailable(self._unavailable)
            lent = self._lend(nbytes, pipeline)
            if lent is None:
                future: Future[dict] = Future()
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
                self._borrowed.discard(lent)
                self._in_flight -= 1
                self._progress += 1
                if self._queue.size or not self._accepting:
                    self._cond.notify_all()  # the instance's worker may be waiting for it
        return result

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

    def _lend(self, nbytes: int, pipeline: bool) -> Backend | None:
        """An idle instance for the caller's thread, when inline execution pays (lock held).

        ``pipeline``: the caller is another scheduler's worker, which may run any request inline.
        """
        if self._queue.size:
            return None
        if not pipeline:
            if not self._inline_capable or self._compute_ema_ns >= self._budget_ns:
                return None
            if nbytes > INLINE_SIZE_FACTOR * self._bytes_ema + INLINE_SIZE_SLACK:
                return None  # out of line with what was measured: a worker runs it (and measures it)
        elif not self._pipeline_inline:
            return None
        for backend in self._waiting:
            if backend not in self._borrowed and backend not in self._failed:
                self._borrowed.add(backend)
                return backend
        return None

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

    def set_alone(self, alone: bool) -> None:
        """Whether this is the only model version the daemon serves (see the module doc)."""
        one = alone and len(self._instances) == 1
        self._budget_ns = ALONE_INLINE_BUDGET_NS if one else INLINE_BUDGET_NS

    def queue_size(self) -> int:
        with self._lock:
            return len(self._queue)

    def liveness(self) -> tuple[int, bool]:
        """(executions finished so far, whether requests are queued or running): see service.liveness."""
        with self._lock:
            return self._progress, bool(len(self._queue) or self._in_flight)

    def instance_busy_ns(self) -> dict[str, int]:
        """Nanoseconds each instance has spent executing, by instance name (a utilisation figure)."""
        return {name: self._busy_ns.get(backend, 0) for name, backend in self._instances}

    # -- lifecycle ------------------------------------------------------------------------------

    def close_intake(self) -> None:
        """Take no new requests; queued ones are sent without waiting for a batching delay."""
        with self._lock:
            self._accepting = False
            self._cond.notify_all()

    def drain(self, deadline: float) -> bool:
        """Close intake and wait, until ``deadline`` (monotonic), for queued and running requests.

        Returns False if the deadline passed first.
        """
        self.close_intake()
        with self._lock:
            while len(self._queue) or self._in_flight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def stop(self, grace: float = 2.0) -> None:
        """Stop the workers, fail whatever is still queued, and close every instance.

        A worker still inside its backend after ``grace`` seconds (a stuck user model) is left behind,
        logged, and its instance is not closed under it; the caller is never held longer than that.
        """
        with self._lock:
            self._accepting = False
            self._stopping = True
            leftover = self._queue.drain()
            self._cond.notify_all()
        for request in leftover:
            if request.future.set_running_or_notify_cancel():
                request.future.set_exception(
                    ServerShuttingDown(f"model {self._config.name!r} was unloaded before the request ran")
                )

        def state(thread: threading.Thread, backend: Backend) -> tuple[bool, bool]:
            with self._lock:  # busy; or closed already by its worker (_replace)
                return thread.is_alive() or backend in self._borrowed, backend in self._failed

        close_instances(self._threads, self._instances, time.monotonic() + grace, state)

    # -- workers --------------------------------------------------------------------------------

    def _worker(self, index: int) -> None:
        backend = self._instances[index][1]
        while True:
            try:
                taken = self._take_batch(backend)
                if taken is None:
                    if backend not in self._failed:
                        return  # stopping
                    replacement = self._replace(index, backend)
                    if replacement is None:
                        return
                    backend = replacement
                    continue
                if isinstance(taken, _Expired):
                    self._fail_expired(taken)
                    continue
                self._run(backend, *taken)
                # Drop the batch now, not at the next request: its inputs may be views of a client's
                # shared memory that must be unmapped when the client unregisters it.
                taken = None
            except Exception:  # the loop never dies: log it and serve the next batch
                log.exception("scheduler worker for %r hit an unexpected error", self._config.name)

    def _take_batch(self, backend: Backend) -> tuple[list[QueuedRequest], int] | _Expired | None:
        """The next batch and its sequence number, requests to fail (timed out), or None: stop."""
        with self._lock:
            self._waiting.add(backend)
            try:
                return self._next_batch_locked(backend)
            finally:
                self._waiting.discard(backend)

    def _next_batch_locked(self, backend: Backend) -> tuple[list[QueuedRequest], int] | _Expired | None:
        while not self._stopping:
            if backend in self._failed:
                return None  # the worker replaces it
            if backend in self._borrowed:
                self._cond.wait()
                continue
            now = time.monotonic_ns()
            expired = self._queue.expire(now)
            if expired:  # failed by the caller once the lock is released (see the module doc)
                return _Expired(expired, now)
            settings = self._settings if self._accepting else self._flush
            decision = next_batch(self._queue.head(settings.max_batch_size + 1), now, settings)
            if decision.count:
                batch = self._queue.pop(decision.count)
                seq = self._next_seq
                self._next_seq += 1
                self._in_flight += len(batch)
                return batch, seq
            self._cond.wait(decision.wait_ns / 1e9 if decision.wait_ns else None)
        return None

    def _fail_expired(self, expired: _Expired) -> None:
        """Fail requests that timed out in the queue (REJECT); called without the lock."""
        now = expired.now_ns
        for request in expired.requests:
            self._stats.record_failure(now - request.enqueue_ns, now - request.enqueue_ns)
            if request.future.set_running_or_notify_cancel():
                request.future.set_exception(timed_out(request, now))

    def _run(self, backend: Backend, batch: list[QueuedRequest], seq: int) -> None:
        try:
            self._execute(backend, batch, seq=seq if self._preserve_ordering else None)
        except Exception as exc:  # a bug of ours: every request of the batch still gets an answer
            log.exception("running a batch of %r failed unexpectedly", self._config.name)
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(ModelExecutionError(f"internal error: {exc!r}"))
        finally:
            with self._lock:
                self._in_flight -= len(batch)
                self._delivered_seq += 1
                self._progress += 1
                if self._preserve_ordering or not self._accepting:
                    self._cond.notify_all()

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
        """One request on a lent instance, in the caller's thread: :meth:`_execute` without a queue."""
        start = time.monotonic_ns()
        timing = Timing()
        try:
            (result,) = self._compute(backend, (item,), timing)
            if self._output_dims and not isinstance(result, Exception):
                result = self._restore_output_shapes(result)
        except Exception as exc:  # the caller must get an answer, whatever broke
            log.exception("inline execution of %r failed unexpectedly", self._config.name)
            result = ModelExecutionError(f"model {self._config.name!r} failed: {exc!r}")
        end = time.monotonic_ns()
        self._observe(end - start, item)
        self._busy_ns[backend] += end - start
        ok = not isinstance(result, Exception)
        self._stats.record_one(item.batch_size, start - enqueue_ns, end - enqueue_ns, ok, timing, end)
        return result

    def _execute(self, backend: Backend, batch: list[QueuedRequest], *, seq: int | None) -> None:
        """Run a batch, deliver each result to its future (in ``seq`` order when given), record stats."""
        start = time.monotonic_ns()
        live = [r for r in batch if r.future.set_running_or_notify_cancel()]
        timing = Timing()
        results: list[Result] = []
        if live:
            results = self._compute(backend, [r.item for r in live], timing)
            spent = time.monotonic_ns() - start
            self._busy_ns[backend] += spent
            if len(live) == 1:
                self._observe(spent, live[0].item)
        if seq is not None:
            with self._lock:
                while self._delivered_seq != seq:
                    self._cond.wait()
        end = time.monotonic_ns()
        for request, result in zip(live, results, strict=True):
            self._deliver(request.future, result)
        if live:
            self._stats.record_batch(
                batch_size=sum(r.batch_size for r in live),
                queue_ns=[start - r.enqueue_ns for r in live],
                request_ns=[end - r.enqueue_ns for r in live],
                succeeded=[not isinstance(res, Exception) for res in results],
                timing=timing,
            )

    def _compute(self, backend: Backend, items: Sequence[BatchItem], timing: Timing) -> list[Result]:
        """One result per item; a failure of the whole batch becomes every item's error."""
        caller = threading.current_thread()
        worker = type(caller) is _Worker
        if worker:
            was, caller.executing = caller.executing, True  # type: ignore[attr-defined]
        try:
            results = backend.execute(items, timing)
            if len(results) != len(items):
                raise ModelExecutionError(
                    f"backend returned {len(results)} results for {len(items)} requests"
                )
            return results
        except InstanceFailed as exc:  # not "this request failed": this instance can never serve again
            self._lost(backend, exc)
            return [exc] * len(items)
        except EdgeServerError as exc:
            return [exc] * len(items)
        except Exception as exc:
            log.exception("instance of %r failed a batch of %d", self._config.name, len(items))
            return [ModelExecutionError(f"model {self._config.name!r} failed: {exc!r}")] * len(items)
        finally:
            if worker:
                caller.executing = was  # type: ignore[attr-defined]

    def _observe(self, spent_ns: int, item: BatchItem) -> None:
        """Fold one single-request execution into the estimates that decide inline execution."""
        if not self._inline_capable:
            return
        ema = self._compute_ema_ns  # a benign race: only these estimates are at stake
        nbytes = _input_bytes(item)
        if ema == float("inf"):
            self._compute_ema_ns, self._bytes_ema = spent_ns, float(nbytes)
        else:
            self._compute_ema_ns = ema + _EMA_WEIGHT * (spent_ns - ema)
            self._bytes_ema += _EMA_WEIGHT * (nbytes - self._bytes_ema)

    def _lost(self, backend: Backend, exc: InstanceFailed) -> None:
        """Take ``backend`` out of service (from execute, or reported by the backend while idle)."""
        with self._lock:
            self._failed.add(backend)
            self._cond.notify_all()  # wakes its worker, also one waiting while the instance is lent

    def _replace(self, index: int, dead: Backend) -> Backend | None:
        """Put a restarted instance in the place of a failed one; None when the scheduler stops first.

        Runs in the failed instance's own worker, so the other instances keep serving meanwhile, and
        queued requests wait for the first instance free.  The worker closes the failed backend, waits
        its back-off, and asks ``restart`` for a new one; while every instance is down and a restart
        has failed, queued and new requests fail with UNAVAILABLE instead of waiting for it.
        """
        name = self._instances[index][0]
        try:
            dead.close()
        except Exception:
            log.exception("closing failed instance %s", name)
        if time.monotonic() - self._since[index] >= RESTART_RESET_S:
            self._restarts[index] = 0
        while True:
            delay = min(self._backoff_s * 2 ** self._restarts[index], RESTART_BACKOFF_MAX_S)
            self._restarts[index] += 1
            if self._restart is None:
                log.error("instance %s failed and cannot be restarted; it stays out of service", name)
                delay = float("inf")
            else:
                log.error("instance %s failed; out of service, restarting in %.0f s", name, delay)
            with self._lock:
                if self._cond.wait_for(lambda: self._stopping, None if delay == float("inf") else delay):
                    return None
            assert self._restart is not None
            try:
                fresh = self._restart(index)
            except Exception as exc:
                log.error("restarting instance %s failed: %s", name, exc)
                self._refuse_if_all_down(f"restarting failed: {exc}")
                continue
            fresh.watch(functools.partial(self._lost, fresh))
            with self._lock:
                stopping = self._stopping
                if not stopping:
                    self._instances[index] = (name, fresh)
                    self._busy_ns[fresh] = self._busy_ns.pop(dead, 0)  # the slot's utilisation goes on
                    self._failed.discard(dead)
                    self._since[index] = time.monotonic()
                    self._unavailable = ""
            if stopping:
                fresh.close()
                return None
            log.warning("instance %s restarted and back in service", name)
            return fresh

    def _refuse_if_all_down(self, why: str) -> None:
        with self._lock:
            if len(self._failed) < len(self._instances):
                return
            self._unavailable = f"model {self._config.name!r}: every instance failed and {why}"
            leftover = self._queue.drain()
        for request in leftover:
            if request.future.set_running_or_notify_cancel():
                request.future.set_exception(Unavailable(self._unavailable))

    def _deliver(self, future: Future[dict], result: Result) -> None:
        if self._output_dims and not isinstance(result, Exception):
            result = self._restore_output_shapes(result)
        if isinstance(result, Exception):
            future.set_exception(result)
        else:
            future.set_result(result)
