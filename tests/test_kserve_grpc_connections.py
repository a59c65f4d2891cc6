"""Issue 23 item 1 on gRPC: one user's idle connections never hold the gRPC port against everyone else.

grpcio caps only the total of its connections; edge_server.kserve.grpc_connections adds the per-user
cap by pairing each connection with its client's uid in the kernel's socket table.  The hostile user is
a forked child dropped to uid 65534 (root only); its connections sent HTTP/2's preface and settings,
so grpc's handshake timeout does not close them, and the test ends before the idle timeout would.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from edge_server.kserve.grpc_connections import Link, links, over_cap, sockets_held
from tests.daemon import (
    Daemon,
    build_repository,
    free_port,
    kserve_flags,
    start_daemon,
    stop_daemon,
    wait_for,
)
from tests.test_security_listeners import NOBODY, OtherUser, needs_root, public_dir  # noqa: F401 - fixture

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS


def test_each_user_keeps_its_oldest_connections_up_to_the_cap() -> None:
    found = [Link(inode, uid) for inode, uid in [(5, 1), (9, 1), (7, 1), (3, 2), (8, 1)]]
    assert sorted(link.inode for link in over_cap(found, 2)) == [8, 9]
    assert over_cap(found, 4) == []


def test_the_sockets_this_process_holds_are_counted() -> None:
    """The pass reads the kernel's tables only past the cap; this count is what it compares."""
    before = sockets_held()
    pair = socket.socketpair()
    try:
        assert sockets_held() == before + 2
    finally:
        for sock in pair:
            sock.close()
    assert sockets_held() == before


def open_http2(port: int, count: int) -> Callable[[], list[socket.socket]]:
    def hold() -> list[socket.socket]:
        kept = []
        for _ in range(count):
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                sock.sendall(PREFACE)
                kept.append(sock)
            except OSError:
                pass
        return kept

    return hold


@pytest.fixture
def grpc_daemon(public_dir: Path) -> Iterator[tuple[Daemon, int]]:  # noqa: F811 - the fixture above
    """RLIMIT_NOFILE 256: a budget of 16 connections, 8 of them gRPC's, 4 per user there."""
    grpc_port = free_port()
    proc = start_daemon(
        public_dir,
        build_repository(public_dir),
        "g.sock",
        *kserve_flags(free_port(), grpc_port),
        "--max-client-connections",
        "4",
        nofile=256,
    )
    try:
        yield proc, grpc_port
    finally:
        assert stop_daemon(proc) == 0, proc.log()


def live(port: int) -> bool:
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            return bool(stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=2).live)
        except grpc.RpcError:
            return False


@needs_root
def test_idle_http2_connections_of_one_user_are_cut_to_its_cap(grpc_daemon: tuple[Daemon, int]) -> None:
    proc, port = grpc_daemon
    attacker = OtherUser(open_http2(port, 40))
    try:
        wait_for(
            lambda: sum(link.uid == NOBODY for link in links(port)) <= 4,
            timeout=20,
            what="the other user's connections cut to its cap",
        )
        wait_for(lambda: live(port), timeout=20, what="another user's gRPC call answered")
        assert "held more than 4 connections" in proc.log()
    finally:
        attacker.close()
    assert proc.proc is not None and proc.proc.poll() is None, proc.log()
