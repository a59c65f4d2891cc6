"""One model's hung ``initialize()`` never holds up control of another (issue 24, defect 6).

A poll-mode server watches two models.  A new version of ``slow`` hangs in ``initialize()`` (until
the test lets it go); meanwhile a new version dropped into ``m`` is picked up and served, and so is
a SIGHUP-style rescan of the whole repository: only ``slow`` waits for its own user code.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

from edge_server import Server
from tests.reload_helpers import answer, state_of, wait_until, write_model

SLOW_CONFIG = """
name: "slow"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""

SLOW_MODEL = """
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        release = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "release")
        while %(hang)s and not os.path.exists(release):  # hangs until the test releases it
            time.sleep(0.01)

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]
            )
            for r in requests
        ]
"""


def _slow_version(repo: Path, version: int, *, hang: bool) -> None:
    (repo / "slow" / str(version)).mkdir(parents=True)
    (repo / "slow" / str(version) / "model.py").write_text(SLOW_MODEL % {"hang": hang})


def test_a_hung_initialize_does_not_stall_the_watched_repository(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "m", (1,))
    (repo / "slow").mkdir()
    (repo / "slow" / "config.pbtxt").write_text(SLOW_CONFIG)
    _slow_version(repo, 1, hang=False)
    with Server(repo, model_control_mode="poll", watch_quiet_s=0.1) as server:
        try:
            assert answer(server, "m") == 1.0
            _slow_version(repo, 2, hang=True)
            wait_until(lambda: state_of(server, "slow", 2) == ("LOADING", ""), 60, "slow v2 loading")
            shutil.copytree(repo / "m" / "1", repo / "m" / "2")  # same model: x + 1, as version 2
            wait_until(lambda: (state_of(server, "m", 2) or ("",))[0] == "READY", 60, "m v2 served")
            assert answer(server, "m", 2) == 1.0
            # SIGHUP: every model, slow among them (that part waits for slow's own load), and m's
            # part goes through meanwhile.
            rescan = threading.Thread(target=server.rescan)
            write_model(repo, "m", (3,))
            rescan.start()
            wait_until(lambda: (state_of(server, "m", 3) or ("",))[0] == "READY", 60, "m v3 served")
            assert state_of(server, "slow", 2) == ("LOADING", "")
            assert (state_of(server, "slow", 1) or ("",))[0] == "READY"  # serves while v2 hangs
            assert answer(server, "m") == 3.0
        finally:
            (repo / "slow" / "release").touch()
        rescan.join()
        wait_until(lambda: (state_of(server, "slow", 2) or ("",))[0] == "READY", 60, "slow v2 ready")
