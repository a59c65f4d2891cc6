"""An iterative-sequence model called without a sequence id (L0_backend_python request_rescheduling).

Triton's iterative sequencer gives such a request a sequence of its own (a fresh correlation id, with
START), so that ``client.infer(model, inputs)`` works on a model whose requests the model reschedules.
Through the daemon and the real tritonclient, over HTTP and gRPC (a stream for the decoupled model);
the models are those of ``tests/test_request_rescheduling.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from queue import Queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.daemon import Daemon, free_port, kserve_flags
from tests.test_request_rescheduling import build

pytestmark = pytest.mark.usefixtures("no_leaked_processes")


@pytest.fixture(scope="module")
def ports(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    root = tmp_path_factory.mktemp("iter")
    http_port, grpc_port = free_port(), free_port()
    daemon = Daemon(
        build(root / "repo", root / "runs.log"),
        f"ipc://{root}/i.sock",
        root / "i.log",
        *kserve_flags(http_port, grpc_port),
    )
    daemon.start()
    try:
        yield http_port, grpc_port
    finally:
        assert daemon.stop() == 0, daemon.log()


def _input(module, n: int):  # type: ignore[no-untyped-def]
    inp = module.InferInput("N", [1, 1], "INT32")
    inp.set_data_from_numpy(np.array([[n]], np.int32))
    return inp


@pytest.mark.parametrize("model", ["counter", "counter_isolated"])
def test_a_request_without_a_sequence_id_is_a_sequence_of_its_own(ports: tuple[int, int], model: str) -> None:
    http = httpclient.InferenceServerClient(f"127.0.0.1:{ports[0]}")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{ports[1]}")
    assert http.infer(model, [_input(httpclient, 5)]).as_numpy("OUT").tolist() == [[5]]
    assert grpc.infer(model, [_input(grpcclient, 3)]).as_numpy("OUT").tolist() == [[3]]


def test_concurrent_requests_without_ids_keep_their_own_state(ports: tuple[int, int]) -> None:
    results: dict[int, int] = {}

    def one(n: int) -> None:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{ports[0]}")
        results[n] = int(
            client.infer("counter", [_input(httpclient, n)], request_id="same").as_numpy("OUT")[0, 0]
        )

    threads = [threading.Thread(target=one, args=(n,)) for n in (2, 4, 6, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {2: 2, 4: 4, 6: 6, 9: 9}


def test_a_decoupled_stream_without_a_sequence_id(ports: tuple[int, int]) -> None:
    got: Queue = Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{ports[1]}")
    client.start_stream(callback=lambda result, error: got.put(error or result))
    try:
        client.async_stream_infer("streamer", [_input(grpcclient, 3)], request_id="s3")
        outs = []
        for _ in range(3):
            item = got.get(timeout=30)
            if isinstance(item, InferenceServerException):
                raise item
            outs.append(int(item.as_numpy("OUT")[0, 0]))
        assert outs == [2, 1, 0]
    finally:
        client.stop_stream()
