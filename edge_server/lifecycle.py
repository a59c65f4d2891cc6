"""Model lifecycle control: which versions serve, and how they are replaced without failing a request.

This module only decides and acts (load, unload, rescan, sync); what it decides is published in
:mod:`edge_server.routing` (the routing table the request path reads without a lock, swapped whole)
and :mod:`edge_server.status_index` (the repository index and its listeners).

Control operations run one at a time *per model*, under that model's lock, so that one model's slow
or stuck load never holds up another's (a rescan brings each model in line on a control thread of its
own); the routing table is swapped under a short ``_tables`` lock.  A load runs on a thread of its own
and is abandoned after ``load_timeout`` (:mod:`edge_server.load_guard`: a Python model's
``initialize()`` that never returns): the version is UNAVAILABLE with that reason, the last good
version keeps serving, and whatever the abandoned thread loads later is closed.

A new version is loaded and warmed up *beside* the serving one, published by swapping the table, and
only then is the old version drained and unloaded.  Because the swap comes
before the drain, a request that routed to the old version just before the swap and finds it closed
(``SchedulerClosed``) is re-routed by the data plane to the new one; requests already queued on the old
version run there before it stops.

A version that fails to load never takes traffic: the last good one keeps serving and the failure is
kept in the index with its reason.  Decisions are made by content hash: a version whose files hash as
before is kept as it is, and a version whose exact content already failed is not retried by the watcher
(an explicit load or SIGHUP retries it).  With a ``latest N`` policy, the N newest versions *that load*
serve, so a broken drop of version 3 leaves version 2 serving, and removing version 2 brings version 1
back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path, PurePosixPath

from edge_server.config import ModelConfig
from edge_server.errors import (
    EdgeServerError,
    InvalidArgument,
    ModelNotFound,
    ModelNotReady,
    ServerShuttingDown,
    UnknownModel,
    shorten,
    unknown_model,
)
from edge_server.load_files import StagedFiles
from edge_server.load_guard import load_abandonable
from edge_server.loader import (
    LoadedVersion,
    LoadEnvironment,
    ensemble_members,
    is_ensemble,
    planned_cpu_sessions,
    read_config,
)
from edge_server.memory import settle_heap
from edge_server.pipeline.graph import parse_steps
from edge_server.repository import ModelSource, check_model_name, scan, scan_model
from edge_server.routing import Routing
from edge_server.status_index import ModelState, StatusIndex, VersionStatus

log = logging.getLogger(__name__)


#: How long a rescan waits for one model's load before it starts the next beside it (loads that
#: finish sooner run one after the other, as they always did).
CONTROL_PATIENCE_S = 1.0

#: Default of ``--model-load-timeout-secs``: a load (instances created, warmed up) taking longer is
#: abandoned.
DEFAULT_LOAD_TIMEOUT_S = 600.0


class ModelManager:
    def __init__(
        self,
        repository: Path,
        *,
        routing: Routing,
        index: StatusIndex,
        env: LoadEnvironment,
        drain_timeout: float = 30.0,
        load_timeout: float = DEFAULT_LOAD_TIMEOUT_S,
    ) -> None:
        """Control of ``repository``'s models: what it loads it publishes in ``routing`` and ``index``.

        ``env`` is what every load gets (model access, engine rebuilder, thread policy, summaries).
        """
        self.repository = repository
        self._routing = routing
        self._index = index
        self._env = env
        self._drain_timeout = drain_timeout
        self.load_timeout = load_timeout
        # Lock order: a model's lock, then (for an ensemble) its members' locks, then _tables, then the
        # routing's swap lock; _tables is held only for table swaps (a read-modify-write of the routing
        # table), never across a load, a drain or a listener call.
        self._locks_lock = threading.Lock()
        self._model_locks: dict[str, threading.RLock] = {}
        self._tables = threading.RLock()
        self._closing = threading.Event()
        self._failed: dict[tuple[str, int], tuple[str, str]] = {}  # (name, version) -> (hash, reason)
        self._unloaded: set[str] = set()  # unloaded through the API: rescans leave them alone
        self._overrides: dict[str, str] = {}  # configs given at load time, until loaded without one
        self._staged = StagedFiles()  # files given at load time (Triton's file:), likewise
        self._file_roots: dict[str, Path] = {}  # model -> the staged root it loads from
        self._closed = False
        self._heap_changed = False  # versions were loaded or freed since the heap was last settled
        self._loading_members: set[str] = set()  # members an explicit ensemble load is bringing up

    # -- control --------------------------------------------------------------------------------

    def load(
        self,
        name: str,
        *,
        config_override: str | None = None,
        files: Mapping[PurePosixPath, bytes] | None = None,
    ) -> list[VersionStatus]:
        """Load or reload ``name`` from the repository; raises if nothing of it can serve afterwards.

        Versions whose files did not change stay as they are; versions that failed before are tried
        again even if their files are the same (the failure may have been transient).
        ``config_override`` (JSON, Triton's load-time ``config``) replaces config.pbtxt until the model
        is loaded again without one; a load that fails keeps the previous choice.  ``files`` (Triton's
        load-time ``file:`` overrides, with a config) are the model's whole directory, staged outside
        the repository (:mod:`edge_server.load_files`), likewise until it is loaded without them.
        """
        if name.startswith(".") and "/" not in name and name.strip() != "..":  # hidden: never a model
            raise ModelNotFound(
                f"failed to load {shorten(name)}, failed to poll from model repository (a name "
                "starting with '.' is hidden, never a model)"
            )
        check_model_name(name)
        if files and config_override is None:
            raise InvalidArgument("file overrides need the model's config too (the 'config' parameter)")
        with self._changing(name):
            self._check_open()
            self._unloaded.discard(name)
            if files:
                self._file_roots[name] = self._staged.stage(name, files)
            elif self._file_roots.pop(name, None) is not None:
                self._staged.drop(name)
            source = self._staged_source(name) or scan_model(self.repository, name)
            if source is None:
                if name in self._routing.serving():
                    self._unload(name)
                raise ModelNotFound(
                    f"failed to load {shorten(name)}, failed to poll from model repository "
                    f"(no model directory {shorten(name)} in {self.repository})"
                )
            previous = self._overrides.pop(name, None)
            if config_override is not None:
                self._overrides[name] = config_override
            try:
                if is_ensemble(source):
                    self._load_members(source)
                self._sync(self._overridden(source), retry_failed=True)
            except BaseException:
                self._overrides.pop(name, None)
                if previous is not None:
                    self._overrides[name] = previous
                raise
        return [s for s in self._routing.index() if s.name == name]

    def _staged_source(self, name: str) -> ModelSource | None:
        root = self._file_roots.get(name)
        return None if root is None else scan_model(root, name)

    def _overridden(self, source: ModelSource) -> ModelSource:
        source = self._staged_source(source.name) or source
        override = self._overrides.get(source.name)
        return source if override is None else dataclasses.replace(source, config_override=override)

    def _load_members(self, source: ModelSource) -> None:
        """Load an ensemble's members that are not serving (Triton's explicit mode does the same)."""
        try:
            config, _ = read_config(source)
        except EdgeServerError:
            return  # _sync reports it
        steps, _ = parse_steps(config)
        for member in dict.fromkeys(step.model_name for step in steps):
            if not member or member in self._routing.serving() or member in self._loading_members:
                continue
            self._loading_members.add(member)  # an ensemble cycle must not recurse forever
            try:
                self.load(member)
            except EdgeServerError as exc:
                log.error("ensemble %s: member %s failed to load: %s", source.name, member, exc.message)
            finally:
                self._loading_members.discard(member)

    def unload(self, name: str) -> None:
        """Drain and unload every version of ``name``; its sessions and threads are gone on return."""
        if name not in self._routing.serving() and not self._index.of(name):
            raise UnknownModel(unknown_model(name))  # no name check first: Triton's unload never has one
        with self._changing(name):
            if name not in self._routing.serving() and not self._index.of(name):
                raise UnknownModel(unknown_model(name))
            self._unload(name)
            if self._file_roots.pop(name, None) is not None:
                self._staged.drop(name)
            self._unloaded.add(name)  # until loaded again, rescans and file changes leave it unloaded
            self._index.publish(name, [VersionStatus(name, None, ModelState.UNAVAILABLE, "unloaded")])

    def rescan(self, names: Iterable[str] | None = None, *, retry_failed: bool = True) -> None:
        """Reload what changed on disk among ``names`` (default: every model); unload removed models.

        Failures are logged and kept in the index; they never stop the rescan of the other models.
        ``retry_failed=False`` (the watcher) skips versions whose exact content already failed.
        The models this rescan will bring in count for the thread rule from the first one's load on
        (:func:`_planned_cpu_sessions`), so that no serving model ever has to be rebuilt for them.
        """
        with self._changing(None):
            self._check_open()
            if names is None:
                on_disk: dict[str, ModelSource | None] = dict(scan(self.repository))
                known = self._index.names()
                wanted = set(on_disk) | set(self._routing.serving()) | known
            else:
                wanted = set(names)
                on_disk = {name: scan_model(self.repository, name) for name in wanted}
            for name in self._file_roots.keys() & wanted:  # loaded from files given at load time
                on_disk[name] = self._staged_source(name)
            # Ensembles after the models they call, so that their steps validate against them.
            ordered = sorted(wanted - set(self._unloaded), key=lambda n: (is_ensemble(on_disk.get(n)), n))
            failed_ensembles: list[ModelSource] = []
            planned = {
                name: planned_cpu_sessions(on_disk.get(name))
                for name in ordered
                if name not in self._routing.serving()
            }
            finished: set[str] = set()

            def bring_in_line(name: str, source: ModelSource | None) -> None:
                try:
                    with self._model_lock(name):
                        self._check_open()
                        if name in self._unloaded:
                            return  # unloaded through the API meanwhile
                        if source is None:
                            if name in self._routing.serving():
                                log.info("model %s was removed from the repository; unloading", name)
                                self._unload(name)
                            self._index.publish(name, [])
                            with self._tables:
                                self._failed = {k: v for k, v in self._failed.items() if k[0] != name}
                            return
                        serving = self._routing.serving()  # one snapshot: each model counted once
                        coming = sum(
                            count
                            for other, count in planned.items()
                            if other != name and other not in finished and other not in serving
                        )
                        self._sync(self._overridden(source), retry_failed=retry_failed, coming=coming)
                except EdgeServerError as exc:
                    log.error("model %s: %s", name, exc.message)
                    if is_ensemble(source):
                        failed_ensembles.append(source)  # type: ignore[arg-type]
                except Exception:  # a bug of ours must not stop the other models' rescans
                    log.exception("rescanning model %s failed unexpectedly", name)
                finally:
                    finished.add(name)

            # Each model on a control thread of its own: a load that hangs in user code (or waits
            # for the lock of another operation on that model) holds up no other model.  One at a
            # time while loads are quick; an ensemble waits for its own members only.
            threads: dict[str, threading.Thread] = {}
            for name in ordered:
                source = on_disk.get(name)
                if is_ensemble(source):
                    for member in ensemble_members(source):
                        if member in threads:
                            threads[member].join()
                thread = threading.Thread(
                    target=bring_in_line, args=(name, source), name=f"edge-control-{name}", daemon=True
                )
                threads[name] = thread
                thread.start()
                thread.join(CONTROL_PATIENCE_S)
            for thread in threads.values():
                thread.join()
            if names is not None and any(name in self._routing.serving() for name in ordered):
                # A member that arrived may be what an ensemble loaded earlier was missing.
                failed_ensembles += self._unavailable_ensembles(exclude=set(ordered))
            self._retry_ensembles(failed_ensembles)

    def _unavailable_ensembles(self, *, exclude: set[str]) -> list[ModelSource]:
        names = self._index.names(ModelState.UNAVAILABLE) - set(self._routing.serving())
        found = []
        for name in sorted(names - exclude - set(self._unloaded)):
            source = scan_model(self.repository, name)
            if source is not None and is_ensemble(source):
                found.append(source)
        return found

    def _retry_ensembles(self, failed: list[ModelSource]) -> None:
        """Ensembles of ensembles load in name order: retry the failed ones while that helps."""
        while failed:
            still: list[ModelSource] = []
            for source in failed:
                try:
                    with self._model_lock(source.name):
                        self._check_open()
                        self._sync(source, retry_failed=True)
                except EdgeServerError:
                    still.append(source)
            if len(still) == len(failed):
                return
            failed = still

    def close(self, deadline: float | None = None) -> None:
        """Unload everything; later control calls fail.

        Every version drains (queued and running requests finish) until ``deadline`` (monotonic;
        default: now + the drain timeout), one deadline for all; what is still queued then fails with
        UNAVAILABLE.  A control operation stuck in user code (a hanging ``initialize``) does not hold
        this up: loads in progress are abandoned, and what they bring up later is closed.
        """
        if deadline is None:
            deadline = time.monotonic() + self._drain_timeout
        self._closing.set()
        with self._tables:
            self._closed = True
            serving = self._routing.serving()
            retiring = [loaded for versions in serving.values() for loaded in versions.values()]
            self._routing.switch({})
        self._retire(retiring, deadline=deadline)
        self._staged.close()

    def _model_lock(self, name: str) -> threading.RLock:
        with self._locks_lock:
            lock = self._model_locks.get(name)
            if lock is None:
                lock = self._model_locks[name] = threading.RLock()
            return lock

    @contextlib.contextmanager
    def _changing(self, name: str | None) -> Iterator[None]:
        """One control operation at a time on ``name``; afterwards, settle the heap if versions changed.

        ``name`` None: the caller takes each model's lock itself (a rescan, model by model).
        """
        with self._model_lock(name) if name is not None else contextlib.nullcontext():
            try:
                yield
            finally:
                if self._heap_changed and not self._closed:
                    self._heap_changed = False
                    settle_heap()

    def _check_open(self) -> None:
        if self._closed:
            raise ServerShuttingDown("the server is shutting down")

    def _unload(self, name: str) -> None:
        with self._tables:
            old = self._routing.serving().get(name, {})
            table = dict(self._routing.serving())
            table.pop(name, None)
            self._routing.switch(table)
        self._retire(list(old.values()))

    def _retire(
        self, versions: list[LoadedVersion], *, finish_sequences: bool = False, deadline: float | None = None
    ) -> None:
        """Drain and close ``versions``; with ``finish_sequences`` (a reload), live sequences end there."""
        if not versions:
            return
        # A copy replaced by a new copy of the same version number has no index row of its own.
        shown = [v for v in versions if v.version not in self._routing.serving().get(v.name, {})]
        for loaded in shown:
            self._index.set(loaded.name, loaded.version, ModelState.UNLOADING)
        for loaded in versions:  # all stop taking requests first, then they share one drain deadline
            loaded.scheduler.close_intake()
        if deadline is None:
            deadline = time.monotonic() + self._drain_timeout
        if finish_sequences:
            self._routing.hold(versions, held=True)
        for loaded in versions:
            loaded.retire(deadline, finish_sequences=finish_sequences)
            self._routing.hold([loaded], held=False)
            log.info("%s v%d unloaded", loaded.name, loaded.version)
        for loaded in shown:
            self._index.forget_unloading(loaded.name, loaded.version)
        shown.clear()
        versions.clear()  # drop our references before the heap is settled
        self._heap_changed = True

    # -- bringing one model in line with its files ---------------------------------------------

    def _sync(self, source: ModelSource, *, retry_failed: bool, coming: int = 0) -> None:
        """Bring ``name`` in line with its files; ``coming``: CPU sessions a rescan loads after it."""
        name = source.name
        current = self._routing.serving().get(name, {})
        config_signature = source.config_signature()
        try:
            config, warnings = read_config(source)
        except EdgeServerError as exc:
            self._fail_model(name, current, exc)
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
            self._fail_model(name, current, missing)
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
        config_changed = config_signature != source.config_signature()
        if config_changed:
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
        self._routing.hold(retiring, held=True)  # before the switch: a live sequence never misses it
        with self._tables:
            if self._closed:  # close() retired what served; what this load brought up goes too
                fresh = [v for key, v in ready.items() if current.get(key) is not v]
                closing = True
            else:
                closing = False
                table = dict(self._routing.serving())
                if ready:
                    table[name] = ready
                else:
                    table.pop(name, None)
                # The atomic switch: new requests go to the new versions from here on.
                self._routing.switch(table)
        if closing:
            self._routing.hold(retiring, held=False)
            for loaded in fresh:
                loaded.retire(time.monotonic())
            raise ServerShuttingDown("the server is shutting down")
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
        with self._tables:
            self._failed = {k: v for k, v in self._failed.items() if k[0] != name or k[1] in source.versions}
        self._retire(retiring, finish_sequences=True)
        if not ready:
            raise ModelNotReady(f"model {shorten(name)}: no version could be loaded ({_summary(failed)})")

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
        self._heap_changed = True
        log.info("%s v%d loading", name, version, extra={"model": name, "version": version})
        began = time.monotonic()
        try:
            loaded = load_abandonable(
                source,
                version,
                config,
                timeout=self.load_timeout,
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
                with self._tables:
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
        with self._tables:
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

    def _fail_model(self, name: str, current: Mapping[int, LoadedVersion], exc: EdgeServerError) -> None:
        log.error("model %s: %s", name, exc.message)
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
