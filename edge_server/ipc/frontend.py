"""The daemon's IPC frontend: one ROUTER socket, one thread that owns it, and its loop.

ZeroMQ sockets are not thread-safe, so a single frontend thread receives, sends every reply and
notices connections come and go; it polls the socket, libzmq's monitor of it and an eventfd that
other threads signal when they queued a reply.  The jobs of a loop turn live beside this module:
:mod:`~edge_server.ipc.admission` counts each connection in the daemon's budget,
:mod:`~edge_server.ipc.requests` checks and dispatches each message, :mod:`~edge_server.ipc.replies`
sends the replies with a bound per client, and :mod:`~edge_server.ipc.peers` remembers each client.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from edge_server.authorization import ControlPolicy
from edge_server.ipc import addresses, protocol, zmqio
from edge_server.ipc.admission import ConnectionGate
from edge_server.ipc.handoff import FdHandoff, handoff_path
from edge_server.ipc.peers import PeerTable
from edge_server.ipc.replies import Replies
from edge_server.ipc.requests import RequestHandler
from edge_server.ipc.wakeup import signal_eventfd
from edge_server.limits import LimitOptions, Limits

if TYPE_CHECKING:
    from edge_server.server import Server

log = logging.getLogger(__name__)

_HWM = 10_000
#: Connections the kernel queues for accept: all of them may arrive after the cap is reached.
_BACKLOG = 64
# Plain ints: pyzmq's enum flags cost a microsecond per operation on the hot path.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = zmqio.NOBLOCK
_PING = protocol.pack({"v": protocol.PROTOCOL_VERSION, "id": None, "op": protocol.PING})


class IpcFrontend:
    """Serves ``server`` on ``address`` (``ipc://PATH`` or ``tcp://127.0.0.1:PORT``).

    ``max_message_bytes`` bounds a whole request; larger ones get MESSAGE_TOO_LARGE.  ZeroMQ itself
    drops the connection of a peer that sends a single frame over twice that (ZMQ_MAXMSGSIZE), so a
    hostile client cannot make the daemon allocate without bound; the ``live`` reply tells clients the
    limit, so that ours refuse such requests before sending them.  ``shm_prefix`` is the only name
    prefix clients may register shared memory under.  ``max_reply_bytes``: a user with more bytes of
    replies waiting for it than this (it sends requests and does not read) has its connection holding
    the most disconnected (``limits``' bound when ``limits`` is given: it counts every frontend).
    """

    def __init__(
        self,
        server: Server,
        address: str | None = None,
        *,
        max_message_bytes: int = protocol.DEFAULT_MAX_MESSAGE_BYTES,
        max_header_bytes: int = protocol.DEFAULT_MAX_HEADER_BYTES,
        probe_interval: float = 10.0,
        max_connections: int | None = None,
        control_policy: ControlPolicy | None = None,
        drain_timeout: float = 5.0,
        max_reply_bytes: int = protocol.DEFAULT_MAX_CLIENT_REPLY_BYTES,
        max_client_requests: int = protocol.DEFAULT_MAX_CLIENT_REQUESTS,
        max_requests: int = protocol.DEFAULT_MAX_REQUESTS,
        max_client_regions: int = protocol.DEFAULT_MAX_CLIENT_REGIONS,
        max_frames: int = protocol.MAX_FRAMES,
        limits: Limits | None = None,
    ) -> None:
        self.server = server
        self.address = address or addresses.default_address()
        self.max_message_bytes = max_message_bytes
        self.drain_timeout = drain_timeout
        self._handoff: FdHandoff | None = None
        self._wake_fd = -1
        self._wake_lock = threading.Lock()
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        # The daemon's one descriptor budget, shared with its other listeners; alone: one of its own.
        self._limits = limits or Limits(
            LimitOptions(max_connections=max_connections or 0, max_client_reply_bytes=max_reply_bytes)
        )
        self._peers = PeerTable(
            probe_interval=probe_interval,
            replies=self._limits.replies,
            on_over=self._over_reply_budget,
            max_client_regions=max_client_regions,
        )
        self.max_connections = self._limits.max_connections
        self.max_regions = self._limits.regions
        self._gate = ConnectionGate(self._limits, self.address)
        self._replies = Replies(self._peers, self._limits, wake=self._wake)
        self._requests = RequestHandler(
            server,
            self._peers,
            self._replies,
            status=self.status,
            control_policy=control_policy or ControlPolicy(),
            max_message_bytes=max_message_bytes,
            max_header_bytes=max_header_bytes,
            max_frames=max_frames,
            max_client_requests=max_client_requests,
            max_requests=max_requests,
            limits=self._limits,
        )
        self.max_frames = max_frames
        self._socket_file: tuple[int, int] | None = None
        self._stop_deadline = 0.0
        self.turns = 0  # loop turns of the frontend thread: its progress counter for the watchdog

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Bind and start serving; returns once the socket accepts connections."""
        if self._thread is not None:
            raise RuntimeError("IpcFrontend.start() called twice")
        addresses.prepare_bind(self.address)
        ctx = zmq.Context(io_threads=1)
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, _HWM)
        sock.setsockopt(zmq.RCVHWM, _HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_message_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.BACKLOG, _BACKLOG)
        try:
            sock.bind(self.address)
            if self.address.startswith("tcp://"):  # a wildcard port (tcp://127.0.0.1:*) resolves here
                self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            addresses.secure_socket(self.address)
            self._socket_file = addresses.socket_identity(self.address)
            path = addresses.ipc_path(self.address)
            if path is not None:  # shared memory needs descriptor passing: ipc:// only
                self._handoff = FdHandoff(handoff_path(path))
                self._handoff.start(addresses.SOCKET_MODE)
                self._requests.handoff = self._handoff
        except Exception:
            sock.close(0)
            ctx.term()
            raise
        self._ctx, self._sock = ctx, sock
        self._monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._peers.shm.max_descriptors = self.max_regions  # a mapped region holds two
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # The thread takes the socket over; Thread.start() is the memory barrier ZeroMQ asks for.
        self._thread = threading.Thread(target=self._run, name="edge-ipc-frontend", daemon=True)
        self._thread.start()
        # Another listener filling the budget must close this door too (libzmq aborts at EMFILE).
        self._limits.watch(self._wake)
        log.info("IPC frontend listening on %s", self.address)

    def refuse_new(self) -> None:
        """Answer new requests UNAVAILABLE while those in flight finish (the first step of a stop)."""
        self._requests.refusing = True

    def close(self, timeout: float | None = None) -> None:
        """Stop taking requests, give in-flight ones up to ``timeout`` to answer, then close.  Idempotent."""
        thread = self._thread
        if thread is None or self._stopping:
            if thread is not None:
                thread.join()
            self._requests.close()
            return
        self._stop_deadline = time.monotonic() + (self.drain_timeout if timeout is None else timeout)
        self._stopping = True
        self._requests.refusing = True
        self._wake()
        thread.join()
        self._requests.close()
        self._limits.trimmer.cancel()  # what it would give back goes with the process, or stays for the next

    def __enter__(self) -> IpcFrontend:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- introspection (tests, status lines) ----------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Counters for status lines and tests; exact when called on the frontend thread.

        ``limits``: the daemon's budget over every listener (:meth:`edge_server.limits.Limits.status`).
        """
        return {
            "limits": self._limits.status(),
            "connections": self._gate.connections,
            "refused_connections": self._gate.refused,
            "paused_accepting": self._gate.paused,
            "clients": len(self._peers),
            "regions": self._peers.region_count(),
            "region_descriptors": self._peers.shm.descriptors,
            "pending_handoffs": self._handoff.pending() if self._handoff is not None else 0,
            "released_clients": self._peers.dropped,
            "dropped_replies": self._replies.dropped,
            "slow_clients": self._replies.slow_clients,
            "cut_off_clients": self._replies.cut_off_clients,
            "reply_backlog_bytes": self._peers.total_backlog(),
            "max_message_bytes": self.max_message_bytes,
        }

    def liveness(self) -> tuple[int, bool]:
        """(loop turns, True): the watchdog pokes the thread each tick, so a live one always turns."""
        return self.turns, True

    def poke(self) -> None:
        """Wake the frontend thread for one loop turn (the watchdog's question: are you there?)."""
        self._wake()

    # -- the frontend thread --------------------------------------------------------------------

    def _over_reply_budget(self, identity: bytes) -> None:
        self._replies.recheck_later(identity)

    def _wake(self) -> None:
        if threading.current_thread() is self._thread:
            # A request that finished just before it got its callback: the callback ran here, and the
            # reply goes out in this loop turn.
            return
        # Under the lock so that a callback finishing after shutdown never writes to a reused fd number.
        with self._wake_lock:
            if self._wake_fd >= 0:
                signal_eventfd(self._wake_fd)

    def _run(self) -> None:
        assert self._sock is not None and self._monitor is not None
        items: list[tuple[Any, int]] = [
            (self._sock, _POLLIN),
            (self._monitor, _POLLIN),
            (self._wake_fd, _POLLIN),
        ]
        try:
            while True:
                try:
                    if self._loop_once(items):
                        break
                except Exception:  # the loop never dies: one bad message must not stop the daemon
                    log.exception("IPC frontend: unexpected error; serving on")
        finally:
            self._shutdown()

    def _loop_once(self, items: list[tuple[Any, int]]) -> bool:
        sock, monitor, peers, replies = self._sock, self._monitor, self._peers, self._replies
        assert sock is not None and monitor is not None
        self.turns += 1
        deadline = min(peers.next_deadline(), replies.next_cut_off())
        timeout_ms = max(0, int((deadline - time.monotonic()) * 1000.0) + 1)
        if self._stopping:
            timeout_ms = min(timeout_ms, 50)
        for item, _revents in zmq.zmq_poll(items, timeout_ms):
            if item is sock:
                # One message per wake-up: asking the socket whether more are queued (ZMQ_EVENTS)
                # costs as much as the next zmq_poll, which also gives replies and the monitor a turn.
                try:
                    frames, dropped = zmqio.recv_bounded(sock, _NOBLOCK, self.max_frames + 1)
                except zmq.Again:
                    continue
                self._requests.handle(sock, frames, dropped)
            elif item is monitor:
                while cast(int, monitor.get(_EVENTS)) & _POLLIN:
                    if self._gate.event(recv_monitor_message(monitor)):  # a connection closed
                        peers.disconnect_seen()
                        replies.trim_later()  # ZeroMQ frees what was queued for or from it
            else:
                try:
                    os.eventfd_read(self._wake_fd)
                except BlockingIOError:
                    pass
        self._gate.sync()  # another listener may have filled or freed the budget
        if replies:
            replies.send_queued(sock)
        now = time.monotonic()
        if now >= replies.next_cut_off():
            replies.cut_off_due()
        if now >= peers.next_deadline():  # handling may have brought probes forward
            for identity in peers.due_probes():
                replies.send(sock, identity, [_PING])
        if self._stopping:
            return not peers.busy() or time.monotonic() >= self._stop_deadline
        return False

    def _shutdown(self) -> None:
        assert self._sock is not None and self._monitor is not None and self._ctx is not None
        self._replies.send_queued(self._sock)
        self._peers.close()
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(linger=500)  # lets the last replies leave
        self._ctx.term()
        self._gate.close()
        with self._wake_lock:
            os.close(self._wake_fd)
            self._wake_fd = -1
        addresses.remove_socket(self.address, self._socket_file)
        if self._handoff is not None:
            self._handoff.close()
        log.info("IPC frontend on %s closed", self.address)
