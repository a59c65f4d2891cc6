"""The rules of Triton's system shared memory on the request path, in process with real segments.

One ``fstat`` per region and use answers both questions a use of a segment opened by key asks (may
this client's user read or write it now, and does it still hold the span): these tests hold the
answers to what they were before that was merged into one call, and count the calls.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_server.errors import ShmOutOfBounds, ShmUnavailable
from edge_server.kserve.shm import Peer, SystemSharedMemory

NOBODY = 65534  # any uid that is not the segment's owner: only the "other" bits decide for it


@pytest.fixture
def segments(tmp_path: Path) -> Iterator[tuple[SystemSharedMemory, Peer, dict[str, Path]]]:
    """A registry over ``tmp_path`` (the daemon's /dev/shm) with an input and an output region."""
    shm = SystemSharedMemory(max_input_bytes=1 << 20, shm_dir=str(tmp_path))
    peer = Peer("127.0.0.1", 40000, 8000, uid=NOBODY if os.getuid() == 0 else os.getuid())
    paths = {}
    for role in ("in", "out"):
        path = tmp_path / f"seg-{role}"
        path.write_bytes(bytes(range(64)))
        path.chmod(0o606)  # others may read and write: a client of another user could open it
        shm.register(role, path.name, 0, 64, peer)
        paths[role] = path
    try:
        yield shm, peer, paths
    finally:
        shm.close()


def count_fstat(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = os.fstat

    def counted(fd: int) -> os.stat_result:
        calls.append(fd)
        return real(fd)

    monkeypatch.setattr(os, "fstat", counted)
    return calls


def test_an_input_read_and_an_output_write_take_one_fstat_each(
    segments: tuple[SystemSharedMemory, Peer, dict[str, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    shm, peer, _paths = segments
    calls = count_fstat(monkeypatch)
    assert bytes(shm.read("in", 0, 16, 16, peer, "input 'A'")) == bytes(range(16))
    assert len(calls) == 1  # the permission bits and the current size, from one call
    calls.clear()
    lease = shm.check_output("out", 8, 8, peer, "output 'Y'")
    assert len(calls) == 1  # refused before the model runs where the user may not write it
    calls.clear()
    shm.write("out", 8, 8, b"\xff" * 8, peer, "output 'Y'", lease)
    lease.close()
    assert len(calls) == 1  # checked again when written: the mode or the size may have changed meanwhile


@pytest.mark.skipif(os.getuid() != 0, reason="the peer must be a uid other than the segment's owner")
def test_permission_is_checked_again_on_every_use(
    segments: tuple[SystemSharedMemory, Peer, dict[str, Path]],
) -> None:
    shm, peer, paths = segments
    shm.read("in", 0, 4, 4, peer, "input 'A'")
    lease = shm.check_output("out", 0, 4, peer, "output 'Y'")
    paths["in"].chmod(0o600)
    paths["out"].chmod(0o604)  # the owner took the write bit back while the request ran
    with pytest.raises(ShmUnavailable, match="may not read"):
        shm.read("in", 0, 4, 4, peer, "input 'A'")
    with pytest.raises(ShmUnavailable, match="may not write"):
        shm.write("out", 0, 4, b"\0" * 4, peer, "output 'Y'", lease)
    lease.close()
    assert paths["out"].read_bytes()[:4] == bytes(range(4))  # untouched
    with pytest.raises(ShmUnavailable, match="may not write"):
        shm.check_output("out", 0, 4, peer, "output 'Y'")
    assert shm.registry.regions(shm.owner(peer), "out")[0].holds == 0  # a refused hold is let go


def test_a_segment_shrunk_while_the_request_ran_is_refused_not_grown(
    segments: tuple[SystemSharedMemory, Peer, dict[str, Path]],
) -> None:
    shm, peer, paths = segments
    lease = shm.check_output("out", 32, 16, peer, "output 'Y'")
    os.truncate(paths["out"], 16)
    with pytest.raises(ShmOutOfBounds, match="shrank"):
        shm.write("out", 32, 16, b"\1" * 16, peer, "output 'Y'", lease)
    lease.close()
    assert paths["out"].stat().st_size == 16
    os.truncate(paths["in"], 8)
    with pytest.raises(ShmOutOfBounds, match="shrank"):
        shm.read("in", 0, 16, 16, peer, "input 'A'")


def test_a_shrink_between_the_size_check_and_the_read_is_refused_not_read_short(
    segments: tuple[SystemSharedMemory, Peer, dict[str, Path]],
) -> None:
    shm, peer, paths = segments
    region, size = shm.registry.access(shm.owner(peer), "in", "input 'A'")
    assert size == 64
    os.truncate(paths["in"], 8)  # after the fstat, before the pread
    with pytest.raises(ShmOutOfBounds, match="while it was read"):
        region.read(0, 16, "input 'A'", size)
