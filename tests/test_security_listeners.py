"""Every listener (IPC, HTTP, gRPC, metrics) asks one descriptor and memory budget (edge_server.limits).

Idle or slow connections from a hostile local user must neither abort the daemon (libzmq aborts when
``accept`` meets EMFILE), nor lock other users out, nor pin threads and memory without end.  A second
user is a forked child that dropped to uid 65534 (the tests need root for it).
"""

from __future__ import annotations

import encodings.idna  # noqa: F401 - the second user's child cannot read the standard library's files
import json
import os
import shutil
import socket
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_server.client import Client
from tests.daemon import (
    Daemon,
    build_repository,
    free_port,
    kserve_flags,
    start_daemon,
    status_kib,
    stop_daemon,
    wait_for,
    wait_rss_back,
)

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a second local user (uid 65534)")


class OtherUser:
    """A forked child, dropped to uid 65534, that runs ``hold()`` and keeps what it opened until closed."""

    def __init__(self, hold: Callable[[], Any]) -> None:
        result_read, result_write = os.pipe()
        self._release_read, self._release = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: it holds its connections until the parent closes the pipe
            code = 1
            try:
                os.close(result_read)
                os.close(self._release)
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                kept = hold()
                os.write(result_write, json.dumps({"ok": kept is not None}).encode() + b"\n")
                os.read(self._release_read, 1)
                code = 0
            except BaseException:
                os.write(result_write, json.dumps({"error": traceback.format_exc()}).encode() + b"\n")
            finally:
                os._exit(code)
        os.close(result_write)
        os.close(self._release_read)
        with os.fdopen(result_read, "rb") as pipe:
            answer = json.loads(pipe.readline())
        if "error" in answer:
            self.close()
            raise AssertionError(f"the second user's process failed: {answer['error']}")

    def close(self) -> None:
        if self._release >= 0:
            os.close(self._release)
            self._release = -1
            os.waitpid(self.pid, 0)


def open_idle(port: int, count: int) -> Callable[[], list[socket.socket]]:
    def hold() -> list[socket.socket]:
        kept = []
        for _ in range(count):
            try:
                kept.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                pass
        return kept

    return hold


def still_serves(proc: Daemon) -> None:
    assert proc.proc is not None and proc.proc.poll() is None, proc.log()
    with Client(proc.address, timeout=10) as client:
        x = np.arange(4, dtype=np.float32)
        np.testing.assert_array_equal(client.infer("identity", {"INPUT0": x})["OUTPUT0"], x)


def http_get(port: int, path: str, timeout: float = 10.0) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
        return int(response.status)


def exchange(port: int, request: bytes, timeout: float = 30.0) -> tuple[int, str]:
    """Send one whole HTTP request (it should ask ``Connection: close``); the status and body answered.

    A connection refused at accept (a penalized user's) gets its 503 and is closed at once.  A client
    that writes its request in two sends (http.client: the head, then the body) meets the reset on the
    second, raises, and never reads the 503 already in its socket; so one send, then read until the
    end even where the send failed or a reset follows.  Status 0: nothing was answered.
    """
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(request)
        except OSError:
            pass  # refused: what the daemon wrote before it closed is still to be read
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except OSError:
            pass  # the reset after the answer
    head, _, body = data.partition(b"\r\n\r\n")
    fields = head.split(None, 2)
    status = int(fields[1]) if len(fields) > 1 and fields[0].startswith(b"HTTP/") else 0
    return status, body.decode(errors="replace")


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the daemon closed ``sock`` (reads what it sent first, e.g. a 408 or 503)."""
    sock.setblocking(False)
    try:
        while data := sock.recv(65536):
            del data
        return True
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A directory the second user may traverse (pytest's own are 0700, and reset by other sessions)."""
    path = Path(tempfile.mkdtemp(prefix="edge-listeners-"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def listener_daemon(public_dir: Path) -> Iterator[tuple[Daemon, int, int]]:
    """Low descriptors (RLIMIT_NOFILE 256: a budget of 16 connections), every listener on, short timeouts."""
    http, grpc_port = free_port(), free_port()
    proc = start_daemon(
        public_dir,
        build_repository(public_dir),
        "l.sock",
        *kserve_flags(http, grpc_port),
        "--max-client-connections",
        "4",
        "--header-timeout-secs",
        "1",
        "--body-timeout-secs",
        "1",
        "--max-client-body-bytes",
        str(1 << 20),
        "--max-client-streams",
        "3",
        nofile=256,
    )
    try:
        settle(proc)
        yield proc, http, grpc_port
    finally:
        assert stop_daemon(proc) == 0, proc.log()


def settle(proc: Daemon) -> None:
    """Wait until the daemon counts no connection of this user but the one asking.

    A connection the client closed counts against its user's --max-client-connections (4 here) until
    the daemon sees it go: under load, start-up's readiness probes were still counted when a test
    opened its 3 connections, and the third was refused for the user's cap, not the test's reason.
    """
    with Client(proc.address, timeout=10) as client:
        wait_for(
            lambda: client.ipc_status()["limits"]["connections"] <= 1,
            timeout=30,
            what="the daemon to let go of the readiness probes' connections",
        )


@needs_root
def test_idle_tcp_connections_of_another_user_leave_ipc_and_http_to_others(
    listener_daemon: tuple[Daemon, int, int],
) -> None:
    """Item 1: hundreds of idle TCP connections to HTTP and gRPC are refused at accept past the user's
    cap; the daemon neither aborts (EMFILE in libzmq's accept) nor turns other users away."""
    proc, http, grpc_port = listener_daemon
    attacker = OtherUser(lambda: [open_idle(http, 300)(), open_idle(grpc_port, 300)()])
    try:
        still_serves(proc)  # a fresh IPC connection of another user (root) is accepted
        assert http_get(http, "/v2/health/live") == 200
        with Client(proc.address, timeout=10) as client:
            status = client.ipc_status()
        assert status["connections"] >= 1, status
    finally:
        attacker.close()
    still_serves(proc)


@needs_root
def test_ipc_connections_are_capped_per_user_beside_the_global_cap(
    listener_daemon: tuple[Daemon, int, int],
) -> None:
    """Item 23: one user holding its share of IPC connections does not lock another user out."""
    proc, _http, _grpc = listener_daemon
    os.chmod(proc.address.removeprefix("ipc://"), 0o666)
    path = proc.address.removeprefix("ipc://")

    def hold() -> list[socket.socket]:
        kept = []
        for _ in range(20):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
            except OSError:
                sock.close()
                continue
            kept.append(sock)
        return kept

    attacker = OtherUser(hold)
    try:
        with Client(proc.address, timeout=10) as client:  # root, the second user
            wait_for(lambda: client.ipc_status()["refused_connections"] > 0, what="refusals past the cap")
            assert client.server_live()
        still_serves(proc)
    finally:
        attacker.close()


def test_http_connections_that_send_nothing_or_slow_headers_are_closed(
    listener_daemon: tuple[Daemon, int, int],
) -> None:
    """Item 2: a connection that sends nothing, or headers a byte at a time, is closed at the timeout."""
    proc, http, _grpc = listener_daemon
    idle = [socket.create_connection(("127.0.0.1", http)) for _ in range(3)]
    slow = socket.create_connection(("127.0.0.1", http))
    stop = threading.Event()

    def dribble() -> None:
        for byte in b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000:
            if stop.wait(0.2):
                return
            try:
                slow.send(bytes([byte]))
            except OSError:
                return

    sender = threading.Thread(target=dribble)
    sender.start()
    try:
        wait_for(lambda: all(closed_by_peer(s) for s in [*idle, slow]), timeout=30, what="closed connections")
    finally:
        stop.set()
        sender.join()
        for sock in [*idle, slow]:
            sock.close()
    assert http_get(http, "/v2/health/live") == 200


def test_http_bodies_are_counted_per_user_and_slow_ones_closed(
    listener_daemon: tuple[Daemon, int, int],
) -> None:
    """Item 4: bodies that stop one byte short count against the user's body budget while they arrive:
    past it the next is refused 503; and each is closed at the body timeout, its bytes given back."""
    proc, http, _grpc = listener_daemon
    body = 400 << 10
    head = (
        f"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {body}\r\n\r\n"
    ).encode()
    partial = []
    replies = []
    for _ in range(3):  # 3 x 400 KiB > the 1 MiB budget of one user
        sock = socket.create_connection(("127.0.0.1", http))
        sock.sendall(head + b" " * (body - 1))
        partial.append(sock)
    try:
        for sock in partial:
            sock.settimeout(30)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
            replies.append(data)
    finally:
        for sock in partial:
            sock.close()
    refused = [r for r in replies if r.startswith(b"HTTP/1.1 503")]
    timed_out = [r for r in replies if r.startswith(b"HTTP/1.1 408")]
    assert len(refused) == 1 and b"--max-client-body-bytes" in refused[0], replies
    assert len(timed_out) == 2, replies
    x = [1.0, 2.0, 3.0, 4.0]
    request = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [4], "data": x}]}
    post = urllib.request.Request(
        f"http://127.0.0.1:{http}/v2/models/identity/infer", data=json.dumps(request).encode(), method="POST"
    )
    with urllib.request.urlopen(post, timeout=10) as response:  # the budget came back
        assert json.loads(response.read())["outputs"][0]["data"] == x


def test_a_body_refused_as_it_arrives_gets_its_503_although_the_client_is_still_sending(
    listener_daemon: tuple[Daemon, int, int],
) -> None:
    """A body larger than the user's whole budget is refused 503 while most of it is still on its way.
    Closing with those bytes unread would reset the connection, and the client, still sending, would
    lose the answer (EPIPE or ECONNRESET); the daemon reads and drops the rest, so the 503 arrives."""
    _proc, http, _grpc = listener_daemon
    body = 4 << 20  # 4x the 1 MiB budget: refused after the first MiB, three more still coming
    for _ in range(3):
        sock = socket.create_connection(("127.0.0.1", http))
        sock.settimeout(30)
        head = (
            f"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {body}\r\n\r\n"
        ).encode()
        with sock:
            sock.sendall(head + b" " * body)  # all of it: the daemon reads what it refused
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        assert data.startswith(b"HTTP/1.1 503") and b"--max-client-body-bytes" in data, data


def test_a_small_body_refused_as_it_arrives_is_answered_once(
    listener_daemon: tuple[Daemon, int, int],
) -> None:
    """A request small enough for the connection to answer by itself, its body refused by the budget as it
    arrives: the 503 is its only answer, and the model never runs it, even when the rest of the request
    came in the same read."""
    proc, http, _grpc = listener_daemon
    held = (1 << 20) - (8 << 10)  # of the user's 1 MiB budget, by a body that stops one byte short
    x = np.ones(4096, np.float32)  # 16 KiB: past the room left, in one read
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": [4096],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ]
        }
    ).encode()

    def runs() -> int:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{http}/v2/models/identity/stats", timeout=10
        ) as answer:
            return int(json.loads(answer.read())["model_stats"][0]["inference_count"])

    before = runs()
    with socket.create_connection(("127.0.0.1", http)) as holder, Client(proc.address, timeout=10) as client:
        holder.sendall(
            b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % held
            + b" " * (held - 1)
        )
        wait_for(
            lambda: client.ipc_status()["limits"]["body_bytes_in_flight"] == held - 1,
            what="the daemon to count the held body",
        )
        with socket.create_connection(("127.0.0.1", http)) as sock:
            sock.settimeout(30)
            sock.sendall(
                b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
                b"Inference-Header-Content-Length: %d\r\n\r\n%s%s"
                % (len(header) + x.nbytes, len(header), header, x.tobytes())
            )
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
    assert data.startswith(b"HTTP/1.1 503") and b"--max-client-body-bytes" in data, data
    assert data.count(b"HTTP/1.1 ") == 1, data
    assert runs() == before


def test_metrics_serves_a_bounded_number_of_connections_and_closes_idle_ones(tmp_path: Path) -> None:
    """Item 2: idle connections to /metrics do not each keep a thread for ever."""
    from edge_server.limits import METRICS_CONNECTIONS

    port = free_port()
    proc = start_daemon(
        tmp_path,
        build_repository(tmp_path),
        "m.sock",
        "--allow-metrics",
        "true",
        "--metrics-port",
        str(port),
        "--header-timeout-secs",
        "1",
    )
    try:
        assert http_get(port, "/metrics") == 200
        before = threads_of(proc.pid)
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
        try:
            refused = 40 - METRICS_CONNECTIONS
            wait_for(lambda: sum(closed_by_peer(s) for s in idle) >= refused, what="refusals")
            assert threads_of(proc.pid) <= before + METRICS_CONNECTIONS
            wait_for(lambda: all(closed_by_peer(s) for s in idle), timeout=30, what="idle connections closed")
        finally:
            for sock in idle:
                sock.close()
        wait_for(lambda: threads_of(proc.pid) <= before, what="the endpoint's threads to end")
        assert http_get(port, "/metrics") == 200
    finally:
        assert stop_daemon(proc) == 0, proc.log()


def threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise AssertionError("no Threads line")


def test_grpc_streams_are_capped_per_user_and_health_never_queues(
    listener_daemon: tuple[Daemon, int, int],
) -> None:
    """Item 3: 140 idle ModelStreamInfer streams from one client: past --max-client-streams they are
    refused RESOURCE_EXHAUSTED, and ServerLive/ModelReady of another call still answer."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    proc, _http, grpc_port = listener_daemon
    stop = threading.Event()

    def requests() -> Iterator[Any]:
        stop.wait()
        return
        yield

    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    other = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    try:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        calls = [stub.ModelStreamInfer(requests()) for _ in range(140)]
        wait_for(lambda: sum(c.done() for c in calls) >= 137, timeout=60, what="refused streams")
        codes = [c.code() for c in calls if c.done()]
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 137, codes[:5]
        assert "--max-client-streams" in next(c.details() for c in calls if c.done())
        health = service_pb2_grpc.GRPCInferenceServiceStub(other)
        assert health.ServerLive(service_pb2.ServerLiveRequest(), timeout=10).live
        ready = health.ModelReady(service_pb2.ModelReadyRequest(name="identity"), timeout=10)
        assert ready.ready
    finally:
        stop.set()
        channel.close()
        other.close()
    still_serves(proc)


def test_json_data_past_its_declared_shape_is_refused_unparsed(tmp_path: Path) -> None:
    """Item 5: an 8 KiB gzip body inflating to 8 MiB of ``[],[],...`` is refused before json.loads
    builds millions of lists (+257 MiB before), other HTTP clients are served meanwhile, and the error
    does not quote the input."""
    import gzip

    http = free_port()
    proc = start_daemon(
        tmp_path, build_repository(tmp_path), "j.sock", "--allow-http", "true", "--http-port", str(http)
    )
    try:
        before = status_kib(proc.pid, "VmHWM")
        data = b"[" + b"[]," * ((8 << 20) // 3) + b"[]]"
        body = b'{"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[4],"data":' + data + b"}]}"
        packed = gzip.compress(body)
        request = urllib.request.Request(
            f"http://127.0.0.1:{http}/v2/models/identity/infer",
            data=packed,
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
            method="POST",
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        message = json.loads(refused.value.read())["error"]
        assert refused.value.code == 400, message
        assert "declared shapes" in message and len(message) < 400, message
        grown_mib = (status_kib(proc.pid, "VmHWM") - before) / 1024
        assert grown_mib < 64, f"the daemon's peak RSS grew {grown_mib:.0f} MiB"
        assert http_get(http, "/v2/health/live") == 200
    finally:
        assert stop_daemon(proc) == 0, proc.log()


def test_a_type_error_quotes_a_few_values_not_the_whole_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 5: the error for wrongly typed data quotes its first values, never ``json.dumps`` of all."""
    from edge_server.kserve import codec

    dumped: list[int] = []
    real = json.dumps

    def counting(value: Any, *args: Any, **kwargs: Any) -> str:
        text = real(value, *args, **kwargs)
        dumped.append(len(text))
        return text

    monkeypatch.setattr(codec.json, "dumps", counting)
    data = [["x"] * 1000] * 1000
    with pytest.raises(Exception) as refused:
        codec.from_json(data, "FP32", (1000, 1000), "INPUT0")
    assert "INPUT0" in str(refused.value) and len(str(refused.value)) < 300
    assert dumped and max(dumped) < 200, dumped


def test_a_grpc_stream_that_does_not_read_is_cut_off_at_the_reply_bound(tmp_path: Path) -> None:
    """Item 6: a stream that sends 400 x 1 MiB requests and never reads its responses is cancelled
    once more than --max-client-reply-bytes of them wait for it (as over IPC), instead of pinning them.
    (With fewer requests in flight than that, the stream just stops reading: a request's slot is freed
    when its response is sent, not when it is produced.)"""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    grpc_port = free_port()
    proc = start_daemon(
        tmp_path,
        build_repository(tmp_path),
        "s.sock",
        "--allow-grpc",
        "true",
        "--grpc-port",
        str(grpc_port),
        "--max-client-reply-bytes",
        str(16 << 20),
        "--max-client-requests",
        "64",
    )
    raw = np.zeros(1 << 18, np.float32).tobytes()  # 1 MiB
    request = service_pb2.ModelInferRequest(model_name="identity")
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1 << 18])
    del tensor
    request.raw_input_contents.append(raw)
    channel = grpc.insecure_channel(
        f"127.0.0.1:{grpc_port}", options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    try:
        before = status_kib(proc.pid, "VmHWM")
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        call = stub.ModelStreamInfer(iter([request] * 400))  # and never read
        with Client(proc.address, timeout=10) as client:
            wait_for(
                lambda: client.ipc_status()["limits"]["cut_off_streams"] == 1, timeout=60, what="cut off"
            )
        with pytest.raises(grpc.RpcError) as cut:
            for _ in call:  # what grpc had sent before the cut, then the end
                pass
        assert cut.value.code() == grpc.StatusCode.CANCELLED, cut.value
        grown_mib = (status_kib(proc.pid, "VmHWM") - before) / 1024
        assert grown_mib < 200, f"the daemon's peak RSS grew {grown_mib:.0f} MiB"
        still_serves(proc)
    finally:
        channel.close()
        assert stop_daemon(proc) == 0, proc.log()


def test_memory_goes_back_after_a_client_with_large_requests_is_gone(tmp_path: Path) -> None:
    """Item 21: 300 requests of 1-8 MiB from a client that never reads (cut off at
    --max-client-reply-bytes, or gone first): once it is gone, the daemon's RSS comes back near where it
    was (ONNX Runtime's arena shrinks after large runs; the heap is trimmed after the client is dropped).
    It stayed +80 to +400 MiB before, and +40 MiB where the model's next run came after the daemon's
    last trim."""
    import zmq

    from tests.daemon import header

    proc = start_daemon(
        tmp_path, build_repository(tmp_path), "r.sock", "--max-client-reply-bytes", str(64 << 20)
    )
    try:
        still_serves(proc)
        before = status_kib(proc.pid, "VmRSS")
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(proc.address)
        sizes = np.random.default_rng(0).integers(1 << 18, 1 << 21, 300)
        for n in sizes:
            desc = {"name": "INPUT0", "datatype": "FP32", "shape": [int(n)], "frame": 0}
            sock.send_multipart([header(op="infer", model="identity", inputs=[desc]), np.ones(n, np.float32)])
        with Client(proc.address, timeout=30) as client:  # every request was answered or dropped
            wait_for(lambda: client.ipc_status()["clients"] <= 2, timeout=60, what="requests done")
            sock.close(0)
            ctx.term()
            wait_for(lambda: client.ipc_status()["clients"] == 1, timeout=60, what="the client dropped")
        # Traffic comes back only after the trims that the drop asked for (the last at 5 s): what the
        # model's next run gives back must still leave the heap (a CI run under load stayed +68 MiB).
        time.sleep(6)
        x = np.arange(4, dtype=np.float32)
        with Client(proc.address, timeout=30) as client:
            # Traffic goes on: a run of the model gives back what the burst left in ONNX Runtime's arena
            # (it shrinks at most every half second, so that steady large frames keep their buffers).
            wait_rss_back(proc.pid, before, 24, poke=lambda: client.infer("identity", {"INPUT0": x}))
        still_serves(proc)
    finally:
        assert stop_daemon(proc) == 0, proc.log()


FLOOD_CONFIG = """
name: "flood"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
instance_group [ { count: 1, kind: KIND_CPU } ]
"""

FLOOD_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            sender = request.get_response_sender()
            for i in range(n):
                if request.is_cancelled():
                    break
                out = pb_utils.Tensor("OUT", np.full(1 << 18, i, dtype=np.float32))  # 1 MiB
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def test_a_decoupled_flood_to_a_grpc_stream_that_does_not_read_is_cut_off(tmp_path: Path) -> None:
    """Item 6: a decoupled model answering 400 x 1 MiB to a stream that never reads: the stream is
    cancelled past --max-client-reply-bytes, and the responses are not kept (+402 MiB before)."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    repo = build_repository(tmp_path)
    (repo / "flood" / "1").mkdir(parents=True)
    (repo / "flood" / "config.pbtxt").write_text(FLOOD_CONFIG)
    (repo / "flood" / "1" / "model.py").write_text(FLOOD_MODEL)
    grpc_port = free_port()
    proc = start_daemon(
        tmp_path,
        repo,
        "d.sock",
        "--allow-grpc",
        "true",
        "--grpc-port",
        str(grpc_port),
        "--max-client-reply-bytes",
        str(16 << 20),
    )
    request = service_pb2.ModelInferRequest(model_name="flood")
    request.inputs.add(name="IN", datatype="INT32", shape=[1])
    request.raw_input_contents.append(np.array([400], np.int32).tobytes())
    channel = grpc.insecure_channel(
        f"127.0.0.1:{grpc_port}", options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    stop = threading.Event()

    def requests() -> Iterator[Any]:
        yield request
        stop.wait()

    try:
        before = status_kib(proc.pid, "VmHWM")
        call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests())
        with Client(proc.address, timeout=10) as client:
            wait_for(lambda: client.ipc_status()["limits"]["cut_off_streams"] == 1, timeout=60, what="a cut")
        with pytest.raises(grpc.RpcError) as cut:
            for _ in call:
                pass
        assert cut.value.code() == grpc.StatusCode.CANCELLED, cut.value
        grown_mib = (status_kib(proc.pid, "VmHWM") - before) / 1024
        assert grown_mib < 200, f"the daemon's peak RSS grew {grown_mib:.0f} MiB"
        still_serves(proc)
    finally:
        stop.set()
        channel.close()
        assert stop_daemon(proc) == 0, proc.log()


def test_a_compressed_body_is_inflated_no_further_than_the_users_body_budget(
    listener_daemon: tuple[Daemon, int, int],
) -> None:
    """Item 5: 8 KiB of gzip that inflates to 4 MiB counts 4 MiB against the user's body budget (1 MiB
    here): refused 503 before it is inflated past that, not pinned once per connection."""
    import gzip

    proc, http, _grpc = listener_daemon
    n = 2 << 20
    body = b'{"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[%d],"data":[' % n
    body += b"0," * (n - 1) + b"0]}]}"
    request = urllib.request.Request(
        f"http://127.0.0.1:{http}/v2/models/identity/infer",
        data=gzip.compress(body),
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    message = json.loads(refused.value.read())["error"]
    assert refused.value.code == 503 and "body budget" in message, message
    assert http_get(http, "/v2/health/live") == 200
    still_serves(proc)


@needs_root
def test_a_user_whose_gzip_bomb_was_refused_is_refused_unread_for_a_while(
    listener_daemon: tuple[Daemon, int, int],
) -> None:
    """Item 5: inflating is the costly part of a gzip bomb, and a client could repeat it as fast as the
    daemon refuses it; so the user whose inflated body was refused gets 503 for its next compressed
    bodies (and connections), unread, for a second, doubling with each repeat; other users are served."""
    import gzip

    proc, http_port, _grpc = listener_daemon
    body = b'{"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[4],"data":['
    body += b"[]," * (200 << 10) + b"[]]}]}"  # 600 KiB: inside the user's 1 MiB body budget here
    bomb = gzip.compress(body)
    request = (
        "POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        "Content-Encoding: gzip\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(bomb)}\r\n\r\n"
    ).encode() + bomb

    def send_bombs() -> bool:
        statuses = []
        for _ in range(6):  # 1 s, 2 s, 4 s...: a loaded machine cannot make every retry miss it
            statuses.append(exchange(http_port, request))  # refused at accept: its 503 is read too
            if statuses[-1][0] == 503:
                break
        assert statuses[0][0] == 400 and "declared shapes" in statuses[0][1], statuses
        assert statuses[-1][0] == 503 and "refused for" in statuses[-1][1], statuses
        assert "MALFORMED_MESSAGE" in statuses[-1][1], statuses  # what it sent, by its own code
        return True

    attacker = OtherUser(send_bombs)
    attacker.close()
    with Client(proc.address, timeout=10) as client:
        assert client.ipc_status()["limits"]["penalized"] >= 1
    assert http_get(http_port, "/v2/health/live") == 200  # root, never penalized
    still_serves(proc)


@needs_root
def test_a_message_over_the_frame_limit_cuts_its_connection_off(
    listener_daemon: tuple[Daemon, int, int],
) -> None:
    """Item 16: libzmq hands over only whole messages, so a message of 300,000 empty frames is received
    whole before it can be refused; the refusal drops the frames past the limit without keeping them,
    answers MALFORMED_MESSAGE, then closes that connection and penalizes its user, so that it cannot
    make the daemon do it again at once; other users are served meanwhile."""
    import zmq

    from edge_server.ipc import protocol
    from tests.daemon import header

    proc, _http, _grpc = listener_daemon
    os.chmod(proc.address.removeprefix("ipc://"), 0o666)

    def flood() -> bool:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            sock.connect(proc.address)
            sock.send_multipart([header(op="live")] + [b""] * 300_000)
            assert sock.poll(60_000), "no answer"
            reply = protocol.unpack(sock.recv_multipart()[-1])
            assert reply["error"]["code"] == "MALFORMED_MESSAGE", reply
            assert "300001 frames" in reply["error"]["message"], reply
            assert monitor.poll(30_000), "the connection was not closed"
        finally:
            monitor.close(0)
            sock.close(0)
            ctx.term()
        return True

    attacker = OtherUser(flood)
    attacker.close()
    with Client(proc.address, timeout=10) as client:
        status = client.ipc_status()
    assert status["cut_off_clients"] == 1 and status["limits"]["penalized"] == 1, status
    still_serves(proc)


@needs_root
def test_a_client_cut_off_for_not_reading_is_penalized(public_dir: Path) -> None:
    """Item 21: a DEALER that never reads is disconnected at --max-client-reply-bytes, and reconnects
    by itself to send the same flood again; its user is penalized (connections refused a while)."""
    import zmq

    from edge_server.ipc import protocol

    proc = start_daemon(
        public_dir, build_repository(public_dir), "n.sock", "--max-client-reply-bytes", str(2 << 20)
    )
    os.chmod(proc.address.removeprefix("ipc://"), 0o666)

    def flood() -> list[Any]:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1)  # its own process takes (almost) nothing off the wire
        sock.setsockopt(zmq.RCVBUF, 4096)  # (so it does not see its connection close either)
        sock.setsockopt(zmq.SNDTIMEO, 2000)  # cut off and penalized: its reconnections are refused
        payload = np.ones(1 << 16, np.float32).tobytes()
        tensor = {"name": "INPUT0", "datatype": "FP32", "shape": [1 << 16], "frame": 0}
        sock.connect(proc.address)
        for rid in range(200):  # 50 MiB of replies
            head = {"v": protocol.PROTOCOL_VERSION, "id": rid, "op": "infer", "model": "identity"}
            try:
                sock.send_multipart([protocol.pack({**head, "inputs": [tensor]}), payload])
            except zmq.Again:
                break
        return [ctx, sock]  # held open, unread, until the test closes the child

    try:
        attacker = OtherUser(flood)
        try:
            with Client(proc.address, timeout=10) as client:
                wait_for(lambda: client.ipc_status()["slow_clients"] >= 1, timeout=60, what="the cut-off")
                status = client.ipc_status()
            assert status["limits"]["penalized"] >= 1, status
            still_serves(proc)
        finally:
            attacker.close()
    finally:
        assert stop_daemon(proc) == 0, proc.log()
