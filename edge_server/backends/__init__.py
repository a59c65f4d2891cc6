"""Backend registry: a backend name maps to an import string.

So importing edge_server never imports onnxruntime, TensorRT or CUDA until a model needs them.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from edge_server.backends.base import Backend
from edge_server.config.model import DEFAULT_MODEL_FILENAME
from edge_server.errors import BackendUnavailable

_REGISTRY: dict[str, str] = {
    "onnxruntime": "edge_server.backends.onnxruntime:OnnxRuntimeBackend",
    "python": "edge_server.backends.python:PythonBackend",
    "tensorrt": "edge_server.backends.tensorrt:TensorRTBackend",
}

# The file names that tell which backend a version directory holds when config.pbtxt names none.
# A plan comes first: a version with model.plan and model.onnx is a TensorRT model whose ONNX serves
# where the plan cannot (backends/tensorrt/fallback.py).
_BY_FILENAME: dict[str, str] = {
    filename: backend
    for backend, filename in sorted(DEFAULT_MODEL_FILENAME.items(), key=lambda item: item[0] != "tensorrt")
}


def backend_class(name: str) -> type[Backend]:
    """Import and return the backend class registered under ``name``."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise BackendUnavailable(
            f"backend {name!r} is not available in this build; available: {sorted(_REGISTRY)}"
        ) from None
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailable(f"backend {name!r} cannot be imported: {exc}") from exc
    cls: type[Backend] = getattr(module, attr)
    return cls


def guess_backend(version_dirs: list[Path]) -> str | None:
    """The backend implied by Triton's default file names in the version directories, if any."""
    for directory in version_dirs:
        for filename, backend in _BY_FILENAME.items():
            if (directory / filename).exists():
                return backend
    return None
