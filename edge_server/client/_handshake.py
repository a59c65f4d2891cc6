"""What the sync client says first on every connection: ask ``live``, then register its regions again.

The daemon's message-size limit is asked before any request goes out (queued requests wait for the
answer, and one over the limit fails unsent); a reconnection (the daemon restarted) registers the
client's shared-memory regions again ahead of everything queued, since a new daemon knows none.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from functools import partial
from typing import Any

from edge_server.client import _wire
from edge_server.client._call import Call
from edge_server.client._common import MessageLimit, daemon_limit, reregistrations
from edge_server.client.shm import SharedMemoryRegion

log = logging.getLogger(__name__)


class Handshake:
    """The first messages of each connection, put at the head of the transport's outbox."""

    def __init__(
        self,
        address: str,
        limit: MessageLimit,
        regions: dict[str, SharedMemoryRegion],
        ids: Iterator[int],
        send_first: Callable[[Call], None],
    ) -> None:
        self._address = address
        self._limit = limit
        self._regions = regions  # the client's registered regions (its own dict: kept up to date)
        self._ids = ids
        self._send_first = send_first
        self.greeting: Call | None = None  # the `live` asked on connecting, until it is answered

    def connected(self, *, again: bool) -> None:
        """A connection is up (``again``: after one was lost): greet, and register regions again."""
        self._greet()
        if again:
            self._reregister()

    def _reregister(self) -> None:
        """A new daemon knows none of our regions: register them again ahead of everything queued."""
        # Each goes to the head of the outbox: the last first, so that they leave in their order.
        for rid, frames, _ in reversed(reregistrations(self._address, self._regions.values(), self._ids)):
            self._send_first(Call(rid, frames, _log_reregister, None, early=True))

    def _greet(self) -> None:
        """Ask the daemon just connected to for its message-size limit before sending any request."""
        self._limit.learned(None)
        rid = next(self._ids)
        call = Call(rid, _wire.control_message(rid, "live"), daemon_limit, None, early=True, future=True)
        self.greeting = call
        assert call.future is not None
        call.future.add_done_callback(partial(self._greeted, call))
        self._send_first(call)

    def _greeted(self, call: Call, future: Future[Any]) -> None:
        # Runs where the future is settled: the leader's _receive or _lost, or close().
        if call is not self.greeting:
            return
        self.greeting = None
        exc = None if future.cancelled() else future.exception()
        if future.cancelled() or exc is not None:
            # Lost with the connection: the next handshake asks again.  An error reply: carry on
            # with the client's own limit (the daemon still answers MESSAGE_TOO_LARGE itself).
            log.debug("the daemon's message limit is unknown: %r", exc)
            return
        self._limit.learned(future.result())


def _log_reregister(header: dict[str, Any], frames: list[Any]) -> None:
    log.info("re-registered shared-memory region %s after reconnecting", header.get("region"))
