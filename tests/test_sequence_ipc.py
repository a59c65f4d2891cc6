"""The sequence batcher through the real daemon: IPC clients (sync and asyncio) and KServe HTTP."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
from daemon import Daemon, free_port, kserve_flags
from sequence_models import (
    DIRECT,
    OLDEST,
    VALUES,
    accumulate_config,
    accumulate_onnx,
    simple_sequence_config,
    simple_sequence_onnx,
    triton_expected,
    write_model,
)

from edge_server.client import AsyncClient, Client
from edge_server.errors import InvalidArgument


@pytest.fixture(scope="module")
def http_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def grpc_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def seq_daemon(tmp_path_factory: pytest.TempPathFactory, http_port: int, grpc_port: int) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("seq_ipc")
    repo = root / "models"
    write_model(repo, "simple_direct", simple_sequence_config("simple_direct", DIRECT), simple_sequence_onnx)
    write_model(repo, "simple_oldest", simple_sequence_config("simple_oldest", OLDEST), simple_sequence_onnx)
    write_model(repo, "acc", accumulate_config("acc", OLDEST), accumulate_onnx)
    write_model(repo, "acc_idle", accumulate_config("acc_idle", DIRECT, idle_us=100_000), accumulate_onnx)
    proc = Daemon(repo, f"ipc://{root}/seq.sock", root / "seq.log", *kserve_flags(http_port, grpc_port))
    proc.start()
    yield proc
    assert proc.stop() == 0, proc.log()


def _run(client: Client, model: str, corrid: int | str, values: list[int]) -> list[int]:
    out = []
    for i, v in enumerate(values):
        result = client.infer(
            model,
            {"INPUT": np.array([[v]], np.int32)},
            sequence_id=corrid,
            sequence_start=i == 0,
            sequence_end=i == len(values) - 1,
        )
        out.append(int(result["OUTPUT"][0, 0]))
    return out


@pytest.mark.parametrize("model", ["simple_direct", "simple_oldest"])
def test_triton_sequences_from_several_ipc_clients(seq_daemon: Daemon, model: str) -> None:
    sequences = {1000: [0, *VALUES], 1001: [100, *[-v for v in VALUES]], "cam-7": [20, *[-v for v in VALUES]]}
    results: dict[int | str, list[int]] = {}

    def one_client(corrid: int | str, values: list[int]) -> None:
        with Client(seq_daemon.address) as client:
            results[corrid] = _run(client, model, corrid, values)

    threads = [threading.Thread(target=one_client, args=item) for item in sequences.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for corrid, values in sequences.items():
        assert results[corrid] == triton_expected(values[0], values[1:])


def test_async_client_keeps_each_sequence_in_order(seq_daemon: Daemon) -> None:
    async def main() -> dict[int, list[int]]:
        async with AsyncClient(seq_daemon.address) as client:
            inputs = {c: list(range(c, c + 20)) for c in range(1, 9)}
            tasks = {
                c: [
                    asyncio.ensure_future(
                        client.infer(
                            "acc",
                            {"INPUT": np.array([[v]], np.int32)},
                            sequence_id=c,
                            sequence_start=i == 0,
                            sequence_end=i == 19,
                        )
                    )
                    for i, v in enumerate(values)
                ]
                for c, values in inputs.items()
            }
            answers: dict[int, list[int]] = {}
            for c, ts in tasks.items():  # not a nested comprehension: Python 3.10 refuses await in one
                answers[c] = [int((await t)["OUTPUT"][0, 0]) for t in ts]
            return answers

    results = asyncio.run(main())
    for c, got in results.items():
        assert got == np.cumsum(range(c, c + 20)).tolist()


def test_ipc_sequence_errors_are_invalid_argument(seq_daemon: Daemon) -> None:
    with Client(seq_daemon.address) as client:
        x = {"INPUT": np.array([[1]], np.int32)}
        with pytest.raises(InvalidArgument, match="must specify a non-zero or non-empty correlation ID"):
            client.infer("acc", x)
        with pytest.raises(InvalidArgument, match="not in progress"):
            client.infer("acc", x, sequence_id=4242, sequence_end=True)
        client.infer("acc", x, sequence_id=4243, sequence_start=True)
        with pytest.raises(InvalidArgument, match="server fills"):
            client.infer("acc", {**x, "ACC_IN": np.zeros((1, 1), np.int32)}, sequence_id=4243)
        assert int(client.infer("acc", x, sequence_id=4243, sequence_end=True)["OUTPUT"][0, 0]) == 2
        stats = client.statistics("acc")[0]["sequence_stats"]
        assert stats["started"] >= 1 and stats["active"] == 0


# Triton's test_no_sequence_end: start 1, 2, then START 42 on the same live id, END 9.  The second
# START ends the first sequence (its requests already sent ran first) and starts afresh: 42, then 51.
RESTART_STEPS = [(1, "s"), (2, ""), (42, "s"), (9, "e")]
RESTART_SUMS = [1, 3, 42, 51]


@pytest.mark.parametrize("model", ["acc", "acc_idle"])
def test_a_second_start_restarts_the_sequence_over_ipc(seq_daemon: Daemon, model: str) -> None:
    with Client(seq_daemon.address) as client:
        got = [
            int(
                client.infer(
                    model,
                    {"INPUT": np.array([[value]], np.int32)},
                    sequence_id=4566,
                    sequence_start="s" in flags,
                    sequence_end="e" in flags,
                )["OUTPUT"][0, 0]
            )
            for value, flags in RESTART_STEPS
        ]
        assert got == RESTART_SUMS
        with pytest.raises(InvalidArgument, match="not in progress"):  # it ended with the END
            client.infer(model, {"INPUT": np.array([[1]], np.int32)}, sequence_id=4566)


def test_a_second_start_restarts_the_sequence_over_http_tritonclient(
    seq_daemon: Daemon, http_port: int
) -> None:
    httpclient = pytest.importorskip("tritonclient.http")
    with httpclient.InferenceServerClient(url=f"127.0.0.1:{http_port}") as client:
        got = []
        for value, flags in RESTART_STEPS:
            tensor = httpclient.InferInput("INPUT", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.full((1, 1), value, np.int32))
            result = client.infer(
                "acc",
                [tensor],
                sequence_id=4567,
                sequence_start="s" in flags,
                sequence_end="e" in flags,
            )
            got.append(int(result.as_numpy("OUTPUT")[0, 0]))
        assert got == RESTART_SUMS
        stats = client.get_inference_statistics("acc")["model_stats"][0]
        assert stats["inference_count"] >= len(RESTART_STEPS)


def _http_infer(port: int, model: str, value: int, **parameters: object) -> dict:
    body = {
        "inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [1, 1], "data": [value]}],
        "parameters": parameters,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v2/models/{model}/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, **json.loads(exc.read())}


def test_kserve_http_sequence_parameters(seq_daemon: Daemon, http_port: int) -> None:
    values = [0, *VALUES]
    got = []
    for i, v in enumerate(values):
        answer = _http_infer(
            http_port,
            "simple_oldest",
            v,
            sequence_id=2000,
            sequence_start=i == 0,
            sequence_end=i == len(values) - 1,
        )
        got.append(answer["outputs"][0]["data"][0])
    assert got == triton_expected(0, VALUES)
    error = _http_infer(http_port, "simple_oldest", 1, sequence_id=2001)
    assert error["status"] == 400 and "not in progress" in error["error"]


def test_tritonclient_grpc_stream_runs_tritons_sequence_example(seq_daemon: Daemon, grpc_port: int) -> None:
    """Triton's simple_grpc_sequence_stream_infer_client, as written, against edge-server."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    import queue

    answers: queue.Queue = queue.Queue()
    sequences = {1000: [0, *VALUES], 1001: [100, *[-v for v in VALUES]]}
    with grpcclient.InferenceServerClient(url=f"127.0.0.1:{grpc_port}") as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        for corrid, values in sequences.items():
            for count, value in enumerate(values, start=1):
                tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
                tensor.set_data_from_numpy(np.full((1, 1), value, np.int32))
                client.async_stream_infer(
                    model_name="simple_direct",
                    inputs=[tensor],
                    outputs=[grpcclient.InferRequestedOutput("OUTPUT")],
                    request_id=f"{corrid}_{count}",
                    sequence_id=corrid,
                    sequence_start=count == 1,
                    sequence_end=count == len(values),
                )
        got: dict[int, list[int]] = {c: [] for c in sequences}
        for _ in range(sum(len(v) for v in sequences.values())):
            result, error = answers.get(timeout=10)
            assert error is None, error
            corrid = int(result.get_response().id.split("_")[0])
            got[corrid].append(int(result.as_numpy("OUTPUT")[0][0]))
        client.stop_stream()
    for corrid, values in sequences.items():
        assert got[corrid] == triton_expected(values[0], values[1:])


def test_idle_sequence_expires_with_the_documented_error_over_ipc(seq_daemon: Daemon) -> None:
    with Client(seq_daemon.address) as client:
        x = {"INPUT": np.array([[3]], np.int32)}
        assert int(client.infer("acc_idle", x, sequence_id="cam-1", sequence_start=True)["OUTPUT"][0, 0]) == 3
        expired = threading.Event()
        while not expired.wait(0.02):  # ask the daemon, not the clock
            if client.statistics("acc_idle")[0]["sequence_stats"]["expired"] >= 1:
                expired.set()
        with pytest.raises(InvalidArgument, match="released after being idle for more than 100000 us"):
            client.infer("acc_idle", x, sequence_id="cam-1")
