"""Unit tests for the config.pbtxt parser: schema mirror, parse errors, warnings, validation."""

from __future__ import annotations

import pathlib

import pytest
from google.protobuf import json_format, text_format

from edge_server.config import (
    Accelerator,
    DynamicBatching,
    InstanceGroup,
    ModelConfig,
    QueuePolicy,
    SecondaryDevice,
    TensorSpec,
    VersionPolicy,
    Warmup,
    WarmupInput,
    load_config_file,
    parse_config_text,
    schema,
    validate_config,
)
from edge_server.errors import ConfigError

SOURCE = "models/densenet/config.pbtxt"

# In the style of Triton's model_configuration.md and optimization.md examples.
DENSENET = """
name: "densenet"
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy: { specific: { versions: [ 1, 3 ] } }
input [
  {
    name: "data_0"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
    reshape: { shape: [ 1, 3, 224, 224 ] }
  }
]
output [
  {
    name: "fc6_1"
    data_type: TYPE_FP32
    dims: [ 1000 ]
    reshape: { shape: [ 1, 1000, 1, 1 ] }
    label_filename: "densenet_labels.txt"
  }
]
instance_group [
  {
    count: 2
    kind: KIND_GPU
    gpus: [ 0 ]
  }
]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 100
  priority_levels: 2
  default_priority_level: 2
  default_queue_policy {
    timeout_action: REJECT
    default_timeout_microseconds: 50000
    max_queue_size: 16
  }
  priority_queue_policy {
    key: 1
    value: {
      timeout_action: DELAY
      default_timeout_microseconds: 1000
      allow_timeout_override: true
    }
  }
}
optimization { execution_accelerators {
  gpu_execution_accelerator : [ {
    name : "tensorrt"
    parameters { key: "precision_mode" value: "FP16" }
    parameters { key: "max_workspace_size_bytes" value: "1073741824" }
  } ]
  cpu_execution_accelerator : [ { name : "openvino" } ]
}}
model_warmup [
  {
    name: "zeros"
    batch_size: 4
    inputs {
      key: "data_0"
      value: { data_type: TYPE_FP32 dims: [ 3, 224, 224 ] zero_data: true }
    }
  },
  {
    name: "from_file"
    batch_size: 1
    count: 3
    inputs {
      key: "data_0"
      value: { data_type: TYPE_FP32 dims: [ 3, 224, 224 ] input_data_file: "raw_data_0" }
    }
  }
]
parameters { key: "intra_op_thread_count" value: { string_value: "2" } }
parameters: { key: "execution_mode" value: { string_value: "0" } }
default_model_filename: "densenet.onnx"
"""

# Sequence batching, as in Triton's architecture.md, plus other fields edge-server ignores.
SEQUENCE = """
backend: "onnxruntime"
max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] allow_ragged_batch: true } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  oldest { max_candidate_sequences: 4 preferred_batch_size: [ 2 ] }
  control_input [
    {
      name: "START"
      control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ]
    },
    {
      name: "CORRID"
      control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ]
    }
  ]
  state [
    {
      input_name: "INPUT_STATE"
      output_name: "OUTPUT_STATE"
      data_type: TYPE_INT32
      dims: [ -1 ]
      initial_state { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "init" }
    }
  ]
}
response_cache { enable: true }
optimization { graph { level: 1 } input_pinned_memory { enable: false } }
instance_group [ { kind: KIND_CPU count: 1 rate_limiter { resources [ { name: "R1" count: 2 } ] } } ]
metric_tags { key: "team" value: "vision" }
"""

ENSEMBLE = """
platform: "ensemble"
max_batch_size: 1
input [ { name: "IMAGE" data_type: TYPE_UINT8 dims: [ -1 ] } ]
output [ { name: "CLASSIFICATION" data_type: TYPE_FP32 dims: [ 1000 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "preprocess"
      model_version: -1
      input_map { key: "INPUT" value: "IMAGE" }
      output_map { key: "OUTPUT" value: "preprocessed_image" }
    },
    {
      model_name: "densenet"
      model_version: -1
      input_map { key: "data_0" value: "preprocessed_image" }
      output_map { key: "fc6_1" value: "CLASSIFICATION" }
    }
  ]
}
"""

MINIMAL = """
name: "m"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


def parse(text: str, name: str = "m") -> tuple[ModelConfig, list[str]]:
    return parse_config_text(text, source="config.pbtxt", default_name=name)


def error(text: str, name: str = "m") -> str:
    with pytest.raises(ConfigError) as info:
        parse(text, name)
    return info.value.message


# --- the realistic config -------------------------------------------------------------------------


def test_realistic_triton_config_parses_to_dataclasses() -> None:
    config, warnings = parse_config_text(DENSENET, source=SOURCE, default_name="densenet")
    assert warnings == []
    assert config.name == "densenet"
    assert config.platform == "onnxruntime_onnx"
    assert config.backend == "onnxruntime"  # filled from the platform, as Triton does
    assert config.max_batch_size == 8
    assert config.source == SOURCE
    assert config.version_policy == VersionPolicy(kind="specific", versions=(1, 3))
    assert config.inputs == (
        TensorSpec(
            name="data_0",
            data_type="TYPE_FP32",
            dims=(3, 224, 224),
            reshape=(1, 3, 224, 224),
            format="FORMAT_NCHW",
        ),
    )
    assert config.outputs == (
        TensorSpec(
            name="fc6_1",
            data_type="TYPE_FP32",
            dims=(1000,),
            reshape=(1, 1000, 1, 1),
            label_filename="densenet_labels.txt",
        ),
    )
    assert config.instance_groups == (InstanceGroup(kind="KIND_GPU", count=2, gpus=(0,)),)
    assert config.dynamic_batching == DynamicBatching(
        preferred_batch_size=(4, 8),
        max_queue_delay_microseconds=100,
        priority_levels=2,
        default_priority_level=2,
        default_queue_policy=QueuePolicy(
            timeout_action="REJECT", default_timeout_microseconds=50000, max_queue_size=16
        ),
        priority_queue_policy={
            1: QueuePolicy(
                timeout_action="DELAY", default_timeout_microseconds=1000, allow_timeout_override=True
            )
        },
    )
    assert config.dynamic_batching.queue_policy(2).max_queue_size == 16
    assert config.gpu_accelerators == (
        Accelerator("tensorrt", {"precision_mode": "FP16", "max_workspace_size_bytes": "1073741824"}),
    )
    assert config.cpu_accelerators == (Accelerator("openvino", {}),)
    assert config.model_warmup == (
        Warmup("zeros", 4, {"data_0": WarmupInput("TYPE_FP32", (3, 224, 224), "zero_data")}, 1),
        Warmup(
            "from_file",
            1,
            {"data_0": WarmupInput("TYPE_FP32", (3, 224, 224), "input_data_file", "raw_data_0")},
            3,
        ),
    )
    assert config.parameters == {"intra_op_thread_count": "2", "execution_mode": "0"}
    assert config.default_model_filename == "densenet.onnx"
    assert config.model_filename == "densenet.onnx"


def test_to_triton_dict_round_trips_key_fields() -> None:
    config, _ = parse_config_text(DENSENET, source=SOURCE, default_name="densenet")
    d = config.to_triton_dict()
    assert d["name"] == "densenet"
    assert (d["platform"], d["backend"], d["max_batch_size"]) == ("onnxruntime_onnx", "onnxruntime", 8)
    assert d["input"] == [
        {
            "name": "data_0",
            "data_type": "TYPE_FP32",
            "dims": [3, 224, 224],
            "reshape": {"shape": [1, 3, 224, 224]},
            "format": "FORMAT_NCHW",
            # Every field, defaults included, as Triton renders it.
            "is_shape_tensor": False,
            "allow_ragged_batch": False,
            "optional": False,
            "is_non_linear_format_io": False,
        }
    ]
    assert d["output"][0]["label_filename"] == "densenet_labels.txt"
    assert d["instance_group"][0]["kind"] == "KIND_GPU"
    assert d["instance_group"][0]["count"] == 2
    assert d["version_policy"] == {"specific": {"versions": [1, 3]}}
    assert d["dynamic_batching"]["preferred_batch_size"] == [4, 8]
    assert d["dynamic_batching"]["priority_queue_policy"]["1"]["timeout_action"] == "DELAY"
    assert d["parameters"]["intra_op_thread_count"] == {"string_value": "2"}
    # Feed the rendering back through the parser: the same config comes out.
    message = json_format.ParseDict(d, schema.new_model_config())
    text = text_format.MessageToString(message)
    again, _ = parse_config_text(text, source=SOURCE, default_name="densenet")
    assert again.inputs == config.inputs
    assert again.outputs == config.outputs
    assert again.instance_groups == config.instance_groups
    assert again.dynamic_batching == config.dynamic_batching
    assert again.version_policy == config.version_policy
    assert again.parameters == config.parameters


def test_minimal_config_defaults() -> None:
    config, warnings = parse(MINIMAL)
    assert warnings == []
    assert config.platform == "onnxruntime_onnx"  # filled from the backend
    assert config.dynamic_batching is None
    assert config.version_policy == VersionPolicy(kind="latest", num_versions=1)
    assert config.instance_groups == ()
    assert config.model_filename == "model.onnx"


def test_missing_name_uses_directory_name() -> None:
    config, _ = parse('backend: "python"', name="my_model")
    assert config.name == "my_model"
    assert (config.backend, config.platform) == ("python", "")


def test_neither_backend_nor_platform_is_allowed() -> None:
    config, _ = parse("max_batch_size: 2")
    assert (config.backend, config.platform) == ("", "")


def test_load_config_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "densenet" / "config.pbtxt"
    path.parent.mkdir()
    path.write_text(DENSENET)
    config, warnings = load_config_file(path, default_name="densenet")
    assert config.source == str(path)
    assert config.name == "densenet"
    path.write_text("max_batch_size: oops\n")
    with pytest.raises(ConfigError, match=rf"^{path}:1:17: "):
        load_config_file(path, default_name="densenet")


def test_load_config_file_leaves_missing_file_to_caller(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_config_file(tmp_path / "config.pbtxt", default_name="m")


# --- syntax variants ------------------------------------------------------------------------------


def test_dims_list_and_repeated_syntax_agree() -> None:
    listed, _ = parse('input { name: "x" data_type: TYPE_FP32 dims: [ -1, 3, 224, 224 ] }')
    repeated, _ = parse('input { name: "x" data_type: TYPE_FP32 dims: -1 dims: 3 dims: 224 dims: 224 }')
    assert listed.inputs[0].dims == repeated.inputs[0].dims == (-1, 3, 224, 224)


def test_comments_colons_and_brackets_are_accepted() -> None:
    text = """
    # a comment
    max_batch_size: 4  # trailing comment
    input: [ { name: "a", data_type: TYPE_INT64, dims: [ 1 ] }, { name: "b" data_type: TYPE_BOOL dims: 2 } ]
    output { name: "c"; data_type: TYPE_STRING; dims: [ -1 ] }
    instance_group: { kind: KIND_CPU }
    """
    config, _ = parse(text)
    assert [t.name for t in config.inputs] == ["a", "b"]
    assert config.outputs[0].data_type == "TYPE_STRING"
    assert config.instance_groups == (InstanceGroup(kind="KIND_CPU", count=1),)


def test_empty_reshape_means_scalar() -> None:
    config, _ = parse(
        'max_batch_size: 8 input { name: "x" data_type: TYPE_FP32 dims: [ 1 ] reshape: { shape: [ ] } }'
    )
    assert config.inputs[0].reshape == ()
    config, _ = parse('max_batch_size: 8 input { name: "x" data_type: TYPE_FP32 dims: [ 1 ] }')
    assert config.inputs[0].reshape is None


def test_instance_group_details() -> None:
    config, _ = parse(
        """
        backend: "tensorrt"
        instance_group [
          { name: "dla" kind: KIND_GPU count: 0 gpus: [ 0 ]
            secondary_devices [ { kind: KIND_NVDLA device_id: 1 } ] },
          { kind: KIND_AUTO passive: true }
        ]
        """
    )
    assert config.instance_groups == (
        InstanceGroup(
            name="dla",
            kind="KIND_GPU",
            count=1,
            gpus=(0,),
            secondary_devices=(SecondaryDevice("KIND_NVDLA", 1),),
        ),
        InstanceGroup(kind="KIND_AUTO", passive=True),
    )
    assert config.platform == "tensorrt_plan"


def test_version_policies() -> None:
    assert parse("version_policy: { all: {} }")[0].version_policy.kind == "all"
    assert parse("version_policy: { latest: { num_versions: 3 } }")[0].version_policy == VersionPolicy(
        kind="latest", num_versions=3
    )


def test_warmup_random_data_and_zero_batch_skipped() -> None:
    config, warnings = parse(
        """
        max_batch_size: 2
        model_warmup { name: "r" batch_size: 2 inputs { key: "x" value { data_type: TYPE_FP16 dims: 4
                       random_data: true } } }
        model_warmup { name: "skip_me"
                       inputs { key: "x" value { data_type: TYPE_FP16 dims: 4 zero_data: true } } }
        """
    )
    assert config.model_warmup == (Warmup("r", 2, {"x": WarmupInput("TYPE_FP16", (4,), "random_data")}, 1),)
    assert any("model_warmup[1].batch_size" in w and "skip_me" in w for w in warnings)


# --- warnings for fields edge-server ignores ------------------------------------------------------


def test_sequence_batching_is_parsed_and_other_ignored_fields_warn() -> None:
    config, warnings = parse(SEQUENCE)
    assert config.backend == "onnxruntime"
    assert config.inputs[0].name == "INPUT"
    assert config.dynamic_batching is None
    assert config.sequence_batching is not None
    assert config.sequence_batching.strategy == "oldest"
    assert config.server_inputs() == ("START", "CORRID", "INPUT_STATE")
    assert config.inputs[0].allow_ragged_batch  # test_ragged_batching.py
    expected = [
        "instance_group.rate_limiter",
        "optimization.graph",
        "optimization.input_pinned_memory",
        "metric_tags",
        "response_cache",
    ]
    for path in expected:
        assert f"config.pbtxt: field '{path}' is not supported by edge-server yet and is ignored" in warnings
    assert len(warnings) == len(expected)


def test_decoupled_is_parsed_and_refused_for_backends_that_answer_once() -> None:
    python = 'name: "m"\nbackend: "python"\nmodel_transaction_policy { decoupled: true }\n'
    config, warnings = parse(python, name="m")
    assert config.decoupled and warnings == []
    assert config.to_triton_dict()["model_transaction_policy"] == {"decoupled": True}
    with pytest.raises(ConfigError, match="model_transaction_policy.decoupled"):
        parse(python.replace("python", "onnxruntime"), name="m")


def test_ensemble_scheduling_is_read() -> None:
    config, warnings = parse(ENSEMBLE, name="ensemble_model")
    assert (config.platform, config.backend) == ("ensemble", "ensemble")
    assert warnings == []
    assert config.written["ensemble_scheduling"]["step"]  # the pipeline package reads it from here


def test_warning_is_listed_once_for_many_inputs() -> None:
    text = "".join(
        f'input {{ name: "i{i}" data_type: TYPE_FP32 dims: 1 is_shape_tensor: true }}' for i in range(3)
    )
    _, warnings = parse(text)
    assert warnings == [
        "config.pbtxt: field 'input.is_shape_tensor' is not supported by edge-server yet and is ignored"
    ]


def test_dynamic_batching_without_batching_is_dropped_with_warning() -> None:
    config, warnings = parse("max_batch_size: 0 dynamic_batching { preferred_batch_size: [ 4 ] }")
    assert config.dynamic_batching is None
    assert len(warnings) == 1
    assert "'dynamic_batching'" in warnings[0] and "max_batch_size is 0" in warnings[0]


# --- parse errors ---------------------------------------------------------------------------------


def test_typo_field_names_file_line_column_and_field() -> None:
    message = error('name: "m"\nmax_batch_sise: 8\n')
    assert message.startswith("config.pbtxt:2:1: ")
    assert "max_batch_sise" in message
    assert "Did you mean 'max_batch_size'?" in message


def test_typo_in_nested_field() -> None:
    message = error('input [\n  { name: "x"\n    data_typ: TYPE_FP32 } ]\n')
    assert message.startswith("config.pbtxt:3:5: ")
    assert "data_typ" in message and "ModelInput" in message


def test_unknown_enum_value_is_named() -> None:
    message = error('input { name: "x" data_type: TYPE_FLOAT33 dims: 1 }')
    assert message.startswith("config.pbtxt:1:30: ")
    assert "TYPE_FLOAT33" in message


def test_unknown_enum_number_is_rejected() -> None:
    # proto3 enums accept any number in text format; conversion must not let it through.
    message = error('input { name: "x" data_type: 42 dims: 1 }')
    assert "input[0].data_type" in message and "42" in message
    message = error("max_batch_size: 4 dynamic_batching { default_queue_policy { timeout_action: 7 } }")
    assert "dynamic_batching.default_queue_policy.timeout_action" in message


def test_wrong_type_is_rejected() -> None:
    message = error('max_batch_size: "abc"')
    assert message.startswith("config.pbtxt:1:17: ")
    assert "max_batch_size" in message and "integer" in message


def test_out_of_range_integer_is_rejected() -> None:
    assert "max_batch_size" in error("max_batch_size: 99999999999")


def test_syntax_error_and_duplicate_scalar() -> None:
    assert error("input { name: 'x' ").startswith("config.pbtxt:1:")
    assert "max_batch_size" in error("max_batch_size: 1\nmax_batch_size: 2")


# --- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        ('name: "other"', "name", "does not match"),
        ('platform: "onnxruntime_onnx" backend: "python"', "platform", "'onnxruntime'"),
        ('backend: "pytorch"', "backend", "backend 'pytorch' is not supported by edge-server"),
        ('platform: "tensorflow_savedmodel"', "platform", "(Triton's tensorflow backend) is not supported"),
        ('platform: "caffe2_netdef"', "platform", "unknown platform"),
        ("max_batch_size: -1", "max_batch_size", ">= 0"),
        (
            'input { name: "x" data_type: TYPE_FP32 dims: 1 }\n'
            'input { name: "x" data_type: TYPE_FP32 dims: 1 }',
            "input[1].name",
            "duplicate",
        ),
        (
            'output { name: "y" data_type: TYPE_FP32 dims: 1 }\n'
            'output { name: "y" data_type: TYPE_FP32 dims: 1 }',
            "output[1].name",
            "duplicate",
        ),
        ("input { data_type: TYPE_FP32 dims: 1 }", "input[0].name", "name"),
        ('input { name: "x" data_type: TYPE_FP32 dims: [ 3, 0 ] }', "input[0].dims", "[3, 0]"),
        ('output { name: "y" data_type: TYPE_FP32 dims: [ -2 ] }', "output[0].dims", "-1"),
        (
            'input { name: "x" data_type: TYPE_FP32 dims: [ 2, 3 ] reshape { shape: [ 5 ] } }',
            "input[0].reshape",
            "has 5 elements but dims [2, 3] have 6 elements",
        ),
        (
            'input { name: "x" data_type: TYPE_FP32 dims: [ 1 ] reshape { shape: [ ] } }',
            "input[0].reshape",
            "batching model",
        ),
        (
            'input { name: "x" data_type: TYPE_FP32 format: FORMAT_NHWC dims: [ 224, 224 ] }',
            "input[0].format",
            "3 dims",
        ),
        ("instance_group { count: -1 }", "instance_group[0].count", ">= 1"),
        ("instance_group { kind: KIND_CPU gpus: 0 }", "instance_group[0].gpus", "KIND_CPU"),
        (
            "instance_group { secondary_devices { device_id: -1 } }",
            "instance_group[0].secondary_devices[0]",
            "device_id",
        ),
        (
            "max_batch_size: 4 dynamic_batching { preferred_batch_size: [ 2, 8 ] }",
            "dynamic_batching.preferred_batch_size",
            "max_batch_size=4",
        ),
        (
            "max_batch_size: 4 dynamic_batching { preferred_batch_size: [ 0 ] }",
            "dynamic_batching.preferred_batch_size",
            "[1,",
        ),
        (
            "max_batch_size: 4 dynamic_batching { priority_levels: 2 default_priority_level: 3 }",
            "dynamic_batching.default_priority_level",
            "[1, priority_levels=2]",
        ),
        (
            "max_batch_size: 4 dynamic_batching { priority_levels: 2 }",
            "dynamic_batching.default_priority_level",
            "got 0",
        ),
        (
            "max_batch_size: 4 dynamic_batching { default_priority_level: 1 }",
            "dynamic_batching.default_priority_level",
            "priority_levels is 0",
        ),
        (
            "max_batch_size: 4 dynamic_batching { priority_levels: 2 default_priority_level: 1 "
            "priority_queue_policy { key: 3 value { } } }",
            "dynamic_batching.priority_queue_policy",
            "level 3",
        ),
        (
            "max_batch_size: 4 dynamic_batching { priority_levels: 2 default_priority_level: 1 "
            "priority_queue_policy { key: 0 value { } } }",
            "dynamic_batching.priority_queue_policy",
            "level 0",
        ),
        (
            "max_batch_size: 4 dynamic_batching { preserve_ordering: true "
            "default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 10 } }",
            "dynamic_batching.default_queue_policy.timeout_action",
            "preserve_ordering",
        ),
        (
            "max_batch_size: 4 dynamic_batching { preserve_ordering: true priority_levels: 2 "
            "default_priority_level: 1 }",
            "dynamic_batching.preserve_ordering",
            "one priority level",
        ),
        ("version_policy { latest { num_versions: 0 } }", "version_policy.latest.num_versions", ">= 1"),
        ("version_policy { latest { } }", "version_policy.latest.num_versions", ">= 1"),
        (
            'model_warmup { name: "w" batch_size: 2 }',
            "model_warmup[0].batch_size",
            "[1, 1]",
        ),
        (
            'model_warmup { name: "w" batch_size: 1\n'
            'inputs { key: "x" value { data_type: TYPE_FP32 dims: 1 } } }',
            "model_warmup[0].inputs['x']",
            "zero_data",
        ),
        (
            'model_warmup { name: "w" batch_size: 1 inputs { key: "x" value { data_type: TYPE_FP32 dims: -1 '
            "zero_data: true } } }",
            "model_warmup[0].inputs['x'].dims",
            ">= 1",
        ),
        (
            "optimization { execution_accelerators { gpu_execution_accelerator { } } }",
            "optimization.execution_accelerators.gpu_execution_accelerator[0].name",
            "name",
        ),
    ],
)
def test_validation_errors_name_file_and_field(text: str, field: str, words: str) -> None:
    message = error(text)
    assert message.startswith(f"config.pbtxt: field '{field}'"), message
    assert words in message, message


def test_variable_dims_skip_reshape_count_check() -> None:
    config, _ = parse(
        'input { name: "x" data_type: TYPE_FP32 dims: [ -1, 6 ] reshape { shape: [ -1, 2, 3 ] } }'
    )
    assert config.inputs[0].reshape == (-1, 2, 3)


def test_validate_config_rechecks_completed_config() -> None:
    config, _ = parse(MINIMAL)
    validate_config(config.replace(inputs=(TensorSpec("x", "TYPE_FP32", (-1,)),)))
    with pytest.raises(ConfigError, match=r"config.pbtxt: field 'input\[1\].name': duplicate"):
        validate_config(config.replace(inputs=config.inputs * 2))


# --- the schema mirrors Triton's model_config.proto ------------------------------------------------


def test_schema_mirrors_triton_field_numbers() -> None:
    fields = schema.model_config_descriptor().fields_by_name
    triton_numbers = {
        "name": 1,
        "platform": 2,
        "version_policy": 3,
        "max_batch_size": 4,
        "input": 5,
        "output": 6,
        "instance_group": 7,
        "default_model_filename": 8,
        "cc_model_filenames": 9,
        "metric_tags": 10,
        "dynamic_batching": 11,
        "optimization": 12,
        "sequence_batching": 13,
        "parameters": 14,
        "ensemble_scheduling": 15,
        "model_warmup": 16,
        "backend": 17,
        "model_operations": 18,
        "model_transaction_policy": 19,
        "batch_input": 20,
        "batch_output": 21,
        "model_repository_agents": 23,
        "response_cache": 24,
        "runtime": 25,
        "model_metrics": 26,
    }
    assert {name: fields[name].number for name in triton_numbers} == triton_numbers
    assert set(fields) == set(triton_numbers)
    descriptor = schema.model_config_descriptor()
    oneof = descriptor.oneofs_by_name["scheduling_choice"]
    assert [f.name for f in oneof.fields] == ["dynamic_batching", "sequence_batching", "ensemble_scheduling"]
    assert descriptor.full_name == "inference.ModelConfig"


def test_schema_nested_messages_and_enums() -> None:
    pool = schema.model_config_descriptor().file.pool
    group = pool.FindMessageTypeByName("inference.ModelInstanceGroup")
    assert {f.name: f.number for f in group.fields} == {
        "name": 1,
        "count": 2,
        "gpus": 3,
        "kind": 4,
        "profile": 5,
        "rate_limiter": 6,
        "passive": 7,
        "secondary_devices": 8,
        "host_policy": 9,
    }
    assert [v.name for v in group.enum_types_by_name["Kind"].values] == [
        "KIND_AUTO",
        "KIND_GPU",
        "KIND_CPU",
        "KIND_MODEL",
    ]
    data_type = pool.FindEnumTypeByName("inference.DataType")
    assert data_type.values_by_name["TYPE_STRING"].number == 13
    assert data_type.values_by_name["TYPE_BF16"].number == 14
    batching = pool.FindMessageTypeByName("inference.ModelDynamicBatching")
    assert batching.fields_by_name["priority_queue_policy"].number == 7
    entry = batching.fields_by_name["priority_queue_policy"].message_type
    assert entry is not None and entry.GetOptions().map_entry
    output = pool.FindMessageTypeByName("inference.ModelOutput")
    assert (output.fields_by_name["label_filename"].number, output.fields_by_name["reshape"].number) == (4, 5)
    warmup_input = pool.FindMessageTypeByName("inference.ModelWarmup.Input")
    assert [f.name for f in warmup_input.oneofs_by_name["input_data_type"].fields] == [
        "zero_data",
        "random_data",
        "input_data_file",
    ]
    accelerators = pool.FindMessageTypeByName("inference.ModelOptimizationPolicy.ExecutionAccelerators")
    assert accelerators.fields_by_name["cpu_execution_accelerator"].number == 2
    sequence = pool.FindMessageTypeByName("inference.ModelSequenceBatching")
    assert {f.name: f.number for f in sequence.fields}["state"] == 5
    assert (
        pool.FindMessageTypeByName("inference.ModelSequenceBatching.Control")
        .fields_by_name["bool_false_true"]
        .number
        == 5
    )
    step = pool.FindMessageTypeByName("inference.ModelEnsembling.Step")
    assert step.fields_by_name["output_map"].number == 4


def test_schema_uses_a_private_pool() -> None:
    from google.protobuf import descriptor_pool

    assert schema.model_config_descriptor().file.pool is not descriptor_pool.Default()
