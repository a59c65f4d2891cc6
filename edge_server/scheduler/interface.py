"""What the data plane and the lifecycle need of a model version's scheduler.

:class:`~edge_server.scheduler.scheduler.ModelScheduler` (queue, dynamic batcher, instances) is one;
an ensemble's runner (``edge_server.pipeline``), which schedules its steps on the members' own
schedulers, is another.
"""

from __future__ import annotations

from collections.abc import Hashable
from concurrent.futures import Future
from typing import Protocol

from edge_server.request import BatchItem, Result


class RequestScheduler(Protocol):
    def submit(
        self, item: BatchItem, shape_key: Hashable, *, priority: int = 0, timeout_us: int | None = None
    ) -> Future[dict]:
        """Queue a validated request; the future gets its outputs or its error."""
        ...

    def dispatch(
        self, item: BatchItem, shape_key: Hashable, *, priority: int = 0, timeout_us: int | None = None
    ) -> Result | Future[dict]:
        """:meth:`submit`, or the result itself when the request ran in the caller's thread."""
        ...

    def queue_size(self) -> int: ...

    def set_sole_version(self, sole: bool) -> None:
        """Told on every change of what is served: whether this is the daemon's only model version."""
        ...

    def close_intake(self) -> None:
        """Take no new requests (``SchedulerClosed``); what is queued still runs."""
        ...

    def drain(self, deadline: float, *, finish_sequences: bool = False) -> bool:
        """Close intake and wait until ``deadline`` (monotonic) for queued and running requests.

        ``finish_sequences`` (a reload with a successor): a sequence batcher also waits for its live
        sequences to end or idle out; the others ignore it.  Every drain waits through
        :func:`edge_server.scheduler.pool.wait_until_idle`.
        """
        ...

    def stop(self, grace: float = 2.0) -> None:
        """Fail what is still queued and free everything."""
        ...

    def liveness(self) -> tuple[int, bool]:
        """(a counter that grows with work done, whether there is work to do now): the watchdog's view."""
        ...

    def instance_busy_ns(self) -> dict[str, int]:
        """Nanoseconds each instance has spent executing, by name (none for an ensemble)."""
        ...
