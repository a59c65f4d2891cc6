"""Triton's ``triton_python_backend_utils`` for models that run inside edge-server.

A ``model.py`` written for Triton's Python backend does ``import triton_python_backend_utils as
pb_utils``; the Python backend makes that name resolve to this module.  Only the parts a model uses on
the request path are here; BLS calls (``InferenceRequest.exec``) arrive with the pipelines work.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np

from edge_server import dtypes
from edge_server.backends.pb_autocomplete import ModelConfig as ModelConfig


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


class InferenceRequest:
    """One request handed to ``TritonPythonModel.execute``."""

    def __init__(
        self, inputs: dict[str, np.ndarray], requested_outputs: Iterable[str], request_id: str = ""
    ) -> None:
        self._inputs = [Tensor(name, array) for name, array in inputs.items()]
        self._requested = list(requested_outputs)
        self._request_id = request_id

    def inputs(self) -> list[Tensor]:
        return list(self._inputs)

    def requested_output_names(self) -> list[str]:
        return list(self._requested)

    def request_id(self) -> str:
        return self._request_id

    def is_cancelled(self) -> bool:
        return False


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


def serialize_config(config: dict[str, Any]) -> str:
    """``args["model_config"]``: the model config as JSON, as Triton passes it."""
    return json.dumps(config)
