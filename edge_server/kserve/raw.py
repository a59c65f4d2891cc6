"""Triton's raw binary inference request: ``Inference-Header-Content-Length: 0``, the body is one tensor.

No JSON at all: the whole body is the data of the model's only input, whose name, datatype and shape
come from the model's config (as Triton deduces them): the shape is the config's ``dims``, with a
batch dimension of 1 in front for a batching model, and the one variable dimension (``-1``), if any,
taken from the body's size.  A ``TYPE_STRING`` input must have ``dims: [1]``: the body is its one
element.  Every output comes back, in the binary tensor format.  The error texts are Triton's, which
its clients and QA match.
"""

from __future__ import annotations

import math

import numpy as np

from edge_server import dtypes
from edge_server.config.model import ModelConfig
from edge_server.errors import InvalidArgument
from edge_server.kserve import codec


def raw_input(config: ModelConfig, body: bytes | memoryview, model: str) -> tuple[str, np.ndarray]:
    """The model's only input, deduced from ``config``, with ``body`` as its data."""
    if len(config.inputs) != 1:
        raise InvalidArgument(
            f"Raw request must only have 1 input (found 1) to be deduced but got {len(config.inputs)} "
            f"inputs in '{model}' model configuration"
        )
    spec = config.inputs[0]
    shape = [1] if config.max_batch_size > 0 else []
    variable = [i for i, dim in enumerate(spec.dims) if dim == -1]
    fixed = math.prod(dim for dim in spec.dims if dim != -1)
    if len(variable) > 1:
        raise InvalidArgument(
            f"The shape of the raw input '{spec.name}' can not be deduced because there are more than one "
            "variable-sized dimension"
        )
    shape += list(spec.dims)
    datatype = dtypes.to_wire(spec.data_type)
    if datatype == "BYTES":
        if variable or fixed != 1:
            raise InvalidArgument(
                f"For BYTE datatype raw input '{spec.name}', the model must have input shape [1]"
            )
        item = np.empty(1, dtype=np.object_)
        item[0] = bytes(body)
        return spec.name, item.reshape(shape)
    if variable:
        itemsize = codec.wire_itemsize(datatype)
        shape[len(shape) - len(spec.dims) + variable[0]] = len(body) // max(1, fixed * itemsize)
    return spec.name, codec.from_raw(body, datatype, tuple(shape), spec.name)
