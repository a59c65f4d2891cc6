"""``sequence_batching`` parsed into typed data and validated at load, with Triton's rules."""

from __future__ import annotations

import pytest

from edge_server.config import parse_config_text
from edge_server.errors import ConfigError

BASE = """
max_batch_size: 4
backend: "onnxruntime"
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching { %s }
"""


def parse(body: str):
    config, warnings = parse_config_text(BASE % body, source="config.pbtxt", default_name="m")
    assert config.sequence_batching is not None
    return config.sequence_batching, warnings


def control(name: str, kind: str, values: str = "int32_false_true: [ 0, 1 ]") -> str:
    return f'control_input [ {{ name: "{name}" control [ {{ kind: {kind} {values} }} ] }} ]'


def test_defaults_are_tritons() -> None:
    seq, warnings = parse("")
    assert warnings == []
    assert seq.strategy == "direct"
    assert seq.max_sequence_idle_microseconds == 1_000_000
    assert seq.control_inputs == () and seq.states == ()


def test_every_field_is_typed() -> None:
    seq, _ = parse(
        "max_sequence_idle_microseconds: 250 "
        "oldest { max_candidate_sequences: 3 preferred_batch_size: [ 2, 4 ] "
        "max_queue_delay_microseconds: 100 preserve_ordering: true } "
        + control("S", "CONTROL_SEQUENCE_START", "fp32_false_true: [ 0, 1 ]")
        + control("E", "CONTROL_SEQUENCE_END", "bool_false_true: [ false, true ]")
        + control("C", "CONTROL_SEQUENCE_CORRID", "data_type: TYPE_STRING")
        + ' state [ { input_name: "si" output_name: "so" data_type: TYPE_FP16 dims: [ 2, 3 ] '
        'initial_state { data_type: TYPE_FP16 dims: [ 2, 3 ] data_file: "init.bin" name: "i" } } ]'
    )
    assert (seq.strategy, seq.max_candidate_sequences, seq.preferred_batch_size) == ("oldest", 3, (2, 4))
    assert (seq.max_queue_delay_microseconds, seq.preserve_ordering) == (100, True)
    assert seq.max_sequence_idle_microseconds == 250
    start, end, corrid = (c.control for c in seq.control_inputs)
    assert (start.tensor_type, start.value(True)) == ("TYPE_FP32", 1.0)
    assert (end.tensor_type, end.value(False)) == ("TYPE_BOOL", False)
    assert corrid.tensor_type == "TYPE_STRING"
    (state,) = seq.states
    assert state.dims == (2, 3) and state.initial_state is not None
    assert state.initial_state.source == "data_file" and state.initial_state.data_file == "init.bin"
    assert seq.server_inputs() == ("S", "E", "C", "si") and seq.state_outputs() == ("so",)


def test_direct_strategy_fields() -> None:
    seq, _ = parse("direct { max_queue_delay_microseconds: 50 minimum_slot_utilization: 0.5 }")
    assert (seq.strategy, seq.max_queue_delay_microseconds, seq.minimum_slot_utilization) == (
        "direct",
        50,
        0.5,
    )


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        (control("INPUT", "CONTROL_SEQUENCE_START"), "control_input[0].name", "also listed in 'input'"),
        (control("S", "CONTROL_SEQUENCE_START", "int32_false_true: [ 1 ]"), "control_input[0]", "two values"),
        (
            control("S", "CONTROL_SEQUENCE_READY", "int32_false_true: [ 0, 1 ] fp32_false_true: [ 0, 1 ]"),
            "control_input[0]",
            "exactly one of",
        ),
        (
            control("C", "CONTROL_SEQUENCE_CORRID", "data_type: TYPE_FP32"),
            "control_input[0].control[0].data_type",
            "TYPE_UINT64",
        ),
        (
            control("C", "CONTROL_SEQUENCE_CORRID", "int32_false_true: [ 0, 1 ]"),
            "control_input[0]",
            "not *_false_true",
        ),
        (
            control("A", "CONTROL_SEQUENCE_START") + control("B", "CONTROL_SEQUENCE_START"),
            "control_input[1]",
            "already given",
        ),
        ('control_input [ { name: "X" } ]', "control_input[0]", "exactly one control"),
        (
            'state [ { input_name: "INPUT" output_name: "o" data_type: TYPE_INT32 dims: [ 1 ] } ]',
            "state[0].input_name",
            "already an input",
        ),
        (
            'state [ { input_name: "i" output_name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]',
            "state[0].output_name",
            "listed in 'output' as TYPE_INT32, but the state is TYPE_FP32",
        ),
        (
            'state [ { input_name: "i" output_name: "o" data_type: TYPE_STRING dims: [ 1 ] '
            'initial_state { data_type: TYPE_STRING dims: [ 1 ] data_file: "x" } } ]',
            "state[0].initial_state",
            "zero_data (empty strings)",
        ),
        (
            'state [ { input_name: "i" output_name: "o" data_type: TYPE_INT32 dims: [ 2 ] '
            "initial_state { data_type: TYPE_INT32 dims: [ 3 ] zero_data: true } } ]",
            "state[0].initial_state.dims",
            "do not fit",
        ),
        (
            'state [ { input_name: "i" output_name: "o" data_type: TYPE_INT32 dims: [ 2 ] '
            'initial_state { data_type: TYPE_INT32 dims: [ 2 ] data_file: "../x" } } ]',
            "state[0].initial_state.data_file",
            "initial_state/ directory",
        ),
        (
            'state [ { input_name: "i" output_name: "o" data_type: TYPE_INT32 dims: [ 2 ] '
            "initial_state { data_type: TYPE_INT32 dims: [ 2 ] } } ]",
            "state[0].initial_state",
            "zero_data or data_file",
        ),
        ("oldest { preferred_batch_size: [ 5 ] }", "oldest.preferred_batch_size", "max_batch_size=4"),
        ("oldest { max_candidate_sequences: -1 }", "oldest.max_candidate_sequences", ">= 0"),
        ("direct { minimum_slot_utilization: 1.5 }", "direct.minimum_slot_utilization", "[0, 1]"),
    ],
)
def test_broken_sequence_batching_fails_at_load_naming_the_field(body: str, field: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(body)
    assert f"field 'sequence_batching.{field}'" in info.value.message
    assert message in info.value.message


def test_iterative_sequence_is_supported() -> None:
    seq, warnings = parse("iterative_sequence: true")
    assert warnings == []
    assert seq.iterative_sequence
