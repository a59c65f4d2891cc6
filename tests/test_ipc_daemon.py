"""The real daemon over a real ipc:// socket: results, concurrency, pipelining, shared memory, control."""

from __future__ import annotations

import asyncio
import os
import stat
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from edge_server.client import AsyncClient, Client, SharedMemoryRegion
from edge_server.errors import InvalidArgument, ModelNotFound
from tests.daemon import Daemon, wait_for

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

RNG = np.random.default_rng(7)


def onnx_run(repository: Path, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(
        str(repository / model / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs), strict=True))


def test_socket_file_is_owner_and_group_only(daemon: Daemon) -> None:
    path = daemon.address[len("ipc://") :]
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660


@pytest.mark.parametrize(
    ("model", "inputs"),
    [
        ("identity", {"INPUT0": RNG.standard_normal(1000).astype(np.float32)}),
        ("digits", {"image": RNG.random((5, 1, 8, 8), dtype=np.float32)}),
        ("frame", {"frame": RNG.integers(0, 255, (48, 64, 3), dtype=np.uint8)}),
    ],
)
def test_results_equal_onnxruntime_bit_for_bit(
    client: Client, ipc_repository: Path, model: str, inputs: dict[str, np.ndarray]
) -> None:
    expected = onnx_run(ipc_repository, model, inputs)
    got = client.infer(model, inputs)
    assert set(got) == set(expected)
    for name, array in expected.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape
        assert got[name].tobytes() == array.tobytes()


def test_cnn_matches_onnxruntime(client: Client, ipc_repository: Path) -> None:
    metadata = client.model_metadata("cnn")
    spec = metadata["inputs"][0]
    shape = [2 if d == -1 else d for d in spec["shape"]]
    inputs = {spec["name"]: RNG.random(shape, dtype=np.float32)}
    expected = onnx_run(ipc_repository, "cnn", inputs)
    got = client.infer("cnn", inputs)
    assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in expected.items()}


def test_requested_outputs_only(client: Client) -> None:
    frame = RNG.integers(0, 255, (4, 4, 3), dtype=np.uint8)
    got = client.infer("frame", {"frame": frame}, outputs=["tail", "shape"])
    assert list(got) == ["tail", "shape"]
    assert got["shape"].tolist() == [4, 4, 3]
    assert got["tail"].tobytes() == frame.tobytes()[-8:]


def test_bytes_tensors_round_trip(client: Client) -> None:
    text = np.array([b"camera", b"", "jetson \u00e9".encode(), b"\x00\xff"], dtype=object)
    got = client.infer("text", {"TEXT": text})
    assert got["UPPER"].dtype == object
    assert list(got["UPPER"]) == [b"CAMERA", b"", "JETSON \u00e9".encode(), b"\x00\xff"]


def test_control_operations(client: Client) -> None:
    assert client.server_live() and client.server_ready()
    assert client.model_ready("identity") and not client.model_ready("no-such-model")
    rows = {(m["name"], m["version"]): m for m in client.models()}
    assert rows[("identity", 1)]["state"] == "READY"
    assert set(rows[("identity", 1)]) == {"name", "version", "state", "reason"}
    assert client.model_metadata("digits")["inputs"] == [
        {"name": "image", "datatype": "FP32", "shape": [-1, 1, 8, 8]}
    ]
    assert client.model_config("digits")["max_batch_size"] == 8
    client.infer("identity", {"INPUT0": np.ones(3, np.float32)})
    stats = client.statistics("identity")
    assert stats and stats[0]["name"] == "identity"
    with pytest.raises(ModelNotFound):
        client.model_metadata("no-such-model")


def test_model_errors_come_back_as_their_class(client: Client) -> None:
    with pytest.raises(ModelNotFound) as not_found:
        client.infer("no-such-model", {"INPUT0": np.ones(3, np.float32)})
    assert not_found.value.code == "MODEL_NOT_FOUND"
    with pytest.raises(InvalidArgument, match="expected TYPE_FP32"):
        client.infer("identity", {"INPUT0": np.ones(3, np.float64)})


def test_eight_concurrent_clients_get_their_own_answers(daemon: Daemon) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def run(index: int) -> None:
        try:
            with Client(daemon.address, timeout=30) as own:
                barrier.wait()
                for step in range(50):
                    x = np.full(16, index * 1000 + step, np.float32)
                    assert own.infer("identity", {"INPUT0": x})["OUTPUT0"].tolist() == x.tolist()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors


def test_many_threads_share_one_client(client: Client) -> None:
    results: dict[int, list[float]] = {}

    def run(index: int) -> None:
        for step in range(30):
            x = np.full(4, index * 100 + step, np.float32)
            results[index * 100 + step] = client.infer("identity", {"INPUT0": x})["OUTPUT0"].tolist()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 180
    assert all(value == [float(key)] * 4 for key, value in results.items())


def test_hundreds_of_pipelined_requests_from_one_thread(client: Client) -> None:
    futures = [client.submit("identity", {"INPUT0": np.full(8, i, np.float32)}) for i in range(500)]
    for i, future in enumerate(futures):
        assert future.result(timeout=30)["OUTPUT0"].tolist() == [float(i)] * 8
    batched = [
        client.submit("digits", {"image": np.full((1, 1, 8, 8), i / 300, np.float32)}) for i in range(300)
    ]
    probabilities = [f.result(timeout=30)["probabilities"] for f in batched]
    assert all(p.shape == (1, 10) for p in probabilities)


def test_answered_requests_leave_no_timeout_behind(client: Client) -> None:
    """A long-lived client must not keep one reply deadline per request it ever sent."""
    x = np.ones(4, np.float32)
    for _ in range(2000):
        client.infer("identity", {"INPUT0": x})
    assert len(client._t._deadlines) < 10


def test_async_client_many_in_flight(daemon: Daemon) -> None:
    async def main() -> list[list[float]]:
        async with AsyncClient(daemon.address, timeout=30) as aclient:
            assert await aclient.server_ready()
            replies = await asyncio.gather(
                *[aclient.infer("identity", {"INPUT0": np.full(4, i, np.float32)}) for i in range(300)]
            )
            assert (await aclient.models())[0]["state"]
            return [r["OUTPUT0"].tolist() for r in replies]

    assert asyncio.run(main()) == [[float(i)] * 4 for i in range(300)]


def test_shared_memory_input_is_read_in_place(client: Client, daemon: Daemon) -> None:
    region = client.create_shm_region(1 << 20)
    assert region.name in daemon.mapped_segments()
    frame = region.array(np.uint8, (480, 640, 3), offset=4096)
    frame[...] = RNG.integers(0, 255, frame.shape, dtype=np.uint8)
    got = client.infer("frame", {"frame": region.tensor(np.uint8, (480, 640, 3), offset=4096)})
    assert got["shape"].tolist() == [480, 640, 3]
    assert got["head"].tobytes() == frame.tobytes()[:8] and got["tail"].tobytes() == frame.tobytes()[-8:]
    # The daemon reads the client's memory, not a copy made at registration: change it and ask again.
    frame[-1, -1, -1] ^= 0xFF
    again = client.infer("frame", {"frame": region.tensor(np.uint8, (480, 640, 3), offset=4096)})
    assert again["tail"].tobytes() == frame.tobytes()[-8:]
    client.release_shm(region)
    # The mapping goes once no request still views it; the model's worker may hold its last batch
    # until it takes the next one, so send one.
    client.infer("frame", {"frame": np.zeros((2, 2, 3), np.uint8)})
    assert region.name not in daemon.mapped_segments()


def test_shared_memory_output_is_written_into_the_region(client: Client) -> None:
    region = client.create_shm_region(64 * 1024)
    x = RNG.standard_normal(1000).astype(np.float32)
    ref = region.write(x)
    out = client.infer("identity", {"INPUT0": ref}, outputs={"OUTPUT0": region.output(offset=8192)})
    result = out["OUTPUT0"]
    assert result.tobytes() == x.tobytes()
    # The result is a view into our region at the offset we asked for, written by the daemon.
    assert np.shares_memory(result, region.array(np.uint8, (4000,), offset=8192))
    assert region.array(np.float32, (1000,), offset=8192).tobytes() == x.tobytes()
    # Mixed: inline input, output into shared memory.
    out = client.infer(
        "identity", {"INPUT0": x * 2}, outputs={"OUTPUT0": region.output(offset=0, byte_size=4000)}
    )
    assert out["OUTPUT0"].tolist() == (x * 2).tolist()


def test_shm_status_and_unregister(client: Client, daemon: Daemon) -> None:
    own = SharedMemoryRegion(4096)
    try:
        client.register_shm(own)
        status = {r["name"]: r for r in client.shm_status()}
        assert {k: status[own.name][k] for k in ("byte_size", "zero_copy")} == {
            "byte_size": 4096,
            "zero_copy": True,
        }
        assert client.unregister_shm(own) == [own.name]
        assert own.name not in {r["name"] for r in client.shm_status()}
        wait_for(lambda: own.name not in daemon.mapped_segments(), what="the daemon to unmap the region")
    finally:
        own.close()


def test_camera_loop_through_a_ring_of_regions(client: Client) -> None:
    shape = (120, 160, 3)
    ring = client.create_shm_ring(3, int(np.prod(shape)) + 64)
    try:
        frames = [RNG.integers(0, 255, shape, dtype=np.uint8) for _ in range(12)]
        futures = []
        for frame in frames:
            slot = ring.next(timeout=30)
            slot.array(np.uint8, shape)[...] = frame
            futures.append(
                slot.hold(client.submit("frame", {"frame": slot.tensor(np.uint8, shape)}, outputs=["tail"]))
            )
        for frame, future in zip(frames, futures, strict=True):
            assert future.result(timeout=30)["tail"].tobytes() == frame.tobytes()[-8:]
    finally:
        ring.close()


def test_async_ring_close_unregisters_its_region(daemon: Daemon) -> None:
    async def main() -> str:
        async with AsyncClient(daemon.address, timeout=30) as aclient:
            ring = await aclient.create_shm_ring(2, 1024)
            name = ring.region.name
            assert name in {r["name"] for r in await aclient.shm_status()}
            ring.close()  # not awaitable: the unregistration is sent before anything that follows
            assert name not in {r["name"] for r in await aclient.shm_status()}
            assert ring.region.closed and not os.path.exists(f"/dev/shm/{name}")
            assert await aclient.server_live()
            return name

    name = asyncio.run(main())
    assert name not in daemon.mapped_segments()


def test_live_and_ipc_status_tell_the_message_limit(client: Client) -> None:
    assert client.server_live()
    assert client.ipc_status()["max_message_bytes"] == 32 << 20  # the daemon's --max-message-bytes
