"""Client shared memory, one set of rules for every way in (IPC, KServe HTTP and gRPC).

* :mod:`~edge_server.shm.region`: one registered span of a segment, read and written without ever
  faulting (mapped only when sealed against shrinking) and never past what a tensor needs;
* :mod:`~edge_server.shm.registry`: who owns which region (:class:`Owner`), quotas, and the one
  access rule :func:`may_use`;
* :mod:`~edge_server.shm.access`: the permission bits of segments the daemon opened by key.

The frontends supply only who their peer is: IPC from ``SO_PEERCRED`` and the descriptor a client
hands over (:mod:`edge_server.ipc.handoff`), KServe from the kernel's socket table
(:mod:`edge_server.kserve.shm`).
"""

from __future__ import annotations

from edge_server.shm.access import may_access, user_groups
from edge_server.shm.region import (
    SHM_DIR,
    CopyRegion,
    MappedRegion,
    Region,
    Segment,
    check_name,
    check_span,
    open_region,
)
from edge_server.shm.registry import (
    DEFAULT_MAX_REGIONS,
    DEFAULT_MAX_REGIONS_PER_USER,
    ClientRegions,
    Lease,
    Owner,
    Registry,
    check_use,
    may_use,
)

__all__ = [
    "DEFAULT_MAX_REGIONS",
    "DEFAULT_MAX_REGIONS_PER_USER",
    "SHM_DIR",
    "ClientRegions",
    "CopyRegion",
    "Lease",
    "MappedRegion",
    "Owner",
    "Region",
    "Registry",
    "Segment",
    "check_name",
    "check_span",
    "check_use",
    "may_access",
    "may_use",
    "open_region",
    "user_groups",
]
