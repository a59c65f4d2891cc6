"""Decoupled (streaming) Python models through the in-process API: zero, one or many responses."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from edge_server import Server
from edge_server.backends import pb_utils
from edge_server.errors import InvalidArgument, ModelExecutionError, RequestTimeout
from edge_server.streaming import ResponseIterator
from tests.decoupled_models import add_decoupled_models
from tests.onnx_factory import affine_model
from tests.test_python_decoupled_release import CONFIG, MODEL  # the model of the daemon's tests


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    add_decoupled_models(repo, tmp_path / "repeat.log")
    affine_model(repo / "affine" / "1" / "model.onnx", scale=2.0, offset=1.0)
    return repo


@pytest.fixture
def server(repo: Path):
    with Server(repo) as server:
        yield server


def repeat_inputs(values: list[int], delay_ms: int = 0) -> dict[str, np.ndarray]:
    return {
        "IN": np.array(values, np.int32),
        "DELAY": np.full(len(values), delay_ms, np.uint32),
    }


def test_responses_sent_after_execute_returned_arrive_in_order(server: Server) -> None:
    responses = list(server.stream("repeat", repeat_inputs([4, 5, 6])))
    assert [int(r["OUT"][0]) for r in responses] == [4, 5, 6]
    assert [int(r["IDX"][0]) for r in responses] == [0, 1, 2]
    assert responses[0]["OUT"].dtype == np.int32


@pytest.mark.parametrize("n", [0, 1, 5])
def test_zero_one_or_many_responses(server: Server, n: int) -> None:
    outs = [int(r["OUT"][0]) for r in server.stream("square", {"IN": np.array([n], np.int32)})]
    assert outs == [n * n] * n


def test_error_mid_stream_is_raised_and_the_stream_goes_on(server: Server) -> None:
    stream = server.stream("flaky", {"IN": np.array([1], np.int32)}, timeout=10)
    assert int(next(stream)["OUT"][0]) == 1
    with pytest.raises(ModelExecutionError, match="second response failed"):
        next(stream)
    assert int(next(stream)["OUT"][0]) == 3
    with pytest.raises(StopIteration):
        next(stream)


def test_execute_raising_ends_the_stream_with_its_error(server: Server) -> None:
    with pytest.raises(ModelExecutionError, match="negative input"):
        list(server.stream("flaky", {"IN": np.array([-1], np.int32)}, timeout=10))
    assert int(next(iter(server.stream("square", {"IN": np.array([2], np.int32)})))["OUT"][0]) == 4


def test_ordinary_call_to_a_decoupled_model_is_refused(server: Server) -> None:
    with pytest.raises(InvalidArgument, match="decoupled"):
        server.infer("square", {"IN": np.array([2], np.int32)})


def test_an_ordinary_model_streams_one_response(server: Server) -> None:
    x = np.ones((1, 4), np.float32)
    (only,) = list(server.stream("affine", {"INPUT0": x}))
    np.testing.assert_allclose(only["OUTPUT0"], 2 * x + 1)


def test_bad_input_to_a_stream_raises_before_anything_is_queued(server: Server) -> None:
    with pytest.raises(InvalidArgument, match="IN"):
        server.stream("square", {"IN": np.array([1.5], np.float32)})


def test_stopping_early_cancels_the_request(server: Server, tmp_path: Path) -> None:
    with server.stream("repeat", repeat_inputs(list(range(50)), delay_ms=20), timeout=10) as stream:
        first = next(stream)
        assert int(first["OUT"][0]) == 0
    deadline = time.monotonic() + 10
    log = tmp_path / "repeat.log"
    while not (log.exists() and log.read_text().endswith("\n")) and time.monotonic() < deadline:
        time.sleep(0.02)
    sent, cancelled = map(int, log.read_text().split())
    assert cancelled == 1 and sent < 50


def test_a_silent_model_times_out_per_response(server: Server) -> None:
    stream = server.stream("repeat", repeat_inputs([1], delay_ms=2000), timeout=0.2)
    with pytest.raises(RequestTimeout):
        next(stream)
    stream.close()


def test_response_parameters_reach_the_caller(tmp_path: Path) -> None:
    from tests.decoupled_models import add_params_model

    repo = tmp_path / "p"
    add_params_model(repo)
    with Server(repo) as server:
        out = server.infer("params", {"IN": np.array([1], np.int32)}, parameters={"a": 1})
    assert out.parameters == {"seen": 1, "model": "params", "echo": True}


def test_asyncio_stream(server: Server) -> None:
    async def collect() -> list[int]:
        stream = await server.stream_async("square", {"IN": np.array([3], np.int32)}, timeout=10)
        return [int(r["OUT"][0]) async for r in stream]

    assert asyncio.run(collect()) == [9, 9, 9]


def test_sender_refuses_a_response_after_the_final_flag() -> None:
    sink = ResponseIterator(timeout=1)
    sender = pb_utils.InferenceResponseSender(
        lambda response, final: sink.put({} if response else None, None, final=final), lambda: sink.cancelled
    )
    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    with pytest.raises(pb_utils.TritonModelException, match="closed"):
        sender.send(pb_utils.InferenceResponse([]))
    with pytest.raises(pb_utils.TritonModelException, match="flags"):
        sender.send(flags=7)


def test_a_request_let_go_without_its_final_response_ends_its_stream_with_an_error(tmp_path: Path) -> None:
    """A decoupled model that drops a request without the final flag left its client waiting (and
    the request's body counted in its user's budget) for ever; the stream now ends with an error
    naming the model, once the model holds nothing of the request any more."""
    repo = tmp_path / "repo"
    (repo / "dropper" / "1").mkdir(parents=True)
    (repo / "dropper" / "1" / "model.py").write_text(MODEL)
    (repo / "dropper" / "config.pbtxt").write_text(CONFIG.format(name="dropper", extra=""))
    with Server(repo) as server:
        stream = server.stream("dropper", {"IN": np.array([0], np.int32)}, timeout=30)
        with pytest.raises(ModelExecutionError, match="released a request without sending its final"):
            next(stream)
        stream = server.stream("dropper", {"IN": np.array([1], np.int32)}, timeout=30)
        assert int(next(stream)["OUT"][0]) == 1
        with pytest.raises(ModelExecutionError, match="without sending its final response"):
            next(stream)
        kept = server.stream("dropper", {"IN": np.array([2], np.int32)}, timeout=0.5)
        next(kept)  # where the model runs (its pid)
        with pytest.raises(RequestTimeout):  # still the model's to finish: it keeps the sender
            next(kept)
        kept.close()
