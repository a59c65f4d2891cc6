"""The daemon's KServe v2 HTTP and gRPC frontends, measured with Triton's own client (tritonclient).

tritonclient is the ``perf`` extra; without it ``--http``/``--grpc`` say how to install it.  Each load
thread gets its own client (tritonclient's clients are not meant to be shared across threads), and
``--shared-memory system`` places the inputs in one POSIX region registered with the server, as
perf_analyzer does, and each load thread's outputs in a region of its own (perf_analyzer shares one
between its threads; ours are never overwritten while a thread reads them).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge_server.perf.inputs import Step
from edge_server.perf.options import PerfError, PerfUsageError
from edge_server.perf.server_stats import Snapshot
from edge_server.perf.targets import ModelInfo, Sequence, Worker, unknown_model

_MISSING = "--{0} needs tritonclient: pip install 'edge-server[perf]'"


def _module(kind: str) -> Any:
    try:
        if kind == "http":
            import tritonclient.http as module
        else:
            import tritonclient.grpc as module
    except ImportError:
        raise PerfUsageError(_MISSING.format(kind)) from None
    return module


def _wire(array: np.ndarray) -> str:
    from tritonclient.utils import np_to_triton_dtype

    return str(np_to_triton_dtype(array.dtype))


class KServeTarget:
    """``--http URL`` or ``--grpc URL``."""

    def __init__(self, kind: str, url: str, model: str, version: int | None) -> None:
        # tritonclient takes host:port; a scheme (http://, grpc://) is what users type anyway
        url = url.split("://", 1)[-1]
        self.kind, self.url, self.model = kind, url, model
        self.version = "" if version is None else str(version)
        self.module = _module(kind)
        self.client = self._client()
        try:
            live = self.client.is_server_live()
        except Exception as exc:
            raise PerfError(f"no KServe {kind} server answers at {url}: {str(exc).splitlines()[0]}") from None
        if not live:
            raise PerfError(f"the server at {url} is not live")
        self._steps: list[Step] = []
        self._streaming = False
        self._shm: tuple[Any, str, list[dict[str, tuple[int, int]]]] | None = None
        self._outputs: dict[str, int] = {}
        self._output_regions: list[tuple[Any, str]] = []
        self._free_outputs: list[_OutputPlaces] = []
        self._lock = threading.Lock()

    def _client(self) -> Any:
        return self.module.InferenceServerClient(self.url)

    def model_info(self) -> ModelInfo:
        try:
            if self.kind == "http":
                metadata = self.client.get_model_metadata(self.model, self.version)
                config = self.client.get_model_config(self.model, self.version)
            else:
                metadata = self.client.get_model_metadata(self.model, self.version, as_json=True)
                config = self.client.get_model_config(self.model, self.version, as_json=True)["config"]
        except Exception as exc:
            raise unknown_model(self.model, exc) from None
        return ModelInfo(metadata, config)

    def statistics(self) -> Snapshot:
        if self.kind == "http":
            answer = self.client.get_inference_statistics(self.model, self.version)
        else:
            answer = self.client.get_inference_statistics(self.model, self.version, as_json=True)
        return Snapshot.from_versions(answer.get("model_stats", []))

    def prepare(
        self,
        steps: list[Step],
        *,
        shared_memory: bool,
        streaming: bool,
        outputs: Mapping[str, int] | None = None,
    ) -> None:
        self._steps, self._streaming = steps, streaming
        self._outputs = dict(outputs or {})
        if shared_memory:
            self._shm = self._place(steps)

    def _place(self, steps: list[Step]) -> tuple[Any, str, list[dict[str, tuple[int, int]]]]:
        """Write every step's inputs into one region, register it, and remember where each one is."""
        from tritonclient.utils import InferenceServerException, serialize_byte_tensor
        from tritonclient.utils import shared_memory as shm

        name = f"edge-server-{os.getpid()}-perf"  # the test guard knows this form
        arrays: list[np.ndarray] = []
        places: list[dict[str, tuple[int, int]]] = []
        offset = 0
        for step in steps:
            where: dict[str, tuple[int, int]] = {}
            for input_name, array in step.items():
                raw = serialize_byte_tensor(array) if array.dtype == np.dtype(object) else array
                raw = np.ascontiguousarray(raw)
                arrays.append(raw)
                where[input_name] = (offset, raw.nbytes)
                offset += raw.nbytes
            places.append(where)
        handle = shm.create_shared_memory_region(name, "/" + name, max(offset, 1))
        try:
            position = 0
            for raw in arrays:
                shm.set_shared_memory_region(handle, [raw], offset=position)
                position += raw.nbytes
            self.client.register_system_shared_memory(name, "/" + name, max(offset, 1))
        except InferenceServerException as exc:
            shm.destroy_shared_memory_region(handle)
            raise PerfUsageError(
                f"--shared-memory system: the server refused the region: {exc.message()}"
            ) from None
        return handle, name, places

    def _inputs(self, step: Step, index: int) -> list[Any]:
        inputs = []
        for input_name, array in step.items():
            tensor = self.module.InferInput(input_name, list(array.shape), _wire(array))
            if self._shm is not None:
                offset, size = self._shm[2][index][input_name]
                tensor.set_shared_memory(self._shm[1], size, offset)
            elif self.kind == "http":
                tensor.set_data_from_numpy(array, binary_data=True)
            else:
                tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        return inputs

    def worker(self) -> Worker:
        prepared = [self._inputs(step, i) for i, step in enumerate(self._steps)]
        if self._streaming:
            return _StreamWorker(self._client(), self.model, self.version, prepared)
        places = self._take_outputs() if self._outputs else None
        return _Worker(self._client(), self.model, self.version, prepared, places, self._give_back)

    def _take_outputs(self) -> _OutputPlaces:
        """One worker's output places: a registered region of its own, reused across levels."""
        from tritonclient.utils import InferenceServerException
        from tritonclient.utils import shared_memory as shm

        with self._lock:
            if self._free_outputs:
                return self._free_outputs.pop()
            name = f"edge-server-{os.getpid()}-perf-out{len(self._output_regions)}"
            size = sum(self._outputs.values())
            handle = shm.create_shared_memory_region(name, "/" + name, size)
            self._output_regions.append((handle, name))
        try:
            self.client.register_system_shared_memory(name, "/" + name, size)
        except InferenceServerException as exc:
            message = f"--shared-memory system: the server refused an output region: {exc.message()}"
            raise PerfError(message) from None
        wanted, places, offset = [], {}, 0
        for output, room in self._outputs.items():
            requested = self.module.InferRequestedOutput(output)
            requested.set_shared_memory(name, room, offset)
            wanted.append(requested)
            places[output] = offset
            offset += room
        return _OutputPlaces(handle, wanted, places)

    def _give_back(self, places: _OutputPlaces) -> None:
        with self._lock:
            self._free_outputs.append(places)

    def close(self) -> None:
        from tritonclient.utils import shared_memory as shm

        regions = [*self._output_regions, *([self._shm[:2]] if self._shm is not None else [])]
        for handle, name in regions:
            with contextlib.suppress(Exception):
                self.client.unregister_system_shared_memory(name)
            shm.destroy_shared_memory_region(handle)
        self._shm, self._output_regions = None, []
        self.client.close()


@dataclass(frozen=True)
class _OutputPlaces:
    """A worker's outputs in shared memory: the region, the requested outputs, each one's offset."""

    handle: Any
    wanted: list[Any]
    offsets: dict[str, int]


class _Worker:
    def __init__(
        self,
        client: Any,
        model: str,
        version: str,
        inputs: list[list[Any]],
        places: _OutputPlaces | None = None,
        release: Any = None,
    ) -> None:
        self.client, self.model, self.version, self.inputs = client, model, version, inputs
        self.places, self._release = places, release
        self._last: Any = None

    def send(self, step: int, sequence: Sequence | None) -> int:
        fields: dict[str, Any] = {}
        if sequence is not None:
            fields = {
                "sequence_id": sequence.correlation_id,
                "sequence_start": sequence.start,
                "sequence_end": sequence.end,
            }
        if self.places is not None:
            fields["outputs"] = self.places.wanted
        self._last = self.client.infer(self.model, self.inputs[step], model_version=self.version, **fields)
        return 1

    def last_outputs(self) -> dict[str, np.ndarray]:
        return _outputs_of(self._last, self.places)

    def close(self) -> None:
        if self._release is not None and self.places is not None:
            self._release(self.places)
        self.client.close()


def response_json(result: Any) -> dict[str, Any]:
    """A tritonclient result's response as JSON (HTTP's already is; gRPC's is a protobuf)."""
    if type(result).__module__.startswith("tritonclient.http"):
        return dict(result.get_response())
    return dict(result.get_response(as_json=True))


def _outputs_of(result: Any, places: _OutputPlaces | None) -> dict[str, np.ndarray]:
    """A response's outputs as arrays: inline ones decoded, shared-memory ones read from the region."""
    from tritonclient.utils import shared_memory as shm
    from tritonclient.utils import triton_to_np_dtype

    response = response_json(result)
    arrays: dict[str, np.ndarray] = {}
    for output in response.get("outputs", []):
        name = output["name"]
        if places is not None and name in places.offsets:
            shape = [int(d) for d in output["shape"]]
            dtype = triton_to_np_dtype(output["datatype"])
            arrays[name] = np.array(
                shm.get_contents_as_numpy(places.handle, dtype, shape, offset=places.offsets[name])
            )
        else:
            arrays[name] = result.as_numpy(name)
    return arrays


class _StreamWorker(_Worker):
    """gRPC's bidirectional stream: one request at a time, done at its ``triton_final_response``."""

    def __init__(self, client: Any, model: str, version: str, inputs: list[list[Any]]) -> None:
        super().__init__(client, model, version, inputs)
        self.responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self._last: Any = None
        client.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def send(self, step: int, sequence: Sequence | None) -> int:
        fields: dict[str, Any] = {}
        if sequence is not None:
            fields = {
                "sequence_id": sequence.correlation_id,
                "sequence_start": sequence.start,
                "sequence_end": sequence.end,
            }
        self.client.async_stream_infer(
            self.model,
            self.inputs[step],
            model_version=self.version,
            enable_empty_final_response=True,
            **fields,
        )
        count = 0
        while True:
            result, error = self.responses.get(timeout=60.0)
            if error is not None:
                raise PerfError(f"the server answered an error: {error}")
            response = result.get_response()
            if response.outputs:
                count, self._last = count + 1, result
            if response.parameters["triton_final_response"].bool_param:
                return count

    def last_outputs(self) -> dict[str, np.ndarray]:
        if self._last is None:
            return {}
        return _outputs_of(self._last, None)

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()
