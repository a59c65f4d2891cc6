"""A request's walk through a decoupled ensemble: every response of a decoupled step flows on alone.

A decoupled member answers a step with zero, one or many responses.  Each response starts a *path*
of its own: a copy of the tensors known when the step ran, plus the response's outputs, and the
steps after it (``EnsembleGraph.scopes``; the graph check guarantees that the copy is complete).  A
path that contains no decoupled step sends one ensemble response when its last step finishes; the
ensemble's final response follows once every path has finished and every decoupled step sent its
final.  An ensemble with a decoupled step is decoupled itself, so its caller streams (IPC, in-process,
gRPC, BLS ``exec(decoupled=True)``).

The first error (a step's error, an error response of a decoupled step, a cancelled stream) ends the
whole request, as it does in an ordinary ensemble: pending steps are cancelled and the error, with the
step named, is the stream's final response.  State is guarded by one lock per request; responses and
the final go to the caller's sink under it (a sink never blocks), so that no response can pass the
final; futures are completed and steps submitted outside it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError, Future
from functools import partial

import numpy as np

from edge_server.errors import Cancelled, EdgeServerError
from edge_server.pipeline.graph import EnsembleGraph, Step
from edge_server.pipeline.steps import ensemble_outputs, step_request
from edge_server.request import BatchItem, ModelAccess, ResponseSink

#: called once when the walk ends: None after the final response was sent, or the error to end it with
Finished = Callable[[Step | None, EdgeServerError | None], None]


class _Path:
    """The tensors of one response's continuation and the steps it still has to run."""

    __slots__ = ("tensors", "settled", "missing", "left", "emits")

    def __init__(
        self, graph: EnsembleGraph, scope: frozenset[int], tensors: dict[str, np.ndarray], settled: set[str]
    ) -> None:
        self.tensors = tensors
        self.settled = settled  # tensors known (an optional ensemble input left out counts as known)
        steps = {step.index: step for step in graph.steps}
        self.missing = {index: len(set(steps[index].input_map.values()) - settled) for index in scope}
        self.left = len(scope)
        self.emits = not (scope & graph.decoupled)  # a path that forks answers through its forks

    def provide(self, graph: EnsembleGraph, outputs: Mapping[str, np.ndarray], step: Step) -> list[int]:
        """Record ``step``'s outputs; return the indices of the steps of this path they complete."""
        ready = []
        for name, tensor in step.output_map.items():
            self.tensors[tensor] = outputs[name]
            self.settled.add(tensor)
            for index in graph.consumers.get(tensor, ()):
                if index in self.missing:
                    self.missing[index] -= 1
                    if self.missing[index] == 0:
                        ready.append(index)
        return ready


class _StepSink(ResponseSink):
    """Receives a decoupled step's responses (on the member's threads)."""

    def __init__(self, walk: DecoupledWalk, path: _Path, step: Step) -> None:
        super().__init__()
        self._walk = walk
        self._path = path
        self._step = step

    def deliver(
        self, outputs: dict[str, np.ndarray] | None, error: EdgeServerError | None, final: bool
    ) -> None:
        self._walk.step_response(self._path, self._step, outputs, error, final)


class DecoupledWalk:
    """One request through an ensemble whose steps may answer many times."""

    def __init__(
        self,
        graph: EnsembleGraph,
        models: ModelAccess,
        item: BatchItem,
        *,
        priority: int,
        timeout_us: int | None,
        finished: Finished,
    ) -> None:
        assert graph.scopes is not None and item.stream is not None
        self._graph = graph
        self._models = models
        self._item = item
        self._sink = item.stream
        self._priority = priority
        self._timeout_us = timeout_us
        self._finished = finished
        self._steps = {step.index: step for step in graph.steps}
        self._lock = threading.Lock()
        self._over = False  # failed, or the final was sent: later outcomes are ignored
        self._sent_final = False
        self._reported = False  # the scheduler was told (once)
        self._paths = 0  # paths not yet finished: the final goes when none is left
        self._futures: list[Future[dict[str, np.ndarray]]] = []
        self._sinks: list[_StepSink] = []

    def start(self, ensemble_inputs: tuple[str, ...]) -> None:
        inputs = self._item.inputs
        tensors = {name: inputs[name] for name in ensemble_inputs if name in inputs}
        with self._lock:
            root, ready = self._open(None, tensors, set(ensemble_inputs))
        self._submit(root, ready)
        self._report_success()

    # -- paths (call with the lock held) ----------------------------------------------------------

    def _open(
        self, start: int | None, tensors: dict[str, np.ndarray], settled: set[str]
    ) -> tuple[_Path, list[int]]:
        assert self._graph.scopes is not None
        path = _Path(self._graph, self._graph.scopes[start], tensors, settled)
        self._paths += 1
        ready = [index for index, count in path.missing.items() if count == 0]
        if path.left == 0:
            self._close(path)
        return path, ready

    def _close(self, path: _Path) -> None:
        """``path`` ran its last step: answer with it, and send the final after the last path."""
        if path.emits:
            wanted = self._item.requested_outputs
            try:
                self._sink.put(ensemble_outputs(self._graph, path.tensors, wanted), None, final=False)
            except EdgeServerError as exc:  # this response fails; the stream goes on to its final
                self._sink.put(None, exc, final=False)
        self._paths -= 1
        if self._paths == 0:
            self._over = self._sent_final = True
            self._sink.put(None, None, final=True)

    def _step_finished(self, path: _Path) -> None:
        path.left -= 1
        if path.left == 0:
            self._close(path)

    # -- steps ------------------------------------------------------------------------------------

    def _submit(self, path: _Path, ready: list[int]) -> None:
        for index in ready:
            step = self._steps[index]
            with self._lock:
                if self._over:
                    return
                request = step_request(
                    self._graph, step, self._item, path.tensors, self._priority, self._timeout_us
                )
            try:
                if index in self._graph.decoupled:
                    sink = _StepSink(self, path, step)
                    with self._lock:
                        self._sinks.append(sink)
                    self._models.stream(request, sink)
                    continue
                future = self._models.submit(request)
            except EdgeServerError as exc:
                self._fail(step, exc)
                return
            except Exception as exc:  # the request must get an answer, whatever broke
                self._fail(step, EdgeServerError(f"internal error: {exc!r}"))
                return
            with self._lock:
                self._futures.append(future)
            future.add_done_callback(partial(self._step_done, path, step))
        self._report_success()

    def _step_done(self, path: _Path, step: Step, future: Future[dict[str, np.ndarray]]) -> None:
        try:
            outputs = future.result()
        except CancelledError:
            self._fail(step, Cancelled("the step was cancelled"))
            return
        except EdgeServerError as exc:
            self._fail(step, exc)
            return
        except Exception as exc:
            self._fail(step, EdgeServerError(f"internal error: {exc!r}"))
            return
        with self._lock:
            if self._over:
                return
            ready = path.provide(self._graph, outputs, step)
            self._step_finished(path)
        self._submit(path, ready)

    def step_response(
        self,
        path: _Path,
        step: Step,
        outputs: dict[str, np.ndarray] | None,
        error: EdgeServerError | None,
        final: bool,
    ) -> None:
        """One response of decoupled ``step``: its outputs start a path of their own."""
        if error is not None:
            self._fail(step, error)
            return
        if self._sink.cancelled:
            self._fail(step, Cancelled("the caller cancelled the stream"))
            return
        child: tuple[_Path, list[int]] | None = None
        with self._lock:
            if self._over:
                return
            if outputs is not None:
                lacking = [name for name in step.output_map if name not in outputs]
                if lacking:
                    error = EdgeServerError(f"a response lacks the outputs {lacking}")
                else:
                    tensors = dict(path.tensors)
                    settled = set(path.settled)
                    for name, tensor in step.output_map.items():
                        tensors[tensor] = outputs[name]
                        settled.add(tensor)
                    child = self._open(step.index, tensors, settled)
            if error is None and final:
                self._step_finished(path)
        if error is not None:
            self._fail(step, error)
            return
        if child is not None:
            self._submit(*child)
        else:
            self._report_success()

    def _report_success(self) -> None:
        """Tell the scheduler once that the final was sent (outside the lock: it completes a future)."""
        with self._lock:
            if not self._sent_final or self._reported:
                return
            self._reported = True
        self._finished(None, None)

    def _fail(self, step: Step, error: EdgeServerError) -> None:
        with self._lock:
            if self._over:
                return
            self._over = self._reported = True
            futures, sinks = list(self._futures), list(self._sinks)
        for future in futures:  # queued steps need not run any more
            future.cancel()
        for sink in sinks:  # decoupled members can see it (request.is_cancelled())
            sink.cancel()
        self._finished(step, error)
