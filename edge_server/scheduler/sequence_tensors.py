"""The tensors a stateful model gets from the server: sequence control inputs and implicit state.

Built once per loaded version from ``sequence_batching``; the sequence scheduler asks it for each row
of a batch.  Nothing here depends on a backend: a row is an ordinary :class:`BatchItem` whose inputs
hold the client's tensors plus the control and state tensors, and whose requested outputs include the
state outputs, so ONNX Runtime, TensorRT and Python models receive them like any other tensor.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from edge_server import dtypes
from edge_server.config.model import ModelConfig
from edge_server.config.sequence import CORRID, END, READY, START, SequenceState
from edge_server.errors import ConfigError
from edge_server.paths import inside
from edge_server.request import BatchItem

State = dict[str, np.ndarray]  # state input name -> its value, with the batch axis when batched


def _zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Zeros, or empty strings for TYPE_STRING (Triton's zeroed string state)."""
    return np.full(shape, b"", dtype=object) if dtype.kind == "O" else np.zeros(shape, dtype)


def _initial_value(state: SequenceState, model_dir: Path, source: str) -> np.ndarray:
    dtype = dtypes.to_numpy(state.data_type)
    init = state.initial_state
    if init is None:  # a variable dim starts as 1, as in Triton
        return _zeros(tuple(1 if d == -1 else d for d in state.dims), dtype)
    if init.source == "zero_data":
        return _zeros(tuple(init.dims), dtype)
    path = inside(
        model_dir / "initial_state", init.data_file, f"initial_state of {state.input_name!r} data_file"
    )
    expected = math.prod(init.dims) * dtype.itemsize
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"{source}: initial_state of {state.input_name!r}: cannot read {path}: {exc}"
        ) from None
    if len(data) != expected:
        raise ConfigError(
            f"{source}: initial_state of {state.input_name!r}: {path} holds {len(data)} bytes; dims "
            f"{list(init.dims)} of {state.data_type} need {expected}"
        )
    return np.frombuffer(data, dtype).reshape(init.dims).copy()


class SequenceTensors:
    """Makes the server-filled inputs of each batch row and takes the state back from its outputs."""

    def __init__(self, config: ModelConfig, model_dir: Path) -> None:
        seq = config.sequence_batching
        assert seq is not None
        self.batched = config.max_batch_size > 0
        shape = (1, 1) if self.batched else (1,)
        self._shape = shape
        # name, kind, (false tensor, true tensor) for START/END/READY; corrid: name and dtype.
        self._flags: list[tuple[str, str, np.ndarray, np.ndarray]] = []
        self._corrid: tuple[str, np.dtype] | None = None
        for entry in seq.control_inputs:
            control = entry.control
            if control.kind == CORRID:
                self._corrid = (entry.name, dtypes.to_numpy(control.data_type))
                continue
            dtype = dtypes.to_numpy(control.tensor_type)
            values = (np.full(shape, control.value(False), dtype), np.full(shape, control.value(True), dtype))
            self._flags.append((entry.name, control.kind, *values))
        self._initial = {
            s.input_name: _initial_value(s, model_dir, config.source)[None]
            if self.batched
            else _initial_value(s, model_dir, config.source)
            for s in seq.states
        }
        self._state_names = tuple((s.output_name, s.input_name) for s in seq.states)
        self.state_outputs = tuple(s.output_name for s in seq.states)
        self.has_state = bool(self._state_names)
        #: a state with a -1 dim may change shape from step to step (a growing cache): only sequences
        #: whose states have the same shapes can share a batch
        self.variable_state = any(-1 in s.dims for s in seq.states)

    def initial_state(self) -> State:
        """A sequence's state at its start (zeros or ``initial_state``); arrays are never written."""
        return dict(self._initial)

    def row(self, item: BatchItem, *, ready: bool, state: State | None) -> BatchItem:
        """``item`` with its control and state inputs added (READY=0 rows are fillers of a batch slot)."""
        inputs = dict(item.inputs)
        start = ready and bool(item.flags & 1)
        end = ready and bool(item.flags & 2)
        flag = {START: start, END: end, READY: ready}
        for name, kind, false, true in self._flags:
            inputs[name] = true if flag[kind] else false
        if self._corrid is not None:
            name, dtype = self._corrid
            corrid = item.correlation_id if ready else 0
            if dtype.kind == "O":
                value = corrid.encode() if isinstance(corrid, str) else str(corrid).encode()
                inputs[name] = np.full(self._shape, value, dtype=object)
            else:
                inputs[name] = np.full(self._shape, corrid if isinstance(corrid, int) else 0, dtype)
        if self.has_state:
            inputs.update(state if state is not None else self._initial)
        return BatchItem(
            inputs,
            1,
            (*item.requested_outputs, *(n for n in self.state_outputs if n not in item.requested_outputs))
            if ready
            else (),
            item.request_id,
            item.parameters,
            item.correlation_id if ready else 0,
            item.flags if ready else 0,
            item.timeout_us,
            stream=item.stream if ready else None,  # a decoupled (iterative) model sends through it
        )

    def filler(self, like: BatchItem, state: State | None) -> BatchItem:
        """A READY=0 row for an empty (or not ready) slot: zeros shaped like ``like``'s inputs."""
        zeros = BatchItem(
            {
                k: np.full_like(v, b"") if v.dtype.kind == "O" else np.zeros_like(v)
                for k, v in like.inputs.items()
            },
            1,
            (),
        )
        return self.row(zeros, ready=False, state=state)

    def stackable(self, state: State | None, like: State | None) -> State | None:
        """``state`` for a filler row, or zeros shaped like ``like`` when the two cannot be stacked."""
        if not self.variable_state or like is None:
            return state
        if state is not None and all(state[name].shape == value.shape for name, value in like.items()):
            return state
        return {name: _zeros(value.shape, value.dtype) for name, value in like.items()}

    def take_state(self, outputs: dict[str, np.ndarray], requested: tuple[str, ...]) -> State:
        """Take the state outputs out of a row's outputs; return them keyed by their state input.

        Those the client ``requested`` (a state the config also lists in ``output``) stay in the row.
        """
        state: State = {}
        for output_name, input_name in self._state_names:
            value = outputs.get(output_name) if output_name in requested else outputs.pop(output_name, None)
            if value is not None:
                state[input_name] = np.array(value, copy=True)  # not a view into the whole batch
        return state
