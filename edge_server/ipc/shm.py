"""The daemon's view of client shared memory: one registry of regions per client connection.

**Access is proven, never assumed.**  The daemon never opens a segment by name: a name would be
opened with the daemon's rights, and any client could then read or overwrite memory it cannot open
itself (a confused deputy).  A client hands the daemon the segment's file descriptor over a Unix
socket (:mod:`edge_server.ipc.handoff`, ``SCM_RIGHTS``): holding the descriptor is the proof.  The
hand-off yields a one-time token that the client's own ``shm_register`` presents.

**No client can make the daemon fault.**  A mapped page past the end of a file that its owner shrank
raises SIGBUS, which would kill the daemon.  So:

* a segment sealed against shrinking (a ``memfd`` with ``F_SEAL_SHRINK``, what our client creates)
  is mapped, and inputs are read in place (zero-copy); it can never shrink under the mapping;
* any other segment (a POSIX ``/dev/shm`` file, an unsealed memfd) is never mapped: inputs are copied
  in with ``pread`` and outputs written with ``pwrite``, which return short counts on a shrunk file
  instead of faulting.  One copy per input: the price of memory whose owner may shrink it.

**Outputs are written where the client asked, once.**  For a mapped region the frontend hands the
request a writable view of the span each output reference names (:meth:`Region.destination`, after
the bounds check), and the model's instance writes the output there: the runtime itself where it can
(ONNX Runtime's IOBinding, TensorRT's tensor addresses), else one copy on the instance's thread after
the run.  A copied region gets ``pwrite`` from the frontend.  ``shm_status`` counts each way.

A descriptor opened read-only serves inputs only.  Unregistering while a request still reads a mapped
region unmaps it when the last array over it goes (``mmap.close`` refuses while views exist).
"""

from __future__ import annotations

import abc
import logging
import mmap
import os
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any

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
from edge_server.request import OutputBuffer

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")
MAX_REGIONS_PER_CLIENT = protocol.DEFAULT_MAX_CLIENT_REGIONS  # --max-client-regions


def check_name(name: object) -> str:
    """A region name (a label within one client's registrations): 1-200 of ``[A-Za-z0-9._-]``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        shown = repr(name)[:60]
        raise ShmNameRejected(
            f"shared-memory name {shown} is not allowed: use 1-200 characters from [A-Za-z0-9._-]"
        )
    return name


@dataclass(frozen=True)
class Segment:
    """A segment's descriptor as a client handed it over, with what the daemon learned about it."""

    fd: int
    size: int
    sealed: bool  # F_SEAL_SHRINK: it can never become smaller, so it may be mapped
    writable: bool  # opened O_RDWR: outputs may be written into it
    uid: int  # the handing peer's credentials (SO_PEERCRED), for logs
    pid: int


class Region(abc.ABC):
    """One registered span (``byte_size`` bytes from the start) of a client's segment."""

    def __init__(self, name: str, byte_size: int, segment: Segment) -> None:
        self.name = name
        self.byte_size = byte_size
        self.segment = segment
        # The fd lives as long as this object: in-flight requests hold the region (for their outputs)
        # after it is unregistered, so closing it earlier could let a reused number be read.
        self._close_fd = weakref.finalize(self, os.close, segment.fd)
        # How outputs reached this region: written by the runtime, copied by the instance, by the frontend.
        self._lock = threading.Lock()
        self.outputs = {OutputBuffer.DIRECT: 0, OutputBuffer.COPIED: 0, "frontend": 0}

    @property
    def zero_copy(self) -> bool:
        return False

    def destination(self, offset: int, byte_size: int) -> OutputBuffer | None:
        """A writable view of a bounds-checked span, for the instance to write an output into.

        None where outputs must be copied in by the frontend (a region that is not mapped).
        """
        return None

    def count_output(self, how: str) -> None:
        """Count one output that reached this region (``OutputBuffer.filled``, or "frontend")."""
        with self._lock:  # replies are encoded on the instances' threads
            self.outputs[how] += 1

    def check(self, offset: int, byte_size: int, where: str, *, output: bool = False) -> None:
        """Refuse bytes outside the registration (and outputs into a read-only segment)."""
        protocol.check_span(offset, byte_size, self.byte_size, f"region {self.name!r}", where)
        if output and not self.segment.writable:
            raise ShmUnavailable(
                f"{where}: region {self.name!r} was handed over read-only; outputs need O_RDWR"
            )

    @abc.abstractmethod
    def read(self, offset: int, byte_size: int, where: str) -> memoryview | bytearray:
        """The input bytes, in place (sealed segments) or copied (all others)."""

    @abc.abstractmethod
    def write(self, offset: int, data: np.ndarray | bytes, where: str) -> None:
        """Copy an output into the region: the one copy an output into shared memory costs."""

    def release(self) -> None:  # noqa: B027 (nothing to do for most regions)
        """Drop the registry's hold; the fd closes with the last request that still uses the region."""


class MappedRegion(Region):
    """A sealed segment, mapped once: inputs are views into it, outputs are copied into it."""

    def __init__(self, name: str, byte_size: int, segment: Segment) -> None:
        self.mm = mmap.mmap(segment.fd, byte_size, mmap.MAP_SHARED, _prot(segment))
        super().__init__(name, byte_size, segment)

    @property
    def zero_copy(self) -> bool:
        return True

    def read(self, offset: int, byte_size: int, where: str) -> memoryview:
        self.check(offset, byte_size, where)
        return memoryview(self.mm)[offset : offset + byte_size]

    def destination(self, offset: int, byte_size: int) -> OutputBuffer | None:
        if not self.segment.writable:
            return None
        try:
            return OutputBuffer(np.frombuffer(self.mm, dtype=np.uint8, count=byte_size, offset=offset))
        except ValueError:  # unmapped meanwhile (unregistered): the frontend's write reports it
            return None

    def write(self, offset: int, data: np.ndarray | bytes, where: str) -> None:
        nbytes = len(data) if isinstance(data, bytes) else data.nbytes
        self.check(offset, nbytes, where, output=True)
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


class CopyRegion(Region):
    """A segment that may shrink: never mapped; ``pread``/``pwrite`` cannot fault, they come up short."""

    def read(self, offset: int, byte_size: int, where: str) -> bytearray:
        self.check(offset, byte_size, where)
        buffer = bytearray(byte_size)
        got = os.preadv(self.segment.fd, [buffer], offset) if byte_size else 0
        if got != byte_size:
            raise ShmOutOfBounds(
                f"{where}: region {self.name!r} holds only {offset + got} bytes now (its owner shrank it); "
                f"bytes {offset}..{offset + byte_size} are gone"
            )
        return buffer

    def write(self, offset: int, data: np.ndarray | bytes, where: str) -> None:
        raw: Any = data if isinstance(data, bytes) else np.ascontiguousarray(data)
        view = memoryview(raw).cast("B")
        self.check(offset, view.nbytes, where, output=True)
        size = os.fstat(self.segment.fd).st_size
        if offset + view.nbytes > size:  # pwrite would grow the client's file: refuse instead
            raise ShmOutOfBounds(
                f"{where}: region {self.name!r} holds only {size} bytes now (its owner shrank it)"
            )
        written = 0
        while written < view.nbytes:
            written += os.pwrite(self.segment.fd, view[written:], offset + written)


def _prot(segment: Segment) -> int:
    return mmap.PROT_READ | (mmap.PROT_WRITE if segment.writable else 0)


def open_region(name: str, segment: Segment, byte_size: int | None) -> Region:
    """A region over the first ``byte_size`` bytes (default: all) of a handed-over segment."""
    check_name(name)
    if byte_size is None:
        byte_size = segment.size
    if byte_size <= 0 or byte_size > segment.size:
        raise ShmOutOfBounds(
            f"cannot register {byte_size} bytes of segment {name!r}: it has {segment.size} bytes"
        )
    if not segment.sealed:
        return CopyRegion(name, byte_size, segment)
    try:
        return MappedRegion(name, byte_size, segment)
    except (OSError, ValueError) as exc:
        raise ShmUnavailable(f"cannot map shared-memory segment {name!r}: {exc}") from None


class ShmRegistry:
    """The regions one client connection registered.  Used only by the frontend thread."""

    def __init__(self, *, max_regions: int = MAX_REGIONS_PER_CLIENT) -> None:
        self._max = max_regions
        self._regions: dict[str, Region] = {}

    def __len__(self) -> int:
        return len(self._regions)

    def register(self, name: str, segment: Segment, byte_size: int | None) -> Region:
        """Register ``segment`` (its fd now belongs to the region) under ``name``."""
        try:
            if name in self._regions:
                raise ShmAlreadyRegistered(
                    f"region {name!r} is already registered by this client; unregister it first"
                )
            if len(self._regions) >= self._max:
                raise InvalidArgument(f"a client may register at most {self._max} regions")
            region = open_region(name, segment, byte_size)
        except BaseException:
            os.close(segment.fd)
            raise
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
            {"name": r.name, "byte_size": r.byte_size, "zero_copy": r.zero_copy, "outputs": dict(r.outputs)}
            for r in self._regions.values()
            if name is None or r.name == name
        ]

    def get(self, region: str, where: str) -> Region:
        """The registered region a reference names (its bounds are checked where it is used)."""
        found = self._regions.get(region)
        if found is None:
            known = sorted(self._regions)[:20]
            raise ShmNotRegistered(
                f"{where}: region {region[:60]!r} is not registered by this client (registered: {known})"
            )
        return found

    def resolve(self, region: str, offset: int, byte_size: int, where: str) -> Region:
        """The region an output reference points into, after checking the reference's bounds."""
        found = self.get(region, where)
        found.check(offset, byte_size, where, output=True)
        return found

    def close(self) -> None:
        self.unregister(None)
