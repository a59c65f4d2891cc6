"""The leak guard of tests/conftest.py still catches a test's own leaks under xdist, and blames no test
for a segment that another live process (a sibling worker, another run) made.

A pytest of its own runs a few tests with the guard loaded as a plugin (``-p tests.conftest``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

INNER = """
import os
import threading
from pathlib import Path


def test_leaks_a_thread():
    threading.Thread(target=threading.Event().wait, args=(60,), name="leaky", daemon=True).start()


def test_leaks_its_own_segment():
    Path(f"/dev/shm/edge-leakcheck-{os.getpid()}-own").write_bytes(b"x")


def test_a_segment_named_for_another_live_process_is_not_blamed():
    Path("/dev/shm/edge-leakcheck-1-other").write_bytes(b"x")  # pid 1: alive, and not this test run's


def test_clean():
    pass
"""


def test_the_guard_blames_own_leaks_only(tmp_path: Path) -> None:
    inner = tmp_path / "test_inner.py"
    inner.write_text(INNER)
    made = ["edge-leakcheck-1-other"]
    command = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-rE"]
    try:
        result = subprocess.run([*command, str(inner)], cwd=ROOT, capture_output=True, text=True, timeout=120)
        made += [name for name in os.listdir("/dev/shm") if name.startswith("edge-leakcheck-")]
        out = result.stdout
        errors = set(re.findall(r"^ERROR \S*test_inner\.py::(\w+)", out, re.MULTILINE))
        assert errors == {"test_leaks_a_thread", "test_leaks_its_own_segment"}, out
        assert "4 passed, 2 errors" in out, out  # teardown errors: every test itself passed
        assert "Failed: leaked threads: leaky" in out, out
        own = re.findall(r"Failed: leaked shared-memory segments: (.*)", out)
        assert own and all(re.fullmatch(r"edge-leakcheck-\d+-own", name) for name in own), out
    finally:
        for name in set(made):
            Path("/dev/shm", name).unlink(missing_ok=True)
