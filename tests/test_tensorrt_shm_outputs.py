"""TensorRT outputs written into a client's shared memory, above the hardware layer.

No GPU exists here, so ``engine.Cuda`` and ``engine.TrtEngine`` are replaced by a labelled test double
(:class:`HostCuda`, :class:`HostEngine`): "device" memory is host memory, a copy is a memmove and the
"engine" computes its outputs on the CPU from the addresses it was bound to.  What runs for real is
everything ``TensorRTBackend`` decides and does with those calls: which buffer or span each tensor is
bound to, what is registered and unregistered, which copies happen and where the bytes end up, in real
memfd shared memory mapped as the IPC frontend maps it.  ``tests/test_tensorrt_gpu.py`` runs the same
path on a real GPU.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_server.backends.base import InstanceSpec, LoadContext
from edge_server.backends.tensorrt import backend as trt_backend
from edge_server.backends.tensorrt import engine, planning
from edge_server.backends.tensorrt.description import EngineDescription, ProfileRange, TensorDescription
from edge_server.config.model import ModelConfig, TensorSpec
from edge_server.errors import ModelExecutionError
from edge_server.request import BatchItem, OutputBuffer, Timing

H, W = 128, 256  # the mask output: H x W FP32 = 128 KiB a row, 256 KiB for two (worth mapping)
JETSON = planning.DeviceTraits(
    integrated=True, can_map_host_memory=True, host_register_supported=True, page_size=mmap.PAGESIZE
)
DESKTOP = planning.DeviceTraits(
    integrated=False, can_map_host_memory=True, host_register_supported=True, page_size=mmap.PAGESIZE
)

SEGMENTER = EngineDescription(
    (
        TensorDescription("image", "INPUT", "TYPE_FP32", (-1, 4), (ProfileRange((1, 4), (2, 4), (8, 4)),)),
        TensorDescription("mask", "OUTPUT", "TYPE_FP32", (-1, H, W)),
        TensorDescription("score", "OUTPUT", "TYPE_FP32", (-1, 1)),
    ),
    1,
    source="segmenter (test double)",
)


def expected(image: np.ndarray) -> dict[str, np.ndarray]:
    """What :class:`HostContext` computes: mask[n] = sum(image[n]) + a ramp; score[n] = max(image[n])."""
    ramp = np.arange(H * W, dtype=np.float32).reshape(H, W)
    mask = image.sum(axis=1, dtype=np.float32)[:, None, None] + ramp
    return {"mask": mask.astype(np.float32), "score": image.max(axis=1, keepdims=True)}


class HostCuda:
    """Test double of ``engine.Cuda``: host memory stands for device memory; records what it is asked."""

    def __init__(self, traits: planning.DeviceTraits) -> None:
        self._traits = traits
        self._blocks: dict[int, np.ndarray] = {}
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []
        self.refuse_register = False

    def traits(self) -> planning.DeviceTraits:
        return self._traits

    def _alloc(self, size: int) -> int:
        block = np.zeros(size, np.uint8)
        address = block.ctypes.data
        self._blocks[address] = block
        return address

    def malloc(self, size: int) -> int:
        return self._alloc(size)

    def host_alloc(self, size: int) -> int:
        return self._alloc(size)

    def free(self, pointer: int) -> None:
        del self._blocks[pointer]

    free_host = free

    def device_pointer(self, host: int) -> int:
        return host  # a Jetson maps host memory at the same address in this double

    def register(self, pointer: int, size: int, *, read_only: bool = False) -> None:
        if self.refuse_register or any(
            p < pointer + size and pointer < p + s for p, s in self.registered.items()
        ):
            raise ModelExecutionError("cudaHostRegister failed: cudaErrorHostMemoryAlreadyRegistered")
        self.registered[pointer] = size
        self.calls.append(("register_read_only" if read_only else "register", pointer))

    def unregister(self, pointer: int) -> None:
        del self.registered[pointer]
        self.calls.append(("unregister", pointer))

    def copy_to_device(self, dst: int, src: int, size: int, stream: Any) -> None:
        ctypes.memmove(dst, src, size)
        self.calls.append(("h2d", dst))

    def copy_to_host(self, dst: int, src: int, size: int, stream: Any) -> None:
        ctypes.memmove(dst, src, size)
        self.calls.append(("d2h", dst))

    def create_stream(self) -> int:
        return 1

    def destroy_stream(self, stream: Any) -> None:
        pass

    def synchronize(self, stream: Any) -> None:
        pass


class HostContext:
    """Test double of ``engine.TrtContext``: computes :func:`expected` from and into bound addresses."""

    def __init__(self, profile: int) -> None:
        self.profile = profile
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}

    def select_profile(self, stream: Any) -> None:
        pass

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> None:
        self.shapes[name] = shape

    def output_shape(self, name: str) -> tuple[int, ...]:
        rows = self.shapes["image"][0]
        return (rows, H, W) if name == "mask" else (rows, 1)

    def set_address(self, name: str, address: int) -> None:
        self.addresses[name] = address

    def _array(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        size = int(np.prod(shape)) * 4
        raw = engine.host_view(self.addresses[name], size)
        return raw.view(np.float32).reshape(shape)

    def enqueue(self, stream: Any) -> None:
        image = self._array("image", self.shapes["image"])
        for name, value in expected(image.copy()).items():
            self._array(name, value.shape)[...] = value

    def close(self) -> None:
        pass


class HostEngine:
    """Test double of ``engine.TrtEngine`` for :data:`SEGMENTER`."""

    version = "test-double"

    def __init__(self, plan: Path, *, dla_core: int | None = None) -> None:
        self.contexts: list[HostContext] = []

    def describe(self) -> EngineDescription:
        return SEGMENTER

    def create_context(self, profile: int) -> HostContext:
        self.contexts.append(HostContext(profile))
        return self.contexts[-1]

    def close(self) -> None:
        pass


@pytest.fixture(params=[JETSON, DESKTOP], ids=["jetson", "discrete"])
def instance(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[trt_backend.TensorRTBackend]:
    yield make_instance(request.param, monkeypatch, tmp_path)


def make_instance(
    traits: planning.DeviceTraits, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> trt_backend.TensorRTBackend:
    cuda = HostCuda(traits)
    caps = engine.Capabilities(tensorrt="test-double", gpus=1, traits=traits)
    monkeypatch.setattr(engine, "probe", lambda: caps)
    monkeypatch.setattr(engine, "Cuda", lambda device: cuda)
    monkeypatch.setattr(engine, "TrtEngine", HostEngine)
    config = ModelConfig(
        name="seg",
        backend="tensorrt",
        max_batch_size=8,
        inputs=(TensorSpec("image", "TYPE_FP32", (4,)),),
        outputs=(TensorSpec("mask", "TYPE_FP32", (H, W)), TensorSpec("score", "TYPE_FP32", (1,))),
    )
    plan = tmp_path / "model.plan"
    plan.write_bytes(b"")
    ctx = LoadContext(config, 1, tmp_path, plan, InstanceSpec("seg_0", "KIND_GPU"))
    return trt_backend.TensorRTBackend(ctx)


class Region:
    """A sealed memfd mapped as the IPC frontend maps a client's region."""

    def __init__(self, size: int = 4 << 20) -> None:
        self.fd = os.memfd_create("client", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.mm = mmap.mmap(self.fd, size)

    def span(self, offset: int, size: int) -> OutputBuffer:
        return OutputBuffer(np.frombuffer(self.mm, np.uint8, count=size, offset=offset))

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture
def region() -> Iterator[Region]:
    r = Region()
    yield r
    r.close()


def cuda_of(instance: trt_backend.TensorRTBackend) -> HostCuda:
    return instance._cuda  # type: ignore[return-value]


def item(image: np.ndarray, destinations: dict[str, OutputBuffer] | None) -> BatchItem:
    return BatchItem(
        inputs={"image": image},
        batch_size=len(image),
        requested_outputs=("mask", "score"),
        destinations=destinations,
    )


def run(instance: trt_backend.TensorRTBackend, *items: BatchItem) -> list[dict[str, np.ndarray]]:
    results = instance.execute(list(items), Timing())
    assert all(isinstance(r, dict) for r in results)
    return results  # type: ignore[return-value]


IMAGE = np.arange(8, dtype=np.float32).reshape(2, 4)


def test_without_destinations_outputs_are_the_instances_own(instance: trt_backend.TensorRTBackend) -> None:
    (out,) = run(instance, item(IMAGE, None))
    for name, want in expected(IMAGE).items():
        np.testing.assert_array_equal(out[name], want)


def test_page_aligned_span_is_mapped_on_jetson_and_dma_target_on_discrete(
    instance: trt_backend.TensorRTBackend, region: Region
) -> None:
    page = mmap.PAGESIZE
    mask_size = 2 * H * W * 4
    spans = {"mask": region.span(page, mask_size), "score": region.span(page + mask_size + page, 64)}
    (out,) = run(instance, item(IMAGE, spans))
    for name, want in expected(IMAGE).items():
        np.testing.assert_array_equal(out[name], want)
        assert np.shares_memory(out[name], spans[name].array)  # in the client's memory
    cuda = cuda_of(instance)
    mask_address = spans["mask"].array.ctypes.data
    context = instance._engine.contexts[0]  # type: ignore[attr-defined]
    if instance._traits.integrated:
        # TensorRT was given the span itself; registered for the run only.
        assert context.addresses["mask"] == mask_address
        assert ("register", mask_address) in cuda.calls and ("unregister", mask_address) in cuda.calls
        assert spans["mask"].filled == OutputBuffer.DIRECT
        # score: 8 bytes, below the size worth registering: computed in pinned memory, copied once.
        assert spans["score"].filled == OutputBuffer.COPIED
    else:
        # Computed in device memory, DMA'd straight into the span: no pinned staging, no host copy.
        assert context.addresses["mask"] != mask_address
        assert ("d2h", mask_address) in cuda.calls and not cuda.registered
        assert spans["mask"].filled == spans["score"].filled == OutputBuffer.DIRECT
    assert not cuda.registered  # nothing stays registered after the run


def test_unaligned_or_refused_span_is_copied_once_on_jetson(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, region: Region
) -> None:
    instance = make_instance(JETSON, monkeypatch, tmp_path)
    mask_size = 2 * H * W * 4
    unaligned = {"mask": region.span(64, mask_size)}
    (out,) = run(instance, item(IMAGE, unaligned))
    np.testing.assert_array_equal(out["mask"], expected(IMAGE)["mask"])
    assert unaligned["mask"].filled == OutputBuffer.COPIED
    assert ("register", unaligned["mask"].array.ctypes.data) not in cuda_of(instance).calls
    cuda_of(instance).refuse_register = True  # e.g. cudaErrorHostMemoryAlreadyRegistered
    aligned = {"mask": region.span(mmap.PAGESIZE * 200, mask_size)}
    (out,) = run(instance, item(IMAGE, aligned))
    np.testing.assert_array_equal(out["mask"], expected(IMAGE)["mask"])
    assert aligned["mask"].filled == OutputBuffer.COPIED


def test_span_over_an_input_or_too_small_is_not_used(
    instance: trt_backend.TensorRTBackend, region: Region
) -> None:
    mask_size = 2 * H * W * 4
    image = region.span(0, mask_size).array[: IMAGE.nbytes].view(np.float32).reshape(2, 4)
    image[...] = IMAGE
    over_input = {"mask": region.span(0, mask_size)}
    too_small = {"score": region.span(mask_size + mmap.PAGESIZE, 4)}
    (out,) = run(instance, item(image, {**over_input, **too_small}))
    want = expected(IMAGE)
    np.testing.assert_array_equal(out["mask"], want["mask"])  # computed from the input, then copied over it
    np.testing.assert_array_equal(out["score"], want["score"])
    assert over_input["mask"].filled == OutputBuffer.COPIED  # by the base class, after the run
    assert too_small["score"].filled == ""  # left to the frontend, which reports the short span
    assert not np.shares_memory(out["score"], too_small["score"].array)


def test_batch_of_two_requests_writes_each_rows_into_its_own_span(
    instance: trt_backend.TensorRTBackend, region: Region
) -> None:
    other = Region()
    try:
        a_image, b_image = IMAGE[:1], IMAGE[1:] * 3
        a = {"mask": region.span(0, H * W * 4), "score": region.span(H * W * 4, 4)}
        b = {"mask": other.span(0, H * W * 4), "score": other.span(H * W * 4, 4)}
        out_a, out_b = run(instance, item(a_image, a), item(b_image, b))
        for out, image, spans in ((out_a, a_image, a), (out_b, b_image, b)):
            for name, want in expected(image).items():
                np.testing.assert_array_equal(out[name], want)
                np.testing.assert_array_equal(spans[name].array.view(np.float32).reshape(want.shape), want)
                assert spans[name].filled == OutputBuffer.COPIED
    finally:
        other.close()


@pytest.mark.parametrize(
    ("traits", "address", "size", "decision"),
    [
        (JETSON, 0x7F0000000000, 1920 * 1080 * 3, planning.MAP),
        (JETSON, 0x7F0000000040, 1920 * 1080 * 3, planning.PINNED_COPY),  # not page-aligned
        (JETSON, 0x7F0000000000, 40, planning.PINNED_COPY),  # too small to be worth registering
        (DESKTOP, 0x7F0000000000, 1920 * 1080 * 3, planning.DEVICE_COPY),
        (DESKTOP, 0x7F0000000040, 40, planning.DEVICE_COPY),
    ],
)
def test_output_staging(traits: planning.DeviceTraits, address: int, size: int, decision: str) -> None:
    assert planning.output_staging(traits, address, size) == decision


@pytest.mark.parametrize(
    "supported", [True, False], ids=["read-only-registration", "no-read-only-registration"]
)
def test_sealed_read_only_input_frame(
    supported: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, region: Region
) -> None:
    """A client's frame mapped read-only: registered read-only where the device can, else copied once."""
    traits = planning.DeviceTraits(
        integrated=True,
        can_map_host_memory=True,
        host_register_supported=True,
        page_size=mmap.PAGESIZE,
        host_register_read_only=supported,
    )
    instance = make_instance(traits, monkeypatch, tmp_path)
    monkeypatch.setattr(planning, "MIN_MAP_BYTES", 0)  # the test image is small; map it anyway
    image = region.span(0, IMAGE.nbytes).array.view(np.float32).reshape(2, 4)
    image[...] = IMAGE
    image.flags.writeable = False
    (out,) = run(instance, item(image, None))
    np.testing.assert_array_equal(out["mask"], expected(IMAGE)["mask"])
    address = image.ctypes.data
    calls = cuda_of(instance).calls
    if supported:
        assert ("register_read_only", address) in calls and ("unregister", address) in calls
    else:
        assert not any(pointer == address for _, pointer in calls)  # copied into pinned memory
