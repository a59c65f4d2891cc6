"""The transport-free data plane every frontend calls: validate a request, route it, queue it.

IPC, HTTP and the in-process API all build an :class:`InferRequest` and call :meth:`DataPlane.submit`;
nothing here knows about sockets or JSON.  Every request is checked against its model's config before
it is queued, so a bad request fails alone and never reaches a batch.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge_server import dtypes
from edge_server.backends.base import BatchItem
from edge_server.config.model import ModelConfig, TensorSpec
from edge_server.errors import InvalidArgument
from edge_server.lifecycle import ModelManager
from edge_server.scheduler.scheduler import SchedulerClosed


@dataclass(frozen=True)
class InferRequest:
    """One inference request as every frontend hands it to the data plane."""

    model: str
    inputs: Mapping[str, np.ndarray]
    version: int | None = None
    outputs: Sequence[str] | None = None  # None: every output
    priority: int = 0
    timeout_us: int | None = None
    request_id: str = ""


def _describe(spec: TensorSpec, batched: bool) -> str:
    dims = ["-1" if d < 0 else str(d) for d in spec.dims]
    return "[" + ", ".join((["batch"] if batched else []) + dims) + "]"


def validate(config: ModelConfig, request: InferRequest) -> tuple[BatchItem, Hashable]:
    """Check inputs and requested outputs against the config; return the batch item and its shape key."""
    model = config.name
    inputs = request.inputs
    if not isinstance(inputs, Mapping):
        raise InvalidArgument(f"inputs must be a mapping of name to array, got {type(inputs).__name__}")
    known = {spec.name for spec in config.inputs}
    unexpected = sorted(set(inputs) - known)
    if unexpected:
        raise InvalidArgument(
            f"model {model!r} has no input {unexpected[0]!r}; its inputs are {sorted(known)}"
        )
    missing = [spec.name for spec in config.inputs if not spec.optional and spec.name not in inputs]
    if missing:
        raise InvalidArgument(f"model {model!r}: missing input {missing[0]!r}")
    batched = config.max_batch_size > 0
    batch_size: int | None = None
    prepared: dict[str, np.ndarray] = {}
    shape_key: list[tuple[str, tuple[int, ...]]] = []
    for spec in config.inputs:
        if spec.name not in inputs:
            continue
        array = inputs[spec.name]
        where = f"model {model!r} input {spec.name!r}"
        if not isinstance(array, np.ndarray):
            raise InvalidArgument(f"{where}: expected a numpy array, got {type(array).__name__}")
        expected = dtypes.to_numpy(spec.data_type)
        if expected.kind == "O":
            if array.dtype.kind not in "OSU":
                raise InvalidArgument(f"{where}: expected {spec.data_type} (bytes), got {array.dtype}")
        elif array.dtype != expected:
            raise InvalidArgument(f"{where}: expected {spec.data_type} ({expected}), got {array.dtype}")
        shape = array.shape
        dims = shape[1:] if batched else shape
        if (
            len(dims) != len(spec.dims)
            or len(shape) < (1 if batched else 0)
            or any(want >= 0 and got != want for want, got in zip(spec.dims, dims, strict=False))
        ):
            raise InvalidArgument(f"{where}: expected shape {_describe(spec, batched)}, got {list(shape)}")
        if batched:
            rows = shape[0]
            if rows < 1 or rows > config.max_batch_size:
                raise InvalidArgument(
                    f"{where}: batch size {rows} is outside 1..{config.max_batch_size} (max_batch_size)"
                )
            if batch_size is not None and rows != batch_size:
                raise InvalidArgument(
                    f"model {model!r}: inputs disagree on the batch size ({batch_size} and {rows})"
                )
            batch_size = rows
        array = np.ascontiguousarray(array)
        if spec.reshape is not None:
            array = array.reshape((shape[0], *spec.reshape) if batched else spec.reshape)
        prepared[spec.name] = array
        shape_key.append((spec.name, tuple(dims)))
    outputs = _requested_outputs(config, request.outputs)
    item = BatchItem(
        inputs=prepared,
        batch_size=batch_size or 1,
        requested_outputs=outputs,
        request_id=request.request_id,
    )
    return item, tuple(shape_key)


def _requested_outputs(config: ModelConfig, requested: Sequence[str] | None) -> tuple[str, ...]:
    names = tuple(spec.name for spec in config.outputs)
    if not requested:  # None or empty: every output, as in KServe v2
        return names
    for name in requested:
        if name not in names:
            raise InvalidArgument(
                f"model {config.name!r} has no output {name!r}; its outputs are {list(names)}"
            )
    return tuple(dict.fromkeys(requested))


class DataPlane:
    """Routes validated requests to the serving version of a model."""

    def __init__(self, manager: ModelManager) -> None:
        self._manager = manager

    def submit(self, request: InferRequest) -> Future[dict[str, np.ndarray]]:
        # A version that is being swapped out can close between routing and queueing; a request that did
        # not ask for a specific version then goes to the version that replaced it.
        for _attempt in range(3):
            loaded = self._manager.resolve(request.model, request.version)
            item, shape_key = validate(loaded.config, request)
            try:
                future = loaded.scheduler.submit(
                    item, shape_key, priority=request.priority, timeout_us=request.timeout_us
                )
            except SchedulerClosed:
                if request.version is not None:
                    raise
                continue
            return future
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
