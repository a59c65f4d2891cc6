"""Who may change what the daemon serves: one rule, asked by every frontend.

Reaching the daemon (the IPC socket's group, a loopback port) is the right to infer, not the right
to control it.  Control is every operation that changes what is served or how the daemon behaves for
everyone: load, unload and reload, and the log and trace settings (turning error logging off is the
first step of an attack that wants no record).  It is allowed to root, the daemon's own user and the
members of ``--operator-group``, and to nobody else: not to the daemon's group, which the installed
service gives every client so that it can reach the socket.

The frontends supply only the caller's uid, each from the kernel (``SO_PEERCRED`` on the IPC socket,
the socket table for HTTP and gRPC); membership of the operator group is read here, from the user
database, the same way for every frontend.  So adding a user to the group (or removing one) takes
effect at its next call, whatever groups its running processes happen to carry.
"""

from __future__ import annotations

import grp
import os

from edge_server.errors import InvalidArgument, PermissionDenied
from edge_server.platform.users import user_groups


def group_id(group: str | None) -> int | None:
    """The gid of ``--operator-group`` (a name or a number), None when the flag is not given."""
    if group is None:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        if group.isdigit():
            return int(group)
        raise InvalidArgument(f"--operator-group {group!r}: no such group") from None


class ControlPolicy:
    """The one authorization function for control operations, built once by the daemon.

    ``daemon_uid`` defaults to the process's effective uid; ``operator_gid`` is ``--operator-group``.
    """

    def __init__(self, *, operator_gid: int | None = None, daemon_uid: int | None = None) -> None:
        self.operator_gid = operator_gid
        self.daemon_uid = os.geteuid() if daemon_uid is None else daemon_uid

    def allows(self, uid: int | None) -> bool:
        if uid is None or uid < 0:
            return False  # not on this host, or no credentials (tcp:// IPC): never control
        if uid in (0, self.daemon_uid):
            return True
        return self.operator_gid is not None and self.operator_gid in user_groups(uid)

    def authorize(self, uid: int | None, what: str) -> None:
        """Return if ``uid`` may do ``what`` (a control operation), else PermissionDenied saying who may."""
        if self.allows(uid):
            return
        who = "root and the daemon's user" + (
            f" and members of its operator group (gid {self.operator_gid})"
            if self.operator_gid is not None
            else " (start it with --operator-group to let a group control it)"
        )
        caller = f"uid {uid} is neither" if uid is not None and uid >= 0 else "the caller's uid is not known"
        raise PermissionDenied(
            f"{what} is a control operation, allowed to {who}; {caller} (reaching the daemon is the right "
            "to infer, not to control it)"
        )
