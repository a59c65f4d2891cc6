"""The daemon's view of client shared memory: one registry of mapped regions per client connection.

Segments are opened as ``/dev/shm/<name>`` with ``os.open`` + ``mmap`` on purpose.  Python's
``multiprocessing.shared_memory`` registers every segment it opens with the resource tracker, which
unlinks them when the process exits: the daemon would delete segments its clients own.  The daemon
never creates and never unlinks a segment; it only maps and unmaps.

A region may still be in use by a request when its client unregisters it or disconnects: the input
arrays of that request are views into the mapping.  Unregistering therefore drops the registry's
reference and unmaps only when no array uses it any more (``mmap.close`` refuses while views exist;
the last view's release unmaps it).

The client may also shrink its segment under a mapping; see :class:`MappedRegion` for why that does
not crash the daemon.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import stat
import weakref

import numpy as np

from edge_server.errors import (
    InvalidArgument,
    ShmAlreadyRegistered,
    ShmNameRejected,
    ShmNotRegistered,
    ShmOutOfBounds,
    ShmUnavailable,
)
from edge_server.ipc import protocol

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")
MAX_REGIONS_PER_CLIENT = 256


def check_name(name: str, prefix: str) -> None:
    """Reject names outside the prefix, or that could escape ``/dev/shm`` (``/``, ``..``)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        raise ShmNameRejected(
            f"shared-memory name {name!r} is not allowed: use 1-200 characters from [A-Za-z0-9._-]"
        )
    if not name.startswith(prefix):
        raise ShmNameRejected(
            f"shared-memory name {name!r} is outside the configured prefix {prefix!r}; "
            f"create segments named {prefix}<something>"
        )


class MappedRegion:
    """One client segment mapped into the daemon.

    The segment belongs to the client, which may ``ftruncate`` it smaller at any time; touching a
    mapped page past the segment's new end raises SIGBUS, which kills the daemon.  So the region keeps
    the segment's fd open and every use (an input view, an output reference, the output's write)
    first asks ``fstat`` how large the segment is *now*.  What remains is the window between that check
    and the model reading an input (docs/protocol.md, "Shared memory").
    """

    def __init__(self, name: str, byte_size: int, mm: mmap.mmap, fd: int) -> None:
        self.name = name
        self.byte_size = byte_size
        self.mm = mm
        self._fd = fd
        # The fd lives as long as this object: in-flight requests hold the region (for their outputs)
        # after it is unregistered, so closing the fd in release() could let fstat see a reused number.
        self._close_fd = weakref.finalize(self, os.close, fd)

    def check(self, offset: int, byte_size: int, where: str) -> None:
        """Refuse bytes outside the registration, or past the segment's end as it is now."""
        protocol.check_span(offset, byte_size, self.byte_size, f"region {self.name!r}", where)
        try:
            size = os.fstat(self._fd).st_size
        except OSError as exc:  # cannot happen while the fd is ours; refuse rather than risk SIGBUS
            raise ShmUnavailable(f"{where}: cannot check segment {self.name!r}: {exc.strerror}") from None
        if size < self.byte_size:
            what = f"what is left of segment {self.name!r} after its owner shrank it"
            protocol.check_span(offset, byte_size, size, what, where)

    def view(self, offset: int, byte_size: int, where: str) -> memoryview:
        """A no-copy view of ``byte_size`` bytes at ``offset``, after :meth:`check`."""
        self.check(offset, byte_size, where)
        return memoryview(self.mm)[offset : offset + byte_size]

    def write(self, offset: int, data: np.ndarray | bytes, where: str) -> None:
        """Copy ``data`` into the region: the one copy an output into shared memory costs."""
        nbytes = len(data) if isinstance(data, bytes) else data.nbytes
        self.check(offset, nbytes, where)
        try:
            if isinstance(data, bytes):
                self.mm[offset : offset + nbytes] = data
                return
            target = np.frombuffer(self.mm, dtype=np.uint8, count=nbytes, offset=offset)
        except ValueError:  # unmapped: the client unregistered it while the request ran
            raise ShmNotRegistered(
                f"region {self.name!r} was unregistered before the output was written"
            ) from None
        target[:] = np.ascontiguousarray(data).reshape(-1).view(np.uint8)

    def release(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            # A request still reads or writes through a view; the mapping goes when the last view does.
            log.debug("region %s still in use by a request; unmapped when it finishes", self.name)


def open_region(name: str, prefix: str, byte_size: int | None) -> MappedRegion:
    """Map the client's segment ``/dev/shm/<name>``; ``byte_size`` (default: all) is what may be used."""
    check_name(name, prefix)
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ShmUnavailable(f"no shared-memory segment {name!r} ({path} does not exist)") from None
    except OSError as exc:
        raise ShmUnavailable(f"cannot open shared-memory segment {name!r}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ShmUnavailable(f"{path} is not a shared-memory segment")
        size = info.st_size
        if size == 0:
            raise ShmUnavailable(f"shared-memory segment {name!r} is empty (size it with ftruncate first)")
        if byte_size is None:
            byte_size = size
        elif byte_size <= 0 or byte_size > size:
            raise ShmOutOfBounds(
                f"cannot register {byte_size} bytes of segment {name!r}: it has {size} bytes"
            )
        mm = mmap.mmap(fd, byte_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        os.close(fd)
        raise ShmUnavailable(f"cannot map shared-memory segment {name!r}: {exc.strerror}") from None
    except BaseException:
        os.close(fd)
        raise
    return MappedRegion(name, byte_size, mm, fd)


class ShmRegistry:
    """The regions one client connection registered.  Used only by the frontend thread."""

    def __init__(self, prefix: str, *, max_regions: int = MAX_REGIONS_PER_CLIENT) -> None:
        self._prefix = prefix
        self._max = max_regions
        self._regions: dict[str, MappedRegion] = {}

    def __len__(self) -> int:
        return len(self._regions)

    def register(self, name: str, byte_size: int | None) -> MappedRegion:
        if name in self._regions:
            raise ShmAlreadyRegistered(
                f"region {name!r} is already registered by this client; unregister it first"
            )
        if len(self._regions) >= self._max:
            raise InvalidArgument(f"a client may register at most {self._max} regions")
        region = open_region(name, self._prefix, byte_size)
        self._regions[name] = region
        return region

    def unregister(self, name: str | None) -> list[str]:
        """Unregister ``name``, or every region when ``name`` is None; the names unregistered."""
        if name is None:
            names = list(self._regions)
        elif name in self._regions:
            names = [name]
        else:
            raise ShmNotRegistered(f"region {name!r} is not registered by this client")
        for key in names:
            self._regions.pop(key).release()
        return names

    def status(self, name: str | None = None) -> list[dict[str, object]]:
        if name is not None and name not in self._regions:
            raise ShmNotRegistered(f"region {name!r} is not registered by this client")
        return [
            {"name": r.name, "byte_size": r.byte_size}
            for r in self._regions.values()
            if name is None or r.name == name
        ]

    def get(self, region: str, where: str) -> MappedRegion:
        """The registered region a reference names (its bounds are checked where it is used)."""
        found = self._regions.get(region)
        if found is None:
            known = sorted(self._regions)
            raise ShmNotRegistered(
                f"{where}: region {region!r} is not registered by this client (registered: {known})"
            )
        return found

    def resolve(self, region: str, offset: int, byte_size: int, where: str) -> MappedRegion:
        """The registered region a reference points into, after checking the reference's bounds."""
        found = self.get(region, where)
        found.check(offset, byte_size, where)
        return found

    def close(self) -> None:
        self.unregister(None)
