"""One ``ModelStreamInfer`` call: requests read on a thread of their own, responses yielded in order.

A stream keeps many requests in flight, and a client that sends and never reads would otherwise make
the daemon hold every response for it (400 x 1 MiB pinned +406 MiB, kept after cancel).  So, as over
IPC:

* at most ``max_client_requests`` requests of one stream are in flight, and a request's slot is given
  back when its last response has been handed to grpc (sent), not when the model produced it;
* the bytes of responses produced and not yet handed to grpc are counted, and past
  ``max_client_reply_bytes`` the stream is cancelled, what waited for it dropped, and the heap trimmed.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from edge_server.limits import Limits
from edge_server.memory import trim_heap

log = logging.getLogger(__name__)

#: An item of the response queue: (response or None, its bytes, whether it ends a request)
Item = tuple[Any, int, bool]
#: Triton's stream mode: with this header set to "true", a request's error ends the whole stream
GRPC_ERROR_HEADER = "triton_grpc_error"


@dataclass(frozen=True)
class StreamError:
    """An error that ends the stream with its gRPC status (``triton_grpc_error`` mode), queued in order."""

    code: str  # a grpc.StatusCode name
    message: str

    def ByteSize(self) -> int:  # noqa: N802 - counted like a response
        return len(self.message)


class StreamCall:
    """The response queue of one stream, with its slots and byte bound (see the module docstring)."""

    def __init__(self, context: Any, limits: Limits) -> None:
        self._context = context
        self._limits = limits
        max_requests, max_reply_bytes = limits.max_client_requests, limits.max_client_reply_bytes
        self._queue: queue.SimpleQueue[Item | None] = queue.SimpleQueue()
        self._slots = threading.BoundedSemaphore(max_requests)
        self._max_reply_bytes = max_reply_bytes
        self._lock = threading.Lock()
        self._pending = 0  # bytes of responses queued, not yet handed to grpc
        self.cut_off = False

    def acquire(self) -> None:
        """Wait for a free slot before starting the next request (the reader thread's back-pressure)."""
        self._slots.acquire()

    def put(self, response: Any, *, ends_request: bool) -> None:
        """Queue ``response`` (None: nothing to send, only the request's end); counts its bytes."""
        nbytes = response.ByteSize() if response is not None else 0
        with self._lock:
            if self.cut_off:
                if ends_request:
                    self._slots.release()
                return
            self._pending += nbytes
            over = self._pending > self._max_reply_bytes
            if over:
                self.cut_off = True
        self._queue.put((response, nbytes, ends_request))
        if over:
            self._cut_off()

    def end(self) -> None:
        """No more responses: the reader is done and every request answered, or the call ended."""
        self._queue.put(None)

    def responses(self) -> Iterator[Any]:
        """The responses to yield to grpc, in order; a slot is freed once a request's last one is taken."""
        while (item := self._queue.get()) is not None:
            response, nbytes, ends_request = item
            with self._lock:
                if self.cut_off:
                    break
                self._pending -= nbytes
            if ends_request:
                self._slots.release()
            if isinstance(response, StreamError):  # raises: the call ends with this status
                self._context.abort(grpc.StatusCode[response.code], response.message)
            if response is not None:
                yield response

    def _cut_off(self) -> None:
        log.warning(
            "gRPC stream from %s is not reading its responses: over --max-client-reply-bytes (%d) wait "
            "for it; cancelling it",
            self._context.peer(),
            self._max_reply_bytes,
        )
        self._limits.stream_cut_off()
        self._context.cancel()
        dropped = 0
        while True:  # free what waited for it now; the reader and sinks see cut_off and stop queuing
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)
                break
            dropped += 1
            if item[2]:
                self._slots.release()
        self._queue.put(None)
        timer = threading.Timer(1.0, trim_heap)  # grpc frees its own buffers a moment later
        timer.daemon = True
        timer.start()
        log.debug("dropped %d responses of a cut-off stream", dropped)
