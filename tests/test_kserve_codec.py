"""Unit tests of the KServe codec: JSON and raw tensors, BYTES, BOOL, FP16, BF16, the binary extension."""

from __future__ import annotations

import gzip
import json
import struct

import numpy as np
import pytest
import tritonclient.utils as tu

from edge_server.errors import InvalidArgument, MalformedMessage, TensorSizeMismatch
from edge_server.kserve import codec


@pytest.mark.parametrize(
    ("datatype", "values"),
    [
        ("BOOL", [[True, False], [False, True]]),
        ("UINT8", [[0, 255], [7, 8]]),
        ("INT8", [[-128, 127], [0, 1]]),
        ("UINT16", [[0, 65535], [1, 2]]),
        ("INT32", [[-(2**31), 2**31 - 1], [3, 4]]),
        ("UINT64", [[0, 2**64 - 1], [5, 6]]),
        ("INT64", [[-(2**63), 2**63 - 1], [7, 8]]),
        ("FP16", [[0.5, -1.25], [65504.0, 0.0]]),
        ("FP32", [[1.5, -2.0], [3.25, 1e-3]]),
        ("FP64", [[1.5, -2.0], [3.25, 1e-300]]),
    ],
)
def test_json_and_raw_round_trip_every_numeric_type(datatype: str, values: list[list[object]]) -> None:
    array = codec.from_json(values, datatype, (2, 2), "x")
    assert array.dtype == codec.NUMPY[datatype]
    assert array.shape == (2, 2)
    np.testing.assert_array_equal(array, np.array(values, dtype=codec.NUMPY[datatype]))
    flat = [v for row in values for v in row]
    assert codec.from_json(flat, datatype, (2, 2), "x").tolist() == array.tolist()  # flat and nested
    raw = codec.to_raw(array, datatype)
    assert raw == array.astype(codec.NUMPY[datatype].newbyteorder("<")).tobytes()
    np.testing.assert_array_equal(codec.from_raw(raw, datatype, (2, 2), "x"), array)
    assert codec.to_json(array, datatype) == array.reshape(-1).tolist()


def test_bytes_match_tritonclient_serialization() -> None:
    items = np.array([b"hello", b"", "w\u00f6rld".encode(), b"\x00\xff"], dtype=object).reshape(2, 2)
    raw = codec.to_raw(items, "BYTES")
    assert raw == tu.serialize_byte_tensor(items).item()
    decoded = codec.from_raw(raw, "BYTES", (2, 2), "s")
    assert decoded.tolist() == items.tolist()
    assert codec.to_json(decoded[:1, :1], "BYTES") == ["hello"]
    assert codec.from_json(["a", "b\u00e9"], "BYTES", (2,), "s").tolist() == [b"a", "b\u00e9".encode()]


def test_bytes_buffers_that_lie_are_refused_in_tritons_words() -> None:
    good = struct.pack("<I", 3) + b"abc"
    where = "for inference input 's' for model 'm'"
    with pytest.raises(
        TensorSizeMismatch, match=f"incomplete string data {where}, expecting string of length 100"
    ):
        codec.from_raw(struct.pack("<I", 100) + b"abc", "BYTES", (1,), "s", "m")
    with pytest.raises(
        TensorSizeMismatch, match=f"incomplete string length indicator {where}, expecting 4 bytes"
    ):
        codec.from_raw(good + b"x", "BYTES", (1,), "s", "m")
    with pytest.raises(
        TensorSizeMismatch, match=f"unexpected number of string elements 2 {where}, expecting 1"
    ):
        codec.from_raw(good + good, "BYTES", (1,), "s", "m")
    with pytest.raises(TensorSizeMismatch, match=f"expected 1000 string elements {where}, got 1"):
        codec.from_raw(good, "BYTES", (1000,), "s", "m")  # refused before any item is allocated
    with pytest.raises(TensorSizeMismatch, match=f"expected 3 string elements {where}, got 2"):
        codec.from_raw(good * 2, "BYTES", (3,), "s", "m")  # 14 bytes: past the first check
    with pytest.raises(InvalidArgument, match="must be strings"):
        codec.from_json([1], "BYTES", (1,), "s")


def test_bf16_is_the_upper_half_of_float32_rounded_to_nearest_even() -> None:
    exact = np.array([1.0, -2.5, 3.140625, 0.0], dtype=np.float32)
    raw = codec.to_raw(exact, "BF16")
    assert len(raw) == 8
    np.testing.assert_array_equal(codec.from_raw(raw, "BF16", (4,), "b"), exact)
    # 1 + 2**-8 lies halfway between two bfloat16 values: ties go to the even one (1.0)
    tie = np.array([1 + 2**-8, 1 + 3 * 2**-8], dtype=np.float32)
    np.testing.assert_array_equal(
        codec.from_raw(codec.to_raw(tie, "BF16"), "BF16", (2,), "b"), [1.0, 1 + 2**-6]
    )
    from_json = codec.from_json([1.0, 2.0], "BF16", (2,), "b")
    assert from_json.dtype == np.float32


def test_raw_size_must_match_shape_exactly() -> None:
    with pytest.raises(TensorSizeMismatch, match="needs 16 bytes, got 12"):
        codec.from_raw(b"\0" * 12, "FP32", (2, 2), "x")


@pytest.mark.parametrize(
    ("data", "datatype", "match"),
    [
        (["1.5"], "FP32", "must be numbers"),
        ([1.5], "INT32", "must be integers"),
        ([1], "BOOL", "must be booleans"),
        ([300], "UINT8", "out of range"),
        ([-1], "UINT32", "out of range"),
    ],
)
def test_json_data_of_the_wrong_kind_is_refused(data: list[object], datatype: str, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        codec.from_json(data, datatype, (len(data),), "x")


def test_json_count_and_shape_checks() -> None:
    with pytest.raises(TensorSizeMismatch, match="needs 4 values, got 3"):
        codec.from_json([1, 2, 3], "INT32", (2, 2), "x")
    with pytest.raises(InvalidArgument, match="non-negative integers"):
        codec.check_shape([2, -1], "x")
    with pytest.raises(InvalidArgument, match="non-negative integers"):
        codec.check_shape([2, "3"], "x")
    with pytest.raises(InvalidArgument, match="unknown datatype"):
        codec.check_datatype("FLOAT", "x")
    assert codec.from_json([], "FP32", (0, 3), "x").shape == (0, 3)


def test_non_utf8_bytes_in_json_ask_for_binary_data() -> None:
    with pytest.raises(InvalidArgument, match="binary_data"):
        codec.to_json(np.array([b"\xff\xfe"], dtype=object), "BYTES")


def test_binary_extension_body_split_and_read_in_order() -> None:
    header = {"inputs": [{"name": "a", "parameters": {"binary_data_size": 4}}]}
    text = json.dumps(header).encode()
    body = text + b"\x01\x02\x03\x04" + b"\x05\x06"
    parsed, binary = codec.split_body(body, len(text))
    assert parsed == header
    reader = codec.BinaryReader(binary)
    assert bytes(reader.take(4, "a")) == b"\x01\x02\x03\x04"
    with pytest.raises(TensorSizeMismatch, match="belong to no input"):
        reader.check_consumed()
    with pytest.raises(TensorSizeMismatch, match="past the end"):
        reader.take(3, "b")
    assert bytes(reader.take(2, "b")) == b"\x05\x06"
    reader.check_consumed()


def test_bad_bodies() -> None:
    with pytest.raises(MalformedMessage, match="not valid JSON"):
        codec.split_body(b"{not json", None)
    with pytest.raises(MalformedMessage, match="JSON object"):
        codec.split_body(b"[1, 2]", None)
    with pytest.raises(InvalidArgument, match="Inference-Header-Content-Length is 99"):
        codec.split_body(b"{}", 99)
    with pytest.raises(InvalidArgument, match="binary_data_size"):
        codec.BinaryReader(memoryview(b"")).take(-1, "a")


def test_encode_body_puts_binary_after_the_json_header() -> None:
    body, length = codec.encode_body({"outputs": []}, [b"\x01\x02"])
    assert length is not None and body[length:] == b"\x01\x02"
    assert json.loads(body[:length]) == {"outputs": []}
    assert codec.encode_body({"a": 1}, []) == (b'{"a":1}', None)
    assert gzip.decompress(gzip.compress(body)) == body


def test_wire_datatype_of_outputs() -> None:
    assert codec.wire_datatype(np.zeros(1, np.float16)) == "FP16"
    assert codec.wire_datatype(np.array([b"x"], dtype=object)) == "BYTES"
    assert codec.wire_datatype(np.zeros(1, np.bool_)) == "BOOL"


def test_absurdly_nested_json_is_malformed_not_a_crash() -> None:
    with pytest.raises(MalformedMessage, match="refused unparsed"):  # counted before json.loads
        codec.split_body(b"[" * 100_000 + b"]" * 100_000, None)
    with pytest.raises(MalformedMessage, match="not valid JSON"):  # below the size that is counted
        codec.split_body(b"[" * 10_000 + b"]" * 10_000, None)


@pytest.mark.parametrize("window", [7, 64, 4096])
def test_json_bounds_count_by_window_as_by_whole_body(monkeypatch: pytest.MonkeyPatch, window: int) -> None:
    """Strings that straddle windows (escaped quotes, brackets and commas inside them) are skipped whole."""
    from edge_server.kserve import json_bounds

    monkeypatch.setattr(json_bounds, "WINDOW", window)
    parts = [b'"a[,{"', b'"\\\\"', b'"x\\"[,"', b"[1,2]", b' {"k": [3]}, ', b'"' + b"[" * 100 + b'"']
    body = b"[" + b",".join(parts * 50) + b"]"
    whole = json_bounds._STRING.sub(b'""', body)
    expected = (whole.count(b"[") + whole.count(b"{"), whole.count(b","))
    assert json_bounds._count(body, 1 << 30, 1 << 30) == (*expected, True)


def test_json_bounds_stop_at_the_first_window_past_the_allowance() -> None:
    """An 8 MiB body of ``[],`` is refused after its first window, not after counting all of it."""
    from edge_server.kserve import json_bounds

    head = b'{"inputs":[{"name":"I","datatype":"FP32","shape":[4],"data":['
    body = head + b"[]," * ((8 << 20) // 3) + b"[]]}]}"
    containers, _values, whole = json_bounds._count(body, 5000, 5000)
    assert not whole and containers <= json_bounds.WINDOW // 3 + 1
    with pytest.raises(MalformedMessage, match="holds at least"):
        codec.split_body(body, None)


def nested(depth: int, value: object) -> object:
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(("datatype", "value"), [("BYTES", "hello"), ("INT64", 123), ("FP32", 1.5)])
def test_json_data_nests_as_deep_as_tritons_limit(datatype: str, value: object) -> None:
    """Triton flattens ``data`` however it nests (L0_http takes depth 50) up to its JSON limit (100)."""
    decoded = codec.from_json(nested(50, value), datatype, (1, 1), "INPUT0")
    assert decoded.shape == (1, 1)
    assert codec.from_json(nested(90, value), datatype, (1,), "INPUT0").shape == (1,)  # past numpy's 64
    with pytest.raises(InvalidArgument, match=r"JSON nesting depth exceeds maximum allowed limit \(100\)"):
        codec.from_json(nested(120, value), datatype, (1, 1), "INPUT0")
    assert codec.from_json([[1, 2], [3]], "INT32", (3,), "ragged").tolist() == [1, 2, 3]  # as Triton
