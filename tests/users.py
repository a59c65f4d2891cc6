"""Clients run as other local users, for the tests of what a stranger may do (they need root).

PYTEST_DONT_REWRITE

``run_as`` starts Python as another uid, gid and group list (``subprocess``'s
``user``/``group``/``extra_groups``: real credentials from the kernel, as a client in the field has),
runs a script that prints one JSON document, and returns it.  ``public_directory`` gives a directory
every user can reach, for the daemon's socket.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon import ROOT

#: A uid with no entry in the user database (so: no groups there), for "a stranger".
STRANGER = 23456
NOBODY = 65534  # nobody, whose primary group is nogroup (65534) in the user database

SYSTEM_PYTHON = "/usr/bin/python3"


def _why_no_client_interpreter() -> str:
    """Why other users cannot run a client here ("" when they can).

    They run the system's Python (the virtual environment's may live under root's 0700 home) with this
    environment's packages, so it must be this very Python version.
    """
    if os.geteuid() != 0:
        return "needs root to run clients as other local users"
    if not os.path.exists(SYSTEM_PYTHON):
        return f"no {SYSTEM_PYTHON} for a client run as another user"
    done = subprocess.run(
        [SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True
    )
    if done.stdout.strip() != str(tuple(sys.version_info[:2])):
        return f"{SYSTEM_PYTHON} is not Python {sys.version_info[0]}.{sys.version_info[1]}, this test's"
    return ""


# Decided once, at collection: a skip raised later, in a client's thread, would be lost there.
_NO_CLIENT_INTERPRETER = _why_no_client_interpreter()
needs_root = pytest.mark.skipif(bool(_NO_CLIENT_INTERPRETER), reason=_NO_CLIENT_INTERPRETER)


def run_as(uid: int, gid: int, groups: list[int], script: str, *args: str) -> Any:
    """Run ``script`` (Python printing one JSON document) as ``uid``/``gid``/``groups``; its JSON.

    The interpreter is the system's Python of the same version, given this environment's packages.
    """
    if _NO_CLIENT_INTERPRETER:
        pytest.skip(_NO_CLIENT_INTERPRETER)
    path = os.pathsep.join([str(ROOT), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    done = subprocess.run(
        [SYSTEM_PYTHON, "-c", script, *args],
        cwd=ROOT,
        user=uid,
        group=gid,
        extra_groups=groups,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": path},
    )
    assert done.returncode == 0, f"the client as uid {uid} failed:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def public_directory() -> Iterator[Path]:
    """A fresh directory every local user can reach (removed afterwards), for the daemon's socket.

    Not under pytest's base temporary directory: every pytest run on the machine sets that back to
    mode 0700, which would cut another user's client off midway.
    """
    path = Path(tempfile.mkdtemp(prefix="edge-public-", dir="/tmp"))
    try:
        os.chmod(path, 0o777)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def open_socket(address: str) -> None:
    """Let every local user reach the daemon's IPC socket (and its hand-off socket), as a group would."""
    path = address.removeprefix("ipc://")
    for name in (path, path + ".shm"):
        if os.path.exists(name):
            os.chmod(name, 0o666)
