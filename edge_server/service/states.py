"""The daemon's life as explicit states under one lock: starting, serving, reloading, draining, stopped.

Readiness is read from here: false while starting or draining (Triton answers "not ready" in both).
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass


class DaemonState(str, enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    RELOADING = "reloading"
    DRAINING = "draining"
    STOPPED = "stopped"


# Which state may follow which; anything else is a bug in the caller.
_NEXT = {
    DaemonState.STARTING: {DaemonState.SERVING, DaemonState.DRAINING, DaemonState.STOPPED},
    DaemonState.SERVING: {DaemonState.RELOADING, DaemonState.DRAINING},
    DaemonState.RELOADING: {DaemonState.SERVING, DaemonState.DRAINING},
    DaemonState.DRAINING: {DaemonState.STOPPED},
    DaemonState.STOPPED: set(),
}


@dataclass(frozen=True)
class Reload:
    """The last SIGHUP rescan: when it ended (wall clock) and whether it went through."""

    at: float
    ok: bool
    detail: str = ""


class ServiceState:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = DaemonState.STARTING
        self.started_at = time.time()
        self._started_mono = time.monotonic()
        self._last_reload: Reload | None = None
        self._reloads = 0
        self._reload_failures = 0

    @property
    def state(self) -> DaemonState:
        with self._lock:
            return self._state

    def move(self, state: DaemonState) -> DaemonState:
        """Go to ``state``; returns the state left.  Raises on a transition that cannot happen."""
        with self._lock:
            previous = self._state
            if state is not previous and state not in _NEXT[previous]:
                raise RuntimeError(f"daemon state {previous.value} cannot become {state.value}")
            self._state = state
            return previous

    def reloaded(self, ok: bool, detail: str = "") -> None:
        with self._lock:
            self._last_reload = Reload(time.time(), ok, detail)
            self._reloads += 1
            self._reload_failures += not ok

    @property
    def last_reload(self) -> Reload | None:
        with self._lock:
            return self._last_reload

    def reload_counts(self) -> tuple[int, int]:
        """SIGHUP rescans so far, and how many of them failed."""
        with self._lock:
            return self._reloads, self._reload_failures

    def uptime(self) -> float:
        return time.monotonic() - self._started_mono

    def accepting(self) -> bool:
        """Serving (a reload keeps serving): the first half of readiness."""
        return self.state in (DaemonState.SERVING, DaemonState.RELOADING)
