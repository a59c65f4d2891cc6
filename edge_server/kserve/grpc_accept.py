"""The gRPC port accepted by the daemon itself, so that every rule of the budget holds at accept.

grpcio accepts on its own threads and caps only its total (``grpc.max_allowed_incoming_connections``),
so one local user holding that total with idle connections refused every other client's new
connection until the per-user cap's next look (:mod:`edge_server.kserve.grpc_connections`) shut the
surplus down.  grpc core has a way in for connections accepted elsewhere: a port named
``external:NAME`` makes grpc write a handler (C++ ``TcpServerFdHandler``) into the pointer channel
argument ``NAME``, and the handler's ``Handle(listener_fd, fd, pending_read)`` takes an accepted
descriptor as if grpc had accepted it (handshake and idle timeouts, HTTP/2, calls).  grpcio passes any
object with ``__int__`` as a pointer argument.  So :class:`GrpcAcceptor` listens on the gRPC port,
learns each connection's uid from the kernel, asks the daemon's one budget
(:meth:`~edge_server.limits.Limits.connect`: total, per uid, penalties) and either closes the
connection or hands it to grpc; a connection grpc has closed since is found gone from the kernel's
socket table (sock_diag) and leaves the budget.  That look walks the kernel's whole table (2.5 ms of
CPU per address family on the 2-core VM, however few connections it keeps), so it is taken when the
host's TCP counters moved (:func:`~edge_server.kserve.sock_diag.tcp_activity`), at least every
:data:`RECHECK_S`, and before a connection is refused; taken every :data:`RECONCILE_S` while any
client stayed connected, it cost an idle daemon 1.2% of a core with 100 connections open.

The descriptor must be non-blocking, as grpc's own accept makes it: a blocking one stalls grpc's
event engine (measured: the handshake completes and no call is ever answered).  And the handler must be
what we call: its C++ type, read from its vtable's type information, is grpc's
``ExternalConnectionHandler``, and ``Handle`` is the slot after the two destructors (Itanium ABI).
The frontend also asks for one call through a handed connection at start; where any of this fails it
falls back to grpc's own port and the per-user cap by looking.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import socket
import threading
import time
from typing import Any

from edge_server.kserve import sock_diag
from edge_server.kserve.shm import Peer, peer_uid
from edge_server.limits import Connection, Limits

log = logging.getLogger(__name__)

HANDLER_TYPE = b"N12_GLOBAL__N_125ExternalConnectionHandlerE"
PORT_NAME = "external:edge-server-accept"
BACKLOG = 1024
RECONCILE_S = 0.5
RECHECK_S = 10.0
_HANDLE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
_POINTER = ctypes.sizeof(ctypes.c_void_p)


class _Pointer:
    """A pointer channel argument for grpcio: any object whose ``__int__`` is the address."""

    def __init__(self, address: int) -> None:
        self._address = address

    def __int__(self) -> int:
        return self._address


class ExternalPort:
    """grpc's handler for the connections the daemon accepted.

    :attr:`option` goes to the server when it is built, :meth:`bind` after
    ``add_insecure_port(PORT_NAME)``, then :meth:`hand` until the server stops.
    """

    def __init__(self) -> None:
        self._slot = ctypes.c_void_p(0)
        self.option = (PORT_NAME, _Pointer(ctypes.addressof(self._slot)))
        self._handler = 0
        self._handle: Any = None

    def bind(self) -> bool:
        """Find the handler grpc wrote and check its type; False when it is not grpc's own."""
        handler = self._slot.value
        if not handler:
            return False
        vtable = ctypes.c_void_p.from_address(handler).value
        if not vtable:
            return False
        type_info = ctypes.c_void_p.from_address(vtable - _POINTER).value
        if not type_info:
            return False
        name = ctypes.c_char_p.from_address(type_info + _POINTER).value or b""
        if name.lstrip(b"*") != HANDLER_TYPE:
            log.warning("gRPC: grpc's connection handler is a %r, not %r", name, HANDLER_TYPE)
            return False
        function = ctypes.c_void_p.from_address(vtable + 2 * _POINTER).value
        if not function:
            return False
        self._handler, self._handle = handler, _HANDLE(function)
        return True

    def hand(self, listener_fd: int, fd: int) -> None:
        """Give ``fd`` to grpc, which owns (and closes) it from here on."""
        assert self._handle is not None
        self._handle(self._handler, listener_fd, fd, None)


class GrpcAcceptor:
    """Accepts the gRPC port's connections, counts them in the budget, hands the admitted to grpc."""

    def __init__(self, host: str, port: int, limits: Limits, external: ExternalPort) -> None:
        self.limits, self.external = limits, external
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(BACKLOG)
            self._sock.setblocking(False)  # a connection reset between select and accept: no wait
        except OSError:
            self._sock.close()
            raise
        self.host, self.port = host, self._sock.getsockname()[1]
        self._held: dict[int, Connection] = {}  # the daemon's socket inode: its count in the budget
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="edge-grpc-accept", daemon=True)
        self.refused = 0

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop accepting; returns once nothing more will be handed to grpc (call before grpc stops)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._sock.close()
        held, self._held = self._held, {}
        for counted in held.values():  # grpc closes them as it stops; they count no more
            self.limits.disconnect(counted)

    def _run(self) -> None:
        due = recheck = time.monotonic() + RECONCILE_S
        seen: tuple[int, ...] = ()
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._sock], [], [], RECONCILE_S)
                if ready and not self._stop.is_set():
                    self._accept()
                now = time.monotonic()
                if now >= due:
                    counters = sock_diag.tcp_activity()  # read first: a close during the look moves them
                    if counters != seen or now >= recheck:
                        self._reconcile()
                        recheck = now + RECHECK_S
                    seen, due = counters, now + RECONCILE_S
            except Exception:  # noqa: BLE001 - the acceptor never dies: log and go on
                log.exception("gRPC acceptor")
                time.sleep(0.05)

    def _accept(self) -> None:
        try:
            conn, address = self._sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as exc:  # EMFILE and the like: the connection waits in the backlog
            log.warning("gRPC: accept failed: %s", exc)
            time.sleep(0.05)
            return
        uid = peer_uid(Peer(address[0], address[1], self.port, conn.getsockname()[0]))
        counted = self.limits.connect(uid)
        if counted.refusal is not None and self._reconcile():  # closed ones may still be counted
            self.limits.disconnect(counted)
            counted = self.limits.connect(uid)
        if counted.refusal is not None:
            self.refused += 1
            if self.refused & (self.refused - 1) == 0:  # 1, 2, 4, 8...: as the IPC frontend logs them
                log.warning("gRPC: connection refused (%d so far): %s", self.refused, counted.refusal)
            conn.close()
            self.limits.disconnect(counted)
            return
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setblocking(False)
            inode = os.fstat(conn.fileno()).st_ino
        except OSError:  # reset meanwhile: it leaves the budget as it came
            conn.close()
            self.limits.disconnect(counted)
            return
        self._held[inode] = counted
        self.external.hand(self._sock.fileno(), conn.detach())

    def _reconcile(self) -> bool:
        """Give back the budget of connections grpc has closed; whether there were any."""
        if not self._held:
            return False
        try:  # its connections are of its own family (an IPv6 listener's IPv4 clients: mapped)
            found = sock_diag.sockets(self._sock.family, bytecode=sock_diag.local_port_filter(self.port))
            alive = {sock.inode for sock in found if sock.local_port == self.port and sock.inode}
        except OSError:
            return False
        gone = [inode for inode in self._held if inode not in alive]
        for inode in gone:
            self.limits.disconnect(self._held.pop(inode))
        return bool(gone)
