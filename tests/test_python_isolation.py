"""Python models in a process of their own (``isolation: process``), against the real daemon.

A model that calls ``os._exit`` or segfaults (``ctypes.string_at(0)``) fails only the request that
crashed it, with INSTANCE_FAILED; the daemon and the other models keep serving, the version's other
instance answers at once, and the crashed instance is back after its restart.  Normal requests get
exactly what the same model answers in the daemon's thread; a hanging ``initialize()`` is killed at
its load timeout.
"""

from __future__ import annotations

import os
import re
import signal
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from edge_server.client import Client
from edge_server.errors import EdgeServerError
from tests.daemon import Daemon, build_repository, python_stubs, start_daemon, stop_daemon

CRASH_CONFIG = """
name: "%(name)s"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU, count: %(count)d } ]
parameters [
  { key: "isolation", value: { string_value: "process" } },
  { key: "instance_restart_backoff_s", value: { string_value: "0.05" } }
]
"""

CRASH_MODEL = """
import ctypes
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        # A (re)start waits while the test holds it: a file "hold" in the model's directory.
        while os.path.exists(os.path.join(args["model_repository"], "hold")):
            time.sleep(0.01)

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if x.size and x[0] == 13:
                os._exit(1)
            if x.size and x[0] == 11:
                ctypes.string_at(0)  # reads address 0: SIGSEGV
            if x.size and x[0] == 7:
                time.sleep(600)  # stuck in user code
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * 3)]))
        return responses
"""

MIXED_CONFIG = """
name: "%(name)s"
backend: "python"
max_batch_size: 8
input [
  { name: "TEXT", data_type: TYPE_STRING, dims: [ -1 ] },
  { name: "X", data_type: TYPE_FP32, dims: [ -1 ] },
  { name: "N", data_type: TYPE_INT64, dims: [ 1 ] }
]
output [
  { name: "UPPER", data_type: TYPE_STRING, dims: [ -1 ] },
  { name: "X2", data_type: TYPE_FP32, dims: [ -1 ] },
  { name: "SUM", data_type: TYPE_INT64, dims: [ 1 ] },
  { name: "POS", data_type: TYPE_BOOL, dims: [ -1 ] }
]
dynamic_batching { max_queue_delay_microseconds: 2000 }
parameters [ { key: "isolation", value: { string_value: "%(isolation)s" } } ]
"""

MIXED_MODEL = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.instance = args["model_instance_name"]

    def execute(self, requests):
        if any(pb_utils.get_input_tensor_by_name(r, "N").as_numpy()[0, 0] == -3 for r in requests):
            raise pb_utils.TritonError("the whole batch is refused", pb_utils.TritonError.UNAVAILABLE)
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            n = pb_utils.get_input_tensor_by_name(request, "N").as_numpy()
            if n[0, 0] == -1:
                error = pb_utils.TritonError("n must not be -1", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            if n[0, 0] == -2:
                raise ValueError("user code blew up")
            if n[0, 0] == -4:  # a BLS call (in a process: over its pipe)
                text_in = pb_utils.Tensor("TEXT", np.array([b"bls"], dtype=object))
                bls = pb_utils.InferenceRequest(
                    model_name="text", inputs=[text_in], requested_output_names=["UPPER"]
                )
                response = bls.exec()
                if response.has_error():
                    raise pb_utils.TritonError(response.error().message())
                answer = pb_utils.get_output_tensor_by_name(response, "UPPER").as_numpy()
                n = n * 0 + len(answer[0])
            upper = np.array([bytes(v).upper() for v in text.reshape(-1)], dtype=object)
            outputs = {
                "UPPER": upper.reshape(text.shape),
                "X2": (x * 2).astype(np.float32),
                "SUM": n + len(json.loads(request.parameters())),
                "POS": x > 0,
            }
            wanted = request.requested_output_names()
            tensors = [pb_utils.Tensor(name, value) for name, value in outputs.items() if name in wanted]
            responses.append(pb_utils.InferenceResponse(tensors))
        return responses
"""

SLOW_PARAMETERS = """
parameters [ { key: "isolation_execute_timeout_s", value: { string_value: "1" } } ]
"""

HANG_CONFIG = """
name: "hang"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
parameters [
  { key: "isolation", value: { string_value: "process" } },
  { key: "isolation_init_timeout_s", value: { string_value: "2" } }
]
"""

HANG_MODEL = """
import time


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(600)

    def execute(self, requests):
        return []
"""


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


@pytest.fixture(scope="module")
def iso_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("iso")
    repo = build_repository(root)
    for name, count in (("crash", 2), ("crash1", 1)):
        _write(repo / name / "config.pbtxt", CRASH_CONFIG % {"name": name, "count": count})
        _write(repo / name / "1" / "model.py", CRASH_MODEL)
    for isolation in ("thread", "process"):
        name = f"mixed_{isolation}"
        _write(repo / name / "config.pbtxt", MIXED_CONFIG % {"name": name, "isolation": isolation})
        _write(repo / name / "1" / "model.py", MIXED_MODEL)
    slow = CRASH_CONFIG % {"name": "slow", "count": 1} + SLOW_PARAMETERS
    _write(repo / "slow" / "config.pbtxt", slow)
    _write(repo / "slow" / "1" / "model.py", CRASH_MODEL)
    bogus = CRASH_CONFIG.replace('"process"', '"Process"') % {"name": "bogus", "count": 1}
    _write(repo / "bogus" / "config.pbtxt", bogus)
    _write(repo / "bogus" / "1" / "model.py", CRASH_MODEL)
    _write(repo / "hang" / "config.pbtxt", HANG_CONFIG)
    _write(repo / "hang" / "1" / "model.py", HANG_MODEL)
    # bogus and hang are refused at load, on purpose: the daemon serves the rest and says it is ready
    proc = start_daemon(root, repo, "iso.sock", "--exit-on-error", "false", "--strict-readiness", "false")
    try:
        yield proc
    finally:
        assert stop_daemon(proc) == 0, proc.log()


@pytest.fixture
def client(iso_daemon: Daemon) -> Iterator[Client]:
    with Client(iso_daemon.address, timeout=30) as c:
        yield c


def _stubs(daemon: Daemon) -> dict[str, int]:
    """The daemon's stub processes now: instance label -> pid."""
    return python_stubs(daemon.pid)


def _healthy(client: Client, daemon: Daemon) -> None:
    """The daemon is alive and its other models answer."""
    assert daemon.proc is not None and daemon.proc.poll() is None
    assert client.server_ready()
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(client.infer("identity", {"INPUT0": x})["OUTPUT0"], x)
    text = np.array([b"ok"], dtype=object)
    assert client.infer("text", {"TEXT": text})["UPPER"].tolist() == [b"OK"]


def _crash(client: Client, model: str, value: float) -> EdgeServerError:
    with pytest.raises(EdgeServerError) as info:
        client.infer(model, {"IN": np.array([value, 1.0], np.float32)})
    assert info.value.code == "INSTANCE_FAILED", info.value
    return info.value


def test_os_exit_fails_its_request_and_the_instance_comes_back(client: Client, iso_daemon: Daemon) -> None:
    before = _stubs(iso_daemon)["crash1_0_0"]
    error = _crash(client, "crash1", 13)
    assert f"process {before} exited with status 1" in error.message
    _healthy(client, iso_daemon)
    # The only instance restarts after its back-off; a request sent meanwhile waits for it.
    out = client.infer("crash1", {"IN": np.array([2.0], np.float32)})["OUT"]
    np.testing.assert_array_equal(out, np.array([6.0], np.float32))
    after = _stubs(iso_daemon)["crash1_0_0"]
    assert after != before
    assert "instance crash1_0_0 restarted" in iso_daemon.log()


def test_segfault_fails_its_request_and_the_instance_comes_back(client: Client, iso_daemon: Daemon) -> None:
    error = _crash(client, "crash1", 11)
    assert "was killed by SIGSEGV" in error.message
    _healthy(client, iso_daemon)
    out = client.infer("crash1", {"IN": np.array([4.0], np.float32)})["OUT"]
    np.testing.assert_array_equal(out, np.array([12.0], np.float32))


def test_a_process_killed_while_idle_is_replaced_before_a_request_reaches_it(
    client: Client, iso_daemon: Daemon
) -> None:
    victim = _stubs(iso_daemon)["crash1_0_0"]
    os.kill(victim, signal.SIGKILL)  # what the OOM killer does
    deadline = time.monotonic() + 40
    while _stubs(iso_daemon).get("crash1_0_0", victim) == victim:
        assert time.monotonic() < deadline, "the killed instance was not replaced"
        time.sleep(0.05)
    assert "was killed by SIGKILL while idle" in iso_daemon.log()
    out = client.infer("crash1", {"IN": np.array([1.0], np.float32)})["OUT"]
    np.testing.assert_array_equal(out, np.array([3.0], np.float32))
    _healthy(client, iso_daemon)


def test_the_versions_other_instance_serves_during_the_restart(client: Client, iso_daemon: Daemon) -> None:
    hold = iso_daemon.repository / "crash" / "hold"
    hold.touch()  # the crashed instance's restart waits in initialize() until the test lets it go
    try:
        _crash(client, "crash", 11)
        out = client.infer("crash", {"IN": np.array([5.0], np.float32)})["OUT"]
        np.testing.assert_array_equal(out, np.array([15.0], np.float32))
        assert not re.search(r"instance crash_0_\d restarted", iso_daemon.log_path.read_text())
    finally:
        hold.unlink()
    deadline = time.monotonic() + 15
    while not re.search(r"instance crash_0_\d restarted", iso_daemon.log_path.read_text()):
        assert time.monotonic() < deadline, "the failed instance was not restarted"
        time.sleep(0.05)


def _mixed_request(i: int) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    rng = np.random.default_rng(i)
    width = 1 + i % 5
    words = [f"wörd-{i}-{k}".encode() for k in range(width)] + [b""]
    inputs = {
        "TEXT": np.array([words], dtype=object),
        "X": rng.standard_normal((1, 3 + i)).astype(np.float32),
        "N": np.array([[i * 1000]], np.int64),
    }
    return inputs, {"parameters": {"a": 1, "b": "two"}} if i % 2 else {}


def test_results_equal_the_thread_mode(client: Client, iso_daemon: Daemon) -> None:
    requests = [_mixed_request(i) for i in range(24)]
    big = np.random.default_rng(99).standard_normal((1, 1 << 20)).astype(np.float32)  # 4 MiB: the arena grows
    requests.append(
        ({"TEXT": np.array([[b"big"]], dtype=object), "X": big, "N": np.zeros((1, 1), np.int64)}, {})
    )

    def run(model: str) -> list[dict[str, np.ndarray]]:
        with ThreadPoolExecutor(6) as pool:  # concurrent: dynamic batches of several requests
            return list(pool.map(lambda r: client.infer(model, r[0], **r[1]), requests))

    threaded, isolated = run("mixed_thread"), run("mixed_process")
    for want, got in zip(threaded, isolated, strict=True):
        assert sorted(want) == sorted(got) == ["POS", "SUM", "UPPER", "X2"]
        for name in want:
            assert want[name].dtype == got[name].dtype and want[name].shape == got[name].shape, name
            assert want[name].tolist() == got[name].tolist(), name
    x = requests[3][0]["X"]
    np.testing.assert_array_equal(isolated[3]["X2"], x * 2)
    assert isolated[3]["SUM"].tolist() == [[3002]]
    one = client.infer("mixed_process", requests[0][0], outputs=["SUM"])
    assert list(one) == ["SUM"]


@pytest.mark.parametrize(
    ("n", "code"), [(-1, "INVALID_ARGUMENT"), (-2, "EXECUTION_FAILED"), (-3, "UNAVAILABLE")]
)
def test_model_errors_equal_the_thread_mode(client: Client, n: int, code: str) -> None:
    inputs, _ = _mixed_request(1)
    inputs["N"] = np.array([[n]], np.int64)
    errors = []
    for model in ("mixed_thread", "mixed_process"):
        with pytest.raises(EdgeServerError) as info:
            client.infer(model, inputs)
        errors.append((info.value.code, info.value.message.replace(model, "M")))
    assert errors[0] == errors[1]
    assert errors[0][0] == code
    inputs["N"] = np.array([[1]], np.int64)
    assert client.infer("mixed_process", inputs)["SUM"].tolist() == [[1]]


def test_a_hanging_initialize_is_killed_at_its_load_timeout(client: Client, iso_daemon: Daemon) -> None:
    (hang,) = [m for m in client.models() if m["name"] == "hang"]
    assert hang["state"] != "READY"
    assert "took more than 2 s" in hang["reason"] and "the process was killed" in hang["reason"]
    assert not [label for label in _stubs(iso_daemon) if label.startswith("hang")]
    with pytest.raises(EdgeServerError, match="took more than 2 s"):
        client.load_model("hang")
    _healthy(client, iso_daemon)


def test_unload_ends_the_models_processes(client: Client, iso_daemon: Daemon) -> None:
    assert "mixed_process_0" in _stubs(iso_daemon)
    client.unload_model("mixed_process")
    assert "mixed_process_0" not in _stubs(iso_daemon)
    client.load_model("mixed_process")
    inputs, _ = _mixed_request(2)
    assert client.infer("mixed_process", inputs)["SUM"].tolist() == [[2000]]


def test_an_unknown_isolation_mode_is_refused_at_load(client: Client) -> None:
    (bogus,) = [m for m in client.models() if m["name"] == "bogus"]
    assert bogus["state"] != "READY"
    assert "'isolation'" in bogus["reason"] and "['thread', 'process'], got 'Process'" in bogus["reason"]


def test_an_execute_past_its_timeout_is_killed_and_the_instance_restarted(
    client: Client, iso_daemon: Daemon
) -> None:
    with pytest.raises(EdgeServerError) as info:
        client.infer("slow", {"IN": np.array([7.0], np.float32)})
    assert info.value.code == "INSTANCE_FAILED"
    assert "was killed by SIGKILL after execute() ran past 1 s" in info.value.message
    out = client.infer("slow", {"IN": np.array([1.0], np.float32)})["OUT"]
    np.testing.assert_array_equal(out, np.array([3.0], np.float32))


def test_bls_calls_work_the_same_in_a_process(client: Client) -> None:
    inputs, _ = _mixed_request(1)
    inputs["N"] = np.array([[-4]], np.int64)
    assert client.infer("mixed_thread", inputs)["SUM"].tolist() == [[3]]
    assert client.infer("mixed_process", inputs)["SUM"].tolist() == [[3]]  # over the stub's pipe
