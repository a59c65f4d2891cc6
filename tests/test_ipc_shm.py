"""Shared memory on both sides (real /dev/shm, no sockets), socket addresses, and the peer table."""

from __future__ import annotations

import concurrent.futures
import gc
import os
import socket
import stat
from pathlib import Path

import numpy as np
import pytest

from edge_server.client.shm import SharedMemoryRegion, ShmRing
from edge_server.errors import (
    AddressInUse,
    InvalidArgument,
    ShmAlreadyRegistered,
    ShmNameRejected,
    ShmNotRegistered,
    ShmOutOfBounds,
    ShmUnavailable,
)
from edge_server.ipc import addresses, peers
from edge_server.ipc.handoff import inspect_fd
from edge_server.reply_budget import ReplyBudget
from edge_server.shm import MappedRegion, Owner, Registry, Segment, check_name


@pytest.fixture
def region() -> SharedMemoryRegion:
    r = SharedMemoryRegion(4096)
    yield r
    r.close()


def segment_of(region: SharedMemoryRegion) -> Segment:
    """What the daemon gets from the hand-off: a duplicate of the client's descriptor."""
    return inspect_fd(os.dup(region.fd), uid=os.getuid(), pid=os.getpid())


def test_default_region_is_a_sealed_memfd_nobody_else_can_open(region: SharedMemoryRegion) -> None:
    assert region.name.startswith("edge-server-")
    assert not os.path.exists(f"/dev/shm/{region.name}")
    assert os.readlink(f"/proc/self/fd/{region.fd}").startswith("/memfd:")
    segment = segment_of(region)
    try:
        assert segment.sealed and segment.writable and segment.size == 4096
        with pytest.raises(OSError):
            os.ftruncate(region.fd, 16)  # F_SEAL_SHRINK: nobody can shrink it, its owner neither
    finally:
        os.close(segment.fd)
    region.close()
    assert region.closed


def test_posix_region_is_private_to_its_owner() -> None:
    region = SharedMemoryRegion(4096, posix=True)
    path = f"/dev/shm/{region.name}"
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and os.path.getsize(path) == 4096
        assert not segment_of(region).sealed
    finally:
        region.close()
    assert not os.path.exists(path)


def test_forgotten_region_is_unlinked_when_collected() -> None:
    r = SharedMemoryRegion(128, posix=True)
    path = f"/dev/shm/{r.name}"
    del r
    gc.collect()
    assert not os.path.exists(path)


def test_region_write_and_references(region: SharedMemoryRegion) -> None:
    x = np.arange(10, dtype=np.int16)
    ref = region.write(x, offset=100)
    assert (ref.offset, ref.byte_size, ref.datatype, ref.shape) == (100, 20, "INT16", (10,))
    assert region.array(np.int16, (10,), offset=100).tolist() == x.tolist()
    assert region.tensor("INT16", (10,), offset=100) == ref
    assert region.output(4000).byte_size == 96
    with pytest.raises(ShmOutOfBounds):
        region.write(np.zeros(100, np.float64), offset=3500)
    with pytest.raises(ShmOutOfBounds):
        region.output(4000, 200)


def test_sealed_region_is_mapped_without_copying_and_bounds_are_checked(region: SharedMemoryRegion) -> None:
    registry = Registry().client(Owner(0))
    mapped = registry.register(region.name, segment_of(region), None)
    assert mapped.byte_size == 4096 and mapped.zero_copy
    region.array(np.uint8, (4,))[...] = [1, 2, 3, 4]
    view = mapped.read(0, 4, "t")
    assert bytes(view) == b"\x01\x02\x03\x04"
    region.array(np.uint8, (1,))[...] = [7]
    assert bytes(view)[0] == 7  # the client's memory, live: no copy
    del view
    mapped.write(8, np.array([9, 9], np.uint8), "t")
    assert region.array(np.uint8, (2,), offset=8).tolist() == [9, 9]
    assert registry.resolve(region.name, 4000, 96, "t") is mapped
    with pytest.raises(ShmOutOfBounds, match="lie outside region"):
        registry.resolve(region.name, 4000, 97, "t")
    with pytest.raises(ShmNotRegistered):
        registry.resolve("edge-server-other", 0, 1, "t")
    with pytest.raises(ShmAlreadyRegistered):
        registry.register(region.name, segment_of(region), 16)
    assert registry.status() == [
        {
            "name": region.name,
            "byte_size": 4096,
            "zero_copy": True,
            "outputs": {"direct": 0, "copied": 0, "frontend": 0},
        }
    ]
    assert registry.unregister(None) == [region.name] and len(registry) == 0
    with pytest.raises(ShmNotRegistered):
        registry.unregister(region.name)


def test_unmap_waits_for_arrays_still_in_use(region: SharedMemoryRegion) -> None:
    registry = Registry().client(Owner(0))
    mapped = registry.register(region.name, segment_of(region), None)
    assert isinstance(mapped, MappedRegion)
    view = np.frombuffer(mapped.read(0, 16, "t"), np.uint8)  # a request's input
    registry.unregister(region.name)
    assert not mapped.mm.closed  # still mapped: the array reads through it
    del view
    mapped.release()
    assert mapped.mm.closed


def test_a_segment_that_may_shrink_is_never_mapped_and_cannot_fault() -> None:
    """A POSIX segment's owner may ftruncate it at any time: the daemon copies with pread/pwrite,
    which come up short instead of raising SIGBUS, so even a shrink mid-request cannot kill it."""
    region = SharedMemoryRegion(64 * 1024, posix=True)
    registry = Registry().client(Owner(0))
    try:
        copied = registry.register(region.name, segment_of(region), None)
        assert not copied.zero_copy
        region.array(np.uint8, (4,))[...] = [1, 2, 3, 4]
        data = copied.read(0, 4, "t")
        region.array(np.uint8, (1,))[...] = [9]
        assert bytes(data) == b"\x01\x02\x03\x04"  # a copy: later writes do not show
        copied.write(100, np.array([5, 6], np.uint8), "t")
        assert region.array(np.uint8, (2,), offset=100).tolist() == [5, 6]
        os.truncate(f"/dev/shm/{region.name}", 4096)
        assert len(copied.read(0, 4096, "t")) == 4096  # what is left is still usable
        with pytest.raises(ShmOutOfBounds, match="shrank"):
            copied.read(8192, 16, "input 'A'")
        with pytest.raises(ShmOutOfBounds, match="shrank"):
            copied.write(32768, np.zeros(16, np.uint8), "output 'Y'")
        assert os.path.getsize(f"/dev/shm/{region.name}") == 4096  # never grown back by a write
    finally:
        registry.close()
        region.close()


def test_read_only_descriptor_serves_inputs_only(region: SharedMemoryRegion) -> None:
    fd = os.open(f"/proc/self/fd/{region.fd}", os.O_RDONLY)
    registry = Registry().client(Owner(0))
    try:
        ro = registry.register(region.name, inspect_fd(fd, uid=os.getuid(), pid=os.getpid()), None)
        assert len(ro.read(0, 16, "t")) == 16
        with pytest.raises(ShmUnavailable, match="read-only"):
            registry.resolve(region.name, 0, 16, "output 'Y'")
    finally:
        registry.close()


@pytest.mark.parametrize("name", ["edge-server-a/b", "..", "edge-server-\u00e9", "edge-server-" + "x" * 200])
def test_bad_names_are_rejected(name: str) -> None:
    with pytest.raises(ShmNameRejected):
        check_name(name)


def test_register_limits(region: SharedMemoryRegion) -> None:
    registry = Registry(max_per_client=1).client(Owner(0))
    with pytest.raises(ShmOutOfBounds):
        registry.register(region.name, segment_of(region), 8192)
    registry.register(region.name, segment_of(region), None)
    with pytest.raises(InvalidArgument, match="at most 1"):
        registry.register("edge-server-second", segment_of(region), None)
    registry.close()


def test_ring_slots_are_aligned_and_wait_for_their_request(region: SharedMemoryRegion) -> None:
    ring = ShmRing(region, 3, 100)
    offsets = [slot.offset for slot in ring.slots]
    assert offsets == [0, 128, 256]
    first = ring.next()
    pending: concurrent.futures.Future[int] = concurrent.futures.Future()
    first.hold(pending)
    assert ring.next() is ring.slots[1] and ring.next() is ring.slots[2]
    with pytest.raises(TimeoutError):
        ring.next(timeout=0.01)  # slot 0 is still busy
    pending.set_result(1)
    assert ring.next(timeout=1) is first
    with pytest.raises(ShmOutOfBounds):
        first.write(np.zeros(200, np.uint8))


def test_default_address(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RUNTIME_DIRECTORY", f"{tmp_path}/run:{tmp_path}/other")
    assert addresses.default_address() == f"ipc://{tmp_path}/run/edge-server.sock"
    monkeypatch.delenv("RUNTIME_DIRECTORY")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert addresses.default_address() == f"ipc://{tmp_path}/edge-server/edge-server.sock"
    assert stat.S_IMODE(os.stat(tmp_path / "edge-server").st_mode) == 0o700
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setattr(addresses.tempfile, "gettempdir", lambda: str(tmp_path))
    assert addresses.default_address() == f"ipc://{tmp_path}/edge-server-{os.getuid()}/edge-server.sock"
    os.chmod(tmp_path / f"edge-server-{os.getuid()}", 0o777)
    with pytest.raises(InvalidArgument, match="not a private directory"):
        addresses.default_address()


def test_group_access_needs_the_systemd_runtime_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The socket is 0660, but only a directory the group may traverse lets the group connect."""
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o750)  # RuntimeDirectoryMode=0750, as systemd/edge-server.service sets it
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(run))
    address = addresses.default_address()
    bound = bind_socket(address)
    try:
        assert stat.S_IMODE(os.stat(run).st_mode) == 0o750  # systemd's directory: left alone
        assert stat.S_IMODE(os.stat(run / "edge-server.sock").st_mode) == 0o660
        assert addresses.who_may_connect(address) == "owner and group"
    finally:
        bound.close()
    monkeypatch.delenv("RUNTIME_DIRECTORY")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    address = addresses.default_address()
    caplog.set_level("INFO", logger=addresses.__name__)
    bound = bind_socket(address)
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "edge-server").st_mode) == 0o700  # per-user fallback
        assert addresses.who_may_connect(address) == "owner"
        assert "only its owner may connect" in caplog.text and "RuntimeDirectoryMode=0750" in caplog.text
    finally:
        bound.close()
    assert addresses.who_may_connect("tcp://127.0.0.1:5555") == "anyone"


def bind_socket(address: str) -> socket.socket:
    """Bind a unix socket where the daemon would, with the daemon's before- and after-bind steps."""
    addresses.prepare_bind(address)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(address[len("ipc://") :])
    addresses.secure_socket(address)
    return sock


def test_address_checks(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="ipc:// or tcp://"):
        addresses.check_address("udp://x")
    with pytest.raises(InvalidArgument, match="limit is 107"):
        addresses.check_address("ipc:///" + "x" * 120)
    addresses.check_address("tcp://127.0.0.1:5555")


def test_prepare_bind_removes_stale_sockets_and_refuses_live_ones(tmp_path: Path) -> None:
    path = tmp_path / "d.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody listens: a crashed daemon's leftover
    addresses.prepare_bind(f"ipc://{path}")
    assert not path.exists()
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        live.bind(str(path))
        live.listen()
        with pytest.raises(AddressInUse):
            addresses.prepare_bind(f"ipc://{path}")
    finally:
        live.close()
    (tmp_path / "plain").write_text("x")
    with pytest.raises(InvalidArgument, match="not a socket"):
        addresses.prepare_bind(f"ipc://{tmp_path}/plain")


def test_prepare_bind_sees_a_socket_renamed_away_at_the_connection_cap(tmp_path: Path) -> None:
    """A daemon at its connection cap listens under ``.NAME.full``: live, it keeps the address; stale,
    the file goes."""
    path = tmp_path / "d.sock"
    paused = addresses.paused_path(path)
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        live.bind(str(paused))
        live.listen()
        with pytest.raises(AddressInUse, match="connection cap"):
            addresses.prepare_bind(f"ipc://{path}")
    finally:
        live.close()  # the file stays, nobody listens: a daemon killed while at its cap
    addresses.prepare_bind(f"ipc://{path}")
    assert not paused.exists()


def test_peer_table_probes_only_clients_that_hold_state(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(peers.time, "monotonic", lambda: now[0])
    table = peers.PeerTable(probe_interval=10.0, replies=ReplyBudget(1 << 20), on_over=lambda _identity: None)
    idle = table.get(b"idle")
    busy = table.get(b"busy")
    busy.in_flight.add(concurrent.futures.Future())
    assert table.due_probes() == []
    now[0] += 11  # both idle past the interval: the empty one is forgotten, the busy one probed
    assert table.due_probes() == [b"busy"] and table.find(b"idle") is None and idle is not None
    table.get(b"busy")
    table.disconnect_seen()
    assert table.due_probes() == []  # the probe waits a moment after the disconnect event
    now[0] += peers.DISCONNECT_PROBE_DELAY
    assert table.due_probes() == [b"busy"]
    future = next(iter(busy.in_flight))
    table.drop(b"busy", "disconnected")
    assert future.cancelled() and table.dropped == 1 and len(table) == 0
