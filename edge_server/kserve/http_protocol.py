"""The HTTP frontend's connection: uvicorn's httptools protocol, held to the daemon's one budget.

uvicorn by itself accepts every connection, waits for ever for a first request's headers and for a body
that stops one byte short, and counts neither descriptors nor body bytes.  Here each connection:

* is counted in :class:`~edge_server.limits.Limits` when it is made, and refused there (a 503 and
  close) over the daemon's connection cap or its user's (``--max-client-connections``);
* must send its request line and headers within ``--header-timeout-secs`` (at most
  :data:`MAX_HEADER_BYTES` of them) and its body within ``--body-timeout-secs``, or is closed;
  between requests, uvicorn's keep-alive timeout is ``--idle-timeout-secs``;
* counts its body's bytes against its user's and the daemon's body budget as they arrive, and is
  answered 503 and closed when one is spent (the rest of that body read and dropped for a moment, so
  that the answer is not lost to a reset); they are given back when the response is sent.  A
  compressed body is inflated no further than that budget's room, and counted too
  (:class:`BodyBudget`, in the request's scope); a user whose inflated body was refused is penalized
  there (:meth:`~edge_server.limits.Limits.penalize`).

Its responses leave in one write (see :class:`_OneWriteTransport`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from edge_server.kserve.shm import Peer, peer_uid
from edge_server.limits import Connection, Limits

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 << 10  # request line and headers together
# A body refused as it arrives is read on and dropped for this long, and no more than this much of it,
# after the refusal was sent: closing a socket with unread bytes resets the connection, and the client
# whose body is still on its way then loses the answer (ECONNRESET before it reads the 503).
LINGER_S = 1.0
LINGER_BYTES = 8 << 20
PEER_KEY = "edge_server.peer"  # scope key: the connection's Peer (a list of one)
BODY_KEY = "edge_server.body"  # scope key: the request body's chunks as they came (a list of bytes)
BUDGET_KEY = "edge_server.budget"  # scope key: the connection's BodyBudget


class _OneWriteTransport:
    """A connection's transport that sends a response's head together with its body.

    uvicorn writes the status line and headers, then the body, as two writes: two ``send`` calls, two
    TCP segments, and on loopback the client woken twice; that cost about a third of a tiny model's
    round trip.  A response head is held here until the next write (the body, or an empty one) and both
    leave in one ``writelines``.  ``100 Continue`` is not held; a held head is sent before a close.

    ``linger``, asked at uvicorn's close once the response is out: True when the connection lingers
    instead (a body still arriving; see ``BoundedHttpToolsProtocol._linger``) and closes later itself.
    """

    __slots__ = ("_transport", "_head", "_linger")

    def __init__(self, transport: asyncio.Transport, linger: Callable[[], bool]) -> None:
        self._transport = transport
        self._head: bytes | None = None
        self._linger = linger

    def write(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._transport.writelines((head, data))
        elif data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 100 "):
            self._head = data
        else:
            self._transport.write(data)

    def close(self) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            self._transport.write(head)
        if not self._linger():
            self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _refusal(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": message}).encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


class BodyBudget:
    """What the app may count against the connection's share of the body budget (an inflated body).

    Counted bytes are given back with the connection's body bytes, when the response is sent.
    """

    __slots__ = ("_limits", "_connection", "held")

    def __init__(self, limits: Limits, connection: Connection) -> None:
        self._limits = limits
        self._connection = connection
        self.held = 0

    def room(self) -> int:
        return self._limits.room(self._connection.uid)

    def reserve(self, nbytes: int) -> str | None:
        refusal = self._limits.reserve(self._connection.uid, nbytes)
        if refusal is None:
            self.held += nbytes
        return refusal

    def penalty(self) -> str | None:
        """Why this connection's user may not have compressed bodies inflated now (see Limits.penalize)."""
        return self._limits.penalty(self._connection.uid)

    def penalize(self, why: str) -> None:
        self._limits.penalize(self._connection.uid, why)

    def give_back(self) -> None:
        if self.held:
            self._limits.release(self._connection.uid, self.held)
            self.held = 0


def http_protocol(limits: Limits, max_body_bytes: int) -> Any:
    """The protocol class for uvicorn's ``http`` setting: httptools, bounded as the module says; or h11.

    Without httptools uvicorn's h11 protocol runs unbounded by the budget (the daemon's dependencies
    include httptools; this is for a library user's stripped-down install).
    """
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        log.warning("httptools is missing: the HTTP frontend runs on h11, without connection limits")
        return "h11"

    class BoundedHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[misc]
        _header_bytes = 0
        _connection: Connection | None = None
        _raw: asyncio.Transport | None = None
        _timer: asyncio.TimerHandle | None = None
        _in_headers = False  # between a request's first byte and its last header
        _reserved = 0  # body bytes this connection holds in the budget
        _received = 0  # body bytes of the requests not yet answered
        _body: list[bytes] | None = None  # the request's body chunks, in its scope for the app
        _body_bytes = 0
        _body_arriving = False  # between the headers of a request with a body and that body's end
        _lingering = False  # refused: what still comes is read and dropped until the close
        _linger_room = 0  # bytes a lingering connection may still read

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._raw = transport
            self.transport = _OneWriteTransport(transport, self._linger_mid_body)  # type: ignore[assignment]
            client = self.client or ("", 0)
            server = self.server or ("", 0)
            peer = Peer(client[0], int(client[1]), int(server[1] or 0), server[0] or "")
            peer.uid = peer_uid(peer)  # the kernel's answer holds for the connection's life
            self._peer: list[Peer] = [peer]
            self._connection = limits.connect(peer.uid)
            self._budget = BodyBudget(limits, self._connection)
            if self._connection.refusal is not None:
                self._refuse(503, "Service Unavailable", self._connection.refusal)
                return
            self._arm(limits.header_timeout_s)

        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            self._disarm()
            self._give_back()
            if self._connection is not None:
                limits.disconnect(self._connection)
                self._connection = None

        # -- timeouts ---------------------------------------------------------------------------------

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self) -> None:
            self._timer = None
            what = "its request headers" if self._in_headers or self.cycle is None else "its request body"
            log.info("HTTP: closing a connection that did not send %s in time", what)
            self._refuse(408, "Request Timeout", f"the connection did not send {what} in time")

        def _refuse(self, status: int, reason: str, message: str, *, linger: bool = False) -> None:
            """Answer ``status`` outside uvicorn's request cycle and close the connection.

            ``linger``: the client is still sending (a body refused as it arrives); the answer is
            followed by the end of our side of the stream, and what still comes is read and dropped
            (:data:`LINGER_S`, :data:`LINGER_BYTES`) before the close, so that the answer arrives.
            """
            raw = self._raw
            assert raw is not None
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.response_complete = True  # nothing more from the app on this connection
                self.cycle.disconnected = True
                self.cycle.message_event.set()
            if raw.is_closing() or self._lingering:
                return
            raw.write(_refusal(status, reason, message))
            if not (linger and self._linger()):
                raw.close()

        def _linger_mid_body(self) -> bool:
            """At uvicorn's close: linger where the request's body is still arriving.

            A 413 answered before the body's end: closing with unread bytes sends a reset, and the
            client, still sending, would lose the answer to it.
            """
            return self._body_arriving and self._linger()

        def _linger(self) -> bool:
            """End our side of the stream, read and drop what still comes, then close.

            For :data:`LINGER_S` and :data:`LINGER_BYTES` at most; False where the transport cannot
            half-close (the caller closes it).
            """
            raw = self._raw
            assert raw is not None
            if self._lingering or raw.is_closing() or not raw.can_write_eof():
                return self._lingering
            raw.write_eof()
            self._lingering, self._linger_room = True, LINGER_BYTES
            raw.resume_reading()  # uvicorn pauses reading while a body waits for the app
            self._disarm()
            self._timer = self.loop.call_later(LINGER_S, raw.close)
            return True

        def data_received(self, data: bytes) -> None:
            if not self._lingering:
                super().data_received(data)
                return
            self._linger_room -= len(data)  # a refused connection: its request's rest is dropped unparsed
            if self._linger_room < 0 and self._raw is not None:
                self._raw.close()

        # -- parser callbacks -------------------------------------------------------------------------

        def on_message_begin(self) -> None:
            self._header_bytes = 0
            self._in_headers = True
            super().on_message_begin()
            self.scope[PEER_KEY] = self._peer  # type: ignore[literal-required]
            self.scope[BUDGET_KEY] = self._budget  # type: ignore[literal-required]
            self._body, self._body_bytes = [], 0
            self.scope[BODY_KEY] = self._body  # type: ignore[literal-required]
            if self._timer is None:  # a keep-alive connection's next request: its headers are timed too
                self._arm(limits.header_timeout_s)

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value))
            super().on_header(name, value)

        def _count(self, size: int) -> None:
            self._header_bytes += size
            if self._header_bytes > MAX_HEADER_BYTES:
                # raised inside a parser callback: httptools reports it as a parser error, and uvicorn
                # answers 400 and closes the connection
                raise ValueError(f"request line and headers over {MAX_HEADER_BYTES} bytes")

        def on_headers_complete(self) -> None:
            self._in_headers = False
            self._disarm()
            super().on_headers_complete()
            expects_body = any(
                (name == b"content-length" and value.strip() not in (b"0", b""))
                or name == b"transfer-encoding"
                for name, value in self.headers
            )
            self._body_arriving = expects_body
            if expects_body:
                self._arm(limits.body_timeout_s)

        def on_body(self, body: bytes) -> None:
            self._received += len(body)
            if self._received > self._reserved and self._received <= max_body_bytes + len(body):
                # (past max_body_bytes the app answers 413 and drops the body: nothing more to count)
                wanted = self._received - self._reserved
                assert self._connection is not None
                refusal = limits.reserve(self._connection.uid, wanted)
                if refusal is not None:
                    log.info("HTTP: refusing a request body: %s", refusal)
                    self._refuse(503, "Service Unavailable", refusal, linger=True)
                    return
                self._reserved += wanted
            self._keep(body)

        def _keep(self, body: bytes) -> None:
            """Keep a body chunk as it came, for the app to join once the body is whole.

            uvicorn's own ``on_body`` appends each chunk to a buffer that its ``receive`` copies out,
            pausing the connection every 64 KiB until the app has taken it: two more copies of the body
            and a wake-up of the app per read (a 0.6 MB body: 611 against 472 us of daemon CPU).  The
            body is counted in the budget as it comes (above), so nothing is paused; past
            ``max_body_bytes`` the app is woken to refuse it and the rest is dropped.
            """
            cycle = self.cycle
            if cycle.response_complete or (self.parser.should_upgrade() and self._should_upgrade()):
                return
            if self._body is None or self._body_bytes > max_body_bytes:
                return
            self._body.append(body)
            self._body_bytes += len(body)
            if self._body_bytes > max_body_bytes:
                cycle.message_event.set()

        def on_message_complete(self) -> None:
            self._body_arriving = False
            self._disarm()
            super().on_message_complete()

        def on_response_complete(self) -> None:
            if not self.pipeline:  # a pipelined request's body may be counted already: keep it
                self._give_back()
            super().on_response_complete()

        def _give_back(self) -> None:
            if self._reserved and self._connection is not None:
                limits.release(self._connection.uid, self._reserved)
            self._reserved = self._received = 0
            self._budget.give_back()

    return BoundedHttpToolsProtocol
