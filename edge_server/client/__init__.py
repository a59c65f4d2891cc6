"""Client library for a running edge-server daemon (the local IPC data plane).

``Client`` is synchronous and thread-safe, with futures for many requests in flight; ``AsyncClient``
has the same calls as coroutines.  ``SharedMemoryRegion`` and ``ShmRing`` pass tensors by reference
instead of through the socket.  Errors are the server's own :mod:`edge_server.errors` classes.
"""

from __future__ import annotations

from edge_server.client._wire import ShmRef, ShmTensor
from edge_server.client.aio import AsyncClient
from edge_server.client.shm import SharedMemoryRegion, ShmRing, ShmSlot
from edge_server.client.sync import Client
from edge_server.errors import ConnectionLost, EdgeServerError, ReplyTimeout

__all__ = [
    "AsyncClient",
    "Client",
    "ConnectionLost",
    "EdgeServerError",
    "ReplyTimeout",
    "SharedMemoryRegion",
    "ShmRef",
    "ShmRing",
    "ShmSlot",
    "ShmTensor",
]
