"""The daemon as systemd sees it: state changes turned into notify lines, and the watchdog's ticks.

``READY=1`` goes out once the repository is loaded and every frontend listens; ``RELOADING=1`` (with
``MONOTONIC_USEC=``) and ``READY=1`` around a SIGHUP rescan; ``STOPPING=1`` when the drain starts;
``EXTEND_TIMEOUT_USEC=`` each time a model starts loading while systemd is timing a start-up or a
reload, so that a long load (a TensorRT engine) is not killed while one that hangs still is;
``STATUS=`` lines with what an operator wants from ``systemctl status``.

The watchdog ticks on its own thread, every half ``WatchdogSec=``, and sends ``WATCHDOG=1`` only when
no scheduler and no frontend is stuck (see :mod:`edge_server.service.liveness`): a hung model with
queued requests, or a wedged frontend thread, stops the pings and systemd restarts the daemon.  The
main thread may be busy for minutes in a reload without that counting against it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING, Any

from edge_server.service.liveness import LivenessMonitor, Progressing
from edge_server.service.notify import Notifier
from edge_server.service.states import DaemonState, ServiceState
from edge_server.status_index import UNLOADED, ModelState, VersionStatus

if TYPE_CHECKING:
    from edge_server.server import Server

log = logging.getLogger(__name__)

# Each model that starts loading during start-up or a reload gets this long from then on.
LOAD_EXTEND_S = 180.0
# STATUS= refresh period when systemd asks for no watchdog.
STATUS_EVERY_S = 5.0


def unloaded_models(index: Iterable[VersionStatus]) -> set[str]:
    """Models every row of which was unloaded on request or removed from the repository."""
    rows: dict[str, bool] = {}
    for s in index:
        gone = s.state is ModelState.UNAVAILABLE and s.reason == UNLOADED
        rows[s.name] = rows.get(s.name, True) and gone
    return {name for name, gone in rows.items() if gone}


def unavailable_models(index: Iterable[VersionStatus]) -> dict[str, str]:
    """Models that should serve and have no READY version, with why; models unloaded on request excluded.

    A model with a broken new drop that keeps serving its previous version is available.
    """
    index = list(index)
    gone = unloaded_models(index)  # unloaded on request, or removed from the repository
    rows: dict[str, list[VersionStatus]] = {}
    for status in index:
        if status.name not in gone:
            rows.setdefault(status.name, []).append(status)
    missing: dict[str, str] = {}
    for name, statuses in rows.items():
        if any(s.state is ModelState.READY for s in statuses):
            continue
        missing[name] = "; ".join(
            f"{'v' + str(s.version) if s.version is not None else 'model'} {s.state.value}"
            + (f": {s.reason}" if s.reason else "")
            for s in statuses
        )
    return missing


class Supervisor:
    def __init__(self, notifier: Notifier, *, strict_readiness: bool = True) -> None:
        self.notifier = notifier
        self.state = ServiceState()
        self.strict_readiness = strict_readiness
        self._server: Server | None = None
        self._frontends: list[tuple[str, Progressing]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_status = ""
        self._stopping = False
        self._not_pinging: list[str] = []
        interval = notifier.watchdog_s
        self.monitor = LivenessMonitor(self._parts, stall_s=2 * interval if interval else 0.0)

    # -- state changes (called by the daemon's main thread) ------------------------------------

    def starting(self) -> None:
        self.notifier.send("STATUS=starting: loading the model repository")

    def attach(self, server: Server) -> None:
        """The server exists (its repository is loaded): readiness is answered from here on.

        (The server was built with this supervisor as its ``service``.)
        """
        self._server = server

    def add_frontend(self, label: str, frontend: Progressing) -> None:
        self._frontends.append((label, frontend))

    def serving(self) -> None:
        """Every frontend listens: READY=1, and the watchdog starts ticking."""
        self.state.move(DaemonState.SERVING)
        self.notifier.send("READY=1", f"STATUS={self.status_line()}")
        if self.notifier.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._tick_loop, name="edge-watchdog", daemon=True)
            self._thread.start()

    def reloading(self) -> None:
        self.state.move(DaemonState.RELOADING)
        now_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.notifier.send("RELOADING=1", f"MONOTONIC_USEC={now_us}", "STATUS=reloading the model repository")

    def reloaded(self, ok: bool, detail: str = "") -> None:
        self.state.reloaded(ok, detail)
        self.state.move(DaemonState.SERVING)
        self.notifier.send("READY=1", f"STATUS={self.status_line()}")

    def stopping(self, status: str | None = None) -> None:
        """The drain begins: not ready any more, STOPPING=1; the watchdog pings on without checks.

        ``status``: the STATUS= line instead of "draining requests and stopping", e.g. why the daemon
        is exiting; systemd keeps the last one in ``systemctl status`` after the process is gone.
        """
        self._stopping = True
        self.state.move(DaemonState.DRAINING)
        self.notifier.send("STOPPING=1", f"STATUS={status or 'draining requests and stopping'}")

    def stopped(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.state.move(DaemonState.STOPPED)
        self.notifier.close()

    # -- readiness and status ---------------------------------------------------------------------

    def is_ready(self) -> bool:
        """Triton's server readiness: serving, and with strict readiness every model that should load is."""
        if not self.state.accepting() or self._server is None:
            return False
        return not self.strict_readiness or not unavailable_models(self._server.models())

    def describe(self) -> dict[str, Any]:
        """The daemon's part of ``edge-server status``."""
        reload = self.state.last_reload
        reloads, failures = self.state.reload_counts()
        return {
            "state": self.state.state.value,
            "ready": self.is_ready(),
            "uptime_s": self.state.uptime(),
            "started_at": self.state.started_at,
            "last_reload": None
            if reload is None
            else {"at": reload.at, "ok": reload.ok, "detail": reload.detail},
            "reloads": reloads,
            "reload_failures": failures,
            "stuck": list(self._not_pinging),
            "ipc": [frontend.status() for _, frontend in self._frontends if hasattr(frontend, "status")],
        }

    def on_model_state(self, status: VersionStatus) -> None:
        """A :class:`ModelManager` listener: more start-up time for each model that starts loading."""
        if status.state is ModelState.LOADING and self.state.state in (
            DaemonState.STARTING,
            DaemonState.RELOADING,
        ):
            self.notifier.send(
                f"EXTEND_TIMEOUT_USEC={int(LOAD_EXTEND_S * 1e6)}",
                f"STATUS=loading {status.name} v{status.version}",
            )

    def status_line(self) -> str:
        """``serving: 4/4 models ready, 1520 requests served (3 failed), last reload 12:04:05 ok``."""
        server = self._server
        if server is None:
            return self.state.state.value
        index = server.models()
        names = {s.name for s in index} - unloaded_models(index)
        missing = unavailable_models(index)
        served = failed = 0
        for stats in server.statistics():
            served += stats["inference_stats"]["success"]["count"]
            failed += stats["inference_stats"]["fail"]["count"]
        line = (
            f"{self.state.state.value}: {len(names) - len(missing)}/{len(names)} models ready, "
            f"{served} requests served ({failed} failed)"
        )
        reload = self.state.last_reload
        if reload is not None:
            when = time.strftime("%H:%M:%S", time.localtime(reload.at))
            line += f", last reload {when} {'ok' if reload.ok else 'failed'}"
        if self._not_pinging:
            line += f"; STUCK (no progress): {', '.join(self._not_pinging)}"
        return line

    # -- the watchdog thread ----------------------------------------------------------------------

    def _parts(self) -> Iterable[tuple[Hashable, str, Progressing]]:
        if self._server is not None:
            for name, versions in self._server.routing.serving().items():
                for version, loaded in versions.items():
                    yield id(loaded.scheduler), f"model {name} v{version}", loaded.scheduler
        for label, frontend in self._frontends:
            yield id(frontend), label, frontend

    def _tick_loop(self) -> None:
        interval = self.notifier.watchdog_s or STATUS_EVERY_S
        while not self._stop.wait(interval):
            try:
                self._tick()
            except Exception:  # the watchdog thread never dies; a failed tick is one missed ping
                log.exception("watchdog tick failed")

    def _tick(self) -> None:
        if self.notifier.watchdog_s:
            stuck = {} if self._stopping else self.monitor.stuck()
            if sorted(stuck) != self._not_pinging:
                if stuck:
                    log.error(
                        "watchdog: not pinging systemd: %s",
                        "; ".join(f"{label} made no progress for {s:.1f} s" for label, s in stuck.items()),
                    )
                elif self._not_pinging:
                    log.warning("watchdog: progress again; pinging systemd")
                self._not_pinging = sorted(stuck)
            if not stuck:
                self.notifier.send("WATCHDOG=1")
            for _, frontend in self._frontends:
                poke = getattr(frontend, "poke", None)
                if poke is not None:
                    poke()  # the next tick sees whether it turned
        if not self._stopping:
            line = self.status_line()
            if line != self._last_status:
                self._last_status = line
                self.notifier.send(f"STATUS={line}")
