"""One budget of descriptors and request memory that every way in asks before it spends them.

Every listener (IPC, KServe HTTP, gRPC, the metrics endpoint) turns a client's connection into a
descriptor and a client's body into memory.  When each counted only its own, a local user could fill
the daemon's descriptors through HTTP and the next IPC ``accept`` made libzmq abort the process
(EMFILE), or pin hundreds of MiB with bodies that never finish.  So one :class:`Limits` object, built
once at start-up and handed to every frontend, holds:

* the descriptor budget: connections of every listener together, at most
  :attr:`Limits.max_connections` (``--max-connections``, and never more than the descriptors left after
  a reserve), and at most :attr:`Limits.max_client_connections` for one uid
  (``--max-client-connections``), so that one local user cannot lock everyone else out.  A listener asks
  :meth:`Limits.connect` when it accepts and refuses (closes) the connection there when told no
  (gRPC's port too, accepted by the daemon and handed to grpc); where grpc must accept by itself, its
  share is set aside whole (:meth:`Limits.set_aside`), since grpc then takes only a cap on its total;
* the memory budget of request bodies while they arrive and until they are answered
  (:meth:`Limits.reserve`; HTTP bodies as they arrive, IPC messages and gRPC stream requests once
  libzmq or grpc hands them over, :meth:`Limits.hold`): all
  clients together at most ``--max-body-bytes-in-flight``, one uid at most ``--max-client-body-bytes``;
* the timeouts every listener applies: a connection must send its request headers within
  ``--header-timeout-secs`` and its body within ``--body-timeout-secs``, and one idle that long
  between requests (``--idle-timeout-secs``) is closed;
* gRPC streams one uid may hold open (``--max-client-streams``);
* the replies produced for a uid and not yet taken, over IPC and gRPC together, at most
  ``--max-client-reply-bytes`` (:attr:`Limits.replies`, a :class:`~edge_server.reply_budget.ReplyBudget`);
* the penalty box (:meth:`Limits.penalize`): a uid whose request cost the daemon much work before it
  could be refused (a gzip body inflating to a JSON bomb, an IPC message of a million frames) has its
  connections refused, and its compressed bodies answered 503 unread, for :data:`PENALTY_S` seconds,
  doubling with each repeat up to :data:`MAX_PENALTY_S`.  Refusing is cheap; the work was not, and a
  client could repeat it as fast as the daemon refuses.  The daemon's own uid and unknown peers
  (``None``: remote TCP clients, who share it) are never penalized.

A peer whose uid is unknown (a TCP client on another host) counts under ``None``: such peers share one
client's caps.  Everything here is thread-safe: listeners run on threads and event loops of their own.
"""

from __future__ import annotations

import argparse
import os
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edge_server import flag_types
from edge_server.errors import Unavailable
from edge_server.memory import DAEMON_TRIM_DELAYS, TRIM_AFTER_BYTES, DeferredTrim
from edge_server.reply_budget import ReplyBudget

#: Descriptors kept free for everything but connections and regions: models, files, hand-offs, and
#: the connections the kernel queued before a listener could refuse them.
FD_RESERVE = 320
#: Connections at most, whatever the descriptor limit (libzmq and the event loops stay quick below it).
MAX_CONNECTIONS = 4096

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_IDLE_TIMEOUT_S = 30.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_BODY_BYTES_IN_FLIGHT = 256 << 20
DEFAULT_MAX_CLIENT_BODY_BYTES = 128 << 20
DEFAULT_MAX_CLIENT_STREAMS = 32
DEFAULT_MAX_CLIENT_REQUESTS = 1024
DEFAULT_MAX_CLIENT_REPLY_BYTES = 256 << 20
#: Connections the metrics endpoint serves at once (one thread each); Prometheus needs one.
METRICS_CONNECTIONS = 8
#: A penalized uid's first penalty; each repeat within :data:`MAX_PENALTY_S` of the last doubles it.
PENALTY_S = 1.0
MAX_PENALTY_S = 60.0


@dataclass(frozen=True)
class LimitOptions:
    """The flags, as given (0: derived from the descriptor budget at start-up)."""

    max_connections: int = 0
    max_client_connections: int = 0
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_body_bytes_in_flight: int = DEFAULT_MAX_BODY_BYTES_IN_FLIGHT
    max_client_body_bytes: int = DEFAULT_MAX_CLIENT_BODY_BYTES
    max_client_streams: int = DEFAULT_MAX_CLIENT_STREAMS
    # --max-client-requests (IPC's, and each gRPC stream's) and --max-client-reply-bytes (per uid)
    max_client_requests: int = DEFAULT_MAX_CLIENT_REQUESTS
    max_client_reply_bytes: int = DEFAULT_MAX_CLIENT_REPLY_BYTES


def descriptor_room() -> int:
    """Descriptors for connections and for shared-memory regions, each (after raising the soft limit).

    libzmq aborts the whole process when ``accept`` fails with EMFILE, so the daemon raises its soft
    descriptor limit to the hard one and keeps connections and regions within what is left after
    :data:`FD_RESERVE`, half for each.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return max(16, (min(soft, 1 << 20) - FD_RESERVE) // 2)


@dataclass(frozen=True)
class Connection:
    """One connection counted by :meth:`Limits.connect`: whose, and why it is refused (None: admitted)."""

    uid: int | None
    refusal: str | None


class BodyHold:
    """One request's body, counted by :meth:`Limits.hold` until :meth:`release` (called once or more).

    No heap trim follows: the frames of an IPC message are libzmq's, reused while its client sends on.
    """

    __slots__ = ("_limits", "_uid", "_nbytes")

    def __init__(self, limits: Limits, uid: int | None, nbytes: int) -> None:
        self._limits = limits
        self._uid = uid
        self._nbytes = nbytes

    def release(self) -> None:
        """Give the bytes back; once, whichever threads call it (a final response and an error path)."""
        with self._limits._lock:
            nbytes, self._nbytes = self._nbytes, 0
        if nbytes:
            self._limits.release(self._uid, nbytes, trim=False)


class Limits:
    """The daemon's one descriptor and memory budget (see the module's docstring)."""

    def __init__(self, options: LimitOptions | None = None, trimmer: DeferredTrim | None = None) -> None:
        """``trimmer``: the daemon's heap trim, shared with its data plane (one of its own without)."""
        options = options or LimitOptions()
        self.options = options
        self.regions = descriptor_room()
        room = min(self.regions, MAX_CONNECTIONS)
        self.max_connections = min(room, options.max_connections) if options.max_connections > 0 else room
        self.max_client_connections = (
            min(options.max_client_connections, self.max_connections)
            if options.max_client_connections > 0
            else min(self.max_connections, max(64, self.max_connections // 4))
        )
        self.header_timeout_s = options.header_timeout_s
        self.idle_timeout_s = options.idle_timeout_s
        self.body_timeout_s = options.body_timeout_s
        self.max_body_bytes = options.max_body_bytes_in_flight
        self.max_client_body_bytes = options.max_client_body_bytes
        self.max_client_streams = options.max_client_streams
        self.max_client_requests = options.max_client_requests
        self.max_client_reply_bytes = options.max_client_reply_bytes
        self.replies = ReplyBudget(options.max_client_reply_bytes)
        self._lock = threading.Lock()
        self._aside = 0  # connections set aside for listeners that accept by themselves (gRPC)
        self._connections = 0
        self._by_uid: dict[int | None, int] = {}
        self._bodies = 0
        self._body_by_uid: dict[int | None, int] = {}
        self._streams: dict[int | None, int] = {}
        self._watchers: list[Callable[[], None]] = []
        self._penalties: dict[int, tuple[float, float, str]] = {}  # uid: (until, seconds, why)
        self._own_uid = os.geteuid()
        self.refused_connections = 0
        self.refused_bodies = 0
        self.refused_streams = 0
        self.cut_off_streams = (
            0  # gRPC streams and ModelInfer calls cancelled for not reading their responses
        )
        self.penalized = 0  # penalties given (see penalize)
        #: gives freed memory back to the system a while after a client's large buffers go (every listener)
        self.trimmer = trimmer or DeferredTrim(DAEMON_TRIM_DELAYS)

    # -- descriptors --------------------------------------------------------------------------------

    def set_aside(self, wanted: int) -> int:
        """Take up to ``wanted`` connections out of the shared pool for one listener; returns how many.

        For gRPC, whose server accepts on its own threads and takes only a total cap
        (``grpc.max_allowed_incoming_connections``).  At least half the pool stays shared.
        """
        with self._lock:
            given = max(1, min(wanted, (self.max_connections - self._aside) // 2))
            self._aside += given
            return given

    def connect(self, uid: int | None) -> Connection:
        """Count one accepted connection of ``uid``; its ``refusal`` says why it must be closed, if so.

        A refused connection holds its descriptor until it is closed, so it counts in :meth:`full` until
        the listener calls :meth:`disconnect` for it too: a burst of refusals cannot exhaust the
        descriptors while the listener is still closing them.
        """
        penalty = self.penalty(uid)
        with self._lock:
            held = self._by_uid.get(uid, 0)
            refusal = None
            if penalty is not None:
                refusal = penalty
            elif self._connections + self._aside >= self.max_connections:
                refusal = (
                    f"the daemon holds {self._connections + self._aside} connections, its limit "
                    "(--max-connections or the descriptor budget)"
                )
            elif held >= self.max_client_connections:
                refusal = (
                    f"uid {uid} holds {held} connections, the limit for one user (--max-client-connections)"
                )
            else:
                self._by_uid[uid] = held + 1
            if refusal is not None:
                self.refused_connections += 1
            self._connections += 1
            full = self._connections + self._aside >= self.max_connections
        if full:
            self._notify()
        return Connection(uid, refusal)

    def disconnect(self, connection: Connection) -> None:
        """A connection counted by :meth:`connect` closed (call it once, refused or not)."""
        with self._lock:
            was_full = self._connections + self._aside >= self.max_connections
            self._connections -= 1
            if connection.refusal is None:
                held = self._by_uid.get(connection.uid, 0) - 1
                if held > 0:
                    self._by_uid[connection.uid] = held
                else:
                    self._by_uid.pop(connection.uid, None)
        if was_full:
            self._notify()

    def full(self) -> bool:
        """Whether every connection of the budget is taken (IPC stops listening while it is)."""
        return self._connections + self._aside >= self.max_connections

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on any thread, no lock held) when :meth:`full` may have changed."""
        with self._lock:
            self._watchers.append(callback)

    def _notify(self) -> None:
        for callback in list(self._watchers):
            callback()

    # -- memory -------------------------------------------------------------------------------------

    def reserve(self, uid: int | None, nbytes: int) -> str | None:
        """Count ``nbytes`` more of ``uid``'s bodies in flight; or, over a cap, why not (not counted)."""
        with self._lock:
            held = self._body_by_uid.get(uid, 0)
            if held + nbytes > self.max_client_body_bytes:
                self.refused_bodies += 1
                return (
                    f"uid {uid} has {held} bytes of request bodies arriving; {nbytes} more would pass the "
                    f"limit for one user of {self.max_client_body_bytes} (--max-client-body-bytes)"
                )
            if self._bodies + nbytes > self.max_body_bytes:
                self.refused_bodies += 1
                return (
                    f"the daemon has {self._bodies} bytes of request bodies arriving; {nbytes} more would "
                    f"pass its limit of {self.max_body_bytes} (--max-body-bytes-in-flight)"
                )
            self._body_by_uid[uid] = held + nbytes
            self._bodies += nbytes
        return None

    def hold(self, uid: int | None, nbytes: int) -> BodyHold:
        """:meth:`reserve` for one whole request (IPC, gRPC streams); raises UNAVAILABLE (HTTP's 503)."""
        refusal = self.reserve(uid, nbytes)
        if refusal is not None:
            raise Unavailable(refusal)
        return BodyHold(self, uid, nbytes)

    def room(self, uid: int | None) -> int:
        """Bytes :meth:`reserve` would grant ``uid`` now (for inflating a compressed body no further)."""
        with self._lock:
            return max(
                0,
                min(
                    self.max_client_body_bytes - self._body_by_uid.get(uid, 0),
                    self.max_body_bytes - self._bodies,
                ),
            )

    def release(self, uid: int | None, nbytes: int, *, trim: bool = True) -> None:
        """Bytes counted by :meth:`reserve` are spent (the request was answered, or its connection closed).

        ``trim``: ask for a heap trim after a large one (an HTTP body: Python's buffers; not an IPC
        message, whose frames libzmq frees and reuses while its client keeps sending).
        """
        if nbytes <= 0:
            return
        with self._lock:
            held = self._body_by_uid.get(uid, 0) - nbytes
            if held > 0:
                self._body_by_uid[uid] = held
            else:
                self._body_by_uid.pop(uid, None)
            self._bodies -= nbytes
        if trim and nbytes >= TRIM_AFTER_BYTES:  # a large body's pages go back once its request is done
            self.trimmer.request()

    # -- penalties ----------------------------------------------------------------------------------

    def penalize(self, uid: int | None, why: str) -> None:
        """``uid`` made the daemon work for a request it then refused: refuse its costly requests a while.

        ``why`` says what it sent; :meth:`penalty` quotes it.  The daemon's own uid and ``None`` are
        never penalized.
        """
        if uid is None or uid == self._own_uid:
            return
        now = time.monotonic()
        with self._lock:
            until, seconds, _why = self._penalties.get(uid, (0.0, 0.0, ""))
            repeat = seconds > 0 and now < until + MAX_PENALTY_S
            seconds = min(MAX_PENALTY_S, 2 * seconds) if repeat else PENALTY_S
            self._penalties[uid] = (now + seconds, seconds, why)
            self.penalized += 1
            for other in [u for u, (end, _s, _w) in self._penalties.items() if end + MAX_PENALTY_S < now]:
                del self._penalties[other]  # long expired: its next offence starts from the first penalty

    def penalty(self, uid: int | None) -> str | None:
        """Why ``uid``'s costly requests and new connections are refused now; None when they are not."""
        if uid is None or not self._penalties:
            return None
        with self._lock:
            entry = self._penalties.get(uid)
        if entry is None:
            return None
        until, seconds, why = entry
        left = until - time.monotonic()
        if left <= 0:
            return None
        return (
            f"uid {uid} {why}; its connections and compressed request bodies are refused for "
            f"{seconds:g} s ({left:.1f} s left)"
        )

    # -- streams ------------------------------------------------------------------------------------

    def open_stream(self, uid: int | None) -> str | None:
        """Count one open gRPC stream of ``uid``; or, over its cap, why not."""
        with self._lock:
            held = self._streams.get(uid, 0)
            if held >= self.max_client_streams:
                self.refused_streams += 1
                return f"uid {uid} holds {held} open streams, the limit for one user (--max-client-streams)"
            self._streams[uid] = held + 1
        return None

    def stream_cut_off(self, uid: int | None, why: str) -> None:
        """A gRPC stream or ``ModelInfer`` call was cut off for not reading its answers: penalize its uid."""
        with self._lock:
            self.cut_off_streams += 1
        self.penalize(uid, why)  # as over IPC: its client would open the next stream at once
        self.trimmer.request()  # its replies are freed as grpc drops them

    def close_stream(self, uid: int | None) -> None:
        with self._lock:
            held = self._streams.get(uid, 0) - 1
            if held > 0:
                self._streams[uid] = held
            else:
                self._streams.pop(uid, None)

    def status(self) -> dict[str, Any]:
        """Counters for status lines and tests."""
        with self._lock:
            return {
                "connections": self._connections,
                "connections_set_aside": self._aside,
                "max_connections": self.max_connections,
                "max_client_connections": self.max_client_connections,
                "refused_connections": self.refused_connections,
                "body_bytes_in_flight": self._bodies,
                "refused_bodies": self.refused_bodies,
                "streams": sum(self._streams.values()),
                "refused_streams": self.refused_streams,
                "cut_off_streams": self.cut_off_streams,
                "penalized": self.penalized,
            }


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of :class:`LimitOptions`: every listener's budget, in one place."""
    group = parser.add_argument_group("limits of every listener (IPC, HTTP, gRPC, metrics)")
    group.add_argument(
        "--max-connections",
        type=flag_types.positive,
        default=None,
        help="connections of every listener together (default: as many as the descriptor budget allows, "
        f"at most {MAX_CONNECTIONS})",
    )
    group.add_argument(
        "--max-client-connections",
        type=flag_types.positive,
        default=None,
        help="connections one user (uid) may hold over every listener (default: a quarter of the total, "
        "at least 64)",
    )
    group.add_argument(
        "--header-timeout-secs",
        type=flag_types.seconds,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="HTTP and metrics: a connection that has not sent its request headers by then is closed",
    )
    group.add_argument(
        "--body-timeout-secs",
        type=flag_types.seconds,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="HTTP: a request whose body has not arrived whole by then is closed; gRPC: a ModelInfer call "
        "whose message has not is cancelled (DEADLINE_EXCEEDED)",
    )
    group.add_argument(
        "--idle-timeout-secs",
        type=flag_types.seconds,
        default=DEFAULT_IDLE_TIMEOUT_S,
        help="HTTP, gRPC and metrics: a connection idle that long between requests is closed",
    )
    group.add_argument(
        "--max-body-bytes-in-flight",
        type=flag_types.positive,
        default=DEFAULT_MAX_BODY_BYTES_IN_FLIGHT,
        help="HTTP, IPC and gRPC (unary bodies from 64 KiB): bytes of request bodies in flight from all "
        "clients together; more are refused (503, UNAVAILABLE)",
    )
    group.add_argument(
        "--max-client-body-bytes",
        type=flag_types.positive,
        default=DEFAULT_MAX_CLIENT_BODY_BYTES,
        help="HTTP, IPC and gRPC (unary bodies from 64 KiB): bytes of request bodies in flight from one "
        "user (uid); more are refused (503, UNAVAILABLE)",
    )
    group.add_argument(
        "--max-client-streams",
        type=flag_types.positive,
        default=DEFAULT_MAX_CLIENT_STREAMS,
        help="gRPC: ModelStreamInfer streams one user (uid) may hold open; more are refused",
    )


def limit_options(args: Any) -> LimitOptions:
    return LimitOptions(
        max_connections=args.max_connections or 0,
        max_client_connections=args.max_client_connections or 0,
        header_timeout_s=args.header_timeout_secs,
        idle_timeout_s=args.idle_timeout_secs,
        body_timeout_s=args.body_timeout_secs,
        max_body_bytes_in_flight=args.max_body_bytes_in_flight,
        max_client_body_bytes=args.max_client_body_bytes,
        max_client_streams=args.max_client_streams,
        max_client_requests=args.max_client_requests,
        max_client_reply_bytes=args.max_client_reply_bytes,
    )
