"""The descriptor hand-off next to strangers: per-peer pending pools, no peer delays another's hand-off,
descriptors refused by what they are, and unsealed regions never read past what a tensor needs.

The hand-off tests run :class:`~edge_server.ipc.handoff.FdHandoff` in this process on a real Unix
socket; the last one runs the real daemon.  A second local user is a forked child that dropped to
uid 65534 (the tests run as root in CI).
"""

from __future__ import annotations

import json
import os
import socket
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_server.client import SharedMemoryRegion
from edge_server.errors import ShmUnavailable
from edge_server.ipc.handoff import MAX_PENDING_PER_PEER, MAX_WAITING_PER_PEER, FdHandoff, hand_over
from tests.daemon import Daemon, RawPeer, build_repository, header, start_daemon, stop_daemon

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a second local user (uid 65534)")


def as_nobody(function: Callable[..., Any], *args: Any) -> Any:
    """Run ``function(*args)`` in a forked child that dropped to uid/gid 65534; its JSON result."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(write, json.dumps(function(*args)).encode())
            code = 0
        except BaseException:
            os.write(write, traceback.format_exc().encode())
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the second user's process failed: {data.decode()}"
    return json.loads(data)


def open_to_everyone(path: Path) -> None:
    for parent in [path, *path.parents]:
        if str(parent).startswith("/tmp/"):
            os.chmod(parent, os.stat(parent).st_mode | 0o005)


@pytest.fixture
def handoff(tmp_path: Path) -> Iterator[FdHandoff]:
    public = tmp_path / "public"
    public.mkdir()
    os.chmod(public, 0o777)
    open_to_everyone(public)
    server = FdHandoff(public / "d.sock.shm")
    server.start(0o666)
    try:
        yield server
    finally:
        server.close()


def flood(path: str, times: int) -> dict[str, int]:
    """Hand one descriptor over ``times`` times and never register it: what a hoarder does."""
    fd = os.memfd_create("hoard")
    os.ftruncate(fd, 4096)
    taken = refused = 0
    for _ in range(times):
        try:
            hand_over(Path(path), fd)
            taken += 1
        except ShmUnavailable:
            refused += 1
    return {"taken": taken, "refused": refused}


@needs_root
def test_one_peer_hoarding_tokens_does_not_lock_the_others_out(handoff: FdHandoff) -> None:
    seen = as_nobody(flood, str(handoff.path), MAX_PENDING_PER_PEER + 20)
    assert seen == {"taken": MAX_PENDING_PER_PEER, "refused": 20}  # its own pool is full
    fd = os.memfd_create("legit")
    try:
        os.ftruncate(fd, 4096)
        token = hand_over(handoff.path, fd)  # another user's pool is its own
        segment = handoff.claim(token, uid=os.geteuid())
        os.close(segment.fd)
        assert segment.size == 4096
    finally:
        os.close(fd)


def test_a_token_is_claimed_only_by_the_user_that_handed_the_descriptor(handoff: FdHandoff) -> None:
    fd = os.memfd_create("mine")
    try:
        os.ftruncate(fd, 4096)
        token = hand_over(handoff.path, fd)
        with pytest.raises(ShmUnavailable, match="another user"):
            handoff.claim(token, uid=NOBODY)
        with pytest.raises(ShmUnavailable, match="unknown or expired"):  # and it is gone: it worked once
            handoff.claim(token, uid=os.geteuid())
    finally:
        os.close(fd)


def test_a_users_own_silent_connections_only_block_that_user(handoff: FdHandoff) -> None:
    idle = []
    fd = os.memfd_create("mine")
    try:
        os.ftruncate(fd, 4096)
        for _ in range(MAX_WAITING_PER_PEER):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.connect(str(handoff.path))
            idle.append(sock)
        with pytest.raises(ShmUnavailable, match="wait silently"):
            hand_over(handoff.path, fd)
    finally:
        os.close(fd)
        for sock in idle:
            sock.close()


@needs_root
def test_idle_connections_do_not_delay_a_hand_off(handoff: FdHandoff) -> None:
    """Another user holds 20 connections that send nothing (each would have cost a second of the
    hand-off's attention when peers were served in turn): a hand-off still completes within the
    client's own default timeout."""
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            idle = []
            for _ in range(20):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                sock.connect(str(handoff.path))
                idle.append(sock)
            os.write(ready_w, b"r")
            os.read(done_r, 1)  # hold them open until the parent's hand-off is done
            code = 0
        finally:
            os._exit(code)
    fd = os.memfd_create("legit")
    try:
        assert os.read(ready_r, 1) == b"r"
        os.ftruncate(fd, 4096)
        token = hand_over(handoff.path, fd, timeout=5.0)  # the client's own default timeout
        segment = handoff.claim(token, uid=os.geteuid())
        os.close(segment.fd)
        assert segment.size == 4096
    finally:
        os.write(done_w, b"d")
        os.waitpid(pid, 0)
        os.close(fd)
        for end in (ready_r, ready_w, done_r, done_w):
            os.close(end)


def test_descriptors_that_are_not_readable_shared_memory_are_refused_at_hand_off(
    handoff: FdHandoff, tmp_path: Path
) -> None:
    path = f"/dev/shm/edge-handoff-test-{os.getpid()}"
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"\0" * 4096)
    fds = []
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 4096)
        os.close(fd)
        cases = {
            "O_PATH": os.open(path, os.O_PATH),
            "write-only": os.open(path, os.O_WRONLY),
            "plain file": os.open(plain, os.O_RDWR),
        }
        fds = list(cases.values())
        refused_before = handoff.refused
        for what, fd in cases.items():
            with pytest.raises(ShmUnavailable) as caught:
                hand_over(handoff.path, fd)
            assert "refused" in caught.value.message, what
        assert handoff.refused == refused_before + 3
        ok = os.open(path, os.O_RDONLY)  # read-only shared memory is fine (inputs only)
        fds.append(ok)
        segment = handoff.claim(hand_over(handoff.path, ok), uid=os.geteuid())
        os.close(segment.fd)
        assert not segment.writable
    finally:
        for fd in fds:
            os.close(fd)
        os.unlink(path)


# -- the daemon ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("handoff")
    proc = start_daemon(root, build_repository(root), "d.sock")
    try:
        yield proc
    finally:
        assert stop_daemon(proc) == 0, proc.log()


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_an_unsealed_region_is_not_read_past_what_the_tensor_needs(daemon: Daemon) -> None:
    from edge_server.client._common import register_fields

    big = 512 << 20
    region = SharedMemoryRegion(big, posix=True)  # /dev/shm: unsealed, so copied, never mapped
    peer = RawPeer(daemon.address)
    try:
        assert peer.ask([header(op="shm_register", **register_fields(daemon.address, region))])["ok"]
        before = peak_rss(daemon.pid)
        desc = {
            "name": "INPUT0",
            "datatype": "FP32",
            "shape": [4],
            "shm": {"region": region.name, "offset": 0, "byte_size": big},
        }
        reply = peer.ask([header(op="infer", model="identity", inputs=[desc])])
        assert reply["error"]["code"] == "TENSOR_SIZE_MISMATCH"
        assert peak_rss(daemon.pid) - before < 64 << 20  # the sparse 512 MiB were never read
        desc["shm"]["byte_size"] = 16
        region.array(np.float32, (4,))[...] = [1, 2, 3, 4]
        assert peer.ask([header(op="infer", model="identity", inputs=[desc])])["ok"]
    finally:
        peer.close()
        region.close()


def test_a_mapped_region_counts_two_descriptors_and_a_refused_one_keeps_none(tmp_path: Path) -> None:
    """At a small descriptor limit one user stops at its share of the budget (half), counting a mapped
    region's two descriptors (the one handed over and mmap's own), and a refused registration's
    descriptor is closed at once instead of waiting for its token to expire."""
    from edge_server.client._common import register_fields
    from edge_server.limits import FD_RESERVE

    nofile = FD_RESERVE + 80  # room for 40 connections and 40 shared-memory descriptors
    proc = start_daemon(tmp_path, build_repository(tmp_path), "fd.sock", nofile=nofile)
    regions = [SharedMemoryRegion(4096) for _ in range(30)]  # sealed memfds: mapped
    peer = RawPeer(proc.address)
    try:
        codes = []
        for region in regions:
            reply = peer.ask([header(op="shm_register", **register_fields(proc.address, region))])
            codes.append("ok" if reply["ok"] else reply["error"]["code"])
        share = (nofile - FD_RESERVE) // 2 // 2  # descriptors one user may hold
        assert codes == ["ok"] * (share // 2) + ["SHM_UNAVAILABLE"] * (len(regions) - share // 2)
        status = peer.ask([header(op="ipc_status")])["ipc"]
        assert status["regions"] == share // 2 and status["region_descriptors"] == share
        assert status["pending_handoffs"] == 0  # the refused ones' descriptors are closed already
        assert peer.ask([header(op="live")])["ok"]
    finally:
        peer.close()
        for region in regions:
            region.close()
        assert stop_daemon(proc) == 0, proc.log()


def test_the_descriptor_budget_is_shared_between_users() -> None:
    from edge_server.errors import ShmUnavailable as Refused
    from edge_server.ipc.handoff import inspect_fd
    from edge_server.shm import Owner, Registry

    registry = Registry(max_descriptors=8)  # four mapped regions in all, two per user
    region = SharedMemoryRegion(4096)
    try:

        def segment() -> Any:
            return inspect_fd(os.dup(region.fd), uid=0, pid=0)

        for name in ("a", "b"):
            registry.register(Owner(1), name, segment(), None)
        with pytest.raises(Refused, match="the most one user may"):
            registry.register(Owner(1, "other connection"), "c", segment(), None)
        for name in ("a", "b"):
            registry.register(Owner(2), name, segment(), None)
        assert registry.descriptors == 8
        with pytest.raises(Refused, match="its limit is 8"):
            registry.register(Owner(3), "a", segment(), None)
        assert registry.unregister(Owner(1), None) == ["a", "b"]
        registry.register(Owner(3), "a", segment(), None)
    finally:
        registry.close()
        region.close()


@pytest.mark.skipif(
    os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") < 8 << 30, reason="needs 8 GiB of free memory"
)
def test_an_input_of_2_gib_or_more_is_read_whole_from_a_copied_region() -> None:
    """preadv moves at most 2 GiB - 4 KiB per call: the read loops, and a short read is not a shrink."""
    from edge_server.ipc.handoff import inspect_fd
    from edge_server.shm import Owner, Registry

    size = (2 << 30) + 4096
    region = SharedMemoryRegion(size, posix=True)
    registry = Registry().client(Owner(0))
    try:
        os.pwrite(region.fd, b"end!", size - 4)
        copied = registry.register("big", inspect_fd(os.dup(region.fd), uid=0, pid=0), None)
        data = copied.read(0, size, "input 'BIG'")
        assert len(data) == size and bytes(data[-4:]) == b"end!"
        del data
    finally:
        registry.close()
        region.close()
