"""edge-server: a Triton-style inference appliance for one NVIDIA Jetson.

``from edge_server import Server`` gives the in-process API; ``edge_server.client`` talks to a running
daemon.  Importing the package imports no backend runtime (onnxruntime, TensorRT, CUDA).
"""

from __future__ import annotations

from edge_server.errors import EdgeServerError
from edge_server.server import Server
from edge_server.status_index import ModelState, VersionStatus

__all__ = ["EdgeServerError", "ModelState", "Server", "VersionStatus"]
__version__ = "0.1.0"
