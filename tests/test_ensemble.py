"""Ensembles in Triton's format: validated at load, walked through the members' own schedulers."""

from __future__ import annotations

import textwrap
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from edge_server import Server
from edge_server.errors import EdgeServerError, ModelNotReady
from edge_server.status_index import ModelState
from tests.onnx_factory import affine_model
from tests.test_pipeline_deadlock import SLOW_MODEL

MEMBER_CONFIG = """
name: "%(name)s"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
%(extra)s
"""

SLOW_CONFIG = """
name: "%(name)s"
backend: "python"
max_batch_size: 1
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
instance_group [ { kind: KIND_CPU, count: %(count)d } ]
"""


def step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = "".join(f' input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    maps += "".join(f' output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: -1{maps} }}'


def ensemble_config(
    name: str,
    steps: list[str],
    *,
    inputs: str = '{ name: "IN", data_type: TYPE_FP32, dims: [ 4 ] }',
    outputs: str = '{ name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] }',
    extra: str = "",
) -> str:
    return textwrap.dedent(
        f"""
        name: "{name}"
        platform: "ensemble"
        max_batch_size: 8
        input [ {inputs} ]
        output [ {outputs} ]
        ensemble_scheduling {{ step [ {", ".join(steps)} ] {extra} }}
        """
    )


def add_ensemble(repo: Path, name: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True)  # Triton requires a version directory, empty
    (repo / name / "config.pbtxt").write_text(config)


def add_member(
    repo: Path, name: str, *, scale: float, offset: float, extra: str = "", version: int = 1
) -> None:
    (repo / name).mkdir(parents=True, exist_ok=True)
    (repo / name / "config.pbtxt").write_text(MEMBER_CONFIG % {"name": name, "extra": extra})
    affine_model(repo / name / str(version) / "model.onnx", scale=scale, offset=offset)


def add_slow(repo: Path, name: str, count: int = 1) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(SLOW_CONFIG % {"name": name, "count": count})
    (repo / name / "1" / "model.py").write_text(SLOW_MODEL)


PIPE = [
    step("scale", {"INPUT0": "IN"}, {"OUTPUT0": "mid"}),
    step("shift", {"INPUT0": "mid"}, {"OUTPUT0": "OUT"}),
]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    add_member(repo, "scale", scale=2.0, offset=0.0)
    add_member(repo, "shift", scale=1.0, offset=3.0)
    add_ensemble(repo, "pipe", ensemble_config("pipe", PIPE))
    return repo


def x(n: int = 2, first: float = 0.0) -> np.ndarray:
    return (np.arange(4 * n, dtype=np.float32).reshape(n, 4) + first).astype(np.float32)


def test_an_ensemble_equals_running_its_models_by_hand(repo: Path) -> None:
    with Server(repo) as server:
        by_hand = server.infer("shift", {"INPUT0": server.infer("scale", {"INPUT0": x()})["OUTPUT0"]})
        out = server.infer("pipe", {"IN": x()})
        np.testing.assert_array_equal(out["OUT"], by_hand["OUTPUT0"])
        np.testing.assert_allclose(out["OUT"], 2 * x() + 3)
        (stats,) = server.statistics("pipe")
        assert stats["inference_stats"]["success"]["count"] == 1
        for member in ("scale", "shift"):  # one direct request and one from the ensemble each
            (member_stats,) = server.statistics(member)
            assert member_stats["inference_stats"]["success"]["count"] == 2


def test_ensemble_traffic_is_batched_with_direct_traffic(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    batching = "dynamic_batching { preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 10000000 }"
    add_member(repo, "scale", scale=2.0, offset=0.0, extra=batching)
    add_member(repo, "shift", scale=1.0, offset=3.0)
    add_ensemble(repo, "pipe", ensemble_config("pipe", PIPE))
    with Server(repo) as server:
        direct = server.submit("scale", {"INPUT0": x(1)})  # waits (10 s at most) for a partner
        out = server.infer("pipe", {"IN": x(1, first=10)})
        np.testing.assert_allclose(out["OUT"], 2 * x(1, first=10) + 3)
        np.testing.assert_allclose(direct.result(timeout=30)["OUTPUT0"], 2 * x(1))
        (stats,) = server.statistics("scale")  # one execution: the partner was the ensemble's request
        assert (stats["inference_count"], stats["execution_count"]) == (2, 1)


def test_independent_branches_run_at_the_same_time(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    add_slow(repo, "slow_a")
    add_slow(repo, "slow_b")
    add_ensemble(
        repo,
        "fork",
        ensemble_config(
            "fork",
            [
                step("slow_a", {"INPUT0": "IN"}, {"OUTPUT0": "A"}),
                step("slow_b", {"INPUT0": "IN"}, {"OUTPUT0": "B"}),
            ],
            outputs='{ name: "A", data_type: TYPE_FP32, dims: [ 4 ] }, '
            '{ name: "B", data_type: TYPE_FP32, dims: [ 4 ] }',
        ).replace("max_batch_size: 8", "max_batch_size: 1"),
    )
    holds = [tmp_path / "slow_a.hold", tmp_path / "slow_b.hold"]  # see SLOW_MODEL: the steps wait
    with Server(repo) as server:
        inputs = {"IN": np.array([[0, 1, 2, 3]], np.float32)}
        for hold in holds:
            hold.touch()
        try:
            future = server.submit("fork", inputs)
            # Both steps are in their models at once: one after the other, B would never start while A waits.
            started = [tmp_path / "slow_a.started", tmp_path / "slow_b.started"]
            deadline = time.monotonic() + 30
            while not all(mark.exists() for mark in started):
                assert time.monotonic() < deadline, [mark.exists() for mark in started]
                time.sleep(0.01)
        finally:
            for hold in holds:
                hold.unlink()
        out = future.result(timeout=30)
        np.testing.assert_array_equal(out["A"], inputs["IN"])
        np.testing.assert_array_equal(out["B"], inputs["IN"])


def test_max_inflight_requests_is_honoured(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    add_slow(repo, "slow", count=2)
    config = ensemble_config(
        "limited", [step("slow", {"INPUT0": "IN"}, {"OUTPUT0": "OUT"})], extra="max_inflight_requests: 1"
    ).replace("max_batch_size: 8", "max_batch_size: 1")
    add_ensemble(repo, "limited", config)
    with Server(repo) as server:
        inputs = {"IN": np.array([[150, 1, 2, 3]], np.float32)}
        start = time.monotonic()
        futures = [server.submit("limited", inputs) for _ in range(2)]
        for future in futures:
            np.testing.assert_array_equal(future.result(timeout=30)["OUT"], inputs["IN"])
        # slow has two instances: only the ensemble's limit makes the second wait for the first
        assert time.monotonic() - start >= 0.3
        (stats,) = server.statistics("limited")
        assert stats["inference_stats"]["queue"]["ns"] >= 100_000_000


MALFORMED = {
    "unknown model": (
        [step("nope", {"INPUT0": "IN"}, {"OUTPUT0": "OUT"})],
        {},
        "step 0 (model 'nope'): Request for unknown model: 'nope' is not found",
    ),
    "consumed, never produced": (
        [
            step("scale", {"INPUT0": "IN"}, {"OUTPUT0": "mid"}),
            step("shift", {"INPUT0": "typo"}, {"OUTPUT0": "OUT"}),
        ],
        {},
        "step 1 (model 'shift'): input 'INPUT0' reads tensor 'typo', which nothing produces",
    ),
    "unused ensemble input": (
        PIPE,
        {
            "inputs": '{ name: "IN", data_type: TYPE_FP32, dims: [ 4 ] }, '
            '{ name: "EXTRA", data_type: TYPE_FP32, dims: [ 4 ] }'
        },
        "ensemble input 'EXTRA' is used by no step",
    ),
    "cycle": (
        [
            step("scale", {"INPUT0": "b"}, {"OUTPUT0": "a"}),
            step("shift", {"INPUT0": "a"}, {"OUTPUT0": "b"}),
            step("scale", {"INPUT0": "IN"}, {"OUTPUT0": "OUT"}),
        ],
        {},
        "the steps form a cycle: step 0 (model 'scale') needs 'b'; step 1 (model 'shift') needs 'a'",
    ),
    "dtype mismatch": (
        PIPE,
        {"inputs": '{ name: "IN", data_type: TYPE_INT32, dims: [ 4 ] }'},
        "tensor 'IN': the ensemble input produces TYPE_INT32, step 0 (model 'scale') input 'INPUT0' "
        "expects TYPE_FP32",
    ),
    "shape mismatch": (
        PIPE,
        {"outputs": '{ name: "OUT", data_type: TYPE_FP32, dims: [ 5 ] }'},
        "tensor 'OUT': step 1 (model 'shift') produces shape [-1, 4], the ensemble output expects [-1, 5]",
    ),
    "unknown member output": (
        [step("scale", {"INPUT0": "IN"}, {"OUT0": "OUT"})],
        {},
        "step 0 (model 'scale'): output_map names output 'OUT0', model has ['OUTPUT0']",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_ensemble_fails_its_own_load_with_a_clear_error(repo: Path, case: str) -> None:
    steps, fields, reason = MALFORMED[case]
    add_ensemble(repo, "broken", ensemble_config("broken", steps, **fields))
    with Server(repo) as server:
        (row,) = [s for s in server.models() if s.name == "broken"]
        assert row.state is ModelState.UNAVAILABLE
        assert reason in row.reason
        np.testing.assert_allclose(server.infer("pipe", {"IN": x()})["OUT"], 2 * x() + 3)


def test_ready_only_while_every_member_is(repo: Path) -> None:
    with Server(repo, model_control_mode="explicit", load_models=["pipe"]) as server:  # loads members
        assert server.is_ready("pipe") and server.is_ready("scale")
        server.unload_model("shift")
        assert not server.is_ready("pipe")
        (row,) = [s for s in server.models() if s.name == "pipe"]
        assert row.state is ModelState.UNAVAILABLE and "member 'shift'" in row.reason
        with pytest.raises(ModelNotReady, match="member 'shift' is not serving"):
            server.infer("pipe", {"IN": x()})
        server.load_model("shift")
        np.testing.assert_allclose(server.infer("pipe", {"IN": x()})["OUT"], 2 * x() + 3)


def test_a_member_reload_is_picked_up_without_reloading_the_ensemble(repo: Path) -> None:
    with Server(repo, model_control_mode="explicit", load_models=["*"]) as server:
        ensemble = server.routing.serving()["pipe"][1]
        affine_model(repo / "shift" / "2" / "model.onnx", scale=1.0, offset=10.0)
        server.load_model("shift")
        np.testing.assert_allclose(server.infer("pipe", {"IN": x()})["OUT"], 2 * x() + 10)
        assert server.routing.serving()["pipe"][1] is ensemble


def test_requests_during_a_member_reload_end_in_a_result_or_an_error(repo: Path) -> None:
    with Server(repo, model_control_mode="explicit", load_models=["*"]) as server:
        stop = threading.Event()
        outcomes: list[Future[dict[str, np.ndarray]]] = []

        def traffic() -> None:
            while not stop.is_set():
                try:
                    outcomes.append(server.submit("pipe", {"IN": x()}))
                except EdgeServerError:
                    pass
                time.sleep(0.001)

        thread = threading.Thread(target=traffic)
        thread.start()
        try:
            for version in (2, 3):
                affine_model(repo / "shift" / str(version) / "model.onnx", scale=1.0, offset=float(version))
                server.load_model("shift")
            server.unload_model("shift")
            server.load_model("shift")
        finally:
            stop.set()
            thread.join()
        assert outcomes
        for future in outcomes:
            try:
                out = future.result(timeout=10)  # never a hang
            except EdgeServerError:
                continue
            assert float(out["OUT"][0, 0] - 2 * x()[0, 0]) in (2.0, 3.0)  # v1 and v3 add 3, v2 adds 2


def test_an_ensemble_waiting_for_a_member_loads_when_the_member_arrives(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    add_member(repo, "scale", scale=2.0, offset=0.0)
    add_ensemble(repo, "pipe", ensemble_config("pipe", PIPE))
    with Server(repo, model_control_mode="poll", watch_quiet_s=0.1) as server:
        (row,) = [s for s in server.models() if s.name == "pipe"]
        assert (
            row.state is ModelState.UNAVAILABLE
            and "Request for unknown model: 'shift' is not found" in row.reason
        )
        staging = tmp_path / "staging"
        add_member(staging, "shift", scale=1.0, offset=3.0)
        (staging / "shift").rename(repo / "shift")  # the OTA way: built elsewhere, renamed into place
        deadline = time.monotonic() + 20
        while not server.is_ready("pipe"):
            assert time.monotonic() < deadline, server.models()
            time.sleep(0.05)
        np.testing.assert_allclose(server.infer("pipe", {"IN": x()})["OUT"], 2 * x() + 3)


CHAIN_CONFIG = """
name: "%(name)s"
backend: "python"
max_batch_size: 8
input [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""

CHAIN_MODEL = """
import triton_python_backend_utils as pb_utils


def call(model, x):
    return pb_utils.InferenceRequest(
        model_name=model, requested_output_names=["OUTPUT0"], inputs=[pb_utils.Tensor("INPUT0", x)]
    )


def output(response):
    if response.has_error():
        raise pb_utils.TritonModelException(response.error().message())
    return pb_utils.get_output_tensor_by_name(response, "OUTPUT0").as_numpy()


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            mid = output(call("scale", x).exec())
            out = output(call("shift", mid).exec())
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]))
        return responses
"""

ASYNC_CHAIN_MODEL = (
    CHAIN_MODEL.replace("def execute", "async def execute")
    .replace(".exec()", ".async_exec()")
    .replace("output(call(", "output(await call(")
)


def test_a_bls_model_sync_and_async_equals_the_ensemble(repo: Path) -> None:
    for name, model in (("chain", CHAIN_MODEL), ("async_chain", ASYNC_CHAIN_MODEL)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(CHAIN_CONFIG % {"name": name})
        (repo / name / "1" / "model.py").write_text(model)
    with Server(repo) as server:
        inputs = {"IN": x(3, first=0.5)}
        ensemble = server.infer("pipe", inputs)["OUT"]
        np.testing.assert_array_equal(server.infer("chain", inputs)["OUT"], ensemble)
        np.testing.assert_array_equal(server.infer("async_chain", inputs)["OUT"], ensemble)


def _swap_member(repo: Path, staging: Path, name: str, *, output_name: str, offset: float) -> None:
    """Replace a model directory the OTA way: built aside, renamed into place (the old one renamed away)."""
    built = staging / f"{name}-{offset}"
    (built / "1").mkdir(parents=True)
    config = MEMBER_CONFIG % {"name": name, "extra": ""}
    (built / "config.pbtxt").write_text(config.replace('"OUTPUT0"', f'"{output_name}"'))
    affine_model(built / "1" / "model.onnx", scale=1.0, offset=offset, output_name=output_name)
    (repo / name).rename(staging / f"{name}-old-{offset}")
    built.rename(repo / name)


def test_a_member_reload_that_breaks_the_steps_makes_the_ensemble_unavailable_until_it_fits(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    add_member(repo, "scale", scale=2.0, offset=0.0)
    add_member(repo, "shift", scale=1.0, offset=3.0)
    add_ensemble(repo, "pipe", ensemble_config("pipe", PIPE))
    staging = tmp_path / "staging"
    staging.mkdir()

    def pipe_row() -> tuple[ModelState, str]:
        (row,) = [s for s in server.models() if s.name == "pipe"]
        return row.state, row.reason

    def shift_outputs() -> list[str]:
        try:
            return [t.name for t in server.model_config("shift").outputs]
        except ModelNotReady:  # between the old directory's unload and the new one's load
            return []

    with Server(repo, model_control_mode="poll", watch_quiet_s=0.1) as server:
        np.testing.assert_allclose(server.infer("pipe", {"IN": x()})["OUT"], 2 * x() + 3)
        _swap_member(repo, staging, "shift", output_name="RENAMED", offset=4.0)
        deadline = time.monotonic() + 20
        while "RENAMED" not in shift_outputs():
            assert time.monotonic() < deadline, server.models()
            time.sleep(0.05)
        np.testing.assert_allclose(server.infer("shift", {"INPUT0": x()})["RENAMED"], x() + 4)
        state, reason = pipe_row()
        assert state is ModelState.UNAVAILABLE
        assert "step 1 (model 'shift')" in reason and "'OUTPUT0'" in reason, reason
        assert not server.is_ready("pipe")
        with pytest.raises(ModelNotReady, match="no longer fits its steps.*'OUTPUT0'"):
            server.infer("pipe", {"IN": x()})

        _swap_member(repo, staging, "shift", output_name="OUTPUT0", offset=5.0)  # fits again
        while not server.is_ready("pipe"):
            assert time.monotonic() < deadline, server.models()
            time.sleep(0.05)
        assert pipe_row() == (ModelState.READY, "")
        np.testing.assert_allclose(server.infer("pipe", {"IN": x()})["OUT"], 2 * x() + 5)


def test_an_ensemble_that_batches_more_than_a_member_is_refused_at_load(tmp_path: Path) -> None:
    """Triton's rule and message: the ensemble's max_batch_size must fit every member's."""
    repo = tmp_path / "repo"
    add_member(repo, "scale", scale=2.0, offset=0.0)
    add_member(repo, "shift", scale=1.0, offset=3.0)
    add_ensemble(
        repo, "pipe", ensemble_config("pipe", PIPE).replace("max_batch_size: 8", "max_batch_size: 32")
    )
    with Server(repo) as server:
        rows = {s.name: s for s in server.models()}
        assert rows["pipe"].state is ModelState.UNAVAILABLE
        assert (
            "ensemble pipe allows maximum batch size 32, but it contains model scale which only allows "
            "maximum batch size to be 8" in rows["pipe"].reason
        )
        with pytest.raises(ModelNotReady):
            server.infer("pipe", {"IN": x(2)})
        np.testing.assert_allclose(server.infer("scale", {"INPUT0": x(2)})["OUTPUT0"], 2 * x(2))


def test_a_non_batching_ensemble_of_batching_members_loads(tmp_path: Path) -> None:
    """The other direction is fine, as in Triton: the ensemble's shapes simply carry no batch axis."""
    repo = tmp_path / "repo"
    add_member(repo, "scale", scale=2.0, offset=0.0)
    add_member(repo, "shift", scale=1.0, offset=3.0)
    config = ensemble_config(
        "pipe",
        PIPE,
        inputs='{ name: "IN", data_type: TYPE_FP32, dims: [ -1, 4 ] }',
        outputs='{ name: "OUT", data_type: TYPE_FP32, dims: [ -1, 4 ] }',
    ).replace("max_batch_size: 8", "max_batch_size: 0")
    add_ensemble(repo, "pipe", config)
    with Server(repo) as server:
        np.testing.assert_allclose(server.infer("pipe", {"IN": x(3)})["OUT"], 2 * x(3) + 3)


def test_a_non_batching_ensemble_sends_its_tensors_to_batching_members_as_a_batch_of_one(
    tmp_path: Path,
) -> None:
    """Triton's rule: the shapes agree without the batch axis; a member that batches gets [1, ...] and
    the ensemble's own output drops that axis again (Triton's generated ``*_nobatch_*`` ensembles)."""
    repo = tmp_path / "repo"
    add_member(repo, "scale", scale=2.0, offset=0.0)
    add_member(repo, "shift", scale=1.0, offset=3.0)
    add_ensemble(
        repo, "pipe", ensemble_config("pipe", PIPE).replace("max_batch_size: 8", "max_batch_size: 0")
    )
    with Server(repo) as server:
        out = server.infer("pipe", {"IN": x(1)[0]})["OUT"]
        assert out.shape == (4,)
        np.testing.assert_allclose(out, 2 * x(1)[0] + 3)


def test_a_batching_ensemble_may_hold_a_non_batching_member_whose_full_shape_agrees(tmp_path: Path) -> None:
    """Triton: a member with max_batch_size 0 and dims [-1, 4] takes the ensemble's [batch, 4] whole."""
    repo = tmp_path / "repo"
    add_member(repo, "scale", scale=2.0, offset=0.0)
    add_member(repo, "shift", scale=1.0, offset=3.0)
    config = (repo / "shift" / "config.pbtxt").read_text()
    (repo / "shift" / "config.pbtxt").write_text(
        config.replace("max_batch_size: 8", "max_batch_size: 0").replace("dims: [ 4 ]", "dims: [ -1, 4 ]")
    )
    add_ensemble(repo, "pipe", ensemble_config("pipe", PIPE))
    with Server(repo) as server:
        out = server.infer("pipe", {"IN": x(3)})["OUT"]
        assert out.shape == (3, 4)
        np.testing.assert_allclose(out, 2 * x(3) + 3)


def test_an_ensembles_reshape_applies_at_its_boundary(tmp_path: Path) -> None:
    """Triton checks and feeds the steps with the ensemble tensors' ``reshape`` shapes; the answer comes
    back in the ensemble's config dims (Triton's generated ``*_reshape_*`` ensembles)."""
    repo = tmp_path / "repo"
    add_member(repo, "scale", scale=2.0, offset=0.0)
    add_member(repo, "shift", scale=1.0, offset=3.0)
    config = ensemble_config(
        "pipe",
        PIPE,
        inputs='{ name: "IN", data_type: TYPE_FP32, dims: [ 2, 2 ] reshape: { shape: [ 4 ] } }',
        outputs='{ name: "OUT", data_type: TYPE_FP32, dims: [ 2, 2 ] reshape: { shape: [ 4 ] } }',
    )
    add_ensemble(repo, "pipe", config)
    with Server(repo) as server:
        out = server.infer("pipe", {"IN": x(3).reshape(3, 2, 2)})["OUT"]
        assert out.shape == (3, 2, 2)
        np.testing.assert_allclose(out, (2 * x(3) + 3).reshape(3, 2, 2))


def test_classes_of_an_ensemble_output_are_named_by_the_member_that_made_it(tmp_path: Path) -> None:
    """Triton's L0_infer ``test_ensemble_label_lookup``: without a ``label_filename`` of its own the
    ensemble's output takes the producing member's labels; with one, its own."""
    repo = tmp_path / "repo"
    add_member(repo, "scale", scale=2.0, offset=0.0)
    add_member(repo, "shift", scale=1.0, offset=3.0)
    config = (repo / "shift" / "config.pbtxt").read_text()
    labelled = '{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ], label_filename: "labels.txt" }'
    (repo / "shift" / "config.pbtxt").write_text(
        config.replace('{ name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] }', labelled)
    )
    (repo / "shift" / "labels.txt").write_text("a\nb\nc\nd\n")
    add_ensemble(repo, "pipe", ensemble_config("pipe", PIPE))
    own = ensemble_config("own", PIPE, outputs=labelled.replace("OUTPUT0", "OUT"))
    add_ensemble(repo, "own", own)
    (repo / "own" / "labels.txt").write_text("w\nx\ny\nz\n")
    with Server(repo) as server:
        assert server.infer("pipe", {"IN": x(1)}, classification={"OUT": 1})["OUT"].tolist() == [
            [b"9.000000:3:d"]
        ]
        assert server.infer("own", {"IN": x(1)}, classification={"OUT": 1})["OUT"].tolist() == [
            [b"9.000000:3:z"]
        ]
