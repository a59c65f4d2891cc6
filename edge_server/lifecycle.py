"""Model lifecycle: which versions serve, and how they are replaced without failing a request.

Control operations (load, unload, rescan) run one at a time under ``_control``; the request path reads
the routing table without any lock (it is replaced whole, never mutated, so a reader sees either the
old table or the new one).  A new version is loaded and warmed up *beside* the serving one, published
by swapping the table, and only then is the old version drained and unloaded.  A version that fails to
load never takes traffic: the last good one keeps serving and the failure is kept in the index.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from edge_server.errors import EdgeServerError, ModelNotFound, ModelNotReady
from edge_server.loader import LoadedVersion, load_version, read_config
from edge_server.repository import ModelSource, scan, scan_model

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


Listener = Callable[[VersionStatus], None]


class ModelManager:
    def __init__(
        self, repository: Path, *, drain_timeout: float = 30.0, cpu_count: int | None = None
    ) -> None:
        self.repository = repository
        self._drain_timeout = drain_timeout
        self._cpu_count = cpu_count
        self._control = threading.RLock()
        self._serving: dict[str, dict[int, LoadedVersion]] = {}  # replaced whole, never mutated
        self._status_lock = threading.Lock()
        self._status: dict[tuple[str, int | None], VersionStatus] = {}
        self._listeners: list[Listener] = []
        self._closed = False

    # -- request path ---------------------------------------------------------------------------

    def resolve(self, name: str, version: int | None = None) -> LoadedVersion:
        """The version a request for ``name`` (and ``version``, or the latest) goes to."""
        versions = self._serving.get(name)
        if versions:
            if version is None:
                return versions[max(versions)]
            found = versions.get(version)
            if found is not None:
                return found
        with self._status_lock:
            known = {key: s for key, s in self._status.items() if key[0] == name}
        if not known and not versions:
            raise ModelNotFound(f"unknown model {name!r}")
        status = known.get((name, version)) if version is not None else None
        if status is not None:
            raise ModelNotReady(f"model {name!r} version {version} is {status.state.value}: {status.reason}")
        if version is not None:
            available = sorted(versions or {})
            raise ModelNotFound(f"model {name!r} has no version {version}; serving versions: {available}")
        reasons = "; ".join(f"v{s.version}: {s.state.value} {s.reason}".strip() for s in known.values())
        raise ModelNotReady(f"model {name!r} is not ready ({reasons})")

    # -- index ----------------------------------------------------------------------------------

    def index(self) -> list[VersionStatus]:
        with self._status_lock:
            return sorted(self._status.values(), key=lambda s: (s.name, -(s.version or 0)))

    def serving(self) -> dict[str, dict[int, LoadedVersion]]:
        return self._serving

    def add_listener(self, listener: Listener) -> None:
        """Called on every state change (metrics, systemd STATUS lines, logs)."""
        self._listeners.append(listener)

    def _set(self, name: str, version: int | None, state: ModelState, reason: str = "") -> None:
        status = VersionStatus(name, version, state, reason)
        with self._status_lock:
            if version is not None:
                self._status.pop((name, None), None)
            self._status[(name, version)] = status
        for listener in self._listeners:
            listener(status)

    def _forget(self, name: str, version: int | None) -> None:
        with self._status_lock:
            self._status.pop((name, version), None)

    # -- control --------------------------------------------------------------------------------

    def load(self, name: str) -> list[VersionStatus]:
        """Bring ``name`` in line with the repository; raises if nothing of it can serve afterwards."""
        with self._control:
            self._check_open()
            source = scan_model(self.repository, name)
            if source is None:
                if name in self._serving:
                    self._unload(name)
                raise ModelNotFound(f"no model directory {name!r} in {self.repository}")
            self._sync(source)
            return [s for s in self.index() if s.name == name]

    def unload(self, name: str) -> None:
        with self._control:
            if name not in self._serving and not any(s.name == name for s in self.index()):
                raise ModelNotFound(f"unknown model {name!r}")
            self._unload(name)
            for status in [s for s in self.index() if s.name == name]:
                self._forget(name, status.version)
            self._set(name, None, ModelState.UNAVAILABLE, "unloaded")

    def rescan(self, names: Iterable[str] | None = None) -> None:
        """Reload what changed on disk among ``names`` (default: every model); unload removed models.

        Failures are logged and kept in the index; they never stop the rescan of the other models.
        """
        with self._control:
            self._check_open()
            on_disk = scan(self.repository)
            wanted = set(on_disk) | set(self._serving) if names is None else set(names)
            for name in sorted(wanted):
                source = on_disk.get(name)
                try:
                    if source is None:
                        if name in self._serving:
                            log.info("model %s was removed from the repository; unloading", name)
                            self._unload(name)
                        for status in [s for s in self.index() if s.name == name]:
                            self._forget(name, status.version)
                    else:
                        self._sync(source)
                except EdgeServerError as exc:
                    log.error("model %s: %s", name, exc.message)

    def close(self) -> None:
        with self._control:
            self._closed = True
            for name in list(self._serving):
                self._unload(name)

    def _check_open(self) -> None:
        if self._closed:
            raise ModelNotReady("the server is shutting down")

    def _unload(self, name: str) -> None:
        old = self._serving.get(name, {})
        table = dict(self._serving)
        table.pop(name, None)
        self._serving = table
        self._retire(list(old.values()))

    def _retire(self, versions: list[LoadedVersion]) -> None:
        for loaded in versions:
            self._set(loaded.name, loaded.version, ModelState.UNLOADING)
        for loaded in versions:
            loaded.retire(self._drain_timeout)
            self._forget(loaded.name, loaded.version)
            log.info("%s v%d unloaded", loaded.name, loaded.version)

    def _sync(self, source: ModelSource) -> None:
        name = source.name
        current = self._serving.get(name, {})
        try:
            config, warnings = read_config(source)
        except EdgeServerError as exc:
            self._fail_model(name, current, exc)
            raise
        for warning in warnings:
            log.warning("%s", warning)
        selected = config.version_policy.select(list(source.versions))
        if not selected:
            exc = ModelNotReady(
                f"{source.path}: no version directory matches the version policy "
                f"(on disk: {sorted(source.versions)})"
            )
            self._fail_model(name, current, exc)
            raise exc
        config_hash = source.config_hash()
        ready: dict[int, LoadedVersion] = {}
        failed: dict[int, EdgeServerError] = {}
        for version in selected:
            content_hash = config_hash + source.version_hash(version)
            existing = current.get(version)
            if existing is not None and existing.content_hash == content_hash:
                ready[version] = existing
                continue
            self._set(name, version, ModelState.LOADING)
            try:
                ready[version] = load_version(
                    source, version, config, content_hash=content_hash, cpu_count=self._cpu_count
                )
            except EdgeServerError as exc:
                log.error("%s v%d failed to load: %s", name, version, exc.message)
                failed[version] = exc
                if existing is not None:
                    ready[version] = existing  # the last good copy of this version keeps serving
            else:
                log.info("%s v%d ready on %s", name, version, ", ".join(ready[version].devices))
        if not ready:
            ready = dict(current)  # every selected version failed: what served before keeps serving
        table = dict(self._serving)
        if ready:
            table[name] = ready
        else:
            table.pop(name, None)
        self._serving = table  # the atomic switch: new requests go to the new versions from here on
        for version, exc in failed.items():
            if version not in ready:
                self._set(name, version, ModelState.UNAVAILABLE, exc.message)
        for version in ready:
            reason = f"serving the previous files; the new ones failed: {failed[version].message}" if version in failed else ""
            self._set(name, version, ModelState.READY, reason)
        self._retire([v for key, v in current.items() if ready.get(key) is not v])
        if not ready and failed:
            raise next(iter(failed.values()))

    def _fail_model(self, name: str, current: dict[int, LoadedVersion], exc: EdgeServerError) -> None:
        log.error("model %s: %s", name, exc.message)
        if current:
            for version in current:
                self._set(name, version, ModelState.READY, f"still serving; the new files failed: {exc.message}")
        self._set(name, None, ModelState.UNAVAILABLE, exc.message)
