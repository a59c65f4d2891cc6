"""The synchronous client: one DEALER socket, many requests in flight, no thread hop on the fast path.

The socket machinery (leader election, reconnection) is in :mod:`edge_server.client._transport`; what
each call sends and returns is in :mod:`edge_server.client._common`, shared with the asyncio client.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from edge_server.client._call import Call, StreamCall
from edge_server.client._common import ClientBase, Control, InferOptions, Request, Steps, T
from edge_server.client._transport import Transport
from edge_server.client.shm import SharedMemoryRegion, ShmRing
from edge_server.errors import EdgeServerError
from edge_server.ipc import protocol
from edge_server.streaming import StreamReader

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger(__name__)


class ResponseStream(StreamReader):
    """The responses of one ``Client.stream`` call, as an iterator (see :meth:`Client.stream`)."""

    def __init__(self, transport: Transport, call: StreamCall, timeout: float | None) -> None:
        self._t = transport
        self._call = call
        self._timeout = timeout
        self._done = False

    def __iter__(self) -> ResponseStream:
        return self

    def __next__(self) -> dict[str, Any]:
        while not self._done:
            value = self._take(self._t.next_response(self._call, self._timeout))
            if value is not None:
                return value  # type: ignore[no-any-return]
        raise StopIteration

    def close(self) -> None:
        """Stop reading; the daemon cancels the request (the model sees ``is_cancelled()``)."""
        if not self._done:
            self._done = True
            self._t.cancel_stream(self._call)

    def __enter__(self) -> ResponseStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Client(ClientBase):
    """Talk to a running edge-server daemon over its IPC socket.

    ``timeout`` (seconds, None: wait forever) is how long a call waits for its reply, the default for
    every call; each call may pass its own.  It is the client's patience only: the daemon is not told
    (``queue_timeout_us`` on :meth:`infer` asks for a server-side queue timeout).
    ``max_message_bytes`` caps a request's size on top of the daemon's ``--max-message-bytes``, which
    the client learns on connecting (None: the daemon's limit alone).

    Output arrays are views over the received message (no copy; yours to modify), or, for outputs requested
    into shared memory, views into your region.  Don't modify an input array until its request is
    answered: its bytes are sent without a copy.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout: float | None = 60.0,
        control_timeout: float | None = 600.0,
        max_message_bytes: int | None = None,
        shm_prefix: str = protocol.DEFAULT_SHM_PREFIX,
    ) -> None:
        super().__init__(
            address,
            timeout=timeout,
            control_timeout=control_timeout,
            max_message_bytes=max_message_bytes,
            shm_prefix=shm_prefix,
        )
        self._t = Transport(self.address, limit=self._limit, regions=self._regions, ids=self._ids)

    # -- running the shared call steps ----------------------------------------------------------

    def _run(self, steps: Steps[T]) -> T:
        """Answer each control request ``steps`` yields with a blocking round trip."""
        try:
            control = next(steps)
            while True:
                try:
                    result = self._round_trip(control)
                except BaseException as exc:
                    control = steps.throw(exc)
                else:
                    control = steps.send(result)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    def _round_trip(self, control: Control) -> Any:
        rid = next(self._ids)
        return self._t.wait(self._t.enqueue(rid, control.frames(rid), control.decode, control.timeout))

    # -- inference ------------------------------------------------------------------------------

    def submit(
        self, model: str, inputs: Mapping[str, Any], **options: Unpack[InferOptions]
    ) -> Future[dict[str, Any]]:
        """Send a request and return at once; keep hundreds in flight from one thread."""
        call = self._queue(self._infer_request(model, inputs, options), future=True)
        self._t.kick()
        assert call.future is not None
        return call.future

    def infer(self, model: str, inputs: Mapping[str, Any], **options: Unpack[InferOptions]) -> dict[str, Any]:
        """Run one request and return its outputs; raises the daemon's error as an EdgeServerError.

        ``options`` (all optional): ``version``, ``outputs`` (names, or name -> ShmRef), ``priority``,
        ``timeout`` (seconds to wait for the reply; default: the client's), ``queue_timeout_us`` (ask
        the daemon to give up on the request after that long in the model's queue, where the model's
        queue policy allows an override; it then answers TIMEOUT), ``parameters`` (str -> bool, int
        or str, handed to the model), ``sequence_id``, ``sequence_start``, ``sequence_end``.
        """
        request = self._infer_request(model, inputs, options)
        return self._t.wait(self._queue(request))  # type: ignore[no-any-return]

    def stream(
        self, model: str, inputs: Mapping[str, Any], **options: Unpack[InferOptions]
    ) -> ResponseStream:
        """Send a request whose responses are streamed (a decoupled model: zero, one or many).

        Iterate the result: each response's outputs as a dict; an error response raises its error
        from ``next()`` (the stream may go on); the final response ends the iteration.  ``close()``
        (or leaving a ``with`` block) stops early and tells the daemon to cancel the request.
        ``timeout`` bounds the wait for each response.  Outputs travel inline.
        """
        request = self._infer_request(model, inputs, options, op="stream")
        call = self._t.enqueue_stream(request.rid, request.frames, request.decode, request.nbytes)
        self._t.kick()
        return ResponseStream(self._t, call, request.timeout)

    def _queue(self, request: Request, *, future: bool = False) -> Call:
        return self._t.enqueue(
            request.rid, request.frames, request.decode, request.timeout, request.nbytes, future=future
        )

    # -- control --------------------------------------------------------------------------------

    def server_live(self, *, timeout: float | None = None) -> bool:
        return self._run(self._live(timeout))

    def server_ready(self, *, timeout: float | None = None) -> bool:
        return self._run(self._ready(None, None, timeout))

    def model_ready(self, name: str, version: int | None = None, *, timeout: float | None = None) -> bool:
        return self._run(self._ready(name, version, timeout))

    def models(self) -> list[dict[str, Any]]:
        """Every model version the daemon knows: ``{"name", "version", "state", "reason"}``."""
        return self._run(self._models())

    def model_config(self, name: str, version: int | None = None) -> dict[str, Any]:
        return self._run(self._model_config(name, version))

    def model_metadata(self, name: str, version: int | None = None) -> dict[str, Any]:
        return self._run(self._model_metadata(name, version))

    def statistics(self, name: str | None = None, version: int | None = None) -> list[dict[str, Any]]:
        return self._run(self._statistics(name, version))

    def load_model(self, name: str, *, timeout: float | None = None) -> list[dict[str, Any]]:
        """Load or reload ``name`` from the repository (daemon in explicit or poll mode)."""
        return self._run(self._load_model(name, timeout))

    def unload_model(self, name: str, *, timeout: float | None = None) -> None:
        self._run(self._unload_model(name, timeout))

    # -- shared memory --------------------------------------------------------------------------

    def register_shm(self, region: SharedMemoryRegion) -> None:
        """Let the daemon map ``region`` (created by you; you keep owning and unlinking it)."""
        self._run(self._register_shm(region))

    def unregister_shm(self, region: SharedMemoryRegion | str | None = None) -> list[str]:
        """Let the daemon unmap one region (None: all of this client's); returns the names."""
        return self._run(self._unregister_shm(region))

    def shm_status(self) -> list[dict[str, Any]]:
        """The regions this client has registered, as the daemon sees them."""
        return self._run(self._shm_status())

    def status(self) -> dict[str, Any]:
        """The daemon's state, uptime, repository and per-model figures (``edge-server status``)."""
        return self._run(self._status())

    def ipc_status(self) -> dict[str, Any]:
        """clients, regions, released_clients, dropped_replies, and the daemon's max_message_bytes."""
        return self._run(self._ipc_status())

    def create_shm_region(self, byte_size: int, *, name: str | None = None) -> SharedMemoryRegion:
        """Create a segment under the daemon's prefix and register it; unlinked by :meth:`close`."""
        return self._run(self._create_shm_region(byte_size, name))

    def release_shm(self, region: SharedMemoryRegion) -> None:
        """Unregister ``region`` and unlink it."""
        self._run(self._release_shm(region))

    def create_shm_ring(self, n: int, byte_size: int) -> ShmRing:
        """``n`` slots of ``byte_size`` bytes in one registered region, for a camera loop.

        ``ring.close()`` unregisters and unlinks it (through :meth:`release_shm`).
        """
        return self._run(self._create_shm_ring(n, byte_size))

    def _ring_releaser(self, region: SharedMemoryRegion) -> None:
        self.release_shm(region)

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Say bye (the daemon unmaps our regions at once), unlink our regions, close the socket."""
        if self._t.closed:
            return
        try:
            if self._t.connected():
                self._round_trip(self._bye())
        except EdgeServerError as exc:
            log.debug("bye was not answered: %s", exc.message)
        finally:
            self._t.close()
            self._forget_regions()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
