"""The :class:`~edge_server.request.ModelAccess` the server hands to pipelines and Python models.

Ensembles and BLS calls reach other models through this object, which the model manager passes down
at load: they submit through the same data plane as every frontend (validated, batched with direct
traffic, counted), and load or unload models only where the control mode allows it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future

import numpy as np

from edge_server.config.model import ModelConfig
from edge_server.dataplane import DataPlane
from edge_server.errors import Unavailable
from edge_server.model_readiness import version_ready
from edge_server.request import InferRequest, ResponseSink
from edge_server.routing import RoutingView
from edge_server.scheduler import inline


class LocalAccess:
    """Other models of this server, for models that call models."""

    def __init__(
        self,
        dataplane: DataPlane,
        routing: RoutingView,
        *,
        control_mode: str,
        load: Callable[[str], object],
        unload: Callable[[str], None],
    ) -> None:
        """``load`` and ``unload``: the lifecycle's control, reached only where ``control_mode`` allows."""
        self._dataplane = dataplane
        self._routing = routing
        self._control_mode = control_mode
        self._load = load
        self._unload = unload

    def submit(self, request: InferRequest) -> Future[dict[str, np.ndarray]]:
        """The data plane's ``run_here`` with the budget stated for this thread (a worker's, mostly)."""
        return self._dataplane.run_here(request, inline.current())

    def stream(self, request: InferRequest, sink: ResponseSink) -> None:
        self._dataplane.stream(request, sink)

    def model_config(self, name: str, version: int | None = None) -> ModelConfig:
        return self._dataplane.config(name, version)

    def labels(self, name: str, version: int | None = None) -> Mapping[str, tuple[str, ...]]:
        return self._dataplane.labels(name, version)

    def is_ready(self, name: str, version: int | None = None) -> bool:
        return version_ready(self._routing, name, version).result()

    def load(self, name: str) -> None:
        self._check_control("load")
        self._load(name)

    def unload(self, name: str) -> None:
        self._check_control("unload")
        self._unload(name)

    def _check_control(self, what: str) -> None:
        if self._control_mode == "none":
            raise control_refused(what)


def control_refused(what: str) -> Unavailable:
    """The one error for load/unload in control mode ``none``: Triton's code and text, then ours.

    Triton answers UNAVAILABLE "explicit model load / unload is not allowed if polling is enabled"
    whenever model control is not explicit; its clients match that text.
    """
    return Unavailable(
        f"explicit model load / unload is not allowed if polling is enabled (cannot {what} models: "
        "model control is disabled, model_control_mode 'none'; start the server with "
        "--model-control-mode explicit or poll)"
    )
