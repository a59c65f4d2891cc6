"""The IPC wire protocol shared by the daemon and the client library (docs/protocol.md).

A message is a ZeroMQ multipart message ``[header, *tensor frames]``.  The header is a msgpack map;
tensor bytes never pass through msgpack: they are raw frames, referenced by index from the header, or
(region, offset, byte_size) references into POSIX shared memory.  Everything that can be wrong with a
message raises an :class:`~edge_server.errors.EdgeServerError` subclass whose ``code`` goes on the
wire, so both sides agree on one meaning per code.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgpack
import numpy as np

from edge_server import dtypes, limits
from edge_server.errors import (
    EdgeServerError,
    InvalidArgument,
    MalformedMessage,
    TensorSizeMismatch,
    UnsupportedProtocolVersion,
    shorten,
)

#: The version this code speaks.  A server answers any other version with UNSUPPORTED_VERSION.
PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})

#: Request operations of protocol version 1.
OPS = frozenset(
    {
        "infer",
        "stream",
        "cancel",
        "live",
        "ready",
        "models",
        "metadata",
        "config",
        "stats",
        "status",
        "load",
        "reload",
        "unload",
        "shm_register",
        "shm_unregister",
        "shm_status",
        "ipc_status",
        "bye",
    }
)
#: Sent by the server to a client, never answered: a liveness probe the client ignores.
PING = "ping"

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: A request header larger than this is refused before it is decoded: msgpack builds one Python object
#: per byte at worst (an array of empty maps), so the header's size bounds what decoding may cost.
DEFAULT_MAX_HEADER_BYTES = 256 * 1024
#: Frames of one request (the header and its tensors); the rest of a longer message is dropped unread.
MAX_FRAMES = 1024
#: Defaults of the per-client and total limits (``--max-client-reply-bytes``, ``--max-client-requests``,
#: ``--max-requests``, ``--max-client-regions``): replies queued for a client that does not read them,
#: requests in flight (queued, running, open streams) for one client and for all, regions per client.
DEFAULT_MAX_CLIENT_REPLY_BYTES = limits.DEFAULT_MAX_CLIENT_REPLY_BYTES
DEFAULT_MAX_CLIENT_REQUESTS = limits.DEFAULT_MAX_CLIENT_REQUESTS
DEFAULT_MAX_REQUESTS = 8192
DEFAULT_MAX_CLIENT_REGIONS = 256
#: Longest array or map msgpack may build in a header, and most dims of a tensor.
MAX_CONTAINER_LEN = 65536
MAX_DIMS = 32  # numpy 1.x's own limit
MAX_DIM = 2**63 - 1
_MAX_ELEMENTS = 2**59  # elements of any shape, zero dims counted as 1: fits numpy with 16-byte items
DEFAULT_SHM_PREFIX = "edge-server-"

# KServe v2 datatype name -> numpy dtype, built from the one table in edge_server.dtypes.
WIRE_DTYPES: dict[str, np.dtype] = {dtypes.to_wire(n): dtypes.to_numpy(n) for n in dtypes.config_names()}
# numpy dtype -> wire name, filled from dtypes.from_numpy as dtypes are seen: that function scans its
# table (about 2 us), and every tensor of every message asks.
_WIRE_NAMES: dict[np.dtype, str] = {}
_WIRE_NAMES_MAX = 256  # unicode dtypes differ by length ('<U5', '<U7'): keep the memo bounded
_LEN = struct.Struct("<I")

# -- headers --------------------------------------------------------------------------------------


def pack(header: Mapping[str, Any]) -> bytes:
    """Msgpack a header (str keys, bin for bytes); never pickles."""
    return msgpack.packb(header, use_bin_type=True)


Pack = Callable[[Mapping[str, Any]], bytes]


def packer() -> Pack:
    """:func:`pack` for the use of one thread: it reuses its buffer, which halves the cost."""
    return msgpack.Packer(use_bin_type=True).pack  # type: ignore[no-any-return]


def unpack(frame: Any) -> dict[str, Any]:
    """Decode a header frame; anything but a msgpack map raises MALFORMED_MESSAGE."""
    try:
        header = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_array_len=MAX_CONTAINER_LEN,
            max_map_len=MAX_CONTAINER_LEN,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated exception types for garbage
        raise MalformedMessage(
            f"the header frame is not valid msgpack ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(header, dict):
        raise MalformedMessage(f"the header must be a msgpack map, got {type(header).__name__}")
    return header


def request_id(header: Mapping[str, Any]) -> int | str | None:
    """The header's id if it has a usable one; None otherwise (the error reply then carries id null)."""
    rid = header.get("id")
    kind = type(rid)
    if kind is int or kind is str or (kind is not bool and isinstance(rid, (int, str))):
        return rid  # type: ignore[no-any-return]
    return None


def check_version(header: Mapping[str, Any]) -> None:
    version = header.get("v")
    if version is None:
        raise MalformedMessage("the header has no protocol version 'v'")
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        shown = repr(version) if type(version) in (int, float, str) else type(version).__name__
        raise UnsupportedProtocolVersion(
            f"protocol version {shown[:40]} is not supported; this server speaks {sorted(SUPPORTED_VERSIONS)}"
        )


def field(
    header: Mapping[str, Any], key: str, kind: type | tuple[type, ...], *, required: bool = True
) -> Any:
    """``header[key]`` checked against ``kind``; None when absent and not required."""
    value = header.get(key)
    if value is None:
        if required:
            raise MalformedMessage(f"the header has no field {shorten(key)}")
        return None
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise MalformedMessage(f"field {key!r} must be {_kind_name(kind)}, got bool")
    if not isinstance(value, kind):
        raise MalformedMessage(f"field {key!r} must be {_kind_name(kind)}, got {type(value).__name__}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {int: "an integer", str: "a string", list: "an array", dict: "a map", bool: "a boolean"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def ok_header(rid: int | str | None, **fields: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": rid, "ok": True, **fields}


def error_header(rid: int | str | None, exc: EdgeServerError) -> dict[str, Any]:
    return {
        "v": PROTOCOL_VERSION,
        "id": rid,
        "ok": False,
        "error": {"code": exc.code, "message": exc.message},
    }


def _error_classes() -> dict[str, type[EdgeServerError]]:
    """Wire code -> the most general class with that code (breadth first from the root)."""
    table: dict[str, type[EdgeServerError]] = {EdgeServerError.code: EdgeServerError}
    queue: list[type[EdgeServerError]] = [EdgeServerError]
    while queue:
        cls = queue.pop(0)
        for sub in cls.__subclasses__():
            table.setdefault(sub.code, sub)
            queue.append(sub)
    return table


def error_from_wire(error: Any) -> EdgeServerError:
    """The exception a client raises for an error reply's ``error`` map; unknown codes are kept as sent."""
    if not isinstance(error, dict):
        return MalformedMessage(f"the error reply carries no error map: {error!r}")
    code = str(error.get("code", "INTERNAL"))
    message = str(error.get("message", ""))
    cls = _error_classes().get(code, EdgeServerError)
    exc = cls(message)
    exc.code = code  # keep a code from a newer server even when this client has no class for it
    return exc


# -- tensors --------------------------------------------------------------------------------------


def wire_datatype(array: np.ndarray) -> str:
    """KServe datatype name of an array (edge_server.dtypes decides); str/bytes/object arrays are BYTES."""
    dtype = array.dtype
    name = _WIRE_NAMES.get(dtype)
    if name is None:
        try:
            name = dtypes.to_wire(dtypes.from_numpy(dtype))
        except InvalidArgument:
            raise MalformedMessage(f"numpy dtype {dtype} has no wire datatype") from None
        if len(_WIRE_NAMES) < _WIRE_NAMES_MAX:
            _WIRE_NAMES[dtype] = name
    return name


def tensor_shape(desc: Mapping[str, Any], where: str) -> tuple[int, ...]:
    shape: Any = desc.get("shape")
    valid = isinstance(shape, list) and len(shape) <= MAX_DIMS
    if valid:
        for d in shape:  # a loop: all() costs a generator, and every tensor of every message asks
            if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d <= MAX_DIM:
                valid = False
                break
    if valid and math.prod(d for d in shape if d) > _MAX_ELEMENTS:
        valid = False  # numpy refuses such a shape even with a zero dim in it
    if not valid:
        raise MalformedMessage(
            f"{where}: 'shape' must be an array of at most {MAX_DIMS} integers in [0, 2^63), "
            f"got {shorten(shape)}"
        )
    return tuple(shape)


def tensor_dtype(desc: Mapping[str, Any], where: str) -> tuple[str, np.dtype]:
    datatype = desc.get("datatype")
    dtype = WIRE_DTYPES.get(datatype) if isinstance(datatype, str) else None
    if dtype is None:
        raise MalformedMessage(
            f"{where}: unknown datatype {shorten(datatype)}; expected one of {sorted(WIRE_DTYPES)}"
        )
    return datatype, dtype  # type: ignore[return-value]


def expected_nbytes(dtype: np.dtype, shape: Iterable[int]) -> int:
    return dtype.itemsize * math.prod(shape)


def tensor_array(desc: Mapping[str, Any], buffer: Any, role: str, name: str) -> np.ndarray:
    """The array that a tensor descriptor (datatype, shape) says ``buffer`` holds, without a copy.

    Every inline tensor of every message, on both sides of the socket, comes through here, so the
    usual case is checked directly; ``role`` and ``name`` ("input", "INPUT0") make the error message.
    """
    datatype = desc.get("datatype")
    dtype = WIRE_DTYPES.get(datatype) if type(datatype) is str else None
    shape = desc.get("shape")
    if dtype is None or dtype.kind == "O" or type(shape) is not list or len(shape) > MAX_DIMS:
        where = f"{role} {shorten(name)}"
        return to_array(buffer, *tensor_dtype(desc, where), tensor_shape(desc, where), where)
    count = 1
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_DIM:
            tensor_shape(desc, f"{role} {shorten(name)}")  # raises the precise error
        count *= d
    if not count:
        tensor_shape(desc, f"{role} {shorten(name)}")  # an empty tensor: its other dims must still be sane
    size = len(buffer) if type(buffer) is not memoryview else buffer.nbytes
    if size != count * dtype.itemsize:
        raise TensorSizeMismatch(
            f"{role} {shorten(name)}: {datatype} {shape} needs {count * dtype.itemsize} bytes, got {size}"
        )
    # One array object (frombuffer + reshape makes two).  ndarray(buffer=) references the buffer's
    # owner (the zmq frame, whose bytes live as long as it does) but holds no export of it, so shared
    # memory, which must not be unmapped under a live view, goes through to_array instead.
    array: np.ndarray = np.ndarray(shape, dtype, buffer)
    if not array.flags.aligned:  # numpy and runtimes tolerate it badly; a copy is cheaper than a crash
        array = array.copy()
    return array


def to_array(buffer: Any, datatype: str, dtype: np.dtype, shape: tuple[int, ...], where: str) -> np.ndarray:
    """An array over ``buffer`` without copying (BYTES are decoded, which copies)."""
    size = len(buffer) if not isinstance(buffer, memoryview) else buffer.nbytes
    if datatype == "BYTES":
        return decode_bytes(buffer, shape, where)
    want = expected_nbytes(dtype, shape)
    if size != want:
        raise TensorSizeMismatch(f"{where}: {datatype} {list(shape)} needs {want} bytes, got {size}")
    # frombuffer, not ndarray(buffer=): its array holds the buffer export, which keeps a shared-memory
    # region from being unmapped under it (mmap.close() refuses while a view is exported).
    array = np.frombuffer(buffer, dtype=dtype).reshape(shape)
    if not array.flags.aligned:  # numpy and runtimes tolerate it badly; a copy is cheaper than a crash
        array = array.copy()
    return array


def encode_bytes(array: np.ndarray) -> bytes:
    """BYTES tensor: each element in C order as a little-endian uint32 length and its bytes."""
    parts: list[bytes] = []
    for item in array.reshape(-1):
        if isinstance(item, str):
            data = item.encode("utf-8")
        elif isinstance(item, (bytes, bytearray, memoryview, np.bytes_)):
            data = bytes(item)
        else:
            raise MalformedMessage(f"a BYTES tensor element must be bytes or str, got {type(item).__name__}")
        parts.append(_LEN.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def decode_bytes(buffer: Any, shape: tuple[int, ...], where: str) -> np.ndarray:
    view = memoryview(buffer).cast("B")
    count = math.prod(shape)
    items: list[bytes] = []
    pos = 0
    end = view.nbytes
    for index in range(count):
        if pos + 4 > end:
            raise TensorSizeMismatch(
                f"{where}: BYTES data ends inside element {index} of {count} (at byte {pos} of {end})"
            )
        (length,) = _LEN.unpack_from(view, pos)
        pos += 4
        if pos + length > end:
            raise TensorSizeMismatch(
                f"{where}: BYTES element {index} claims {length} bytes but only {end - pos} remain"
            )
        items.append(bytes(view[pos : pos + length]))
        pos += length
    if pos != end:
        raise TensorSizeMismatch(f"{where}: {end - pos} bytes left over after {count} BYTES elements")
    array = np.empty(count, dtype=object)
    array[:] = items
    return array.reshape(shape)


def to_buffer(array: np.ndarray) -> tuple[str, list[int], Any]:
    """(datatype, shape, buffer) for sending ``array``; numeric arrays go out without a copy."""
    datatype = wire_datatype(array)
    if datatype == "BYTES":
        return datatype, list(array.shape), encode_bytes(array)
    return datatype, list(array.shape), np.ascontiguousarray(array)


def shm_ref(desc: Any, where: str) -> tuple[str, int, int]:
    """(region, offset, byte_size) of a ``shm`` descriptor."""
    if not isinstance(desc, dict):
        raise MalformedMessage(f"{where}: 'shm' must be a map with region, offset and byte_size")
    region = desc.get("region")
    offset = desc.get("offset", 0)
    byte_size = desc.get("byte_size")
    if not isinstance(region, str) or not region:
        raise MalformedMessage(f"{where}: 'shm.region' must be a region name, got {shorten(region)}")
    for key, value in (("offset", offset), ("byte_size", byte_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise MalformedMessage(
                f"{where}: 'shm.{key}' must be a non-negative integer, got {shorten(value)}"
            )
    return region, offset, byte_size  # type: ignore[return-value]
