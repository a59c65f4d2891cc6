"""Which version a request goes to: an immutable routing table, swapped whole, and its read-only view.

The request path reads the current :class:`RoutingTable` without a lock: it is replaced whole, never
changed, so a reader sees either the old table or the new one.  Only the lifecycle's control swaps it
(:meth:`Routing.switch`, :meth:`Routing.hold`); everyone else (the data plane, KServe, metrics, the
supervisor, ``status``) gets the :class:`RoutingView`, which can only read.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from edge_server.errors import ModelNotFound, ModelNotReady, UnknownModel, unknown_model
from edge_server.loader import LoadedVersion
from edge_server.pipeline.ensemble import EnsembleScheduler
from edge_server.repository import check_model_name
from edge_server.scheduler.sequence import SequenceScheduler
from edge_server.status_index import ModelState, StatusIndex, VersionStatus

Serving = Mapping[str, Mapping[int, LoadedVersion]]


@dataclass(frozen=True)
class RoutingTable:
    """What serves now (name -> version -> loaded version), and where live sequences still run.

    ``holders``: retiring versions whose live sequences finish there (a reload lets a sequence end on
    the version it started on).
    """

    serving: Serving = field(default_factory=dict)
    holders: Mapping[str, tuple[LoadedVersion, ...]] = field(default_factory=dict)


class RoutingView(Protocol):
    """What the request path and the observers may ask; nothing here changes what is served."""

    def serving(self) -> Serving: ...

    def resolve(self, name: str, version: int | None = None) -> LoadedVersion: ...

    def sequence_holder(
        self, name: str, correlation_id: int | str, owner: int | None = None
    ) -> LoadedVersion | None: ...

    def index(self) -> list[VersionStatus]: ...


class Routing:
    """The current routing table (see the module doc) over the repository index."""

    def __init__(self, index: StatusIndex) -> None:
        self._index = index
        self._table = RoutingTable()
        self._swap = threading.Lock()  # one swap at a time; readers never take it

    # -- the read-only view ---------------------------------------------------------------------

    def serving(self) -> Serving:
        return self._table.serving

    def resolve(self, name: str, version: int | None = None) -> LoadedVersion:
        """The version a request for ``name`` (and ``version``, or the latest) goes to."""
        versions = self._table.serving.get(name)
        if versions:
            found = versions[max(versions)] if version is None else versions.get(version)
            if found is not None:
                if found.members:
                    self._check_members(found)
                return found
        check_model_name(name)
        known = self._index.of(name)
        if not known and not versions:
            raise UnknownModel(unknown_model(name))
        status = known.get((name, version)) if version is not None else None
        if status is not None:
            raise ModelNotReady(
                unknown_model(name, f"version {version} is not at ready state")
                + f" ({status.state.value}: {status.reason})"
            )
        if version is not None:
            available = sorted(versions or {})
            raise ModelNotFound(
                unknown_model(name, f"version {version} is not found") + f" (serving versions: {available})"
            )
        reasons = "; ".join(f"v{s.version}: {s.state.value} {s.reason}".strip() for s in known.values())
        raise ModelNotReady(unknown_model(name, f"has no available versions ({reasons})"))

    def sequence_holder(
        self, name: str, correlation_id: int | str, owner: int | None = None
    ) -> LoadedVersion | None:
        """The retiring version of ``name`` on which ``owner``'s sequence ``correlation_id`` is live."""
        for loaded in self._table.holders.get(name, ()):
            scheduler = loaded.scheduler
            if isinstance(scheduler, SequenceScheduler) and scheduler.holds(correlation_id, owner):
                return loaded
        return None

    def index(self) -> list[VersionStatus]:
        """Every version known: serving, loading, unloading or failed (with why).

        A loaded ensemble whose member is not serving shows as UNAVAILABLE with the member named.
        """
        return [self._with_members(row) for row in self._index.rows()]

    def _with_members(self, row: VersionStatus) -> VersionStatus:
        if row.state is not ModelState.READY or row.version is None:
            return row
        loaded = self._table.serving.get(row.name, {}).get(row.version)
        if loaded is None or not loaded.members:
            return row
        try:
            self._check_members(loaded)
        except ModelNotReady as exc:
            return VersionStatus(row.name, row.version, ModelState.UNAVAILABLE, exc.message)
        return row

    def _check_members(self, ensemble: LoadedVersion) -> None:
        """An ensemble is ready only while every member serves and its steps fit the members' configs.

        One level: members check theirs.  A member's reload may have changed its tensors (see
        ``EnsembleScheduler.members_fit``).
        """
        serving = self._table.serving
        configs = {}
        for member, version in ensemble.members:
            versions = serving.get(member)
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

    # -- swaps (the lifecycle's control only) ---------------------------------------------------

    def switch(self, serving: Serving) -> None:
        """Serve ``serving`` from now on, telling every version whether it is the daemon's only one."""
        sole = sum(len(versions) for versions in serving.values()) == 1
        with self._swap:  # held while telling, so that two swaps never tell in crossed order
            self._table = replace(self._table, serving=serving)
            for versions in serving.values():
                for loaded in versions.values():
                    loaded.scheduler.set_sole_version(sole)

    def hold(self, versions: Iterable[LoadedVersion], *, held: bool) -> None:
        """Let (or stop letting) the live sequences of retiring ``versions`` be routed to them."""
        with self._swap:
            table = dict(self._table.holders)
            for loaded in versions:
                if loaded.config.sequence_batching is None:
                    continue
                others = tuple(v for v in table.get(loaded.name, ()) if v is not loaded)
                table[loaded.name] = (*others, loaded) if held else others
                if not table[loaded.name]:
                    del table[loaded.name]
            self._table = replace(self._table, holders=table)
