"""BLS from a Python model in its own process (``isolation: process``): calls cross the stub's pipe.

The same Triton-style ``model.py`` files as the thread-mode BLS tests (sync ``exec`` and ``async def
execute`` with ``async_exec``) give the ensemble's answer; a streamed call iterates a decoupled
ensemble; a call the data plane refuses comes back as the callee's error.
"""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from edge_server import Server
from edge_server.errors import EdgeServerError
from tests.daemon import python_stubs
from tests.test_ensemble import ASYNC_CHAIN_MODEL, CHAIN_CONFIG, CHAIN_MODEL, x
from tests.test_ensemble import repo as repo  # noqa: F401  (the fixture: scale, shift and pipe)
from tests.test_ensemble_decoupled import add_counted, n

ISOLATED = '\nparameters [ { key: "isolation", value: { string_value: "process" } } ]\n'


def add_isolated(repo: Path, name: str, config: str, model: str) -> None:
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    (repo / name / "config.pbtxt").write_text(config + ISOLATED)
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(model))


def test_sync_and_async_bls_from_a_process_equal_the_ensemble(repo: Path) -> None:  # noqa: F811
    for name, model in (("chain", CHAIN_MODEL), ("async_chain", ASYNC_CHAIN_MODEL)):
        add_isolated(repo, name, CHAIN_CONFIG % {"name": name}, model)
    with Server(repo) as server:
        inputs = {"IN": x(3, first=0.5)}
        ensemble = server.infer("pipe", inputs)["OUT"]
        for name in ("chain", "async_chain"):
            np.testing.assert_array_equal(server.infer(name, inputs)["OUT"], ensemble)
        (stats,) = server.statistics("scale")  # the calls went through the data plane: counted
        assert stats["inference_stats"]["success"]["count"] == 3


def test_a_streamed_bls_call_from_a_process(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    add_counted(repo)
    config = (repo / "collect" / "config.pbtxt").read_text()
    (repo / "collect" / "config.pbtxt").write_text(config + ISOLATED)
    with Server(repo) as server:
        np.testing.assert_array_equal(server.infer("collect", n(3))["OUT"], [0, 10, 20, 30])


def test_a_refused_bls_call_from_a_process_is_the_callees_error(repo: Path) -> None:  # noqa: F811
    add_isolated(repo, "chain", CHAIN_CONFIG % {"name": "chain"}, CHAIN_MODEL.replace('"scale"', '"nope"'))
    with Server(repo) as server:
        with pytest.raises(EdgeServerError, match="Request for unknown model: 'nope' is not found"):
            server.infer("chain", {"IN": x(1)})
        np.testing.assert_allclose(server.infer("pipe", {"IN": x(1)})["OUT"], 2 * x(1) + 3)


def _stub_pids() -> dict[str, int]:
    return python_stubs(os.getpid())


def test_a_restarted_process_keeps_its_bls_calls(repo: Path) -> None:  # noqa: F811
    """The restart builds the instance as the load did: with its way to the other models."""
    add_isolated(repo, "chain", CHAIN_CONFIG % {"name": "chain"}, CHAIN_MODEL)
    with Server(repo) as server:
        inputs = {"IN": x(2, first=0.5)}
        expected = server.infer("pipe", inputs)["OUT"]
        np.testing.assert_array_equal(server.infer("chain", inputs)["OUT"], expected)
        (victim,) = (pid for label, pid in _stub_pids().items() if label.startswith("chain"))
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while victim in _stub_pids().values() or not any(k.startswith("chain") for k in _stub_pids()):
            assert time.monotonic() < deadline, "the killed instance was not replaced"
            time.sleep(0.05)
        np.testing.assert_array_equal(server.infer("chain", inputs)["OUT"], expected)
