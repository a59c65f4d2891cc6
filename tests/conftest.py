"""Shared fixtures: the example repository, and a guard that fails any test leaking threads or
shared-memory segments (the daemon must clean up after every request, model and client)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = ["tests.daemon", "tests.kserve_daemon"]  # the real daemon, its clients and test models

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "models"


@pytest.fixture(scope="session")
def example_repository() -> Path:
    """The bundled example repository, made by its script if a model file is missing."""
    subprocess.run([sys.executable, str(EXAMPLES / "make_models.py")], check=True, capture_output=True)
    return EXAMPLES


_CLIENT_SEGMENT = re.compile(r"^edge-server-(\d+)-")


def _ours(pid: int) -> bool:
    """Whether ``pid`` is this test process or one of its descendants (walking /proc parents)."""
    me = os.getpid()
    while pid > 1:
        if pid == me:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True  # gone: it may have been ours, so its segments count
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False


def _shm_segments() -> set[str]:
    """Segments in /dev/shm, leaving out client segments of live processes that are not ours
    (another test run on the same machine)."""
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return set()
    return {
        name for name in names if not (match := _CLIENT_SEGMENT.match(name)) or _ours(int(match.group(1)))
    }


def _held_by_others(names: set[str]) -> set[str]:
    """Those of ``names`` that a live process outside this test tree has open or mapped (another
    program on the machine made them: Triton's python backend, a benchmark), so they are not leaks."""
    held: set[str] = set()
    paths = {f"/dev/shm/{name}": name for name in names}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or _ours(int(entry)):
            continue
        try:
            with open(f"/proc/{entry}/maps") as maps:
                for line in maps:
                    name = paths.get(line.rstrip("\n").split(maxsplit=5)[-1].removesuffix(" (deleted)"))
                    if name is not None:
                        held.add(name)
            for fd in os.listdir(f"/proc/{entry}/fd"):
                name = paths.get(os.readlink(f"/proc/{entry}/fd/{fd}"))
                if name is not None:
                    held.add(name)
        except OSError:
            continue  # gone, or not ours to read
    return held


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    threads_before = set(threading.enumerate())
    shm_before = _shm_segments()
    yield
    deadline = time.monotonic() + 5.0
    while True:
        leaked = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
        leaked_shm = sorted(_shm_segments() - shm_before)
        if leaked_shm:
            leaked_shm = sorted(set(leaked_shm) - _held_by_others(set(leaked_shm)))
        if not leaked and not leaked_shm:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    problems = []
    if leaked:
        problems.append("leaked threads: " + ", ".join(t.name for t in leaked))
    if leaked_shm:
        problems.append("leaked shared-memory segments: " + ", ".join(leaked_shm))
    pytest.fail("; ".join(problems))
