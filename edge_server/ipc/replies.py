"""Replies to IPC clients: queued from any thread, sent by the frontend thread, bounded per user.

Requests complete on scheduler threads, whose done-callbacks encode the reply there and :meth:`Replies.put`
it; the frontend thread sends what is queued each loop turn (ZeroMQ sockets are not thread-safe).
Sends are non-blocking, and each client's backlog of replies handed to ZeroMQ and not yet taken is
counted (:class:`~edge_server.ipc.peers.ReplyBacklog`) in its uid's share of the daemon's reply budget
(:class:`~edge_server.reply_budget.ReplyBudget`, with the uid's gRPC streams): once the uid passes
``--max-client-reply-bytes`` the client holding the most is disconnected (a client also loses replies
past ZeroMQ's 10,000-message queue), instead of stalling everyone or pinning the daemon's memory.
A vanished client is noticed (ZMQ_ROUTER_MANDATORY) and its state released.  Clients are also cut
off here after a message over the frame limit, once its error reply has left.  Either way their uid
is penalized in the daemon's budget (:meth:`~edge_server.limits.Limits.penalize`), and the heap is
trimmed once their buffers are freed.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq

from edge_server.ipc import protocol, zmqio
from edge_server.ipc.admission import refuse_connection
from edge_server.ipc.peers import (
    Peer,
    PeerTable,
    ReplyBacklog,
    connection_of,
    connection_uid,
    same_connection,
)
from edge_server.limits import Limits
from edge_server.reply_budget import ReplyBudget
from edge_server.request import ResponseSink

log = logging.getLogger(__name__)

_ZERO_COPY = zmq.COPY_THRESHOLD  # frames this large are sent zero-copy, so tracking them is free
# Plain ints: pyzmq's enum flags cost a microsecond per operation on the hot path.
_NOBLOCK = zmqio.NOBLOCK
_SNDMORE = int(zmq.SNDMORE)
#: A connection cut off for a message over the frame limit is closed this long after its error reply was
#: handed to ZeroMQ, so that the reply leaves first.
CUT_OFF_DELAY_S = 0.2
#: A queued entry that asks the frontend thread to look at a client's uid against the reply budget.
_RECHECK = object()


class Replies:
    """The reply queue and the sending side of the IPC frontend (see the module's docstring).

    ``wake`` wakes the frontend thread after a reply was queued from another thread.
    """

    def __init__(self, peers: PeerTable, limits: Limits, *, wake: Callable[[], None]) -> None:
        self._peers = peers
        self._limits = limits
        self._budget: ReplyBudget = limits.replies
        self._wake = wake
        self._pack = protocol.packer()  # the frontend thread's own
        # (client, frames, the request it answers or None, the stream id when that is a stream's end)
        self._queued: collections.deque[tuple[bytes, list[Any], Future | ResponseSink | None, Any]] = (
            collections.deque()
        )
        self._cut_offs: collections.deque[tuple[float, bytes, tuple[int, int]]] = collections.deque()
        self.dropped = 0  # replies dropped at ZeroMQ's queue limit
        self.slow_clients = 0  # disconnected for not reading their replies
        self.cut_off_clients = 0  # disconnected for a message over the frame limit

    def __bool__(self) -> bool:
        return bool(self._queued)

    # -- queueing (any thread) --------------------------------------------------------------------

    def put(
        self,
        identity: bytes,
        frames: list[Any],
        done: Future | ResponseSink | None = None,
        stream: Any = None,
    ) -> None:
        """Queue ``frames`` for ``identity`` from any thread.

        ``done``: the request whose reply this is (a future, or a stream's sink with its id
        ``stream``), which stops counting against the client once the reply leaves.
        """
        self._queued.append((identity, frames, done, stream))
        self._wake()

    def recheck_later(self, identity: bytes) -> None:
        """From any thread: ``identity``'s uid went over the reply budget; look again on this thread."""
        self.put(identity, [], None, _RECHECK)

    def queue(self, identity: bytes, header: dict[str, Any]) -> None:
        """Queue a header-only reply on the frontend thread (sent in this loop turn)."""
        self._queued.append((identity, [self._pack(header)], None, None))

    # -- sending (the frontend thread) ------------------------------------------------------------

    def send_queued(self, sock: zmq.Socket) -> None:
        queued = self._queued
        find = self._peers.find
        while queued:
            identity, frames, done, stream = queued.popleft()
            peer = find(identity)
            if done is not None:
                if peer is None:  # dropped while the request ran: its outputs are freed now
                    self.trim_later()
                    continue
                self._peers.settle(peer, done, stream)
            if frames:
                self.send(sock, identity, frames, peer)
            elif stream is _RECHECK and peer is not None:
                peer.backlog.recheck_queued = False
                self._enforce(peer.uid)

    def send(self, sock: zmq.Socket, identity: bytes, frames: list[Any], peer: Peer | None = None) -> None:
        """Send one reply now, counted in ``peer``'s backlog when given."""
        try:
            if peer is None:
                zmqio.send_frames(sock, [identity, *frames], _NOBLOCK)
            else:
                self._send_counted(sock, peer, frames)
        except zmq.Again:
            self.dropped += 1
            log.warning("client %s is not reading its replies; one reply dropped", identity.hex())
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            if self._peers.find(identity) is not None:
                self.trim_later()  # it went away, maybe with replies queued or requests running
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
            if backlog.sent_reply(nbytes, None):
                self._enforce(peer.uid)
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
        if backlog.sent_reply(nbytes, tracker):
            self._enforce(peer.uid)

    # -- cutting clients off ----------------------------------------------------------------------

    def _enforce(self, uid: int) -> None:
        """``uid`` may hold more unsent replies than the budget allows: cut off who holds the most.

        Its clients' backlogs are looked at first (ZeroMQ may have freed replies since they were
        counted); a gRPC stream of the uid that holds the most is told to stop, on its own threads.
        """
        budget = self._budget
        key = None if uid < 0 else uid
        if not budget.over(key):
            return
        peers = self._peers.of_uid(key)
        for peer in peers:
            peer.backlog.pending()
        for _ in range(len(peers) + 1):
            if not budget.over(key):
                return
            heaviest = budget.heaviest(key)
            client = self._peers.find(heaviest.identity) if isinstance(heaviest, ReplyBacklog) else None
            if client is None or client.backlog is not heaviest:
                if heaviest is not None:
                    heaviest.over_budget(budget.why)  # a gRPC stream: it stops on its own
                return
            self._disconnect_slow(client, heaviest.unsent)

    def _disconnect_slow(self, peer: Peer, pending: int) -> None:
        """Shut down the connection of a client that does not read; ZeroMQ then frees its replies.

        Its uid is penalized: a DEALER reconnects by itself and would send the same flood again at once
        (as bench_hostile's nonreading-ipc client does), each time costing the model's queue and a
        burst of memory before the cut-off.
        """
        self.slow_clients += 1
        self._limits.penalize(None if peer.uid < 0 else peer.uid, self._budget.why)
        log.warning(
            "client %s is not reading its replies: %d bytes wait for it, its uid is over "
            "--max-client-reply-bytes (%d); disconnecting it",
            peer.identity.hex(),
            pending,
            self._budget.max_bytes,
        )
        if peer.connection is not None and same_connection(peer.connection):
            refuse_connection(peer.connection[0])
        self._peers.drop(peer.identity, "disconnected for not reading its replies")
        self.trim_later()

    def cut_off_later(self, identity: bytes, frame: zmq.Frame, why: str) -> None:
        """A message was refused after costly work (``why``): close its connection, penalize its uid.

        libzmq hands over only whole messages, so the frames past the frame limit were all received
        and held (about 64 bytes each inside libzmq) before the daemon could see the first; draining
        them costs ~1 us each.  So the client must not do it again: its connection is shut down once
        the error reply has left (:data:`CUT_OFF_DELAY_S`), and its uid's new connections are refused
        for a while (:meth:`~edge_server.limits.Limits.penalize`).
        """
        connection = connection_of(frame)
        uid = connection_uid(connection[0])
        self._limits.penalize(None if uid < 0 else uid, why)
        self._cut_offs.append((time.monotonic() + CUT_OFF_DELAY_S, identity, connection))

    def next_cut_off(self) -> float:
        """When :meth:`cut_off_due` has work next (infinity: none)."""
        return self._cut_offs[0][0] if self._cut_offs else float("inf")

    def cut_off_due(self) -> None:
        now = time.monotonic()
        while self._cut_offs and self._cut_offs[0][0] <= now:
            _due, identity, connection = self._cut_offs.popleft()
            self.cut_off_clients += 1
            log.warning("client %s sent a message over the frame limit; disconnecting it", identity.hex())
            if same_connection(connection):
                refuse_connection(connection[0])
            self._peers.drop(identity, "disconnected for a message over the frame limit")
            self.trim_later()

    def trim_later(self) -> None:
        """Hand the memory of a dropped client's replies and requests back to the system once freed.

        ZeroMQ's I/O thread, pyzmq's collector and the schedulers free them over the next seconds, and
        glibc keeps freed pages in its arenas (measured: 300 x 1-8 MiB requests of a client that went
        away left +70 to +370 MiB resident until a trim): trim 0.25, 1 and 5 s after the last drop.
        """
        self._limits.trimmer.request()
