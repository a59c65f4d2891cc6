"""Clients take turns in a model's queue: one client's burst does not make the others wait for all of it.

Through the real daemon, over IPC and KServe HTTP.  The ``turns`` models number their executions
(``CALL``) and say how many requests each one ran (``BATCH``), and every execution waits at the
test's gate, so the order is read from the model's own counter, never from a clock: the test queues a
burst from one connection, then one request from each other connection, and lets the executions go.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient

from edge_server.client import Client
from tests.daemon import EXAMPLES, Daemon, gate_fifos, stop_daemon, wait_for
from tests.kserve_daemon import KServeDaemon, start_kserve_daemon

TURNS_MODEL = """
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.gate = os.open(params["gate"]["string_value"], os.O_RDWR)
        self.started = os.open(params["started"]["string_value"], os.O_RDWR)
        self.calls = 0

    def execute(self, requests):
        self.calls += 1
        os.write(self.started, b"s")
        os.read(self.gate, 1)  # one release of the test's gate per execution
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            call = np.full(x.shape, self.calls, np.int32)
            batch = np.full(x.shape, len(requests), np.int32)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("Y", x.copy()), pb_utils.Tensor("CALL", call), pb_utils.Tensor("BATCH", batch)
            ]))
        return responses

    def finalize(self):
        os.close(self.gate)
        os.close(self.started)
"""

TURNS_CONFIG = """
backend: "python"
max_batch_size: %(max_batch_size)d
%(batching)s
input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [
  { name: "Y", data_type: TYPE_FP32, dims: [ 1 ] },
  { name: "CALL", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "BATCH", data_type: TYPE_INT32, dims: [ 1 ] }
]
instance_group [ { kind: KIND_CPU, count: 1 } ]
parameters [
  { key: "gate", value: { string_value: "%(gate)s" } },
  { key: "started", value: { string_value: "%(started)s" } }
]
"""


@pytest.fixture
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KServeDaemon]:
    """A daemon per test: a test that fails leaves requests held at the gate (which both models share),
    and they would take the next test's releases."""
    root = tmp_path_factory.mktemp("fair")
    repo = root / "repo"
    shutil.copytree(EXAMPLES / "identity", repo / "identity", ignore=shutil.ignore_patterns("samples"))
    gate, started = gate_fifos(root)
    models = {"turns": (0, ""), "turns_batched": (4, "dynamic_batching { }")}
    for name, (max_batch_size, batching) in models.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(TURNS_MODEL)
        fields = {"max_batch_size": max_batch_size, "batching": batching, "gate": gate, "started": started}
        (repo / name / "config.pbtxt").write_text(TURNS_CONFIG % fields)
    daemon = start_kserve_daemon(root, repo, "f.sock")
    try:
        yield daemon
    finally:
        assert stop_daemon(daemon.daemon) == 0, daemon.daemon.log()


def _x(value: float, batched: bool) -> np.ndarray:
    return np.array([[value]] if batched else [value], np.float32)


def _queued(client: Client, model: str) -> int:
    return next(row["queue_depth"] for row in client.status()["models"] if row["name"] == model)


def _block(daemon: Daemon, flooder: Client, model: str, batched: bool) -> Future:
    """One request of ``flooder`` held in the model, so that what comes next waits in the queue."""
    assert daemon.gate is not None
    blocker = flooder.submit(model, {"X": _x(-1, batched)})
    daemon.gate.wait_started(1, timeout=60)  # a bound for a loaded machine, not a timing
    return blocker


def _answer(future: Future) -> dict[str, Any]:
    return future.result(timeout=60)


def _infer_over_http(url: str, model: str, value: float) -> httpclient.InferResult:
    """One request through tritonclient's HTTP client, sent at once from the calling thread.

    Not ``async_infer``: it sends from a greenlet that runs only while the caller yields to gevent, and
    it yields for 10 ms; on a loaded machine the request is then not sent until the caller waits for
    its result, and a test waiting to see it queued first waits forever.
    """
    http = httpclient.InferenceServerClient(url, concurrency=1)
    try:
        x = httpclient.InferInput("X", [1], "FP32")
        x.set_data_from_numpy(_x(value, False))
        return http.infer(model, [x])
    finally:
        http.close()


def test_a_burst_from_one_client_waits_its_turn(server: KServeDaemon) -> None:
    """A burst of 12 from one connection; a single request from another IPC connection and one over HTTP
    run after one request of the burst each, not after all 12; the burst keeps its own order."""
    daemon = server.daemon
    assert daemon.gate is not None
    with (
        Client(daemon.address, timeout=60) as flooder,
        Client(daemon.address, timeout=60) as other,
        ThreadPoolExecutor(1) as http_thread,
    ):
        blocker = _block(daemon, flooder, "turns", batched=False)
        burst = [flooder.submit("turns", {"X": _x(i, False)}) for i in range(12)]
        wait_for(lambda: _queued(other, "turns") == 12, 60, what="the burst to be queued")
        lone = other.submit("turns", {"X": _x(100, False)})
        wait_for(lambda: _queued(other, "turns") == 13, 60, what="the other client's request to be queued")
        over_http = http_thread.submit(_infer_over_http, server.http_url, "turns", 200)
        wait_for(lambda: _queued(other, "turns") == 14, 60, what="the HTTP request to be queued")
        daemon.gate.release(15)
        _answer(blocker)
        burst_calls = [int(_answer(f)["CALL"][0]) for f in burst]
        lone_call = int(_answer(lone)["CALL"][0])
        http_call = int(over_http.result(timeout=60).as_numpy("CALL")[0])
    daemon.gate.settle()
    assert burst_calls == sorted(burst_calls), "one client's requests ran out of their order"
    # Queued after 12 requests of the burst, each ran after the burst's first one only (FIFO: 13th, 14th).
    assert lone_call < burst_calls[1], (burst_calls, lone_call)
    assert http_call < burst_calls[2], (burst_calls, http_call)


def test_batches_still_take_every_clients_requests(server: KServeDaemon) -> None:
    """Eight queued from one connection and four from another: the next batches are full (4 of 4) and
    each holds requests of both, so the second client is done two batches on, not after the first's 8."""
    daemon = server.daemon
    assert daemon.gate is not None
    model = "turns_batched"
    with Client(daemon.address, timeout=60) as flooder, Client(daemon.address, timeout=60) as other:
        blocker = _block(daemon, flooder, model, batched=True)
        burst = [flooder.submit(model, {"X": _x(i, True)}) for i in range(8)]
        wait_for(lambda: _queued(other, model) == 8, 60, what="the burst to be queued")
        mine = [other.submit(model, {"X": _x(100 + i, True)}) for i in range(4)]
        wait_for(lambda: _queued(other, model) == 12, 60, what="the other client's requests to be queued")
        daemon.gate.release(4)
        _answer(blocker)
        burst_out = [_answer(f) for f in burst]
        mine_out = [_answer(f) for f in mine]
    daemon.gate.settle()
    by_call: dict[int, list[str]] = {}
    for who, outs in (("burst", burst_out), ("other", mine_out)):
        for out in outs:
            by_call.setdefault(int(out["CALL"][0, 0]), []).append(who)
            assert int(out["BATCH"][0, 0]) == 4, "a batch was not full"
    assert sorted(by_call) == [2, 3, 4]
    assert sorted(by_call[2]) == sorted(by_call[3]) == ["burst", "burst", "other", "other"], by_call
    assert by_call[4] == ["burst"] * 4
