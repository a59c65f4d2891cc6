"""What the daemon and an isolated Python model's process share: a private pipe and two memory arenas.

* :class:`Channel`: length-prefixed msgpack messages over one end of a ``socketpair``.  It is private
  to the daemon and its own child (no client can reach it) and carries small control messages only:
  tensor descriptors, request fields, error codes and messages.  The child never sends anything the
  daemon would have to unpickle; only the daemon's first message to its child (the instance's load
  context) is a pickle, read by the child that the daemon itself started.
* :class:`Arena`: a ``memfd`` the daemon creates per instance and direction (requests to the child,
  responses back), mapped by both processes.  The daemon seals it against shrinking
  (``F_SEAL_SHRINK``), so neither side can ever fault on the other's mapping; the writer grows it
  when a batch does not fit, and the reader follows the file's size (``fstat``), never a size it
  was told.  Tensors cross as raw bytes at 64-byte aligned offsets: one copy in, one copy out.
  String (``TYPE_STRING``) tensors travel inside the message as lists of ``bytes`` instead, and so
  do the tensors of a decoupled model's streamed responses (they are sent from the model's own
  threads at any time, also while the next batch uses the arenas).
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import socket
import struct
import threading
from collections.abc import Iterable
from typing import Any

import msgpack
import numpy as np

_HEADER = struct.Struct("<I")
#: A message longer than this means the stream is corrupt (the child writes only metadata and strings).
MAX_MESSAGE = 1 << 30
_ALIGN = 64
_INITIAL_ARENA = 1 << 16
_NUMERIC_KINDS = frozenset("biufc")


class ChannelClosed(ConnectionError):
    """The other end of the channel is gone (its process exited) or sent something unreadable."""


class Channel:
    """Length-prefixed msgpack messages over a connected stream socket (one sender at a time)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray()
        self._timeout: float | None = None  # the socket's, changed only when asked (a syscall)
        self._send_lock = threading.Lock()  # a decoupled model's threads send beside the main loop
        self._close_lock = threading.Lock()  # shutdown() (the exit watcher) never races close()

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, message: dict[str, Any]) -> None:
        payload = msgpack.packb(message, use_bin_type=True)
        try:
            with self._send_lock:
                self._sock.sendall(_HEADER.pack(len(payload)) + payload)
        except OSError as exc:  # EPIPE, ECONNRESET: the peer died
            raise ChannelClosed(f"send failed: {exc}") from exc

    def recv(self, timeout: float | None = None) -> dict[str, Any]:
        """The next message; ``TimeoutError`` after ``timeout`` seconds, ``ChannelClosed`` at EOF."""
        if timeout != self._timeout:
            self._sock.settimeout(timeout)
            self._timeout = timeout
        buffer = self._buffer
        while True:
            if len(buffer) >= _HEADER.size:
                (length,) = _HEADER.unpack_from(buffer)
                if length > MAX_MESSAGE:
                    raise ChannelClosed(f"a message claims {length} bytes; the stream is corrupt")
                end = _HEADER.size + length
                if len(buffer) >= end:
                    payload = bytes(buffer[_HEADER.size : end])
                    del buffer[:end]
                    try:
                        message = msgpack.unpackb(payload, raw=False)
                    except Exception as exc:  # any malformed payload: the stream cannot be trusted
                        raise ChannelClosed(f"an unreadable message: {exc!r}") from exc
                    if not isinstance(message, dict):
                        raise ChannelClosed(f"a message is {type(message).__name__}, not a map")
                    return message
            try:
                chunk = self._sock.recv(max(1 << 16, _HEADER.size))
            except TimeoutError:
                raise TimeoutError("no message within the timeout") from None
            except OSError as exc:
                raise ChannelClosed(f"receive failed: {exc}") from exc
            if not chunk:
                raise ChannelClosed("end of stream")
            buffer += chunk

    def shutdown(self) -> None:
        """End the stream from this side, whoever else still holds the other end.

        A blocked or later :meth:`recv` returns what was already received, then raises ChannelClosed.
        """
        with self._close_lock:
            if self._sock.fileno() >= 0:
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        with self._close_lock:
            self._sock.close()


class Arena:
    """One shared ``memfd`` mapping; see the module docstring for who grows it and who follows."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.map: mmap.mmap | None = None
        self.size = 0
        self.follow()

    @classmethod
    def create(cls, name: str, size: int = _INITIAL_ARENA) -> Arena:
        """A new arena, sealed against shrinking; its descriptor is inherited by no one unless passed."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
            return cls(fd)
        except BaseException:
            os.close(fd)
            raise

    def follow(self, size: int | None = None) -> None:
        """Map the whole file as it is now, when the other side says it grew it (``size``).

        The size is only a hint to look: the mapping always has the file's real size (``fstat``), and
        a file that never shrinks keeps a smaller old mapping valid.
        """
        if size is not None and size <= self.size:
            return
        size = os.fstat(self.fd).st_size
        if size != self.size or self.map is None:
            # The old mapping is released when the last view of it goes (mmap objects count exports).
            self.map = mmap.mmap(self.fd, size) if size else None
            self.size = size

    def ensure(self, size: int) -> None:
        """Grow the file (never shrink) so that ``size`` bytes fit, and map it."""
        if size > self.size:
            os.ftruncate(self.fd, 1 << max(size - 1, 1).bit_length())
            self.follow()

    def write(self, offset: int, array: np.ndarray) -> None:
        target: np.ndarray = np.ndarray(array.shape, array.dtype, buffer=self.map, offset=offset)
        np.copyto(target, array, casting="no")

    def view(self, dtype: np.dtype, shape: tuple[int, ...], offset: int, nbytes: int) -> np.ndarray:
        """An array over the arena (no copy); bounds and size are checked, never trusted."""
        count = math.prod(shape)
        if offset < 0 or nbytes != count * dtype.itemsize or offset + nbytes > self.size or self.map is None:
            raise ValueError(
                f"tensor {dtype} {list(shape)} at {offset}+{nbytes} does not fit an arena of {self.size}"
            )
        return np.frombuffer(self.map, dtype=dtype, count=count, offset=offset).reshape(shape)

    def close(self) -> None:
        self.map = None
        os.close(self.fd)


def layout(arrays: Iterable[np.ndarray]) -> tuple[list[int], int]:
    """Aligned offsets for the numeric arrays (strings: -1) and the bytes they need in all."""
    offsets: list[int] = []
    end = 0
    for array in arrays:
        if array.dtype.kind not in _NUMERIC_KINDS:
            offsets.append(-1)
            continue
        offsets.append(end)
        end += -(-array.nbytes // _ALIGN) * _ALIGN
    return offsets, end


def describe(name: str, array: np.ndarray, offset: int) -> list[Any]:
    """A tensor's descriptor: ``[name, dtype, shape, offset, nbytes]`` or ``[name, "S", shape, items]``."""
    if offset < 0:
        items = [x if type(x) is bytes else _as_bytes(x) for x in array.reshape(-1)]
        return [name, "S", list(array.shape), items]
    return [name, array.dtype.str, list(array.shape), offset, array.nbytes]


def _as_bytes(item: Any) -> bytes:
    if isinstance(item, str):
        return item.encode("utf-8")
    return bytes(item)


def read(desc: list[Any], arena: Arena, *, copy: bool) -> tuple[str, np.ndarray]:
    """The array a descriptor names; ``copy`` when the arena will be reused before the array dies."""
    name, dtype_str, shape = desc[0], desc[1], tuple(int(d) for d in desc[2])
    if dtype_str == "S":
        array = np.empty(len(desc[3]), dtype=object)
        array[:] = [bytes(x) for x in desc[3]]
        return str(name), array.reshape(shape)
    dtype = np.dtype(dtype_str)
    if dtype.kind not in _NUMERIC_KINDS or dtype.fields is not None:
        raise ValueError(f"tensor {name!r}: dtype {dtype_str!r} cannot cross the arena")
    array = arena.view(dtype, shape, int(desc[3]), int(desc[4]))
    if copy:
        return str(name), array.copy()
    array.flags.writeable = False  # the model reads a request's inputs; it never writes them back
    return str(name), array


def put(named: list[tuple[str, np.ndarray]], arena: Arena) -> list[list[Any]]:
    """Write the numeric arrays into ``arena`` (grown as needed) and describe them all."""
    offsets, total = layout(array for _, array in named)
    arena.ensure(total)
    descs = []
    for (name, array), offset in zip(named, offsets, strict=True):
        if offset >= 0:
            arena.write(offset, array)
        descs.append(describe(name, array, offset))
    return descs


def pack_inline(named: Iterable[tuple[str, np.ndarray]]) -> list[list[Any]]:
    """Descriptors that carry their bytes: ``[name, dtype, shape, data]`` (strings: as :func:`describe`)."""
    descs: list[list[Any]] = []
    for name, array in named:
        if array.dtype.kind not in _NUMERIC_KINDS:
            descs.append(describe(name, array, -1))
        else:
            descs.append([name, array.dtype.str, list(array.shape), np.ascontiguousarray(array).tobytes()])
    return descs


def unpack_inline(descs: list[list[Any]]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for desc in descs:
        name, dtype_str, shape = str(desc[0]), desc[1], tuple(int(d) for d in desc[2])
        if dtype_str == "S":
            out[name] = read(desc, _NO_ARENA, copy=True)[1]
            continue
        dtype = np.dtype(dtype_str)
        data = desc[3]
        if dtype.kind not in _NUMERIC_KINDS or len(data) != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {name!r}: {dtype_str} {list(shape)} does not match {len(data)} bytes")
        out[name] = np.frombuffer(data, dtype=dtype).reshape(shape).copy()
    return out


class _NoArena(Arena):
    def __init__(self) -> None:  # strings never touch an arena
        self.fd, self.map, self.size = -1, None, 0


_NO_ARENA = _NoArena()
