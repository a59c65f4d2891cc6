"""The KServe v2 HTTP/REST frontend's ASGI app (run under uvicorn by ``kserve/http_frontend.py``).

Why a bare ASGI app on uvicorn: measured against aiohttp's server (bench/bench_http_stacks.py,
docs/architecture.md) it adds the least per request, and a framework's routing and request objects would
add more.  Routing is a dict lookup on the path's fixed shape; every handler returns JSON or raises an
:class:`~edge_server.errors.EdgeServerError`, mapped to Triton's status codes in one place
(:func:`~edge_server.kserve.service.error_status`).

Bodies are bounded before they are read (``Content-Length`` against ``max_body_bytes``; a chunked body
is counted as it arrives), compressed bodies are inflated with the same bound, and an inference response is
compressed when the client's ``Accept-Encoding`` asks for gzip or deflate (as tritonclient does).  A user
whose inflated body is then refused as malformed or too large (a gzip bomb: 8 KiB inflating to 8 MiB of
``[],``) is penalized (:meth:`~edge_server.limits.Limits.penalize`): inflating is the costly part, and
its next compressed bodies are answered 503 without it.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import re
import zlib
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge_server.errors import (
    EdgeServerError,
    InvalidArgument,
    MalformedMessage,
    MessageTooLarge,
    ProtocolError,
    Unavailable,
    Unsupported,
)
from edge_server.kserve import codec, rest
from edge_server.kserve.http_protocol import BODY_KEY, BUDGET_KEY, LATER_KEY, PEER_KEY, BodyBudget
from edge_server.kserve.service import NO_CUDA_SHM, KServeService, error_code, error_status
from edge_server.kserve.shm import Peer

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 64 << 20
#: Bodies at least this large are decoded (inflated, parsed) on a worker thread, not on the event loop.
OFF_LOOP_BYTES = 1 << 20
_JSON = [(b"content-type", b"application/json")]
_MODEL_PATH = re.compile(
    r"/v2/models/([^/]+)(?:/versions/([^/]+))?(/ready|/config|/stats|/infer|/trace/setting)?"
)
_REPO_PATH = re.compile(r"/v2/repository/models/([^/]+)/(load|unload)")
_INFLATED = "edge_server.inflated"  # scope key: the request's body was inflated (see _body)
_SHM_PATH = re.compile(r"/v2/(system|cuda)sharedmemory(?:/region/([^/]+))?/(status|register|unregister)")

Scope = dict[str, Any]
Answer = tuple[int, bytes, list[tuple[bytes, bytes]]]  # status, body, headers (content-length is added)
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class _Disconnected(Exception):
    """The client went away before its body arrived; nothing to answer."""


class _Reply(Exception):
    """A handler's non-JSON answer (a bare status), raised to skip the JSON path."""

    def __init__(self, status: int) -> None:
        self.status = status


@dataclass(frozen=True)
class _Later:
    """An inference that :meth:`KServeHttpApp.answer_now` started and that waits for an instance."""

    app: KServeHttpApp
    decoded: rest.RestInfer
    future: Future[dict[str, np.ndarray]]
    peer: Peer
    headers: dict[bytes, bytes]

    async def reply(self) -> Answer:
        try:
            outputs = await asyncio.wrap_future(self.future)
            return _compressed(self.app.encode(self.decoded, outputs, self.peer), self.headers)
        except Exception as exc:  # noqa: BLE001 - as in KServeHttpApp.__call__
            return _error_reply(exc)


class KServeHttpApp:
    """The ASGI application: routes, body bounds, compression, errors."""

    def __init__(self, service: KServeService, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.service = service
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        later: _Later | None = scope.get(LATER_KEY)
        if later is not None:  # an inference the protocol started (see answer_now): only its answer is due
            await _send(send, *await later.reply())
            return
        headers = dict(scope["headers"])
        try:
            status, body, extra = await self._route(scope, receive, headers)
        except _Reply as reply:
            await _send(send, reply.status, b"", [])
            return
        except _Disconnected:
            return
        except Exception as exc:  # noqa: BLE001 - every error becomes a reply; the server never dies
            if scope.get(_INFLATED) and isinstance(exc, (MalformedMessage, MessageTooLarge)):
                # it cost a whole inflation to find out: the next such body is refused unread
                why = f"sent a compressed request body refused after inflating ({exc.code})"
                scope[BUDGET_KEY].penalize(why)
            await _send(send, *_error_reply(exc))
            return
        # Triton compresses only inference answers: tritonclient.http.aio cannot read a compressed
        # metadata, config or statistics answer.
        if self.infer_route(scope["path"]) is not None:
            status, body, extra = _compressed((status, body, extra), headers)
        await _send(send, status, body, extra)

    def infer_route(self, path: str) -> tuple[str, str] | None:
        """The model and version of an inference path (``/v2/models/NAME[/versions/V]/infer``), or None."""
        match = _MODEL_PATH.fullmatch(path)
        if match is None or match.group(3) != "/infer":
            return None
        return match.group(1), match.group(2) or ""

    def answer_now(
        self, peer: Peer, headers: dict[bytes, bytes], model: str, version: str, body: bytes
    ) -> Answer | _Later:
        """An inference request whose whole body is here, answered in this thread where it can be.

        The protocol calls this for a small uncompressed body (see ``http_protocol``): decoding it and a
        model that runs inline (:mod:`edge_server.scheduler.inline`) need no request cycle, no task and no
        ASGI messages, which cost uvicorn about 40 us a request, a sixth of a tiny model's.  A request
        that waits for an instance gives back a :class:`_Later`, which the ASGI app answers.
        """
        try:
            decoded = self._decode(headers, model, version, body, peer)
            future = self.service.submit(decoded.request)
            if not future.done():
                return _Later(self, decoded, future, peer, headers)
            return _compressed(self.encode(decoded, future.result(), peer), headers)
        except Exception as exc:  # noqa: BLE001 - as in __call__
            return _error_reply(exc)

    async def _route(self, scope: Scope, receive: Receive, headers: dict[bytes, bytes]) -> Answer:
        path: str = scope["path"]
        method: str = scope["method"]
        service = self.service
        if path.startswith("/v2/models/") and path != "/v2/models/stats":
            match = _MODEL_PATH.fullmatch(path)
            if match is None:
                raise _not_found(path)
            name, version, action = match.group(1), match.group(2) or "", match.group(3) or ""
            if action == "/infer":
                _expect(method, "POST", path)
                body = await self._body(receive, headers, scope)
                return await self._infer(scope, headers, name, version, body)
            if action == "/trace/setting":
                return await self._settings(scope, method, receive, headers, path)
            _expect(method, "GET", path)
            if action == "/ready":
                if not await asyncio.wrap_future(service.model_ready(name, version)):
                    raise _Reply(400)
                return 200, b"", []
            if action == "/config":
                return _json(service.model_config(name, version))
            if action == "/stats":
                return _json(service.statistics(name, version))
            return _json(service.model_metadata(name, version))
        if path in ("/v2/health/live", "/v2/health/ready"):
            _expect(method, "GET", path)
            ok = service.live() if path.endswith("live") else service.ready()
            if not ok:
                raise _Reply(400)
            return 200, b"", []
        if path in ("/v2", "/v2/"):
            _expect(method, "GET", path)
            return _json(service.server_metadata())
        if path == "/v2/models/stats":
            _expect(method, "GET", path)
            return _json(service.statistics())
        if path == "/v2/repository/index":
            _expect(method, "POST", path)
            request = await self._json_body(receive, headers, scope)
            ready = request.get("ready", False)
            return _json(service.repository_index(ready is True))
        if match := _REPO_PATH.fullmatch(path):
            _expect(method, "POST", path)
            request = await self._json_body(receive, headers, scope)
            params = request.get("parameters", {})
            if not isinstance(params, dict):
                raise InvalidArgument("'parameters' must be a JSON object")
            service.authorize_control(_peer(scope), match.group(2))
            # Loading takes seconds: off the event loop, so that other requests go on meanwhile.
            action = service.load if match.group(2) == "load" else service.unload
            await asyncio.to_thread(action, match.group(1), params)
            return 200, b"", []
        if match := _SHM_PATH.fullmatch(path):
            return await self._shm(scope, receive, headers, match)
        if path in ("/v2/logging", "/v2/trace/setting"):
            return await self._settings(scope, method, receive, headers, path)
        raise _not_found(path)

    async def _settings(
        self, scope: Scope, method: str, receive: Receive, headers: dict[bytes, bytes], path: str
    ) -> Answer:
        """GET: the settings in force; POST: change them (all or none; 400 naming what cannot be).

        A POST is a control operation (403 unless the caller may control the daemon), even one that
        changes nothing: the answer to it must not depend on what the settings are now.
        """
        if method not in ("GET", "POST"):
            raise _MethodNotAllowed(f"{path} takes GET or POST, not {method}")
        settings = self.service.settings
        logging_path = path == "/v2/logging"
        if method == "GET":
            return _json(settings.log_settings() if logging_path else settings.trace_settings())
        self.service.authorize_control(_peer(scope), f"POST {'/v2/logging' if logging_path else path}")
        changes = await self._json_body(receive, headers, scope)
        return _json(settings.update_log(changes) if logging_path else settings.update_trace(changes))

    async def _infer(
        self, scope: Scope, headers: dict[bytes, bytes], model: str, version: str, body: bytes
    ) -> Answer:
        peer = _peer(scope)
        if len(body) < OFF_LOOP_BYTES:
            decoded = self._decode(headers, model, version, body, peer)
        else:  # parsing megabytes of JSON would stall every other client of this loop
            decoded = await asyncio.to_thread(self._decode, headers, model, version, body, peer)
        future = self.service.submit(decoded.request)
        outputs = future.result() if future.done() else await asyncio.wrap_future(future)
        return self.encode(decoded, outputs, peer)

    def _decode(
        self, headers: dict[bytes, bytes], model: str, version: str, body: bytes, peer: Peer
    ) -> rest.RestInfer:
        header_length = headers.get(b"inference-header-content-length")
        length: int | None = None
        if header_length is not None:
            try:
                length = int(header_length)
            except ValueError:
                raise InvalidArgument("Inference-Header-Content-Length must be an integer") from None
        return rest.decode(self.service, model, version, body, length, peer)

    def encode(self, decoded: rest.RestInfer, outputs: dict[str, np.ndarray], peer: Peer) -> Answer:
        """The answer to a decoded request: JSON, or JSON then binary tensors (its length in a header)."""
        response, json_length = rest.encode(self.service, decoded, outputs, peer)
        if json_length is None:
            return 200, response, _JSON
        return (
            200,
            response,
            [
                (b"content-type", b"application/octet-stream"),
                (b"inference-header-content-length", str(json_length).encode()),
            ],
        )

    async def _shm(
        self, scope: Scope, receive: Receive, headers: dict[bytes, bytes], match: re.Match[str]
    ) -> Answer:
        kind, region, action = match.group(1), match.group(2) or "", match.group(3)
        if kind == "cuda":  # none is ever registered: its status is empty and unregistering is a no-op
            if action == "status":
                return _json([])
            if action == "unregister":
                return 200, b"", []
            raise Unsupported(NO_CUDA_SHM)
        if action == "status":
            return _json(self.service.shm_status(region, _peer(scope)))
        registry = self.service.registry()
        _expect(scope["method"], "POST", scope["path"])
        request = await self._json_body(receive, headers, scope)
        if action == "unregister":
            registry.unregister(region, _peer(scope))
            return 200, b"", []
        if not region:
            raise InvalidArgument("register needs a region name: /v2/systemsharedmemory/region/NAME/register")
        registry.register(
            region, request.get("key"), request.get("offset", 0), request.get("byte_size"), _peer(scope)
        )
        return 200, b"", []

    async def _json_body(
        self, receive: Receive, headers: dict[bytes, bytes], scope: Scope | None = None
    ) -> dict[str, Any]:
        body = await self._body(receive, headers, scope)
        if len(body) < OFF_LOOP_BYTES:
            return _json_object(body)
        return await asyncio.to_thread(_json_object, body)  # counting and parsing megabytes take a while

    async def _body(self, receive: Receive, headers: dict[bytes, bytes], scope: Scope | None = None) -> bytes:
        """The whole body, refused before it is read when its declared length is over the limit.

        A compressed body is inflated no further than the room its user has left in the body budget
        (when ``scope`` carries it), and the inflated bytes are counted there until the response is sent.
        """
        limit = self.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                raise MalformedMessage("Content-Length must be a non-negative integer")
            if int(declared) > limit:
                raise MessageTooLarge(  # Triton's text first: its clients and QA match it
                    f"request JSON size of {int(declared)} bytes exceeds the maximum allowed input size of "
                    f"{limit} bytes (the request body; --max-message-bytes sets the limit)"
                )
        kept: list[bytes] | None = scope.get(BODY_KEY) if scope is not None else None
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            if kept:  # our protocol's: the chunks as they came, uvicorn's message carries none
                chunks += kept
                total += sum(map(len, kept))
                kept.clear()
            chunk = message.get("body", b"")
            if chunk:
                chunks.append(chunk)
                total += len(chunk)
            if total > limit:
                raise MessageTooLarge(f"the request body is over this server's limit of {limit} bytes")
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        encoding = headers.get(b"content-encoding", b"identity").lower()
        if encoding in (b"identity", b""):
            return body
        if encoding not in (b"gzip", b"deflate"):
            raise Unsupported(f"Content-Encoding {encoding.decode(errors='replace')!r}; use gzip or deflate")
        budget: BodyBudget | None = scope.get(BUDGET_KEY) if scope is not None else None
        if budget is not None:
            penalty = budget.penalty()
            if penalty is not None:
                raise Unavailable(penalty)
            assert scope is not None
            scope[_INFLATED] = True
        room = limit if budget is None else min(limit, budget.room())
        if len(body) < OFF_LOOP_BYTES // 1032:  # inflates to at most ~1 MiB (zlib's ratio is at most 1032)
            plain = _inflate(body, encoding, room)
        else:
            plain = await asyncio.to_thread(_inflate, body, encoding, room)
        if plain is None:
            if room < limit:
                raise Unavailable(
                    f"the inflated request body is over the {room} bytes left in this user's body budget "
                    "(--max-client-body-bytes, --max-body-bytes-in-flight)"
                )
            raise MessageTooLarge(f"the inflated request body is over this server's limit of {limit} bytes")
        if budget is not None:
            refusal = budget.reserve(len(plain))
            if refusal is not None:
                raise Unavailable(refusal)
        return plain


def _json_object(body: bytes) -> dict[str, Any]:
    """A control request's JSON body ({} when empty), its objects counted before it is parsed."""
    if not body.strip():
        return {}
    return codec.json_object(body, shapes=False)


def _inflate(body: bytes, encoding: bytes, limit: int) -> bytes | None:
    """Gzip and zlib streams alike (wbits 47: detect), inflated no further than ``limit`` (None: past it)."""
    inflater = zlib.decompressobj(47 if encoding == b"gzip" else 15)
    try:
        plain = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise MalformedMessage(f"the {encoding.decode()} body cannot be inflated: {exc}") from None
    if len(plain) > limit or inflater.unconsumed_tail:
        return None
    return plain


def _json(value: Any) -> Answer:
    return 200, json.dumps(value, separators=(",", ":")).encode(), _JSON


def _expect(method: str, wanted: str, path: str) -> None:
    if method != wanted:
        raise _MethodNotAllowed(f"{path} takes {wanted}, not {method}")


class _MethodNotAllowed(EdgeServerError):
    code = "METHOD_NOT_ALLOWED"
    http_status = 405


class _RouteNotFound(EdgeServerError):
    code = "NOT_FOUND"
    http_status = 404


def _not_found(path: str) -> EdgeServerError:
    return _RouteNotFound(f"no such endpoint: {path}")


def _peer(scope: Scope) -> Peer:
    """The connection's :class:`Peer`, one per connection, so that its uid is looked up once.

    The kernel's answer for a socket holds for the connection's life (sock_diag costs 30-40 us a
    request on the 2-core VM); ``client`` is the socket's own address (uvicorn's proxy headers are off).
    """
    cached: list[Peer] | None = scope.get(PEER_KEY)
    if cached:
        return cached[0]
    client = scope.get("client") or ("", 0)
    server = scope.get("server") or ("", 0)
    peer = Peer(client[0], int(client[1]), int(server[1] or 0), server[0] or "")
    if cached is not None:
        cached.append(peer)
    return peer


def _error_reply(exc: Exception) -> Answer:
    """Any error as its answer: Triton's status and text (error_status), our stable code beside it."""
    status, _code, message = error_status(exc)
    close = [(b"connection", b"close")] if isinstance(exc, (MessageTooLarge, ProtocolError)) else []
    body = json.dumps({"error": message, "code": error_code(exc)}).encode()
    return status, body, _JSON + close


def _compressed(answer: Answer, headers: dict[bytes, bytes]) -> Answer:
    """An inference answer compressed when the request's ``Accept-Encoding`` asks for gzip or deflate."""
    status, body, extra = answer
    encoding = _response_encoding(headers.get(b"accept-encoding", b""))
    if not encoding or not body:
        return status, body, extra
    body = gzip.compress(body, 1, mtime=0) if encoding == b"gzip" else zlib.compress(body, 1)
    return status, body, [*extra, (b"content-encoding", encoding)]


def _response_encoding(accept: bytes) -> bytes:
    accepted = [part.split(b";")[0].strip().lower() for part in accept.split(b",")]
    for encoding in (b"gzip", b"deflate"):
        if encoding in accepted:
            return encoding
    return b""


async def _send(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*headers, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
