"""One ensemble step as the request it sends to its member, and the ensemble's answer from its tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from edge_server.errors import ModelExecutionError
from edge_server.pipeline.graph import Consumer, EnsembleGraph, Step, shapes_agree
from edge_server.request import (
    REQUEST_FLAG_SEQUENCE_END,
    REQUEST_FLAG_SEQUENCE_START,
    BatchItem,
    InferRequest,
)


def fit_batch_axis(array: np.ndarray, batched: bool, consumer: Consumer) -> np.ndarray:
    """``array`` as ``consumer`` takes it, where one side batches and the other does not (Triton's rule).

    A batching consumer given an unbatched tensor whose shape is its dims gets a batch of one; any other
    unbatched tensor is taken to hold its batch already.  A non-batching consumer given a batch of one
    whose shape is not its dims gets the one item.  Both are views: nothing is copied.
    """
    if batched == consumer.batches:
        return array
    agrees = shapes_agree(consumer.dims, array.shape)
    if consumer.batches:
        return array[np.newaxis] if agrees else array
    return array[0] if not agrees and array.shape[:1] == (1,) else array


def step_request(
    graph: EnsembleGraph,
    step: Step,
    item: BatchItem,
    tensors: Mapping[str, np.ndarray],
    priority: int,
    timeout_us: int | None,
) -> InferRequest:
    """The member's request: its inputs from the walk's tensors, the rest from the ensemble's request.

    An optional input whose tensor was left out of the ensemble's request is left out here too.
    """
    batched, takes = graph.batched, graph.takes
    inputs = {
        name: fit_batch_axis(tensors[tensor], batched[tensor], takes[(step.index, name)])
        for name, tensor in step.input_map.items()
        if tensor in tensors
    }
    return InferRequest(
        model=step.model_name,
        version=step.model_version,
        inputs=inputs,
        outputs=list(step.output_map),
        priority=priority,
        timeout_us=timeout_us,
        request_id=item.request_id,
        parameters=item.parameters,
        correlation_id=item.correlation_id,
        sequence_start=bool(item.flags & REQUEST_FLAG_SEQUENCE_START),
        sequence_end=bool(item.flags & REQUEST_FLAG_SEQUENCE_END),
        client=item.client,  # a step waits its turn as its client's, not as everyone's
    )


def ensemble_outputs(
    graph: EnsembleGraph, tensors: Mapping[str, np.ndarray], wanted: Sequence[str]
) -> dict[str, np.ndarray]:
    """The requested ensemble outputs, fitted to the ensemble's batching and given its config dims.

    Raises ModelExecutionError when a member's output cannot take the ensemble output's dims.
    """
    answer = {
        name: fit_batch_axis(tensors[name], graph.batched[name], graph.answers[name]) for name in wanted
    }
    for name, dims in graph.restore.items():  # undo the output's reshape, as a model's scheduler does
        if name in answer:
            array = answer[name]
            try:
                answer[name] = array.reshape((array.shape[0], *dims) if graph.answers[name].batches else dims)
            except (ValueError, IndexError):
                raise ModelExecutionError(
                    f"ensemble output {name!r} has shape {list(array.shape)}, which cannot be reshaped to "
                    f"its config dims {list(dims)}"
                ) from None
    return answer
