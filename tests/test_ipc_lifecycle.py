"""Requests in flight while things go away: unloads, disconnecting clients, timeouts, daemon restarts."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_server.client import AsyncClient, Client
from edge_server.client._common import register_fields
from edge_server.errors import ConnectionLost, ModelNotReady, ReplyTimeout, RequestTimeout
from tests.daemon import (
    ROOT,
    Daemon,
    Gate,
    RawPeer,
    build_repository,
    header,
    start_daemon,
    start_pyzmq_gc,
    stop_daemon,
    wait_for,
)

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

X = np.arange(4, dtype=np.float32)


def gate_count(c: Client) -> int:
    return int(c.statistics("gate")[0]["inference_count"])


def test_request_to_a_model_that_is_unloading(daemon: Daemon, gate: Gate, client: Client) -> None:
    first = client.submit("gate", {"INPUT0": X})
    gate.wait_started()
    unloaded = threading.Event()

    def unload() -> None:
        with Client(daemon.address) as control:
            control.unload_model("gate")
        unloaded.set()

    worker = threading.Thread(target=unload)
    worker.start()
    try:
        wait_for(
            lambda: any(m["name"] == "gate" and m["state"] == "UNLOADING" for m in client.models()),
            what="the gate model to be UNLOADING",
        )
        with pytest.raises(ModelNotReady) as caught:
            client.infer("gate", {"INPUT0": X})
        assert caught.value.code == "MODEL_NOT_READY"
        assert not unloaded.is_set()  # the unload waits for the request it drains
        assert client.infer("identity", {"INPUT0": X})["OUTPUT0"].tolist() == X.tolist()
    finally:
        gate.release()
        worker.join(30)
    assert unloaded.is_set()
    assert first.result(timeout=30)["OUTPUT0"].tolist() == X.tolist()  # drained, not failed
    client.load_model("gate")
    assert client.model_ready("gate")


def test_client_that_disconnects_with_requests_in_flight(daemon: Daemon, gate: Gate, client: Client) -> None:
    before = client.ipc_status()["released_clients"]
    count = gate_count(client)
    peer = RawPeer(daemon.address)
    region = client.create_shm_region(4096)  # created by us, registered by the raw peer as well
    try:
        region.write(X)
        fields = register_fields(daemon.address, region)  # hands the descriptor over for this peer
        assert peer.ask([header(op="shm_register", **fields)])["ok"]
        desc = {"name": "INPUT0", "datatype": "FP32", "shape": [4]}
        desc["shm"] = {"region": region.name, "offset": 0, "byte_size": 16}
        for rid in range(3):
            peer.sock.send_multipart([header(id=rid, op="infer", model="gate", inputs=[desc])])
        gate.wait_started()  # one runs; two wait in the queue
    finally:
        peer.close()  # gone without a bye
    wait_for(
        lambda: client.ipc_status()["released_clients"] > before, what="the daemon to release the client"
    )
    gate.release()  # the running request finishes; its reply has nobody to go to
    # The two queued requests were cancelled: the next request through the gate is ours.
    ours = client.submit("gate", {"INPUT0": X * 3})
    gate.wait_started()
    gate.release()
    assert ours.result(timeout=30)["OUTPUT0"].tolist() == (X * 3).tolist()
    assert gate_count(client) == count + 2
    client.release_shm(region)
    # The mapping goes when the last view of it does (edge_server.shm.region): the vanished client's
    # request may still be let go by the thread that delivered it.  A leak never gets there.
    wait_for(lambda: region.name not in daemon.mapped_segments(), what="the released region to be unmapped")
    assert client.infer("identity", {"INPUT0": X})["OUTPUT0"].tolist() == X.tolist()


def test_close_says_bye_and_the_daemon_unmaps_at_once(daemon: Daemon) -> None:
    with Client(daemon.address) as own:
        region = own.create_shm_region(8192)
        name = region.name
        assert name in daemon.mapped_segments()
    assert region.closed
    assert name not in daemon.mapped_segments()


def test_client_timeout_then_later_requests_succeed(gate: Gate, client: Client) -> None:
    with pytest.raises(ReplyTimeout) as caught:
        client.infer("gate", {"INPUT0": X}, timeout=0.3)
    assert caught.value.code == "TIMEOUT"
    gate.wait_started()
    gate.release()  # its late reply arrives and is ignored
    assert client.infer("identity", {"INPUT0": X}, timeout=10)["OUTPUT0"].tolist() == X.tolist()


def test_reply_timeout_does_not_expire_the_request_in_the_queue(gate: Gate, client: Client) -> None:
    """The gate model has no queue policy, so any timeout_us sent would be honoured: a client that
    gives up waiting must not also have its request dropped from the model's queue."""
    count = gate_count(client)
    first = client.submit("gate", {"INPUT0": X})
    gate.wait_started()
    with pytest.raises(ReplyTimeout):
        client.infer("gate", {"INPUT0": X * 2}, timeout=0.2)  # queued behind the first
    gate.release()
    gate.wait_started()  # the second still runs: its reply is ignored, but it was not dropped
    gate.release()
    assert first.result(timeout=30)["OUTPUT0"].tolist() == X.tolist()
    wait_for(lambda: gate_count(client) == count + 2, what="both gated requests to finish")


def test_queue_timeout_is_asked_for_explicitly(gate: Gate, client: Client) -> None:
    first = client.submit("gate", {"INPUT0": X})
    gate.wait_started()
    late = client.submit("gate", {"INPUT0": X}, queue_timeout_us=1, timeout=30)
    assert client.model_ready("gate")  # answered after the daemon queued `late`: it is waiting now
    gate.release()
    with pytest.raises(RequestTimeout) as caught:
        late.result(timeout=30)
    assert type(caught.value) is RequestTimeout and caught.value.code == "TIMEOUT"  # the daemon's
    assert first.result(timeout=30)["OUTPUT0"].tolist() == X.tolist()


def test_graceful_stop_answers_requests_in_flight(tmp_path: Path) -> None:
    proc = start_daemon(tmp_path, build_repository(tmp_path), "stop.sock")
    assert proc.gate is not None
    try:
        with Client(proc.address, timeout=30) as c:
            future = c.submit("gate", {"INPUT0": X})
            proc.gate.wait_started()
            assert proc.proc is not None
            proc.proc.terminate()  # SIGTERM: drain, then stop
            proc.gate.release()
            assert future.result(timeout=30)["OUTPUT0"].tolist() == X.tolist()
        assert proc.proc.wait(30) == 0
    finally:
        stop_daemon(proc)


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    start_pyzmq_gc()
    yield tmp_path, build_repository(tmp_path)


def test_daemon_restart_client_reconnects(restartable: tuple[Path, Path]) -> None:
    root, repo = restartable
    first = start_daemon(root, repo, "r.sock")
    second: Daemon | None = None
    assert first.gate is not None
    try:
        with Client(first.address, timeout=30) as c:
            region = c.create_shm_region(4096)
            assert c.infer("identity", {"INPUT0": region.write(X)})["OUTPUT0"].tolist() == X.tolist()
            in_flight = c.submit("gate", {"INPUT0": X})
            first.gate.wait_started()
            first.kill()  # SIGKILL: no drain, no reply, a stale socket file left behind
            with pytest.raises(ConnectionLost) as caught:
                in_flight.result(timeout=30)
            assert caught.value.code == "CONNECTION_LOST"
            first.gate.close()
            waiting = c.submit("identity", {"INPUT0": X * 2})  # sent while no daemon is there
            second = start_daemon(root, repo, "r.sock")
            assert waiting.result(timeout=30)["OUTPUT0"].tolist() == (X * 2).tolist()
            # The region was registered again with the new daemon before anything else was sent.
            assert (
                c.infer("identity", {"INPUT0": region.write(X * 5)})["OUTPUT0"].tolist() == (X * 5).tolist()
            )
            assert region.name in second.mapped_segments()
    finally:
        first.kill()
        first.gate.close()
        if second is not None:
            assert stop_daemon(second) == 0


def test_async_client_reconnects(restartable: tuple[Path, Path]) -> None:
    import asyncio

    root, repo = restartable
    first = start_daemon(root, repo, "a.sock")
    assert first.gate is not None

    async def scenario() -> Daemon:
        async with AsyncClient(first.address, timeout=30) as c:
            region = await c.create_shm_region(4096)
            assert (await c.infer("identity", {"INPUT0": region.write(X)}))["OUTPUT0"].tolist() == X.tolist()
            in_flight = asyncio.ensure_future(c.infer("gate", {"INPUT0": X}))
            await asyncio.get_running_loop().run_in_executor(None, first.gate.wait_started)  # type: ignore[union-attr]
            first.kill()
            first.gate.close()  # type: ignore[union-attr]
            with pytest.raises(ConnectionLost):
                await in_flight
            second = await asyncio.get_running_loop().run_in_executor(
                None, start_daemon, root, repo, "a.sock"
            )
            out = await c.infer("identity", {"INPUT0": region.write(X * 7)})
            assert out["OUTPUT0"].tolist() == (X * 7).tolist()
            return second

    second = None
    try:
        second = asyncio.run(scenario())
    finally:
        first.kill()
        first.gate.close()
        if second is not None:
            assert stop_daemon(second) == 0


def test_second_daemon_on_the_same_address_is_refused(daemon: Daemon, tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge_server",
            "serve",
            "--model-repository",
            str(daemon.repository),
            "--ipc",
            daemon.address,
            # No TCP listener on its default port: another daemon on the machine may hold it.
            *["--allow-http", "false", "--allow-grpc", "false", "--allow-metrics", "false"],
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "ADDRESS_IN_USE" in result.stderr and daemon.address in result.stderr, result.stderr
    with Client(daemon.address) as c:
        assert c.server_live()


def test_a_daemon_at_its_connection_cap_keeps_its_address(tmp_path: Path) -> None:
    """At the cap the socket file is renamed away (.NAME.full): a second daemon must not take the name."""
    first = start_daemon(tmp_path, build_repository(tmp_path), "capped.sock", "--max-connections", "1")
    try:
        path = tmp_path / "capped.sock"
        with Client(first.address, timeout=30) as held:
            assert held.ipc_status()["connections"] == 1  # at the cap: the file is renamed away
            assert not path.exists() and (tmp_path / ".capped.sock.full").exists()
            result = subprocess.run(
                [sys.executable, "-m", "edge_server", "serve", "--model-repository", str(first.repository)]
                + ["--ipc", first.address, "--allow-http", "false", "--allow-grpc", "false"]
                + ["--allow-metrics", "false"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert result.returncode != 0, result.stderr
            assert "ADDRESS_IN_USE" in result.stderr and "connection cap" in result.stderr
            assert held.server_live()
        with Client(first.address, timeout=30) as again:  # the door opened again, on the first daemon
            assert again.ipc_status()["connections"] == 1
    finally:
        assert stop_daemon(first) == 0, first.log()
