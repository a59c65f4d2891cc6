"""Wire protocol rules without sockets: headers, tensors, BYTES, request decoding, reply encoding."""

from __future__ import annotations

import os
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from edge_server import dtypes
from edge_server.client import _common, _wire
from edge_server.client.shm import SharedMemoryRegion, ShmRing
from edge_server.errors import (
    ConnectionLost,
    EdgeServerError,
    InvalidArgument,
    MalformedMessage,
    MessageTooLarge,
    ModelNotReady,
    ShmNotRegistered,
    ShmOutOfBounds,
    TensorSizeMismatch,
    Unavailable,
    UnsupportedProtocolVersion,
)
from edge_server.ipc import handlers, protocol
from edge_server.ipc.handoff import inspect_fd
from edge_server.shm import Owner, Registry
from edge_server.shm import region as shm_region


def infer_header(**overrides: Any) -> dict[str, Any]:
    base = {
        "v": 1,
        "id": 5,
        "op": "infer",
        "model": "m",
        "inputs": [{"name": "A", "datatype": "FP32", "shape": [2], "frame": 0}],
    }
    base.update(overrides)
    return base


def decode(header: dict[str, Any], *frames: bytes) -> tuple[Any, handlers.InferContext]:
    return handlers.decode_infer(header, [zmq.Frame(f) for f in frames], Registry().client(Owner(0)))


def test_bytes_round_trip_and_layout() -> None:
    array = np.array([[b"ab", "\u00e9"], [b"", b"\x00"]], dtype=object)
    data = protocol.encode_bytes(array)
    assert data[:6] == b"\x02\x00\x00\x00ab"  # little-endian uint32 length, then the bytes
    back = protocol.decode_bytes(data, (2, 2), "t")
    assert back.shape == (2, 2) and back.tolist() == [[b"ab", "\u00e9".encode()], [b"", b"\x00"]]


@pytest.mark.parametrize(
    "data",
    [b"\x02\x00\x00", b"\x05\x00\x00\x00abc", b"\x01\x00\x00\x00a\x01\x00\x00\x00bextra"],
    ids=["short-length", "element-past-end", "bytes-left-over"],
)
def test_bytes_decoding_rejects_bad_lengths(data: bytes) -> None:
    with pytest.raises(TensorSizeMismatch):
        protocol.decode_bytes(data, (2,), "t")


def test_to_array_is_a_view_and_checks_the_size() -> None:
    data = bytearray(np.arange(6, dtype=np.int32).tobytes())
    array = protocol.to_array(memoryview(data), "INT32", np.dtype(np.int32), (2, 3), "t")
    data[0] = 42
    assert array[0, 0] == 42  # no copy
    with pytest.raises(TensorSizeMismatch, match="needs 20 bytes, got 24"):
        protocol.to_array(memoryview(data), "INT32", np.dtype(np.int32), (5,), "t")


def test_unaligned_buffer_is_copied_rather_than_misread() -> None:
    raw = bytearray(9)
    raw[1:] = np.array([1.5], np.float64).tobytes()
    array = protocol.to_array(memoryview(raw)[1:], "FP64", np.dtype(np.float64), (1,), "t")
    assert array.flags.aligned and array[0] == 1.5


@pytest.mark.parametrize("frame", [b"\xc1", b"", msgpack.packb([1, 2]), msgpack.packb("text")])
def test_unpack_rejects_what_is_not_a_msgpack_map(frame: bytes) -> None:
    with pytest.raises(MalformedMessage):
        protocol.unpack(frame)


def test_versions_and_ids() -> None:
    protocol.check_version({"v": 1})
    for bad in (2, 0, "1", True):
        with pytest.raises(UnsupportedProtocolVersion, match=r"speaks \[1\]"):
            protocol.check_version({"v": bad})
    with pytest.raises(MalformedMessage):
        protocol.check_version({})
    assert protocol.request_id({"id": 3}) == 3 and protocol.request_id({"id": "x"}) == "x"
    assert protocol.request_id({"id": True}) is None and protocol.request_id({"id": [1]}) is None


def test_errors_map_to_their_class_and_unknown_codes_survive() -> None:
    exc = protocol.error_from_wire({"code": "MODEL_NOT_READY", "message": "unloading"})
    assert type(exc) is ModelNotReady and exc.message == "unloading"
    assert type(protocol.error_from_wire({"code": "UNAVAILABLE", "message": ""})) is Unavailable
    assert type(protocol.error_from_wire({"code": "CONNECTION_LOST", "message": ""})) is ConnectionLost
    future = protocol.error_from_wire({"code": "SOMETHING_NEW", "message": "from a newer server"})
    assert type(future) is EdgeServerError and future.code == "SOMETHING_NEW"


def test_error_codes_are_unique_per_class_family() -> None:
    table = protocol._error_classes()
    assert table["SHM_OUT_OF_BOUNDS"] is ShmOutOfBounds and table["MALFORMED_MESSAGE"] is MalformedMessage


def test_decode_infer_builds_the_request() -> None:
    header = infer_header(version=2, priority=1, timeout_us=500, outputs=[{"name": "Y"}, {"name": "X"}])
    request, ctx = decode(header, np.array([1, 2], np.float32).tobytes())
    assert (
        request.model == "m" and request.version == 2 and request.priority == 1 and request.timeout_us == 500
    )
    assert request.inputs["A"].tolist() == [1.0, 2.0]
    assert request.outputs == ["Y", "X"] and ctx.order == ["Y", "X"] and ctx.rid == 5


@pytest.mark.parametrize(
    ("overrides", "frames", "match"),
    [
        ({"inputs": [{"name": "A", "datatype": "FP32", "shape": [2], "frame": 1}]}, 1, "truncated"),
        ({}, 2, "refers to 1 of them"),
        ({"inputs": [{"name": "A", "datatype": "FP32", "shape": [2]}]}, 1, "needs 'frame'"),
        ({"inputs": [{"name": "A", "datatype": "FP32", "shape": [2], "frame": 0}] * 2}, 1, "appears twice"),
        ({"outputs": [{"name": "Y"}, {"name": "Y"}]}, 1, "appears twice"),
        ({"outputs": "Y"}, 1, "array of maps"),
        ({"priority": -1}, 1, "non-negative"),
        ({"model": 7}, 1, "must be a string"),
        ({"inputs": {"A": 1}}, 1, "must be an array"),
    ],
)
def test_decode_infer_rejects(overrides: dict[str, Any], frames: int, match: str) -> None:
    with pytest.raises(MalformedMessage, match=match):
        decode(infer_header(**overrides), *([np.zeros(2, np.float32).tobytes()] * frames))


@pytest.mark.parametrize("version", ["latest", "9" * 5000, -1, True, 2**63, 1.5])
def test_decode_infer_rejects_versions_as_every_frontend_does(version: object) -> None:
    with pytest.raises(InvalidArgument, match="model version must be a non-negative integer below 2"):
        decode(infer_header(version=version), np.zeros(2, np.float32).tobytes())


def test_shm_reference_needs_a_registered_region() -> None:
    desc = {"name": "A", "datatype": "FP32", "shape": [2], "shm": {"region": "edge-server-x", "byte_size": 8}}
    with pytest.raises(ShmNotRegistered, match="not registered"):
        decode(infer_header(inputs=[desc]))
    with pytest.raises(MalformedMessage, match="shm.byte_size"):
        decode(infer_header(inputs=[{**desc, "shm": {"region": "edge-server-x", "byte_size": -1}}]))


def test_encode_result_orders_outputs_and_keeps_arrays_zero_copy() -> None:
    ctx = handlers.InferContext(rid=9, order=["B", "A"])
    a, b = np.arange(3, dtype=np.int64), np.array([b"x"], dtype=object)
    frames = handlers.encode_result(ctx, {"A": a, "B": b})
    header = protocol.unpack(frames[0])
    assert header == {
        "v": 1,
        "id": 9,
        "ok": True,
        "outputs": [
            {"name": "B", "datatype": "BYTES", "shape": [1], "frame": 0},
            {"name": "A", "datatype": "INT64", "shape": [3], "frame": 1},
        ],
    }
    assert frames[1] == b"\x01\x00\x00\x00x" and frames[2] is a


def test_client_message_layout() -> None:
    ref = _wire.ShmTensor("edge-server-r", 64, 16, "FP32", (4,))
    frames, nbytes = _wire.infer_message(
        3,
        "m",
        {"A": np.ones(2, np.float32), "B": ref},
        version=None,
        outputs={"Y": _wire.ShmRef("edge-server-r", 128, 32), "Z": None},
        priority=0,
        timeout_us=None,
    )
    header = protocol.unpack(frames[0])
    assert header["inputs"][0]["frame"] == 0 and header["inputs"][1]["shm"]["offset"] == 64
    assert header["outputs"] == [
        {"name": "Y", "shm": {"region": "edge-server-r", "offset": 128, "byte_size": 32}},
        {"name": "Z"},
    ]
    assert "version" not in header and "priority" not in header and "timeout_us" not in header
    assert len(frames) == 2 and nbytes == len(frames[0]) + 8


def test_queue_timeout_is_sent_only_when_asked_for() -> None:
    assert _common.queue_timeout_us(None) is None
    assert _common.queue_timeout_us(2500) == 2500 and _common.queue_timeout_us(np.int64(7)) == 7
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(InvalidArgument, match="queue_timeout_us"):
            _common.queue_timeout_us(bad)  # type: ignore[arg-type]
    frames, _ = _wire.infer_message(
        1, "m", {"A": np.ones(2, np.float32)}, version=None, outputs=None, priority=0, timeout_us=2500
    )
    assert protocol.unpack(frames[0])["timeout_us"] == 2500


def test_message_limit_is_the_smaller_of_the_clients_and_the_daemons() -> None:
    limit = _common.MessageLimit(None)
    limit.check(1 << 40)  # nothing known yet: the daemon still answers MESSAGE_TOO_LARGE itself
    limit.learned(1000)
    limit.check(1000)
    with pytest.raises(MessageTooLarge, match="the daemon accepts at most 1000"):
        limit.check(1001)
    own = _common.MessageLimit(500)
    own.learned(1000)
    with pytest.raises(MessageTooLarge, match="max_message_bytes is 500"):
        own.check(501)
    own.learned(None)  # a new connection: the daemon's limit is asked again
    assert own.allowed == 500
    own.learned(True)  # not a size
    assert own.daemon is None


def test_wire_datatype_comes_from_edge_server_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    """One numpy -> wire mapping: edge_server.dtypes; the protocol only remembers its answers."""
    asked: list[np.dtype] = []
    real = dtypes.from_numpy

    def spy(dtype: np.dtype) -> str:
        asked.append(np.dtype(dtype))
        return real(dtype)

    monkeypatch.setattr(protocol, "_WIRE_NAMES", {})
    monkeypatch.setattr(dtypes, "from_numpy", spy)
    for name in dtypes.config_names():
        dtype = dtypes.to_numpy(name)
        assert protocol.wire_datatype(np.empty(0, dtype)) == dtypes.to_wire(name)
    assert protocol.wire_datatype(np.array(["a\u00e9"])) == "BYTES"  # unicode arrays are BYTES
    assert protocol.wire_datatype(np.array([b"ab"])) == "BYTES"
    assert np.dtype(np.float32) in asked and np.dtype("<U2") in asked
    count = len(asked)
    protocol.wire_datatype(np.zeros(3, np.float32))
    assert len(asked) == count  # remembered
    with pytest.raises(MalformedMessage, match="complex64 has no wire datatype"):
        protocol.wire_datatype(np.zeros(1, np.complex64))


def test_one_bounds_rule_for_daemon_and_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's regions, the client's regions and ring slots all ask one check_span."""
    calls: list[tuple[int, int, int]] = []
    real = shm_region.check_span

    def spy(offset: int, byte_size: int, size: int, what: str, where: str = "") -> None:
        calls.append((offset, byte_size, size))
        real(offset, byte_size, size, what, where)

    monkeypatch.setattr(shm_region, "check_span", spy)
    region = SharedMemoryRegion(4096)
    registry = Registry().client(Owner(0))
    try:
        mapped = registry.register(region.name, inspect_fd(os.dup(region.fd), uid=0, pid=0), None)
        with pytest.raises(ShmOutOfBounds, match=r"input 'A': bytes 4000..4100 lie outside region"):
            mapped.read(4000, 100, "input 'A'")
        with pytest.raises(ShmOutOfBounds, match=r"bytes 4000..4100 lie outside region"):
            region.output(4000, 100)
        slot = ShmRing(region, 2, 1000).slots[1]
        with pytest.raises(ShmOutOfBounds, match=r"bytes 990..1010 lie outside the slot at 1024"):
            slot.output(990, 20)
        assert calls == [(4000, 100, 4096), (4000, 100, 4096), (990, 20, 1000)]
    finally:
        registry.close()
        region.close()
