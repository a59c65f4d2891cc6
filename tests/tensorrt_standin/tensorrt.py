"""TEST DOUBLE of NVIDIA's ``tensorrt`` Python module, for a GPU machine that has CUDA but no TensorRT.

TensorRT's library wheels are not reachable from the machines this project is tested on (PyPI holds only
a stub that downloads them from NVIDIA's own index), so tests/test_tensorrt_cuda_gpu.py puts this
directory on a daemon's PYTHONPATH to run the real TensorRT backend, with the real CUDA runtime
(cuda-python) and real device memory, around an engine that is not TensorRT's.  It implements just the
names edge_server/backends/tensorrt/engine.py calls, with TensorRT 10's signatures.

A "plan" here is JSON: ``{"edge_server_standin": 1, "copies": {"OUT": "IN"}, "tensors": [...]}`` with
the tensors as ``EngineDescription.to_json`` writes them (TensorRT type names, e.g. ``FLOAT``).  Its
execution context copies each input to its output on the GPU (cudaMemcpyAsync, cudaMemcpyDefault: device
buffers and mapped host memory alike) on the stream the backend enqueues on, so what comes back proves
the backend's staging, addresses, copies and synchronisation on the device; no kernel of a real
network runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__version__ = "10.3.0+edge-server-standin"

MARKER = "edge_server_standin"
ITEMSIZE = {"FLOAT": 4, "HALF": 2, "INT8": 1, "INT32": 4, "INT64": 8, "BOOL": 1, "UINT8": 1}


class Logger:
    ERROR = 1
    WARNING = 2

    def __init__(self, severity: int = WARNING) -> None:
        self.severity = severity


class TensorIOMode:
    INPUT = "INPUT"
    OUTPUT = "OUTPUT"


@dataclass(frozen=True)
class DataType:
    name: str


class Runtime:
    num_DLA_cores = 0  # a discrete GPU; a Jetson's DLA is not stood in for here

    def __init__(self, logger: Logger) -> None:
        self.DLA_core = -1

    def deserialize_cuda_engine(self, data: bytes) -> _Engine | None:
        try:
            plan = json.loads(data)
        except ValueError:
            return None  # what TensorRT does with bytes it cannot read
        if not isinstance(plan, dict) or plan.get(MARKER) != 1:
            return None
        return _Engine(plan)


class _Engine:
    def __init__(self, plan: dict[str, Any]) -> None:
        self._tensors = {t["name"]: t for t in plan["tensors"]}
        self._names = [t["name"] for t in plan["tensors"]]
        self._copies: dict[str, str] = plan["copies"]
        self.num_io_tensors = len(self._names)
        self.num_optimization_profiles = int(plan.get("num_profiles", 1))

    def get_tensor_name(self, index: int) -> str:
        return self._names[index]

    def get_tensor_mode(self, name: str) -> str:
        return TensorIOMode.INPUT if self._tensors[name]["mode"] == "INPUT" else TensorIOMode.OUTPUT

    def is_shape_inference_io(self, name: str) -> bool:
        return False

    def get_tensor_dtype(self, name: str) -> DataType:
        return DataType(self._tensors[name]["data_type"])

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name]["shape"])

    def get_tensor_profile_shape(self, name: str, profile: int) -> list[tuple[int, ...]]:
        return [tuple(dims) for dims in self._tensors[name]["profiles"][profile]]

    def create_execution_context(self) -> _Context:
        return _Context(self)


class _Context:
    def __init__(self, engine: _Engine) -> None:
        self._engine = engine
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._addresses: dict[str, int] = {}

    def set_optimization_profile_async(self, profile: int, stream: int) -> bool:
        return 0 <= profile < self._engine.num_optimization_profiles

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        self._shapes[name] = tuple(shape)
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        source = self._engine._copies.get(name, name)
        return self._shapes.get(source, self._engine.get_tensor_shape(name))

    def set_tensor_address(self, name: str, address: int) -> bool:
        self._addresses[name] = int(address)
        return True

    def execute_async_v3(self, stream: int) -> bool:
        try:
            from cuda.bindings import runtime
        except ImportError:  # cuda-python before 12.6.1 (JetPack 6.0's 12.2)
            from cuda import cudart as runtime

        for output, source in self._engine._copies.items():
            dtype = self._engine._tensors[output]["data_type"]
            count = 1
            for d in self.get_tensor_shape(output):
                count *= d
            (error,) = runtime.cudaMemcpyAsync(
                self._addresses[output],
                self._addresses[source],
                count * ITEMSIZE[dtype],
                runtime.cudaMemcpyKind.cudaMemcpyDefault,
                runtime.cudaStream_t(stream),
            )
            if error != runtime.cudaError_t.cudaSuccess:
                return False
        return True
