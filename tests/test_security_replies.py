"""A client that asks for large outputs and never reads them: the daemon's memory stays bounded.

ZeroMQ queues up to 10,000 replies per connection; without a byte cap a client that never reads holds
10,000 large outputs in the daemon.  With ``--max-client-reply-bytes`` the daemon disconnects such a
client once that many bytes of replies wait for it, releases them, and keeps serving everyone else.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from edge_server.client import Client
from edge_server.ipc import protocol
from tests.daemon import Daemon, build_repository, start_daemon, status_kib, stop_daemon, wait_for

BLOB_CONFIG = """
name: "blob"
backend: "python"
max_batch_size: 0
input [ { name: "SIZE", data_type: TYPE_INT64, dims: [ 1 ] } ]
output [ { name: "BLOB", data_type: TYPE_UINT8, dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""

# np.full touches every page: the output is resident memory, as a real model's would be.
BLOB_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            size = int(pb_utils.get_input_tensor_by_name(request, "SIZE").as_numpy()[0])
            blob = np.full(size, 7, dtype=np.uint8)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("BLOB", blob)]))
        return responses
"""

CAP = 64 << 20
BLOB = 1 << 20
REQUESTS = 600  # 600 MiB of replies: ~10 times the cap


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("replies")
    repo = build_repository(root)
    (repo / "blob" / "1").mkdir(parents=True)
    (repo / "blob" / "config.pbtxt").write_text(BLOB_CONFIG)
    (repo / "blob" / "1" / "model.py").write_text(BLOB_MODEL)
    proc = start_daemon(root, repo, "r.sock", "--max-client-reply-bytes", str(CAP))
    try:
        yield proc
    finally:
        status = stop_daemon(proc)
        assert status == 0, f"the daemon exited with {status}:\n{proc.log()}"


def blob_request(rid: int) -> list[bytes]:
    size = np.array([BLOB], np.int64)
    head = {
        "v": protocol.PROTOCOL_VERSION,
        "id": rid,
        "op": "infer",
        "model": "blob",
        "inputs": [{"name": "SIZE", "datatype": "INT64", "shape": [1], "frame": 0}],
    }
    return [protocol.pack(head), size.tobytes()]


def test_a_client_that_never_reads_is_disconnected_and_its_replies_released(capped: Daemon) -> None:
    with Client(capped.address, timeout=30) as other:
        np.testing.assert_array_equal(other.infer("blob", {"SIZE": np.array([16])})["BLOB"], np.full(16, 7))
        slow_before = other.ipc_status()["slow_clients"]
        peak_before = status_kib(capped.pid, "VmHWM")

        ctx = zmq.Context()
        hostile = ctx.socket(zmq.DEALER)
        hostile.setsockopt(zmq.LINGER, 0)
        hostile.setsockopt(zmq.RCVHWM, 1)  # its own process takes (almost) nothing off the wire
        hostile.setsockopt(zmq.RCVBUF, 4096)
        try:
            hostile.connect(capped.address)
            for rid in range(REQUESTS):
                hostile.send_multipart(blob_request(rid))
                if rid % 50 == 0:  # everyone else is still served while the replies pile up
                    got = other.infer("blob", {"SIZE": np.array([8])})["BLOB"]
                    np.testing.assert_array_equal(got, np.full(8, 7))
            wait_for(
                lambda: other.ipc_status()["slow_clients"] > slow_before,
                timeout=60,
                what="the daemon to disconnect the client that does not read",
            )
            grown_mib = (status_kib(capped.pid, "VmHWM") - peak_before) / 1024
            assert grown_mib < CAP / (1 << 20) + 96, f"the daemon's peak RSS grew {grown_mib:.0f} MiB"
        finally:
            hostile.close(0)
            ctx.term()
        # The daemon serves on, and gives the memory back once the replies are released.
        np.testing.assert_array_equal(other.infer("blob", {"SIZE": np.array([4])})["BLOB"], np.full(4, 7))
        wait_for(
            lambda: status_kib(capped.pid, "VmRSS") < peak_before + 48 * 1024,
            timeout=10,
            what="the memory of the released replies to go back to the system",
        )
    assert "not reading its replies" in capped.log()


def test_a_client_that_reads_slowly_but_stays_under_the_cap_keeps_its_connection(capped: Daemon) -> None:
    with Client(capped.address, timeout=30) as client, Client(capped.address, timeout=30) as other:
        released_before = client.ipc_status()["released_clients"]
        done_before = other.statistics("blob")[0]["inference_count"]
        futures = [client.submit("blob", {"SIZE": np.array([BLOB])}) for _ in range(16)]
        # 16 MiB wait in the daemon for a client that reads later
        wait_for(lambda: other.statistics("blob")[0]["inference_count"] >= done_before + 16, what="replies")
        for future in futures:
            assert future.result(30)["BLOB"].nbytes == BLOB
        assert client.ipc_status()["released_clients"] == released_before
