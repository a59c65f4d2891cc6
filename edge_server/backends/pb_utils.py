"""Triton's ``triton_python_backend_utils`` for models that run inside edge-server.

A ``model.py`` written for Triton's Python backend does ``import triton_python_backend_utils as
pb_utils``; the Python backend makes that name resolve to this module.  Only the parts a model uses on
the request path are here; BLS calls (``InferenceRequest.exec``) arrive with the pipelines work.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from edge_server import dtypes
from edge_server.request import REQUEST_FLAG_SEQUENCE_END, REQUEST_FLAG_SEQUENCE_START


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


#: ``InferenceResponseSender.send(flags=...)``: this is the last response of the request.
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
#: ``InferenceRequest.flags()`` bits of a sequence's first and last request.
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = REQUEST_FLAG_SEQUENCE_START
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = REQUEST_FLAG_SEQUENCE_END


class TritonModelException(Exception):
    """Raised by the server's utilities (a closed response sender, a bad call) into model code."""


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
    """One request handed to ``TritonPythonModel.execute``."""

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


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None) -> None:
        self._outputs = list(output_tensors or [])
        self._error = error

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


class ModelConfig:
    """The object ``auto_complete_config(auto_complete_model_config)`` receives."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._config = config

    def as_dict(self) -> dict[str, Any]:
        return self._config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        self._config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self) -> None:
        self._config.setdefault("dynamic_batching", {})

    def add_input(self, spec: dict[str, Any]) -> None:
        self._add("input", spec)

    def add_output(self, spec: dict[str, Any]) -> None:
        self._add("output", spec)

    def _add(self, role: str, spec: dict[str, Any]) -> None:
        if not {"name", "data_type", "dims"} <= spec.keys():
            raise TritonError(f"auto_complete_config: {role} needs name, data_type and dims, got {spec}")
        existing = [t for t in self._config.setdefault(role, []) if t["name"] == spec["name"]]
        if not existing:
            self._config[role].append(dict(spec))


def serialize_config(config: dict[str, Any]) -> str:
    """``args["model_config"]``: the model config as JSON, as Triton passes it."""
    return json.dumps(config)
