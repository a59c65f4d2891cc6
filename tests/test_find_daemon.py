"""Clients find the daemon by one rule (service socket, per-user socket, $EDGE_SERVER_IPC), fail fast
when none runs, and the operator commands (`status`, `--version`, usage errors) behave."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_server.client import Client
from edge_server.errors import DaemonNotRunning, EdgeServerError
from edge_server.ipc.addresses import client_address, find_daemon
from tests.daemon import ROOT, start_pyzmq_gc
from tests.test_metrics import COUNTED_CONFIG, COUNTED_MODEL


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    start_pyzmq_gc()
    path = tmp_path / "repo"
    shutil.copytree(ROOT / "models" / "identity", path / "identity")
    (path / "counted" / "1").mkdir(parents=True)
    (path / "counted" / "config.pbtxt").write_text(COUNTED_CONFIG)
    (path / "counted" / "1" / "model.py").write_text(COUNTED_MODEL)
    return path


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A per-user runtime directory of the test's own; no $EDGE_SERVER_IPC."""
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    monkeypatch.delenv("EDGE_SERVER_IPC", raising=False)
    return dict(os.environ)


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edge_server", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )


class Serving:
    """``edge-server serve`` with only the environment saying where (no --ipc)."""

    def __init__(self, repo: Path, env: dict[str, str], expected: str, log: Path) -> None:
        command = [sys.executable, "-m", "edge_server", "serve", "--model-repository", str(repo)]
        command += ["--allow-http", "false", "--allow-grpc", "false", "--allow-metrics", "false"]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        self.log = log
        deadline = time.monotonic() + 60
        with Client(expected, timeout=0.5) as client:
            while True:
                assert self.proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                try:
                    if client.server_ready():
                        return
                except EdgeServerError:
                    continue

    def stop(self) -> None:
        self.proc.terminate()
        assert self.proc.wait(20) == 0, self.log.read_text()


@pytest.fixture
def user_daemon(repo: Path, env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    address = f"ipc://{env['XDG_RUNTIME_DIR']}/edge-server/edge-server.sock"
    daemon = Serving(repo, env, address, tmp_path / "user.log")
    try:
        yield address
    finally:
        daemon.stop()


def test_per_user_socket_found_by_the_cli(user_daemon: str, env: dict[str, str], tmp_path: Path) -> None:
    assert find_daemon(service_dir=tmp_path / "no-service") == user_daemon
    result = cli("models", env=env)
    assert result.returncode == 0, result.stderr
    assert "identity" in result.stdout and "READY" in result.stdout
    np.save(tmp_path / "x.npy", np.arange(3, dtype=np.float32))
    result = cli("infer", "counted", "--input", f"INPUT0={tmp_path / 'x.npy'}", env=env)
    assert result.returncode == 0, result.stderr
    assert "[0. 2. 4.]" in result.stdout
    assert "model print" not in result.stdout  # the model printed in the daemon, not here

    result = cli("status", env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"daemon      {user_daemon}"
    assert lines[1] == "state       serving, ready"
    counted = next(line.split() for line in lines if line.startswith("counted "))
    assert counted[:5] == ["counted", "1", "READY", "1", "0"]  # one request, no errors, none queued
    assert counted[6].startswith("counted_0")  # the instance's busy time


def test_service_socket_comes_first(repo: Path, env: dict[str, str], tmp_path: Path) -> None:
    service_dir = tmp_path / "run-edge-server"  # stands for /run/edge-server, which tests must not touch
    service = f"ipc://{service_dir}/edge-server.sock"
    assert client_address(service_dir) == f"ipc://{env['XDG_RUNTIME_DIR']}/edge-server/edge-server.sock"
    daemon = Serving(repo, {**env, "RUNTIME_DIRECTORY": str(service_dir)}, service, tmp_path / "svc.log")
    try:
        assert find_daemon(service_dir=service_dir) == service
        assert client_address(service_dir) == service
    finally:
        daemon.stop()


def test_environment_variable_overrides_for_daemon_and_clients(
    repo: Path, env: dict[str, str], tmp_path: Path
) -> None:
    address = f"ipc://{tmp_path}/chosen.sock"
    env = {**env, "EDGE_SERVER_IPC": address}
    daemon = Serving(repo, env, address, tmp_path / "env.log")
    try:
        result = cli("models", env=env)
        assert result.returncode == 0, result.stderr
        assert "counted" in result.stdout
    finally:
        daemon.stop()


def test_no_daemon_fails_fast_naming_the_addresses(env: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(DaemonNotRunning) as info:
        find_daemon(service_dir=tmp_path / "none")
    assert f"{env['XDG_RUNTIME_DIR']}/edge-server/edge-server.sock" in info.value.message
    result = cli("models", env=env)  # at once: DAEMON_NOT_RUNNING, not a connection that timed out
    assert result.returncode == 1
    assert "error [DAEMON_NOT_RUNNING]" in result.stderr
    assert "/run/edge-server/edge-server.sock" in result.stderr
    assert f"{env['XDG_RUNTIME_DIR']}/edge-server/edge-server.sock" in result.stderr
    assert "--model-repository" in result.stderr
    result = cli("status", "--ipc", f"ipc://{tmp_path}/wrong.sock", env=env)
    assert result.returncode == 1 and f"{tmp_path}/wrong.sock" in result.stderr


def test_version_usage_errors_and_bad_files(repo: Path, env: dict[str, str], tmp_path: Path) -> None:
    result = cli("--version", env=env)
    assert result.returncode == 0 and result.stdout.startswith("edge-server ")
    result = cli("infer", "identity", "--model-repository", str(repo), env=env)
    assert result.returncode == 2
    assert result.stderr.startswith("usage:") and "give --input" in result.stderr
    result = cli("models", "--ipc", "ipc://x", "--local", env=env)
    assert result.returncode == 2
    result = cli(
        "infer",
        "identity",
        "--input",
        f"INPUT0={tmp_path / 'missing.npy'}",
        "--model-repository",
        str(repo),
        env=env,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error [INVALID_ARGUMENT]: --input INPUT0: cannot read {tmp_path / 'missing.npy'} as a .npy array: "
        f"[Errno 2] No such file or directory: '{tmp_path / 'missing.npy'}'"
    ]
    (tmp_path / "junk.npy").write_bytes(b"junk")
    result = cli(
        "infer",
        "identity",
        "--input",
        f"INPUT0={tmp_path / 'junk.npy'}",
        "--model-repository",
        str(repo),
        env=env,
    )
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr
    # global flags after the command, as docs/cli.md says they may come
    assert cli("models", "--model-repository", str(repo), "--log-verbose", "1", env=env).returncode == 0


def test_model_print_stays_out_of_local_output(repo: Path, env: dict[str, str], tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.arange(3, dtype=np.float32))
    result = cli(
        "infer",
        "counted",
        "--input",
        f"INPUT0={tmp_path / 'x.npy'}",
        "--model-repository",
        str(repo),
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "model print" not in result.stdout
    assert "model print" in result.stderr
    assert result.stdout.startswith("OUTPUT0: float32 [3]")
