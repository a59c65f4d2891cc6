"""Ragged batching for backends that run one stacked batch (ONNX Runtime, TensorRT), as Triton's do.

An input with ``allow_ragged_batch`` reaches the model as one 1-D tensor of every request's elements,
one request after the other, whatever the batch holds (one request too: the model has one input
shape); each ``batch_input`` adds a tensor, made from the formed batch, that tells the model where
each request's elements are (see :mod:`edge_server.config.ragged`).  A ``batch_output`` is handed
back by :func:`edge_server.backends.base.scatter`, each request taking as many elements as its source
input has, in that input's shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from edge_server import dtypes
from edge_server.config.model import ModelConfig
from edge_server.config.ragged import BatchInput
from edge_server.request import BatchItem


class RaggedPlan:
    """How one model's batches are gathered when it has ragged inputs, batch inputs or batch outputs."""

    __slots__ = ("ragged", "batch_inputs", "by_shape")

    def __init__(
        self, ragged: frozenset[str], batch_inputs: tuple[BatchInput, ...], by_shape: Mapping[str, str]
    ) -> None:
        self.ragged = ragged
        self.batch_inputs = batch_inputs
        #: output -> the input whose shape each request's part of it takes (batch_output)
        self.by_shape = by_shape

    @classmethod
    def of(cls, config: ModelConfig) -> RaggedPlan | None:
        """The plan of ``config``; None when it does not batch or uses none of ragged batching's settings."""
        if config.max_batch_size == 0:  # nothing to batch: allow_ragged_batch means nothing
            return None
        ragged = frozenset(t.name for t in config.inputs if t.allow_ragged_batch)
        if not ragged and not config.batch_inputs and not config.batch_outputs:
            return None
        by_shape = {name: o.source_inputs[0] for o in config.batch_outputs for name in o.target_names}
        return cls(ragged, config.batch_inputs, by_shape)

    def gather(self, batch: Sequence[BatchItem]) -> dict[str, np.ndarray]:
        """The model's inputs for ``batch``: stacked, ragged ones flattened, and the batch inputs."""
        inputs: dict[str, np.ndarray] = {}
        for name in batch[0].inputs:
            arrays = [item.inputs[name] for item in batch]
            if name in self.ragged:
                arrays = [array.reshape(-1) for array in arrays]
            inputs[name] = arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)
        for spec in self.batch_inputs:
            source = spec.source_inputs[0]
            value = batch_input(spec, [item.inputs[source] for item in batch if source in item.inputs])
            for target in spec.target_names:
                inputs[target] = value
        return inputs


def batch_input(spec: BatchInput, sources: Sequence[np.ndarray]) -> np.ndarray:
    """One ``batch_input`` tensor from the source input of each request (with its batch axis)."""
    dtype = dtypes.to_numpy(spec.data_type)
    counts = [array.size for array in sources]
    kind = spec.kind
    if kind == "BATCH_ELEMENT_COUNT":
        return np.array(counts, dtype=dtype)
    if kind == "BATCH_ACCUMULATED_ELEMENT_COUNT":
        return np.cumsum(counts, dtype=np.int64).astype(dtype)
    if kind == "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO":
        return np.cumsum([0, *counts], dtype=np.int64).astype(dtype)
    if kind == "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE":  # only its shape means anything
        return np.zeros(max(counts, default=0), dtype=dtype)
    rank = sources[0].ndim - 1 if sources else 0
    rows = [array.shape[1:] for array in sources for _ in range(array.shape[0])]
    shapes = np.array(rows, dtype=dtype).reshape(len(rows), rank)
    return shapes.reshape(-1) if kind == "BATCH_ITEM_SHAPE_FLATTEN" else shapes
