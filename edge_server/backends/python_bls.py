"""BLS calls of an isolated Python model: the model's process asks, the daemon's data plane answers.

The child cannot hold the daemon's :class:`~edge_server.request.ModelAccess` (live objects), so its
models get :class:`PipeModels`, which sends each call over the instance's private pipe:

* ``bls`` (child -> daemon): ``q`` the call's id, ``s`` whether it is streamed, and the request's
  fields (tensors inline, as a decoupled model's responses travel).
* ``blsr`` (daemon -> child): ``q``, then ``o`` outputs or ``e`` ``[code, message]``, and ``f``
  (final) for streamed calls, one message per response.

The daemon treats a ``bls`` message as what it is, a request from model code: every field is checked
(:func:`decode_request`), the request goes through the data plane like any other (validated, batched,
counted), and a malformed one is answered with an error, never trusted.  A call takes the turns of the
client whose request the model works on (``u``: that request's position in the batch the daemon sent
last; the daemon looks its client up, so the child can only name one of that batch's clients).  The
daemon reads these messages while the instance executes, and at any time for decoupled models (their
pipe has a reader thread): a non-decoupled model's own threads that call other models outside
``execute`` wait until its next execution.  Model control (``is_model_ready``, ``load_model``,
``unload_model``) is not forwarded.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from functools import partial
from typing import Any

import numpy as np

from edge_server.backends.python_wire import Channel, pack_inline, unpack_inline
from edge_server.errors import EdgeServerError, InvalidArgument, Unsupported
from edge_server.request import ClientKey, InferRequest, ModelAccess, ResponseSink

log = logging.getLogger(__name__)


def _by_code() -> dict[str, type[EdgeServerError]]:
    found: dict[str, type[EdgeServerError]] = {}
    todo: list[type[EdgeServerError]] = [EdgeServerError]
    while todo:
        cls = todo.pop(0)  # breadth first: the most general class of a code wins
        found.setdefault(cls.code, cls)
        todo += cls.__subclasses__()
    return found


def error_from(entry: Any) -> EdgeServerError:
    """``[code, message]`` back into the error class with that code (the caller may check the code)."""
    code, message = str(entry[0]), str(entry[1])
    return _by_code().get(code, EdgeServerError)(message)


_IN_BATCH = "position in the batch"  # a child's stand-in for a request's client (see position)


def position(index: int) -> ClientKey:
    """In the child: the client of the batch's ``index``-th request, as the daemon will look it up."""
    return (_IN_BATCH, index)


def encode_request(request: InferRequest) -> dict[str, Any]:
    client = request.client
    return {
        "u": client[1] if client is not None and client[0] == _IN_BATCH else None,
        "m": request.model,
        "v": request.version,
        "i": pack_inline(request.inputs.items()),
        "o": None if request.outputs is None else list(request.outputs),
        "pr": request.priority,
        "t": request.timeout_us,
        "id": request.request_id,
        "p": dict(request.parameters),
        "c": request.correlation_id,
        "ss": request.sequence_start,
        "se": request.sequence_end,
    }


def _typed(message: dict[str, Any], key: str, kinds: type | tuple[type, ...], *, none: bool = False) -> Any:
    value = message.get(key)
    if (value is None and none) or (isinstance(value, kinds) and not isinstance(value, bool | None)):
        return value
    if kinds is bool and isinstance(value, bool):
        return value
    raise InvalidArgument(f"BLS call from an isolated model: field {key!r} is malformed")


def decode_request(message: dict[str, Any], clients: Sequence[ClientKey | None] = ()) -> InferRequest:
    """The request a child asked for; raises InvalidArgument for anything malformed.

    ``clients``: those of the batch the daemon sent last, by position; the call takes the turns of the
    one it names (none: an anonymous client's).
    """
    index = _typed(message, "u", int, none=True)
    outputs = _typed(message, "o", list, none=True)
    if outputs is not None and not all(isinstance(o, str) for o in outputs):
        raise InvalidArgument("BLS call from an isolated model: output names must be strings")
    parameters = _typed(message, "p", dict)
    if not all(isinstance(k, str) and isinstance(v, bool | int | str) for k, v in parameters.items()):
        raise InvalidArgument("BLS call from an isolated model: parameters must map strings to bool/int/str")
    try:
        inputs = unpack_inline(_typed(message, "i", list))
    except (TypeError, ValueError, IndexError, KeyError) as exc:
        raise InvalidArgument(f"BLS call from an isolated model: unreadable inputs ({exc})") from None
    return InferRequest(
        model=_typed(message, "m", str),
        version=_typed(message, "v", int, none=True),
        inputs=inputs,
        outputs=outputs,
        priority=_typed(message, "pr", int),
        timeout_us=_typed(message, "t", int, none=True),
        request_id=_typed(message, "id", str),
        parameters=parameters,
        correlation_id=_typed(message, "c", (int, str)),
        sequence_start=_typed(message, "ss", bool),
        sequence_end=_typed(message, "se", bool),
        client=clients[index] if index is not None and 0 <= index < len(clients) else None,
    )


# -- the daemon's side ----------------------------------------------------------------------------


class _ReplySink(ResponseSink):
    """A streamed call's responses, sent back to the child as they come.

    Listed in ``streams`` (the instance's streamed calls by id) until its final response, so that a
    ``blsc`` from the child (its ``ResponseIterator.cancel()``) reaches the called model; what that
    model still sends goes on coming back, as in Triton.
    """

    keeps_reading = True

    def __init__(self, channel: Channel, call: int, streams: dict[int, ResponseSink]) -> None:
        super().__init__()
        self._channel = channel
        self._call = call
        self._streams = streams
        streams[call] = self

    def deliver(
        self, outputs: dict[str, np.ndarray] | None, error: EdgeServerError | None, final: bool
    ) -> None:
        if final:
            self._streams.pop(self._call, None)
        _reply(self._channel, self._call, outputs, error, final)


def _reply(
    channel: Channel,
    call: int,
    outputs: dict[str, np.ndarray] | None,
    error: EdgeServerError | None,
    final: bool,
) -> None:
    message: dict[str, Any] = {"op": "blsr", "q": call, "f": final}
    if error is not None:
        message["e"] = [error.code, error.message]
    elif outputs is not None:
        message["o"] = pack_inline(outputs.items())
    try:
        channel.send(message)
    except (ConnectionError, OSError):
        pass  # the process is gone; its instance reports that


def serve_call(
    message: dict[str, Any],
    access: ModelAccess | None,
    channel: Channel,
    streams: dict[int, ResponseSink],
    clients: Sequence[ClientKey | None] = (),
) -> None:
    """Run one ``bls`` message through ``access``; the answer goes back over ``channel`` when it comes.

    A ``blsc`` message cancels the streamed call it names (``streams``: the instance's open ones).
    ``clients``: those of the batch sent last, by position (see :func:`decode_request`).
    """
    call = message.get("q")
    if not isinstance(call, int):
        log.error("an isolated model sent a BLS call without an id; ignored")
        return
    if message.get("op") == "blsc":
        sink = streams.get(call)
        if sink is not None:
            sink.cancel()
        return
    try:
        if access is None:
            raise Unsupported("this model has no way to other models here")
        request = decode_request(message, clients)
        if message.get("s"):
            sink = _ReplySink(channel, call, streams)
            try:
                access.stream(request, sink)
            except BaseException:
                streams.pop(call, None)
                raise
            return
        future = access.submit(request)
    except EdgeServerError as exc:
        _reply(channel, call, None, exc, True)
        return

    def done(future: Future[dict[str, np.ndarray]]) -> None:
        if future.cancelled():
            _reply(channel, call, None, EdgeServerError("the BLS call was cancelled"), True)
            return
        error = future.exception()
        if error is None:
            _reply(channel, call, future.result(), None, True)
        elif isinstance(error, EdgeServerError):
            _reply(channel, call, None, error, True)
        else:
            _reply(channel, call, None, EdgeServerError(f"internal error: {error!r}"), True)

    future.add_done_callback(done)


# -- the child's side -----------------------------------------------------------------------------


class PipeModels:
    """The :class:`~edge_server.request.ModelAccess` of a model in its own process (see the module doc)."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._lock = threading.Lock()
        self._calls: dict[int, Future[dict[str, np.ndarray]] | ResponseSink] = {}
        self._ids = itertools.count(1)

    def submit(self, request: InferRequest) -> Future[dict[str, np.ndarray]]:
        future: Future[dict[str, np.ndarray]] = Future()
        self._send(request, future, streamed=False)
        return future

    def stream(self, request: InferRequest, sink: ResponseSink) -> None:
        call = self._send(request, sink, streamed=True)
        sink.on_cancel = partial(self._cancel, call)

    def _cancel(self, call: int) -> None:
        """The model cancelled a streamed call (``ResponseIterator.cancel()``): tell the daemon."""
        try:
            self._channel.send({"op": "blsc", "q": call})
        except (ConnectionError, OSError):
            pass  # the daemon is gone; the stub exits

    def _send(
        self, request: InferRequest, target: Future[dict[str, np.ndarray]] | ResponseSink, *, streamed: bool
    ) -> int:
        message = encode_request(request)
        with self._lock:
            call = next(self._ids)
            self._calls[call] = target
        message.update(op="bls", q=call, s=streamed)
        self._channel.send(message)
        return call

    def answer(self, message: dict[str, Any]) -> None:
        """A ``blsr`` message (the child's pipe reader): complete its call or feed its stream."""
        final = bool(message.get("f", True))
        with self._lock:
            target = self._calls.pop(message["q"], None) if final else self._calls.get(message["q"])
        if target is None:
            return
        error = error_from(message["e"]) if message.get("e") else None
        outputs = unpack_inline(message["o"]) if message.get("o") is not None else None
        if isinstance(target, ResponseSink):
            target.put(outputs, error, final=final)
            return
        try:
            if error is not None:
                target.set_exception(error)
            else:
                target.set_result(outputs or {})
        except InvalidStateError:
            pass  # the caller gave up on it (its timeout cancelled the future)

    def fail_all(self, error: EdgeServerError) -> None:
        """The pipe closed: every call still waiting gets ``error``."""
        with self._lock:
            calls, self._calls = self._calls, {}
        for target in calls.values():
            if isinstance(target, ResponseSink):
                target.put(None, error, final=True)
            else:
                try:
                    target.set_exception(error)
                except InvalidStateError:
                    pass

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise Unsupported(
            "model control (is_model_ready, load_model, unload_model) is not available to a model with "
            "isolation 'process'; use isolation 'thread' for that"
        )

    model_config = is_ready = load = unload = _refuse
