"""Triton's ``triton_grpc_error`` stream mode: with that header set to "true", the first error on a
gRPC stream ends the whole stream with the error's gRPC status; without it the error is a message on
the stream, which goes on.  From Triton's QA (L0_backend_python lifecycle ``test_triton_grpc_error_*``).
"""

from __future__ import annotations

import queue
import textwrap
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.daemon import Daemon, free_port, kserve_flags

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

CONFIG = """
name: "picky"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]
"""
MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if x[0] < 0:
                error = pb_utils.TritonError("negative input", pb_utils.TritonError.INTERNAL)
                responses.append(pb_utils.InferenceResponse(error=error))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * 2)]))
        return responses
"""


@pytest.fixture(scope="module")
def grpc_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    root = tmp_path_factory.mktemp("grpc_error")
    (root / "repo" / "picky" / "1").mkdir(parents=True)
    (root / "repo" / "picky" / "config.pbtxt").write_text(textwrap.dedent(CONFIG))
    (root / "repo" / "picky" / "1" / "model.py").write_text(textwrap.dedent(MODEL))
    http_port, port = free_port(), free_port()
    daemon = Daemon(root / "repo", f"ipc://{root}/d.sock", root / "d.log", *kserve_flags(http_port, port))
    daemon.start()
    try:
        yield port
    finally:
        assert daemon.stop() == 0, daemon.log()


def _send(client: grpcclient.InferenceServerClient, value: float) -> None:
    tensor = grpcclient.InferInput("IN", [1], "FP32")
    tensor.set_data_from_numpy(np.array([value], np.float32))
    client.async_stream_infer("picky", [tensor])


@pytest.mark.parametrize("mode", [True, False])
def test_an_error_ends_the_stream_only_in_tritons_grpc_error_mode(grpc_port: int, mode: bool) -> None:
    got: queue.Queue[tuple[object, object]] = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    headers = {"triton_grpc_error": "true"} if mode else None
    client.start_stream(callback=lambda result, error: got.put((result, error)), headers=headers)
    try:
        _send(client, 1.0)
        result, error = got.get(timeout=30)
        assert error is None and result.as_numpy("OUT").tolist() == [2.0]  # type: ignore[attr-defined]
        _send(client, -1.0)
        result, error = got.get(timeout=30)
        assert isinstance(error, InferenceServerException) and "negative input" in error.message()
        if mode:  # the stream is over, with the error's gRPC status
            assert error.status() == "StatusCode.INTERNAL"
            with pytest.raises(InferenceServerException):
                _send(client, 3.0)
        else:  # an error message on the stream, which goes on
            _send(client, 3.0)
            result, error = got.get(timeout=30)
            assert error is None and result.as_numpy("OUT").tolist() == [6.0]  # type: ignore[attr-defined]
    finally:
        client.stop_stream()
        client.close()
