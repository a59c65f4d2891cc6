"""``--max-client-reply-bytes`` bounds one user's unread replies, however many streams or connections.

The bound used to be per gRPC stream and per IPC connection, so a user that opened four of them held
four times the bound.  Now every holder of unsent replies counts in its uid's share of one budget,
gRPC and IPC together, and the one holding the most is cut off once the uid passes the bound.  Each
holder here stays under the bound on its own (8-12 MiB of 16 MiB); together they pass it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from edge_server.client import Client
from edge_server.ipc import protocol
from tests.daemon import Daemon, build_repository, free_port, start_daemon, stop_daemon, wait_for

CAP = 16 << 20
FLOATS = 1 << 18  # 1 MiB of FP32 per request, and per reply of ``identity``
STREAMS = 8


def still_serves(proc: Daemon) -> None:
    assert proc.proc is not None and proc.proc.poll() is None, proc.log()
    with Client(proc.address, timeout=30) as client:
        x = np.arange(4, dtype=np.float32)
        np.testing.assert_array_equal(client.infer("identity", {"INPUT0": x})["OUTPUT0"], x)


def test_a_users_grpc_streams_share_one_reply_bound(tmp_path: Path) -> None:
    """Eight streams that never read, 12 MiB of responses each: a stream is cancelled (one user held
    all of them at a 16 MiB bound before), while a stream of the same user that reads gets every
    response."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    grpc_port = free_port()
    proc = start_daemon(
        tmp_path,
        build_repository(tmp_path),
        "g.sock",
        "--allow-grpc",
        "true",
        "--grpc-port",
        str(grpc_port),
        "--max-client-reply-bytes",
        str(CAP),
    )
    request = service_pb2.ModelInferRequest(model_name="identity")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[FLOATS])
    request.raw_input_contents.append(np.zeros(FLOATS, np.float32).tobytes())
    # one channel and one connection per stream, as separate clients would: channels to one address
    # share one connection otherwise, and the streams of a connection that reads nothing stop being
    # read together (HTTP/2's window updates wait behind the unread answers), under the bound or not
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=options) for _ in range(STREAMS + 1)]
    stop = threading.Event()

    def twelve() -> Iterator[Any]:
        yield from [request] * 12  # within the 16 requests a stream has in flight
        stop.wait()  # the stream stays open, never read

    try:
        stubs = [service_pb2_grpc.GRPCInferenceServiceStub(channel) for channel in channels]
        calls = [stub.ModelStreamInfer(twelve()) for stub in stubs[:STREAMS]]
        with Client(proc.address, timeout=30) as client:
            try:
                wait_for(
                    lambda: client.ipc_status()["limits"]["cut_off_streams"] >= 1,
                    timeout=60,
                    what="a stream of the user over its reply bound to be cut off",
                )
            except AssertionError as exc:
                raise AssertionError(f"{exc}; status: {client.ipc_status()}\n{proc.log()}") from None
            cut = client.ipc_status()["limits"]["cut_off_streams"]
            assert cut < STREAMS, cut  # the bound is met by cutting who holds the most, not everyone
        small = service_pb2.ModelInferRequest(model_name="identity")
        small.inputs.add(name="INPUT0", datatype="FP32", shape=[4])
        small.raw_input_contents.append(np.zeros(4, np.float32).tobytes())
        reader = stubs[STREAMS].ModelStreamInfer(iter([small] * 50))
        assert sum(1 for response in reader if not response.error_message) == 50
        still_serves(proc)
        del calls
    finally:
        stop.set()
        for channel in channels:
            channel.close()
        assert stop_daemon(proc) == 0, proc.log()


def _identity_request(rid: int) -> list[bytes]:
    head = {
        "v": protocol.PROTOCOL_VERSION,
        "id": rid,
        "op": "infer",
        "model": "identity",
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [FLOATS], "frame": 0}],
    }
    return [protocol.pack(head), np.zeros(FLOATS, np.float32).tobytes()]


def test_a_users_ipc_connections_share_one_reply_bound(tmp_path: Path) -> None:
    """Three IPC connections that never read, 8 MiB of replies each: one is disconnected (each stayed
    under the bound alone before), and a connection of the same user that reads keeps its own."""
    proc = start_daemon(tmp_path, build_repository(tmp_path), "i.sock", "--max-client-reply-bytes", str(CAP))
    ctx = zmq.Context()
    hostile: list[zmq.Socket] = []
    try:
        with Client(proc.address, timeout=30) as reader:
            x = np.arange(FLOATS, dtype=np.float32)
            np.testing.assert_array_equal(reader.infer("identity", {"INPUT0": x})["OUTPUT0"], x)
            for _ in range(3):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, 1)  # its own process takes (almost) nothing off the wire
                sock.setsockopt(zmq.RCVBUF, 4096)
                sock.connect(proc.address)
                hostile.append(sock)
                for rid in range(8):
                    sock.send_multipart(_identity_request(rid))
            wait_for(
                lambda: reader.ipc_status()["slow_clients"] >= 1,
                timeout=60,
                what="a connection of the user over its reply bound to be disconnected",
            )
            assert reader.ipc_status()["slow_clients"] < 3  # who holds the most, not everyone
            for _ in range(4):  # the user's reading connection is served on
                np.testing.assert_array_equal(reader.infer("identity", {"INPUT0": x})["OUTPUT0"], x)
        still_serves(proc)
    finally:
        for sock in hostile:
            sock.close(0)
        ctx.term()
        assert stop_daemon(proc) == 0, proc.log()
