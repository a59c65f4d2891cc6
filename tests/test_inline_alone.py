"""The daemon's only model runs on the caller's thread whatever it costs, up to a frame period.

A model whose executions take milliseconds goes to its worker thread when other models share the
daemon (its run on a frontend thread would hold their requests), but when it is the only model and
has one instance, nothing but requests for that same instance could wait behind it: it runs where
the request arrived, as a hand-written loop would, and saves two thread wake-ups per request.
"""

from __future__ import annotations

import textwrap
import threading
from pathlib import Path

import numpy as np

from edge_server import Server
from edge_server.client import Client
from edge_server.scheduler.scheduler import INLINE_BUDGET_NS, SOLE_VERSION_INLINE_BUDGET_NS
from tests.daemon import Daemon
from tests.test_python_inline import threads_that_ran

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ 2 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_STRING, dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: {count} }} ]
"""

# Sleeps for SECONDS, then names the thread that ran execute().
MODEL = """
import threading
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep({seconds})
        out = pb_utils.Tensor("OUT", np.array([threading.current_thread().name.encode()], object))
        return [pb_utils.InferenceResponse([out]) for _ in requests]
"""

SLOW_S = 0.002  # well over the shared budget, well under the alone budget
assert INLINE_BUDGET_NS < SLOW_S * 1e9 < SOLE_VERSION_INLINE_BUDGET_NS / 4


def _model(repo: Path, name: str, seconds: float, count: int = 1) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(MODEL.format(seconds=seconds)))
    (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, count=count))


def test_the_only_model_runs_on_the_callers_thread_until_another_is_loaded(tmp_path: Path) -> None:
    _model(tmp_path, "slow", SLOW_S)
    _model(tmp_path, "other", 0.0)
    me = threading.current_thread().name
    with Server(tmp_path, model_control_mode="explicit", load_models=["slow"]) as server:
        alone = threads_that_ran(server, "slow", 12)
        assert alone[0] != me  # measured on the instance's worker first
        assert alone[-5:] == [me] * 5, alone

        server.load_model("other")  # now a run on this thread could hold the other model's requests
        shared = threads_that_ran(server, "slow", 8)
        assert me not in shared, shared

        server.unload_model("other")
        assert threads_that_ran(server, "slow", 8)[-5:] == [me] * 5
        stats = server.statistics("slow")[0]["inference_stats"]
        assert stats["success"]["count"] == 28 and stats["fail"]["count"] == 0


def test_the_only_model_with_two_instances_keeps_its_workers(tmp_path: Path) -> None:
    # A second request could run on the other instance while the first holds the caller's thread.
    _model(tmp_path, "slow", SLOW_S, count=2)
    with Server(tmp_path) as server:
        assert threading.current_thread().name not in threads_that_ran(server, "slow", 12)


def test_the_only_model_over_the_budget_keeps_its_worker(tmp_path: Path) -> None:
    _model(tmp_path, "slower", 1.5 * SOLE_VERSION_INLINE_BUDGET_NS / 1e9)
    with Server(tmp_path) as server:
        assert threading.current_thread().name not in threads_that_ran(server, "slower", 4)


def test_the_daemons_only_model_runs_on_its_ipc_thread(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _model(repo, "slow", SLOW_S)
    daemon = Daemon(repo, f"ipc://{tmp_path}/alone.sock", tmp_path / "alone.log").start()
    try:
        with Client(daemon.address, timeout=30) as client:
            x = np.ones(2, np.float32)
            names: list[str] = []
            # The first runs are measured on the worker; a slow first one (a loaded machine, a cold
            # start) keeps the average over the budget for a few more: ask until it settles.
            while names[-5:] != ["edge-ipc-frontend"] * 5 and len(names) < 200:
                names.append(client.infer("slow", {"IN": x})["OUT"][0].decode())
        assert names[-5:] == ["edge-ipc-frontend"] * 5, names
    finally:
        assert daemon.stop() == 0, daemon.log()
