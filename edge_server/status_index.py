"""The repository index: every version the server knows, in which state and why, and who hears of changes.

Triton's ``RepositoryIndex``: a row per version that is loading, serving, unloading or failed (with the
reason).  The lifecycle's control writes it; the routing view reads it for precise errors, and
listeners (metrics, systemd STATUS lines, logs) hear every change.  One lock guards the rows; listeners
are called outside it.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


class ModelState(str, enum.Enum):
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


@dataclass(frozen=True)
class VersionStatus:
    """One row of the repository index: Triton's ``RepositoryIndex.ModelIndex``."""

    name: str
    version: int | None  # None: the model failed before any version could be named
    state: ModelState
    reason: str = ""


#: the reason of a row whose version (or model) was unloaded on purpose: through the API, or because
#: it left the repository.  Triton keeps such rows in its index as UNAVAILABLE, with this reason.
UNLOADED = "unloaded"


@dataclass(frozen=True)
class NotLoaded:
    """A model in the repositories that the server never loaded (explicit mode).

    Triton's index lists it by name alone, so that a client sees what it can load.
    """

    name: str


def _kept(status: VersionStatus) -> bool:
    """A version row that outlives a new publication of its model: retiring, or unloaded."""
    if status.version is None:
        return False
    return status.state is ModelState.UNLOADING or (
        status.state is ModelState.UNAVAILABLE and status.reason == UNLOADED
    )


def index_row(status: VersionStatus | NotLoaded) -> dict[str, Any]:
    """One row of the index as plain data (IPC, the CLI): a model never loaded has its name alone."""
    if isinstance(status, NotLoaded):
        return {"name": status.name}
    return {
        "name": status.name,
        "version": status.version,
        "state": status.state.value,
        "reason": status.reason,
    }


Listener = Callable[[VersionStatus], None]
_Key = tuple[str, int | None]


class StatusIndex:
    """The rows of the index, replaced per model; listeners are told of every row that changed."""

    def __init__(self, listeners: Iterable[Listener] = ()) -> None:
        #: held only to read or replace rows, never across a listener call (tests block readers on it)
        self.lock = threading.Lock()
        self._rows: dict[_Key, VersionStatus] = {}
        self._listeners: list[Listener] = list(listeners)

    def add_listener(self, listener: Listener) -> None:
        """Called on every state change (metrics, systemd STATUS lines, logs); must not block."""
        self._listeners.append(listener)

    def rows(self) -> list[VersionStatus]:
        """Every row, by name, newest version first."""
        with self.lock:
            return sorted(self._rows.values(), key=lambda s: (s.name, -(s.version or 0)))

    def of(self, name: str) -> dict[_Key, VersionStatus]:
        """The rows of one model."""
        with self.lock:
            return {key: s for key, s in self._rows.items() if key[0] == name}

    def names(self, state: ModelState | None = None) -> set[str]:
        """The models with a row (in ``state``, when given)."""
        with self.lock:
            return {key[0] for key, s in self._rows.items() if state is None or s.state is state}

    def set(self, name: str, version: int | None, state: ModelState, reason: str = "") -> None:
        """Set one row (a version row replaces the model's row without a version)."""
        status = VersionStatus(name, version, state, reason)
        with self.lock:
            if version is not None:
                self._rows.pop((name, None), None)
            unchanged = self._rows.get((name, version)) == status
            self._rows[(name, version)] = status
        if not unchanged:
            self._notify(status)

    def publish(self, name: str, rows: list[VersionStatus]) -> None:
        """Replace every row of ``name`` with ``rows``.

        Versions being retired keep their rows, and so do versions unloaded before (UNAVAILABLE,
        "unloaded"): Triton's index lists every version it unloaded until it loads again.
        """
        keep = {(r.name, r.version) for r in rows}
        with self.lock:
            stale = [
                key for key, s in self._rows.items() if key[0] == name and key not in keep and not _kept(s)
            ]
            for key in stale:
                del self._rows[key]
            changed = [r for r in rows if self._rows.get((r.name, r.version)) != r]
            for row in rows:
                self._rows[(row.name, row.version)] = row
        for row in changed:
            self._notify(row)

    def unloaded(self, name: str, version: int) -> None:
        """A retired version is gone: its UNLOADING row becomes UNAVAILABLE, "unloaded", as in Triton.

        A newer row of that version (loading or serving again) stays as it is.
        """
        status = VersionStatus(name, version, ModelState.UNAVAILABLE, UNLOADED)
        with self.lock:
            row = self._rows.get((name, version))
            if row is None or row.state is not ModelState.UNLOADING:
                return
            self._rows[(name, version)] = status
        self._notify(status)

    def _notify(self, status: VersionStatus) -> None:
        for listener in self._listeners:
            try:
                listener(status)
            except Exception:  # a broken listener must not stop a swap half-way
                log.exception("model state listener failed on %s", status)
