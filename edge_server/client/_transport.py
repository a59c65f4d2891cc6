"""The sync client's socket machinery: leader election, outbox, replies, timeouts, reconnection.

Whoever holds ``_io`` is the *leader* and alone touches the sockets: it sends what callers queued
in the outbox, receives replies and completes their futures.  A thread that waits for its own reply
becomes the leader itself when nobody else is (the common case: one thread, one request at a time),
so a round trip costs no thread hand-off.  When requests are pending and no caller leads (futures from
``Client.submit``), a background pump thread leads instead; every release of ``_io`` hands over to it
when work remains, so no request is ever left without a leader.

Connecting: on every connection (the first, and each reconnection after the daemon restarted) the
leader first says what :class:`~edge_server.client._handshake.Handshake` says (``live``, for the
daemon's message-size limit, and the client's regions registered again); queued requests wait until
that answer came, and one over the limit fails with MessageTooLarge instead of being sent (ZeroMQ would
drop the connection for it).
Requests already sent when a connection drops fail with ConnectionLost: their replies died with the
old daemon.
"""

from __future__ import annotations

import collections
import heapq
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import InvalidStateError
from typing import Any, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from edge_server.client import _wire
from edge_server.client._call import Call, StreamCall
from edge_server.client._common import (
    Decoder,
    MessageLimit,
    dealer,
    reply_header,
    reply_outcome,
)
from edge_server.client._handshake import Handshake
from edge_server.client.shm import SharedMemoryRegion
from edge_server.errors import Cancelled, ConnectionLost, MessageTooLarge, ReplyTimeout
from edge_server.ipc import zmqio
from edge_server.ipc.wakeup import signal_eventfd

log = logging.getLogger(__name__)

# Plain ints: pyzmq's enum flags cost a microsecond per operation on the hot path.
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
# A leader that starts after the socket went this long without a poll checks the monitor first.
_UNWATCHED_S = 0.001


class Transport:
    """The socket machinery: leader election, outbox, replies, timeouts, reconnection."""

    def __init__(
        self,
        address: str,
        *,
        limit: MessageLimit,
        regions: dict[str, SharedMemoryRegion],
        ids: Iterator[int],
    ) -> None:
        self.address = address
        self.limit = limit
        self._ids = ids
        self._ctx = zmq.Context(io_threads=1)
        sock, self._monitor = dealer(self._ctx, address)
        self._sock = sock
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # A client dropped without close() must release its sockets in the right order when it is
        # collected: left to pyzmq, the context's own finalizer may run first and block forever in
        # zmq_ctx_term (its sockets still open) on whatever thread the collection happened to run,
        # typically another client's caller, whose call then never returns.
        self._release_zmq = weakref.finalize(
            self, _release_zmq, self._ctx, sock, self._monitor, self._wake_fd
        )
        self._poll_items: list[tuple[Any, int]] = [
            (sock, zmq.POLLIN),
            (self._monitor, zmq.POLLIN),
            (self._wake_fd, zmq.POLLIN),
        ]
        self._pollout = False
        # The monitor is read when a poll reports it, and before sending after the socket went
        # unwatched for a while; between back-to-back round trips asking ZMQ_EVENTS would cost more.
        self._monitor_due = True
        self._polled_at = 0.0
        self._io = threading.Lock()  # leadership
        self._lock = threading.Lock()  # _pending, _outbox, _deadlines
        self._work = threading.Condition(self._lock)
        self._answered = threading.Condition(self._lock)  # callers waiting while another thread leads
        self._waiting = 0  # how many (under _lock)
        self._pending: dict[int, Call] = {}
        self._outbox: collections.deque[Call] = collections.deque()
        self._deadlines: list[tuple[float, int]] = []
        self._connected = False
        self._was_connected = False
        # What is said first on every connection: `live` (the daemon's limit), regions registered again.
        self._handshake = Handshake(address, limit, regions, ids, self._send_first)
        self._closed = False
        self._pump: threading.Thread | None = None

    # -- calls ----------------------------------------------------------------------------------

    def enqueue(
        self,
        rid: int,
        frames: list[Any],
        decode: Decoder,
        timeout: float | None,
        nbytes: int = 0,
        *,
        future: bool = False,
    ) -> Call:
        if self._closed:
            raise Cancelled("the client is closed")
        deadline = None if timeout is None else time.monotonic() + timeout
        call = Call(rid, frames, decode, deadline, nbytes=nbytes, future=future)
        with self._lock:
            self._pending[rid] = call
            self._outbox.append(call)
            if call.deadline is not None:
                heapq.heappush(self._deadlines, (call.deadline, rid))
        return call

    def wait(self, call: Call) -> Any:
        """Lead until ``call`` is answered, or let the current leader answer it."""
        self._await(call, None)
        return call.outcome()

    def _await(self, call: Call, deadline: float | None) -> None:
        """Return once ``call`` is settled, or at ``deadline`` (monotonic; None: never)."""
        while not call.settled:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return
            if self._io.acquire(blocking=False):
                try:
                    self._drive(call, deadline)
                finally:
                    self._release()
            else:
                self._poke()
                # The leader sends our call; when it stops leading it hands over to the pump.
                with self._lock:
                    self._waiting += 1
                    try:
                        if not call.settled:
                            self._answered.wait(1.0 if remaining is None else min(1.0, remaining))
                    finally:
                        self._waiting -= 1

    # -- streams --------------------------------------------------------------------------------

    def enqueue_stream(self, rid: int, frames: list[Any], decode: Decoder, nbytes: int) -> StreamCall:
        if self._closed:
            raise Cancelled("the client is closed")
        call = StreamCall(rid, frames, decode, nbytes=nbytes)
        with self._lock:
            self._pending[rid] = call
            self._outbox.append(call)
        return call

    def next_response(
        self, call: StreamCall, timeout: float | None
    ) -> tuple[Any, BaseException | None, bool]:
        """The stream's next (value, error, final), waiting up to ``timeout`` seconds for it."""
        if not call.sent and not call.settled:
            self.kick()
        self._await(call, None if timeout is None else time.monotonic() + timeout)
        with self._lock:
            if not call.items:
                raise ReplyTimeout(f"no response from {self.address} within {timeout} s")
            item = call.items.popleft()
            call.settled = bool(call.items) or call.done
        return item

    def cancel_stream(self, call: StreamCall) -> None:
        """The caller stops reading: forget the stream and ask the daemon to cancel it (not awaited)."""
        with self._lock:
            self._pending.pop(call.rid, None)
            call.done = call.settled = True
            if not call.sent:
                call.frames = None  # never sent: nothing to cancel
                return
        rid = next(self._ids)
        self.enqueue(rid, _wire.control_message(rid, "cancel", target=call.rid), _ignore, None)
        self.kick()

    def _push(self, call: StreamCall, value: Any, error: BaseException | None, final: bool) -> None:
        with self._lock:
            call.items.append((value, error, final))
            call.done = call.done or final
            call.settled = True
            if self._waiting:
                self._answered.notify_all()

    def _settle(self, call: Call, result: Any = None, exc: BaseException | None = None) -> None:
        """Give ``call`` its outcome (never under ``_lock``) and wake whoever waits for it."""
        if type(call) is StreamCall:  # lost, closed: the stream ends with that error
            self._push(call, result, exc, True)
            return
        call.value, call.error = result, exc
        call.settled = True
        future = call.future
        if future is not None:
            try:
                if exc is not None:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            except InvalidStateError:  # the caller cancelled it
                pass
        if self._waiting:
            with self._lock:
                self._answered.notify_all()

    def kick(self) -> None:
        """Send now if nobody leads, then make sure someone keeps receiving (futures API)."""
        if self._io.acquire(blocking=False):
            try:
                self._service_monitor()
                self._flush()
            finally:
                self._release()
        else:
            self._poke()

    def _poke(self) -> None:
        fd = self._wake_fd
        if fd >= 0:
            signal_eventfd(fd)  # a failure (closed by close() in the meantime) is ignored

    def _release(self) -> None:
        self._io.release()
        with self._lock:
            if self._pending and not self._closed:  # every queued call is also pending
                if self._pump is None:
                    self._pump = threading.Thread(
                        target=self._pump_main, name="edge-client-pump", daemon=True
                    )
                    self._pump.start()
                self._work.notify()

    def _pump_main(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._pending:
                    self._work.wait()
                if self._closed:
                    return
            if not self._io.acquire(timeout=0.2):
                continue
            try:
                self._drive(None)
            finally:
                self._io.release()

    # -- the leader's loop (caller holds _io) ---------------------------------------------------

    def _drive(self, until: Call | None, deadline: float | None = None) -> None:
        """Send, receive and expire until ``until`` is settled (None: until nothing is pending).

        ``deadline`` (monotonic): return then even if it is not.
        """
        sock, monitor = self._sock, self._monitor
        now = time.monotonic()
        if now - self._polled_at > _UNWATCHED_S:
            self._monitor_due = True  # no one polled for a while: connection events may be waiting
        while True:
            if self._monitor_due:
                self._monitor_due = False
                if cast(int, monitor.get(_EVENTS)) & _POLLIN:
                    self._service_monitor()
            blocked = self._flush() if self._outbox else False
            if blocked != self._pollout:
                self._poll_items[0] = (sock, zmq.POLLIN | (zmq.POLLOUT if blocked else 0))
                self._pollout = blocked
            if self._finished(until):
                return
            timeout_ms = -1
            if self._deadlines:
                # ``now`` may be a flush old: a deadline then fires that much late (microseconds).
                timeout_ms = max(0, int((self._deadlines[0][0] - now) * 1000.0) + 1)
            if deadline is not None:
                mine = max(0, int((deadline - now) * 1000.0) + 1)
                timeout_ms = mine if timeout_ms < 0 else min(timeout_ms, mine)
            received = False
            for item, revents in zmq.zmq_poll(self._poll_items, timeout_ms):
                if item is sock:
                    if revents & _POLLIN:
                        self._receive(until)
                        received = True
                elif item is monitor:
                    self._monitor_due = True  # serviced at the top, before anything more is sent
                else:
                    try:
                        os.eventfd_read(self._wake_fd)
                    except BlockingIOError:
                        pass
            now = self._polled_at = time.monotonic()
            if self._deadlines and self._deadlines[0][0] <= now:
                self._expire()
            if received and self._finished(until) and not self._outbox:
                return  # the usual round trip ends here; monitor events wait for the next turn
            if deadline is not None and now >= deadline:
                return

    def _finished(self, until: Call | None) -> bool:
        return until.settled if until is not None else self._closed or not self._pending

    def _flush(self) -> bool:
        """Send the outbox; True if the socket could not take more (reconnecting or full)."""
        if not self._connected:
            return False  # the monitor's HANDSHAKE_SUCCEEDED wakes the poll
        outbox = self._outbox
        while outbox:
            call = outbox[0]
            if call.frames is None:  # timed out before it could be sent
                outbox.popleft()
                continue
            if self._handshake.greeting is not None and not call.early:
                return False  # the daemon's limit is not known yet; its answer wakes the poll
            if call.nbytes > self.limit.allowed:
                outbox.popleft()
                self._refuse(call)
                continue
            try:
                zmqio.send_frames(self._sock, call.frames, zmqio.NOBLOCK)
            except zmq.Again:
                return True
            outbox.popleft()
            call.frames = None
            call.sent = True
        return False

    def _receive(self, until: Call | None = None) -> None:
        """Take the replies that are in, but return as soon as ``until`` is answered.

        Replies still queued then wait for the next leader or the pump.
        """
        sock = self._sock
        while True:
            try:
                frames = zmqio.recv_frames(sock, zmqio.NOBLOCK)
            except zmq.Again:
                return
            self._reply(frames)
            if (until is not None and until.settled) or not cast(int, sock.get(_EVENTS)) & _POLLIN:
                return

    def _reply(self, frames: list[Any]) -> None:
        header = reply_header(frames)
        if header is None:
            return
        rid = header.get("id")
        with self._lock:
            call = self._pending.get(rid) if isinstance(rid, int) else None
            if call is None:
                return  # a ping, or the reply to a request that already timed out or was cancelled
            # A stream stays pending until its final response (an error without 'final' ends it too).
            stream = type(call) is StreamCall
            final = not stream or header.get("final", True) is not False
            if final:
                del self._pending[call.rid]
            deadlines = self._deadlines
            if final and deadlines and deadlines[0][1] == rid:
                heapq.heappop(deadlines)  # answered: its deadline is moot (the others expire lazily)
        if stream:
            self._push(call, *reply_outcome(header, frames[1:], call.decode), final)  # type: ignore[arg-type]
        else:
            self._settle(call, *reply_outcome(header, frames[1:], call.decode))

    def _expire(self) -> None:
        now = time.monotonic()
        expired: list[Call] = []
        with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                _, rid = heapq.heappop(self._deadlines)
                call = self._pending.pop(rid, None)
                if call is not None:
                    call.frames = None
                    expired.append(call)
            if any(not call.sent for call in expired):
                self._outbox = collections.deque(c for c in self._outbox if c.frames is not None)
        for call in expired:
            hint = "" if self._connected else " (not connected: is the daemon running?)"
            self._settle(call, exc=ReplyTimeout(f"no reply from {self.address} in time{hint}"))

    def _service_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._connected = False
                self._receive()  # replies that arrived before the connection closed still count
                self._lost()
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshake.connected(again=self._was_connected)
                self._connected = self._was_connected = True

    def _lost(self) -> None:
        with self._lock:
            gone = [c for c in self._pending.values() if c.sent]
            for call in gone:
                del self._pending[call.rid]
        for call in gone:
            self._settle(call, exc=ConnectionLost(f"the daemon at {self.address} went away before replying"))

    def _send_first(self, call: Call) -> None:
        with self._lock:
            self._pending[call.rid] = call
            self._outbox.appendleft(call)

    def _refuse(self, call: Call) -> None:
        """A queued request over the daemon's limit (learned after it was queued): fail it unsent."""
        with self._lock:
            self._pending.pop(call.rid, None)
        call.frames = None
        try:
            self.limit.check(call.nbytes)
        except MessageTooLarge as exc:
            self._settle(call, exc=exc)

    # -- shutdown -------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def connected(self) -> bool:
        """Whether the socket is connected, as far as the monitor has told us."""
        if self._io.acquire(timeout=0.1):  # a leader stuck on a hung daemon must not block close()
            try:
                self._service_monitor()
            finally:
                self._release()
        return self._connected

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending.values())
            self._pending.clear()
            self._outbox.clear()
            self._work.notify_all()
        self._poke()
        for call in pending:
            self._settle(call, exc=Cancelled("the client was closed before the reply came"))
        if self._pump is not None:
            self._pump.join()
        with self._io:
            self._wake_fd = -1
            self._release_zmq()


def _release_zmq(ctx: zmq.Context, sock: zmq.Socket, monitor: zmq.Socket, wake_fd: int) -> None:
    """Close in the one order that never blocks: monitor off, both sockets closed, then the context."""
    sock.disable_monitor()
    monitor.close(0)
    sock.close(0)
    ctx.term()
    os.close(wake_fd)


def _ignore(header: dict[str, Any], frames: list[Any]) -> None:
    return None
