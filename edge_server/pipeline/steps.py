"""One ensemble step as the request it sends to its member."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from edge_server.pipeline.graph import Step
from edge_server.request import (
    REQUEST_FLAG_SEQUENCE_END,
    REQUEST_FLAG_SEQUENCE_START,
    BatchItem,
    InferRequest,
)


def step_request(
    step: Step, item: BatchItem, tensors: Mapping[str, np.ndarray], priority: int, timeout_us: int | None
) -> InferRequest:
    """The member's request: its inputs from the walk's tensors, the rest from the ensemble's request.

    An optional input whose tensor was left out of the ensemble's request is left out here too.
    """
    return InferRequest(
        model=step.model_name,
        version=step.model_version,
        inputs={name: tensors[t] for name, t in step.input_map.items() if t in tensors},
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
