"""The transport-free data plane every frontend calls: validate a request, route it, queue it.

IPC, HTTP and the in-process API all build an :class:`InferRequest` and call :meth:`DataPlane.submit`;
nothing here knows about sockets or JSON.  Every request is checked against its model's config
(:mod:`edge_server.validation`) before it is queued, so a bad request fails alone and never reaches a
batch.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from edge_server import dtypes
from edge_server.config.model import ModelConfig, TensorSpec
from edge_server.lifecycle import ModelManager
from edge_server.request import InferRequest, Result
from edge_server.scheduler.scheduler import ModelScheduler, SchedulerClosed

_Outcome = Result | Future[dict[str, np.ndarray]]


class DataPlane:
    """Routes validated requests to the serving version of a model."""

    def __init__(self, manager: ModelManager) -> None:
        self._manager = manager

    def submit(self, request: InferRequest) -> Future[dict[str, np.ndarray]]:
        """Validate, route and queue ``request``; the future gets its outputs or its error."""
        return self._route(request, ModelScheduler.submit)  # type: ignore[return-value]

    def dispatch(self, request: InferRequest) -> dict[str, np.ndarray] | Future[dict[str, np.ndarray]]:
        """:meth:`submit`, except that a request that ran inline in this thread returns its outputs.

        Cheap models run in the caller's thread when an instance is idle (see the scheduler); a frontend
        that can answer at once saves a future per request this way.  Errors of an inline run raise.
        """
        outcome = self._route(request, ModelScheduler.dispatch)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _route(self, request: InferRequest, call: Callable[..., _Outcome]) -> _Outcome:
        # A version that is being swapped out can close between routing and queueing; a request that did
        # not ask for a specific version then goes to the version that replaced it.
        for _attempt in range(3):
            loaded = self._manager.resolve(request.model, request.version)
            item, shape_key = loaded.validator(request)
            try:
                return call(
                    loaded.scheduler,
                    item,
                    shape_key,
                    priority=request.priority,
                    timeout_us=request.timeout_us,
                )
            except SchedulerClosed:
                if request.version is not None:
                    raise
        raise SchedulerClosed(f"model {request.model!r} is being unloaded")

    def config(self, name: str, version: int | None = None) -> ModelConfig:
        return self._manager.resolve(name, version).config

    def metadata(self, name: str, version: int | None = None) -> dict[str, Any]:
        """KServe v2 model metadata."""
        config = self.config(name, version)
        versions = sorted(self._manager.serving().get(name, {}))
        batched = config.max_batch_size > 0

        def tensor(spec: TensorSpec) -> dict[str, Any]:
            return {
                "name": spec.name,
                "datatype": dtypes.to_wire(spec.data_type),
                "shape": ([-1] if batched else []) + list(spec.dims),
            }

        return {
            "name": name,
            "versions": [str(v) for v in versions],
            "platform": config.platform or config.backend,
            "inputs": [tensor(s) for s in config.inputs],
            "outputs": [tensor(s) for s in config.outputs],
        }

    def statistics(self, name: str | None = None, version: int | None = None) -> list[dict[str, Any]]:
        """Triton's per-version statistics for one model, or for every serving model."""
        serving = self._manager.serving()
        if name is not None:
            if version is not None:
                return [self._manager.resolve(name, version).stats.as_dict()]
            self._manager.resolve(name)  # raises the precise error for unknown or unready models
            chosen = {name: serving.get(name, {})}
        else:
            chosen = serving
        return [
            loaded.stats.as_dict() for versions in chosen.values() for _, loaded in sorted(versions.items())
        ]
