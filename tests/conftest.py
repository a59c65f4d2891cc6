"""Shared fixtures: the example repository, the ``daemon`` marker (the slow tier), and a guard that
fails any test leaking threads or shared-memory segments (the daemon must clean up after every
request, model and client).

The suite runs on several pytest-xdist workers (``./run test``), so everything here works per worker:
threads are this process's own, and a segment counts against a test only when this worker's process
tree made it (its name carries the maker's pid) or, for a name without one, when no live process
outside this tree holds it (a sibling worker, another test run, another program on the machine).
"""

from __future__ import annotations

import inspect
import os
import re
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon import ensure_examples

pytest_plugins = ["tests.daemon", "tests.kserve_daemon"]  # the real daemon, its clients and test models

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "models"
TESTS = ROOT / "tests"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker's temporary directories sit in ``<run>/gw<N>``, not ``<run>/popen-gw<N>``: tests
    bind Unix sockets under ``tmp_path``, and a socket path has at most 107 bytes.  Before the
    temporary-path factory reads the option (tryfirst)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and config.option.basetemp:
        config.option.basetemp = str(Path(config.option.basetemp).with_name(workerinput["workerid"]))


@pytest.fixture(scope="session")
def example_repository() -> Path:
    """The bundled example repository, made by its script if a model file is missing."""
    return ensure_examples()


# -- the `daemon` marker: the slow tier ----------------------------------------------------------------

# Names whose use means a test starts a process or a server: the real daemon, an in-process Server,
# a subprocess.  Read from the code (not its text), so a docstring that mentions them does not count.
_STARTERS = frozenset(
    {"Daemon", "KServeDaemon", "start_daemon", "start_kserve_daemon", "Server", "subprocess", "Popen"}
)


def _names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _starts_something(obj: Any, seen: set[int]) -> bool:
    """Whether ``obj`` (a test, a fixture, or a helper in tests/) uses a starter, directly or through
    helpers and classes of the tests package that it calls."""
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    if inspect.isclass(obj):
        return any(_starts_something(v, seen) for v in vars(obj).values() if inspect.isfunction(v))
    func = inspect.unwrap(obj)
    code = getattr(func, "__code__", None)
    if code is None:
        return False
    for name in _names(code):
        if name in _STARTERS:
            return True
        target = func.__globals__.get(name)
        if (inspect.isfunction(target) or inspect.isclass(target)) and _in_tests(target):
            if _starts_something(target, seen):
                return True
    return False


def _in_tests(obj: Any) -> bool:
    """Whether ``obj`` is defined in a module of tests/ (test modules are imported by file name)."""
    module = inspect.getmodule(obj)
    return Path(getattr(module, "__file__", None) or "/").parent == TESTS


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``daemon`` every test that, itself or through a fixture or helper, starts the daemon, an
    in-process server or a subprocess (``-m "not daemon"`` runs the fast tier).  A module or test
    can also carry the mark explicitly."""
    seen: dict[int, bool] = {}
    for item in items:
        if item.get_closest_marker("daemon") is not None:
            continue
        funcs = [getattr(item, "function", None)]
        info = getattr(item, "_fixtureinfo", None)
        if info is not None:
            funcs += [defs[-1].func for defs in info.name2fixturedefs.values() if defs]
        for func in funcs:
            if func is None:
                continue
            if id(func) not in seen:
                seen[id(func)] = _starts_something(func, set())
            if seen[id(func)]:
                item.add_marker(pytest.mark.daemon)
                break


# -- the leak guard ------------------------------------------------------------------------------------

# The pid a segment's name carries: client regions (edge-server-<pid>-<hex>), the tests' own segments
# (edge-kserve-test-<pid>-..., edge-server-test-<pid>): the first number between dashes.
_PID_IN_NAME = re.compile(r"-(\d+)(?:-|$)")


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
    """Segments in /dev/shm, leaving out those whose name carries the pid of a live process that is
    not ours (a sibling xdist worker, another test run on the same machine)."""
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return set()
    return {name for name in names if not (match := _PID_IN_NAME.search(name)) or _ours(int(match.group(1)))}


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
