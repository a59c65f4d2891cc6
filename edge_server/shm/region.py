"""One registered span of a client's shared-memory segment, and how the daemon reads and writes it.

**No client can make the daemon fault.**  A mapped page past the end of a file that its owner shrank
raises SIGBUS, which would kill the daemon.  So:

* a segment sealed against shrinking (a ``memfd`` with ``F_SEAL_SHRINK``, what our IPC client
  creates) is mapped, and inputs are read in place (zero-copy); it can never shrink under the mapping;
* any other segment (a POSIX ``/dev/shm`` file, an unsealed memfd) is never mapped: inputs are copied
  in with ``preadv`` and outputs written with ``pwrite``, which return short counts on a shrunk file
  instead of faulting.  One copy per input: the price of memory whose owner may shrink it.

**Never more than the tensor needs.**  A caller asks :meth:`Region.read` for exactly the bytes of
one tensor, after comparing them with the tensor's datatype and shape (or with the request limit,
for strings), so a sparse segment of gigabytes named as a 16-byte input costs nothing.  The segment's
current size is compared before anything is read, and reads loop past the kernel's 2 GiB per call.

**Outputs are written where the client asked, once.**  For a mapped region the frontend hands the
request a writable view of the span each output reference names (:meth:`Region.destination`), and
the model's instance writes the output there where it can.  A copied region gets ``pwrite``.

**Descriptors are counted as held.**  A mapped region holds two descriptors (the one handed over and
``mmap``'s own duplicate), a copied one holds one: :attr:`Region.descriptors`, which the daemon's
descriptor budget adds up.
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

from edge_server.errors import ShmNameRejected, ShmNotRegistered, ShmOutOfBounds, ShmUnavailable
from edge_server.request import OutputBuffer

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")
#: The most ``preadv`` moves in one call on Linux (0x7ffff000): larger reads loop.
_MAX_IO = 0x7FFFF000


def check_name(name: object) -> str:
    """An IPC region name (a label within one client's registrations): 1-200 of ``[A-Za-z0-9._-]``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        shown = repr(name)[:60]
        raise ShmNameRejected(
            f"shared-memory name {shown} is not allowed: use 1-200 characters from [A-Za-z0-9._-]"
        )
    return name


def check_span(offset: int, byte_size: int, size: int, what: str, where: str = "") -> None:
    """Refuse bytes ``offset .. offset + byte_size`` unless they lie inside the ``size`` bytes of ``what``.

    The one bounds rule for shared memory, used by the daemon (registered regions) and by the client
    (its regions and ring slots).  ``where`` names the tensor, for the message.
    """
    if offset < 0 or byte_size < 0 or offset + byte_size > size:
        # Triton's texts first (its clients and QA match them), then which bytes and where.
        kind, _, name = what.partition(" ")
        triton = "Invalid offset + byte size"
        if offset < 0 or offset >= size:  # checked first, as Triton does
            triton = "Invalid offset"
        elif offset + byte_size >= 2**64:
            triton = f"Integer overflow detected: byte_size ({byte_size}) + offset ({offset}) exceeds maximum"
        detail = f"bytes {offset}..{offset + byte_size} lie outside {what} ({size} bytes)"
        raise ShmOutOfBounds(
            f"{triton} for shared memory {kind}: {name} ({where + ': ' if where else ''}{detail})"
        )


@dataclass(frozen=True)
class Segment:
    """A segment's open descriptor, with what the daemon learned about it when it got it.

    ``proven``: the client handed the descriptor over itself (IPC), so holding it proves it may use
    the memory; otherwise (Triton's system shared memory, opened by the daemon by key) every use is
    checked against the using peer's permission bits (:func:`edge_server.shm.registry.may_use`).
    """

    fd: int
    size: int
    sealed: bool  # F_SEAL_SHRINK: it can never become smaller, so it may be mapped
    writable: bool  # opened for writing: outputs may be written into it
    uid: int  # the peer that handed it over or registered it (for logs)
    pid: int = 0
    proven: bool = True
    key: str = ""  # Triton's segment key ("" for a handed-over descriptor)


class Region(abc.ABC):
    """One registered span (``byte_size`` bytes from ``base``) of a client's segment."""

    descriptors = 1  # held open while the region lives

    def __init__(self, name: str, byte_size: int, segment: Segment, base: int = 0) -> None:
        self.name = name
        self.byte_size = byte_size
        self.base = base
        self.segment = segment
        self.owner: object = None  # set by the registry (an Owner)
        self.holds = 0  # requests in flight that will write outputs here (the registry's lock)
        self.retired = False  # unregistered while held: listed, not usable, until the last hold goes
        # The fd lives as long as this object: in-flight requests hold the region (for their outputs)
        # after it is unregistered, so closing it earlier could let a reused number be read.
        self._close_fd = weakref.finalize(self, os.close, segment.fd)
        self._lock = threading.Lock()
        # How outputs reached this region: written by the runtime, copied by the instance, by the frontend.
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
        if not (0 <= offset and 0 <= byte_size and offset + byte_size <= self.byte_size):
            check_span(offset, byte_size, self.byte_size, f"region {self.name!r}", where)  # raises
        if output and not self.segment.writable:
            raise ShmUnavailable(
                f"{where}: region {self.name!r} was handed over read-only; outputs need O_RDWR"
            )

    @abc.abstractmethod
    def read(
        self, offset: int, byte_size: int, where: str, size: int | None = None
    ) -> memoryview | bytes | bytearray:
        """Exactly ``byte_size`` input bytes, in place (sealed segments) or copied (all others).

        ``size``: the segment's size from an ``fstat`` the caller just took (the permission check's,
        :func:`~edge_server.shm.registry.check_use`); None: look now.
        """

    @abc.abstractmethod
    def write(self, offset: int, data: np.ndarray | bytes, where: str, size: int | None = None) -> None:
        """Copy an output into the region: the one copy an output into shared memory costs.

        ``size``: as for :meth:`read`.
        """

    def release(self) -> None:  # noqa: B027 (nothing to do for most regions)
        """Drop the registry's hold; the fd closes with the last request that still uses the region."""

    def discard(self) -> None:
        """A registration refused after the region was opened: give its descriptors back now."""
        self.release()
        self._close_fd()


class MappedRegion(Region):
    """A sealed segment, mapped once: inputs are views into it, outputs are copied into it."""

    descriptors = 2  # the handed-over fd and mmap's own duplicate

    def __init__(self, name: str, byte_size: int, segment: Segment) -> None:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if segment.writable else 0)
        self.mm = mmap.mmap(segment.fd, byte_size, mmap.MAP_SHARED, prot)
        super().__init__(name, byte_size, segment)

    @property
    def zero_copy(self) -> bool:
        return True

    def read(self, offset: int, byte_size: int, where: str, size: int | None = None) -> memoryview:
        self.check(offset, byte_size, where)
        return memoryview(self.mm)[offset : offset + byte_size]

    def destination(self, offset: int, byte_size: int) -> OutputBuffer | None:
        if not self.segment.writable:
            return None
        try:
            return OutputBuffer(np.frombuffer(self.mm, dtype=np.uint8, count=byte_size, offset=offset))
        except ValueError:  # unmapped meanwhile (unregistered): the frontend's write reports it
            return None

    def write(self, offset: int, data: np.ndarray | bytes, where: str, size: int | None = None) -> None:
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
    """A segment that may shrink: never mapped; ``preadv``/``pwrite`` cannot fault, they come up short."""

    def _file_span(self, offset: int, byte_size: int, where: str, size: int | None) -> int:
        """The file offset of the span, after checking that the segment (``size`` bytes) still holds it."""
        start = self.base + offset
        if size is None:
            size = os.fstat(self.segment.fd).st_size
        if start + byte_size > size:
            key = f" (segment {self.segment.key!r})" if self.segment.key else ""
            raise ShmOutOfBounds(
                f"{where}: region {self.name!r}{key} needs bytes up to {start + byte_size} but its segment "
                f"now holds {size} (its owner shrank it)"
            )
        return start

    def read(self, offset: int, byte_size: int, where: str, size: int | None = None) -> bytes | bytearray:
        self.check(offset, byte_size, where)
        start = self._file_span(offset, byte_size, where, size)
        if byte_size <= _MAX_IO:  # every tensor under 2 GiB: one pread, straight into the bytes returned
            data = os.pread(self.segment.fd, byte_size, start)
            if len(data) != byte_size:
                self._shrank(offset, byte_size, where)
            return data
        buffer = bytearray(byte_size)
        view = memoryview(buffer)
        done = 0
        while done < byte_size:
            got = os.preadv(self.segment.fd, [view[done : done + _MAX_IO]], start + done)
            if got == 0:
                self._shrank(offset, byte_size, where)
            done += got
        return buffer

    def _shrank(self, offset: int, byte_size: int, where: str) -> None:
        """A read came up short: the owner shrank the segment after the size check."""
        size = os.fstat(self.segment.fd).st_size
        raise ShmOutOfBounds(
            f"{where}: region {self.name!r} holds only {size - self.base} bytes now (its owner "
            f"shrank it while it was read); bytes {offset}..{offset + byte_size} are gone"
        )

    def write(self, offset: int, data: np.ndarray | bytes, where: str, size: int | None = None) -> None:
        raw: Any = data if isinstance(data, bytes) else np.ascontiguousarray(data)
        nbytes = len(raw) if isinstance(raw, bytes) else raw.nbytes
        self.check(offset, nbytes, where, output=True)
        start = self._file_span(offset, nbytes, where, size)  # pwrite would grow the file: refuse instead
        written = 0
        if isinstance(raw, bytes) and nbytes <= _MAX_IO:  # the frontends' outputs: one pwrite, no view
            written = os.pwrite(self.segment.fd, raw, start)
        if written < nbytes:
            view = memoryview(raw).cast("B")
            while written < nbytes:
                written += os.pwrite(self.segment.fd, view[written : written + _MAX_IO], start + written)


def open_region(name: str, segment: Segment, byte_size: int | None, base: int = 0) -> Region:
    """A region over ``byte_size`` bytes (default: the rest) from ``base`` of a segment it now owns.

    The descriptor belongs to the region once this returns; if it raises, the caller still owns it.
    """
    if byte_size is None:
        byte_size = segment.size - base
    if byte_size <= 0 or base < 0 or base + byte_size > segment.size:
        raise ShmOutOfBounds(  # Triton's text first, then which bytes
            f"failed to register shared memory region {name!r}: invalid args (cannot register bytes "
            f"{base}..{base + byte_size} of segment {segment.key or name!r}: it has {segment.size} bytes)"
        )
    if not segment.sealed or base:
        return CopyRegion(name, byte_size, segment, base)
    try:
        return MappedRegion(name, byte_size, segment)
    except (OSError, ValueError) as exc:
        raise ShmUnavailable(f"cannot map shared-memory segment {name!r}: {exc}") from None
