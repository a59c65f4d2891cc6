"""Is the daemon still doing its work?  The question the watchdog asks before each ``WATCHDOG=1``.

A part is stuck when it has work and its progress counter has not moved for ``stall_s``: a scheduler
with queued or running requests and no finished batch, or an IPC frontend thread that did not turn
its loop after being woken.  An idle part is never stuck.  Each part keeps one integer that it bumps
where it already does its bookkeeping; reading it costs the request path nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Protocol


class Progressing(Protocol):
    def liveness(self) -> tuple[int, bool]:
        """(a counter that grows with work done, whether there is work to do now)."""
        ...


@dataclass
class _Seen:
    progress: int
    changed_at: float


class LivenessMonitor:
    """Remembers each part's counter between checks; ``parts`` lists (key, label, part) when called."""

    def __init__(
        self,
        parts: Callable[[], Iterable[tuple[Hashable, str, Progressing]]],
        stall_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._parts = parts
        self.stall_s = stall_s
        self._clock = clock
        self._seen: dict[Hashable, _Seen] = {}

    def stuck(self) -> dict[str, float]:
        """Parts with work and no progress for ``stall_s`` (label: seconds); empty when all is well."""
        now = self._clock()
        seen: dict[Hashable, _Seen] = {}
        stuck: dict[str, float] = {}
        for key, label, part in self._parts():
            progress, busy = part.liveness()
            last = self._seen.get(key)
            if last is None or last.progress != progress or not busy:
                last = _Seen(progress, now)
            elif now - last.changed_at >= self.stall_s:
                stuck[label] = now - last.changed_at
            seen[key] = last
        self._seen = seen  # parts that went away (unloaded versions) are forgotten
        return stuck
