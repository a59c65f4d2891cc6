"""The asyncio client: the same calls as :class:`edge_server.client.Client`, as coroutines.

One reader task owns receiving; sends happen in the calling coroutine (all on the event loop's
thread, so the socket is never shared between threads).  Many requests are in flight at once with
``asyncio.gather`` or tasks.  What each call sends and returns is in :mod:`edge_server.client._common`,
shared with the sync client.

Connecting works as in the sync client: on every connection the regions this client registered are
registered again and the daemon is asked (``live``) for its message-size limit before any request is
sent; requests already sent when the daemon goes away fail with ConnectionLost, later ones wait for
the new connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from edge_server.client import _wire
from edge_server.client._common import (
    ClientBase,
    Control,
    Decoder,
    InferOptions,
    Steps,
    T,
    daemon_limit,
    dealer,
    reply_header,
    reply_outcome,
    reregistrations,
)
from edge_server.client.shm import SharedMemoryRegion, ShmRing
from edge_server.errors import Cancelled, ConnectionLost, EdgeServerError, ReplyTimeout
from edge_server.ipc import protocol
from edge_server.streaming import StreamReader

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger(__name__)


_StreamItem = tuple[Any, BaseException | None, bool]


class _Pending:
    __slots__ = ("future", "decode", "sent", "responses")

    def __init__(
        self,
        future: asyncio.Future[Any],
        decode: Decoder,
        responses: asyncio.Queue[_StreamItem] | None = None,
    ) -> None:
        self.future = future
        self.decode = decode
        self.sent = False
        self.responses = responses  # a stream's: its responses until the final one


class AsyncResponseStream(StreamReader):
    """The responses of one ``AsyncClient.stream`` call: ``async for outputs in stream``."""

    def __init__(self, client: AsyncClient, rid: int, pending: _Pending, timeout: float | None) -> None:
        assert pending.responses is not None
        self._client = client
        self._rid = rid
        self._responses = pending.responses
        self._timeout = timeout
        self._done = False

    def __aiter__(self) -> AsyncResponseStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        while not self._done:
            try:
                item = await asyncio.wait_for(self._responses.get(), self._timeout)
            except asyncio.TimeoutError:
                raise ReplyTimeout(f"no response within {self._timeout} s") from None
            value = self._take(item)
            if value is not None:
                return value  # type: ignore[no-any-return]
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Stop reading; the daemon cancels the request (the model sees ``is_cancelled()``)."""
        if not self._done:
            self._done = True
            await self._client._cancel_stream(self._rid)

    async def __aenter__(self) -> AsyncResponseStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncClient(ClientBase):
    """asyncio client of a running daemon; create it inside the event loop that uses it.

    ``timeout``, ``control_timeout`` and ``max_message_bytes`` mean what they mean for
    :class:`~edge_server.client.Client`.
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
        self._ctx = zmq.asyncio.Context(io_threads=1)
        self._sock, self._monitor = dealer(self._ctx, self.address)
        self._pending: dict[int, _Pending] = {}
        self._can_send = asyncio.Event()  # connected, and the daemon's limit asked for
        self._epoch = 0  # connections seen to drop: a late answer to an old greeting is ignored
        self._was_connected = False
        self._reader: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._greeter: asyncio.Task[None] | None = None
        self._closed = False

    # -- plumbing -------------------------------------------------------------------------------

    async def _call(
        self, frames: list[Any], rid: int, decode: Decoder, timeout: float | None, nbytes: int = 0
    ) -> Any:
        if self._closed:
            raise Cancelled("the client is closed")
        loop = asyncio.get_running_loop()
        pending = _Pending(loop.create_future(), decode)
        self._pending[rid] = pending
        # call_later instead of wait_for: no extra task per request on the hot path.
        timer = loop.call_later(timeout, self._expire, rid) if timeout is not None else None
        try:
            await self._send_when_ready(frames, nbytes, pending)
            return await pending.future
        finally:
            self._pending.pop(rid, None)
            if timer is not None:
                timer.cancel()

    async def _send_when_ready(self, frames: list[Any], nbytes: int, pending: _Pending) -> None:
        """Send once connected and the daemon's limit is known; give up if ``pending`` ends first."""
        loop = asyncio.get_running_loop()
        if self._reader is None:
            self._reader = loop.create_task(self._read())
            self._watcher = loop.create_task(self._watch())
        while True:
            if self._can_send.is_set():
                if nbytes > self._limit.allowed:
                    self._limit.check(nbytes)  # over the daemon's limit, learned since it was built
                if await self._try_send(frames):
                    break
            if pending.future.done():
                return
            waiter = loop.create_task(self._can_send.wait())
            await asyncio.wait([waiter, pending.future], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        pending.sent = True

    async def _cancel_stream(self, rid: int) -> None:
        pending = self._pending.pop(rid, None)
        if pending is not None and pending.sent and not self._closed:
            await self._try_send(_wire.control_message(next(self._ids), "cancel", target=rid))

    async def _try_send(self, frames: list[Any]) -> bool:
        try:
            await self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            await asyncio.sleep(0.001)  # the connection went away, or the queue is full
            return False
        return True

    def _expire(self, rid: int) -> None:
        pending = self._pending.pop(rid, None)
        if pending is not None and not pending.future.done():
            hint = "" if self._can_send.is_set() else " (not connected: is the daemon running?)"
            pending.future.set_exception(ReplyTimeout(f"no reply from {self.address} in time{hint}"))

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            header = reply_header(frames)
            if header is None:
                continue
            rid = header.get("id")
            if not isinstance(rid, int):
                continue  # a ping
            pending = self._pending.get(rid)
            if pending is None or pending.future.done():
                continue  # a ping, a re-registration, or the reply to a request that timed out
            value, error = reply_outcome(header, frames[1:], pending.decode)
            if pending.responses is not None:
                final = header.get("final", True) is not False
                if final:
                    del self._pending[rid]
                pending.responses.put_nowait((value, error, final))
                continue
            del self._pending[rid]
            if error is not None:
                pending.future.set_exception(error)
            else:
                pending.future.set_result(value)

    async def _watch(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._can_send.clear()
                self._epoch += 1
                # Replies that arrived before the connection closed still count: let the reader take them.
                for _ in range(10_000):
                    if not cast(int, self._sock.get(zmq.EVENTS)) & zmq.POLLIN:
                        break
                    await asyncio.sleep(0)
                for rid, pending in list(self._pending.items()):
                    if pending.sent and not pending.future.done():
                        del self._pending[rid]
                        lost = ConnectionLost(f"the daemon at {self.address} went away before replying")
                        if pending.responses is not None:
                            pending.responses.put_nowait((None, lost, True))
                        else:
                            pending.future.set_exception(lost)
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._limit.learned(None)
                if self._was_connected:
                    await self._reregister()
                self._was_connected = True
                # A task of its own: this one must go on watching while the greeting waits for its reply.
                self._greeter = asyncio.get_running_loop().create_task(self._greet(self._epoch))

    async def _reregister(self) -> None:
        """A new daemon knows none of our regions: register them before anything else is sent."""
        for _, frames, name in reregistrations(self.address, self._regions.values(), self._ids):
            if not await self._try_send(frames):
                log.warning("could not re-register region %s after reconnecting", name)

    async def _greet(self, epoch: int) -> None:
        """Ask the daemon just connected to for its message-size limit, then let requests go."""
        rid = next(self._ids)
        pending = _Pending(asyncio.get_running_loop().create_future(), daemon_limit)
        self._pending[rid] = pending
        frames = _wire.control_message(rid, "live")
        try:
            while not await self._try_send(frames):
                if epoch != self._epoch:
                    return  # gone again; the next handshake greets anew
            pending.sent = True
            try:
                limit = await pending.future
            except ConnectionLost:
                return
            except EdgeServerError as exc:  # carry on with our own limit; the daemon still checks
                log.debug("the daemon's message limit is unknown: %s", exc.message)
                limit = None
        finally:
            self._pending.pop(rid, None)
        if epoch == self._epoch:
            self._limit.learned(limit)
            self._can_send.set()

    # -- running the shared call steps ----------------------------------------------------------

    async def _run(self, steps: Steps[T]) -> T:
        """Answer each control request ``steps`` yields with an awaited round trip."""
        try:
            control = next(steps)
            while True:
                try:
                    result = await self._round_trip(control)
                except BaseException as exc:
                    control = steps.throw(exc)
                else:
                    control = steps.send(result)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    async def _round_trip(self, control: Control) -> Any:
        rid = next(self._ids)
        return await self._call(control.frames(rid), rid, control.decode, control.timeout)

    # -- inference ------------------------------------------------------------------------------

    async def infer(
        self, model: str, inputs: Mapping[str, Any], **options: Unpack[InferOptions]
    ) -> dict[str, Any]:
        """Run one request; await many of these at once to keep requests in flight.

        ``options`` as for :meth:`edge_server.client.Client.infer`.
        """
        r = self._infer_request(model, inputs, options)
        return await self._call(r.frames, r.rid, r.decode, r.timeout, r.nbytes)  # type: ignore[no-any-return]

    async def stream(
        self, model: str, inputs: Mapping[str, Any], **options: Unpack[InferOptions]
    ) -> AsyncResponseStream:
        """Send a streamed request; ``async for outputs in await client.stream(...)``.

        As :meth:`edge_server.client.Client.stream`: errors raise from ``__anext__``, the final
        response ends the iteration, ``aclose()`` cancels, ``timeout`` bounds each wait.
        """
        if self._closed:
            raise Cancelled("the client is closed")
        r = self._infer_request(model, inputs, options, op="stream")
        loop = asyncio.get_running_loop()
        pending = _Pending(loop.create_future(), r.decode, asyncio.Queue())
        self._pending[r.rid] = pending
        await self._send_when_ready(r.frames, r.nbytes, pending)
        return AsyncResponseStream(self, r.rid, pending, r.timeout)

    # -- control --------------------------------------------------------------------------------

    async def server_live(self, *, timeout: float | None = None) -> bool:
        return await self._run(self._live(timeout))

    async def server_ready(self, *, timeout: float | None = None) -> bool:
        return await self._run(self._ready(None, None, timeout))

    async def model_ready(
        self, name: str, version: int | None = None, *, timeout: float | None = None
    ) -> bool:
        return await self._run(self._ready(name, version, timeout))

    async def models(self) -> list[dict[str, Any]]:
        return await self._run(self._models())

    async def model_config(self, name: str, version: int | None = None) -> dict[str, Any]:
        return await self._run(self._model_config(name, version))

    async def model_metadata(self, name: str, version: int | None = None) -> dict[str, Any]:
        return await self._run(self._model_metadata(name, version))

    async def statistics(self, name: str | None = None, version: int | None = None) -> list[dict[str, Any]]:
        return await self._run(self._statistics(name, version))

    async def load_model(self, name: str, *, timeout: float | None = None) -> list[dict[str, Any]]:
        return await self._run(self._load_model(name, timeout))

    async def unload_model(self, name: str, *, timeout: float | None = None) -> None:
        await self._run(self._unload_model(name, timeout))

    # -- shared memory --------------------------------------------------------------------------

    async def register_shm(self, region: SharedMemoryRegion) -> None:
        await self._run(self._register_shm(region))

    async def unregister_shm(self, region: SharedMemoryRegion | str | None = None) -> list[str]:
        return await self._run(self._unregister_shm(region))

    async def shm_status(self) -> list[dict[str, Any]]:
        return await self._run(self._shm_status())

    async def status(self) -> dict[str, Any]:
        return await self._run(self._status())

    async def ipc_status(self) -> dict[str, Any]:
        return await self._run(self._ipc_status())

    async def create_shm_region(self, byte_size: int, *, name: str | None = None) -> SharedMemoryRegion:
        return await self._run(self._create_shm_region(byte_size, name))

    async def release_shm(self, region: SharedMemoryRegion) -> None:
        await self._run(self._release_shm(region))

    async def create_shm_ring(self, n: int, byte_size: int) -> ShmRing:
        """A ring for a camera loop.

        ``ring.close()`` (call it on the event loop's thread) sends the unregistration at once,
        without waiting for its reply, and unlinks the region; ``await client.release_shm(ring.region)``
        is the same with the reply awaited.
        """
        return await self._run(self._create_shm_ring(n, byte_size))

    def _ring_releaser(self, region: SharedMemoryRegion) -> None:
        # ShmRing.close() cannot await.  The unregistration is sent now, so that whatever this client
        # sends next reaches the daemon after it; its reply is ignored like a re-registration's.
        self._owned.pop(region.name, None)
        if self._regions.pop(region.name, None) is not None and not self._closed and self._can_send.is_set():
            frames = _wire.control_message(next(self._ids), "shm_unregister", name=region.name)
            sent = cast(asyncio.Future[Any], self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False))
            sent.add_done_callback(_unregister_sent)
        region.close()

    # -- lifecycle ------------------------------------------------------------------------------

    async def close(self) -> None:
        """Say bye, unlink our regions, fail what is still pending, close the socket."""
        if self._closed:
            return
        try:
            if self._can_send.is_set():
                await self._round_trip(self._bye())
        except EdgeServerError as exc:
            log.debug("bye was not answered: %s", exc.message)
        finally:
            self._closed = True
            for task in (self._reader, self._watcher, self._greeter):
                if task is not None:
                    task.cancel()
                    try:
                        await task
                    except asyncio.CancelledError:
                        pass
            for pending in self._pending.values():
                closed = Cancelled("the client was closed before the reply came")
                if pending.responses is not None:
                    pending.responses.put_nowait((None, closed, True))
                elif not pending.future.done():
                    pending.future.set_exception(closed)
            self._pending.clear()
            self._forget_regions()
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(0)
            self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _unregister_sent(sent: asyncio.Future[Any]) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        # The queue is full or the connection is gone: the daemon unmaps the region at bye or disconnect.
        log.debug("could not send the unregistration of a ring's region: %r", sent.exception())
