"""Tensors to and from KServe v2's encodings: JSON lists, raw bytes, the binary data extension.

Pure functions, no transport: the HTTP and gRPC frontends both use them.

Every size is checked before memory is spent: a raw buffer must hold exactly ``prod(shape)`` elements,
a JSON ``data`` list exactly as many values of the right kind (no strings where numbers are expected,
no floats for integers), and a ``BYTES`` buffer exactly ``prod(shape)`` length-prefixed items.

``BF16`` has no numpy dtype: it decodes to ``float32`` (exactly: a bfloat16 is the upper half of a
float32) and ``float32`` arrays sent as ``BF16`` are rounded to the nearest bfloat16 (ties to even).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from edge_server import dtypes
from edge_server.errors import InvalidArgument, MalformedMessage, TensorSizeMismatch, shorten
from edge_server.kserve.json_bounds import check_json_objects

#: KServe v2 datatype -> numpy dtype of the decoded array.
NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BF16": np.dtype(np.float32),
    "BYTES": np.dtype(np.object_),
}
_WIRE_ITEMSIZE = {name: (2 if name == "BF16" else dtype.itemsize) for name, dtype in NUMPY.items()}
_WIRE_ITEMSIZE["BYTES"] = 0
_LE = {name: dtype.newbyteorder("<") for name, dtype in NUMPY.items() if name not in ("BYTES", "BF16")}
# Which numpy kinds a JSON ``data`` list may hold for a datatype (np.asarray of the list).
_JSON_KINDS = {"BOOL": "b", "FP16": "iuf", "FP32": "iuf", "FP64": "iuf", "BF16": "iuf"}
_LENGTH = struct.Struct("<I")
MAX_DIMS = 16
#: Triton's limit on a JSON request's nesting, and so on a tensor's ``data`` inside its four levels
#: (the body, ``inputs``, the tensor, ``data``): the data is flattened, however it nests.
MAX_JSON_DEPTH = 100
MAX_DATA_DEPTH = MAX_JSON_DEPTH - 4
MAX_DIM = 2**63 - 1  # Triton's int64 dims
MAX_ELEMENTS = 2**59  # elements of any shape, zero dims counted as 1: fits numpy with 16-byte items


def check_datatype(datatype: object, name: str) -> str:
    if not isinstance(datatype, str) or datatype not in NUMPY:
        raise InvalidArgument(
            f"tensor {shorten(name)}: unknown datatype {datatype!r}; expected one of {sorted(NUMPY)}"
        )
    return datatype


def check_shape(shape: object, name: str, datatype: str | None = None) -> tuple[int, ...]:
    """The shape as a tuple of non-negative ints (a request's shape is concrete: no -1).

    A shape whose element count, or byte size for ``datatype``, passes a signed 64-bit integer is
    refused with Triton's texts.
    """
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS:
        raise InvalidArgument(f"tensor {shorten(name)}: shape must be a list of at most {MAX_DIMS} integers")
    for dim in shape:
        if type(dim) is not int or not 0 <= dim <= MAX_DIM:
            raise InvalidArgument(
                f"tensor {shorten(name)}: shape must hold non-negative integers below 2^63, "
                f"got {shorten(list(shape))}"
            )
    count = math.prod(shape)
    if count > _INT64_MAX:
        raise InvalidArgument(
            f"invalid shape for input {shorten(name)}: shape {list(shape)} causes total element count "
            f"to exceed maximum size of {_INT64_MAX}"
        )
    itemsize = _WIRE_ITEMSIZE.get(datatype or "", 0)
    if itemsize > 1 and count > _INT64_MAX // itemsize:
        raise InvalidArgument(
            f"byte size overflow for input {shorten(name)}: element count ({count}) * data type size "
            f"({itemsize}) exceeds maximum allowed size ({_INT64_MAX})"
        )
    if math.prod(d for d in shape if d) > MAX_ELEMENTS:  # numpy refuses it, even with a zero dim in it
        raise InvalidArgument(
            f"tensor {shorten(name)}: shape {list(shape)} has more than 2^59 elements (its dims other than "
            "0 multiplied)"
        )
    return tuple(shape)


def wire_size(datatype: str, shape: tuple[int, ...]) -> int | None:
    """Bytes the raw encoding of a fixed-size datatype takes; None for BYTES (its items vary)."""
    itemsize = _WIRE_ITEMSIZE[datatype]
    return math.prod(shape) * itemsize if itemsize else None


def wire_datatype(array: np.ndarray) -> str:
    """The KServe datatype of an output array (strings and bytes are ``BYTES``)."""
    name = _WIRE_OF.get(array.dtype)
    if name is None:
        name = dtypes.to_wire(dtypes.from_numpy(array.dtype))
        if len(_WIRE_OF) < 256:  # unicode dtypes differ by length: keep the memo bounded
            _WIRE_OF[array.dtype] = name
    return name


_WIRE_OF: dict[np.dtype, str] = {}


# -- raw bytes --------------------------------------------------------------------------------------


_INT64_MAX = 2**63 - 1


def wire_itemsize(datatype: str) -> int:
    """Bytes per element of a fixed-size KServe datatype on the wire (BF16: 2)."""
    return _WIRE_ITEMSIZE[datatype]


def from_raw(
    buffer: bytes | bytearray | memoryview,
    datatype: str,
    shape: tuple[int, ...],
    name: str,
    model: str = "",
) -> np.ndarray:
    """Decode ``buffer`` (exactly one tensor's bytes) into an array of ``shape``; no copy for numbers.

    ``model``: the model the request names, for the texts of a bad BYTES tensor.
    """
    count = math.prod(shape)
    if datatype == "BYTES":
        return deserialize_bytes(buffer, count, name, model).reshape(shape)
    expected = count * _WIRE_ITEMSIZE[datatype]
    if len(buffer) != expected:
        raise TensorSizeMismatch(
            f"tensor {shorten(name)}: {datatype} {list(shape)} needs {expected} bytes, got {len(buffer)}"
        )
    if datatype == "BF16":
        halves = np.frombuffer(buffer, dtype="<u2").astype(np.uint32)
        return (halves << 16).view(np.float32).reshape(shape)
    return np.frombuffer(buffer, dtype=_LE[datatype]).reshape(shape)


def to_raw(array: np.ndarray, datatype: str) -> bytes:
    """The raw little-endian bytes of ``array`` as ``datatype`` (BYTES: length-prefixed items)."""
    if datatype == "BYTES":
        return serialize_bytes(array)
    if datatype == "BF16":
        bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # nearest bfloat16, ties to even
        return rounded.astype("<u2").tobytes()
    return np.ascontiguousarray(array, dtype=_LE[datatype]).tobytes()


class BytesCountMismatch(TensorSizeMismatch):
    """A BYTES input whose items disagree with its shape, in Triton's words (its clients match them).

    Triton checks a request's inputs in the order of its hash map, which for a request's few inputs
    is the reverse of the order they came in, so where several are wrong its clients see the last
    one: a frontend decodes every input first and raises the last of these.
    """


def deserialize_bytes(
    buffer: bytes | bytearray | memoryview, count: int, name: str, model: str = ""
) -> np.ndarray:
    """``count`` items, each a 4-byte little-endian length and that many bytes, filling ``buffer``."""
    view = memoryview(buffer).cast("B")
    where = f"inference input {shorten(name)} for model {shorten(model)}"
    if count * 4 > len(view):  # checked before the items' array is allocated
        raise BytesCountMismatch(
            f"expected {count} string elements for {where}, got {_count_items(view, count)}"
        )
    items = np.empty(count, dtype=np.object_)
    pos = 0
    for i in range(count):
        if pos == len(view):
            raise BytesCountMismatch(f"expected {count} string elements for {where}, got {i}")
        if pos + 4 > len(view):
            raise BytesCountMismatch(_partial_length(where, len(view) - pos))
        (length,) = _LENGTH.unpack_from(view, pos)
        pos += 4
        if pos + length > len(view):
            raise BytesCountMismatch(
                f"incomplete string data for {where}, expecting string of length {length} but only "
                f"{len(view) - pos} bytes available"
            )
        items[i] = bytes(view[pos : pos + length])
        pos += length
    if pos != len(view):
        if len(view) - pos < 4:
            raise BytesCountMismatch(_partial_length(where, len(view) - pos))
        raise BytesCountMismatch(
            f"unexpected number of string elements {count + 1} for {where}, expecting {count}"
        )
    return items


def _partial_length(where: str, left: int) -> str:
    return (
        f"incomplete string length indicator for {where}, expecting 4 bytes but only {left} bytes available"
    )


def _count_items(view: memoryview, limit: int) -> int:
    """How many whole length-prefixed items ``view`` starts with (at most ``limit``)."""
    pos = found = 0
    while found < limit and pos + 4 <= len(view):
        (length,) = _LENGTH.unpack_from(view, pos)
        pos += 4 + length
        if pos > len(view):
            break
        found += 1
    return found


def serialize_bytes(array: np.ndarray) -> bytes:
    """Length-prefixed items of a BYTES array (str items are UTF-8 encoded, as tritonclient does)."""
    parts = []
    for item in np.asarray(array).reshape(-1):
        if isinstance(item, str):
            data = item.encode()
        elif isinstance(item, (bytes, bytearray, memoryview, np.bytes_)):
            data = bytes(item)
        else:
            data = str(item).encode()
        parts.append(_LENGTH.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


# -- JSON ---------------------------------------------------------------------------------------------


def from_json(data: object, datatype: str, shape: tuple[int, ...], name: str) -> np.ndarray:
    """Decode a JSON ``data`` value (flat or nested list, row-major) into an array of ``shape``."""
    if not isinstance(data, list):
        data = [data]
    count = math.prod(shape)
    if datatype == "BYTES":
        flat = _flatten(data, name)
        if len(flat) != count:
            raise TensorSizeMismatch(
                f"tensor {shorten(name)}: shape {list(shape)} needs {count} values, got {len(flat)}"
            )
        items = np.empty(count, dtype=np.object_)
        for i, value in enumerate(flat):
            if isinstance(value, str):
                items[i] = value.encode()
            else:
                raise InvalidArgument(
                    f"tensor {shorten(name)}: BYTES data must be strings, element {i} is {value!r}"
                )
        return items.reshape(shape)
    try:
        array = np.asarray(data)
    except ValueError:  # ragged, or nested past numpy's 64 dimensions: the values in row-major order
        array = np.asarray(_flatten(data, name))
        if array.dtype.kind == "O":
            raise InvalidArgument(f"tensor {shorten(name)}: data holds a value that is no number") from None
    if array.size == 0 and count == 0:  # an empty list is an empty tensor of any type (numpy: float64)
        return np.empty(shape, dtype=NUMPY[datatype])
    allowed = _JSON_KINDS.get(datatype, "iu")
    if allowed == "iu" and array.dtype.kind in "fO":
        # Integers beyond int64 (UINT64's upper half) make numpy fall back to float64 or objects.
        flat = _flatten(data, name)
        if all(type(v) is int for v in flat):
            try:
                array = np.array(flat, dtype=NUMPY[datatype])
            except OverflowError:
                raise InvalidArgument(
                    f"tensor {shorten(name)}: a value is out of range for {datatype}"
                ) from None
    if array.dtype.kind not in allowed or (array.size == 0 and count != 0):
        kind = {"b": "booleans", "iu": "integers", "iuf": "numbers"}[allowed]
        raise InvalidArgument(f"tensor {shorten(name)}: {datatype} data must be {kind}, got {_sample(data)}")
    if array.size != count:
        raise TensorSizeMismatch(
            f"tensor {shorten(name)}: shape {list(shape)} needs {count} values, got {array.size}"
        )
    target = NUMPY[datatype]
    if array.dtype.kind in "iu" and target.kind in "iu":
        info = np.iinfo(target)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise InvalidArgument(f"tensor {shorten(name)}: a value is out of range for {datatype}")
    return array.astype(target, copy=False).reshape(shape)


def to_json(array: np.ndarray, datatype: str) -> list[Any]:
    """A flat ``data`` list (BYTES as UTF-8 strings; binary-only bytes need ``binary_data``)."""
    flat = np.asarray(array).reshape(-1)
    if datatype != "BYTES":
        return flat.tolist()
    out = []
    for item in flat:
        if isinstance(item, str):
            out.append(item)
            continue
        try:
            out.append(bytes(item).decode())
        except UnicodeDecodeError:
            raise InvalidArgument(
                "a BYTES output is not UTF-8 text; ask for it with the binary_data parameter"
            ) from None
    return out


def _flatten(data: list[Any], name: str, limit: int = -1) -> list[Any]:
    """The leaves of ``data`` in row-major order (the first ``limit`` of them when ``limit`` >= 0)."""
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                if len(stack) >= MAX_DATA_DEPTH:
                    raise InvalidArgument(
                        f"JSON nesting depth exceeds maximum allowed limit ({MAX_JSON_DEPTH}): "
                        f"tensor {shorten(name)}'s data is nested deeper than {MAX_DATA_DEPTH}"
                    )
                stack.append(iter(value))
                break
            flat.append(value)
            if len(flat) == limit:
                return flat
        else:
            stack.pop()
    return flat


def _sample(data: list[Any]) -> str:
    """The first values of ``data`` for an error message (never the whole input: it may be huge)."""
    try:
        head = _flatten(data, "", 8)
    except InvalidArgument:  # nested too deep: say nothing of the values
        return "..."
    text = json.dumps(head, default=repr)[:60]
    return text + ("..." if len(head) == 8 or len(text) == 60 else "")


# -- HTTP bodies with the binary tensor data extension --------------------------------------------------


def split_body(body: bytes, header_length: int | None) -> tuple[dict[str, Any], memoryview]:
    """The JSON header of an inference body and the binary part after it.

    ``header_length`` is the ``Inference-Header-Content-Length`` header (None: the body is all JSON).
    """
    view = memoryview(body)
    if header_length is None:
        header_length = len(body)
    elif not 0 <= header_length <= len(body):
        raise InvalidArgument(
            f"Inference-Header-Content-Length is {header_length}, but the body has {len(body)} bytes"
        )
    text = view[:header_length].tobytes() if header_length != len(body) else body
    return json_object(text, shapes=True), view[header_length:]


def json_object(text: bytes, *, shapes: bool) -> dict[str, Any]:
    """A request body's JSON object, its lists and objects counted before it is parsed.

    ``shapes``: an inference body, whose declared shapes bound what its ``data`` may hold
    (:func:`~edge_server.kserve.json_bounds.check_json_objects`).
    """
    check_json_objects(text, shapes=shapes)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurd nesting
        raise MalformedMessage(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise MalformedMessage(f"the request body must be a JSON object, got {type(value).__name__}")
    return value


class BinaryReader:
    """Hands out the binary part of a body in order, chunk by chunk, as inputs declare their sizes."""

    def __init__(self, data: memoryview) -> None:
        self._data = data
        self._pos = 0

    def take(self, size: object, name: str) -> memoryview:
        if type(size) is not int or size < 0:
            raise InvalidArgument(f"tensor {shorten(name)}: binary_data_size must be a non-negative integer")
        if self._pos + size > len(self._data):
            raise TensorSizeMismatch(
                f"tensor {shorten(name)}: binary_data_size {size} reaches past the end of the body "
                f"({len(self._data) - self._pos} binary bytes remain)"
            )
        chunk = self._data[self._pos : self._pos + size]
        self._pos += size
        return chunk

    def check_consumed(self) -> None:
        if self._pos != len(self._data):
            raise TensorSizeMismatch(
                f"{len(self._data) - self._pos} bytes after the JSON header belong to no input's "
                "binary_data_size"
            )


def parameters_of(entry: Mapping[str, Any], what: str) -> dict[str, Any]:
    params = entry.get("parameters", {})
    if not isinstance(params, dict):
        raise InvalidArgument(f"{what}: parameters must be a JSON object")
    return params


def encode_body(header: dict[str, Any], chunks: Iterable[bytes]) -> tuple[bytes, int | None]:
    """A response body: the JSON header then the binary chunks; and the header's length when any."""
    text = json.dumps(header, separators=(",", ":")).encode()
    binary = list(chunks)
    if not binary:
        return text, None
    return b"".join([text, *binary]), len(text)
