"""One model version's instances and their worker threads, under every batcher.

The pool owns what the dynamic batcher (:mod:`~edge_server.scheduler.scheduler`) and the sequence
batcher (:mod:`~edge_server.scheduler.sequence`) have in common: one worker thread per instance, which
instances are idle, lent to a caller's thread or failed, the watch for faults found while idle, the
restart of a failed instance with back-off, busy time, the progress counter the watchdog reads, one
``drain(deadline)`` and the bounded stop.  A batcher keeps only its own two jobs, given to the pool as
a :class:`Batcher`: *form* the next unit of work for an idle instance (under the pool's lock) and *run*
it (deliver its results), outside the lock.

One lock for both: whether an instance may take work and what work is queued are decided together,
so the batcher reads and waits on the pool's ``lock`` and ``cond``.  The lock is never held while a
backend runs or a future is completed (a future's callbacks may submit to this very model).

An instance whose backend raises :class:`InstanceFailed` (its process died, its device context is
lost), or reports it while idle through :meth:`Backend.watch`, is taken out of service: its worker
closes it and asks ``restart`` for a new one in its place, after a back-off (1 s, 2 s, 4 s ...
``RESTART_BACKOFF_MAX_S``; the first wait is the model's ``instance_restart_backoff_s`` parameter
where set), while the other instances keep serving.  PyTriton's split, kept here: "this
request failed" is the batcher's result; "this instance can never serve again" is the pool's.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Generic, Protocol, TypeVar

from edge_server.backends.base import Backend, BatchItem, Result, Timing
from edge_server.config.model import ModelConfig, seconds_parameter
from edge_server.errors import EdgeServerError, InstanceFailed, ModelExecutionError
from edge_server.model_readiness import answered
from edge_server.scheduler import inline
from edge_server.scheduler.drain import wait_until_idle
from edge_server.scheduler.handoff import Handoff

log = logging.getLogger(__name__)

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

W = TypeVar("W")


def restart_backoff(config: ModelConfig) -> float:
    """The first restart's wait for this model: ``instance_restart_backoff_s``, or RESTART_BACKOFF_S."""
    wait = seconds_parameter(config, RESTART_BACKOFF_KEY, RESTART_BACKOFF_S, most=RESTART_BACKOFF_MAX_S)
    return RESTART_BACKOFF_S if wait is None else wait


class Batcher(Protocol[W]):
    """What a batcher gives the pool: forming work for an idle instance, and running it."""

    def form(self, index: int) -> tuple[W | None, float | None]:
        """The next work for instance ``index`` (pool lock held), or None and how long to wait (s)."""
        ...

    def run(self, backend: Backend, work: W) -> None:
        """Run ``work`` on ``backend`` and deliver its results (lock not held; never raises)."""
        ...

    def waiting(self) -> int:
        """How many requests wait for an instance (a hint, read without the lock)."""
        ...

    def all_down(self, why: str) -> None:
        """Every instance failed and a restart failed too: fail what waits (lock not held)."""
        ...


class Worker(threading.Thread):
    """An instance's worker thread, named in the OS too (``top -H``)."""

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


def complete(future: Future[dict], result: Result) -> None:
    """Complete a request's future with its result: the outputs, or the error that is its answer."""
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)


class InstancePool(Generic[W]):
    """The instances of one model version, each with its worker thread (see the module doc)."""

    def __init__(
        self,
        model: str,
        instances: list[tuple[str, Backend]],
        batcher: Batcher[W],
        *,
        restart: Restart | None = None,
        backoff_s: float = RESTART_BACKOFF_S,
    ) -> None:
        """Prepare one worker per instance; :meth:`start` starts them.

        ``restart(index)`` loads (and warms up) a fresh instance in place of instance ``index`` after
        it failed unrecoverably; without it such an instance leaves service.
        """
        self.model = model
        self._backoff_s = backoff_s
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.stopping = False
        #: why requests are refused: every instance is down and a restart failed ("" while serving)
        self.unavailable = ""
        #: finished executions, inline ones too (the watchdog's progress counter)
        self.progress = 0
        self._batcher = batcher
        self._handoff = Handoff(model)
        self._instances = instances
        self._idle: set[Backend] = set()  # instances whose worker waits for work
        self._lent: set[Backend] = set()  # idle instances lent to a caller's thread
        self._failed: set[Backend] = set()  # out of service, waiting for their worker to replace them
        self._restart = restart
        self._restarts = [0] * len(instances)  # consecutive restarts per instance (the back-off)
        self._since = [time.monotonic()] * len(instances)  # when each instance entered service
        # Watched, not used: the time each instance spent executing (metrics); one thread per instance.
        self._busy_ns: collections.defaultdict[Backend, int] = collections.defaultdict(int)
        for _, backend in instances:
            backend.watch(functools.partial(self.lost, backend))
        self._threads = [
            Worker(target=self._work, args=(index,), name=f"edge-{name}", daemon=True)
            for index, (name, _) in enumerate(instances)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    # -- what batchers read -----------------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self._instances)

    def backends(self) -> list[Backend]:
        return [backend for _, backend in self._instances]

    def names(self) -> list[str]:
        return [name for name, _ in self._instances]

    def workers_alive(self) -> int:
        """How many worker threads still run (after :meth:`stop`: those stuck in user code)."""
        return sum(thread.is_alive() for thread in self._threads)

    def readiness(self) -> list[Future[bool]]:
        """What the instances that have a say in their readiness answer (see model_readiness).

        An instance out of service (its process died; it is being restarted) makes the model not ready
        until it is back, as Triton's model is while its stub is not healthy.
        """
        with self.lock:
            if self._failed:
                return [answered(False)]
            backends = [backend for _, backend in self._instances]
        return [probe.ask() for backend in backends if (probe := backend.readiness_probe) is not None]

    def busy_ns(self) -> dict[str, int]:
        """Nanoseconds each instance has spent executing, by instance name (a utilisation figure)."""
        return {name: self._busy_ns.get(backend, 0) for name, backend in self._instances}

    # -- lending an idle instance to the caller's thread ------------------------------------------

    def lend(self) -> Backend | None:
        """An idle, healthy instance for the caller's thread, or None (lock held).

        None while batches wait for the delivering thread: an answer given here would overtake them.
        """
        if self._handoff.busy():
            return None
        for backend in self._idle:
            if backend not in self._lent and backend not in self._failed:
                self._lent.add(backend)
                return backend
        return None

    def give_back(self, backend: Backend) -> None:
        """A lent instance is free again, one execution further (lock held)."""
        self._lent.discard(backend)
        self.progress += 1

    # -- running ----------------------------------------------------------------------------------

    def execute(self, backend: Backend, items: Sequence[BatchItem], timing: Timing) -> list[Result]:
        """One result per item on ``backend``; a failure of the whole batch becomes every item's error.

        :class:`InstanceFailed` also takes the instance out of service.  Counts its busy time.  On a
        worker (its own, or one that runs another model's request inline), the calls its backend makes
        meanwhile (BLS) may run in this thread: its instance is busy anyway (:data:`inline.IN_EXECUTE`).
        """
        outer = inline.current()
        if outer.on_worker:
            inline.state(inline.IN_EXECUTE)
        start = time.monotonic_ns()
        try:
            results = backend.execute(items, timing)
            if len(results) != len(items):
                raise ModelExecutionError(
                    f"backend returned {len(results)} results for {len(items)} requests"
                )
            return results
        except InstanceFailed as exc:  # not "this request failed": this instance can never serve again
            self.lost(backend, exc)
            return [exc] * len(items)
        except EdgeServerError as exc:
            return [exc] * len(items)
        except (Exception, SystemExit) as exc:  # SystemExit would end this worker thread silently
            log.exception("instance of %r failed a batch of %d", self.model, len(items))
            return [ModelExecutionError(f"model {self.model!r} failed: {exc!r}")] * len(items)
        finally:
            self._busy_ns[backend] += time.monotonic_ns() - start
            if outer.on_worker:
                inline.state(outer)

    def deliver(self, deliver: Callable[[], None]) -> None:
        """Complete a finished batch here, or on the delivering thread while requests wait (:mod:`handoff`).

        Handed off, it lets this worker's instance take the next batch at once.

        ``deliver`` must not raise.  What it leaves for after the delivery (the in-flight count a drain
        waits on) it does itself.
        """
        self._handoff.deliver(deliver, others_wait=bool(self._batcher.waiting()))

    def _work(self, index: int) -> None:
        # What this thread lets others' requests cost while it delivers (an ensemble's next step).
        inline.state(inline.delivering(self._batcher.waiting))
        backend = self._instances[index][1]
        while True:
            try:
                work = self._take(index, backend)
                if work is None:
                    if backend not in self._failed:
                        return  # stopping
                    replacement = self._replace(index, backend)
                    if replacement is None:
                        return
                    backend = replacement
                    continue
                try:
                    self._batcher.run(backend, work)
                finally:
                    # Drop the work now, not at the next request: its inputs may be views of a
                    # client's shared memory that must be unmapped when the client unregisters it.
                    work = None
                    with self.lock:
                        self.progress += 1
            except Exception:  # the loop never dies: log it and serve the next batch
                log.exception("worker of %r hit an unexpected error", self.model)

    def _take(self, index: int, backend: Backend) -> W | None:
        """The next work for ``backend``, or None: stopping, or the instance failed."""
        with self.lock:
            self._idle.add(backend)
            try:
                while not self.stopping:
                    if backend in self._failed:
                        return None  # its worker replaces it
                    if backend in self._lent:
                        self.cond.wait()
                        continue
                    work, wait_s = self._batcher.form(index)
                    if work is not None:
                        return work
                    self.cond.wait(wait_s)
                return None
            finally:
                self._idle.discard(backend)

    # -- faults and restarts ----------------------------------------------------------------------

    def lost(self, backend: Backend, exc: InstanceFailed) -> None:
        """Take ``backend`` out of service (from execute, or reported by the backend while idle)."""
        with self.lock:
            self._failed.add(backend)
            self.cond.notify_all()  # wakes its worker, also one waiting while the instance is lent

    def _replace(self, index: int, dead: Backend) -> Backend | None:
        """Put a restarted instance in the place of a failed one; None when the pool stops first.

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
            with self.lock:
                if self.cond.wait_for(lambda: self.stopping, None if delay == float("inf") else delay):
                    return None
            assert self._restart is not None
            try:
                fresh = self._restart(index)
            except Exception as exc:
                log.error("restarting instance %s failed: %s", name, exc)
                self._refuse_if_all_down(f"restarting failed: {exc}")
                continue
            fresh.watch(functools.partial(self.lost, fresh))
            with self.lock:
                stopping = self.stopping
                if not stopping:
                    self._instances[index] = (name, fresh)
                    self._busy_ns[fresh] = self._busy_ns.pop(dead, 0)  # the slot's utilisation goes on
                    self._failed.discard(dead)
                    self._since[index] = time.monotonic()
                    self.unavailable = ""
                    self.cond.notify_all()
            if stopping:
                fresh.close()
                return None
            log.warning("instance %s restarted and back in service", name)
            return fresh

    def _refuse_if_all_down(self, why: str) -> None:
        with self.lock:
            if len(self._failed) < len(self._instances):
                return
            self.unavailable = f"model {self.model!r}: every instance failed and {why}"
        self._batcher.all_down(self.unavailable)

    # -- draining and stopping --------------------------------------------------------------------

    def drain(self, deadline: float, busy: Callable[[], bool]) -> bool:
        """Wait until ``busy()`` (read under the lock) is false and every batch is delivered.

        False if ``deadline`` (monotonic) passed first.
        """
        return wait_until_idle(self.cond, busy, deadline) and self._handoff.wait_idle(deadline)

    def stop(self, grace: float = 2.0) -> None:
        """Stop the workers and close every instance, holding the caller ``grace`` seconds at most.

        The batcher has failed what was queued (under the lock, with ``stopping`` set by
        :meth:`mark_stopping`).  A worker still inside its backend after ``grace`` (a stuck user model)
        is logged and left behind, and its instance is not closed under it.
        """
        with self.lock:
            self.mark_stopping()
        deadline = time.monotonic() + grace
        for index, thread in enumerate(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
            with self.lock:  # busy; or closed already by its worker (_replace)
                name, backend = self._instances[index]
                busy = thread.is_alive() or backend in self._lent
                closed = backend in self._failed
            if busy:
                log.error("instance %s is still executing after the drain deadline; left running", name)
                continue
            if closed:
                continue
            try:
                backend.close()
            except Exception:
                log.exception("closing instance %s failed", name)
        if not self._handoff.close(max(0.0, deadline - time.monotonic())):
            log.error("%r: a delivery is still running after the stop deadline; left running", self.model)

    def mark_stopping(self) -> None:
        """Workers stop taking work (lock held): the batcher calls it as it empties its queue."""
        self.stopping = True
        self.cond.notify_all()
