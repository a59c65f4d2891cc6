"""TensorRT backend: ``platform: "tensorrt_plan"`` / ``backend: "tensorrt"`` (``model.plan``).

One instance is one engine deserialized on its device (the GPU, or a DLA core through its own
``trt.Runtime``), one CUDA stream, an execution context per optimization profile it has used, and
buffers allocated once and grown when a larger batch comes.  Every decision that needs no GPU (profile,
sizes, staging, placement, config) is made by ``planning``/``placement``/``config_check`` and tested
without one; this module carries them out through ``engine``.

Instances never run on a frontend thread (``allows_inline = False``): a GPU call can block for the whole
inference, and the scheduler's inline path is for CPU models that take microseconds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge_server import dtypes
from edge_server.backends.base import LoadContext, OutputBuffer, TensorBackend
from edge_server.backends.ragged import RaggedPlan
from edge_server.backends.tensorrt import cache, engine, planning
from edge_server.backends.tensorrt.config_check import complete_from_engine
from edge_server.backends.tensorrt.placement import place, plan_for
from edge_server.config.model import ModelConfig
from edge_server.errors import BackendUnavailable, ConfigError, ModelExecutionError

log = logging.getLogger(__name__)


@dataclass
class _Buffer:
    """One tensor's memory: a device buffer and/or a pinned (mapped) host buffer, grown together."""

    sizer: planning.BufferSizer
    device: int = 0  # cudaMalloc'd, 0 when not needed (integrated GPU, host-mapped)
    host: int = 0  # cudaHostAlloc'd (mapped), 0 when not needed


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def _rows(inputs: dict[str, np.ndarray]) -> int:
    return min((len(array) for array in inputs.values() if array.ndim), default=0)


def require_capabilities() -> engine.Capabilities:
    caps = engine.probe()
    if not caps.usable:
        raise BackendUnavailable("the TensorRT backend cannot run here: " + "; ".join(caps.missing))
    return caps


class TensorRTBackend(TensorBackend):
    allows_inline = False

    @classmethod
    def gpu_available(cls) -> bool:
        return engine.probe().usable

    @classmethod
    def complete_config(cls, config: ModelConfig, model_path: Path) -> ModelConfig:
        if RaggedPlan.of(config) is not None:  # its batches are cut into profile-sized row chunks
            raise ConfigError(
                f"{config.source}: allow_ragged_batch, batch_input and batch_output are not supported for "
                "TensorRT models yet (ONNX Runtime and Python models support them)"
            )
        require_capabilities()
        record = cache.read_record(model_path)
        trt_engine = engine.TrtEngine(model_path, dla_core=record.dla_core if record else None)
        try:
            description = trt_engine.describe()
        finally:
            trt_engine.close()
        return complete_from_engine(config, description)

    def __init__(self, ctx: LoadContext) -> None:
        caps = require_capabilities()
        plan = plan_for(ctx.instance, ctx.model_path)  # a DLA instance's own plan, where there is one
        record = cache.read_record(plan)
        placement = place(
            ctx.instance,
            gpu_count=caps.gpus,
            dla_cores=caps.dla_cores,
            engine_dla_core=record.dla_core if record else None,
            engine_known=record is not None,
        )
        self.device = placement.label
        self.output_names = tuple(t.name for t in ctx.config.outputs)
        self.batched = ctx.config.max_batch_size > 0
        self._cuda = engine.Cuda(placement.gpu)
        self._traits = self._cuda.traits()
        self._engine = engine.TrtEngine(plan, dla_core=placement.dla_core)
        self.plan = plan
        try:
            self._description = self._engine.describe()
            if plan != ctx.model_path:  # the config was completed from the model's plan: check this one
                # A plan taking fewer rows than max_batch_size runs larger batches in pieces (_run).
                top = planning.max_batch_from_profiles(self._description)
                rows = min(ctx.config.max_batch_size, top) if top else ctx.config.max_batch_size
                complete_from_engine(
                    ctx.config.replace(source=str(plan), max_batch_size=rows), self._description
                )
        except BaseException:
            self._engine.close()
            raise
        self._dtypes = {t.name: dtypes.to_numpy(t.data_type) for t in self._description.tensors}
        self._contexts: dict[int, engine.TrtContext] = {}
        self._buffers: dict[str, _Buffer] = {}
        self._stream = self._cuda.create_stream()
        log.info(
            "%s: TensorRT %s engine %s on %s", ctx.instance.name, self._engine.version, plan.name, self.device
        )

    # -- buffers ----------------------------------------------------------------------------------

    def _buffer(self, name: str, size: int, *, device: bool, host: bool) -> _Buffer:
        """The tensor's buffer with room for ``size`` bytes, (re)allocated when it grows."""
        buffer = self._buffers.get(name)
        if buffer is None:
            ceiling = planning.ceiling_bytes(self._description, name, self._dtypes[name].itemsize)
            buffer = self._buffers[name] = _Buffer(planning.BufferSizer(ceiling=ceiling))
        capacity = buffer.sizer.grow_to(size)
        if capacity is not None:
            self._free(buffer)
            if device:
                buffer.device = self._cuda.malloc(capacity)
            if host:
                buffer.host = self._cuda.host_alloc(capacity)
        return buffer

    def _free(self, buffer: _Buffer) -> None:
        if buffer.device:
            self._cuda.free(buffer.device)
            buffer.device = 0
        if buffer.host:
            self._cuda.free_host(buffer.host)
            buffer.host = 0

    def _context(self, profile: int) -> engine.TrtContext:
        context = self._contexts.get(profile)
        if context is None:
            context = self._contexts[profile] = self._engine.create_context(profile)
            context.select_profile(self._stream)
        return context

    # -- execution --------------------------------------------------------------------------------

    def run(self, inputs: dict[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        return self._run(inputs, output_names, None)

    def run_into(
        self,
        inputs: dict[str, np.ndarray],
        output_names: Sequence[str],
        destinations: Mapping[str, OutputBuffer],
    ) -> dict[str, np.ndarray]:
        """Outputs straight into the client's shared memory: see ``planning.output_staging``."""
        return self._run(inputs, output_names, destinations)

    def _run(
        self,
        inputs: dict[str, np.ndarray],
        output_names: Sequence[str],
        destinations: Mapping[str, OutputBuffer] | None,
    ) -> dict[str, np.ndarray]:
        chunks = planning.batch_chunks(self._description, _rows(inputs)) if self.batched else []
        if len(chunks) > 1:  # more rows than the plan takes at once (a DLA plan): run them in pieces
            parts = [
                self._run({k: v[start:stop] for k, v in inputs.items()}, output_names, None)
                for start, stop in chunks
            ]
            return {name: np.concatenate([part[name] for part in parts]) for name in output_names}
        shapes = {name: tuple(array.shape) for name, array in inputs.items()}
        context = self._context(planning.choose_profile(self._description, shapes))
        integrated = planning.output_in_host_memory(self._traits)
        registered: list[int] = []
        outputs: dict[str, tuple[tuple[int, ...], _Buffer | None]] = {}  # None: written into a span
        placed: dict[str, tuple[np.ndarray, str]] = {}  # outputs bound to a client's span, and how
        try:
            for name, array in inputs.items():
                array = np.ascontiguousarray(array, dtype=self._dtypes[name])
                context.set_input_shape(name, shapes[name])
                context.set_address(name, self._stage_input(name, array, registered))
            for tensor in self._description.outputs:  # TensorRT needs every output bound
                name = tensor.name
                shape = context.output_shape(name)
                size = planning.nbytes(shape, self._dtypes[name].itemsize)
                how = ""
                if destinations is not None and name in destinations and name in output_names:
                    view = self._destination(destinations[name], name, shape, inputs)
                    if view is not None:
                        how = planning.output_staging(self._traits, _address(view), size)
                        placed[name] = (view, how)
                if how == planning.MAP:
                    span = placed[name][0]
                    address = self._map(_address(span), size, registered)
                    if address is not None:
                        context.set_address(name, address)
                        outputs[name] = (shape, None)
                        continue
                    placed[name] = (span, planning.PINNED_COPY)
                own = self._buffer(name, size, device=not integrated, host=True)
                address = self._cuda.device_pointer(own.host) if integrated else own.device
                context.set_address(name, address)
                outputs[name] = (shape, own)
            context.enqueue(self._stream)
            if not integrated:
                for name in output_names:
                    shape, computed = outputs[name]
                    assert computed is not None  # only integrated GPUs map outputs
                    size = planning.nbytes(shape, self._dtypes[name].itemsize)
                    target = _address(placed[name][0]) if name in placed else computed.host
                    self._cuda.copy_to_host(target, computed.device, size, self._stream)
            self._cuda.synchronize(self._stream)
        finally:
            for pointer in registered:
                self._cuda.unregister(pointer)
        result = {}
        for name in output_names:
            shape, buffer = outputs[name]
            dtype = self._dtypes[name]
            size = planning.nbytes(shape, dtype.itemsize)
            if name in placed:
                view, how = placed[name]
                if how == planning.PINNED_COPY:  # integrated, span not mappable: one host copy into it
                    assert buffer is not None
                    view.reshape(-1).view(np.uint8)[:] = engine.host_view(buffer.host, size)
                assert destinations is not None
                destinations[name].filled = (
                    OutputBuffer.COPIED if how == planning.PINNED_COPY else OutputBuffer.DIRECT
                )
                result[name] = view
                continue
            assert buffer is not None
            # A copy: the pinned buffer is reused by the next batch while the caller still holds this one.
            result[name] = engine.host_view(buffer.host, size).view(dtype).reshape(shape).copy()
        return result

    def _destination(
        self, destination: OutputBuffer, name: str, shape: tuple[int, ...], inputs: dict[str, np.ndarray]
    ) -> np.ndarray | None:
        """The client's span as this output's array, or None where it cannot take it.

        Refused: a span too small (the frontend reports it) and one that overlaps an input of the same
        request (the engine would read what it writes; on a discrete GPU the inputs were copied to the
        device already, but the rule stays one for both).
        """
        view = destination.view(self._dtypes[name], shape)
        if view is None or any(np.may_share_memory(view, array) for array in inputs.values()):
            return None
        return view

    def _map(self, host: int, size: int, registered: list[int], *, read_only: bool = False) -> int | None:
        """Register a client's span for the GPU and return its device address; None if CUDA refuses."""
        try:
            self._cuda.register(host, size, read_only=read_only)
        except ModelExecutionError as exc:  # e.g. pages another registration (an input) already covers
            log.debug("host registration of an output span failed (%s); copying", exc.message)
            return None
        registered.append(host)
        if self._traits.host_pointer_is_device_pointer:
            return host
        return self._cuda.device_pointer(host)

    def _stage_input(self, name: str, array: np.ndarray, registered: list[int]) -> int:
        """The device address the engine reads ``array`` from: mapped in place, or copied once."""
        address, size = array.ctypes.data, array.nbytes
        read_only = not array.flags.writeable  # e.g. a client's sealed frame, mapped read-only
        if planning.input_staging(self._traits, address, size, read_only=read_only) == planning.MAP:
            mapped = self._map(address, size, registered, read_only=read_only)
            if mapped is not None:
                return mapped
        integrated = planning.output_in_host_memory(self._traits)
        buffer = self._buffer(name, size, device=not integrated, host=True)
        engine.host_view(buffer.host, size)[:] = array.reshape(-1).view(np.uint8)
        if integrated:
            return self._cuda.device_pointer(buffer.host)
        self._cuda.copy_to_device(buffer.device, buffer.host, size, self._stream)
        return buffer.device

    def close(self) -> None:
        try:
            for context in self._contexts.values():
                context.close()
            self._contexts.clear()
            for buffer in self._buffers.values():
                self._free(buffer)
            self._buffers.clear()
            if self._stream is not None:
                self._cuda.destroy_stream(self._stream)
                self._stream = None
        except (ModelExecutionError, BackendUnavailable) as exc:
            log.warning("%s: freeing TensorRT resources failed: %s", self.device, exc.message)
        finally:
            self._engine.close()

    def describe(self) -> dict[str, Any]:
        return {"device": self.device, "engine": self._description.to_json()}
