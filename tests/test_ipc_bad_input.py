"""Every bad input of the issue gets its precise error code, and the daemon keeps serving others."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest

from edge_server.client import Client, SharedMemoryRegion
from edge_server.client._common import register_fields
from edge_server.ipc import protocol
from tests.daemon import Daemon, Gate, RawPeer, header, raw_request

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

X = np.arange(4, dtype=np.float32)
INPUT = {"name": "INPUT0", "datatype": "FP32", "shape": [4], "frame": 0}


@pytest.fixture
def other(daemon: Daemon) -> Iterator[Client]:
    """A well-behaved client that must keep getting answers whatever the others send."""
    with Client(daemon.address, timeout=30) as c:
        yield c


def still_serving(other: Client) -> None:
    assert other.infer("identity", {"INPUT0": X})["OUTPUT0"].tolist() == X.tolist()


def error_of(reply: dict[str, Any]) -> str:
    assert reply["ok"] is False, reply
    assert reply["v"] == protocol.PROTOCOL_VERSION and reply["error"]["message"]
    return str(reply["error"]["code"])


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        pytest.param([os.urandom(64), os.urandom(32)], "MALFORMED_MESSAGE", id="garbage-frames"),
        pytest.param([b"\xc1not msgpack"], "MALFORMED_MESSAGE", id="header-not-msgpack"),
        pytest.param([b""], "MALFORMED_MESSAGE", id="empty-header"),
        pytest.param([msgpack.packb([1, "infer"])], "MALFORMED_MESSAGE", id="header-not-a-map"),
        pytest.param([msgpack.packb({"id": 1, "op": "live"})], "MALFORMED_MESSAGE", id="no-version"),
        pytest.param([header()], "MALFORMED_MESSAGE", id="no-op"),
        pytest.param([header(op="infer", inputs=[INPUT]), X.tobytes()], "MALFORMED_MESSAGE", id="no-model"),
        pytest.param(
            [header(op="infer", model="identity"), X.tobytes()], "MALFORMED_MESSAGE", id="no-inputs"
        ),
        pytest.param(
            [
                header(op="infer", model="identity", inputs=[{"name": "INPUT0", "shape": [4], "frame": 0}]),
                X.tobytes(),
            ],
            "MALFORMED_MESSAGE",
            id="input-without-datatype",
        ),
        pytest.param(
            [header(op="infer", model="identity", inputs=[{**INPUT, "datatype": "FP33"}]), X.tobytes()],
            "MALFORMED_MESSAGE",
            id="unknown-datatype",
        ),
        pytest.param(
            [header(op="infer", model="identity", inputs=[{**INPUT, "shape": [-4]}]), X.tobytes()],
            "MALFORMED_MESSAGE",
            id="negative-dim",
        ),
        pytest.param(
            [header(op="infer", model="identity", inputs=[{**INPUT, "frame": 1}]), X.tobytes()],
            "MALFORMED_MESSAGE",
            id="truncated-multipart",
        ),
        pytest.param(
            [header(op="infer", model="identity", inputs=[INPUT])], "MALFORMED_MESSAGE", id="frame-missing"
        ),
        pytest.param(
            [header(op="infer", model="identity", inputs=[INPUT]), X.tobytes(), b"extra"],
            "MALFORMED_MESSAGE",
            id="unreferenced-frame",
        ),
        pytest.param([header(op="live"), b"stray"], "MALFORMED_MESSAGE", id="frames-on-control-op"),
        pytest.param(
            [header(op="infer", model="identity", inputs=[INPUT]), X.tobytes()[:-1]],
            "TENSOR_SIZE_MISMATCH",
            id="inline-frame-too-short",
        ),
        pytest.param(
            [header(op="infer", model="identity", inputs=[INPUT]), X.tobytes() + b"\0\0\0\0"],
            "TENSOR_SIZE_MISMATCH",
            id="inline-frame-too-long",
        ),
        pytest.param(
            [
                header(
                    op="infer",
                    model="text",
                    inputs=[{"name": "TEXT", "datatype": "BYTES", "shape": [2], "frame": 0}],
                ),
                b"\x05\0\0\0abc",
            ],
            "TENSOR_SIZE_MISMATCH",
            id="bytes-element-past-the-end",
        ),
        pytest.param([header(op="explode")], "UNKNOWN_OP", id="unknown-op"),
        pytest.param(
            [protocol.pack({"v": 99, "id": 1, "op": "live"})], "UNSUPPORTED_VERSION", id="newer-version"
        ),
        pytest.param(
            [protocol.pack({"v": "1", "id": 1, "op": "live"})], "UNSUPPORTED_VERSION", id="version-as-text"
        ),
        pytest.param(
            [
                header(op="infer", model="identity", inputs=[{**INPUT, "datatype": "FP64", "shape": [2]}]),
                X.tobytes(),
            ],
            "INVALID_ARGUMENT",
            id="dtype-the-model-does-not-take",
        ),
        pytest.param(
            [header(op="infer", model="nope", inputs=[INPUT]), X.tobytes()],
            "MODEL_NOT_FOUND",
            id="unknown-model",
        ),
        pytest.param([header(op="metadata")], "MALFORMED_MESSAGE", id="metadata-without-model"),
    ],
)
def test_bad_message_gets_precise_error(
    daemon: Daemon, other: Client, frames: list[bytes], code: str
) -> None:
    reply = raw_request(daemon.address, frames)
    assert error_of(reply) == code
    still_serving(other)


def test_garbage_without_an_id_is_answered_with_id_null(daemon: Daemon, other: Client) -> None:
    reply = raw_request(daemon.address, [b"\x93garbage"])
    assert reply["id"] is None and error_of(reply) == "MALFORMED_MESSAGE"
    still_serving(other)


def test_error_keeps_the_request_id(daemon: Daemon) -> None:
    reply = raw_request(daemon.address, [protocol.pack({"v": 7, "id": "abc-123", "op": "live"})])
    assert reply["id"] == "abc-123" and error_of(reply) == "UNSUPPORTED_VERSION"
    assert "[1]" in reply["error"]["message"]  # says which versions it speaks


def test_oversize_message(daemon: Daemon, other: Client) -> None:
    # The daemon runs with --max-message-bytes 32 MiB; 40 MiB in two frames is over the limit but each
    # frame is under ZeroMQ's hard cap, so the daemon reads it and answers instead of dropping us.
    big = np.zeros(5 << 20, np.float32)
    desc = [{**INPUT, "shape": [big.size]}, {**INPUT, "name": "INPUT1", "shape": [big.size], "frame": 1}]
    reply = raw_request(daemon.address, [header(id=42, op="infer", model="identity", inputs=desc), big, big])
    assert reply["id"] == 42 and error_of(reply) == "MESSAGE_TOO_LARGE"
    still_serving(other)


def test_client_refuses_oversize_before_sending(daemon: Daemon) -> None:
    with Client(daemon.address, max_message_bytes=1024) as small, pytest.raises(Exception) as caught:
        small.infer("identity", {"INPUT0": np.zeros(1024, np.float32)})
    assert getattr(caught.value, "code", None) == "MESSAGE_TOO_LARGE"


def shm_infer(address: str, region: str, offset: int, byte_size: int, shape: list[int]) -> dict[str, Any]:
    """Register nothing, reference ``region``: a raw request on its own connection."""
    shm = {"region": region, "offset": offset, "byte_size": byte_size}
    desc = {"name": "INPUT0", "datatype": "FP32", "shape": shape, "shm": shm}
    return raw_request(address, [header(op="infer", model="identity", inputs=[desc])])


def test_unregistered_region(daemon: Daemon, other: Client) -> None:
    region = other.create_shm_region(4096)  # registered by *another* client: not ours to use
    try:
        assert error_of(shm_infer(daemon.address, region.name, 0, 16, [4])) == "SHM_NOT_REGISTERED"
    finally:
        other.release_shm(region)
    still_serving(other)


def register(daemon: Daemon, region: SharedMemoryRegion, **extra: Any) -> bytes:
    """A raw shm_register, after handing the region's descriptor over as every client must."""
    fields = register_fields(daemon.address, region)
    return header(op="shm_register", **{**fields, **extra})


@pytest.fixture
def peer(daemon: Daemon) -> Iterator[RawPeer]:
    p = RawPeer(daemon.address)
    yield p
    p.close()


@pytest.fixture
def segment() -> Iterator[SharedMemoryRegion]:
    region = SharedMemoryRegion(4096)
    yield region
    region.close()


def test_reference_past_the_end_of_a_region(
    daemon: Daemon, peer: RawPeer, segment: SharedMemoryRegion, other: Client
) -> None:
    assert peer.ask([register(daemon, segment)])["region"]["byte_size"] == 4096
    shm = {"region": segment.name, "offset": 4096 - 8, "byte_size": 16}
    desc = {"name": "INPUT0", "datatype": "FP32", "shape": [4], "shm": shm}
    assert error_of(peer.ask([header(op="infer", model="identity", inputs=[desc])])) == "SHM_OUT_OF_BOUNDS"
    # In bounds, but the size disagrees with the shape: a different, equally precise error.
    desc["shm"] = {"region": segment.name, "offset": 0, "byte_size": 12}
    assert error_of(peer.ask([header(op="infer", model="identity", inputs=[desc])])) == "TENSOR_SIZE_MISMATCH"
    # An output reference past the end is refused before the request runs.
    desc["shm"] = {"region": segment.name, "offset": 0, "byte_size": 16}
    out = [{"name": "OUTPUT0", "shm": {"region": segment.name, "offset": 4090, "byte_size": 16}}]
    assert (
        error_of(peer.ask([header(op="infer", model="identity", inputs=[desc], outputs=out)]))
        == "SHM_OUT_OF_BOUNDS"
    )
    # An output that does not fit the room given for it.
    out = [{"name": "OUTPUT0", "shm": {"region": segment.name, "offset": 1024, "byte_size": 8}}]
    assert (
        error_of(peer.ask([header(op="infer", model="identity", inputs=[desc], outputs=out)]))
        == "SHM_OUT_OF_BOUNDS"
    )
    # No descriptor handed over: the daemon never opens a segment by name.
    reply = peer.ask([header(op="shm_register", name=segment.name + "x", byte_size=1)])
    assert error_of(reply) == "SHM_UNAVAILABLE"
    still_serving(other)


def test_segment_shrunk_by_its_client(daemon: Daemon, peer: RawPeer, other: Client) -> None:
    """A client registers 64 KiB, then ftruncates the segment to 4 KiB: a reference past the new end
    gets SHM_OUT_OF_BOUNDS instead of a SIGBUS that would kill the daemon for everyone."""
    region = SharedMemoryRegion(64 * 1024, posix=True)  # a POSIX segment: its owner can shrink it
    try:
        region.write(X, offset=8192)
        assert peer.ask([register(daemon, region)])["ok"]
        os.truncate(f"/dev/shm/{region.name}", 4096)
        shm = {"region": region.name, "offset": 8192, "byte_size": 16}
        desc = {"name": "INPUT0", "datatype": "FP32", "shape": [4], "shm": shm}
        reply = peer.ask([header(op="infer", model="identity", inputs=[desc])])
        assert error_of(reply) == "SHM_OUT_OF_BOUNDS" and "shrank" in reply["error"]["message"]
        # An output reference past the new end is refused before the request runs.
        out = [{"name": "OUTPUT0", "shm": {"region": region.name, "offset": 16384, "byte_size": 16}}]
        reply = peer.ask([header(op="infer", model="identity", inputs=[INPUT], outputs=out), X.tobytes()])
        assert error_of(reply) == "SHM_OUT_OF_BOUNDS"
        # What is left of the segment still works.
        desc["shm"] = {"region": region.name, "offset": 0, "byte_size": 16}
        assert peer.ask([header(op="infer", model="identity", inputs=[desc])])["ok"]
    finally:
        region.close()
    assert daemon.proc is not None and daemon.proc.poll() is None
    still_serving(other)


def test_segment_shrunk_while_the_request_runs(
    daemon: Daemon, gate: Gate, peer: RawPeer, other: Client
) -> None:
    """The output's write checks the segment again: a shrink during the inference is refused too."""
    region = SharedMemoryRegion(64 * 1024, posix=True)
    try:
        assert peer.ask([register(daemon, region)])["ok"]
        out = [{"name": "OUTPUT0", "shm": {"region": region.name, "offset": 32768, "byte_size": 16}}]
        peer.sock.send_multipart([header(op="infer", model="gate", inputs=[INPUT], outputs=out), X.tobytes()])
        gate.wait_started()
        os.truncate(f"/dev/shm/{region.name}", 4096)
        gate.release()
        reply = peer.recv(10.0)
        assert error_of(reply) == "SHM_OUT_OF_BOUNDS" and "shrank" in reply["error"]["message"]
    finally:
        region.close()
    assert daemon.proc is not None and daemon.proc.poll() is None
    still_serving(other)


def test_register_errors(daemon: Daemon, peer: RawPeer, segment: SharedMemoryRegion, other: Client) -> None:
    assert (
        error_of(peer.ask([register(daemon, segment, name="edge-server-../../etc/passwd")]))
        == "SHM_NAME_REJECTED"
    )
    assert error_of(peer.ask([header(op="shm_register", name="edge-server-gone-1")])) == "SHM_UNAVAILABLE"
    assert peer.ask([register(daemon, segment)])["ok"]
    assert error_of(peer.ask([register(daemon, segment)])) == "SHM_ALREADY_REGISTERED"
    assert error_of(peer.ask([register(daemon, segment, byte_size=8192)])) == "SHM_ALREADY_REGISTERED"
    assert peer.ask([header(op="shm_unregister", name=segment.name)])["unregistered"] == [segment.name]
    assert error_of(peer.ask([header(op="shm_unregister", name=segment.name)])) == "SHM_NOT_REGISTERED"
    assert error_of(peer.ask([register(daemon, segment, byte_size=8192)])) == "SHM_OUT_OF_BOUNDS"
    still_serving(other)


def test_slow_reader_does_not_stall_others(daemon: Daemon, peer: RawPeer, other: Client) -> None:
    """A client that sends many requests and reads none of the replies; the others are served."""
    frames = [header(op="infer", model="identity", inputs=[INPUT]), X.tobytes()]
    for _ in range(2000):
        peer.sock.send_multipart(frames)
    for _ in range(20):
        still_serving(other)
