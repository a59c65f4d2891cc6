"""The daemon's view of client shared memory: one registry of mapped regions per client connection.

Segments are opened as ``/dev/shm/<name>`` with ``os.open`` + ``mmap`` on purpose.  Python's
``multiprocessing.shared_memory`` registers every segment it opens with the resource tracker, which
unlinks them when the process exits: the daemon would delete segments its clients own.  The daemon
never creates and never unlinks a segment; it only maps and unmaps.

A region may still be in use by a request when its client unregisters it or disconnects: the input
arrays of that request are views into the mapping.  Unregistering therefore drops the registry's
reference and unmaps only when no array uses it any more (``mmap.close`` refuses while views exist;
the last view's release unmaps it).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import stat
from dataclasses import dataclass

import numpy as np

from edge_server.errors import (
    InvalidArgument,
    ShmAlreadyRegistered,
    ShmNameRejected,
    ShmNotRegistered,
    ShmOutOfBounds,
    ShmUnavailable,
)

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


@dataclass(eq=False)
class MappedRegion:
    """One client segment mapped into the daemon."""

    name: str
    byte_size: int
    mm: mmap.mmap

    def span(self, offset: int, byte_size: int, where: str) -> None:
        if offset + byte_size > self.byte_size:
            raise ShmOutOfBounds(
                f"{where}: bytes {offset}..{offset + byte_size} reach past the end of region "
                f"{self.name!r} ({self.byte_size} bytes)"
            )

    def view(self, offset: int, byte_size: int) -> memoryview:
        """A no-copy view of ``byte_size`` bytes at ``offset`` (already bounds-checked)."""
        return memoryview(self.mm)[offset : offset + byte_size]

    def write(self, offset: int, data: np.ndarray | bytes) -> None:
        """Copy ``data`` into the region: the one copy an output into shared memory costs."""
        try:
            if isinstance(data, bytes):
                self.mm[offset : offset + len(data)] = data
                return
            target = np.frombuffer(self.mm, dtype=np.uint8, count=data.nbytes, offset=offset)
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
        raise ShmUnavailable(f"cannot map shared-memory segment {name!r}: {exc.strerror}") from None
    finally:
        os.close(fd)
    return MappedRegion(name=name, byte_size=byte_size, mm=mm)


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

    def resolve(self, region: str, offset: int, byte_size: int, where: str) -> MappedRegion:
        """The registered region a reference points into, after checking the reference's bounds."""
        found = self._regions.get(region)
        if found is None:
            known = sorted(self._regions)
            raise ShmNotRegistered(
                f"{where}: region {region!r} is not registered by this client (registered: {known})"
            )
        found.span(offset, byte_size, where)
        return found

    def close(self) -> None:
        self.unregister(None)
