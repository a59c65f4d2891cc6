"""The scheduler of an ensemble: each request walks the step graph through the members' own schedulers.

An ensemble owns no instance and no thread.  A request's steps are submitted through the
:class:`~edge_server.request.ModelAccess` (the data plane) as soon as their inputs exist, so
independent branches run at the same time, every step is validated and batched together with direct
traffic to that member, and a member's hot reload is picked up by the next step that routes to it
(steps name members, not loaded versions).  A step's completion callback (on the member's worker
thread, outside every scheduler lock) stores its outputs and submits the steps they complete.

A member's reload may change the tensors a step relies on (a renamed output, another dtype or
shape).  The ensemble's readiness check hands :meth:`EnsembleScheduler.members_fit` the members'
serving configs; when they are not the ones last checked, the graph is validated again against them,
and while it does not fit the ensemble is unavailable with that validation error (it recovers by
itself when a later reload makes the members fit again).

``max_inflight_requests`` (0: no limit) bounds how many requests walk the graph at once; the others
wait here, in order.  The first failing step fails the request: its still-queued steps are cancelled
and the error names the step.
"""

from __future__ import annotations

import collections
import copy
import logging
import operator
import threading
import time
from collections.abc import Hashable
from concurrent.futures import CancelledError, Future
from functools import partial

import numpy as np

from edge_server.config.model import ModelConfig
from edge_server.errors import Cancelled, EdgeServerError, ServerShuttingDown
from edge_server.pipeline.decoupled import DecoupledWalk
from edge_server.pipeline.graph import EnsembleGraph, Step, build_graph
from edge_server.pipeline.steps import ensemble_outputs, step_request
from edge_server.request import BatchItem, ModelAccess, Timing
from edge_server.scheduler.drain import wait_until_idle
from edge_server.scheduler.inline import QUEUE_ONLY, Budget
from edge_server.scheduler.scheduler import SchedulerClosed
from edge_server.scheduler.stats import ModelStats

log = logging.getLogger(__name__)


class _Run:
    """One ensemble request on its way through the graph."""

    __slots__ = (
        "item",
        "future",
        "priority",
        "timeout_us",
        "enqueue_ns",
        "start_ns",
        "tensors",
        "missing",
        "steps_left",
        "step_futures",
        "lock",
        "over",
    )

    def __init__(
        self, item: BatchItem, graph: EnsembleGraph, priority: int, timeout_us: int | None, now: int
    ) -> None:
        self.item = item
        self.future: Future[dict] = Future()
        self.priority = priority
        self.timeout_us = timeout_us
        self.enqueue_ns = now
        self.start_ns = now
        self.tensors: dict[str, np.ndarray] = {}
        self.missing = {step.index: len(set(step.input_map.values())) for step in graph.steps}
        self.steps_left = len(graph.steps)
        self.step_futures: list[Future[dict[str, np.ndarray]]] = []
        self.lock = threading.Lock()
        self.over = False  # failed or finished: later step outcomes are ignored


class EnsembleScheduler:
    """:class:`~edge_server.scheduler.interface.RequestScheduler` for ``platform: "ensemble"``."""

    def __init__(self, config: ModelConfig, graph: EnsembleGraph, models: ModelAccess, stats: ModelStats):
        self._config = config
        self._graph = graph
        self._models = models
        self._stats = stats
        self._steps = {step.index: step for step in graph.steps}
        self._first = [step for step in graph.steps if not step.input_map]  # steps with no inputs at all
        self._ensemble_inputs = tuple(t.name for t in config.inputs)
        self._limit = graph.max_inflight_requests
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiting: collections.deque[_Run] = collections.deque()
        self._running = 0
        self._finished = 0  # requests that left the graph: the watchdog's progress counter
        self._accepting = True
        # (the member configs last checked, why they do not fit or ""): replaced whole, read lock-free
        self._fit: tuple[tuple[ModelConfig, ...] | None, str] = (None, "")

    # -- members ----------------------------------------------------------------------------------

    def members_fit(self, configs: dict[tuple[str, int | None], ModelConfig]) -> str:
        """Why the steps do not fit the members' serving ``configs`` ("" when they do).

        ``configs`` maps each of ``graph.members`` to the config of the version a step would reach
        now.  Checked again only when one of them is another object than last time (a reload), so
        the request path pays a tuple comparison.
        """
        key = tuple(configs[member] for member in self._graph.members)
        checked, why = self._fit
        if checked is not None and len(checked) == len(key) and all(map(operator.is_, checked, key)):
            return why
        try:
            graph = build_graph(self._config, lambda name, version: configs[(name, version)])
            if graph.decoupled != self._graph.decoupled:
                was, now = (
                    sorted(self._steps[i].describe() for i in g.decoupled) for g in (self._graph, graph)
                )
                raise EdgeServerError(
                    f"the decoupled steps changed from {was} to {now} "
                    "(reload the ensemble to change how it answers)"
                )
        except EdgeServerError as exc:
            why = f"a member reload no longer fits its steps: {exc.message}"
            log.error("ensemble %r is unavailable: %s", self._config.name, why)
        else:
            if checked is not None and self._fit[1]:
                log.info("ensemble %r: its members fit its steps again", self._config.name)
            why = ""
            # The same steps; what a member now takes (its batching, its dims) is the reloaded one's.
            self._graph = graph
        self._fit = (key, why)
        return why

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
        """Start walking the graph; its first steps go out with the budget stated for this thread.

        (The data plane stated ``budget`` for the time of a ``run_here``: the steps reach their models
        through :class:`~edge_server.request.ModelAccess`, which submits with the thread's budget.)
        """
        run = _Run(item, self._graph, priority, timeout_us, time.monotonic_ns())
        with self._lock:
            if not self._accepting:
                raise SchedulerClosed(f"ensemble {self._config.name!r} is unloading")
            admitted = not self._limit or self._running < self._limit
            if admitted:
                self._running += 1
            else:
                self._waiting.append(run)
        if admitted:
            self._start(run)
        return run.future

    def queue_size(self) -> int:
        with self._lock:
            return len(self._waiting)

    def set_sole_version(self, sole: bool) -> None:
        """Nothing to change: an ensemble is never alone (its members are served beside it)."""

    # -- walking the graph ----------------------------------------------------------------------

    def _start(self, run: _Run) -> None:
        run.start_ns = time.monotonic_ns()
        if not run.future.set_running_or_notify_cancel():  # cancelled while it waited for a slot
            self._release()
            return
        if self._config.decoupled:
            walk = DecoupledWalk(
                self._graph,
                self._models,
                run.item,
                priority=run.priority,
                timeout_us=run.timeout_us,
                finished=partial(self._walked, run),
            )
            walk.start(self._ensemble_inputs)
            return
        ready = list(self._first)
        inputs = run.item.inputs
        for name in self._ensemble_inputs:  # an optional input left out still counts as settled
            ready += self._provide(run, name, inputs.get(name))
        self._submit_steps(run, ready)

    def _provide(self, run: _Run, tensor: str, array: np.ndarray | None) -> list[Step]:
        """Record a produced tensor; return the steps it completes (call with ``run.lock`` or alone)."""
        if array is not None:
            run.tensors[tensor] = array
        ready = []
        for index in self._graph.consumers.get(tensor, ()):
            run.missing[index] -= 1
            if run.missing[index] == 0:
                ready.append(self._steps[index])
        return ready

    def _submit_steps(self, run: _Run, steps: list[Step]) -> None:
        item = run.item
        for step in steps:
            request = step_request(self._graph, step, item, run.tensors, run.priority, run.timeout_us)
            try:
                future = self._models.submit(request)
            except EdgeServerError as exc:
                self._fail(run, step, exc)
                return
            except Exception as exc:  # the request must get an answer, whatever broke
                log.exception("ensemble %r: submitting %s failed", self._config.name, step.describe())
                self._fail(run, step, EdgeServerError(f"internal error: {exc!r}"))
                return
            with run.lock:
                run.step_futures.append(future)
            # Runs at once when the step already finished (it ran inline): at most one level per step.
            future.add_done_callback(partial(self._step_done, run, step))

    def _step_done(self, run: _Run, step: Step, future: Future[dict[str, np.ndarray]]) -> None:
        try:
            outputs = future.result()
        except CancelledError:
            self._fail(run, step, Cancelled("the step was cancelled"))
            return
        except EdgeServerError as exc:
            self._fail(run, step, exc)
            return
        except Exception as exc:
            self._fail(run, step, EdgeServerError(f"internal error: {exc!r}"))
            return
        ready: list[Step] = []
        with run.lock:
            if run.over:
                return
            for name, tensor in step.output_map.items():
                ready += self._provide(run, tensor, outputs[name])
            run.steps_left -= 1
            finished = run.steps_left == 0
            if finished:
                run.over = True
        if finished:
            self._finish(run, None)
        elif ready:
            self._submit_steps(run, ready)

    def _fail(self, run: _Run, step: Step, error: EdgeServerError) -> None:
        with run.lock:
            if run.over:
                return
            run.over = True
            pending = list(run.step_futures)
        for future in pending:  # the other branches' queued steps need not run any more
            future.cancel()
        self._finish(run, self._step_error(step, error))

    def _step_error(self, step: Step, error: EdgeServerError) -> EdgeServerError:
        """The member's error class (its code) with the step named: the client can act on the code.

        Triton's text first ("in ensemble 'NAME', " and the member's text: its clients match it with
        ``startswith``), the step after it.
        """
        wrapped = copy.copy(error)
        wrapped.message = f"in ensemble {self._config.name!r}, {error.message} ({step.describe()})"
        wrapped.args = (wrapped.message,)
        return wrapped

    def _walked(self, run: _Run, step: Step | None, error: EdgeServerError | None) -> None:
        """A decoupled walk ended: its responses and final went to the stream, or it failed."""
        if error is not None and step is not None:
            error = self._step_error(step, error)
        self._finish(run, error)

    def _finish(self, run: _Run, error: EdgeServerError | None) -> None:
        end = time.monotonic_ns()
        result: dict[str, np.ndarray] = {}  # a decoupled ensemble sent its responses to the stream already
        if error is None and not self._config.decoupled:
            try:
                result = ensemble_outputs(self._graph, run.tensors, run.item.requested_outputs)
            except EdgeServerError as exc:
                error = exc
        if error is None:
            run.future.set_result(result)
        else:
            run.future.set_exception(error)
        if error is None:
            self._stats.record_batch(
                batch_size=run.item.batch_size,
                queue_ns=[run.start_ns - run.enqueue_ns],
                request_ns=[end - run.enqueue_ns],
                succeeded=[True],
                timing=Timing(compute_infer_ns=end - run.start_ns),
            )
        else:  # as Triton: a failure (reason OTHER), no execution or batch counted
            self._stats.record_failure(run.start_ns - run.enqueue_ns, end - run.enqueue_ns, "OTHER")
        run.tensors = {}
        self._release()

    def _release(self) -> None:
        """A request left the graph: admit the next waiting one."""
        with self._lock:
            self._finished += 1
            following = self._waiting.popleft() if self._waiting else None
            if following is None:
                self._running -= 1
            self._cond.notify_all()
        if following is not None:
            self._start(following)

    def liveness(self) -> tuple[int, bool]:
        """Progress is the members' to make: the ensemble itself only counts what left the graph."""
        with self._lock:
            return self._finished, bool(self._running or self._waiting)

    def readiness(self) -> list[Future[bool]]:
        return []  # its members' readiness is checked where it is routed (Routing.resolve)

    def instance_busy_ns(self) -> dict[str, int]:
        return {}  # no instances of its own: the members report theirs

    # -- lifecycle ------------------------------------------------------------------------------

    def close_intake(self, *, finish_sequences: bool = False) -> None:
        with self._lock:
            self._accepting = False

    def drain(self, deadline: float) -> bool:
        self.close_intake()
        return wait_until_idle(self._cond, lambda: bool(self._running or self._waiting), deadline)

    def stop(self, grace: float = 2.0) -> None:
        """Fail what still waits for a slot; requests inside the members finish there on their own."""
        with self._lock:
            self._accepting = False
            leftover = list(self._waiting)
            self._waiting.clear()
        for run in leftover:
            if run.future.set_running_or_notify_cancel():
                run.future.set_exception(
                    ServerShuttingDown(f"ensemble {self._config.name!r} was unloaded before the request ran")
                )
