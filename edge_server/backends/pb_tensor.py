"""Tensors and data types of Triton's ``triton_python_backend_utils`` (re-exported by :mod:`pb_utils`).

``Tensor`` (numpy and DLPack), the ``DataType`` conversions, the serialised form of bytes tensors,
and the two exception types a model sees: what a ``model.py`` handles as data, apart from requests,
responses and BLS (:mod:`edge_server.backends.pb_utils`).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from edge_server import dtypes
from edge_server.config import schema


class TritonModelException(Exception):
    """What Triton raises into model code when a call it made fails (and what models raise)."""


class TritonError(Exception):
    """An error a model returns for one request (``InferenceResponse(error=...)``) or raises."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        super().__init__(message)
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, code={self._code})"


class _CPUDLPack:
    """Gives a bare DLPack capsule the protocol ``np.from_dlpack`` reads (CPU memory only)."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU


class Tensor:
    """A named numpy array, as in Triton's Python backend."""

    def __init__(self, name: str, array: np.ndarray) -> None:
        if not isinstance(name, str) or not isinstance(array, np.ndarray):  # TypeError, as Triton's binding
            raise TypeError(
                f"Tensor(name: str, array: numpy.ndarray): got {type(name).__name__}, {type(array).__name__}"
            )
        self._name = name
        self._array = array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def is_cpu(self) -> bool:
        return True

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def triton_dtype(self) -> int:
        """The ``DataType`` enum number (``TYPE_FP32`` is 11), as Triton's ``triton_dtype()``."""
        data_type = schema.model_config_descriptor().file.enum_types_by_name["DataType"]
        return int(data_type.values_by_name[dtypes.from_numpy(self._array.dtype)].number)

    def to_dlpack(self) -> Any:
        """A DLPack capsule over this tensor's memory (no copy); strings have no DLPack form."""
        if self._array.dtype.kind in "OSU":
            raise TritonModelException(f"tensor {self._name!r}: string tensors cannot be exported to DLPack")
        return self._array.__dlpack__()

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU: every tensor here is in host memory

    @staticmethod
    def from_dlpack(name: str, dlpack: Any) -> Tensor:
        """A tensor over a DLPack capsule or an object with ``__dlpack__`` (CPU memory; no copy)."""
        source = dlpack if hasattr(dlpack, "__dlpack__") else _CPUDLPack(dlpack)
        try:
            array = np.from_dlpack(source)
        except (BufferError, TypeError, RuntimeError, ValueError) as exc:
            raise TritonModelException(
                f"tensor {name!r}: cannot import from DLPack ({exc}); only CPU tensors are supported here"
            ) from exc
        return Tensor(name, array)


def triton_string_to_numpy(triton_type: str) -> type:
    """Numpy scalar type for a config name such as ``TYPE_FP32`` (Triton returns the type, not a dtype)."""
    return dtypes.to_numpy(triton_type).type


def numpy_to_triton_string(dtype: Any) -> str:
    return dtypes.from_numpy(np.dtype(dtype))


def _data_type_numbers() -> dict[str, int]:
    enum = schema.model_config_descriptor().file.enum_types_by_name["DataType"]
    return {value.name: int(value.number) for value in enum.values}


def triton_to_numpy_type(data_type: int) -> type | None:
    """Numpy scalar type for a ``DataType`` enum number (``11`` -> ``np.float32``); None if unknown."""
    names = {number: name for name, number in _data_type_numbers().items()}
    name = names.get(int(data_type))
    if name is None or name not in dtypes.config_names():
        return None
    return dtypes.to_numpy(name).type


def numpy_to_triton_type(data_type: Any) -> int | None:
    """``DataType`` enum number for a numpy type (``np.float32`` -> ``11``); None if it has none."""
    try:
        return _data_type_numbers()[dtypes.from_numpy(np.dtype(data_type))]
    except Exception:
        return None


def serialize_byte_tensor(input_tensor: np.ndarray) -> np.ndarray:
    """Triton's serialised form of a bytes tensor, as one flat uint8 array.

    Each element in C order as a little-endian uint32 length and its bytes (``str`` UTF-8 encoded).
    """
    if input_tensor.size == 0:
        return np.empty(0, dtype=np.uint8)
    chunks = []
    for item in dtypes.as_bytes_array(np.asarray(input_tensor)).reshape(-1):
        chunks.append(struct.pack("<I", len(item)))
        chunks.append(item)
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def deserialize_bytes_tensor(encoded_tensor: Any) -> np.ndarray:
    """The inverse of :func:`serialize_byte_tensor`: a flat object array of ``bytes``."""
    raw = (
        bytes(np.asarray(encoded_tensor, dtype=np.uint8))
        if not isinstance(encoded_tensor, bytes)
        else encoded_tensor
    )
    items: list[bytes] = []
    pos = 0
    while pos < len(raw):
        if pos + 4 > len(raw):
            raise TritonModelException("serialized bytes tensor ends inside a length prefix")
        (length,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + length > len(raw):
            raise TritonModelException("serialized bytes tensor ends inside an element")
        items.append(raw[pos : pos + length])
        pos += length
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out
