"""``ModelInfer`` answered by the thread that polls grpc's completion queue: no worker, no hand-off.

grpcio's threaded server costs a unary call four hand-offs between its polling thread and a worker
(the call, its message, its answer, its end): on the 2-core VM that alone was Triton's whole tiny
``ModelInfer`` (a bare server: 627 µs and 423 µs of server CPU per call against 409 µs and 180 µs when
the polling thread answers; bench/bench_kserve_floor.py).  So ``ModelInfer``, the call a camera pipeline
pays per frame, is registered on grpcio's server as a method of our own, and :class:`InferQueue` asks
grpc for its calls on grpcio's own queue with tags that grpcio's loop calls: the message arrives, the
request is decoded and handed to the data plane, and the answer is sent from where it is ready, in this
thread when the model ran inline (:mod:`edge_server.scheduler.inline`), else from the instance's
thread.  Everything else (health, metadata, control, streams) stays on grpcio's workers.

A call counts among the frontend's inference calls from its arrival to its answer, so a client can
hold it with calls it never sends (cancelled past ``--body-timeout-secs``, :class:`_Unread`); a large
answer counts in its user's reply budget until grpc has sent it (:class:`_UnsentAnswer`), so a client
that never reads cannot make the daemon hold answers without bound.

This relies on grpcio's Cython layer (``grpc._cython.cygrpc``, the one grpcio's servers are written
on) and on its threaded server's private state and loop (``_state``; a tag is called with its event
and returns what to take out of ``rpc_states``).  :func:`attach` checks what it uses; where it is not
there, the frontend registers ``ModelInfer`` on grpcio's workers instead, with the same
:class:`InferCalls` work.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from edge_server.errors import EdgeServerError
from edge_server.kserve import grpc_codec
from edge_server.kserve.grpc_wire import parse_infer_request
from edge_server.kserve.service import KServeService, error_status
from edge_server.kserve.shm import Peer, known_uid
from edge_server.limits import Limits
from edge_server.reply_budget import ReplyHolder

if TYPE_CHECKING:
    from edge_server.kserve.grpc_frontend import GrpcFrontend

log = logging.getLogger(__name__)

METHOD = "/inference.GRPCInferenceService/ModelInfer"
#: A call's body of at least this many bytes counts in its user's body budget (with the user's HTTP,
#: IPC and stream bodies), and an answer of that many in its reply budget until grpc has sent it.
#: Smaller bodies are bounded by the frontend's inference count alone (120 x 64 KiB) and skip the uid
#: lookup a count needs: tens of microseconds on a call of a few hundred.
COUNTED_BODY_BYTES = 64 << 10
#: grpcio's text for a message its deserializer refused; clients and tests know it.
UNPARSABLE = "Exception deserializing request!"
#: Why a call whose message did not arrive in time was cancelled (``DEADLINE_EXCEEDED``).
SLOW_MESSAGE = "the request message did not arrive within --body-timeout-secs ({timeout:g} s)"

#: (the serialized answer, None) or (None, (a grpc.StatusCode name, its message))
Reply = Callable[[bytes | None, tuple[str, str] | None], None]


def peer_from(text: str, server_port: int) -> Peer:
    """The client's address from grpc's peer text (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``)."""
    kind, _, rest = text.partition(":")
    host, _, port = rest.rpartition(":")
    if kind not in ("ipv4", "ipv6") or not port.isdigit():
        return Peer("", 0, server_port)
    # grpc does not tell the local address; on one host the client's own address is the one it reached.
    return Peer(host.strip("[]"), int(port), server_port, "")


def _status(exc: BaseException) -> tuple[str, str]:
    _http, code, message = error_status(exc)
    return code, message


class InferCalls:
    """One ``ModelInfer``'s work from its message to its serialized answer, for either server."""

    def __init__(self, service: KServeService, frontend: GrpcFrontend) -> None:
        self.service = service
        self.frontend = frontend

    def admit(self) -> tuple[str, str] | None:
        """Count a call among the frontend's inference calls, before its message is read; or refuse it.

        A refused call's message is never read: a burst past the count costs no memory.
        """
        try:
            self.frontend.take_worker()
        except EdgeServerError as exc:
            return _status(exc)
        return None

    def run(self, data: bytes | None, peer: Peer, reply: Reply) -> None:
        """Answer the admitted call's message ``data`` through ``reply``, exactly once, maybe at once."""
        frontend = self.frontend
        if data is None:  # the client half-closed without a message
            frontend.give_worker()
            reply(None, ("UNIMPLEMENTED", '"ModelInfer" requires exactly one request message.'))
            return
        try:
            wire = parse_infer_request(data)
        except Exception:  # noqa: BLE001 - protobuf's refusal, whatever its type
            frontend.give_worker()
            reply(None, ("INTERNAL", UNPARSABLE))
            return
        release = frontend.give_worker
        try:
            nbytes = len(data)
            if nbytes >= COUNTED_BODY_BYTES:
                body = frontend.limits.hold(known_uid(peer), nbytes)
                release = _both(body.release, frontend.give_worker)
            infer, wants = grpc_codec.decode(self.service, wire.message, peer, wire.raw)
            future = self.service.submit(infer)
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            release()
            reply(None, _status(exc))
            return

        def done(future: Future[dict[str, np.ndarray]]) -> None:
            # the call leaves the count once its answer is with grpc (and, if large, in the reply budget):
            # its memory is counted somewhere all along
            try:
                try:
                    response = grpc_codec.encode(self.service, infer, wants, future.result(), peer)
                    answer = response.SerializeToString()
                except Exception as exc:  # noqa: BLE001
                    reply(None, _status(exc))
                    return
                reply(answer, None)
            finally:
                release()

        if future.done():
            done(future)
        else:
            future.add_done_callback(done)

    def blocking(self, data: bytes, context: grpc.ServicerContext) -> bytes:
        """The handler on grpcio's workers (where :func:`attach` cannot be): the same work, waited for."""
        answered: Future[tuple[bytes | None, tuple[str, str] | None]] = Future()
        refusal = self.admit()
        if refusal is not None:
            context.abort(grpc.StatusCode[refusal[0]], refusal[1])
        peer = peer_from(context.peer() or "", self.frontend.port)
        self.run(data, peer, lambda body, error: answered.set_result((body, error)))
        body, error = answered.result()
        if error is not None:
            context.abort(grpc.StatusCode[error[0]], error[1])
        assert body is not None
        return body


def _both(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def release() -> None:
        try:
            first()
        finally:
            second()

    return release


def _cygrpc() -> Any:
    try:
        from grpc._cython import cygrpc
    except ImportError:
        return None
    needed = (
        "ReceiveMessageOperation",
        "ReceiveCloseOnServerOperation",
        "SendInitialMetadataOperation",
        "SendMessageOperation",
        "SendStatusFromServerOperation",
    )
    return cygrpc if all(hasattr(cygrpc, name) for name in needed) else None


_ITSELF = object()  # a _Tag that is itself taken out of the server's rpc_states when it fails


class _Tag:
    """A batch's tag on grpcio's queue: grpcio's loop calls it with the event and expects (state, callbacks).

    The state it returns is taken out of the server's ``rpc_states``; the server stops only once that
    set is empty, so a call counts there from its arrival to its end (see :class:`InferQueue`).  No tag
    refers to itself: one left over when the server stops must not keep the server alive in a cycle.
    """

    __slots__ = ("handle", "ends")

    def __init__(self, handle: Callable[[Any], object], ends: object = None) -> None:
        self.handle, self.ends = handle, ends

    def __call__(self, event: Any) -> tuple[object, tuple[()]]:
        try:
            ended = self.handle(event)
        except Exception:  # noqa: BLE001 - grpcio's loop must never see an error of ours
            log.exception("gRPC ModelInfer")
            ended = self if self.ends is _ITSELF else self.ends
        return ended, ()


def _ended(event: Any) -> object:
    return event.tag


class _Unread:
    """Admitted calls whose message has not arrived: one still waiting past the body timeout is cancelled.

    A call counts among the inference calls from its arrival (:meth:`InferCalls.admit`), so a client that
    opened calls and never sent their messages would hold the count for as long as it liked; HTTP closes
    such a connection after ``--body-timeout-secs`` and so does this, per call.  One thread looks a few
    times per timeout; a call costs an insertion and a removal here.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._calls: dict[object, tuple[float, Any]] = {}  # by the call's end tag: (deadline, call)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._look, name="edge-grpc-unread", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def add(self, key: object, call: Any) -> None:
        with self._lock:
            self._calls[key] = (time.monotonic() + self.timeout_s, call)

    def take(self, key: object) -> bool:
        """The call's message came (or the call failed): False when it was cancelled here first."""
        with self._lock:
            return self._calls.pop(key, None) is not None

    def _look(self) -> None:
        why = SLOW_MESSAGE.format(timeout=self.timeout_s).encode()
        code = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        while not self._stop.wait(max(0.05, self.timeout_s / 4)):
            now = time.monotonic()
            with self._lock:
                late = [key for key, (deadline, _call) in self._calls.items() if deadline <= now]
                calls = [self._calls.pop(key)[1] for key in late]
            for call in calls:  # its receive then fails: the polling thread gives the count back
                call.cancel(code, why)


class _UnsentAnswer(ReplyHolder):
    """A call's answer that grpc has not sent yet, counted in its user's reply budget (as a stream's are).

    The call leaves the inference count when its answer is handed to grpc; a client that never reads
    would otherwise make the daemon hold every answer it asked for, with no bound at all.
    """

    def __init__(self, uid: int | None, call: Any, limits: Limits, code: int) -> None:
        super().__init__(uid)
        self._call, self._limits, self._code = call, limits, code

    def sent(self, event: Any) -> object:
        """Its batch ended (sent, or the call is over): the call's end tag."""
        self._limits.replies.leave(self)
        return event.tag

    def over_budget(self, why: str) -> None:
        log.warning(
            "gRPC ModelInfer from %s is not reading its answer (%d bytes); its uid is over "
            "--max-client-reply-bytes; cancelling it",
            self._call.peer().decode(errors="replace"),
            self.unsent,
        )
        self._limits.replies.leave(self)
        self._limits.stream_cut_off(self.uid, why)
        self._call.cancel(self._code, why.encode())


class InferQueue:
    """``ModelInfer`` on grpcio's own completion queue, handled by the thread that polls it (see the module).

    One queue and one thread: with a second queue polled by a second thread, grpc core lets either
    thread read a connection, and the call then hops between them (measured: the saving gone).
    """

    def __init__(self, cygrpc: Any, state: Any, started: object, calls: InferCalls) -> None:
        self._cygrpc = cygrpc
        self._state = state  # grpcio's server state: its core server, queue, lock, rpc_states, stage
        self._started = started
        self._calls = calls
        self._ok = grpc.StatusCode.OK.value[0]
        self._codes = {code.name: code.value[0] for code in grpc.StatusCode}
        self._unread = _Unread(calls.frontend.limits.body_timeout_s)
        state.server.register_method(METHOD)

    def start(self) -> None:
        """After the server started: ask for the first call."""
        self._unread.start()
        with self._state.lock:
            self._ask()

    def stop(self) -> None:
        """The server stopped (or never served)."""
        self._unread.stop()

    def _ask(self) -> None:
        """Ask grpc for the next call (under the server's lock); the asking counts until it is answered."""
        state = self._state
        if state.stage is not self._started:
            return
        tag = _Tag(self._arrived, _ITSELF)
        state.rpc_states.add(tag)
        state.server.request_registered_call(state.completion_queue, state.completion_queue, METHOD, tag)

    def _arrived(self, event: Any) -> object:
        ended = event.tag
        if not event.success:  # the server is stopping
            return ended
        call = event.call
        state = self._state
        with state.lock:
            self._ask()
            done = _Tag(_ended, _ITSELF)  # the call's end: its last batch
            state.rpc_states.add(done)
        peer = peer_from(call.peer().decode(errors="replace"), self._calls.frontend.port)
        refusal = self._calls.admit()
        if refusal is not None:
            self._replier(call, done, peer)(None, refusal)
            return ended
        # an operation holds its call's state: a new one per batch, never shared
        receive = (self._cygrpc.ReceiveMessageOperation(0),)
        self._unread.add(done, call)
        call.start_server_batch(receive, _Tag(lambda event: self._received(event, call, peer, done), done))
        return ended

    def _received(self, event: Any, call: Any, peer: Peer, done: _Tag) -> object:
        # cancelled before its message came (by its client, or here: too slow): grpc ended the call
        if not self._unread.take(done) or not event.success:
            self._calls.frontend.give_worker()
            return done
        self._calls.run(event.batch_operations[0].message(), peer, self._replier(call, done, peer))
        return None

    def _replier(self, call: Any, done: _Tag, peer: Peer) -> Reply:
        cygrpc = self._cygrpc

        def reply(body: bytes | None, error: tuple[str, str] | None) -> None:
            over = None
            if error is None:
                assert body is not None
                status = cygrpc.SendStatusFromServerOperation(None, self._ok, b"", 0)
                ops: tuple[Any, ...] = (cygrpc.SendMessageOperation(body, 0), status)
                if len(body) >= COUNTED_BODY_BYTES:
                    over = self._count_answer(call, peer, done, len(body))
            else:
                code, message = error
                details = message.encode(errors="replace")
                ops = (cygrpc.SendStatusFromServerOperation(None, self._codes[code], details, 0),)
            head = cygrpc.SendInitialMetadataOperation(None, 0)
            call.start_server_batch((head, *ops, cygrpc.ReceiveCloseOnServerOperation(0)), done)
            if over is not None:  # its user holds too much: the call or stream holding the most stops
                self._calls.frontend.limits.replies.enforce(over.uid)

        return reply

    def _count_answer(self, call: Any, peer: Peer, done: _Tag, nbytes: int) -> _UnsentAnswer | None:
        """Count an answer in its user's reply budget until its batch ends (``done`` then leaves it).

        Returns it when its user is now over the bound (enforced once the batch is started).
        """
        limits = self._calls.frontend.limits
        uid = known_uid(peer)  # asked of the kernel once per call (a large request asked already)
        holder = _UnsentAnswer(uid, call, limits, self._codes["RESOURCE_EXHAUSTED"])
        done.handle = holder.sent
        return holder if limits.replies.add(holder, nbytes) else None


def attach(server: grpc.Server, calls: InferCalls) -> InferQueue | None:
    """Register ``ModelInfer`` on ``server``'s queue for an :class:`InferQueue` (before the server starts).

    None where grpcio is not as this module needs it; the frontend then registers :meth:`InferCalls.blocking`.
    """
    cygrpc = _cygrpc()
    state = getattr(server, "_state", None)
    stage = getattr(getattr(grpc, "_server", None), "_ServerStage", None)
    needed = ("server", "completion_queue", "lock", "rpc_states", "stage")
    if cygrpc is None or stage is None or state is None or not all(hasattr(state, n) for n in needed):
        log.warning("gRPC: this grpcio's server is not as expected; ModelInfer runs on its workers")
        return None
    return InferQueue(cygrpc, state, stage.STARTED, calls)
