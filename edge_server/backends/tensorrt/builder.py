"""Building a TensorRT plan from ONNX: the TensorRT builder, for the GPU or a DLA core.

Like ``engine.py`` this touches TensorRT (and CUDA for INT8 calibration) directly and imports both only
when called; ``tests/test_tensorrt_api.py`` checks its names against TensorRT 8.6 and 10.3.  The choices
around it (profile shapes, DLA rules, where the plan goes) are in ``edge_server/tools/build_engine.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge_server.backends.tensorrt.engine import Cuda, import_tensorrt
from edge_server.errors import ConfigError, ModelExecutionError

log = logging.getLogger(__name__)

Shape = tuple[int, ...]


@dataclass(frozen=True)
class BuildOptions:
    fp16: bool = False
    int8: bool = False
    calibration_images: Path | None = None  # a folder of images for INT8 calibration
    calibration_cache: Path | None = None
    dla_core: int | None = None
    gpu_fallback: bool = False
    workspace_bytes: int = 1 << 30
    # input name -> (min, opt, max) shapes; inputs not named are static
    profile: dict[str, tuple[Shape, Shape, Shape]] = field(default_factory=dict)


@dataclass(frozen=True)
class BuildResult:
    plan: bytes
    tensorrt: str
    layers_on_gpu: tuple[str, ...]  # DLA builds: layers can_run_on_DLA said no to
    seconds: float


def network_inputs(onnx: Path) -> list[tuple[str, Shape]]:
    """The ONNX model's inputs as TensorRT's parser sees them (name, shape with -1 for dynamic)."""
    trt = import_tensorrt()
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network, _parser = _parse(trt, builder, logger, onnx)
    return [(network.get_input(i).name, tuple(network.get_input(i).shape)) for i in range(network.num_inputs)]


def profile_shapes(
    inputs: list[tuple[str, Shape]], batch: tuple[int, int, int]
) -> dict[str, tuple[Shape, Shape, Shape]]:
    """Profile (min, opt, max) per input with a dynamic batch axis; other dynamic axes are refused."""
    profile: dict[str, tuple[Shape, Shape, Shape]] = {}
    for name, shape in inputs:
        if any(d < 0 for d in shape[1:]):
            raise ConfigError(
                f"input {name!r} has dynamic dimensions {list(shape)} beyond the batch axis; export the ONNX "
                "with fixed sizes for them"
            )
        if shape and shape[0] < 0:
            low, opt, high = ((size, *shape[1:]) for size in batch)
            profile[name] = (low, opt, high)
    return profile


def _parse(trt: Any, builder: Any, logger: Any, onnx: Path) -> tuple[Any, Any]:
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)  # required by 8.x, default in 10.x
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ConfigError(f"{onnx}: TensorRT's ONNX parser failed: {errors}")
    return network, parser


def checked_options(options: BuildOptions, progress: Callable[[str], None]) -> BuildOptions:
    """``options`` made buildable: the DLA runs FP16 or INT8 only, so a DLA build without either is FP16.

    INT8 needs calibration: an image folder, or a cache file that exists (a cache alone is read as is).
    """
    if options.dla_core is not None and not (options.fp16 or options.int8):
        progress("the DLA runs FP16 or INT8 only: building FP16 (pass --fp16 or --int8 to choose)")
        log.info("DLA build without --fp16/--int8: building FP16")
        options = dataclasses.replace(options, fp16=True)
    if options.int8 and options.calibration_images is None:
        cache = options.calibration_cache
        if cache is None or not cache.is_file():
            raise ConfigError(
                "INT8 needs calibration: pass --calib-images DIR, or --calib-cache FILE naming an existing "
                f"cache{f' ({cache} does not exist)' if cache is not None else ''}"
            )
    return options


def build(onnx: Path, options: BuildOptions, progress: Callable[[str], None]) -> BuildResult:
    """Build a serialized plan; ``progress`` gets a line now and then (builds take minutes on a Jetson)."""
    options = checked_options(options, progress)
    trt = import_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network, _parser = _parse(trt, builder, logger, onnx)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_bytes)
    if options.fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    calibrator = None
    if options.int8:
        config.set_flag(trt.BuilderFlag.INT8)
        calibrator = calibrator_for(trt, network, options)
        config.int8_calibrator = calibrator
    if options.profile:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in options.profile.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
        if options.int8 and calibrator is not None:
            config.set_calibration_profile(profile)
    on_gpu: list[str] = []
    if options.dla_core is not None:
        if options.dla_core >= builder.num_DLA_cores:
            raise ConfigError(
                f"DLA core {options.dla_core} requested; this device has {builder.num_DLA_cores}"
            )
        config.default_device_type = trt.DeviceType.DLA
        config.DLA_core = options.dla_core
        if options.gpu_fallback:
            config.set_flag(trt.BuilderFlag.GPU_FALLBACK)
        for index in range(network.num_layers):
            layer = network.get_layer(index)
            if not config.can_run_on_DLA(layer):
                on_gpu.append(f"{layer.name} ({layer.type})")
        if on_gpu and not options.gpu_fallback:
            raise ConfigError(
                f"{len(on_gpu)} layer(s) cannot run on the DLA and --gpu-fallback is off: "
                + ", ".join(on_gpu)
            )
    started = time.monotonic()
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(15.0):
            progress(f"building... {time.monotonic() - started:.0f} s")

    ticker = threading.Thread(target=heartbeat, name="edge-build-progress", daemon=True)
    ticker.start()
    try:
        progress(f"building with TensorRT {trt.__version__} ({network.num_layers} layers)")
        serialized = builder.build_serialized_network(network, config)
    finally:
        done.set()
        ticker.join()
    if serialized is None:
        raise ModelExecutionError("TensorRT could not build the engine (see the messages above)")
    return BuildResult(
        plan=bytes(memoryview(serialized)),
        tensorrt=str(trt.__version__),
        layers_on_gpu=tuple(on_gpu),
        seconds=time.monotonic() - started,
    )


def calibration_batches(folder: Path, shape: Shape, batch: int) -> list[np.ndarray]:
    """Images from ``folder``, resized to the input's H and W, as float32 NCHW batches scaled to [0, 1]."""
    import cv2

    _, channels, height, width = shape
    images = []
    for path in sorted(folder.iterdir()):
        flag = cv2.IMREAD_GRAYSCALE if channels == 1 else cv2.IMREAD_COLOR
        image = cv2.imread(str(path), flag)
        if image is None:
            continue
        image = cv2.resize(image, (width, height)).astype(np.float32) / 255.0
        images.append(image[None] if channels == 1 else image.transpose(2, 0, 1)[::-1])
    if not images:
        raise ConfigError(f"{folder}: no readable images for INT8 calibration")
    return [
        np.ascontiguousarray(np.stack(images[i : i + batch]))
        for i in range(0, len(images) - batch + 1, batch)
    ]


def calibrator_for(trt: Any, network: Any, options: BuildOptions) -> Any:
    """The INT8 calibrator: over the image folder, or serving the cache file alone when no folder is given.

    With a cache TensorRT calls ``read_calibration_cache`` first and, when it returns the table, never
    asks for a batch; without a calibrator it would not read the cache at all.
    """
    if options.calibration_images is None:
        return _cache_calibrator(trt, options)
    return _calibrator(trt, network, options)


def _cache_calibrator(trt: Any, options: BuildOptions) -> Any:
    """A calibrator that only serves an existing cache file (no images, no device memory)."""
    cache = options.calibration_cache
    if cache is None or not cache.is_file():
        raise ConfigError(f"INT8 calibration cache {cache} does not exist and no --calib-images were given")
    table = cache.read_bytes()

    class CacheCalibrator(trt.IInt8EntropyCalibrator2):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)

        def get_batch_size(self) -> int:
            return 1

        def get_batch(self, names: Sequence[str]) -> list[int] | None:
            return None  # no images: the cache is the whole calibration

        def read_calibration_cache(self) -> bytes:
            return table

        def write_calibration_cache(self, cache: bytes) -> None:
            pass  # the file it came from stays as it is

    return CacheCalibrator()


def _calibrator(trt: Any, network: Any, options: BuildOptions) -> Any:
    """An entropy calibrator over the image folder (one image input); reads and writes the cache file."""
    if network.num_inputs != 1:
        raise ConfigError("INT8 calibration from an image folder needs a model with one image input")
    name = network.get_input(0).name
    shape = options.profile[name][1] if name in options.profile else tuple(network.get_input(0).shape)
    assert options.calibration_images is not None
    batches = calibration_batches(options.calibration_images, shape, shape[0])
    cuda = Cuda(0)

    class Calibrator(trt.IInt8EntropyCalibrator2):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)
            self._next = 0
            self._device = cuda.malloc(batches[0].nbytes)

        def get_batch_size(self) -> int:
            return int(shape[0])

        def get_batch(self, names: Sequence[str]) -> list[int] | None:
            if self._next >= len(batches):
                return None
            batch = batches[self._next]
            self._next += 1
            cuda.call(cuda.rt.cudaMemcpy, self._device, batch.ctypes.data, batch.nbytes,
                      cuda.rt.cudaMemcpyKind.cudaMemcpyHostToDevice)  # fmt: skip
            return [self._device]

        def read_calibration_cache(self) -> bytes | None:
            cache = options.calibration_cache
            return cache.read_bytes() if cache is not None and cache.is_file() else None

        def write_calibration_cache(self, cache: bytes) -> None:
            if options.calibration_cache is not None:
                options.calibration_cache.write_bytes(bytes(cache))

    return Calibrator()
