"""The permission-bit rule for segments the daemon opened by key on a client's behalf.

Triton's system shared memory names a POSIX segment (``/dev/shm/<key>``), so the daemon opens it
with its own rights.  To be no confused deputy, every use is checked against the using peer's uid as
``open(2)`` would: owner, group (the uid's primary and supplementary groups) or other bits; root
passes.  Descriptors a client handed over need no such check: holding one is the proof.
"""

from __future__ import annotations

import os
import stat

from edge_server.platform.users import user_groups


def may_access(uid: int, st: os.stat_result, *, write: bool) -> bool:
    """Whether ``uid`` passes the permission bits of ``st`` (read, or write) as open(2) would check."""
    if uid == 0:
        return True
    if uid == st.st_uid:
        bit = stat.S_IWUSR if write else stat.S_IRUSR
    elif st.st_gid in user_groups(uid):
        bit = stat.S_IWGRP if write else stat.S_IRGRP
    else:
        bit = stat.S_IWOTH if write else stat.S_IROTH
    return bool(st.st_mode & bit)
