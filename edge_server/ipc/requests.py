"""What the IPC frontend does with one received message: check it, decode it, hand it on, reply.

Checks come before memory is spent: the frame count, the header's size and the message's size, then
the client's and the daemon's in-flight limits, and the message's bytes in its uid's (and the
daemon's) body budget, which HTTP bodies count in too (:meth:`~edge_server.limits.Limits.reserve`:
held until the request is answered, when its inputs are let go); only then the tensors are decoded.  Inference
goes to the data plane; load and unload may take seconds, so they run on a small control executor,
never on the frontend thread; everything else is answered at once.  Requests complete on scheduler
threads, whose done-callbacks encode the reply there (including the copy of an output into the
client's shared memory) and queue it in :class:`~edge_server.ipc.replies.Replies`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

import zmq

from edge_server.authorization import ControlPolicy
from edge_server.errors import (
    EdgeServerError,
    InvalidArgument,
    MalformedMessage,
    MessageTooLarge,
    ServerShuttingDown,
    TooManyRequests,
)
from edge_server.ipc import handlers, protocol
from edge_server.ipc.handoff import FdHandoff
from edge_server.ipc.peers import Peer, PeerTable
from edge_server.ipc.replies import Replies
from edge_server.limits import Limits
from edge_server.request import InferRequest, ResponseSink
from edge_server.scheduler import inline

if TYPE_CHECKING:
    from edge_server.server import Server

log = logging.getLogger(__name__)

_CONTROL_WORKERS = 4


class RequestHandler:
    """Handles each message the frontend thread receives (see the module's docstring).

    ``status`` answers the ``ipc_status`` operation.  ``refusing`` is set when the daemon stops: new
    requests are answered UNAVAILABLE while those in flight finish.
    """

    def __init__(
        self,
        server: Server,
        peers: PeerTable,
        replies: Replies,
        *,
        status: Callable[[], dict[str, Any]],
        control_policy: ControlPolicy,
        max_message_bytes: int,
        max_header_bytes: int,
        max_frames: int,
        max_client_requests: int,
        max_requests: int,
        limits: Limits,
    ) -> None:
        self.server = server
        self._limits = limits
        self._dataplane = server.dataplane
        self._peers = peers
        self._replies = replies
        self._status = status
        self.control_policy = control_policy
        self.max_message_bytes = max_message_bytes
        self.max_header_bytes = min(max_header_bytes, max_message_bytes)
        self.max_frames = max_frames
        self.max_client_requests = max_client_requests
        self.max_requests = max_requests
        self.refusing = False
        self.handoff: FdHandoff | None = None  # descriptor passing, on ipc:// only (set at start)
        self._pack = protocol.packer()  # the frontend thread's own
        # Several: control is locked per model, and one model's slow load must not queue the others'.
        self._control = ThreadPoolExecutor(
            max_workers=_CONTROL_WORKERS, thread_name_prefix="edge-ipc-control"
        )

    def close(self) -> None:
        """Wait for the control operations under way."""
        self._control.shutdown(wait=True)

    def handle(self, sock: zmq.Socket, frames: list[zmq.Frame], dropped: int = 0) -> None:
        """One message: ``frames`` (the client's identity first) and how many past the frame limit."""
        identity = frames[0].bytes
        rid: int | str | None = None
        queue = self._replies.queue
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
                count = len(frames) + dropped - 1
                why = f"sent an IPC message of {count} frames (--max-frames {self.max_frames})"
                self._replies.cut_off_later(identity, head, why)
                raise MalformedMessage(
                    f"the message has {count} frames; a request may have at most "
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
            if rid is None and header.get("id") is not None:
                raise MalformedMessage(f"field 'id' must be an integer or a string, got {header['id']!r}")
            protocol.check_version(header)
            op = header.get("op")
            if type(op) is not str:
                op = protocol.field(header, "op", str)
            peer = self._peers.get(identity, head)
            if op == "infer":
                self._infer(sock, peer, identity, header, frames[2:], total)
                return
            if op == "stream":
                self._stream(peer, identity, rid, header, frames[2:], total)
                return
            if len(frames) > 2:
                raise MalformedMessage(f"operation {op!r} takes no tensor frames, got {len(frames) - 2}")
            if op == "cancel":
                stream = peer.streams.get(header.get("target"))
                if stream is not None:
                    stream.cancel()
                queue(identity, protocol.ok_header(rid, cancelled=stream is not None))
            elif op == "bye":
                released = self._peers.drop(identity, "said bye")
                queue(identity, protocol.ok_header(rid, unregistered=released))
            elif op == "ipc_status":
                queue(identity, protocol.ok_header(rid, ipc=self._status()))
            elif op == "live":
                # Clients ask this first on every connection and keep the limit: a request over twice
                # it would make ZeroMQ drop the connection (ZMQ_MAXMSGSIZE) instead of getting an answer.
                queue(identity, protocol.ok_header(rid, live=True, max_message_bytes=self.max_message_bytes))
            elif op == "ready" and header.get("model") is not None:
                ready = handlers.model_ready(self.server, header)
                ready.add_done_callback(partial(self._ready_done, identity, rid))
            elif op in handlers.SLOW_OPS:
                self.control_policy.authorize(None if peer.uid < 0 else peer.uid, f"operation {op!r}")
                future = self._control.submit(
                    handlers.control, self.server, peer.registry, op, header, self.handoff
                )
                future.add_done_callback(partial(self._control_done, identity, rid))
            else:
                reply = handlers.control(self.server, peer.registry, op, header, self.handoff)
                queue(identity, protocol.ok_header(rid, **reply))
        except EdgeServerError as exc:
            queue(identity, protocol.error_header(rid, exc))
        except Exception as exc:
            log.exception("IPC request from %s failed unexpectedly", identity.hex())
            queue(identity, protocol.error_header(rid, EdgeServerError(f"internal error: {exc!r}")))

    def _admit(self, peer: Peer) -> None:
        """Refuse a request over the client's or the daemon's in-flight limit, before it is decoded."""
        if self.refusing:
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

    def _reserve(self, peer: Peer, nbytes: int) -> Callable[[], None]:
        """Count a request's ``nbytes`` in its uid's body budget; the callable gives them back."""
        return self._limits.hold(None if peer.uid < 0 else peer.uid, nbytes).release

    def _infer(
        self, sock: zmq.Socket, peer: Peer, identity: bytes, header: dict, frames: list, nbytes: int
    ) -> None:
        self._admit(peer)
        release = self._reserve(peer, nbytes)
        try:
            request, ctx = _decode(peer, header, frames)
            future = self._dataplane.run_here(request, inline.FRONTEND)
        except BaseException:
            release()
            raise
        if future.done():  # it ran on this thread: answer now (its error raises), nothing to track
            release()
            self._replies.send(sock, identity, handlers.encode_result(ctx, future.result(), self._pack), peer)
            return
        self._peers.track(peer, future)
        future.add_done_callback(partial(self._infer_done, identity, ctx, release))

    def _stream(
        self, peer: Peer, identity: bytes, rid: int | str | None, header: dict, frames: list, nbytes: int
    ) -> None:
        self._admit(peer)
        release = self._reserve(peer, nbytes)
        try:
            request, ctx = _decode(peer, header, frames)
            if ctx.shm_outputs:
                raise InvalidArgument("the responses of a stream travel inline; leave out 'shm' in 'outputs'")
            if rid is None or rid in peer.streams:
                raise MalformedMessage("a stream needs an 'id' of its own, not one of a stream still open")
            sink = IpcStream(self._replies, identity, ctx, release)
            self._dataplane.stream(request, sink)
        except BaseException:
            release()
            raise
        # Even if it already finished: its final reply is taken off on this thread, after this.
        self._peers.track(peer, (rid, sink))

    def _infer_done(
        self, identity: bytes, ctx: handlers.InferContext, release: Callable[[], None], future: Future
    ) -> None:
        """Runs on the scheduler thread that finished the request: encode here, send on the frontend."""
        release()  # the request's inputs are let go: its body no longer counts
        self._replies.put(identity, _reply_frames(ctx, future), future)

    def _ready_done(self, identity: bytes, rid: int | str | None, ready: Future[bool]) -> None:
        self._replies.put(identity, [protocol.pack(protocol.ok_header(rid, ready=ready.result()))])

    def _control_done(self, identity: bytes, rid: int | str | None, future: Future) -> None:
        try:
            header = protocol.ok_header(rid, **future.result())
        except Exception as exc:
            header = protocol.error_header(rid, as_error(exc))
        self._replies.put(identity, [protocol.pack(header)])


def _decode(peer: Peer, header: dict, frames: list) -> tuple[InferRequest, handlers.InferContext]:
    """The request of an infer or stream message, marked as ``peer``'s (its turn, its sequences)."""
    request, ctx = handlers.decode_infer(header, frames, peer.registry)
    request.client = peer.client  # its turn in the queue (scheduler.queue)
    if request.correlation_id:
        request.owner = peer.uid  # the sequence belongs to this user (scheduler.sequence)
    return request, ctx


def _reply_frames(ctx: handlers.InferContext, future: Future) -> list[Any]:
    if future.cancelled():
        return []  # a cancelled request's client is gone: nothing to send
    try:
        return handlers.encode_result(ctx, future.result())
    except Exception as exc:
        return [protocol.pack(protocol.error_header(ctx.rid, as_error(exc)))]


class IpcStream(ResponseSink):
    """The responses of one ``stream`` request, encoded on the model's thread and sent by the frontend.

    ``release`` gives the request's body back to the budget at its final response (delivered or not).
    """

    def __init__(
        self, replies: Replies, identity: bytes, ctx: handlers.InferContext, release: Callable[[], None]
    ) -> None:
        super().__init__()
        self.replies = replies
        self.identity = identity
        self.ctx = ctx
        self.on_final = release

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
            frames = [protocol.pack({**protocol.error_header(rid, as_error(exc)), "final": final})]
        if final:
            self.replies.put(self.identity, frames, self, rid)
        else:
            self.replies.put(self.identity, frames)


def as_error(exc: BaseException) -> EdgeServerError:
    if isinstance(exc, EdgeServerError):
        return exc
    log.error("unexpected error from the data plane: %r", exc, exc_info=exc)
    return EdgeServerError(f"internal error: {exc!r}")
