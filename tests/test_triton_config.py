"""Configs that Triton accepts load here: schema field by field, BF16, partial configs, reshape rules."""

from __future__ import annotations

import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from google.protobuf.descriptor import FieldDescriptor

from edge_server import Server
from edge_server.config import parse_config_text, schema, validate_config
from edge_server.config.parser import reshape_problem
from edge_server.errors import ConfigError
from edge_server.pipeline.graph import parse_steps
from tests.onnx_factory import affine_model

FIELD_LIST = Path(__file__).parent / "data" / "triton_model_config_fields.txt"

_SCALAR_NAMES = {
    FieldDescriptor.TYPE_DOUBLE: "double",
    FieldDescriptor.TYPE_FLOAT: "float",
    FieldDescriptor.TYPE_INT32: "int32",
    FieldDescriptor.TYPE_INT64: "int64",
    FieldDescriptor.TYPE_UINT32: "uint32",
    FieldDescriptor.TYPE_UINT64: "uint64",
    FieldDescriptor.TYPE_BOOL: "bool",
    FieldDescriptor.TYPE_STRING: "string",
}


def _type_name(field) -> str:
    if field.type in _SCALAR_NAMES:
        return _SCALAR_NAMES[field.type]
    return (field.message_type or field.enum_type).name


def _our_fields() -> list[str]:
    """Our schema in the list's format (maps as map<key,value>, nested names as dotted paths)."""
    lines: list[str] = []

    def enum(descriptor, prefix: str) -> None:
        lines.extend(f"enum {prefix}{descriptor.name}.{v.name} = {v.number}" for v in descriptor.values)

    def message(descriptor, prefix: str) -> None:
        scope = prefix + descriptor.name
        for nested_enum in descriptor.enum_types:
            enum(nested_enum, scope + ".")
        for nested in descriptor.nested_types:
            if not nested.GetOptions().map_entry:
                message(nested, scope + ".")
        for field in descriptor.fields:
            entry = field.message_type
            if entry is not None and entry.GetOptions().map_entry:
                key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
                kind = f"map<{_type_name(key)},{_type_name(value)}>"
            else:
                kind = ("repeated " if field.is_repeated else "") + _type_name(field)
            oneof = f" oneof({field.containing_oneof.name})" if field.containing_oneof else ""
            lines.append(f"field {scope}.{field.name} = {field.number} {kind}{oneof}")

    file = schema.model_config_descriptor().file
    for descriptor in file.enum_types_by_name.values():
        enum(descriptor, "")
    for descriptor in file.message_types_by_name.values():
        message(descriptor, "")
    return sorted(lines)


def test_schema_matches_tritons_model_config_proto_field_by_field() -> None:
    theirs = sorted(line for line in FIELD_LIST.read_text().splitlines() if line and not line.startswith("#"))
    ours = _our_fields()
    assert [line for line in theirs if line not in ours] == []  # missing or different here
    assert [line for line in ours if line not in theirs] == []  # invented here
    assert len(ours) == 203


def parse(text: str, name: str = "m"):
    return parse_config_text(textwrap.dedent(text), source="config.pbtxt", default_name=name)


def test_ensemble_max_inflight_requests_parses() -> None:
    config, warnings = parse(
        """
        platform: "ensemble"
        input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
        ensemble_scheduling {
          max_inflight_requests: 8
          step [ { model_name: "a" model_version: -1 input_map { key: "x" value: "IN" }
                   output_map { key: "y" value: "OUT" } } ]
        }
        """
    )
    assert config.backend == "ensemble"
    assert warnings == []
    assert parse_steps(config)[1] == 8


def test_bf16_config_loads_and_a_python_model_round_trips_it(tmp_path: Path) -> None:
    config, _ = parse('backend: "python" input { name: "x" data_type: TYPE_BF16 dims: [ 2 ] }')
    assert config.inputs[0].data_type == "TYPE_BF16"
    repo = tmp_path / "repo"
    (repo / "bf" / "1").mkdir(parents=True)
    (repo / "bf" / "config.pbtxt").write_text(
        'backend: "python"\n'
        'input [ { name: "X" data_type: TYPE_BF16 dims: [ 2 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_BF16 dims: [ 2 ] } ]\n'
    )
    (repo / "bf" / "1" / "model.py").write_text(
        textwrap.dedent(
            """
            import triton_python_backend_utils as pb_utils

            class TritonPythonModel:
                def execute(self, requests):
                    out = []
                    for request in requests:
                        x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
                        out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)]))
                    return out
            """
        )
    )
    with Server(repo) as server:
        x = np.array([1.5, -2.25], dtype=ml_dtypes.bfloat16)
        y = server.infer("bf", {"X": x})["Y"]
        assert y.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(y.astype(np.float32), [3.0, -4.5])


def test_data_type_and_dims_left_for_auto_complete_parse() -> None:
    config, _ = parse(
        """
        platform: "onnxruntime_onnx"
        max_batch_size: 8
        input [ { name: "INPUT0" } ]
        output [ { name: "OUTPUT0" data_type: TYPE_FP32 } ]
        """
    )
    assert config.inputs[0].data_type == "TYPE_INVALID" and config.inputs[0].dims == ()
    with pytest.raises(ConfigError, match=r"input\[0\].data_type.*auto-complete did not fill it"):
        validate_config(config)  # the loader's check after the backend ran


def test_onnx_model_fills_what_the_config_left_out(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    affine_model(repo / "partial" / "1" / "model.onnx", offset=2.0, dims=("batch", 4))
    (repo / "partial" / "config.pbtxt").write_text(
        'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
        'input [ { name: "INPUT0" } ]\noutput [ { name: "OUTPUT0" data_type: TYPE_FP32 } ]\n'
    )
    with Server(repo) as server:
        config = server.model_config("partial")
        assert (config.inputs[0].data_type, config.inputs[0].dims) == ("TYPE_FP32", (4,))
        assert config.outputs[0].dims == (4,)
        out = server.infer("partial", {"INPUT0": np.ones((2, 4), np.float32)})["OUTPUT0"]
        np.testing.assert_array_equal(out, np.full((2, 4), 3.0, np.float32))


PARTIAL_PY_MODEL = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "IN", "data_type": "TYPE_INT32", "dims": [3]})
        config.add_output({"name": "OUT", "data_type": "TYPE_INT32", "dims": [3]})
        return config

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() + 1)])
            for r in requests
        ]
"""


def test_python_auto_complete_fills_data_type_and_dims(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "py" / "1").mkdir(parents=True)
    (repo / "py" / "config.pbtxt").write_text(
        'backend: "python"\ninput [ { name: "IN" } ]\noutput [ { name: "OUT" } ]\n'
    )
    (repo / "py" / "1" / "model.py").write_text(PARTIAL_PY_MODEL)
    with Server(repo) as server:
        config = server.model_config("py")
        assert [(t.data_type, t.dims) for t in config.inputs + config.outputs] == [
            ("TYPE_INT32", (3,)),
            ("TYPE_INT32", (3,)),
        ]
        out = server.infer("py", {"IN": np.arange(3, dtype=np.int32)})["OUT"]
        np.testing.assert_array_equal(out, [1, 2, 3])


@pytest.mark.parametrize(
    ("dims", "reshape", "valid"),
    [
        ((3, 224, 224), (1, 3, 224, 224), True),
        ((1,), (), True),  # a scalar needs exactly one element
        ((2,), (), False),
        ((2, 3), (5,), False),
        ((2, 4, -1, 6), (8, -1, 1, 6), True),  # Triton's own example
        ((-1, 6), (-1, 2, 3), True),
        ((-1, 6), (6, -1), False),  # fixed runs [1, 6] against [6, 1]
        ((-1, 6), (12,), False),  # variable on one side only
        ((4,), (-1, 2), False),
        ((-1, 2, -1), (-1, 2), False),  # different numbers of variable dims
    ],
)
def test_reshape_element_count_follows_tritons_rules(
    dims: tuple[int, ...], reshape: tuple[int, ...], valid: bool
) -> None:
    assert (reshape_problem(dims, reshape) == "") is valid
    text = (
        f'max_batch_size: 1 input {{ name: "x" data_type: TYPE_FP32 dims: {list(dims)} '
        f"reshape {{ shape: {list(reshape)} }} }}"
    )
    if valid:
        parse(text)
    else:
        with pytest.raises(ConfigError, match=r"field 'input\[0\].reshape'"):
            parse(text)


@pytest.mark.parametrize(
    ("config", "files", "reason"),
    [
        (
            'backend: "pytorch"',
            {"1/model.pt": b"torchscript"},
            "field 'backend': backend 'pytorch' is not supported by edge-server, which serves "
            "onnxruntime, tensorrt, python, ensemble models; export the model to ONNX",
        ),
        ('backend: "vllm"', {"1/model.json": b"{}"}, "LLM serving is not part of edge-server"),
        ('backend: "openvino"', {"1/model.xml": b"<xml/>"}, "backend 'openvino' is not supported"),
        (
            'platform: "tensorflow_graphdef"',
            {"1/model.graphdef": b"graph"},
            "platform 'tensorflow_graphdef' (Triton's tensorflow backend) is not supported by edge-server",
        ),
        (
            'platform: "tensorrt_plan"',
            {"1/model.plan": b"engine"},
            "model.plan cannot serve here: TensorRT not installed",
        ),
    ],
)
def test_unknown_and_unrunnable_backends_are_different_clear_errors(
    tmp_path: Path, config: str, files: dict[str, bytes], reason: str
) -> None:
    model = tmp_path / "repo" / "m"
    model.mkdir(parents=True)
    (model / "config.pbtxt").write_text(config + "\nmax_batch_size: 0\n")
    for name, data in files.items():
        (model / name).parent.mkdir(parents=True, exist_ok=True)
        (model / name).write_bytes(data)
    with Server(tmp_path / "repo") as server:
        (status,) = server.models()
        assert status.state.value == "UNAVAILABLE"
        assert reason in status.reason, status.reason
        if "cannot run here" in reason:
            assert "backends this machine runs: onnxruntime, python" in status.reason


def test_gpu_ids_missing_here_are_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    repo = tmp_path / "repo"
    affine_model(repo / "gpus" / "1" / "model.onnx", dims=("batch", 4))
    (repo / "gpus" / "config.pbtxt").write_text(
        'platform: "onnxruntime_onnx"\nmax_batch_size: 4\n'
        "instance_group [ { kind: KIND_AUTO gpus: [ 7 ] } ]\n"
    )
    with Server(repo) as server:
        out = server.infer("gpus", {"INPUT0": np.zeros((1, 4), np.float32)})["OUTPUT0"]
        np.testing.assert_array_equal(out, np.ones((1, 4), np.float32))
    assert any(
        "names GPU ids [7] that do not exist on this machine" in r.getMessage() for r in caplog.records
    )


def test_gpu_ids_come_from_device_nodes(tmp_path: Path) -> None:
    from edge_server.platform.gpus import gpu_ids

    (tmp_path / "dev").mkdir()
    assert gpu_ids(tmp_path) == ()
    for name in ("nvidia1", "nvidia0", "nvidiactl", "nvidia-uvm"):
        (tmp_path / "dev" / name).touch()
    assert gpu_ids(tmp_path) == (0, 1)
    jetson = tmp_path / "jetson"
    (jetson / "dev").mkdir(parents=True)
    (jetson / "dev" / "nvhost-ctrl-gpu").touch()
    assert gpu_ids(jetson) == (0,)


def test_bf16_onnx_model_answers_as_onnxruntime(tmp_path: Path) -> None:
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["X"], ["SAME"]),
            helper.make_node("Cast", ["X"], ["WIDE"], to=TensorProto.FLOAT),
        ],
        "bf16",
        [helper.make_tensor_value_info("X", TensorProto.BFLOAT16, ["n", 3])],
        [
            helper.make_tensor_value_info("SAME", TensorProto.BFLOAT16, ["n", 3]),
            helper.make_tensor_value_info("WIDE", TensorProto.FLOAT, ["n", 3]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "repo" / "bf16" / "1" / "model.onnx"
    path.parent.mkdir(parents=True)
    path.write_bytes(model.SerializeToString())
    x = np.array([[1.5, -2.25, 1e30], [0, 3, 7]], dtype=ml_dtypes.bfloat16)
    with Server(tmp_path / "repo") as server:
        config = server.model_config("bf16")
        assert [t.data_type for t in config.inputs + config.outputs] == [
            "TYPE_BF16",
            "TYPE_BF16",
            "TYPE_FP32",
        ]
        out = server.infer("bf16", {"X": x})
    assert out["SAME"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out["SAME"].view(np.uint16), x.view(np.uint16))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(x.view(np.uint16), TensorProto.BFLOAT16)
    (wide,) = session.run_with_ort_values(["WIDE"], {"X": value})
    np.testing.assert_array_equal(out["WIDE"], wide.numpy())
