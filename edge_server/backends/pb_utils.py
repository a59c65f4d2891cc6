"""Triton's ``triton_python_backend_utils`` for models that run inside edge-server.

A ``model.py`` written for Triton's Python backend does ``import triton_python_backend_utils as
pb_utils``; the Python backend makes that name resolve to this module.  Only the parts a model uses on
the request path are here; BLS calls (``InferenceRequest.exec``) arrive with the pipelines work.
``TritonError`` codes reach the client as our stable error codes (see ``backends/python.py``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from edge_server import dtypes
from edge_server.backends.pb_autocomplete import ModelConfig as ModelConfig
from edge_server.backends.pb_context import Logger as Logger
from edge_server.backends.pb_context import LogLevel as LogLevel
from edge_server.backends.pb_context import get_model_dir as get_model_dir
from edge_server.config import schema

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2


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
        if not isinstance(array, np.ndarray):
            raise TritonError(f"Tensor {name!r}: expected a numpy array, got {type(array).__name__}")
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


class InferenceResponseSender:
    """A decoupled model's way to answer: any number of ``send(response)``, then one FINAL flag.

    It may be used from any thread, also after ``execute`` returned.  ``emit`` is the backend's: it
    checks and converts the response and hands it to the request's stream.
    """

    def __init__(self, emit: Callable[[InferenceResponse | None, bool], bool], cancelled: Callable[[], bool]):
        self._emit = emit
        self._cancelled = cancelled

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise TritonModelException(
                f"send(): unknown flags {flags!r}; use 0 or TRITONSERVER_RESPONSE_COMPLETE_FINAL"
            )
        final = flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if response is None and not final:
            raise TritonModelException(
                "send(): give a response, or flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL"
            )
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(
                f"send(): expected an InferenceResponse, got {type(response).__name__}"
            )
        if not self._emit(response, final):
            raise TritonModelException(
                "send(): the response sender is closed (the final flag was already sent)"
            )

    def is_cancelled(self) -> bool:
        return self._cancelled()


class InferenceRequest:
    """One request handed to ``TritonPythonModel.execute``.

    ``flags`` holds ``TRITONSERVER_REQUEST_FLAG_SEQUENCE_START``/``_END``; ``timeout`` is the
    request's timeout in microseconds (0: none), as in Triton.
    """

    def __init__(
        self,
        inputs: dict[str, np.ndarray],
        requested_outputs: Iterable[str],
        request_id: str = "",
        *,
        parameters: Mapping[str, Any] | None = None,
        correlation_id: int | str = 0,
        flags: int = 0,
        timeout: int = 0,
        sender: InferenceResponseSender | None = None,
    ) -> None:
        self._inputs = [Tensor(name, array) for name, array in inputs.items()]
        self._requested = list(requested_outputs)
        self._request_id = request_id
        self._parameters = dict(parameters or {})
        self._correlation_id = correlation_id
        self._flags = flags
        self._timeout = timeout
        self._sender = sender

    def inputs(self) -> list[Tensor]:
        return list(self._inputs)

    def requested_output_names(self) -> list[str]:
        return list(self._requested)

    def request_id(self) -> str:
        return self._request_id

    def parameters(self) -> str:
        """The request's parameters as a JSON object string, as Triton hands them to a model."""
        return json.dumps(self._parameters)

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def timeout(self) -> int:
        """The request's queue timeout in microseconds (0: none)."""
        return self._timeout

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            raise TritonModelException(
                "get_response_sender() is only available to decoupled models "
                "(model_transaction_policy { decoupled: true })"
            )
        return self._sender

    def is_cancelled(self) -> bool:
        return self._sender.is_cancelled() if self._sender is not None else False


def _parameters_json(parameters: Any) -> str:
    """Triton's rule for response parameters: string keys, bool/int/str values, kept as JSON text."""
    if parameters is None:
        return "{}"
    if isinstance(parameters, str):
        parameters = json.loads(parameters)
    if not isinstance(parameters, dict):
        raise TritonModelException(f"parameters must be a dict, got {type(parameters).__name__}")
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(f"parameter keys must be strings, got {key!r}")
        if not isinstance(value, bool | int | str):
            raise TritonModelException(
                f"parameter {key!r}: values must be bool, int or str, got {type(value).__name__}"
            )
    return json.dumps(parameters)


class InferenceResponse:
    """One response: output tensors, or an error for its request; ``parameters()`` is JSON text."""

    def __init__(
        self,
        output_tensors: list[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: dict[str, bool | int | str] | str | None = None,
    ) -> None:
        self._outputs = list(output_tensors or [])
        self._error = error
        # TODO(issue 9): response parameters do not reach clients yet; Result carries outputs only.
        self._parameters = _parameters_json(parameters)

    def parameters(self) -> str:
        return self._parameters

    def output_tensors(self) -> list[Tensor]:
        return list(self._outputs)

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("input", []) if t["name"] == name), None)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("output", []) if t["name"] == name), None)


def triton_string_to_numpy(triton_type: str) -> type:
    """Numpy scalar type for a config name such as ``TYPE_FP32`` (Triton returns the type, not a dtype)."""
    return dtypes.to_numpy(triton_type).type


def numpy_to_triton_string(dtype: Any) -> str:
    return dtypes.from_numpy(np.dtype(dtype))


def serialize_config(config: dict[str, Any]) -> str:
    """``args["model_config"]``: the model config as JSON, as Triton passes it."""
    return json.dumps(config)


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    """Whether the config (``json.loads(args["model_config"])``) makes the model decoupled."""
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


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


# Custom metrics (Triton's pb_utils.MetricFamily / Metric): see python_metrics.py.
from edge_server.backends.python_metrics import Metric as Metric  # noqa: E402
from edge_server.backends.python_metrics import MetricFamily as MetricFamily  # noqa: E402
