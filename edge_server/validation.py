"""Checking a request against its model's config before it may join a batch.

A :class:`RequestValidator` is built once per loaded model version, when the config is final, so the
per-request check only compares against prepared dtypes, dims and names: every frontend pays for it on
every request, and a bad request must fail alone, before it reaches a batch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from edge_server import dtypes
from edge_server.config.model import ModelConfig, TensorSpec
from edge_server.errors import InvalidArgument, shorten
from edge_server.request import (
    REQUEST_FLAG_SEQUENCE_END,
    REQUEST_FLAG_SEQUENCE_START,
    BatchItem,
    InferRequest,
    Parameters,
)

#: Bounds on request parameters, the same for every frontend.
MAX_PARAMETERS = 64
#: The owner of the sequences the server opens for iterative-sequence requests without a correlation
#: id: no client's (a uid >= 0, or None in-process), so their keys never meet a client's sequence.
ITERATIVE_OWNER = -1
#: Their correlation ids: one counter per process, so that no two such sequences share an id across
#: versions and reloads (next() is atomic).
_iterative_ids = itertools.count(1)
MAX_PARAMETER_KEY = 256
MAX_PARAMETER_STR = 64 * 1024


@dataclass(frozen=True)
class _InputRule:
    name: str
    data_type: str  # config name, for messages
    dtype: np.dtype  # object for TYPE_STRING
    dims: tuple[int, ...]  # without the batch axis
    variable: bool  # some dim is -1
    reshape: tuple[int, ...] | None
    optional: bool
    where: str
    ragged: bool  # allow_ragged_batch: its shape does not split batches

    def expected_shape(self, batched: bool) -> str:
        dims = ["-1" if d < 0 else str(d) for d in self.dims]
        return "[" + ", ".join((["batch"] if batched else []) + dims) + "]"


def _rule(model: str, spec: TensorSpec, *, batched: bool) -> _InputRule:
    return _InputRule(
        name=spec.name,
        data_type=spec.data_type,
        dtype=dtypes.to_numpy(spec.data_type),
        dims=spec.dims,
        variable=any(d < 0 for d in spec.dims),
        reshape=spec.reshape,
        optional=spec.optional,
        where=f"model {shorten(model)} input {spec.name!r}",
        ragged=spec.allow_ragged_batch and batched,
    )


def check_parameters(parameters: object) -> Parameters:
    """``parameters`` if it is a small map of str to bool, int, float or str (Triton's parameter types)."""
    if not isinstance(parameters, Mapping):
        raise InvalidArgument(f"parameters must be a map of name to value, got {type(parameters).__name__}")
    if len(parameters) > MAX_PARAMETERS:
        raise InvalidArgument(
            f"a request may carry at most {MAX_PARAMETERS} parameters, got {len(parameters)}"
        )
    for key, value in parameters.items():
        if not isinstance(key, str) or not 0 < len(key) <= MAX_PARAMETER_KEY:
            raise InvalidArgument(f"parameter names must be strings of 1..{MAX_PARAMETER_KEY} characters")
        if isinstance(value, str):
            if len(value) > MAX_PARAMETER_STR:
                raise InvalidArgument(f"parameter {key!r} is longer than {MAX_PARAMETER_STR} characters")
        elif isinstance(value, int):  # bool is an int
            if not -(2**63) <= value < 2**64:
                raise InvalidArgument(f"parameter {key!r} is outside the 64-bit integer range")
        elif isinstance(value, float):  # Triton's double_param (JSON numbers with a fraction)
            if not math.isfinite(value):
                raise InvalidArgument(f"parameter {key!r} must be a finite number, got {value!r}")
        else:
            raise InvalidArgument(
                f"parameter {key!r} must be a bool, a number or a string, got {type(value).__name__}"
            )
    return parameters


class RequestValidator:
    """Checks inputs and requested outputs against one config; returns the batch item and its shape key.

    The shape key groups requests whose tensors may be stacked into one batch.  A model whose inputs
    are all fixed-size (or ragged) and required has one key for every request: an input with
    ``allow_ragged_batch`` leaves its shape out of the key, as Triton's batcher does.
    """

    def __init__(self, config: ModelConfig) -> None:
        self.model = config.name
        self._rules = tuple(
            _rule(config.name, spec, batched=config.max_batch_size > 0) for spec in config.inputs
        )
        self._by_name = {rule.name: rule for rule in self._rules}
        self._names = frozenset(self._by_name)
        self._required = tuple(rule.name for rule in self._rules if not rule.optional)
        self._batched = config.max_batch_size > 0
        self._max_batch_size = config.max_batch_size
        self._outputs = tuple(spec.name for spec in config.outputs)
        self._server_inputs = frozenset(config.server_inputs())
        self._state_outputs = frozenset(config.state_outputs())
        seq = config.sequence_batching
        self._sequence = seq is not None
        corrid = seq.control("CONTROL_SEQUENCE_CORRID") if seq else None
        self._corrid_type = corrid.control.data_type if corrid else ""
        self._iterative = bool(seq and seq.iterative_sequence)
        self._fixed_key: Hashable | None = None
        if not any((rule.variable and not rule.ragged) or rule.optional for rule in self._rules):
            self._fixed_key = tuple((rule.name, rule.dims) for rule in self._rules)

    def __call__(self, request: InferRequest) -> tuple[BatchItem, Hashable]:
        inputs = request.inputs
        if type(inputs) is not dict and not isinstance(inputs, Mapping):
            raise InvalidArgument(f"inputs must be a mapping of name to array, got {type(inputs).__name__}")
        if inputs.keys() != self._names:  # not simply every input: look for unknown and missing ones
            self._check_names(inputs)
        batched = self._batched
        batch_size = 0
        prepared: dict[str, np.ndarray] = {}
        shapes: list[tuple[str, tuple[int, ...]]] | None = [] if self._fixed_key is None else None
        for rule in self._rules:
            if rule.name not in inputs:
                continue
            array = self._check(rule, inputs[rule.name])
            if shapes is not None:
                shapes.append((rule.name, () if rule.ragged else array.shape[1:] if batched else array.shape))
            if batched:
                rows = array.shape[0]
                if batch_size and rows != batch_size:
                    raise InvalidArgument(
                        f"model {self.model!r}: inputs disagree on the batch size ({batch_size} and {rows})"
                    )
                batch_size = rows
            if rule.reshape is not None:
                array = array.reshape((array.shape[0], *rule.reshape) if batched else rule.reshape)
            prepared[rule.name] = array
        key = self._fixed_key if shapes is None else tuple(shapes)
        requested = request.outputs
        item = BatchItem(
            prepared,
            batch_size or 1,
            self._requested_outputs(requested) if requested else self._outputs,
            request.request_id,
        )
        item.client = request.client
        if request.parameters:
            item.parameters = check_parameters(request.parameters)
        if request.correlation_id or request.sequence_start or request.sequence_end:
            item.correlation_id = request.correlation_id
            item.owner = request.owner
            item.flags = (REQUEST_FLAG_SEQUENCE_START if request.sequence_start else 0) | (
                REQUEST_FLAG_SEQUENCE_END if request.sequence_end else 0
            )
        if self._sequence:
            self._check_sequence(request, item)
        if request.timeout_us:
            item.timeout_us = request.timeout_us
        return item, key

    def _check_sequence(self, request: InferRequest, item: BatchItem) -> None:
        """A stateful model's request: a correlation id of the right kind, one row per request."""
        corrid = request.correlation_id
        if not corrid and self._iterative and not item.flags:
            # Triton's iterative sequencer: the request is a sequence of its own, started and ended by it
            number = next(_iterative_ids)
            corrid = str(number) if self._corrid_type == "TYPE_STRING" else number
            item.correlation_id, item.owner = corrid, ITERATIVE_OWNER
            item.flags = REQUEST_FLAG_SEQUENCE_START | REQUEST_FLAG_SEQUENCE_END
        if not corrid:
            raise InvalidArgument(  # Triton's text first: its clients match it (L0_sequence_batcher)
                f"inference request to model {self.model!r} must specify a non-zero or non-empty "
                "correlation ID (it is a sequence model: every request needs a sequence_id, and the "
                "first request of a sequence sequence_start)"
            )
        if type(corrid) is bool or not isinstance(corrid, int | str):
            raise InvalidArgument(f"the correlation id must be an integer or a string, got {corrid!r}")
        if isinstance(corrid, int) and not 0 < corrid < 2**64:
            raise InvalidArgument(f"an integer correlation id must be in 1..2**64-1, got {corrid}")
        if isinstance(corrid, str) and len(corrid) > MAX_PARAMETER_KEY:
            raise InvalidArgument(f"a string correlation id may have at most {MAX_PARAMETER_KEY} characters")
        if self._corrid_type == "TYPE_STRING" and not isinstance(corrid, str):
            raise InvalidArgument(f"model {self.model!r} takes string correlation ids, got {corrid!r}")
        if self._corrid_type and self._corrid_type != "TYPE_STRING" and not isinstance(corrid, int):
            raise InvalidArgument(f"model {self.model!r} takes integer correlation ids, got {corrid!r}")
        if self._batched and item.batch_size != 1:
            raise InvalidArgument(
                f"inference request to model {self.model!r} must specify batch-size 1 due to "
                f"requirements of sequence batcher (a request of a sequence carries one row, got "
                f"{item.batch_size})"
            )

    def _check_names(self, inputs: Mapping[str, object]) -> None:
        by_name = self._by_name
        for name in self._server_inputs:  # before the count: the precise reason for a count one too many
            if name in inputs:
                raise InvalidArgument(
                    f"model {self.model!r}: input {shorten(name)} is a sequence control or state input, "
                    "which the "
                    "server fills; do not send it (use sequence_id, sequence_start and sequence_end)"
                )
        if not len(self._required) <= len(inputs) <= len(by_name):
            raise InvalidArgument(self._count_text(inputs))
        for name in inputs:
            if name not in by_name:
                raise InvalidArgument(
                    f"unexpected inference input {shorten(name)} for model {self.model!r} "
                    f"(its inputs are {sorted(by_name)})"
                )
        if any(name not in inputs for name in self._required):
            raise InvalidArgument(self._count_text(inputs))

    def _count_text(self, inputs: Mapping[str, object]) -> str:
        """Triton's text for a request without all required inputs (or with too many): its QA matches it."""
        total, required = len(self._by_name), len(self._required)
        expected = (
            f"{total} inputs" if total == required else f"number of inputs between {required} and {total}"
        )
        got = ",".join(shorten(name) for name in list(inputs)[:16])
        missing = ",".join(repr(name) for name in self._required if name not in inputs)
        return (
            f"expected {expected} but got {len(inputs)} inputs for model {self.model!r}. Got input(s) "
            f"[{got}], but missing required input(s) [{missing}]. Please provide all required input(s)."
        )

    def _check(self, rule: _InputRule, array: object) -> np.ndarray:
        """``array`` as a C-contiguous ndarray of the rule's dtype and shape, or InvalidArgument."""
        if not isinstance(array, np.ndarray):
            raise InvalidArgument(f"{rule.where}: expected a numpy array, got {type(array).__name__}")
        if array.dtype != rule.dtype:
            if rule.dtype.kind != "O":
                raise InvalidArgument(
                    f"{rule.where}: expected {rule.data_type} ({rule.dtype}), got {array.dtype}"
                )
            if array.dtype.kind not in "OSU":
                raise InvalidArgument(f"{rule.where}: expected {rule.data_type} (bytes), got {array.dtype}")
        if rule.dtype.kind == "O":  # TYPE_STRING reaches every backend as an object array of bytes
            array = dtypes.as_bytes_array(array, where=rule.where)
        shape = array.shape
        if self._batched:
            ok = len(shape) >= 1 and self._dims_match(rule, shape[1:])
            if ok and not 1 <= shape[0] <= self._max_batch_size:
                raise InvalidArgument(
                    f"{rule.where}: batch size {shape[0]} is outside 1..{self._max_batch_size} "
                    "(max_batch_size)"
                )
        else:
            ok = self._dims_match(rule, shape)
        if not ok:
            raise InvalidArgument(
                f"{rule.where}: expected shape {rule.expected_shape(self._batched)}, got {list(shape)}"
            )
        return array if array.flags.c_contiguous else np.ascontiguousarray(array)

    @staticmethod
    def _dims_match(rule: _InputRule, dims: tuple[int, ...]) -> bool:
        if not rule.variable:
            return dims == rule.dims
        if len(dims) != len(rule.dims):
            return False
        for want, got in zip(rule.dims, dims):  # noqa: B905 (lengths checked)
            if want >= 0 and got != want:
                return False
        return True

    def _requested_outputs(self, requested: Sequence[str]) -> tuple[str, ...]:
        """The outputs asked for, in the order asked (none asked: every output, as KServe v2).

        An unknown output and one asked for twice are refused with Triton's texts (ours after them).
        """
        names = self._outputs
        for name in requested:
            if name not in names:
                why = (
                    "an implicit state the server keeps" if name in self._state_outputs else "no such output"
                )
                raise InvalidArgument(
                    f"unexpected inference output {shorten(name)} for model {self.model!r} ({why}; its "
                    f"outputs are {list(names)})"
                )
        once = tuple(dict.fromkeys(requested))
        if len(once) != len(requested):
            twice = next(name for index, name in enumerate(requested) if name in requested[:index])
            raise InvalidArgument(f"output '{twice}' already exists in request")
        return once
