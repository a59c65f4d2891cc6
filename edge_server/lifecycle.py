"""Model lifecycle: which versions serve, and how they are replaced without failing a request.

Control operations (load, unload, rescan) run one at a time *per model*, under that model's lock, so
that one model's slow or stuck load never holds up another's; the routing table and the other shared
tables are replaced whole under a short ``_tables`` lock.  The request path reads the routing table
without any lock (it is replaced whole, never mutated, so a reader sees either the old table or the
new one).  A load runs on a thread of its own and is abandoned after ``load_timeout`` (a Python
model's ``initialize()`` that never returns): the version is UNAVAILABLE with that reason, the last
good version keeps serving, and whatever the abandoned thread loads later is closed.

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
import enum
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_server.backends.base import AUTO_ALONE_RULE
from edge_server.backends.tensorrt.rebuild import EngineRebuilder
from edge_server.config import ModelConfig
from edge_server.errors import EdgeServerError, ModelNotFound, ModelNotReady, ServerShuttingDown
from edge_server.loader import LoadedVersion, load_version, read_config
from edge_server.memory import settle_heap
from edge_server.pipeline.ensemble import EnsembleScheduler
from edge_server.pipeline.graph import declares_ensemble, parse_steps
from edge_server.repository import ModelSource, check_model_name, scan, scan_model
from edge_server.request import ModelAccess
from edge_server.scheduler.sequence import SequenceScheduler
from edge_server.scheduler.summaries import SummaryOptions

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
_Key = tuple[str, int | None]


#: Default of ``--model-load-timeout-secs``: a load (instances created, warmed up) taking longer is
#: abandoned.
DEFAULT_LOAD_TIMEOUT_S = 600.0


class ModelManager:
    def __init__(
        self,
        repository: Path,
        *,
        drain_timeout: float = 30.0,
        cpu_count: int | None = None,
        load_timeout: float = DEFAULT_LOAD_TIMEOUT_S,
    ) -> None:
        self.repository = repository
        self._drain_timeout = drain_timeout
        self._cpu_count = cpu_count
        self.load_timeout = load_timeout
        # Lock order: a model's lock, then (for an ensemble) its members' locks, then _tables; _tables
        # is held only for table swaps, never across a load, a drain or a listener call.
        self._locks_lock = threading.Lock()
        self._model_locks: dict[str, threading.RLock] = {}
        self._tables = threading.RLock()
        self._closing = threading.Event()
        self._serving: dict[str, dict[int, LoadedVersion]] = {}  # replaced whole, never mutated
        # Retiring sequence-model versions whose live sequences finish there (replaced whole, too).
        self._sequence_holders: dict[str, tuple[LoadedVersion, ...]] = {}
        self._status_lock = threading.Lock()
        self._status: dict[_Key, VersionStatus] = {}
        self._failed: dict[tuple[str, int], tuple[str, str]] = {}  # (name, version) -> (hash, reason)
        self._listeners: list[Listener] = []
        self._unloaded: set[str] = set()  # unloaded through the API: rescans leave them alone
        self._overrides: dict[str, str] = {}  # configs given at load time, until loaded without one
        self._closed = False
        self._heap_changed = False  # versions were loaded or freed since the heap was last settled
        self._access: ModelAccess | None = None
        self._loading_members: set[str] = set()  # members an explicit ensemble load is bringing up
        # --metrics-config summary_latencies=true: versions keep latency quantiles (set by Server)
        self.latency_summaries: SummaryOptions | None = None
        # --onnxruntime-thread-policy (set by Server): auto, default or split; see _stale_threads
        self.onnxruntime_thread_policy = "auto"

    def attach(self, access: ModelAccess) -> None:
        """Give the models loaded from now on their way to other models (ensembles, BLS calls)."""
        self._access = access
        # --engine-build on-load: stale TensorRT plans are rebuilt while their ONNX serves (set by Server)
        self.engine_rebuilder: EngineRebuilder | None = None

    # -- request path ---------------------------------------------------------------------------

    def resolve(self, name: str, version: int | None = None) -> LoadedVersion:
        """The version a request for ``name`` (and ``version``, or the latest) goes to."""
        versions = self._serving.get(name)
        if versions:
            found = versions[max(versions)] if version is None else versions.get(version)
            if found is not None:
                if found.members:
                    self._check_members(found)
                return found
        check_model_name(name)
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

    def _check_members(self, ensemble: LoadedVersion) -> None:
        """An ensemble is ready only while every member serves and its steps fit the members' configs.

        One level: members check theirs.  A member's reload may have changed its tensors (see
        ``EnsembleScheduler.members_fit``).
        """
        configs = {}
        for member, version in ensemble.members:
            versions = self._serving.get(member)
            if not versions or (version is not None and version not in versions):
                which = f"{member!r}" + (f" version {version}" if version is not None else "")
                raise ModelNotReady(
                    f"ensemble {ensemble.name!r} is not ready: its member {which} is not serving"
                )
            configs[(member, version)] = versions[max(versions) if version is None else version].config
        if isinstance(ensemble.scheduler, EnsembleScheduler):
            why = ensemble.scheduler.members_fit(configs)
            if why:
                raise ModelNotReady(f"ensemble {ensemble.name!r} is not ready: {why}")

    def sequence_holder(self, name: str, correlation_id: int | str) -> LoadedVersion | None:
        """The retiring version of ``name`` on which sequence ``correlation_id`` is still live, if any."""
        for loaded in self._sequence_holders.get(name, ()):
            scheduler = loaded.scheduler
            if isinstance(scheduler, SequenceScheduler) and scheduler.holds(correlation_id):
                return loaded
        return None

    def _hold_sequences(self, versions: list[LoadedVersion], *, held: bool) -> None:
        """Let (or stop letting) the live sequences of retiring ``versions`` be routed to them."""
        with self._tables:
            table = dict(self._sequence_holders)
            for loaded in versions:
                if loaded.config.sequence_batching is None:
                    continue
                others = tuple(v for v in table.get(loaded.name, ()) if v is not loaded)
                table[loaded.name] = (*others, loaded) if held else others
                if not table[loaded.name]:
                    del table[loaded.name]
            self._sequence_holders = table

    # -- index ----------------------------------------------------------------------------------

    def index(self) -> list[VersionStatus]:
        """Every version the manager knows: serving, loading, unloading or failed (with why).

        A loaded ensemble whose member is not serving shows as UNAVAILABLE with the member named.
        """
        with self._status_lock:
            rows = sorted(self._status.values(), key=lambda s: (s.name, -(s.version or 0)))
        return [self._with_members(row) for row in rows]

    def _with_members(self, row: VersionStatus) -> VersionStatus:
        if row.state is not ModelState.READY or row.version is None:
            return row
        loaded = self._serving.get(row.name, {}).get(row.version)
        if loaded is None or not loaded.members:
            return row
        try:
            self._check_members(loaded)
        except ModelNotReady as exc:
            return VersionStatus(row.name, row.version, ModelState.UNAVAILABLE, exc.message)
        return row

    def serving(self) -> dict[str, dict[int, LoadedVersion]]:
        return self._serving

    def add_listener(self, listener: Listener) -> None:
        """Called on every state change (metrics, systemd STATUS lines, logs); must not block."""
        self._listeners.append(listener)

    def _set(self, name: str, version: int | None, state: ModelState, reason: str = "") -> None:
        status = VersionStatus(name, version, state, reason)
        with self._status_lock:
            if version is not None:
                self._status.pop((name, None), None)
            unchanged = self._status.get((name, version)) == status
            self._status[(name, version)] = status
        if not unchanged:
            self._notify(status)

    def _publish(self, name: str, rows: list[VersionStatus]) -> None:
        """Replace every index row of ``name`` with ``rows`` (versions being retired keep theirs)."""
        keep = {(r.name, r.version) for r in rows}
        with self._status_lock:
            stale = [
                key
                for key, s in self._status.items()
                if key[0] == name and key not in keep and s.state is not ModelState.UNLOADING
            ]
            for key in stale:
                del self._status[key]
            changed = [r for r in rows if self._status.get((r.name, r.version)) != r]
            for row in rows:
                self._status[(row.name, row.version)] = row
        for row in changed:
            self._notify(row)

    def _notify(self, status: VersionStatus) -> None:
        for listener in self._listeners:
            try:
                listener(status)
            except Exception:  # a broken listener must not stop a swap half-way
                log.exception("model state listener failed on %s", status)

    # -- control --------------------------------------------------------------------------------

    def load(self, name: str, *, config_override: str | None = None) -> list[VersionStatus]:
        """Load or reload ``name`` from the repository; raises if nothing of it can serve afterwards.

        Versions whose files did not change stay as they are; versions that failed before are tried
        again even if their files are the same (the failure may have been transient).
        ``config_override`` (JSON, Triton's load-time ``config``) replaces config.pbtxt until the model
        is loaded again without one; a load that fails keeps the previous choice.
        """
        check_model_name(name)
        with self._changing(name):
            self._check_open()
            self._unloaded.discard(name)
            source = scan_model(self.repository, name)
            if source is None:
                if name in self._serving:
                    self._unload(name)
                raise ModelNotFound(f"no model directory {name!r} in {self.repository}")
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
        if name not in self._loading_members:  # an ensemble's member: the ensemble's load does it
            self._rebuild_alone_no_more()
        return [s for s in self.index() if s.name == name]

    def _overridden(self, source: ModelSource) -> ModelSource:
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
            if not member or member in self._serving or member in self._loading_members:
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
        check_model_name(name)
        with self._changing(name):
            if name not in self._serving and not any(s.name == name for s in self.index()):
                raise ModelNotFound(f"unknown model {name!r}")
            self._unload(name)
            self._unloaded.add(name)  # until loaded again, rescans and file changes leave it unloaded
            self._publish(name, [VersionStatus(name, None, ModelState.UNAVAILABLE, "unloaded")])

    def rescan(
        self, names: Iterable[str] | None = None, *, retry_failed: bool = True, rebuild_threads: bool = True
    ) -> None:
        """Reload what changed on disk among ``names`` (default: every model); unload removed models.

        Failures are logged and kept in the index; they never stop the rescan of the other models.
        ``retry_failed=False`` (the watcher) skips versions whose exact content already failed.
        ``rebuild_threads``: afterwards, rebuild models that ONNX Runtime's defaults no longer suit.
        """
        with self._changing(None):
            self._check_open()
            if names is None:
                on_disk: dict[str, ModelSource | None] = dict(scan(self.repository))
                with self._status_lock:
                    known = {key[0] for key in self._status}
                wanted = set(on_disk) | set(self._serving) | known
            else:
                wanted = set(names)
                on_disk = {name: scan_model(self.repository, name) for name in wanted}
            # Ensembles after the models they call, so that their steps validate against them.
            ordered = sorted(wanted - set(self._unloaded), key=lambda n: (is_ensemble(on_disk.get(n)), n))
            failed_ensembles: list[ModelSource] = []
            for name in ordered:
                source = on_disk.get(name)
                try:
                    with self._model_lock(name):
                        self._check_open()
                        if name in self._unloaded:
                            continue  # unloaded through the API meanwhile
                        if source is None:
                            if name in self._serving:
                                log.info("model %s was removed from the repository; unloading", name)
                                self._unload(name)
                            self._publish(name, [])
                            with self._tables:
                                self._failed = {k: v for k, v in self._failed.items() if k[0] != name}
                        else:
                            self._sync(self._overridden(source), retry_failed=retry_failed)
                except EdgeServerError as exc:
                    log.error("model %s: %s", name, exc.message)
                    if is_ensemble(source):
                        failed_ensembles.append(source)  # type: ignore[arg-type]
            if names is not None and any(name in self._serving for name in ordered):
                # A member that arrived may be what an ensemble loaded earlier was missing.
                failed_ensembles += self._unavailable_ensembles(exclude=set(ordered))
            self._retry_ensembles(failed_ensembles)
        if rebuild_threads:
            self._rebuild_alone_no_more()

    def _unavailable_ensembles(self, *, exclude: set[str]) -> list[ModelSource]:
        with self._status_lock:
            names = {
                key[0]
                for key, status in self._status.items()
                if status.state is ModelState.UNAVAILABLE and key[0] not in self._serving
            }
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
            retiring = [loaded for versions in self._serving.values() for loaded in versions.values()]
            self._serving = {}
        self._retire(retiring, deadline=deadline)

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
            old = self._serving.get(name, {})
            table = dict(self._serving)
            table.pop(name, None)
            self._switch(table)
        self._retire(list(old.values()))

    def _switch(self, table: dict[str, dict[int, LoadedVersion]]) -> None:
        """Serve ``table`` from now on (``_tables`` held), telling its versions whether one is alone."""
        self._serving = table
        alone = sum(len(versions) for versions in table.values()) == 1
        for versions in table.values():
            for loaded in versions.values():
                loaded.scheduler.set_alone(alone)

    def _retire(
        self, versions: list[LoadedVersion], *, finish_sequences: bool = False, deadline: float | None = None
    ) -> None:
        """Drain and close ``versions``; with ``finish_sequences`` (a reload), live sequences end there."""
        if not versions:
            return
        # A copy replaced by a new copy of the same version number has no index row of its own.
        shown = [v for v in versions if v.version not in self._serving.get(v.name, {})]
        for loaded in shown:
            self._set(loaded.name, loaded.version, ModelState.UNLOADING)
        for loaded in versions:  # all stop taking requests first, then they share one drain deadline
            loaded.scheduler.close_intake()
        if deadline is None:
            deadline = time.monotonic() + self._drain_timeout
        if finish_sequences:
            self._hold_sequences(versions, held=True)
        for loaded in versions:
            loaded.retire(deadline, finish_sequences=finish_sequences)
            self._hold_sequences([loaded], held=False)
            log.info("%s v%d unloaded", loaded.name, loaded.version)
        for loaded in shown:
            with self._status_lock:
                status = self._status.get((loaded.name, loaded.version))
                if status is not None and status.state is ModelState.UNLOADING:
                    del self._status[(loaded.name, loaded.version)]
        shown.clear()
        versions.clear()  # drop our references before the heap is settled
        self._heap_changed = True

    # -- bringing one model in line with its files ---------------------------------------------

    def _sync(self, source: ModelSource, *, retry_failed: bool) -> None:
        name = source.name
        current = self._serving.get(name, {})
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
                source, version, config, config_hash, current.get(version), retry_failed=retry_failed
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
        self._hold_sequences(retiring, held=True)  # before the switch: a live sequence never misses it
        with self._tables:
            if self._closed:  # close() retired what served; what this load brought up goes too
                fresh = [v for key, v in ready.items() if current.get(key) is not v]
                closing = True
            else:
                closing = False
                table = dict(self._serving)
                if ready:
                    table[name] = ready
                else:
                    table.pop(name, None)
                self._switch(table)  # the atomic switch: new requests go to the new versions from here on
        if closing:
            self._hold_sequences(retiring, held=False)
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
        self._publish(name, rows)
        with self._tables:
            self._failed = {k: v for k, v in self._failed.items() if k[0] != name or k[1] in source.versions}
        self._retire(retiring, finish_sequences=True)
        if not ready:
            raise ModelNotReady(f"model {name!r}: no version could be loaded ({_summary(failed)})")

    def _bring_up(
        self,
        source: ModelSource,
        version: int,
        config: ModelConfig,
        config_hash: str,
        existing: LoadedVersion | None,
        *,
        retry_failed: bool,
    ) -> LoadedVersion | str:
        """The loaded version (``existing`` when its content is unchanged), or why it did not load."""
        name = source.name
        signature = source.version_signature(version)
        content_hash = config_hash + source.version_hash(version)
        if (
            existing is not None
            and existing.content_hash == content_hash
            and not self._alone_no_more(existing)
        ):
            return existing
        known = self._failed.get((name, version))
        if known is not None and known[0] == content_hash and not retry_failed:
            return known[1]
        self._set(name, version, ModelState.LOADING, "replacing the serving copy" if existing else "")
        self._heap_changed = True
        log.info("%s v%d loading", name, version, extra={"model": name, "version": version})
        began = time.monotonic()
        try:
            loaded = self._load_in_thread(
                source,
                version,
                config,
                content_hash=content_hash,
                cpu_count=self._cpu_count,
                access=self._access,
                rebuilder=self.engine_rebuilder,
                sharing=self._cpu_onnxruntime_instances(exclude=(name, version)),
                thread_policy=self.onnxruntime_thread_policy,
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
        if self.latency_summaries is not None:
            loaded.stats.enable_summaries(self.latency_summaries)
        log.info(
            "%s v%d ready: %s, in %.2f s",
            name,
            version,
            describe_placement(loaded.devices, ensemble=bool(loaded.members) or not loaded.devices),
            time.monotonic() - began,
            extra={"model": name, "version": version},
        )
        return loaded

    @property
    def cpu_count(self) -> int:
        """The cores the ONNX Runtime thread rule divides (the loader's default: this machine's)."""
        return self._cpu_count or os.cpu_count() or 1

    def cpu_onnxruntime_instances(self) -> int:
        """CPU ONNX Runtime sessions of every serving version (the thread rule's count, as it is now)."""
        return self._cpu_onnxruntime_instances()

    def _cpu_onnxruntime_instances(self, *, exclude: tuple[str, int] | None = None) -> int:
        """CPU ONNX Runtime sessions of every serving version but ``exclude`` (the one being replaced)."""
        return sum(
            loaded.cpu_onnxruntime_instances
            for name, versions in self._serving.items()
            for version, loaded in versions.items()
            if (name, version) != exclude
        )

    def _alone_no_more(self, loaded: LoadedVersion) -> bool:
        """Whether ``loaded`` has ONNX Runtime's default threads from ``auto`` and others loaded since.

        Its spinning workers would steal the newcomers' cores, and a session cannot change its threads:
        it is built again, as a hot reload does (the old one serves until the new one is ready).
        """
        settings = loaded.thread_settings
        if settings is None or settings["rule"] != AUTO_ALONE_RULE:
            return False
        return self._cpu_onnxruntime_instances(exclude=(loaded.name, loaded.version)) > 0

    def _rebuild_alone_no_more(self) -> None:
        """Reload the versions :meth:`_alone_no_more` names (after a load or a rescan brought others)."""
        stale = sorted(
            {
                v.name
                for versions in self._serving.values()
                for v in versions.values()
                if self._alone_no_more(v)
            }
        )
        if not stale or self._closed:
            return
        log.info(
            "%s: built with ONNX Runtime's default threads as the only CPU ONNX Runtime model; other "
            "models loaded since, so rebuilding with the cores split (--onnxruntime-thread-policy auto)",
            ", ".join(stale),
        )
        try:
            self.rescan(stale, rebuild_threads=False)  # once: a reload that fails keeps the old one serving
        except EdgeServerError as exc:  # shutting down meanwhile; per-model failures are logged by rescan
            log.warning("rebuilding %s with split threads: %s", ", ".join(stale), exc.message)

    def _load_in_thread(self, source: ModelSource, version: int, *args: Any, **kwargs: Any) -> LoadedVersion:
        """``load_version`` on a thread of its own, given up after ``load_timeout`` or at close().

        Python cannot stop a thread, so a load that does not finish in time (user code stuck in
        ``initialize()``) is abandoned: its thread runs on, and closes what it loaded if it ever ends.
        """
        future: Future[LoadedVersion] = Future()

        def run() -> None:
            try:
                future.set_result(load_version(source, version, *args, **kwargs))
            except BaseException as exc:
                future.set_exception(exc)

        # Woken by the load's end (not a poll: every load would last a whole poll period), and at
        # least every 0.25 s to look at close() and the deadline.
        finished = threading.Event()
        future.add_done_callback(lambda _: finished.set())
        thread = threading.Thread(target=run, name=f"edge-load-{source.name}-{version}", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.load_timeout
        while not future.done():
            finished.wait(min(0.25, max(0.0, deadline - time.monotonic())))
            if future.done():
                break
            if self._closing.is_set():
                future.add_done_callback(_close_abandoned)
                raise ServerShuttingDown("the server is shutting down")
            if time.monotonic() >= deadline and not future.done():
                future.add_done_callback(_close_abandoned)
                log.error(
                    "%s v%d did not finish loading within %g s (--model-load-timeout-secs); its load "
                    "thread %s is abandoned (a Python model's initialize() may be stuck)",
                    source.name,
                    version,
                    self.load_timeout,
                    thread.name,
                )
                raise ModelNotReady(
                    f"{source.name} v{version} did not finish loading within {self.load_timeout:g} s "
                    "(--model-load-timeout-secs); its initialize() may be stuck, and its thread was "
                    "abandoned"
                )
        return future.result()

    def _fail_model(self, name: str, current: dict[int, LoadedVersion], exc: EdgeServerError) -> None:
        log.error("model %s: %s", name, exc.message)
        rows = [
            VersionStatus(name, v, ModelState.READY, f"still serving; the new files failed: {exc.message}")
            for v in current
        ]
        rows.append(VersionStatus(name, None, ModelState.UNAVAILABLE, exc.message))
        self._publish(name, rows)


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


def _close_abandoned(future: Future[LoadedVersion]) -> None:
    """An abandoned load that ended after all: free what it brought up (it never took traffic)."""
    if future.cancelled() or future.exception() is not None:
        return
    loaded = future.result()
    log.warning("%s v%d: an abandoned load finished late; closing it", loaded.name, loaded.version)
    loaded.retire(time.monotonic())


def _summary(failed: dict[int, str]) -> str:
    return "; ".join(f"v{v}: {reason}" for v, reason in sorted(failed.items())) or "nothing to load"


def is_ensemble(source: ModelSource | None) -> bool:
    return source is not None and declares_ensemble(source.config_path)
