"""Which connections the IPC listener admits: each counted in the daemon's one budget, at accept.

libzmq accepts connections on its I/O thread and only reports them afterwards (its socket monitor).
Each accepted connection is counted in :class:`~edge_server.limits.Limits` under the uid its
``SO_PEERCRED`` names and shut down there when refused (over ``--max-connections``, the uid's
``--max-client-connections``, or a penalized uid).  While the budget is full, whichever listener
filled it, the socket file is renamed away (:meth:`ConnectionGate.sync`): libzmq aborts the whole
process when ``accept`` on a Unix socket meets EMFILE.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import zmq

from edge_server.ipc import addresses
from edge_server.ipc.peers import connection_uid
from edge_server.limits import Connection, Limits

log = logging.getLogger(__name__)


class ConnectionGate:
    """The IPC listener's connections in the daemon's budget; all of it on the frontend thread."""

    def __init__(self, limits: Limits, address: str) -> None:
        self._limits = limits
        self._address = address
        self._counted: dict[int, Connection] = {}  # each connection in the budget, by its descriptor
        self.connections = 0  # admitted and open
        self.refused = 0
        self.paused = 0  # times the listener closed at the connection cap
        self.listening = True

    def event(self, event: dict[str, Any]) -> bool:
        """Count an accepted connection (refused over a cap), or uncount one; True: one closed."""
        fd = event["value"]
        if event["event"] == zmq.EVENT_ACCEPTED:
            uid = connection_uid(fd)
            connection = self._limits.connect(None if uid < 0 else uid)
            self._counted[fd] = connection
            if self.listening and self._limits.full():
                # At once, not after this batch of events: under a flood of connects libzmq's I/O
                # thread accepts faster than they are counted, and it aborts the process at EMFILE
                # (a CI run saw 94 held and 128 refused, still open, at 256 descriptors).
                self._pause()
            if connection.refusal is not None:
                refuse_connection(fd)
                self.refused += 1
                if self.refused & (self.refused - 1) == 0:  # 1, 2, 4, 8...
                    log.warning(
                        "IPC frontend: connection refused (%d so far): %s", self.refused, connection.refusal
                    )
                return False
            self.connections += 1
            return False
        if event["event"] == zmq.EVENT_DISCONNECTED:
            counted = self._counted.pop(fd, None)
            if counted is not None:
                self._limits.disconnect(counted)
                if counted.refusal is None:
                    self.connections = max(0, self.connections - 1)
            return True
        return False

    def sync(self) -> None:
        """Stop or resume accepting as the budget filled or freed (another listener may have done it)."""
        full = self._limits.full()
        if full == self.listening:
            if full:
                self._pause()
            else:
                self._resume()

    def close(self) -> None:
        """The socket closed: its file back under its own name, its connections out of the budget."""
        if not self.listening:
            self._resume()  # the file is ours to remove, under its own name
        for connection in self._counted.values():  # the budget is the daemon's
            self._limits.disconnect(connection)
        self._counted.clear()

    def _pause(self) -> None:
        """Hide the socket file while the connection cap is reached.

        Refusing a connection after libzmq accepted it is not enough: its I/O thread accepts a burst
        faster than they can be refused, and it aborts the process when ``accept`` on a Unix socket
        meets EMFILE (on TCP it does not).  Unbinding would close the connections already accepted,
        so the listener stays and its path is renamed away: a ``connect`` finds nothing and the
        client retries until the file is back.  Only the connections already queued still arrive.
        """
        path = addresses.ipc_path(self._address)
        if path is None:
            return
        try:
            os.rename(path, addresses.paused_path(path))
        except OSError as exc:
            log.warning("IPC frontend: could not stop accepting at the connection cap: %s", exc)
            return
        self.listening = False
        self.paused += 1
        log.warning(
            "IPC frontend: %d connections, the cap (--max-connections or the descriptor budget); "
            "not accepting more until one closes",
            self.connections,
        )

    def _resume(self) -> None:
        path = addresses.ipc_path(self._address)
        assert path is not None
        try:
            os.rename(addresses.paused_path(path), path)
        except OSError as exc:
            log.error("IPC frontend: could not accept connections again on %s: %s", path, exc)
            return
        self.listening = True
        log.info("IPC frontend: below the connection cap again; accepting connections")


def refuse_connection(fd: int) -> None:
    """Close a connection from outside libzmq: shut its socket down; libzmq sees EOF."""
    try:
        duplicate = os.dup(fd)
    except OSError:
        return
    try:
        with socket.socket(fileno=duplicate) as conn:
            conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
