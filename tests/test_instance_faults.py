"""Unrecoverable instance faults: the scheduler takes the instance out of service and restarts it.

Through the in-process API with isolated Python models (real child processes), and once through the
scheduler itself with a labelled stand-in for a TensorRT instance whose CUDA context is lost (no GPU
here), which is the other fault the same path serves.
"""

from __future__ import annotations

import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from edge_server import Server
from edge_server.backends.base import Backend, BatchItem, LoadContext, Result, Timing
from edge_server.config.model import ModelConfig
from edge_server.errors import InstanceFailed, ModelExecutionError, Unavailable
from edge_server.scheduler.scheduler import ModelScheduler
from edge_server.scheduler.stats import ModelStats

CONFIG = """
name: "fragile"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
parameters [ { key: "isolation", value: { string_value: "process" } } ]
"""

MODEL = """
import os
from pathlib import Path

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        # One mark per (re)start, outside the repository (a change inside would be a reload).
        with open(Path(pb_utils.get_model_dir()).parents[2] / "initialized", "a") as marks:
            marks.write("i")
        if (Path(pb_utils.get_model_dir()) / "broken").exists():
            raise RuntimeError("broken on purpose")

    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "IN").as_numpy()
        if x[0] == 13:
            os._exit(3)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x + 1)])]
"""


@pytest.fixture
def fragile(tmp_path: Path) -> Path:
    (tmp_path / "repo" / "fragile" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "fragile" / "config.pbtxt").write_text(textwrap.dedent(CONFIG))
    (tmp_path / "repo" / "fragile" / "1" / "model.py").write_text(textwrap.dedent(MODEL))
    return tmp_path / "repo"


def _eventually(check: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            check()  # type: ignore[operator]
            return
        except (AssertionError, Unavailable, InstanceFailed):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_every_instance_down_and_restart_failing_answers_unavailable(fragile: Path) -> None:
    _backoff(fragile, "0.2")
    one = {"IN": np.array([1.0], np.float32)}
    with Server(fragile) as server:
        (fragile / "fragile" / "1" / "broken").touch()  # the next initialize() fails
        with pytest.raises(InstanceFailed, match="exited with status 3"):
            server.infer("fragile", {"IN": np.array([13.0], np.float32)})

        def refused() -> None:
            with pytest.raises(Unavailable, match="every instance failed and restarting failed"):
                server.infer("fragile", one)

        _eventually(refused)
        (fragile / "fragile" / "1" / "broken").unlink()
        _eventually(lambda: np.testing.assert_array_equal(server.infer("fragile", one)["OUT"], [2.0]))


def _backoff(repo: Path, seconds: str) -> None:
    """Set fragile's first restart back-off (``instance_restart_backoff_s``)."""
    config = repo / "fragile" / "config.pbtxt"
    config.write_text(
        config.read_text()
        + f'parameters [ {{ key: "instance_restart_backoff_s", value: {{ string_value: "{seconds}" }} }} ]\n'
    )


def test_stop_does_not_wait_for_a_pending_restart(fragile: Path) -> None:
    _backoff(fragile, "30")
    server = Server(fragile)
    try:
        with pytest.raises(InstanceFailed):
            server.infer("fragile", {"IN": np.array([13.0], np.float32)})
    finally:
        server.close()  # the instance waits 30 s for its restart; stopping cuts that short
    # Cut short, not waited out: the restart never ran (a late one would have initialized again).
    assert (fragile.parent / "initialized").read_text() == "i"


@pytest.mark.parametrize("value", ["-1", "31", "soon", "nan"])
def test_a_bad_restart_backoff_fails_the_load_by_name(fragile: Path, value: str) -> None:
    _backoff(fragile, value)
    with Server(fragile) as server:
        (status,) = server.models()
        assert status.state.value != "READY"
        assert "'instance_restart_backoff_s'" in status.reason and repr(value) in status.reason


def assert_closed(backend: LostContextStandIn) -> None:
    assert backend.closed


class LostContextStandIn(Backend):
    """Stands in for a TensorRT instance whose CUDA context is lost (no GPU here): it fails with
    InstanceFailed on the first batch with a negative value, and with an ordinary error on NaN."""

    @classmethod
    def complete_config(cls, config: ModelConfig, model_path: Path) -> ModelConfig:
        return config

    def __init__(self, ctx: LoadContext | None = None, *, tag: str = "") -> None:
        self.tag = tag
        self.closed = False
        self.lost = False

    def execute(self, batch: Sequence[BatchItem], timing: Timing) -> list[Result]:
        x = batch[0].inputs["X"]
        if self.lost or (x < 0).any():
            self.lost = True
            raise InstanceFailed(f"{self.tag}: CUDA context lost")
        if np.isnan(x).any():
            raise ModelExecutionError("nan")
        return [{"Y": np.full_like(x, ord(self.tag[0]))}]

    def close(self) -> None:
        self.closed = True


def test_scheduler_replaces_only_the_failed_instance() -> None:
    first, second = LostContextStandIn(tag="a"), LostContextStandIn(tag="b")
    restarted: list[int] = []
    allow_restart = threading.Event()

    def restart(index: int) -> Backend:
        allow_restart.wait(10)
        restarted.append(index)
        return LostContextStandIn(tag="r")

    scheduler = ModelScheduler(
        ModelConfig(name="trt", backend="tensorrt", parameters={"instance_restart_backoff_s": "0.05"}),
        [("trt_0", first), ("trt_1", second)],
        ModelStats("trt", 1),
        restart=restart,
    )

    def run(value: float) -> Result:
        item = BatchItem(inputs={"X": np.array([value], np.float32)}, batch_size=1, requested_outputs=("Y",))
        try:
            return scheduler.submit(item, ("X",)).result(10)
        except Exception as exc:
            return exc

    try:
        assert isinstance(run(float("nan")), ModelExecutionError)  # "this request failed": no one replaced
        assert not first.closed and not second.closed
        assert isinstance(run(-1.0), InstanceFailed)  # one instance lost its context ...
        assert isinstance(run(2.0), dict)  # ... the other serves at once
        assert isinstance(run(-1.0), InstanceFailed)  # now the other one
        _eventually(lambda: (assert_closed(first), assert_closed(second)))  # by their own workers
        # Both out of service, restarts held back: a request waits in the queue for the first one back.
        result: list[Result] = []
        waiting = threading.Thread(target=lambda: result.append(run(1.0)))
        waiting.start()
        waiting.join(0.3)
        assert waiting.is_alive()
        allow_restart.set()
        waiting.join(10)
        assert isinstance(result[0], dict) and result[0]["Y"].tolist() == [ord("r")]
        deadline = time.monotonic() + 5
        while sorted(restarted) != [0, 1]:
            assert time.monotonic() < deadline, restarted
            time.sleep(0.01)
    finally:
        allow_restart.set()
        scheduler.stop()
