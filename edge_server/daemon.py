"""The ``edge-server serve`` process: a Server, its frontends, and the signals that drive them.

Signal handlers only record the signal; the main loop acts on it (SIGHUP rescans the repository,
SIGTERM and SIGINT drain and stop), so nothing heavy ever runs inside a handler.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from edge_server.authorization import ControlPolicy, group_id
from edge_server.errors import EdgeServerError
from edge_server.ipc import protocol
from edge_server.ipc.protocol import DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_MESSAGE_BYTES
from edge_server.kserve.frontends import KServeFrontends, KServeOptions
from edge_server.limits import LimitOptions, Limits
from edge_server.memory import DAEMON_TRIM_DELAYS, DeferredTrim, keep_large_buffers, limit_malloc_arenas
from edge_server.metrics.collector import LoadCounter, ServerCollector
from edge_server.scheduler.summaries import SummaryOptions
from edge_server.server import ControlMode, Server
from edge_server.service.notify import Notifier
from edge_server.service.supervisor import Supervisor, unavailable_models
from edge_server.status_index import ModelState

log = logging.getLogger(__name__)

# After the drain deadline, how long the IPC frontend may take to send the last answers.
_FLUSH_S = 1.0


@dataclass(frozen=True)
class DaemonOptions:
    model_repositories: tuple[Path, ...] = ()  # none: the bundled models/
    model_control_mode: ControlMode = "none"
    load_models: tuple[str, ...] = ()
    ipc_address: str | None = None  # None: the default address; "" disables the IPC frontend
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    # IPC limits: replies waiting for a client that does not read; requests in flight for one client and
    # for all together; shared-memory regions one client may register
    max_client_reply_bytes: int = protocol.DEFAULT_MAX_CLIENT_REPLY_BYTES
    max_client_requests: int = protocol.DEFAULT_MAX_CLIENT_REQUESTS
    max_requests: int = protocol.DEFAULT_MAX_REQUESTS
    max_client_regions: int = protocol.DEFAULT_MAX_CLIENT_REGIONS
    limits: LimitOptions = LimitOptions()  # every listener's descriptor and memory budget
    max_frames: int = protocol.MAX_FRAMES  # IPC: frames in one message
    operator_group: str | None = None  # may control (load, unload, settings) as root and the daemon do
    drain_timeout: float = 30.0
    load_timeout: float = 600.0  # a model load running longer is abandoned (a stuck initialize())
    watch_quiet_s: float = 0.5
    strict_readiness: bool = True  # Triton's default: ready only when every model that should load is
    exit_on_error: bool = True  # Triton's default: a model that fails at start-up stops the daemon
    engine_build: str = "none"  # "on-load": rebuild stale TensorRT plans while their ONNX serves
    kserve: KServeOptions = KServeOptions()
    allow_metrics: bool = True
    metrics_address: str = "127.0.0.1"
    metrics_port: int = 8002
    latency_summaries: SummaryOptions | None = None  # --metrics-config summary_latencies=true
    onnxruntime_thread_policy: str = "auto"  # auto: ONNX Runtime's defaults only for a model alone on the box


def startup_failure_status(failed: dict[str, str]) -> str:
    """The ``STATUS=`` line of a daemon that exits because models failed to load at start-up."""
    names = sorted(failed)
    if len(names) == 1:
        return f"failed: model {names[0]} did not load: {failed[names[0]]}"
    reasons = "; ".join(f"{name}: {failed[name]}" for name in names)
    return f"failed: models {', '.join(names)} did not load: {reasons}"


def _log_startup_failure(failed: dict[str, str]) -> None:
    for name, reason in sorted(failed.items()):
        log.error("model %s failed to load: %s", name, reason)
    log.error(
        "exiting: %d model(s) failed to load at start-up (--exit-on-error false serves the rest)",
        len(failed),
    )


class Daemon:
    def __init__(self, options: DaemonOptions) -> None:
        self._options = options
        self._signals: queue.SimpleQueue[int] = queue.SimpleQueue()  # put() is safe inside a handler

    def _record(self, signum: int, _frame: FrameType | None) -> None:
        self._signals.put(signum)

    def run(self) -> int:
        options = self._options
        # One rule for who may control the daemon, asked by every frontend; a group that does not
        # exist fails the start before any model loads.
        control_policy = ControlPolicy(operator_gid=group_id(options.operator_group))
        limit_malloc_arenas()  # before any thread starts: see edge_server.memory
        keep_large_buffers()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._record)
        # NOTIFY_SOCKET stays set: the TensorRT engine rebuilder sends its own EXTEND_TIMEOUT_USEC, and
        # the unit's NotifyAccess=main keeps any child process from speaking for the daemon.
        notifier = Notifier(unset=False)
        supervisor = Supervisor(notifier, strict_readiness=options.strict_readiness)
        supervisor.starting()
        loads = LoadCounter()  # hears every load from the first one on, for the metrics
        heap_trim = DeferredTrim(DAEMON_TRIM_DELAYS)  # one, asked by the data plane and every listener
        server = Server(
            options.model_repositories or None,
            model_control_mode=options.model_control_mode,
            load_models=options.load_models,
            drain_timeout=options.drain_timeout,
            watch_quiet_s=options.watch_quiet_s,
            listeners=(supervisor.on_model_state, loads),
            engine_build=options.engine_build,
            load_timeout=options.load_timeout,
            latency_summaries=options.latency_summaries,
            onnxruntime_thread_policy=options.onnxruntime_thread_policy,
            service=supervisor,
            heap_trim=heap_trim,
        )
        supervisor.attach(server)
        frontend = None
        metrics = None
        kserve = None
        status = 0
        failed: dict[str, str] = {}
        try:
            failed = unavailable_models(server.models()) if options.exit_on_error else {}
            if failed:
                _log_startup_failure(failed)
                status = 1
                return status
            limits = Limits(options.limits, heap_trim)  # one budget, asked by every listener below
            kserve = KServeFrontends(
                server,
                options.kserve,
                max_message_bytes=options.max_message_bytes,
                control_policy=control_policy,
                limits=limits,
            )
            kserve.start()
            for label, probe in kserve.probes():
                supervisor.add_frontend(label, probe)
            if options.ipc_address != "":
                from edge_server.ipc.addresses import default_address
                from edge_server.ipc.frontend import IpcFrontend

                address = options.ipc_address or default_address()
                frontend = IpcFrontend(
                    server,
                    address,
                    max_message_bytes=options.max_message_bytes,
                    max_header_bytes=options.max_header_bytes,
                    control_policy=control_policy,
                    drain_timeout=options.drain_timeout,
                    max_reply_bytes=options.max_client_reply_bytes,
                    max_client_requests=options.max_client_requests,
                    max_requests=options.max_requests,
                    max_client_regions=options.max_client_regions,
                    limits=limits,
                    max_frames=options.max_frames,
                )
                frontend.start()
                supervisor.add_frontend("IPC frontend", frontend)
                log.info("serving on %s", address)
            if options.allow_metrics:
                from edge_server.metrics.endpoint import serve_metrics

                collector = ServerCollector(
                    server,
                    loads=loads,
                    service=supervisor.state,
                    frontends=lambda: [frontend] if frontend else [],
                )
                metrics = serve_metrics(
                    collector, address=options.metrics_address, port=options.metrics_port, limits=limits
                )
            ready = [s for s in server.models() if s.state is ModelState.READY]
            log.info(
                "edge-server ready: %d model version(s) serving from %s", len(ready), server.repositories
            )
            supervisor.serving()
            self._loop(server, supervisor)
        finally:
            # One budget for the whole stop: intake closes, what is in flight and queued gets until the
            # deadline, what is left then fails UNAVAILABLE (and is answered), models unload.
            deadline = time.monotonic() + options.drain_timeout
            self._escalate_on_second_signal()
            log.info("stopping: draining requests (up to %.1f s)", options.drain_timeout)
            # STOPPING=1; readiness false from here on.  A start-up failure stays in STATUS= (what
            # `systemctl status` shows after the exit), naming the model and why.
            supervisor.stopping(startup_failure_status(failed) if failed else None)
            if frontend is not None:
                frontend.refuse_new()
            if kserve is not None:
                kserve.refuse_new()  # HTTP/gRPC: no new calls; those in flight are answered as they finish
            server.close(deadline)
            if frontend is not None:
                frontend.close(timeout=_FLUSH_S)  # every request has its answer now: send them
            if kserve is not None:
                kserve.close()
            if metrics is not None:
                metrics.close()
            supervisor.stopped()
            if failed:  # the last lines of the journal say why, after the other models' unloading
                _log_startup_failure(failed)
            else:
                log.info("stopped")
        return status

    @staticmethod
    def _escalate_on_second_signal() -> None:
        """While stopping, a second SIGTERM/SIGINT stops at once (as uvicorn does)."""

        def now(signum: int, _frame: FrameType | None) -> None:
            os.write(2, f"received {signal.Signals(signum).name} while stopping: exiting now\n".encode())
            os._exit(1)

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, now)

    def _loop(self, server: Server, supervisor: Supervisor) -> None:
        while True:
            try:
                signum = self._signals.get(timeout=1.0)
            except queue.Empty:
                continue
            if signum == signal.SIGHUP:
                log.info("SIGHUP: rescanning %s", server.repositories)
                supervisor.reloading()
                try:
                    server.rescan()
                except EdgeServerError as exc:
                    log.error("rescan failed: %s", exc.message)
                    supervisor.reloaded(False, exc.message)
                else:
                    missing = unavailable_models(server.models())
                    supervisor.reloaded(not missing, "; ".join(sorted(missing)))
                continue
            log.info("received %s", signal.Signals(signum).name)
            return
