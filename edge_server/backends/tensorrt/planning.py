"""Decisions a TensorRT instance makes that need no GPU: profile choice, buffer growth, host staging.

Which optimization profile serves a batch, how large device buffers are and when they grow, and how host
data reaches the GPU.

Pure functions over an :class:`~.description.EngineDescription` and numbers, tested here; the GPU code in
``engine.py``/``backend.py`` only carries out what these return.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from edge_server.backends.tensorrt.description import EngineDescription, Shape
from edge_server.errors import ConfigError, InvalidArgument


def _volume(shape: Shape) -> int:
    return math.prod(shape) if shape else 1


def choose_profile(description: EngineDescription, shapes: dict[str, Shape]) -> int:
    """The smallest optimization profile whose ranges hold every input shape.

    "Smallest" is the total volume of the profile's max shapes: a profile tuned for small batches runs a
    small batch faster than one tuned for large ones.  Static engines have one implicit profile (0).
    """
    best: tuple[int, int] | None = None
    for index in range(max(description.num_profiles, 1)):
        volume = 0
        for tensor in description.inputs:
            shape = shapes.get(tensor.name)
            if shape is None:
                raise InvalidArgument(f"input {tensor.name!r} is missing")
            if not tensor.profiles:  # static input: the shape must be the engine's own
                if tuple(shape) != tensor.shape:
                    break
                volume += _volume(tensor.shape)
                continue
            limits = tensor.profiles[index]
            if not limits.fits(tuple(shape)):
                break
            volume += _volume(limits.max)
        else:
            if best is None or volume < best[0]:
                best = (volume, index)
    if best is None:
        ranges = {
            t.name: [(list(p.min), list(p.max)) for p in t.profiles] or [(list(t.shape), list(t.shape))]
            for t in description.inputs
        }
        raise InvalidArgument(
            f"no optimization profile of the engine holds input shapes "
            f"{ {k: list(v) for k, v in shapes.items()} }; the profiles' (min, max) are {ranges}"
        )
    return best[1]


def max_batch_from_profiles(description: EngineDescription) -> int:
    """The largest batch every input accepts in some profile (0 when the engine has no batch axis).

    An engine batches when every input and output starts with a run-time dimension and every profile lets
    that dimension go down to 1.
    """
    if not description.tensors or any(not t.shape or t.shape[0] != -1 for t in description.tensors):
        return 0
    limit = None
    for tensor in description.inputs:
        if any(p.min[0] > 1 for p in tensor.profiles):
            return 0
        best = max((p.max[0] for p in tensor.profiles), default=0)
        limit = best if limit is None else min(limit, best)
    return limit or 0


def batch_chunks(description: EngineDescription, rows: int) -> list[tuple[int, int]]:
    """The (start, stop) row ranges an instance runs a batch of ``rows`` in.

    The whole batch where the engine's profiles hold it; else pieces of the engine's largest batch.
    That is how a DLA instance (its plan has a static batch, usually 1) serves a model whose GPU plan
    batches up to ``max_batch_size``: the queue is one, the DLA runs its share row by row.
    """
    top = max_batch_from_profiles(description)
    if top == 0 or rows <= top:
        return [(0, rows)]
    return [(start, min(start + top, rows)) for start in range(0, rows, top)]


def nbytes(shape: Shape, itemsize: int) -> int:
    if any(d < 0 for d in shape):
        raise ConfigError(f"shape {list(shape)} is not resolved")
    return _volume(shape) * itemsize


@dataclass
class BufferSizer:
    """Capacity of one tensor's device (and pinned host) buffer: allocated once, grown, never shrunk.

    Growth rounds up to a power of two, capped at the largest size the engine can ever ask for, so that a
    slowly rising batch size reallocates a few times rather than on every new maximum.
    """

    ceiling: int  # bytes at the engine's largest profile shape (0: unknown, no cap)
    capacity: int = 0

    def grow_to(self, needed: int) -> int | None:
        """The new capacity when ``needed`` bytes do not fit, else None (the buffer is kept)."""
        if needed <= self.capacity:
            return None
        size = 1 << max(needed - 1, 1).bit_length()
        if self.ceiling:
            size = min(size, max(self.ceiling, needed))
        self.capacity = size
        return size


def ceiling_bytes(description: EngineDescription, name: str, itemsize: int) -> int:
    """Bytes of input ``name`` at its largest profile shape (0 when unknown, e.g. an output)."""
    tensor = description.tensor(name)
    if tensor is None:
        return 0
    if not tensor.profiles:
        return nbytes(tensor.shape, itemsize) if -1 not in tensor.shape else 0
    return max(nbytes(p.max, itemsize) for p in tensor.profiles)


# How host memory reaches the GPU.
MAP = "map"  # register the host pages (mapped) and let the GPU read them in place: no copy
PINNED_COPY = "pinned_copy"  # copy once into a page-locked staging buffer, then DMA (or map it)

# Below this, pinning pages costs more than copying them (a cudaHostRegister call is tens of microseconds).
MIN_MAP_BYTES = 256 * 1024


@dataclass(frozen=True)
class DeviceTraits:
    """What the CUDA device offers, from cudaGetDeviceProperties/cudaDeviceGetAttribute."""

    integrated: bool  # Jetson: GPU and CPU share DRAM
    can_map_host_memory: bool
    host_register_supported: bool
    page_size: int = 4096
    #: cudaDevAttrCanUseHostPointerForRegisteredMem: registered host memory has the same address on
    #: the device, so no cudaHostGetDevicePointer is needed
    host_pointer_is_device_pointer: bool = False
    #: cudaDevAttrHostRegisterReadOnlySupported: read-only pages (a client's sealed frame, mapped
    #: read-only) can be registered with cudaHostRegisterReadOnly; without it they are copied
    host_register_read_only: bool = False


def input_staging(traits: DeviceTraits, address: int, size: int, *, read_only: bool = False) -> str:
    """Whether a host input (e.g. a frame in a client's shared memory) is mapped in place or copied.

    Mapping pays on an integrated GPU only (on a discrete GPU mapped memory is read over PCIe on every
    access); it needs host registration, a page-aligned start (cudaHostRegister's requirement on Tegra),
    and a size large enough to be worth the registration.  Read-only memory (a sealed frame mapped
    read-only) also needs the device to support read-only registration.
    """
    if read_only and not traits.host_register_read_only:
        return PINNED_COPY
    if (
        traits.integrated
        and traits.can_map_host_memory
        and traits.host_register_supported
        and address % traits.page_size == 0
        and size >= MIN_MAP_BYTES
    ):
        return MAP
    return PINNED_COPY


def output_in_host_memory(traits: DeviceTraits) -> bool:
    """Whether outputs are written by the GPU straight into mapped pinned host memory.

    True on an integrated GPU, saving the device-to-host copy; on a discrete GPU they are computed in
    device memory and copied.
    """
    return traits.integrated and traits.can_map_host_memory


# Where an output whose client named a span of its (mapped) shared memory is computed.
DEVICE_COPY = "device_copy"  # in device memory, then one DMA copy (cudaMemcpyAsync) into the span


def output_staging(traits: DeviceTraits, address: int, size: int) -> str:
    """How an output reaches a destination in a client's shared memory at host ``address``.

    * ``MAP``: on an integrated GPU, register the span (mapped) and let TensorRT write into it: no copy;
      the same conditions as :func:`input_staging` (registration, page-aligned start, large enough).
    * ``DEVICE_COPY``: on a discrete GPU the output is computed in device memory and DMA'd straight
      into the span (no pinned staging buffer and no second host copy).
    * ``PINNED_COPY``: on an integrated GPU where the span cannot be mapped, the output is written into
      the instance's mapped pinned buffer and copied into the span once on the host.
    """
    if not traits.integrated:
        return DEVICE_COPY
    if input_staging(traits, address, size) == MAP:
        return MAP
    return PINNED_COPY
