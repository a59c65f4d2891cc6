"""Head-of-line blocking: one client's unexpectedly large request must not stall other models."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from edge_server.client import Client
from tests.daemon import Daemon, build_repository, start_daemon, stop_daemon

REDUCE_CONFIG = """
name: "reduce"
backend: "onnxruntime"
max_batch_size: 0
input [ { name: "X", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "S", data_type: TYPE_FP32, dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""


def reduce_model(path: Path) -> None:
    """S = sum(X): a model whose cost grows with its input, cheap for small ones."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n"])
    s = helper.make_tensor_value_info("S", TensorProto.FLOAT, [1])
    node = helper.make_node("ReduceSum", ["X"], ["S"], keepdims=1)
    model = helper.make_model(
        helper.make_graph([node], "reduce", [x], [s]), opset_imports=[helper.make_opsetid("", 13)]
    )
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("hol")
    repo = build_repository(root)
    reduce_model(repo / "reduce" / "1" / "model.onnx")
    (repo / "reduce" / "config.pbtxt").write_text(REDUCE_CONFIG)
    proc = start_daemon(root, repo, "h.sock")
    try:
        yield proc
    finally:
        assert stop_daemon(proc) == 0, proc.log()


def test_a_large_request_to_a_cheap_model_does_not_block_the_frontend(daemon: Daemon) -> None:
    small = np.ones(1024, np.float32)
    big_count = 48 * 1024 * 1024  # 192 MiB of FP32: tens of milliseconds to sum
    with Client(daemon.address, timeout=60) as a, Client(daemon.address, timeout=60) as b:
        for _ in range(50):  # the model is measured cheap on small requests: these run inline
            assert a.infer("reduce", {"X": small})["S"][0] == 1024
        region = a.create_shm_region(big_count * 4)
        try:
            region.array(np.float32, (big_count,))[...] = 1.0
            done = threading.Event()
            running = threading.Event()
            in_flight = threading.Event()
            answered_meanwhile = 0

            def other_client() -> None:
                nonlocal answered_meanwhile
                x = np.arange(16, dtype=np.float32)
                while not done.is_set():
                    b.infer("identity", {"INPUT0": x})
                    running.set()  # connected and answered once: the big request may go now
                    if in_flight.is_set() and not done.is_set():
                        answered_meanwhile += 1

            thread = threading.Thread(target=other_client)
            thread.start()
            assert running.wait(30)
            t0 = time.perf_counter()
            in_flight.set()
            big = a.submit("reduce", {"X": region.tensor("FP32", (big_count,))})
            assert big.result(timeout=60)["S"][0] == big_count
            took = time.perf_counter() - t0
            done.set()
            thread.join()
        finally:
            a.release_shm(region)
    # Run on the frontend thread, the big sum would have stalled every other client for its whole
    # duration: not a single answer would have come meanwhile.
    assert answered_meanwhile >= 3, f"{answered_meanwhile} answers during a {took * 1000:.0f} ms request"
