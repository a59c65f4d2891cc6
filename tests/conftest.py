"""Shared fixtures: the example repository, and a guard that fails any test leaking threads or
shared-memory segments (the daemon must clean up after every request, model and client)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = ["tests.daemon"]  # the real daemon, its clients and test models

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "models"


@pytest.fixture(scope="session")
def example_repository() -> Path:
    """The bundled example repository, made by its script if a model file is missing."""
    subprocess.run([sys.executable, str(EXAMPLES / "make_models.py")], check=True, capture_output=True)
    return EXAMPLES


def _shm_segments() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    threads_before = set(threading.enumerate())
    shm_before = _shm_segments()
    yield
    deadline = time.monotonic() + 5.0
    while True:
        leaked = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
        leaked_shm = sorted(_shm_segments() - shm_before)
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
