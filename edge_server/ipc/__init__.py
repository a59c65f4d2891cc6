"""The local data plane: ZeroMQ over ``ipc://`` with msgpack headers and zero-copy tensors.

``protocol`` is the wire format both sides share (docs/protocol.md), ``frontend`` the daemon's ROUTER
socket, ``shm`` the daemon's registry of client shared-memory regions, ``addresses`` where the socket
lives.  The client side is :mod:`edge_server.client`.
"""

from __future__ import annotations
