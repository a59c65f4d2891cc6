"""Parse Triton ``config.pbtxt`` files into validated :class:`~edge_server.config.model.ModelConfig`.

Three steps, each with one kind of outcome:

1. protobuf text format against our mirror of Triton's schema: a typo'd field, a wrong type or an
   unknown enum value is a :class:`ConfigError` that says ``file:line:col`` and names the field;
2. every field Triton knows but edge-server does not act on yet becomes a warning naming its path,
   so nothing is silently ignored;
3. conversion to dataclasses (:mod:`.convert`) and one validation pass over the result
   (:func:`validate_config`), whose errors name the file and the field.
"""

from __future__ import annotations

import difflib
import math
import pathlib
import re
from collections.abc import Mapping
from typing import get_args

from google.protobuf import json_format, text_format

from edge_server import dtypes
from edge_server.config import ragged, schema, sequence
from edge_server.config.convert import Proto, to_model_config
from edge_server.config.model import (
    OTHER_TRITON_PLATFORMS,
    PLATFORM_TO_BACKEND,
    BackendName,
    ModelConfig,
    TensorSpec,
    unsupported_backend_message,
)
from edge_server.errors import ConfigError, UnsupportedBackend

BACKENDS: tuple[str, ...] = get_args(BackendName)

# The fields edge-server acts on.  True: the whole subtree; a mapping: only the fields it names.
_SUPPORTED: Mapping[str, object] = {
    "name": True,
    "platform": True,
    "backend": True,
    "max_batch_size": True,
    "input": dict.fromkeys(
        ("name", "data_type", "dims", "reshape", "optional", "format", "allow_ragged_batch"), True
    ),
    "batch_input": True,
    "batch_output": True,
    "output": dict.fromkeys(("name", "data_type", "dims", "reshape", "label_filename"), True),
    "instance_group": dict.fromkeys(("name", "kind", "count", "gpus", "secondary_devices", "passive"), True),
    "dynamic_batching": True,
    "sequence_batching": {
        "max_sequence_idle_microseconds": True,
        "control_input": True,
        "direct": True,
        "oldest": True,
        "iterative_sequence": True,
        "state": dict.fromkeys(("input_name", "output_name", "data_type", "dims", "initial_state"), True),
    },
    "version_policy": True,
    "parameters": True,
    "model_warmup": True,
    "default_model_filename": True,
    "optimization": {"execution_accelerators": True},
    "model_transaction_policy": True,
    "ensemble_scheduling": True,
}

_PARSE_ERROR_PREFIX = re.compile(r"^\d+(?::\d+)? : ")
_NO_FIELD = re.compile(r'Message type "([\w.]+)" has no field named "(\w+)"')


def parse_config_text(text: str, *, source: str, default_name: str) -> tuple[ModelConfig, list[str]]:
    """Parse and validate the text of a ``config.pbtxt``; also return warnings for ignored fields.

    ``source`` names the file in every message.  ``default_name`` is the model's directory name: it is
    the model name when the file gives none, and the file's ``name`` must equal it, as in Triton.  A
    config without ``backend`` and ``platform`` is valid and has backend ``""``: the caller decides
    from the model file.
    """
    message = schema.new_model_config()
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as exc:
        raise ConfigError(_describe_parse_error(source, exc)) from None

    if message.name and message.name != default_name:
        raise ConfigError(
            f"{source}: field 'name': {message.name!r} does not match the model directory "
            f"{default_name!r}; Triton requires them to be equal (or leave 'name' out)"
        )
    warnings = [
        f"{source}: field '{path}' is not supported by edge-server yet and is ignored"
        for path in unsupported_fields(message)
    ]
    config, conversion_warnings = to_model_config(message, source=source, default_name=default_name)
    validate_config(config, completed=False)
    return config, warnings + conversion_warnings


def parse_config_json(text: str, *, source: str, default_name: str) -> tuple[ModelConfig, list[str]]:
    """Parse a config given as JSON (Triton's load-time ``config``), then as :func:`parse_config_text`.

    The JSON names fields as Triton's ``ModelConfig`` protobuf does; it is checked against the same
    schema and converted to text format, so that one path validates every config.
    """
    message = schema.new_model_config()
    try:
        json_format.Parse(text, message)
    except json_format.ParseError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return parse_config_text(text_format.MessageToString(message), source=source, default_name=default_name)


def load_config_file(path: pathlib.Path, *, default_name: str) -> tuple[ModelConfig, list[str]]:
    """Read and parse a ``config.pbtxt``.  A missing or unreadable file raises ``OSError`` as is."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: {exc}") from None
    return parse_config_text(text, source=str(path), default_name=default_name)


def _describe_parse_error(source: str, exc: text_format.ParseError) -> str:
    # ParseError's text starts "line:col : "; put the position after the file name instead.
    message = _PARSE_ERROR_PREFIX.sub("", str(exc))
    match = _NO_FIELD.search(message)
    if match:
        message += _suggestion(match[1], match[2])
    line, column = exc.GetLine(), exc.GetColumn()
    if line is None:
        return f"{source}: {message}"
    if column is None:
        return f"{source}:{line}: {message}"
    return f"{source}:{line}:{column}: {message}"


def _suggestion(message_type: str, field: str) -> str:
    descriptor = schema.model_config_descriptor().file.pool.FindMessageTypeByName(message_type)
    close = difflib.get_close_matches(field, list(descriptor.fields_by_name), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def unsupported_fields(message: Proto, supported: Mapping[str, object] = _SUPPORTED) -> list[str]:
    """Paths such as ``input.allow_ragged_batch`` of fields set in ``message`` but not in ``supported``.

    Each path is listed once, however many inputs or groups set it.  Only fields that are present
    count: in proto3 a scalar left at its default (``allow_ragged_batch: false``) is not.
    """
    found: list[str] = []
    for field, value in message.ListFields():
        rule = supported.get(field.name)
        if rule is True:
            continue
        if not isinstance(rule, Mapping):
            found.append(field.name)
            continue
        items = value if field.is_repeated else [value]
        for item in items:
            found.extend(f"{field.name}.{path}" for path in unsupported_fields(item, rule))
    return list(dict.fromkeys(found))


def _fail(config: ModelConfig, field: str, problem: str) -> ConfigError:
    return ConfigError(f"{config.source}: field '{field}': {problem}")


def validate_config(config: ModelConfig, *, completed: bool = True) -> None:
    """Raise :class:`ConfigError` for the first rule ``config`` breaks; Triton's rules where it has them.

    ``completed=False`` is the check of a config as written, before the backend's auto-complete: an
    input or output may then leave its ``data_type`` (``TYPE_INVALID``) or its ``dims`` for the
    backend to fill from the model file, as Triton allows for ONNX, TensorRT and Python models.  The
    loader checks again with ``completed=True`` once the backend has filled them.
    """
    _validate_backend(config)
    if config.max_batch_size < 0:
        raise _fail(config, "max_batch_size", f"must be >= 0 (0: no batching), got {config.max_batch_size}")
    _validate_tensors(config, "input", config.inputs, completed=completed)
    _validate_tensors(config, "output", config.outputs, completed=completed)
    _validate_instance_groups(config)
    _validate_dynamic_batching(config)
    problem = ragged.problems(
        config.batch_inputs,
        config.batch_outputs,
        max_batch_size=config.max_batch_size,
        inputs=tuple(t.name for t in config.inputs),
        outputs=tuple(t.name for t in config.outputs),
    )
    if problem:
        raise _fail(config, *problem)
    if config.sequence_batching is not None:
        problem = sequence.problems(
            config.sequence_batching,
            max_batch_size=config.max_batch_size,
            inputs=tuple(t.name for t in config.inputs),
            outputs={t.name: t.data_type for t in config.outputs},
        )
        if problem:
            raise _fail(config, *problem)
        if config.decoupled and not config.sequence_batching.iterative_sequence:
            raise _fail(
                config,
                "sequence_batching",
                "a decoupled model can use sequence batching here only with iterative_sequence: true "
                "(request rescheduling)",
            )
    policy = config.version_policy
    if policy.kind == "latest" and policy.num_versions < 1:
        raise _fail(config, "version_policy.latest.num_versions", f"must be >= 1, got {policy.num_versions}")
    _validate_warmup(config)
    if config.decoupled and config.backend not in ("", "python", "ensemble"):
        raise _fail(
            config,
            "model_transaction_policy.decoupled",
            f"backend {config.backend!r} answers each request once; only Python models (and ensembles of "
            "them) send their own responses",
        )
    for kind, accelerators in (("gpu", config.gpu_accelerators), ("cpu", config.cpu_accelerators)):
        for i, accelerator in enumerate(accelerators):
            if not accelerator.name:
                field = f"optimization.execution_accelerators.{kind}_execution_accelerator[{i}].name"
                raise _fail(config, field, "must name the accelerator")


def _validate_backend(config: ModelConfig) -> None:
    if config.backend and config.backend not in BACKENDS:
        message = unsupported_backend_message(config.backend)
        raise UnsupportedBackend(f"{config.source}: field 'backend': {message}")
    if not config.platform:
        return
    expected = PLATFORM_TO_BACKEND.get(config.platform)
    if expected is None:
        triton_backend = OTHER_TRITON_PLATFORMS.get(config.platform)
        if triton_backend is not None:
            message = unsupported_backend_message(triton_backend, platform=config.platform)
            raise UnsupportedBackend(f"{config.source}: field 'platform': {message}")
        raise _fail(
            config,
            "platform",
            f"unknown platform {config.platform!r}; edge-server has {', '.join(PLATFORM_TO_BACKEND)}",
        )
    if config.backend != expected:
        raise _fail(
            config,
            "platform",
            f"platform {config.platform!r} is served by backend {expected!r}, "
            f"but the config says backend {config.backend!r}",
        )


def _check_dims(config: ModelConfig, field: str, dims: tuple[int, ...], *, variable_ok: bool = True) -> None:
    for dim in dims:
        if dim >= 1 or (dim == -1 and variable_ok):
            continue
        rule = "must be >= 1, or -1 for a variable size" if variable_ok else "must all be >= 1"
        raise _fail(config, field, f"dimensions {rule}; got {list(dims)}")


def _validate_tensors(
    config: ModelConfig, side: str, tensors: tuple[TensorSpec, ...], *, completed: bool
) -> None:
    seen: set[str] = set()
    for i, tensor in enumerate(tensors):
        path = f"{side}[{i}]"
        if not tensor.name:
            raise _fail(config, f"{path}.name", f"every {side} must have a name")
        if tensor.name in seen:
            raise _fail(config, f"{path}.name", f"duplicate {side} name {tensor.name!r}")
        seen.add(tensor.name)
        if tensor.data_type == "TYPE_INVALID":
            if completed:
                raise _fail(
                    config,
                    f"{path}.data_type",
                    f"{side} {tensor.name!r} must set a data_type "
                    "(the backend's auto-complete did not fill it)",
                )
        elif tensor.data_type not in dtypes.config_names():
            raise _fail(
                config,
                f"{path}.data_type",
                f"{tensor.data_type} of {side} {tensor.name!r} is not supported by edge-server; "
                f"use one of {', '.join(dtypes.config_names())}",
            )
        _check_dims(config, f"{path}.dims", tensor.dims)
        if tensor.format in ("FORMAT_NHWC", "FORMAT_NCHW") and tensor.dims and len(tensor.dims) != 3:
            raise _fail(config, f"{path}.format", f"{tensor.format} needs 3 dims, got {list(tensor.dims)}")
        if tensor.reshape is None:
            continue
        _check_dims(config, f"{path}.reshape.shape", tensor.reshape)
        if not tensor.reshape and config.max_batch_size == 0:
            raise _fail(
                config,
                f"{path}.reshape",
                "an empty reshape needs a batching model (max_batch_size > 0): "
                "a non-batching model has no scalar tensors",
            )
        if tensor.dims or completed:
            problem = reshape_problem(tensor.dims, tensor.reshape)
            if problem:
                raise _fail(config, f"{path}.reshape", f"{side} {tensor.name!r}: {problem}")


def _element_count(dims: tuple[int, ...]) -> int:
    """Triton's count: -1 when any dim is variable, 0 for no dims at all."""
    if -1 in dims:
        return -1
    return math.prod(dims) if dims else 0


def _chunks(dims: tuple[int, ...]) -> list[int]:
    """Element counts of the runs of fixed dims between variable ones: [2, 4, -1, 6] -> [8, 6]."""
    counts, current = [], 1
    for dim in dims:
        if dim == -1:
            counts.append(current)
            current = 1
        else:
            current *= dim
    counts.append(current)
    return counts


def reshape_problem(dims: tuple[int, ...], reshape: tuple[int, ...]) -> str:
    """Why ``reshape`` cannot be a view of ``dims`` under Triton's rules, or ``""`` when it can.

    Both must hold the same element count, or both have variable dims; an empty reshape (a scalar)
    needs exactly one element.  With variable dims, the fixed runs between them must match pairwise:
    [2, 4, -1, 6] -> [8, -1, 1, 6] is valid (2*4 = 8 and 6 = 1*6), [-1, 6] -> [6, -1] is not.
    """
    dims_count, reshape_count = _element_count(dims), _element_count(reshape)
    if dims_count != reshape_count and not (reshape_count == 0 and dims_count == 1):
        return (
            f"reshape {list(reshape)} has {_describe_count(reshape_count)} but dims {list(dims)} have "
            f"{_describe_count(dims_count)}"
        )
    if dims_count != -1:
        return ""
    dims_chunks, reshape_chunks = _chunks(dims), _chunks(reshape)
    if len(dims_chunks) != len(reshape_chunks):
        return f"reshape {list(reshape)} and dims {list(dims)} have different numbers of variable (-1) dims"
    if dims_chunks != reshape_chunks:
        return (
            f"reshape {list(reshape)} does not match dims {list(dims)}: the fixed dims between the "
            f"variable ones hold {reshape_chunks} and {dims_chunks} elements"
        )
    return ""


def _describe_count(count: int) -> str:
    return "a variable element count (-1)" if count == -1 else f"{count} elements"


def _validate_instance_groups(config: ModelConfig) -> None:
    for i, group in enumerate(config.instance_groups):
        path = f"instance_group[{i}]"
        if group.count < 1:
            raise _fail(config, f"{path}.count", f"must be >= 1 (0 or unset means 1), got {group.count}")
        if group.kind not in ("KIND_AUTO", "KIND_GPU", "KIND_CPU", "KIND_MODEL"):
            raise _fail(config, f"{path}.kind", f"unknown kind {group.kind!r}")
        if group.gpus and group.kind in ("KIND_CPU", "KIND_MODEL"):
            raise _fail(config, f"{path}.gpus", f"a {group.kind} group cannot name GPUs")
        if any(gpu < 0 for gpu in group.gpus):
            raise _fail(config, f"{path}.gpus", f"GPU ids must be >= 0, got {list(group.gpus)}")
        for j, device in enumerate(group.secondary_devices):
            if device.kind != "KIND_NVDLA" or device.device_id < 0:
                raise _fail(
                    config,
                    f"{path}.secondary_devices[{j}]",
                    f"expected kind KIND_NVDLA and a device_id >= 0, got {device.kind} {device.device_id}",
                )


def _validate_dynamic_batching(config: ModelConfig) -> None:
    batching = config.dynamic_batching
    if batching is None:
        return
    path = "dynamic_batching"
    for size in batching.preferred_batch_size:
        if size < 1 or size > config.max_batch_size:
            raise _fail(
                config,
                f"{path}.preferred_batch_size",
                f"each size must be in [1, max_batch_size={config.max_batch_size}], "
                f"got {list(batching.preferred_batch_size)}",
            )
    levels = batching.priority_levels
    default_level = batching.default_priority_level
    if levels and not 1 <= default_level <= levels:
        raise _fail(
            config,
            f"{path}.default_priority_level",
            f"must be in [1, priority_levels={levels}], got {default_level}",
        )
    if not levels and default_level:
        raise _fail(
            config, f"{path}.default_priority_level", f"is {default_level} but priority_levels is 0 (unset)"
        )
    for level in batching.priority_queue_policy:
        if not 1 <= level <= levels:
            raise _fail(
                config,
                f"{path}.priority_queue_policy",
                f"priority level {level} is out of range [1, priority_levels={levels}]",
            )
    policies = {"default_queue_policy": batching.default_queue_policy}
    policies.update({f"priority_queue_policy[{k}]": v for k, v in batching.priority_queue_policy.items()})
    for name, policy in policies.items():
        if policy.timeout_action not in ("REJECT", "DELAY"):
            raise _fail(
                config,
                f"{path}.{name}.timeout_action",
                f"must be REJECT or DELAY, got {policy.timeout_action!r}",
            )
        delays = policy.timeout_action == "DELAY" and policy.default_timeout_microseconds != 0
        if batching.preserve_ordering and delays:
            raise _fail(
                config, f"{path}.{name}.timeout_action", "DELAY cannot be used with preserve_ordering"
            )
    if batching.preserve_ordering and levels > 1:
        raise _fail(config, f"{path}.preserve_ordering", "allows only one priority level")


def _validate_warmup(config: ModelConfig) -> None:
    largest = max(1, config.max_batch_size)
    for i, sample in enumerate(config.model_warmup):
        path = f"model_warmup[{i}]"
        if not 1 <= sample.batch_size <= largest:
            raise _fail(
                config,
                f"{path}.batch_size",
                f"sample {sample.name!r} has batch_size {sample.batch_size}; must be in [1, {largest}]",
            )
        for key, spec in sample.inputs.items():
            where = f"{path}.inputs[{key!r}]"
            if spec.data_type == "TYPE_INVALID":
                raise _fail(config, f"{where}.data_type", "must set a data_type")
            _check_dims(config, f"{where}.dims", spec.dims, variable_ok=False)
            if spec.source == "input_data_file" and not spec.input_data_file:
                raise _fail(
                    config, f"{where}.input_data_file", "must name a file under the warmup/ directory"
                )
