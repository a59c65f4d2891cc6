"""The KServe v2 gRPC frontend: Triton's ``GRPCInferenceService`` on grpcio's threaded server.

This module runs the server (options, registration, start and stop, the worker accounting).
``ModelInfer`` is answered by grpcio's polling thread itself (edge_server.kserve.grpc_infer); the other
RPCs run on grpcio's workers (edge_server.kserve.grpc_servicer, ``ModelStreamInfer`` in
edge_server.kserve.grpc_stream).  The port's connections are accepted and counted by the daemon
(edge_server.kserve.grpc_accept); where that cannot be, grpc accepts with a total and
edge_server.kserve.grpc_connections keeps the per-user cap.

Why the threaded server and not grpc.aio: a unary call costs less (a bare server answering
``ModelInfer`` with a canned response, called by tritonclient: 377 against 446 us with or without
uvloop, one interleaved run on the 2-core VM), and the data plane is synchronous anyway.  Its workers
are what a tiny ``ModelInfer`` could not afford against Triton's C++ frontend; see grpc_infer.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from edge_server.errors import AddressInUse, TooManyRequests
from edge_server.kserve.grpc_accept import PORT_NAME, ExternalPort, GrpcAcceptor
from edge_server.kserve.grpc_connections import ConnectionCap
from edge_server.kserve.grpc_infer import InferCalls, InferQueue, attach
from edge_server.kserve.grpc_servicer import Servicer
from edge_server.kserve.grpc_wire import parse_infer_request
from edge_server.kserve.probes import loopback
from edge_server.kserve.service import KServeService
from edge_server.limits import Limits

log = logging.getLogger(__name__)

MAX_WORKERS = 128  # calls served at once (an open stream counts as one); more wait in grpc's queue
#: Workers inference (ModelInfer, open streams) may never take: health, metadata and control calls
#: always find one, so that they never queue behind inference.
RESERVED_WORKERS = 8
#: ModelReady calls that may wait (a worker each, up to 5 s) for a model's own ``is_ready()``; more
#: are refused at once, so that probes of a slow or hanging ``is_ready()`` never take the workers that
#: inference and health calls need (HTTP and IPC await the answer without holding a thread).
READINESS_WAITERS = 8
#: Connections the gRPC server may hold, set aside from the daemon's budget (grpcio accepts by itself).
GRPC_CONNECTIONS = 512
#: How long the start waits for grpc to answer on a connection the daemon handed it.
SELF_TEST_S = 10.0


def server_options(
    max_message_bytes: int, limits: Limits | None = None, connections: int = 0
) -> list[tuple[str, Any]]:
    """The server's options: message bounds, no port sharing; with ``limits``, its connections bounded.

    ``connections`` is grpc core's own total (refused at its accept): the whole budget as a backstop when
    the daemon accepts and counts every connection itself, a share set aside from it when grpc accepts.
    A connection that has not sent HTTP/2's preface and settings within the header timeout is closed,
    and so is one without a call for the idle timeout.

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


def _add_servicer(servicer: Servicer, server: grpc.Server, infer: InferCalls | None) -> None:
    """The generated registration, with ``ModelStreamInfer`` requests parsed by grpc_wire.

    ``ModelInfer`` is left to grpcio's polling thread (edge_server.kserve.grpc_infer), or, with
    ``infer``, served by the same work on grpcio's workers, its message and answer as bytes.
    """
    captured = _Handlers()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, captured)
    handlers = dict(captured.handlers)
    del handlers["ModelInfer"]
    if infer is not None:
        handlers["ModelInfer"] = grpc.unary_unary_rpc_method_handler(infer.blocking)
    handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
        servicer.ModelStreamInfer,
        request_deserializer=parse_infer_request,
        response_serializer=service_pb2.ModelStreamInferResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(captured.name, handlers),))
    server.add_registered_method_handlers(captured.name, handlers)


def _answers(host: str, port: int) -> bool:
    """Whether ``ServerLive`` is answered on ``host:port`` (a new connection) within :data:`SELF_TEST_S`."""
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            return bool(stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=SELF_TEST_S).live)
        except grpc.RpcError:
            return False


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
        own_accept: bool = True,
    ) -> None:
        self.service = service
        self.limits = limits or Limits()  # the daemon's; alone, one of the frontend's own
        self._inference = 0  # workers held by ModelInfer calls and open streams
        self._inference_lock = threading.Lock()
        self._readiness_waiters = threading.BoundedSemaphore(READINESS_WAITERS)
        self.host = host
        self.port = port
        self.max_workers = max_workers
        self._streams = 0  # open ModelStreamInfer calls: each holds a worker while the client keeps it
        self._streams_lock = threading.Lock()
        self.max_message_bytes = max_message_bytes
        self.drain_timeout = drain_timeout
        self._server: grpc.Server | None = None
        self._stopped: threading.Event | None = None
        self._cap: ConnectionCap | None = None
        self._acceptor: GrpcAcceptor | None = None
        self._infer_queue: InferQueue | None = None
        #: the daemon accepts the port's connections itself (see edge_server.kserve.grpc_accept)
        self.own_accept = own_accept

    def start(self) -> None:
        """Bind (a failure raises here) and serve."""
        if self.own_accept and self._start_accepting():
            log.info("gRPC frontend (KServe v2) listening on %s:%d", self.host, self.port)
            return
        connections = self.limits.set_aside(GRPC_CONNECTIONS)
        server = self._build(server_options(self.max_message_bytes, self.limits, connections))
        address = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        try:
            port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise AddressInUse(f"the gRPC frontend cannot bind {address}: {exc}") from None
        if port == 0:
            raise AddressInUse(f"the gRPC frontend cannot bind {address}")
        self.port = port
        self._serve(server)
        self._server = server
        # One user may hold at most half of gRPC's connections (and never more than its cap overall).
        self._cap = ConnectionCap(
            port, min(self.limits.max_client_connections, connections // 2), self.limits
        )
        self._cap.start()
        log.info(
            "gRPC frontend (KServe v2) listening on %s:%d (grpc accepts; per-user cap by looking)",
            self.host,
            self.port,
        )

    def _build(self, options: list[tuple[str, Any]]) -> grpc.Server:
        server = grpc.server(
            ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="edge-grpc"),
            options=options,
        )
        calls = InferCalls(self.service, self)
        self._infer_queue = attach(server, calls)
        _add_servicer(Servicer(self.service, self), server, None if self._infer_queue else calls)
        return server

    def _serve(self, server: grpc.Server) -> None:
        server.start()
        if self._infer_queue is not None:
            self._infer_queue.start()

    def _stop(self, server: grpc.Server) -> None:
        """Stop a server that never served (a failed start)."""
        server.stop(None).wait(5)
        if self._infer_queue is not None:
            self._infer_queue.stop()
        self._infer_queue = None

    def _start_accepting(self) -> bool:
        """Serve connections the daemon accepts and counts itself (edge_server.kserve.grpc_accept).

        grpc's own total stays as a backstop at the whole budget.  False (nothing left running) when grpc
        has no such port, its handler is not the one expected, or it does not answer on a connection
        handed to it; a bind failure raises.
        """
        external = ExternalPort()
        options = server_options(self.max_message_bytes, self.limits, self.limits.max_connections)
        server = self._build([*options, external.option])
        try:
            server.add_insecure_port(PORT_NAME)
        except RuntimeError as exc:  # a grpcio without external ports
            log.warning("gRPC: grpc takes no connections from the daemon (%s)", exc)
            self._stop(server)
            return False
        if not external.bind():
            self._stop(server)
            return False
        try:
            acceptor = GrpcAcceptor(self.host, self.port, self.limits, external)
        except OSError as exc:
            self._stop(server)
            raise AddressInUse(f"the gRPC frontend cannot bind {self.host}:{self.port}: {exc}") from None
        self._serve(server)
        acceptor.start()
        if not _answers(loopback(self.host), acceptor.port):
            log.error(
                "gRPC: grpc did not answer on a connection the daemon handed it; grpc accepts by itself "
                "instead (the per-user cap then holds by looking)"
            )
            acceptor.close()
            self._stop(server)
            return False
        self._server, self._acceptor, self.port = server, acceptor, acceptor.port
        return True

    def await_readiness(self, answer: Future[bool]) -> bool:
        """Wait for a model's own readiness answer in one of :data:`READINESS_WAITERS` slots, or refuse."""
        if not self._readiness_waiters.acquire(blocking=False):
            raise TooManyRequests(
                f"{READINESS_WAITERS} model-ready calls already wait for a model's is_ready(); retry later"
            )
        try:
            return answer.result()
        finally:
            self._readiness_waiters.release()

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
        if self._acceptor is not None:  # first: nothing is handed to grpc once it stops
            self._acceptor.close()
        if self._server is not None and self._stopped is None:
            self._stopped = self._server.stop(self.drain_timeout)

    def close(self) -> None:
        """Stop taking calls, give open ones the drain timeout, then cancel them."""
        if self._server is None:
            return
        self.refuse_new()
        assert self._stopped is not None
        self._stopped.wait(self.drain_timeout + 5)
        if self._infer_queue is not None:
            self._infer_queue.stop()
        self._server = self._infer_queue = None  # grpcio's workers end with the server's last reference
        if self._cap is not None:
            self._cap.close()
