"""Publishing what serves and retiring what it replaced: the routing table's one writer.

Every change to what serves is a read-modify-write of the routing table under one short lock
(:attr:`ServingTable.lock`), never held across a load, a drain or a listener call.  What a change
replaced is then retired: it stops taking requests, drains until one deadline shared by all of it,
and is closed.  Because the swap comes before the drain, a request that routed to an old version just
before the swap and finds it closed is re-routed by the data plane to the new one.
"""

from __future__ import annotations

import logging
import threading
import time

from edge_server.errors import ServerShuttingDown
from edge_server.loader import LoadedVersion
from edge_server.memory import settle_heap
from edge_server.routing import Routing
from edge_server.status_index import ModelState, StatusIndex

log = logging.getLogger(__name__)


class ServingTable:
    """Swaps the routing table, drains and closes replaced versions, and remembers the server closed."""

    def __init__(self, routing: Routing, index: StatusIndex, *, drain_timeout: float) -> None:
        self.routing = routing
        self._index = index
        self.drain_timeout = drain_timeout
        # Lock order: a model's lock, then (for an ensemble) its members' locks, then this lock, then
        # the routing's swap lock.
        self.lock = threading.RLock()
        self.closed = False
        self._heap_changed = False  # versions were loaded or freed since the heap was last settled

    def check_open(self) -> None:
        if self.closed:
            raise ServerShuttingDown("the server is shutting down")

    def heap_changed(self) -> None:
        """Versions were loaded or freed: :meth:`settle` gives the freed memory back afterwards."""
        self._heap_changed = True

    def settle(self) -> None:
        """Give freed memory back to the system once a control operation ended, if versions changed."""
        if self._heap_changed and not self.closed:
            self._heap_changed = False
            settle_heap()

    def remove(self, name: str) -> None:
        """Stop routing to ``name``, then drain and close every version of it."""
        with self.lock:
            old = self.routing.serving().get(name, {})
            table = dict(self.routing.serving())
            table.pop(name, None)
            self.routing.switch(table)
        self.retire(list(old.values()))

    def close(self, deadline: float) -> None:
        """Route to nothing from now on and retire every version by ``deadline``; later swaps refuse."""
        with self.lock:
            self.closed = True
            serving = self.routing.serving()
            retiring = [loaded for versions in serving.values() for loaded in versions.values()]
            self.routing.switch({})
        self.retire(retiring, deadline=deadline)

    def retire(
        self, versions: list[LoadedVersion], *, finish_sequences: bool = False, deadline: float | None = None
    ) -> None:
        """Drain and close ``versions``; with ``finish_sequences`` (a reload), live sequences end there."""
        if not versions:
            return
        # A copy replaced by a new copy of the same version number has no index row of its own.
        shown = [v for v in versions if v.version not in self.routing.serving().get(v.name, {})]
        for loaded in shown:
            self._index.set(loaded.name, loaded.version, ModelState.UNLOADING)
        for loaded in versions:  # all stop taking requests first, then they share one drain deadline
            loaded.scheduler.close_intake()
        if deadline is None:
            deadline = time.monotonic() + self.drain_timeout
        if finish_sequences:
            self.routing.hold(versions, held=True)
        for loaded in versions:
            loaded.retire(deadline, finish_sequences=finish_sequences)
            self.routing.hold([loaded], held=False)
            log.info("%s v%d unloaded", loaded.name, loaded.version)
        for loaded in shown:
            self._index.unloaded(loaded.name, loaded.version)
        shown.clear()
        versions.clear()  # drop our references before the heap is settled
        self._heap_changed = True
