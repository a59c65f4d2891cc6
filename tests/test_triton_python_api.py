"""Python models use pb_utils as Triton's own examples and QA models do, in-process and over IPC."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_server import Server
from edge_server.backends import pb_autocomplete, pb_utils
from edge_server.client import Client
from edge_server.errors import (
    AlreadyExists,
    Cancelled,
    EdgeServerError,
    InvalidArgument,
    ModelExecutionError,
    ModelUnknownError,
    NotFound,
    Unavailable,
    Unsupported,
)
from edge_server.request import InferRequest
from edge_server.scheduler import inline
from tests import triton_models
from tests.daemon import Daemon

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

CODES = [
    (pb_utils.TritonError.INVALID_ARG, InvalidArgument, "INVALID_ARGUMENT"),
    (pb_utils.TritonError.NOT_FOUND, NotFound, "NOT_FOUND"),
    (pb_utils.TritonError.UNAVAILABLE, Unavailable, "UNAVAILABLE"),
    (pb_utils.TritonError.UNSUPPORTED, Unsupported, "UNSUPPORTED"),
    (pb_utils.TritonError.ALREADY_EXISTS, AlreadyExists, "ALREADY_EXISTS"),
    (pb_utils.TritonError.CANCELLED, Cancelled, "CANCELLED"),
    (pb_utils.TritonError.INTERNAL, ModelExecutionError, "EXECUTION_FAILED"),
    (pb_utils.TritonError.UNKNOWN, ModelUnknownError, "UNKNOWN"),
]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return triton_models.build(tmp_path_factory.mktemp("triton") / "repo")


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[Server]:
    with Server(repository) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    root = tmp_path_factory.mktemp("sock")
    daemon = Daemon(repository, f"ipc://{root}/t.sock", root / "t.log").start()
    try:
        with Client(daemon.address, timeout=30) as c:
            yield c
    finally:
        assert daemon.stop() == 0, daemon.log()


def probe_info(outputs: dict[str, np.ndarray]) -> dict:
    (info,) = outputs["INFO"]
    assert type(info) is bytes
    return json.loads(info)


def test_args_hold_exactly_tritons_keys_and_formats(server: Server, repository: Path) -> None:
    info = probe_info(server.infer("probe", {"CODE": np.zeros(1, np.int32)}))
    args = info["args"]
    assert sorted(args) == [
        "model_config",
        "model_instance_device_id",
        "model_instance_kind",
        "model_instance_name",
        "model_name",
        "model_repository",
        "model_version",
    ]
    assert all(isinstance(v, str) for v in args.values())
    assert args["model_instance_name"] in ("probe_0_0", "probe_0_1")  # <group name>_<index>
    assert args["model_instance_kind"] == "CPU"
    assert args["model_instance_device_id"] == "0"
    assert args["model_name"] == "probe" and args["model_version"] == "1"
    assert Path(args["model_repository"]) == repository / "probe"
    assert info["dir_at_init"] == info["dir"] == str(repository / "probe" / "1")
    config = info["config"]
    assert config["instance_group"][0]["name"] == "probe_0"
    assert config["model_transaction_policy"] == {"decoupled": False}
    assert config["optimization"]["input_pinned_memory"] == {"enable": True}
    assert config["parameters"] == {"greeting": {"string_value": "hello"}}
    assert config["input"][0]["optional"] is False and config["input"][0]["dims"] == [1]
    assert config["output"][0]["data_type"] == "TYPE_STRING"


def test_request_accessors_come_from_the_request(server: Server) -> None:
    request = InferRequest(
        model="probe",
        inputs={"CODE": np.zeros(1, np.int32)},
        request_id="req-7",
        correlation_id=42,
        sequence_start=True,
        timeout_us=1_500_000,
        outputs=["INFO"],
    )
    info = probe_info(server._dataplane.run_here(request, inline.FRONTEND).result())
    assert info["request_id"] == "req-7"
    assert info["correlation_id"] == 42
    assert info["flags"] == pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
    assert info["timeout"] == 1_500_000
    assert info["requested"] == ["INFO"]


def test_dlpack_round_trip_and_logger(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="edge_server.models"):
        out = server.infer("probe", {"CODE": np.zeros(1, np.int32)})
    np.testing.assert_array_equal(out["DL"], np.arange(3, dtype=np.float32))
    records = [r for r in caplog.records if r.name == "edge_server.models"]
    levels = {r.getMessage().split(": ", 1)[1]: r.levelno for r in records}
    assert levels == {
        "code 0": logging.WARNING,
        "verbose detail": logging.DEBUG,
        "at error level": logging.ERROR,
    }
    assert all(r.getMessage().startswith("probe_0_") for r in records)
    assert {Path(r.pathname).name for r in records} == {"model.py"}  # the model's own line


@pytest.mark.parametrize(("code", "cls", "wire"), [c for c in CODES if c[0]])
def test_triton_error_codes_reach_the_caller_in_process(
    server: Server, code: int, cls: type[EdgeServerError], wire: str
) -> None:
    with pytest.raises(cls) as info:
        server.infer("probe", {"CODE": np.array([code], np.int32)})
    assert info.value.code == wire
    assert f"code {code} asked for" in info.value.message


@pytest.mark.parametrize(("code", "cls", "wire"), [c for c in CODES if c[0]])
def test_triton_error_codes_reach_an_ipc_client(
    client: Client, code: int, cls: type[EdgeServerError], wire: str
) -> None:
    with pytest.raises(EdgeServerError) as info:
        client.infer("probe", {"CODE": np.array([code], np.int32)})
    assert info.value.code == wire
    assert isinstance(info.value, cls)
    assert f"code {code} asked for" in info.value.message


def test_unknown_code_and_model_exception_are_execution_failures(server: Server) -> None:
    with pytest.raises(ModelExecutionError, match="code 100 asked for"):
        server.infer("probe", {"CODE": np.array([100], np.int32)})
    with pytest.raises(ModelExecutionError, match="the model gave up"):
        server.infer("probe", {"CODE": np.array([-1], np.int32)})


def test_response_parameters_follow_tritons_rules() -> None:
    response = pb_utils.InferenceResponse([], parameters={"a": 1, "b": "x", "c": True})
    assert json.loads(response.parameters()) == {"a": 1, "b": "x", "c": True}
    assert pb_utils.InferenceResponse([]).parameters() == "{}"
    with pytest.raises(pb_utils.TritonModelException, match="bool/int/str"):
        pb_utils.InferenceResponse([], parameters={"a": 1.5})


def test_dlpack_refuses_strings() -> None:
    with pytest.raises(pb_utils.TritonModelException, match="string"):
        pb_utils.Tensor("s", np.array([b"a"], dtype=object)).to_dlpack()


# --- auto-complete ModelConfig: Triton's conflict checks ------------------------------------------


def holder(**config: object) -> pb_autocomplete.ModelConfig:
    base: dict[str, object] = {"name": "m", "max_batch_size": 0, "input": [], "output": []}
    base.update(config)
    return pb_utils.ModelConfig(json.dumps(base))


def test_auto_complete_conflicts_are_errors() -> None:
    with pytest.raises(ValueError, match="max_batch_size 8"):
        holder(max_batch_size=8).set_max_batch_size(4)
    with pytest.raises(ValueError, match="sequence_batching"):
        holder(sequence_batching={}).set_dynamic_batching()
    existing = [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}]
    with pytest.raises(ValueError, match="expects datatype TYPE_FP32"):
        holder(input=existing).add_input({"name": "x", "data_type": "TYPE_INT32", "dims": [4]})
    with pytest.raises(ValueError, match="dims"):
        holder(input=existing).add_input({"name": "x", "data_type": "TYPE_FP32", "dims": [5]})
    with pytest.raises(ValueError, match="missing 'dims'"):
        holder().add_output({"name": "y", "data_type": "TYPE_FP32"})
    with pytest.raises(ValueError, match="'reshape'"):
        holder().add_output({"name": "y", "data_type": "TYPE_FP32", "dims": [1], "reshape": [1]})
    with pytest.raises(ValueError, match="other than 'decoupled'"):
        holder().set_model_transaction_policy({"streaming": True})
    with pytest.raises(ValueError, match="decoupled"):
        holder(model_transaction_policy={"decoupled": True}).set_model_transaction_policy(
            {"decoupled": False}
        )


def test_auto_complete_fills_and_keeps_explicit_values() -> None:
    config = holder(max_batch_size=2, input=[{"name": "x", "data_type": "TYPE_INVALID", "dims": []}])
    config.set_max_batch_size(16)  # the explicit, smaller value is kept
    config.add_input({"name": "x", "data_type": "TYPE_FP32", "dims": [3]})
    config.add_input({"name": "x", "data_type": "TYPE_FP32", "dims": [3]})  # same again: fine
    config.set_dynamic_batching()
    config.set_model_transaction_policy({"decoupled": True})
    d = config.as_dict()
    assert d["max_batch_size"] == 2
    assert d["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [3]}]
    assert d["dynamic_batching"] == {} and d["model_transaction_policy"] == {"decoupled": True}


NONE_MODEL = """
class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [1]})

    def execute(self, requests):
        return []
"""

CONFLICT_MODEL = """
class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "IN", "data_type": "TYPE_INT64", "dims": [1]})
        return config

    def execute(self, requests):
        return []
"""


@pytest.mark.parametrize(
    ("config", "model", "reason"),
    [
        ('backend: "python"', NONE_MODEL, "returned None"),
        (
            'backend: "python"\ninput [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
            'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]',
            CONFLICT_MODEL,
            "configuration expects datatype TYPE_FP32 for input 'IN', model provides TYPE_INT64",
        ),
    ],
)
def test_auto_complete_errors_fail_the_load_with_the_reason(
    tmp_path: Path, config: str, model: str, reason: str
) -> None:
    triton_models.write(tmp_path / "m" / "config.pbtxt", config)
    triton_models.write(tmp_path / "m" / "1" / "model.py", model)
    with Server(tmp_path) as server:
        (status,) = server.models()
        assert status.state.value == "UNAVAILABLE"
        assert reason in status.reason


DECOUPLED_BY_AUTO_COMPLETE = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "N", "data_type": "TYPE_INT32", "dims": [1]})
        config.add_output({"name": "I", "data_type": "TYPE_INT32", "dims": [1]})
        config.set_model_transaction_policy({"decoupled": True})
        return config

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            for i in range(n):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("I", np.array([i], np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def test_auto_complete_can_make_a_model_decoupled(tmp_path: Path) -> None:
    triton_models.write(tmp_path / "counter" / "1" / "model.py", DECOUPLED_BY_AUTO_COMPLETE)
    with Server(tmp_path) as server:
        assert server.model_config("counter").decoupled
        with server.stream("counter", {"N": np.array([3], np.int32)}) as responses:
            assert [r["I"].tolist() for r in responses] == [[0], [1], [2]]


def test_byte_tensor_serialisation_and_type_numbers() -> None:
    strings = np.array([[b"ab", b""], ["ü".encode(), b"xyz"]], dtype=object)
    flat = pb_utils.serialize_byte_tensor(strings)
    assert flat.dtype == np.uint8
    assert bytes(flat) == b"\x02\x00\x00\x00ab\x00\x00\x00\x00\x02\x00\x00\x00\xc3\xbc\x03\x00\x00\x00xyz"
    assert pb_utils.deserialize_bytes_tensor(flat).tolist() == [b"ab", b"", "ü".encode(), b"xyz"]
    with pytest.raises(pb_utils.TritonModelException, match="length prefix"):
        pb_utils.deserialize_bytes_tensor(np.array([1, 0], np.uint8))
    assert pb_utils.triton_to_numpy_type(11) is np.float32
    assert pb_utils.triton_to_numpy_type(13) is np.object_
    assert pb_utils.numpy_to_triton_type(np.int64) == 9
    assert pb_utils.numpy_to_triton_type(np.object_) == 13
    assert pb_utils.triton_to_numpy_type(0) is None
