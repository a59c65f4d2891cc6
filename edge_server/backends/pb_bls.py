"""BLS: a Python model's calls into other models (``pb_utils.InferenceRequest(...).exec()``).

A call becomes an ordinary :class:`~edge_server.request.InferRequest` submitted through the
:class:`~edge_server.request.ModelAccess` the model received at load, so it is validated, queued,
batched with every other request for the called model and counted in its statistics.

No call waits without bound when it was given a ``timeout``: the wait for the answer is bounded by it
(not only the time in the queue), because the called model may be unable to run the request at all
(a model calling itself with its only instance, two models calling each other).  A call that times
out is cancelled, so it never runs later.  This module returns outcomes; ``pb_utils`` turns them into
``InferenceResponse`` objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from edge_server.backends import pb_context
from edge_server.errors import Cancelled, EdgeServerError, RequestTimeout, Unavailable
from edge_server.request import InferRequest, ModelAccess, ResponseSink

Outcome = dict[str, np.ndarray] | EdgeServerError


def models() -> ModelAccess:
    """The calling model's way to other models; raises where there is none."""
    context = pb_context.calling_model()
    if context is None or context.models is None:
        raise Unavailable(
            "BLS calls are available to model code loaded by the server (execute, initialize, or the "
            "model's own threads), not here"
        )
    return context.models


def _never_runs(request: InferRequest) -> EdgeServerError | None:
    """A call that could never run: the model calling itself from its only instance's ``execute``.

    The request would queue behind the very execution that waits for it; refuse it at once instead
    of letting it wait for its timeout (or forever, without one).
    """
    context = pb_context.current()
    if context is None or not context.executing or context.model_name != request.model:
        return None
    if context.instances > 1 or (request.version is not None and request.version != context.model_version):
        return None
    return Unavailable(
        f"model {request.model!r} calls itself from its only instance, which is busy waiting for the "
        "call: it could never run (give the model more instances with instance_group count)"
    )


def _timed_out(request: InferRequest, wait_s: float) -> RequestTimeout:
    return RequestTimeout(f"BLS call to model {request.model!r} got no answer within {wait_s * 1e6:.0f} us")


def _outcome(future: Future[dict[str, np.ndarray]]) -> Outcome:
    try:
        return future.result(timeout=0)
    except CancelledError:
        return Cancelled("the BLS call was cancelled")
    except EdgeServerError as exc:
        return exc
    except Exception as exc:
        return EdgeServerError(f"internal error: {exc!r}")


def call(access: ModelAccess, request: InferRequest, wait_s: float | None) -> Outcome:
    """Run ``request`` and wait for its outputs (at most ``wait_s`` seconds; None: no bound)."""
    refused = _never_runs(request)
    if refused is not None:
        return refused
    try:
        future = access.submit(request)
    except EdgeServerError as exc:
        return exc
    try:
        future.result(timeout=wait_s)
    except FutureTimeout:
        if future.cancel() or not future.done():
            return _timed_out(request, wait_s or 0.0)
    except BaseException:
        pass
    return _outcome(future)


async def call_async(access: ModelAccess, request: InferRequest, wait_s: float | None) -> Outcome:
    """:func:`call` for ``async def execute``: the event loop runs other coroutines meanwhile."""
    refused = _never_runs(request)
    if refused is not None:
        return refused
    try:
        future = access.submit(request)
    except EdgeServerError as exc:
        return exc
    try:
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), wait_s)
    except asyncio.TimeoutError:
        if future.cancel() or not future.done():
            return _timed_out(request, wait_s or 0.0)
    except BaseException:
        pass
    return _outcome(future)


_Item = tuple[dict[str, np.ndarray] | None, EdgeServerError | None, bool]


class _Collect(ResponseSink):
    """The responses of a streamed BLS call, as they come (on any thread).

    It keeps reading after a cancellation: :meth:`Stream.cancel` tells the called model (which sees
    ``request.is_cancelled()``), and the responses it still sends, its final one included, arrive.
    """

    keeps_reading = True

    def __init__(self) -> None:
        super().__init__()
        self.items: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self.on_item: Callable[[], None] | None = None  # told after each item (an awaiting coroutine)

    def deliver(
        self, outputs: dict[str, np.ndarray] | None, error: EdgeServerError | None, final: bool
    ) -> None:
        self.items.put((outputs, error, final))
        on_item = self.on_item
        if on_item is not None:
            on_item()


class Stream:
    """The responses of a streamed call (a decoupled model's, zero or many) as ``(outputs, error)``.

    What ``exec(decoupled=True)`` iterates: a bare final yields ``({}, None)``.  ``wait_s`` bounds the
    wait for each response (past it the call is cancelled and a TIMEOUT error ends the iteration).
    :meth:`cancel` asks the called model to stop, as Triton's ``ResponseIterator.cancel()`` does: the
    iteration goes on with what the model still sends, up to its final response.  A stream dropped
    before its final response cancels the call.
    """

    def __init__(self, access: ModelAccess, request: InferRequest, wait_s: float | None) -> None:
        self._request = request
        self._wait_s = wait_s
        self._sink = _Collect()
        self._done = False
        self._first: _Item | None = None  # taken by :meth:`first_response` before the iteration
        self._error = _never_runs(request)
        if self._error is None:
            try:
                access.stream(request, self._sink)
            except EdgeServerError as exc:
                self._error = exc

    def __iter__(self) -> Iterator[tuple[dict[str, np.ndarray], EdgeServerError | None]]:
        return self

    def __next__(self) -> tuple[dict[str, np.ndarray], EdgeServerError | None]:
        if self._done:
            raise StopIteration
        if self._error is not None:
            self._done = True
            return {}, self._error
        while True:
            try:
                if self._first is not None:
                    (outputs, error, final), self._first = self._first, None
                else:
                    outputs, error, final = self._sink.items.get(timeout=self._wait_s)
            except queue.Empty:
                self._sink.cancel()
                self._done = True
                return {}, _timed_out(self._request, self._wait_s or 0.0)
            if final:
                self._done = True
            if outputs is not None or error is not None or final:
                return outputs or {}, error

    async def first_response(self) -> None:
        """Wait, without blocking the event loop, until the first response is there.

        Triton's ``async_exec`` hands back the iterator once the call's first response came, so an
        ``async def execute`` that awaits the call and then iterates lets its other requests run
        meanwhile.
        """
        if self._error is not None or self._first is not None:
            return
        loop = asyncio.get_running_loop()
        arrived: asyncio.Future[None] = loop.create_future()

        def settle() -> None:
            if not arrived.done():
                arrived.set_result(None)

        def wake() -> None:  # on the thread that delivered
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(settle)

        self._sink.on_item = wake
        try:
            if not self._sink.items.empty():
                settle()
            await asyncio.wait_for(arrived, self._wait_s)
        except asyncio.TimeoutError:
            self._sink.cancel()
            self._error = _timed_out(self._request, self._wait_s or 0.0)
            return
        finally:
            self._sink.on_item = None
        self._first = self._sink.items.get_nowait()

    def cancel(self) -> None:
        """Ask the called model to stop (it sees ``request.is_cancelled()``); keep iterating."""
        self._sink.cancel()

    def __del__(self) -> None:
        if not self._sink.finished:
            self._sink.cancel()
