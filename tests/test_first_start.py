"""The first start, as a user's machine makes it: Python writes bytecode wherever it may.

These development machines (and CI) set ``PYTHONDONTWRITEBYTECODE=1``; an ordinary Linux box does not.
There, importing a ``model.py`` used to write ``<model>/<version>/__pycache__/*.pyc`` into the repository,
the version's content hash changed while it loaded, the load was refused and ``--exit-on-error`` stopped
the daemon on its first start (issue #22).  Every test here runs the daemon with bytecode writing on.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_server.client import Client
from tests.daemon import EXAMPLES, Daemon, wait_for

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

# What an ordinary machine has: no variable that stops Python from writing bytecode.
_DEV_ONLY = ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")
USER_ENV = {k: v for k, v in os.environ.items() if k not in _DEV_ONLY}

ISOLATED_CONFIG = """
name: "%(name)s"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
parameters [ { key: "isolation", value: { string_value: "%(isolation)s" } } ]
"""

DOUBLE_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x * 2)]))
        return out
"""


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes: what an OTA agent syncing the folder would compare."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _loads(log: str) -> Counter[str]:
    """How many times each ``model vN`` began loading, from the daemon's own log lines."""
    return Counter(re.findall(r"(\S+ v\d+) loading", log))


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    """A fresh copy of the example repository, as a clone's first ``./run serve`` finds it."""
    if not (EXAMPLES / "identity" / "1" / "model.onnx").exists():
        subprocess.run([sys.executable, str(EXAMPLES / "make_models.py")], check=True, capture_output=True)
    repo = tmp_path / "models"
    shutil.copytree(EXAMPLES, repo, ignore=shutil.ignore_patterns("make_models.py", "__pycache__"))
    return repo


@pytest.fixture
def user_daemon(tmp_path: Path, repository: Path) -> Iterator[Daemon]:
    daemon = Daemon(
        repository,
        f"ipc://{tmp_path}/d.sock",
        tmp_path / "d.log",
        # ./run serve's defaults for loading: every model, a failed one stops the daemon.
        "--exit-on-error",
        "true",
        "--strict-readiness",
        "true",
        "--model-control-mode",
        "poll",
    )
    daemon.env = USER_ENV
    daemon.start()
    try:
        yield daemon
    finally:
        status = daemon.stop()
        assert status == 0, daemon.log()


def test_the_example_repository_loads_once_on_the_first_start(user_daemon: Daemon, repository: Path) -> None:
    before = _tree(repository)
    with Client(user_daemon.address, timeout=30) as client:
        models = client.models()
        assert models and all(m["state"] == "READY" for m in models), models
        # Run the Python models, so that whatever importing and running them writes is written.
        assert client.infer("detect_classify", {"image": np.zeros((64, 64, 3), np.uint8)})
        assert client.infer("preprocess", {"raw": np.zeros((16, 16), np.uint8)})
    loads = _loads(user_daemon.log())
    assert loads and set(loads.values()) == {1}, loads
    assert _tree(repository) == before, "the daemon wrote into the model repository"


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_dropped_python_model_is_loaded_once(user_daemon: Daemon, repository: Path, isolation: str) -> None:
    staging = repository.parent / ".ota"
    (staging / "1").mkdir(parents=True)
    (staging / "config.pbtxt").write_text(ISOLATED_CONFIG % {"name": "doubler", "isolation": isolation})
    (staging / "1" / "model.py").write_text(DOUBLE_MODEL)
    before = _tree(staging)
    os.rename(staging, repository / "doubler")  # the atomic drop docs/hot-reload.md recommends

    with Client(user_daemon.address, timeout=30) as client:
        wait_for(lambda: client.model_ready("doubler"), timeout=60, what="the dropped model to be ready")
        out = client.infer("doubler", {"INPUT0": np.arange(4, dtype=np.float32)})
        np.testing.assert_array_equal(out["OUTPUT0"], np.arange(4, dtype=np.float32) * 2)
    assert _tree(repository / "doubler") == before, "the daemon wrote into the model's directory"

    # Bytecode someone else leaves there is not a new version: drop it, then a second model, and
    # once the second serves (the watcher handles changes in order) the first was not loaded again.
    cache = repository / "doubler" / "1" / "__pycache__"
    cache.mkdir()
    (cache / f"model.cpython-{sys.version_info.major}{sys.version_info.minor}.pyc").write_bytes(b"\0" * 64)
    shutil.copytree(repository / "doubler", staging)
    (staging / "config.pbtxt").write_text(ISOLATED_CONFIG % {"name": "tripler", "isolation": isolation})
    os.rename(staging, repository / "tripler")
    with Client(user_daemon.address, timeout=30) as client:
        wait_for(lambda: client.model_ready("tripler"), timeout=60, what="the second model to be ready")
    loads = _loads(user_daemon.log())
    assert (loads["doubler v1"], loads["tripler v1"]) == (1, 1), user_daemon.log()


def _distributions(extras: set[str]) -> set[str]:
    """The packages that installing edge-server with ``extras`` brings, nested extras followed."""
    from packaging.requirements import Requirement

    found: set[str] = set()
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for text in importlib.metadata.requires("edge-server") or []:
            requirement = Requirement(text)
            if requirement.marker is None or not requirement.marker.evaluate({"extra": extra}):
                continue
            if requirement.name == "edge-server":
                todo += requirement.extras
            else:
                found.add(requirement.name)
    return found


def test_run_serve_installs_every_frontend_the_daemon_starts() -> None:
    """A clean clone's ``./run serve`` installed the `ocr` extra alone: without grpcio the daemon started
    with its gRPC frontend off, and a stock gRPC client was refused.  Every earlier check had run it in a
    clone where ``./run test`` had already installed the `dev` extra, which brings grpc."""
    run = (Path(__file__).resolve().parent.parent / "run").read_text()
    branch = run[run.index("    serve)") :]
    extras = re.search(r"setup (\S+)", branch[: branch.index(";;")])
    assert extras is not None, "./run serve sets nothing up"
    installed = _distributions(set(extras.group(1).split(",")))
    assert {"grpcio", "tritonclient", "onnx", "scikit-learn"} <= installed, installed
