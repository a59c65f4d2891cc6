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

An inference request with a small uncompressed body is answered by the connection itself, once its body is
whole, when nothing else of the connection is in flight: the app decodes it and runs the model inline
where the model allows it (:meth:`KServeHttpApp.answer_now`), and the answer is written without uvicorn's
request cycle, task and ASGI messages (about 40 us a request; a tiny model's round trip costs the daemon
about 230).  Any other request, and one that must wait for an instance, goes through uvicorn's cycle; so
do the requests pipelined behind the first one of a read, which then take turns with other connections'
(answered here, a read of a thousand pipelined requests would hold the event loop for all of them).
An answer here that closes the connection lingers as a refusal does; and once a connection is closing or
lingering, nothing more of its read is run.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edge_server.kserve.shm import Peer, peer_uid
from edge_server.limits import Connection, Limits

if TYPE_CHECKING:
    from edge_server.kserve.http import KServeHttpApp

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
LATER_KEY = "edge_server.later"  # scope key: an inference the connection started, for the app to answer
#: The largest body answered by the connection itself (larger ones are decoded off the event loop).
DIRECT_BODY_BYTES = 1 << 20


@dataclass
class _Direct:
    """An inference request the connection answers itself, between its headers and its body's end."""

    model: str
    version: str
    headers: dict[bytes, bytes]
    keep_alive: bool


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


def http_protocol(limits: Limits, max_body_bytes: int, app: KServeHttpApp | None = None) -> Any:
    """The protocol class for uvicorn's ``http`` setting: httptools, bounded as the module says; or h11.

    With ``app``, the connection answers small inference requests itself (see the module doc).

    Without httptools uvicorn's h11 protocol runs unbounded by the budget (the daemon's dependencies
    include httptools; this is for a library user's stripped-down install).
    """
    try:
        import httptools
        from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
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
        _direct: _Direct | None = None  # the request the connection answers itself, its body arriving
        _answered_in_read = False  # one request per read is answered here; pipelined ones take turns

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
            self._lingering = False  # over, and its close timer with it
            self._disarm()
            self._give_back()
            if self._connection is not None:
                limits.disconnect(self._connection)
                self._connection = None

        # -- timeouts ---------------------------------------------------------------------------------

        def _arm(self, seconds: float) -> None:
            if self._lingering:
                return
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._timer is not None and not self._lingering:  # a lingering connection's close stays due
                self._timer.cancel()
                self._timer = None

        def _expired(self) -> None:
            self._timer = None
            what = "its request body" if self._body_arriving else "its request headers"
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
            self._disarm()
            self._lingering, self._linger_room = True, LINGER_BYTES
            raw.resume_reading()  # uvicorn pauses reading while a body waits for the app
            self._timer = self.loop.call_later(LINGER_S, raw.close)
            return True

        def data_received(self, data: bytes) -> None:
            if not self._lingering:
                self._answered_in_read = False
                super().data_received(data)
                return
            self._linger_room -= len(data)  # a refused connection: its request's rest is dropped unparsed
            if self._linger_room < 0 and self._raw is not None:
                self._raw.close()

        # -- parser callbacks -------------------------------------------------------------------------

        def on_message_begin(self) -> None:
            # a request pipelined behind one answered here: the idle timer that answer armed is not for it
            self._unset_keepalive_if_required()
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
            self._direct = self._answerable()
            if self._direct is None:
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
            if self._direct is None and (
                cycle.response_complete or (self.parser.should_upgrade() and self._should_upgrade())
            ):
                return
            if self._body is None or self._body_bytes > max_body_bytes:
                return
            self._body.append(body)
            self._body_bytes += len(body)
            if self._body_bytes > max_body_bytes:  # (never a direct request's: its length was checked)
                cycle.message_event.set()

        def on_message_complete(self) -> None:
            self._body_arriving = False
            self._disarm()
            direct, self._direct = self._direct, None
            if direct is None:
                super().on_message_complete()
            elif not self._ended():  # (not when refused meanwhile)
                self._answer(direct)

        # -- inference requests answered here -----------------------------------------------------------

        def _answerable(self) -> _Direct | None:
            """The request, if the connection answers it itself (see the module doc); else None."""
            if (
                app is None
                or self._answered_in_read  # the rest of a pipelined read: uvicorn's cycles, one a turn
                or self.parser.get_method() != b"POST"
                or (self.cycle is not None and not self.cycle.response_complete)
                or self.pipeline
                or self.expect_100_continue
                or self.flow.write_paused  # a client that does not read: uvicorn's cycle waits for it
                or self.parser.should_upgrade()
            ):
                return None
            headers = dict(self.headers)
            declared = headers.get(b"content-length", b"")
            if (
                not declared.isdigit()
                or int(declared) > min(DIRECT_BODY_BYTES, max_body_bytes)
                or b"content-encoding" in headers
                or b"transfer-encoding" in headers
            ):
                return None
            try:
                path = httptools.parse_url(self.url).path
            except httptools.HttpParserInvalidURLError:
                return None  # uvicorn answers it
            if b"%" in path:
                return None
            route = app.infer_route(path.decode("ascii", "replace"))
            if route is None:
                return None
            keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
            return _Direct(*route, headers, keep_alive)

        def _answer(self, direct: _Direct) -> None:
            assert app is not None
            self._answered_in_read = True
            chunks = self._body or []
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            answer = app.answer_now(self._peer[0], direct.headers, direct.model, direct.version, body)
            if not isinstance(answer, tuple):  # it waits for an instance: uvicorn's cycle answers it
                self.scope[LATER_KEY] = answer  # type: ignore[literal-required]
                super().on_headers_complete()
                self.cycle.keep_alive &= direct.keep_alive  # (False when the server began to stop meanwhile)
                super().on_message_complete()
                return
            status, content, headers = answer
            asks_close = (b"connection", b"close") in headers
            close = asks_close or not direct.keep_alive
            head = [STATUS_LINE[status]]
            for name, value in (*self.server_state.default_headers, *headers):
                head += (name, b": ", value, b"\r\n")
            head.append(b"content-length: %d\r\n" % len(content))
            if close and not asks_close:
                head.append(b"connection: close\r\n")
            head.append(b"\r\n")
            raw = self._raw
            assert raw is not None
            raw.writelines((b"".join(head), content))
            if close and not self._linger():  # what the client still sends must not reset the answer
                raw.close()
            self.on_response_complete()

        def _ended(self) -> bool:
            """Whether the connection had its last answer (a close, a refusal): nothing more is run.

            Nor answered: uvicorn would run a request pipelined behind it in the same read, its answer
            lost, and answer a parser error in the rest of that read after the end of the stream.
            """
            return self._lingering or (self._raw is not None and self._raw.is_closing())

        def _start_asgi_task(self, cycle: Any, asgi: Any) -> None:
            if not self._ended():
                super()._start_asgi_task(cycle, asgi)

        def send_400_response(self, msg: str) -> None:
            if not self._ended():
                super().send_400_response(msg)

        def shutdown(self) -> None:
            if self._direct is not None:  # its body is arriving: answer it, then close
                self._direct.keep_alive = False
                return
            super().shutdown()

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
