"""The KServe v2 gRPC frontend: Triton's ``GRPCInferenceService`` on grpcio's threaded server.

The service definition is Triton's own, as the generated modules of the maintained ``tritonclient``
package (``tritonclient.grpc.service_pb2``/``service_pb2_grpc``); nothing of the protocol is written
here.  Every RPC is a thin translation to :class:`~edge_server.kserve.service.KServeService`; errors
become gRPC status codes through the same mapping as HTTP's
(:func:`~edge_server.kserve.service.error_status`).

``ModelStreamInfer`` keeps many requests in flight on one stream through ``DataPlane.stream``: an
ordinary model's request gets one response, a decoupled model's request as many as the model sends;
each is written as it comes (an error as ``error_message``, the stream staying open).

Why the threaded server and not grpc.aio: a unary call costs about 100 us less (235 against 335 us
for ``ServerLive`` from tritonclient on the 2-core VM), and the data plane is synchronous anyway.
A unary call holds a worker thread until its answer; a stream holds one worker and a reader thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from edge_server.errors import AddressInUse, EdgeServerError, TooManyRequests, Unsupported
from edge_server.kserve import grpc_codec
from edge_server.kserve.grpc_stream import GRPC_ERROR_HEADER, StreamCall, StreamError
from edge_server.kserve.grpc_wire import WireRequest, parse_infer_request
from edge_server.kserve.service import NO_CUDA_SHM, KServeService, OutputWant, error_status
from edge_server.kserve.shm import Peer, peer_uid
from edge_server.limits import Limits
from edge_server.request import InferRequest, ResponseSink

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_WORKERS = 128  # calls served at once (an open stream counts as one); more wait in grpc's queue
#: Workers inference (ModelInfer, open streams) may never take: health, metadata and control calls
#: always find one, so that they never queue behind inference.
RESERVED_WORKERS = 8
#: Connections the gRPC server may hold, set aside from the daemon's budget (grpcio accepts by itself).
GRPC_CONNECTIONS = 512
EMPTY_FINAL = "triton_enable_empty_final_response"  # Triton's request parameter
FINAL_FLAG = "triton_final_response"  # and the response parameter it enables


def _peer(context: grpc.ServicerContext, server_port: int) -> Peer:
    """The client's address from ``context.peer()`` (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``)."""
    text = context.peer() or ""
    kind, _, rest = text.partition(":")
    host, _, port = rest.rpartition(":")
    if kind not in ("ipv4", "ipv6") or not port.isdigit():
        return Peer("", 0, server_port)
    # grpc does not tell the local address; on one host the client's own address is the one it reached.
    return Peer(host.strip("[]"), int(port), server_port, "")


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


class _StreamSink(ResponseSink):
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
        finished: Callable[[_StreamSink], None],
        ends_stream: bool = False,
    ) -> None:
        super().__init__()
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
                self._call.put(StreamError(code, message), ends_request=final)
                if final:
                    self._finished(self)
                return
            response = service_pb2.ModelInferResponse(model_name=request.model, id=request.request_id)
            response.parameters[FINAL_FLAG].bool_param = final
            response = service_pb2.ModelStreamInferResponse(error_message=message, infer_response=response)
        # A final without a response still ends the request: its slot is freed when that is taken.
        if response is not None or final:
            self._call.put(response, ends_request=final)
        if final:
            self._finished(self)


class _Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, service: KServeService, frontend: GrpcFrontend) -> None:
        self.service = service
        self.frontend = frontend

    def _call(self, context: grpc.ServicerContext, work: Callable[[], T]) -> T:
        try:
            return work()
        except Exception as exc:  # noqa: BLE001 - every error becomes a status; the server never dies
            _http, code, message = error_status(exc)
            context.abort(grpc.StatusCode[code], message)
            raise  # abort raises; this line is for the type checker

    def ServerLive(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerLiveResponse(live=self.service.live())

    def ServerReady(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerReadyResponse(ready=self.service.ready())

    def ModelReady(self, request: Any, context: Any) -> Any:
        def work() -> Any:
            return service_pb2.ModelReadyResponse(
                ready=self.service.model_ready(request.name, request.version)
            )

        return self._call(context, work)

    def ServerMetadata(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerMetadataResponse(**self.service.server_metadata())

    def ModelMetadata(self, request: Any, context: Any) -> Any:
        def work() -> Any:
            meta = self.service.model_metadata(request.name, request.version)
            response = service_pb2.ModelMetadataResponse(
                name=meta["name"], versions=meta["versions"], platform=meta["platform"]
            )
            for field in ("inputs", "outputs"):
                for tensor in meta[field]:
                    getattr(response, field).add(**tensor)
            return response

        return self._call(context, work)

    def ModelConfig(self, request: Any, context: Any) -> Any:
        def work() -> Any:
            config = self.service.model_config(request.name, request.version)
            return service_pb2.ModelConfigResponse(config=grpc_codec.model_config(config))

        return self._call(context, work)

    def ModelStatistics(self, request: Any, context: Any) -> Any:
        def work() -> Any:
            return grpc_codec.statistics(self.service.statistics(request.name, request.version))

        return self._call(context, work)

    def RepositoryIndex(self, request: Any, context: Any) -> Any:
        def work() -> Any:
            response = service_pb2.RepositoryIndexResponse()
            for row in self.service.repository_index(request.ready):
                response.models.add(**row)
            return response

        return self._call(context, work)

    def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        def work() -> Any:
            self.service.authorize_control(_peer(context, self.frontend.port), "load")
            self.service.load(request.model_name, grpc_codec.parameters(request.parameters))
            return service_pb2.RepositoryModelLoadResponse()

        return self._call(context, work)

    def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        def work() -> Any:
            self.service.authorize_control(_peer(context, self.frontend.port), "unload")
            self.service.unload(request.model_name, grpc_codec.parameters(request.parameters))
            return service_pb2.RepositoryModelUnloadResponse()

        return self._call(context, work)

    def ModelInfer(self, request: WireRequest, context: Any) -> Any:
        return self._call(context, lambda: self._infer_counted(request, context))

    def _infer_counted(self, request: WireRequest, context: Any) -> Any:
        self.frontend.take_worker()
        try:
            return self._infer(request, context)
        finally:
            self.frontend.give_worker()

    def _infer(self, request: WireRequest, context: Any) -> Any:
        peer = _peer(context, self.frontend.port)
        infer, wants = grpc_codec.decode(self.service, request.message, peer, request.raw)
        outputs = self.service.infer_blocking(infer)
        return grpc_codec.encode(self.service, infer, wants, outputs, peer)

    def ModelStreamInfer(self, request_iterator: Iterator[WireRequest], context: Any) -> Iterator[Any]:
        peer = _peer(context, self.frontend.port)
        peer.uid = peer_uid(peer)
        limits = self.frontend.limits
        try:
            refusal = limits.open_stream(peer.uid)
            if refusal is not None:
                raise TooManyRequests(refusal)
            try:
                self.frontend.take_worker()
            except BaseException:
                limits.close_stream(peer.uid)
                raise
        except EdgeServerError as exc:
            _http, code, message = error_status(exc)
            context.abort(grpc.StatusCode[code], message)
        try:
            yield from self._stream(request_iterator, context, peer)
        finally:
            self.frontend.give_worker()
            limits.close_stream(peer.uid)

    def _stream(self, request_iterator: Iterator[WireRequest], context: Any, peer: Peer) -> Iterator[Any]:
        call = StreamCall(context, self.frontend.limits)
        lock = threading.Lock()
        open_sinks: set[_StreamSink] = set()
        reading = [True]
        ends_stream = _grpc_error_mode(context)

        def finished(sink: _StreamSink) -> None:
            with lock:
                open_sinks.discard(sink)
                done = not reading[0] and not open_sinks
            if done:
                call.end()

        def start(wire: WireRequest) -> None:
            request = wire.message
            try:
                infer, wants = grpc_codec.decode(self.service, request, peer, wire.raw)
                empty_final = infer.parameters.get(EMPTY_FINAL, False) is True
                sink = _StreamSink(self.service, call, infer, wants, peer, empty_final, finished, ends_stream)
                with lock:
                    open_sinks.add(sink)
                try:
                    self.service.dataplane.stream(infer, sink)
                except BaseException:
                    with lock:
                        open_sinks.discard(sink)
                    raise
            except Exception as exc:  # noqa: BLE001 - the error goes to the client; the stream stays open
                call.put(_stream_error(request, exc, ends_stream), ends_request=True)

        def read() -> None:
            try:
                for request in request_iterator:
                    call.acquire()
                    if call.cut_off:
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
        self.frontend.stream_opened(+1)
        try:
            yield from call.responses()
        finally:
            self.frontend.stream_opened(-1)
            with lock:
                left = list(open_sinks)
            for sink in left:
                sink.cancel()

    # -- system shared memory ---------------------------------------------------------------------

    def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        def work() -> Any:
            response = service_pb2.SystemSharedMemoryStatusResponse()
            peer = _peer(context, self.frontend.port)
            for region in self.service.shm_status(request.name, peer):
                response.regions[region["name"]].CopyFrom(
                    service_pb2.SystemSharedMemoryStatusResponse.RegionStatus(**region)
                )
            return response

        return self._call(context, work)

    def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        def work() -> Any:
            peer = _peer(context, self.frontend.port)
            self.service.registry().register(
                request.name, request.key, request.offset, request.byte_size, peer
            )
            return service_pb2.SystemSharedMemoryRegisterResponse()

        return self._call(context, work)

    def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        def work() -> Any:
            self.service.registry().unregister(request.name, _peer(context, self.frontend.port))
            return service_pb2.SystemSharedMemoryUnregisterResponse()

        return self._call(context, work)

    def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        def work() -> Any:
            raise Unsupported(NO_CUDA_SHM)

        return self._call(context, work)

    # none is ever registered: its status is empty and unregistering is a no-op (as Triton's with none)
    def CudaSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        return service_pb2.CudaSharedMemoryStatusResponse()

    def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        return service_pb2.CudaSharedMemoryUnregisterResponse()

    # -- settings (edge_server.kserve.settings: the same answers as HTTP's) -----------------------

    def LogSettings(self, request: Any, context: Any) -> Any:
        def work() -> Any:
            changes = {key: _setting_value(value) for key, value in request.settings.items()}
            if request.settings:  # a change (even to the current value) is control; reading is not
                self.service.authorize_control(_peer(context, self.frontend.port), "LogSettings")
            settings = self.service.settings
            current = settings.update_log(changes) if changes else settings.log_settings()
            response = service_pb2.LogSettingsResponse()
            for key, value in current.items():
                entry = response.settings[key]
                if isinstance(value, bool):
                    entry.bool_param = value
                elif isinstance(value, int):
                    entry.uint32_param = value
                else:
                    entry.string_param = str(value)
            return response

        return self._call(context, work)

    def TraceSetting(self, request: Any, context: Any) -> Any:
        def work() -> Any:
            changes = {key: list(value.value) for key, value in request.settings.items()}
            if changes:
                self.service.authorize_control(_peer(context, self.frontend.port), "TraceSetting")
            settings = self.service.settings
            current = settings.update_trace(changes) if changes else settings.trace_settings()
            response = service_pb2.TraceSettingResponse()
            for key, value in current.items():
                response.settings[key].value.extend(value if isinstance(value, list) else [value])
            return response

        return self._call(context, work)


def _setting_value(value: Any) -> Any:
    """A LogSettings value as Python (None where the client sent none: nothing to change)."""
    which = value.WhichOneof("parameter_choice")
    return None if which is None else getattr(value, which)


def server_options(
    max_message_bytes: int, limits: Limits | None = None, connections: int = 0
) -> list[tuple[str, Any]]:
    """The server's options: message bounds, no port sharing; with ``limits``, its connections bounded.

    grpcio accepts on its own threads, so the daemon's budget cannot refuse there: the server gets a
    fixed share of it (``connections``, refused by grpc core at accept), a connection that has not sent
    HTTP/2's preface and settings within the header timeout is closed, and so is one without a call for
    the idle timeout.

    Flow-control and latency options (``grpc.http2.lookahead_bytes`` 16 MiB, ``grpc.http2.bdp_probe``
    off, ``grpc.optimization_target`` latency) changed nothing measurable on a bare grpcio server
    (bench/bench_kserve_floor.py), tiny or 1080p, so grpc's defaults stay.
    """
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    if limits is not None:
        options += [
            ("grpc.max_allowed_incoming_connections", connections),
            ("grpc.server_handshake_timeout_ms", int(limits.header_timeout_s * 1000)),
            ("grpc.max_connection_idle_ms", int(limits.idle_timeout_s * 1000)),
        ]
    return options


class _Handlers:
    """Stands in for the server while the generated code registers the service: keeps the handlers."""

    def __init__(self) -> None:
        self.name = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, name: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.name, self.handlers = name, handlers


def _add_servicer(servicer: _Servicer, server: grpc.Server) -> None:
    """The generated registration, with ``ModelInfer``/``ModelStreamInfer`` requests parsed by grpc_wire."""
    captured = _Handlers()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, captured)
    handlers = dict(captured.handlers)
    handlers["ModelInfer"] = grpc.unary_unary_rpc_method_handler(
        servicer.ModelInfer,
        request_deserializer=parse_infer_request,
        response_serializer=service_pb2.ModelInferResponse.SerializeToString,
    )
    handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
        servicer.ModelStreamInfer,
        request_deserializer=parse_infer_request,
        response_serializer=service_pb2.ModelStreamInferResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(captured.name, handlers),))
    server.add_registered_method_handlers(captured.name, handlers)


class GrpcFrontend:
    """Runs the servicer on grpcio's threaded server; ``port`` 0 picks a free one."""

    def __init__(
        self,
        service: KServeService,
        *,
        host: str = "127.0.0.1",
        port: int = 8001,
        max_message_bytes: int = 64 << 20,
        drain_timeout: float = 5.0,
        max_workers: int = MAX_WORKERS,
        limits: Limits | None = None,
    ) -> None:
        self.service = service
        self.limits = limits or Limits()  # the daemon's; alone, one of the frontend's own
        self._inference = 0  # workers held by ModelInfer calls and open streams
        self._inference_lock = threading.Lock()
        self.host = host
        self.port = port
        self.max_workers = max_workers
        self._streams = 0  # open ModelStreamInfer calls: each holds a worker while the client keeps it
        self._streams_lock = threading.Lock()
        self.max_message_bytes = max_message_bytes
        self.drain_timeout = drain_timeout
        self._server: grpc.Server | None = None
        self._stopped: threading.Event | None = None

    def start(self) -> None:
        """Bind (a failure raises here) and serve."""
        server = grpc.server(
            ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="edge-grpc"),
            options=server_options(
                self.max_message_bytes, self.limits, self.limits.set_aside(GRPC_CONNECTIONS)
            ),
        )
        _add_servicer(_Servicer(self.service, self), server)
        address = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        try:
            port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise AddressInUse(f"the gRPC frontend cannot bind {address}: {exc}") from None
        if port == 0:
            raise AddressInUse(f"the gRPC frontend cannot bind {address}")
        self.port = port
        server.start()
        self._server = server
        log.info("gRPC frontend (KServe v2) listening on %s:%d", self.host, self.port)

    def take_worker(self) -> None:
        """Count a worker for inference, or refuse: :data:`RESERVED_WORKERS` stay for everything else."""
        with self._inference_lock:
            if self._inference >= self.max_workers - min(RESERVED_WORKERS, self.max_workers // 2):
                raise TooManyRequests(
                    f"the gRPC frontend runs {self._inference} inference calls and streams, its limit; "
                    "retry when one ends"
                )
            self._inference += 1

    def give_worker(self) -> None:
        with self._inference_lock:
            self._inference -= 1

    def stream_opened(self, delta: int) -> None:
        with self._streams_lock:
            self._streams += delta

    def saturated(self) -> bool:
        """Whether open streams hold every worker (new calls wait for one to close: full, not wedged)."""
        return self._streams >= self.max_workers

    def refuse_new(self) -> None:
        """Refuse new calls; those in flight have the drain timeout to finish, then are cancelled."""
        if self._server is not None and self._stopped is None:
            self._stopped = self._server.stop(self.drain_timeout)

    def close(self) -> None:
        """Stop taking calls, give open ones the drain timeout, then cancel them."""
        if self._server is None:
            return
        self.refuse_new()
        assert self._stopped is not None
        self._stopped.wait(self.drain_timeout + 5)
        self._server = None
