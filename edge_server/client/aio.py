"""The asyncio client: the same calls as :class:`edge_server.client.Client`, as coroutines.

One reader task owns receiving; sends happen in the calling coroutine (all on the event loop's
thread, so the socket is never shared between threads).  Many requests are in flight at once with
``asyncio.gather`` or tasks.  Reconnection works as in the sync client: requests already sent when the
daemon goes away fail with ConnectionLost, later ones wait for the new connection, and registered
regions are registered again before anything else is sent.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Mapping
from typing import Any, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from edge_server.client import _wire
from edge_server.client.shm import SharedMemoryRegion, ShmRing, stride
from edge_server.errors import Cancelled, ConnectionLost, EdgeServerError, ReplyTimeout
from edge_server.ipc import protocol
from edge_server.ipc.addresses import default_address

log = logging.getLogger(__name__)

Decoder = Callable[[dict[str, Any], list[Any]], Any]


class _Pending:
    __slots__ = ("future", "decode", "sent")

    def __init__(self, future: asyncio.Future[Any], decode: Decoder) -> None:
        self.future = future
        self.decode = decode
        self.sent = False


class AsyncClient:
    """asyncio client of a running daemon; create it inside the event loop that uses it."""

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout: float | None = 60.0,
        control_timeout: float | None = 600.0,
        max_message_bytes: int = protocol.DEFAULT_MAX_MESSAGE_BYTES,
        shm_prefix: str = protocol.DEFAULT_SHM_PREFIX,
    ) -> None:
        self.address = address or default_address()
        self.timeout = timeout
        self.control_timeout = control_timeout
        self.max_message_bytes = max_message_bytes
        self.shm_prefix = shm_prefix
        self._ctx = zmq.asyncio.Context(io_threads=1)
        sock = self._ctx.socket(zmq.DEALER)
        # ZMQ_IMMEDIATE stays off (see the sync client): sends are held back while disconnected.
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        sock.setsockopt(zmq.RECONNECT_IVL, 20)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        sock.setsockopt(zmq.LINGER, 0)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.address)
        self._sock = sock
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._can_send = asyncio.Event()
        self._was_connected = False
        self._reader: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._closed = False
        self._regions: dict[str, SharedMemoryRegion] = {}
        self._owned: dict[str, SharedMemoryRegion] = {}

    # -- plumbing -------------------------------------------------------------------------------

    async def _call(self, frames: list[Any], rid: int, decode: Decoder, timeout: float | None) -> Any:
        if self._closed:
            raise Cancelled("the client is closed")
        loop = asyncio.get_running_loop()
        if self._reader is None:
            self._reader = loop.create_task(self._read())
            self._watcher = loop.create_task(self._watch())
        pending = _Pending(loop.create_future(), decode)
        self._pending[rid] = pending
        # call_later instead of wait_for: no extra task per request on the hot path.
        timer = loop.call_later(timeout, self._expire, rid) if timeout is not None else None
        try:
            while not self._can_send.is_set() or not await self._try_send(frames):
                if pending.future.done():
                    break
                waiter = loop.create_task(self._can_send.wait())
                await asyncio.wait([waiter, pending.future], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            pending.sent = True
            return await pending.future
        finally:
            self._pending.pop(rid, None)
            if timer is not None:
                timer.cancel()

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
            try:
                header = protocol.unpack(frames[0].buffer)
            except EdgeServerError as exc:
                log.warning("ignoring a reply that is not protocol: %s", exc.message)
                continue
            rid = header.get("id")
            pending = self._pending.pop(rid, None) if isinstance(rid, int) else None
            if pending is None or pending.future.done():
                continue  # a ping, a re-registration, or the reply to a request that timed out
            if header.get("ok") is True:
                try:
                    pending.future.set_result(pending.decode(header, frames[1:]))
                except EdgeServerError as exc:
                    pending.future.set_exception(exc)
            else:
                pending.future.set_exception(protocol.error_from_wire(header.get("error")))

    async def _watch(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._can_send.clear()
                # Replies that arrived before the connection closed still count: let the reader take them.
                for _ in range(10_000):
                    if not cast(int, self._sock.get(zmq.EVENTS)) & zmq.POLLIN:
                        break
                    await asyncio.sleep(0)
                for rid, pending in list(self._pending.items()):
                    if pending.sent and not pending.future.done():
                        del self._pending[rid]
                        pending.future.set_exception(
                            ConnectionLost(f"the daemon at {self.address} went away before replying")
                        )
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if self._was_connected:
                    await self._reregister()
                self._was_connected = True
                self._can_send.set()

    async def _reregister(self) -> None:
        """A new daemon knows none of our regions: register them before anything else is sent."""
        for region in self._regions.values():
            frames = _wire.control_message(
                next(self._ids), "shm_register", name=region.name, byte_size=region.byte_size
            )
            if not await self._try_send(frames):
                log.warning("could not re-register region %s after reconnecting", region.name)

    async def _control(self, op: str, key: str | None, *, timeout: float | None = None, **fields: Any) -> Any:
        rid = next(self._ids)
        return await self._call(
            _wire.control_message(rid, op, **fields),
            rid,
            lambda h, f: h.get(key) if key else None,
            self.timeout if timeout is None else timeout,
        )

    # -- inference ------------------------------------------------------------------------------

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        version: int | None = None,
        outputs: _wire.Outputs = None,
        priority: int = 0,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Run one request; await many of these at once to keep requests in flight."""
        timeout = self.timeout if timeout is None else timeout
        rid = next(self._ids)
        frames = _wire.infer_message(
            rid,
            model,
            inputs,
            version=version,
            outputs=outputs,
            priority=priority,
            timeout_us=int(timeout * 1e6) if timeout is not None and timeout < 1e6 else None,
            max_message_bytes=self.max_message_bytes,
        )
        regions = self._regions
        return await self._call(frames, rid, lambda h, f: _wire.infer_outputs(h, f, regions), timeout)

    # -- control --------------------------------------------------------------------------------

    async def server_live(self, *, timeout: float | None = None) -> bool:
        return bool(await self._control("live", "live", timeout=timeout))

    async def server_ready(self, *, timeout: float | None = None) -> bool:
        return bool(await self._control("ready", "ready", timeout=timeout))

    async def model_ready(
        self, name: str, version: int | None = None, *, timeout: float | None = None
    ) -> bool:
        return bool(await self._control("ready", "ready", timeout=timeout, model=name, version=version))

    async def models(self) -> list[dict[str, Any]]:
        return list(await self._control("models", "models"))

    async def model_config(self, name: str, version: int | None = None) -> dict[str, Any]:
        return dict(await self._control("config", "config", model=name, version=version))

    async def model_metadata(self, name: str, version: int | None = None) -> dict[str, Any]:
        return dict(await self._control("metadata", "metadata", model=name, version=version))

    async def statistics(self, name: str | None = None, version: int | None = None) -> list[dict[str, Any]]:
        return list(await self._control("stats", "stats", model=name, version=version))

    async def load_model(self, name: str, *, timeout: float | None = None) -> list[dict[str, Any]]:
        return list(
            await self._control("load", "models", timeout=timeout or self.control_timeout, model=name)
        )

    async def unload_model(self, name: str, *, timeout: float | None = None) -> None:
        await self._control("unload", None, timeout=timeout or self.control_timeout, model=name)

    # -- shared memory --------------------------------------------------------------------------

    async def register_shm(self, region: SharedMemoryRegion) -> None:
        await self._control("shm_register", None, name=region.name, byte_size=region.byte_size)
        self._regions[region.name] = region

    async def unregister_shm(self, region: SharedMemoryRegion | str | None = None) -> list[str]:
        name = region.name if isinstance(region, SharedMemoryRegion) else region
        names = list(await self._control("shm_unregister", "unregistered", name=name))
        for key in names:
            self._regions.pop(key, None)
        return names

    async def shm_status(self) -> list[dict[str, Any]]:
        return list(await self._control("shm_status", "regions"))

    async def ipc_status(self) -> dict[str, int]:
        return dict(await self._control("ipc_status", "ipc"))

    async def create_shm_region(self, byte_size: int, *, name: str | None = None) -> SharedMemoryRegion:
        region = SharedMemoryRegion(byte_size, name=name, prefix=self.shm_prefix)
        try:
            await self.register_shm(region)
        except BaseException:
            region.close()
            raise
        self._owned[region.name] = region
        return region

    async def release_shm(self, region: SharedMemoryRegion) -> None:
        try:
            if region.name in self._regions:
                await self.unregister_shm(region)
        finally:
            self._owned.pop(region.name, None)
            region.close()

    async def create_shm_ring(self, n: int, byte_size: int) -> ShmRing:
        """A ring for a camera loop; ``ring.close()`` unlinks it (the daemon unmaps it at close/bye)."""
        region = await self.create_shm_region(stride(byte_size) * n)
        return ShmRing(region, n, byte_size)

    # -- lifecycle ------------------------------------------------------------------------------

    async def close(self) -> None:
        """Say bye, unlink our regions, fail what is still pending, close the socket."""
        if self._closed:
            return
        try:
            if self._can_send.is_set():
                await self._control("bye", None, timeout=1.0)
        except EdgeServerError as exc:
            log.debug("bye was not answered: %s", exc.message)
        finally:
            self._closed = True
            for task in (self._reader, self._watcher):
                if task is not None:
                    task.cancel()
                    try:
                        await task
                    except asyncio.CancelledError:
                        pass
            for pending in self._pending.values():
                if not pending.future.done():
                    pending.future.set_exception(Cancelled("the client was closed before the reply came"))
            self._pending.clear()
            for region in self._owned.values():
                region.close()
            self._owned.clear()
            self._regions.clear()
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(0)
            self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
