"""Triton data type names and their numpy, ONNX and wire equivalents, in one table.

``TYPE_BF16`` is ``ml_dtypes.bfloat16`` (numpy has no bfloat16; ml_dtypes is the numpy extension type
JAX and TensorFlow use): two bytes per element on the wire, as in KServe v2's ``BF16``.  ONNX Runtime's
Python API does not take or return such arrays; its backend converts at its edge.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from edge_server.errors import InvalidArgument

# Triton config name -> (KServe v2 wire name, numpy dtype).  TYPE_STRING travels as numpy object arrays
# of bytes, as in Triton's Python backend.
_TABLE: dict[str, tuple[str, np.dtype]] = {
    "TYPE_BOOL": ("BOOL", np.dtype(np.bool_)),
    "TYPE_UINT8": ("UINT8", np.dtype(np.uint8)),
    "TYPE_UINT16": ("UINT16", np.dtype(np.uint16)),
    "TYPE_UINT32": ("UINT32", np.dtype(np.uint32)),
    "TYPE_UINT64": ("UINT64", np.dtype(np.uint64)),
    "TYPE_INT8": ("INT8", np.dtype(np.int8)),
    "TYPE_INT16": ("INT16", np.dtype(np.int16)),
    "TYPE_INT32": ("INT32", np.dtype(np.int32)),
    "TYPE_INT64": ("INT64", np.dtype(np.int64)),
    "TYPE_FP16": ("FP16", np.dtype(np.float16)),
    "TYPE_FP32": ("FP32", np.dtype(np.float32)),
    "TYPE_FP64": ("FP64", np.dtype(np.float64)),
    "TYPE_STRING": ("BYTES", np.dtype(np.object_)),
    "TYPE_BF16": ("BF16", np.dtype(ml_dtypes.bfloat16)),
}

_WIRE_TO_CONFIG = {wire: name for name, (wire, _) in _TABLE.items()}

# ONNX Runtime reports element types as 'tensor(float)' etc.
_ORT_TO_CONFIG = {
    "tensor(bool)": "TYPE_BOOL",
    "tensor(uint8)": "TYPE_UINT8",
    "tensor(uint16)": "TYPE_UINT16",
    "tensor(uint32)": "TYPE_UINT32",
    "tensor(uint64)": "TYPE_UINT64",
    "tensor(int8)": "TYPE_INT8",
    "tensor(int16)": "TYPE_INT16",
    "tensor(int32)": "TYPE_INT32",
    "tensor(int64)": "TYPE_INT64",
    "tensor(float16)": "TYPE_FP16",
    "tensor(float)": "TYPE_FP32",
    "tensor(double)": "TYPE_FP64",
    "tensor(string)": "TYPE_STRING",
    "tensor(bfloat16)": "TYPE_BF16",
}


def config_names() -> list[str]:
    """All data type names a config may use."""
    return list(_TABLE)


def to_numpy(config_type: str) -> np.dtype:
    """Numpy dtype for a config type name such as ``TYPE_FP32``."""
    try:
        return _TABLE[config_type][1]
    except KeyError:
        raise InvalidArgument(f"unsupported data type {config_type!r}") from None


def to_wire(config_type: str) -> str:
    """KServe v2 datatype string (``FP32``, ``BYTES``) for a config type name."""
    return _TABLE[config_type][0]


def from_wire(wire: str) -> str:
    """Config type name for a KServe v2 datatype string."""
    try:
        return _WIRE_TO_CONFIG[wire]
    except KeyError:
        raise InvalidArgument(
            f"unknown datatype {wire!r}; expected one of {sorted(_WIRE_TO_CONFIG)}"
        ) from None


def from_numpy(dtype: np.dtype) -> str:
    """Config type name of a numpy dtype; unicode and bytes arrays count as TYPE_STRING."""
    dtype = np.dtype(dtype)
    if dtype.kind in ("O", "S", "U"):
        return "TYPE_STRING"
    for name, (_, np_dtype) in _TABLE.items():
        if np_dtype == dtype:
            return name
    raise InvalidArgument(f"numpy dtype {dtype} has no Triton equivalent")


def from_onnxruntime(ort_type: str) -> str:
    """Config type name for an ONNX Runtime type string such as ``tensor(float)``."""
    try:
        return _ORT_TO_CONFIG[ort_type]
    except KeyError:
        raise InvalidArgument(f"ONNX element type {ort_type!r} is not supported") from None


def as_bytes_array(array: np.ndarray, *, where: str = "tensor", stringify: bool = False) -> np.ndarray:
    """``array`` as TYPE_STRING travels everywhere: a numpy object array of ``bytes`` (Triton's form).

    ``str`` elements and unicode arrays are UTF-8 encoded, fixed-width bytes arrays (``S``) become
    objects; an array that already holds only ``bytes`` is returned as is.  Anything else (numbers,
    None inside an object array) is an InvalidArgument naming ``where``, unless ``stringify``: then
    it becomes ``str(item)`` UTF-8 encoded, as Triton's Python backend serializes a model's output.
    """
    kind = array.dtype.kind
    if kind in "SU":
        encoded = np.empty(array.size, dtype=object)
        if kind == "S":
            encoded[:] = [bytes(x) for x in array.flat]
        else:
            encoded[:] = [str(x).encode("utf-8") for x in array.flat]
        return encoded.reshape(array.shape)
    if kind != "O":
        raise InvalidArgument(f"{where}: expected TYPE_STRING (bytes), got {array.dtype}")
    flat = array.reshape(-1)
    if all(type(x) is bytes for x in flat):
        return array
    encoded = np.empty(array.size, dtype=object)
    for index, item in enumerate(flat):
        if isinstance(item, bytes):
            encoded[index] = bytes(item)
        elif isinstance(item, str):
            encoded[index] = item.encode("utf-8")
        elif stringify:
            encoded[index] = str(item).encode("utf-8")
        else:
            raise InvalidArgument(
                f"{where}: TYPE_STRING element {index} is {type(item).__name__}, expected bytes or str"
            )
    return encoded.reshape(array.shape)


def as_str_array(array: np.ndarray, *, where: str = "tensor") -> np.ndarray:
    """An object array of ``bytes`` as ONNX Runtime's Python API needs it: ``str`` (UTF-8 decoded).

    ONNX Runtime turns a ``bytes`` element into the text of its repr (``"b'a'"``) without a word, so
    every string tensor is converted at its edge; bytes that are not UTF-8 cannot be passed at all.
    """
    flat = array.reshape(-1)
    decoded = np.empty(array.size, dtype=object)
    for index, item in enumerate(flat):
        if isinstance(item, bytes):
            try:
                decoded[index] = item.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidArgument(
                    f"{where}: element {index} is not UTF-8 ({exc.reason} at byte {exc.start}); "
                    "ONNX Runtime string tensors must be UTF-8"
                ) from None
        else:
            decoded[index] = str(item)
    return decoded.reshape(array.shape)
