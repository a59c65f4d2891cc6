"""The ONNX Runtime backend's thread rule: ORT's defaults for one instance, split cores for several."""

from __future__ import annotations

import pytest

from edge_server.backends.base import InstanceSpec
from edge_server.backends.onnxruntime import OnnxRuntimeBackend, session_options, thread_policy
from edge_server.config.model import InstanceGroup, ModelConfig, TensorSpec
from edge_server.errors import ConfigError
from edge_server.loader import instance_specs

SPIN = "session.intra_op.allow_spinning"


def _specs(count: int, cpu_count: int = 4) -> list[InstanceSpec]:
    config = ModelConfig(
        name="m",
        backend="onnxruntime",
        inputs=(TensorSpec(name="x", data_type="TYPE_FP32", dims=(1,)),),
        outputs=(TensorSpec(name="y", data_type="TYPE_FP32", dims=(1,)),),
        instance_groups=(InstanceGroup(kind="KIND_CPU", count=count),),
    )
    return instance_specs(config, OnnxRuntimeBackend, cpu_count=cpu_count)


def test_one_instance_keeps_onnxruntime_defaults() -> None:
    (spec,) = _specs(1)
    assert thread_policy({}, spec, source="t") == "default"
    options = session_options({}, spec, source="t")
    assert options.intra_op_num_threads == 0  # ONNX Runtime picks one thread per core
    assert options.get_session_config_entry(SPIN) == "1"


def test_several_instances_split_the_cores_and_do_not_spin() -> None:
    specs = _specs(2)
    assert {thread_policy({}, s, source="t") for s in specs} == {"split"}
    options = session_options({}, specs[0], source="t")
    assert options.intra_op_num_threads == 2
    assert options.inter_op_num_threads == 1
    assert options.get_session_config_entry(SPIN) == "0"


def test_explicit_parameters_win() -> None:
    (spec,) = _specs(1)
    options = session_options({"thread_policy": "split"}, spec, source="t")
    assert options.intra_op_num_threads == 4 and options.get_session_config_entry(SPIN) == "0"
    params = {"intra_op_thread_count": "3", SPIN: "0"}
    options = session_options(params, spec, source="t")
    assert options.intra_op_num_threads == 3 and options.get_session_config_entry(SPIN) == "0"
    options = session_options({"thread_policy": "default"}, _specs(2)[0], source="t")
    assert options.intra_op_num_threads == 0 and options.get_session_config_entry(SPIN) == "1"


@pytest.mark.parametrize(
    ("params", "message"),
    [({"thread_policy": "fast"}, "thread_policy is 'fast'"), ({"intra_op_thread_count": "x"}, "integers")],
)
def test_bad_parameters_are_config_errors(params: dict[str, str], message: str) -> None:
    (spec,) = _specs(1)
    with pytest.raises(ConfigError, match=message):
        session_options(params, spec, source="t")
