"""Triton's auto-complete for ONNX models: a config's inputs, outputs and batching filled from the graph.

Where ``config.pbtxt`` leaves them out, the inputs and outputs come from the ONNX graph, and a model
whose every tensor starts with a dynamic axis batches (``max_batch_size`` 4, Triton's
``default-max-batch-size``, with dynamic batching).  Where the config names them, each is checked
against the graph (name, type, dims, the batch axis), so that a mismatch fails the load with a precise
message instead of the first request.  Sequence batching's control and state tensors are model inputs
and outputs that the config does not list (Triton's rule): checked, and left out of the client's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnxruntime as ort

from edge_server import dtypes
from edge_server.config.model import DynamicBatching, ModelConfig, TensorSpec
from edge_server.errors import ConfigError

# Triton's --backend-config=onnxruntime,default-max-batch-size default.
DEFAULT_MAX_BATCH_SIZE = 4

_Graph = tuple[str, str, list[int]]


def complete_from_graph(config: ModelConfig, model_path: Path) -> ModelConfig:
    """``config`` with what it leaves out filled from the ONNX graph, and what it says checked there."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ConfigError(f"{model_path}: not a loadable ONNX model: {exc}") from exc
    inputs = _graph_tensors(session.get_inputs())
    outputs = _graph_tensors(session.get_outputs())
    del session
    if config.sequence_batching is not None:
        inputs, outputs = _split_sequence_tensors(config, inputs, outputs)
    changes: dict[str, Any] = {}
    max_batch = config.max_batch_size
    if max_batch == 0 and not config.inputs and not config.outputs:
        # Triton's rule: batch when every input and output starts with a dynamic axis.
        if all(dims and dims[0] == -1 for _, _, dims in inputs + outputs):
            max_batch = DEFAULT_MAX_BATCH_SIZE
            changes["max_batch_size"] = max_batch
            if config.dynamic_batching is None and config.sequence_batching is None:
                changes["dynamic_batching"] = DynamicBatching()
    batched = max_batch > 0
    inputs, outputs = _split_ragged_tensors(config, inputs, outputs)
    changes["inputs"] = _check_or_fill(
        config.inputs, inputs, role="input", batched=batched, source=config.source
    )
    changes["outputs"] = _check_or_fill(
        config.outputs, outputs, role="output", batched=batched, source=config.source
    )
    if not config.platform:
        changes["platform"] = "onnxruntime_onnx"
    return config.replace(**changes)


def _graph_tensors(args: Sequence[Any]) -> list[tuple[str, str, list[int]]]:
    """(name, config type, dims with -1 for symbolic) of ONNX Runtime NodeArgs."""
    out = []
    for arg in args:
        dims = [d if isinstance(d, int) and d >= 0 else -1 for d in (arg.shape or [])]
        out.append((arg.name, dtypes.from_onnxruntime(arg.type), dims))
    return out


def _check_or_fill(
    configured: tuple[TensorSpec, ...],
    graph: list[tuple[str, str, list[int]]],
    *,
    role: str,
    batched: bool,
    source: str,
) -> tuple[TensorSpec, ...]:
    by_name = {name: (dtype, dims) for name, dtype, dims in graph}
    if not configured:
        return tuple(
            TensorSpec(name=name, data_type=dtype, dims=tuple(dims[1:] if batched else dims))
            for name, dtype, dims in graph
        )
    completed = []
    for spec in configured:
        if spec.name not in by_name:
            raise ConfigError(
                f"{source}: {role} {spec.name!r} is not in the ONNX model; the model's {role}s are "
                f"{sorted(by_name)}"
            )
        dtype, dims = by_name[spec.name]
        spec = _fill_from_graph(spec, dtype, dims, batched=batched)
        completed.append(spec)
        if spec.data_type != dtype:
            raise ConfigError(
                f"{source}: {role} {spec.name!r} has data_type {spec.data_type} "
                f"but the ONNX model has {dtype}"
            )
        model_dims = dims[1:] if batched and dims else dims
        want = list(spec.reshape if spec.reshape is not None else spec.dims)
        if batched and not dims:
            raise ConfigError(
                f"{source}: {role} {spec.name!r} is a scalar in the model but max_batch_size > 0"
            )
        if len(want) != len(model_dims) or any(
            m != -1 and w != -1 and m != w for w, m in zip(want, model_dims, strict=False)
        ):
            raise ConfigError(
                f"{source}: {role} {spec.name!r} has dims {want} but the ONNX model has "
                f"{model_dims} (excluding the batch axis)"
                if batched
                else f"{source}: {role} {spec.name!r} has dims {want} but the ONNX model has {model_dims}"
            )
        if batched and dims[0] not in (-1,):
            raise ConfigError(
                f"{source}: max_batch_size > 0 but the ONNX model's {role} {spec.name!r} has a fixed first "
                f"dimension {dims[0]}; export it with a dynamic batch axis or set max_batch_size: 0"
            )
    return tuple(completed)


def _fill_from_graph(spec: TensorSpec, dtype: str, dims: list[int], *, batched: bool) -> TensorSpec:
    """Fill a data_type or dims the config left out (TYPE_INVALID, no dims) from the graph."""
    changes: dict[str, Any] = {}
    if spec.data_type == "TYPE_INVALID":
        changes["data_type"] = dtype
    if not spec.dims and spec.reshape is None:
        changes["dims"] = tuple(dims[1:] if batched and dims else dims)
    return dataclasses.replace(spec, **changes) if changes else spec


def _split_ragged_tensors(
    config: ModelConfig, inputs: list[_Graph], outputs: list[_Graph]
) -> tuple[list[_Graph], list[_Graph]]:
    """The graph's tensors checked as a batch of stacked requests, after checking the ragged ones.

    A ragged input reaches the model as one 1-D tensor of every request's elements, a batch input as
    a tensor the server makes (``batch_input``, not listed in ``input``), and a batch output is any
    tensor whose elements go back to the requests by their inputs' shapes: as in Triton, their dims
    are not compared with the config's (their types are).
    """
    ragged = {t.name: t.data_type for t in config.inputs if t.allow_ragged_batch and config.max_batch_size}
    ragged.update((name, b.data_type) for b in config.batch_inputs for name in b.target_names)
    scattered = {name for o in config.batch_outputs for name in o.target_names}
    if not ragged and not scattered:
        return inputs, outputs
    graph_in = {name: (dtype, dims) for name, dtype, dims in inputs}
    for name, dtype in ragged.items():
        if name not in graph_in:
            raise ConfigError(
                f"{config.source}: batch input {name!r} is not an input of the ONNX model; its inputs are "
                f"{sorted(graph_in)}"
            )
        model_type, dims = graph_in[name]
        if dtype not in ("TYPE_INVALID", model_type) or len(dims) != 1:
            raise ConfigError(
                f"{config.source}: input {name!r} of a ragged batch reaches the model as a 1-D "
                f"{dtype} tensor, but the ONNX model has {model_type} {dims}"
            )
    batch_targets = {name for b in config.batch_inputs for name in b.target_names}
    kept_in = [t for t in inputs if t[0] not in batch_targets]  # the server's, not the client's
    for spec in config.outputs:
        found = next((t for t in outputs if t[0] == spec.name), None)
        if spec.name in scattered and found is not None and spec.data_type not in ("TYPE_INVALID", found[1]):
            raise ConfigError(
                f"{config.source}: output {spec.name!r} has data_type {spec.data_type} but the ONNX model "
                f"has {found[1]}"
            )
    # the config's own dims stand for ragged inputs and batch outputs: the graph's are not compared
    loose = set(ragged) | scattered
    return (
        [(n, d, _as_config(config, n) if n in loose else dims) for n, d, dims in kept_in],
        [(n, d, _as_config(config, n) if n in loose else dims) for n, d, dims in outputs],
    )


def _as_config(config: ModelConfig, name: str) -> list[int]:
    """Dims that agree with the config's dims of ``name`` (``[-1]`` where it gives none), batch axis first."""
    spec = config.input(name) or config.output(name)
    if spec is None or (not spec.dims and spec.reshape is None):
        own = [-1]
    else:
        own = list(spec.reshape if spec.reshape is not None else spec.dims)
    return [-1, *own] if config.max_batch_size > 0 else own


def _split_sequence_tensors(
    config: ModelConfig, inputs: list[_Graph], outputs: list[_Graph]
) -> tuple[list[_Graph], list[_Graph]]:
    """The graph's client inputs and outputs, after checking the ones sequence batching fills and keeps.

    Control and state inputs are model inputs that the config does not list (Triton's rule), so they
    are neither auto-completed as client inputs nor left for a client to send.
    """
    seq = config.sequence_batching
    assert seq is not None
    graph_in = {name: dtype for name, dtype, _ in inputs}
    graph_out = {name: dtype for name, dtype, _ in outputs}
    wanted = [(c.name, c.control.tensor_type, "control input") for c in seq.control_inputs]
    wanted += [(s.input_name, s.data_type, "state input") for s in seq.states]
    for name, dtype, role in wanted:
        if name not in graph_in:
            raise ConfigError(
                f"{config.source}: sequence_batching {role} {name!r} is not an input of the ONNX model; "
                f"its inputs are {sorted(graph_in)}"
            )
        if graph_in[name] != dtype:
            raise ConfigError(
                f"{config.source}: sequence_batching {role} {name!r} is {dtype} in the config but "
                f"{graph_in[name]} in the ONNX model"
            )
    for state in seq.states:
        if graph_out.get(state.output_name) != state.data_type:
            raise ConfigError(
                f"{config.source}: sequence_batching state output {state.output_name!r} must be a "
                f"{state.data_type} output of the ONNX model; its outputs are {sorted(graph_out)}"
            )
    server_in, kept_out = set(seq.server_inputs()), set(config.state_outputs())  # listed ones stay
    return [t for t in inputs if t[0] not in server_in], [t for t in outputs if t[0] not in kept_out]
