"""Where a TensorRT instance runs: the GPU, or a DLA core, checked against the device and the engine.

The loader resolves ``instance_group`` into :class:`~edge_server.backends.base.InstanceSpec` (``KIND_GPU``
with ``gpus``; Triton's DLA form, ``KIND_GPU`` with ``secondary_devices [{kind: KIND_NVDLA, device_id: N}]``,
becomes ``KIND_DLA`` core N; ``KIND_AUTO`` becomes ``KIND_GPU`` where the backend has a GPU).  This module
turns that into a placement or a load error that says what does not match.

A GPU engine and a DLA engine are different plans, so one model whose instances sit on the GPU and on DLA
cores needs both: each instance picks its own plan by its device (:func:`plan_for`).  GPU instances load
the model's plan (``model.plan``, or ``default_model_filename``); DLA instances load ``model.dla.plan``
(the same name with ``.dla`` before the suffix) when it exists, else the model's plan.  One DLA plan
serves every core: TensorRT picks the core at deserialization.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edge_server.backends.base import InstanceSpec
from edge_server.errors import ConfigError


@dataclass(frozen=True)
class Placement:
    gpu: int
    dla_core: int | None  # None: the GPU itself

    @property
    def label(self) -> str:
        """The device label shown in model lists and metrics: "cuda:0", "dla:1"."""
        return f"cuda:{self.gpu}" if self.dla_core is None else f"dla:{self.dla_core}"


DLA_INFIX = ".dla"


def dla_plan_path(plan: Path) -> Path:
    """The DLA plan beside a model's plan: ``model.plan`` -> ``model.dla.plan``."""
    return plan.with_name(f"{plan.stem}{DLA_INFIX}{plan.suffix}")


def plan_for(spec: InstanceSpec, plan: Path) -> Path:
    """The plan an instance loads: the DLA plan for a DLA instance where one exists, else ``plan``."""
    if spec.kind == "KIND_DLA":
        dla = dla_plan_path(plan)
        if dla.is_file():
            return dla
    return plan


def place(
    spec: InstanceSpec, *, gpu_count: int, dla_cores: int, engine_dla_core: int | None, engine_known: bool
) -> Placement:
    """The placement of one instance, or a ConfigError naming the mismatch.

    ``engine_dla_core`` is the core the engine was built for (from its cache record; None: built for the
    GPU) and ``engine_known`` says whether that record exists.  A DLA engine is bound to the DLA, not to
    the core: TensorRT picks the core at deserialization, so an engine built on core 0 runs on core 1.
    """
    if spec.kind == "KIND_CPU":
        raise ConfigError(
            f"{spec.name}: TensorRT engines run on a GPU or a DLA core, not KIND_CPU; use KIND_GPU "
            "(optionally with secondary_devices KIND_NVDLA) or serve the model's ONNX through onnxruntime "
            "for the CPU"
        )
    if gpu_count < 1:
        raise ConfigError(f"{spec.name}: no CUDA GPU on this machine")
    if spec.kind == "KIND_GPU":
        if spec.device_id >= gpu_count:
            raise ConfigError(
                f"{spec.name}: instance_group asks for GPU {spec.device_id} but this machine has {gpu_count} "
                f"GPU(s) (ids 0..{gpu_count - 1})"
            )
        if engine_known and engine_dla_core is not None:
            raise ConfigError(
                f"{spec.name}: the engine was built for the DLA (core {engine_dla_core}) but the "
                "instance is placed on the GPU; add secondary_devices [{ kind: KIND_NVDLA, device_id: N }], "
                "or build a GPU plan too ('edge-server build-engine --dla-core N --also-gpu' writes "
                "model.plan for the GPU and model.dla.plan for the DLA)"
            )
        return Placement(gpu=spec.device_id, dla_core=None)
    if spec.kind == "KIND_DLA":
        if dla_cores == 0:
            raise ConfigError(
                f"{spec.name}: the instance asks for DLA core {spec.device_id} but this device has no DLA"
            )
        if spec.device_id >= dla_cores:
            raise ConfigError(
                f"{spec.name}: the instance asks for DLA core {spec.device_id} but this device has "
                f"{dla_cores} DLA core(s) (ids 0..{dla_cores - 1})"
            )
        if engine_known and engine_dla_core is None:
            raise ConfigError(
                f"{spec.name}: the instance is placed on DLA core {spec.device_id} but the engine was "
                "built for the GPU and no DLA plan (model.dla.plan) is beside it; build one with "
                "'edge-server build-engine --dla-core N --also-gpu'"
            )
        return Placement(gpu=0, dla_core=spec.device_id)
    raise ConfigError(f"{spec.name}: instance kind {spec.kind} is not supported by the TensorRT backend")
