"""Shared memory next to strangers: no confused deputy, no SIGBUS from a shrinking segment."""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from edge_server.client import Client, SharedMemoryRegion
from edge_server.errors import ShmOutOfBounds, ShmUnavailable
from tests.daemon import Daemon, build_repository, start_daemon, stop_daemon
from tests.users import open_socket, public_directory

NOBODY = 65534


def attack(address: str, victim: str) -> dict[str, str]:
    """What a second local user gets when it goes for another user's segment through the daemon."""
    from edge_server.errors import EdgeServerError
    from tests.daemon import RawPeer, header

    seen = {}
    try:
        SharedMemoryRegion.attach(victim)
        seen["attach"] = "opened"
    except EdgeServerError as exc:
        seen["attach"] = exc.code
    peer = RawPeer(address)
    reply = peer.ask([header(op="shm_register", name=victim)])
    seen["register_by_name"] = "ok" if reply["ok"] else reply["error"]["code"]
    desc = {
        "name": "frame",
        "datatype": "UINT8",
        "shape": [1, 1, 64],
        "shm": {"region": victim, "offset": 0, "byte_size": 64},
    }
    reply = peer.ask([header(op="infer", model="frame", inputs=[desc])])
    seen["infer_from_victim"] = "ok" if reply["ok"] else reply["error"]["code"]
    peer.close()
    return seen


def as_other_user(function: Any, *args: Any) -> Any:
    """Run ``function(*args)`` in a forked child that dropped to uid/gid 65534; return its JSON result."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no shared sockets; it talks through fresh ones
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(write, json.dumps(function(*args)).encode())
            code = 0
        except BaseException:
            os.write(write, traceback.format_exc().encode())  # the parent's assertion shows why
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the second user's process failed: {data.decode()}"
    return json.loads(data)


@pytest.fixture(scope="module")
def open_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon whose socket everyone may reach, as a group-shared socket would be in the field."""
    # Not under pytest's base directory: every pytest run (each xdist worker too) sets it back to 0700,
    # which would cut the second user off midway.
    with public_directory() as public:
        repo = build_repository(public)
        proc = start_daemon(public, repo, "d.sock")
        open_socket(proc.address)
        try:
            yield proc
        finally:
            assert stop_daemon(proc) == 0, proc.log()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a second local user (uid 65534) in the test")
def test_a_client_cannot_register_memory_it_could_not_open_itself(open_daemon: Daemon) -> None:
    secret = SharedMemoryRegion(64, posix=True)  # mode 0600, owned by this (root) process
    try:
        secret.array(np.uint8, (64,))[...] = 0x5A
        seen = as_other_user(attack, open_daemon.address, secret.name)
    finally:
        secret.close()
    assert seen == {
        "attach": "SHM_UNAVAILABLE",  # the kernel says no to the attacker itself
        "register_by_name": "SHM_UNAVAILABLE",  # and the daemon never opens a segment by name for it
        "infer_from_victim": "SHM_NOT_REGISTERED",
    }


def test_registering_by_name_is_refused(open_daemon: Daemon) -> None:
    own = SharedMemoryRegion(64, posix=True)
    try:
        from tests.daemon import RawPeer, header

        peer = RawPeer(open_daemon.address)
        reply = peer.ask([header(op="shm_register", name=own.name)])
        peer.close()
    finally:
        own.close()
    assert reply["error"]["code"] == "SHM_UNAVAILABLE" and "descriptor" in reply["error"]["message"]


def test_a_token_works_once(open_daemon: Daemon) -> None:
    from edge_server.client._common import register_fields
    from tests.daemon import RawPeer, header

    region = SharedMemoryRegion(4096)
    peer = RawPeer(open_daemon.address)
    try:
        fields = register_fields(open_daemon.address, region)
        assert peer.ask([header(op="shm_register", **fields)])["ok"]
        again = peer.ask([header(op="shm_register", **{**fields, "name": "edge-server-again"})])
        assert again["error"]["code"] == "SHM_UNAVAILABLE"
        forged = peer.ask([header(op="shm_register", name="edge-server-x", token="0" * 32)])
        assert forged["error"]["code"] == "SHM_UNAVAILABLE"
    finally:
        peer.close()
        region.close()


@pytest.fixture(scope="module")
def daemon_with_gate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("shrink")
    proc = start_daemon(root, build_repository(root), "s.sock")
    try:
        yield proc
    finally:
        assert stop_daemon(proc) == 0, proc.log()


def test_shrinking_a_segment_while_its_request_waits_cannot_kill_the_daemon(daemon_with_gate: Daemon) -> None:
    """The request waits in the gate model's queue (a window the client controls) while the client
    truncates the segment to nothing: the daemon must not fault, and the request gets its data."""
    gate = daemon_with_gate.gate
    assert gate is not None
    x = np.arange(1024, dtype=np.float32)
    with Client(daemon_with_gate.address, timeout=30) as client:
        region = SharedMemoryRegion(x.nbytes, posix=True)  # a POSIX segment can be shrunk by its owner
        client.register_shm(region)
        try:
            blocker = client.submit("gate", {"INPUT0": np.zeros(4, np.float32)})
            gate.wait_started()
            queued = client.submit("gate", {"INPUT0": region.write(x)})
            client.ipc_status()  # answered after the frontend decoded the request: it waits in the queue
            os.truncate(f"/dev/shm/{region.name}", 0)
            gate.release(2)
            assert blocker.result(timeout=30)["OUTPUT0"].shape == (4,)
            np.testing.assert_array_equal(queued.result(timeout=30)["OUTPUT0"], x)  # copied at decoding
            assert daemon_with_gate.proc is not None and daemon_with_gate.proc.poll() is None
            with pytest.raises(ShmOutOfBounds, match="shrank"):
                client.infer("gate", {"INPUT0": region.tensor("FP32", (1024,))})
        finally:
            gate.settle()
            client.unregister_shm(region)
            region.close()


def test_a_sealed_region_cannot_be_shrunk_by_its_owner_either() -> None:
    region = SharedMemoryRegion(4096)
    try:
        with pytest.raises(OSError):
            os.ftruncate(region.fd, 0)
    finally:
        region.close()


def test_shared_memory_over_tcp_is_refused_clearly() -> None:
    from edge_server.client._common import register_fields

    region = SharedMemoryRegion(64)
    try:
        with pytest.raises(ShmUnavailable, match="ipc://"):
            register_fields("tcp://127.0.0.1:5555", region)
    finally:
        region.close()


def try_unload(address: str) -> dict[str, str]:
    from tests.daemon import RawPeer, header

    peer = RawPeer(address)
    try:
        reply = peer.ask([header(op="unload", model="identity")])
        live = peer.ask([header(op="ready", model="identity")])
    finally:
        peer.close()
    return {"unload": "ok" if reply["ok"] else reply["error"]["code"], "ready": str(live.get("ready"))}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a second local user (uid 65534) in the test")
def test_only_the_daemons_user_may_unload_models(open_daemon: Daemon) -> None:
    assert as_other_user(try_unload, open_daemon.address) == {"unload": "PERMISSION_DENIED", "ready": "True"}
