"""TensorRT backend package: ``engine`` is the only module that imports TensorRT or CUDA (lazily)."""

from __future__ import annotations

from edge_server.backends.tensorrt.backend import TensorRTBackend

__all__ = ["TensorRTBackend"]
