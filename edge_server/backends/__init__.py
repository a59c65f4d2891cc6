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


# What a backend edge-server knows needs, for the message when this machine or build lacks it.
_NEEDS: dict[str, str] = {
    "tensorrt": "TensorRT (JetPack's python3-libnvinfer, or the tensorrt package) and an NVIDIA GPU",
    "ensemble": "the ensemble scheduler, which this build does not include yet",
}


def _cannot_run(name: str, why: str) -> BackendUnavailable:
    here = ", ".join(sorted(_REGISTRY))
    return BackendUnavailable(
        f"backend {name!r} is supported by edge-server but cannot run here: {why}; "
        f"backends this machine runs: {here}"
    )


def backend_class(name: str) -> type[Backend]:
    """Import and return the backend class registered under ``name``.

    Names the config parser lets through but that have no runnable implementation here raise
    :class:`BackendUnavailable` saying what is missing (backends edge-server does not have at all
    were refused by the parser with ``UnsupportedBackend``).
    """
    target = _REGISTRY.get(name)
    if target is None:
        raise _cannot_run(name, f"it needs {_NEEDS.get(name, 'a module this build lacks')}")
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = f"it needs {_NEEDS[name]}" if name in _NEEDS else "its Python module cannot be imported"
        raise _cannot_run(name, f"{missing} ({exc})") from exc
    cls: type[Backend] = getattr(module, attr)
    return cls


def guess_backend(version_dirs: list[Path]) -> str | None:
    """The backend implied by Triton's default file names in the version directories, if any."""
    for directory in version_dirs:
        for filename, backend in _BY_FILENAME.items():
            if (directory / filename).exists():
                return backend
    return None
