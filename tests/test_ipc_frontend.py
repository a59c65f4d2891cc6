"""The frontend in this process (no daemon): TCP addresses, liveness probes, close."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_server import Server
from edge_server.client import Client, SharedMemoryRegion
from edge_server.client._common import register_fields
from edge_server.errors import MessageTooLarge
from edge_server.ipc.frontend import IpcFrontend
from tests.daemon import RawPeer, header, start_pyzmq_gc, wait_for

pytestmark = pytest.mark.usefixtures("no_leaked_processes")


@pytest.fixture(scope="module")
def server(example_repository: Path) -> Iterator[Server]:
    start_pyzmq_gc()
    with Server(example_repository, load_models=["identity"], model_control_mode="explicit") as s:
        yield s


def test_tcp_loopback_with_a_wildcard_port(server: Server) -> None:
    with IpcFrontend(server, "tcp://127.0.0.1:*") as frontend:
        assert frontend.address.startswith("tcp://127.0.0.1:") and not frontend.address.endswith("*")
        with Client(frontend.address, timeout=10) as c:
            x = np.arange(5, dtype=np.float32)
            assert c.infer("identity", {"INPUT0": x})["OUTPUT0"].tolist() == x.tolist()


def test_vanished_client_is_found_by_a_probe(server: Server, tmp_path: Path) -> None:
    """No bye: the socket monitor sees the disconnect and a probe confirms the client is gone."""
    frontend = IpcFrontend(server, f"ipc://{tmp_path}/f.sock", probe_interval=0.5)
    frontend.start()
    region = SharedMemoryRegion(4096)
    try:
        peer = RawPeer(frontend.address)
        assert peer.ask([header(op="shm_register", **register_fields(frontend.address, region))])["ok"]
        assert frontend.status()["regions"] == 1
        peer.close()
        wait_for(lambda: frontend.status()["regions"] == 0, what="the frontend to release the region")
        assert frontend.status()["released_clients"] == 1
    finally:
        frontend.close()
        region.close()


def test_close_is_idempotent_and_removes_the_socket_file(server: Server, tmp_path: Path) -> None:
    frontend = IpcFrontend(server, f"ipc://{tmp_path}/c.sock")
    frontend.start()
    frontend.close()
    frontend.close()
    assert not (tmp_path / "c.sock").exists()


def test_client_refuses_what_zeromq_would_drop_the_connection_for(server: Server, tmp_path: Path) -> None:
    """One frame over twice --max-message-bytes makes ZeroMQ drop the connection unanswered; the
    client knows the daemon's limit and raises MessageTooLarge instead of sending it."""
    with IpcFrontend(server, f"ipc://{tmp_path}/m.sock", max_message_bytes=1 << 20) as frontend:
        with Client(frontend.address, timeout=10) as c:
            big = np.zeros(3 << 18, np.float32)  # 3 MiB in one frame: over ZeroMQ's 2 MiB cap
            with pytest.raises(MessageTooLarge, match="the daemon accepts at most 1048576"):
                c.infer("identity", {"INPUT0": big})
            with pytest.raises(MessageTooLarge):  # over the limit, under the cap: refused as well
                c.infer("identity", {"INPUT0": big[: 3 << 17]})
            x = np.arange(5, dtype=np.float32)
            assert c.infer("identity", {"INPUT0": x})["OUTPUT0"].tolist() == x.tolist()
            assert frontend.status()["max_message_bytes"] == 1 << 20
