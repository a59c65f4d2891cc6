"""``edge-server build-engine model.onnx``: build a TensorRT plan and drop it into the repository.

The plan, its engine record and (when the model has none) a ready ``config.pbtxt`` go into a new version
directory, written beside it under a hidden name and renamed into place, so a watched repository picks
the version up as an OTA drop.  DLA builds refuse dynamic shapes (the DLA needs min = opt = max) and list
the layers that will fall back to the GPU.  Needs TensorRT and a GPU; everything else here is plain code.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from edge_server.backends.tensorrt.description import EngineDescription
from edge_server.config.model import ModelConfig
from edge_server.errors import ConfigError


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "build-engine",
        help="build a TensorRT plan from an ONNX model into a new version of a repository model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", type=Path, help="the ONNX model")
    parser.add_argument("--model-repository", type=Path, default=None, help="default: from the ONNX's path")
    parser.add_argument(
        "--name", default=None, help="the model's name in the repository (default: from the path)"
    )
    parser.add_argument("--version", type=int, default=None, help="default: one above the highest present")
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--int8", action="store_true")
    parser.add_argument("--calib-images", type=Path, default=None, help="image folder for INT8 calibration")
    parser.add_argument("--calib-cache", type=Path, default=None, help="INT8 calibration cache file")
    parser.add_argument("--dla-core", type=int, default=None, help="build for this DLA core")
    parser.add_argument(
        "--gpu-fallback", action="store_true", help="let layers the DLA cannot run use the GPU"
    )
    parser.add_argument(
        "--also-gpu",
        action="store_true",
        help="with --dla-core: also build a GPU plan, so one model runs instances on the GPU and on every "
        "DLA core (model.plan for the GPU over the batch range, model.dla.plan for the DLA at --min-batch)",
    )
    parser.add_argument("--min-batch", type=int, default=1)
    parser.add_argument("--opt-batch", type=int, default=None, help="default: --max-batch")
    parser.add_argument("--max-batch", type=int, default=None, help="default: 8 (GPU), --min-batch (DLA)")
    parser.add_argument("--workspace-mib", type=int, default=1024, help="builder workspace limit")
    parser.set_defaults(tool_run=run)


def batch_range(args: argparse.Namespace) -> tuple[int, int, int]:
    """(min, opt, max) batch sizes; DLA builds get one fixed size.

    With ``--also-gpu`` this is the GPU plan's range (default up to 8) and the DLA plan is built for
    ``--min-batch`` alone (:func:`dla_batch`).
    """
    also_gpu = bool(getattr(args, "also_gpu", False))
    if also_gpu and args.dla_core is None:
        raise ConfigError("--also-gpu goes with --dla-core (it adds a GPU plan to a DLA build)")
    low = args.min_batch
    dla_only = args.dla_core is not None and not also_gpu
    high = args.max_batch if args.max_batch is not None else (low if dla_only else 8)
    opt = args.opt_batch if args.opt_batch is not None else high
    if not 1 <= low <= opt <= high:
        raise ConfigError(f"batch sizes must satisfy 1 <= min <= opt <= max; got {low}, {opt}, {high}")
    if dla_only and not low == opt == high:
        raise ConfigError(
            f"the DLA needs static shapes (min = opt = max); got batch {low}/{opt}/{high}: pass one size, "
            "e.g. --min-batch 1 --max-batch 1 (or add --also-gpu: a GPU plan for the range, a DLA plan "
            "for batch 1)"
        )
    if also_gpu and 1 < low < high:
        raise ConfigError(
            f"--also-gpu with batch {low}..{high}: a DLA plan with a fixed batch of {low} cannot serve a "
            "queue that batches other sizes; use --min-batch 1 (the DLA runs larger batches row by row) "
            f"or one size (--min-batch {low} --max-batch {low})"
        )
    if args.int8 and args.calib_images is None and args.calib_cache is None:
        raise ConfigError(
            "--int8 needs --calib-images (and optionally --calib-cache) or an existing --calib-cache"
        )
    return low, opt, high


def dla_batch(batch: tuple[int, int, int]) -> tuple[int, int, int]:
    """The DLA plan's static batch: the range's minimum (min = opt = max)."""
    return batch[0], batch[0], batch[0]


def locate(args: argparse.Namespace) -> tuple[Path, str]:
    """The repository and model name: given, or read from a path like ``repo/<name>/<version>/model.onnx``."""
    path = args.model.resolve()
    repository, name = args.model_repository, args.name
    looks_like_repo = path.parent.name.isdigit()
    if repository is None:
        if not looks_like_repo:
            raise ConfigError(
                f"{args.model}: not inside a repository version directory; pass --model-repository"
            )
        repository = path.parents[2]
    if name is None:
        name = path.parents[1].name if looks_like_repo else path.stem
    return repository, name


def next_version(model_dir: Path) -> int:
    versions = (
        [int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()]
        if model_dir.is_dir()
        else []
    )
    return max(versions, default=0) + 1


def config_text(
    config: ModelConfig, dla_core: int | None, *, gpu_too: bool = False, dla_cores: int = 1
) -> str:
    """A config.pbtxt for the built engine, in Triton's text format.

    A DLA build places one instance on the core it was built for; with ``gpu_too`` (both plans built),
    one instance on the GPU and one on each of the ``dla_cores`` cores, all serving one queue.
    """

    def tensor(spec: Any) -> str:
        dims = ", ".join(str(d) for d in spec.dims)
        return f'  {{ name: "{spec.name}", data_type: {spec.data_type}, dims: [ {dims} ] }}'

    lines = [
        "# Written by edge-server build-engine.",
        f'name: "{config.name}"',
        'platform: "tensorrt_plan"',
        f"max_batch_size: {config.max_batch_size}",
        "input [",
        ",\n".join(tensor(t) for t in config.inputs),
        "]",
        "output [",
        ",\n".join(tensor(t) for t in config.outputs),
        "]",
    ]
    gpu = "  { count: 1, kind: KIND_GPU }"
    cores = range(max(dla_cores, 1)) if gpu_too else ([dla_core] if dla_core is not None else [])
    groups = [gpu] if dla_core is None or gpu_too else []
    groups += [
        f"  {{ count: 1, kind: KIND_GPU, secondary_devices [ {{ kind: KIND_NVDLA, device_id: {core} }} ] }}"
        for core in cores
    ]
    lines += ["instance_group [", ",\n".join(groups), "]"]
    if config.max_batch_size > 0:
        lines.append("dynamic_batching { }")
    return "\n".join(lines) + "\n"


def install(model_dir: Path, version: int, files: dict[str, bytes], config: str | None) -> Path:
    """Write the version directory under a hidden name, then rename it into place (one atomic drop)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    target = model_dir / str(version)
    if target.exists():
        raise ConfigError(f"{target} already exists; pick another --version")
    staging = Path(tempfile.mkdtemp(prefix=f".build-{version}-", dir=model_dir))
    try:
        for name, data in files.items():
            (staging / name).write_bytes(data)
        if config is not None and not (model_dir / "config.pbtxt").exists():
            temp = model_dir / ".config.pbtxt.tmp"
            temp.write_text(config)
            os.replace(temp, model_dir / "config.pbtxt")
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def completed_config(name: str, description: EngineDescription) -> ModelConfig:
    from edge_server.backends.tensorrt.config_check import complete_from_engine

    return complete_from_engine(ModelConfig(name=name, backend="tensorrt", source=name), description)


def _build_plan(
    args: argparse.Namespace, caps: Any, dla_core: int | None, batch: tuple[int, int, int]
) -> tuple[bytes, bytes, EngineDescription, float, str]:
    """One plan for the GPU (``dla_core`` None) or the DLA: (plan, record, description, seconds, version)."""
    import dataclasses
    import json

    from edge_server.backends.tensorrt import builder, cache, engine
    from edge_server.backends.tensorrt.fallback import this_device

    profile = builder.profile_shapes(builder.network_inputs(args.model), batch)
    options = builder.BuildOptions(
        fp16=args.fp16,
        int8=args.int8,
        calibration_images=args.calib_images,
        calibration_cache=args.calib_cache,
        dla_core=dla_core,
        gpu_fallback=args.gpu_fallback,
        workspace_bytes=args.workspace_mib << 20,
        profile=profile,
    )
    where = "the GPU" if dla_core is None else f"DLA core {dla_core}"
    result = builder.build(
        args.model, options, progress=lambda line: print(f"{where}: {line}", file=sys.stderr, flush=True)
    )
    if result.layers_on_gpu:
        print(f"{len(result.layers_on_gpu)} layer(s) fall back to the GPU:", file=sys.stderr)
        for layer in result.layers_on_gpu:
            print(f"  {layer}", file=sys.stderr)
    key = cache.EngineKey(this_device(caps), dla_core, result.tensorrt, cache.sha256_file(args.model))
    with tempfile.TemporaryDirectory() as temp:
        plan = Path(temp) / "model.plan"
        plan.write_bytes(result.plan)
        trt_engine = engine.TrtEngine(plan, dla_core=dla_core)
        description = trt_engine.describe()
        trt_engine.close()
    record = json.dumps(dataclasses.asdict(key), indent=2).encode() + b"\n"
    return result.plan, record, description, result.seconds, result.tensorrt


def run(args: argparse.Namespace) -> int:
    from edge_server.backends.tensorrt.backend import require_capabilities

    batch = batch_range(args)
    repository, name = locate(args)
    caps = require_capabilities()  # says exactly what is missing: TensorRT, cuda-python, a GPU
    also_gpu = bool(getattr(args, "also_gpu", False))
    dla_range = dla_batch(batch) if args.dla_core is not None else batch
    plan, record, description, seconds, version_text = _build_plan(args, caps, args.dla_core, dla_range)
    # The ONNX goes along: where the plan cannot run (another TensorRT, no GPU) the version serves it.
    files = {"model.onnx": args.model.read_bytes()}
    if also_gpu:
        # The DLA plan is model.dla.plan; the GPU plan, for the whole batch range, is the model's plan
        # (the config's max_batch_size comes from it; DLA instances run larger batches row by row).
        files |= {"model.dla.plan": plan, "model.dla.plan.json": record}
        plan, record, description, more, _ = _build_plan(args, caps, None, batch)
        seconds += more
    files |= {"model.plan": plan, "model.plan.json": record}
    config = completed_config(name, description)
    version = args.version or next_version(repository / name)
    text = config_text(config, args.dla_core, gpu_too=also_gpu, dla_cores=caps.dla_cores)
    target = install(repository / name, version, files, text)
    existing = repository / name / "config.pbtxt"
    if "tensorrt" not in existing.read_text():
        print(
            f"note: {existing} does not name the TensorRT backend, so the ONNX will serve; set "
            'platform: "tensorrt_plan" there to serve the plan',
            file=sys.stderr,
        )
    built = ", ".join(sorted(f for f in files if f.endswith(".plan")))
    print(f"{target}: {built} built in {seconds:.0f} s with TensorRT {version_text}")
    return 0
