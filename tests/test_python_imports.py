"""A ``model.py`` imports the ``.py`` files beside it, as Triton's python_backend allows.

Triton appends the version folder and the model folder to ``sys.path`` of each model's process, so a
model written for Triton does ``from model_common import Helper`` (Triton's own QA models do:
``response_sender/model_common.py``).  Here the models of one daemon share an interpreter: two
models that each ship a ``model_common.py`` must each get their own, an installed module of the same
name still wins (Triton's order), no bytecode may appear in the repository, and nothing stays in
``sys.modules`` once the model is unloaded.  Checked in the daemon's threads, in the in-process
server, and in a stub process (``isolation: process``).
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from edge_server import Server
from edge_server.client import Client
from tests.daemon import Daemon

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "X", data_type: TYPE_INT32, dims: [ 1 ] }} ]
output [ {{ name: "WHO", data_type: TYPE_STRING, dims: [ 1 ] }} ]
{extra}
"""

# The model answers with what its helpers say; one helper is imported only inside execute().
MODEL = """
import json  # a json.py lies beside this file too: the installed module must win, as in Triton

import numpy as np
import triton_python_backend_utils as pb_utils
from model_common import WHO, describe
from helpers import tag


class TritonPythonModel:
    def execute(self, requests):
        import late  # a lazy import, on the instance's thread, at request time

        responses = []
        for request in requests:
            text = json.dumps([WHO, describe(), tag(), late.LATE])
            out = pb_utils.Tensor("WHO", np.array([text.encode()], dtype=np.object_))
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
"""


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def make_model(root: Path, name: str, *, extra: str = "") -> None:
    """``name`` with a version-folder helper, a model-folder helper package and a lazy helper."""
    model = root / name
    write(model / "config.pbtxt", CONFIG.format(name=name, extra=extra))
    write(model / "1" / "model.py", MODEL)
    # the same file name in every model, different content
    write(model / "1" / "model_common.py", f"WHO = {name!r}\n\ndef describe():\n    return 'common ' + WHO\n")
    write(model / "1" / "late.py", f"LATE = 'late {name}'\n")
    write(model / "1" / "json.py", "raise RuntimeError('the installed json module must win')\n")
    # a package in the model folder (Triton's second sys.path entry), with a relative import
    write(model / "helpers" / "__init__.py", "from .naming import tag\n")
    write(model / "helpers" / "naming.py", f"def tag():\n    return 'tag {name}'\n")


def answer(outputs: dict[str, np.ndarray]) -> list[str]:
    import json

    (text,) = outputs["WHO"]
    return json.loads(text)


def expected(name: str) -> list[str]:
    return [name, f"common {name}", f"tag {name}", f"late {name}"]


def scope_modules() -> list[str]:
    return [n for n in sys.modules if n.startswith("_edge_server_model_")]


def no_bytecode(root: Path) -> None:
    assert not list(root.rglob("__pycache__")), "bytecode was written into the repository"
    assert not list(root.rglob("*.pyc"))


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    make_model(root, "alpha")
    make_model(root, "beta", extra="instance_group [ { count: 2, kind: KIND_CPU } ]")
    make_model(root, "gamma", extra='parameters [ { key: "isolation", value: { string_value: "process" } } ]')
    return root


def test_each_model_imports_its_own_siblings_in_process(repository: Path) -> None:
    before = scope_modules()
    with Server(repository) as server:
        x = {"X": np.zeros(1, np.int32)}
        for name in ("alpha", "beta", "gamma", "alpha", "beta"):
            assert answer(server.infer(name, x)) == expected(name)
        assert "model_common" not in sys.modules  # the global namespace is untouched
        assert "helpers" not in sys.modules
    assert scope_modules() == before  # unloading forgets every module of the instances
    no_bytecode(repository)


def test_siblings_through_the_daemon(repository: Path, tmp_path: Path) -> None:
    daemon = Daemon(repository, f"ipc://{tmp_path}/d.sock", tmp_path / "d.log").start()
    try:
        with Client(daemon.address, timeout=30) as client:
            for name in ("gamma", "alpha", "beta"):
                assert answer(client.infer(name, {"X": np.zeros(1, np.int32)})) == expected(name)
    finally:
        assert daemon.stop() == 0, daemon.log()
    no_bytecode(repository)


def test_a_reload_imports_the_new_helper(repository: Path) -> None:
    with Server(repository, model_control_mode="explicit", load_models=["alpha"]) as server:
        x = {"X": np.zeros(1, np.int32)}
        assert answer(server.infer("alpha", x))[0] == "alpha"
        changed = "WHO = 'changed'\ndef describe():\n    return ''\n"
        write(repository / "alpha" / "1" / "model_common.py", changed)
        server.load_model("alpha")
        assert answer(server.infer("alpha", x))[0] == "changed"


def test_a_missing_helper_names_the_module(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    write(root / "lonely" / "config.pbtxt", CONFIG.format(name="lonely", extra=""))
    model = "from not_shipped import x\nclass TritonPythonModel:\n    pass\n"
    write(root / "lonely" / "1" / "model.py", model)
    before = scope_modules()  # other tests of this worker may leave a stuck instance's scope behind
    with Server(root) as server:
        (status,) = [m for m in server.models() if m.name == "lonely"]
    assert "No module named 'not_shipped'" in status.reason
    assert scope_modules() == before
