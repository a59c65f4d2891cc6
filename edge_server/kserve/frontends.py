"""The daemon's KServe frontends as one unit: their flags (Triton's names), options, start and stop.

uvicorn and grpcio are imported only when their frontend starts, so ``--allow-grpc false`` works where
grpcio is not installed.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from edge_server.authorization import ControlPolicy
from edge_server.flag_types import boolean
from edge_server.kserve import grpc_env
from edge_server.kserve.probes import GrpcProbe, LoopProbe, loopback
from edge_server.kserve.service import KServeService
from edge_server.kserve.settings import RuntimeSettings
from edge_server.kserve.shm import SystemSharedMemory
from edge_server.limits import Limits

if TYPE_CHECKING:
    from edge_server.server import Server

log = logging.getLogger(__name__)

GRPC_ACCEPT_ENV = "EDGE_SERVER_GRPC_ACCEPT"


@dataclass(frozen=True)
class KServeOptions:
    allow_http: bool = True
    http_address: str = "127.0.0.1"
    http_port: int = 8000
    allow_grpc: bool | None = None  # None: on when the grpc extra is installed
    grpc_address: str = "127.0.0.1"
    grpc_port: int = 8001
    allow_client_shm: bool = False
    log_verbose: int | None = None  # --log-verbose and --log-format, as /v2/logging reports them
    log_format: str = "default"
    #: the daemon accepts gRPC's connections and hands them to grpc (edge_server.kserve.grpc_accept);
    #: EDGE_SERVER_GRPC_ACCEPT=grpc lets grpc accept by itself, should it ever misserve handed ones
    grpc_own_accept: bool = True


def add_kserve_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KServe v2 (HTTP and gRPC)")
    group.add_argument(
        "--allow-http", type=boolean, default=True, metavar="BOOL", help="serve HTTP (default true)"
    )
    group.add_argument("--http-address", default="127.0.0.1", help="default 127.0.0.1 (loopback only)")
    group.add_argument("--http-port", type=int, default=8000)
    group.add_argument(
        "--allow-grpc",
        type=boolean,
        default=None,
        metavar="BOOL",
        help="serve gRPC (default: true where the grpc extra is installed; true makes it required)",
    )
    group.add_argument("--grpc-address", default="127.0.0.1", help="default 127.0.0.1 (loopback only)")
    group.add_argument("--grpc-port", type=int, default=8001)
    group.add_argument(
        "--allow-client-shm",
        type=boolean,
        default=False,
        metavar="BOOL",
        help="let HTTP/gRPC clients on this host use system shared memory (default false)",
    )


def kserve_options(args: Any) -> KServeOptions:
    return KServeOptions(
        allow_http=args.allow_http,
        http_address=args.http_address,
        http_port=args.http_port,
        allow_grpc=args.allow_grpc,
        grpc_address=args.grpc_address,
        grpc_port=args.grpc_port,
        allow_client_shm=args.allow_client_shm,
        log_verbose=getattr(args, "log_verbose", None),
        log_format=getattr(args, "log_format", "default"),
        grpc_own_accept=os.environ.get(GRPC_ACCEPT_ENV, "daemon") != "grpc",
    )


class KServeFrontends:
    """The HTTP and gRPC frontends that ``options`` enable, over one :class:`KServeService`."""

    def __init__(
        self,
        server: Server,
        options: KServeOptions,
        *,
        max_message_bytes: int,
        control_policy: ControlPolicy | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.options = options
        self.limits = limits or Limits()
        self.max_message_bytes = max_message_bytes
        shm = SystemSharedMemory(max_input_bytes=max_message_bytes) if options.allow_client_shm else None
        self.service = KServeService(
            server,
            shm=shm,
            control_policy=control_policy,
            settings=RuntimeSettings(log_verbose=options.log_verbose, log_format=options.log_format),
        )
        self.http: Any = None
        self.grpc: Any = None
        self._probes: list[tuple[str, LoopProbe | GrpcProbe]] = []

    def probes(self) -> list[tuple[str, LoopProbe | GrpcProbe]]:
        """The watchdog's liveness probe of each started frontend (see :mod:`edge_server.kserve.probes`)."""
        return list(self._probes)

    def start(self) -> None:
        options = self.options
        if options.allow_http:
            from edge_server.kserve.http_frontend import HttpFrontend

            self.http = HttpFrontend(
                self.service,
                host=options.http_address,
                port=options.http_port,
                max_body_bytes=self.max_message_bytes,
                limits=self.limits,
            )
            self.http.start()
            self._probes.append(("HTTP frontend", LoopProbe(self.http.call_soon)))
        if options.allow_grpc is not False:
            grpc_env.poll_connections_on_the_queue()
            try:
                from edge_server.kserve.grpc_frontend import GrpcFrontend
            except ImportError as exc:
                if options.allow_grpc:
                    raise
                log.warning("gRPC frontend off: %s (install edge-server[grpc])", exc)
                return

            self.grpc = GrpcFrontend(
                self.service,
                host=options.grpc_address,
                port=options.grpc_port,
                max_message_bytes=self.max_message_bytes,
                limits=self.limits,
                own_accept=options.grpc_own_accept,
            )
            self.grpc.start()
            host = loopback(self.grpc.host)
            target = f"[{host}]:{self.grpc.port}" if ":" in host else f"{host}:{self.grpc.port}"
            self._probes.append(("gRPC frontend", GrpcProbe(target, self.grpc.saturated)))

    def refuse_new(self) -> None:
        """Stop taking connections and calls; what is in flight goes on (the daemon's stop, step one)."""
        for frontend in (self.http, self.grpc):
            if frontend is not None:
                frontend.refuse_new()

    def close(self) -> None:
        """Wait (up to the drain timeout) for what is in flight to be answered, then stop."""
        for frontend in (self.http, self.grpc):
            if frontend is not None:
                frontend.close()
        self.http = self.grpc = None
        for _, probe in self._probes:
            if isinstance(probe, GrpcProbe):
                probe.close()
        self._probes = []
