"""What ``edge-server perf`` measures: a daemon over IPC, or a repository loaded in this process.

A :class:`Target` answers the model's metadata, config and statistics and hands each load thread a
:class:`Worker` that sends one request (or one stream) and returns when every response is in.  The
HTTP and gRPC targets (tritonclient) are in :mod:`edge_server.perf.kserve_targets`.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edge_server.errors import EdgeServerError
from edge_server.perf.inputs import Step
from edge_server.perf.options import PerfError, PerfUsageError
from edge_server.perf.server_stats import Snapshot


@dataclass(frozen=True)
class Sequence:
    """The sequence fields of one request: correlation id, and whether it starts or ends the sequence."""

    correlation_id: int
    start: bool
    end: bool


@dataclass(frozen=True)
class ModelInfo:
    metadata: dict[str, Any]  # KServe v2 metadata: inputs and outputs with datatype and shape
    config: dict[str, Any]  # Triton's model config as JSON

    @property
    def max_batch_size(self) -> int:
        return int(self.config.get("max_batch_size") or 0)

    @property
    def sequence(self) -> bool:
        return bool(self.config.get("sequence_batching"))

    @property
    def decoupled(self) -> bool:
        return bool((self.config.get("model_transaction_policy") or {}).get("decoupled"))


class Worker(Protocol):
    """One load thread's connection: ``send`` runs request ``step`` and returns its response count."""

    def send(self, step: int, sequence: Sequence | None) -> int: ...

    def last_outputs(self) -> dict[str, np.ndarray]:
        """The last request's outputs (read from shared memory where they were written there)."""
        ...

    def close(self) -> None: ...


class Target(Protocol):
    def model_info(self) -> ModelInfo: ...

    def statistics(self) -> Snapshot: ...

    def prepare(
        self,
        steps: list[Step],
        *,
        shared_memory: bool,
        streaming: bool,
        outputs: Mapping[str, int] | None = None,
    ) -> None:
        """Make the requests; ``outputs`` (name -> bytes of room) puts the outputs in shared memory."""
        ...

    def worker(self) -> Worker: ...

    def close(self) -> None: ...


def unknown_model(model: str, exc: Exception) -> PerfUsageError:
    message = getattr(exc, "message", None) or str(exc).splitlines()[0]
    return PerfUsageError(f"model {model!r} cannot be measured: {message}")


def _sequence_options(sequence: Sequence | None, key: str) -> dict[str, Any]:
    if sequence is None:
        return {}
    return {key: sequence.correlation_id, "sequence_start": sequence.start, "sequence_end": sequence.end}


class _Shared:
    """A worker on a target whose client is thread-safe: every worker shares it.

    ``outputs`` is this worker's own place for each output in shared memory (None: inline); a worker
    sends one request at a time, so its outputs are never overwritten while being read.
    """

    def __init__(self, send: Any, outputs: dict[str, Any] | None = None, release: Any = None) -> None:
        self._send, self.outputs, self._release = send, outputs, release
        self._last: dict[str, np.ndarray] = {}

    def send(self, step: int, sequence: Sequence | None) -> int:
        count, self._last = self._send(step, sequence, self.outputs)
        return int(count)

    def last_outputs(self) -> dict[str, np.ndarray]:
        return {name: np.array(value, copy=True) for name, value in self._last.items()}

    def close(self) -> None:
        if self._release is not None:
            self._release(self.outputs)


class IpcTarget:
    """The daemon over its IPC socket, with our :class:`~edge_server.client.Client` (thread-safe)."""

    def __init__(self, address: str | None, model: str, version: int | None) -> None:
        from edge_server.client import Client
        from edge_server.ipc.addresses import find_daemon

        self.model, self.version = model, version
        self.address = find_daemon(address)
        self.client = Client(self.address, timeout=60.0, control_timeout=30.0)
        self._steps: list[dict[str, Any]] = []
        self._streaming = False
        self._region: Any = None
        self._outputs: dict[str, int] = {}
        self._output_regions: list[Any] = []
        self._free_outputs: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def model_info(self) -> ModelInfo:
        try:
            metadata = self.client.model_metadata(self.model, self.version)
            config = self.client.model_config(self.model, self.version)
        except EdgeServerError as exc:
            raise unknown_model(self.model, exc) from None
        return ModelInfo(metadata, config)

    def statistics(self) -> Snapshot:
        return Snapshot.from_versions(self.client.statistics(self.model, self.version))

    def prepare(
        self,
        steps: list[Step],
        *,
        shared_memory: bool,
        streaming: bool,
        outputs: Mapping[str, int] | None = None,
    ) -> None:
        self._streaming = streaming
        self._outputs = dict(outputs or {})
        if not shared_memory:
            self._steps = [dict(s) for s in steps]
            return
        from edge_server.ipc import protocol

        sizes = [[len(_raw(protocol, a)) for a in s.values()] for s in steps]
        try:
            self._region = self.client.create_shm_region(max(1, sum(map(sum, sizes))))
        except EdgeServerError as exc:
            raise PerfUsageError(
                f"--shared-memory system: the daemon refused the region: {exc.message}"
            ) from None
        offset = 0
        for step in steps:
            refs: dict[str, Any] = {}
            for name, array in step.items():
                refs[name] = self._region.write(array, offset)
                offset += refs[name].byte_size
            self._steps.append(refs)

    def worker(self) -> Worker:
        if not self._outputs:
            return _Shared(self._send)
        return _Shared(self._send, self._take_outputs(), self._give_back)

    def _take_outputs(self) -> dict[str, Any]:
        """One worker's output places: a region of its own, reused by the next level's workers."""
        with self._lock:
            if self._free_outputs:
                return self._free_outputs.pop()
        try:
            region = self.client.create_shm_region(sum(self._outputs.values()))
        except EdgeServerError as exc:
            raise PerfError(
                f"--shared-memory system: the daemon refused an output region: {exc.message} "
                "(one region per concurrent request; see the daemon's --max-client-regions)"
            ) from None
        places, offset = {}, 0
        for name, size in self._outputs.items():
            places[name] = region.output(offset, size)
            offset += size
        with self._lock:
            self._output_regions.append(region)
        return places

    def _give_back(self, places: dict[str, Any]) -> None:
        with self._lock:
            self._free_outputs.append(places)

    def _send(
        self, step: int, sequence: Sequence | None, outputs: dict[str, Any] | None
    ) -> tuple[int, dict[str, np.ndarray]]:
        options = _sequence_options(sequence, "sequence_id")
        if self.version is not None:
            options["version"] = self.version
        inputs = self._steps[step]
        if not self._streaming:
            if outputs is not None:
                options["outputs"] = outputs
            return 1, self.client.infer(self.model, inputs, **options)
        count, last = 0, {}
        with self.client.stream(self.model, inputs, **options) as responses:
            for response in responses:
                count, last = count + 1, response
        return count, last

    def close(self) -> None:
        for region in [*self._output_regions, *([self._region] if self._region is not None else [])]:
            with contextlib.suppress(EdgeServerError):
                self.client.release_shm(region)
        self.client.close()


def _raw(protocol: Any, array: np.ndarray) -> bytes | memoryview:
    _, _, data = protocol.to_buffer(array)
    return data if isinstance(data, bytes) else memoryview(data.reshape(-1).view(np.uint8))


class LocalTarget:
    """A repository loaded by a :class:`~edge_server.server.Server` in this process: no IPC at all."""

    def __init__(self, repository: Path, model: str, version: int | None) -> None:
        from edge_server.server import Server

        self.model, self.version = model, version
        logging.getLogger("edge_server").setLevel(logging.WARNING)  # loading should not drown the report
        self._stdout = contextlib.redirect_stdout(sys.stderr)  # models print() from their threads
        self._stdout.__enter__()
        try:
            self.server = Server(repository)
        except BaseException:
            self._stdout.__exit__(None, None, None)
            raise
        self._steps: list[Step] = []
        self._streaming = False

    def model_info(self) -> ModelInfo:
        try:
            metadata = self.server.model_metadata(self.model, self.version)
            config = self.server.model_config(self.model, self.version).to_triton_dict()
        except EdgeServerError as exc:
            raise unknown_model(self.model, exc) from None
        return ModelInfo(metadata, config)

    def statistics(self) -> Snapshot:
        return Snapshot.from_versions(self.server.statistics(self.model, self.version))

    def prepare(
        self,
        steps: list[Step],
        *,
        shared_memory: bool,
        streaming: bool,
        outputs: Mapping[str, int] | None = None,
    ) -> None:
        self._steps, self._streaming = steps, streaming

    def worker(self) -> Worker:
        return _Shared(self._send)

    def _send(
        self, step: int, sequence: Sequence | None, outputs: dict[str, Any] | None
    ) -> tuple[int, dict[str, np.ndarray]]:
        options = _sequence_options(sequence, "correlation_id")
        if self.version is not None:
            options["version"] = self.version
        if not self._streaming:
            return 1, self.server.infer(self.model, self._steps[step], **options)
        count, last = 0, {}
        for response in self.server.stream(self.model, self._steps[step], timeout=60.0, **options):
            count, last = count + 1, response
        return count, last

    def close(self) -> None:
        try:
            self.server.close()
        finally:
            self._stdout.__exit__(None, None, None)
