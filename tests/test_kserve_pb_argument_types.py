"""pb_utils refuses wrong argument types as Triton's bindings do (L0_backend_python argument_validation).

Triton's python_backend is a pybind11 module: a ``None`` or an ``int`` where a ``str``, a list or a
``LogLevel`` belongs raises ``TypeError``; a list holding ``None`` where tensors belong raises
``TritonModelException``.  A model inside the daemon makes each call and answers, through the real
tritonclient, the calls whose outcome differs from Triton's (none expected).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from tests.daemon import Daemon, free_port, kserve_flags

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

CONFIG = """
name: "arguments"
backend: "python"
max_batch_size: 0
output [ { name: "WRONG" data_type: TYPE_STRING dims: [ -1 ] } ]
"""

MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

T = pb_utils.Tensor("INPUT0", np.array([1], np.int32))
REQ = dict(model_name="m", inputs=[T], requested_output_names=["OUTPUT0"])
Req, Resp, Exc = pb_utils.InferenceRequest, pb_utils.InferenceResponse, pb_utils.TritonModelException
CHECKS = [  # name, call, the exception Triton raises (None: none)
    ("inputs=[None]", lambda: Req(**{**REQ, "inputs": [None]}), Exc),
    ("inputs=None", lambda: Req(**{**REQ, "inputs": None}), TypeError),
    ("model_name=None", lambda: Req(**{**REQ, "model_name": None}), TypeError),
    ("requested=[None]", lambda: Req(**{**REQ, "requested_output_names": [None]}), TypeError),
    ("requested=None", lambda: Req(**{**REQ, "requested_output_names": None}), TypeError),
    ("correlation_id=None", lambda: Req(**REQ, correlation_id=None), TypeError),
    ("request_id=None", lambda: Req(**REQ, request_id=None), TypeError),
    ("model_version=None", lambda: Req(**REQ, model_version=None), TypeError),
    ("flags=None", lambda: Req(**REQ, flags=None), TypeError),
    ("empty lists", lambda: Req(model_name="m", inputs=[], requested_output_names=[]), None),
    ("correlation_id str", lambda: Req(**REQ, correlation_id="id-5"), None),
    ("response [None]", lambda: Resp(output_tensors=[None]), Exc),
    ("response None", lambda: Resp(output_tensors=None), TypeError),
    ("response []", lambda: Resp(output_tensors=[]), None),
    ("response error only", lambda: Resp(error=pb_utils.TritonError("x")), None),
    ("tensor name None", lambda: pb_utils.Tensor(None, np.array([1], np.int32)), TypeError),
    ("tensor array None", lambda: pb_utils.Tensor("OUTPUT0", None), TypeError),
    ("tensor both empty", lambda: pb_utils.Tensor("", None), TypeError),
    ("dlpack None", lambda: pb_utils.Tensor.from_dlpack("OUTPUT0", None), Exc),
    ("dlpack empty name", lambda: pb_utils.Tensor.from_dlpack("", None), Exc),
    ("log level None", lambda: pb_utils.Logger.log("x", None), TypeError),
    ("log level int", lambda: pb_utils.Logger.log("x", 1), TypeError),
    ("log_info None", lambda: pb_utils.Logger.log_info(None), TypeError),
    ("log_warn None", lambda: pb_utils.Logger.log_warn(None), TypeError),
    ("log_error None", lambda: pb_utils.Logger.log_error(None), TypeError),
    ("log_verbose None", lambda: pb_utils.Logger.log_verbose(None), TypeError),
    ("log level unspecified", lambda: pb_utils.Logger.log("Level unspecified"), None),
    ("log level enum", lambda: pb_utils.Logger.log("x", pb_utils.Logger.WARNING), None),
]


def _outcome(call, expected):
    try:
        call()
    except Exception as exc:  # the exception raised, named as the test reads it
        return None if expected is not None and isinstance(exc, expected) else f"raised {exc!r}"
    return None if expected is None else f"did not raise {expected.__name__}"


class TritonPythonModel:
    def execute(self, requests):
        wrong = [f"{name}: {why}" for name, call, expected in CHECKS if (why := _outcome(call, expected))]
        out = pb_utils.Tensor("WRONG", np.array([w.encode() for w in wrong], dtype=object))
        return [pb_utils.InferenceResponse([out]) for _ in requests]
"""


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[grpcclient.InferenceServerClient]:
    root = tmp_path_factory.mktemp("args")
    repo = root / "repo"
    (repo / "arguments" / "1").mkdir(parents=True)
    (repo / "arguments" / "config.pbtxt").write_text(CONFIG)
    (repo / "arguments" / "1" / "model.py").write_text(MODEL)
    http_port, grpc_port = free_port(), free_port()
    daemon = Daemon(Path(repo), f"ipc://{root}/a.sock", root / "a.log", *kserve_flags(http_port, grpc_port))
    daemon.start()
    try:
        yield grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_pb_utils_refuses_arguments_of_the_wrong_type_as_triton_does(
    client: grpcclient.InferenceServerClient,
) -> None:
    wrong = client.infer("arguments", []).as_numpy("WRONG")
    assert [w.decode() for w in wrong] == []
