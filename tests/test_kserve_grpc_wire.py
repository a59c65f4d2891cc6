"""ModelInferRequest parsed with its raw contents as views (edge_server.kserve.grpc_wire): the same
request as protobuf's own parse, hostile bytes refused as protobuf refuses them, and large tensors
over the real daemon's gRPC port, unary and streamed, arriving intact."""

from __future__ import annotations

import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

from edge_server.kserve.grpc_wire import VIEW_FROM_BYTES, parse_infer_request
from tests.kserve_daemon import KServeDaemon


def request(*raws: bytes) -> service_pb2.ModelInferRequest:
    msg = service_pb2.ModelInferRequest(model_name="m", model_version="2", id="r-1")
    msg.parameters["sequence_id"].int64_param = 7
    for k, raw in enumerate(raws):
        msg.inputs.add(name=f"x{k}", datatype="UINT8", shape=[len(raw)])
    msg.outputs.add(name="y")
    msg.raw_input_contents.extend(raws)
    return msg


def test_large_request_keeps_raw_contents_as_views_of_the_wire() -> None:
    big = np.random.default_rng(1).integers(0, 256, VIEW_FROM_BYTES + 5, dtype=np.uint8).tobytes()
    msg = request(big, b"", b"\x01\x02")
    wire = msg.SerializeToString()
    parsed = parse_infer_request(wire)
    assert parsed.raw is not None
    assert [bytes(v) for v in parsed.raw] == [big, b"", b"\x01\x02"]
    assert all(v.obj is wire for v in parsed.raw)  # views, not copies
    expected = service_pb2.ModelInferRequest()
    expected.CopyFrom(msg)
    del expected.raw_input_contents[:]
    assert parsed.message == expected


def test_small_request_is_protobufs_own_parse() -> None:
    msg = request(b"abc")
    parsed = parse_infer_request(msg.SerializeToString())
    assert parsed.raw is None and parsed.message == msg


@pytest.mark.parametrize(
    "cut",
    [
        lambda wire: wire[:-1],  # the last raw entry is cut short
        lambda wire: wire + b"\x3a\xff\xff\xff\xff\x0f",  # a raw entry longer than the message
        lambda wire: wire + b"\xff" * 11,  # a varint that never ends
        lambda wire: wire + b"\x0b",  # a group start without its end
    ],
)
def test_hostile_bytes_are_refused_as_protobuf_refuses_them(cut: object) -> None:
    wire = cut(request(bytes(VIEW_FROM_BYTES)).SerializeToString())  # type: ignore[operator]
    with pytest.raises(DecodeError):
        service_pb2.ModelInferRequest.FromString(wire)
    with pytest.raises(DecodeError):
        parse_infer_request(wire)


def test_large_frames_over_the_daemon_unary_and_streamed(kserve: KServeDaemon) -> None:
    client = grpcclient.InferenceServerClient(kserve.grpc_url)
    rng = np.random.default_rng(5)
    frames = [rng.integers(0, 256, (240, 320 + k, 3), dtype=np.uint8) for k in range(3)]
    assert min(f.nbytes for f in frames) > VIEW_FROM_BYTES  # the view path, not protobuf's

    def tensor(frame: np.ndarray) -> grpcclient.InferInput:
        t = grpcclient.InferInput("frame", list(frame.shape), "UINT8")
        t.set_data_from_numpy(frame)
        return t

    def check(result: grpcclient.InferResult, frame: np.ndarray) -> None:
        np.testing.assert_array_equal(result.as_numpy("shape"), frame.shape)
        np.testing.assert_array_equal(result.as_numpy("head"), frame.reshape(-1)[:8])
        np.testing.assert_array_equal(result.as_numpy("tail"), frame.reshape(-1)[-8:])

    try:
        for frame in frames:
            check(client.infer("frame", [tensor(frame)]), frame)
        results: queue.Queue[tuple[object, object]] = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        for k, frame in enumerate(frames):
            client.async_stream_infer("frame", [tensor(frame)], request_id=str(k))
        for _ in frames:
            result, error = results.get(timeout=30)
            assert error is None, error
            check(result, frames[int(result.get_response().id)])  # type: ignore[arg-type,attr-defined]
        client.stop_stream()
    finally:
        client.close()
