"""The model config checked against an engine, and completed from it where the config is silent.

This is Triton's auto-complete for TensorRT plans: names, data types, dims and max_batch_size.
"""

from __future__ import annotations

from typing import Any

from edge_server.backends.tensorrt.description import EngineDescription, TensorDescription
from edge_server.backends.tensorrt.planning import max_batch_from_profiles
from edge_server.config.model import DynamicBatching, ModelConfig, TensorSpec
from edge_server.errors import ConfigError


def _check(
    configured: tuple[TensorSpec, ...],
    engine: tuple[TensorDescription, ...],
    *,
    role: str,
    batched: bool,
    source: str,
) -> tuple[TensorSpec, ...]:
    if not configured:
        return tuple(
            TensorSpec(name=t.name, data_type=t.data_type, dims=t.shape[1:] if batched else t.shape)
            for t in engine
        )
    by_name = {t.name: t for t in engine}
    for spec in configured:
        tensor = by_name.get(spec.name)
        if tensor is None:
            raise ConfigError(
                f"{source}: {role} {spec.name!r} is not in the engine; its {role}s are {sorted(by_name)}"
            )
        if spec.data_type != tensor.data_type:
            raise ConfigError(
                f"{source}: {role} {spec.name!r} has data_type {spec.data_type} but the engine has "
                f"{tensor.data_type}"
            )
        engine_dims = tensor.shape[1:] if batched else tensor.shape
        want = tuple(spec.reshape if spec.reshape is not None else spec.dims)
        if len(want) != len(engine_dims) or any(
            e != -1 and w != -1 and e != w for w, e in zip(want, engine_dims, strict=True)
        ):
            where = " (excluding the batch axis)" if batched else ""
            raise ConfigError(
                f"{source}: {role} {spec.name!r} has dims {list(want)} but the engine has "
                f"{list(engine_dims)}{where}"
            )
        if batched and tensor.shape[0] != -1:
            raise ConfigError(
                f"{source}: max_batch_size > 0 but the engine's {role} {spec.name!r} has a fixed first "
                f"dimension {tensor.shape[0]}; build the engine with a dynamic batch profile or set "
                "max_batch_size: 0"
            )
    return configured


def complete_from_engine(config: ModelConfig, engine: EngineDescription) -> ModelConfig:
    """Check ``config`` against ``engine`` and fill what it leaves out; raises ConfigError on a mismatch."""
    source = config.source or engine.source
    engine_max = max_batch_from_profiles(engine)
    changes: dict[str, Any] = {}
    max_batch = config.max_batch_size
    if max_batch == 0 and not config.inputs and not config.outputs and engine_max > 0:
        max_batch = engine_max
        changes["max_batch_size"] = max_batch
        if config.dynamic_batching is None:
            changes["dynamic_batching"] = DynamicBatching()
    if max_batch > 0 and engine_max == 0:
        raise ConfigError(
            f"{source}: max_batch_size is {max_batch} but the engine has no batch axis (every input and "
            "output must start with a dynamic dimension whose profiles go down to 1); set max_batch_size: 0"
        )
    if max_batch > engine_max > 0:
        raise ConfigError(
            f"{source}: max_batch_size {max_batch} exceeds the engine's optimization profiles, which accept "
            f"batches up to {engine_max}; rebuild with a larger --max-batch or lower max_batch_size"
        )
    batched = max_batch > 0
    changes["inputs"] = _check(config.inputs, engine.inputs, role="input", batched=batched, source=source)
    changes["outputs"] = _check(config.outputs, engine.outputs, role="output", batched=batched, source=source)
    if not config.platform:
        changes["platform"] = "tensorrt_plan"
    return config.replace(**changes)
