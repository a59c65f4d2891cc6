"""The synchronous client: one DEALER socket, many requests in flight, no thread hop on the fast path.

The socket machinery (leader election, reconnection) is in :mod:`edge_server.client._transport`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from edge_server.client import _wire
from edge_server.client._transport import Call, Transport
from edge_server.client.shm import SharedMemoryRegion, ShmRing, stride
from edge_server.errors import EdgeServerError
from edge_server.ipc import protocol
from edge_server.ipc.addresses import default_address

log = logging.getLogger(__name__)


class Client:
    """Talk to a running edge-server daemon over its IPC socket.

    ``timeout`` (seconds, None: wait forever) is the default for every call; each call may pass its
    own.  Output arrays are read-only views over the received message (no copy), or, for outputs
    requested into shared memory, views into your region.  Don't modify an input array until its
    request is answered: its bytes are sent without a copy.
    """

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
        self.shm_prefix = shm_prefix
        self._t = Transport(self.address, max_message_bytes=max_message_bytes)
        self._owned: dict[str, SharedMemoryRegion] = {}

    # -- inference ------------------------------------------------------------------------------

    def submit(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        version: int | None = None,
        outputs: _wire.Outputs = None,
        priority: int = 0,
        timeout: float | None = None,
    ) -> Future[dict[str, Any]]:
        """Send a request and return at once; keep hundreds in flight from one thread."""
        call = self._infer_call(model, inputs, version, outputs, priority, timeout)
        self._t.kick()
        return call.future

    def infer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        version: int | None = None,
        outputs: _wire.Outputs = None,
        priority: int = 0,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Run one request and return its outputs; raises the daemon's error as an EdgeServerError."""
        return self._t.wait(self._infer_call(model, inputs, version, outputs, priority, timeout))

    def _infer_call(
        self,
        model: str,
        inputs: Mapping[str, Any],
        version: int | None,
        outputs: _wire.Outputs,
        priority: int,
        timeout: float | None,
    ) -> Call:
        timeout = self.timeout if timeout is None else timeout
        rid = self._t.next_id()
        frames = _wire.infer_message(
            rid,
            model,
            inputs,
            version=version,
            outputs=outputs,
            priority=priority,
            timeout_us=int(timeout * 1e6) if timeout is not None and timeout < 1e6 else None,
            max_message_bytes=self._t.max_message_bytes,
        )
        regions = self._t.regions
        return self._t.enqueue(rid, frames, lambda h, f: _wire.infer_outputs(h, f, regions), timeout)

    # -- control --------------------------------------------------------------------------------

    def _control(self, op: str, key: str | None, *, timeout: float | None = None, **fields: Any) -> Any:
        rid = self._t.next_id()
        frames = _wire.control_message(rid, op, **fields)
        call = self._t.enqueue(
            rid,
            frames,
            lambda h, f: h.get(key) if key else None,
            self.timeout if timeout is None else timeout,
        )
        return self._t.wait(call)

    def server_live(self, *, timeout: float | None = None) -> bool:
        return bool(self._control("live", "live", timeout=timeout))

    def server_ready(self, *, timeout: float | None = None) -> bool:
        return bool(self._control("ready", "ready", timeout=timeout))

    def model_ready(self, name: str, version: int | None = None, *, timeout: float | None = None) -> bool:
        return bool(self._control("ready", "ready", timeout=timeout, model=name, version=version))

    def models(self) -> list[dict[str, Any]]:
        """Every model version the daemon knows: ``{"name", "version", "state", "reason"}``."""
        return list(self._control("models", "models"))

    def model_config(self, name: str, version: int | None = None) -> dict[str, Any]:
        return dict(self._control("config", "config", model=name, version=version))

    def model_metadata(self, name: str, version: int | None = None) -> dict[str, Any]:
        return dict(self._control("metadata", "metadata", model=name, version=version))

    def statistics(self, name: str | None = None, version: int | None = None) -> list[dict[str, Any]]:
        return list(self._control("stats", "stats", model=name, version=version))

    def load_model(self, name: str, *, timeout: float | None = None) -> list[dict[str, Any]]:
        """Load or reload ``name`` from the repository (daemon in explicit or poll mode)."""
        return list(self._control("load", "models", timeout=timeout or self.control_timeout, model=name))

    def unload_model(self, name: str, *, timeout: float | None = None) -> None:
        self._control("unload", None, timeout=timeout or self.control_timeout, model=name)

    # -- shared memory --------------------------------------------------------------------------

    def register_shm(self, region: SharedMemoryRegion) -> None:
        """Let the daemon map ``region`` (created by you; you keep owning and unlinking it)."""
        self._control("shm_register", None, name=region.name, byte_size=region.byte_size)
        self._t.regions[region.name] = region

    def unregister_shm(self, region: SharedMemoryRegion | str | None = None) -> list[str]:
        """Let the daemon unmap one region (None: all of this client's); returns the names."""
        name = region.name if isinstance(region, SharedMemoryRegion) else region
        names = list(self._control("shm_unregister", "unregistered", name=name))
        for key in names:
            self._t.regions.pop(key, None)
        return names

    def shm_status(self) -> list[dict[str, Any]]:
        """The regions this client has registered, as the daemon sees them."""
        return list(self._control("shm_status", "regions"))

    def ipc_status(self) -> dict[str, int]:
        """The frontend's counters: clients, regions, released_clients, dropped_replies."""
        return dict(self._control("ipc_status", "ipc"))

    def create_shm_region(self, byte_size: int, *, name: str | None = None) -> SharedMemoryRegion:
        """Create a segment under the daemon's prefix and register it; unlinked by :meth:`close`."""
        region = SharedMemoryRegion(byte_size, name=name, prefix=self.shm_prefix)
        try:
            self.register_shm(region)
        except BaseException:
            region.close()
            raise
        self._owned[region.name] = region
        return region

    def release_shm(self, region: SharedMemoryRegion) -> None:
        """Unregister ``region`` and unlink it."""
        try:
            if region.name in self._t.regions:
                self.unregister_shm(region)
        finally:
            self._owned.pop(region.name, None)
            region.close()

    def create_shm_ring(self, n: int, byte_size: int) -> ShmRing:
        """``n`` slots of ``byte_size`` bytes in one registered region, for a camera loop."""
        region = self.create_shm_region(stride(byte_size) * n)
        return ShmRing(region, n, byte_size, releaser=self.release_shm)

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Say bye (the daemon unmaps our regions at once), unlink our regions, close the socket."""
        if self._t.closed:
            return
        try:
            if self._t.connected():
                self._control("bye", None, timeout=1.0)
        except EdgeServerError as exc:
            log.debug("bye was not answered: %s", exc.message)
        finally:
            self._t.close()
            for region in self._owned.values():
                region.close()
            self._owned.clear()
            self._t.regions.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
