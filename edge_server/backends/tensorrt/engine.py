"""The only code that touches ``tensorrt`` and ``cuda.bindings.runtime``.

Three thin wrappers: :class:`Cuda` (the CUDA runtime calls an instance needs: streams, device and pinned
memory, host registration, async copies), :class:`TrtEngine` (deserialize a plan on the GPU or a DLA core
and describe it as an :class:`~.description.EngineDescription`), :class:`TrtContext` (set shapes, bind
addresses, enqueue).  Both libraries are imported when first used, so importing this module costs nothing
where they are absent, and their absence is a :class:`BackendUnavailable` that says what to install.

Written against the documented APIs present in both TensorRT 8.6 (JetPack 6.0) and 10.3 (JetPack 6.1/6.2);
``tests/test_tensorrt_api.py`` checks every name used here against both versions' member lists.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge_server.backends.tensorrt.description import (
    TRT_TO_CONFIG,
    EngineDescription,
    ProfileRange,
    TensorDescription,
)
from edge_server.backends.tensorrt.planning import DeviceTraits
from edge_server.errors import BackendUnavailable, ConfigError, InstanceFailed, ModelExecutionError

log = logging.getLogger(__name__)

INSTALL_TENSORRT = (
    "TensorRT's Python bindings are not installed: on a Jetson install JetPack's python3-libnvinfer and "
    "use a virtual environment created with --system-site-packages (see jetson/README.md)"
)
INSTALL_CUDA_PYTHON = (
    "cuda-python is not installed: pip install 'edge-server[jetson-jp6]' on JetPack 6.1/6.2, "
    "'edge-server[jetson-jp60]' on JetPack 6.0 (its version must match the device's CUDA)"
)


def import_tensorrt() -> Any:
    try:
        import tensorrt
    except ImportError as exc:
        raise BackendUnavailable(f"{INSTALL_TENSORRT} ({exc})") from exc
    return tensorrt


def import_cudart() -> Any:
    """CUDA's runtime API from cuda-python, in either of its layouts.

    ``cuda.bindings.runtime`` exists from cuda-python 12.6.1 on; older releases (the ``12.2.*`` that
    matches JetPack 6.0's CUDA) have the same API as ``cuda.cudart``, which 13.0 removed.
    """
    try:
        from cuda.bindings import runtime
    except ImportError as exc:
        try:
            from cuda import cudart
        except ImportError:
            raise BackendUnavailable(f"{INSTALL_CUDA_PYTHON} ({exc})") from exc
        return cudart
    return runtime


def cuda_python_version() -> str:
    """The installed cuda-python's version ("" when it is not installed)."""
    from importlib import metadata

    for distribution in ("cuda-python", "cuda-bindings"):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return ""


# CUDA errors after which the context can do nothing more (CUDA Runtime API, "sticky" errors).
STICKY_ERRORS = frozenset(
    {
        "cudaErrorIllegalAddress",
        "cudaErrorLaunchFailure",
        "cudaErrorHardwareStackError",
        "cudaErrorIllegalInstruction",
        "cudaErrorMisalignedAddress",
        "cudaErrorInvalidAddressSpace",
        "cudaErrorInvalidPc",
        "cudaErrorECCUncorrectable",
        "cudaErrorLaunchTimeout",
    }
)


class Cuda:
    """CUDA runtime calls on one device, each checked; a failure names the call and CUDA's message."""

    def __init__(self, device: int = 0) -> None:
        self.rt = import_cudart()
        self.device = device
        self.call(self.rt.cudaSetDevice, device)

    def call(self, fn: Any, *args: Any) -> Any:
        """Call ``fn`` and return its value(s); cuda-python returns ``(error, *values)``."""
        try:
            result = fn(*args)
        except RuntimeError as exc:  # cuda-python raises this when libcuda.so cannot be loaded
            raise BackendUnavailable(f"CUDA is not usable on this machine: {exc}") from exc
        error, values = result[0], result[1:]
        if error != self.rt.cudaError_t.cudaSuccess:
            _, text = self.rt.cudaGetErrorString(error)
            message = f"{fn.__name__} failed: {error.name}: {text.decode(errors='replace')}"
            if error.name in STICKY_ERRORS:  # the context is unusable: this instance must be replaced
                raise InstanceFailed(message)
            raise ModelExecutionError(message)
        if not values:
            return None
        return values[0] if len(values) == 1 else values

    def traits(self) -> DeviceTraits:
        prop = self.call(self.rt.cudaGetDeviceProperties, self.device)
        register = self.call(
            self.rt.cudaDeviceGetAttribute,
            self.rt.cudaDeviceAttr.cudaDevAttrHostRegisterSupported,
            self.device,
        )
        read_only = self.call(
            self.rt.cudaDeviceGetAttribute,
            self.rt.cudaDeviceAttr.cudaDevAttrHostRegisterReadOnlySupported,
            self.device,
        )
        same_address = self.call(
            self.rt.cudaDeviceGetAttribute,
            self.rt.cudaDeviceAttr.cudaDevAttrCanUseHostPointerForRegisteredMem,
            self.device,
        )
        return DeviceTraits(
            integrated=bool(prop.integrated),
            can_map_host_memory=bool(prop.canMapHostMemory),
            host_register_supported=bool(register),
            page_size=mmap.PAGESIZE,
            host_pointer_is_device_pointer=bool(same_address),
            host_register_read_only=bool(read_only),
        )

    def create_stream(self) -> Any:
        return self.call(self.rt.cudaStreamCreateWithFlags, self.rt.cudaStreamNonBlocking)

    def destroy_stream(self, stream: Any) -> None:
        self.call(self.rt.cudaStreamDestroy, stream)

    def synchronize(self, stream: Any) -> None:
        self.call(self.rt.cudaStreamSynchronize, stream)

    def malloc(self, size: int) -> int:
        return int(self.call(self.rt.cudaMalloc, size))

    def free(self, pointer: int) -> None:
        self.call(self.rt.cudaFree, pointer)

    def host_alloc(self, size: int) -> int:
        """Page-locked host memory, mapped into the device's address space."""
        return int(self.call(self.rt.cudaHostAlloc, size, self.rt.cudaHostAllocMapped))

    def free_host(self, pointer: int) -> None:
        self.call(self.rt.cudaFreeHost, pointer)

    def device_pointer(self, host_pointer: int) -> int:
        """The device address of mapped (allocated or registered) host memory."""
        return int(self.call(self.rt.cudaHostGetDevicePointer, host_pointer, 0))

    def register(self, pointer: int, size: int, *, read_only: bool = False) -> None:
        """Page-lock and map host memory for the device.

        ``read_only``: the pages are mapped read-only (a client's sealed frame); CUDA then needs
        ``cudaHostRegisterReadOnly`` (callers check ``DeviceTraits.host_register_read_only`` first).
        A refused registration leaves CUDA's last error set; it is cleared here so that the next
        unrelated call does not report it.
        """
        flags = self.rt.cudaHostRegisterMapped
        if read_only:
            flags |= self.rt.cudaHostRegisterReadOnly
        try:
            self.call(self.rt.cudaHostRegister, pointer, size, flags)
        except ModelExecutionError:
            self.rt.cudaGetLastError()
            raise

    def unregister(self, pointer: int) -> None:
        self.call(self.rt.cudaHostUnregister, pointer)

    def copy_to_device(self, dst: int, src: int, size: int, stream: Any) -> None:
        kind = self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self.call(self.rt.cudaMemcpyAsync, dst, src, size, kind, stream)

    def copy_to_host(self, dst: int, src: int, size: int, stream: Any) -> None:
        kind = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self.call(self.rt.cudaMemcpyAsync, dst, src, size, kind, stream)


def host_view(pointer: int, size: int) -> np.ndarray:
    """A uint8 numpy view of ``size`` bytes of host memory at ``pointer`` (pinned buffers)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(pointer))


class TrtContext:
    """One execution context: shapes in, addresses bound, work enqueued on a stream."""

    def __init__(self, context: Any, profile: int) -> None:
        self._context = context
        self.profile = profile

    def select_profile(self, stream: Any) -> None:
        if not self._context.set_optimization_profile_async(self.profile, int(stream)):
            raise ModelExecutionError(
                f"TensorRT refused optimization profile {self.profile} for a new execution context (see "
                "TensorRT's message in the log: the profile index is out of range, or another context "
                "of this engine already uses it)"
            )

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> None:
        if not self._context.set_input_shape(name, shape):
            raise ModelExecutionError(f"TensorRT refused shape {list(shape)} for input {name!r}")

    def output_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._context.get_tensor_shape(name))

    def set_address(self, name: str, address: int) -> None:
        if not self._context.set_tensor_address(name, address):
            raise ModelExecutionError(f"TensorRT refused the buffer address for tensor {name!r}")

    def enqueue(self, stream: Any) -> None:
        if not self._context.execute_async_v3(int(stream)):
            raise ModelExecutionError("TensorRT execute_async_v3 failed (see the log for TensorRT's message)")

    def close(self) -> None:
        self._context = None


class TrtEngine:
    """A deserialized plan: one ``trt.Runtime`` (with ``DLA_core`` set for a DLA instance) and its engine."""

    def __init__(self, plan: Path, *, dla_core: int | None = None) -> None:
        trt = import_tensorrt()
        self._trt = trt
        self.version = str(trt.__version__)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        if dla_core is not None:
            cores = int(self._runtime.num_DLA_cores)
            if dla_core >= cores:
                raise ConfigError(
                    f"{plan}: DLA core {dla_core} requested; TensorRT reports {cores} DLA core(s)"
                )
            self._runtime.DLA_core = dla_core
        try:
            data = plan.read_bytes()
        except OSError as exc:
            raise ConfigError(f"{plan}: cannot read the plan: {exc}") from exc
        self._engine = self._runtime.deserialize_cuda_engine(data)
        if self._engine is None:
            raise ConfigError(
                f"{plan}: TensorRT {self.version} could not deserialize this plan; plans are tied to the "
                "TensorRT version and the device they were built on: rebuild it with "
                "'edge-server build-engine'"
            )
        self.source = str(plan)

    def describe(self) -> EngineDescription:
        engine = self._engine
        tensors = []
        for index in range(engine.num_io_tensors):
            name = engine.get_tensor_name(index)
            is_input = engine.get_tensor_mode(name) == self._trt.TensorIOMode.INPUT
            if engine.is_shape_inference_io(name):
                raise ConfigError(f"{self.source}: tensor {name!r} is a shape tensor; not supported")
            dtype = engine.get_tensor_dtype(name).name
            if dtype not in TRT_TO_CONFIG:
                raise ConfigError(f"{self.source}: tensor {name!r} has TensorRT type {dtype}; not supported")
            shape = tuple(int(d) for d in engine.get_tensor_shape(name))
            profiles: tuple[ProfileRange, ...] = ()
            if is_input and -1 in shape:
                profiles = tuple(
                    ProfileRange(
                        *(tuple(int(d) for d in dims) for dims in engine.get_tensor_profile_shape(name, p))
                    )
                    for p in range(engine.num_optimization_profiles)
                )
            tensors.append(
                TensorDescription(
                    name=name,
                    mode="INPUT" if is_input else "OUTPUT",
                    data_type=TRT_TO_CONFIG[dtype],
                    shape=shape,
                    profiles=profiles,
                )
            )
        return EngineDescription(tuple(tensors), int(engine.num_optimization_profiles), source=self.source)

    def create_context(self, profile: int) -> TrtContext:
        context = self._engine.create_execution_context()
        if context is None:
            raise ModelExecutionError(f"{self.source}: TensorRT could not create an execution context")
        return TrtContext(context, profile)

    def close(self) -> None:
        self._engine = None
        self._runtime = None


@dataclass
class Capabilities:
    """What this machine offers the TensorRT backend; ``missing`` says why it cannot run, if it cannot."""

    tensorrt: str = ""
    cuda_python: str = ""
    cuda_runtime: str = ""
    cuda_driver: str = ""
    gpus: int = 0
    gpu_name: str = ""
    dla_cores: int = 0
    traits: DeviceTraits | None = None
    missing: list[str] = field(default_factory=list)

    @property
    def usable(self) -> bool:
        return not self.missing


def _version(number: int) -> str:
    return f"{number // 1000}.{(number % 1000) // 10}"


def probe() -> Capabilities:
    """Find TensorRT, cuda-python, a CUDA GPU and the DLA cores without raising; list what is missing."""
    caps = Capabilities()
    try:
        trt = import_tensorrt()
        caps.tensorrt = str(trt.__version__)
    except BackendUnavailable:
        trt = None
        caps.missing.append("TensorRT not installed (JetPack's python3-libnvinfer, see jetson/README.md)")
    try:
        caps.cuda_python = cuda_python_version() or "?"
        cuda = Cuda(0)
    except BackendUnavailable as exc:
        caps.missing.append(exc.message)
        return caps
    except ModelExecutionError as exc:
        caps.missing.append(f"no usable CUDA GPU: {exc.message}")
        return caps
    try:
        caps.cuda_driver = _version(int(cuda.call(cuda.rt.cudaDriverGetVersion)))
        caps.cuda_runtime = _version(int(cuda.call(cuda.rt.cudaRuntimeGetVersion)))
        caps.gpus = int(cuda.call(cuda.rt.cudaGetDeviceCount))
        prop = cuda.call(cuda.rt.cudaGetDeviceProperties, 0)
        caps.gpu_name = bytes(prop.name).split(b"\0", 1)[0].decode(errors="replace")
        caps.traits = cuda.traits()
    except (BackendUnavailable, ModelExecutionError) as exc:
        caps.missing.append(f"no usable CUDA GPU: {exc.message}")
        return caps
    if trt is not None:
        runtime = trt.Runtime(trt.Logger(trt.Logger.ERROR))
        caps.dla_cores = int(runtime.num_DLA_cores)
    return caps
