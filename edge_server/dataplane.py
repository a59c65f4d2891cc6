"""The transport-free data plane every frontend calls: validate a request, route it, queue it.

IPC, HTTP and the in-process API all build an :class:`InferRequest` and get a future for it:
:meth:`DataPlane.submit` queues it; :meth:`DataPlane.run_here` may run it in the caller's thread first,
within the budget the caller states (:mod:`edge_server.scheduler.inline`).  Nothing here knows about
sockets or JSON.  Every request is checked against its model's config
(:mod:`edge_server.validation`) before it is queued, so a bad request fails alone and never reaches a
batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from functools import partial
from typing import Any

import numpy as np

from edge_server import classification, dtypes
from edge_server.config.model import ModelConfig, TensorSpec
from edge_server.errors import Cancelled, EdgeServerError, InvalidArgument, shorten
from edge_server.memory import TRIM_AFTER_BYTES, DeferredTrim
from edge_server.request import InferRequest, ResponseSink
from edge_server.routing import RoutingView
from edge_server.scheduler import inline
from edge_server.scheduler.inline import QUEUE_ONLY, Budget
from edge_server.scheduler.scheduler import SchedulerClosed


def _finish_stream(sink: ResponseSink, future: Future[dict[str, np.ndarray]]) -> None:
    """End ``sink`` with the request's own outcome, unless its model already sent the final response."""
    if future.cancelled():
        sink.put(None, Cancelled("the request was cancelled before it ran"), final=True)
        return
    error = future.exception()
    if error is not None:
        if not isinstance(error, EdgeServerError):
            error = EdgeServerError(f"internal error: {error!r}")
        sink.put(None, error, final=True)
    elif not sink.model_sends:
        sink.put(future.result(), None, final=True)


def _converted(
    future: Future[dict[str, np.ndarray]], convert: classification.Convert
) -> Future[dict[str, np.ndarray]]:
    """A future of ``future``'s outputs with ``convert`` applied, once it is done."""
    converted: Future[dict[str, np.ndarray]] = Future()

    def done(future: Future[dict[str, np.ndarray]]) -> None:
        if future.cancelled():
            converted.cancel()
            converted.set_running_or_notify_cancel()
            return
        error = future.exception()
        if error is not None:
            converted.set_exception(error)
            return
        try:
            converted.set_result(convert(future.result()))
        except EdgeServerError as exc:
            converted.set_exception(exc)

    future.add_done_callback(done)
    return converted


class DataPlane:
    """Routes validated requests to the serving version of a model."""

    def __init__(self, routing: RoutingView, heap_trim: DeferredTrim | None = None) -> None:
        """``heap_trim``: asked for by every request with large inputs (the daemon's; None in-process).

        Whichever frontend a frame came through, its buffers (body, message, copies, outputs) are freed
        once it is answered, and glibc keeps their pages (see :func:`~edge_server.memory.keep_large_buffers`)
        until the trim that follows a pause in such traffic.
        """
        self._routing = routing
        self._heap_trim = heap_trim

    def submit(self, request: InferRequest) -> Future[dict[str, np.ndarray]]:
        """Validate, route and queue ``request``; the future gets its outputs or its error.

        Validation and routing errors raise here, before anything was queued.  Never runs the request
        in this thread: see :meth:`run_here`.
        """
        return self._route(request, None, QUEUE_ONLY)

    def run_here(self, request: InferRequest, budget: Budget) -> Future[dict[str, np.ndarray]]:
        """:meth:`submit`, but the request may run in this thread first, within the caller's ``budget``.

        The model's :class:`~edge_server.scheduler.inline.InlinePolicy` decides (cheap models, the
        daemon's only model, a pipeline's next step; see :mod:`edge_server.scheduler.inline`); when it
        ran here, the future is done on return, and a frontend can answer at once.  Calls made
        meanwhile from this thread (an ensemble's steps, BLS calls) inherit ``budget``.
        """
        outer = inline.state(budget)
        try:
            return self._route(request, None, budget)
        finally:
            inline.state(outer)

    def stream(self, request: InferRequest, sink: ResponseSink) -> None:
        """Run ``request`` and send its responses to ``sink``, ending with exactly one final.

        A decoupled model sends zero or more responses itself (maybe after its ``execute`` returned);
        any other model's single result becomes one final response.  Errors before or instead of a
        response (validation, queue policy, a failed execution) end the stream as an error; a
        validation error raises here instead, before anything was queued.  An ordinary model's
        request may run in this thread within the budget stated for it (:func:`inline.current`).
        """
        self._route(request, sink, inline.current())

    def _route(
        self, request: InferRequest, sink: ResponseSink | None, budget: Budget
    ) -> Future[dict[str, np.ndarray]]:
        """Validate and hand ``request`` to its version; ``budget``: what it may cost this thread."""
        if self._heap_trim is not None and sum(a.nbytes for a in request.inputs.values()) >= TRIM_AFTER_BYTES:
            self._heap_trim.request()
        # A version that is being swapped out can close between routing and queueing; a request that did
        # not ask for a specific version then goes to the version that replaced it.
        for _attempt in range(3):
            loaded = None
            if request.correlation_id:
                # A sequence that started before a reload finishes on the version it started on (and a
                # second start of it restarts it there, as it would without a reload).
                loaded = self._routing.sequence_holder(request.model, request.correlation_id, request.owner)
            if loaded is None or (request.version is not None and loaded.version != request.version):
                loaded = self._routing.resolve(request.model, request.version)
            item, shape_key = loaded.validator(request)
            stream, convert = sink, None
            if request.classification:  # checked here, applied to each result (every frontend alike)
                classification.check(loaded.config, request.classification, request.outputs)
                convert = partial(
                    classification.apply,
                    counts=request.classification,
                    batched=loaded.config.max_batch_size > 0,
                    labels=loaded.labels,
                )
                if sink is not None:
                    stream = classification.ClassifyingSink(sink, convert)
            if request.output_buffers:  # the client's shared memory, for backends that write there
                item.destinations = request.output_buffers
            if loaded.config.decoupled:
                if stream is None:
                    # Triton's words first (its clients and L0_decoupled match them), then ours
                    raise InvalidArgument(
                        "a non-streaming call doesn't support models with decoupled transaction policy "
                        f"(model {shorten(request.model)} may send many responses per request: call it "
                        "with a streaming call: Client.stream, Server.stream, gRPC ModelStreamInfer)"
                    )
                item.stream = stream
                stream.model_sends = True
            request.routed_version = loaded.version
            scheduler = loaded.scheduler
            try:
                future = scheduler.submit(
                    item, shape_key, priority=request.priority, timeout_us=request.timeout_us, budget=budget
                )
            except SchedulerClosed:
                if request.version is not None:
                    raise
                continue
            if stream is not None:
                future.add_done_callback(partial(_finish_stream, stream))
            elif convert is not None:
                return _converted(future, convert)
            return future
        raise SchedulerClosed(f"model {shorten(request.model)} is being unloaded")

    def config(self, name: str, version: int | None = None) -> ModelConfig:
        return self._routing.resolve(name, version).config

    def labels(self, name: str, version: int | None = None) -> Mapping[str, tuple[str, ...]]:
        """The class names of the serving version's outputs (from their ``label_filename``)."""
        return self._routing.resolve(name, version).labels

    def metadata(self, name: str, version: int | None = None) -> dict[str, Any]:
        """KServe v2 model metadata."""
        config = self.config(name, version)
        versions = sorted(self._routing.serving().get(name, {}))
        batched = config.max_batch_size > 0

        def tensor(spec: TensorSpec) -> dict[str, Any]:
            return {
                "name": spec.name,
                "datatype": dtypes.to_wire(spec.data_type),
                "shape": ([-1] if batched else []) + list(spec.dims),
            }

        return {
            "name": name,
            "versions": [str(v) for v in versions],
            "platform": config.platform or config.backend,
            "inputs": [tensor(s) for s in config.inputs],
            "outputs": [tensor(s) for s in config.outputs],
        }

    def statistics(self, name: str | None = None, version: int | None = None) -> list[dict[str, Any]]:
        """Triton's per-version statistics for one model, or for every serving model."""
        serving = self._routing.serving()
        if name is not None:
            if version is not None:
                return [self._routing.resolve(name, version).stats.as_dict()]
            self._routing.resolve(name)  # raises the precise error for unknown or unready models
            chosen: Mapping[str, Mapping[int, Any]] = {name: serving.get(name, {})}
        else:
            chosen = serving
        return [
            loaded.stats.as_dict() for versions in chosen.values() for _, loaded in sorted(versions.items())
        ]
