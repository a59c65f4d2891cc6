"""The KServe v2 gRPC frontend: Triton's ``GRPCInferenceService`` on grpc.aio, on its own thread and loop.

The service definition is Triton's own, as the generated modules of the maintained ``tritonclient``
package (``tritonclient.grpc.service_pb2``/``service_pb2_grpc``); nothing of the protocol is written
here.  Every RPC is a thin translation to :class:`~edge_server.kserve.service.KServeService`; errors
become gRPC status codes through the same mapping as HTTP's
(:func:`~edge_server.kserve.service.error_status`).

``ModelStreamInfer`` keeps many requests in flight on one stream: each request runs as its own task and
its response (or its error, as ``error_message``, the stream staying open) is written as it completes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from edge_server.errors import EdgeServerError, InvalidArgument, Unsupported
from edge_server.kserve import grpc_codec
from edge_server.kserve.service import KServeService, error_status
from edge_server.kserve.shm import Peer

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_STREAM_IN_FLIGHT = 1024


def _peer(context: grpc.aio.ServicerContext, server_port: int) -> Peer:
    """The client's address from ``context.peer()`` (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``)."""
    text = context.peer() or ""
    kind, _, rest = text.partition(":")
    host, _, port = rest.rpartition(":")
    if kind not in ("ipv4", "ipv6") or not port.isdigit():
        return Peer("", 0, server_port)
    return Peer(host.strip("[]"), int(port), server_port)


class _Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, service: KServeService, frontend: GrpcFrontend) -> None:
        self.service = service
        self.frontend = frontend

    async def _call(self, context: grpc.aio.ServicerContext, work: Callable[[], Awaitable[T]]) -> T:
        try:
            return await work()
        except Exception as exc:  # noqa: BLE001 - every error becomes a status; the server never dies
            _http, code, message = error_status(exc)
            await context.abort(grpc.StatusCode[code], message)
            raise  # abort raises; this line is for the type checker

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerLiveResponse(live=self.service.live())

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerReadyResponse(ready=self.service.ready())

    async def ModelReady(self, request: Any, context: Any) -> Any:
        async def work() -> Any:
            return service_pb2.ModelReadyResponse(
                ready=self.service.model_ready(request.name, request.version)
            )

        return await self._call(context, work)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerMetadataResponse(**self.service.server_metadata())

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        async def work() -> Any:
            meta = self.service.model_metadata(request.name, request.version)
            response = service_pb2.ModelMetadataResponse(
                name=meta["name"], versions=meta["versions"], platform=meta["platform"]
            )
            for field in ("inputs", "outputs"):
                for tensor in meta[field]:
                    getattr(response, field).add(**tensor)
            return response

        return await self._call(context, work)

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        async def work() -> Any:
            config = self.service.model_config(request.name, request.version)
            return service_pb2.ModelConfigResponse(config=grpc_codec.model_config(config))

        return await self._call(context, work)

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        async def work() -> Any:
            return grpc_codec.statistics(self.service.statistics(request.name, request.version))

        return await self._call(context, work)

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        async def work() -> Any:
            response = service_pb2.RepositoryIndexResponse()
            for row in self.service.repository_index(request.ready):
                response.models.add(**row)
            return response

        return await self._call(context, work)

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        async def work() -> Any:
            await self.service.load(request.model_name, grpc_codec.parameters(request.parameters))
            return service_pb2.RepositoryModelLoadResponse()

        return await self._call(context, work)

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        async def work() -> Any:
            await self.service.unload(request.model_name, grpc_codec.parameters(request.parameters))
            return service_pb2.RepositoryModelUnloadResponse()

        return await self._call(context, work)

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        return await self._call(context, lambda: self._infer(request, context))

    async def _infer(self, request: Any, context: Any) -> Any:
        peer = _peer(context, self.frontend.port)
        infer, wants = grpc_codec.decode(self.service, request, peer)
        outputs = await self.service.infer(infer)
        return grpc_codec.encode(self.service, infer, wants, outputs, peer)

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[Any], context: Any
    ) -> AsyncIterator[Any]:
        responses: asyncio.Queue[Any] = asyncio.Queue()
        in_flight = asyncio.Semaphore(MAX_STREAM_IN_FLIGHT)
        tasks: set[asyncio.Task[None]] = set()

        async def one(request: Any) -> None:
            try:
                response = await self._infer(request, context)
                await responses.put(service_pb2.ModelStreamInferResponse(infer_response=response))
            except Exception as exc:  # noqa: BLE001 - the error goes to the client; the stream stays open
                _http, _code, message = error_status(exc)
                await responses.put(
                    service_pb2.ModelStreamInferResponse(
                        error_message=message,
                        infer_response=service_pb2.ModelInferResponse(
                            model_name=request.model_name, model_version=request.model_version, id=request.id
                        ),
                    )
                )
            finally:
                in_flight.release()

        async def read() -> None:
            async for request in request_iterator:
                await in_flight.acquire()
                task = asyncio.ensure_future(one(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*list(tasks))
            await responses.put(None)

        reader = asyncio.ensure_future(read())
        try:
            while (response := await responses.get()) is not None:
                yield response
            await reader
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    # -- system shared memory ---------------------------------------------------------------------

    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        async def work() -> Any:
            response = service_pb2.SystemSharedMemoryStatusResponse()
            for region in self.service.registry().status(request.name):
                response.regions[region["name"]].CopyFrom(
                    service_pb2.SystemSharedMemoryStatusResponse.RegionStatus(**region)
                )
            return response

        return await self._call(context, work)

    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        async def work() -> Any:
            peer = _peer(context, self.frontend.port)
            self.service.registry().register(
                request.name, request.key, request.offset, request.byte_size, peer
            )
            return service_pb2.SystemSharedMemoryRegisterResponse()

        return await self._call(context, work)

    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        async def work() -> Any:
            self.service.registry().unregister(request.name)
            return service_pb2.SystemSharedMemoryUnregisterResponse()

        return await self._call(context, work)

    async def _no_cuda(self, request: Any, context: Any) -> Any:
        async def work() -> Any:
            raise Unsupported("CUDA shared memory is not supported by edge-server; use system shared memory")

        return await self._call(context, work)

    CudaSharedMemoryStatus = _no_cuda
    CudaSharedMemoryRegister = _no_cuda
    CudaSharedMemoryUnregister = _no_cuda

    # -- settings (read-only) ---------------------------------------------------------------------

    async def LogSettings(self, request: Any, context: Any) -> Any:
        async def work() -> Any:
            if request.settings:
                raise InvalidArgument("log settings are read-only on edge-server (use --log-verbose)")
            response = service_pb2.LogSettingsResponse()
            for key in ("log_info", "log_warning", "log_error"):
                response.settings[key].bool_param = True
            response.settings["log_verbose_level"].uint32_param = 0
            response.settings["log_format"].string_param = "default"
            response.settings["log_file"].string_param = ""
            return response

        return await self._call(context, work)

    async def TraceSetting(self, request: Any, context: Any) -> Any:
        async def work() -> Any:
            if request.settings:
                raise InvalidArgument("tracing is not supported by edge-server; trace settings are read-only")
            response = service_pb2.TraceSettingResponse()
            response.settings["trace_level"].value.append("OFF")
            return response

        return await self._call(context, work)


class GrpcFrontend:
    """Runs the servicer on a grpc.aio server in a thread of its own; ``port`` 0 picks a free one."""

    def __init__(
        self,
        service: KServeService,
        *,
        host: str = "127.0.0.1",
        port: int = 8001,
        max_message_bytes: int = 64 << 20,
        drain_timeout: float = 5.0,
    ) -> None:
        self.service = service
        self.host = host
        self.port = port
        self.max_message_bytes = max_message_bytes
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None

    def start(self) -> None:
        """Bind (a failure raises here) and serve; returns once the server accepts calls."""
        started = threading.Event()
        failure: list[BaseException] = []

        async def main() -> None:
            server = grpc.aio.server(
                options=[
                    ("grpc.max_receive_message_length", self.max_message_bytes),
                    ("grpc.max_send_message_length", self.max_message_bytes),
                    ("grpc.so_reuseport", 0),
                ]
            )
            service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(_Servicer(self.service, self), server)
            address = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
            try:
                port = server.add_insecure_port(address)
                if port == 0:
                    raise OSError(f"cannot bind the gRPC frontend to {address}")
                self.port = port
                await server.start()
            except BaseException as exc:
                failure.append(exc)
                started.set()
                return
            self._server = server
            self._stopped = asyncio.Event()
            started.set()
            await self._stopped.wait()
            await server.stop(self.drain_timeout)

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(main())
            except BaseException:  # noqa: BLE001 - logged; the daemon goes on with its other frontends
                log.exception("the gRPC frontend stopped")
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="edge-grpc-frontend", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self._thread.join()
            raise EdgeServerError(f"the gRPC frontend did not start: {failure[0]}")
        log.info("gRPC frontend (KServe v2) listening on %s:%d", self.host, self.port)

    def close(self) -> None:
        """Stop taking calls, give open ones the drain timeout, stop the loop."""
        if self._thread is None:
            return
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(self.drain_timeout + 5)
        self._thread = None
