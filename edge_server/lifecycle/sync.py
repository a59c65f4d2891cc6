"""Bringing one model in line with its files: which versions load, which keep serving, which fail.

A new version is loaded and warmed up *beside* the serving one, published by swapping the table
(:mod:`edge_server.lifecycle.drain`), and only then is the old version drained and unloaded.

A version that fails to load never takes traffic: the last good one keeps serving and the failure is
kept in the index with its reason.  Decisions are made by content hash: a version whose files hash as
before is kept as it is, and a version whose exact content already failed is not retried by the watcher
(an explicit load or SIGHUP retries it).  With a ``latest N`` policy, the N newest versions *that load*
serve, so a broken drop of version 3 leaves version 2 serving, and removing version 2 brings version 1
back.  A load runs on a thread of its own and is abandoned after ``load_timeout``
(:mod:`edge_server.load_guard`): the version is UNAVAILABLE with that reason and the last good version
keeps serving.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping

from edge_server.config import ModelConfig
from edge_server.errors import EdgeServerError, ModelNotReady, ServerShuttingDown, shorten
from edge_server.lifecycle.drain import ServingTable
from edge_server.load_guard import load_abandonable
from edge_server.loader import LoadedVersion, LoadEnvironment, read_config
from edge_server.repository import ModelSource
from edge_server.status_index import ModelState, StatusIndex, VersionStatus

log = logging.getLogger(__name__)


class ModelSync:
    """Loads what changed of one model and publishes the outcome; the caller holds that model's lock."""

    def __init__(
        self,
        table: ServingTable,
        index: StatusIndex,
        env: LoadEnvironment,
        *,
        load_timeout: float,
        closing: threading.Event,
    ) -> None:
        self._table = table
        self._routing = table.routing
        self._index = index
        self._env = env
        self._load_timeout = load_timeout
        self._closing = closing
        self._failed: dict[tuple[str, int], tuple[str, str]] = {}  # (name, version) -> (hash, reason)

    def forget(self, name: str) -> None:
        """``name`` left the repository: its failed contents are tried again should it come back."""
        with self._table.lock:
            self._failed = {k: v for k, v in self._failed.items() if k[0] != name}

    def sync(self, source: ModelSource, *, retry_failed: bool, coming: int = 0) -> None:
        """Bring ``source`` in line with its files; ``coming``: CPU sessions a rescan loads after it."""
        name = source.name
        current = self._routing.serving().get(name, {})
        config_signature = source.config_signature()
        try:
            config, warnings = read_config(source)
        except EdgeServerError as exc:
            self.fail_model(name, exc)
            raise
        for warning in warnings:
            log.warning("%s", warning)
        policy = config.version_policy
        selected = policy.select(list(source.versions))
        if not selected:
            missing = ModelNotReady(
                f"{source.path}: no version directory matches the version policy "
                f"(on disk: {sorted(source.versions)})"
            )
            self.fail_model(name, missing)
            raise missing
        # latest N: a version that does not load is replaced by the next older one on disk.
        candidates = sorted(source.versions, reverse=True) if policy.kind == "latest" else selected
        config_hash = source.config_hash()
        ready: dict[int, LoadedVersion] = {}
        failed: dict[int, str] = {}
        for version in candidates:
            if len(ready) >= len(selected):
                break
            outcome = self._bring_up(
                source,
                version,
                config,
                config_hash,
                current.get(version),
                retry_failed=retry_failed,
                coming=coming,
            )
            if isinstance(outcome, str):
                failed[version] = outcome
                if version in current:
                    ready[version] = current[version]  # the last good copy of this version keeps serving
            else:
                ready[version] = outcome
        if config_signature != source.config_signature():
            # What was loaded may come from a half-written config.pbtxt (a prefix of a text proto can
            # parse): throw the fresh versions away and keep what served; the change's own event
            # brings the next attempt.
            reason = "the config files changed while loading; loading again when they settle"
            log.warning("model %s: %s", name, reason)
            for version, loaded in ready.items():
                if current.get(version) is not loaded:
                    loaded.retire(time.monotonic())
                    failed[version] = reason
            ready = dict(current)
        removed_but_serving = not ready and bool(current)
        if removed_but_serving:
            ready = dict(current)  # nothing on disk loads: what served before keeps serving
        retiring = [v for key, v in current.items() if ready.get(key) is not v]
        self._publish(name, ready, current, retiring)
        rows = [
            VersionStatus(name, v, ModelState.UNAVAILABLE, r) for v, r in failed.items() if v not in ready
        ]
        for version in ready:
            reason = ready[version].note  # e.g. a TensorRT model serving its ONNX: which, and why
            if version in failed:
                reason = f"serving the previous files; the new ones failed: {failed[version]}"
            elif removed_but_serving:
                reason = "still serving; no version on disk could be loaded"
            rows.append(VersionStatus(name, version, ModelState.READY, reason))
        rows += [
            VersionStatus(name, v.version, ModelState.UNLOADING) for v in retiring if v.version not in ready
        ]
        self._index.publish(name, rows)
        with self._table.lock:
            self._failed = {k: v for k, v in self._failed.items() if k[0] != name or k[1] in source.versions}
        self._table.retire(retiring, finish_sequences=True)
        if not ready:
            raise ModelNotReady(f"model {shorten(name)}: no version could be loaded ({_summary(failed)})")

    def _publish(
        self,
        name: str,
        ready: dict[int, LoadedVersion],
        current: Mapping[int, LoadedVersion],
        retiring: list[LoadedVersion],
    ) -> None:
        """The atomic switch: new requests go to ``ready`` from here on (unless the server closed)."""
        self._routing.hold(retiring, held=True)  # before the switch: a live sequence never misses it
        with self._table.lock:
            if self._table.closed:  # close() retired what served; what this load brought up goes too
                fresh = [v for key, v in ready.items() if current.get(key) is not v]
            else:
                table = dict(self._routing.serving())
                if ready:
                    table[name] = ready
                else:
                    table.pop(name, None)
                self._routing.switch(table)
                return
        self._routing.hold(retiring, held=False)
        for loaded in fresh:
            loaded.retire(time.monotonic())
        raise ServerShuttingDown("the server is shutting down")

    def _bring_up(
        self,
        source: ModelSource,
        version: int,
        config: ModelConfig,
        config_hash: str,
        existing: LoadedVersion | None,
        *,
        retry_failed: bool,
        coming: int = 0,
    ) -> LoadedVersion | str:
        """The loaded version (``existing`` when its content is unchanged), or why it did not load."""
        name = source.name
        signature = source.version_signature(version)
        content_hash = config_hash + source.version_hash(version)
        if existing is not None and existing.content_hash == content_hash:
            return existing  # never rebuilt for another model's sake: it keeps its session and counts
        known = self._failed.get((name, version))
        if known is not None and known[0] == content_hash and not retry_failed:
            return known[1]
        self._index.set(name, version, ModelState.LOADING, "replacing the serving copy" if existing else "")
        self._table.heap_changed()
        log.info("%s v%d loading", name, version, extra={"model": name, "version": version})
        began = time.monotonic()
        try:
            loaded = load_abandonable(
                source,
                version,
                config,
                timeout=self._load_timeout,
                closing=self._closing,
                content_hash=content_hash,
                env=self._env,
                sharing=self._cpu_sessions(exclude=(name, version)) + coming,
            )
        except Exception as exc:  # any failure, expected or not, must leave the old version serving
            reason = exc.message if isinstance(exc, EdgeServerError) else repr(exc)
            if source.version_signature(version) != signature:
                reason += " (the files changed while loading; loading again when they settle)"
            else:
                with self._table.lock:
                    self._failed[(name, version)] = (content_hash, reason)
            fields = {"model": name, "version": version}
            if isinstance(exc, EdgeServerError):
                log.error("%s v%d failed to load: %s", name, version, reason, extra=fields)
            else:
                log.exception("%s v%d failed to load", name, version, extra=fields)
            return reason
        if source.version_signature(version) != signature:
            # It never took traffic; what it loaded may be a half-written file.
            loaded.retire(time.monotonic())
            reason = "the files changed while loading; loading again when they settle"
            log.warning("%s v%d: %s", name, version, reason)
            return reason
        with self._table.lock:
            self._failed.pop((name, version), None)
        log.info(
            "%s v%d ready: %s, in %.2f s",
            name,
            version,
            describe_placement(loaded.devices, ensemble=bool(loaded.members) or not loaded.devices),
            time.monotonic() - began,
            extra={"model": name, "version": version},
        )
        return loaded

    def thread_rule_now(self) -> tuple[str, int, int]:
        """The ONNX Runtime thread rule's inputs as they stand now: policy, CPU sessions, cores."""
        return self._env.thread_policy, self._cpu_sessions(), self._env.cpu_count or os.cpu_count() or 1

    def _cpu_sessions(self, *, exclude: tuple[str, int] | None = None) -> int:
        """CPU ONNX Runtime sessions of every serving version but ``exclude`` (the one being replaced)."""
        return sum(
            loaded.cpu_sessions
            for name, versions in self._routing.serving().items()
            for version, loaded in versions.items()
            if (name, version) != exclude
        )

    def fail_model(self, name: str, exc: EdgeServerError) -> None:
        """``name``'s files cannot load at all: whatever of it serves keeps serving, with the reason."""
        log.error("model %s: %s", name, exc.message)
        current = self._routing.serving().get(name, {})
        rows = [
            VersionStatus(name, v, ModelState.READY, f"still serving; the new files failed: {exc.message}")
            for v in current
        ]
        rows.append(VersionStatus(name, None, ModelState.UNAVAILABLE, exc.message))
        self._index.publish(name, rows)


def describe_placement(devices: tuple[str, ...], *, ensemble: bool) -> str:
    """Where a version's instances run, for its ready line: ``2 instances on cpu``, ``an ensemble``.

    ``devices`` holds one entry per instance; counted per device, in order of first appearance.
    """
    if ensemble or not devices:
        return "an ensemble"
    counts: dict[str, int] = {}
    for device in devices:
        counts[device] = counts.get(device, 0) + 1
    total = len(devices)
    if len(counts) == 1:
        return f"{total} instance{'s' if total > 1 else ''} on {devices[0]}"
    return f"{total} instances: " + ", ".join(f"{n} on {device}" for device, n in counts.items())


def _summary(failed: dict[int, str]) -> str:
    return "; ".join(f"v{v}: {reason}" for v, reason in sorted(failed.items())) or "nothing to load"
