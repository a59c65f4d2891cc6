"""Issue 23 item 6 on gRPC: one stream's backlog never stands whole ahead of other clients of a model.

A stream of many requests used to put every one of them into the model's queue at once (up to
--max-client-requests), so that 400 x 1 MiB from one non-reading stream stood ahead of every other
client of the same model.  Now at most ``RUNNING_PER_STREAM`` of a stream's requests are in the data
plane; the ``gate`` model (tests/daemon.py) holds them there until the test lets them through.
"""

from __future__ import annotations

import os
import re
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from edge_server.kserve.grpc_stream import RUNNING_PER_STREAM
from tests.daemon import build_repository, free_port, kserve_flags, start_daemon, stop_daemon, wait_for

REQUESTS = 60


def pending(metrics_port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.search(r'nv_inference_pending_request_count\{model="gate",version="1"\} (\d+)', text)
    assert found, text[:2000]
    return int(found.group(1))


def test_a_stream_keeps_at_most_its_share_of_requests_in_the_model_queue(tmp_path: Path) -> None:
    metrics_port, grpc_port = free_port(), free_port()
    repo = build_repository(tmp_path)
    proc = start_daemon(
        tmp_path,
        repo,
        "b.sock",
        *kserve_flags(free_port(), grpc_port),
        "--allow-metrics",
        "true",
        "--metrics-port",
        str(metrics_port),
    )
    gate = os.open(tmp_path / "gate.fifo", os.O_RDWR)
    answers: list[object] = []
    released = False
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        client.start_stream(callback=lambda result, error: answers.append(error or result))
        tensor = grpcclient.InferInput("INPUT0", [4], "FP32")
        tensor.set_data_from_numpy(np.arange(4, dtype=np.float32))
        for k in range(REQUESTS):
            client.async_stream_infer("gate", [tensor], request_id=str(k))
        # One request runs (held at the gate), the rest of the stream's share waits in the queue...
        wait_for(lambda: pending(metrics_port) >= RUNNING_PER_STREAM - 1, timeout=30, what="a full share")
        seen = [pending(metrics_port) for _ in range(20)]
        assert max(seen) == RUNNING_PER_STREAM - 1, seen  # ... and no more of the stream's requests
        os.write(gate, b"g" * REQUESTS)  # let everything through: every request is answered, in order
        released = True
        wait_for(lambda: len(answers) == REQUESTS, timeout=60, what="every answer")
        assert all(not isinstance(a, Exception) for a in answers), answers[:3]
    finally:
        if not released:
            os.write(gate, b"g" * REQUESTS)
        client.stop_stream()
        client.close()
        os.close(gate)
        assert stop_daemon(proc) == 0, proc.log()
