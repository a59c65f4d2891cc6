"""Issue 23 item 1 on gRPC: one user's idle connections never hold the gRPC port against everyone else.

The daemon accepts the gRPC port's connections itself and counts them in its one budget (total, per
uid) before grpc sees them (edge_server.kserve.grpc_accept).  Where it cannot (or is told not to),
grpcio accepts and caps only its total, and
edge_server.kserve.grpc_connections adds the per-user cap by pairing each connection with its client's
uid in the kernel's socket table.  The hostile user is a forked child dropped to uid 65534 (root
only); its connections sent HTTP/2's preface and settings, so grpc's handshake timeout does not close
them, and the test ends before the idle timeout would.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from edge_server.client import Client
from edge_server.kserve import grpc_accept, sock_diag
from edge_server.kserve.frontends import GRPC_ACCEPT_ENV
from edge_server.kserve.grpc_connections import (
    ESTABLISHED,
    Link,
    links,
    over_cap,
    sockets_held,
)
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


@contextmanager
def loopback(
    clients: int, host: str = "127.0.0.1"
) -> Iterator[tuple[socket.socket, list[socket.socket], list[socket.socket]]]:
    """A listener on ``host`` and ``clients`` connections to it: (listener, client ends, accepted ends)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as server:
        server.bind((host, 0))
        server.listen(16)
        port = server.getsockname()[1]
        ends = [socket.create_connection((host, port)) for _ in range(clients)]
        accepted = [server.accept()[0] for _ in ends]
        try:
            yield server, ends, accepted
        finally:
            for sock in ends + accepted:
                sock.close()


def test_each_user_keeps_its_oldest_connections_up_to_the_cap() -> None:
    found = [Link(inode, uid) for inode, uid in [(5, 1), (9, 1), (7, 1), (3, 2), (8, 1)]]
    assert sorted(link.inode for link in over_cap(found, 2)) == [8, 9]
    assert over_cap(found, 4) == []


def test_a_penalized_user_keeps_none_of_its_connections() -> None:
    found = [Link(inode, uid) for inode, uid in [(5, 1), (9, 1), (3, 2), (8, 2)]]
    assert sorted(link.inode for link in over_cap(found, 4, penalized={1})) == [5, 9]


def test_the_text_tables_read_into_the_same_sockets_as_the_kernels_answer() -> None:
    """sock_diag.table (the fallback of the gRPC cap and of the shared-memory uid lookup) and the
    netlink query agree field for field: addresses as bytes (IPv4 on both families), ports, uid, inode."""
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        with loopback(1, host) as (server, _, _):
            port = server.getsockname()[1]

            def mine(found: Iterable[sock_diag.Socket], port: int = port) -> set[sock_diag.Socket]:
                return {s for s in found if port in (s.local_port, s.remote_port)}

            by_kernel = mine(sock_diag.sockets(family, bytecode=sock_diag.port_filter(port)))
            by_text = mine(
                s for s in sock_diag.table() if len(s.local) == len(socket.inet_pton(family, host))
            )
            assert by_text == by_kernel and len(by_kernel) == 3  # listener, client, accepted
            assert {s.local for s in by_text} == {socket.inet_pton(family, host)}


def test_the_kernels_answer_pairs_the_same_connections_as_its_text_tables() -> None:
    """sock_diag (filtered by port in the kernel) and /proc/net/tcp{,6} see the same links."""
    with loopback(5) as (server, _, accepted):
        port = server.getsockname()[1]
        found = links(port)
        assert sorted(found, key=lambda link: link.inode) == sorted(
            links(port, "/proc/net"), key=lambda link: link.inode
        )
        assert {link.inode for link in found} == {os.fstat(sock.fileno()).st_ino for sock in accepted}
        assert {link.uid for link in found} == {os.geteuid()}


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


def _grpc_daemon(directory: Path, env: dict[str, str] | None) -> Iterator[tuple[Daemon, int]]:
    """RLIMIT_NOFILE 256: a budget of 16 connections, 4 per user."""
    grpc_port = free_port()
    proc = start_daemon(
        directory,
        build_repository(directory),
        "g.sock",
        *kserve_flags(free_port(), grpc_port),
        "--max-client-connections",
        "4",
        nofile=256,
        env=env,
    )
    try:
        yield proc, grpc_port
    finally:
        assert stop_daemon(proc) == 0, proc.log()


@pytest.fixture
def grpc_daemon(public_dir: Path) -> Iterator[tuple[Daemon, int]]:  # noqa: F811 - the fixture above
    """The daemon accepts gRPC's connections itself."""
    yield from _grpc_daemon(public_dir, None)


@pytest.fixture
def grpc_accepting_daemon(public_dir: Path) -> Iterator[tuple[Daemon, int]]:  # noqa: F811
    """grpc accepts by itself (the operator's escape hatch): 8 of the 16 connections are gRPC's, 4 per
    user there, kept by looking."""
    yield from _grpc_daemon(public_dir, {**os.environ, GRPC_ACCEPT_ENV: "grpc"})


def still_open(port: int, uid: int) -> int:
    """``uid``'s connections to ``port`` that the daemon has not closed, seen from the client's side.

    :func:`links` sees a connection only once grpc accepted it (before, the daemon's end has no inode),
    so "none of the user's connections in :func:`links`" also holds while all of them still wait in
    grpc's accept queue; a connection the daemon shut down or closed is no longer ESTABLISHED here.
    """
    found = sock_diag.sockets(socket.AF_INET, states=1 << ESTABLISHED, bytecode=sock_diag.port_filter(port))
    return sum(sock.uid == uid and sock.remote_port == port for sock in found)


def live(port: int) -> bool:
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            return bool(stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=10).live)
        except grpc.RpcError:
            return False


@needs_root
def test_one_users_idle_connections_never_keep_another_users_new_connections_out(
    grpc_daemon: tuple[Daemon, int],
) -> None:
    """Refused at accept past the user's cap: no moment when grpc's total is full of them."""
    proc, port = grpc_daemon
    attacker = OtherUser(open_http2(port, 40))
    try:
        assert all(live(port) for _ in range(20))  # each a new connection, right after the flood
        assert sum(link.uid == NOBODY for link in links(port)) <= 4
        with Client(proc.address, timeout=10) as client:
            assert client.ipc_status()["limits"]["refused_connections"] >= 36
        assert "gRPC: connection refused" in proc.log()
        assert "the limit for one user (--max-client-connections)" in proc.log()
    finally:
        attacker.close()
    assert proc.proc is not None and proc.proc.poll() is None, proc.log()


@needs_root
def test_idle_http2_connections_of_one_user_are_cut_to_its_cap(
    grpc_accepting_daemon: tuple[Daemon, int],
) -> None:
    proc, port = grpc_accepting_daemon
    attacker = OtherUser(open_http2(port, 40))
    try:
        # (its connections may still wait in grpc's accept queue: first the cap's look at them)
        wait_for(
            lambda: "more than 4 (--max-client-connections" in proc.log(),
            timeout=20,
            what="the cap to find the other user over it",
        )
        wait_for(
            lambda: still_open(port, NOBODY) <= 4,
            timeout=20,
            what="the other user's connections cut to its cap",
        )
        wait_for(lambda: live(port), timeout=20, what="another user's gRPC call answered")
    finally:
        attacker.close()
    assert proc.proc is not None and proc.proc.poll() is None, proc.log()


@needs_root
def test_a_user_over_its_cap_is_penalized_and_loses_every_grpc_connection(
    grpc_accepting_daemon: tuple[Daemon, int],
) -> None:
    """Cut to the cap it could refill at once, between two looks, and hold grpc's total against new
    clients; penalized, it keeps none (and the other listeners refuse it while the penalty lasts)."""
    proc, port = grpc_accepting_daemon
    attacker = OtherUser(open_http2(port, 40))
    try:
        # Its connections may all still wait in grpc's accept queue here, unseen by the cap: wait for
        # the penalty, then for every connection it made (accepted or queued then) to be closed.
        with Client(proc.address, timeout=10) as client:
            wait_for(
                lambda: client.ipc_status()["limits"]["penalized"] >= 1,
                timeout=20,
                what="the user over its cap penalized",
            )
        wait_for(
            lambda: still_open(port, NOBODY) == 0,
            timeout=20,
            what="every connection of the user over its cap shut down",
        )
        assert not any(link.uid == NOBODY for link in links(port))
        assert live(port)
    finally:
        attacker.close()
    assert proc.proc is not None and proc.proc.poll() is None, proc.log()


def test_a_grpc_that_does_not_serve_handed_connections_accepts_by_itself(
    tmp_path: Path,
    example_repository: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A handed connection that grpc never serves (here: dropped on the way) is seen at start, and the
    frontend binds grpc's own port instead of leaving every client waiting."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from edge_server.kserve.grpc_frontend import GrpcFrontend
    from edge_server.kserve.service import KServeService
    from edge_server.server import Server

    monkeypatch.setattr(grpc_accept.ExternalPort, "hand", lambda _self, _listener, fd: os.close(fd))
    repo = tmp_path / "repo"
    shutil.copytree(example_repository / "identity", repo / "identity")
    with Server(repo) as server:
        frontend = GrpcFrontend(KServeService(server), host="127.0.0.1", port=0)
        frontend.start()
        try:
            assert "grpc accepts by itself instead" in caplog.text
            with grpc.insecure_channel(f"127.0.0.1:{frontend.port}") as channel:
                stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
                assert stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=10).live
        finally:
            frontend.close()


def test_the_activity_counters_are_read_per_family_without_memory(tmp_path: Path) -> None:
    """The cue to look again: every TCP counter of sockstat but ``mem``, which moves with traffic."""
    (tmp_path / "sockstat").write_text("sockets: used 22\nTCP: inuse 4 orphan 1 tw 1814 alloc 7 mem 54\n")
    (tmp_path / "sockstat6").write_text("TCP6: inuse 3\nUDP6: inuse 9\n")
    assert sock_diag.tcp_activity(str(tmp_path)) == (4, 1, 1814, 7, 3)
    assert sock_diag.tcp_activity(str(tmp_path / "missing")) == ()


def test_the_activity_counters_move_when_a_connection_opens_and_when_it_closes() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        before = sock_diag.tcp_activity()
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        opened = sock_diag.tcp_activity()
        assert opened != before
        accepted.close()  # the listener's end first, as grpc closes a connection it ends
        client.close()
        assert sock_diag.tcp_activity() != opened


def test_the_local_port_filter_keeps_the_listeners_ends_only() -> None:
    with loopback(3) as (server, _, accepted):
        port = server.getsockname()[1]
        found = list(sock_diag.sockets(socket.AF_INET, bytecode=sock_diag.local_port_filter(port)))
        assert {s.local_port for s in found} == {port}
        assert {s.inode for s in found} == {os.fstat(s.fileno()).st_ino for s in [server, *accepted]}


def test_the_acceptor_looks_at_the_kernels_table_only_when_a_connection_may_have_closed(
    example_repository: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A look walks the kernel's whole socket table (~2.5 ms of CPU per family): taken every 0.5 s while any
    client stayed connected, it cost an idle daemon 1.2% of a core with 100 connections open.  Now it
    is taken when the host's TCP counters moved; a connection that closed still leaves the budget."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from edge_server.kserve.grpc_frontend import GrpcFrontend
    from edge_server.kserve.service import KServeService
    from edge_server.server import Server

    looks: list[float] = []
    dump = sock_diag.sockets

    def counted(family: int, **kwargs: object) -> Iterator[sock_diag.Socket]:
        if kwargs.get("exact") is None:
            looks.append(time.monotonic())
        return dump(family, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sock_diag, "sockets", counted)
    # nothing else on the host moves the counters during the quiet second below
    monkeypatch.setattr(sock_diag, "tcp_activity", lambda: (1, 2, 3), raising=False)
    repo = tmp_path / "repo"
    shutil.copytree(example_repository / "identity", repo / "identity")
    with Server(repo) as server:
        frontend = GrpcFrontend(KServeService(server), host="127.0.0.1", port=0)
        frontend.start()
        try:
            own = [("grpc.use_local_subchannel_pool", 1)]  # a connection per channel
            channels = [grpc.insecure_channel(f"127.0.0.1:{frontend.port}", own) for _ in range(3)]
            for channel in channels:
                stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
                assert stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=10).live
            # the frontend's own call at start leaves at the first look (its counters are new), or at
            # the next one at least every RECHECK_S should grpc have closed it after that look
            wait_for(lambda: frontend.limits.status()["connections"] == 3, timeout=30, what="3 left")
            time.sleep(0.6)
            settled = len(looks)
            time.sleep(1.5)  # three more times the old interval, nothing changed
            assert len(looks) == settled
            channels.pop().close()
            monkeypatch.setattr(sock_diag, "tcp_activity", lambda: (1, 2, 4))
            wait_for(
                lambda: frontend.limits.status()["connections"] == 2, timeout=30, what="a closed one gone"
            )
            for channel in channels:
                channel.close()
        finally:
            frontend.close()
