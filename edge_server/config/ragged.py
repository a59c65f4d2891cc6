"""Triton's ragged batching settings: ``batch_input`` and ``batch_output`` of a model config.

An input with ``allow_ragged_batch: true`` does not split batches by its shape; a model that stacks
its batch into tensors (ONNX Runtime, TensorRT) then gets it as one 1-D tensor of every request's
elements, and the tensors a ``batch_input`` names (made by the server once the batch is formed) tell
it where each request's elements are.  A ``batch_output`` gives an output back to each request in the
shape of one of its inputs.  The tensors are built by :mod:`edge_server.backends.ragged`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: what each batch_input kind holds, per request of the batch (element counts include the batch axis)
BATCH_INPUT_KINDS = (
    "BATCH_ELEMENT_COUNT",  # the source input's element count
    "BATCH_ACCUMULATED_ELEMENT_COUNT",  # the running sum: where each request's elements end
    "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO",  # the same, after a leading 0
    "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE",  # only a shape: [the largest element count]
    "BATCH_ITEM_SHAPE",  # per batch row, the source input's shape without the batch axis
    "BATCH_ITEM_SHAPE_FLATTEN",  # the same, as one 1-D tensor
)

#: the data types a batch input may have (Triton fills counts as INT32 or FP32; shapes also as INT64)
BATCH_INPUT_TYPES = ("TYPE_INT32", "TYPE_INT64", "TYPE_FP32")


@dataclass(frozen=True)
class BatchInput:
    kind: str
    target_names: tuple[str, ...]
    data_type: str
    source_inputs: tuple[str, ...]


@dataclass(frozen=True)
class BatchOutput:
    kind: str  # BATCH_SCATTER_WITH_INPUT_SHAPE
    target_names: tuple[str, ...]
    source_inputs: tuple[str, ...]


def convert_inputs(messages: Any, enum_name: Callable[[Any, str, str], str]) -> tuple[BatchInput, ...]:
    return tuple(
        BatchInput(
            kind=enum_name(m, "kind", f"batch_input[{i}].kind"),
            target_names=tuple(m.target_name),
            data_type=enum_name(m, "data_type", f"batch_input[{i}].data_type"),
            source_inputs=tuple(m.source_input),
        )
        for i, m in enumerate(messages)
    )


def convert_outputs(messages: Any, enum_name: Callable[[Any, str, str], str]) -> tuple[BatchOutput, ...]:
    return tuple(
        BatchOutput(
            kind=enum_name(m, "kind", f"batch_output[{i}].kind"),
            target_names=tuple(m.target_name),
            source_inputs=tuple(m.source_input),
        )
        for i, m in enumerate(messages)
    )


def problems(
    batch_inputs: tuple[BatchInput, ...],
    batch_outputs: tuple[BatchOutput, ...],
    *,
    max_batch_size: int,
    inputs: tuple[str, ...],
    outputs: tuple[str, ...],
) -> tuple[str, str] | None:
    """(field, problem) of the first rule these settings break, or None."""
    if (batch_inputs or batch_outputs) and max_batch_size == 0:
        field = "batch_input" if batch_inputs else "batch_output"
        return field, "needs a batching model (max_batch_size > 0)"
    targets: set[str] = set()
    for i, b in enumerate(batch_inputs):
        field = f"batch_input[{i}]"
        if len(b.source_inputs) != 1 or b.source_inputs[0] not in inputs:
            return f"{field}.source_input", f"must name one of the model's inputs {list(inputs)}"
        if not b.target_names:
            return f"{field}.target_name", "names no tensor"
        for name in b.target_names:
            if name in inputs or name in targets:
                return f"{field}.target_name", f"{name!r} is already an input of the model"
            targets.add(name)
        if b.data_type not in BATCH_INPUT_TYPES:
            return f"{field}.data_type", f"must be one of {', '.join(BATCH_INPUT_TYPES)}, got {b.data_type}"
    for i, o in enumerate(batch_outputs):
        field = f"batch_output[{i}]"
        if len(o.source_inputs) != 1 or o.source_inputs[0] not in inputs:
            return f"{field}.source_input", f"must name one of the model's inputs {list(inputs)}"
        for name in o.target_names:
            if name not in outputs:
                return f"{field}.target_name", f"{name!r} is not an output of the model {list(outputs)}"
    return None
