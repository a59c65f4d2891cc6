"""The ``edge-server serve`` process: a Server, its frontends, and the signals that drive them.

Signal handlers only record the signal; the main loop acts on it (SIGHUP rescans the repository,
SIGTERM and SIGINT drain and stop), so nothing heavy ever runs inside a handler.
"""

from __future__ import annotations

import logging
import queue
import signal
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from edge_server.errors import EdgeServerError
from edge_server.ipc.protocol import DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_MESSAGE_BYTES
from edge_server.kserve.frontends import KServeFrontends, KServeOptions
from edge_server.lifecycle import ModelState
from edge_server.memory import limit_malloc_arenas
from edge_server.server import ControlMode, Server

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DaemonOptions:
    model_repository: Path | None
    model_control_mode: ControlMode = "none"
    load_models: tuple[str, ...] = ()
    ipc_address: str | None = None  # None: the default address; "" disables the IPC frontend
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    drain_timeout: float = 30.0
    watch_quiet_s: float = 0.5
    engine_build: str = "none"  # "on-load": rebuild stale TensorRT plans while their ONNX serves
    kserve: KServeOptions = KServeOptions()


class Daemon:
    def __init__(self, options: DaemonOptions) -> None:
        self._options = options
        self._signals: queue.SimpleQueue[int] = queue.SimpleQueue()  # put() is safe inside a handler

    def _record(self, signum: int, _frame: FrameType | None) -> None:
        self._signals.put(signum)

    def run(self) -> int:
        options = self._options
        limit_malloc_arenas()  # before any thread starts: see edge_server.memory
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._record)
        server = Server(
            options.model_repository,
            model_control_mode=options.model_control_mode,
            load_models=options.load_models,
            drain_timeout=options.drain_timeout,
            watch_quiet_s=options.watch_quiet_s,
            engine_build=options.engine_build,
        )
        frontend = None
        kserve = KServeFrontends(server, options.kserve, max_message_bytes=options.max_message_bytes)
        try:
            kserve.start()
            if options.ipc_address != "":
                from edge_server.ipc.addresses import default_address
                from edge_server.ipc.frontend import IpcFrontend

                address = options.ipc_address or default_address()
                frontend = IpcFrontend(
                    server,
                    address,
                    max_message_bytes=options.max_message_bytes,
                    max_header_bytes=options.max_header_bytes,
                    drain_timeout=options.drain_timeout,
                )
                frontend.start()
                log.info("serving on %s", address)
            ready = [s for s in server.models() if s.state is ModelState.READY]
            log.info("edge-server ready: %d model version(s) serving from %s", len(ready), server.repository)
            self._loop(server)
        finally:
            log.info("stopping: draining requests")
            if frontend is not None:
                frontend.close()
            kserve.close()
            server.close()
            log.info("stopped")
        return 0

    def _loop(self, server: Server) -> None:
        while True:
            try:
                signum = self._signals.get(timeout=1.0)
            except queue.Empty:
                continue
            if signum == signal.SIGHUP:
                log.info("SIGHUP: rescanning %s", server.repository)
                try:
                    server.rescan()
                except EdgeServerError as exc:
                    log.error("rescan failed: %s", exc.message)
                continue
            log.info("received %s", signal.Signals(signum).name)
            return
