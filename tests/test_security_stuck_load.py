"""A Python model whose ``initialize()`` never returns blocks nothing but itself.

Other models still load, reload and unload over IPC; the daemon stays live and stops on time; with
``--model-load-timeout-secs`` the stuck load ends with a precise error and the version UNAVAILABLE.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_server.client import Client
from edge_server.errors import EdgeServerError
from tests.daemon import Daemon, build_repository, start_daemon, stop_daemon

STUCK_CONFIG = """
name: "stuck"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""

STUCK_MODEL = """
import threading


class TritonPythonModel:
    def initialize(self, args):
        threading.Event().wait()  # forever

    def execute(self, requests):
        raise AssertionError("never initialized")
"""


def add_stuck_model(repo: Path) -> None:
    """Added after start-up: the daemon loads every model at start, and this one must be loaded later."""
    (repo / "stuck" / "1").mkdir(parents=True)
    (repo / "stuck" / "config.pbtxt").write_text(STUCK_CONFIG)
    (repo / "stuck" / "1" / "model.py").write_text(STUCK_MODEL)


def serve(tmp_path_factory: pytest.TempPathFactory, name: str, *args: str) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp(name)
    repo = build_repository(root)
    proc = start_daemon(root, repo, "s.sock", *args)
    add_stuck_model(repo)
    try:
        yield proc
    finally:
        status = stop_daemon(proc)  # within its 20 s, though a thread is stuck in initialize()
        assert status == 0, f"the daemon exited with {status}:\n{proc.log()}"


@pytest.fixture
def patient(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A load timeout far beyond the test: only per-model control keeps the other models going."""
    yield from serve(tmp_path_factory, "patient", "--model-load-timeout-secs", "3600")


@pytest.fixture
def impatient(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    yield from serve(tmp_path_factory, "impatient", "--model-load-timeout-secs", "1")


def start_stuck_load(address: str) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def load() -> None:
        try:
            with Client(address, timeout=None) as client:
                client.load_model("stuck")
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    return thread, errors


def wait_loading(client: Client, name: str) -> None:
    for _ in range(1000):
        states = {row.get("state") for row in client.models() if row["name"] == name}
        if "LOADING" in states:
            return
        threading.Event().wait(0.02)
    raise AssertionError(f"{name} never started loading")


def test_a_stuck_initialize_does_not_block_other_models_control(patient: Daemon) -> None:
    _thread, _errors = start_stuck_load(patient.address)
    x = np.arange(4, dtype=np.float32)
    with Client(patient.address, timeout=30) as client:  # a blocked control call ends in TIMEOUT
        wait_loading(client, "stuck")
        client.load_model("identity")  # a reload
        client.unload_model("text")
        client.load_model("text")
        np.testing.assert_array_equal(client.infer("identity", {"INPUT0": x})["OUTPUT0"], x)
        assert client.server_live()
        assert client.model_ready("text")
        assert not client.model_ready("stuck")


def test_a_load_past_its_timeout_fails_precisely_and_the_daemon_serves_on(impatient: Daemon) -> None:
    thread, errors = start_stuck_load(impatient.address)
    thread.join(30)
    assert not thread.is_alive(), "the stuck load never answered"
    assert len(errors) == 1 and isinstance(errors[0], EdgeServerError), errors
    assert "--model-load-timeout-secs" in str(errors[0])
    with Client(impatient.address, timeout=30) as client:
        rows = [row for row in client.models() if row["name"] == "stuck"]
        assert [row["state"] for row in rows] == ["UNAVAILABLE"]
        assert "did not finish loading" in rows[0]["reason"]
        client.load_model("identity")
        x = np.arange(4, dtype=np.float32)
        np.testing.assert_array_equal(client.infer("identity", {"INPUT0": x})["OUTPUT0"], x)
    assert "abandoned" in impatient.log()
