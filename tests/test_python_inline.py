"""Cheap in-thread Python models run on the caller's thread, like cheap CPU ONNX models; others never."""

from __future__ import annotations

import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_server import Server
from edge_server.backends.python_process import IsolatedPythonBackend
from edge_server.request import InferRequest
from edge_server.scheduler import inline

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
{extra}
input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ 2 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_STRING, dims: [ 1 ] }} ]
"""

# OUT names the thread that ran execute().
SYNC = """
import threading
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    {kw}def execute(self, requests):
        out = pb_utils.Tensor("OUT", np.array([threading.current_thread().name.encode()], object))
        return [pb_utils.InferenceResponse([out]) for _ in requests]
"""

DECOUPLED = """
import threading
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            name = threading.current_thread().name.encode()
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([name], object))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def _model(repo: Path, name: str, source: str, extra: str = "") -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(source))
    (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, extra=extra))


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    # What "cheap" means is not at stake here (tests/test_inline_alone.py tests the budgets): a budget
    # of 50 ms keeps a loaded machine's preemptions from making the cheap model look expensive.
    monkeypatch.setattr(inline, "INLINE_BUDGET_NS", 50_000_000)
    _model(tmp_path, "plain", SYNC.format(kw=""))
    _model(tmp_path, "coro", SYNC.format(kw="async "))
    _model(tmp_path, "stream", DECOUPLED, "model_transaction_policy { decoupled: true }")
    _model(
        tmp_path,
        "isolated",
        SYNC.format(kw=""),
        'parameters { key: "isolation" value: { string_value: "process" } }',
    )
    with Server(tmp_path) as srv:
        yield srv


def threads_that_ran(server: Server, model: str, count: int = 60) -> list[str]:
    """Run ``count`` requests with a frontend's budget (here or queued, as the policy says): who ran them."""
    x = np.ones(2, np.float32)
    names = []
    for _ in range(count):
        out = server.dataplane.run_here(InferRequest(model=model, inputs={"IN": x}), inline.FRONTEND).result()
        names.append(out["OUT"][0].decode())
    return names


def test_cheap_python_model_runs_inline_once_measured(server: Server) -> None:
    names = threads_that_ran(server, "plain")
    me = threading.current_thread().name
    assert names[0] != me  # the first run is measured on the instance's worker
    assert names[-5:] == [me] * 5, names
    stats = server.statistics("plain")[0]
    assert stats["inference_stats"]["success"]["count"] == len(names)


def test_submit_and_a_queue_only_budget_never_run_on_the_callers_thread(server: Server) -> None:
    me = threading.current_thread().name
    assert threads_that_ran(server, "plain")[-1] == me  # measured cheap: it would run here
    x = {"IN": np.ones(2, np.float32)}
    for _ in range(5):
        assert (
            server.dataplane.submit(InferRequest(model="plain", inputs=x)).result()["OUT"][0].decode() != me
        )
        queued = server.dataplane.run_here(InferRequest(model="plain", inputs=x), inline.QUEUE_ONLY)
        assert queued.result()["OUT"][0].decode() != me
        assert server.submit("plain", x).result()["OUT"][0].decode() != me


def test_async_python_model_stays_off_the_callers_thread(server: Server) -> None:
    me = threading.current_thread().name
    assert me not in threads_that_ran(server, "coro", 30)


def test_isolated_python_model_is_not_lent_to_the_caller(server: Server) -> None:
    assert threads_that_ran(server, "isolated", 3) == ["MainThread"] * 3  # the child process's own thread
    assert not IsolatedPythonBackend.allows_inline  # a round trip to the child is no cheap model


def test_decoupled_python_model_stays_off_the_callers_thread(server: Server) -> None:
    me = threading.current_thread().name
    for _ in range(30):
        (response,) = list(server.stream("stream", {"IN": np.ones(2, np.float32)}))
        assert response["OUT"][0].decode() != me
