"""The daemon's IPC frontend: one ROUTER socket, one thread that owns it.

ZeroMQ sockets are not thread-safe, so a single frontend thread receives, decodes, hands requests to
the data plane and sends every reply.  Requests complete on scheduler threads; their done-callback
encodes the reply there (including the copy of an output into the client's shared memory) and queues
it, then wakes the frontend thread through an eventfd it polls beside the socket.  Sends are
non-blocking: a client that stops reading is disconnected once the replies waiting for it pass
``max_reply_bytes`` (or loses replies past ZeroMQ's 10,000-message queue), instead of stalling everyone
or pinning the daemon's memory, and a vanished client is noticed (ZMQ_ROUTER_MANDATORY) and its state
released.  Load and unload may take
seconds, so they run on a one-thread control executor, never on the frontend thread.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from edge_server.authorization import ControlPolicy
from edge_server.errors import (
    EdgeServerError,
    InvalidArgument,
    MalformedMessage,
    MessageTooLarge,
    ServerShuttingDown,
    TooManyRequests,
)
from edge_server.ipc import addresses, handlers, protocol, zmqio
from edge_server.ipc.handoff import FdHandoff, handoff_path
from edge_server.ipc.peers import Peer, PeerTable, connection_of, connection_uid, same_connection
from edge_server.ipc.wakeup import signal_eventfd
from edge_server.limits import Connection, LimitOptions, Limits
from edge_server.request import ResponseSink

if TYPE_CHECKING:
    from edge_server.server import Server

log = logging.getLogger(__name__)

_HWM = 10_000
_CONTROL_WORKERS = 4
_ZERO_COPY = zmq.COPY_THRESHOLD  # frames this large are sent zero-copy, so tracking them is free
#: Connections the kernel queues for accept: all of them may arrive after the cap is reached.
_BACKLOG = 64
# Plain ints: pyzmq's enum flags cost a microsecond per operation on the hot path.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = zmqio.NOBLOCK
_SNDMORE = int(zmq.SNDMORE)
_PING = protocol.pack({"v": protocol.PROTOCOL_VERSION, "id": None, "op": protocol.PING})
#: A connection cut off for a message over the frame limit is closed this long after its error reply was
#: handed to ZeroMQ, so that the reply leaves first.
_CUT_OFF_DELAY_S = 0.2


class IpcFrontend:
    """Serves ``server`` on ``address`` (``ipc://PATH`` or ``tcp://127.0.0.1:PORT``).

    ``max_message_bytes`` bounds a whole request; larger ones get MESSAGE_TOO_LARGE.  ZeroMQ itself
    drops the connection of a peer that sends a single frame over twice that (ZMQ_MAXMSGSIZE), so a
    hostile client cannot make the daemon allocate without bound; the ``live`` reply tells clients the
    limit, so that ours refuse such requests before sending them.  ``shm_prefix`` is the only name
    prefix clients may register shared memory under.  ``max_reply_bytes``: a client with more bytes
    of replies waiting for it than this (it sends requests and does not read) is disconnected.
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
        self._dataplane = server.dataplane
        self._pack = protocol.packer()  # the frontend thread's own
        self.address = address or addresses.default_address()
        self.max_message_bytes = max_message_bytes
        self.max_header_bytes = min(max_header_bytes, max_message_bytes)
        self.drain_timeout = drain_timeout
        self.max_reply_bytes = max_reply_bytes
        self.max_client_requests = max_client_requests
        self.max_frames = max_frames
        self.max_requests = max_requests
        self.slow_clients = 0  # disconnected for not reading their replies
        self.cut_off_clients = 0  # disconnected for a message over the frame limit
        self._cut_offs: collections.deque[tuple[float, bytes, tuple[int, int]]] = collections.deque()
        self._peers = PeerTable(probe_interval=probe_interval, max_client_regions=max_client_regions)
        self._handoff: FdHandoff | None = None
        self._replies: collections.deque[tuple[bytes, list[Any], Future | _IpcStream | None]] = (
            collections.deque()
        )
        self._wake_fd = -1
        self._wake_lock = threading.Lock()
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        # Several: control is locked per model, and one model's slow load must not queue the others'.
        self._control = ThreadPoolExecutor(
            max_workers=_CONTROL_WORKERS, thread_name_prefix="edge-ipc-control"
        )
        self._stopping = False
        self._refusing = False  # stopping: new requests are answered UNAVAILABLE, the rest go on
        # The daemon's one descriptor budget, shared with its other listeners; alone: one of its own.
        self._limits = limits or Limits(LimitOptions(max_connections=max_connections or 0))
        self.max_connections = self._limits.max_connections
        self.max_regions = self._limits.regions
        self._counted: dict[int, Connection] = {}  # each connection in the budget, by its descriptor
        self.control_policy = control_policy or ControlPolicy()
        self._connections = 0
        self._listening = True
        self.refused_connections = 0
        self.paused_accepting = 0  # times the listener closed at the connection cap
        self._socket_file: tuple[int, int] | None = None
        self._stop_deadline = 0.0
        self.dropped_replies = 0
        self._trimmer = self._limits.trimmer  # after a client is dropped: the daemon's one trimmer
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
        self._refusing = True

    def close(self, timeout: float | None = None) -> None:
        """Stop taking requests, give in-flight ones up to ``timeout`` to answer, then close.  Idempotent."""
        thread = self._thread
        if thread is None or self._stopping:
            if thread is not None:
                thread.join()
            self._control.shutdown(wait=True)
            return
        self._stop_deadline = time.monotonic() + (self.drain_timeout if timeout is None else timeout)
        self._stopping = True
        self._wake()
        thread.join()
        self._control.shutdown(wait=True)
        self._trimmer.cancel()  # what it would give back goes with the process, or stays for the next

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
            "connections": self._connections,
            "refused_connections": self.refused_connections,
            "paused_accepting": self.paused_accepting,
            "clients": len(self._peers),
            "regions": self._peers.region_count(),
            "region_descriptors": self._peers.shm.descriptors,
            "pending_handoffs": self._handoff.pending() if self._handoff is not None else 0,
            "released_clients": self._peers.dropped,
            "dropped_replies": self.dropped_replies,
            "slow_clients": self.slow_clients,
            "cut_off_clients": self.cut_off_clients,
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

    def _wake(self) -> None:
        if threading.current_thread() is self._thread:
            # A request that finished just before _infer added its callback: the callback ran here, and
            # the reply goes out in this loop turn.
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
        sock, monitor, peers = self._sock, self._monitor, self._peers
        assert sock is not None and monitor is not None
        self.turns += 1
        deadline = peers.next_deadline()
        if self._cut_offs:
            deadline = min(deadline, self._cut_offs[0][0])
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
                self._handle(frames, dropped)
            elif item is monitor:
                while cast(int, monitor.get(_EVENTS)) & _POLLIN:
                    self._connection_event(recv_monitor_message(monitor))
            else:
                try:
                    os.eventfd_read(self._wake_fd)
                except BlockingIOError:
                    pass
        full = self._limits.full()
        if full == self._listening:  # another listener may have filled or freed the budget
            if full:
                self._pause_accepting()
            else:
                self._resume_accepting()
        if self._replies:
            self._send_replies(sock)
        if self._cut_offs and time.monotonic() >= self._cut_offs[0][0]:
            self._cut_off_due()
        if time.monotonic() >= peers.next_deadline():  # handling may have brought probes forward
            for identity in peers.due_probes():
                self._send(sock, identity, [_PING])
        if self._stopping:
            return not peers.busy() or time.monotonic() >= self._stop_deadline
        return False

    def _connection_event(self, event: dict[str, Any]) -> None:
        """Count an accepted connection in the daemon's budget (refused over a cap), or uncount one."""
        fd = event["value"]
        if event["event"] == zmq.EVENT_ACCEPTED:
            connection = self._limits.connect(socket_uid(fd))
            self._counted[fd] = connection
            if connection.refusal is not None:
                refuse_connection(fd)
                self.refused_connections += 1
                if self.refused_connections & (self.refused_connections - 1) == 0:  # 1, 2, 4, 8...
                    log.warning(
                        "IPC frontend: connection refused (%d so far): %s",
                        self.refused_connections,
                        connection.refusal,
                    )
                return
            self._connections += 1
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            self._peers.disconnect_seen()
            self._trim_later()  # ZeroMQ frees what was queued for or from that connection
            counted = self._counted.pop(fd, None)
            if counted is not None:
                self._limits.disconnect(counted)
                if counted.refusal is None:
                    self._connections = max(0, self._connections - 1)

    def _pause_accepting(self) -> None:
        """Hide the socket file while the connection cap is reached.

        Refusing a connection after libzmq accepted it is not enough: its I/O thread accepts a burst
        faster than they can be refused, and it aborts the process when ``accept`` on a Unix socket
        meets EMFILE (on TCP it does not).  Unbinding would close the connections already accepted,
        so the listener stays and its path is renamed away: a ``connect`` finds nothing and the
        client retries until the file is back.  Only the connections already queued still arrive.
        """
        path = addresses.ipc_path(self.address)
        if path is None:
            return
        try:
            os.rename(path, addresses.paused_path(path))
        except OSError as exc:
            log.warning("IPC frontend: could not stop accepting at the connection cap: %s", exc)
            return
        self._listening = False
        self.paused_accepting += 1
        log.warning(
            "IPC frontend: %d connections, the cap (--max-connections or the descriptor budget); "
            "not accepting more until one closes",
            self._connections,
        )

    def _resume_accepting(self) -> None:
        path = addresses.ipc_path(self.address)
        assert path is not None
        try:
            os.rename(addresses.paused_path(path), path)
        except OSError as exc:
            log.error("IPC frontend: could not accept connections again on %s: %s", path, exc)
            return
        self._listening = True
        log.info("IPC frontend: below the connection cap again; accepting connections")

    def _shutdown(self) -> None:
        assert self._sock is not None and self._monitor is not None and self._ctx is not None
        if not self._listening:
            self._resume_accepting()  # the file is ours to remove, under its own name
        self._send_replies(self._sock)
        self._peers.close()
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(linger=500)  # lets the last replies leave
        self._ctx.term()
        for connection in self._counted.values():  # closed with the socket: the budget is the daemon's
            self._limits.disconnect(connection)
        self._counted.clear()
        with self._wake_lock:
            os.close(self._wake_fd)
            self._wake_fd = -1
        addresses.remove_socket(self.address, self._socket_file)
        if self._handoff is not None:
            self._handoff.close()
        log.info("IPC frontend on %s closed", self.address)

    # -- requests -------------------------------------------------------------------------------

    def _handle(self, frames: list[zmq.Frame], dropped: int = 0) -> None:
        identity = frames[0].bytes
        rid: int | str | None = None
        try:
            if len(frames) < 2:
                raise MalformedMessage("empty message: expected a header frame")
            head = frames[1]
            total = -len(frames[0])  # the body's size: every frame but the identity (no slice to build)
            for frame in frames:
                total += len(frame)
            header: dict[str, Any] | None = None
            if len(head) <= self.max_header_bytes:
                header = protocol.unpack(head)
                rid = protocol.request_id(header)
            if dropped:
                self._cut_off_later(identity, head, len(frames) + dropped - 1)
                raise MalformedMessage(
                    f"the message has {len(frames) + dropped - 1} frames; a request may have at most "
                    f"{self.max_frames} (a header and its tensors; --max-frames)"
                )
            if header is None:
                raise MessageTooLarge(
                    f"the header frame has {len(head)} bytes; this server decodes at most "
                    f"{self.max_header_bytes} (--max-header-bytes)"
                )
            if total > self.max_message_bytes:
                raise MessageTooLarge(
                    f"the message has {total} bytes; this server accepts at most "
                    f"{self.max_message_bytes} (pass large tensors through shared memory)"
                )
            assert header is not None
            if rid is None and header.get("id") is not None:
                raise MalformedMessage(f"field 'id' must be an integer or a string, got {header['id']!r}")
            protocol.check_version(header)
            op = header.get("op")
            if type(op) is not str:
                op = protocol.field(header, "op", str)
            peer = self._peers.get(identity, head)
            if op == "infer":
                self._infer(peer, identity, rid, header, frames[2:])
                return
            if op == "stream":
                self._stream(peer, identity, rid, header, frames[2:])
                return
            if len(frames) > 2:
                raise MalformedMessage(f"operation {op!r} takes no tensor frames, got {len(frames) - 2}")
            if op == "cancel":
                stream = peer.streams.get(header.get("target"))
                if stream is not None:
                    stream.cancel()
                self._queue(identity, protocol.ok_header(rid, cancelled=stream is not None))
            elif op == "bye":
                released = self._peers.drop(identity, "said bye")
                self._queue(identity, protocol.ok_header(rid, unregistered=released))
            elif op == "ipc_status":
                self._queue(identity, protocol.ok_header(rid, ipc=self.status()))
            elif op == "live":
                # Clients ask this first on every connection and keep the limit: a request over twice
                # it would make ZeroMQ drop the connection (ZMQ_MAXMSGSIZE) instead of getting an answer.
                self._queue(
                    identity, protocol.ok_header(rid, live=True, max_message_bytes=self.max_message_bytes)
                )
            elif op in handlers.SLOW_OPS:
                self.control_policy.authorize(peer_uid(head), f"operation {op!r}")
                future = self._control.submit(
                    handlers.control, self.server, peer.registry, op, header, self._handoff
                )
                future.add_done_callback(partial(self._control_done, identity, rid))
            else:
                reply = handlers.control(self.server, peer.registry, op, header, self._handoff)
                self._queue(identity, protocol.ok_header(rid, **reply))
        except EdgeServerError as exc:
            self._queue(identity, protocol.error_header(rid, exc))
        except Exception as exc:
            log.exception("IPC request from %s failed unexpectedly", identity.hex())
            self._queue(identity, protocol.error_header(rid, EdgeServerError(f"internal error: {exc!r}")))

    def _admit(self, peer: Peer) -> None:
        """Refuse a request over the client's or the daemon's in-flight limit, before it is decoded."""
        if self._stopping or self._refusing:
            raise ServerShuttingDown("the daemon is shutting down")
        if len(peer.in_flight) + len(peer.streams) >= self.max_client_requests:
            raise TooManyRequests(
                f"this client has {self.max_client_requests} requests in flight, its limit "
                "(--max-client-requests); wait for replies before sending more"
            )
        if self._peers.requests >= self.max_requests:
            raise TooManyRequests(
                f"the daemon has {self.max_requests} requests in flight, its limit (--max-requests)"
            )

    def _infer(self, peer: Peer, identity: bytes, rid: int | str | None, header: dict, frames: list) -> None:
        self._admit(peer)
        request, ctx = handlers.decode_infer(header, frames, peer.registry)
        if request.correlation_id:
            request.owner = peer.uid  # the sequence belongs to this user (scheduler.sequence)
        outcome = self._dataplane.dispatch(request)
        if not isinstance(outcome, Future):  # it ran inline on this thread: answer now, nothing to track
            assert self._sock is not None
            self._send(self._sock, identity, handlers.encode_result(ctx, outcome, self._pack), peer)
            return
        self._peers.track(peer, outcome)
        outcome.add_done_callback(partial(self._infer_done, identity, ctx))

    def _stream(self, peer: Peer, identity: bytes, rid: int | str | None, header: dict, frames: list) -> None:
        self._admit(peer)
        request, ctx = handlers.decode_infer(header, frames, peer.registry)
        if request.correlation_id:
            request.owner = peer.uid  # the sequence belongs to this user (scheduler.sequence)
        if ctx.shm_outputs:
            raise InvalidArgument("the responses of a stream travel inline; leave out 'shm' in 'outputs'")
        if rid is None or rid in peer.streams:
            raise MalformedMessage("a stream needs an 'id' of its own, not one of a stream still open")
        sink = _IpcStream(self, identity, ctx)
        self._dataplane.stream(request, sink)
        # Even if it already finished: its final reply is taken off below on this thread, after this.
        self._peers.track(peer, (rid, sink))

    def _infer_done(self, identity: bytes, ctx: handlers.InferContext, future: Future) -> None:
        """Runs on the scheduler thread that finished the request: encode here, send on the frontend."""
        self._replies.append((identity, self._reply_frames(ctx, future), future))
        self._wake()

    @staticmethod
    def _reply_frames(ctx: handlers.InferContext, future: Future) -> list[Any]:
        if future.cancelled():
            return []  # a cancelled request's client is gone: nothing to send
        try:
            return handlers.encode_result(ctx, future.result())
        except Exception as exc:
            return [protocol.pack(protocol.error_header(ctx.rid, _as_error(exc)))]

    def _control_done(self, identity: bytes, rid: int | str | None, future: Future) -> None:
        try:
            header = protocol.ok_header(rid, **future.result())
        except Exception as exc:
            header = protocol.error_header(rid, _as_error(exc))
        self._replies.append((identity, [protocol.pack(header)], None))
        self._wake()

    def _queue(self, identity: bytes, header: dict[str, Any]) -> None:
        self._replies.append((identity, [self._pack(header)], None))

    # -- replies --------------------------------------------------------------------------------

    def _send_replies(self, sock: zmq.Socket) -> None:
        replies = self._replies
        find = self._peers.find
        while replies:
            identity, frames, done = replies.popleft()
            peer = find(identity)
            if done is not None:
                if peer is None:  # dropped while the request ran: its outputs are freed now
                    self._trim_later()
                    continue
                self._peers.settle(peer, done, done.ctx.rid if isinstance(done, _IpcStream) else None)
            if frames:
                self._send(sock, identity, frames, peer)

    def _send(self, sock: zmq.Socket, identity: bytes, frames: list[Any], peer: Peer | None = None) -> None:
        try:
            if peer is None:
                zmqio.send_frames(sock, [identity, *frames], _NOBLOCK)
            else:
                self._send_counted(sock, peer, frames)
        except zmq.Again:
            self.dropped_replies += 1
            log.warning("client %s is not reading its replies; one reply dropped", identity.hex())
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            if self._peers.find(identity) is not None:
                self._trim_later()  # it went away, maybe with replies queued or requests running
            self._peers.drop(identity, "disconnected")

    def _send_counted(self, sock: zmq.Socket, peer: Peer, frames: list[Any]) -> None:
        """Send a reply and count its bytes against ``peer``'s backlog (see ``peers.ReplyBacklog``)."""
        nbytes = 0
        tracked = -1  # the last zero-copy frame: ZeroMQ frees a message's frames in order
        for index, frame in enumerate(frames):
            if type(frame) is bytes:
                size = len(frame)
            elif isinstance(frame, zmq.Frame):  # a received frame sent on has no tracker: not a mark
                nbytes += len(frame)
                continue
            else:
                size = memoryview(frame).nbytes
            nbytes += size
            if size >= _ZERO_COPY:
                tracked = index
        backlog = peer.backlog
        if tracked < 0 and not backlog.wants_mark(nbytes):
            zmqio.send_frames(sock, [peer.identity, *frames], _NOBLOCK)
            backlog.sent_reply(nbytes, None)
            return
        if tracked < 0:  # a small reply that marks the backlog: its header goes zero-copy, tracked
            tracked = 0
            frames = [zmq.Frame(frames[0], copy=False, track=True), *frames[1:]]
        send = zmqio.send_one
        send(sock, peer.identity, _NOBLOCK | _SNDMORE)
        last = len(frames) - 1
        tracker: zmq.MessageTracker | None = None
        for index, frame in enumerate(frames):
            flags = 0 if index == last else _SNDMORE
            if index == tracked:
                tracker = send(sock, frame, flags, track=True)
            else:
                send(sock, frame, flags)
        backlog.sent_reply(nbytes, tracker)
        if backlog.sent - backlog.freed > self.max_reply_bytes:
            pending = backlog.pending()
            if pending > self.max_reply_bytes:
                self._disconnect_slow(peer, pending)

    def _disconnect_slow(self, peer: Peer, pending: int) -> None:
        """Shut down the connection of a client that does not read; ZeroMQ then frees its replies.

        Its uid is penalized: a DEALER reconnects by itself and would send the same flood again at once
        (as bench_hostile's nonreading-ipc client does), each time costing the model's queue
        and a burst of memory before the cut-off.
        """
        self.slow_clients += 1
        why = f"left over {self.max_reply_bytes} bytes of IPC replies unread (--max-client-reply-bytes)"
        self._limits.penalize(None if peer.uid < 0 else peer.uid, why)
        log.warning(
            "client %s is not reading its replies: %d bytes wait for it, over --max-client-reply-bytes "
            "(%d); disconnecting it",
            peer.identity.hex(),
            pending,
            self.max_reply_bytes,
        )
        if peer.connection is not None and same_connection(peer.connection):
            refuse_connection(peer.connection[0])
        self._peers.drop(peer.identity, "disconnected for not reading its replies")
        self._trim_later()

    def _cut_off_later(self, identity: bytes, frame: zmq.Frame, count: int) -> None:
        """A message of ``count`` frames was refused (and drained): close its connection, penalize its uid.

        libzmq hands over only whole messages, so the frames past the limit were all received and
        held (about 64 bytes each inside libzmq) before the daemon could see the first; draining them
        costs ~1 us each.  So the client must not do it again: its connection is shut down once the
        error reply has left, and its uid's new connections are refused for a while
        (:meth:`~edge_server.limits.Limits.penalize`).
        """
        connection = connection_of(frame)
        uid = connection_uid(connection[0])
        why = f"sent an IPC message of {count} frames (--max-frames {self.max_frames})"
        self._limits.penalize(None if uid < 0 else uid, why)
        self._cut_offs.append((time.monotonic() + _CUT_OFF_DELAY_S, identity, connection))

    def _cut_off_due(self) -> None:
        now = time.monotonic()
        while self._cut_offs and self._cut_offs[0][0] <= now:
            _due, identity, connection = self._cut_offs.popleft()
            self.cut_off_clients += 1
            log.warning(
                "client %s sent a message over the frame limit (--max-frames %d); disconnecting it",
                identity.hex(),
                self.max_frames,
            )
            if same_connection(connection):
                refuse_connection(connection[0])
            self._peers.drop(identity, "disconnected for a message over the frame limit")
            self._trim_later()

    def _trim_later(self) -> None:
        """Hand the memory of a dropped client's replies and requests back to the system once freed.

        ZeroMQ's I/O thread, pyzmq's collector and the schedulers free them over the next seconds, and
        glibc keeps freed pages in its arenas (measured: 300 x 1-8 MiB requests of a client that went
        away left +70 to +370 MiB resident until a trim): trim 0.25, 1 and 5 s after the last drop.
        """
        self._trimmer.request()


class _IpcStream(ResponseSink):
    """The responses of one ``stream`` request, encoded on the model's thread and sent by the frontend."""

    def __init__(self, frontend: IpcFrontend, identity: bytes, ctx: handlers.InferContext) -> None:
        super().__init__()
        self.frontend = frontend
        self.identity = identity
        self.ctx = ctx

    def deliver(self, outputs: dict[str, Any] | None, error: EdgeServerError | None, final: bool) -> None:
        rid = self.ctx.rid
        try:
            if error is not None:
                frames = [protocol.pack({**protocol.error_header(rid, error), "final": final})]
            elif outputs is not None:
                frames = handlers.encode_result(self.ctx, outputs, final=final)
            else:
                frames = [protocol.pack(protocol.ok_header(rid, final=True))]
        except Exception as exc:  # an output that cannot be encoded: this response becomes an error
            frames = [protocol.pack({**protocol.error_header(rid, _as_error(exc)), "final": final})]
        self.frontend._replies.append((self.identity, frames, self if final else None))
        self.frontend._wake()


_CREDS = struct.Struct("3i")


def socket_uid(fd: int) -> int | None:
    """The uid of the process at the other end of Unix socket ``fd`` (SO_PEERCRED); None on TCP."""
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:
            return int(_CREDS.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size))[1])
    except OSError:
        return None


def peer_uid(frame: zmq.Frame) -> int | None:
    """The uid of the process that sent ``frame`` (SO_PEERCRED of its connection); None on tcp://."""
    try:
        fd = frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None
    return socket_uid(fd)


def refuse_connection(fd: int) -> None:
    """Close a just-accepted connection from outside libzmq: shut its socket down; libzmq sees EOF."""
    try:
        duplicate = os.dup(fd)
    except OSError:
        return
    try:
        with socket.socket(fileno=duplicate) as conn:
            conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _as_error(exc: BaseException) -> EdgeServerError:
    if isinstance(exc, EdgeServerError):
        return exc
    log.error("unexpected error from the data plane: %r", exc, exc_info=exc)
    return EdgeServerError(f"internal error: {exc!r}")
