"""Who owns which region: one registry with ownership and quotas, and the one rule for using a region.

Every way in (the IPC frontend, KServe HTTP and gRPC) registers regions here and looks them up here;
a frontend only supplies who its peer is, as an :class:`Owner`:

* IPC: the uid of the connection (``SO_PEERCRED``) and the connection itself, so regions are per
  connection and go when it does;
* KServe: the uid owning the client's TCP socket (the kernel's socket table), and no connection:
  HTTP clients reconnect at will, so a user's regions are shared by all of its connections.

**A region belongs to the owner that registered it** (:func:`may_use`): nobody else finds it by name,
sees it in a status, uses it in a request, unregisters it or replaces it; unregistering everything
drops only the caller's own.  Names are per owner, so another user registering the same name gets a
region of its own and never receives the first user's outputs.  Quotas bound what one client and one
user may hold, beside the daemon-wide table and the descriptor budget (a mapped region holds two).

**Unregistering waits for the requests that write into a region** (as Triton does): a request holds
the regions its outputs go to (:meth:`Registry.hold`, a :class:`Lease` that lets go when the request
is done with it), and a region unregistered meanwhile stays listed, unusable by new requests and its
name taken, until the last lease goes.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any, NamedTuple

from edge_server.errors import InvalidArgument, ShmAlreadyRegistered, ShmNotRegistered, ShmUnavailable
from edge_server.shm.access import may_access
from edge_server.shm.region import Region, Segment, open_region

DEFAULT_MAX_REGIONS = 256
DEFAULT_MAX_REGIONS_PER_USER = 64


class Owner(NamedTuple):
    """Who registers and uses regions: a uid, and (IPC) the connection that scopes its names.

    A tuple, so that the lookups every request makes hash and compare it in C.
    """

    uid: int
    scope: Any = None


def may_use(peer: Owner, region: Region, *, write: bool = False) -> bool:
    """The one access rule: only the region's owner, and (segments opened by key) only as its bits allow.

    A descriptor the client handed over proves by itself that the client may use the memory; a
    segment the daemon opened by key is checked again on every use, as ``open(2)`` would check it,
    since its owner may have changed its mode since.
    """
    return check_use(peer, region, write=write)[0]


def check_use(peer: Owner, region: Region, *, write: bool) -> tuple[bool, int | None]:
    """:func:`may_use`, with the segment's current size from the same ``fstat`` (None where not taken).

    A read or write of a segment opened by key needs both (its owner may have shrunk it), and one
    ``fstat`` answers both: the request path takes one per region and use, not one per question.
    """
    if region.owner != peer:
        return False, None
    segment = region.segment
    if segment.proven:
        return True, None
    st = os.fstat(segment.fd)
    return may_access(peer.uid, st, write=write), st.st_size


class Registry:
    """Regions by owner and name; safe to call from any thread.

    ``max_regions``: the daemon-wide table; ``max_per_user``: what one uid may hold over all its
    connections; ``max_per_client``: what one owner (one IPC connection) may hold;
    ``max_descriptors``: descriptors all regions together may hold (None: no such limit), of which one
    user may hold ``user_share`` (half: one user can never take every other user's room).
    """

    def __init__(
        self,
        *,
        max_regions: int = DEFAULT_MAX_REGIONS,
        max_per_user: int | None = DEFAULT_MAX_REGIONS_PER_USER,
        max_per_client: int | None = None,
        max_descriptors: int | None = None,
        user_share: float = 0.5,
    ) -> None:
        self.max_regions = max_regions
        self.user_share = user_share
        self.max_per_user = max_per_user
        self.max_per_client = max_per_client
        self.max_descriptors = max_descriptors
        self._lock = threading.Lock()
        self._owned: dict[Owner, dict[str, Region]] = {}
        self._per_uid: collections.Counter[int] = collections.Counter()
        self._uid_descriptors: collections.Counter[int] = collections.Counter()
        self._count = 0
        self._descriptors = 0

    # -- registering ------------------------------------------------------------------------------

    def register(
        self, owner: Owner, name: str, segment: Segment, byte_size: int | None, base: int = 0
    ) -> Region:
        """Register ``byte_size`` bytes from ``base`` of ``segment`` as ``owner``'s region ``name``.

        The segment's descriptor belongs to the registry from here on: a refused registration closes
        it at once (a refused client must not keep daemon descriptors open).
        """
        try:
            with self._lock:
                self._admit(owner, name, 1)
            region = open_region(name, segment, byte_size, base)
        except BaseException:
            os.close(segment.fd)
            raise
        region.owner = owner
        with self._lock:
            try:
                self._admit(owner, name, region.descriptors)
            except BaseException:
                region.discard()
                raise
            self._owned.setdefault(owner, {})[name] = region
            self._per_uid[owner.uid] += 1
            self._uid_descriptors[owner.uid] += region.descriptors
            self._count += 1
            self._descriptors += region.descriptors
        return region

    def _admit(self, owner: Owner, name: str, descriptors: int) -> None:
        """Refuse a registration that would break a rule or a quota (called under the lock)."""
        mine = self._owned.get(owner, {})
        if name in mine:
            raise ShmAlreadyRegistered(
                f"shared memory region {name!r} already in manager (this client registered it; unregister "
                "it first)"
            )
        if self.max_per_client is not None and len(mine) >= self.max_per_client:
            raise InvalidArgument(f"a client may register at most {self.max_per_client} regions")
        if self.max_per_user is not None and self._per_uid[owner.uid] >= self.max_per_user:
            raise InvalidArgument(
                f"a user may register at most {self.max_per_user} shared-memory regions per user "
                f"(uid {owner.uid} holds {self._per_uid[owner.uid]})"
            )
        if self._count >= self.max_regions:
            raise InvalidArgument(f"at most {self.max_regions} shared-memory regions may be registered")
        if self.max_descriptors is None:
            return
        share = max(2, int(self.max_descriptors * self.user_share))
        held = self._uid_descriptors[owner.uid]
        if held + descriptors > share:
            raise ShmUnavailable(
                f"uid {owner.uid}'s shared-memory regions hold {held} descriptors, "
                f"the most one user may ({share}, its share per user of the descriptor budget); unregister "
                "regions first"
            )
        if self._descriptors + descriptors > self.max_descriptors:
            raise ShmUnavailable(
                f"the daemon's shared-memory regions hold {self._descriptors} descriptors, its limit is "
                f"{self.max_descriptors} (the descriptor budget); unregister regions or retry later"
            )

    def unregister(self, owner: Owner, name: str | None, *, missing_ok: bool = False) -> list[str]:
        """Unregister ``owner``'s region ``name``, or all of its regions when ``name`` is None."""
        with self._lock:
            mine = self._owned.get(owner, {})
            if name is None:
                names = list(mine)
            elif name in mine:
                names = [name]
            elif missing_ok:
                names = []
            else:
                raise ShmNotRegistered(_not_found(name, "shared memory"))
            gone = []
            for key in names:
                region = mine[key]
                region.retired = True
                if region.holds == 0:  # else the last lease removes it
                    self._remove(region)
                    gone.append(region)
        for region in gone:
            region.release()
        return names

    def _remove(self, region: Region) -> None:
        """Take ``region`` out of the table (called under the lock)."""
        owner = region.owner
        assert isinstance(owner, Owner)
        mine = self._owned.get(owner, {})
        if mine.get(region.name) is not region:
            return
        del mine[region.name]
        if not mine:
            self._owned.pop(owner, None)
        self._per_uid[owner.uid] -= 1
        self._uid_descriptors[owner.uid] -= region.descriptors
        if self._per_uid[owner.uid] <= 0:
            del self._per_uid[owner.uid]
            del self._uid_descriptors[owner.uid]
        self._count -= 1
        self._descriptors -= region.descriptors

    def hold(self, owner: Owner, name: object, where: str) -> Lease:
        """``owner``'s region ``name`` for a request's outputs, kept registered until the lease goes."""
        region, _size = self.access(owner, name, where, write=True, hold=True)
        return Lease(self, region)

    def _let_go(self, region: Region) -> None:
        with self._lock:
            region.holds -= 1
            done = region.retired and region.holds == 0
            if done:
                self._remove(region)
        if done:
            region.release()

    # -- looking up -------------------------------------------------------------------------------

    def regions(self, owner: Owner, name: str | None = None) -> list[Region]:
        """``owner``'s regions (or its region ``name``: ShmNotRegistered if it has none so named)."""
        with self._lock:
            mine = dict(self._owned.get(owner, {}))
        if name is None:
            return list(mine.values())
        if name not in mine:
            raise ShmNotRegistered(_not_found(name, "system shared memory"))
        return [mine[name]]

    def use(self, owner: Owner, name: object, where: str, *, write: bool = False) -> Region:
        """The region ``name`` of ``owner`` for one request, after :func:`may_use`.

        Another owner's region of that name is never found: the error is the same as for a name
        nobody registered, so a stranger learns nothing about other users' names.
        """
        return self.access(owner, name, where, write=write)[0]

    def access(
        self, owner: Owner, name: object, where: str, *, write: bool = False, hold: bool = False
    ) -> tuple[Region, int | None]:
        """:meth:`use`, with the segment's current size from the permission check's ``fstat``.

        ``hold``: also count a hold on the region, under the same lock as the lookup (a caller that
        asks for one lets go of it with :meth:`_let_go`, through a :class:`Lease`).  The size is None
        for a descriptor the client handed over (never re-checked: it cannot shrink under a mapping).
        """
        if not isinstance(name, str):
            raise InvalidArgument(f"{where}: a shared-memory region name must be a string")
        with self._lock:
            mine = self._owned.get(owner)
            region = None if mine is None else mine.get(name)
            if region is None or region.retired:  # the names for the message, only when it is needed
                known = [] if mine is None else sorted(k for k, r in mine.items() if not r.retired)[:20]
            elif hold:
                region.holds += 1
        if region is None or region.retired:
            raise ShmNotRegistered(f"{where}: {_not_found(name, 'shared memory')} (registered: {known})")
        try:
            allowed, size = check_use(owner, region, write=write)
            if not allowed:
                key = region.segment.key or region.name
                raise ShmUnavailable(
                    f"{where}: the client's user may not {'write' if write else 'read'} segment {key!r}"
                )
        except BaseException:
            if hold:
                self._let_go(region)
            raise
        return region, size

    def count(self, owner: Owner | None = None) -> int:
        """Regions registered by ``owner``, or by everyone."""
        with self._lock:
            return self._count if owner is None else len(self._owned.get(owner, {}))

    @property
    def descriptors(self) -> int:
        """Descriptors all registered regions hold (two per mapped region)."""
        return self._descriptors

    def client(self, owner: Owner) -> ClientRegions:
        """``owner``'s view: the only regions a frontend handling that owner's requests can reach."""
        return ClientRegions(self, owner)

    def close(self) -> None:
        with self._lock:
            owners = list(self._owned)
        for owner in owners:
            self.unregister(owner, None)


class Lease:
    """A request's hold on a region it writes outputs into; lets go when dropped (or :meth:`close`)."""

    __slots__ = ("region", "_registry")

    def __init__(self, registry: Registry, region: Region) -> None:
        self._registry: Registry | None = registry
        self.region = region

    def close(self) -> None:
        registry, self._registry = self._registry, None
        if registry is not None:
            registry._let_go(self.region)

    def __del__(self) -> None:
        self.close()


class ClientRegions:
    """One owner's regions: what an IPC connection's requests can name (a view of the registry)."""

    def __init__(self, registry: Registry, owner: Owner) -> None:
        self.registry = registry
        self.owner = owner

    def __len__(self) -> int:
        return self.registry.count(self.owner)

    def register(self, name: str, segment: Segment, byte_size: int | None) -> Region:
        return self.registry.register(self.owner, name, segment, byte_size)

    def unregister(self, name: str | None) -> list[str]:
        return self.registry.unregister(self.owner, name)

    def status(self, name: str | None = None) -> list[dict[str, object]]:
        return [
            {"name": r.name, "byte_size": r.byte_size, "zero_copy": r.zero_copy, "outputs": dict(r.outputs)}
            for r in self.registry.regions(self.owner, name)
        ]

    def get(self, region: str, where: str) -> Region:
        """The registered region a reference names (its bounds are checked where it is used)."""
        return self.registry.use(self.owner, region, where)

    def resolve(self, region: str, offset: int, byte_size: int, where: str) -> Region:
        """The region an output reference points into, after checking the reference's bounds."""
        found = self.registry.use(self.owner, region, where, write=True)
        found.check(offset, byte_size, where, output=True)
        return found

    def hold(self, region: str, offset: int, byte_size: int, where: str) -> Lease:
        """:meth:`resolve`, keeping the region registered until the lease goes (a request's outputs)."""
        lease = self.registry.hold(self.owner, region, where)
        lease.region.check(offset, byte_size, where, output=True)
        return lease

    def close(self) -> None:
        self.unregister(None)


def _not_found(name: str, kind: str) -> str:
    """Triton's text for a region name this client has not registered (its clients match it)."""
    return f"Unable to find {kind} region: {name[:60]!r} (not registered by this client)"
