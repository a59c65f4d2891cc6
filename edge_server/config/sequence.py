"""Triton's ``sequence_batching`` as typed data: control inputs, implicit state and the two strategies.

A stateful model sees tensors the client never sends: control inputs (``CONTROL_SEQUENCE_START``,
``_END``, ``_READY``, ``_CORRID``) and the inputs of its implicit state.  The server fills them, so
they are model inputs that are *not* listed in the config's ``input``, exactly as in Triton; the
helpers here name them for the validator (a client that sends one is refused), the backends'
auto-complete (they are not offered as client inputs) and the sequence scheduler (which builds them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

START = "CONTROL_SEQUENCE_START"
END = "CONTROL_SEQUENCE_END"
READY = "CONTROL_SEQUENCE_READY"
CORRID = "CONTROL_SEQUENCE_CORRID"
CONTROL_KINDS = (START, END, READY, CORRID)
CORRID_TYPES = ("TYPE_UINT64", "TYPE_INT64", "TYPE_UINT32", "TYPE_INT32", "TYPE_STRING")
#: Triton's default for max_sequence_idle_microseconds (0 in the config): one second.
DEFAULT_IDLE_US = 1_000_000


@dataclass(frozen=True)
class Control:
    """One control of a control input: its kind and the (false, true) values it is given in."""

    kind: str
    int32_false_true: tuple[int, ...] = ()
    fp32_false_true: tuple[float, ...] = ()
    bool_false_true: tuple[bool, ...] = ()
    data_type: str = "TYPE_INVALID"  # CORRID only

    @property
    def tensor_type(self) -> str:
        """The config data type of the tensor the server builds for this control."""
        if self.kind == CORRID:
            return self.data_type
        if self.fp32_false_true:
            return "TYPE_FP32"
        if self.bool_false_true:
            return "TYPE_BOOL"
        return "TYPE_INT32"

    def value(self, flag: bool) -> int | float | bool:
        """The value that means ``flag`` (for START, END and READY)."""
        values: tuple[Any, ...] = self.int32_false_true or self.fp32_false_true or self.bool_false_true
        return values[1] if flag else values[0]


@dataclass(frozen=True)
class ControlInput:
    name: str
    control: Control


@dataclass(frozen=True)
class InitialState:
    data_type: str
    dims: tuple[int, ...]
    source: Literal["zero_data", "data_file"] = "zero_data"
    data_file: str = ""  # under <model>/initial_state/, as in Triton
    name: str = ""


@dataclass(frozen=True)
class SequenceState:
    """One implicit state: ``output_name`` of a step is fed back as ``input_name`` of the next."""

    input_name: str
    output_name: str
    data_type: str
    dims: tuple[int, ...]
    initial_state: InitialState | None = None


@dataclass(frozen=True)
class SequenceBatching:
    """``sequence_batching``; ``strategy`` is ``direct`` unless ``oldest`` was given (Triton's default).

    ``max_queue_delay_microseconds`` and ``preserve_ordering`` belong to the chosen strategy;
    ``minimum_slot_utilization`` only to ``direct``, the candidate and preferred sizes only to ``oldest``.
    """

    max_sequence_idle_microseconds: int = DEFAULT_IDLE_US
    control_inputs: tuple[ControlInput, ...] = ()
    states: tuple[SequenceState, ...] = ()
    strategy: Literal["direct", "oldest"] = "direct"
    max_queue_delay_microseconds: int = 0
    minimum_slot_utilization: float = 0.0
    max_candidate_sequences: int = 0  # 0: no limit
    preferred_batch_size: tuple[int, ...] = ()
    preserve_ordering: bool = False
    #: a Python model may release a request with RESCHEDULE to run it again (request rescheduling)
    iterative_sequence: bool = False

    def control(self, kind: str) -> ControlInput | None:
        return next((c for c in self.control_inputs if c.control.kind == kind), None)

    def server_inputs(self) -> tuple[str, ...]:
        """The model inputs the server fills: control inputs, then state inputs."""
        return tuple(c.name for c in self.control_inputs) + tuple(s.input_name for s in self.states)

    def state_outputs(self) -> tuple[str, ...]:
        return tuple(s.output_name for s in self.states)


# -- conversion from the parsed proto -----------------------------------------------------------

EnumName = Callable[[Any, str, str], str]


def convert(msg: Any, enum_name: EnumName) -> SequenceBatching:
    """The dataclass form of a parsed ``ModelSequenceBatching`` (values kept as written)."""
    path = "sequence_batching"
    controls = []
    for i, entry in enumerate(msg.control_input):
        where = f"{path}.control_input[{i}]"
        if len(entry.control) != 1:
            raise ConversionError(
                where, f"control input {entry.name!r} must have exactly one control, got {len(entry.control)}"
            )
        c = entry.control[0]
        controls.append(
            ControlInput(
                name=entry.name,
                control=Control(
                    kind=enum_name(c, "kind", f"{where}.control[0].kind"),
                    int32_false_true=tuple(c.int32_false_true),
                    fp32_false_true=tuple(c.fp32_false_true),
                    bool_false_true=tuple(c.bool_false_true),
                    data_type=enum_name(c, "data_type", f"{where}.control[0].data_type"),
                ),
            )
        )
    states = []
    for i, s in enumerate(msg.state):
        where = f"{path}.state[{i}]"
        if len(s.initial_state) > 1:
            raise ConversionError(where, f"at most one initial_state, got {len(s.initial_state)}")
        initial = None
        for init in s.initial_state:
            choice = init.WhichOneof("state_data")
            if choice is None:
                raise ConversionError(f"{where}.initial_state", "set zero_data or data_file")
            initial = InitialState(
                data_type=enum_name(init, "data_type", f"{where}.initial_state.data_type"),
                dims=tuple(init.dims),
                source=choice,
                data_file=init.data_file,
                name=init.name,
            )
        states.append(
            SequenceState(
                input_name=s.input_name,
                output_name=s.output_name,
                data_type=enum_name(s, "data_type", f"{where}.data_type"),
                dims=tuple(s.dims),
                initial_state=initial,
            )
        )
    common: dict[str, Any] = {
        "max_sequence_idle_microseconds": msg.max_sequence_idle_microseconds or DEFAULT_IDLE_US,
        "control_inputs": tuple(controls),
        "states": tuple(states),
        "iterative_sequence": msg.iterative_sequence,
    }
    if msg.WhichOneof("strategy_choice") == "oldest":
        oldest = msg.oldest
        return SequenceBatching(
            **common,
            strategy="oldest",
            max_candidate_sequences=oldest.max_candidate_sequences,
            preferred_batch_size=tuple(oldest.preferred_batch_size),
            max_queue_delay_microseconds=oldest.max_queue_delay_microseconds,
            preserve_ordering=oldest.preserve_ordering,
        )
    direct = msg.direct
    return SequenceBatching(
        **common,
        strategy="direct",
        max_queue_delay_microseconds=direct.max_queue_delay_microseconds,
        minimum_slot_utilization=direct.minimum_slot_utilization,
    )


class ConversionError(Exception):
    """Raised by :func:`convert`; the caller turns it into a ConfigError naming the file."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(field, problem)
        self.field = field
        self.problem = problem


# -- validation ----------------------------------------------------------------------------------


def problems(
    seq: SequenceBatching, *, max_batch_size: int, inputs: tuple[str, ...], outputs: Mapping[str, str]
) -> tuple[str, str] | None:
    """The first ``(field, problem)`` of Triton's sequence batching rules ``seq`` breaks, or None.

    ``outputs`` maps the config's output names to their data types: a state output may be listed
    there too (as in Triton), so that a client can ask for it, in the state's own type.
    """
    path = "sequence_batching"
    seen_kinds: dict[str, str] = {}
    names: set[str] = set()
    for i, entry in enumerate(seq.control_inputs):
        where = f"{path}.control_input[{i}]"
        c = entry.control
        if not entry.name:
            return where + ".name", "every control input needs a name"
        if entry.name in names:
            return where + ".name", f"duplicate control input {entry.name!r}"
        names.add(entry.name)
        if entry.name in inputs:
            return where + ".name", (
                f"{entry.name!r} is also listed in 'input'; control inputs are filled by the server and "
                "must not be listed there"
            )
        if c.kind in seen_kinds:
            return where, f"{c.kind} is already given by control input {seen_kinds[c.kind]!r}"
        seen_kinds[c.kind] = entry.name
        lists = [v for v in (c.int32_false_true, c.fp32_false_true, c.bool_false_true) if v]
        if c.kind == CORRID:
            if lists:
                return where, "CONTROL_SEQUENCE_CORRID takes a data_type, not *_false_true values"
            if c.data_type not in CORRID_TYPES:
                return where + ".control[0].data_type", (
                    f"CONTROL_SEQUENCE_CORRID needs data_type one of {', '.join(CORRID_TYPES)}, "
                    f"got {c.data_type}"
                )
        else:
            if len(lists) != 1 or len(lists[0]) != 2:
                return where, (
                    f"{c.kind} needs exactly one of int32_false_true, fp32_false_true or bool_false_true, "
                    "with two values (false, true)"
                )
            if c.data_type != "TYPE_INVALID":
                return where + ".control[0].data_type", f"{c.kind} takes no data_type (only CORRID does)"
    for i, state in enumerate(seq.states):
        where = f"{path}.state[{i}]"
        if not state.input_name or not state.output_name:
            return where, "a state needs input_name and output_name"
        if state.input_name in names or state.input_name in inputs:
            return where + ".input_name", (
                f"{state.input_name!r} is already an input or a control input; the server fills a state "
                "input itself"
            )
        names.add(state.input_name)
        if state.data_type == "TYPE_INVALID":
            return where + ".data_type", "a state needs a data_type"
        if outputs.get(state.output_name, state.data_type) != state.data_type:
            return where + ".output_name", (
                f"{state.output_name!r} is listed in 'output' as {outputs[state.output_name]}, "
                f"but the state is {state.data_type}"
            )
        if not state.dims or any(d < 1 and d != -1 for d in state.dims):
            return where + ".dims", f"must be >= 1 (or -1), got {list(state.dims)}"
        init = state.initial_state
        if init is None:  # zeros, each -1 taken as 1 (Triton's rule for a state's first request)
            continue
        if init.data_type != state.data_type:
            return where + ".initial_state.data_type", (
                f"{init.data_type} differs from the state's {state.data_type}"
            )
        if not init.dims or any(d < 1 for d in init.dims) or len(init.dims) != len(state.dims):
            return (
                where + ".initial_state.dims",
                f"must be concrete and match the state's rank, got {list(init.dims)}",
            )
        if any(s not in (-1, d) for s, d in zip(state.dims, init.dims, strict=True)):
            return (
                where + ".initial_state.dims",
                f"{list(init.dims)} do not fit the state dims {list(state.dims)}",
            )
        if init.source == "data_file" and state.data_type == "TYPE_STRING":
            return where + ".initial_state", "a TYPE_STRING state starts from zero_data (empty strings)"
        if init.source == "data_file" and (
            not init.data_file or "/" in init.data_file or init.data_file.startswith(".")
        ):
            return where + ".initial_state.data_file", (
                "must name a file directly inside the model's initial_state/ directory"
            )
    for size in seq.preferred_batch_size:
        if not 1 <= size <= max(max_batch_size, 1):
            return f"{path}.oldest.preferred_batch_size", (
                f"each size must be in [1, max_batch_size={max_batch_size}], "
                f"got {list(seq.preferred_batch_size)}"
            )
    if seq.max_candidate_sequences < 0:
        return f"{path}.oldest.max_candidate_sequences", f"must be >= 0, got {seq.max_candidate_sequences}"
    if not 0.0 <= seq.minimum_slot_utilization <= 1.0:
        return f"{path}.direct.minimum_slot_utilization", (
            f"must be in [0, 1], got {seq.minimum_slot_utilization}"
        )
    return None
