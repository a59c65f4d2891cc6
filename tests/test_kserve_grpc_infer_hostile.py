"""``ModelInfer`` on grpcio's polling thread (kserve/grpc_infer.py) against hostile clients.

The queue counts a call among the frontend's inference calls when it arrives, before its message is
read, and answers it from grpcio's polling thread or a model's instance thread.  Each test is a way a
local client may try to hold that count, the daemon's memory or its threads: the count and the body
budget must come back, the daemon must stay up, and other clients must be served.  They also guard the
coupling to grpcio's private server state: a grpcio that changes it fails here first.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2

from edge_server.limits import LimitOptions, Limits
from tests.daemon import wait_for
from tests.test_kserve_grpc_infer_queue import CONFIG, in_process, infer, start_serving, write_repository

pytestmark = pytest.mark.daemon

METHOD = "/inference.GRPCInferenceService/ModelInfer"

#: Answers ``INPUT0[0]`` ones: a small request, a large answer.
GROW = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()[0])
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.ones(n, np.float32))]))
        return responses
"""


def with_grow(repo: Path) -> Path:
    (repo / "grow" / "1").mkdir(parents=True)
    (repo / "grow" / "config.pbtxt").write_text(CONFIG.format(name="grow", count=1))
    (repo / "grow" / "1" / "model.py").write_text(GROW)
    return repo


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


class NoReader:
    """An HTTP/2 client that sends ``ModelInfer`` calls and never lets the server send it a byte of data.

    Its settings give every stream a flow-control window of 0 and it never opens one: the answers stay
    in the server.  It answers settings and pings, so that grpc keeps the connection.  ``frames``
    counts what the server sent, by frame type (3: RST_STREAM, a call the server cancelled).
    """

    RST_STREAM = 3

    def __init__(self, port: int) -> None:
        self._sock = socket.create_connection(("127.0.0.1", port))
        self._lock = threading.Lock()
        self._next = 1
        self.frames: dict[int, int] = {}
        initial_window_0 = struct.pack(">HI", 4, 0)
        self._send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, initial_window_0))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _send(self, data: bytes) -> None:
        with self._lock:
            self._sock.sendall(data)

    def _read(self) -> None:
        buffer = b""
        while data := self._sock.recv(1 << 16):
            buffer += data
            while len(buffer) >= 9 and len(buffer) >= 9 + (size := int.from_bytes(buffer[:3], "big")):
                kind, flags, payload, buffer = buffer[3], buffer[4], buffer[9 : 9 + size], buffer[9 + size :]
                self.frames[kind] = self.frames.get(kind, 0) + 1
                if kind in (4, 6) and not flags & 1:  # SETTINGS, PING: acknowledged
                    self._send(_frame(kind, 1, 0, b"" if kind == 4 else payload))

    def call(self, request: service_pb2.ModelInferRequest) -> None:
        body = request.SerializeToString()
        message = b"\0" + struct.pack(">I", len(body)) + body  # fits the default window and frame
        fields = {":method": "POST", ":scheme": "http", ":path": METHOD, ":authority": "localhost"}
        fields.update({"content-type": "application/grpc", "te": "trailers"})
        # HPACK literals, not indexed, no Huffman
        head = b"".join(
            b"\0" + bytes((len(k),)) + k.encode() + bytes((len(v),)) + v.encode() for k, v in fields.items()
        )
        stream, self._next = self._next, self._next + 2
        self._send(_frame(1, 4, stream, head) + _frame(0, 1, stream, message))  # END_HEADERS; END_STREAM

    def close(self) -> None:
        self._sock.shutdown(socket.SHUT_RDWR)
        self._reader.join(10)
        self._sock.close()


def grow(n: int) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="grow")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1])
    request.raw_input_contents.append(np.array([n], np.float32).tobytes())
    return request


def never(stop: threading.Event) -> Iterator[bytes]:
    """A request stream that sends nothing until ``stop``: a call opened, its message never sent."""
    stop.wait()
    yield from ()


def test_a_call_whose_message_never_comes_gives_its_count_back(tmp_path: Path) -> None:
    """Calls that open and never send their message (a slow-loris) are cancelled past the body timeout.

    Before, each held one of the inference count's places for as long as its client liked: 120 of them
    (2 here) refused every other client's inference, on one connection.
    """
    limits = Limits(LimitOptions(body_timeout_s=0.5))
    stop = threading.Event()
    with in_process(write_repository(tmp_path / "repo"), max_workers=4, limits=limits) as frontend:
        with grpc.insecure_channel(f"127.0.0.1:{frontend.port}") as channel:
            call = channel.stream_unary(METHOD)
            hanging = [call.future(never(stop)) for _ in range(2)]
            try:
                for future in hanging:
                    with pytest.raises(grpc.RpcError) as cut:
                        future.result(timeout=30)
                    assert cut.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                    assert "--body-timeout-secs" in (cut.value.details() or "")
            finally:
                stop.set()
        wait_for(lambda: frontend._inference == 0, 30, "the count given back")
        with grpcclient.InferenceServerClient(f"127.0.0.1:{frontend.port}") as client:
            assert np.array_equal(infer(client, "quick", np.ones(2, np.float32)), np.full(2, 2, np.float32))
        wait_for(lambda: frontend._inference == 0, 30, "the count given back")


def test_answers_a_client_never_reads_count_in_its_reply_budget(tmp_path: Path) -> None:
    """Unread answers count in the user's reply bound, as a stream's do; past it the heaviest is cut off.

    Before, an answer left the inference count when it was handed to grpc: a client that sent small
    calls and never read the large answers made the daemon hold all of them (60 answers of 16 MiB
    from one connection: +1.9 GiB resident, on the old worker path too), with no bound at all.
    """
    limits = Limits(LimitOptions(max_client_reply_bytes=8 << 20))
    with in_process(with_grow(write_repository(tmp_path / "repo")), limits=limits) as frontend:
        client = NoReader(frontend.port)
        try:
            for _ in range(8):
                client.call(grow(1 << 19))  # 2 MiB answers: the fifth is over the bound
            wait_for(lambda: client.frames.get(NoReader.RST_STREAM, 0) >= 1, 30, "a call cut off")
            # every answer is with grpc (counted, and the bound enforced) once the calls leave the count
            wait_for(lambda: frontend._inference == 0, 30, "every call answered")
            assert not limits.replies.over(os.getuid())
        finally:
            client.close()
        wait_for(lambda: limits.replies.heaviest(os.getuid()) is None, 30, "the answers given back")
        wait_for(lambda: frontend._inference == 0, 30, "the count given back")
        assert limits.status()["cut_off_streams"] >= 1
        with grpcclient.InferenceServerClient(f"127.0.0.1:{frontend.port}") as reader:
            assert infer(reader, "grow", np.full(1, 3, np.float32)).tolist() == [1.0, 1.0, 1.0]


@pytest.fixture(params=["queue", "workers"])
def server_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Either server: the polling thread's queue, or grpcio's workers (a grpcio the queue cannot use)."""
    from edge_server.kserve import grpc_infer

    if request.param == "workers":
        monkeypatch.setattr(grpc_infer, "_cygrpc", lambda: None)
    return str(request.param)


#: Sends three 1 MiB calls to the one-instance ``sleepy`` model, says so, and waits to be killed.
VANISHING = """
import sys, time
import grpc, numpy as np
from tritonclient.grpc import service_pb2

channel = grpc.insecure_channel(sys.argv[1])
call = channel.unary_unary(
    "/inference.GRPCInferenceService/ModelInfer",
    request_serializer=service_pb2.ModelInferRequest.SerializeToString,
)
request = service_pb2.ModelInferRequest(model_name="sleepy")
request.inputs.add(name="INPUT0", datatype="FP32", shape=[1 << 18])
request.raw_input_contents.append(np.ones(1 << 18, np.float32).tobytes())
calls = [call.future(request) for _ in range(3)]
print("sent", flush=True)
time.sleep(600)
"""


def large_call(model: str, floats: int) -> bytes:
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[floats])
    request.raw_input_contents.append(np.ones(floats, np.float32).tobytes())
    return request.SerializeToString()


def test_clients_that_give_up_in_every_way_leave_nothing_held(server_kind: str, tmp_path: Path) -> None:
    """Killed with calls running on an instance, cancelled mid-message, past their deadlines: the count
    and the body budget come back to zero, and the next client is answered.

    The answer of a call whose client is gone is sent from the instance's thread on a dead call; the
    call's end must still come back to grpcio's loop, or the server could never stop.
    """
    with in_process(write_repository(tmp_path / "repo"), max_workers=16) as frontend:
        target = f"127.0.0.1:{frontend.port}"
        held = lambda: (frontend._inference, frontend.limits.status()["body_bytes_in_flight"])  # noqa: E731
        client = subprocess.Popen([sys.executable, "-c", VANISHING, target], stdout=subprocess.PIPE)
        try:
            assert client.stdout is not None and client.stdout.readline() == b"sent\n"
            # each 1 MiB body counted: the three calls are read, one runs, two wait for the instance
            wait_for(lambda: held()[1] >= 3 << 20, 30, "three calls read")
            assert held()[0] == 3
        finally:
            client.kill()
            client.wait()
        with grpc.insecure_channel(target) as channel:
            call = channel.unary_unary(METHOD)
            body = large_call("busy", 8 << 20)  # 32 MiB
            for delay in (0, 0.001, 0.01, 0.05):
                future = call.future(body)
                threading.Event().wait(delay)
                future.cancel()
            small = {model: large_call(model, 64) for model in ("quick", "busy", "sleepy")}
            storm = [
                call.future(small[m], timeout=t) for m in small for t in (1e-3, 5e-3, 0.05) for _ in range(10)
            ]
            for future in storm:
                with contextlib.suppress(grpc.RpcError):
                    future.result()
        wait_for(lambda: held() == (0, 0), 60, "the count and the body budget given back")
        with grpcclient.InferenceServerClient(target) as reader:
            assert np.array_equal(infer(reader, "quick", np.ones(2, np.float32)), np.full(2, 2, np.float32))
            assert reader.is_server_live()


def test_sigterm_during_a_flood_of_large_calls_exits_cleanly(tmp_path: Path) -> None:
    """SIGTERM while many connections send 8 MiB calls, some mid-message, some answered from the
    instances' threads: the daemon exits 0, with no crash in grpc core, and every client hears an end."""
    daemon, port = start_serving(tmp_path, "--exit-timeout-secs", "2")
    answered = threading.Semaphore(0)
    outcomes: list[str] = []
    body = large_call("busy", 2 << 20)

    def flood(model: str) -> None:
        unbounded = [("grpc.max_receive_message_length", -1)]
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=unbounded) as channel:
            call = channel.unary_unary(METHOD)
            for _ in range(20):
                try:
                    call(body if model == "busy" else large_call(model, 2 << 20), timeout=120)
                    answered.release()
                except grpc.RpcError as exc:
                    outcomes.append(exc.code().name)
                    return
        outcomes.append("all answered")

    threads = [threading.Thread(target=flood, args=(m,)) for m in ("busy", "quick", "sleepy") * 4]
    try:
        for thread in threads:
            thread.start()
        for _ in range(8):  # the flood is under way
            assert answered.acquire(timeout=120), outcomes
    finally:
        status = daemon.stop(timeout=60)
        for thread in threads:
            thread.join(120)
    log = daemon.log()
    assert status == 0, log
    assert not any(thread.is_alive() for thread in threads)
    assert len(outcomes) == len(threads)
    for crash in ("double free", "Aborted", "Fatal Python error", "Traceback", "Segmentation"):
        assert crash not in log, log


def mutations(seed: int, count: int) -> Iterator[bytes]:
    """Random bytes, and valid requests with bytes flipped, cut short or grown: what a fuzzer sends."""
    rng = np.random.default_rng(seed)
    valid = large_call("quick", 4)
    for index in range(count):
        kind = index % 4
        if kind == 0:
            yield rng.integers(0, 256, int(rng.integers(1, 200)), np.uint8).tobytes()
        elif kind == 1:
            data = bytearray(valid)
            for at in rng.integers(0, len(data), 3):
                data[at] = int(rng.integers(0, 256))
            yield bytes(data)
        elif kind == 2:
            yield valid[: int(rng.integers(1, len(valid)))]
        else:
            yield valid + rng.integers(0, 256, int(rng.integers(1, 64)), np.uint8).tobytes()


def test_garbled_messages_get_a_status_each_and_hold_nothing(server_kind: str, tmp_path: Path) -> None:
    """Each garbled message is answered with a client-error status (never a crash, never a hang) and the
    count comes back; a well-formed call after them is answered."""
    allowed = {"OK", "INTERNAL", "INVALID_ARGUMENT", "UNIMPLEMENTED"}
    with in_process(write_repository(tmp_path / "repo")) as frontend:
        target = f"127.0.0.1:{frontend.port}"
        codes: dict[str, int] = {}
        with grpc.insecure_channel(target) as channel:
            call = channel.unary_unary(METHOD)
            for data in mutations(seed=7, count=400):
                try:
                    call(data, timeout=60)
                    code = "OK"
                except grpc.RpcError as exc:
                    code = exc.code().name
                    if code == "INTERNAL":  # protobuf's refusal, in grpcio's words; nothing else
                        assert exc.details() == "Exception deserializing request!", exc.details()
                codes[code] = codes.get(code, 0) + 1
        assert set(codes) <= allowed, codes
        wait_for(lambda: frontend._inference == 0, 30, "the count given back")
        with grpcclient.InferenceServerClient(target) as client:
            assert np.array_equal(infer(client, "quick", np.ones(2, np.float32)), np.full(2, 2, np.float32))
