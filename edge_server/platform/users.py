"""Who a local user is: their groups in the user database, asked the same way by every rule that needs it.

Control (:mod:`edge_server.authorization`) and the permission bits of a client's shared-memory segment
(:mod:`edge_server.shm.access`) both ask which groups a uid belongs to.  The user database, not a
process's ``/proc`` groups: adding a user to a group takes effect at their next call, and a service
hardened with ``ProtectProc=invisible`` cannot read other processes' ``/proc`` entries anyway.
"""

from __future__ import annotations

import os
import pwd


def user_groups(uid: int) -> set[int]:
    """The primary and supplementary groups of ``uid`` in the user database (empty if unknown)."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return set()
    return set(os.getgrouplist(entry.pw_name, entry.pw_gid))
