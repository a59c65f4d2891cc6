"""Plan or ONNX: which file of a TensorRT model directory serves on this machine.

A version directory that holds both ``model.plan`` and ``model.onnx`` serves the plan where TensorRT and a
GPU exist and the plan fits this machine (its engine record names this TensorRT version and device, and
the ONNX it was built from is unchanged), and the ONNX through ONNX Runtime everywhere else.  The choice
and its reason are logged and shown in the model list.  Without an ONNX beside it, a plan that cannot run
fails to load with the reason (TensorRT missing, no GPU, built for another version or device).

A plan without its record (e.g. from ``trtexec``) carries no version or device to compare; where an ONNX
is beside it, the plan is deserialized once here, and a plan TensorRT cannot deserialize falls back to
the ONNX like a plan whose record does not match.  A model with DLA instances and a DLA plan
(``model.dla.plan``, see ``placement``) has that plan checked the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from edge_server.backends.tensorrt import cache, engine
from edge_server.backends.tensorrt.builder import BuildOptions
from edge_server.backends.tensorrt.placement import dla_plan_path
from edge_server.backends.tensorrt.rebuild import EngineRebuilder, Job
from edge_server.config.model import InstanceGroup, ModelConfig
from edge_server.errors import BackendUnavailable, ConfigError, ModelExecutionError
from edge_server.platform import platform_report

log = logging.getLogger(__name__)

ONNX_FILENAME = "model.onnx"


@dataclass(frozen=True)
class Choice:
    config: ModelConfig  # the config to load with (backend switched when falling back)
    note: str  # what serves and why, for the log and the model list ("" when the plan serves as asked)


def this_device(caps: engine.Capabilities) -> str:
    """The device name engine records use: the Jetson module, else the CUDA device's name."""
    report = platform_report()
    return report.module if report.is_jetson else caps.gpu_name


def plan_problems(
    plan: Path, onnx: Path | None, caps: engine.Capabilities, *, dla_core: int | None = None
) -> list[str]:
    """Why ``plan`` cannot serve here; empty when it can.

    Without a record, and with an ONNX to fall back to, the plan is deserialized (on ``dla_core`` for a
    DLA plan) to find out; without an ONNX the instance's own load says what TensorRT said.
    """
    if not caps.usable:
        return list(caps.missing)
    if not plan.is_file():
        return [f"no {plan.name}"]
    record = cache.read_record(plan)
    if record is None:
        return deserialize_problems(plan, dla_core) if onnx is not None else []
    return cache.mismatches(record, device=this_device(caps), tensorrt=caps.tensorrt, onnx=onnx)


def deserialize_problems(plan: Path, dla_core: int | None) -> list[str]:
    """Deserialize ``plan`` once: empty when TensorRT can, else what it said."""
    try:
        trt_engine = engine.TrtEngine(plan, dla_core=dla_core)
    except (ConfigError, ModelExecutionError) as exc:
        return [f"{plan.name} has no engine record and {exc.message.removeprefix(f'{plan}: ')}"]
    trt_engine.close()
    return []


def _dla_groups(config: ModelConfig) -> tuple[bool, bool]:
    """(any DLA instance, every instance on the DLA)."""
    dla = [bool(g.secondary_devices) for g in config.instance_groups]
    return any(dla), bool(dla) and all(dla)


def choose(
    config: ModelConfig,
    version_dir: Path,
    *,
    caps: engine.Capabilities | None = None,
    rebuilder: EngineRebuilder | None = None,
) -> Choice:
    """The runtime for a TensorRT model's version directory (other backends pass through unchanged).

    With a ``rebuilder`` (``--engine-build on-load``) a plan that cannot serve but could be built here is
    rebuilt from the ONNX in the background while the ONNX serves.
    """
    if config.backend != "tensorrt":
        return Choice(config, "")
    plan = version_dir / config.model_filename
    onnx = version_dir / ONNX_FILENAME
    caps = caps if caps is not None else engine.probe()
    beside = onnx if onnx.is_file() else None
    some_dla, all_dla = _dla_groups(config)
    dla_core = 0 if all_dla and caps.dla_cores > 0 else None  # the model's plan is a DLA plan
    problems = plan_problems(plan, beside, caps, dla_core=dla_core)
    dla_plan = dla_plan_path(plan)
    if not problems and some_dla and dla_plan.is_file():
        core = 0 if caps.dla_cores > 0 else None
        problems = [f"{dla_plan.name}: {p}" for p in plan_problems(dla_plan, beside, caps, dla_core=core)]
    if not problems:
        return Choice(config, "")
    if not onnx.is_file():
        raise BackendUnavailable(f"{plan} cannot serve here: " + "; ".join(problems))
    note = f"serving {ONNX_FILENAME} through onnxruntime: " + "; ".join(problems)
    if rebuilder is not None and caps.usable:
        note += "; " + _rebuild(config, plan, onnx, caps, rebuilder)
    log.warning("%s: %s", config.name, note)
    # DLA and GPU placements belong to the plan; ONNX Runtime places on its own (GPU where it has CUDA).
    groups = tuple(
        InstanceGroup(name=g.name, count=g.count * max(1, len(g.secondary_devices)), kind="KIND_AUTO")
        for g in config.instance_groups
    )
    fallback = config.replace(
        backend="onnxruntime",
        platform="onnxruntime_onnx",
        default_model_filename=ONNX_FILENAME,
        instance_groups=groups,
    )
    return Choice(fallback, note)


def _rebuild(
    config: ModelConfig, plan: Path, onnx: Path, caps: engine.Capabilities, rebuilder: EngineRebuilder
) -> str:
    """Queue a GPU rebuild of ``plan`` (FP16, the config's batch range); say what happens, for the note."""
    if any(g.secondary_devices for g in config.instance_groups):
        return "DLA plans are not rebuilt on load: run 'edge-server build-engine --dla-core N'"
    top = max(config.max_batch_size, 1)
    job = Job(
        model=config.name,
        onnx=onnx,
        plan=plan,
        device=this_device(caps),
        options=BuildOptions(fp16=True),
        batch=(1, top, top),
    )
    rebuilder.request(job)
    return "rebuilding the plan in the background (--engine-build on-load)"
