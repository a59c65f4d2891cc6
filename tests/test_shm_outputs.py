"""Outputs written straight into a client's shared memory: the real daemon, real memfd regions.

The ONNX Runtime backend binds outputs of fixed shape to the client's span (IOBinding); the path each
output took is read back from ``shm_status`` (``outputs``: ``direct`` written by the runtime, ``copied``
by the instance after the run, ``frontend`` by the IPC frontend), never inferred from timing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from edge_server.backends.base import fill_destinations
from edge_server.client import Client
from edge_server.client._wire import ShmRef
from edge_server.client.shm import SharedMemoryRegion
from edge_server.errors import EdgeServerError, ShmOutOfBounds
from edge_server.ipc.handlers import _destinations
from edge_server.ipc.handoff import inspect_fd
from edge_server.request import OutputBuffer
from edge_server.shm import Owner, Registry
from tests.daemon import Daemon, gate_fifos, start_daemon, stop_daemon

ROWS = 16

ADD_CONFIG = """
name: "%(name)s"
backend: "onnxruntime"
max_batch_size: 4
input [ { name: "x", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [
  { name: "y", data_type: TYPE_FP32, dims: [ 16 ] },
  { name: "z", data_type: TYPE_FP32, dims: [ -1 ] }
]
instance_group [ { kind: KIND_CPU, count: 1 } ]
%(batching)s
"""
# The batch forms when the fourth request arrives (max_batch_size), not after a delay.
BATCHING = "dynamic_batching { max_queue_delay_microseconds: 30000000 }"


def add_model(path: Path) -> None:
    """ONNX: x FP32 [n, 16] -> y = x + 1 (fixed shape: bindable) and z = [x, x] ([n, m]: not bindable)."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node("Add", ["x", "one"], ["y"]),
            helper.make_node("Concat", ["x", "x"], ["z"], axis=1),
        ],
        "add",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", ROWS])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", ROWS]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", "m"]),
        ],
        [numpy_helper.from_array(np.ones(1, np.float32), "one")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("shm_outputs") / "repo"
    for name, batching in (("add", ""), ("add_batched", BATCHING)):
        add_model(repo / name / "1" / "model.onnx")
        (repo / name / "config.pbtxt").write_text(ADD_CONFIG % {"name": name, "batching": batching})
    return repo


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, repository: Path) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("shm_outputs_run")
    gate_fifos(root)
    proc = start_daemon(root, repository, "out.sock")
    try:
        yield proc
    finally:
        assert stop_daemon(proc) == 0, proc.log()


@pytest.fixture
def client(daemon: Daemon) -> Iterator[Client]:
    with Client(daemon.address, timeout=30) as c:
        yield c


def reference(repository: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(repository / "add" / "1" / "model.onnx"))
    y, z = session.run(["y", "z"], {"x": x})
    return {"y": y, "z": z}


def counts(client: Client, region: SharedMemoryRegion) -> dict[str, int]:
    (status,) = [r for r in client.shm_status() if r["name"] == region.name]
    return dict(status["outputs"])


def test_fixed_shape_output_is_written_by_onnxruntime_in_place(client: Client, repository: Path) -> None:
    region = client.create_shm_region(1 << 16)
    x = np.random.default_rng(0).random((3, ROWS), dtype=np.float32)
    out = client.infer(
        "add",
        {"x": region.write(x)},
        outputs={"y": region.output(offset=4096, byte_size=3 * ROWS * 4), "z": region.output(offset=8192)},
    )
    want = reference(repository, x)
    np.testing.assert_array_equal(out["y"], want["y"])
    np.testing.assert_array_equal(out["z"], want["z"])
    assert np.shares_memory(out["y"], region.array(np.uint8, (4096,), offset=4096))
    # y's shape is known before the run: bound to the region; z's ([n, -1]) is copied after the run.
    assert counts(client, region) == {"direct": 1, "copied": 1, "frontend": 0}
    # An output asked inline beside them still travels as a frame.
    inline = client.infer("add", {"x": region.write(x)}, outputs={"y": region.output(offset=4096), "z": None})
    np.testing.assert_array_equal(inline["z"], want["z"])
    assert counts(client, region)["direct"] == 2
    client.release_shm(region)


def test_copied_region_keeps_the_frontend_copy(client: Client, repository: Path) -> None:
    region = SharedMemoryRegion(1 << 16, posix=True, prefix=client.shm_prefix)  # unsealed: never mapped
    client.register_shm(region)
    try:
        x = np.arange(2 * ROWS, dtype=np.float32).reshape(2, ROWS)
        out = client.infer("add", {"x": region.write(x)}, outputs={"y": region.output(offset=4096)})
        np.testing.assert_array_equal(out["y"], reference(repository, x)["y"])
        assert counts(client, region) == {"direct": 0, "copied": 0, "frontend": 1}
    finally:
        client.release_shm(region)


def test_output_over_its_own_input_is_copied_after_the_run(client: Client, repository: Path) -> None:
    region = client.create_shm_region(1 << 16)
    x = np.random.default_rng(1).random((2, ROWS), dtype=np.float32)
    want = reference(repository, x)["y"]
    out = client.infer(
        "add", {"x": region.write(x)}, outputs={"y": region.output(offset=0, byte_size=x.nbytes)}
    )
    np.testing.assert_array_equal(out["y"], want)  # the model never read what it was writing
    assert counts(client, region) == {"direct": 0, "copied": 1, "frontend": 0}
    client.release_shm(region)


def test_batched_requests_of_two_clients_land_each_in_its_own_region(
    daemon: Daemon, repository: Path
) -> None:
    with Client(daemon.address, timeout=60) as a, Client(daemon.address, timeout=60) as b:
        regions = {a: a.create_shm_region(1 << 16), b: b.create_shm_region(1 << 16)}
        rng = np.random.default_rng(2)
        sent = []
        for index in range(4):  # four requests of one row: one batch of four, two per client
            client = (a, b)[index % 2]
            region = regions[client]
            x = rng.random((1, ROWS), dtype=np.float32)
            offset = 8192 * (index // 2 + 1)
            future = client.submit(
                "add_batched",
                {"x": region.write(x, offset=offset - 4096)},
                outputs={"y": region.output(offset=offset, byte_size=4 * ROWS)},
            )
            sent.append((client, region, offset, x, future))
        for _client, region, offset, x, future in sent:
            y = future.result(timeout=60)["y"]
            np.testing.assert_array_equal(y, reference(repository, x)["y"])
            np.testing.assert_array_equal(region.array(np.float32, (1, ROWS), offset=offset), x + 1)
        stats = a.statistics("add_batched")[0]
        assert stats["execution_count"] == 1 and stats["inference_count"] == 4
        # A batch of several requests runs into the backend's buffers; each row is copied after the run.
        for client, region in regions.items():
            assert counts(client, region) == {"direct": 0, "copied": 2, "frontend": 0}
            client.release_shm(region)


def test_bad_output_regions_fail_before_anything_is_written(client: Client) -> None:
    region = client.create_shm_region(1 << 16)
    x = np.ones((2, ROWS), np.float32)
    region.array(np.uint8, (4096,), offset=4096)[:] = 0xAB
    with pytest.raises(EdgeServerError) as info:  # y needs 128 bytes; the span holds 100
        client.infer("add", {"x": region.write(x)}, outputs={"y": region.output(offset=4096, byte_size=100)})
    assert info.value.code == ShmOutOfBounds.code
    assert "needs 128 bytes" in info.value.message and "holds 100" in info.value.message
    assert (region.array(np.uint8, (4096,), offset=4096) == 0xAB).all()  # nothing written, in or past it
    with pytest.raises(EdgeServerError) as info:  # a span past the registration: refused at decode
        client.infer(
            "add",
            {"x": region.write(x)},
            outputs={"y": ShmRef(region.name, (1 << 16) - 64, 128)},
        )
    assert info.value.code == ShmOutOfBounds.code
    assert counts(client, region) == {"direct": 0, "copied": 0, "frontend": 0}
    client.release_shm(region)


# -- the pieces, without a daemon ---------------------------------------------------------------


def test_output_buffer_views_only_what_fits() -> None:
    span = OutputBuffer(np.zeros(64, np.uint8))
    view = span.view(np.dtype(np.float32), (2, 8))
    assert view is not None and view.shape == (2, 8) and np.shares_memory(view, span.array)
    assert span.holds(view) and not span.holds(view[1:]) and not span.holds(np.zeros((2, 8), np.float32))
    assert span.view(np.dtype(np.float32), (3, 8)) is None  # 96 bytes into 64
    assert span.view(np.dtype(object), (1,)) is None  # BYTES: serialized by the frontend


def test_fill_destinations_copies_what_fits_and_leaves_the_rest() -> None:
    fits, small = OutputBuffer(np.zeros(64, np.uint8)), OutputBuffer(np.zeros(8, np.uint8))
    outputs = {"a": np.arange(4, dtype=np.float64), "b": np.arange(4, dtype=np.float64)}
    fill_destinations(outputs, {"a": fits, "b": small})
    assert fits.filled == OutputBuffer.COPIED and np.shares_memory(outputs["a"], fits.array)
    assert small.filled == "" and not np.shares_memory(outputs["b"], small.array)
    np.testing.assert_array_equal(outputs["a"], np.arange(4))


def test_overlapping_output_spans_get_no_view(tmp_path: Path) -> None:
    region_file = SharedMemoryRegion(1 << 14)
    registry = Registry().client(Owner(0))
    try:
        region = registry.register("r", inspect_fd(os.dup(region_file.fd), uid=0, pid=0), None)
        spans = {
            "a": (region, 0, 100),
            "b": (region, 50, 100),
            "c": (region, 4096, 100),
            "d": (region, 0, 4000),
        }
        found = _destinations(spans)
        assert found is not None and set(found) == {"c"}  # d covers a and b; c stands alone
        assert _destinations({"a": (region, 0, 100), "b": (region, 100, 100)}) is not None
    finally:
        registry.close()
        region_file.close()
