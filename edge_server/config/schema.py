"""Our own copy of Triton's ``inference.ModelConfig`` protobuf schema, built at run time.

Any ``config.pbtxt`` written for Triton must parse here, so the table below mirrors every message,
field name and field number of Triton's ``model_config.proto``, including the parts edge-server
ignores: the parser warns about those by name instead of rejecting the file.

The schema is written as a compact table of proto-like field lines and compiled into a
``FileDescriptorProto`` in a private descriptor pool.  That avoids ``protoc``, generated ``_pb2``
files and any clash with a ``tritonclient`` that registers the same names in the default pool.
Type names in field lines resolve with protobuf's scoping rules, exactly as in a ``.proto`` file.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor
from google.protobuf.descriptor_pb2 import (
    DescriptorProto,
    EnumDescriptorProto,
    FieldDescriptorProto,
    FileDescriptorProto,
)

PACKAGE = "inference"
_FILE_NAME = "edge_server/model_config.proto"

_SCALARS = {
    "double": FieldDescriptorProto.TYPE_DOUBLE,
    "float": FieldDescriptorProto.TYPE_FLOAT,
    "int32": FieldDescriptorProto.TYPE_INT32,
    "int64": FieldDescriptorProto.TYPE_INT64,
    "uint32": FieldDescriptorProto.TYPE_UINT32,
    "uint64": FieldDescriptorProto.TYPE_UINT64,
    "bool": FieldDescriptorProto.TYPE_BOOL,
    "string": FieldDescriptorProto.TYPE_STRING,
}

# "repeated int64 dims = 4", "map<string, ModelParameter> parameters = 14", "DataType data_type = 2"
_FIELD_LINE = re.compile(
    r"^(?:(?P<repeated>repeated) )?(?:map<(?P<key>\w+), *(?P<value>[\w.]+)>|(?P<type>[\w.]+)) "
    r"(?P<name>\w+) = (?P<number>\d+)$"
)


@dataclass(frozen=True)
class _Oneof:
    name: str
    fields: tuple[str, ...]


def _oneof(name: str, *fields: str) -> _Oneof:
    return _Oneof(name, fields)


def _enum(name: str, *values: str) -> EnumDescriptorProto:
    """An enum whose values are numbered 0, 1, 2... in order, as all of Triton's are."""
    enum = EnumDescriptorProto(name=name)
    for number, value in enumerate(values):
        enum.value.add(name=value, number=number)
    return enum


def _set_type(field: FieldDescriptorProto, type_name: str) -> None:
    if type_name in _SCALARS:
        field.type = _SCALARS[type_name]
    else:
        # Message or enum: the pool resolves the (relative) name and fills in the type.
        field.type_name = type_name


def _add_field(message: DescriptorProto, line: str, oneof_index: int | None = None) -> None:
    match = _FIELD_LINE.match(line)
    if match is None:
        raise ValueError(f"bad schema field line {line!r} in message {message.name}")
    field = message.field.add(name=match["name"], number=int(match["number"]))
    field.label = FieldDescriptorProto.LABEL_OPTIONAL
    if oneof_index is not None:
        field.oneof_index = oneof_index
    if match["key"] is not None:
        # A map is a repeated nested "<Name>Entry" message with map_entry set, as protoc makes it.
        entry = message.nested_type.add(name="".join(p.title() for p in field.name.split("_")) + "Entry")
        entry.options.map_entry = True
        _add_field(entry, f"{match['key']} key = 1")
        _add_field(entry, f"{match['value']} value = 2")
        field.label = FieldDescriptorProto.LABEL_REPEATED
        field.type_name = entry.name
        return
    if match["repeated"]:
        field.label = FieldDescriptorProto.LABEL_REPEATED
    _set_type(field, match["type"])


def _msg(name: str, *members: DescriptorProto | EnumDescriptorProto | _Oneof | str) -> DescriptorProto:
    """A message from nested messages, nested enums, oneofs and field lines, in any order."""
    message = DescriptorProto(name=name)
    for member in members:
        if isinstance(member, DescriptorProto):
            message.nested_type.append(member)
        elif isinstance(member, EnumDescriptorProto):
            message.enum_type.append(member)
        elif isinstance(member, _Oneof):
            message.oneof_decl.add(name=member.name)
            for line in member.fields:
                _add_field(message, line, oneof_index=len(message.oneof_decl) - 1)
        else:
            _add_field(message, member)
    return message


# The table: Triton's model_config.proto, message by message, with its field numbers.
_TOP_LEVEL: tuple[DescriptorProto | EnumDescriptorProto, ...] = (
    _enum(
        "DataType",
        "TYPE_INVALID",
        "TYPE_BOOL",
        "TYPE_UINT8",
        "TYPE_UINT16",
        "TYPE_UINT32",
        "TYPE_UINT64",
        "TYPE_INT8",
        "TYPE_INT16",
        "TYPE_INT32",
        "TYPE_INT64",
        "TYPE_FP16",
        "TYPE_FP32",
        "TYPE_FP64",
        "TYPE_STRING",
        "TYPE_BF16",
    ),
    _msg(
        "ModelRateLimiter",
        _msg("Resource", "string name = 1", "bool global = 2", "uint32 count = 3"),
        "repeated Resource resources = 1",
        "uint32 priority = 2",
    ),
    _msg(
        "ModelInstanceGroup",
        _enum("Kind", "KIND_AUTO", "KIND_GPU", "KIND_CPU", "KIND_MODEL"),
        _msg(
            "SecondaryDevice",
            _enum("SecondaryDeviceKind", "KIND_NVDLA"),
            "SecondaryDeviceKind kind = 1",
            "int64 device_id = 2",
        ),
        "string name = 1",
        "Kind kind = 4",
        "int32 count = 2",
        "ModelRateLimiter rate_limiter = 6",
        "repeated int32 gpus = 3",
        "repeated SecondaryDevice secondary_devices = 8",
        "repeated string profile = 5",
        "bool passive = 7",
        "string host_policy = 9",
    ),
    _msg("ModelTensorReshape", "repeated int64 shape = 1"),
    _msg(
        "ModelInput",
        _enum("Format", "FORMAT_NONE", "FORMAT_NHWC", "FORMAT_NCHW"),
        "string name = 1",
        "DataType data_type = 2",
        "Format format = 3",
        "repeated int64 dims = 4",
        "ModelTensorReshape reshape = 5",
        "bool is_shape_tensor = 6",
        "bool allow_ragged_batch = 7",
        "bool optional = 8",
        "bool is_non_linear_format_io = 9",
    ),
    _msg(
        "ModelOutput",
        "string name = 1",
        "DataType data_type = 2",
        "repeated int64 dims = 3",
        "ModelTensorReshape reshape = 5",
        "string label_filename = 4",
        "bool is_shape_tensor = 6",
        "bool is_non_linear_format_io = 7",
    ),
    _msg(
        "BatchInput",
        _enum(
            "Kind",
            "BATCH_ELEMENT_COUNT",
            "BATCH_ACCUMULATED_ELEMENT_COUNT",
            "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO",
            "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE",
            "BATCH_ITEM_SHAPE",
            "BATCH_ITEM_SHAPE_FLATTEN",
        ),
        "Kind kind = 1",
        "repeated string target_name = 2",
        "DataType data_type = 3",
        "repeated string source_input = 4",
    ),
    _msg(
        "BatchOutput",
        _enum("Kind", "BATCH_SCATTER_WITH_INPUT_SHAPE"),
        "repeated string target_name = 1",
        "Kind kind = 2",
        "repeated string source_input = 3",
    ),
    _msg(
        "ModelVersionPolicy",
        _msg("Latest", "uint32 num_versions = 1"),
        _msg("All"),
        _msg("Specific", "repeated int64 versions = 1"),
        _oneof("policy_choice", "Latest latest = 1", "All all = 2", "Specific specific = 3"),
    ),
    _msg(
        "ModelOptimizationPolicy",
        _msg("Graph", "int32 level = 1"),
        _enum("ModelPriority", "PRIORITY_DEFAULT", "PRIORITY_MAX", "PRIORITY_MIN"),
        _msg(
            "Cuda",
            _msg(
                "GraphSpec",
                _msg("Shape", "repeated int64 dim = 1"),
                _msg("LowerBound", "int32 batch_size = 1", "map<string, Shape> input = 2"),
                "int32 batch_size = 1",
                "map<string, Shape> input = 2",
                "LowerBound graph_lower_bound = 3",
            ),
            "bool graphs = 1",
            "bool busy_wait_events = 2",
            "repeated GraphSpec graph_spec = 3",
            "bool output_copy_stream = 4",
        ),
        _msg(
            "ExecutionAccelerators",
            _msg("Accelerator", "string name = 1", "map<string, string> parameters = 2"),
            "repeated Accelerator gpu_execution_accelerator = 1",
            "repeated Accelerator cpu_execution_accelerator = 2",
        ),
        _msg("PinnedMemoryBuffer", "bool enable = 1"),
        "Graph graph = 1",
        "ModelPriority priority = 2",
        "Cuda cuda = 3",
        "ExecutionAccelerators execution_accelerators = 4",
        "PinnedMemoryBuffer input_pinned_memory = 5",
        "PinnedMemoryBuffer output_pinned_memory = 6",
        "uint32 gather_kernel_buffer_threshold = 7",
        "bool eager_batching = 8",
    ),
    _msg(
        "ModelQueuePolicy",
        _enum("TimeoutAction", "REJECT", "DELAY"),
        "TimeoutAction timeout_action = 1",
        "uint64 default_timeout_microseconds = 2",
        "bool allow_timeout_override = 3",
        "uint32 max_queue_size = 4",
    ),
    _msg(
        "ModelDynamicBatching",
        "repeated int32 preferred_batch_size = 1",
        "uint64 max_queue_delay_microseconds = 2",
        "bool preserve_ordering = 3",
        "uint64 priority_levels = 4",
        "uint64 default_priority_level = 5",
        "ModelQueuePolicy default_queue_policy = 6",
        "map<uint64, ModelQueuePolicy> priority_queue_policy = 7",
    ),
    _msg(
        "ModelSequenceBatching",
        _msg(
            "Control",
            _enum(
                "Kind",
                "CONTROL_SEQUENCE_START",
                "CONTROL_SEQUENCE_READY",
                "CONTROL_SEQUENCE_END",
                "CONTROL_SEQUENCE_CORRID",
            ),
            "Kind kind = 1",
            "repeated int32 int32_false_true = 2",
            "repeated float fp32_false_true = 3",
            "repeated bool bool_false_true = 5",
            "DataType data_type = 4",
        ),
        _msg("ControlInput", "string name = 1", "repeated Control control = 2"),
        _msg(
            "InitialState",
            "DataType data_type = 1",
            "repeated int64 dims = 2",
            _oneof("state_data", "bool zero_data = 3", "string data_file = 4"),
            "string name = 5",
        ),
        _msg(
            "State",
            "string input_name = 1",
            "string output_name = 2",
            "DataType data_type = 3",
            "repeated int64 dims = 4",
            "repeated InitialState initial_state = 5",
            "bool use_same_buffer_for_input_output = 6",
            "bool use_growable_memory = 7",
        ),
        _msg(
            "StrategyDirect", "uint64 max_queue_delay_microseconds = 1", "float minimum_slot_utilization = 2"
        ),
        _msg(
            "StrategyOldest",
            "int32 max_candidate_sequences = 1",
            "repeated int32 preferred_batch_size = 2",
            "uint64 max_queue_delay_microseconds = 3",
            "bool preserve_ordering = 4",
        ),
        _oneof("strategy_choice", "StrategyDirect direct = 3", "StrategyOldest oldest = 4"),
        "uint64 max_sequence_idle_microseconds = 1",
        "repeated ControlInput control_input = 2",
        "repeated State state = 5",
        "bool iterative_sequence = 6",
    ),
    _msg(
        "ModelEnsembling",
        _msg(
            "Step",
            "string model_name = 1",
            "int64 model_version = 2",
            "map<string, string> input_map = 3",
            "map<string, string> output_map = 4",
            "string model_namespace = 5",
        ),
        "repeated Step step = 1",
        "uint32 max_inflight_requests = 2",
    ),
    _msg("ModelParameter", "string string_value = 1"),
    _msg(
        "ModelWarmup",
        _msg(
            "Input",
            "DataType data_type = 1",
            "repeated int64 dims = 2",
            _oneof(
                "input_data_type",
                "bool zero_data = 3",
                "bool random_data = 4",
                "string input_data_file = 5",
            ),
        ),
        "string name = 1",
        "uint32 batch_size = 2",
        "map<string, Input> inputs = 3",
        "uint32 count = 4",
    ),
    _msg("ModelOperations", "repeated string op_library_filename = 1"),
    _msg("ModelTransactionPolicy", "bool decoupled = 1"),
    _msg(
        "ModelRepositoryAgents",
        _msg("Agent", "string name = 1", "map<string, string> parameters = 2"),
        "repeated Agent agents = 1",
    ),
    _msg("ModelResponseCache", "bool enable = 1"),
    _msg(
        "ModelMetrics",
        _msg(
            "MetricControl",
            _msg("MetricIdentifier", "string family = 1"),
            _msg("HistogramOptions", "repeated double buckets = 1"),
            "MetricIdentifier metric_identifier = 1",
            _oneof("metric_options", "HistogramOptions histogram_options = 2"),
        ),
        "repeated MetricControl metric_control = 1",
    ),
    _msg(
        "ModelConfig",
        "string name = 1",
        "string platform = 2",
        "string backend = 17",
        "string runtime = 25",
        "ModelVersionPolicy version_policy = 3",
        "int32 max_batch_size = 4",
        "repeated ModelInput input = 5",
        "repeated ModelOutput output = 6",
        "repeated BatchInput batch_input = 20",
        "repeated BatchOutput batch_output = 21",
        "ModelOptimizationPolicy optimization = 12",
        _oneof(
            "scheduling_choice",
            "ModelDynamicBatching dynamic_batching = 11",
            "ModelSequenceBatching sequence_batching = 13",
            "ModelEnsembling ensemble_scheduling = 15",
        ),
        "repeated ModelInstanceGroup instance_group = 7",
        "string default_model_filename = 8",
        "map<string, string> cc_model_filenames = 9",
        "map<string, string> metric_tags = 10",
        "map<string, ModelParameter> parameters = 14",
        "repeated ModelWarmup model_warmup = 16",
        "ModelOperations model_operations = 18",
        "ModelTransactionPolicy model_transaction_policy = 19",
        "ModelRepositoryAgents model_repository_agents = 23",
        "ModelResponseCache response_cache = 24",
        "ModelMetrics model_metrics = 26",
    ),
)


def _file_proto() -> FileDescriptorProto:
    proto = FileDescriptorProto(name=_FILE_NAME, package=PACKAGE, syntax="proto3")
    for item in _TOP_LEVEL:
        if isinstance(item, EnumDescriptorProto):
            proto.enum_type.append(item)
        else:
            proto.message_type.append(item)
    return proto


@functools.cache
def _pool() -> descriptor_pool.DescriptorPool:
    # Built on first use, not at import, so importing edge_server.config stays cheap.
    pool = descriptor_pool.DescriptorPool()
    pool.Add(_file_proto())
    return pool


def model_config_descriptor() -> Descriptor:
    """The descriptor of our ``inference.ModelConfig``."""
    return _pool().FindMessageTypeByName(f"{PACKAGE}.ModelConfig")


def new_model_config() -> Any:
    """An empty ``inference.ModelConfig`` message (typed ``Any``: its fields are made at run time)."""
    return message_factory.GetMessageClass(model_config_descriptor())()
