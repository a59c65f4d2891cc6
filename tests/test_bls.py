"""BLS in Triton's form: Python models calling other models through the data plane (in-process API)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_server import Server
from edge_server.backends import pb_utils
from edge_server.errors import InvalidArgument, NotFound
from tests.bls_models import add_bls_models


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    add_bls_models(repo, tmp_path / "repeat.log")
    return repo


def x(n: int = 1) -> np.ndarray:
    return np.arange(4 * n, dtype=np.float32).reshape(n, 4)


def success_count(server: Server, model: str) -> int:
    (stats,) = server.statistics(model)
    return int(stats["inference_stats"]["success"]["count"])


def test_sync_bls_call_goes_through_the_data_plane_and_is_counted(repo: Path) -> None:
    with Server(repo) as server:
        before = success_count(server, "affine")
        out = server.infer("caller", {"INPUT0": x(3)})
        np.testing.assert_allclose(out["OUTPUT0"], 2 * x(3) + 1 + 1)
        assert success_count(server, "affine") == before + 1


def test_async_execute_with_async_exec_gives_the_sync_answer(repo: Path) -> None:
    with Server(repo) as server:
        futures = [server.submit("async_caller", {"INPUT0": x(2) + i}) for i in range(8)]
        for i, future in enumerate(futures):
            np.testing.assert_allclose(future.result(timeout=30)["OUTPUT0"], 2 * (x(2) + i) + 2)
        sync = server.infer("caller", {"INPUT0": x(2)})
        np.testing.assert_allclose(server.infer("async_caller", {"INPUT0": x(2)})["OUTPUT0"], sync["OUTPUT0"])


@pytest.mark.parametrize("model", ["stream_caller", "async_stream_caller"])
@pytest.mark.parametrize(("n", "count", "empty"), [(3, 3, 0), (0, 0, 1)])
def test_exec_decoupled_iterates_every_response(
    repo: Path, model: str, n: int, count: int, empty: int
) -> None:
    with Server(repo) as server:
        out = server.infer(model, {"IN": np.array([n], np.int32)})
        assert int(out["COUNT"][0]) == count
        assert int(out["SUM"][0]) == n * n * n
        assert int(out["EMPTY"][0]) == empty  # square sends its last response with the final flag


def test_bls_from_a_thread_the_model_started(repo: Path) -> None:
    with Server(repo) as server:
        (out,) = list(server.stream("thread_caller", {"INPUT0": x(2)}, timeout=30))
        np.testing.assert_allclose(out["OUTPUT0"], 2 * x(2) + 2)


def test_a_failed_call_is_an_error_response_with_the_callee_error_code(repo: Path) -> None:
    with Server(repo) as server:
        text = r"\[MODEL_NOT_FOUND\] Request for unknown model: 'nope' is not found"
        with pytest.raises(NotFound, match=text):
            server.infer("caller", {"INPUT0": x()}, parameters={"target": "nope"})
        # the callee validates the call like any request: affine's input has 4 columns, not 3
        with pytest.raises(InvalidArgument, match="INVALID_ARGUMENT"):
            server.infer("caller", {"INPUT0": x()}, parameters={"target": "stream_caller"})


def test_is_model_ready_and_load_unload_follow_the_control_mode(repo: Path) -> None:
    dummy = {"DUMMY": np.zeros(1, np.int32)}
    with Server(repo) as server:  # mode none: asking is fine, loading is refused
        assert server.infer("control", dummy, parameters={"op": "ready", "name": "affine"})["READY"][0]
        assert not server.infer("control", dummy, parameters={"op": "ready", "name": "nope"})["READY"][0]
        with pytest.raises(Exception, match="model control is disabled"):
            server.infer("control", dummy, parameters={"op": "unload", "name": "affine"})
    with Server(repo, model_control_mode="explicit", load_models=["control", "affine"]) as server:
        out = server.infer("control", dummy, parameters={"op": "unload", "name": "affine"})
        assert not out["READY"][0]
        assert not server.is_ready("affine")
        out = server.infer("control", dummy, parameters={"op": "load", "name": "affine"})
        assert out["READY"][0]
        np.testing.assert_allclose(server.infer("affine", {"INPUT0": x()})["OUTPUT0"], 2 * x() + 1)


def test_bls_outside_model_code_is_refused() -> None:
    request = pb_utils.InferenceRequest(
        model_name="affine", requested_output_names=["OUTPUT0"], inputs=[pb_utils.Tensor("INPUT0", x())]
    )
    with pytest.raises(pb_utils.TritonModelException, match="BLS calls are available"):
        request.exec()


def test_the_constructor_checks_its_arguments() -> None:
    with pytest.raises(pb_utils.TritonModelException, match="pb_utils.Tensor"):
        pb_utils.InferenceRequest(model_name="m", inputs=[np.zeros(1)], requested_output_names=[])
    with pytest.raises(pb_utils.TritonModelException, match="model_name"):
        pb_utils.InferenceRequest(model_name="", inputs=[])
    with pytest.raises(pb_utils.TritonModelException, match="timeout"):
        pb_utils.InferenceRequest(model_name="m", inputs=[], timeout=-1)
