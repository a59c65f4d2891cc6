"""What the frontend remembers about each connected client, and how it notices one has gone.

A ROUTER socket does not say which client disconnected.  The frontend learns it three ways, all
ending in :meth:`PeerTable.drop` (unmap every region of that client, cancel its queued requests):

* the client says ``bye`` when it closes (the normal case, immediate);
* a reply or probe to it fails with EHOSTUNREACH (the socket runs with ZMQ_ROUTER_MANDATORY, so
  ZeroMQ reports a vanished peer instead of silently dropping the message);
* probes: after the socket monitor reports any disconnect, and every ``probe_interval`` for clients
  idle that long, each client that still holds regions or requests gets a ``ping`` message (clients
  ignore it).  A live client, even an idle one, keeps its regions; a dead one is dropped.

Clients that hold nothing are simply forgotten when idle.  All of it runs on the frontend thread.

Each peer also counts the bytes of replies handed to ZeroMQ that it has not taken yet
(:class:`ReplyBacklog`), in its uid's share of the daemon's :class:`~edge_server.reply_budget.ReplyBudget`
(with the uid's gRPC streams): the frontend disconnects the client that holds the most once its uid
passes ``--max-client-reply-bytes``, so that one that asks and never reads cannot pin the daemon's
memory, however many connections it opens.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import struct
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import zmq

from edge_server.ipc import protocol
from edge_server.reply_budget import ReplyBudget, ReplyHolder
from edge_server.request import ClientKey, ResponseSink, client_key
from edge_server.shm import ClientRegions, Owner, Registry

log = logging.getLogger(__name__)

# After a disconnect event ZeroMQ may not yet have removed the peer's pipe; probing a moment later
# makes EHOSTUNREACH reliable.
DISCONNECT_PROBE_DELAY = 0.2


#: Untracked (copied, small) reply bytes after which the next reply carries a tracked marker frame.
MARK_EVERY_BYTES = 1 << 20


class ReplyBacklog(ReplyHolder):
    """Bytes of replies sent to one client that ZeroMQ still holds (queued, not yet written to it).

    ZeroMQ says when a zero-copy frame is freed (pyzmq's ``MessageTracker``), and it writes one
    connection's messages in order; so a tracked frame that is freed means every reply sent before it
    is gone too.  Replies with a frame of at least ZeroMQ's copy threshold are sent zero-copy and
    tracked anyway; among small replies (copied by ZeroMQ) one in every :data:`MARK_EVERY_BYTES` gets
    a tracked header.  The backlog is then exact to within that, at the cost of one tracker per MiB.
    What is freed is learnt when :meth:`pending` looks, so the budget may count a little too much
    until then (the frontend looks before it cuts anyone off).
    """

    def __init__(
        self, budget: ReplyBudget, uid: int, identity: bytes, on_over: Callable[[bytes], None]
    ) -> None:
        super().__init__(uid)
        self._budget = budget
        self.identity = identity
        self._on_over = on_over
        self.recheck_queued = False  # the frontend thread was asked to look at this client's uid
        self._marks: collections.deque[tuple[zmq.MessageTracker, int]] = collections.deque()
        self.sent = 0  # bytes of replies handed to ZeroMQ
        self.freed = 0  # of which ZeroMQ has freed at least this many
        self._since_mark = 0

    def over_budget(self, why: str) -> None:
        if not self.recheck_queued:  # the frontend thread looks again and cuts it off if still over
            self.recheck_queued = True
            self._on_over(self.identity)

    def wants_mark(self, nbytes: int) -> bool:
        """Whether the next reply (of ``nbytes``) should carry a tracked frame although it is small."""
        return self._since_mark + nbytes >= MARK_EVERY_BYTES

    def sent_reply(self, nbytes: int, tracker: zmq.MessageTracker | None) -> bool:
        """Count a reply handed to ZeroMQ; True: its uid now holds more than the budget allows."""
        self.sent += nbytes
        if tracker is None:
            self._since_mark += nbytes
        else:
            self._since_mark = 0
            self._marks.append((tracker, self.sent))
        return self._budget.add(self, nbytes)

    def pending(self) -> int:
        """Bytes still held for this client (at most :data:`MARK_EVERY_BYTES` over the truth)."""
        marks = self._marks
        freed = self.freed
        while marks and marks[0][0].done:
            freed = marks.popleft()[1]
        if not marks:
            freed = self.sent - self._since_mark
        if freed != self.freed:
            self._budget.sent(self, freed - self.freed)
            self.freed = freed
        return self.sent - freed

    def __bool__(self) -> bool:
        """Whether a tracked reply is still held (small untracked rest: not enough to keep a peer)."""
        self.pending()
        return bool(self._marks)


@dataclass(eq=False)
class Peer:
    identity: bytes
    registry: ClientRegions  # its shared-memory regions: owned by its uid and this connection
    last_seen: float
    backlog: ReplyBacklog  # its replies ZeroMQ still holds, in its uid's reply budget
    in_flight: set[Future] = field(default_factory=set)
    streams: dict[Any, ResponseSink] = field(default_factory=dict)  # open streams by request id
    #: its connection (ZMQ_SRCFD and the socket's inode, to be sure the number was not reused);
    #: None: not asked yet, (-1, -1): libzmq did not say
    connection: tuple[int, int] | None = None
    #: the client's uid (SO_PEERCRED), asked with ``connection``; -1 where there is none (tcp://)
    uid: int = -1
    #: who its requests come from, for the scheduler's turns (``request.client_key``)
    client: ClientKey | None = None

    @property
    def holds_state(self) -> bool:
        return bool(self.in_flight) or bool(self.streams) or len(self.registry) > 0 or bool(self.backlog)


class PeerTable:
    """The IPC clients known.

    ``replies``: the daemon's reply budget; ``on_over``: a client's uid went over it (called with the
    identity of the client holding the most, on any thread).
    """

    def __init__(
        self,
        *,
        probe_interval: float,
        replies: ReplyBudget,
        on_over: Callable[[bytes], None],
        max_client_regions: int = protocol.DEFAULT_MAX_CLIENT_REGIONS,
    ) -> None:
        self._probe_interval = probe_interval
        self._replies = replies
        self._on_over = on_over
        # Every IPC client's regions, each owned by its connection; the daemon-wide bound is the
        # descriptor budget (set when the frontend starts).
        self.shm = Registry(max_regions=1 << 30, max_per_user=None, max_per_client=max_client_regions)
        self._peers: dict[bytes, Peer] = {}
        self._next_sweep = time.monotonic() + probe_interval
        self._probe_all_at: float | None = None
        self.dropped = 0  # clients whose state was released because they vanished or said bye
        self.requests = 0  # requests in flight and streams open, over every client still known

    def track(self, peer: Peer, request: Future | tuple[Any, ResponseSink]) -> None:
        """Count a request the client waits for: a future, or ``(stream id, sink)``."""
        if isinstance(request, tuple):
            peer.streams[request[0]] = request[1]
        else:
            peer.in_flight.add(request)
        self.requests += 1

    def settle(self, peer: Peer, request: Future | ResponseSink, stream_id: Any = None) -> None:
        """The reply to ``request`` leaves: it no longer counts against the client or the daemon."""
        if isinstance(request, Future):
            if request in peer.in_flight:
                peer.in_flight.discard(request)
                self.requests -= 1
        elif peer.streams.pop(stream_id, None) is not None:
            self.requests -= 1

    def __len__(self) -> int:
        return len(self._peers)

    def get(self, identity: bytes, frame: zmq.Frame | None = None) -> Peer:
        """The client ``identity``; a new one is owned by the uid of the connection ``frame`` came on."""
        peer = self._peers.get(identity)
        now = time.monotonic()
        if peer is None:
            connection = connection_of(frame) if frame is not None else None
            uid = connection_uid(connection[0]) if connection is not None else -1
            owner = Owner(uid, identity)
            peer = Peer(
                identity=identity,
                registry=self.shm.client(owner),
                last_seen=now,
                backlog=ReplyBacklog(self._replies, uid, identity, self._on_over),
                connection=connection,
                uid=uid,
                client=client_key(uid, identity),
            )
            self._peers[identity] = peer
        else:
            peer.last_seen = now
        return peer

    def find(self, identity: bytes) -> Peer | None:
        return self._peers.get(identity)

    def of_uid(self, uid: int | None) -> list[Peer]:
        """The clients of ``uid`` (None: those whose uid is unknown)."""
        return [p for p in self._peers.values() if p.backlog.uid == uid]

    def busy(self) -> bool:
        """Whether any client still waits for a reply."""
        return self.requests > 0

    def region_count(self) -> int:
        return self.shm.count()

    def drop(self, identity: bytes, why: str) -> list[str]:
        """Forget a client: unmap its regions and cancel what it still has queued."""
        peer = self._peers.pop(identity, None)
        if peer is None:
            return []
        self._replies.leave(peer.backlog)  # ZeroMQ frees what it still holds with the connection
        self.requests -= len(peer.in_flight) + len(peer.streams)
        cancelled = sum(1 for f in list(peer.in_flight) if f.cancel())
        for stream in peer.streams.values():
            stream.cancel()  # the model sees is_cancelled(); its further responses are dropped
        peer.streams.clear()
        releases = len(peer.registry) > 0 or bool(peer.in_flight)
        if releases:  # counted first: a status read from another thread that sees its regions gone
            self.dropped += 1  # sees the client released too
        names = peer.registry.unregister(None)
        if releases:
            log.info(
                "client %s %s: released %d shared-memory regions, cancelled %d of %d queued requests",
                identity.hex(),
                why,
                len(names),
                cancelled,
                len(peer.in_flight),
            )
        peer.in_flight.clear()
        return names

    def disconnect_seen(self) -> None:
        """The socket monitor saw some connection close; probe everyone who holds state shortly."""
        when = time.monotonic() + DISCONNECT_PROBE_DELAY
        if self._probe_all_at is None or when < self._probe_all_at:
            self._probe_all_at = when

    def next_deadline(self) -> float:
        if self._probe_all_at is not None:
            return min(self._probe_all_at, self._next_sweep)
        return self._next_sweep

    def due_probes(self) -> list[bytes]:
        """Clients to probe now; forgets idle clients that hold nothing."""
        now = time.monotonic()
        probe_all = self._probe_all_at is not None and now >= self._probe_all_at
        sweep = now >= self._next_sweep
        if not probe_all and not sweep:
            return []
        if probe_all:
            self._probe_all_at = None
        if sweep:
            self._next_sweep = now + self._probe_interval
        idle_before = now - self._probe_interval
        due: list[bytes] = []
        for identity, peer in list(self._peers.items()):
            if not peer.holds_state:
                if peer.last_seen < idle_before:
                    del self._peers[identity]
                    self._replies.leave(peer.backlog)
                continue
            if probe_all or peer.last_seen < idle_before:
                due.append(identity)
        return due

    def total_backlog(self) -> int:
        """Bytes of replies ZeroMQ holds for every client, as last looked (any thread: no refresh)."""
        return sum(p.backlog.unsent for p in list(self._peers.values()))

    def close(self) -> None:
        for identity in list(self._peers):
            self.drop(identity, "released at shutdown")


def connection_of(frame: zmq.Frame) -> tuple[int, int]:
    """(descriptor, inode) of the connection ``frame`` came on; (-1, -1) where libzmq does not say."""
    try:
        fd = frame.get(zmq.SRCFD)
        return fd, os.fstat(fd).st_ino
    except (OSError, zmq.ZMQError):
        return -1, -1


_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def connection_uid(fd: int) -> int:
    """The uid of the process at the other end of Unix socket ``fd`` (SO_PEERCRED); -1 if none (TCP)."""
    if fd < 0:
        return -1
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:
            if conn.family != socket.AF_UNIX:
                return -1
            _pid, uid, _gid = _CREDS.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
            )
    except OSError:
        return -1
    return int(uid)


def same_connection(connection: tuple[int, int]) -> bool:
    """Whether descriptor ``connection[0]`` is still the socket it was (numbers are reused)."""
    if connection[0] < 0:
        return False
    try:
        return os.fstat(connection[0]).st_ino == connection[1]
    except OSError:
        return False
