"""The one drain: wait on a condition until what it guards is idle, or a deadline passes.

Every scheduler, the delivering thread and the ensemble drain through it; it sits below them all (the
pool imports the hand-off, which drains too).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def wait_until_idle(cond: threading.Condition, busy: Callable[[], bool], deadline: float) -> bool:
    """Wait on ``cond`` until ``busy()`` is false or ``deadline`` (monotonic) passes.

    Returns False if the deadline passed first.
    """
    with cond:
        while busy():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            cond.wait(remaining)
    return True
