"""What the data plane and the lifecycle need of a model version's scheduler.

:class:`~edge_server.scheduler.scheduler.ModelScheduler` (queue, dynamic batcher, instances) is one;
an ensemble's runner (``edge_server.pipeline``), which schedules its steps on the members' own
schedulers, is another.
"""

from __future__ import annotations

from collections.abc import Hashable
from concurrent.futures import Future
from typing import Protocol

from edge_server.request import BatchItem
from edge_server.scheduler.inline import QUEUE_ONLY, Budget


class RequestScheduler(Protocol):
    def submit(
        self,
        item: BatchItem,
        shape_key: Hashable,
        *,
        priority: int = 0,
        timeout_us: int | None = None,
        budget: Budget = QUEUE_ONLY,
    ) -> Future[dict]:
        """Queue a validated request; the future gets its outputs or its error.

        ``budget``: what the caller lets the request cost in its own thread (:mod:`.inline`); where the
        model's :class:`~edge_server.scheduler.inline.InlinePolicy` says it pays, the request runs
        here and the future is done on return.
        """
        ...

    def queue_size(self) -> int: ...

    def set_sole_version(self, sole: bool) -> None:
        """Told on every change of what is served: whether this is the daemon's only model version."""
        ...

    def close_intake(self, *, finish_sequences: bool = False) -> None:
        """Take no new requests (``SchedulerClosed``); what is queued still runs.

        ``finish_sequences`` (a reload with a successor, where the data plane still routes the live
        sequences' requests here): a sequence batcher's :meth:`drain` also waits for its live sequences
        to end or idle out; the others ignore it.
        """
        ...

    def drain(self, deadline: float) -> bool:
        """Close intake and wait until ``deadline`` (monotonic) for what it accepted to finish.

        Every drain waits through :func:`edge_server.scheduler.drain.wait_until_idle`.
        """
        ...

    def stop(self, grace: float = 2.0) -> None:
        """Fail what is still queued and free everything."""
        ...

    def liveness(self) -> tuple[int, bool]:
        """(a counter that grows with work done, whether there is work to do now): the watchdog's view."""
        ...

    def readiness(self) -> list[Future[bool]]:
        """One future per instance that has a say in its readiness (:mod:`edge_server.model_readiness`)."""
        ...

    def instance_busy_ns(self) -> dict[str, int]:
        """Nanoseconds each instance has spent executing, by name (none for an ensemble)."""
        ...
