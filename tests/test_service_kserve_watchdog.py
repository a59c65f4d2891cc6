"""The watchdog's liveness probes of the KServe frontends: a wedged HTTP event loop or gRPC worker pool is
seen (and the daemon's pings stop), a busy one is not, and the real daemon keeps pinging with both on."""

from __future__ import annotations

import http.client
import queue
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from edge_server.kserve.frontends import KServeFrontends, KServeOptions
from edge_server.kserve.probes import GrpcProbe, LoopProbe
from edge_server.server import Server
from edge_server.service.liveness import LivenessMonitor
from tests.daemon import build_repository
from tests.kserve_daemon import start_kserve_daemon
from tests.notify_socket import NotifySocket

grpc = pytest.importorskip("grpc")
service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
service_pb2_grpc = pytest.importorskip("tritonclient.grpc.service_pb2_grpc")

STALL_S = 0.3


@pytest.fixture
def server(tmp_path: Path, example_repository: Path) -> Iterator[Server]:
    repo = tmp_path / "repo"
    shutil.copytree(example_repository / "identity", repo / "identity")
    with Server(repo) as server:
        yield server


def _ticker(parts: list[tuple[str, LoopProbe | GrpcProbe]]) -> Callable[[], dict[str, float]]:
    """What the supervisor does each watchdog tick: ask who is stuck, then poke every frontend."""
    monitor = LivenessMonitor(lambda: [(label, label, probe) for label, probe in parts], stall_s=STALL_S)

    def tick() -> dict[str, float]:
        stuck = monitor.stuck()
        for _, probe in parts:
            probe.poke()
        return stuck

    return tick


Tick = Callable[[], dict[str, float]]


def _until(tick: Tick, want: Callable[[dict[str, float]], bool]) -> dict[str, float]:
    deadline = time.monotonic() + 10
    while True:
        stuck = tick()
        if want(stuck) or time.monotonic() > deadline:
            return stuck
        time.sleep(0.1)


def _healthy_for(tick: Callable[[], dict[str, float]], seconds: float) -> None:
    """No part is reported stuck over ``seconds`` (longer than the stall time) of ticks."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert tick() == {}
        time.sleep(0.1)


def test_a_wedged_http_event_loop_is_seen_then_clears(server: Server) -> None:
    """A handler that blocks uvicorn's loop (here: the repository index, whose lock the test holds)
    stops the probe's callbacks; the check names the HTTP frontend, and clears once the loop turns."""
    kserve = KServeFrontends(server, KServeOptions(http_port=0, allow_grpc=False), max_message_bytes=1 << 20)
    kserve.start()
    try:
        probes = kserve.probes()
        assert [label for label, _ in probes] == ["HTTP frontend"]
        tick = _ticker(probes)
        _healthy_for(tick, 3 * STALL_S)
        answers: list[int] = []

        def ask() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", kserve.http.port, timeout=30)
            conn.request("POST", "/v2/repository/index", body=b"{}")
            answers.append(conn.getresponse().status)
            conn.close()

        asker = threading.Thread(target=ask)
        with server._index.lock:  # the event loop blocks on it inside the handler
            asker.start()
            stuck = _until(tick, bool)
            assert list(stuck) == ["HTTP frontend"]
        asker.join(10)
        assert answers == [200]
        assert _until(tick, lambda s: not s) == {}
        _healthy_for(tick, 3 * STALL_S)
    finally:
        kserve.close()


def test_a_dead_http_loop_stays_stuck(server: Server) -> None:
    """A frontend whose loop is gone (its thread ended) never answers the probe."""
    kserve = KServeFrontends(server, KServeOptions(http_port=0, allow_grpc=False), max_message_bytes=1 << 20)
    kserve.start()
    probes = kserve.probes()
    call_soon = kserve.http.call_soon
    kserve.close()
    assert call_soon(lambda: None) is False
    tick = _ticker(probes)
    assert list(_until(tick, bool)) == ["HTTP frontend"]


@pytest.fixture
def small_grpc(server: Server) -> Iterator[tuple[object, GrpcProbe]]:
    """The gRPC frontend with two workers, so that the test can occupy all of them."""
    from edge_server.kserve.grpc_frontend import GrpcFrontend
    from edge_server.kserve.service import KServeService

    frontend = GrpcFrontend(KServeService(server), host="127.0.0.1", port=0, max_workers=2)
    frontend.start()
    probe = GrpcProbe(f"127.0.0.1:{frontend.port}", frontend.saturated)
    try:
        yield frontend, probe
    finally:
        probe.close()
        frontend.close()


def test_a_wedged_grpc_worker_pool_is_seen_then_clears(
    server: Server, small_grpc: tuple[object, GrpcProbe]
) -> None:
    """Every worker blocked inside a call (the repository index, its lock held by the test): the probe's
    ServerLive waits in grpc's queue, and the check names the gRPC frontend until the workers free."""
    frontend, probe = small_grpc
    tick = _ticker([("gRPC frontend", probe)])
    _healthy_for(tick, 3 * STALL_S)
    channel = grpc.insecure_channel(f"127.0.0.1:{frontend.port}")  # type: ignore[attr-defined]
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    try:
        with server._index.lock:
            calls = [stub.RepositoryIndex.future(service_pb2.RepositoryIndexRequest()) for _ in range(2)]
            stuck = _until(tick, bool)
            assert list(stuck) == ["gRPC frontend"]
        assert all(len(call.result(timeout=10).models) == 1 for call in calls)
        assert _until(tick, lambda s: not s) == {}
    finally:
        channel.close()


def test_streams_never_hold_every_grpc_worker(server: Server, small_grpc: tuple[object, GrpcProbe]) -> None:
    """Open streams hold a worker each for as long as the client likes, but never the workers kept for
    health and control calls: the stream past that is refused RESOURCE_EXHAUSTED, the pool is never
    saturated, and the probe keeps being answered."""
    frontend, probe = small_grpc
    tick = _ticker([("gRPC frontend", probe)])
    channel = grpc.insecure_channel(f"127.0.0.1:{frontend.port}")  # type: ignore[attr-defined]
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    ends: list[queue.SimpleQueue[object]] = [queue.SimpleQueue() for _ in range(2)]

    def requests(end: queue.SimpleQueue[object]) -> Iterator[object]:
        end.get()  # the client sends nothing and keeps the stream open
        yield from ()

    streams = [stub.ModelStreamInfer(requests(end)) for end in ends]
    try:
        deadline = time.monotonic() + 10
        while not any(s.done() for s in streams) and time.monotonic() < deadline:
            time.sleep(0.05)
        refused = [s for s in streams if s.done()]
        assert len(refused) == 1 and refused[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert not frontend.saturated()  # type: ignore[attr-defined]
        answered = probe.liveness()[0]
        _healthy_for(tick, 4 * STALL_S)
        assert probe.liveness()[0] > answered
    finally:
        for end in ends:
            end.put(None)
        for stream in streams:
            if not stream.done() or stream.code() == grpc.StatusCode.OK:
                assert list(stream) == []
        channel.close()


def test_the_daemon_pings_with_http_and_grpc_probed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real daemon with both KServe frontends: their probes are answered, so the pings go on well
    past the stall time, and the STATUS line never says STUCK."""
    notify = NotifySocket(tmp_path / "notify.sock")
    monkeypatch.setenv("NOTIFY_SOCKET", str(notify.path))
    monkeypatch.setenv("WATCHDOG_USEC", "400000")  # a ping every 0.2 s; stuck after 0.4 s
    repo = tmp_path / "small"
    shutil.copytree(build_repository(tmp_path) / "identity", repo / "identity")
    daemon = start_kserve_daemon(tmp_path, repo, "w.sock")
    try:
        notify.wait_for("READY", "1")
        first = time.monotonic()
        notify.wait_for("WATCHDOG", "1", timeout=5)
        notify.poll(1.5)
        pings = notify.since(first, "WATCHDOG")
        assert len(pings) >= 4, pings
        assert not [m for _, m in notify.messages if "STUCK" in m.get("STATUS", "")]
    finally:
        status = daemon.daemon.stop()
        notify.close()
    assert status == 0, daemon.daemon.log()


def test_grpc_is_optional_unless_asked_for(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the grpc extra (its module cannot import), the default serves HTTP alone and probes it;
    ``--allow-grpc true`` makes gRPC required."""
    from edge_server.cli import build_parser

    assert build_parser().parse_args(["serve"]).allow_grpc is None
    monkeypatch.setitem(sys.modules, "edge_server.kserve.grpc_frontend", None)  # import raises ImportError
    kserve = KServeFrontends(server, KServeOptions(http_port=0, allow_grpc=None), max_message_bytes=1 << 20)
    kserve.start()
    try:
        assert kserve.grpc is None
        assert [label for label, _ in kserve.probes()] == ["HTTP frontend"]
    finally:
        kserve.close()
    required = KServeFrontends(server, KServeOptions(http_port=0, allow_grpc=True), max_message_bytes=1 << 20)
    with pytest.raises(ImportError):
        required.start()
    required.close()
