"""What the sync and asyncio clients share: everything but the I/O.

Each client call is written once here, as a generator of :class:`Control` requests: it yields the
request it needs answered, is sent the decoded result, and returns the call's result (or does the
bookkeeping, like the shared-memory calls).  :class:`edge_server.client.Client` runs these steps with
blocking round trips, :class:`edge_server.client.AsyncClient` with awaited ones; the header a call
sends, how its reply is unpacked and what it remembers afterwards exist only here.

Also shared: the DEALER socket's options, the id counter, the message-size limit (the client's own
and the one the daemon announces in its ``live`` reply), and building infer requests.
"""

from __future__ import annotations

import itertools
import logging
import operator
import sys
import threading
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict, TypeVar

import zmq

from edge_server.client import _wire
from edge_server.client.shm import SharedMemoryRegion, ShmRing, stride
from edge_server.errors import EdgeServerError, InvalidArgument, MessageTooLarge, ShmUnavailable
from edge_server.ipc import protocol
from edge_server.ipc.addresses import client_address, ipc_path
from edge_server.ipc.handoff import hand_over, handoff_path

log = logging.getLogger(__name__)

T = TypeVar("T")
S = TypeVar("S", bound="zmq.Socket[Any]")
Decoder = Callable[[dict[str, Any], list[Any]], Any]


# pyzmq names a monitor endpoint after the socket's file descriptor, and descriptors are reused after
# a socket is collected: a name of our own per socket instead.
_MONITORS = itertools.count(1)


def dealer(ctx: zmq.Context[S], address: str) -> tuple[S, S]:
    """The client's DEALER socket, connected, and its monitor (handshakes and disconnects)."""
    sock = ctx.socket(zmq.DEALER)
    # ZMQ_IMMEDIATE stays off: with it on, ZeroMQ discards replies still unread when the connection
    # drops, and a graceful daemon stop sends its last replies just before closing.  Sends are held
    # back by the client itself while the monitor says it is disconnected.
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.setsockopt(zmq.RCVHWM, 10_000)
    sock.setsockopt(zmq.RECONNECT_IVL, 20)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED,
        addr=f"inproc://edge-monitor-{next(_MONITORS)}",
    )
    sock.connect(address)
    return sock, monitor


def register_fields(address: str, region: SharedMemoryRegion) -> dict[str, Any]:
    """The ``shm_register`` fields for ``region``, after handing its descriptor to the daemon.

    The daemon never opens segments by name; the descriptor (passed over the hand-off socket beside
    the IPC socket) proves this client may use the memory, and the token ties it to this request.
    """
    path = ipc_path(address)
    if path is None:
        raise ShmUnavailable(
            f"shared memory needs an ipc:// address (descriptor passing); {address} is not one"
        )
    token = hand_over(handoff_path(path), region.fd)
    return {"name": region.name, "byte_size": region.byte_size, "token": token}


def reply_header(frames: list[Any]) -> dict[str, Any] | None:
    """A reply's header, or None (logged) for a first frame that is not our protocol."""
    try:
        return protocol.unpack(frames[0])
    except EdgeServerError as exc:
        log.warning("ignoring a reply that is not protocol: %s", exc.message)
        return None


def reregistrations(
    address: str, regions: Iterable[SharedMemoryRegion], ids: Iterator[int]
) -> list[tuple[int, list[Any], str]]:
    """(id, frames, region name) of the ``shm_register`` messages that register ``regions`` again.

    What a client sends first to a daemon that restarted (it knows none of them); a region that
    cannot be handed over any more is logged and left out.
    """
    messages = []
    for region in regions:
        try:
            fields = register_fields(address, region)
        except EdgeServerError as exc:
            log.warning("could not re-register region %s after reconnecting: %s", region.name, exc.message)
            continue
        rid = next(ids)
        messages.append((rid, _wire.control_message(rid, "shm_register", **fields), region.name))
    return messages


class MessageLimit:
    """The largest request this client sends: its own cap, and the daemon's once it has said it.

    The daemon answers a request over its ``--max-message-bytes`` with MESSAGE_TOO_LARGE, but ZeroMQ
    drops the connection of a peer whose single frame is over twice that, before the daemon sees it.
    So the client asks the daemon's limit (``live``) first on every connection, holds requests until the
    answer comes, and refuses larger ones itself.
    """

    __slots__ = ("own", "daemon", "allowed")

    def __init__(self, own: int | None) -> None:
        self.own = own
        self.daemon: int | None = None
        self.allowed = sys.maxsize  # min of the known limits, read on the send path
        self._update()

    def learned(self, daemon: Any) -> None:
        """The daemon's limit from a ``live`` reply (None: not known, e.g. a new connection)."""
        valid = isinstance(daemon, int) and not isinstance(daemon, bool) and daemon > 0
        self.daemon = daemon if valid else None
        self._update()

    def capped(self, own: int | None) -> None:
        """Set the client's own cap (None: none)."""
        self.own = own
        self._update()

    def _update(self) -> None:
        limits = [v for v in (self.own, self.daemon) if v is not None]
        self.allowed = min(limits) if limits else sys.maxsize

    def check(self, nbytes: int) -> None:
        if nbytes <= self.allowed:
            return
        if self.daemon is not None and self.daemon == self.allowed:
            whose = f"the daemon accepts at most {self.daemon} (its --max-message-bytes)"
        else:
            whose = f"this client's max_message_bytes is {self.allowed}"
        raise MessageTooLarge(
            f"the request has {nbytes} bytes; {whose}: pass large tensors through shared memory "
            "(create_shm_region)"
        )


def daemon_limit(header: dict[str, Any], frames: list[Any]) -> Any:
    """Decoder of the ``live`` reply a client sends first on each connection."""
    return header.get("max_message_bytes")


def reply_outcome(
    header: dict[str, Any], frames: list[Any], decode: Decoder
) -> tuple[Any, BaseException | None]:
    """(value, None) for an ok reply, decoded; (None, error) for an error or a reply that fails to decode."""
    if header.get("ok") is not True:
        return None, protocol.error_from_wire(header.get("error"))
    if header.get("final") is True and "outputs" not in header:
        return None, None  # a stream's bare final flag: no response of its own
    try:
        return decode(header, frames), None
    except EdgeServerError as exc:
        return None, exc


def queue_timeout_us(value: int | None) -> int | None:
    """The infer header's ``timeout_us``: sent only when the caller asks for a queue timeout.

    It is not the reply timeout: a model's ``default_timeout_microseconds`` stays in force unless the
    caller overrides it on purpose (and the model's queue policy allows that).
    """
    if value is None:
        return None
    try:
        us = operator.index(value)
    except TypeError:
        raise InvalidArgument(f"queue_timeout_us must be an integer, got {value!r}") from None
    if us < 0 or isinstance(value, bool):
        raise InvalidArgument(f"queue_timeout_us must be a non-negative integer, got {value!r}")
    return us


class InferOptions(TypedDict, total=False):
    """The keyword arguments of ``infer``, ``submit`` and ``stream`` on both clients.

    ``timeout``: seconds to wait for the reply (for a stream: for each response); the client's patience
    only.  ``queue_timeout_us``: ask the daemon to give up on the request after that long in the
    model's queue (where its queue policy allows an override).  ``parameters``: str -> bool/int/str,
    handed to the model.  ``sequence_id``/``sequence_start``/``sequence_end``: Triton's sequence fields.
    ``classification``: output name -> N, that output comes back as its top N classes (Triton's
    classification extension: BYTES ``"score:index:label"``, see edge_server.classification).
    """

    version: int | None
    outputs: _wire.Outputs
    priority: int
    timeout: float | None
    queue_timeout_us: int | None
    parameters: Mapping[str, bool | int | str] | None
    sequence_id: int | str | None
    sequence_start: bool
    sequence_end: bool
    classification: Mapping[str, int] | None


@dataclass(frozen=True, slots=True)
class Control:
    """One control request: its op and fields, its reply timeout, and the reply field it returns."""

    op: str
    fields: dict[str, Any]
    timeout: float | None
    key: str | None = None  # the reply header field that is the result; None: no result

    def frames(self, rid: int) -> list[Any]:
        return _wire.control_message(rid, self.op, **self.fields)

    def decode(self, header: dict[str, Any], frames: list[Any]) -> Any:
        return header.get(self.key) if self.key else None


@dataclass(slots=True)
class Request:
    """An infer request ready to queue."""

    rid: int
    frames: list[Any]
    nbytes: int
    decode: Decoder
    timeout: float | None


Steps = Generator[Control, Any, T]


class ClientBase:
    """State and call logic of both clients; subclasses run the :data:`Steps` with their I/O."""

    def __init__(
        self,
        address: str | None,
        *,
        timeout: float | None,
        control_timeout: float | None,
        max_message_bytes: int | None,
        shm_prefix: str,
    ) -> None:
        self.address = address or client_address()
        self.timeout = timeout
        self.control_timeout = control_timeout
        self.shm_prefix = shm_prefix
        self._limit = MessageLimit(max_message_bytes)
        self._ids: Iterator[int] = itertools.count(1)  # next() on it is atomic: threads may share it
        self._regions: dict[str, SharedMemoryRegion] = {}  # registered: registered again on reconnect
        self._owned: dict[str, SharedMemoryRegion] = {}  # created by this client: unlinked at close
        self._packers = threading.local()  # one msgpack packer per calling thread

    @property
    def max_message_bytes(self) -> int | None:
        """The client's own cap on a request's size (None: only the daemon's limit applies)."""
        return self._limit.own

    @max_message_bytes.setter
    def max_message_bytes(self, value: int | None) -> None:
        self._limit.capped(value)

    # -- building requests ----------------------------------------------------------------------

    def _packer(self) -> protocol.Pack:
        """The calling thread's msgpack packer: threads may share a client, a packer is not thread-safe."""
        try:
            return self._packers.pack  # type: ignore[no-any-return]
        except AttributeError:
            self._packers.pack = protocol.packer()
            return self._packers.pack  # type: ignore[no-any-return]

    def _reply_timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _infer_request(
        self, model: str, inputs: Mapping[str, Any], options: InferOptions, op: str = "infer"
    ) -> Request:
        rid = next(self._ids)
        queue_timeout = options.get("queue_timeout_us")
        extra: dict[str, Any] = {}
        parameters = options.get("parameters")
        if parameters:
            extra["parameters"] = dict(parameters)
        if options.get("sequence_id") is not None:
            extra["sequence_id"] = options["sequence_id"]
        for flag in ("sequence_start", "sequence_end"):
            if options.get(flag):
                extra[flag] = True
        counts = options.get("classification")
        if counts:
            extra["classification"] = dict(counts)
        frames, nbytes = _wire.infer_message(
            rid,
            model,
            inputs,
            version=options.get("version"),
            outputs=options.get("outputs"),
            priority=options.get("priority", 0),
            timeout_us=None if queue_timeout is None else queue_timeout_us(queue_timeout),
            pack=self._packer(),
            op=op,
            extra=extra,
        )
        if nbytes > self._limit.allowed:  # checked again before sending, once the daemon's is known
            self._limit.check(nbytes)
        regions = self._regions
        return Request(
            rid,
            frames,
            nbytes,
            lambda h, f: _wire.infer_outputs(h, f, regions),
            self._reply_timeout(options.get("timeout")),
        )

    def _control(self, op: str, key: str | None, timeout: float | None, **fields: Any) -> Control:
        return Control(op, fields, timeout, key)

    # -- the calls, once for both clients -------------------------------------------------------

    def _live(self, timeout: float | None) -> Steps[bool]:
        return bool((yield self._control("live", "live", self._reply_timeout(timeout))))

    def _ready(self, name: str | None, version: int | None, timeout: float | None) -> Steps[bool]:
        control = self._control("ready", "ready", self._reply_timeout(timeout), model=name, version=version)
        return bool((yield control))

    def _models(self) -> Steps[list[dict[str, Any]]]:
        return list((yield self._control("models", "models", self.timeout)))

    def _model_config(self, name: str, version: int | None) -> Steps[dict[str, Any]]:
        return dict((yield self._control("config", "config", self.timeout, model=name, version=version)))

    def _model_metadata(self, name: str, version: int | None) -> Steps[dict[str, Any]]:
        control = self._control("metadata", "metadata", self.timeout, model=name, version=version)
        return dict((yield control))

    def _statistics(self, name: str | None, version: int | None) -> Steps[list[dict[str, Any]]]:
        return list((yield self._control("stats", "stats", self.timeout, model=name, version=version)))

    def _load_model(self, name: str, timeout: float | None) -> Steps[list[dict[str, Any]]]:
        return list((yield self._control("load", "models", timeout or self.control_timeout, model=name)))

    def _unload_model(self, name: str, timeout: float | None) -> Steps[None]:
        yield self._control("unload", None, timeout or self.control_timeout, model=name)

    def _register_shm(self, region: SharedMemoryRegion) -> Steps[None]:
        yield self._control("shm_register", None, self.timeout, **register_fields(self.address, region))
        self._regions[region.name] = region

    def _unregister_shm(self, region: SharedMemoryRegion | str | None) -> Steps[list[str]]:
        name = region.name if isinstance(region, SharedMemoryRegion) else region
        names = list((yield self._control("shm_unregister", "unregistered", self.timeout, name=name)))
        for key in names:
            self._regions.pop(key, None)
        return names

    def _shm_status(self) -> Steps[list[dict[str, Any]]]:
        return list((yield self._control("shm_status", "regions", self.timeout)))

    def _status(self) -> Steps[dict[str, Any]]:
        return dict((yield self._control("status", "status", self.timeout)))

    def _ipc_status(self) -> Steps[dict[str, Any]]:
        return dict((yield self._control("ipc_status", "ipc", self.timeout)))

    def _create_shm_region(self, byte_size: int, name: str | None) -> Steps[SharedMemoryRegion]:
        region = SharedMemoryRegion(byte_size, name=name, prefix=self.shm_prefix)
        try:
            yield from self._register_shm(region)
        except BaseException:
            region.close()
            raise
        self._owned[region.name] = region
        return region

    def _release_shm(self, region: SharedMemoryRegion) -> Steps[None]:
        try:
            if region.name in self._regions:
                yield from self._unregister_shm(region)
        finally:
            self._owned.pop(region.name, None)
            region.close()

    def _create_shm_ring(self, n: int, byte_size: int) -> Steps[ShmRing]:
        region = yield from self._create_shm_region(stride(byte_size) * n, None)
        return ShmRing(region, n, byte_size, releaser=self._ring_releaser)

    def _ring_releaser(self, region: SharedMemoryRegion) -> None:
        """What ``ShmRing.close()`` calls: unregister and unlink, without an event loop to await on."""
        raise NotImplementedError

    def _bye(self) -> Control:
        return self._control("bye", None, 1.0)

    def _forget_regions(self) -> None:
        """At close: unlink what this client created (the daemon unmapped it at bye or disconnect)."""
        for region in self._owned.values():
            region.close()
        self._owned.clear()
        self._regions.clear()
