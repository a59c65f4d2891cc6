"""``ModelInfer`` answered by grpcio's polling thread (kserve/grpc_infer.py), through the real daemon.

Calls of many clients at once land on one queue and are answered from two places: the polling thread
(a model that runs inline) and the instances' threads (one that does not).  Each client sends its own
numbers and must get its own numbers back, the daemon must survive clients that give up, and it must
stop cleanly with calls still running.  The fallback (grpcio's workers, where the queue cannot be
attached) answers the same calls the same way, checked in-process.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.daemon import Daemon, free_port, kserve_flags, wait_for

if TYPE_CHECKING:
    from edge_server.kserve.grpc_frontend import GrpcFrontend

pytestmark = pytest.mark.daemon

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: {count} }} ]
"""

#: Adds 1 to its input after sleeping ``SLEEP`` seconds (0: cheap enough to run inline).
MODEL = """
import time

import triton_python_backend_utils as pb_utils

SLEEP = {sleep}


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            if SLEEP:
                time.sleep(SLEEP)
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x + 1)]))
        return responses
"""

#: name -> (seconds each execute sleeps, instances)
MODELS = {"quick": (0, 1), "busy": (0.003, 2), "sleepy": (1.5, 1)}


def write_repository(repo: Path) -> Path:
    for name, (sleep, count) in MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, count=count))
        (repo / name / "1" / "model.py").write_text(MODEL.format(sleep=sleep))
    return repo


def start_serving(root: Path, *flags: str) -> tuple[Daemon, int]:
    """A daemon serving :data:`MODELS` from ``root / "repo"``, and its gRPC port."""
    port = free_port()
    daemon = Daemon(
        write_repository(root / "repo"),
        f"ipc://{root}/edge.sock",
        root / "daemon.log",
        *kserve_flags(free_port(), port),
        *flags,
    )
    daemon.start()
    return daemon, port


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, int]]:
    daemon, port = start_serving(tmp_path_factory.mktemp("infer-queue"))
    try:
        yield daemon, port
    finally:
        assert daemon.stop() == 0, daemon.log()


def infer(
    client: grpcclient.InferenceServerClient, model: str, x: np.ndarray, **kwargs: object
) -> np.ndarray:
    tensor = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    answer = client.infer(model, [tensor], **kwargs)  # type: ignore[arg-type]
    return answer.as_numpy("OUTPUT0")


def many_clients(port: int, model: str, clients: int = 8, calls: int = 25) -> list[str]:
    """Each client sends its own numbers ``calls`` times; what went wrong, per client."""
    problems: list[str] = []

    def run(index: int) -> None:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            for call in range(calls):
                x = np.full(4 + index, index * 1000 + call, np.float32)
                got = infer(client, model, x)
                if not np.array_equal(got, x + 1):
                    problems.append(f"client {index} call {call}: sent {x[:2]}..., got {got[:2]}...")
                    return
        except Exception as exc:  # noqa: BLE001 - reported below, per client
            problems.append(f"client {index}: {exc}")
        finally:
            client.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return problems


@pytest.mark.parametrize("model", ["quick", "busy"])
def test_many_clients_at_once_each_get_their_own_answers(served: tuple[Daemon, int], model: str) -> None:
    """``quick`` is answered from the queue's thread, ``busy`` (two instances) from the instances'."""
    daemon, port = served
    assert many_clients(port, model) == []
    assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log()


def test_both_kinds_of_model_at_once(served: tuple[Daemon, int]) -> None:
    daemon, port = served
    problems: list[str] = []
    threads = [
        threading.Thread(target=lambda m=model: problems.extend(many_clients(port, m, clients=4)))
        for model in ("quick", "busy")
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert problems == []


def test_a_client_that_gives_up_leaves_the_daemon_serving(served: tuple[Daemon, int]) -> None:
    """The answer to a call whose client gave up (its deadline passed) goes nowhere; nothing breaks."""
    daemon, port = served
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        with pytest.raises(InferenceServerException) as refused:
            infer(client, "sleepy", np.ones(3, np.float32), client_timeout=0.2)
        assert "DEADLINE_EXCEEDED" in str(refused.value.status())
        # the sleepy call still runs; others are answered meanwhile, and after it
        assert np.array_equal(infer(client, "quick", np.zeros(2, np.float32)), np.ones(2, np.float32))
        assert np.array_equal(infer(client, "sleepy", np.ones(3, np.float32)), np.full(3, 2, np.float32))
    finally:
        client.close()
    assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log()


def test_a_call_without_its_message_is_refused(served: tuple[Daemon, int]) -> None:
    """A client may end a call without sending one: grpcio's own status and text for that."""
    _daemon, port = served
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelInferResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as refused:
            call(iter(()), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "requires exactly one request message" in (refused.value.details() or "")


def test_an_unparsable_message_is_refused_with_grpcios_text(served: tuple[Daemon, int]) -> None:
    _daemon, port = served
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as refused:
            call(b"\x0a\xff\xff\xff", timeout=10)  # a name longer than the message
    assert refused.value.code() == grpc.StatusCode.INTERNAL
    assert refused.value.details() == "Exception deserializing request!"


def test_the_daemon_stops_cleanly_with_calls_running(tmp_path: Path) -> None:
    """SIGTERM while calls wait in a slow model: the daemon drains, cancels and exits 0, not a crash."""
    daemon, port = start_serving(tmp_path, "--exit-timeout-secs", "1")
    started = threading.Event()
    outcomes: list[str] = []

    def call() -> None:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            started.set()
            infer(client, "sleepy", np.ones(2, np.float32))
            outcomes.append("answered")
        except InferenceServerException as exc:
            outcomes.append(str(exc.status()))
        finally:
            client.close()

    threads = [threading.Thread(target=call) for _ in range(3)]
    try:
        for thread in threads:
            thread.start()
        started.wait(10)
        # the first call is running, the others wait for the one instance
        with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as probe:
            probe.is_server_live()
    finally:
        status = daemon.stop()
        for thread in threads:
            thread.join(30)
    assert status == 0, daemon.log()
    assert len(outcomes) == 3
    assert "double free" not in daemon.log() and "Traceback" not in daemon.log(), daemon.log()


# -- in-process: the queue and grpcio's workers answer alike ------------------------------------------


@contextlib.contextmanager
def in_process(repo: Path, **frontend: Any) -> Iterator[GrpcFrontend]:
    from edge_server.kserve.grpc_frontend import GrpcFrontend
    from edge_server.kserve.service import KServeService
    from edge_server.server import Server

    with Server(repo) as server:
        started = GrpcFrontend(KServeService(server), host="127.0.0.1", port=0, **frontend)
        started.start()
        try:
            yield started
        finally:
            started.close()


@pytest.fixture(params=["queue", "workers"])
def server_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    from edge_server.kserve import grpc_infer

    if request.param == "workers":  # a grpcio without what the queue needs
        monkeypatch.setattr(grpc_infer, "_cygrpc", lambda: None)
    return str(request.param)


@pytest.fixture
def frontend_port(server_kind: str, tmp_path: Path) -> Iterator[int]:
    with in_process(write_repository(tmp_path / "repo")) as frontend:
        assert (frontend._infer_queue is not None) == (server_kind == "queue")
        yield frontend.port


def test_model_infer_is_answered_alike_on_either_server(frontend_port: int) -> None:
    port = frontend_port
    assert many_clients(port, "busy", clients=4, calls=5) == []
    with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as client:
        assert np.array_equal(infer(client, "quick", np.arange(3, dtype=np.float32)), np.arange(1, 4))
        with pytest.raises(InferenceServerException) as unknown:
            infer(client, "nobody", np.ones(1, np.float32))
        assert unknown.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "Request for unknown model: 'nobody' is not found" in unknown.value.message()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as wrong:
            request = service_pb2.ModelInferRequest(model_name="quick")
            request.inputs.add(name="INPUT0", datatype="FP32", shape=[2])
            request.raw_input_contents.append(b"\0" * 4)  # 2 FP32s need 8 bytes
            stub.ModelInfer(request, timeout=10)
        assert wrong.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_calls_past_the_inference_count_are_refused_and_the_count_given_back(
    server_kind: str, tmp_path: Path
) -> None:
    """With 4 workers, 2 inference calls run at once (the other 2 stay for health and control); a third
    is refused at once (the queue refuses it before reading its message), and the count comes back."""
    with in_process(write_repository(tmp_path / "repo"), max_workers=4) as frontend:
        port = frontend.port
        answers: list[object] = []

        def slow() -> None:
            with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as client:
                answers.append(infer(client, "sleepy", np.ones(2, np.float32)))

        running = [threading.Thread(target=slow) for _ in range(2)]
        for thread in running:
            thread.start()
        with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as client:
            deadline = time.monotonic() + 10
            while frontend._inference < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            with pytest.raises(InferenceServerException) as refused:
                infer(client, "quick", np.ones(2, np.float32))
            assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
            assert "its limit" in refused.value.message()
            assert client.is_server_live()  # health is never refused for inference
            for thread in running:
                thread.join(30)
            assert len(answers) == 2
            assert np.array_equal(infer(client, "quick", np.ones(2, np.float32)), np.full(2, 2, np.float32))
        wait_for(lambda: frontend._inference == 0, 30, "the count given back")
