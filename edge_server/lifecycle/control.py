"""Model control: load, unload, rescan and close, one model at a time, over every repository.

This module decides which model to bring in line and when; bringing one model in line with its files is
:mod:`edge_server.lifecycle.sync`, and publishing and draining is :mod:`edge_server.lifecycle.drain`.
What they decide is read through :mod:`edge_server.routing` (the routing table the request path reads
without a lock, swapped whole) and :mod:`edge_server.status_index` (the repository index and its
listeners).

Control operations run one at a time *per model*, under that model's lock, so that one model's slow
or stuck load never holds up another's (a rescan brings each model in line on a control thread of its
own).  A model whose name is in two repositories is refused (:class:`~edge_server.repository.DuplicateModel`,
as Triton refuses it): a copy that serves keeps serving, and the index says why the other is ignored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path, PurePosixPath

from edge_server.errors import (
    EdgeServerError,
    InvalidArgument,
    ModelNotFound,
    failed_to_poll,
    shorten,
)
from edge_server.lifecycle.drain import ServingTable
from edge_server.lifecycle.sync import ModelSync
from edge_server.load_files import StagedFiles
from edge_server.loader import (
    LoadEnvironment,
    ensemble_members,
    is_ensemble,
    planned_cpu_sessions,
    read_config,
)
from edge_server.pipeline.graph import parse_steps
from edge_server.repository import DuplicateModel, ModelSource, Repositories, check_model_name, scan_model
from edge_server.routing import Routing
from edge_server.status_index import UNLOADED, ModelState, StatusIndex, VersionStatus

log = logging.getLogger(__name__)


#: How long a rescan waits for one model's load before it starts the next beside it (loads that
#: finish sooner run one after the other, as they always did).
CONTROL_PATIENCE_S = 1.0

#: Default of ``--model-load-timeout-secs``: a load (instances created, warmed up) taking longer is
#: abandoned.
DEFAULT_LOAD_TIMEOUT_S = 600.0

# What a repository holds under a name: the model, a refusal (in two repositories), or nothing.
Found = ModelSource | DuplicateModel | None


class ModelManager:
    def __init__(
        self,
        repositories: Repositories,
        *,
        routing: Routing,
        index: StatusIndex,
        env: LoadEnvironment,
        drain_timeout: float = 30.0,
        load_timeout: float = DEFAULT_LOAD_TIMEOUT_S,
    ) -> None:
        """Control of the models of ``repositories``: what it loads it publishes in ``routing`` and ``index``.

        ``env`` is what every load gets (model access, engine rebuilder, thread policy, summaries).
        """
        self.repositories = repositories
        self._routing = routing
        self._index = index
        self._table = ServingTable(routing, index, drain_timeout=drain_timeout)
        self._closing = threading.Event()
        self._sync = ModelSync(self._table, index, env, load_timeout=load_timeout, closing=self._closing)
        # Lock order: a model's lock, then (for an ensemble) its members' locks, then the table's lock.
        self._locks_lock = threading.Lock()
        self._model_locks: dict[str, threading.RLock] = {}
        self._unloaded: set[str] = set()  # unloaded through the API: rescans leave them alone
        self._overrides: dict[str, str] = {}  # configs given at load time, until loaded without one
        self._staged = StagedFiles()  # files given at load time (Triton's file:), likewise
        self._file_roots: dict[str, Path] = {}  # model -> the staged root it loads from
        self._loading_members: set[str] = set()  # members an explicit ensemble load is bringing up

    def load(
        self,
        name: str,
        *,
        config_override: str | None = None,
        files: Mapping[PurePosixPath, bytes] | None = None,
    ) -> list[VersionStatus]:
        """Load or reload ``name`` from the repositories; raises if nothing of it can serve afterwards.

        Versions whose files did not change stay as they are; versions that failed before are tried
        again even if their files are the same (the failure may have been transient).
        ``config_override`` (JSON, Triton's load-time ``config``) replaces config.pbtxt until the model
        is loaded again without one; a load that fails keeps the previous choice.  ``files`` (Triton's
        load-time ``file:`` overrides, with a config) are the model's whole directory, staged outside
        the repositories (:mod:`edge_server.load_files`), likewise until it is loaded without them.
        A name in two repositories is refused (whatever of it serves keeps serving).
        """
        if name.startswith(".") and "/" not in name and name.strip() != "..":  # hidden: never a model
            raise ModelNotFound(failed_to_poll(name, "a name starting with '.' is hidden, never a model"))
        check_model_name(name)
        if files and config_override is None:
            raise InvalidArgument(
                failed_to_poll(name, "file overrides need the model's config too (the 'config' parameter)")
            )
        with self._changing(name):
            self._table.check_open()
            self._unloaded.discard(name)
            if files:
                self._file_roots[name] = self._staged.stage(name, files)
            elif self._file_roots.pop(name, None) is not None:
                self._staged.drop(name)
            source = self._staged_source(name) or self.repositories.locate(name)
            if isinstance(source, DuplicateModel):
                self._sync.fail_model(name, source)
                # Triton's words for a name it cannot poll (its clients match "failed to load 'X'")
                raise source.restated(failed_to_poll(name, source.message))
            if source is None:
                if name in self._routing.serving():
                    self._table.remove(name)
                raise ModelNotFound(
                    failed_to_poll(name, f"no model directory {shorten(name)} in {self.repositories}")
                )
            previous = self._overrides.pop(name, None)
            if config_override is not None:
                self._overrides[name] = config_override
            try:
                if is_ensemble(source):
                    self._load_members(source)
                self._sync.sync(self._overridden(source), retry_failed=True)
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
        """``source`` with the config given at load time (staged files: load and rescan look first)."""
        override = self._overrides.get(source.name)
        return source if override is None else dataclasses.replace(source, config_override=override)

    def _load_members(self, source: ModelSource) -> None:
        """Load an ensemble's members that are not serving (Triton's explicit mode does the same)."""
        try:
            config, _ = read_config(source)
        except EdgeServerError:
            return  # the sync reports it
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
        """Drain and unload every version of ``name``; its sessions and threads are gone on return.

        A name that is neither serving nor known is a no-op, as in Triton (L0_lifecycle unloads an
        unknown model and expects success); the name is only looked up, never joined to a path.
        """
        if name not in self._routing.serving() and not self._index.of(name):
            return
        with self._changing(name):
            if name not in self._routing.serving() and not self._index.of(name):
                return
            self._table.remove(name)
            if self._file_roots.pop(name, None) is not None:
                self._staged.drop(name)
            self._unloaded.add(name)  # until loaded again, rescans and file changes leave it unloaded
            self._publish_unloaded(name)

    def _publish_unloaded(self, name: str) -> None:
        """``name``'s rows after an unload: each version it had, UNAVAILABLE "unloaded", as in Triton.

        A model that had no version row (it never loaded one) gets one row without a version.
        """
        known = sorted({s.version for s in self._index.of(name).values() if s.version is not None})
        rows = [VersionStatus(name, v, ModelState.UNAVAILABLE, UNLOADED) for v in known]
        self._index.publish(name, rows or [VersionStatus(name, None, ModelState.UNAVAILABLE, UNLOADED)])

    def rescan(self, names: Iterable[str] | None = None, *, retry_failed: bool = True) -> None:
        """Reload what changed on disk among ``names`` (default: every model); unload removed models.

        Failures are logged and kept in the index; they never stop the rescan of the other models.
        ``retry_failed=False`` (the watcher) skips versions whose exact content already failed.
        The models this rescan will bring in count for the thread rule from the first one's load on
        (:func:`~edge_server.loader.planned_cpu_sessions`), so that no serving model ever has to be
        rebuilt for them.
        """
        with self._changing(None):
            self._table.check_open()
            if names is None:
                on_disk: dict[str, Found] = dict(self.repositories.scan())
                wanted = set(on_disk) | set(self._routing.serving()) | self._index.names()
            else:
                wanted = set(names)
                on_disk = {name: self.repositories.locate(name) for name in wanted}
            for name in self._file_roots.keys() & wanted:  # loaded from files given at load time
                on_disk[name] = self._staged_source(name)
            # Ensembles after the models they call, so that their steps validate against them.
            ordered = sorted(wanted - set(self._unloaded), key=lambda n: (_ensemble(on_disk.get(n)), n))
            failed_ensembles: list[ModelSource] = []
            planned = {
                name: planned_cpu_sessions(_model(on_disk.get(name)))
                for name in ordered
                if name not in self._routing.serving()
            }
            finished: set[str] = set()

            def bring_in_line(name: str, source: Found) -> None:
                try:
                    with self._model_lock(name):
                        self._bring_in_line(name, source, planned, finished, retry_failed=retry_failed)
                except EdgeServerError as exc:
                    log.error("model %s: %s", name, exc.message)
                    if isinstance(source, ModelSource) and is_ensemble(source):
                        failed_ensembles.append(source)
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
                if _ensemble(source):
                    for member in ensemble_members(_model(source)):
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

    def _bring_in_line(
        self, name: str, source: Found, planned: dict[str, int], finished: set[str], *, retry_failed: bool
    ) -> None:
        """One model of a rescan, under its lock: removed, refused as a duplicate, or synced."""
        self._table.check_open()
        if name in self._unloaded:
            return  # unloaded through the API meanwhile
        if isinstance(source, DuplicateModel):
            self._sync.fail_model(name, source)
            raise source
        if source is None:
            if name in self._routing.serving():
                log.info("model %s was removed from the repository; unloading", name)
                self._table.remove(name)
            # Triton keeps a model that left the repository in its index, UNAVAILABLE: a request
            # for it then reads "has no available versions" rather than "is not found"
            self._publish_unloaded(name)
            self._sync.forget(name)
            return
        serving = self._routing.serving()  # one snapshot: each model counted once
        coming = sum(
            count
            for other, count in planned.items()
            if other != name and other not in finished and other not in serving
        )
        self._sync.sync(self._overridden(source), retry_failed=retry_failed, coming=coming)

    def _unavailable_ensembles(self, *, exclude: set[str]) -> list[ModelSource]:
        names = self._index.names(ModelState.UNAVAILABLE) - set(self._routing.serving())
        found = []
        for name in sorted(names - exclude - set(self._unloaded)):
            source = self.repositories.locate(name)
            if isinstance(source, ModelSource) and is_ensemble(source):
                found.append(source)
        return found

    def _retry_ensembles(self, failed: list[ModelSource]) -> None:
        """Ensembles of ensembles load in name order: retry the failed ones while that helps."""
        while failed:
            still: list[ModelSource] = []
            for source in failed:
                try:
                    with self._model_lock(source.name):
                        self._table.check_open()
                        self._sync.sync(source, retry_failed=True)
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
            deadline = time.monotonic() + self._table.drain_timeout
        self._closing.set()
        self._table.close(deadline)
        self._staged.close()

    def thread_rule_now(self) -> tuple[str, int, int]:
        """The ONNX Runtime thread rule's inputs as they stand now: policy, CPU sessions, cores."""
        return self._sync.thread_rule_now()

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
                self._table.settle()


def _model(found: Found) -> ModelSource | None:
    return found if isinstance(found, ModelSource) else None


def _ensemble(found: Found) -> bool:
    return is_ensemble(_model(found))
