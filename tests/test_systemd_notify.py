"""systemd's notify protocol against the real daemon: a real datagram socket as ``NOTIFY_SOCKET``."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_server.client import Client
from edge_server.service.liveness import LivenessMonitor
from edge_server.service.notify import Notifier, watchdog_interval
from tests.daemon import ROOT, Daemon, build_repository, start_pyzmq_gc
from tests.notify_socket import NotifySocket

X = np.ones(4, np.float32)
EXAMPLE_MODELS = {"identity", "digits", "cnn", "frame", "gate", "text"}


@pytest.fixture
def notify(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NotifySocket]:
    start_pyzmq_gc()
    sock = NotifySocket(tmp_path / "notify.sock")
    monkeypatch.setenv("NOTIFY_SOCKET", str(sock.path))
    yield sock
    sock.close()


def test_notifier_without_socket_does_nothing() -> None:
    env: dict[str, str] = {}
    notifier = Notifier(env)
    assert not notifier.enabled
    assert notifier.send("READY=1") is False


def test_notifier_abstract_namespace_and_unset_environment() -> None:
    name = f"edge-server-test-{os.getpid()}"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind("\0" + name)
    receiver.settimeout(5)
    env = {"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid())}
    notifier = Notifier(env)
    try:
        assert notifier.watchdog_s == 1.5
        assert env == {}  # children of the daemon cannot notify in its name
        assert notifier.send("READY=1", "STATUS=up")
        assert receiver.recv(100) == b"READY=1\nSTATUS=up"
    finally:
        notifier.close()
        receiver.close()


def test_watchdog_interval_rules() -> None:
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "1000000"}) == 0.5
    assert watchdog_interval({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}) is None  # not us
    assert watchdog_interval({"WATCHDOG_USEC": "x"}) is None


class _Part:
    def __init__(self) -> None:
        self.progress, self.busy = 0, False

    def liveness(self) -> tuple[int, bool]:
        return self.progress, self.busy


def test_liveness_monitor_flags_only_busy_parts_without_progress() -> None:
    now = [0.0]
    part = _Part()
    monitor = LivenessMonitor(lambda: [("k", "model m v1", part)], stall_s=2.0, clock=lambda: now[0])
    assert monitor.stuck() == {}
    now[0] = 10.0
    assert monitor.stuck() == {}  # idle for long: not stuck
    part.busy = True
    now[0] = 11.0
    assert monitor.stuck() == {}
    now[0] = 12.5
    assert monitor.stuck() == {"model m v1": 2.5}
    part.progress += 1  # it finished something: alive again
    now[0] = 13.0
    assert monitor.stuck() == {}


def _daemon(tmp_path: Path, repo: Path, *args: str) -> Daemon:
    return Daemon(
        repo,
        f"ipc://{tmp_path}/n.sock",
        tmp_path / "n.log",
        "--model-control-mode",
        "explicit",
        "--load-model",
        "*",
        *args,
    )


def test_ready_status_reload_and_stopping(tmp_path: Path, notify: NotifySocket) -> None:
    daemon = _daemon(tmp_path, build_repository(tmp_path))
    daemon.start()
    try:
        ready = notify.wait_for("READY", "1")
        before_ready = [m for _, m in notify.messages[:-1]]
        # Every model started loading (and asked for more start-up time) before READY=1 went out.
        loading = {m["STATUS"].split()[1] for m in before_ready if "EXTEND_TIMEOUT_USEC" in m}
        assert loading == EXAMPLE_MODELS
        assert ready["STATUS"].startswith("serving: 6/6 models ready, 0 requests served")
        with Client(daemon.address, timeout=10) as client:
            assert all(m["state"] == "READY" for m in client.models())
            for _ in range(5):
                client.infer("identity", {"INPUT0": X})

            # SIGHUP: RELOADING=1 with the monotonic clock, then READY=1 again with the reload noted.
            sent = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
            daemon.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
            reloading = notify.wait_for("RELOADING", "1")
            assert int(reloading["MONOTONIC_USEC"]) >= sent
            again = notify.wait_for("READY", "1")
            assert "5 requests served" in again["STATUS"]
            assert "last reload" in again["STATUS"] and again["STATUS"].endswith("ok")
            assert client.server_ready()
    finally:
        status = daemon.stop()
    assert status == 0, daemon.log()
    assert notify.wait_for("STOPPING", "1", timeout=2)["STATUS"].startswith("draining")


def test_watchdog_pings_stop_while_a_scheduler_hangs(
    tmp_path: Path, notify: NotifySocket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "400000")  # a ping every 0.2 s; stuck after 0.4 s
    repo = build_repository(tmp_path)
    daemon = _daemon(tmp_path, repo)
    from tests.daemon import Gate

    gate = Gate(tmp_path)
    daemon.start()
    try:
        notify.wait_for("READY", "1")
        notify.wait_for("WATCHDOG", "1", timeout=5)
        with Client(daemon.address, timeout=30) as client:
            running = client.submit("gate", {"INPUT0": X})
            gate.wait_started()
            queued = client.submit("gate", {"INPUT0": X})  # work waiting behind the hung one
            hung_at = time.monotonic()
            stuck = notify.wait_for("STATUS", timeout=5)
            while "STUCK" not in stuck["STATUS"]:
                stuck = notify.wait_for("STATUS", timeout=5)
            assert stuck["STATUS"].endswith("STUCK (no progress): model gate v1")
            quiet_from = time.monotonic()
            notify.poll(1.0)
            assert notify.since(quiet_from, "WATCHDOG") == [], "pinged while the gate model hung"
            assert time.monotonic() - hung_at < 5
            gate.release(2)
            running.result(10)
            queued.result(10)
            notify.wait_for("WATCHDOG", "1", timeout=5)  # progress again: pings resume
    finally:
        gate.release(100)
        status = daemon.stop()
        gate.close()
    assert status == 0, daemon.log()


BROKEN_CONFIG = 'name: "broken"\nbackend: "onnxruntime"\nmax_batch_size: 0\n'


def _small_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "small"
    shutil.copytree(ROOT / "models" / "identity", repo / "identity")
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "config.pbtxt").write_text(BROKEN_CONFIG)
    (repo / "broken" / "1" / "model.onnx").write_bytes(b"not an onnx model")
    return repo


# No TCP listener on its default port (8000-8002): another daemon on the machine may hold it.
NO_TCP = ["--allow-http", "false", "--allow-grpc", "false", "--allow-metrics", "false"]


def test_exit_on_error_exits_non_zero_without_ready(tmp_path: Path, notify: NotifySocket) -> None:
    command = [sys.executable, "-m", "edge_server", "serve", "--model-repository", str(_small_repo(tmp_path))]
    command += ["--ipc", f"ipc://{tmp_path}/e.sock", *NO_TCP]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert "model broken failed to load" in result.stderr
    notify.poll(0.2)
    assert notify.since(0, "READY") == []
    assert notify.since(0, "STOPPING")
    # What `systemctl status` shows after the exit: the last STATUS= names the model and why it failed,
    # and so do the last log lines (the unloading of the other models comes before them).
    status = notify.since(0, "STATUS")[-1]["STATUS"]
    assert status.startswith("failed: model broken did not load: "), status
    assert "onnx" in status.lower(), status
    last = [line for line in result.stderr.splitlines() if line.strip()][-2:]
    assert "model broken failed to load: " in last[0], result.stderr
    assert "exiting: 1 model(s) failed to load at start-up" in last[1], result.stderr


def test_strict_readiness_with_a_failed_model(tmp_path: Path, notify: NotifySocket) -> None:
    daemon = _daemon(tmp_path, _small_repo(tmp_path), "--exit-on-error", "false")
    with open(daemon.log_path, "ab") as log:
        command = [sys.executable, "-m", "edge_server", "serve", "--model-repository", str(daemon.repository)]
        command += ["--ipc", daemon.address, "--exit-on-error", "false", *NO_TCP]
        daemon.proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        ready = notify.wait_for("READY", "1")  # the service is up: systemd need not restart it
        assert ready["STATUS"].startswith("serving: 1/2 models ready")
        with Client(daemon.address, timeout=10) as client:
            assert client.model_ready("identity")
            assert not client.server_ready()  # strict readiness (Triton's default): not every model is
    finally:
        assert daemon.stop() == 0, daemon.log()
    lenient = _daemon(
        tmp_path, daemon.repository, "--exit-on-error", "false", "--strict-readiness", "false"
    ).start()  # start() waits for server_ready
    assert lenient.stop() == 0


def test_a_wedged_ipc_frontend_is_seen_by_the_liveness_check(tmp_path: Path) -> None:
    """The real frontend thread, blocked inside a request it handles itself (here: the repository index,
    whose lock the test holds), stops turning its loop; the watchdog's check names it, then clears."""
    from edge_server.ipc.frontend import IpcFrontend
    from edge_server.server import Server

    start_pyzmq_gc()
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "models" / "identity", repo / "identity")
    with Server(repo) as server:
        frontend = IpcFrontend(server, f"ipc://{tmp_path}/w.sock")
        frontend.start()
        monitor = LivenessMonitor(lambda: [("ipc", "IPC frontend", frontend)], stall_s=0.3)
        try:
            with Client(frontend.address, timeout=10) as client:

                def tick() -> dict[str, float]:
                    stuck = monitor.stuck()
                    frontend.poke()  # what the watchdog does after each check
                    return stuck

                for _ in range(3):
                    assert tick() == {}
                    time.sleep(0.15)
                answer: list[list[dict]] = []
                asker = threading.Thread(target=lambda: answer.append(client.models()))
                with server._index.lock:  # the frontend thread will block on it
                    asker.start()
                    deadline = time.monotonic() + 5
                    while not (stuck := tick()) and time.monotonic() < deadline:
                        time.sleep(0.1)
                    assert list(stuck) == ["IPC frontend"]
                asker.join(10)
                assert answer and answer[0][0]["name"] == "identity"
                time.sleep(0.1)
                assert tick() == {}
                time.sleep(0.1)
                assert tick() == {}  # turning again
        finally:
            frontend.close()
