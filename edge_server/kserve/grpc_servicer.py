"""The RPCs of Triton's ``GRPCInferenceService``, each a thin translation to the KServe service.

The service definition is Triton's own, as the generated modules of the maintained ``tritonclient``
package (``tritonclient.grpc.service_pb2``); nothing of the protocol is written here.  Errors become gRPC
status codes through the same mapping as HTTP's (:func:`~edge_server.kserve.service.error_status`).
A unary call holds one of the server's worker threads until its answer; a stream holds one worker and
a reader thread (edge_server.kserve.grpc_stream).  ``ModelInfer`` is not here: grpcio's polling thread
answers it (edge_server.kserve.grpc_infer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from edge_server.errors import EdgeServerError, TooManyRequests, Unsupported
from edge_server.kserve import grpc_codec
from edge_server.kserve.grpc_infer import peer_from
from edge_server.kserve.grpc_stream import serve_stream
from edge_server.kserve.grpc_wire import WireRequest
from edge_server.kserve.service import NO_CUDA_SHM, KServeService, error_status
from edge_server.kserve.shm import Peer, peer_uid

if TYPE_CHECKING:
    from edge_server.kserve.grpc_frontend import GrpcFrontend

T = TypeVar("T")


def peer_of(context: grpc.ServicerContext, server_port: int) -> Peer:
    """The client's address, as grpc tells it."""
    return peer_from(context.peer() or "", server_port)


class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Every RPC of Triton's service as a thin translation to :class:`KServeService`."""

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
            answer = self.service.model_ready(request.name, request.version)
            ready = answer.result() if answer.done() else self.frontend.await_readiness(answer)
            return service_pb2.ModelReadyResponse(ready=ready)

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
            self.service.authorize_control(peer_of(context, self.frontend.port), "load")
            self.service.load(request.model_name, grpc_codec.parameters(request.parameters))
            return service_pb2.RepositoryModelLoadResponse()

        return self._call(context, work)

    def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        def work() -> Any:
            self.service.authorize_control(peer_of(context, self.frontend.port), "unload")
            self.service.unload(request.model_name, grpc_codec.parameters(request.parameters))
            return service_pb2.RepositoryModelUnloadResponse()

        return self._call(context, work)

    def ModelStreamInfer(self, request_iterator: Iterator[WireRequest], context: Any) -> Iterator[Any]:
        peer = peer_of(context, self.frontend.port)
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
            yield from serve_stream(self.service, self.frontend, request_iterator, context, peer)
        finally:
            self.frontend.give_worker()
            limits.close_stream(peer.uid)

    # -- system shared memory ---------------------------------------------------------------------

    def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        def work() -> Any:
            response = service_pb2.SystemSharedMemoryStatusResponse()
            peer = peer_of(context, self.frontend.port)
            for region in self.service.shm_status(request.name, peer):
                response.regions[region["name"]].CopyFrom(
                    service_pb2.SystemSharedMemoryStatusResponse.RegionStatus(**region)
                )
            return response

        return self._call(context, work)

    def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        def work() -> Any:
            peer = peer_of(context, self.frontend.port)
            self.service.registry().register(
                request.name, request.key, request.offset, request.byte_size, peer
            )
            return service_pb2.SystemSharedMemoryRegisterResponse()

        return self._call(context, work)

    def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        def work() -> Any:
            self.service.registry().unregister(request.name, peer_of(context, self.frontend.port))
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
                self.service.authorize_control(peer_of(context, self.frontend.port), "LogSettings")
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
                self.service.authorize_control(peer_of(context, self.frontend.port), "TraceSetting")
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
