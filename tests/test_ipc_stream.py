"""Decoupled models and request parameters over IPC, through both client libraries and raw frames."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_server.client import AsyncClient, Client
from edge_server.errors import ConnectionLost, InvalidArgument, ModelExecutionError, ReplyTimeout
from edge_server.ipc import protocol
from tests.daemon import Daemon, RawPeer, build_repository, header, start_daemon, stop_daemon
from tests.decoupled_models import add_decoupled_models, add_params_model


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stream")


@pytest.fixture(scope="module")
def daemon(root: Path) -> Iterator[Daemon]:
    repo = build_repository(root)
    add_decoupled_models(repo, root / "repeat.log")
    add_params_model(repo)
    proc = start_daemon(root, repo, "s.sock")
    try:
        yield proc
    finally:
        assert stop_daemon(proc) == 0, proc.log()


@pytest.fixture
def client(daemon: Daemon) -> Iterator[Client]:
    with Client(daemon.address, timeout=30) as c:
        yield c


def repeat_inputs(values: list[int], delay_ms: int = 0) -> dict[str, np.ndarray]:
    return {"IN": np.array(values, np.int32), "DELAY": np.full(len(values), delay_ms, np.uint32)}


def test_many_responses_sent_after_execute_returned(client: Client) -> None:
    responses = list(client.stream("repeat", repeat_inputs([7, 8, 9], delay_ms=5)))
    assert [int(r["OUT"][0]) for r in responses] == [7, 8, 9]
    assert [int(r["IDX"][0]) for r in responses] == [0, 1, 2]


@pytest.mark.parametrize("n", [0, 1, 4])
def test_zero_one_many(client: Client, n: int) -> None:
    outs = [int(r["OUT"][0]) for r in client.stream("square", {"IN": np.array([n], np.int32)})]
    assert outs == [n * n] * n


def test_error_mid_stream_then_more_responses(client: Client) -> None:
    stream = client.stream("flaky", {"IN": np.array([0], np.int32)})
    assert int(next(stream)["OUT"][0]) == 1
    with pytest.raises(ModelExecutionError, match="second response failed"):
        next(stream)
    assert int(next(stream)["OUT"][0]) == 3
    assert list(stream) == []


def test_execute_raising_ends_the_stream(client: Client) -> None:
    with pytest.raises(ModelExecutionError, match="negative input"):
        list(client.stream("flaky", {"IN": np.array([-1], np.int32)}))


def test_plain_infer_on_a_decoupled_model_is_a_clear_error(client: Client) -> None:
    with pytest.raises(InvalidArgument, match="decoupled"):
        client.infer("square", {"IN": np.array([1], np.int32)})


def test_streams_interleave_with_ordinary_requests(client: Client) -> None:
    first = client.stream("repeat", repeat_inputs([1, 2, 3, 4], delay_ms=10))
    second = client.stream("square", {"IN": np.array([2], np.int32)})
    x = np.arange(16, dtype=np.float32)
    np.testing.assert_array_equal(client.infer("identity", {"INPUT0": x})["OUTPUT0"], x)
    assert [int(r["OUT"][0]) for r in second] == [4, 4]
    assert [int(r["OUT"][0]) for r in first] == [1, 2, 3, 4]


def test_client_stopping_early_cancels_in_the_model(client: Client, root: Path) -> None:
    log = root / "repeat.log"
    before = log.read_text().count("\n") if log.exists() else 0
    with client.stream("repeat", repeat_inputs(list(range(100)), delay_ms=20)) as stream:
        assert int(next(stream)["OUT"][0]) == 0
    deadline = time.monotonic() + 10
    while (log.read_text().count("\n") if log.exists() else 0) == before and time.monotonic() < deadline:
        time.sleep(0.02)
    sent, cancelled = map(int, log.read_text().splitlines()[-1].split())
    assert cancelled == 1 and sent < 100
    assert client.infer("identity", {"INPUT0": np.zeros(16, np.float32)})  # the connection is fine


def test_per_response_timeout(client: Client) -> None:
    stream = client.stream("repeat", repeat_inputs([1], delay_ms=3000), timeout=0.2)
    with pytest.raises(ReplyTimeout):
        next(stream)
    stream.close()


def test_parameters_and_sequence_fields_reach_the_model(client: Client) -> None:
    params = {"threshold": 3, "label": "cat", "strict": True}
    out = client.infer(
        "params",
        {"IN": np.array([1], np.int32)},
        parameters=params,
        sequence_id=42,
        sequence_start=True,
    )
    seen = json.loads(out["PARAMS"][0])
    assert seen["parameters"] == params
    assert out.parameters == {"seen": 3, "model": "params", "echo": True}  # the response's parameters
    assert seen["correlation_id"] == 42 and seen["flags"] == 1
    assert seen["request_id"]  # the IPC request id


@pytest.mark.parametrize(
    "parameters",
    [{"x": float("inf")}, {"x": [1]}, {"x": None}, {"": 1}, {f"k{i}": i for i in range(65)}],
)
def test_bad_parameters_are_refused(client: Client, parameters: dict) -> None:
    with pytest.raises(InvalidArgument, match="parameter"):
        client.infer("params", {"IN": np.array([1], np.int32)}, parameters=parameters)


def test_raw_stream_protocol(daemon: Daemon) -> None:
    peer = RawPeer(daemon.address)
    try:
        desc = {"name": "IN", "datatype": "INT32", "shape": [1], "frame": 0}
        peer.sock.send_multipart(
            [header(op="stream", model="square", inputs=[desc]), np.array([2], np.int32).tobytes()]
        )
        replies = []
        while not replies or not replies[-1]["final"]:
            replies.append(peer.recv(10.0))
        assert [r["final"] for r in replies] == [False, True]
        assert all(r["ok"] and r["id"] == 1 for r in replies)
        # shm outputs are refused for streams; a stream needs an id
        bad = peer.ask([header(op="stream", model="square", inputs=[], outputs=[{"name": "OUT", "shm": {}}])])
        assert bad["ok"] is False
        no_id = protocol.pack({"v": 1, "op": "stream", "model": "square", "inputs": [desc]})
        reply = peer.ask([no_id, np.array([1], np.int32).tobytes()])
        assert reply["error"]["code"] == "MALFORMED_MESSAGE"
    finally:
        peer.close()


def test_asyncio_client_streams(daemon: Daemon) -> None:
    async def run() -> tuple[list[int], list[int]]:
        async with AsyncClient(daemon.address, timeout=30) as client:
            a = await client.stream("square", {"IN": np.array([3], np.int32)})
            b = await client.stream("repeat", repeat_inputs([5, 6], delay_ms=5))
            return [int(r["OUT"][0]) async for r in a], [int(r["OUT"][0]) async for r in b]

    assert asyncio.run(run()) == ([9, 9, 9], [5, 6])


def test_stream_in_flight_when_the_daemon_dies_ends_with_connection_lost(root: Path) -> None:
    repo = root / "repo"
    proc = start_daemon(root, repo, "dying.sock")
    try:
        with Client(proc.address, timeout=30) as client:
            stream = client.stream("repeat", repeat_inputs(list(range(100)), delay_ms=50))
            assert int(next(stream)["OUT"][0]) == 0
            proc.kill()
            with pytest.raises(ConnectionLost):
                for _ in stream:
                    pass
    finally:
        proc.kill()
        stop_daemon(proc)
