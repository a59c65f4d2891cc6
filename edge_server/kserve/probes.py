"""Are the HTTP and gRPC frontends still answering?  The watchdog's question, asked of each.

Both follow the shape of :mod:`edge_server.service.liveness`: ``poke()`` after each watchdog check
asks the frontend for a trivial piece of work, ``liveness()`` reports a counter of answers.  A frontend
that does not answer within the stall time stops the ``WATCHDOG=1`` pings, and systemd restarts the
daemon.

* HTTP: a callback queued onto uvicorn's event loop.  Every request runs on that one loop, so a handler
  that blocks it (a lock that is never released, a blocking call in an async path) stops the callback
  and the probe sees it.  Nothing a client sends can delay a queued callback by the stall time.
* gRPC: a real ``ServerLive`` call over a loopback channel, through grpc's transport, its worker pool
  and our servicer.  A pool whose every worker is blocked, or a transport that stopped, leaves the call
  unanswered.  Open streams hold a worker each for as long as the client keeps them open; when they
  hold every worker, the pool is full, not wedged, and the probe does not count (a client can make
  the frontend busy, never make systemd restart the daemon).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class LoopProbe:
    """Liveness of an asyncio event loop in another thread, through ``call_soon``."""

    def __init__(self, call_soon: Callable[[Callable[[], None]], bool]) -> None:
        self._call_soon = call_soon
        self._answered = 0
        self._pending = False
        self._lock = threading.Lock()

    def liveness(self) -> tuple[int, bool]:
        """(callbacks run, whether one is waiting to run)."""
        with self._lock:
            return self._answered, self._pending

    def poke(self) -> None:
        with self._lock:
            if self._pending:
                return  # the last one has not run yet: one in the queue is enough
            self._pending = True
        # A loop that is gone (the frontend thread died) never runs it: stuck, as it should be seen.
        self._call_soon(self._ran)

    def _ran(self) -> None:
        with self._lock:
            self._answered += 1
            self._pending = False


class GrpcProbe:
    """Liveness of a gRPC server through ``ServerLive`` calls from a channel of its own.

    ``saturated`` says whether long-lived calls (open streams) hold every worker; then an unanswered
    probe does not count.
    """

    def __init__(self, target: str, saturated: Callable[[], bool]) -> None:
        self._target = target
        self._saturated = saturated
        self._lock = threading.Lock()
        self._answered = 0
        self._in_flight = False
        self._waiting = False  # asked, and no answer since: a failed call (refused, reset) keeps waiting
        self._channel: Any = None
        self._stub: Any = None

    def liveness(self) -> tuple[int, bool]:
        """(probes answered, whether one is unanswered while the workers are not all held by streams)."""
        with self._lock:
            return self._answered, self._waiting and not self._saturated()

    def poke(self) -> None:
        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        with self._lock:
            if self._in_flight:
                return
            if self._channel is None:
                self._channel = grpc.insecure_channel(self._target)
                self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
            self._in_flight = self._waiting = True
            stub = self._stub
        future = stub.ServerLive.future(service_pb2.ServerLiveRequest())
        future.add_done_callback(self._done)

    def _done(self, future: Any) -> None:
        error = "cancelled" if future.cancelled() else future.exception()
        with self._lock:
            self._in_flight = False  # a failed call is asked again at the next poke
            if error is None:
                self._answered += 1
                self._waiting = False
        if error is not None:
            log.debug("gRPC liveness probe failed: %s", error)

    def close(self) -> None:
        with self._lock:
            channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            channel.close()


def loopback(host: str) -> str:
    """The address to reach a server bound to ``host`` from this host (a wildcard means loopback)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host
