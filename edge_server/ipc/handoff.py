"""Handing a shared-memory segment's file descriptor to the daemon, in exchange for a one-time token.

ZeroMQ cannot carry file descriptors, so beside the IPC socket ``PATH`` the daemon listens on
``PATH.shm``, a Unix ``SOCK_SEQPACKET`` socket with the same permissions.  A client connects, sends
:data:`HELLO` with exactly one descriptor (``SCM_RIGHTS``), and gets back ``OK <token>`` (32 hex
digits) or ``ERR <message>``.  Its ``shm_register`` over the IPC socket then presents the token; the
daemon takes the descriptor that came with it.  A token works once, for a short time
(:data:`TOKEN_TTL`), only for the user that handed the descriptor over (``SO_PEERCRED`` of both
sockets), and each user has its own bounded pool of outstanding tokens (:data:`MAX_PENDING_PER_PEER`,
beside the daemon-wide :data:`MAX_PENDING`), so a client that hands over descriptors and never
registers them can neither hoard the daemon's descriptors nor lock other users out.

Holding the descriptor proves the client could open the segment itself: the daemon never opens a
segment by name (see :mod:`edge_server.shm`).  So the descriptor is judged by what it is, never by
re-opening it (a re-open would be a confused deputy): it must be a shared-memory file (tmpfs or
hugetlbfs, by ``fstatfs``), opened for reading (not ``O_PATH``, not write-only).

All connections are served at once by one thread (a selector): a peer that connects and sends
nothing costs the others nothing, and is closed after :data:`RECEIVE_TIMEOUT`.  A user may have at
most :data:`MAX_WAITING_PER_PEER` connections waiting (its next ones are closed at once), all users
together :data:`MAX_WAITING`, so silent connections cannot take the daemon's descriptors either.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import logging
import os
import secrets
import selectors
import socket
import stat
import struct
import threading
import time
from pathlib import Path

from edge_server.errors import ShmUnavailable
from edge_server.shm import Segment

log = logging.getLogger(__name__)

HELLO = b"EDGE-SHM-1"
TOKEN_TTL = 30.0
MAX_PENDING = 256
MAX_PENDING_PER_PEER = 64
RECEIVE_TIMEOUT = 1.0  # a connected peer must send its descriptor within this
MAX_WAITING = 64  # connections accepted and not heard from yet, all users together
MAX_WAITING_PER_PEER = 8  # ... and per user: a user's further connections are closed at once
_SHM_FILESYSTEMS = (0x01021994, 0x958458F6)  # TMPFS_MAGIC (memfd, /dev/shm), HUGETLBFS_MAGIC
_O_PATH = getattr(os, "O_PATH", 0o10000000)
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)


def handoff_path(ipc_socket: Path) -> Path:
    """Where the hand-off socket of the IPC socket ``ipc_socket`` lives."""
    return ipc_socket.with_name(ipc_socket.name + ".shm")


def inspect_fd(fd: int, *, uid: int, pid: int) -> Segment:
    """What the daemon needs to know about a handed-over descriptor; ShmUnavailable if unusable.

    Judged by what the descriptor is (``fstat``, ``fstatfs``, its access mode), never by re-opening it.
    """
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if flags & _O_PATH:
        raise ShmUnavailable("refused: an O_PATH descriptor gives no access to the memory; open the segment")
    mode = flags & os.O_ACCMODE
    if mode == os.O_WRONLY:
        raise ShmUnavailable("refused: a write-only descriptor; open the segment O_RDONLY or O_RDWR")
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or _filesystem(fd) not in _SHM_FILESYSTEMS:
        raise ShmUnavailable(
            "refused: the descriptor is not a shared-memory file (memfd or /dev/shm segment)"
        )
    if info.st_size <= 0:
        raise ShmUnavailable("refused: the segment is empty (size it with ftruncate first)")
    try:
        sealed = bool(fcntl.fcntl(fd, _SEALS) & _SEAL_SHRINK)
    except OSError:  # not a memfd: POSIX shm cannot be sealed
        sealed = False
    return Segment(fd=fd, size=info.st_size, sealed=sealed, writable=mode == os.O_RDWR, uid=uid, pid=pid)


_libc = ctypes.CDLL(None, use_errno=True)


def _filesystem(fd: int) -> int:
    """The ``f_type`` of the filesystem ``fd`` lives on (``fstatfs``: the first field of struct statfs)."""
    buffer = ctypes.create_string_buffer(256)
    if _libc.fstatfs(fd, buffer) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF


class FdHandoff:
    """The daemon's end: accepts descriptors on ``path`` and keeps them until their token is claimed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[float, Segment]] = {}
        self._per_uid: collections.Counter[int] = collections.Counter()
        self._sock: socket.socket | None = None
        self._stop_r, self._stop_w = os.pipe()
        self._thread: threading.Thread | None = None
        self.refused = 0

    def start(self, mode: int) -> None:
        if self.path.exists() or self.path.is_symlink():
            if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                raise ShmUnavailable(f"{self.path} exists and is not a socket; refusing to replace it")
            self.path.unlink()  # the IPC socket beside it was just bound by us: this one is stale
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.bind(str(self.path))
        os.chmod(self.path, mode)
        sock.listen(64)
        sock.setblocking(False)
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name="edge-shm-handoff", daemon=True)
        self._thread.start()

    def pending(self) -> int:
        """Descriptors handed over and not claimed yet (each one open in the daemon)."""
        with self._lock:
            return len(self._pending)

    def claim(self, token: object, *, uid: int) -> Segment:
        """The segment handed over with ``token`` by user ``uid``; it works once."""
        with self._lock:
            entry = self._pending.pop(token, None) if isinstance(token, str) else None
            if entry is not None:
                self._forget(entry[1].uid)
        if entry is None or entry[0] < time.monotonic():
            if entry is not None:
                os.close(entry[1].fd)
            raise ShmUnavailable(
                "unknown or expired shared-memory token: hand the segment's descriptor over first "
                f"(to {self.path}); a token works once, within {TOKEN_TTL:.0f} s"
            )
        if entry[1].uid != uid:
            os.close(entry[1].fd)
            raise ShmUnavailable(
                "the shared-memory token was handed over by another user; it works only for them"
            )
        return entry[1]

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        if self._thread is not None:
            self._thread.join()
        if self._sock is not None:
            self._sock.close()
            self.path.unlink(missing_ok=True)
        os.close(self._stop_r)
        os.close(self._stop_w)
        with self._lock:
            for _, segment in self._pending.values():
                os.close(segment.fd)
            self._pending.clear()
            self._per_uid.clear()

    def _forget(self, uid: int) -> None:
        self._per_uid[uid] -= 1
        if self._per_uid[uid] <= 0:
            del self._per_uid[uid]

    def _run(self) -> None:
        assert self._sock is not None
        waiting = _Waiting()
        with selectors.DefaultSelector() as selector:
            selector.register(self._sock, selectors.EVENT_READ)
            selector.register(self._stop_r, selectors.EVENT_READ)
            try:
                while True:
                    oldest = waiting.next_deadline()
                    wait = 5.0 if oldest is None else max(0.0, min(oldest - time.monotonic(), 5.0))
                    events = selector.select(wait)
                    self._expire()
                    for key, _ in events:
                        if key.fileobj == self._stop_r:
                            return
                        if key.fileobj is self._sock:
                            self._accept(selector, waiting)
                        else:
                            conn = key.fileobj
                            assert isinstance(conn, socket.socket)
                            selector.unregister(conn)
                            waiting.remove(conn)
                            with conn:
                                try:
                                    self._serve(conn)
                                except Exception:  # one bad peer must never stop the hand-off
                                    log.exception("shared-memory hand-off failed")
                    for conn in waiting.overdue(time.monotonic()):  # said nothing in time
                        selector.unregister(conn)
                        conn.close()
            finally:
                for conn in waiting.all():
                    conn.close()

    def _accept(self, selector: selectors.BaseSelector, waiting: _Waiting) -> None:
        assert self._sock is not None
        for _ in range(64):  # a burst at a time; the selector says when more wait
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # EMFILE and friends: refuse this one, live on
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    time.sleep(0.05)
                return
            try:
                _pid, uid, _gid = _CREDS.unpack(
                    conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
                )
            except OSError:
                conn.close()
                continue
            if waiting.count(uid) >= MAX_WAITING_PER_PEER or len(waiting) >= MAX_WAITING:
                # This user's own silent connections are what fill its share; say so, and close.
                conn.setblocking(False)
                try:  # take what it sent already (a close with unread data would reset the reply away)
                    _message, fds, _flags, _addr = socket.recv_fds(conn, 64, 4)
                    for fd in fds:
                        os.close(fd)
                except OSError:
                    pass
                _reply(conn, b"ERR too many connections to the hand-off socket wait silently; retry later")
                conn.close()
                self.refused += 1
                continue
            conn.setblocking(False)
            waiting.add(conn, uid, time.monotonic() + RECEIVE_TIMEOUT)
            selector.register(conn, selectors.EVENT_READ)

    def _serve(self, conn: socket.socket) -> None:
        pid, uid, _gid = _CREDS.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size))
        try:
            message, fds, _flags, _addr = socket.recv_fds(conn, 64, 4)
        except OSError:
            return
        try:
            if message != HELLO or len(fds) != 1:
                raise ShmUnavailable(f"expected {HELLO!r} with one descriptor")
            with self._lock:
                mine, everyone = self._per_uid[uid], len(self._pending)
            if mine >= MAX_PENDING_PER_PEER:
                raise ShmUnavailable(
                    f"this user has {mine} descriptors handed over and not registered yet, the most one user "
                    "may; register or let them expire first"
                )
            if everyone >= MAX_PENDING:
                raise ShmUnavailable("too many descriptors handed over and not registered yet; retry later")
            segment = inspect_fd(fds[0], uid=uid, pid=pid)
        except (ShmUnavailable, OSError) as exc:
            for fd in fds:
                os.close(fd)
            self.refused += 1
            text = exc.message if isinstance(exc, ShmUnavailable) else str(exc)
            _reply(conn, b"ERR " + text.encode()[:512])
            return
        token = secrets.token_hex(16)
        with self._lock:
            self._pending[token] = (time.monotonic() + TOKEN_TTL, segment)
            self._per_uid[uid] += 1
        log.debug(
            "segment handed over by pid %d uid %d (%d bytes, sealed=%s)",
            pid,
            uid,
            segment.size,
            segment.sealed,
        )
        _reply(conn, b"OK " + token.encode())

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [token for token, (deadline, _) in self._pending.items() if deadline < now]
            segments = [self._pending.pop(token)[1] for token in stale]
            for segment in segments:
                self._forget(segment.uid)
        for segment in segments:
            os.close(segment.fd)


class _Waiting:
    """Connections accepted and not heard from yet, oldest first, counted per user."""

    def __init__(self) -> None:
        self._conns: collections.OrderedDict[socket.socket, tuple[float, int]] = collections.OrderedDict()
        self._per_uid: collections.Counter[int] = collections.Counter()

    def __len__(self) -> int:
        return len(self._conns)

    def count(self, uid: int) -> int:
        return self._per_uid[uid]

    def add(self, conn: socket.socket, uid: int, deadline: float) -> None:
        self._conns[conn] = (deadline, uid)
        self._per_uid[uid] += 1

    def remove(self, conn: socket.socket) -> None:
        entry = self._conns.pop(conn, None)
        if entry is not None:
            self._per_uid[entry[1]] -= 1

    def next_deadline(self) -> float | None:
        return next(iter(self._conns.values()))[0] if self._conns else None

    def overdue(self, now: float) -> list[socket.socket]:
        late = []
        while self._conns and next(iter(self._conns.values()))[0] < now:
            conn = next(iter(self._conns))
            self.remove(conn)
            late.append(conn)
        return late

    def all(self) -> list[socket.socket]:
        return list(self._conns)


def _reply(conn: socket.socket, message: bytes) -> None:
    try:
        conn.send(message)  # one small datagram into an empty buffer: it does not block
    except OSError:
        pass  # the peer went away; a token it never read expires


def hand_over(path: Path, fd: int, timeout: float = 5.0) -> str:
    """Client side: give the daemon ``fd`` through the hand-off socket at ``path``; returns the token."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
            try:
                socket.send_fds(sock, [HELLO], [fd])
            except (BrokenPipeError, ConnectionResetError):
                pass  # a refused connection: the daemon wrote why before it closed; read it below
            reply = sock.recv(1024)
        except OSError as exc:
            raise ShmUnavailable(f"cannot hand the segment to the daemon at {path}: {exc}") from None
        if not reply:
            raise ShmUnavailable(f"cannot hand the segment to the daemon at {path}: it closed the connection")
    if reply.startswith(b"OK "):
        return reply[3:].decode()
    raise ShmUnavailable(f"the daemon refused the segment: {reply[4:].decode(errors='replace')}")
