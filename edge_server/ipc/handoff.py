"""Handing a shared-memory segment's file descriptor to the daemon, in exchange for a one-time token.

ZeroMQ cannot carry file descriptors, so beside the IPC socket ``PATH`` the daemon listens on
``PATH.shm``, a Unix ``SOCK_SEQPACKET`` socket with the same permissions.  A client connects, sends
:data:`HELLO` with exactly one descriptor (``SCM_RIGHTS``), and gets back ``OK <token>`` (32 hex
digits) or ``ERR <message>``.  Its ``shm_register`` over the IPC socket then presents the token; the
daemon takes the descriptor that came with it.  A token works once, for a short time
(:data:`TOKEN_TTL`), and only a bounded number are outstanding (:data:`MAX_PENDING`), so a client that
hands over descriptors and never registers them cannot hoard the daemon's descriptors.

Holding the descriptor proves the client could open the segment itself: the daemon never opens a
segment by name (see :mod:`edge_server.ipc.shm`).  The peer's credentials (``SO_PEERCRED``) are kept
with the segment for the logs.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import select
import socket
import stat
import struct
import threading
import time
from pathlib import Path
from typing import Any

from edge_server.errors import ShmUnavailable
from edge_server.ipc.shm import Segment

log = logging.getLogger(__name__)

HELLO = b"EDGE-SHM-1"
TOKEN_TTL = 30.0
MAX_PENDING = 256
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)


def handoff_path(ipc_socket: Path) -> Path:
    """Where the hand-off socket of the IPC socket ``ipc_socket`` lives."""
    return ipc_socket.with_name(ipc_socket.name + ".shm")


def inspect_fd(fd: int, *, uid: int, pid: int) -> Segment:
    """What the daemon needs to know about a handed-over descriptor; ShmUnavailable if unusable."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise ShmUnavailable("the descriptor is not a shared-memory file (memfd or /dev/shm segment)")
    if info.st_size <= 0:
        raise ShmUnavailable("the segment is empty (size it with ftruncate first)")
    try:
        sealed = bool(fcntl.fcntl(fd, _SEALS) & _SEAL_SHRINK)
    except OSError:  # not a memfd: POSIX shm cannot be sealed
        sealed = False
    writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
    return Segment(fd=fd, size=info.st_size, sealed=sealed, writable=writable, uid=uid, pid=pid)


class FdHandoff:
    """The daemon's end: accepts descriptors on ``path`` and keeps them until their token is claimed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[float, Segment]] = {}
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
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name="edge-shm-handoff", daemon=True)
        self._thread.start()

    def claim(self, token: object) -> Segment:
        """The segment handed over with ``token``; it works once."""
        with self._lock:
            entry = self._pending.pop(token, None) if isinstance(token, str) else None
        if entry is None or entry[0] < time.monotonic():
            if entry is not None:
                os.close(entry[1].fd)
            raise ShmUnavailable(
                "unknown or expired shared-memory token: hand the segment's descriptor over first "
                f"(to {self.path}); a token works once, within {TOKEN_TTL:.0f} s"
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

    def _run(self) -> None:
        assert self._sock is not None
        while True:
            watched: list[Any] = [self._sock, self._stop_r]
            ready, _, _ = select.select(watched, [], [], 5.0)
            self._expire()
            if self._stop_r in ready:
                return
            if self._sock in ready:
                try:
                    conn, _ = self._sock.accept()
                except OSError as exc:  # EMFILE and friends: refuse this one, live on
                    if exc.errno in (errno.EMFILE, errno.ENFILE):
                        time.sleep(0.05)
                    continue
                with conn:
                    try:
                        self._serve(conn)
                    except Exception:  # one bad peer must never stop the hand-off
                        log.exception("shared-memory hand-off failed")

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(1.0)
        pid, uid, _gid = _CREDS.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size))
        try:
            message, fds, _flags, _addr = socket.recv_fds(conn, 64, 4)
        except (OSError, TimeoutError):
            return
        try:
            if message != HELLO or len(fds) != 1:
                raise ShmUnavailable(f"expected {HELLO!r} with one descriptor")
            with self._lock:
                full = len(self._pending) >= MAX_PENDING
            if full:
                raise ShmUnavailable("too many descriptors handed over and not registered yet; retry later")
            segment = inspect_fd(fds[0], uid=uid, pid=pid)
        except (ShmUnavailable, OSError) as exc:
            for fd in fds:
                os.close(fd)
            self.refused += 1
            text = exc.message if isinstance(exc, ShmUnavailable) else str(exc)
            conn.send(b"ERR " + text.encode()[:512])
            return
        token = secrets.token_hex(16)
        with self._lock:
            self._pending[token] = (time.monotonic() + TOKEN_TTL, segment)
        log.debug(
            "segment handed over by pid %d uid %d (%d bytes, sealed=%s)",
            pid,
            uid,
            segment.size,
            segment.sealed,
        )
        conn.send(b"OK " + token.encode())

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [token for token, (deadline, _) in self._pending.items() if deadline < now]
            segments = [self._pending.pop(token)[1] for token in stale]
        for segment in segments:
            os.close(segment.fd)


def hand_over(path: Path, fd: int, timeout: float = 5.0) -> str:
    """Client side: give the daemon ``fd`` through the hand-off socket at ``path``; returns the token."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
            socket.send_fds(sock, [HELLO], [fd])
            reply = sock.recv(1024)
        except OSError as exc:
            raise ShmUnavailable(f"cannot hand the segment to the daemon at {path}: {exc}") from None
    if reply.startswith(b"OK "):
        return reply[3:].decode()
    raise ShmUnavailable(f"the daemon refused the segment: {reply[4:].decode(errors='replace')}")
