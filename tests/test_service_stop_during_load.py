"""Stopping the daemon while the watched repository is loading a hot-dropped model.

The load runs on the watcher's rescan thread.  A stop must not wait for it: one shutdown budget
(``--exit-timeout-secs``) covers loads in progress as well as requests, so that systemd's
``TimeoutStopSec`` never has to SIGKILL the daemon (which skips the drain of every other model).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from edge_server.client import Client
from tests.daemon import ROOT, Daemon
from tests.test_security_stuck_load import add_stuck_model, wait_loading


def test_stop_while_a_hot_dropped_model_loads_keeps_the_budget(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "models" / "identity", repo / "identity")
    daemon = Daemon(
        repo,
        f"ipc://{tmp_path}/stop.sock",
        tmp_path / "stop.log",
        "--model-control-mode",
        "poll",
        "--repository-quiet-secs",
        "0.1",
        "--exit-timeout-secs",
        "1",
        "--model-load-timeout-secs",
        "3600",  # the load would hold the stop for an hour if the stop waited for it
    ).start()
    try:
        with Client(daemon.address, timeout=30) as client:
            add_stuck_model(repo)  # initialize() never returns
            wait_loading(client, "stuck")
            x = np.arange(4, dtype=np.float32)
            np.testing.assert_array_equal(client.infer("identity", {"INPUT0": x})["OUTPUT0"], x)
    finally:
        # Daemon.stop kills the daemon (status -9) when it has not exited on its own within 60 s.
        status = daemon.stop(timeout=60)
    assert status == 0, daemon.log()
    assert "the server is shutting down" in daemon.log() or "abandoned" in daemon.log(), daemon.log()
