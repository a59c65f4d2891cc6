"""One shutdown deadline: a hung request cannot stretch a stop, and queued requests get an answer."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest

from edge_server.client import Client
from edge_server.errors import ConnectionLost, EdgeServerError
from tests.daemon import build_repository, start_daemon, stop_daemon

EXIT_TIMEOUT = 2.0


def test_stop_takes_one_deadline_and_answers_what_was_queued(
    tmp_path: Path, no_leaked_processes: None
) -> None:
    root = tmp_path
    proc = start_daemon(root, build_repository(root), "x.sock", "--exit-timeout-secs", str(EXIT_TIMEOUT))
    gate = proc.gate
    assert gate is not None and proc.proc is not None
    try:
        with Client(proc.address, timeout=30) as client:
            x = np.ones(4, np.float32)
            hung = client.submit("gate", {"INPUT0": x})  # never released: a model stuck in user code
            gate.wait_started()
            queued = [client.submit("gate", {"INPUT0": x}) for _ in range(3)]
            client.ipc_status()  # the frontend has taken them all by now
            t0 = time.monotonic()
            proc.proc.send_signal(signal.SIGTERM)
            proc.proc.wait(timeout=30)
            took = time.monotonic() - t0
            codes = []
            for future in queued:
                with pytest.raises(EdgeServerError) as info:
                    future.result(timeout=10)
                codes.append(info.value.code)
            with pytest.raises((ConnectionLost, EdgeServerError)):
                hung.result(timeout=10)
    finally:
        gate.release(10)
        stop_daemon(proc)
    assert codes == ["UNAVAILABLE"] * 3
    # the drain deadline, the workers' short grace, and the last replies' flush: never twice the deadline
    assert took < EXIT_TIMEOUT + 2.0 + 1.0 + 1.5, (
        f"stop took {took:.1f} s with --exit-timeout-secs {EXIT_TIMEOUT}"
    )


def test_a_second_signal_stops_at_once(tmp_path: Path, no_leaked_processes: None) -> None:
    proc = start_daemon(tmp_path, build_repository(tmp_path), "y.sock", "--exit-timeout-secs", "60")
    gate = proc.gate
    assert gate is not None and proc.proc is not None
    try:
        with Client(proc.address, timeout=30) as client:
            client.submit("gate", {"INPUT0": np.ones(4, np.float32)})
            gate.wait_started()
            proc.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)  # the first signal started a drain that would wait 60 s for the gate
            t0 = time.monotonic()
            proc.proc.send_signal(signal.SIGTERM)
            proc.proc.wait(timeout=10)
            assert time.monotonic() - t0 < 5
    finally:
        gate.release(10)
        stop_daemon(proc)
