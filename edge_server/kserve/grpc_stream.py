"""One ``ModelStreamInfer`` call: requests read on a thread of their own, responses yielded in order.

Many requests are in flight on one stream through ``DataPlane.stream``: an ordinary model's request gets
one response, a decoupled model's request as many as the model sends; each is written as it comes (an
error as ``error_message``, the stream staying open).

A client that sends and never reads would otherwise make the daemon hold every response for it
(400 x 1 MiB pinned +406 MiB, kept after cancel), and queue all its requests ahead of every other client
of the same model (their p99 6x idle).  So:

* at most :data:`RUNNING_PER_STREAM` (or ``max_client_requests``, if fewer) requests of one stream are in
  flight, and a request's slot is given back when its last response has been sent (grpc's sync server
  resumes the response generator only once a send has completed), not when the model produced it: a
  stream that does not read stops being read after that many, and grpc's flow control holds the client;
* each request counts in its user's body budget (``--max-client-body-bytes``, with its HTTP and IPC
  bodies) until its final response, and one past it is answered UNAVAILABLE, the stream going on;
* the bytes of responses produced and not yet sent are counted in the client's uid's share of the
  daemon's reply budget (:class:`~edge_server.reply_budget.ReplyBudget`, with its other streams and
  its IPC connections; a decoupled model can send many responses to one request), and once the uid
  passes ``--max-client-reply-bytes`` the stream (or IPC client) holding the most is cancelled, what
  waited for it dropped, the heap trimmed and the uid penalized, as over IPC.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2

from edge_server.errors import EdgeServerError
from edge_server.kserve import grpc_codec
from edge_server.kserve.grpc_wire import WireRequest
from edge_server.kserve.service import KServeService, OutputWant, error_status
from edge_server.kserve.shm import Peer
from edge_server.limits import Limits
from edge_server.reply_budget import ReplyHolder
from edge_server.request import InferRequest, ResponseSink

if TYPE_CHECKING:
    from edge_server.kserve.grpc_frontend import GrpcFrontend

log = logging.getLogger(__name__)

#: An item of the response queue: (response or None, its bytes, whether it ends a request)
Item = tuple[Any, int, bool]
EMPTY_FINAL = "triton_enable_empty_final_response"  # Triton's request parameter
FINAL_FLAG = "triton_final_response"  # and the response parameter it enables
#: Triton's stream mode: with this header set to "true", a request's error ends the whole stream
GRPC_ERROR_HEADER = "triton_grpc_error"
#: A stream's requests in flight at once: enough to keep a model's batches full, few enough that one
#: stream's backlog never stands long ahead of other clients of the same model.
RUNNING_PER_STREAM = 16


@dataclass(frozen=True)
class StreamError:
    """An error that ends the stream with its gRPC status (``triton_grpc_error`` mode), queued in order."""

    code: str  # a grpc.StatusCode name
    message: str

    def ByteSize(self) -> int:  # noqa: N802 - counted like a response
        return len(self.message)


class StreamCall(ReplyHolder):
    """The response queue of one stream, with its slots; its unsent bytes count in its uid's reply budget."""

    def __init__(self, context: Any, limits: Limits, uid: int | None) -> None:
        super().__init__(uid)
        self._context = context
        self._limits = limits
        self._budget = limits.replies
        self._queue: queue.SimpleQueue[Item | None] = queue.SimpleQueue()
        self._slots = threading.BoundedSemaphore(min(limits.max_client_requests, RUNNING_PER_STREAM))
        self._ended = False
        self._closed = False
        self._lock = threading.Lock()
        self.cut_off = False

    def acquire(self) -> bool:
        """Wait for a free slot before starting the next request (the reader thread's back-pressure).

        False: the call ended or was cut off meanwhile.
        """
        while not self._slots.acquire(timeout=0.5):
            if self._ended or self.cut_off:
                return False
        return not self.cut_off

    def put(self, response: Any, *, ends_request: bool, held: int | None = None) -> None:
        """Queue ``response`` (None: nothing to send, only the request's end); counts its bytes.

        ``held``: the bytes :meth:`hold` counted for it already (its slot is free already).
        """
        nbytes = held if held is not None else response.ByteSize() if response is not None else 0
        with self._lock:
            if self.cut_off or self._closed:
                if ends_request:
                    self._slots.release()
                return
            over = False
            if held is None:
                over = self._budget.add(self, nbytes)
        self._queue.put((response, nbytes, ends_request))
        if over:  # its user holds too much: whoever holds the most (this stream or another) stops
            self._budget.enforce(self.uid)

    def hold(self, response: Any) -> int | None:
        """Count ``response``, held back for the stream's order, and free its request's slot.

        Its request is done: the slot goes back now, so that a stream whose earlier request waits
        (a sequence waiting for a place, say) is still read; the bytes count in the reply budget as
        queued ones do.  Returns the bytes counted (for :meth:`put`), None when the stream is over.
        """
        nbytes = response.ByteSize() if response is not None else 0
        with self._lock:
            if self.cut_off or self._closed:
                self._slots.release()
                return None
            over = self._budget.add(self, nbytes)
        self._slots.release()
        if over:
            self._budget.enforce(self.uid)
        return nbytes

    def end(self) -> None:
        """No more responses: the reader is done and every request answered, or the call ended."""
        self._ended = True
        self._queue.put(None)

    def close(self) -> None:
        """The call is over: what it still held is dropped with it, and counts no more."""
        with self._lock:
            self._closed = True
            self._budget.leave(self)

    def responses(self) -> Iterator[Any]:
        """The responses to yield to grpc, in order; a slot is freed once a request's last one is sent."""
        while (item := self._queue.get()) is not None:
            response, nbytes, ends_request = item
            if self.cut_off:
                break
            if isinstance(response, StreamError):  # raises: the call ends with this status
                self._context.abort(grpc.StatusCode[response.code], response.message)
            if response is not None:
                yield response  # resumes once grpc has sent it
            with self._lock:
                if self.cut_off:
                    break
                self._budget.sent(self, nbytes)
            if ends_request:
                self._slots.release()
        if self.cut_off:  # the cut's own cancel may not have run yet: never end as if all was answered
            self._context.cancel()

    def over_budget(self, why: str) -> None:
        """Its user holds too many unsent replies and this stream the most: cancel it, drop its queue."""
        with self._lock:
            if self.cut_off:
                return
            self.cut_off = True
        log.warning(
            "gRPC stream from %s is not reading its responses: %d bytes wait for it, its uid is over "
            "--max-client-reply-bytes (%d); cancelling it",
            self._context.peer(),
            self.unsent,
            self._budget.max_bytes,
        )
        self._budget.leave(self)
        self._limits.stream_cut_off(self.uid, why)
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
        self._queue.put(None)  # the trims stream_cut_off asked for give the dropped memory back
        log.debug("dropped %d responses of a cut-off stream", dropped)


class InOrder:
    """A stream's answers to ordinary (not decoupled) models, written in the order the requests came.

    Triton's stream handler does so (L0_sequence_batcher's ordering test relies on it): a request
    takes its place when it is read, and its one answer waits for the answers before it.  A decoupled
    model's responses are written as they come, as in Triton.
    """

    def __init__(self, call: StreamCall) -> None:
        self._call = call
        self._lock = threading.Lock()
        self._places = itertools.count()
        self._next = 0
        self._waiting: dict[int, tuple[Any, int]] = {}  # place -> (answer, its bytes)

    def place(self) -> int:
        """The next place; the stream's reader takes them, one request after the other."""
        return next(self._places)

    def put(self, place: int, response: Any) -> None:
        """The answer of the request at ``place``; it goes to the stream once the earlier ones have."""
        with self._lock:  # call.put and call.hold only queue and count: nothing calls back in here
            if place != self._next:
                held = self._call.hold(response)
                if held is not None:
                    self._waiting[place] = (response, held)
                return
            self._call.put(response, ends_request=True)
            self._next += 1
            while (waiting := self._waiting.pop(self._next, None)) is not None:
                self._call.put(waiting[0], ends_request=False, held=waiting[1])
                self._next += 1


def wire_bytes(wire: WireRequest) -> int:
    """The bytes a received request holds: its message, and its raw tensors where kept apart."""
    return wire.message.ByteSize() + (sum(len(view) for view in wire.raw) if wire.raw else 0)


def _grpc_error_mode(context: Any) -> bool:
    """Triton's ``triton_grpc_error: true`` stream header: an error ends the stream with its status."""
    return any(k == GRPC_ERROR_HEADER and v == "true" for k, v in context.invocation_metadata() or ())


def _stream_error(request: Any, exc: BaseException, ends_stream: bool = False) -> Any:
    _http, code, message = error_status(exc)
    if ends_stream:
        return StreamError(code, message)
    return service_pb2.ModelStreamInferResponse(
        error_message=message,
        infer_response=service_pb2.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id
        ),
    )


class StreamSink(ResponseSink):
    """One streamed request's responses, encoded on the model's thread and queued for the stream.

    Every response carries ``triton_final_response`` (as Triton's do); with Triton's
    ``triton_enable_empty_final_response`` request parameter a final without outputs is sent as an
    empty response too, so that the client knows when a decoupled request is complete.
    """

    def __init__(
        self,
        service: KServeService,
        call: StreamCall,
        request: InferRequest,
        wants: list[OutputWant] | None,
        peer: Peer,
        empty_final: bool,
        finished: Callable[[StreamSink], None],
        ends_stream: bool = False,
        in_order: tuple[InOrder, int] | None = None,
    ) -> None:
        super().__init__()
        self._in_order = in_order  # an ordinary model's answer: (the stream's order, its place)
        self._service = service
        self._call = call
        self._request = request
        self._wants = wants
        self._peer = peer
        self._empty_final = empty_final
        self._finished = finished
        self._ends_stream = ends_stream  # triton_grpc_error mode: an error ends the whole stream

    def deliver(
        self, outputs: dict[str, np.ndarray] | None, error: EdgeServerError | None, final: bool
    ) -> None:
        request = self._request
        response: Any = None
        try:
            if error is not None:
                raise error
            if outputs is not None:
                response = grpc_codec.encode(self._service, request, self._wants, outputs, self._peer)
            elif self._empty_final and final:
                response = service_pb2.ModelInferResponse(model_name=request.model, id=request.request_id)
            if response is not None:
                response.parameters[FINAL_FLAG].bool_param = final  # on every streamed one, as Triton
                response = service_pb2.ModelStreamInferResponse(infer_response=response)
        except Exception as exc:  # noqa: BLE001 - one response's error is sent; the stream goes on
            _http, code, message = error_status(exc)
            if self._ends_stream:
                self._send(StreamError(code, message), final)
                if final:
                    self._finished(self)
                return
            response = service_pb2.ModelInferResponse(model_name=request.model, id=request.request_id)
            response.parameters[FINAL_FLAG].bool_param = final
            response = service_pb2.ModelStreamInferResponse(error_message=message, infer_response=response)
        # A final without a response still ends the request: its slot is freed when that is taken.
        if response is not None or final:
            self._send(response, final)
        if final:
            self._finished(self)

    def _send(self, response: Any, final: bool) -> None:
        if self._in_order is not None and final:  # an ordinary model's one answer
            self._in_order[0].put(self._in_order[1], response)
        else:
            self._call.put(response, ends_request=final)


def _decoupled(service: KServeService, request: InferRequest) -> bool:
    """Whether ``request``'s model is decoupled; False where it is not known (its error keeps its place)."""
    try:
        return service.dataplane.config(request.model, request.version).decoupled
    except EdgeServerError:
        return False


def serve_stream(
    service: KServeService, frontend: GrpcFrontend, requests: Iterator[WireRequest], context: Any, peer: Peer
) -> Iterator[Any]:
    """One ``ModelStreamInfer`` call: requests read on a thread of their own, responses yielded in order."""
    call = StreamCall(context, frontend.limits, peer.uid)
    in_order = InOrder(call)
    lock = threading.Lock()
    open_sinks: set[StreamSink] = set()
    reading = [True]
    ends_stream = _grpc_error_mode(context)

    def finished(sink: StreamSink) -> None:
        with lock:
            open_sinks.discard(sink)
            done = not reading[0] and not open_sinks
        if done:
            call.end()

    def start(wire: WireRequest) -> None:
        request = wire.message
        place: int | None = None
        try:
            # counted in the user's body budget (with its HTTP and IPC bodies) until its final response
            body = frontend.limits.hold(peer.uid, wire_bytes(wire))
            try:
                infer, wants = grpc_codec.decode(service, request, peer, wire.raw)
                if not _decoupled(service, infer):
                    place = in_order.place()
                empty_final = infer.parameters.get(EMPTY_FINAL, False) is True
                sink = StreamSink(
                    service,
                    call,
                    infer,
                    wants,
                    peer,
                    empty_final,
                    finished,
                    ends_stream,
                    None if place is None else (in_order, place),
                )
                sink.on_final = body.release
                with lock:
                    open_sinks.add(sink)
                try:
                    service.dataplane.stream(infer, sink)
                except BaseException:
                    with lock:
                        open_sinks.discard(sink)
                    raise
            except BaseException:
                body.release()
                raise
        except Exception as exc:  # noqa: BLE001 - the error goes to the client; the stream stays open
            error = _stream_error(request, exc, ends_stream)
            in_order.put(in_order.place() if place is None else place, error)

    def read() -> None:
        try:
            for request in requests:
                if not call.acquire():
                    break
                start(request)
        except Exception as exc:  # noqa: BLE001 - the client went away or broke the stream
            log.debug("stream reader stopped: %s", exc)
        finally:
            with lock:
                reading[0] = False
                done = not open_sinks
            if done:
                call.end()

    context.add_callback(call.end)  # the call ended (cancelled, deadline)
    reader = threading.Thread(target=read, name="edge-grpc-stream", daemon=True)
    reader.start()
    frontend.stream_opened(+1)
    try:
        yield from call.responses()
    finally:
        call.close()
        frontend.stream_opened(-1)
        with lock:
            left = list(open_sinks)
        for sink in left:
            sink.cancel()
