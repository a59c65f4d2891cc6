"""``await request.async_exec(decoupled=True)`` waits for the first response without blocking the loop.

Triton's ``async_exec`` runs the call in the event loop's executor and hands back the response
iterator once the first response is there (L0_backend_python async_execute,
``test_concurrent_execute_multi_request_bls``): an ``async def execute`` that awaits it and then
iterates lets the model's other requests run meanwhile.  Through the daemon and tritonclient's gRPC
stream: the called model answers each request with how many of them were inside it at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from queue import Queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.daemon import Daemon, free_port, kserve_flags

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

REQUESTS = 4

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
"""

# Waits (up to 20 s, a bound against a deadlock, not a timing) until REQUESTS requests are inside it at
# once; answers each with the most it saw.
GATHERING = f"""
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.inside = 0
        self.most = 0

    async def _one(self, request):
        self.inside += 1
        self.most = max(self.most, self.inside)
        for _ in range(200):
            if self.most >= {REQUESTS}:
                break
            await asyncio.sleep(0.1)
        self.inside -= 1
        out = pb_utils.Tensor("OUT", np.array([self.most], np.int32))
        sender = request.get_response_sender()
        sender.send(pb_utils.InferenceResponse([out]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    async def execute(self, requests):
        await asyncio.gather(*(self._one(r) for r in requests))
        return None
"""

# Calls "gathering" per request as Triton's async_execute_decouple_bls does: await, then iterate.
CALLER = """
import asyncio
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def _one(self, request):
        call = pb_utils.InferenceRequest(
            model_name="gathering",
            inputs=[pb_utils.get_input_tensor_by_name(request, "IN")],
            requested_output_names=["OUT"],
        )
        responses = await call.async_exec(decoupled=True)
        sender = request.get_response_sender()
        for response in responses:
            if response.has_error():
                raise pb_utils.TritonModelException(response.error().message())
            out = pb_utils.get_output_tensor_by_name(response, "OUT")
            if out is not None:
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out.as_numpy())]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    async def execute(self, requests):
        await asyncio.gather(*(self._one(r) for r in requests))
        return None
"""


# An async decoupled execute that raises: the client gets the error, the log its "Type: message" line
# (L0_backend_python async_execute test_model_raise_exception reads the server log for it).
RAISER = """
class TritonPythonModel:
    async def execute(self, requests):
        raise ValueError("wait_secs cannot be negative")
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, int]]:
    root = tmp_path_factory.mktemp("abls")
    repo = root / "repo"
    for name, source in (("gathering", GATHERING), ("caller", CALLER), ("raiser", RAISER)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name))
        (repo / name / "1" / "model.py").write_text(source)
    http_port, grpc_port = free_port(), free_port()
    daemon = Daemon(repo, f"ipc://{root}/a.sock", root / "a.log", *kserve_flags(http_port, grpc_port))
    daemon.start()
    try:
        yield daemon, grpc_port
    finally:
        assert daemon.stop() == 0, daemon.log()


@pytest.fixture
def client(daemon: tuple[Daemon, int]) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(f"127.0.0.1:{daemon[1]}")


def test_awaited_decoupled_bls_calls_of_concurrent_requests_run_together(
    client: grpcclient.InferenceServerClient,
) -> None:
    got: Queue = Queue()
    client.start_stream(callback=lambda result, error: got.put(error or result))
    try:
        for i in range(REQUESTS):
            inp = grpcclient.InferInput("IN", [1], "INT32")
            inp.set_data_from_numpy(np.array([i], np.int32))
            client.async_stream_infer("caller", [inp], request_id=str(i))
        seen = []
        for _ in range(REQUESTS):
            item = got.get(timeout=120)
            if isinstance(item, InferenceServerException):
                raise item
            seen.append(int(item.as_numpy("OUT")[0]))
    finally:
        client.stop_stream()
    assert seen == [REQUESTS] * REQUESTS


def test_an_async_execute_that_raises_is_logged_with_its_type_and_message(
    daemon: tuple[Daemon, int], client: grpcclient.InferenceServerClient
) -> None:
    got: Queue = Queue()
    client.start_stream(callback=lambda result, error: got.put(error or result))
    try:
        inp = grpcclient.InferInput("IN", [1], "INT32")
        inp.set_data_from_numpy(np.array([-1], np.int32))
        client.async_stream_infer("raiser", [inp])
        assert "ValueError: wait_secs cannot be negative" in str(got.get(timeout=60))
    finally:
        client.stop_stream()
    assert "ValueError: wait_secs cannot be negative" in daemon[0].log()
