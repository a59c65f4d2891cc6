"""Client-owned shared memory: regions to pass tensors by reference, and a ring for camera loops.

By default a region is a ``memfd`` sealed against shrinking (``F_SEAL_SHRINK``): nothing else can
open it, it never appears in ``/dev/shm``, it vanishes when the last descriptor and mapping go (a
crashed client leaks nothing), and because it can never shrink the daemon maps it and reads inputs in
place (zero-copy).  The client hands the daemon its descriptor when registering it (see
:mod:`edge_server.ipc.handoff`).  ``SharedMemoryRegion(..., posix=True)`` makes a named ``/dev/shm``
segment instead (mode 0600), and :meth:`SharedMemoryRegion.attach` opens one another program made;
the daemon reads such segments by copy, since their owner could shrink them.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import mmap
import os
import secrets
import weakref
from typing import Any

import numpy as np

from edge_server.client._wire import ShmRef, ShmTensor
from edge_server.errors import InvalidArgument, ShmUnavailable
from edge_server.ipc import protocol
from edge_server.shm import SHM_DIR, check_name
from edge_server.shm import region as shm_region

_ALIGN = 64  # slot alignment: cache lines, and any dtype's alignment
_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0x0002) | getattr(fcntl, "F_SEAL_SEAL", 0x0001)
_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)


def _cleanup(path: str | None, fd: int, mm: mmap.mmap) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    try:
        mm.close()
    except BufferError:
        pass  # arrays still view it; the mapping goes with the last of them
    os.close(fd)


class SharedMemoryRegion:
    """Shared memory this process owns; register it with a client to use it in requests.

    ``name`` labels the region in requests (default: a unique one).  ``posix=True``: a named
    ``/dev/shm/<name>`` segment (mode 0600) instead of a sealed memfd.
    """

    def __init__(
        self,
        byte_size: int,
        *,
        name: str | None = None,
        prefix: str = protocol.DEFAULT_SHM_PREFIX,
        posix: bool = False,
        _fd: int | None = None,
    ) -> None:
        if byte_size <= 0:
            raise InvalidArgument(f"a shared-memory region needs a positive size, got {byte_size}")
        name = name or f"{prefix}{os.getpid()}-{secrets.token_hex(6)}"
        check_name(name)
        path = os.path.join(SHM_DIR, name) if posix else None
        writable = True
        if _fd is not None:  # attach(): a segment someone else made
            fd, path = _fd, None
            writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
        elif path is not None:
            fd = _create_posix(path, byte_size)
        else:
            fd = _create_memfd(name, byte_size)
        try:
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(fd, byte_size, mmap.MAP_SHARED, prot)
        except OSError as exc:
            if path is not None:
                os.unlink(path)
            os.close(fd)
            raise ShmUnavailable(f"cannot map shared memory {name!r}: {exc.strerror}") from None
        self.name = name
        self.byte_size = byte_size
        self.fd = fd
        self.mm = mm
        self._finalizer = weakref.finalize(self, _cleanup, path, fd, mm)

    @classmethod
    def attach(
        cls, segment: str, byte_size: int | None = None, *, writable: bool = True
    ) -> SharedMemoryRegion:
        """A region over an existing ``/dev/shm/<segment>``, opened with this process's own rights.

        The segment stays its creator's (closing the region does not unlink it); the daemon reads it by
        copy, since its owner could shrink it.
        """
        check_name(segment)
        path = os.path.join(SHM_DIR, segment)
        try:
            fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ShmUnavailable(f"cannot open shared-memory segment {path}: {exc.strerror}") from None
        size = os.fstat(fd).st_size
        return cls(byte_size or size, name=segment, _fd=fd)

    def __repr__(self) -> str:
        return f"SharedMemoryRegion({self.name!r}, {self.byte_size} bytes)"

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def _check(self, offset: int, byte_size: int) -> None:
        if self.closed:
            raise ShmUnavailable(f"region {self.name!r} is closed")
        shm_region.check_span(offset, byte_size, self.byte_size, f"region {self.name!r}")

    def array(self, dtype: Any, shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
        """A writable array over the region: fill it in place (a camera frame) and pass :meth:`tensor`."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        self._check(offset, dtype.itemsize * count)
        return np.frombuffer(self.mm, dtype=dtype, count=count, offset=offset).reshape(shape)

    def tensor(
        self, dtype: Any, shape: tuple[int, ...], offset: int = 0, *, byte_size: int | None = None
    ) -> ShmTensor:
        """A reference to a tensor already written at ``offset`` (BYTES tensors: give ``byte_size``)."""
        if isinstance(dtype, str) and dtype in protocol.WIRE_DTYPES:
            datatype = dtype
        else:
            datatype = protocol.wire_datatype(np.empty(0, dtype=dtype))
        if byte_size is None:
            byte_size = protocol.expected_nbytes(protocol.WIRE_DTYPES[datatype], shape)
        self._check(offset, byte_size)
        return ShmTensor(self.name, offset, byte_size, datatype, tuple(int(d) for d in shape))

    def write(self, array: np.ndarray, offset: int = 0) -> ShmTensor:
        """Copy ``array`` into the region at ``offset`` and return the reference to send."""
        array = np.asarray(array)
        datatype, shape, data = protocol.to_buffer(array)
        raw = data if isinstance(data, bytes) else data.reshape(-1).view(np.uint8)
        size = len(raw)
        self._check(offset, size)
        np.frombuffer(self.mm, dtype=np.uint8, count=size, offset=offset)[:] = np.frombuffer(raw, np.uint8)
        return ShmTensor(self.name, offset, size, datatype, tuple(shape))

    def output(self, offset: int = 0, byte_size: int | None = None) -> ShmRef:
        """Ask for an output to be written here; the reply's array is a view at this place."""
        if byte_size is None:
            byte_size = self.byte_size - offset
        self._check(offset, byte_size)
        return ShmRef(self.name, offset, byte_size)

    def view_as(
        self, datatype: str, dtype: np.dtype, shape: tuple[int, ...], offset: int, byte_size: int, where: str
    ) -> np.ndarray:
        """The array an output reply describes (a view; BYTES are decoded)."""
        self._check(offset, byte_size)
        return protocol.to_array(
            memoryview(self.mm)[offset : offset + byte_size], datatype, dtype, shape, where
        )

    def close(self) -> None:
        """Unlink and unmap.  Unregister it from the daemon first (``client.release_shm`` does both)."""
        self._finalizer()


class ShmSlot:
    """One slot of a :class:`ShmRing`: a window of its region, busy while its last request runs."""

    def __init__(self, region: SharedMemoryRegion, offset: int, byte_size: int) -> None:
        self.region = region
        self.offset = offset
        self.byte_size = byte_size
        self.future: Any = None

    def _at(self, offset: int, size: int) -> int:
        shm_region.check_span(
            offset, size, self.byte_size, f"the slot at {self.offset} of {self.region.name!r}"
        )
        return self.offset + offset

    def array(self, dtype: Any, shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
        size = np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64))
        return self.region.array(dtype, shape, self._at(offset, size))

    def tensor(self, dtype: Any, shape: tuple[int, ...], offset: int = 0) -> ShmTensor:
        ref = self.region.tensor(dtype, shape, self.offset + offset)
        self._at(offset, ref.byte_size)
        return ref

    def write(self, array: np.ndarray, offset: int = 0) -> ShmTensor:
        self._at(offset, np.asarray(array).nbytes)
        return self.region.write(array, self.offset + offset)

    def output(self, offset: int = 0, byte_size: int | None = None) -> ShmRef:
        if byte_size is None:
            byte_size = self.byte_size - offset
        return self.region.output(self._at(offset, byte_size), byte_size)

    def hold(self, future: Any) -> Any:
        """Mark the slot busy until ``future`` (the request using it) is done; returns the future."""
        self.future = future
        return future


class ShmRing:
    """``n`` equal slots in one registered region, handed out round robin.

    A camera loop writes frame *i* into slot *i mod n* while earlier frames are still being served;
    :meth:`next` waits until the slot's previous request has finished, so a frame is never overwritten
    while the daemon reads it.  Create it with ``client.create_shm_ring(n, byte_size)``.
    """

    def __init__(self, region: SharedMemoryRegion, n: int, slot_size: int, *, releaser: Any = None) -> None:
        self.region = region
        self.slot_size = slot_size
        self.slots = [ShmSlot(region, i * stride(slot_size), slot_size) for i in range(n)]
        self._next = 0
        self._releaser = releaser

    def __len__(self) -> int:
        return len(self.slots)

    def _advance(self) -> None:
        self._next = (self._next + 1) % len(self.slots)

    def next(self, timeout: float | None = None) -> ShmSlot:
        """The next slot, once its previous request (a concurrent.futures.Future) is done."""
        slot = self.slots[self._next]
        if slot.future is not None:
            done, _ = concurrent.futures.wait([slot.future], timeout=timeout)
            if not done:
                raise TimeoutError(f"slot {self._next} is still busy after {timeout} s")
            slot.future = None
        self._advance()
        return slot

    async def next_async(self) -> ShmSlot:
        """The next slot, once its previous request (an asyncio future or task) is done."""
        import asyncio

        slot = self.slots[self._next]
        if slot.future is not None:
            await asyncio.wait([slot.future])
            slot.future = None
        self._advance()
        return slot

    def close(self) -> None:
        """Unregister and unlink the ring's region (through the client that made it)."""
        if self._releaser is not None:
            self._releaser(self.region)
        else:
            self.region.close()


def _create_memfd(name: str, byte_size: int) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, byte_size)
        fcntl.fcntl(fd, _ADD_SEALS, _SEALS)  # it can never shrink: the daemon may map it safely
    except OSError as exc:
        os.close(fd)
        raise ShmUnavailable(f"cannot create a sealed memfd of {byte_size} bytes: {exc.strerror}") from None
    return fd


def _create_posix(path: str, byte_size: int) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ShmUnavailable(f"cannot create shared-memory segment {path}: {exc.strerror}") from None
    try:
        os.ftruncate(fd, byte_size)
    except OSError as exc:
        os.unlink(path)
        os.close(fd)
        raise ShmUnavailable(f"cannot size {path}: {exc.strerror}") from None
    return fd


def stride(slot_size: int) -> int:
    return (slot_size + _ALIGN - 1) // _ALIGN * _ALIGN
