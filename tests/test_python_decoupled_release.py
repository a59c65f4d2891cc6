"""How a decoupled Python model's request ends when the model does not end it, in both isolation modes.

One rule for the thread and the process mode, through the daemon and its real clients (IPC, and
tritonclient's gRPC stream): a request the model lets go without the final flag (its sender
collected) ends its stream with an error naming the model; a request the client cancelled ends once
the model lets it go or sends the final flag; a request whose process is killed ends with
INSTANCE_FAILED.  Every one of them gives its body back to the user's budget (a stream's body
counts there until its final response).  A model that keeps the sender is left to finish.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from queue import Queue

import numpy as np
import pytest

from edge_server.client import Client
from edge_server.errors import InstanceFailed, ModelExecutionError, ReplyTimeout
from tests.daemon import Daemon, free_port, kserve_flags, wait_for

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

MODEL = """
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.kept = []

    def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            n = int(x[0])
            if n == 1:  # answers once, then lets the request go without the final flag
                request.get_response_sender().send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
            elif n == 2:  # keeps the sender (after saying where it runs): never ended by the server
                sender = request.get_response_sender()
                pid = np.array([os.getpid()], np.int32)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pid)]))
                self.kept.append(sender)
            elif n in (3, 4, 5):  # answers until the client cancels; then lets it go (3) or ends it (4, 5)
                threading.Thread(target=self.until_cancelled, args=(request.get_response_sender(), n)).start()
        return None

    def until_cancelled(self, sender, n):
        out = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([n], np.int32))])
        sender.send(out)
        while not sender.is_cancelled():
            if n != 5:  # 5 answers once, then only waits to be cancelled
                sender.send(out)
            time.sleep(0.02)
        if n != 3:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
{extra}
"""

ISOLATED = 'parameters [ { key: "isolation", value: { string_value: "process" } } ]'
MODELS = {"dropper": "", "dropper_isolated": ISOLATED}
LET_GO = "released a request without sending its final response"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("release")
    repo = root / "repo"
    for name, extra in MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(MODEL)
        (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, extra=extra))
    grpc_port = free_port()
    proc = Daemon(repo, f"ipc://{root}/r.sock", root / "r.log", *kserve_flags(free_port(), grpc_port))
    proc.grpc_port = grpc_port  # type: ignore[attr-defined]
    proc.start()
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.fixture
def client(daemon: Daemon) -> Iterator[Client]:
    with Client(daemon.address, timeout=30) as c:
        yield c


def _in(n: int) -> dict[str, np.ndarray]:
    return {"IN": np.array([n], np.int32)}


def _held(client: Client) -> int:
    """The bodies counted in the budget (a stream's until its final response), in bytes."""
    return int(client.ipc_status()["limits"]["body_bytes_in_flight"])


def _given_back(client: Client, before: int) -> None:
    wait_for(lambda: _held(client) == before, 30, what="the streams' bodies to be given back")


@pytest.mark.parametrize("model", list(MODELS))
def test_a_request_let_go_without_its_final_response_ends_its_ipc_stream(client: Client, model: str) -> None:
    before = _held(client)
    with pytest.raises(ModelExecutionError, match=f"model '{model}' {LET_GO}"):
        next(client.stream(model, _in(0), timeout=30))
    stream = client.stream(model, _in(1), timeout=30)
    assert int(next(stream)["OUT"][0]) == 1
    with pytest.raises(ModelExecutionError, match=LET_GO):
        next(stream)
    _given_back(client, before)


@pytest.mark.parametrize("model", list(MODELS))
def test_a_request_let_go_without_its_final_response_ends_its_grpc_stream(daemon: Daemon, model: str) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    got: Queue = Queue()
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{daemon.grpc_port}")  # type: ignore[attr-defined]
    grpc.start_stream(callback=lambda result, error: got.put(error or result))
    try:
        tensor = grpcclient.InferInput("IN", [1], "INT32")
        tensor.set_data_from_numpy(np.array([1], np.int32))
        grpc.async_stream_infer(model, [tensor], request_id="let-go")
        assert int(got.get(timeout=30).as_numpy("OUT")[0]) == 1
        error = got.get(timeout=30)
        assert isinstance(error, InferenceServerException), error
        assert f"model '{model}' {LET_GO}" in str(error.message())
    finally:
        grpc.stop_stream()
        grpc.close()


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("n", [3, 4, 5], ids=["let-go", "final-flag", "silent"])
def test_a_cancelled_request_gives_its_body_back_once_the_model_ends_it(
    client: Client, model: str, n: int
) -> None:
    """The model's last word on a cancelled request (the final flag, or letting it go) is not sent to
    the client, but it still ends the request in the daemon (its process's too); a model that sends
    nothing more learns of the cancellation all the same (``is_cancelled()``)."""
    before = _held(client)
    with client.stream(model, _in(n), timeout=30) as stream:
        assert int(next(stream)["OUT"][0]) == n
    _given_back(client, before)


@pytest.mark.parametrize("model", list(MODELS))
def test_a_classified_stream_is_cancelled_the_same(client: Client, model: str) -> None:
    """A stream with the classification extension is cancelled through the sink that classifies it."""
    before = _held(client)
    with client.stream(model, _in(5), timeout=30, classification={"OUT": 1}) as stream:
        assert next(stream)["OUT"].tolist() == [b"5:0"]
    _given_back(client, before)


def test_a_kept_request_waits_for_its_model_and_ends_when_its_process_is_killed(client: Client) -> None:
    before = _held(client)
    kept = client.stream("dropper_isolated", _in(2), timeout=0.5)
    waiting = client.stream("dropper_isolated", _in(2), timeout=30)
    pids = {int(next(stream)["OUT"][0]) for stream in (kept, waiting)}
    with pytest.raises(ReplyTimeout):  # still the model's to finish: it keeps the sender
        next(kept)
    kept.close()  # cancelled: the model could see it, but it keeps the sender and sends nothing more
    assert len(pids) == 1
    os.kill(pids.pop(), signal.SIGKILL)
    with pytest.raises(InstanceFailed, match="killed by SIGKILL"):
        next(waiting)
    _given_back(client, before)  # the cancelled one's too
    with pytest.raises(ModelExecutionError, match=LET_GO):  # the restarted instance serves again
        next(client.stream("dropper_isolated", _in(0), timeout=60))
