"""Iterators over a streamed request's responses, for the in-process API (sync and asyncio).

Each is a :class:`~edge_server.request.ResponseSink` the data plane sends to, and an iterator the
caller reads: every response is a ``{name: array}`` dict; an error response raises its
:class:`~edge_server.errors.EdgeServerError` from ``next()`` and the iterator stays usable (a
decoupled model may go on after an error); the final flag ends the iteration.  ``close()`` (or
leaving the ``with`` block) stops early: later responses are dropped and the model sees
``request.is_cancelled()``.
"""

from __future__ import annotations

import asyncio
import queue
from types import TracebackType
from typing import Any

import numpy as np

from edge_server.errors import EdgeServerError, RequestTimeout
from edge_server.request import ResponseSink

_Item = tuple[dict[str, np.ndarray] | None, EdgeServerError | None, bool]


class StreamReader:
    """What every stream iterator does with one (outputs, error, final) it took: the shared rules."""

    _done = False

    def _take(self, item: tuple[Any, BaseException | None, bool]) -> Any:
        """The response's outputs; None for a bare final; its error raised (the stream goes on)."""
        outputs, error, final = item
        self._done = final
        if error is not None:
            raise error
        return outputs


class ResponseIterator(ResponseSink, StreamReader):
    """Blocking iterator; ``timeout`` (seconds, None: forever) bounds the wait for each response."""

    def __init__(self, timeout: float | None = None) -> None:
        super().__init__()
        self._items: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._timeout = timeout
        self._done = False

    def deliver(
        self, outputs: dict[str, np.ndarray] | None, error: EdgeServerError | None, final: bool
    ) -> None:
        self._items.put((outputs, error, final))

    def __iter__(self) -> ResponseIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        while not self._done:
            try:
                item = self._items.get(timeout=self._timeout)
            except queue.Empty:
                raise RequestTimeout(f"no response within {self._timeout} s") from None
            outputs = self._take(item)
            if outputs is not None:
                return outputs  # type: ignore[no-any-return]
        raise StopIteration

    def close(self) -> None:
        self.cancel()
        self._done = True

    def __enter__(self) -> ResponseIterator:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncResponseIterator(ResponseSink, StreamReader):
    """``async for`` over the responses; create it on the event loop that reads it."""

    def __init__(self, timeout: float | None = None) -> None:
        super().__init__()
        self._loop = asyncio.get_running_loop()
        self._items: asyncio.Queue[_Item] = asyncio.Queue()
        self._timeout = timeout
        self._done = False

    def deliver(
        self, outputs: dict[str, np.ndarray] | None, error: EdgeServerError | None, final: bool
    ) -> None:
        self._loop.call_soon_threadsafe(self._items.put_nowait, (outputs, error, final))

    def __aiter__(self) -> AsyncResponseIterator:
        return self

    async def __anext__(self) -> dict[str, np.ndarray]:
        while not self._done:
            try:
                item = await asyncio.wait_for(self._items.get(), self._timeout)
            except asyncio.TimeoutError:
                raise RequestTimeout(f"no response within {self._timeout} s") from None
            outputs = self._take(item)
            if outputs is not None:
                return outputs  # type: ignore[no-any-return]
        raise StopAsyncIteration

    def close(self) -> None:
        self.cancel()
        self._done = True

    async def __aenter__(self) -> AsyncResponseIterator:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()
